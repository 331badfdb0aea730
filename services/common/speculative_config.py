"""`--speculative-config` (vLLM's flag and keys): how the engine speculates, validated once here.

The engine's speculative decoding lives in `kvmesh.engine.spec_decode`; the config is in `common`
because `EngineConfig` holds it (a floor below the engine).
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from kvmesh.common.json_flag import json_object

METHODS = ("ngram", "draft_model")
# vLLM methods kvmesh does not build (named in the error, so the message says what is missing)
_OTHER_VLLM_METHODS = ("eagle", "eagle3", "medusa", "mlp_speculator", "mtp", "suffix")
_NGRAM_DEFAULT_LOOKUP = 5     # vLLM's: both lookup bounds when neither is given


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    method: str                              # "ngram" (prompt lookup) or "draft_model"
    num_speculative_tokens: int              # k: draft tokens proposed per step per request
    prompt_lookup_min: int | None = None     # ngram: shortest suffix matched in the request's own tokens
    prompt_lookup_max: int | None = None     # ngram: longest suffix tried first
    model: str | None = None                 # draft_model: the draft's HF directory
    # speculation is off in a step whose running batch holds more requests than this (None: never)
    disable_by_batch_size: int | None = None

    def __post_init__(self) -> None:
        _check(self)


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _check(c: SpeculativeConfig) -> None:
    def need(cond: bool, msg: str) -> None:
        if not cond:
            raise ValueError(f"--speculative-config: {msg}")

    if c.method in _OTHER_VLLM_METHODS:
        raise ValueError(f"--speculative-config: method {c.method!r} is not supported by kvmesh; "
                         f"use one of {', '.join(METHODS)}")
    need(c.method in METHODS, f"method must be one of {', '.join(METHODS)}, got {c.method!r}")
    need(_is_int(c.num_speculative_tokens) and c.num_speculative_tokens >= 1,
         f"num_speculative_tokens must be an integer >= 1, got {c.num_speculative_tokens!r}")
    need(c.disable_by_batch_size is None
         or (_is_int(c.disable_by_batch_size) and c.disable_by_batch_size >= 1),
         f"disable_by_batch_size must be an integer >= 1, got {c.disable_by_batch_size!r}")
    if c.method == "ngram":
        need(c.model is None, "method 'ngram' takes no model (it looks up the request's own tokens)")
        lo, hi = c.prompt_lookup_min, c.prompt_lookup_max
        need(lo is None or (_is_int(lo) and lo >= 1),
             f"prompt_lookup_min must be an integer >= 1, got {lo!r}")
        need(hi is None or (_is_int(hi) and hi >= 1),
             f"prompt_lookup_max must be an integer >= 1, got {hi!r}")
        if lo is not None and hi is not None:
            need(lo <= hi, f"prompt_lookup_min ({lo}) must be <= prompt_lookup_max ({hi})")
    else:
        need(isinstance(c.model, str) and c.model != "",
             "method 'draft_model' needs \"model\": the draft's HF directory")
        need(c.prompt_lookup_min is None and c.prompt_lookup_max is None,
             "prompt_lookup_min / prompt_lookup_max apply to method 'ngram' only")


_KEYS = tuple(f.name for f in fields(SpeculativeConfig))


def parse_speculative_config(value: Any) -> SpeculativeConfig | None:
    """A SpeculativeConfig from the flag's JSON text, a mapping (`LLM(speculative_config=...)`)
    or a SpeculativeConfig; None for None. ValueError naming the bad or unknown key."""
    if value is None or isinstance(value, SpeculativeConfig):
        return value
    args = json_object("--speculative-config", value, _KEYS,
                       '{"method": "ngram", "num_speculative_tokens": 4}')
    if args.get("method") is None:
        # NOTE: vLLM's inference: a draft model when one is named, else the method is required
        if args.get("model") is None:
            raise ValueError("--speculative-config: \"method\" is required "
                             f"(one of {', '.join(METHODS)})")
        args["method"] = "draft_model"
    if "num_speculative_tokens" not in args:
        raise ValueError("--speculative-config: \"num_speculative_tokens\" is required")
    if args["method"] == "ngram":
        lo, hi = args.get("prompt_lookup_min"), args.get("prompt_lookup_max")
        if lo is None and hi is None:
            lo = hi = _NGRAM_DEFAULT_LOOKUP
        elif lo is None:
            lo = hi
        elif hi is None:
            hi = lo
        args["prompt_lookup_min"], args["prompt_lookup_max"] = lo, hi
    return SpeculativeConfig(**args)
