"""Stream mode: the ZeRO-3 step with optimizer state streamed from the host store.

Read this file top to bottom to see the whole step. The pieces it drives:
``layout.py`` (what moves, computed once), ``host_store.py`` (where it lives between steps),
``residency.py`` (each sub-group's phase, and what waits on what), ``copies.py`` (the copy executor,
synchronous on the CPU accelerator, streams and events on a GPU), ``patches.py`` (every hook, removable).

``DeepSpeedZeroOptimizer_Stage3.step()`` walks its sub-groups: ``_prepare_sub_group`` (build the
fp32 gradient), unscale/clip, ``_optimizer_step``, copy the fp32 master into the bf16/fp16
partition, ``_release_sub_group``. We wrap the first and the last of these on the optimizer
instance and leave everything in between to DeepSpeed, so the update is DeepSpeed's own, bit for bit.

One iteration with ``overlap`` on (the default)::

    last backward:  as gradients are reduced (and backward frees activations), the first offloaded
                    sub-groups start loading into buffers of their own, in step order, as far as
                    ``LoadTiming`` allows without raising the iteration's peak (``_load_early``)
    step:           sub-groups loaded early are updated in place and written back at once on the
                    D2H stream; the others stream through two staging slots:
        h2d stream:      load next -> slot B     (after slot B's previous write-back)
        compute stream:  wait(load i); prepare, clip, optimizer.step(), copy to bf16, in slot A
        d2h stream:      write back i from slot A (after the update of i)
    step's end:     the CPU waits for the last write-back (``_end_step``): between steps the device
                    holds none of the state, whatever else synchronizes or not.

Write-backs are not carried into the next forward: its activations need that memory sooner than
PCIe drains the state (docs/benchmarks.md). When each sub-group loads is ``LoadTiming``'s decision
(``load_timing.py``): early loads begin once it has measured one iteration without them.

With ``speculate_memory_gb`` (experimental, ``speculation.py``), the early loads take the members
first, in the order their gradients become final, and each is updated in backward as soon as its
gradient is final, into a second host region; at the step's start (``_begin_step``: DeepSpeed has
the norm) the updates are committed, and DeepSpeed's loop skips those sub-groups, or discarded.

With ``overlap`` off, nothing loads in backward except (``prefetch``) the first two sub-groups
into the two slots. The DeepSpeed tensor objects never change: ``fp32_partitioned_groups_flat[i]``
(the key of ``optimizer.state``) and each state tensor get their ``.data`` pointed at the device
buffers for the update and back at their host slice afterwards. Nothing in the loop synchronizes
the device; a load waits for the sub-group's previous write-back, and anything on the CPU that
reads host state (checkpoint, ``safe_get_full_*``) waits for every write-back first
(``synchronize_for_checkpoint``).

State the optimizer creates lazily (Adam's moments at step 1) is made by the optimizer on the
device for the one sub-group being updated, copied into its buffers and written back with it.
"""

import time
from typing import Dict, List, Optional

from deepspeed.accelerator import get_accelerator
from deepspeed.utils import log_dist

from ..config import OffloadConfig
from ..handle import HANDLE_ATTR
from ..host_memory import HostMemory, format_bytes, local_ranks
from .checkpoint import AsyncCheckpointer
from .colocation import StateOffload
from .copies import make_copies
from .host_store import HostStore
from .layout import compute_layout, fitting_prefix
from .load_timing import LoadTiming
from .patches import PatchRegistry
from .residency import Phase, ResidencyTable
from .speculation import Speculation
from .state_tensors import StateTensors
from .step_stats import StepStats

# On a GPU, the resident budget left unspecified keeps this share of the card for everything else.
DERIVED_BUDGET_SPARE = 0.5
# Methods of the ZeRO-3 optimizer that read host state on the CPU: they wait for the write-backs.
READERS = ("state_dict", "_get_fp32_opt_state_partition")
# ... and that write it: they also wait for a checkpoint write and drop what was loaded early.
WRITERS = ("_restore_from_bit16_weights", "_restore_from_fp32_weights", "set_full_hp_param", "set_local_hp_param")
# ... and that write the gradient partitions between backward and the step (safe_set_full_grad and
# its kin): an update speculated from the gradients before them is void.
GRAD_WRITERS = ("set_fp32_grad_for_param", "set_local_grad_for_param", "update_fp32_grad_for_param_vectorized")
# The optimizer method the gradient hooks call as backward produces each gradient (and frees memory).
GRADIENT_HOOK = "reduce_ready_partitions_and_remove_grads"


class StreamMode:
    """Attached to one engine: owns the host store, the residency table and the hooks.

    ``early_in_backward``: sub-groups may load during backward as ``timing`` allows (compile mode:
    False, the reloads its graphs place do that); ``defer_write_back``: a sub-group updated in
    buffers of its own stays there until ``offload_for_forward`` (compile mode's next forward head)."""

    def __init__(self, engine, cfg: OffloadConfig, early_in_backward: bool = True, defer_write_back: bool = False):
        started = time.perf_counter()
        self.engine = engine
        self.opt = engine.optimizer
        self.base = self.opt.optimizer
        self.cfg = cfg
        self.acc = get_accelerator()
        self.copies = make_copies(self.acc)
        self.layout = compute_layout(self.opt, self._resident_budget_bytes())
        self.order: List[int] = self.layout.order
        self.resident: List[int] = self.layout.resident
        self.slot_bytes = self.layout.slot_bytes
        members = self._speculation_members(early_in_backward)
        self.store = HostStore(self.layout.entries, cfg.pin_memory, budget_gb=cfg.memory_budget_gb, twins=members)
        self.table = ResidencyTable(self.store, self.copies, self.layout.slot_numel)
        self.timing = LoadTiming(self.acc, self.copies.synchronous, self.slot_bytes,
                                 early_in_backward=cfg.overlap and early_in_backward, prefetch=cfg.prefetch,
                                 early_cap=None if cfg.overlap_memory_gb is None else int(cfg.overlap_memory_gb * 2**30))
        self.defer_write_back = defer_write_back
        self._next_early = 0  # position in self._early_order of the next sub-group to load early
        self._early_order: List[int] = self.order  # members in the order they speculate, then step order
        self._streamed: List[int] = []  # this step's sub-groups that go through the slots, in order
        self._position: Dict[int, int] = {}  # sub-group -> its index in self._streamed
        self._update_start = None
        self._in_step = False
        self.steps = 0
        self.released_unused = 0  # sub-groups loaded ahead of a step that did not run, given back
        self.stats: Optional[StepStats] = None
        self.last_stats: Optional[StepStats] = None

        self.tensors = StateTensors(self.opt, self.store, self.order)
        self.speculation = Speculation(self, members) if members else None
        self.colocation = StateOffload(self)
        # Move what exists now (masters; states too if the optimizer already stepped or loaded).
        self.tensors.all_to_host()
        self.acc.empty_cache()
        self.patches = PatchRegistry()
        self._install_hooks()
        # The checkpointer's engine hooks are in a registry of its own: close() takes them off.
        self.checkpointer = AsyncCheckpointer(engine, self.store.buffers.values()) if cfg.async_checkpoint else None
        self.attach_s = time.perf_counter() - started
        n = len(self.opt.fp32_partitioned_groups_flat)
        # INFO, like DeepSpeed's own attach lines: shown once the user sets DeepSpeed's logger to info.
        log_dist(f"[deepspeed-offload] stream mode: {len(self.order)} of {n} sub-groups offloaded "
                 f"({len(self.resident)} resident within the budget), "
                 f"{sum(len(self.store.slices[i]) for i in self.order)} tensors, host store "
                 f"{self.store.pinning.describe()}, 2 staging slots of {format_bytes(self.slot_bytes)}, "
                 f"overlap={'on' if self.overlap else 'off'}; attached in {self.attach_s:.1f} s", ranks=[0])
        if self.speculation is not None:
            self.speculation.log_attach()

    @property
    def overlap(self) -> bool:
        return self.timing.early_in_backward

    def _speculation_members(self, early_in_backward: bool) -> List[int]:
        """The sub-groups that speculate (``speculation.py``), within ``speculate_memory_gb`` per rank;
        null: what the node has spare after every rank's store, shared among its ranks. None where
        nothing loads in backward or the 16-bit partition is the master itself (fp32)."""
        gb = self.cfg.speculate_memory_gb
        if gb == 0 or not (self.cfg.overlap and early_in_backward) or not self.order:
            return []
        if any(self.opt.fp16_partitioned_groups_flat[i].dtype == self.opt.fp32_partitioned_groups_flat[i].dtype
               for i in self.order):
            log_dist("[deepspeed-offload] speculation off: the parameters are fp32", ranks=[0])
            return []
        if gb is None:  # the second regions within what is spare
            store = sum(self.layout.nbytes[i] for i in self.order)
            budget = max(0, HostMemory.read().usable // local_ranks() - store)
        else:
            budget = int(gb * 2**30)
        # the last sub-groups first: their gradients are final first
        return fitting_prefix(sorted(self.order, reverse=True), self.layout.nbytes.__getitem__, budget)

    def _resident_budget_bytes(self) -> int:
        if self.cfg.memory_budget_gb is not None:
            return int(self.cfg.memory_budget_gb * 2**30)
        if self.copies.synchronous:
            return 0  # device memory is host memory: residency saves nothing, offloading exercises the path
        return max(0, int(self.acc.available_memory() - DERIVED_BUDGET_SPARE * self.acc.total_memory()))

    # ------------------------------------------------------------------ the hooks (all through self.patches)

    def _install_hooks(self):
        opt, engine, patch = self.opt, self.engine, self.patches.patch
        patch(opt, "_prepare_sub_group", lambda orig: self._wrap_prepare(orig))
        patch(opt, "_release_sub_group", lambda orig: self._wrap_release(orig))
        for name in READERS:
            patch(opt, name, lambda orig: self._around(orig))
        for name in WRITERS:
            patch(opt, name, lambda orig: self._around(orig, writes=True))
        patch(opt, "load_state_dict",
              lambda orig: self._around(orig, writes=True, after=lambda: self.tensors.after_load(self.acc)))
        patch(opt, "step", lambda orig: self._wrap_step(orig))
        patch(engine, "_backward_prologue", lambda orig: self._wrap_backward_prologue(orig))
        if self.overlap:
            patch(opt, GRADIENT_HOOK, lambda orig: self._wrap_gradient_hook(orig))
        if self.speculation is not None:
            spec = self.speculation
            patch(opt, "partition_grads", lambda orig: self._wrap_partition_grads(orig))
            patch(opt, "independent_gradient_partition_epilogue", lambda orig: self._wrap_epilogue(orig))
            for name in ("unscale_and_clip_grads", "_optimizer_step"):
                patch(opt, name, lambda orig: spec.skip_committed(orig))
            patch(opt, "_reassign_or_swap_out_partitioned_parameters", lambda orig: spec.wrap_reassign(orig))
            for name in GRAD_WRITERS:
                if hasattr(opt, name):
                    patch(opt, name, lambda orig: self._discarding(orig, "gradient written"))
        # engine.offload_states()/reload_states() check their arguments and call these two.
        patch(opt, "offload_states", lambda orig: self.colocation.offload_states)
        patch(opt, "reload_states", lambda orig: lambda *a, **kw: self.colocation.reload_states(orig, *a, **kw))
        # ... and while they are in effect, these refuse on entry, before the engine changes anything.
        for name in ("step", "backward", "load_checkpoint"):
            patch(engine, name, lambda orig, name=name: self._refuse_if_offloaded(orig, name))

    def _discarding(self, orig, why):
        """``orig`` changes what the updates speculated in backward were computed from."""

        def call(*args, **kwargs):
            self._discard_speculation(why)
            return orig(*args, **kwargs)

        return call

    def _refuse_if_offloaded(self, orig, name):

        def call(*args, **kwargs):
            self.colocation.refuse_if_offloaded(f"engine.{name}()")
            return orig(*args, **kwargs)

        return call

    def detach(self):
        """Undo attach: write everything back, point the optimizer's tensors at device copies of
        their state again, and remove every hook (the engine and optimizer methods are DeepSpeed's
        own again). A pending asynchronous checkpoint is waited for first. Call it on every rank;
        not between ``offload_states()`` and ``reload_states()``."""
        self.colocation.refuse_if_offloaded("detach()")
        self._discard_speculation("detach")
        if self.checkpointer is not None:
            self.checkpointer.close()  # waits for the last save (collective), removes its hooks
            self.checkpointer = None
        self.synchronize_for_checkpoint()
        self.table.release_loaded()
        device = self.acc.current_device_name()
        for i in self.order:
            self.tensors.point_at(i, lambda key: self.store.view(i, key).to(device, copy=True))
        self.patches.remove_all()
        if getattr(self.engine, HANDLE_ATTR, None) is self:
            delattr(self.engine, HANDLE_ATTR)

    def _wrap_prepare(self, orig):

        def prepare(i, timer_names):
            if i in self.table.of:
                if not self._in_step:
                    self._begin_step()
                if self.speculation is not None and self.speculation.commit(i):
                    return None  # updated in backward: DeepSpeed's calls for it are skipped
                self._bring_in(i)
            return orig(i, timer_names)

        return prepare

    def _wrap_release(self, orig):

        def release(i, timer_names):
            orig(i, timer_names)
            if i in self.table.of:
                if self.speculation is None or not self.speculation.took(i):
                    self._updated(i)  # (a committed sub-group was written back in backward)
                if i == self.order[-1]:
                    self._end_step()

        return release

    def _wrap_backward_prologue(self, orig):

        def backward_prologue(*args, **kwargs):
            # Both engine.backward(loss) and a plain loss.backward() come through here, once.
            self.colocation.refuse_if_offloaded("backward()")
            self._next_early = 0
            boundary = self.engine.is_gradient_accumulation_boundary()
            if self.speculation is not None and not self._in_step:
                speculates = self.speculation.backward_begins(boundary)
                self._early_order = self.speculation.early_order(self.order) if speculates else self.order
            if self.timing.backward_begins(boundary) and not self._in_step:
                self._prefetch_into_slots()
            return orig(*args, **kwargs)

        return backward_prologue

    def _wrap_gradient_hook(self, orig):

        def gradient_ready(param):
            result = orig(param)
            self._gradients_final(self.timing.gradient_ready())
            return result

        return gradient_ready

    def _wrap_partition_grads(self, orig):

        def partition_grads(params_to_release, grad_partitions):
            params = list(params_to_release)  # DeepSpeed clears its list after this call
            result = orig(params_to_release, grad_partitions)
            self.speculation.partitioned(params)
            return result

        return partition_grads

    def _wrap_epilogue(self, orig):

        def epilogue(*args, **kwargs):
            result = orig(*args, **kwargs)  # the last buckets' gradients are final now
            self._gradients_final(self.timing.allowance())
            return result

        return epilogue

    def _gradients_final(self, allowance: Optional[float]):
        """In backward, after a gradient hook or the epilogue: load early as ``allowance`` allows,
        then update what speculation found final and loaded."""
        if self._in_step:
            return
        if allowance is not None and self._next_early < len(self._early_order):
            self._load_early(allowance)
        if self.speculation is not None:
            self.speculation.run()

    def _wrap_step(self, orig):

        def step(*args, **kwargs):
            steps = self.steps
            try:
                result = orig(*args, **kwargs)
            except BaseException:
                self._abort_step()
                raise
            if self.steps == steps:
                self._step_skipped()
            return result

        return step

    def _around(self, fn, writes=False, after=None):
        """``fn`` reads (or ``writes``) host state on the CPU: every write-back lands first."""

        def wrapper(*args, **kwargs):
            if not self._in_step:
                self.colocation.wait_for_copies()
                self.synchronize_for_checkpoint()
                if writes:
                    self.colocation.refuse_if_offloaded(fn.__name__ + "()")
                    self._discard_speculation("state written")  # computed from the state this replaces
                    self._guard()
                    self.table.release_loaded()  # loaded early: the old values
            result = fn(*args, **kwargs)
            if after is not None:
                after()
            return result

        return wrapper

    # ------------------------------------------------------------------ backward: loads ahead of the step

    def _load_early(self, allowance: float):
        """Load the next offloaded sub-groups, in ``_early_order`` (step order; speculation's members
        first when it speculates), into buffers of their own while the
        bytes held that way (and by speculated updates) stay within ``allowance``
        (``LoadTiming.gradient_ready``)."""
        held = self.table.early_bytes + (self.speculation.held_bytes if self.speculation is not None else 0)
        while self._next_early < len(self._early_order):
            i = self._early_order[self._next_early]
            if not self.table[i].on_device:
                if held + self.layout.nbytes[i] > allowance:
                    return  # asked again at the next gradient hook, when backward has freed more
                self._load(i, slot=None, early=True)
                held += self.layout.nbytes[i]
            self._next_early += 1

    def _prefetch_into_slots(self):
        """When backward begins, without early loads: the step's first two streamed sub-groups into
        the two staging slots (``prefetch``)."""
        for k, i in enumerate(self.timing.prefetch_order(self._stream_order())):
            if not self.table[i].on_device:
                self._load(i, slot=k, early=True)

    def _load(self, i, slot, early):
        if self.stats is None:
            self.stats = StepStats(self.copies)
        nbytes, span = self.table.load(i, slot=slot)
        self.stats.bytes_h2d += nbytes
        if early:
            self.stats.loaded_early += 1
        else:
            self.stats.loaded_in_step += 1
            self.stats.span("h2d_wait", span)  # a synchronous copy in the step: time the step waits

    # ------------------------------------------------------------------ the streamed step

    def _stream_order(self) -> List[int]:
        """The sub-groups the step streams through the slots: all but those in buffers of their own
        and those whose update from backward it commits."""
        committing = self.speculation.committing if self.speculation is not None else ()
        return [i for i in self.order
                if not (self.table[i].on_device and self.table[i].slot is None) and i not in committing]

    def _begin_step(self):
        # (A sub-group still UPDATED in buffers of its own, compile mode's kept ones, or any whose
        # offload_launch did not run, is updated again where it is: ``ResidencyTable.arrive``.)
        self._in_step = True  # from here on, a failure is undone by _abort_step
        self.timing.step_begins()
        if self.stats is None:
            self.stats = StepStats(self.copies)
        if self.speculation is not None:
            self.speculation.decide()  # DeepSpeed has the norm now: commit the updates from backward, or not
        for i in self.timing.load_at_step_start(lambda i: self.table[i].on_device):
            self._load(i, slot=None, early=False)
        self._streamed = self._stream_order()
        self._position = {i: k for k, i in enumerate(self._streamed)}
        for k, i in enumerate(self._streamed[:2]):  # both slots are free: fill them now
            self._load_into_slot(k)

    def _load_into_slot(self, k):
        """Load the ``k``-th streamed sub-group into slot ``k % 2`` unless it is there already."""
        if k >= len(self._streamed):
            return
        i = self._streamed[k]
        r = self.table[i]
        if r.on_device:
            assert r.slot == k % 2, f"deepspeed-offload: sub-group {i} is in slot {r.slot}, the step expects {k % 2}"
            return
        self._load(i, slot=k % 2, early=False)

    def _bring_in(self, i):
        """Before DeepSpeed prepares sub-group ``i`` (the step has begun): its state on the device,
        its tensors on it."""
        if i in self._position:
            self._load_into_slot(self._position[i])  # normally done already, by the previous sub-group
        before = self.copies.clock()
        self.table.arrive(i)
        self._update_start = self.copies.clock()
        self.stats.span("h2d_wait", (before, self._update_start))
        self.tensors.point_at(i, lambda key: self.table.view(i, key))
        if i in self._position:
            self._load_into_slot(self._position[i] + 1)  # into the other slot, after its last write-back

    def _updated(self, i):
        """After DeepSpeed released sub-group ``i``: written back and its tensors pointed at the host
        store, or (compile mode, buffers of its own) left UPDATED on the device, its tensors on them,
        for the next forward's head or the next step."""
        # State created by this step (lazy optimizer state) goes into the buffers, to leave with the rest.
        self.tensors.move_into(i, lambda key: self.table.view(i, key))
        self.stats.span("update", (self._update_start, self.copies.clock()))
        self.table.mark_updated(i)
        if self.stats.sub_groups == 0:
            self._guard()  # the first write to the host store in this step
        self.stats.sub_groups += 1
        if not (self.defer_write_back and self.table[i].slot is None):
            self._write_back(i, self.stats)

    def _write_back(self, i, stats: Optional[StepStats]):
        nbytes, span = self.table.write_back(i)
        self.tensors.point_at(i, lambda key: self.store.view(i, key))
        if stats is not None:
            stats.bytes_d2h += nbytes
            stats.span("d2h", span)
        return nbytes

    def _end_step(self):
        if self.speculation is not None:
            self.speculation.step_ends()
        self.table.free_slots()  # back to the allocator; record_stream holds the blocks until the copies end
        if not self.defer_write_back:
            self.table.drain()  # the step returns with every write-back landed: nothing held after it
        self._in_step = False
        self.timing.step_ends()
        self.steps += 1
        self.last_stats, self.stats = self.stats, None

    # ------------------------------------------------------------------ a step that did not run

    def _step_skipped(self):
        """A step DeepSpeed skipped (fp16 overflow, a non-finite gradient norm) never asked for what
        backward loaded: give those buffers back (the host copy is still the current one) and drop
        the stats of what it loaded, so they do not count in the next step."""
        self.timing.step_skipped()
        self._discard_speculation("overflow")
        if self.stats is not None or self.table.slots is not None:
            self.released_unused += len(self.table.release_loaded())
            self.table.free_slots()
            self.stats = None

    def _abort_step(self):
        """A step that raised: point every tensor back at the host store and drop the slots, so the
        next step (or a checkpoint) starts from a consistent place."""
        self.timing.step_skipped()
        self._discard_speculation("step raised")
        if not self._in_step:
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

    def offload_for_forward(self, sub_groups=None) -> int:
        """Write back what the last step left updated in buffers of its own (``defer_write_back``;
        compile mode calls this per sub-group at the next forward's head). Returns the bytes."""
        todo = self.table.in_phase(Phase.UPDATED) if sub_groups is None else \
            [i for i in sub_groups if self.table[i].phase is Phase.UPDATED]
        if todo:
            self._guard()  # an async checkpoint may still be reading the host copy this overwrites
        # Counted in the stats of the step that updated them.
        return sum(self._write_back(i, self.last_stats) for i in todo)

    def synchronize_for_checkpoint(self):
        """Before anything on the CPU reads host state: write back what is left on the device and
        block until every write-back has landed."""
        self.offload_for_forward()
        self.table.drain()

    drain = synchronize_for_checkpoint

    def _discard_speculation(self, why: str):
        if self.speculation is not None:
            self.speculation.discard_all(why)

    def _guard(self):
        """Before host state is overwritten: let an in-flight checkpoint write finish reading it."""
        if self.checkpointer is not None:
            self.checkpointer.guard()

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
