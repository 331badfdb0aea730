"""fetch: a model source -> a local directory or file the loader reads.

    local path, pvc://   checked, returned as they are
    s3://                listed -> cache entry (URI + listing's ETags) -> lock -> room made ->
                         parallel ranged download -> files checked -> entry committed
    hf://                huggingface_hub's snapshot_download into the Hub cache layout
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from kvmesh.common.startup import startup_phase
from kvmesh.common.storage import etag as E
from kvmesh.common.storage.cache import ENTRY, ModelCache, default_max_bytes, default_root
from kvmesh.common.storage.check import check_model_dir
from kvmesh.common.storage.download import download
from kvmesh.common.storage.errors import FetchError
from kvmesh.common.storage.hf import fetch_hf
from kvmesh.common.storage.progress import mib
from kvmesh.common.storage.s3 import RemoteFile, S3Store
from kvmesh.common.storage.uri import ModelSource, is_uri, parse_source

if TYPE_CHECKING:
    from kvmesh.common.config import EngineConfig

logger = logging.getLogger("kvmesh.fetch")


@dataclass(frozen=True, slots=True)
class FetchOptions:
    cache_dir: Path | None = None   # the model cache; None: cache.default_root()
    max_bytes: int | None = None    # its size bound; None: KVMESH_MODEL_CACHE_MAX_SIZE (or none)
    workers: int = 8                # parallel ranged reads
    chunk_bytes: int = 16 << 20     # bytes one ranged read asks for
    required_file: str | None = None  # what the fetched directory must hold; None: a model's
                                      # config.json or *.gguf ("adapter_config.json": a LoRA adapter)


@dataclass(frozen=True, slots=True)
class FetchedModel:
    path: Path                      # what the loader opens: a model directory or a .gguf file
    name: str | None                # the served name it gives by default (None: the loader's)
    fetched_bytes: int = 0          # read from the store by this call (0: all cached)
    seconds: float = 0.0            # the fetch's duration (0 for a local path)


def fetch(model: str, options: FetchOptions | None = None) -> FetchedModel:
    """The local path of `model` (fetched into the node cache first when remote). FetchError,
    naming the URI, when it cannot be had."""
    options = options or FetchOptions()
    source = parse_source(model)
    if not source.remote:
        path = Path(source.location)
        if not path.exists():
            raise FetchError(source.uri, "not_found", f"no such file or directory {path}")
        return FetchedModel(path, source.name if source.scheme == "pvc" else None)
    root = options.cache_dir or default_root()
    with startup_phase("fetching model", source.uri, phase="fetch"):
        if source.scheme == "hf":
            snapshot = fetch_hf(source, root, options.workers)
            check_model_dir(snapshot, source.uri, options.required_file)
            return FetchedModel(snapshot, source.name)
        return _fetch_s3(source, root, options)


def resolve_engine_model(config: EngineConfig) -> EngineConfig:
    """`config` (an EngineConfig) with a remote `model` fetched and replaced by its local path,
    and the served name defaulting to the source's; any other config unchanged."""
    if config.model is None or not is_uri(config.model):
        return config
    fetched = fetch(config.model)
    return dataclasses.replace(config, model=str(fetched.path),
                               served_model_name=config.served_model_name or fetched.name)


def _fetch_s3(source: ModelSource, root: Path, options: FetchOptions) -> FetchedModel:
    cache = ModelCache(root, options.max_bytes if options.max_bytes is not None else default_max_bytes())
    store = S3Store(source, options.workers + 2)
    try:
        files = store.list()
    except FetchError as e:
        cached = _latest_cached(root, source.uri) if e.reason == "network" else None
        if cached is None:
            raise
        logger.warning("%s; using the copy cached at %s", e, cached)
        return FetchedModel(cached, source.name)
    version = _version(files)
    entry = cache.entry(source.uri, version, source.name)
    total = sum(f.size for f in files)
    if not entry.complete:
        with cache.locked(entry, source.uri):
            if not entry.complete:           # else another process fetched it while we waited
                cache.make_room(entry, total, source.uri)
                progress = download(source.uri, store, files, entry.model_dir,
                                    workers=options.workers, chunk_bytes=options.chunk_bytes)
                check_model_dir(entry.model_dir, source.uri, options.required_file)
                cache.commit(entry, source.uri, version, total)
                seconds = progress.close()
                logger.info("fetched %s: %s in %.1f s (%.1f MiB/s) into %s", source.uri,
                            mib(progress.fetched), seconds,
                            progress.fetched / 2**20 / max(seconds, 1e-9), entry.model_dir)
                return FetchedModel(entry.model_dir, source.name, progress.fetched, seconds)
    cache.touch(entry)
    logger.info("%s: cached at %s", source.uri, entry.model_dir)
    return FetchedModel(entry.model_dir, source.name)


def _version(files: list[RemoteFile]) -> str:
    """What the store says this model's bytes are: each file's name, size and ETag."""
    listing = "\n".join(f"{f.name} {f.size} {E.normalise(f.etag)}" for f in files)
    return hashlib.sha256(listing.encode()).hexdigest()[:16]


def _latest_cached(root: Path, uri: str) -> Path | None:
    """The most recently used complete entry of `uri` (the store cannot be reached)."""
    best: tuple[float, Path] | None = None
    for marker in root.glob(f"*/{ENTRY}") if root.is_dir() else ():
        try:
            record = json.loads(marker.read_text())
            used = marker.stat().st_mtime
        except (OSError, ValueError):
            continue
        if record.get("uri") == uri and (best is None or used > best[0]):
            best = (used, marker.parent / record["name"])
    return best[1] if best else None


__all__ = ["FetchOptions", "FetchedModel", "fetch", "resolve_engine_model"]
