"""Router settings: one frozen, validated dataclass (built from the CLI in main.py)."""
from __future__ import annotations

from dataclasses import dataclass, field

from kvmesh.common.cache_salt import CacheSaltSource
from kvmesh.common.config import EngineConfig, field_default
from kvmesh.router.backends import BACKEND_KINDS, parse_backend
from kvmesh.router.routing_policy import STRATEGIES, PolicyConfig


@dataclass(frozen=True, slots=True)
class RouterConfig:
    redis_url: str | None = None            # the prefix index; None: route by load only
    backends: tuple[str, ...] = ()          # static engine URLs
    discover: str | None = None             # headless Service name resolved for engine IPs
    backend_port: int = 8000                # engine port for discovered IPs
    backend_kind: str = "kvmesh"            # kvmesh | vllm: backends without a KIND= prefix
    kv_events_port: int = 5557              # vLLM backends' ZMQ PUB port (on the backend's host)
    kv_events_replay_port: int = 5558       # their ZMQ replay port; 0: none (no gap repair)
    kv_events_topic: str = "kv-events"      # their --kv-events-config topic
    strategy: str = "kv-aware"
    model: str | None = None                # model path or name, for the tokenizer
    tokenizer: str | None = None            # tokenizer directory (overrides model)
    # NOTE: the engines' own defaults, so a router and engines started without either flag agree
    block_size: int = field_default(EngineConfig, "block_size")    # must equal the engines'
    hash_seed: str = field_default(EngineConfig, "hash_seed")      # must equal the engines'

    api_key: str | None = None              # clients must send "Authorization: Bearer KEY"
    cache_salt_from: str = "none"           # none | api-key | header:NAME: the engines' value
    expose_route_headers: bool = False      # x-kvmesh-backend / -route-reason on responses
    session_header: str | None = None       # e.g. X-Session-Id: sticky routing per value
    namespace: str | None = None            # Redis key space; default $POD_NAMESPACE / default
    service: str | None = None              # Redis key space; default $KVMESH_SERVICE / kvmesh
    redis_password: str | None = None
    health_interval_s: float = 1.0          # GET /health period
    load_interval_s: float = 0.25           # heartbeat (load) refresh period
    discover_interval_s: float = 5.0        # DNS re-resolution period
    lookup_timeout_s: float = 0.25          # a slower prefix lookup: this request routes by load
    heartbeat_timeout_s: float = 1.0        # a slower heartbeat read counts as Redis down
    connect_timeout_s: float = 2.0          # backend connect timeout (then try another)
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    # scale to zero (hold.py): wait this long for a ready engine instead of a 503 at once; 0: off
    hold_timeout_s: float = 0.0
    max_held_requests: int = 256            # held at once; more get a 503 with Retry-After
    # a request for a LoRA adapter no backend lists goes to the best backend anyway, whose engine
    # loads it (its --lora-resolver-dir); off: such a request is a 404
    lora_load_on_demand: bool = False
    # prefill/decode disaggregation (disagg.py): each role's engines, static or discovered; the
    # decode side answers the client and takes --backends' place
    prefill_backends: tuple[str, ...] = ()
    prefill_discover: str | None = None     # headless Service of the prefill engines
    decode_backends: tuple[str, ...] = ()
    decode_discover: str | None = None      # headless Service of the decode engines

    @property
    def disaggregated(self) -> bool:
        """P/D mode: every generation request is prefilled on one engine, decoded on another."""
        return bool(self.prefill_backends or self.prefill_discover or self.decode_backends
                    or self.decode_discover)

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise ValueError(f"--strategy must be one of {', '.join(STRATEGIES)}, "
                             f"got {self.strategy!r}")
        if self.disaggregated:
            _check_disaggregated(self)
        elif bool(self.backends) == bool(self.discover):
            raise ValueError("give exactly one of --backends URL ... or "
                             "--discover-headless-service NAME (or, for prefill/decode "
                             "disaggregation, --prefill-backends and --decode-backends)")
        if self.block_size not in (1, 2, 4, 8, 16, 32, 64, 128):
            raise ValueError(f"--block-size must be a power of two from 1 to 128 (the engines' "
                             f"value), got {self.block_size}")
        if not 0 < self.backend_port < 65536:
            raise ValueError(f"--backend-port must be a TCP port, got {self.backend_port}")
        if self.backend_kind not in BACKEND_KINDS:
            raise ValueError(f"--backend-kind must be one of {', '.join(BACKEND_KINDS)}, "
                             f"got {self.backend_kind!r}")
        kinds = {parse_backend(b, self.backend_kind).kind
                 for b in (*self.backends, *self.prefill_backends, *self.decode_backends)}
        if self.discover or self.prefill_discover or self.decode_discover:
            kinds.add(self.backend_kind)
        if "vllm" in kinds and not self.redis_url:
            raise ValueError("vLLM backends need --redis-url: their KV events are written to "
                             "the shared prefix index")
        if not 0 < self.kv_events_port < 65536:
            raise ValueError(f"--kv-events-port must be a TCP port, got {self.kv_events_port}")
        if not 0 <= self.kv_events_replay_port < 65536 \
                or self.kv_events_replay_port == self.kv_events_port:
            raise ValueError("--kv-events-replay-port must be a TCP port other than "
                             f"--kv-events-port, or 0 (none), got {self.kv_events_replay_port}")
        CacheSaltSource.parse(self.cache_salt_from)     # raises with the accepted values
        if not self.lookup_timeout_s > 0:
            raise ValueError(f"--lookup-timeout must be > 0 seconds, got {self.lookup_timeout_s}")
        if self.hold_timeout_s < 0:
            raise ValueError(f"--hold-timeout must be >= 0 seconds (0: do not hold), got "
                             f"{self.hold_timeout_s}")
        if self.max_held_requests < 1:
            raise ValueError(f"--max-held-requests must be >= 1, got {self.max_held_requests}")
        for name in ("health_interval_s", "load_interval_s", "discover_interval_s",
                     "heartbeat_timeout_s", "connect_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0")


def _check_disaggregated(cfg: RouterConfig) -> None:
    if cfg.backends or cfg.discover:
        raise ValueError("--backends / --discover-headless-service cannot be combined with "
                         "--prefill-backends / --decode-backends: in P/D mode the decode "
                         "engines answer the clients")
    for role in ("prefill", "decode"):
        static, dns = getattr(cfg, f"{role}_backends"), getattr(cfg, f"{role}_discover")
        if bool(static) == bool(dns):
            raise ValueError(f"P/D mode needs exactly one of --{role}-backends URL ... or "
                             f"--discover-{role}-service NAME")
