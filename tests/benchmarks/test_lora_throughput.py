"""The multi-LoRA benchmark's pieces: which adapter each request names, the peer's LoRA mode
driven through a stand-in that speaks its JSON (no vLLM here), and the report table."""
from __future__ import annotations

import sys
import textwrap

import pytest

from benchmarks import lora_throughput as lt
from benchmarks.peer import PeerError

FAKE = textwrap.dedent('''
    import json, sys
    spec = json.load(open(sys.argv[1]))
    mode = spec["lora"].get("fake_mode", "ok")
    cases = []
    for c in spec["cases"]:
        # each output token is the adapter's id: the benchmark must keep request order
        ids = [spec["lora"]["adapters"][r["lora"]]["id"] for r in c["requests"]]
        outs = [[i] * r["max_tokens"] for i, r in zip(ids, c["requests"])]
        if mode == "short":
            outs[0] = outs[0][:-1]
        cases.append({"name": c["name"], "outputs": outs, "wall_s": 2.0, "cpu_s": 3.0})
    if mode == "missing":
        cases = cases[:-1]
    json.dump({"system": "fake", "cases": cases, "load_s": 1.0}, open(sys.argv[2], "w"))
''')


def test_uniform_popularity_puts_every_adapter_in_the_batch_and_skewed_favours_the_first():
    assert lt.assign_adapters(10, 4, "uniform", 0) == [2, 0, 1, 3, 2, 0, 1, 3, 2, 0]
    assert lt.assign_adapters(10, 4, "skewed", 0) == [1, 0, 0, 0, 2, 3, 1, 2, 1, 3]
    picks = lt.assign_adapters(640, 8, "skewed", 0)
    counts = [picks.count(i) for i in range(8)]
    assert counts[0] > 2 * counts[7] and sum(counts) == 640
    with pytest.raises(ValueError, match="popularity"):
        lt.assign_adapters(4, 2, "zipf", 0)
    with pytest.raises(ValueError, match="k >= 1"):
        lt.assign_adapters(4, 0, "uniform", 0)


def _spec(mode: str = "ok") -> dict:
    reqs = [{"prompt_ids": [1, 2], "max_tokens": 3, "lora": "r8-00"},
            {"prompt_ids": [3], "max_tokens": 2, "lora": "r8-01"}]
    return {"lora": {"max_loras": 2, "max_cpu_loras": 2, "max_lora_rank": 8, "fake_mode": mode,
                     "adapters": {"r8-00": {"id": 1, "path": "/a"}, "r8-01": {"id": 2, "path": "/b"}}},
            "cases": [{"name": "two", "warmup": [], "requests": reqs},
                      {"name": "one", "warmup": [], "requests": reqs[:1]}]}


def test_the_lora_peer_answers_each_case_in_request_order(tmp_path):
    fake = tmp_path / "fake.py"
    fake.write_text(FAKE)
    got = lt.run_lora_peer([sys.executable, str(fake)], _spec(), {}, 60)
    assert got["two"].outputs == [[1, 1, 1], [2, 2]] and got["one"].outputs == [[1, 1, 1]]
    assert (got["two"].wall_s, got["two"].cpu_s) == (2.0, 3.0)


@pytest.mark.parametrize("mode,message", [("short", "exactly 3"), ("missing", "answered cases")])
def test_a_wrong_lora_peer_answer_is_an_error(tmp_path, mode, message):
    fake = tmp_path / "fake.py"
    fake.write_text(FAKE)
    with pytest.raises(PeerError, match=message):
        lt.run_lora_peer([sys.executable, str(fake)], _spec(mode), {}, 60)


def test_the_table_gives_each_case_against_its_own_systems_base():
    case = lt.Case(8, 16, "uniform")
    results = {"kvmesh": {"base": lt.Timing(10.0, 1, []), case.name: lt.Timing(12.5, 1, [])},
               "vllm": {"base": lt.Timing(10.0, 1, []), case.name: lt.Timing(20.0, 1, [])}}
    lines = lt.table(results, [case], 1000, {case.name: 8})
    assert lines[2] == "| base | 0 | 100.0 | 1.00x | 100.0 | 1.00x |"
    assert lines[3] == "| 8 adapters r16 uniform | 8 | 80.0 | 0.80x | 50.0 | 0.50x |"
