"""LoRAManager: adapters read in host memory (an LRU of --max-cpu-loras) and the device slots
(--max-loras) the step's adapters are written into.

    ensure(req)        at admission (engine thread): read and check it unless cached
    slots_for(reqs)    per scheduled sequence, its slot (-1: base); writes adapters new to a slot
    set_step(step)     the step's LoRAMapping, read by every site in the forward

Under tensor parallelism every rank holds its slices in the same slots: rank 0 decides, and
the slots it writes (`slot_writes`) travel to the workers with the step (`write_slot`).

NOTE: an adapter a live request uses is never evicted from the host LRU (`in_use`, supplied
by the engine), so a step never reads a file; the LRU may then hold more than --max-cpu-loras
until those requests finish. Slots are reassigned least recently used first, never one the
current step uses (the scheduler admits at most --max-loras distinct adapters per step).
"""
from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING, Callable

import torch
from torch import nn

from kvmesh.engine.lora.adapter import LoRAModel, read_adapter
from kvmesh.engine.lora.config import LoRAConfig
from kvmesh.engine.lora.mapping import LoRAMapping
from kvmesh.engine.lora.request import LoRARequest
from kvmesh.engine.lora.targets import attach_sites

if TYPE_CHECKING:
    from kvmesh.engine.parallel.sharding import ShardRule


class LoRAManager:
    def __init__(self, model: nn.Module, config: LoRAConfig, dtype: torch.dtype,
                 device: torch.device, shard: dict[str, ShardRule] | None = None) -> None:
        self.config = config
        self.dtype = dtype
        self.shard = shard                    # tensor parallelism: this rank's slices
        self.mapping = LoRAMapping()
        self.targets = attach_sites(model, config.max_loras, config.max_lora_rank, dtype, device,
                                    self.mapping)
        self.in_use: Callable[[], set[int]] = set     # ids of adapters live requests run with
        self._cpu: OrderedDict[int, LoRAModel] = OrderedDict()   # LRU: oldest first
        self._slot_of: dict[int, int] = {}
        self._slot_lora: list[int | None] = [None] * config.max_loras
        self._slot_step: list[int] = [-1] * config.max_loras
        self._step = 0
        # tensor parallelism: (slot, adapter) written since the workers were last told
        self.slot_writes: list[tuple[int, LoRARequest]] = []

    # ---- host LRU ----------------------------------------------------------------------------
    def read(self, req: LoRARequest) -> LoRAModel:
        """The adapter read and checked against the base model; changes nothing (any thread)."""
        return read_adapter(req, self.targets, self.config.max_lora_rank, self.dtype, self.shard)

    def add(self, lora: LoRAModel) -> bool:
        """Cache a read adapter (engine thread); False when its id is cached already."""
        if lora.lora_int_id in self._cpu:
            self._cpu.move_to_end(lora.lora_int_id)
            return False
        self._evict(len(self._cpu) + 1 - self.config.max_cpu_loras)
        self._cpu[lora.lora_int_id] = lora
        return True

    def ensure(self, req: LoRARequest) -> None:
        """Make the adapter of an admitted request resident (LoRAAdapterError if it cannot be)."""
        if req.lora_int_id in self._cpu:
            self._cpu.move_to_end(req.lora_int_id)
        else:
            self.add(self.read(req))

    def remove(self, lora_int_id: int) -> bool:
        """Forget an adapter; one that live requests still run with stays until they finish."""
        if lora_int_id not in self._cpu:
            return False
        if lora_int_id not in self.in_use():
            del self._cpu[lora_int_id]
            self._free_slot(lora_int_id)
        return True

    def list_loras(self) -> set[int]:
        return set(self._cpu)

    def _evict(self, count: int) -> None:
        if count <= 0:
            return
        busy = self.in_use()
        for lid in [lid for lid in self._cpu if lid not in busy][:count]:
            del self._cpu[lid]
            self._free_slot(lid)

    # ---- device slots ------------------------------------------------------------------------
    def _free_slot(self, lora_int_id: int) -> None:
        slot = self._slot_of.pop(lora_int_id, None)
        if slot is not None:
            self._slot_lora[slot] = None
            self._slot_step[slot] = -1

    def slots_for(self, loras: list[LoRARequest | None]) -> list[int]:
        """Each scheduled sequence's slot (-1: base model); writes adapters new to a slot."""
        self._step += 1
        out = []
        for req in loras:
            if req is None:
                out.append(-1)
                continue
            slot = self._slot_of.get(req.lora_int_id)
            if slot is None:
                slot = self._assign(req.lora_int_id)
                if self.shard is not None:
                    self.slot_writes.append((slot, req))
            self._slot_step[slot] = self._step
            out.append(slot)
        return out

    def _assign(self, lora_int_id: int) -> int:
        free = [s for s, lid in enumerate(self._slot_lora) if lid is None]
        if free:
            slot = free[0]
        else:
            candidates = [s for s in range(len(self._slot_lora)) if self._slot_step[s] != self._step]
            assert candidates, "more distinct adapters in one step than --max-loras"
            slot = min(candidates, key=self._slot_step.__getitem__)
            del self._slot_of[self._slot_lora[slot]]
        self._write(slot, self._cpu[lora_int_id])   # resident: ensure() at admission
        self._slot_of[lora_int_id] = slot
        self._slot_lora[slot] = lora_int_id
        return slot

    def write_slot(self, slot: int, req: LoRARequest) -> None:
        """A tensor-parallel worker: put `req`'s slice into `slot`, as rank 0 decided."""
        self.ensure(req)
        old = self._slot_lora[slot]
        if old is not None:
            self._slot_of.pop(old, None)
        self._free_slot(req.lora_int_id)
        self._write(slot, self._cpu[req.lora_int_id])
        self._slot_of[req.lora_int_id] = slot
        self._slot_lora[slot] = req.lora_int_id

    def _write(self, slot: int, lora: LoRAModel) -> None:
        per_site: dict[int, dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}
        for module, pair in lora.weights.items():
            site, part = self.targets.parts[module]
            per_site.setdefault(id(site), {})[part] = pair
        for site in self.targets.sites:
            site.set_slot(slot, per_site.get(id(site), {}))

    def set_step(self, seq_slots: list[int] | None, query_lens: list[int],
                 device: torch.device) -> None:
        """The mapping of the step about to run (None: a base-only step, nothing to do)."""
        if seq_slots is None:
            self.mapping.clear()
        else:
            self.mapping.update(seq_slots, query_lens, device)


def lora_manager(loaded, config) -> LoRAManager:
    """The manager of an engine (or tensor-parallel rank) with --enable-lora: sites on
    `loaded.model`, and the rank's slices when the model is sharded (`loaded.plan`)."""
    shard = None
    if loaded.plan is not None:
        from kvmesh.engine.parallel.sharding import shard_rules  # noqa: PLC0415
        shard = shard_rules(loaded.model, loaded.plan)
    return LoRAManager(loaded.model, LoRAConfig(config.max_loras, config.max_lora_rank,
                                                config.max_cpu_loras or config.max_loras),
                       loaded.dtype, loaded.device, shard)
