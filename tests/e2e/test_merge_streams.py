"""merge_streams (api/serving_common.py): one stream is read directly, several through pumps;
either way the items arrive in order and every stream is closed when the reader stops."""
from __future__ import annotations

import asyncio

import pytest

from kvmesh.api.serving_common import merge_streams


class _Stream:
    """An async iterator of `items` (an exception item is raised) that records aclose()."""

    def __init__(self, items) -> None:
        self.items = list(items)
        self.closed = 0

    def __aiter__(self):
        return self

    async def __anext__(self):
        await asyncio.sleep(0)
        if not self.items:
            raise StopAsyncIteration
        item = self.items.pop(0)
        if isinstance(item, BaseException):
            raise item
        return item

    async def aclose(self) -> None:
        self.closed += 1


async def test_one_stream_is_read_in_order_with_no_pump_task():
    s = _Stream(["a", "b", "c"])
    tasks_before = len(asyncio.all_tasks())
    seen = []
    async for i, item in merge_streams([s]):
        seen.append((i, item, len(asyncio.all_tasks()) - tasks_before))
    assert seen == [(0, "a", 0), (0, "b", 0), (0, "c", 0)] and s.closed == 1


async def test_one_stream_closed_when_the_reader_stops_early_and_its_error_raised():
    s = _Stream(["a", "b", "c"])
    merged = merge_streams([s])
    assert await merged.__anext__() == (0, "a")
    await merged.aclose()
    assert s.closed == 1
    failing = _Stream(["a", ValueError("engine said no")])
    with pytest.raises(ValueError, match="engine said no"):
        async for _ in merge_streams([failing]):
            pass
    assert failing.closed == 1


async def test_several_streams_interleave_and_all_close():
    a, b = _Stream(["a1", "a2"]), _Stream(["b1"])
    seen = [x async for x in merge_streams([a, b])]
    assert sorted(seen) == [(0, "a1"), (0, "a2"), (1, "b1")]
    assert [x for x in seen if x[0] == 0] == [(0, "a1"), (0, "a2")]
    assert (a.closed, b.closed) == (1, 1)
