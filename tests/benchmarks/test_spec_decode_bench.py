"""benchmarks/spec_decode.py: both parts on a tiny random model, and vLLM's side through a
stand-in peer (vLLM cannot run here in a test's time: the stand-in answers its JSON, echoing
kvmesh-shaped results, so what is sent and how the answer is read are checked)."""
from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import pytest

from benchmarks import peer, spec_decode
from kvmesh.kernels import gemm_rows

STAND_IN = textwrap.dedent('''
    import json, os, sys
    spec = json.load(open(sys.argv[1]))
    sd = spec["spec_decode"]
    json.dump(sd, open(os.environ["STAND_IN_SEEN"], "a")); open(os.environ["STAND_IN_SEEN"], "a").write("\\n")
    if os.environ.get("STAND_IN_MODE") == "malformed":
        json.dump({"system": "x"}, open(sys.argv[2], "w")); sys.exit(0)
    on = sd["speculative_config"] is not None
    lat = [{"tokens": list(range(1 + i % 3 + 2)), "decode_s": 0.02, "drafts": 2 if on else 0,
            "draft_tokens": 4 if on else 0, "accepted": 3 if on else 0,
            "decode_steps": 2 if on else i % 3 + 2}
           for i, r in enumerate(sd["latency"])]
    batches = [{"name": b["name"], "outputs": [[7] * r["max_tokens"] for r in b["requests"]],
                "wall_s": 0.5 if on else 1.0, "drafts": 0, "draft_tokens": 0, "accepted": 0}
               for b in sd["batches"]]
    json.dump({"system": "stand-in", "load_s": 1.0, "latency": lat, "batches": batches,
               "note": "stand-in"}, open(sys.argv[2], "w"))
''')


def _args(tmp_path: Path, *extra: str, isolate: bool = False) -> list[str]:
    # NOTE: in this process unless asked (monkeypatches reach no spawned process, and a spawn
    # imports torch again: seconds a mode)
    return ["--model", "random-tiny", "--cache", str(tmp_path / "models"), "--threads", "1",
            "--max-tokens", "4", "--batch-sizes", "1,3", "--throughput-max-tokens", "3",
            "--num-kv-blocks", "128", "--json", str(tmp_path / "out.json"),
            *(() if isolate else ("--no-isolate",)), *extra]


def test_both_parts_with_a_vllm_stand_in(tmp_path, monkeypatch, capsys):
    script = tmp_path / "stand_in.py"
    script.write_text(STAND_IN)
    seen = tmp_path / "seen.jsonl"
    monkeypatch.setenv("STAND_IN_SEEN", str(seen))
    monkeypatch.setattr(gemm_rows, "MIN_ROWS", 4)
    config = ('{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, '
              '"prompt_lookup_max": 3, "disable_by_batch_size": 2}')
    assert spec_decode.main(_args(tmp_path, "--systems", "kvmesh,vllm", "--speculative-config", config,
                                  "--vllm-command", f"{sys.executable} {script}")) == 0
    sent = [json.loads(line) for line in seen.read_text().splitlines()]
    # one vLLM start per mode, off first; disable_by_batch_size (kvmesh-only) left out
    assert [s["speculative_config"] for s in sent] == [None, {
        "method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}]
    assert [len(s["latency"]) for s in sent] == [8, 8]          # 3 copy, 2 verbatim, 3 free
    assert [(b["name"], len(b["requests"]), b["requests"][0]["max_tokens"])
            for b in sent[1]["batches"]] == [("b1", 1, 3), ("b3", 3, 3)]
    report = json.loads((tmp_path / "out.json").read_text())
    kv, vl = report["systems"]["kvmesh"], report["systems"]["vllm"]
    assert set(kv["latency"]) == set(vl["latency"]) == {"copy", "verbatim", "free"}
    for name in ("copy", "verbatim", "free"):
        off, on = kv["latency"][name]["off"], kv["latency"][name]["spec"]
        # without drafts one token per step; with them, batch 1: one verification per drafted step
        assert off["plain_steps"] == off["decode_steps"] == off["tokens"]
        assert "drafted_steps" not in off and off["tokens_per_step"] == 1.0
        assert on.get("drafted_steps", 0) == on.get("verifications", 0)
        assert on.get("drafted_steps", 0) + on.get("plain_steps", 0) == on["decode_steps"]
        assert on["decode_steps"] <= on["tokens"]
    for name in ("b1", "b3"):
        t = kv["throughput"][name]
        assert t["greedy_identical"] and t["off"]["tokens"] == t["spec"]["tokens"] == 3 * int(name[1:])
    # vLLM's numbers are read as sent: 3 tokens per request, 1.0 s off, 0.5 s on
    assert vl["throughput"]["b3"]["off"]["tok_s"] == 9.0 and vl["throughput"]["b3"]["spec"]["tok_s"] == 18.0
    # acceptance length 1 + accepted / drafts = 2.5, rate accepted / draft tokens = 0.75
    assert vl["latency"]["copy"]["spec"]["acceptance_length"] == 2.5
    assert vl["latency"]["copy"]["spec"]["acceptance_rate"] == 0.75
    assert "acceptance_length" not in vl["latency"]["copy"]["off"]
    # three copy prompts, 2 verifications and 3 accepted tokens each (as the stand-in answers)
    assert (vl["latency"]["copy"]["spec"]["verifications"],
            vl["latency"]["copy"]["spec"]["accepted_tokens"]) == (6, 9)
    # 2 + 3 + 4 decode tokens in 2 steps each with drafts (0.02 s each), one per step without
    assert (vl["latency"]["copy"]["spec"]["tokens_per_step"],
            vl["latency"]["copy"]["off"]["tokens_per_step"]) == (1.5, 1.0)
    assert round(vl["latency"]["copy"]["spec"]["step_ms"], 6) == 10.0
    assert vl["note"] == "stand-in disable_by_batch_size left out (no such key in vLLM)"
    assert kv["note"] == ""
    out = capsys.readouterr().out
    assert "# vllm: disable_by_batch_size left out of vLLM's --speculative-config" in out
    assert "# kvmesh: offline throughput" in out and "# vllm: batch-1 latency" in out
    assert "side by side" in out
    # which GEMM row floor kvmesh ran with (it moves the plain steps against the drafted ones)
    assert report["gemm_min_rows"] == 4
    assert "# kvmesh: oneDNN GEMMs of fewer than 4 rows run as 4 rows (KVMESH_GEMM_MIN_ROWS=4)" in out


def test_one_workload_only(tmp_path, monkeypatch, capsys):
    script = tmp_path / "stand_in.py"
    script.write_text(STAND_IN)
    seen = tmp_path / "seen.jsonl"
    monkeypatch.setenv("STAND_IN_SEEN", str(seen))
    monkeypatch.setattr(gemm_rows, "MIN_ROWS", 1)
    assert spec_decode.main(_args(tmp_path, "--systems", "vllm", "--parts", "latency",
                                  "--workloads", "verbatim",
                                  "--vllm-command", f"{sys.executable} {script}")) == 0
    sent = [json.loads(line) for line in seen.read_text().splitlines()]
    assert [len(s["latency"]) for s in sent] == [2, 2]           # the two verbatim prompts
    report = json.loads((tmp_path / "out.json").read_text())
    assert set(report["systems"]["vllm"]["latency"]) == {"verbatim"}
    assert report["gemm_min_rows"] == 1
    assert "# kvmesh: oneDNN GEMMs" not in capsys.readouterr().out     # no kvmesh in this run


def test_a_malformed_peer_answer_is_an_error(tmp_path, monkeypatch):
    script = tmp_path / "stand_in.py"
    script.write_text(STAND_IN)
    monkeypatch.setenv("STAND_IN_SEEN", str(tmp_path / "seen.jsonl"))
    monkeypatch.setenv("STAND_IN_MODE", "malformed")
    with pytest.raises(peer.PeerError, match="spec_decode result is malformed"):
        spec_decode.main(_args(tmp_path, "--systems", "vllm", "--parts", "latency",
                               "--vllm-command", f"{sys.executable} {script}"))


def test_each_mode_in_a_fresh_process_gives_the_same_counts_in_either_order(tmp_path):
    def counts(*flags: str, isolate: bool) -> dict:
        assert spec_decode.main(_args(tmp_path, "--parts", "latency", "--workloads", "copy",
                                      *flags, isolate=isolate)) == 0
        copy = json.loads((tmp_path / "out.json").read_text())["systems"]["kvmesh"]["latency"]["copy"]
        keep = ("tokens", "decode_steps", "verifications", "accepted_tokens", "drafted_steps",
                "plain_steps")
        return {"identical": copy["greedy_identical"],
                **{mode: {k: copy[mode].get(k) for k in keep} for mode in ("off", "spec")}}
    here = counts(isolate=False)
    assert here["identical"] is True and here["spec"]["verifications"]
    assert counts("--mode-order", "spec,off", isolate=True) == here


@pytest.mark.parametrize(("flags", "message"), [
    (["--mode-order", "spec"], "--mode-order: off,spec or spec,off"),
    (["--batch-sizes", "1,0"], "--batch-sizes: each at least 1"),
    (["--batch-sizes", "x"], "--batch-sizes: a comma list of integers"),
    (["--systems", "sglang"], "--systems: kvmesh, vllm or both"),
    (["--parts", "speed"], "--parts: latency, throughput or both"),
    (["--workloads", "copy,poems"], "--workloads: a comma list of copy, verbatim, free"),
    (["--speculative-config", "{nope"], "--speculative-config: not JSON"),
])
def test_bad_flags_exit_2_naming_the_flag(flags, message, capsys):
    with pytest.raises(SystemExit) as e:
        spec_decode.main(flags)
    assert e.value.code == 2 and message in capsys.readouterr().err
