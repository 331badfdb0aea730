"""The deletion handler run twice for one deletion (kopf can replay it while the finalizer is still
on the resource): the Redis cleanup and its event happen once."""
from __future__ import annotations

import asyncio
import logging
from types import SimpleNamespace
from typing import Any

import kopf
import pytest

from kvmesh.operator import handlers, redis_cleanup

SPEC = {"model": {}, "redis": {"url": "redis://redis.infra:6379/0"}}


class FakeKube:
    """The one read the deletion handler makes: the live resource, still holding the finalizer."""

    def __init__(self, uid: str) -> None:
        self.uid = uid

    async def get(self, api_version: str, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        assert kind == handlers.KIND
        return {"metadata": {"name": name, "namespace": namespace, "uid": self.uid,
                             "finalizers": [handlers.FINALIZER]}}


def _delete_handler(config: handlers.OperatorConfig):
    registry = handlers.make_registry(config)
    [handler] = [h for h in registry._changing.get_all_handlers() if h.id == "redis-cleanup"]
    return handler.fn


def _run(fn, memo: Any, uid: str, retry: int) -> dict[str, Any]:
    patch = kopf.Patch()
    asyncio.run(fn(name="svc", namespace="team-a", uid=uid, spec=SPEC, body={"metadata": {"uid": uid}},
                   retry=retry, memo=memo, patch=patch, logger=logging.getLogger("test")))
    return patch


@pytest.mark.parametrize("fails", [False, True])
def test_a_replayed_deletion_cleans_and_reports_once(monkeypatch: pytest.MonkeyPatch, fails: bool) -> None:
    cleanups: list[tuple[Any, ...]] = []
    events: list[tuple[str, str]] = []

    def cleanup(*args: Any) -> int:
        cleanups.append(args)
        if fails:
            raise ConnectionError("redis.infra:6379 refused the connection")
        return 4

    monkeypatch.setattr(redis_cleanup, "cleanup", cleanup)
    monkeypatch.setattr(kopf, "event", lambda body, *, type, reason, message: events.append((reason, message)))
    fn = _delete_handler(handlers.OperatorConfig(cleanup_retries=1))
    memo = SimpleNamespace(kube=FakeKube("uid-1"))
    _run(fn, memo, "uid-1", retry=0)
    _run(fn, memo, "uid-1", retry=0)                   # the replay, with kopf's retry count reset
    assert len(cleanups) == 1
    if fails:
        assert events == [("RedisCleanupFailed", "gave up removing keys kvmesh:team-a/svc:* after 1 attempts: "
                                                 "redis.infra:6379 refused the connection")]
    else:
        assert events == [("RedisCleaned", "deleted 4 Redis keys")]
    # a new resource of the same name (another uid) is cleaned on its own deletion
    memo.kube = FakeKube("uid-2")
    _run(fn, memo, "uid-2", retry=0)
    assert len(cleanups) == 2


def test_a_retried_attempt_is_not_a_replay(monkeypatch: pytest.MonkeyPatch) -> None:
    attempts: list[int] = []

    def cleanup(*args: Any) -> int:
        attempts.append(1)
        if len(attempts) == 1:
            raise ConnectionError("timeout")
        return 2

    monkeypatch.setattr(redis_cleanup, "cleanup", cleanup)
    monkeypatch.setattr(kopf, "event", lambda *a, **k: None)
    fn = _delete_handler(handlers.OperatorConfig(cleanup_retries=3))
    memo = SimpleNamespace(kube=FakeKube("uid-3"))
    with pytest.raises(kopf.TemporaryError):
        _run(fn, memo, "uid-3", retry=0)
    _run(fn, memo, "uid-3", retry=1)
    assert len(attempts) == 2
    assert handlers._finalized(memo) == {"uid-3": "cleaned"}
