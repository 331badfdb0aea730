"""Model sources: the one syntax `--model`, `LLM(model=...)` and `kvmesh fetch` accept.

    ./dir, /abs/model.gguf       a local path (unchanged)
    s3://bucket/prefix           any S3-compatible store (AWS_ENDPOINT_URL, path-style there)
    hf://org/name[@revision]     the Hugging Face Hub (or an HF_ENDPOINT mirror)
    pvc://claim/path             a PersistentVolumeClaim the operator mounts at PVC_MOUNT

Parsing only: nothing here touches the network or the disk.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass

from kvmesh.common.storage.errors import FetchError

# NOTE: the operator mounts a model claim read-only at /models (operator's resources.MODELS_DIR);
# KVMESH_PVC_MOUNT moves it (a test, or a pod that mounts the claim elsewhere).
PVC_MOUNT = "/models"

_SCHEME = re.compile(r"^([a-zA-Z][a-zA-Z0-9+.-]*)://")
# S3 bucket names: 3-63 of lowercase letters, digits, dots and hyphens (AWS's rules, simplified)
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")
_HF_PART = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


@dataclass(frozen=True, slots=True)
class ModelSource:
    scheme: str         # "local", "s3", "hf" or "pvc"
    uri: str            # as the user wrote it, normalised (no trailing slash): names it in messages
    location: str       # local / pvc: the path; s3: the bucket; hf: the repo id (org/name)
    prefix: str = ""    # s3: the key prefix, "" for the whole bucket, else ending in "/"
    revision: str | None = None   # hf: branch, tag or commit; None: the repo's default (main)

    @property
    def remote(self) -> bool:
        """Whether the model is fetched into the node cache before it is loaded."""
        return self.scheme in ("s3", "hf")

    @property
    def name(self) -> str:
        """The served model name it gives by default: hf's repo id (as vLLM serves it), else the
        last path component (as a local directory gives its name)."""
        if self.scheme == "hf":
            return self.location
        tail = self.prefix.rstrip("/") or self.location
        return tail.rsplit("/", 1)[-1]


def is_uri(text: str) -> bool:
    return bool(_SCHEME.match(text))


def parse_source(text: str) -> ModelSource:
    """The ModelSource `text` names; FetchError (reason "invalid") for a malformed or
    unsupported URI."""
    m = _SCHEME.match(text)
    if not m:
        return ModelSource("local", text, os.path.expanduser(text))
    scheme, rest = m.group(1).lower(), text[m.end():]
    if scheme == "s3":
        return _parse_s3(text, rest)
    if scheme == "hf":
        return _parse_hf(text, rest)
    if scheme == "pvc":
        return _parse_pvc(text, rest)
    if scheme == "gs":
        raise FetchError(text, "invalid", "gs:// is not supported; read the bucket through "
                         "Cloud Storage's S3-compatible XML API instead: s3://BUCKET/PREFIX with "
                         "AWS_ENDPOINT_URL=https://storage.googleapis.com and an HMAC key as "
                         "AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY")
    raise FetchError(text, "invalid", f"unsupported scheme {scheme}://; use a local path, "
                     "s3://bucket/prefix, hf://org/name[@revision] or pvc://claim/path")


def _parse_s3(text: str, rest: str) -> ModelSource:
    bucket, _, prefix = rest.partition("/")
    if not _BUCKET.match(bucket):
        raise FetchError(text, "invalid", f"{bucket!r} is not a valid bucket name; expected "
                         "s3://bucket/prefix")
    prefix = prefix.strip("/")
    uri = f"s3://{bucket}/{prefix}" if prefix else f"s3://{bucket}"
    return ModelSource("s3", uri, bucket, prefix + "/" if prefix else "")


def _parse_hf(text: str, rest: str) -> ModelSource:
    repo, at, revision = rest.partition("@")
    parts = repo.strip("/").split("/")
    if len(parts) != 2 or not all(_HF_PART.match(p) for p in parts) or (at and not revision):
        raise FetchError(text, "invalid", "expected hf://org/name or hf://org/name@revision")
    repo_id = "/".join(parts)
    return ModelSource("hf", f"hf://{repo_id}" + (f"@{revision}" if revision else ""), repo_id,
                       revision=revision or None)


def _parse_pvc(text: str, rest: str) -> ModelSource:
    claim, _, path = rest.partition("/")
    if not claim:
        raise FetchError(text, "invalid", "expected pvc://claim/path")
    path = path.strip("/")
    if any(p == ".." for p in path.split("/")):
        raise FetchError(text, "invalid", "a pvc:// path may not leave its claim ('..')")
    root = os.environ.get("KVMESH_PVC_MOUNT") or PVC_MOUNT
    local = os.path.join(root, path) if path else root
    return ModelSource("pvc", f"pvc://{claim}/{path}".rstrip("/"), local)
