"""The seeds' load scenarios (seed 001) as a reusable, seeded request generator.

Seed 001 simulates users: each user sends Poisson(lambda_requests) requests, separated by
Exponential(1 / lambda_frequency) gaps, and each request's length is drawn from weighted length
classes, Poisson(length_lambdas[class]). This module keeps that structure (classes and weights
unchanged) and adds what a benchmark on a small CPU needs:

    length  = Poisson(length_lambdas[class] / scale), clipped to [2, max_total_len]
    prompt  = ceil(length * prompt_fraction)   (at least 1)
    output  = length - prompt                  (at least 1)

`scale` divides the class means (the seeds' 30k-token class cannot run on a 2-core CPU);
`max_total_len` caps a request at the context we can afford; `prompt_fraction` splits the seed's
single "request length" into prompt and output tokens (the seed does not say; 0.5 by default).

No engine import: the HTTP load-scenario benchmark reuses this module as is.
"""
from __future__ import annotations

import math
import weakref
from dataclasses import dataclass
from typing import Protocol, Sequence

import numpy as np

CLASS_NAMES = ("short", "medium", "long", "very_long")


@dataclass(frozen=True, slots=True)
class Scenario:
    name: str
    user_count: int                       # simulated concurrent users
    lambda_requests: float                # mean requests per user (Poisson)
    lambda_frequency: float               # requests per second per user (exponential gaps)
    weights: tuple[float, ...]            # probability of each length class
    length_lambdas: tuple[float, ...]     # mean request length of each class, in tokens (unscaled)


SCENARIOS: dict[str, Scenario] = {
    "low": Scenario("low", 8, 5, 0.05, (0.5, 0.3, 0.15, 0.05), (20, 100, 2000, 15000)),
    "medium": Scenario("medium", 12, 10, 0.2, (0.2, 0.3, 0.35, 0.15), (20, 100, 2000, 20000)),
    "high": Scenario("high", 24, 20, 0.5, (0.1, 0.2, 0.35, 0.35), (100, 1500, 5000, 30000)),
}


@dataclass(frozen=True, slots=True)
class WorkloadRequest:
    arrival_s: float      # seconds since the start of the scenario
    user_id: int          # 1-based, as in the seed
    length_class: int     # index into the scenario's weights / length_lambdas
    prompt_len: int       # exact prompt tokens
    output_len: int       # exact output tokens (benchmarks force it: ignore_eos / min == max)


def get_scenario(name: str) -> Scenario:
    try:
        return SCENARIOS[name]
    except KeyError:
        raise ValueError(f"unknown scenario {name!r}; choose one of {', '.join(SCENARIOS)}") from None


def generate_requests(
    scenario: Scenario | str,
    seed: int = 0,
    scale: float = 1.0,
    max_total_len: int | None = None,
    prompt_fraction: float = 0.5,
) -> list[WorkloadRequest]:
    """All requests of one scenario run, sorted by arrival time (ties by user id)."""
    sc = get_scenario(scenario) if isinstance(scenario, str) else scenario
    if scale <= 0:
        raise ValueError(f"scale must be > 0, got {scale}")
    if not 0.0 < prompt_fraction < 1.0:
        raise ValueError(f"prompt_fraction must be in (0, 1), got {prompt_fraction}")
    if max_total_len is not None and max_total_len < 2:
        raise ValueError(f"max_total_len must be >= 2, got {max_total_len}")
    weights = np.asarray(sc.weights, dtype=np.float64)
    weights = weights / weights.sum()
    means = np.asarray(sc.length_lambdas, dtype=np.float64) / scale
    rng = np.random.default_rng(seed)
    events: list[WorkloadRequest] = []
    for user_id in range(1, sc.user_count + 1):
        count = int(rng.poisson(sc.lambda_requests))
        if count <= 0:
            continue
        classes = rng.choice(len(weights), size=count, p=weights)
        lengths = rng.poisson(means[classes])
        send_times = np.cumsum(rng.exponential(1.0 / sc.lambda_frequency, size=count))
        for t, cls, length in zip(send_times, classes, lengths):
            total = max(int(length), 2)
            if max_total_len is not None:
                total = min(total, max_total_len)
            prompt = min(max(1, math.ceil(total * prompt_fraction)), total - 1)
            events.append(WorkloadRequest(float(t), user_id, int(cls), prompt, total - prompt))
    events.sort(key=lambda r: (r.arrival_s, r.user_id))
    return events


@dataclass(frozen=True, slots=True)
class UniformWorkload:
    """A fixed number of requests with prompt and output lengths drawn uniformly (inclusive)."""

    name: str
    num_requests: int
    prompt_range: tuple[int, int]
    output_range: tuple[int, int]


# NOTE: the two shapes of the vLLM comparison (docs/BENCHMARKS.md): many long prompts with short
# answers, and many medium prompts with long answers.
WORKLOADS: dict[str, UniformWorkload] = {
    "prefill-heavy": UniformWorkload("prefill-heavy", 48, (12, 600), (8, 128)),
    "decode-heavy": UniformWorkload("decode-heavy", 64, (32, 256), (64, 256)),
}


def uniform_requests(workload: UniformWorkload | str, seed: int = 0) -> list[WorkloadRequest]:
    """The workload's requests, all arriving at 0 (an offline batch), lengths seeded."""
    w = WORKLOADS[workload] if isinstance(workload, str) else workload
    (plo, phi), (olo, ohi) = w.prompt_range, w.output_range
    if not (1 <= plo <= phi and 1 <= olo <= ohi and w.num_requests >= 1):
        raise ValueError(f"workload {w.name!r} needs 1 <= lo <= hi lengths and >= 1 request")
    rng = np.random.default_rng(seed)
    prompts = rng.integers(plo, phi + 1, size=w.num_requests)
    outputs = rng.integers(olo, ohi + 1, size=w.num_requests)
    return [WorkloadRequest(0.0, i + 1, 0, int(p), int(o))
            for i, (p, o) in enumerate(zip(prompts, outputs))]


class _Encoder(Protocol):
    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...


# NOTE: real English text (public-domain sentences about the subject at hand), so prompts look
# like what a tokenizer sees in production; the text repeats to any length.
_CORPUS = (
    "A large language model serves many users at once. Each request arrives with a prompt, "
    "which the server turns into tokens, and asks for a number of new tokens in return. "
    "The server keeps the keys and values of every token it has seen in a cache, split into "
    "fixed-size blocks, so that a new token only attends to what is already stored. When many "
    "requests share the same system prompt, their first blocks are identical and can be shared. "
    "The scheduler decides, at every step, which requests run: those already decoding come "
    "first, then new prompts fill what is left of the token budget. If memory runs out, the "
    "request that arrived last is preempted and its blocks are freed or swapped to host memory. "
    "It was the best of times, it was the worst of times, it was the age of wisdom, it was the "
    "age of foolishness, it was the epoch of belief, it was the epoch of incredulity, it was the "
    "season of Light, it was the season of Darkness, it was the spring of hope, it was the winter "
    "of despair. Call me Ishmael. Some years ago, never mind how long precisely, having little or "
    "no money in my purse, and nothing particular to interest me on shore, I thought I would sail "
    "about a little and see the watery part of the world. In the beginning the Universe was "
    "created. This has made a lot of people very angry and been widely regarded as a bad move. "
    "The river flows past the old mill, under the stone bridge and out towards the sea, where "
    "fishing boats wait for the tide to turn before they set out in the grey morning light. "
)
# NOTE: keyed by the tokenizer object itself, weakly: an id() key outlives its tokenizer, and a
# later tokenizer given the same address would read the first one's ids
_corpus_ids: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _encode_corpus(tokenizer: _Encoder) -> list[int]:
    try:
        return _corpus_ids[tokenizer]
    except (KeyError, TypeError):           # TypeError: an object that takes no weak reference
        pass
    try:
        ids = list(tokenizer.encode(_CORPUS, add_special_tokens=False))
    except TypeError:
        ids = list(tokenizer.encode(_CORPUS))
    if len(ids) < 2:
        raise ValueError("the tokenizer turned the corpus into fewer than 2 tokens")
    try:
        _corpus_ids[tokenizer] = ids
    except TypeError:
        pass
    return ids


def make_prompt_ids(tokenizer: _Encoder, prompt_len: int, rng: np.random.Generator) -> list[int]:
    """Exactly `prompt_len` token ids of real text, starting at a random point of the corpus."""
    if prompt_len < 1:
        raise ValueError(f"prompt_len must be >= 1, got {prompt_len}")
    ids = _encode_corpus(tokenizer)
    start = int(rng.integers(len(ids)))
    reps = (start + prompt_len) // len(ids) + 1
    return (ids * reps)[start:start + prompt_len]


def summarize(requests: Sequence[WorkloadRequest], num_classes: int = 4) -> dict:
    """Counts and token totals, for the benchmark's header."""
    return {
        "requests": len(requests),
        "per_class": [sum(r.length_class == c for r in requests) for c in range(num_classes)],
        "prompt_tokens": sum(r.prompt_len for r in requests),
        "output_tokens": sum(r.output_len for r in requests),
        "max_prompt_len": max((r.prompt_len for r in requests), default=0),
        "max_output_len": max((r.output_len for r in requests), default=0),
        "span_s": max((r.arrival_s for r in requests), default=0.0),
    }
