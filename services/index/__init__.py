"""The prefix index, in one package: KV events (events), the Redis key layout (layout), the
engine-side publisher (publisher, serve), the router-side lookup (lookup, hashing), cross-pod KV
bytes (kv_bytes) and the finalizer's purge (purge). Torch-free at import: the router and the
operator use it."""
