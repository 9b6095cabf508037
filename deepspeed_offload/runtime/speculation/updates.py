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
  the result is written back while its 16-bit cast stays on the device (2 bytes a parameter), and
  the optimizer's small state (Adam's ``step``) and group entries are put back as they were. The
  result goes where its rollback keeps the state before (``Rollback``): ``SECOND_REGION``, the
  sub-group's second host region (12 bytes a parameter of host memory); ``DEVICE_COPY`` (those the
  host has no second region for), over its current region, the state before copied into device
  buffers first, counted with the early loads like the casts and the shared fp32 gradient buffer
  (``held.py``), so that the iteration's peak does not rise.
  The updates run on a side stream: backward never waits for a load or an update;
- as the step begins, before DeepSpeed's norm (bf16): each cast is **settled** into its 16-bit
  partition, so that the casts' device memory is free for the step's first loads while DeepSpeed
  computes the norm. Nothing reads the partitions between there and DeepSpeed's loop, and each one
  is the cast of its master at every step's end: a discarded update puts back the cast of the state
  before (from its device copy, or from its current host region);
- at the step, once DeepSpeed has the norm: if it did not overflow, the loss scale and the
  hyper-parameters are the ones the update used, and the clip factor is exactly 1, each updated
  sub-group is **committed** in DeepSpeed's loop (a second region becomes current, a device copy is
  dropped; only the 16-bit partition is copied, from the cast, unless it was settled); otherwise
  everything speculated is **discarded** and the step runs as if nothing had happened (a current
  region overwritten gets the device copy back first). Where rollbacks repeat (clipping fires at
  every step), ``Backoff`` spaces the speculating backwards out.

A sub-group's speculation goes ``final -> updated [-> settled] -> committed | discarded``; this class
is the one place that moves it. Every offloaded sub-group is a member; second regions go to the ones
whose gradients are final first, within ``speculate_memory_gb`` per rank (attach). Readers of host
state between backward and the step discard the updates first. DeepSpeed's per-sub-group calls that
a commit replaces are wrapped here and installed by the stream mode's patch registry.
"""

from collections import deque
from typing import Dict, List

import torch

from ..memory.host_store import MASTER
from .compute import update_in_backward
from .held import Coming, HeldBytes, Waiting
from .records import (BACKS_OFF, Backoff, Counters, Rollback, Speculated, group_entries, restore_group, restore_state,
                      same_entries)


class Speculation(HeldBytes):

    def __init__(self, mode, members: List[int]):
        self.mode = mode
        self.opt = mode.opt
        self.base = mode.opt.optimizer
        self.load_order: List[int] = []  # learned: the order they became final
        self.set_members(members)
        self.counters = Counters()
        self.backoff = Backoff()
        self.force_commit = False  # tests only: commit without the norm check (the negative control)
        self.masters_written = False  # since the last applied step (``master_written``)
        self._boundary = False
        self._seen: Dict[int, set] = {}  # this boundary backward: sub-group -> ds_ids of its parameters partitioned
        self._final: Dict[int, None] = {}  # final, not yet updated, in the order they became final
        self._final_order: List[int] = []
        self._ready: deque = deque()  # final and loaded into buffers of their own: to update (``run``)
        self.final_event: Dict[int, object] = {}
        self.updated: Dict[int, Speculated] = Waiting()  # (their device bytes counted: held.py)
        self.coming = Coming()  # members loaded in this backward whose update is to come
        self.committing: Dict[int, object] = {}  # this step: sub-groups whose update it takes -> their cast
        # sub-groups whose update a second reduction in the same backward voided: they wait for the step
        self.reduced_again: set = set()
        # the fp32 gradient every update of a backward builds its sub-group's into (``compute._grad_buffer``)
        self.grad_buffer = None

    def set_members(self, members):
        """The sub-groups that speculate: every offloaded one (at attach, and each time the measured plan
        moves state: those made resident leave, those given back join again, with the second region
        the store kept for them). Between steps, with nothing speculated."""
        self.members = frozenset(members)
        self.group_of = {p.ds_id: i for i, params in enumerate(self.opt.fp16_groups) if i in self.members
                         for p in params}
        self.needed = {i: sum(bool(p.requires_grad) for p in self.opt.fp16_groups[i]) for i in self.members}
        known = [i for i in self.load_order if i in self.members]  # the order learned, then the new ones
        self.load_order = known + sorted(self.members - set(known), reverse=True)
        masters = [self.opt.fp32_partitioned_groups_flat[i] for i in self.members]
        self.grad_numel = max((m.numel() for m in masters), default=0)
        self._grad_bytes = max((m.numel() * m.element_size() for m in masters), default=0)

    def overwrote_host(self) -> bool:
        """Some update waiting for the norm was written over its current host region."""
        return any(s.kept is not None for s in self.updated.values())

    def rollback(self, i: int) -> Rollback:
        """What member ``i``'s update is rolled back from: its second host region if the store has one."""
        return Rollback.SECOND_REGION if i in self.mode.store.twins else Rollback.DEVICE_COPY

    @property
    def from_device(self) -> frozenset:
        """The members whose updates roll back from a device copy."""
        return self.members - self.mode.store.twins

    # ------------------------------------------------------------------ backward

    def backward_begins(self, boundary: bool) -> bool:
        """Returns whether this backward speculates (a boundary one, not backing off)."""
        self._boundary = boundary and bool(self.members)
        self.mode.copies.join_side()  # this backward's reductions rewrite what the last updates read
        if self._boundary:
            self.discard_all("no step")  # an update from a backward whose step never ran is stale
            self._seen, self._final, self._final_order, self.final_event = {}, {}, [], {}
            if self.backoff.skips():
                self.counters.backed_off += 1
                self._boundary = False
        return self._boundary

    def early_order(self, order: List[int]) -> List[int]:
        """The order the early loads of a speculating backward take: the members in the order their
        gradients became final last time, then the rest of ``order`` (the step's)."""
        return self.load_order + [i for i in order if i not in self.members]

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
                    self.discard(i, "gradient changed")  # updated from the gradient before this one
                elif i in self._final:
                    self.final_event[i] = self.mode.copies.mark()  # the update waits for this copy too
                continue
            seen.add(p.ds_id)
            if len(seen) == self.needed[i] and i not in self.reduced_again:
                self._final[i] = None
                self._final_order.append(i)
                self.final_event[i] = self.mode.copies.mark()
                if i in self.coming:
                    self._ready.append(i)

    def run(self):
        """Update every final sub-group whose state is in buffers of its own (those that became both since
        the last call: ``_ready``)."""
        if not self._boundary:
            return
        while self._ready:
            i = self._ready.popleft()
            r = self.mode.table[i]
            if i in self._final and r.on_device and r.slot is None and not r.host_stale:
                del self._final[i]
                self.coming.gone(i)  # (made, or failed: its update is not to come any more)
                update_in_backward(self, i)

    # ------------------------------------------------------------------ the step

    def settle_casts(self) -> int:
        """As DeepSpeed's step begins, before its norm (``StreamMode.step_entered``): every update's 16-bit
        cast into its sub-group's partition, and the cast's block free, for the step's first loads. Not
        with fp16, whose dynamic loss scale skips steps often (each would put the casts back). Returns
        how many it settled."""
        self._boundary = False  # backward is over: nothing more is updated in it (``held_bytes``)
        self.coming.clear()
        todo = {i: s for i, s in self.updated.items() if not s.settled}
        if not todo or self.masters_written or \
                self.opt.fp16_partitioned_groups_flat[next(iter(todo))].dtype == torch.float16:
            return 0
        copies, casts = self.mode.copies, []
        queued = copies.mark()  # (backward's last reads of the partitions, on the compute stream)
        try:
            with copies.side():  # after the updates that made the casts
                copies.compute_waits(queued)
                for i, spec in todo.items():
                    flat = self.opt.fp16_partitioned_groups_flat[i]
                    copies.uses(reads=(spec.lp, ), writes=(flat, ))
                    flat.data.copy_(spec.lp)
                    casts.append(spec.lp)  # (settled from here on: a rollback puts the cast before back)
                    self.updated.shrunk(spec.lp.numel() * spec.lp.element_size())
                    spec.lp = None
                    self.counters.settled += 1
        finally:
            copies.join_side()  # the casts' blocks (and the fp32 gradient buffer) go back in the compute stream's order
        self.grad_buffer = None
        return len(casts)

    def master_written(self):
        """A writer of fp32 masters alone (``safe_set_full_fp32_param``: DeepSpeed's partitions catch up at
        the next applied step) ran: until that step ends, a partition may differ from its master's cast,
        which ``_unsettle`` could not put back, so nothing settles."""
        self.masters_written = True

    def _unsettle(self, i: int, spec: Speculated):
        """Discarded after ``settle_casts``: sub-group ``i``'s 16-bit partition gets the cast of its master before
        the update back (DeepSpeed keeps the partition the cast of the master), from the device copy
        of the state before, or from its current host region (which the update did not write). On the
        current stream, after ``join_side``; only where a step discards its updates."""
        flat = self.opt.fp16_partitioned_groups_flat[i]
        if spec.kept is not None:
            s = self.mode.store.slices[i][MASTER]
            master = spec.kept[s.dtype].narrow(0, s.offset, s.numel)
        else:
            master = self.mode.store.view(i, MASTER).to(flat.device)  # (synchronous: a writer may follow)
        flat.data.copy_(master)
        self.opt._unflatten_partitioned_parameters(i)
        self.counters.unsettled += 1

    def decide(self):
        """At the step's start (DeepSpeed has the norm and did not overflow): commit every update or
        none. Also learns the order gradients became final in, for the next backward's loads."""
        self._boundary = False
        self.coming.clear()  # (backward is over: no update is to come)
        self.mode.copies.join_side()  # the step (and the next backward) after every update
        self.grad_buffer = None  # joined: its block goes back in the compute stream's order
        if self._final_order:
            rest = [i for i in self.load_order if i not in self._final_order]
            self.load_order = self._final_order + rest
        if not self.updated:
            return
        opt = self.opt
        why, scale = None, float(opt.loss_scale)
        if any(s.loss_scale != scale for s in self.updated.values()):
            why = "loss scale"
        elif not all(same_entries(group_entries(self.base.param_groups[opt.sub_group_to_group_id[i]]),
                                   s.group_before) for i, s in self.updated.items()):
            why = "hyper-parameters"
        elif opt.clip_grad > 0 and not self.force_commit:
            clip = (opt._global_grad_norm + 1e-6) / opt.clip_grad  # DeepSpeed's unscale_and_clip_grads
            if not bool(torch.clamp(clip, min=1.0) == 1.0):
                why = "clipped"
        if why is None:
            self.committing = dict.fromkeys(self.updated)
            self.counters.commit_steps += 1
            self.backoff.committed()
        else:
            self.discard_all(why)

    def commit(self, i: int) -> bool:
        """In DeepSpeed's loop, where it would prepare sub-group ``i``: take its update if this step
        commits it. Returns whether it did (then DeepSpeed's calls for ``i`` are skipped)."""
        if i not in self.committing:
            return False
        spec = self.updated.pop(i)
        mode, opt = self.mode, self.opt
        if self.rollback(i) is Rollback.SECOND_REGION:
            mode.store.flip(i)  # the second region, written in backward, is the current one now
        # (else the current region holds the update already, and the device copy of the state before
        # it is dropped with ``spec``, here: a step that raises before it reaches a sub-group still
        # has that sub-group's copy to roll back to; ``decide`` joined the side stream that made it)
        mode.tensors.point_at(i, lambda key: mode.store.view(i, key))
        master = opt.fp32_partitioned_groups_flat[i]
        restore_state(self.base.state[master], spec.state_after)
        restore_group(self.base.param_groups[opt.sub_group_to_group_id[i]], spec.group_after)
        opt.averaged_gradients[i] = None  # as _prepare_fp32_grad_for_sub_group leaves it
        self.committing[i] = spec.lp
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
        comes from the cast computed in backward, not from its master. Copied on the side stream,
        after what the compute stream queued so far (the step's own use of the partition);
        ``step_ends`` makes the compute stream wait for it."""

        def reassign(sub_group_id, *args, **kwargs):
            if sub_group_id not in self.committing:
                return orig(sub_group_id, *args, **kwargs)
            if self.committing[sub_group_id] is None:  # settled: the partition holds the cast already
                self.opt._unflatten_partitioned_parameters(sub_group_id)
                return None
            flat = self.opt.fp16_partitioned_groups_flat[sub_group_id]
            copies = self.mode.copies
            queued = copies.mark()
            with copies.side():
                copies.compute_waits(queued)
                copies.uses(reads=(self.committing[sub_group_id], ), writes=(flat, ))
                flat.data.copy_(self.committing[sub_group_id])
            self.opt._unflatten_partitioned_parameters(sub_group_id)

        return reassign

    def took(self, i: int) -> bool:
        """This step committed sub-group ``i``'s update from backward."""
        return i in self.committing

    def step_ends(self):
        self.mode.copies.join_side()  # the next forward reads the committed 16-bit partitions
        self.committing = {}  # the casts, after the join (``JOINED``)
        self.masters_written = False  # DeepSpeed's loop wrote every partition from its master

    def discard(self, i: int, why: str):
        """Drop sub-group ``i``'s update alone (``why``: counted): its gradient changed after it, the other
        updates stand. Its current region holds the state before (``_roll_back``); the step updates it
        as if it had not speculated, and so will every later step (``reduced_again``). Called where
        DeepSpeed reduces, maybe on its reduction stream: the cast is freed recorded on the side
        stream (``discard_all``)."""
        spec = self.updated.pop(i)
        self._roll_back(i, spec)
        self.mode.copies.free(spec.lp)
        self.reduced_again.add(i)
        self._count_discarded(1, why)

    def _roll_back(self, i: int, spec: Speculated):
        """An update rolled back from the device: the copy of the state before it goes back over the
        current host region, after the update's own write-back (the D2H stream keeps the order); its
        buffers are freed while that copy reads them (the table counts them until it ends)."""
        if spec.kept is None:
            return  # the current region was never written
        mode = self.mode
        mode.guard(i)  # an asynchronous checkpoint may still read the region this writes
        mode.table.restore(i, spec.kept)
        mode.copies.free(*spec.kept.values(), read_by_copies=True)
        self.counters.restored += 1

    def _count_discarded(self, n: int, why: str):
        self.counters.discarded += n
        self.counters.reasons[why] = self.counters.reasons.get(why, 0) + 1
        if self.mode.stats is not None:
            self.mode.stats.discarded += n

    def discard_all(self, why: str):
        """Drop every update not committed (``why``: counted): the current regions hold the state before
        them (``_roll_back``).
        The current stream waits for the side stream (a step that raised may have queued commits' copies
        there). Callers outside the step (a writer of host state, ``offload_states``) may run on another
        stream than the one the casts and the fp32 gradient buffer came from, so they are freed
        recorded on the side stream."""
        self.mode.copies.join_side()
        for i, spec in self.updated.items():
            if spec.settled:
                self._unsettle(i, spec)  # (before the device copy it may read is dropped)
            self._roll_back(i, spec)
        self.mode.copies.free(*[s.lp for s in self.updated.values() if s.lp is not None],
                                 *[lp for lp in self.committing.values() if lp is not None],
                                 *([self.grad_buffer] if self.grad_buffer is not None else []))
        self.grad_buffer = None
        if self.updated:
            self._count_discarded(len(self.updated), why)
            self.counters.rollback_steps += 1
            if why in BACKS_OFF:
                self.backoff.rolled_back()
        self.updated.clear()
        self.committing.clear()
        self.coming.clear()
        self._ready.clear()
        self._final = {}
