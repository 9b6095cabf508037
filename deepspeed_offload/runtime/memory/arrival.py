"""Sub-groups the measured plan made resident, while their state travels to the device.

A switch to resident (a take-back, ``runtime/step/moves.py``) moves many sub-groups at once (75 GiB on a 7B, the first time
the plan measures). Copied and unpinned inside the step that decided it, that costs the step seconds
(the copies, then ``cudaHostUnregister`` and ``MADV_DONTNEED`` of every slab). ``Arrival`` takes it out
of the step; a switch goes through these phases::

    IDLE ──start──▶ QUEUED ──launch──▶ COPYING ──landed──▶ UNPINNING ──(every slab unpinned)──▶ IDLE

- ``allocate`` (before the switch moves anything: a failure changes nothing; the device's cache
  emptied first), then ``start``: device tensors for the sub-groups, DeepSpeed's tensors pointed at
  them (between steps);
- ``launch`` (the next backward begins, or anything below comes first): their state copied
  on the H2D stream behind the work the compute stream has queued, beside the backward
  (not behind the step that decided them, where a synchronized iteration would wait for them);
- ``before_step``: DeepSpeed's step is about to read and update that state: the compute stream waits
  for the copies (on the device, the CPU goes on); ``wait``: the CPU is about to read or move state
  (``synchronize_for_checkpoint``): it waits for them;
- ``between_steps``: once the copies landed and the split has held for ``UNPIN_AFTER_STEPS`` applied
  steps (a give-back within them finds its slabs still locked: it needs no locking, which costs a
  give-back of gigabytes most of an iteration), the sub-groups still resident have their host
  regions unpinned (``HostStore.unpin``), for at most ``UNPIN_SHARE`` of the last iteration's time
  per step (one sub-group at least): the store's memory goes back to the host over the next steps;
- ``settle``: all of that now (before something needs the host memory: ``offload_states()``).

A sub-group that goes back to the host before its region was unpinned needs nothing: its slabs are
still locked.
"""

import enum
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import torch
from deepspeed.utils import log_dist

from ...sizing.host_memory import format_bytes

# What unpinning may take of each step, as a share of the last iteration's time.
UNPIN_SHARE = 0.02
# Applied steps the split holds (no move) before the host memory of what it made resident is unpinned:
# the measured plan's window of recent inputs (placement.RECENT_STEPS), in which one may send it back.
UNPIN_AFTER_STEPS = 32


class ArrivalPhase(enum.Enum):
    IDLE = "idle"  # nothing in flight, nothing left to unpin
    QUEUED = "queued"  # device tensors made and pointed at, the copies not launched yet
    COPYING = "copying"  # the state is on its way to the device
    UNPINNING = "unpinning"  # landed; host regions still locked, unpinned between steps


@dataclass
class Switch:
    """The device tensors of one switch, made before anything moved (``Arrival.allocate``)."""
    sub_groups: List[int]
    dst: Dict[Tuple[int, str], torch.Tensor] = field(default_factory=dict)  # (sub-group, key) -> device
    src: Dict[Tuple[int, str], torch.Tensor] = field(default_factory=dict)  # ... -> its host region, flat


class Arrival:

    def __init__(self, mode):
        self.mode = mode
        self.queued: Optional[Switch] = None  # a switch whose copies are not launched yet
        self.event = None  # the H2D stream's event after the last switch's copies (None: landed)
        self.to_unpin: List[int] = []  # sub-groups made resident whose host regions are still locked
        self.copied_bytes = 0  # the last switch's
        self.unpin_s = 0.0  # seconds spent unpinning since the last switch
        self.unpin_steps = 0  # ... over this many steps
        self.unpin_after = UNPIN_AFTER_STEPS
        self.steps_held = 0  # applied steps since the split last changed (``moved``)

    @property
    def phase(self) -> ArrivalPhase:
        if self.queued is not None:
            return ArrivalPhase.QUEUED
        if self.event is not None:
            return ArrivalPhase.COPYING
        return ArrivalPhase.UNPINNING if self.to_unpin else ArrivalPhase.IDLE

    def allocate(self, sub_groups: List[int]) -> "Switch":
        """Device tensors for the state of ``sub_groups``, nothing else changed: a failure (out of
        memory near the limit) leaves every tensor where it was. A move calls it in its prepare, before
        it moves anything, and ``start`` once it has."""
        mode = self.mode
        device = mode.acc.current_device_name()
        switch = Switch(list(sub_groups))
        if switch.sub_groups:
            # The cached blocks the last iteration freed go back first, so that the state gets segments
            # of its own: placed into those blocks, it would split them, and the next iteration, asking
            # for the same blocks, would reserve new segments beside the fragments left.
            mode.memory.empty_cache()
        for i in switch.sub_groups:
            for key, _ in mode.tensors.stored(i):
                host = mode.store.view(i, key)
                switch.src[i, key] = host.view(-1)
                switch.dst[i, key] = torch.empty(host.shape, dtype=host.dtype, device=device)
        mode.copies.written_by_copies(*switch.dst.values())  # (never reused before the copies end)
        return switch

    def start(self, switch: "Switch"):
        """The sub-groups of ``switch`` become resident: DeepSpeed's tensors pointed at its device
        tensors; the copies wait for ``launch``."""
        mode = self.mode
        for i in switch.sub_groups:
            mode.tensors.point_at(i, lambda key, i=i: switch.dst[i, key])
        self.queued = switch if switch.dst else None
        self.copied_bytes = sum(t.numel() * t.element_size() for t in switch.dst.values())
        self.to_unpin += [i for i in switch.sub_groups if i not in self.to_unpin]
        self.unpin_s, self.unpin_steps = 0.0, 0
        self.moved()

    def moved(self):
        """The split changed (a take-back, or a give-back: ``runtime/step/moves.py``): the unpinning waits
        for it to hold again."""
        self.steps_held = 0

    def launch(self):
        """The switch's copies onto the H2D stream, after the compute stream's queued work (the
        allocator may have handed out blocks it still reads)."""
        switch, self.queued = self.queued, None
        if switch is not None:
            dst = {k: t.view(-1) for k, t in switch.dst.items()}
            self.event, _ = self.mode.copies.h2d(dst, switch.src, [self.mode.copies.mark()])

    def before_step(self):
        """DeepSpeed's step begins: the compute stream waits for the switch's copies (a no-op once landed)."""
        self.launch()
        if self.event is not None:
            self.mode.copies.compute_waits(self.event)

    def wait(self):
        """The CPU is about to read or move state: the switch's copies land first."""
        self.launch()
        if self.event is not None:
            self.mode.copies.wait_host(self.event)
            self.event = None

    def between_steps(self, iteration_s: Optional[float]):
        """After an applied step: once the copies landed and the split held for ``unpin_after`` steps,
        unpin for at most ``UNPIN_SHARE`` of ``iteration_s`` (at least one sub-group)."""
        self.steps_held += 1
        if self.queued is not None:
            return  # (no backward since the switch: the next one launches its copies)
        if self.event is not None:
            if not self.mode.copies.done(self.event):
                return  # still copying: the regions are read
            self.event = None
        if self.steps_held >= self.unpin_after:
            self._unpin(UNPIN_SHARE * (iteration_s or 0.0))

    def settle(self):
        """Everything now: the copies landed, every region of a resident sub-group unpinned."""
        self.wait()
        self._unpin(float("inf"))

    def _unpin(self, budget_s: float):
        if not self.to_unpin:
            return
        mode, started = self.mode, time.perf_counter()
        resident = set(mode.resident)
        while self.to_unpin:
            i = self.to_unpin.pop(0)
            if i in resident:  # (one that went back to the host meanwhile keeps its locked regions)
                mode.guard(i, other=None)  # an asynchronous checkpoint may still be reading them
                mode.store.unpin([i])
            if time.perf_counter() - started >= budget_s:
                break
        self.unpin_s += time.perf_counter() - started
        self.unpin_steps += 1
        if not self.to_unpin:
            log_dist(f"[deepspeed-offload] host store: {format_bytes(mode.store.pinned_bytes)} locked, "
                     f"{format_bytes(mode.store.slabs.unpinned_bytes)} given back to the host (its sub-groups are "
                     f"resident; {format_bytes(self.copied_bytes)} copied to the device beside the next "
                     f"backward, the regions unpinned in {self.unpin_s:.2f} s over {self.unpin_steps} steps)",
                     ranks=[0])
