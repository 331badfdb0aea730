"""hf://org/name[@revision]: the Hugging Face Hub through huggingface_hub's snapshot_download.

The Hub's own cache layout (models--org--name/{blobs,refs,snapshots}) is kept, so its tools
(`hf cache ls`, `hf cache rm`) work on it, under HF_HUB_CACHE (or HF_HOME/hub) when set, else
beside kvmesh's other models (<model cache>/hub, which the operator mounts per node).
HF_TOKEN, HF_ENDPOINT (a mirror) and HF_HUB_OFFLINE are read at each fetch.
"""
from __future__ import annotations

import logging
import os
from pathlib import Path

from kvmesh.common.storage.errors import FetchError
from kvmesh.common.storage.files import ALLOW_PATTERNS
from kvmesh.common.storage.uri import ModelSource

logger = logging.getLogger("kvmesh.fetch")


def hub_cache(models_root: Path) -> Path:
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    return models_root / "hub"


def offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def fetch_hf(source: ModelSource, models_root: Path, workers: int = 8) -> Path:
    """The snapshot directory of the source's repo and revision (downloaded unless cached)."""
    assert source.scheme == "hf"
    try:
        from huggingface_hub import snapshot_download  # noqa: PLC0415 - only hf:// needs it
    except ImportError:
        raise FetchError(source.uri, "invalid", "hf:// needs huggingface_hub: pip install "
                         "huggingface_hub") from None
    cache = hub_cache(models_root)
    try:
        path = snapshot_download(
            source.location, revision=source.revision, cache_dir=cache,
            allow_patterns=list(ALLOW_PATTERNS), local_files_only=offline(),
            token=os.environ.get("HF_TOKEN") or None,
            endpoint=os.environ.get("HF_ENDPOINT") or None, max_workers=workers)
    except Exception as e:  # noqa: BLE001 - mapped to a FetchError or re-raised
        raise _error(source, cache, e) from None
    return Path(path)


def _error(source: ModelSource, cache: Path, e: Exception) -> Exception:
    kind = type(e).__name__
    revision = source.revision or "main"
    if kind in ("LocalEntryNotFoundError", "IncompleteSnapshotError", "OfflineModeIsEnabled"):
        repo = cache / ("models--" + source.location.replace("/", "--"))
        where = "HF_HUB_OFFLINE is set" if offline() else "the Hub could not be reached"
        if not repo.is_dir():
            return FetchError(source.uri, "not_found", f"not in the Hub cache {cache} and {where}")
        refs = sorted(p.name for p in (repo / "refs").glob("*")) if (repo / "refs").is_dir() else []
        snaps = (repo / "snapshots")
        if kind == "IncompleteSnapshotError" or (snaps / revision).is_dir() or revision in refs:
            return FetchError(source.uri, "not_found", f"revision {revision!r} is only partly in "
                              f"the Hub cache {cache} and {where}")
        return FetchError(source.uri, "revision", f"revision {revision!r} is not in the Hub cache "
                          f"{cache} ({where}); cached: {', '.join(refs) or 'no named revision'}")
    if kind == "GatedRepoError":
        return FetchError(source.uri, "denied", "a gated repository: accept its terms on the Hub "
                          "and set HF_TOKEN")
    if kind == "RepositoryNotFoundError":
        return FetchError(source.uri, "not_found", "no such repository (or a private one: set "
                          "HF_TOKEN to a token that may read it)")
    if kind == "RevisionNotFoundError":
        return FetchError(source.uri, "revision", f"no revision {revision!r} in the repository")
    status = getattr(getattr(e, "response", None), "status_code", None)
    if status == 401:
        return FetchError(source.uri, "credentials", "the Hub refused the token (HF_TOKEN)")
    if kind in ("HfHubHTTPError", "ConnectError", "ConnectTimeout", "ReadTimeout", "OSError"):
        return FetchError(source.uri, "network", f"cannot fetch from the Hub ({kind})")
    return e
