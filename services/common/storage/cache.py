"""The node-local model cache: one entry per (URI, version), a size bound, LRU eviction.

    $KVMESH_CACHE_DIR/models/          (or KVMESH_MODEL_CACHE_DIR, or kvmesh fetch --cache-dir)
        <key>.lock                     fcntl lock: one process on the node fetches an entry
        <key>/<name>/                  the model directory the engine loads
        <key>/entry.json               written last: the entry is complete (its mtime: last use)

`key` is a digest of the URI and the version the store gave (the listing's sizes and ETags),
so an object replaced in the store is a new entry, and the old one ages out.
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import re
import shutil
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from kvmesh.common.model_files import cache_dir
from kvmesh.common.storage.errors import FetchError

logger = logging.getLogger("kvmesh.fetch")

ENTRY = "entry.json"
# NOTE: the size bound, where no flag names one; unset or 0: no bound.
MAX_SIZE_ENV = "KVMESH_MODEL_CACHE_MAX_SIZE"
_UNITS = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12, "ki": 1 << 10, "mi": 1 << 20,
          "gi": 1 << 30, "ti": 1 << 40}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]i?)?b?\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """Bytes from `10G`, `500MiB`, `1.5T` or a plain number (decimal units; `Gi` is binary)."""
    m = _SIZE.match(text)
    if not m:
        raise ValueError(f"cannot read {text!r} as a size; use e.g. 50G, 500Mi or 1000000")
    return int(float(m.group(1)) * _UNITS[(m.group(2) or "").lower()])


# NOTE: the model cache may live apart from the kernels' cache (a node's big disk, a PVC)
ROOT_ENV = "KVMESH_MODEL_CACHE_DIR"


def default_root() -> Path:
    """KVMESH_MODEL_CACHE_DIR, else $KVMESH_CACHE_DIR/models (~/.cache/kvmesh/models)."""
    return Path(os.environ[ROOT_ENV]).expanduser() if os.environ.get(ROOT_ENV) else cache_dir() / "models"


def default_max_bytes() -> int | None:
    """The bound KVMESH_MODEL_CACHE_MAX_SIZE sets (None: none)."""
    text = os.environ.get(MAX_SIZE_ENV, "").strip()
    if not text:
        return None
    try:
        return parse_size(text) or None
    except ValueError as e:
        raise ValueError(f"{MAX_SIZE_ENV}: {e}") from None


@dataclass(frozen=True, slots=True)
class Entry:
    key: str                # digest of the URI and its version: the directory and lock name
    root: Path              # <cache>/<key>
    name: str               # the model directory's name inside it

    @property
    def model_dir(self) -> Path:
        return self.root / self.name

    @property
    def complete(self) -> bool:
        return (self.root / ENTRY).is_file()


class ModelCache:
    """The cache under `root`; `max_bytes` bounds its complete and partial entries together."""

    def __init__(self, root: Path | None = None, max_bytes: int | None = None) -> None:
        self.root = Path(root) if root is not None else default_root()
        self.max_bytes = max_bytes

    def entry(self, uri: str, version: str, name: str) -> Entry:
        digest = hashlib.sha256(f"{uri}\n{version}".encode()).hexdigest()[:24]
        return Entry(digest, self.root / digest, name)

    @contextmanager
    def locked(self, entry: Entry, uri: str) -> Iterator[None]:
        """Hold the entry's lock: a second process on the node waits here, then finds the
        entry complete. The kernel drops the lock when its holder dies (a kill mid-fetch)."""
        self.root.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.root / f"{entry.key}.lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                logger.info("waiting: another process on this node is fetching %s", uri)
                fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)            # releases the lock

    def commit(self, entry: Entry, uri: str, version: str, size: int) -> None:
        """Mark the entry complete (its files are all checked and in place)."""
        record = {"uri": uri, "version": version, "name": entry.name, "bytes": size,
                  "fetched_at": time.time()}
        tmp = entry.root / f"{ENTRY}.tmp"
        tmp.write_text(json.dumps(record, indent=1) + "\n")
        os.replace(tmp, entry.root / ENTRY)

    def touch(self, entry: Entry) -> None:
        """Record a use (LRU order is the entry file's mtime)."""
        try:
            os.utime(entry.root / ENTRY)
        except OSError:
            pass

    def make_room(self, keep: Entry, need: int, uri: str) -> None:
        """Evict least recently used entries (never `keep`, never one being fetched) until
        `keep`'s `need` bytes (the whole model) fit under the bound beside the rest. FetchError when the model alone exceeds it."""
        if self.max_bytes is None:
            return
        if need > self.max_bytes:
            raise FetchError(uri, "cache_full", f"{need / 2**30:.2f} GiB does not fit the model "
                             f"cache's bound of {self.max_bytes / 2**30:.2f} GiB; raise "
                             f"{MAX_SIZE_ENV} (or --max-size)")
        entries = sorted(self._others(keep), key=lambda e: e[1])
        used = sum(size for _, _, size in entries)
        for path, _, size in entries:
            if used + need <= self.max_bytes:
                break
            if self._evict(path, uri):
                used -= size
        if used + need > self.max_bytes:
            logger.warning("model cache %s: %.2f GiB in use by entries being fetched; %s needs "
                           "%.2f GiB more than the bound allows", self.root, used / 2**30, uri,
                           (used + need - self.max_bytes) / 2**30)

    def _others(self, keep: Entry) -> list[tuple[Path, float, int]]:
        """(entry dir, last use, bytes) of every entry but `keep`."""
        out = []
        if not self.root.is_dir():
            return out
        for path in self.root.iterdir():
            if not path.is_dir() or path.name == keep.key or path.name.startswith("."):
                continue
            marker = path / ENTRY
            try:
                used = (marker if marker.exists() else path).stat().st_mtime
            except OSError:
                continue
            out.append((path, used, _tree_bytes(path)))
        return out

    def _evict(self, path: Path, uri: str) -> bool:
        """Remove one entry unless another process holds its lock (a fetch in progress)."""
        fd = os.open(self.root / f"{path.name}.lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return False
            # NOTE: renamed first, so no reader ever sees a half-deleted model directory
            gone = _entry_uri(path) or path.name
            trash = self.root / f".trash-{path.name}-{os.getpid()}"
            os.rename(path, trash)
            shutil.rmtree(trash, ignore_errors=True)
            logger.info("model cache: evicted %s (least recently used) to make room for %s",
                        gone, uri)
            return True
        finally:
            os.close(fd)


def _entry_uri(path: Path) -> str | None:
    try:
        return json.loads((path / ENTRY).read_text()).get("uri")
    except (OSError, ValueError):
        return None


def _tree_bytes(path: Path) -> int:
    total = 0
    for dirpath, _, names in os.walk(path):
        for n in names:
            try:
                total += os.stat(os.path.join(dirpath, n)).st_size
            except OSError:
                pass
    return total
