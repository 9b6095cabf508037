"""A move of optimizer state between device and host, as one transaction on every rank.

The measured plan (``memory/placement.py``) decides how many of the first sub-groups stay resident;
this carries the decision out. A ``Move`` is one rank's change of that split (give-back: resident
sub-groups start streaming; take-back: streamed ones become resident), and it goes through these
phases, changed only by ``Move.move``::

    DECIDED ──prepare──▶ PREPARED ──(every rank prepared)──▶ APPLIED ──▶ the plan's bookkeeping
       │                    │
       └──(prepare raised)──┴──(a rank failed)──▶ UNDONE

- **prepare** changes nothing that training reads: speculation discarded (between steps there is
  nothing speculated), every write-back and every earlier switch's copy landed (the drain: a
  take-back's device tensors are read by a give-back only after their copies ran), what was
  loaded early unloaded, device tensors made for the sub-groups that become resident (the device's
  cache emptied first; out of memory here is the expected failure), the host slabs of those that
  stream again locked (``HostStore.repin``: where locking fails the slab stays pageable and
  live, nothing raises), and a checkpoint still reading their memory finished.
- **agree**: ``Moves.carry_out`` runs where every rank runs it (after every applied step and before
  every training forward while a measured plan exists, or where a caller asks on every rank), and
  the ranks agree over a CPU group (``agreement.agree``: one one-element all-reduce that waits for no
  device work) whether any prepare failed, moving or not.
- **apply** (nothing fatal on any rank): those that stream again copied into their host regions,
  DeepSpeed's tensors pointed at the new device tensors (their copies queued beside the next
  backward: ``memory/arrival.py``), then every part that follows the split (the table, the timing,
  the early loads, speculation's members, colocation) and last the plan's bookkeeping
  (``MeasuredPlan.landed``): it counts what has landed, never what was only decided.
- **undo**: what prepare made goes again (the device tensors freed, the slabs it locked unpinned);
  the split is as it was. A rank that ran out of memory undoes its own move alone, logs it and tells
  its plan (``MeasuredPlan.move_failed``: a wider margin, measured again); training goes on on every
  rank and the other ranks' moves land. Any other failure is not one a later step recovers from:
  every rank undoes its move and raises the same ``MoveError``, naming the rank and the cause.

Every move that lands is a line in the log of the rank that moved, and ``step_stats()`` counts the
give-backs, take-backs and failed moves since attach.
"""

import enum
from dataclasses import dataclass, field
from typing import List, Optional

import torch
from deepspeed.utils import log_dist

from ...sizing.host_memory import format_bytes
from .. import agreement
from ..memory.arrival import Switch


class MoveError(RuntimeError):
    """A move of state failed on some rank for another reason than memory; every rank raises it, its
    state as it was before the move."""


class MovePhase(enum.Enum):
    DECIDED = "decided"
    PREPARED = "prepared"
    APPLIED = "applied"
    UNDONE = "undone"


_NEXT = {MovePhase.DECIDED: {MovePhase.PREPARED, MovePhase.UNDONE},
         MovePhase.PREPARED: {MovePhase.APPLIED, MovePhase.UNDONE},
         MovePhase.APPLIED: set(), MovePhase.UNDONE: set()}


@dataclass
class Move:
    """One rank's change of the split: from the first ``old`` sub-groups resident to the first ``new``."""
    old: int
    new: int
    why: str
    to_device: List[int] = field(default_factory=list)  # streamed sub-groups that become resident
    to_host: List[int] = field(default_factory=list)  # resident sub-groups that stream again
    phase: MovePhase = MovePhase.DECIDED
    switch: Optional[Switch] = None  # the device tensors of ``to_device`` (prepare)
    relocked: List[int] = field(default_factory=list)  # sub-groups whose released slabs prepare locked
    nbytes: int = 0  # the state that changes place

    def move(self, phase: MovePhase):
        if phase not in _NEXT[self.phase]:
            raise RuntimeError(f"deepspeed-offload: a move cannot go from {self.phase.value} to {phase.value}")
        self.phase = phase

    @property
    def kind(self) -> str:
        return "take-back" if self.to_device else "give-back"


class Moves:
    """The moves of one stream mode: the one place the split between resident and streamed changes
    after attach. Counts what landed and what failed, for ``step_stats()``."""

    def __init__(self, mode):
        self.mode = mode
        self.give_backs = 0  # moves that landed with sub-groups going back to the host
        self.take_backs = 0  # ... with sub-groups made resident
        self.failed = 0  # moves undone because a rank ran out of memory

    def decide(self, k: int, why: str) -> Optional[Move]:
        mode = self.mode
        old, new = mode.layout, mode.probe.split(k)
        if new.resident == old.resident:
            return None
        to_device = [i for i in new.resident if i in old.order]
        to_host = [i for i in old.resident if i in new.order]
        return Move(len(old.resident), len(new.resident), why, to_device, to_host,
                    nbytes=sum(mode.probe.nbytes(i) for i in to_device + to_host))

    def carry_out(self, k: Optional[int], why: str) -> bool:
        """From the next step on, the first ``k`` sub-groups are resident (None: as they are). Every rank
        calls this at the same point (a collective where there are several). Returns whether this
        rank's split changed."""
        move = self.decide(k, why) if k is not None else None
        problem, out_of_memory = None, False
        if move is not None:
            try:
                self._prepare(move)
            except torch.OutOfMemoryError as e:
                out_of_memory, problem = True, f"out of memory: {agreement.describe(e)}"
            except Exception as e:  # noqa: B902 - agreed below, raised on every rank
                problem = agreement.describe(e)
        failures = agreement.agree(None if problem is None else f"{'OOM ' if out_of_memory else ''}{problem}",
                                   group=agreement.cpu_group())
        fatal = [(r, m) for r, m in failures if not m.startswith("OOM ")]
        if move is not None and (problem is not None or fatal):
            self._undo(move)
        if fatal:
            agreement.raise_agreed(fatal, problem if problem is not None and not out_of_memory else None,
                                   MoveError, "deepspeed-offload: a move of optimizer state failed (every rank "
                                   "kept its state where it was)")
        if out_of_memory:
            self._failed(move, problem)
        if move is None or move.phase is MovePhase.UNDONE:
            return False
        self._apply(move)
        return True

    # ------------------------------------------------------------------ the phases

    def _prepare(self, move: Move):
        mode = self.mode
        mode.discard_speculation("placement changed")
        mode.synchronize_for_checkpoint()  # every write-back landed, every switch's copies too (arrival.wait)
        mode.table.unload_all()
        move.switch = mode.arrival.allocate(move.to_device)  # first: out of memory here changes nothing
        for i in move.to_host:  # an asynchronous checkpoint may still be reading their regions
            mode.guard(i, other=None)
        if move.to_host:  # ... or copying the resident state that leaves the device (its reference holds it)
            mode.guard_resident()
        move.relocked = [i for i in move.to_host if i in mode.store.unpinned]
        mode.store.repin(move.to_host)  # (never raises: a slab it cannot lock stays pageable)
        move.move(MovePhase.PREPARED)

    def _undo(self, move: Move):
        move.switch = None  # the device tensors go back to the allocator (no copy was queued into them)
        if move.relocked:
            self.mode.store.unpin(move.relocked)  # their state is still on the device
        move.move(MovePhase.UNDONE)

    def _apply(self, move: Move):
        mode = self.mode
        for i in move.to_host:
            mode.tensors.move_into(i, lambda key, i=i: mode.store.view(i, key))
        new = mode.probe.split(move.new)
        moved = mode.probe.resident_bytes(move.new) - mode.probe.resident_bytes(move.old)
        mode.layout, mode.order, mode.resident, mode.slot_bytes = new, new.order, new.resident, new.slot_bytes
        mode.arrival.start(move.switch)  # after the bookkeeping (its copies wait for the next backward)
        move.switch = None
        mode.table.set_offloaded(new.order, new.slot_numel)
        mode.tensors.order = new.order
        mode.timing.slot_bytes = new.slot_bytes
        mode.timing.shift(moved)
        # the loads ahead of the step follow the new order; every offloaded sub-group speculates (those given
        # back join again, with the second regions the store kept for them); colocation learns of it
        mode.early.reset()
        if mode.speculation is not None:
            mode.speculation.set_members(new.order)
        mode.colocation.layout_changed()
        mode.arrival.moved()  # (what was made resident keeps its host memory locked while the split settles)
        move.move(MovePhase.APPLIED)
        if mode.plan is not None:
            mode.plan.landed(move.to_device, move.to_host)
        if move.to_device:
            self.take_backs += 1
        if move.to_host:
            self.give_backs += 1
        rank = agreement.rank_world()[0]
        log_dist(f"[deepspeed-offload] rank {rank}: {move.kind} {move.why}: {len(move.to_device or move.to_host)} "
                 f"sub-groups ({format_bytes(move.nbytes)}) {'made resident' if move.to_device else 'back to the host'}, "
                 f"{move.new} resident, {len(new.order)} streamed", ranks=[-1])

    def _failed(self, move: Move, problem: str):
        self.failed += 1
        rank = agreement.rank_world()[0]
        log_dist(f"[deepspeed-offload] rank {rank}: {move.kind} {move.why} undone, the state stays where it "
                 f"was ({move.old} resident): {problem}", ranks=[-1])
        if self.mode.plan is not None:
            self.mode.plan.move_failed(self.mode, move.nbytes)
