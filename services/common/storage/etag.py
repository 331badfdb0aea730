"""Checking a downloaded file against the ETag its store gave.

An S3 ETag is the object's MD5 (`"<32 hex>"`) for a single upload, and for a multipart upload
the MD5 of its parts' MD5s with the part count (`"<32 hex>-N"`): checking that one needs the
part size the uploader used. Other ETags (SSE-KMS / SSE-C objects, some stores' own) are no
digest: such a file is checked by its size alone.
"""
from __future__ import annotations

import hashlib
import re
from pathlib import Path
from typing import Iterable

_MIB = 1 << 20
_SIMPLE = re.compile(r"^[0-9a-f]{32}$")
_MULTIPART = re.compile(r"^([0-9a-f]{32})-(\d+)$")
# Part sizes of common uploaders (boto3 / aws cli: 8 MiB; s5cmd: 50 MiB; rclone: 5 MiB)
COMMON_PART_SIZES = (8 * _MIB, 16 * _MIB, 5 * _MIB, 50 * _MIB, 64 * _MIB)
_READ = 8 * _MIB


def normalise(etag: str) -> str:
    """The ETag without its quotes (and a weak validator's W/), lowercased."""
    return etag.strip().removeprefix("W/").strip('"').lower()


def is_digest(etag: str) -> bool:
    """Whether the ETag is an MD5 this module can check (a plain or a multipart one)."""
    e = normalise(etag)
    return bool(_SIMPLE.match(e) or _MULTIPART.match(e))


def multipart_count(etag: str) -> int | None:
    m = _MULTIPART.match(normalise(etag))
    return int(m.group(2)) if m else None


def matches(path: Path, etag: str, size: int, part_sizes: Iterable[int] = ()) -> bool | None:
    """True when the file is the object the ETag names, False when it is not, None when the
    ETag cannot tell (no digest, or no known part size gives its part count). `part_sizes` are
    tried first (e.g. the size of part 1, which the store reports), then common ones."""
    e = normalise(etag)
    if _SIMPLE.match(e):
        return _md5_parts(path, None) == e
    m = _MULTIPART.match(e)
    if not m:
        return None
    count = int(m.group(2))
    tried = False
    for part in _candidates(size, count, part_sizes):
        tried = True
        if _md5_parts(path, part) == e:
            return True
    return False if tried else None


def _candidates(size: int, count: int, first: Iterable[int]) -> list[int]:
    derived = -(-size // count)                       # the smallest part size giving `count`
    # ... rounded up to whole MiB and to whole 64 KiB (uploaders pick round part sizes)
    rounded = [-(-derived // unit) * unit for unit in (_MIB, 64 << 10)]
    out: list[int] = []
    for p in (*first, *COMMON_PART_SIZES, *rounded, derived):
        if p > 0 and p not in out and -(-size // p) == count:
            out.append(p)
    return out


def _md5_parts(path: Path, part_size: int | None) -> str:
    """The file's MD5 (part_size None), or its multipart ETag for that part size."""
    whole = hashlib.md5(usedforsecurity=False)
    parts: list[bytes] = []
    with open(path, "rb") as f:
        while True:
            if part_size is None:
                buf = f.read(_READ)
                if not buf:
                    return whole.hexdigest()
                whole.update(buf)
                continue
            part = hashlib.md5(usedforsecurity=False)
            left = part_size
            while left:
                buf = f.read(min(_READ, left))
                if not buf:
                    break
                part.update(buf)
                left -= len(buf)
            if left == part_size:                     # nothing read: past the end
                break
            parts.append(part.digest())
            if left:
                break
    combined = hashlib.md5(b"".join(parts), usedforsecurity=False).hexdigest()
    return f"{combined}-{len(parts)}"
