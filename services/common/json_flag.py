"""A flag that takes a JSON object (vLLM's `--speculative-config`, `--kv-transfer-config`): the
text, a mapping or None, read once with errors that name the flag and the unknown keys."""
from __future__ import annotations

import json
from typing import Any


def json_object(flag: str, value: Any, keys: tuple[str, ...], example: str) -> dict:
    """`value` (JSON text or a mapping) as a new dict with only `keys`; ValueError otherwise.
    `example` is a valid value, shown when the text does not parse."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"{flag}: not valid JSON ({e.msg} at column {e.colno}); "
                             f"e.g. '{example}'") from None
    if not isinstance(value, dict):
        raise ValueError(f"{flag} must be a JSON object, got {type(value).__name__}")
    unknown = sorted(set(value) - set(keys))
    if unknown:
        raise ValueError(f"{flag}: unknown key(s) {', '.join(map(repr, unknown))}; "
                         f"kvmesh reads {', '.join(keys)}")
    return dict(value)
