"""--watch-secrets: a deleted or changed managed-Redis password Secret rolls the pods at once, with the
resync timer too slow to be the one doing it."""
from __future__ import annotations

from typing import Any

import pytest
from kvmesh.operator.handlers import OperatorConfig

from .conftest import NAMESPACE, StampingEmulator, obj, wait_for
from .test_e2e_kmock import _cr, _create, _post
from .test_e2e_modes import CHECKSUM, _template_annotations

pytestmark = [pytest.mark.kmock(cls=StampingEmulator), pytest.mark.timeout(60)]


@pytest.fixture()
def operator_config() -> OperatorConfig:
    # NOTE: no resync within the test: only the Secret watch can make the operator act
    return OperatorConfig(resync_seconds=600, cleanup_retries=2, cleanup_delay_seconds=0.1, watch_secrets=True)


async def test_the_secret_watch_rolls_the_pods(cluster: Any) -> None:
    server = cluster
    await _create(server, "sw", {"model": {}})
    secret = await wait_for(lambda: obj(server, "v1/secrets", "sw-redis-auth"), what="password Secret")
    first = await wait_for(lambda: _template_annotations(server, "sw-engine").get(CHECKSUM), what="checksum")
    await wait_for(lambda: (_cr(server, "sw").get("status") or {}).get("redisAuthChecksum") == first,
                   what="status checksum")
    # deleted: recreated with a new password, every pod template rolls
    async with server.request("DELETE", f"/api/v1/namespaces/{NAMESPACE}/secrets/sw-redis-auth") as resp:
        assert resp.status == 200
    recreated = await wait_for(lambda: obj(server, "v1/secrets", "sw-redis-auth"), what="Secret recreated")
    assert recreated["stringData"]["password"] != secret["stringData"]["password"]
    second = await wait_for(lambda: (c := _template_annotations(server, "sw-engine").get(CHECKSUM)) != first and c,
                            what="engine rolled")
    for name in ("sw-router", "sw-redis"):
        await wait_for(lambda n=name: _template_annotations(server, n).get(CHECKSUM) == second, what=f"{name} rolled")
    # changed in place (someone rotated it by hand): the pods follow it
    await _post(server, f"/api/v1/namespaces/{NAMESPACE}/secrets/sw-redis-auth",
                {"data": {"password": "cm90YXRlZA=="}}, method="patch",  # "rotated"
                content_type="application/merge-patch+json")
    third = await wait_for(lambda: (c := _template_annotations(server, "sw-engine").get(CHECKSUM)) not in (
        first, second) and c, what="engine rolled again")
    await wait_for(lambda: _cr(server, "sw")["status"]["redisAuthChecksum"] == third, what="status follows")
