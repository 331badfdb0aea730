"""The P/D benchmark's load: steady decode streams plus bursts of long prompts, and its statistics.

Two kinds of request, both streamed `/v1/completions` with token-id prompts (every prompt is new:
no prefix-cache hit on either system), greedy, `ignore_eos`, and a running token count on every
chunk (`stream_options.continuous_usage_stats`, vLLM's field):

  * streams: `streams` closed loops, each sending a short prompt with a long output and sending
    the next one as soon as it ends, for the whole duration; or, with `stream_rate`, one new
    stream every 1 / stream_rate seconds (open loop: the same arrivals on every system, so two
    systems that both keep up serve the same throughput);
  * bursts: every `burst_every_s` seconds (open loop, the same schedule on every system),
    `burst_size` requests of `burst_prompt_tokens` prompt tokens and `burst_output_tokens`
    output tokens.

At the end of the duration every request still running is closed (the server aborts it), so both
systems are measured over the same window. `drive` runs the load against one URL and returns
one `Record` per request; `summarize` is pure: ITL (the gaps between a stream's chunks, as
`vllm bench serve` counts them), TTFT and output tokens per second within the window.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from benchmarks.load_stats import percentile

# NOTE: token ids drawn from the middle of the vocabulary: clear of the special tokens at its start
_ID_LOW, _ID_HIGH = 1000, 40000


@dataclass(frozen=True, slots=True)
class Load:
    """What both systems are sent: the same streams and the same burst schedule."""

    duration_s: float           # the measured window
    streams: int                # concurrent steady streams (closed loops)
    stream_prompt_tokens: int
    stream_output_tokens: int
    burst_every_s: float        # seconds between bursts (the first one after one period)
    burst_size: int             # requests per burst
    burst_prompt_tokens: int
    burst_output_tokens: int
    seed: int = 0
    stream_rate: float | None = None    # new streams per second (open loop); None: closed loops

    def stream_times(self) -> list[float]:
        """Open loop: when each stream is sent, seconds after the start (from 0, inside the window)."""
        if self.stream_rate is None:
            return []
        n = int(self.duration_s * self.stream_rate - 1e-9) + 1
        return [i / self.stream_rate for i in range(n)]

    def burst_times(self) -> list[float]:
        """When each burst is sent, seconds after the start (only bursts inside the window)."""
        n = int((self.duration_s - 1e-9) // self.burst_every_s)
        return [self.burst_every_s * (i + 1) for i in range(n)]


@dataclass(slots=True)
class Record:
    """One request as the client saw it; times are seconds after the load started."""

    kind: str                   # "stream" | "burst"
    sent_s: float
    ttft_s: float | None = None           # first chunk with text, from sent_s
    chunk_s: list[float] = field(default_factory=list)   # arrival of each chunk with text
    tokens: list[int] = field(default_factory=list)      # output tokens so far at each chunk
    done: bool = False          # finished on its own (not cut at the end of the window)
    error: str | None = None


def prompt_ids(rng: np.random.Generator, n: int) -> list[int]:
    return rng.integers(_ID_LOW, _ID_HIGH, n).tolist()


async def send_one(client, model: str, kind: str, ids: list[int], max_tokens: int, t0: float,
               records: list[Record]) -> None:
    rec = Record(kind, time.perf_counter() - t0)
    records.append(rec)
    try:
        stream = await client.completions.create(
            model=model, prompt=ids, max_tokens=max_tokens, temperature=0.0, stream=True,
            stream_options={"include_usage": True, "continuous_usage_stats": True},
            extra_body={"ignore_eos": True})
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].text:
                now = time.perf_counter() - t0
                if rec.ttft_s is None:
                    rec.ttft_s = now - rec.sent_s
                rec.chunk_s.append(now)
                rec.tokens.append(chunk.usage.completion_tokens if chunk.usage else len(rec.tokens) + 1)
        rec.done = True
    except asyncio.CancelledError:
        raise
    except Exception as e:  # noqa: BLE001 - a failed request is a result, not a crash
        rec.error = f"{type(e).__name__}: {e}"[:300]


async def drive(url: str, model: str, load: Load) -> list[Record]:
    """Run `load` against `url` (an OpenAI-compatible server); the records of every request."""
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=600)
    records: list[Record] = []
    t0 = time.perf_counter()
    end = t0 + load.duration_s

    async def stream_loop(i: int) -> None:
        rng = np.random.default_rng([load.seed, 1, i])
        while time.perf_counter() < end:
            await send_one(client, model, "stream", prompt_ids(rng, load.stream_prompt_tokens),
                       load.stream_output_tokens, t0, records)

    async def scheduled(kind: str, times: list[float], per_time: int, prompt_tokens: int,
                        output_tokens: int, stream: int) -> None:
        rng = np.random.default_rng([load.seed, stream])
        tasks = []
        for at in times:
            await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))
            tasks += [asyncio.ensure_future(send_one(client, model, kind, prompt_ids(rng, prompt_tokens),
                                                 output_tokens, t0, records))
                      for _ in range(per_time)]
        await asyncio.gather(*tasks)

    if load.stream_rate is None:
        work = [asyncio.ensure_future(stream_loop(i)) for i in range(load.streams)]
    else:
        work = [asyncio.ensure_future(scheduled("stream", load.stream_times(), 1,
                                                load.stream_prompt_tokens,
                                                load.stream_output_tokens, 3))]
    work.append(asyncio.ensure_future(scheduled("burst", load.burst_times(), load.burst_size,
                                                load.burst_prompt_tokens,
                                                load.burst_output_tokens, 2)))
    # NOTE: cut at the end of the window: a request still running is closed (the server aborts
    # it), so a slower system is not measured over a longer time than a faster one
    _, pending = await asyncio.wait(work, timeout=max(0.0, end - time.perf_counter()))
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    await client.close()
    return records


# ---- statistics (pure) -------------------------------------------------------------------------
@dataclass(slots=True)
class Summary:
    """One system's numbers over the window (latencies in milliseconds)."""

    itl_ms: tuple[float | None, float | None]           # streams: p50, p99 of the chunk gaps
    stream_ttft_ms: tuple[float | None, float | None]   # p50, p99
    burst_ttft_ms: tuple[float | None, float | None]    # p50, p99
    output_tok_s: float          # output tokens of every request received in the window / window
    stream_requests: int         # started in the window
    burst_requests: int          # sent in the window
    bursts_answered: int         # burst requests that got their first token in the window
    errors: int
    first_error: str | None


def _p(values: Sequence[float]) -> tuple[float | None, float | None]:
    ms = [v * 1e3 for v in values]
    return percentile(ms, 50), percentile(ms, 99)


def summarize(records: Sequence[Record], duration_s: float) -> Summary:
    streams = [r for r in records if r.kind == "stream"]
    bursts = [r for r in records if r.kind == "burst"]
    gaps = [b - a for r in streams for a, b in zip(r.chunk_s, r.chunk_s[1:]) if b <= duration_s]
    tokens = sum(max((n for t, n in zip(r.chunk_s, r.tokens) if t <= duration_s), default=0)
                 for r in records)
    errors = [r.error for r in records if r.error]
    return Summary(
        itl_ms=_p(gaps),
        stream_ttft_ms=_p([r.ttft_s for r in streams if r.ttft_s is not None]),
        burst_ttft_ms=_p([r.ttft_s for r in bursts if r.ttft_s is not None]),
        output_tok_s=tokens / duration_s, stream_requests=len(streams),
        burst_requests=len(bursts), bursts_answered=sum(r.ttft_s is not None for r in bursts),
        errors=len(errors), first_error=errors[0] if errors else None)
