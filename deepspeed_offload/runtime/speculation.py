"""Speculation: update each sub-group as soon as its gradient is final, commit when the norm allows.

DeepSpeed's step waits for the global gradient norm before it updates anything, so with the state on
the host every write-back comes after backward. Yet with a loss scale of 1 (bf16) and a norm under
the clip threshold, DeepSpeed multiplies each gradient by exactly 1.0: an update computed *before*
the norm is known is bitwise the one computed after. So, in the boundary backward:

- a sub-group's gradient partition is **final** once every trainable parameter of it went through
  ``partition_grads`` (its reduce-scatter landed in the partition buffer);
- if its state is on the device by then (the early loads walk the members in the order their
  gradients became final in the last iteration), it is **updated** there: its fp32 gradient built as
  DeepSpeed builds it, times the factor ``unscale_and_clip_grads`` uses when clipping does not
  fire (1 / loss scale), then DeepSpeed's own ``_optimizer_step``;
  the result goes to the sub-group's *second* host region (``HostStore`` twins) and its 16-bit
  cast to a host staging buffer, while the optimizer's small state (Adam's ``step``) and group
  entries are put back as they were;
- at the step, once DeepSpeed has the norm: if it did not overflow, the loss scale and the
  hyper-parameters are the ones the update used, and the clip factor is exactly 1, each updated
  sub-group is **committed** in DeepSpeed's loop (its second region becomes current: nothing is
  copied, the 16-bit partition is copied in from the staging buffer); otherwise everything
  speculated is **discarded** and the step runs as if nothing had happened (the current region was
  never touched).

A sub-group's speculation goes ``final -> updated -> committed | discarded``; this class is the one
place that moves it. The members (sub-groups with a second region) are chosen at attach within
``speculate_memory_gb`` of host memory per rank, the first gradients to be final first (the last
layers). DeepSpeed's per-sub-group calls that a commit replaces (``unscale_and_clip_grads``,
``_optimizer_step``, ``_reassign_or_swap_out_partitioned_parameters``) are wrapped here and
installed by the stream mode's patch registry.
"""

from dataclasses import asdict, dataclass, field
from typing import Dict, List

import torch
from deepspeed.utils import log_dist

from ..host_memory import format_bytes
from .host_store import MASTER, HostStore

LP = "__lp__"  # the 16-bit cast of an updated master, in the staging store


@dataclass
class Speculated:
    """An update computed in backward, waiting for the norm."""
    state_after: Dict[str, object]  # the optimizer's own small state of the master after the update
    group_after: Dict[str, object]  # its param group's entries after the update
    group_before: Dict[str, object]  # ... and before (a change by the step's time voids the update)
    loss_scale: float  # the one the update used
    lp_written: object  # event: the 16-bit cast reached the staging store


@dataclass
class Counters:
    """Since attach: sub-groups updated in backward, committed, discarded; steps that committed or
    rolled back, and why they rolled back."""
    speculated: int = 0
    committed: int = 0
    discarded: int = 0
    commit_steps: int = 0
    rollback_steps: int = 0
    reasons: Dict[str, int] = field(default_factory=dict)

    def as_dict(self):
        return asdict(self)


class Speculation:

    def __init__(self, mode, members: List[int]):
        self.mode = mode
        self.opt = mode.opt
        self.base = mode.opt.optimizer
        self.members = frozenset(members)
        self.group_of = {p.ds_id: i for i, params in enumerate(self.opt.fp16_groups) if i in self.members
                         for p in params}
        self.needed = {i: sum(bool(p.requires_grad) for p in self.opt.fp16_groups[i]) for i in self.members}
        lp = self.opt.fp16_partitioned_groups_flat
        self.staging = HostStore({i: [(LP, lp[i].dtype, lp[i].numel())] for i in self.members},
                                 mode.cfg.pin_memory, warn_pageable=False) if self.members else None
        self.load_order: List[int] = sorted(self.members, reverse=True)  # learned: the order they became final
        self.counters = Counters()
        self.force_commit = False  # tests only: commit without the norm check (the negative control)
        self._boundary = False
        self._seen: Dict[int, set] = {}  # this boundary backward: sub-group -> ds_ids of its parameters partitioned
        self._final: List[int] = []  # final, not yet updated, in the order they became final
        self._final_order: List[int] = []
        self._final_event: Dict[int, object] = {}
        self.updated: Dict[int, Speculated] = {}
        self.committing: set = set()  # this step: sub-groups whose update it takes
        self._guarded = False

    def describe(self) -> str:
        store = self.mode.store
        return (f"{len(self.members)} sub-groups speculate ({format_bytes(store.twin_nbytes)} second host regions, "
                f"{format_bytes(self.staging.nbytes if self.staging else 0)} 16-bit staging)")

    # ------------------------------------------------------------------ backward

    def backward_begins(self, boundary: bool):
        self._boundary = boundary and bool(self.members)
        if self._boundary:
            self.discard_all("no step")  # an update from a backward whose step never ran is stale
            self._seen, self._final, self._final_order, self._final_event = {}, [], [], {}
            self._guarded = False

    def partitioned(self, params):
        """``partition_grads`` moved these parameters' gradients into their partitions (on the
        current stream, DeepSpeed's reduction stream): count them toward their sub-group."""
        if not self._boundary:
            return
        for p in params:
            i = self.group_of.get(p.ds_id)
            if i is None or not p.requires_grad:
                continue
            seen = self._seen.setdefault(i, set())
            if p.ds_id in seen:  # reduced again in this backward (reentrant checkpointing)
                if i in self.updated:
                    self.discard_all("gradient changed")  # updated from the gradient before this one
                elif i in self._final:
                    self._final_event[i] = self.mode.copies.mark()  # the update waits for this copy too
                continue
            seen.add(p.ds_id)
            if len(seen) == self.needed[i]:
                self._final.append(i)
                self._final_order.append(i)
                self._final_event[i] = self.mode.copies.mark()

    def run(self):
        """Update every final sub-group whose state is in buffers of its own."""
        if not self._boundary:
            return
        for i in list(self._final):
            r = self.mode.table[i]
            if r.on_device and r.slot is None and not r.host_stale:
                self._final.remove(i)
                self._update(i)

    def _update(self, i: int):
        mode, opt, table, store = self.mode, self.opt, self.mode.table, self.mode.store
        master = opt.fp32_partitioned_groups_flat[i]
        state = self.base.state.get(master)
        if not state or any(key not in state for key in store.slices[i] if key != MASTER):
            return  # the optimizer creates its state at its first step: nothing to speculate on yet
        if not self._guarded:
            mode._guard()  # an async checkpoint may still read the region this writes
            self._guarded = True
        group = self.base.param_groups[opt.sub_group_to_group_id[i]]
        state_before = _small_state(state, store.slices[i])
        group_before = _group_entries(group)
        try:
            table.arrive(i)
            mode.copies.compute_waits(self._final_event.pop(i, None))
            mode.tensors.point_at(i, lambda key: table.view(i, key))
            master.grad = self._fp32_grad(i)
            # unscale_and_clip_grads's factor when clipping does not fire: 1 / loss scale, bitwise the
            # same whether DeepSpeed computes it as a tensor (clipping on) or a float (off)
            master.grad.mul_(1. / opt.loss_scale)
            opt._optimizer_step(i)
            master.grad = None
            lp_dtype = opt.fp16_partitioned_groups_flat[i].dtype
            lp, _ = mode.copies.alloc({lp_dtype: master.numel()})
            lp[lp_dtype].copy_(master.data)  # the cast DeepSpeed's _reassign_or_swap_out... does
            state_after, group_after = _small_state(state, store.slices[i]), _group_entries(group)
        except BaseException:
            table.release(i)  # its device copy may be half updated: the step loads it again
            raise
        finally:  # whatever happened (an out-of-memory error in backward), the state is as it was
            master.grad = None
            _restore_state(state, state_before)
            _restore_group(group, group_before)
            mode.tensors.point_at(i, lambda key: store.view(i, key))  # the committed state, until a commit
        table.mark_updated(i)
        lp_written, _ = mode.copies.d2h({lp_dtype: self.staging.region(i, lp_dtype)}, lp, waits=(table[i].updated, ))
        nbytes, span = table.write_back(i, other=True)
        if mode.stats is not None:
            mode.stats.bytes_d2h += nbytes
            mode.stats.span("d2h", span)
            mode.stats.speculated += 1
        self.updated[i] = Speculated(state_after, group_after, group_before, float(opt.loss_scale), lp_written)
        self.counters.speculated += 1

    def _fp32_grad(self, i: int) -> torch.Tensor:
        """The sub-group's flat fp32 gradient, built as ``_prepare_fp32_grad_for_sub_group`` builds it
        from the partitions the epilogue will list (zeros for a frozen parameter)."""
        opt = self.opt
        partitions = getattr(opt, "_DeepSpeedZeroOptimizer_Stage3__param_id_to_grad_partition")
        grads = [partitions[p.ds_id] if p.requires_grad else torch.zeros_like(p.ds_tensor)
                 for p in opt.fp16_groups[i]]
        return opt.flatten(grads).to(opt.fp32_partitioned_groups_flat[i].dtype)

    # ------------------------------------------------------------------ the step

    def decide(self):
        """At the step's start (DeepSpeed has the norm and did not overflow): commit every update or
        none. Also learns the order gradients became final in, for the next backward's loads."""
        self._boundary = False
        if self._final_order:
            rest = [i for i in self.load_order if i not in self._final_order]
            self.load_order = self._final_order + rest
        if not self.updated:
            return
        opt = self.opt
        why = None
        if any(s.loss_scale != float(opt.loss_scale) for s in self.updated.values()):
            why = "loss scale"
        elif not all(_same_entries(_group_entries(self.base.param_groups[opt.sub_group_to_group_id[i]]),
                                   s.group_before) for i, s in self.updated.items()):
            why = "hyper-parameters"
        elif opt.clip_grad > 0 and not self.force_commit:
            clip = (opt._global_grad_norm + 1e-6) / opt.clip_grad  # DeepSpeed's unscale_and_clip_grads
            if not bool(torch.clamp(clip, min=1.0) == 1.0):
                why = "clipped"
        if why is None:
            self.committing = set(self.updated)
            self.counters.commit_steps += 1
        else:
            self.discard_all(why)

    def commit(self, i: int) -> bool:
        """In DeepSpeed's loop, where it would prepare sub-group ``i``: take its update if this step
        commits it. Returns whether it did (then DeepSpeed's calls for ``i`` are skipped)."""
        if i not in self.committing:
            return False
        spec = self.updated.pop(i)
        mode, opt = self.mode, self.opt
        mode.store.flip(i)
        mode.tensors.point_at(i, lambda key: mode.store.view(i, key))
        master = opt.fp32_partitioned_groups_flat[i]
        _restore_state(self.base.state[master], spec.state_after)
        _restore_group(self.base.param_groups[opt.sub_group_to_group_id[i]], spec.group_after)
        opt.averaged_gradients[i] = None  # as _prepare_fp32_grad_for_sub_group leaves it
        mode.copies.compute_waits(spec.lp_written)
        self.counters.committed += 1
        if mode.stats is not None:
            mode.stats.committed += 1
        return True

    def skip_committed(self, orig):
        """Wraps a DeepSpeed call per sub-group that a commit replaces."""

        def call(sub_group_id, *args, **kwargs):
            if sub_group_id in self.committing:
                return None
            return orig(sub_group_id, *args, **kwargs)

        return call

    def wrap_reassign(self, orig):
        """``_reassign_or_swap_out_partitioned_parameters``: a committed sub-group's 16-bit partition
        comes from the staging store (the cast computed in backward), not from its master."""

        def reassign(sub_group_id, *args, **kwargs):
            if sub_group_id not in self.committing:
                return orig(sub_group_id, *args, **kwargs)
            flat = self.opt.fp16_partitioned_groups_flat[sub_group_id]
            flat.data.copy_(self.staging.region(sub_group_id, flat.dtype), non_blocking=True)
            self.opt._unflatten_partitioned_parameters(sub_group_id)

        return reassign

    def took(self, i: int) -> bool:
        """This step committed sub-group ``i``'s update from backward."""
        return i in self.committing

    def step_ends(self):
        self.committing = set()

    def discard_all(self, why: str):
        """Drop every update not committed (``why``: counted): the current regions were never written."""
        if self.updated:
            self.counters.discarded += len(self.updated)
            self.counters.rollback_steps += 1
            self.counters.reasons[why] = self.counters.reasons.get(why, 0) + 1
            if self.mode.stats is not None:
                self.mode.stats.discarded += len(self.updated)
        self.updated.clear()
        self.committing.clear()
        self._final = []

    def log_attach(self):
        if self.members:
            log_dist(f"[deepspeed-offload] speculation: {self.describe()}", ranks=[0])


def _small_state(state: dict, stored) -> Dict[str, object]:
    """The optimizer's state entries the host store does not hold (Adam's ``step``), copied."""
    return {k: (v.clone() if torch.is_tensor(v) else v) for k, v in state.items() if k not in stored}


def _restore_state(state: dict, saved: Dict[str, object]):
    for k, v in saved.items():
        if torch.is_tensor(v) and torch.is_tensor(state.get(k)) and state[k].shape == v.shape:
            state[k].copy_(v)  # the optimizer's own tensor object, its value put back
        else:
            state[k] = v.clone() if torch.is_tensor(v) else v


def _group_entries(group: dict) -> Dict[str, object]:
    return {k: (v.clone() if torch.is_tensor(v) else v) for k, v in group.items() if k != "params"}


def _same_entries(a: Dict[str, object], b: Dict[str, object]) -> bool:
    """The same hyper-parameters (a learning rate may be a tensor)."""
    return a.keys() == b.keys() and all(
        torch.equal(a[k], b[k]) if torch.is_tensor(a[k]) and torch.is_tensor(b[k]) else
        (not torch.is_tensor(a[k]) and not torch.is_tensor(b[k]) and a[k] == b[k]) for k in a)


def _restore_group(group: dict, saved: Dict[str, object]):
    for k in [k for k in group if k != "params" and k not in saved]:
        del group[k]
    _restore_state(group, saved)
