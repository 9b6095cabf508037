"""Stream mode: the ZeRO-3 step with optimizer state streamed from the host store.

Read this file top to bottom to see the whole step; ``hooks.py`` says where DeepSpeed calls each
of its verbs, and ``step.py`` owns each optimizer step (DeepSpeed's outcome closes it, and everything
between steps runs from that close). The pieces it drives, each once per phase: ``layout.py`` (what moves),
``host_store.py`` (where it lives between steps), ``residency.py`` (each sub-group's phase, and
what waits on what), ``copies.py`` (the copy executor: streams and events on a GPU, synchronous on
the CPU accelerator), ``load_timing.py`` (when sub-groups may load early), ``speculation.py``
(updates in backward), ``placement.py`` (what stays resident).

``DeepSpeedZeroOptimizer_Stage3.step()`` walks its sub-groups: ``_prepare_sub_group`` (build the
fp32 gradient), unscale/clip, ``_optimizer_step``, copy the fp32 master into the bf16/fp16
partition, ``_release_sub_group``. We wrap the first and the last of these and leave everything in
between to DeepSpeed, so the update is DeepSpeed's own, bit for bit.

One iteration, with ``overlap`` on (the default)::

    backward:   as gradients are reduced (and backward frees activations), offloaded sub-groups load
                into buffers of their own, as far as ``LoadTiming`` allows without raising the
                iteration's peak (``gradients_final``); with speculation, each one whose gradient is
                final is updated there, into its second host region or over its host region with a
                copy of the state before kept on the device (``speculation.py``)
    step:       ``step_entered``: the first sub-groups to stream load into the slots while
                DeepSpeed computes the gradient norm;
                ``bring_in``: speculated updates are committed (or discarded) once DeepSpeed has the
                norm; sub-groups loaded early are updated in place; the others stream through two
                staging slots, packed several to a slot where they are smaller than the largest
                (``ResidencyTable.plan``):
        h2d stream:      load k+1, k+2, ... into their places (each after the write-backs of the
                         sub-groups that were there before it: ``_stage_ahead``)
        compute stream:  wait(load k); prepare, clip, optimizer.step(), copy to bf16, in its place
        d2h stream:      write back k from its place (after the update of k)
                ``send_out``: written back, its place free for the next loads. When DeepSpeed's loop
                is over (``updates_done``, at its ``_post_step``) the CPU waits for every write-back:
                between steps the device holds none of the offloaded state.
    after:      ``step_applied`` and ``between_steps`` (``StepLifecycle.close``, once per step, whatever
                streamed): the statistics, and the measured plan's moves (``_place``).
    forward:    ``forward_begins``: the measured plan may give state back before an input larger than
                it planned for runs (``placement.py``, ``iteration_memory.py``).

With ``overlap`` off, nothing loads in backward except (``prefetch``) the first sub-groups into
the two slots, as many as they take. DeepSpeed's tensor objects never change; only their ``.data``
moves (state_tensors.py).
Nothing in the loop synchronizes the device; a load waits for the sub-group's previous write-back,
and anything on the CPU that reads host state (a checkpoint, ``safe_get_full_*``) waits for every
write-back first (``synchronize_for_checkpoint``). Attach is one transaction (``attach.py``): a
failure while this class is built undoes what it did.
"""

import itertools
import logging
import math
import time
from typing import Dict, List, Optional

from deepspeed.accelerator import get_accelerator
from deepspeed.utils import log_dist, logger

from ..config import OffloadConfig
from ..handle import HANDLE_ATTR
from ..host_memory import format_bytes
from . import hooks
from .attach import Placement, fault_point
from .checkpoint import ALIGN, AsyncCheckpointer
from .colocation import StateOffload
from .copies import make_copies
from .host_store import HostStore
from .layout import Probe, probe_layout
from .iteration_memory import DeviceMemory
from .load_timing import LoadTiming
from .patches import PatchRegistry
from .placement import MeasuredPlan, device_limit, margin_bytes
from .residency import Phase, ResidencyTable
from .speculation import Speculation, choose_members
from .state_tensors import StateTensors
from .step import Step, StepLifecycle
from .step_stats import StepStats


class StreamMode:
    """Attached to one engine: owns the host store, the residency table and the hooks.

    ``placement`` (attach.py's agreed split; None: ``memory_budget_gb``'s, or everything offloaded);
    ``early_in_backward``: sub-groups may load during backward as ``timing`` allows (compile mode:
    False, the reloads its graphs place do that); ``defer_write_back``: a sub-group updated in
    buffers of its own stays there until ``offload_for_forward`` (compile mode's next forward head)."""

    def __init__(self, engine, cfg: OffloadConfig, placement: Optional[Placement] = None, probe: Optional[Probe] = None,
                 early_in_backward: bool = True, defer_write_back: bool = False):
        started = time.perf_counter()
        self.engine, self.opt, self.base, self.cfg = engine, engine.optimizer, engine.optimizer.optimizer, cfg
        self.acc = get_accelerator()
        self.copies = make_copies(self.acc)
        self.probe = probe if probe is not None else probe_layout(self.opt)
        placement = placement if placement is not None else Placement.without_agreement(cfg, self.probe)
        self.layout = self.probe.split(placement.resident)
        self.order, self.resident, self.slot_bytes = self.layout.order, self.layout.resident, self.layout.slot_bytes
        self.defer_write_back = defer_write_back
        self._next_early = 0  # position in self._early_order of the next sub-group to load early
        self._early_order: List[int] = self.order  # members in the order they speculate, then step order
        self._streamed: List[int] = []  # this step's sub-groups that go through the slots, in order
        self._next_staged = 0  # index in self._streamed of the next one to load
        self._update_start, self._in_step = None, False
        self.lifecycle = StepLifecycle(self)  # the one place a step ends (step.py)
        self.released_unused = 0  # sub-groups loaded ahead of a step that did not run, given back
        self.stats: Optional[StepStats] = None
        self.last_stats: Optional[StepStats] = None
        self.patches, self.checkpointer, self.store = PatchRegistry(), None, None
        try:
            self._build(placement, early_in_backward)
        except BaseException:
            self.undo_attach()
            raise
        self.attach_s = time.perf_counter() - started
        n = len(self.opt.fp32_partitioned_groups_flat)
        # INFO, like DeepSpeed's own attach lines: shown once the user sets DeepSpeed's logger to info.
        log_dist(f"[deepspeed-offload] stream mode: {len(self.order)} of {n} sub-groups offloaded "
                 f"({len(self.resident)} resident{', the rest measured after the second step' if self.plan else ''}), "
                 f"{sum(len(self.store.slices[i]) for i in self.order)} tensors, this rank's host store "
                 f"{format_bytes(self.store.nbytes - self.store.twin_nbytes)}"
                 f"{f' and second regions {format_bytes(self.store.twin_nbytes)}' if self.store.twin_nbytes else ''}: "
                 f"{self.store.pinning.describe()}, 2 staging slots of {format_bytes(self.slot_bytes)}, "
                 f"overlap={'on' if self.overlap else 'off'}; attached in {self.attach_s:.1f} s", ranks=[0])
        if self.speculation is not None:
            self.speculation.log_attach()

    def _build(self, placement: Placement, early_in_backward: bool):
        cfg = self.cfg
        members, twins = choose_members(self, early_in_backward, placement.twins_budget)
        self.store = HostStore(self.layout.entries, cfg.pin_memory, twins=twins, check_host=False)
        fault_point("pinning")
        self.table = ResidencyTable(self.store, self.copies, self.order, self.layout.slot_numel)
        self.memory = DeviceMemory(self.acc)
        self.forward_level: Optional[int] = None  # allocated as this step's first forward began
        self.timing = LoadTiming(self.memory, self.copies.synchronous, self.slot_bytes,
                                 early_in_backward=cfg.overlap and early_in_backward, prefetch=cfg.prefetch,
                                 early_cap=None if cfg.overlap_memory_gb is None else int(cfg.overlap_memory_gb * 2**30))
        # The measured plan (budget derived, a device with memory of its own): it needs the measurement.
        self.plan = None
        if placement.host_first and not self.copies.synchronous and early_in_backward:
            self.measure_with(self.memory)
        self.tensors = StateTensors(self.opt, self.store, self.order)
        self.speculation = Speculation(self, members) if members else None
        self.colocation = StateOffload(self)
        self.tensors.all_to_host()  # what exists now: masters; states too if the optimizer stepped
        self.acc.empty_cache()
        fault_point("moving")
        hooks.install(self)
        self._checkpoint_patches = PatchRegistry("deepspeed-offload async checkpoint")  # close() takes them off
        if cfg.async_checkpoint:  # with a buffer for its copies aside where attach's node plan had room
            self.checkpointer = AsyncCheckpointer(self.engine, self.store.buffers.values(), self._checkpoint_patches,
                                                  aside_bytes=placement.aside_budget and self.store.side_bytes(ALIGN))
        fault_point("patching")

    def measure_with(self, memory: DeviceMemory):
        """Place by measurement (``MeasuredPlan``), reading the device's memory through ``memory`` (tests
        on the CPU accelerator give one whose figures they script: the plan and the load policy then
        decide as on a device with memory of its own)."""
        self.memory = self.timing.acc = memory
        self.timing.synchronous = False
        limit = device_limit(memory, self.cfg.max_device_memory_gb)
        self.plan, self.timing.measure_always = MeasuredPlan(limit=limit, margin=margin_bytes(limit)), True

    def undo_attach(self):
        """Attach failed (here, or on another rank once this one was built): every hook off, every
        tensor moved to the host back on the device, on this rank alone (no collective: ``detach``
        waits for checkpoints with the other ranks)."""
        if self.checkpointer is not None:
            self.checkpointer.forget()  # no save ran: nothing to wait for
        if getattr(self, "_checkpoint_patches", None) is not None:
            self._checkpoint_patches.remove_all()
        self.patches.remove_all()
        if self.store is not None and getattr(self, "tensors", None) is not None:
            self.tensors.back_to_device(self.acc.current_device_name())

    @property
    def overlap(self) -> bool:
        return self.timing.early_in_backward

    @property
    def in_step(self) -> bool:
        return self._in_step

    @property
    def steps(self) -> int:
        """Steps DeepSpeed applied since attach (``StepLifecycle``)."""
        return self.lifecycle.applied

    def detach(self):
        """Undo attach: write everything back, point the optimizer's tensors at device copies of
        their state again, and remove every hook (the engine and optimizer methods are DeepSpeed's
        own again). A pending asynchronous checkpoint is waited for first. Call it on every rank;
        not between ``offload_states()`` and ``reload_states()``."""
        self.colocation.refuse_if_offloaded("detach()")
        self.discard_speculation("detach")
        if self.checkpointer is not None:
            self.checkpointer.close()  # waits for the last save (collective), removes its hooks
            self.checkpointer = None
        self.synchronize_for_checkpoint()
        self.table.release_loaded()
        self.tensors.back_to_device(self.acc.current_device_name())
        self.patches.remove_all()
        if getattr(self.engine, HANDLE_ATTR, None) is self:
            delattr(self.engine, HANDLE_ATTR)

    # ------------------------------------------------------------------ forward: the input's size

    def forward_begins(self, numel: int):
        """A training forward begins with an input of ``numel`` elements (``hooks.input_numel``). The
        step's first opens the window of its peak (``DeviceMemory``); where the measured plan expects the
        iteration not to fit beside the resident state, state goes back to the host before it runs."""
        first = self.lifecycle.current is None or not self.lifecycle.current.input_numel
        if self.plan is not None and not self._in_step:
            k = self.plan.before_forward(self, numel)
            if k is not None:
                self._place(k)
                self.memory.empty_cache()  # what went back is the device's again
            if first:
                self.forward_level = self.memory.open_window()
        self.lifecycle.forward_input(numel)

    # ------------------------------------------------------------------ backward: loads ahead of the step

    def backward_begins(self):
        """A backward begins (``engine.backward`` or a plain ``loss.backward()``, once)."""
        self._next_early = 0
        boundary = self.engine.is_gradient_accumulation_boundary()
        if self.speculation is not None and not self._in_step:
            speculates = self.speculation.backward_begins(boundary)
            self._early_order = self.speculation.early_order(self.order) if speculates else self.order
        if self.timing.backward_begins(boundary) and not self._in_step:
            self._prefetch_into_slots(self.timing.prefetch_order(self._stream_order()), early=True)
            # the table allocates both slots at its first load into one: held from here to the step
            self.timing.prefetched(2 * self.slot_bytes if self.table.slots is not None else 0)
        if self.timing.take_divergence():
            self._give_back_early()

    def gradients_final(self, allowance: Optional[float]):
        """In backward, after a gradient hook or the epilogue: load early as ``allowance`` allows,
        then update what speculation found final and loaded."""
        if self._in_step:
            return
        if self.timing.take_divergence():
            self._give_back_early()
            return
        if allowance is not None and self._next_early < len(self._early_order):
            self._load_early(allowance)
        if self.speculation is not None:
            self.speculation.run()

    def _give_back_early(self):
        """This backward differs from the measured one: what the early loads and the updates hold
        goes back (the host copy is the current one), so that the peak holds; the step loads it again."""
        self.discard_speculation("backward changed")
        self.released_unused += len(self.table.release_loaded())
        self._next_early = len(self._early_order)

    def _load_early(self, allowance: float):
        """Load the next offloaded sub-groups, in ``_early_order`` (step order; speculation's members
        first when it speculates), into buffers of their own while the bytes held that way (and by
        speculated updates) stay within ``allowance`` (``LoadTiming.gradient_ready``), and what of it
        outlasts backward within ``LoadTiming.step_allowance``: a sub-group updated in backward gives
        its loaded state back there, keeping only what its update keeps for the step."""
        spec = self.speculation
        held = self.table.held_early() + (spec.held_bytes if spec is not None else 0)
        room, step_room = self.timing.backward_allowance(), self.timing.step_allowance()
        room = allowance if room is None else room
        lasting = None  # what early loads and updates hold into the step: counted once a load fits `room`
        while self._next_early < len(self._early_order):
            i = self._early_order[self._next_early]
            if not self.table[i].on_device:
                extra = spec.extra_bytes(i) if spec is not None else 0  # (its update's)
                needed = self.layout.nbytes[i] + extra
                if held + needed > room:
                    return  # asked again at the next gradient hook, when backward has freed more
                if step_room != math.inf:
                    lasting = self._held_into_step() if lasting is None else lasting
                    lasting += extra if spec is not None and spec.updates_in_backward(i) else needed
                    if lasting > step_room:
                        return
                self._load(i, staged=False, early=True)
                held += needed
            self._next_early += 1

    def _held_into_step(self) -> int:
        """Device memory that what was loaded early and what the updates keep will still hold when the
        step begins: the updates' casts and copies, and the loaded sub-groups no update gives back."""
        spec = self.speculation
        own = [i for i in self.order if self.table[i].on_device and self.table[i].slot is None]
        return (spec.held_bytes if spec is not None else 0) + sum(
            self.table.store_bytes(i) for i in own if spec is None or not spec.updates_in_backward(i))

    def _prefetch_into_slots(self, first: List[int], early: bool):
        """The step's first streamed sub-groups (``first``, in its order) into their places in the
        staging slots, as many as the empty slots take (``prefetch``)."""
        self.table.plan(first)
        for i in first:
            if not self.table[i].on_device:
                if not self.table.can_stage(i):
                    return
                self._load(i, staged=True, early=early)

    def _load(self, i, staged, early):
        if self.stats is None:
            self.stats = StepStats(self.copies)
        nbytes, span = self.table.load(i, staged=staged)
        self.stats.bytes_h2d += nbytes
        if early:
            self.stats.loaded_early += 1
        else:
            self.stats.loaded_in_step += 1
            self.stats.span("h2d_wait", span)  # a synchronous copy in the step: time the step waits

    # ------------------------------------------------------------------ the streamed step

    def step_entered(self):
        """DeepSpeed's ``step()`` begins. Before it asks for the first sub-group it computes the
        gradient norm and waits for it on the CPU; the first sub-groups the step streams load into
        the slots now (as many as they take), beside that work, where ``LoadTiming.step_begins`` allows. With updates from
        backward the stream order depends on the norm (committed, they leave it; discarded, they
        stream): only the sub-groups first in both orders load now. Where backward prefetched into
        the slots already (compile mode may since keep what it put there), they stay as they are."""
        if self.stats is None:
            self.stats = StepStats(self.copies)  # every step has its figures, offloaded sub-groups or not
        if self._in_step or not self.timing.step_begins() or self.table.in_slots():
            return
        updated = self.speculation.updated if self.speculation is not None else {}
        if_committed = self.timing.prefetch_order(self._stream_order(committing=updated))
        if_discarded = self.timing.prefetch_order(self._stream_order(committing=()))
        first = [i for i, j in itertools.takewhile(lambda pair: pair[0] == pair[1], zip(if_committed, if_discarded))]
        self._prefetch_into_slots(first, early=False)
        if self.stats is not None:
            self.stats.loaded_at_entry = len(self.table.in_slots())

    def streams(self, i: int) -> bool:
        """Sub-group ``i``'s state is offloaded: the step brings it in and sends it out."""
        return i in self.table.of

    def bring_in(self, i: int) -> bool:
        """Before DeepSpeed prepares sub-group ``i``: the step begins at the first; its state on the
        device, its tensors on it. False: its update from backward is committed, DeepSpeed skips it."""
        if not self._in_step:
            self._begin_step()
        if self.speculation is not None and self.speculation.commit(i):
            return False
        if i in self.table.places:  # streamed through the slots
            self._stage_ahead()  # normally done already, as the sub-groups before it went out
            if not self.table[i].on_device:
                raise RuntimeError(f"deepspeed-offload: sub-group {i}'s place in a slot is not free")
        before = self.copies.clock()
        self.table.arrive(i)
        self._update_start = self.copies.clock()
        self.stats.span("h2d_wait", (before, self._update_start))
        self.tensors.point_at(i, lambda key: self.table.view(i, key))
        return True

    def send_out(self, i: int):
        """After DeepSpeed released sub-group ``i``: written back (unless its update was committed in
        backward)."""
        if self.speculation is None or not self.speculation.took(i):
            self._updated(i)
            self._stage_ahead()  # its place is free for the next sub-groups once its write-back ran

    def _stream_order(self, committing=None) -> List[int]:
        """The sub-groups the step streams through the slots: all but those in buffers of their own
        and those whose update from backward it commits (``committing``; None: this step's)."""
        if committing is None:
            committing = self.speculation.committing if self.speculation is not None else ()
        return [i for i in self.order
                if not (self.table[i].on_device and self.table[i].slot is None) and i not in committing]

    def _begin_step(self):
        # (A sub-group still UPDATED in buffers of its own, compile mode's kept ones, or any whose
        # offload_launch did not run, is updated again where it is: ``ResidencyTable.arrive``.)
        self._in_step = True  # from here on, a failure is undone by abort_step
        self.timing.step_begins()
        if self.stats is None:
            self.stats = StepStats(self.copies)
        self.stats.offloaded = len(self.order)
        if self.speculation is not None:
            self.speculation.decide()  # DeepSpeed has the norm now: commit the updates from backward, or not
        for i in self.timing.load_at_step_start(lambda i: self.table[i].on_device):
            self._load(i, staged=False, early=False)
        self._streamed = self._stream_order()
        self.table.plan(self._streamed)
        self._next_staged = 0
        self._stage_ahead()  # the slots are free: fill them now

    def _stage_ahead(self):
        """Queue the loads of the streamed sub-groups, in order, from the next one not loaded, for as
        long as each one's place in the slots is free (the sub-groups there before it went out:
        the load waits for their write-backs on the device)."""
        while self._in_step and self._next_staged < len(self._streamed):
            i = self._streamed[self._next_staged]
            if not self.table[i].on_device:
                if not self.table.can_stage(i):
                    return
                self._load(i, staged=True, early=False)
            self._next_staged += 1

    def _updated(self, i):
        """Sub-group ``i`` was updated: written back and its tensors pointed at the host store, or
        (compile mode, buffers of its own) left UPDATED on the device, its tensors on them, for the
        next forward's head or the next step."""
        # State created by this step (lazy optimizer state) goes into the buffers, to leave with the rest.
        self.tensors.move_into(i, lambda key: self.table.view(i, key))
        self.stats.span("update", (self._update_start, self.copies.clock()))
        self.table.mark_updated(i)
        self.stats.sub_groups += 1
        if not (self.defer_write_back and self.table[i].slot is None):
            self._write_back(i, self.stats)

    def _write_back(self, i, stats: Optional[StepStats]):
        self.guard(i)  # an asynchronous checkpoint may still be reading its host region
        nbytes, span = self.table.write_back(i)
        self.tensors.point_at(i, lambda key: self.store.view(i, key))
        if stats is not None:
            stats.bytes_d2h += nbytes
            stats.span("d2h", span)
        return nbytes

    def updates_done(self):
        """DeepSpeed's loop over the sub-groups is over (``_post_step`` begins, which gathers the
        persistent parameters from the 16-bit partitions: the commits' copies land before it)."""
        if self.speculation is not None:
            self.speculation.step_ends()
        self.table.free_slots()  # back to the allocator; record_stream holds the blocks until the copies end
        if not self.defer_write_back:
            self.table.drain()  # the step returns with every write-back landed: nothing held after it
        self._in_step = False

    def step_applied(self, step: Step):
        """DeepSpeed applied the step (``StepLifecycle.close``): its figures become ``step_stats()``."""
        self.timing.step_ends()
        stats = self.stats if self.stats is not None else StepStats(self.copies)
        stats.offloaded = len(self.order)
        stats.resident = len(self.resident)
        stats.step_s, stats.iteration_s, stats.input_numel = step.step_s, step.iteration_s, step.input_numel
        self.last_stats, self.stats = stats, None
        every = self.engine.steps_per_print() if callable(getattr(self.engine, "steps_per_print", None)) else None
        if every and step.index % every == 0 and logger.isEnabledFor(logging.INFO):
            log_dist(stats.line(step.index, self.store.pinned_bytes, self.memory.memory_allocated(),
                                self.memory.memory_reserved()), ranks=[0])

    # ------------------------------------------------------------------ a step that did not run

    def step_skipped(self):
        """A step DeepSpeed skipped (fp16 overflow, a non-finite gradient norm) never asked for what
        backward (or its own entry) loaded: give those buffers back (the host copy is still the current
        one) and drop the stats of what it loaded, so they do not count in the next step."""
        self.timing.step_skipped()
        self.discard_speculation("overflow")
        self._give_back_unused()

    def _give_back_unused(self):
        if self.stats is not None or self.table.slots is not None:
            self.released_unused += len(self.table.release_loaded())
            self.table.free_slots()
            self.table.drain()  # the discarded updates' copies into their second regions, landed
            self.stats = None

    def abort_step(self):
        """A step that raised: point every tensor back at the host store and drop the slots, so the
        next step (or a checkpoint) starts from a consistent place."""
        self.timing.step_skipped()
        self.discard_speculation("step raised")
        if not self._in_step:  # raised before its first sub-group: what was loaded for it goes back
            self._give_back_unused()
            return
        for i in self.table.in_phase(Phase.ON_DEVICE):
            if self.table[i].host_stale:  # kept on the device (compile mode): still its newest copy
                self.table.mark_updated(i)  # so that it is written back with the rest
        self.synchronize_for_checkpoint()
        self.table.release_loaded()
        for i in self.order:
            self.tensors.point_at(i, lambda key: self.store.view(i, key), drop_grad=True)
        self.table.free_slots()
        self._in_step = False
        self.stats = None

    # ------------------------------------------------------------------ between steps

    def between_steps(self, step: Step):
        """After a step DeepSpeed applied (``StepLifecycle.close``): the measured plan may change what
        stays resident (``_place``); copy events that landed are forgotten."""
        if self.plan is not None:
            k = self.plan.between_steps(self, step)
            if k is not None:
                self._place(k)
        self.forward_level = None
        self.table.prune_in_flight()

    def _place(self, k: int):
        """From the next step on, the first ``k`` sub-groups keep their state on the device and the rest
        stream: the one place the split changes after attach (placement.py decides ``k``). Between steps:
        every write-back has landed; sub-groups that stop streaming get device copies of their host
        state and give their host memory back (``HostStore.release``), those that start streaming
        get theirs locked again (``reacquire``) and their state written into it."""
        old, new = self.layout, self.probe.split(k)
        if new.resident == old.resident:
            return
        self.discard_speculation("placement changed")
        self.synchronize_for_checkpoint()
        self.table.release_loaded()
        device = self.acc.current_device_name()
        to_device = [i for i in new.resident if i in old.order]
        to_host = [i for i in old.resident if i in new.order]
        for i in to_device:
            self.tensors.point_at(i, lambda key: self.store.view(i, key).to(device, copy=True))
        for i in to_device + to_host:  # an asynchronous checkpoint may still be reading their regions
            self.guard(i, other=None)
        self.store.release(to_device)
        self.store.reacquire(to_host)
        for i in to_host:
            self.tensors.move_into(i, lambda key: self.store.view(i, key))
        moved = self.probe.resident_bytes(len(new.resident)) - self.probe.resident_bytes(len(old.resident))
        self.layout, self.order, self.resident, self.slot_bytes = new, new.order, new.resident, new.slot_bytes
        self.table.set_offloaded(new.order, new.slot_numel)
        self.tensors.order = new.order
        self._early_order = self.order
        self.timing.slot_bytes = new.slot_bytes
        self.timing.shift(moved)
        if self.speculation is not None:
            self.speculation.set_members(new.order)  # every offloaded sub-group speculates
        self.colocation.layout_changed()

    def offload_for_forward(self, sub_groups=None) -> int:
        """Write back what the last step left updated in buffers of its own (``defer_write_back``;
        compile mode calls this per sub-group at the next forward's head). Returns the bytes."""
        todo = self.table.in_phase(Phase.UPDATED) if sub_groups is None else \
            [i for i in sub_groups if self.table[i].phase is Phase.UPDATED]
        # Counted in the stats of the step that updated them.
        return sum(self._write_back(i, self.last_stats) for i in todo)

    def synchronize_for_checkpoint(self):
        """Before anything on the CPU reads host state: write back what is left on the device and
        block until every write-back has landed."""
        self.offload_for_forward()
        self.table.drain()

    drain = synchronize_for_checkpoint

    def discard_speculation(self, why: str):
        if self.speculation is not None:
            self.speculation.discard_all(why)

    def guard(self, i: Optional[int] = None, other: Optional[bool] = False):
        """Before sub-group ``i``'s host region (``other``: its second one; None: both; ``i`` None: the
        whole store) is overwritten or released: an asynchronous checkpoint reading it finishes first."""
        if self.checkpointer is not None:
            self.checkpointer.guard(None if i is None else self.store.byte_ranges(i, other))

    def host_resident(self) -> bool:
        """True when every offloaded tensor that exists points at its slice of the host store."""
        return self.tensors.host_resident()

    def step_stats(self) -> Optional[Dict[str, float]]:
        """The last step that ran: bytes moved each way, sub-groups loaded early (in backward) and in
        the step, seconds the compute stream waited for loads, updating and writing back; None
        before one. A skipped step leaves the previous step's figures. Reading the timings waits
        for that step's copies (in stream mode they landed before the step returned; compile mode
        defers some write-backs to the next forward)."""
        return None if self.last_stats is None else self.last_stats.resolve()
