"""Compile mode's runtime: stream mode's parts, driven by ops in the graphs.

``CompileMode`` holds one ``StreamMode`` (``runtime/step/stream.py``) built with its early loads off
and its write-backs deferred, and uses its parts: one host store, one streamed step, one residency
table (``runtime/memory/residency.py``). The stream mode is the engine's handle (``get_handle``);
its ``compile`` names this driver. This class only adds what the ops do:

- ``reload`` (in backward, where the planner found room): ``preload`` loads a sub-group into
  buffers of its own (``ResidencyTable.load``); the step updates it there instead of streaming it.
- ``copy_stream_sync`` (end of backward): the compute stream waits for those copies (an event,
  no host wait), so the step starts on complete state.
- ``offload_launch`` (head of the next forward): ``offload_for_forward`` writes the updated
  sub-group back and hands its buffers to the allocator once the copy is done, unless the pass
  keeps it on the device (``keep``). (Stream mode writes such a sub-group back at once, in the
  step; compile mode defers it to this op: ``defer_write_back``.)
- ``empty_cache`` (head of forward): returns cached blocks once per compile phase, not per step.

Stream mode's own early loads from the gradient hook are off here (the graphs place the reloads);
``prefetch`` of the first two sub-groups not kept into the slots works as in stream mode without overlap.

The budget decides what moves. Reloaded sub-groups that fit beside the iteration's floor (the
planner's ``plan_kept``) stay on the device from step to step: the step updates them where they are,
and neither ``offload_launch`` nor ``reload`` moves them (nor ``prefetch``, which takes the first
two that are not kept). The others reloaded leave at the head of forward and come back in backward;
what was not reloaded streams through the step. So a budget that holds everything moves nothing
from a phase's third step on at the latest (in its first step, prefetch may have loaded the first
two into the slots before the pass decided what stays), and a budget of 0 streams everything.
Forwards DeepCompile did not profile (evaluation, a shape dynamo recompiles for) run beside the
kept state too. Nothing stays between
compile phases: ``begin_phase`` writes everything back, so DeepCompile profiles the floor, and the
pass decides again. Anything on the CPU that reads host state (a checkpoint, ``state_dict``)
writes the kept sub-groups back first; they come back at the next backward's reloads (or, when
the reader ran between backward and the step, at the step's start: ``LoadTiming.load_at_step_start``). With
gradient accumulation, only the boundary micro-batch reloads; write-backs (``offload_launch``) happen on
the first micro-batch, the only one that finds anything to write back.

The counters are the cheap proof that the ops ran inside the compiled graphs: reloads are skipped
while DeepCompile profiles, so a nonzero count means the compiled graph executed them.
"""

from typing import Dict

from deepspeed.utils import log_dist

from ..runtime.attach import Placement
from ..runtime.memory.layout import probe_layout
from ..runtime.step.stream import StreamMode
from . import ops

# With memory_budget_gb unset, the planner leaves this share of the device for what it cannot see.
MARGIN = 0.2


def _deepcompile_is_profiling() -> bool:
    """DeepCompile's profiler is running. Reads the extension only if DeepCompile loaded it: asking
    for the handle would build the extension (a minute of JIT) inside whatever op called us."""
    from deepspeed.compile import util
    handle = util.dc_handle
    return handle is not None and bool(handle.is_profiling())


class CompileMode:
    """Attached to one engine that will run under DeepCompile with our pass in its schedule. The
    reload ops the planner places load early instead of the gradient hook, and ``offload_launch`` at
    the next forward's head writes back what the step left in buffers of its own."""

    def __init__(self, engine, cfg, placement=None, probe=None, is_profiling=_deepcompile_is_profiling):
        if placement is None:  # built directly: capacity-first, nothing resident at attach
            probe = probe or probe_layout(engine.optimizer)
            placement = Placement.without_agreement(cfg, probe, resident_budget=False)
        self.stream = StreamMode(engine, cfg, placement, probe, early_in_backward=False, defer_write_back=True)
        self.engine, self.cfg = engine, cfg
        self.is_profiling = is_profiling
        self.counters: Dict[str, int] = dict(launches=0, reloads=0, empty_cache=0, syncs=0, bytes_offloaded=0,
                                             bytes_reloaded=0, phases=0)
        # The step streams order[0] first and prefetch loads it during backward; the ones reloaded
        # early are therefore the last of the order, and they are written back in the same order
        # so that the next reload of each finds its own write-back done first.
        self.priority = list(reversed(self.stream.order))
        self._planner_budget = self._budget(placement)
        self._empty_cache_armed = False
        self.ops_key = None
        try:
            self.ops_key = ops.bind(self)
        except BaseException:
            self.stream.undo_attach()
            raise
        self.stream.compile = self
        self.stream.on_detach(self._unbind)
        log_dist(f"[deepspeed-offload] compile mode: planner budget {self.planner_budget_bytes() / 2**30:.1f} GiB",
                 ranks=[0])

    def _unbind(self):
        """The stream mode detaches (or its attach is undone): the ops and the pass let go of it."""
        from .schedule import unregister
        if self.ops_key is not None:
            ops.unbind(self.ops_key)
            self.ops_key = None
        unregister(self)

    # what the pass (schedule.py) reads of the stream mode it drives
    @property
    def slot_bytes(self) -> int:
        return self.stream.slot_bytes

    @property
    def patches(self):
        return self.stream.patches

    def drain(self):
        self.stream.synchronize_for_checkpoint()

    @property
    def kept(self):
        """Reloaded sub-groups that stay on the device between steps (this phase): the timing
        policy's, which prefetch leaves alone and the step loads into buffers of their own."""
        return self.stream.timing.kept

    def planner_budget_bytes(self) -> int:
        return self._planner_budget

    def _budget(self, placement) -> int:
        """The same budget on every rank (every rank must place the same reload nodes, since
        DeepCompile's profiler runs a collective per node): ``memory_budget_gb``, or a share of the
        smallest device among the ranks (attach exchanged their sizes)."""
        if self.cfg.memory_budget_gb is not None:
            return int(self.cfg.memory_budget_gb * 2**30)
        if self.stream.copies.synchronous:
            return 0
        total = placement.min_device_total if placement is not None and placement.min_device_total else \
            self.stream.acc.total_memory()
        return int(total * (1 - MARGIN))

    def sub_group_bytes(self, i) -> int:
        return self.stream.layout.nbytes[i]

    def begin_phase(self):
        """Called by the pass on the first forward graph of a compile phase, before it is profiled:
        every sub-group back on the host (so the profile is the floor), and one empty_cache armed."""
        # DeepCompile calls passes from inside AOT's fake mode; these are real copies of real tensors.
        from torch._subclasses.fake_tensor import unset_fake_temporarily
        with unset_fake_temporarily():
            self.stream.synchronize_for_checkpoint()
            self.stream.table.unload_all()
        self.stream.timing.kept = frozenset()  # the pass decides again from this phase's profile
        self._empty_cache_armed = True
        self.counters["phases"] += 1

    def keep(self, sub_groups, only_fewer=False):
        """From the pass, at the phase's last backward graph: these reloaded sub-groups stay on the
        device between steps (``planner.plan_kept``); ``only_fewer`` (a graph dynamo recompiled,
        planned on its own profile): keep no more than before. ``prefetch`` leaves kept ones alone
        (``LoadTiming.prefetch_order``): they come back through their reload ops into buffers of their own."""
        kept = frozenset(int(i) for i in sub_groups)
        if only_fewer:
            kept &= self.kept
        self.stream.timing.kept = kept
        nbytes = sum(self.sub_group_bytes(i) for i in self.kept)
        log_dist(f"[deepspeed-offload] compile mode: {len(self.kept)} of {len(self.stream.order)} sub-groups "
                 f"({nbytes / 2**30:.2f} GiB) stay on the device between steps", ranks=[0])

    # ------------------------------------------------------------------ what the ops call

    def _known(self, i):
        if i not in self.stream.table.of:
            raise RuntimeError(f"torch.ops.ds_offload names sub-group {i}, which this engine does not offload "
                               f"(it has {len(self.stream.order)}): the graph was compiled for another model or "
                               "sub_group_size; clear the inductor cache (TORCHINDUCTOR_CACHE_DIR) and recompile")

    def _count(self, ops_key, bytes_key, moved):
        if moved:
            self.counters[ops_key] += 1
            self.counters[bytes_key] += moved

    def op_offload_launch(self, i):
        if not self.is_profiling():
            self._known(i)
            if i not in self.kept:
                self._count("launches", "bytes_offloaded", self.stream.offload_for_forward([i]))

    def op_reload(self, i):
        if not self.is_profiling() and self.engine.is_gradient_accumulation_boundary():
            self._known(i)
            self._count("reloads", "bytes_reloaded", self.stream.preload(i))

    def op_empty_cache(self):
        if self.is_profiling() or not self._empty_cache_armed:
            return
        self._empty_cache_armed = False
        self.stream.acc.empty_cache()
        self.counters["empty_cache"] += 1

    def op_copy_stream_sync(self):
        if self.is_profiling():
            return
        # The newest H2D: the copy stream runs them in order, so every reload is done after it.
        self.stream.copies.compute_waits(self.stream.table.last_load)
        self.counters["syncs"] += 1
