"""PURE: spec.loraAdapters against what each ready engine pod serves → the loads and unloads to
make, each adapter's status and the AdaptersReady condition.

    spec.loraAdapters ─┐
    pod's /v1/models ──┴─▶ plan ─▶ lora_sync (POST load / unload) ─▶ PodOutcome ─▶ adapter_statuses
                                                                                  adapters_condition

The adapters never enter the pod template: a new pod gets the current set from the next sync once
it is ready, and a change to the list is a few HTTP calls, not a rollout.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .crd import LoRAAdapterSpec

# The engine's 400 message → the reason status shows (first match wins; else Refused).
_REASONS = (("cannot fetch the lora adapter", "FetchFailed"), ("exceeds --max-lora-rank", "RankTooLarge"),
            ("another base model", "BaseModelMismatch"), ("not in the base model", "UnsupportedTarget"),
            ("no adapter_config.json", "NotFound"), ("no adapter_model.safetensors", "NotFound"))


@dataclass(frozen=True, slots=True)
class Plan:
    unload: tuple[str, ...]  # names the pod serves that the spec no longer wants (or from another source)
    load: tuple[LoRAAdapterSpec, ...]  # wanted adapters the pod lacks, in spec order


@dataclass(slots=True)
class PodOutcome:
    """One ready engine pod after a sync."""
    pod: str  # the pod's name
    loaded: dict[str, str] = field(default_factory=dict)  # adapter name → its source (/v1/models' root)
    errors: dict[str, str] = field(default_factory=dict)  # adapter name → the engine's refusal
    unreachable: str | None = None  # why the pod could not be asked (its adapters are unknown)


def served(models: Mapping[str, Any]) -> dict[str, str]:
    """name → root of the adapters in a /v1/models answer (the base model has no `parent`)."""
    return {m["id"]: m.get("root") or "" for m in models.get("data") or []
            if isinstance(m, dict) and m.get("parent") is not None and isinstance(m.get("id"), str)}


def plan(wanted: Sequence[LoRAAdapterSpec], loaded: Mapping[str, str], skip: frozenset[str] = frozenset()) -> Plan:
    """What to do on one pod; `skip`: wanted names not to try again yet (refused a moment ago).

    NOTE: an adapter whose source changed under the same name is unloaded, then loaded from the
    new source (the engine refuses a second load of a name)."""
    want = {a.name: a.source for a in wanted}
    unload = tuple(n for n, root in loaded.items() if want.get(n) != root)
    load = tuple(a for a in wanted if (loaded.get(a.name) != a.source) and a.name not in skip)
    return Plan(unload, load)


def reason_of(message: str) -> str:
    return next((reason for text, reason in _REASONS if text in message), "Refused")


def adapter_statuses(wanted: Sequence[LoRAAdapterSpec], pods: Sequence[PodOutcome]) -> list[dict[str, Any]]:
    """status.loraAdapters: per adapter, the ready pods serving it, and why the others do not."""
    out = []
    for a in wanted:
        have = sorted(p.pod for p in pods if p.loaded.get(a.name) == a.source)
        entry: dict[str, Any] = {"name": a.name, "source": a.source, "pods": have,
                                 "ready": bool(pods) and len(have) == len(pods)}
        errors = [(p.pod, p.errors[a.name]) for p in pods if a.name in p.errors]
        unreachable = [p for p in pods if p.unreachable is not None]
        if entry["ready"]:
            entry["reason"] = "Loaded"
        elif errors:
            entry["reason"] = reason_of(errors[0][1])
            entry["message"] = "; ".join(f"{pod}: {message}" for pod, message in errors)
        elif unreachable:
            entry["reason"] = "PodUnreachable"
            entry["message"] = "; ".join(f"{p.pod}: {p.unreachable}" for p in unreachable)
        else:
            entry["reason"] = "Loading"
        out.append(entry)
    return out


def adapters_condition(statuses: Sequence[dict[str, Any]], ready_pods: int, problem: tuple[str, str] | None = None
                       ) -> dict[str, str]:
    """AdaptersReady: True when every adapter is on every ready engine pod. `problem`: (reason,
    message) that kept the operator from asking the pods at all (an unreadable key)."""
    if problem is not None:
        return _cond(False, *problem)
    if not statuses:
        return _cond(True, "NoAdapters", "no adapter in spec.loraAdapters")
    if ready_pods == 0:
        return _cond(False, "AwaitingPods", "no engine pod is ready to load the adapters on")
    failing = [s for s in statuses if not s["ready"]]
    if not failing:
        return _cond(True, "AllAdaptersLoaded", f"{len(statuses)} adapter(s) on {ready_pods} ready engine pod(s)")
    message = "; ".join(f"{s['name']} ({s['reason']})" + (f": {s['message']}" if s.get("message") else "")
                        for s in failing)
    return _cond(False, failing[0]["reason"], message)


def _cond(ok: bool, reason: str, message: str) -> dict[str, str]:
    return {"type": "AdaptersReady", "status": "True" if ok else "False", "reason": reason, "message": message}
