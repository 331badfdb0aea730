"""`kvmesh fetch --summary-file`: the JSON the fetch-model init container leaves in its termination
message (the operator's status.modelStorage), from a real S3-protocol server (moto.server)."""
from __future__ import annotations

import json
import time
from pathlib import Path

from upload import upload

from kvmesh.cli import main
from kvmesh.common.storage.summary import FetchSummary, model_bytes

MODEL_FILES_SKIPPED = ("README.md", "pytorch_model.bin")


def _model_bytes(tiny_model) -> int:
    return sum(p.stat().st_size for p in tiny_model.iterdir()
               if p.is_file() and p.name not in MODEL_FILES_SKIPPED)


def test_a_fetch_then_a_cache_hit_write_the_size_and_the_time(moto_server, s3_env, bucket, tiny_model,
                                                              tmp_path, capsys):
    upload(moto_server.client(), bucket, "team/tiny", tiny_model)
    uri, out = f"s3://{bucket}/team/tiny", tmp_path / "termination-log"
    size = _model_bytes(tiny_model)

    t0 = time.monotonic()
    assert main(["fetch", uri, "--summary-file", str(out)]) == 0
    wall = time.monotonic() - t0
    path = capsys.readouterr().out.strip()
    first = json.loads(out.read_text())
    assert (first["uri"], first["sizeBytes"], first["fetchedBytes"]) == (uri, size, size)
    assert 0 < first["fetchSeconds"] <= wall
    assert model_bytes(Path(path)) == size

    assert main(["fetch", uri, "--summary-file", str(out)]) == 0      # the node cache has it
    again = FetchSummary.parse(out.read_text())
    assert (again.uri, again.size_bytes, again.fetched_bytes) == (uri, size, 0)


def test_a_failed_fetch_writes_no_summary_and_an_unwritable_one_is_no_failure(
        moto_server, s3_env, bucket, tiny_model, tmp_path, capsys, caplog):
    out = tmp_path / "termination-log"
    assert main(["fetch", f"s3://{bucket}/absent", "--summary-file", str(out)]) == 2
    assert not out.exists()          # the kubelet then shows the log's last lines: the error
    assert "kvmesh fetch: error: s3://" in capsys.readouterr().err

    upload(moto_server.client(), bucket, "tiny", tiny_model)
    assert main(["fetch", f"s3://{bucket}/tiny", "--summary-file", str(tmp_path / "no" / "dir")]) == 0
    assert "cannot write the summary to" in caplog.text


def test_parse_takes_a_summary_and_nothing_else():
    s = FetchSummary("s3://b/m", 1000, 0, 1.23456)
    assert s.to_json() == ('{"uri": "s3://b/m", "sizeBytes": 1000, "fetchedBytes": 0, '
                           '"fetchSeconds": 1.235}')
    assert FetchSummary.parse(s.to_json()) == FetchSummary("s3://b/m", 1000, 0, 1.235)
    for text in (None, "", "kvmesh fetch: error: s3://b/m: no such key", "[1, 2]",
                 '{"uri": "s3://b/m"}', '{"uri": "u", "sizeBytes": "x", "fetchedBytes": 0, '
                 '"fetchSeconds": 1}'):
        assert FetchSummary.parse(text) is None, text
