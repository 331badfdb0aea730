"""A fetched model directory, checked before the cache calls it complete: every file the
loader parses first must parse (its JSON files, each safetensors header, a GGUF's magic)."""
from __future__ import annotations

import json
import struct
from pathlib import Path

from kvmesh.common.storage.errors import FetchError

_MAX_HEADER = 100 << 20         # the safetensors format's own limit on its JSON header


def check_model_dir(path: Path, uri: str, required: str | None = None) -> None:
    """FetchError (reason "unparsable") naming the first file that does not parse; `required`:
    the file the directory must hold (None: a model's config.json or a *.gguf)."""
    files = sorted(p for p in path.iterdir() if p.is_file())
    if required is not None and not any(p.name == required for p in files):
        raise FetchError(uri, "not_found", f"no {required} among the fetched files "
                         f"({', '.join(p.name for p in files) or 'none'})")
    if required is None and not any(p.name == "config.json" or p.suffix == ".gguf" for p in files):
        raise FetchError(uri, "not_found", "no config.json or *.gguf among the model's files "
                         f"({', '.join(p.name for p in files) or 'none'})")
    for p in files:
        problem = _problem(p)
        if problem:
            raise FetchError(uri, "unparsable", f"{p.name}: {problem}")


def _problem(p: Path) -> str | None:
    if p.suffix == ".json":
        try:
            json.loads(p.read_bytes())
        except (ValueError, UnicodeDecodeError) as e:
            return f"not valid JSON ({e})"
        return None
    if p.suffix == ".safetensors":
        return _safetensors_problem(p)
    if p.suffix == ".gguf":
        with open(p, "rb") as f:
            return None if f.read(4) == b"GGUF" else "not a GGUF file (no GGUF magic)"
    return None


def _safetensors_problem(p: Path) -> str | None:
    size = p.stat().st_size
    with open(p, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            return "not a safetensors file (shorter than its header length)"
        (n,) = struct.unpack("<Q", head)
        if n > min(_MAX_HEADER, size - 8):
            return f"not a safetensors file (header length {n} in a file of {size} bytes)"
        try:
            header = json.loads(f.read(n))
        except (ValueError, UnicodeDecodeError):
            return "not a safetensors file (its header is not JSON)"
    if not isinstance(header, dict):
        return "not a safetensors file (its header is not a JSON object)"
    try:
        end = max((int(t["data_offsets"][1]) for k, t in header.items() if k != "__metadata__"),
                  default=0)
    except (TypeError, KeyError, IndexError, ValueError):
        return "not a safetensors file (a tensor without data_offsets)"
    if 8 + n + end > size:
        return f"truncated: its header describes {8 + n + end} bytes, the file has {size}"
    return None
