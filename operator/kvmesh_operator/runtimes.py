"""PURE: what the engine container runs, per runtime: `kvmesh serve` or `vllm serve`, and the
vLLM-format KV-event publisher both can turn on.

The ZMQ endpoints are fixed ports of every engine pod (exposed by the headless Service): kvmesh's
router subscribes to them for vLLM engines, llm-d's endpoint picker for the engines of an
InferencePool.
"""
from __future__ import annotations

import json
from typing import Any

from .crd import InferenceService

ENGINE_PORT = 8000
KV_EVENTS_PORT = 5557  # ZMQ PUB of vLLM-format KV events
KV_REPLAY_PORT = 5558  # ZMQ ROUTER answering "every batch since sequence N"
KV_EVENTS_BUFFER_STEPS = 10000  # batches the replay socket keeps
ROUTER_TOPIC = "kv-events"  # topic kvmesh's router subscribes to
# NOTE: llm-d's KV-event pool takes the pod and model from the topic, `kv@<pod>@<model>`, and
# scores endpoints as "<pod IP>:<target port>", so the topic names the pod that way.
LLMD_TOPIC_FILTER = "kv@"
# NOTE: the seed of llm-d's block hash (its indexing and scoring both use it); vLLM engines get the
# same PYTHONHASHSEED, which seeds their own block hashes, so those are stable across restarts too.
HASH_SEED = "42"
CACHE_DIR = "/home/kvmesh/.cache"  # the writable emptyDir of engine pods


def kv_events_topic(svc: InferenceService) -> str:
    if svc.router.mode == "inference-pool":
        # NOTE: $(POD_IP) is expanded by the kubelet (the config is an argument, not a file).
        return f"{LLMD_TOPIC_FILTER}$(POD_IP):{ENGINE_PORT}@{svc.model.served_name}"
    return ROUTER_TOPIC


def kv_events_config(svc: InferenceService) -> dict[str, Any] | None:
    """vLLM's --kv-events-config for this service's engines; None when nobody subscribes."""
    if not svc.kv_events:
        return None
    return {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{KV_EVENTS_PORT}",
            "replay_endpoint": f"tcp://*:{KV_REPLAY_PORT}", "buffer_steps": KV_EVENTS_BUFFER_STEPS,
            "topic": kv_events_topic(svc)}


def kv_events_args(svc: InferenceService) -> list[str]:
    config = kv_events_config(svc)
    return [] if config is None else ["--kv-events-config", json.dumps(config, separators=(",", ":"))]


def vllm_args(svc: InferenceService, model: str) -> list[str]:
    """`vllm serve` arguments equivalent to the kvmesh engine settings (the container's command is
    `vllm serve`); `model` is the weights' path inside the pod."""
    e = svc.engine
    args = [model, "--served-model-name", svc.model.served_name, "--host", "0.0.0.0", "--port", str(ENGINE_PORT),
            "--tensor-parallel-size", str(e.tensor_parallel_size), "--max-num-seqs", str(e.max_num_seqs),
            "--max-num-batched-tokens", str(e.max_num_batched_tokens), "--block-size", str(e.block_size),
            "--gpu-memory-utilization", str(e.kv_cache_memory_fraction),
            "--scheduling-policy", e.scheduling_policy, "--enable-prefix-caching"]
    if svc.model.tokenizer is not None:
        args += ["--tokenizer", svc.model.tokenizer]
    if e.speculative_config is not None:
        args += ["--speculative-config", e.speculative_config.to_json()]
    if e.kv_cache_dtype != "auto":
        args += ["--kv-cache-dtype", e.kv_cache_dtype]
    return args + kv_events_args(svc)


def vllm_env() -> list[dict[str, Any]]:
    """vLLM writes caches under $HOME by default; the root filesystem is read-only and the user is not root."""
    return [{"name": "HOME", "value": "/tmp"}, {"name": "HF_HOME", "value": f"{CACHE_DIR}/huggingface"},
            {"name": "VLLM_CACHE_ROOT", "value": f"{CACHE_DIR}/vllm"},
            {"name": "TRITON_CACHE_DIR", "value": f"{CACHE_DIR}/triton"},
            {"name": "XDG_CACHE_HOME", "value": CACHE_DIR}, {"name": "HF_HUB_OFFLINE", "value": "1"},
            {"name": "PYTHONHASHSEED", "value": HASH_SEED}]


def nccl_env(svc: InferenceService) -> list[dict[str, Any]]:
    """NCCL settings of tensor-parallel GPU engines; empty for one GPU or on CPU (gloo)."""
    if svc.engine.tensor_parallel_size < 2 or svc.gpu.count == 0:
        return []
    env = [{"name": "NCCL_DEBUG", "value": svc.engine.nccl.debug}]
    if svc.engine.nccl.socket_ifname is not None:
        env.append({"name": "NCCL_SOCKET_IFNAME", "value": svc.engine.nccl.socket_ifname})
    return env


def router_backend_args(svc: InferenceService) -> list[str]:
    """kvmesh router flags for vLLM backends: where each engine pod's ZMQ publisher is."""
    if svc.engine.runtime != "vllm":
        return []
    return ["--backend-kind", "vllm", "--kv-events-port", str(KV_EVENTS_PORT),
            "--kv-events-replay-port", str(KV_REPLAY_PORT), "--kv-events-topic", ROUTER_TOPIC]
