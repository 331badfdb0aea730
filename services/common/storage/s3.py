"""An S3-compatible store through boto3 (imported on first use): list a prefix, read ranges.

The endpoint, the region and the credentials come from the standard AWS settings, which
botocore reads itself: AWS_ENDPOINT_URL (or AWS_ENDPOINT_URL_S3), AWS_REGION,
AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY / AWS_SESSION_TOKEN, AWS_PROFILE and the shared
credentials file. With an endpoint of its own (MinIO, Ceph, a test server) addressing is
path-style (`http://host/bucket/key`), which every S3-compatible server serves.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Iterator
from urllib.parse import urlsplit

from kvmesh.common.storage.errors import FetchError
from kvmesh.common.storage.files import wanted
from kvmesh.common.storage.uri import ModelSource

_PIECE = 1 << 20           # bytes per read from a response stream


@dataclass(frozen=True, slots=True)
class RemoteFile:
    key: str        # the object's key in the bucket
    name: str       # its path relative to the model directory (the key less the prefix)
    size: int       # bytes, as listed
    etag: str       # as listed (quoted): sent back as If-Match, so a changed object is noticed


class S3Store:
    """One model prefix in one bucket. Thread-safe: the download threads share it."""

    def __init__(self, source: ModelSource, max_connections: int = 16) -> None:
        assert source.scheme == "s3"
        self.source = source
        try:
            import boto3  # noqa: PLC0415 - only an s3:// model needs it
            from botocore.config import Config  # noqa: PLC0415
        except ImportError:
            raise FetchError(source.uri, "invalid", "s3:// needs boto3: pip install boto3") from None
        endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
        # NOTE: botocore's own checksum check is off: on a ranged read it has no whole-object
        # checksum to check, and download.py checks every file against its ETag itself
        config = Config(s3={"addressing_style": "path" if endpoint else "auto"},
                        retries={"mode": "standard", "max_attempts": 3},
                        response_checksum_validation="when_required",
                        max_pool_connections=max_connections, connect_timeout=10, read_timeout=60)
        try:
            self.client = boto3.session.Session().client("s3", endpoint_url=endpoint or None,
                                                         config=config)
        except Exception as e:  # noqa: BLE001 - botocore's config errors name no secret
            raise FetchError(source.uri, "invalid", f"cannot configure the S3 client: {e}") from None
        self.endpoint = _shown(self.client.meta.endpoint_url)
        self._encrypted: set[str] = set()     # keys whose reads said KMS / customer-key encryption

    def list(self) -> list[RemoteFile]:
        """The model's files under the prefix (the allow-list's), sorted by name."""
        files = []
        try:
            pages = self.client.get_paginator("list_objects_v2").paginate(
                Bucket=self.source.location, Prefix=self.source.prefix)
            for page in pages:
                for obj in page.get("Contents", ()):
                    name = obj["Key"][len(self.source.prefix):]
                    if wanted(name):
                        files.append(RemoteFile(obj["Key"], name, obj["Size"], obj.get("ETag", "")))
        except Exception as e:  # noqa: BLE001 - mapped to a FetchError or re-raised
            raise self.error(e) from None
        if not files:
            raise FetchError(self.source.uri, "not_found", "no model files under this prefix (none of "
                             "config.json, *.safetensors, *.gguf, tokenizer*: is the prefix right?)")
        return sorted(files, key=lambda f: f.name)

    def read(self, f: RemoteFile, start: int, end: int) -> Iterator[bytes]:
        """Bytes [start, end) of the object, as it was listed (If-Match its ETag)."""
        try:
            extra = {"IfMatch": f.etag} if f.etag else {}
            response = self.client.get_object(Bucket=self.source.location, Key=f.key,
                                              Range=f"bytes={start}-{end - 1}", **extra)
            if response.get("ServerSideEncryption") == "aws:kms" or "SSECustomerAlgorithm" in response:
                self._encrypted.add(f.key)
            yield from response["Body"].iter_chunks(_PIECE)
        except Exception as e:  # noqa: BLE001
            raise self.error(e, f.name) from None

    def part_size(self, f: RemoteFile) -> int | None:
        """The size of part 1 of a multipart object, where the store tells it (HEAD partNumber=1)."""
        try:
            head = self.client.head_object(Bucket=self.source.location, Key=f.key, PartNumber=1)
        except Exception:  # noqa: BLE001 - only a hint: the common part sizes are tried anyway
            return None
        size = head.get("ContentLength")
        return size if isinstance(size, int) and 0 < size < f.size else None

    def encrypted(self, f: RemoteFile) -> bool:
        """Whether a read of the object said it is encrypted with KMS or a customer key (its
        ETag is then no MD5 of its bytes). A file resumed with nothing left to read counts as not."""
        return f.key in self._encrypted

    def error(self, e: Exception, name: str | None = None) -> Exception:
        """`e` as a FetchError naming the URI (and the file), never a credential; an exception
        this module does not know is returned unchanged."""
        uri = self.source.uri + (f" ({name})" if name else "")
        kind = type(e).__name__
        if kind in ("NoCredentialsError", "PartialCredentialsError"):
            return FetchError(uri, "credentials", "no S3 credentials: set AWS_ACCESS_KEY_ID and "
                              "AWS_SECRET_ACCESS_KEY (or AWS_PROFILE, or a credentials file)")
        if kind in ("EndpointConnectionError", "ConnectTimeoutError", "ReadTimeoutError",
                    "ConnectionClosedError", "ResponseStreamingError", "IncompleteReadError"):
            return FetchError(uri, "network", f"cannot read from the store at {self.endpoint} ({kind})")
        response = getattr(e, "response", None)
        if not isinstance(response, dict):
            return e
        code = str(response.get("Error", {}).get("Code", ""))
        status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        if code in ("InvalidAccessKeyId", "SignatureDoesNotMatch", "InvalidToken", "ExpiredToken",
                    "InvalidClientTokenId", "AuthorizationHeaderMalformed"):
            return FetchError(uri, "credentials", f"the store refused the credentials ({code}): "
                              "check AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY")
        if code in ("AccessDenied", "AllAccessDisabled") or status == 403:
            return FetchError(uri, "denied", f"access denied ({code or status}): the credentials "
                              "may not read this bucket or prefix")
        if code == "NoSuchBucket":
            return FetchError(uri, "not_found", f"no such bucket {self.source.location!r} at {self.endpoint}")
        if code in ("NoSuchKey", "404") or status == 404:
            return FetchError(uri, "not_found", "no such key (deleted while fetching?)")
        if code == "PreconditionFailed" or status == 412:
            return FetchError(uri, "changed", "the object changed while it was fetched; run the "
                              "fetch again")
        return FetchError(uri, "network", f"the store answered {code or status}")


def _shown(url: str | None) -> str:
    """An endpoint URL as messages show it: never a user:password it may carry."""
    if not url:
        return "AWS S3"
    parts = urlsplit(url)
    host = parts.hostname or ""
    return f"{parts.scheme}://{host}" + (f":{parts.port}" if parts.port else "")
