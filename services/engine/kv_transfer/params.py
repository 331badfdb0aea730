"""`kv_transfer_params`: a request's part in a prefill/decode hand-off, with vLLM 0.32's field names.

    router ─ {"do_remote_decode": true, "transfer_id": T} ─▶ prefill engine (kv_producer)
            ◀─ response "kv_transfer_params": {"do_remote_prefill": true, "do_remote_decode": false,
                 "remote_engine_id": E, "remote_bootstrap_addr": "http://ip:port",
                 "remote_block_ids": [...], "transfer_id": T}
    router ─ those params ─▶ decode engine (kv_consumer): reads the blocks, then decodes

vLLM's own Mooncake proxy sends the decode side the same fields without `remote_block_ids`: the
consumer then asks the producer's bootstrap side channel for them by `transfer_id`.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from kvmesh.engine.sampling_params import SamplingParamsError

FIELDS = ("do_remote_decode", "do_remote_prefill", "remote_engine_id", "remote_bootstrap_addr",
          "remote_block_ids", "transfer_id")
_BOOTSTRAP = re.compile(r"http://[A-Za-z0-9.\-\[\]:]+:\d{1,5}")
_ID = re.compile(r"[A-Za-z0-9._:\-]{1,128}")


@dataclass(frozen=True, slots=True)
class KVTransferParams:
    do_remote_decode: bool = False            # prefill here; a remote engine decodes (producer)
    do_remote_prefill: bool = False           # the prompt's KV was computed remotely (consumer)
    remote_engine_id: str | None = None       # the producer's engine_id (consumer side)
    remote_bootstrap_addr: str | None = None  # "http://ip:port" of the producer's side channel
    # the producer's block ids of the prompt's full blocks, in order (None: ask the side channel)
    remote_block_ids: tuple[int, ...] | None = None
    transfer_id: str | None = None            # names one hand-off on both sides

    def to_dict(self) -> dict[str, Any]:
        """The JSON object, as vLLM writes it (None fields left out)."""
        out: dict[str, Any] = {"do_remote_decode": self.do_remote_decode,
                               "do_remote_prefill": self.do_remote_prefill}
        for name in ("remote_engine_id", "remote_bootstrap_addr", "transfer_id"):
            value = getattr(self, name)
            if value is not None:
                out[name] = value
        if self.remote_block_ids is not None:
            out["remote_block_ids"] = list(self.remote_block_ids)
        return out


def _bad(name: str, message: str) -> SamplingParamsError:
    return SamplingParamsError(f"kv_transfer_params.{name}", f"kv_transfer_params.{name} {message}")


def parse_kv_transfer_params(value: Any) -> KVTransferParams | None:
    """The request body's `kv_transfer_params` (a JSON object), checked once; None for None.
    SamplingParamsError (a ValueError) whose `param` names the bad field."""
    if value is None or isinstance(value, KVTransferParams):
        return value
    if not isinstance(value, dict):
        raise SamplingParamsError("kv_transfer_params", "kv_transfer_params must be a JSON object")
    unknown = sorted(set(value) - set(FIELDS))
    if unknown:
        raise _bad(unknown[0], f"is not a known field; kvmesh reads {', '.join(FIELDS)}")
    for name in ("do_remote_decode", "do_remote_prefill"):
        if not isinstance(value.get(name, False), bool):
            raise _bad(name, f"must be a boolean, got {value[name]!r}")
    for name, pattern, what in (("remote_engine_id", _ID, "an engine id"),
                                ("transfer_id", _ID, "1-128 letters, digits or ._:-"),
                                ("remote_bootstrap_addr", _BOOTSTRAP, "of the form http://ip:port")):
        v = value.get(name)
        if v is not None and not (isinstance(v, str) and pattern.fullmatch(v)):
            raise _bad(name, f"must be {what}, got {v!r}")
    ids = value.get("remote_block_ids")
    if ids is not None and not (isinstance(ids, list) and all(
            isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids)):
        raise _bad("remote_block_ids", "must be a list of integers >= 0")
    params = KVTransferParams(
        do_remote_decode=value.get("do_remote_decode", False),
        do_remote_prefill=value.get("do_remote_prefill", False),
        remote_engine_id=value.get("remote_engine_id"),
        remote_bootstrap_addr=value.get("remote_bootstrap_addr"),
        remote_block_ids=None if ids is None else tuple(ids),
        transfer_id=value.get("transfer_id"))
    if params.do_remote_decode and params.do_remote_prefill:
        raise _bad("do_remote_prefill", "cannot be true together with do_remote_decode")
    if params.do_remote_prefill:
        for name in ("remote_engine_id", "remote_bootstrap_addr", "transfer_id"):
            if getattr(params, name) is None:
                raise _bad(name, "is required with do_remote_prefill")
    return params
