"""Putting a model directory into a bucket, as a user's `aws s3 cp --recursive` would."""
from __future__ import annotations

from pathlib import Path


def upload(client, bucket: str, prefix: str, model_dir: Path, part_bytes: int | None = None) -> dict[str, bytes]:
    """Every file under `model_dir` to s3://bucket/prefix/...; with `part_bytes`, files larger
    than one part go up as multipart uploads of that part size. Returns {key: bytes}."""
    sent = {}
    for f in sorted(p for p in model_dir.rglob("*") if p.is_file()):
        key = f"{prefix}/{f.relative_to(model_dir).as_posix()}"
        data = f.read_bytes()
        if part_bytes and len(data) > part_bytes:
            _multipart(client, bucket, key, data, part_bytes)
        else:
            client.put_object(Bucket=bucket, Key=key, Body=data)
        sent[key] = data
    return sent


def _multipart(client, bucket: str, key: str, data: bytes, part_bytes: int) -> None:
    # NOTE: the low-level calls: boto3's upload_file raises any part size below 5 MiB to 5 MiB
    upload_id = client.create_multipart_upload(Bucket=bucket, Key=key)["UploadId"]
    parts = []
    for n, start in enumerate(range(0, len(data), part_bytes), 1):
        etag = client.upload_part(Bucket=bucket, Key=key, UploadId=upload_id, PartNumber=n,
                                  Body=data[start:start + part_bytes])["ETag"]
        parts.append({"PartNumber": n, "ETag": etag})
    client.complete_multipart_upload(Bucket=bucket, Key=key, UploadId=upload_id,
                                     MultipartUpload={"Parts": parts})
