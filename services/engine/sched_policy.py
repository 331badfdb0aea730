"""Scheduling policies: one ordering key per policy.

The key orders admission (lowest first) and, reversed, picks preemption victims (highest first).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from kvmesh.common.config import DynamicPriorityWeights, EngineConfig
from kvmesh.engine.request import Request

SortKey = Callable[[Request, float], tuple]


def _remaining_work(req: Request) -> int:
    """Predicted tokens still to process: prompt tokens to (re)compute plus outputs to generate."""
    prefill = max(req.num_tokens - req.num_computed_tokens - 1, 0)
    return prefill + max(req.max_tokens - req.num_output_tokens, 0)


@dataclass(frozen=True, slots=True)
class Policy:
    name: str
    key: SortKey
    # NOTE: only the priority policy lets a waiting request evict running ones; for the others
    # preemption happens only when blocks run out, so admission order alone carries the policy.
    preempts_for_waiting: bool = False
    # NOTE: the key depends only on what a request arrives with (priority, arrival time), not on
    # the clock or its progress: a queue sorted once stays sorted until a request joins it.
    static: bool = False


def fcfs() -> Policy:
    return Policy("fcfs", lambda r, now: (r.arrival_time,), static=True)


def priority() -> Policy:
    return Policy("priority", lambda r, now: (r.priority, r.arrival_time),
                  preempts_for_waiting=True, static=True)


def sjf(aging_tokens_per_s: float) -> Policy:
    # NOTE: aging subtracts work per second waited, so a long request's key keeps falling until
    # it is the smallest: long requests are never starved.
    def key(r: Request, now: float) -> tuple:
        waited = max(now - r.arrival_time, 0.0)
        return (_remaining_work(r) - aging_tokens_per_s * waited, r.arrival_time)
    return Policy("sjf", key)


def dynamic(w: DynamicPriorityWeights) -> Policy:
    # The seeds' token-level dynamic priority, as a "lower is first" score: the base priority,
    # minus a bonus for progress (finish what is nearly done), minus a bonus for time waited.
    def key(r: Request, now: float) -> tuple:
        progress = r.num_output_tokens / max(r.max_tokens, 1)
        waited = max(now - r.arrival_time, 0.0)
        return (w.priority * r.priority - w.progress * progress - w.waiting * waited, r.arrival_time)
    return Policy("dynamic", key)


def make_policy(config: EngineConfig) -> Policy:
    name = config.scheduling_policy
    if name == "fcfs":
        return fcfs()
    if name == "priority":
        return priority()
    if name == "sjf":
        return sjf(config.sjf_aging_tokens_per_s)
    if name == "dynamic":
        return dynamic(config.dynamic_weights)
    raise ValueError(f"unknown scheduling policy {name!r}")
