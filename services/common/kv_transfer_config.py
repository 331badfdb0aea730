"""`--kv-transfer-config` (vLLM's flag and keys): prefill/decode disaggregation, validated once here.

The engine's side of it lives in `kvmesh.engine.kv_transfer`; the config is in `common` because
`EngineConfig` holds it (a floor below the engine), as `--speculative-config` is.
"""
from __future__ import annotations

import re
import uuid
from dataclasses import dataclass, field, fields
from typing import Any

from kvmesh.common.json_flag import json_object

CONNECTORS = ("MooncakeConnector",)
ROLES = ("kv_producer", "kv_consumer", "kv_both")
# vLLM connectors kvmesh does not build (named in the error, so the message says what is missing)
_OTHER_VLLM_CONNECTORS = ("NixlConnector", "LMCacheConnectorV1", "P2pNcclConnector",
                          "OffloadingConnector", "MultiConnector", "MooncakeStoreConnector")
PROTOCOLS = ("tcp", "rdma")
# kv_connector_extra_config keys kvmesh reads (vLLM's MooncakeConnector reads the first two)
EXTRA_KEYS = ("mooncake_protocol", "device_name", "pinned_timeout_s", "transfer_timeout_s")
DEFAULT_BOOTSTRAP_PORT = 8998        # vLLM's Mooncake bootstrap port
DEFAULT_PINNED_TIMEOUT_S = 30.0      # a producer frees blocks nobody read after this long
DEFAULT_TRANSFER_TIMEOUT_S = 10.0    # a consumer gives a read up (local prefill) after this long


@dataclass(frozen=True, slots=True)
class KVTransferConfig:
    kv_connector: str                        # "MooncakeConnector"
    kv_role: str                             # kv_producer (prefill) | kv_consumer (decode) | kv_both
    # this engine's id in kv_transfer_params (remote_engine_id on the other side); default random
    engine_id: str = field(default_factory=lambda: str(uuid.uuid4()))
    kv_ip: str = "127.0.0.1"                 # address advertised to peers (a pod's IP) and bound
    kv_port: int = DEFAULT_BOOTSTRAP_PORT    # the bootstrap side channel's port; 0: any free port
    # connector options: mooncake_protocol (tcp | rdma), device_name (RDMA NICs),
    # pinned_timeout_s, transfer_timeout_s (kvmesh's)
    kv_connector_extra_config: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        _check(self)

    @property
    def is_producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_consumer(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")

    @property
    def protocol(self) -> str:
        return self.kv_connector_extra_config.get("mooncake_protocol", "tcp")

    @property
    def device_name(self) -> str:
        return self.kv_connector_extra_config.get("device_name", "")

    @property
    def pinned_timeout_s(self) -> float:
        return float(self.kv_connector_extra_config.get("pinned_timeout_s",
                                                        DEFAULT_PINNED_TIMEOUT_S))

    @property
    def transfer_timeout_s(self) -> float:
        return float(self.kv_connector_extra_config.get("transfer_timeout_s",
                                                        DEFAULT_TRANSFER_TIMEOUT_S))


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_pos_number(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0


def _check(c: KVTransferConfig) -> None:
    def need(cond: bool, msg: str) -> None:
        if not cond:
            raise ValueError(f"--kv-transfer-config: {msg}")

    if c.kv_connector in _OTHER_VLLM_CONNECTORS:
        raise ValueError(f"--kv-transfer-config: kv_connector {c.kv_connector!r} is not supported "
                         f"by kvmesh; use one of {', '.join(CONNECTORS)}")
    need(c.kv_connector in CONNECTORS,
         f"kv_connector must be one of {', '.join(CONNECTORS)}, got {c.kv_connector!r}")
    need(c.kv_role in ROLES, f"kv_role must be one of {', '.join(ROLES)}, got {c.kv_role!r}")
    need(isinstance(c.engine_id, str) and re.fullmatch(r"[A-Za-z0-9._:-]{1,128}", c.engine_id)
         is not None, f"engine_id must be 1-128 letters, digits or ._:- , got {c.engine_id!r}")
    need(isinstance(c.kv_ip, str) and c.kv_ip != "", f"kv_ip must be a host name or address, "
         f"got {c.kv_ip!r}")
    need(_is_int(c.kv_port) and 0 <= c.kv_port <= 65535,
         f"kv_port must be an integer in [0, 65535] (0: any free port), got {c.kv_port!r}")
    extra = c.kv_connector_extra_config
    need(isinstance(extra, dict), "kv_connector_extra_config must be a JSON object")
    unknown = sorted(set(extra) - set(EXTRA_KEYS))
    need(not unknown, f"unknown kv_connector_extra_config key(s) "
         f"{', '.join(map(repr, unknown))}; kvmesh reads {', '.join(EXTRA_KEYS)}")
    need(extra.get("mooncake_protocol", "tcp") in PROTOCOLS,
         f"kv_connector_extra_config.mooncake_protocol must be one of {', '.join(PROTOCOLS)}, "
         f"got {extra.get('mooncake_protocol')!r}")
    need(isinstance(extra.get("device_name", ""), str),
         "kv_connector_extra_config.device_name must be a string")
    for key in ("pinned_timeout_s", "transfer_timeout_s"):
        need(key not in extra or _is_pos_number(extra[key]),
             f"kv_connector_extra_config.{key} must be a number > 0, got {extra.get(key)!r}")


_KEYS = tuple(f.name for f in fields(KVTransferConfig))


def parse_kv_transfer_config(value: Any) -> KVTransferConfig | None:
    """A KVTransferConfig from the flag's JSON text, a mapping or a KVTransferConfig; None for
    None. ValueError naming the bad or unknown key."""
    if value is None or isinstance(value, KVTransferConfig):
        return value
    args = json_object("--kv-transfer-config", value, _KEYS,
                       '{"kv_connector": "MooncakeConnector", "kv_role": "kv_producer"}')
    for key in ("kv_connector", "kv_role"):
        if key not in args:
            raise ValueError(f"--kv-transfer-config: \"{key}\" is required")
    if args.get("engine_id") is None:
        args.pop("engine_id", None)
    return KVTransferConfig(**args)
