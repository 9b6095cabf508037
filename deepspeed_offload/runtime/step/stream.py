"""Stream mode: the ZeRO-3 step with optimizer state streamed from the host store.

Read this file top to bottom to see the whole step. ``hooks.py`` says where DeepSpeed calls each
verb; ``lifecycle.py`` owns each optimizer step (DeepSpeed's outcome closes it, and everything
between steps runs from that close); ``setup.py`` builds and takes apart the parts this class drives:
``memory/`` (the layout, the host store, the residency table, the measured plan),
``staging/copies.py`` (streams and events on a GPU, synchronous on the CPU accelerator),
``load_timing.py`` and ``early_loads.py`` (loads in backward), ``speculation/`` (updates in backward).

``DeepSpeedZeroOptimizer_Stage3.step()`` walks its sub-groups: ``_prepare_sub_group`` (build the
fp32 gradient), unscale/clip, ``_optimizer_step``, copy the fp32 master into the bf16/fp16
partition, ``_release_sub_group``. We wrap the first and the last of these and leave everything in
between to DeepSpeed, so the update is DeepSpeed's own, bit for bit. One iteration, ``overlap`` on::

    forward:    ``forward_begins``: the measured plan may give state back before an input larger than
                it planned for runs (``memory/placement.py``; the move: ``moves.py``)
    backward:   offloaded sub-groups load into buffers of their own as far as ``LoadTiming`` allows
                without raising the iteration's peak; with speculation, each one whose gradient is
                final is updated there (``early_loads.py``, ``speculation/``)
    step:       ``step_entered``: the first sub-groups to stream load into the slots while
                DeepSpeed computes the gradient norm;
                ``bring_in``: speculated updates are committed (or discarded) once DeepSpeed has the
                norm; sub-groups loaded early are updated in place; the others stream through two
                staging slots, packed several to a slot where they are smaller than the largest:
        h2d stream:      load k+1, k+2, ... into their places (each after the write-backs of the
                         sub-groups that were there before it: ``_stage_ahead``)
        compute stream:  wait(load k); prepare, clip, optimizer.step(), copy to bf16, in its place
        d2h stream:      write back k from its place (after the update of k)
                ``send_out``: written back, its place free; at ``updates_done`` (DeepSpeed's
                ``_post_step``) the CPU waits for every write-back: between steps the device holds
                none of the offloaded state
    after:      ``step_applied`` and ``between_steps`` (``StepLifecycle.close``, once per step): the
                statistics, the measured plan's moves (``moves.py``, ``arrival.py``)

With ``overlap`` off, nothing loads in backward except (``prefetch``) the first sub-groups into the
slots. DeepSpeed's tensor objects never change; only their ``.data`` moves. Nothing in the loop
synchronizes the device; a load waits for the sub-group's previous write-back, and anything on the
CPU that reads host state (a checkpoint, ``safe_get_full_*``) waits for every write-back first
(``synchronize_for_checkpoint``).
"""
import itertools
import time
from typing import Dict, List, Optional

from deepspeed.accelerator import get_accelerator

from ...config import OffloadConfig
from ..attach import Placement
from ..memory.iteration_memory import DeviceMemory
from ..memory.layout import Probe, probe_layout
from ..memory.residency import Phase
from ..patches import PatchRegistry
from ..staging.copies import make_copies
from . import setup
from .lifecycle import Step, StepLifecycle
from .stats import StepStats


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
        self._streamed: List[int] = []  # this step's sub-groups that go through the slots, in order
        self._next_staged = 0  # index in self._streamed of the next one to load
        self._update_start, self._in_step = None, False
        self.lifecycle = StepLifecycle(self)  # the one place a step ends (lifecycle.py)
        self.unloaded_unused = 0  # sub-groups loaded ahead of a step that did not run, unloaded
        self.stats: Optional[StepStats] = None
        self.last_stats: Optional[StepStats] = None
        self.patches, self.checkpointer, self.store = PatchRegistry(), None, None
        self.compile = None  # compile mode's driver, where one composes this mode (compile_passes/mode.py)
        self._on_detach: List = []  # what composes this mode lets go of it here (``on_detach``)
        try:
            setup.build(self, placement, early_in_backward)
        except BaseException:
            self.undo_attach()
            raise
        self.attach_s = time.perf_counter() - started
        setup.log_attach(self)

    def measure_with(self, memory: DeviceMemory):
        """Place by measurement (``MeasuredPlan``), reading the device's memory through ``memory`` (tests
        on the CPU accelerator give one whose figures they script)."""
        setup.measure_with(self, memory)

    def undo_attach(self):  # (attach failed here, or on another rank once this one was built)
        setup.undo(self)

    def on_detach(self, fn):
        """``fn()`` runs once when this mode detaches or its attach is undone (compile mode's ops and pass)."""
        self._on_detach.append(fn)

    def run_on_detach(self):
        while self._on_detach:
            self._on_detach.pop()()

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
        """Undo attach: everything written back, the optimizer's tensors on device copies of their state
        again, every hook off. A pending asynchronous checkpoint is waited for first. Call it on every
        rank; not between ``offload_states()`` and ``reload_states()``."""
        setup.detach(self)

    # ------------------------------------------------------------------ forward: the input's size

    def forward_begins(self, numel: int):
        """A training forward begins with an input of ``numel`` elements (``hooks.input_numel``). The
        step's first opens the window of its peak (``DeviceMemory``); where the measured plan expects the
        iteration not to fit beside the resident state, state goes back to the host before it runs."""
        first = self.lifecycle.current is None or not self.lifecycle.current.input_numel
        # (every rank: the move agrees; not while offload_states() holds the state: its forward is a rollout's)
        if self.plan is not None and not self._in_step and not self.opt.offloaded_states:
            k = self.plan.before_forward(self, numel)
            if self.moves.carry_out(k, self.plan.reason):  # (a give-back: it only makes room)
                self.memory.empty_cache()  # what went back is the device's again
            if first:
                self.forward_level = self.memory.open_window()
        if not self._in_step:
            self.timing.forward_input(numel)  # larger than the early loads were measured on: measured again
        self.lifecycle.forward_input(numel)

    # ------------------------------------------------------------------ backward: loads ahead of the step

    def backward_begins(self):
        """A backward begins (once); what the plan made resident last step travels beside it (``arrival``)."""
        self.arrival.launch()
        self.early.backward_begins(self.engine.is_gradient_accumulation_boundary())

    def gradients_final(self, allowance: Optional[float]):
        """In backward, after a gradient hook or the epilogue: early loads as ``allowance`` allows."""
        self.early.gradients_final(allowance)

    def prefetch_into_slots(self, first: List[int], early: bool):
        """The step's first streamed sub-groups (``first``, in its order) into their places in the
        staging slots, as many as the empty slots take (``prefetch``)."""
        self.table.plan(first)
        for i in first:
            if not self.table[i].on_device:
                if not self.table.can_stage(i):
                    return
                self.load(i, staged=True, early=early)

    def preload(self, i) -> int:
        """Sub-group ``i`` into buffers of its own ahead of the step (compile mode's reloads; colocation's
        reload of what was kept). Returns the bytes it started to copy (0 if it is on the device
        already, or a step is running)."""
        if self._in_step or self.table[i].on_device:
            return 0
        self.load(i, staged=False, early=True)
        return self.layout.nbytes[i]

    def load(self, i, staged, early):
        if self.stats is None:
            self.stats = StepStats(self.copies)
        nbytes, span = self.table.load(i, staged=staged)
        self.stats.loaded(nbytes, early, span)
        if not staged and self.speculation is not None:
            self.speculation.loaded(i)  # (a member's update is to come: held_bytes reserves it)

    # ------------------------------------------------------------------ the streamed step

    def step_entered(self):
        """DeepSpeed's ``step()`` begins; before its first sub-group it computes the gradient norm and
        waits for it on the CPU. Meanwhile the first sub-groups the step streams load into the slots,
        where ``LoadTiming.step_begins`` allows, then into buffers of their own as far as
        ``LoadTiming.entry_allowance`` allows (speculation's casts settled first, their memory free):
        those first both if backward's updates are committed and if not (the order depends on the
        norm). What backward put in the slots stays there."""
        if self.stats is None:
            self.stats = StepStats(self.copies)  # every step has its figures, offloaded sub-groups or not
        self.arrival.before_step()  # state the measured plan just made resident: its copies first
        if self._in_step or not self.timing.step_begins() or self.table.in_slots():
            return
        updated = self.speculation.updated if self.speculation is not None else {}
        if self.speculation is not None:
            self.stats.settled = self.speculation.settle_casts()  # the casts' memory, free for these loads
        if_committed = self.timing.prefetch_order(self.stream_order(committing=updated))
        if_discarded = self.timing.prefetch_order(self.stream_order(committing=()))
        first = [i for i, j in itertools.takewhile(lambda pair: pair[0] == pair[1], zip(if_committed, if_discarded))]
        self.prefetch_into_slots(first, early=False)
        own = self.early.at_step_entry(first)  # what the slots did not take, as far as the step's room allows
        self.stats.loaded_at_entry = len(self.table.in_slots()) + own

    def streams(self, i: int) -> bool:  # (offloaded: the step brings it in and sends it out)
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
        """After DeepSpeed's ``_release_sub_group(i)``: written back (unless its update was committed in
        backward)."""
        if self.speculation is None or not self.speculation.took(i):
            self._updated(i)
            self._stage_ahead()  # its place is free for the next sub-groups once its write-back ran

    def stream_order(self, committing=None) -> List[int]:
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
            self.load(i, staged=False, early=False)
        self._streamed = self.stream_order()
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
                self.load(i, staged=True, early=False)
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
        stats.moves = (self.moves.give_backs, self.moves.take_backs, self.moves.failed)
        self.last_stats, self.stats = stats, None
        stats.log_every(self.engine, step.index, self.store.pinned_bytes, self.memory)

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
            self.unloaded_unused += len(self.table.unload_all())
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
        self.table.unload_all()
        for i in self.order:
            self.tensors.point_at(i, lambda key: self.store.view(i, key), drop_grad=True)
        self.table.free_slots()
        self._in_step = False
        self.stats = None

    # ------------------------------------------------------------------ between steps

    def between_steps(self, step: Step):
        """After an applied step: the measured plan's moves; copy events that landed forgotten."""
        if self.plan is not None:  # (every rank: the move agrees)
            self.moves.carry_out(self.plan.between_steps(self, step), self.plan.reason)
        self.arrival.between_steps(step.iteration_s)  # what it made resident: unpinned, a little a step
        self.forward_level = None
        self.table.prune_in_flight()

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
        self.arrival.wait()  # (state the measured plan made resident: its copies to the device)

    def discard_speculation(self, why: str):
        if self.speculation is not None:
            self.speculation.discard_all(why)

    def guard(self, i: Optional[int] = None, other: Optional[bool] = False):
        """Before sub-group ``i``'s host region (``other``: its second one; None: both; ``i`` None: the
        whole store) is overwritten or unpinned: an asynchronous checkpoint reading it finishes first."""
        if self.checkpointer is not None:
            self.checkpointer.guard(None if i is None else self.store.byte_ranges(i, other))

    def guard_resident(self, i: Optional[int] = None):
        """Before resident sub-group ``i`` changes in place (None: any leaves the device): a save copying it ends."""
        if self.checkpointer is not None and self.checkpointer.copying_resident():
            self.checkpointer.guard_resident(None if i is None else self.tensors.byte_ranges(i))

    def step_stats(self) -> Optional[Dict[str, float]]:
        """The last step that ran: bytes moved each way, sub-groups loaded early (in backward) and in
        the step, seconds the compute stream waited for loads, updating and writing back; None
        before one. A skipped step leaves the previous step's figures. Reading the timings waits
        for that step's copies (in stream mode they landed before the step returned; compile mode
        defers some write-backs to the next forward)."""
        return None if self.last_stats is None else self.last_stats.resolve()
