"""``engine.offload_states()`` / ``engine.reload_states()`` with the block attached (RL colocation).

Trainers that share their GPUs with rollouts (TRL's GRPO in colocate mode, OpenRLHF, verl) free the
trainer's memory between steps with DeepSpeed's own ``engine.offload_states(include, device,
pin_memory, non_blocking)`` and bring it back with ``engine.reload_states(non_blocking)``. The engine
checks its arguments and calls the ZeRO-3 optimizer's methods of the same names; ``StateOffload``
stands in for those two, installed by stream mode with its other hooks.

Who moves what, per ``OffloadStateTypeEnum``:

- ``hp_params`` (fp32 masters) and ``optim_states`` (the optimizer's per-parameter state), ours:
  an offloaded sub-group's are in the host store already and move 0 bytes. What is on the device
  moves: the sub-groups kept resident within ``memory_budget_gb`` go to a host store of their own
  (exact size, pinned when ``pin_memory``; made at the first call, reused after), and compile mode's
  sub-groups kept on the device are written back to the main store and, at reload, loaded again into
  buffers of their own, where the next step expects them. Any optimizer the block accepts works
  (DeepSpeed's own code for these two asserts FusedAdam).
- ``lp_params`` and ``lp_grads`` (the 16-bit partitions and their gradients): ``partitions.py``.
- ``contiguous_grad_buffer`` (the reduce buckets): as DeepSpeed does, its ``reload_states`` makes them
  again.
DeepSpeed's ``offload_states`` is not called at all: it ends with a ``gc.collect()``, a full collection
of the trainer's Python heap (0.3 s in a trainer with 600k objects), which frees nothing of ours (every
device tensor we drop is freed with its last reference). Its ``reload_states`` is, for the kinds
not done here.

A kind is in ``optimizer.offloaded_states`` (DeepSpeed's set) while it is off the device, ours
included (marked as it moves, so a failure half-way leaves it known). While anything is offloaded,
``engine.step()``, ``engine.backward()`` (and the gradient hooks' prologue), ``engine.load_checkpoint()``,
the optimizer's writers of host state and ``detach()`` raise ``StatesOffloaded`` on entry, before
they change anything: call ``reload_states()`` first (stream mode installs those refusals).

Both calls happen on every rank or on none (as attach does, ``agreement.py``), so that a failure on one
rank (its host short of memory for the resident sub-groups' copy, a device allocation at reload) is
raised on every rank within seconds, naming the failing rank and the cause, instead of leaving the
others in their next collective until the timeout. ``offload_states`` makes every host buffer it needs
first (what can fail), then the ranks agree (one one-element all-reduce), then it copies, which cannot
fail; after a failure on any rank every rank drops what it made and raises ``OffloadStatesError``, its
states untouched. ``reload_states`` agrees once at its end (it synchronizes there anyway); after a
failure on any rank every rank offloads again what it brought back, with the ``pin_memory`` it was
offloaded with, and raises: every rank's states are off the device as before, ready for another
``reload_states()``.
"""

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import torch
from deepspeed.runtime.zero.offload_config import OffloadDeviceEnum, OffloadStateTypeEnum

from ...compat import drop_reduce_buffers
from .. import agreement
from ..memory.host_store import MASTER, HostStore
from .partitions import LP, LP_GRADS, Partitions16

OURS = (OffloadStateTypeEnum.hp_params, OffloadStateTypeEnum.optim_states)
BUCKETS = OffloadStateTypeEnum.contiguous_grad_buffer


class StatesOffloaded(RuntimeError):
    """An operation that needs the optimizer's state on the device, called between
    ``offload_states()`` and ``reload_states()``."""


class OffloadStatesError(RuntimeError):
    """``engine.offload_states()`` or ``reload_states()`` failed on some rank: raised on every rank,
    naming the failing rank(s) and the cause; every rank's states are where they were before the call."""


@dataclass
class _Moves:
    """What one ``offload_states()`` moves, with every host buffer it needs made already."""
    wanted: list  # the kinds asked for that are on the device
    ours: list  # of those, hp_params and optim_states
    pin_memory: bool
    store: Optional[HostStore] = None  # the resident sub-groups' host copy (None: nothing resident moves)
    lp: Optional[Tuple] = None  # lp_params: (host flat buffer, trainable partitions, [(frozen, its device, host)])
    grads: Optional[torch.Tensor] = None  # lp_grads: the host flat buffer
    made: list = field(default_factory=list)  # ("store", pin) / ("attr", name): made by this call


class StateOffload:
    """The offload_states/reload_states of one attached engine. ``mode``: its ``StreamMode``."""

    def __init__(self, mode):
        self.mode = mode
        self.opt = mode.opt
        self.resident_stores: Dict[bool, HostStore] = {}  # pin_memory -> the resident sub-groups' host copy
        self.resident_on_host: Dict[OffloadStateTypeEnum, HostStore] = {}  # kind -> the store it is in
        self.kept: List[int] = []  # compile mode's sub-groups that were on the device at offload
        self.copied = None  # event of a non-blocking offload's copies into the resident host store
        self.lp = Partitions16(mode)  # lp_params and lp_grads
        self.pinned: Dict[OffloadStateTypeEnum, bool] = {}  # kind -> the pin_memory it was offloaded with
        self.offload_bytes = 0  # moved by the last offload_states() for hp_params and optim_states
        self.reload_bytes = 0  # ... and by the last reload_states()

    def layout_changed(self):
        """The measured plan changed which sub-groups are resident (between steps, nothing offloaded):
        the host copy of the resident ones is made anew at the next offload_states()."""
        self.resident_stores.clear()

    def refuse_if_offloaded(self, what: str):
        if self.opt.offloaded_states:
            names = ", ".join(sorted(s.value for s in self.opt.offloaded_states))
            raise StatesOffloaded(f"deepspeed-offload: {what} called while engine.offload_states() has moved "
                                  f"{names} off the device; call engine.reload_states() first")

    # ------------------------------------------------------------------ the optimizer's two methods

    def offload_states(self, include=None, device=OffloadDeviceEnum.cpu, pin_memory: bool = True,
                       non_blocking: bool = False):
        """``DeepSpeedZeroOptimizer_Stage3.offload_states``, every kind (see the module's docstring), on
        every rank or on none."""
        moves, error = None, None
        try:
            moves = self._prepare_offload(include, pin_memory)
        except Exception as e:  # noqa: B902 - agreed below, so no rank is left waiting
            error = e
        self._agree("engine.offload_states()", error, "nothing moved, on any rank",
                    undo=lambda: self._forget(moves.made if moves is not None else ()))
        self._offload(moves, non_blocking)

    def reload_states(self, orig, non_blocking: bool = False):
        """``DeepSpeedZeroOptimizer_Stage3.reload_states``, ``orig`` its own version, on every rank or on
        none."""
        before, kept, figures = set(self.opt.offloaded_states), list(self.kept), (self.offload_bytes, self.reload_bytes)
        error = None
        try:
            self._reload(orig, non_blocking)
        except Exception as e:  # noqa: B902 - agreed below, so no rank is left waiting
            error = e

        def undo():
            self._offload_again(before, kept)
            self.offload_bytes, self.reload_bytes = figures

        self._agree("engine.reload_states()", error, "every rank's states are off the device again, as before "
                    "the call", undo=undo)
        if self.mode.plan is not None:  # the rollout's memory is the device's again: the plan may take state back
            self.mode.plan.memory_returned(self.mode)

    def wait_for_copies(self):
        """Before the CPU reads the resident sub-groups' host copy: a non-blocking offload has landed."""
        if self.copied is not None:
            self.mode.copies.wait_host(self.copied)
            self.copied = None

    # ------------------------------------------------------------------ every rank or none

    def _agree(self, what: str, error: Optional[BaseException], outcome: str, undo):
        """The ranks agree whether ``what`` failed on any of them (one one-element all-reduce; the
        messages only after a failure). If one did, every rank runs ``undo`` (no collective) and raises
        ``OffloadStatesError``: its own cause, or the failing ranks' and theirs."""
        own = None if error is None else agreement.describe(error)
        failures = agreement.agree(own)
        if not failures:
            return
        rank, _ = agreement.rank_world()
        undo_error = None
        try:
            undo()
        except Exception as e:  # noqa: B902 - reported with the agreed failure
            undo_error = e
        try:
            agreement.raise_agreed(failures, None if own is None else f"rank {rank}: {own}", OffloadStatesError,
                                   f"[deepspeed-offload] {what} failed ({outcome})")
        except OffloadStatesError as agreed:
            if undo_error is None:
                raise agreed from error
            names = ", ".join(sorted(s.value for s in self.opt.offloaded_states)) or "nothing"
            raise OffloadStatesError(f"{agreed}; undoing it on rank {rank} failed too: "
                                     f"{agreement.describe(undo_error)} "
                                     f"(off the device on this rank now: {names})") from undo_error

    def _forget(self, made):
        """Drop the host buffers an ``offload_states()`` that failed made (on any rank)."""
        for what, key in made:
            if what == "store":
                self.resident_stores.pop(key, None)
            elif hasattr(self.opt, key):
                delattr(self.opt, key)

    def _offload_again(self, before, kept: List[int]):
        """A ``reload_states()`` failed on some rank: what this rank brought back goes off the device
        again (``before``: what was off before the call), each kind with its ``pin_memory`` of then, and
        compile mode's kept sub-groups are those it kept (``kept``)."""
        back = [k for k in OffloadStateTypeEnum if k in before and k not in self.opt.offloaded_states]
        for pin in (True, False):
            kinds = [k for k in back if self.pinned.get(k, True) == pin]
            if kinds:
                self._offload(self._prepare_offload(kinds, pin), non_blocking=False)
        self.kept = sorted(set(self.kept) | set(kept))

    # ------------------------------------------------------------------ offload: what can fail, then the moves

    def _prepare_offload(self, include, pin_memory: bool) -> _Moves:
        """Every check, and every host buffer this offload needs (the resident sub-groups' copy, its host
        memory checked; the 16-bit buffers' pinned copies): what can fail, before anything moves."""
        mode, opt = self.mode, self.opt
        if mode._in_step:
            raise StatesOffloaded("deepspeed-offload: engine.offload_states() called inside a step")
        wanted = [k for k in (list(OffloadStateTypeEnum) if include is None else list(include))
                  if k not in opt.offloaded_states]
        moves = _Moves(wanted=wanted, ours=[k for k in OURS if k in wanted], pin_memory=bool(pin_memory))
        try:
            if moves.ours:  # what the plan made resident gives its host memory back first (arrival.py)
                mode.arrival.settle()
            if moves.ours and self._resident_keys(moves.ours):
                moves.store = self._resident_store(pin_memory, moves.made)
            if LP in wanted:
                moves.lp = self.lp.host(pin_memory, moves.made)
            if LP_GRADS in wanted:
                moves.grads = self.lp.host_buffer("lp_grad_partitions_flat_pin_buffers",
                                                opt.grad_partitions_flat_buffer.data, pin_memory, moves.made)
        except BaseException:
            self._forget(moves.made)
            raise
        return moves

    def _offload(self, moves: _Moves, non_blocking: bool):
        """The moves ``_prepare_offload`` made ready: copies into buffers that exist, and ``.data``
        rebound."""
        mode, opt = self.mode, self.opt
        mode.discard_speculation("offload_states")  # updated from the state that moves now
        opt.empty_partition_cache()  # as DeepSpeed: the gathered parameters are released first
        moved = 0
        if moves.ours:
            store = moves.store
            # Write-backs land: what compile mode left updated on the device goes to the host store
            # (those it keeps there between steps come back at reload_states).
            updated = [i for i in mode.order if mode.table[i].on_device and mode.table[i].host_stale]
            self.kept = sorted(set(self.kept) | {i for i in updated if i in mode.timing.kept})
            mode.synchronize_for_checkpoint()
            mode.table.unload_all()  # loaded ahead of a step: the host copy is the current one
            mode.guard_resident()  # a save still copying resident state holds its device memory until then
            moved += sum(mode.layout.nbytes[i] for i in updated)
            for kind in moves.ours:
                if store is not None:
                    moved += self._move_resident(kind, store, non_blocking)
                    self.resident_on_host[kind] = store
                opt.offloaded_states.add(kind)  # marked as it moves
            if non_blocking and store is not None:
                self.copied = mode.copies.mark()  # CPU readers of the host copy wait for it (wait_for_copies)
        self.offload_bytes = moved
        if moves.lp is not None:
            self.lp.offload_params(moves.lp, moves.pin_memory, non_blocking)
        if moves.grads is not None:
            self.lp.offload_grads(moves.grads, non_blocking)
        if BUCKETS in moves.wanted and drop_reduce_buffers(opt):  # DeepSpeed's reload makes empty ones of their shape
            opt.offloaded_states.add(BUCKETS)
        for kind in moves.wanted:
            if kind in opt.offloaded_states:
                self.pinned[kind] = moves.pin_memory
        mode.acc.empty_cache()  # the rollout in this process or another sees the memory free

    # ------------------------------------------------------------------ reload

    def _reload(self, orig, non_blocking: bool):
        """Each kind back on the device, each one whole or not at all (its device buffers made before
        anything is rebound), marked back as it arrives: a failure half-way leaves known what is still
        off the device."""
        opt = self.opt
        moved = 0
        device = self.mode.acc.current_device_name()
        for kind in OURS:
            if kind not in opt.offloaded_states:
                continue
            store = self.resident_on_host.get(kind)
            if store is not None:
                moved += self._move_resident(kind, None, non_blocking, device=device, store=store)
            self.resident_on_host.pop(kind, None)
            opt.offloaded_states.discard(kind)  # DeepSpeed's reload below must not see ours
        for i in self.kept:
            moved += self.mode.preload(i)  # back into buffers of their own, where the step expects them
        self.kept = []
        self.reload_bytes = moved
        if LP_GRADS in opt.offloaded_states:
            self.lp.reload_grads(non_blocking)
        lp = LP in opt.offloaded_states
        try:
            orig(non_blocking=non_blocking)  # the buckets and the trainable lp_params; synchronizes when non_blocking
        finally:
            if lp and LP not in opt.offloaded_states:  # DeepSpeed brought the flat 16-bit buffer back
                self.lp.reload_rest(non_blocking)

    # ------------------------------------------------------------------ the resident sub-groups

    def _resident_keys(self, kinds) -> bool:
        return any(self._keys(i, kind) for i in self.mode.resident for kind in kinds)

    def _keys(self, i: int, kind) -> List[str]:
        """The keys of resident sub-group ``i``'s tensors of ``kind`` that exist now (the master only
        where it is not the model's own partition, as in the host store's layout)."""
        keys = [key for key, _, _ in self.mode.layout.resident_entries.get(i, ())
                if (key == MASTER) == (kind is OffloadStateTypeEnum.hp_params)]
        return [key for key in keys if self.mode.tensors.get(i, key) is not None]

    def _resident_store(self, pin_memory: bool, made: list) -> HostStore:
        store = self.resident_stores.get(bool(pin_memory))
        if store is None:
            store = HostStore(self.mode.layout.resident_entries, bool(pin_memory), warn_pageable=False,
                              what="engine.offload_states(pin_memory=...)")
            self.resident_stores[bool(pin_memory)] = store
            made.append(("store", bool(pin_memory)))
        return store

    def _move_resident(self, kind, to: Optional[HostStore], non_blocking: bool, device=None,
                       store: Optional[HostStore] = None) -> int:
        """The resident sub-groups' tensors of ``kind`` into host store ``to``, or (``to`` None) from
        ``store`` back onto ``device``, every target made before any tensor is rebound (a failure moves
        none). Returns the bytes."""
        found = [(self.mode.tensors.get(i, key), i, key) for i in self.mode.resident for key in self._keys(i, kind)]
        if to is not None:  # (tensor, source, target)
            moves = [(t, t.data, to.view(i, key)) for t, i, key in found]
        else:
            moves = [(t, store.view(i, key), torch.empty_like(store.view(i, key), device=device))
                     for t, i, key in found]
        moved = 0
        for t, source, target in moves:
            target.copy_(source, non_blocking=non_blocking)
            t.data = target
            moved += target.numel() * target.element_size()
        return moved

