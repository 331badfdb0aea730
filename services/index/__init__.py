"""The prefix index: a plug-in of the engine (it imports the engine, never the reverse) with
two sides over one Redis key layout (layout):

- engine side: publishing this pod's KV events and load to Redis (publisher, serve) and over ZMQ
  in vLLM's format (zmq_events), and the cross-pod KV bytes connector (kv_bytes);
- router side: prefix lookup (lookup, hashing), vLLM engines' ZMQ events into Redis
  (vllm_subscriber, vllm_chain), and the finalizer's purge (purge).

vllm_wire (vLLM's KV-event wire format) serves both sides. The event types themselves live below
the engine, in kvmesh.common.kv_events. Torch-free at import: the router and the operator use it.
"""
