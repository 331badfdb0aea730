"""Parallel ranged reads into `NAME.partial`, resumable after a kill, checked, then renamed.

    for each file:  NAME.partial (its full size, chunks written in place)
                    NAME.partial.state (the object's size + ETag, then one line per chunk done)
    all chunks in:  size and ETag/MD5 checked  ->  os.replace(NAME.partial, NAME)

A file under its final name was checked; a `.partial` is never loaded. After a kill the next
fetch keeps the chunks the state file lists, if the object's size and ETag are still the
ones it records, and reads the rest; the final check covers the kept bytes too, so a chunk
that was recorded but never reached the disk fails the check (and is then fetched anew).
"""
from __future__ import annotations

import json
import logging
import os
import threading
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from kvmesh.common.storage import etag as E
from kvmesh.common.storage.errors import FetchError
from kvmesh.common.storage.progress import Progress, mib
from kvmesh.common.storage.s3 import RemoteFile

logger = logging.getLogger("kvmesh.fetch")

PARTIAL, STATE = ".partial", ".partial.state"
_ATTEMPTS = 3              # a chunk whose stream breaks is read again from its start


class Store(Protocol):
    def read(self, f: RemoteFile, start: int, end: int): ...
    def part_size(self, f: RemoteFile) -> int | None: ...
    def encrypted(self, f: RemoteFile) -> bool: ...
    def error(self, e: Exception, name: str | None = None) -> Exception: ...


@dataclass(slots=True)
class _File:
    remote: RemoteFile
    final: Path
    chunk_bytes: int                         # the range one read asks for
    chunks: int                              # ranges of chunk_bytes (the last may be shorter)
    todo: list[int]                          # chunk indices still to read
    fd: int = -1
    lock: threading.Lock = field(default_factory=threading.Lock)   # the state file's appends
    left: int = 0                            # chunks not yet written (under lock)

    @property
    def partial(self) -> Path:
        return self.final.with_name(self.final.name + PARTIAL)

    @property
    def state(self) -> Path:
        return self.final.with_name(self.final.name + STATE)


def download(uri: str, store: Store, files: list[RemoteFile], dest: Path, *, workers: int = 8,
             chunk_bytes: int = 16 << 20) -> Progress:
    """Every file of `files` into `dest` (kept if already complete); the fetch's Progress."""
    plans = [_plan(f, dest, chunk_bytes) for f in files]
    pending = [p for p in plans if p.todo or not p.final.exists()]
    progress = None
    try:
        for p in pending:
            _open(p)
        total = sum(f.size for f in files)
        have = total - sum(_todo_bytes(p) for p in pending)
        if have and pending:
            logger.info("resuming %s: %s of %s already here", uri, mib(have), mib(total))
        progress = Progress(uri, total, have)
        failed_fast = threading.Event()      # set: the running chunks stop at their next piece
        with ThreadPoolExecutor(max(1, workers), thread_name_prefix="kvmesh-fetch") as pool:
            futures = [pool.submit(_chunk, uri, store, p, i, progress, failed_fast)
                       for p in pending for i in p.todo]
            futures += [pool.submit(_finish, uri, store, p) for p in pending if not p.todo]
            done, _ = wait(futures, return_when=FIRST_EXCEPTION)
            failed = [f for f in done if f.exception() is not None]
            if failed:
                failed_fast.set()
                for f in futures:
                    f.cancel()
                raise failed[0].exception()
    finally:
        for p in pending:
            if p.fd >= 0:
                os.close(p.fd)
                p.fd = -1
        if progress is not None:
            progress.close()
    return progress


def _plan(f: RemoteFile, dest: Path, chunk_bytes: int) -> _File:
    chunks = max(1, -(-f.size // chunk_bytes))
    plan = _File(f, dest / f.name, chunk_bytes, chunks, [])
    if plan.final.exists() and plan.final.stat().st_size == f.size:
        return plan                          # checked before its rename
    done = _read_state(plan, chunk_bytes)
    plan.todo = [i for i in range(chunks) if i not in done] if f.size else []
    return plan


def _read_state(p: _File, chunk_bytes: int) -> set[int]:
    """The chunks a previous fetch of this very object wrote; empty when there is none."""
    try:
        lines = p.state.read_text().splitlines()
        header = json.loads(lines[0])
        if (header != _header(p.remote, chunk_bytes) or not p.partial.exists()
                or p.partial.stat().st_size != p.remote.size):
            return set()
        return {int(x) for x in lines[1:] if x.strip().isdigit()}
    except (OSError, IndexError, ValueError):
        return set()


def _header(f: RemoteFile, chunk_bytes: int) -> dict:
    return {"size": f.size, "etag": f.etag, "chunk": chunk_bytes}


def _todo_bytes(p: _File) -> int:
    return sum(min(p.chunk_bytes, p.remote.size - i * p.chunk_bytes) for i in p.todo)


def _open(p: _File) -> None:
    """Open the .partial file (created at its full size when the fetch starts afresh)."""
    p.final.parent.mkdir(parents=True, exist_ok=True)
    fresh = len(p.todo) == p.chunks or not p.partial.exists()
    if fresh:
        p.todo = list(range(p.chunks)) if p.remote.size else []
        p.partial.unlink(missing_ok=True)
        p.state.write_text(json.dumps(_header(p.remote, p.chunk_bytes)) + "\n")
    p.fd = os.open(p.partial, os.O_RDWR | os.O_CREAT, 0o644)
    if fresh:
        os.ftruncate(p.fd, p.remote.size)
    p.left = len(p.todo)


def _chunk(uri: str, store: Store, p: _File, i: int, progress: Progress,
           stop: threading.Event) -> None:
    start, end = i * p.chunk_bytes, min(p.remote.size, (i + 1) * p.chunk_bytes)
    for attempt in range(1, _ATTEMPTS + 1):
        offset = start
        try:
            for piece in store.read(p.remote, start, end):
                if stop.is_set():
                    return                   # another chunk failed: the fetch is over
                if offset + len(piece) > end:
                    raise FetchError(uri, "network", f"{p.remote.name}: the store sent more "
                                     f"bytes than asked for at {start}")
                os.pwrite(p.fd, piece, offset)
                offset += len(piece)
                progress.add(len(piece))
            if offset != end:
                raise FetchError(uri, "network", f"{p.remote.name}: short read at {offset} of "
                                 f"{start}-{end}")
            break
        except FetchError as e:
            progress.add(start - offset)     # the chunk is read again from its start
            if e.reason != "network" or attempt == _ATTEMPTS:
                raise
            logger.warning("%s; reading that range again (%d of %d)", e, attempt + 1, _ATTEMPTS)
    with p.lock:
        with open(p.state, "a") as state:
            state.write(f"{i}\n")
        p.left -= 1
        last = p.left == 0
    if last:
        _finish(uri, store, p)


def _finish(uri: str, store: Store, p: _File) -> None:
    """Check the complete .partial against the object's size and ETag, then rename it."""
    size = os.stat(p.partial).st_size
    if size != p.remote.size:
        _discard(p)
        raise FetchError(uri, "checksum", f"{p.remote.name}: {size} bytes, the store lists "
                         f"{p.remote.size}; the partial file was removed, run the fetch again")
    verdict = None
    if E.is_digest(p.remote.etag) and not store.encrypted(p.remote):
        hint = store.part_size(p.remote) if E.multipart_count(p.remote.etag) else None
        verdict = E.matches(p.partial, p.remote.etag, p.remote.size, () if hint is None else (hint,))
    if verdict is False:
        _discard(p)
        raise FetchError(uri, "checksum", f"{p.remote.name}: checksum mismatch (the MD5 of "
                         f"the bytes fetched is not the ETag {E.normalise(p.remote.etag)}); the "
                         "partial file was removed, run the fetch again")
    if verdict is None:
        logger.info("%s: %s checked by size only (its ETag is no MD5)", uri, p.remote.name)
    os.replace(p.partial, p.final)
    p.state.unlink(missing_ok=True)


def _discard(p: _File) -> None:
    p.partial.unlink(missing_ok=True)
    p.state.unlink(missing_ok=True)
