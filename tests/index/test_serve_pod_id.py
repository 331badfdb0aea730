"""The default pod id is unique per serving endpoint (issue 12: engines on one host)."""
from __future__ import annotations

import argparse
import socket

from kvmesh.index.serve import add_args, default_pod_id


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, default=8000)
    add_args(parser)
    return parser.parse_args(list(argv))


def test_two_engines_on_one_host_get_distinct_pod_ids(monkeypatch):
    monkeypatch.delenv("POD_NAME", raising=False)
    a, b = default_pod_id(parse("--port", "8001")), default_pod_id(parse("--port", "8002"))
    host = socket.gethostname()
    assert (a, b) == (f"{host}:8001", f"{host}:8002")


def test_pod_name_and_the_flag_win(monkeypatch):
    monkeypatch.setenv("POD_NAME", "engine-0")
    assert default_pod_id(parse("--port", "8001")) == "engine-0"
    assert default_pod_id(parse("--port", "8001", "--pod-id", "p1")) == "p1"
