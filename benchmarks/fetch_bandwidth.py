"""Fetch bandwidth: `kvmesh fetch` from an S3 endpoint against a plain parallel copy of the same
objects, in one run, as a ratio (issue 27's target: at least 80 %).

    kvmesh   `kvmesh fetch s3://BUCKET/PREFIX --cache-dir EMPTY --summary-file F` as a process;
             its time is the summary's fetchSeconds (listing, ranged reads, checks, rename), so
             the interpreter's start-up is not counted against it
    copy     boto3's TransferManager (`download_file`: multipart ranged GETs of `chunk` bytes on
             `workers` threads) for every object, the objects themselves on a pool of `workers`
             threads, in a process of its own too: the client, the listing and the downloads are
             timed, boto3's import is not (NOTE: a fresh process on both sides, so each loads
             botocore's S3 model when it makes its client)

Both read the same bytes (the model's files) into an empty directory; repetitions alternate
which goes first. The store is whatever `endpoint` is (cold_start.py runs a moto server on
loopback, which is itself a Python process: the ratio is what matters there, not MB/s).
"""
from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True)
class FetchRun:
    tool: str           # "kvmesh fetch" or "parallel copy"
    bytes: int
    seconds: float

    @property
    def mib_s(self) -> float:
        return self.bytes / 2**20 / max(self.seconds, 1e-9)


def kvmesh_fetch(uri: str, env: dict[str, str], workers: int, chunk: int, timeout_s: float = 1800,
                 ) -> FetchRun:
    """One `kvmesh fetch` process into an empty cache; its own account of bytes and seconds."""
    with tempfile.TemporaryDirectory(prefix="kvmesh-fetch-bw-") as tmp:
        summary = Path(tmp) / "summary.json"
        done = subprocess.run(
            [sys.executable, "-m", "kvmesh.cli", "fetch", uri, "--cache-dir", str(Path(tmp) / "cache"),
             "--workers", str(workers), "--chunk-size", str(chunk), "--summary-file", str(summary)],
            env=env, capture_output=True, text=True, timeout=timeout_s)
        if done.returncode != 0:
            raise RuntimeError(f"kvmesh fetch {uri} failed ({done.returncode}): {done.stderr[-2000:]}")
        s = json.loads(summary.read_text())
        return FetchRun("kvmesh fetch", s["fetchedBytes"], s["fetchSeconds"])


def parallel_copy(bucket: str, prefix: str, keys: list[str], env: dict[str, str], workers: int,
                  chunk: int, timeout_s: float = 1800) -> FetchRun:
    """`keys` (under `prefix`) downloaded with boto3's TransferManager on `workers` threads, by
    this file run as a process."""
    done = subprocess.run([sys.executable, __file__, bucket, prefix, str(workers), str(chunk), *keys],
                          env=env, capture_output=True, text=True, timeout=timeout_s)
    if done.returncode != 0:
        raise RuntimeError(f"parallel copy of s3://{bucket}/{prefix} failed ({done.returncode}): "
                           f"{done.stderr[-2000:]}")
    got = json.loads(done.stdout.strip().splitlines()[-1])
    return FetchRun("parallel copy", got["bytes"], got["seconds"])


def _copy(bucket: str, prefix: str, keys: list[str], env: dict[str, str], workers: int,
          chunk: int) -> FetchRun:
    import boto3
    from boto3.s3.transfer import TransferConfig

    config = TransferConfig(max_concurrency=workers, multipart_chunksize=chunk,
                            multipart_threshold=chunk)
    with tempfile.TemporaryDirectory(prefix="kvmesh-copy-bw-") as tmp:
        t0 = time.monotonic()
        client = boto3.client("s3", endpoint_url=env["AWS_ENDPOINT_URL"], region_name=env["AWS_REGION"],
                              aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
                              aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"])
        listed = client.list_objects_v2(Bucket=bucket, Prefix=prefix + "/")
        sizes = {o["Key"]: o["Size"] for o in listed.get("Contents", [])}

        def one(key: str) -> int:
            dest = Path(tmp) / key
            dest.parent.mkdir(parents=True, exist_ok=True)
            client.download_file(bucket, key, str(dest), Config=config)
            return sizes[key]

        with ThreadPoolExecutor(workers) as pool:
            total = sum(pool.map(one, keys))
        return FetchRun("parallel copy", total, time.monotonic() - t0)


def compare(uri: str, bucket: str, prefix: str, keys: list[str], env: dict[str, str], workers: int,
            chunk: int, repeats: int) -> list[FetchRun]:
    """`repeats` runs of each, alternating which goes first."""
    runs: list[FetchRun] = []
    for i in range(repeats):
        order = ("kvmesh", "copy") if i % 2 == 0 else ("copy", "kvmesh")
        for tool in order:
            if tool == "kvmesh":
                runs.append(kvmesh_fetch(uri, env, workers, chunk))
            else:
                runs.append(parallel_copy(bucket, prefix, keys, env, workers, chunk))
    return runs


def ratio(runs: list[FetchRun]) -> float:
    """kvmesh's median bandwidth over the copy's."""
    def median_mib_s(tool: str) -> float:
        values = sorted(r.mib_s for r in runs if r.tool == tool)
        mid = len(values) // 2
        return values[mid] if len(values) % 2 else (values[mid - 1] + values[mid]) / 2
    return median_mib_s("kvmesh fetch") / median_mib_s("parallel copy")


def table(runs: list[FetchRun]) -> str:
    lines = ["| tool | MiB | seconds | MiB/s |", "|---|---:|---:|---:|"]
    lines += [f"| {r.tool} | {r.bytes / 2**20:.1f} | {r.seconds:.2f} | {r.mib_s:.1f} |" for r in runs]
    lines.append(f"\nkvmesh fetch / parallel copy (median bandwidth): {ratio(runs):.0%} (target: >= 80 %)")
    return "\n".join(lines)


if __name__ == "__main__":          # the copy's own process: BUCKET PREFIX WORKERS CHUNK KEY...
    import os
    if len(sys.argv) < 6:
        print("usage: fetch_bandwidth.py BUCKET PREFIX WORKERS CHUNK KEY... (the copy's own process, "
              "started by benchmarks/cold_start.py; run that one)", file=sys.stderr)
        sys.exit(2)
    bucket_, prefix_, workers_, chunk_, *keys_ = sys.argv[1:]
    run_ = _copy(bucket_, prefix_, keys_, dict(os.environ), int(workers_), int(chunk_))
    print(json.dumps({"bytes": run_.bytes, "seconds": run_.seconds}))
