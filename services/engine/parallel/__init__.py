"""Tensor parallelism: one model split across N ranks, one per device (Megatron-style).

    plan.py      which sizes split how: validation against the model, each rank's heads and slices
    group.py     the ranks' process group (gloo on CPU, NCCL on CUDA): all-reduce, gather to rank 0
    sharding.py  the shard of every parameter, from the shared layers; vocab-parallel embedding
    messages.py  what rank 0 sends the workers: one step message per step (msgspec)
    worker.py    a worker process: connect, load its shard, run each step it is sent
    executor.py  rank 0's side: spawn and watch the workers, broadcast each step, shut them down

Rank 0 is the engine process (scheduler, sampler, rank 0's shard); ranks 1..N-1 are worker
processes. With tensor_parallel_size 1 none of this is imported.
"""
