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
                    sub-groups start loading into buffers of their own, in step order, while the
                    device memory stays under the limit (``prefetch_for_step``)
    step:           sub-groups loaded early are updated in place and written back at once on the
                    D2H stream; the others stream through two staging slots:
        h2d stream:      load next -> slot B     (after slot B's previous write-back)
        compute stream:  wait(load i); prepare, clip, optimizer.step(), copy to bf16, in slot A
        d2h stream:      write back i from slot A (after the update of i)
    step's end:     the CPU waits for the last write-back (``_end_step``): between steps the device
                    holds none of the state, whatever else synchronizes or not.

Write-backs are not carried into the next forward. That was built and measured (2026-11-30, H200,
docs/benchmarks.md): the forward's activations grow faster than PCIe drains the state, so the
forward had to wait for the write-backs to keep the peak, and the iteration got no faster.

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

import torch
from deepspeed.accelerator import get_accelerator
from deepspeed.utils import log_dist

from ..config import OffloadConfig, format_bytes
from .checkpoint import AsyncCheckpointer
from .copies import make_copies
from .host_store import MASTER, HostStore
from .layout import compute_layout, probe_state_layout  # noqa: F401 (probe_state_layout: re-exported)
from .patches import PatchRegistry
from .residency import Phase, ResidencyTable

# On a GPU, the resident budget left unspecified keeps this share of the card for everything else.
DERIVED_BUDGET_SPARE = 0.5
# Methods of the ZeRO-3 optimizer that read host state on the CPU: they wait for the write-backs.
READERS = ("state_dict", "_get_fp32_opt_state_partition")
# ... and that write it: they also wait for a checkpoint write and drop what was loaded early.
WRITERS = ("_restore_from_bit16_weights", "_restore_from_fp32_weights", "set_full_hp_param", "set_local_hp_param")
# Early loads that did not fit ask the device's memory again after this long (seconds): the query
# (the allocator's statistics) costs tens of microseconds of the CPU that drives backward.
EARLY_POLL_S = 0.002
# The optimizer method the gradient hooks call as backward produces each gradient (and frees memory).
GRADIENT_HOOK = "reduce_ready_partitions_and_remove_grads"


class StepStats:
    """What one step moved and where its time went. Device timings are read lazily (``resolve``),
    so recording them costs no synchronization."""

    KINDS = ("h2d_wait", "update", "d2h")

    def __init__(self, copies):
        self.copies = copies
        self.bytes_h2d = 0
        self.bytes_d2h = 0
        self.sub_groups = 0
        self.loaded_early = 0  # sub-groups loaded before the step (in backward)
        self.loaded_in_step = 0
        self._spans: Dict[str, List] = {kind: [] for kind in self.KINDS}

    def span(self, kind, span):
        if span is not None:
            self._spans[kind].append(span)

    def resolve(self) -> Dict[str, float]:
        out = {"bytes_h2d": self.bytes_h2d, "bytes_d2h": self.bytes_d2h, "sub_groups": self.sub_groups,
               "loaded_early": self.loaded_early, "loaded_in_step": self.loaded_in_step}
        for kind, spans in self._spans.items():
            out[f"{kind}_s"] = sum(self.copies.elapsed(a, b) for a, b in spans)
        return out


class StreamMode:
    """Attached to one engine: owns the host store, the residency table and the hooks."""

    OVERLAP_IN_BACKWARD = True  # early loads from the gradient hook (compile mode: its graphs do it)
    DEFER_WRITE_BACK = False  # True: a sub-group updated in its own buffers stays until offload_for_forward

    def __init__(self, engine, cfg: OffloadConfig):
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
        self.store = HostStore(self.layout.entries, cfg.pin_memory)
        self.table = ResidencyTable(self.store, self.copies, self.layout.slot_numel)
        self.overlap = cfg.overlap and self.OVERLAP_IN_BACKWARD
        # overlap_memory_gb in bytes: what the early loads may hold together (None: derived limit)
        self.early_cap = None if cfg.overlap_memory_gb is None else int(cfg.overlap_memory_gb * 2**30)
        self._early_window = False  # the boundary micro-batch's backward is running: early loads allowed
        self._streamed: List[int] = []  # this step's sub-groups that go through the slots, in order
        self._position: Dict[int, int] = {}  # sub-group -> its index in self._streamed
        self._next_poll = 0.0  # when the gradient hook may query device memory again
        self._peak_seen = 0  # the device's peak, sampled at the first iteration's phase boundaries
        self._peak_ref: Optional[int] = None  # the first iteration's peak, frozen: what later ones stay under
        self._update_start = None
        self._in_step = False
        self.steps = 0
        self.released_unused = 0  # sub-groups loaded ahead of a step that did not run, given back
        self.stats: Optional[StepStats] = None
        self.last_stats: Optional[StepStats] = None

        # Move what exists now (masters; states too if the optimizer already stepped or loaded).
        self._all_to_host()
        self.acc.empty_cache()
        if not self.copies.synchronous:
            # The derived early-load limit is the peak seen since attach: DeepSpeed's init peaked with
            # the whole fp32 state on the device, which would let early loads climb back up to it.
            self.acc.reset_peak_memory_stats()
        self.patches = PatchRegistry()
        self._install_hooks()
        # The checkpointer's engine hooks are in a registry of its own: close() takes them off.
        self.checkpointer = AsyncCheckpointer(engine, self.store.buffers.values()) if cfg.async_checkpoint else None
        pinned = ", ".join(f"{dt}: {format_bytes(b)}" for dt, b in self.store.nbytes_by_dtype.items())
        n = len(self.opt.fp32_partitioned_groups_flat)
        # INFO, like DeepSpeed's own attach lines: shown once the user sets DeepSpeed's logger to info.
        log_dist(f"[deepspeed-offload] stream mode: {len(self.order)} of {n} sub-groups offloaded "
                 f"({len(self.resident)} resident within the budget), "
                 f"{sum(len(self.store.slices[i]) for i in self.order)} tensors, host store {pinned} "
                 f"(pinned={cfg.pin_memory}), 2 staging slots of {format_bytes(self.slot_bytes)}, "
                 f"overlap={'on' if self.overlap else 'off'}", ranks=[0])

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
        patch(opt, "load_state_dict", lambda orig: self._around(orig, writes=True, after=self._after_load))
        patch(opt, "step", lambda orig: self._around(orig, drain=False, on_error=self._abort_step,
                                                     after=self._after_step))
        patch(engine, "_backward_prologue", lambda orig: self._wrap_backward_prologue(orig))
        if self.overlap:
            patch(opt, GRADIENT_HOOK, lambda orig: self._wrap_gradient_hook(orig))
        for name in ("offload_states", "reload_states"):
            patch(engine, name, lambda orig, name=name: self._refuse(name))

    def detach(self):
        """Undo attach: write everything back, point the optimizer's tensors at device copies of
        their state again, and remove every hook (the engine and optimizer methods are DeepSpeed's
        own again). A pending asynchronous checkpoint is waited for first. Call it on every rank."""
        if self.checkpointer is not None:
            self.checkpointer.close()  # waits for the last save (collective), removes its hooks
            self.checkpointer = None
        self.synchronize_for_checkpoint()
        self.table.release_loaded()
        device = self.acc.current_device_name()
        for i in self.order:
            for key in self.store.slices[i]:
                t = self._tensor(i, key)
                if t is not None:
                    t.data = self.store.view(i, key).to(device, copy=True)
        self.patches.remove_all()
        from ..api import HANDLE_ATTR
        if getattr(self.engine, HANDLE_ATTR, None) is self:
            delattr(self.engine, HANDLE_ATTR)

    def _wrap_prepare(self, orig):

        def prepare(i, timer_names):
            if i in self.table.of:
                self._bring_in(i)
            return orig(i, timer_names)

        return prepare

    def _wrap_release(self, orig):

        def release(i, timer_names):
            orig(i, timer_names)
            if i in self.table.of:
                self._updated(i)

        return release

    def _wrap_backward_prologue(self, orig):

        def backward_prologue(*args, **kwargs):
            # Both engine.backward(loss) and a plain loss.backward() come through here, once.
            boundary = self.engine.is_gradient_accumulation_boundary()
            self._early_window = self.overlap and boundary
            self._next_poll = 0.0
            if boundary:
                self._sample_peak()  # the forward's
            if boundary and not self.overlap and self.cfg.prefetch:
                self.prefetch_for_step()
            return orig(*args, **kwargs)

        return backward_prologue

    def _wrap_gradient_hook(self, orig):

        def gradient_ready(param):
            result = orig(param)
            if self._early_window and time.perf_counter() >= self._next_poll:
                self.prefetch_for_step()
            return result

        return gradient_ready

    def _around(self, fn, drain=True, writes=False, after=None, on_error=None):

        def wrapper(*args, **kwargs):
            if drain and not self._in_step:
                self.synchronize_for_checkpoint()
                if writes:
                    self._guard()
                    self.table.release_loaded()  # loaded early: the old values
            try:
                result = fn(*args, **kwargs)
            except BaseException:
                if on_error is not None:
                    on_error()
                raise
            if after is not None:
                after()
            return result

        return wrapper

    @staticmethod
    def _refuse(name):

        def refuse(*args, **kwargs):
            raise RuntimeError(f"engine.{name}() is not available with deepspeed-offload attached: the optimizer "
                               "state already lives in host memory and streams through each step")

        return refuse

    # ------------------------------------------------------------------ backward: loads ahead of the step

    def prefetch_for_step(self):
        """Start loading what the next step needs while backward still runs. With ``overlap``: the
        next offloaded sub-groups in step order, into buffers of their own, while they fit under
        ``_early_limit()`` (the gradient hook calls this again as backward frees memory). Without:
        the first two into the two staging slots, if the peak so far plus both slots fits in 90% of
        the device."""
        if self._in_step or not self.order:
            return
        if self.overlap:
            limit, cap = self._early_limit(), self.early_cap
            held = self.table.early_bytes() if cap is not None else 0
            allocated = self.acc.memory_allocated() if limit is not None else 0  # one query per call
            for i in self.order:
                r = self.table[i]
                if r.on_device:
                    continue  # loaded already
                nbytes = self.layout.nbytes[i]
                if cap is not None and held + nbytes > cap:
                    self._early_window = False  # the cap is fixed: nothing more will fit this step
                    return
                if limit is not None and allocated + nbytes > limit:
                    # Try again when backward has freed more; not at every gradient (the query's cost).
                    self._next_poll = time.perf_counter() + EARLY_POLL_S
                    return
                self._load(i, slot=None, early=True)
                held += nbytes
                allocated += nbytes  # what the buffers just took from the allocator
            self._early_window = False  # everything is loaded
            return
        if not self.copies.synchronous and \
                self.acc.max_memory_allocated() + 2 * self.slot_bytes > 0.9 * self.acc.total_memory():
            return  # the peak seen so far plus both slots would not fit: load at the step instead
        for k, i in enumerate(self._prefetch_order()[:2]):
            if not self.table[i].on_device:
                self._load(i, slot=k, early=True)

    def _early_limit(self) -> Optional[int]:
        """With ``overlap_memory_gb`` unset, early loads keep the device's allocated memory under
        the peak less what the rest of backward and the step still allocate on top: the two slots,
        the step's fp32 gradient of the largest sub-group with the flattened 16-bit gradient it is
        built from (1.5x), and at the first step the moments the optimizer creates for it (2x). So
        the iteration's peak does not rise. The peak: during the first iteration the device's, since
        attach (reset once there); from the first step's end on, that iteration's, frozen
        (``_peak_ref``), so that neither the early loads themselves nor a reset of the device's peak
        statistics by other code moves it. None (no limit) on the CPU accelerator."""
        if self.early_cap is not None or self.copies.synchronous:
            return None
        grad = self.layout.grad_bytes
        reserve = 2 * self.slot_bytes + grad * 3 // 2 + (2 * grad if self.steps == 0 else 0)
        if self._peak_ref is None:
            self._sample_peak()  # backward's, as it goes
        peak = self._peak_seen if self._peak_ref is None else self._peak_ref
        return peak - reserve

    def _sample_peak(self):
        """During the first iteration, at each phase boundary (the backward's start, the step's start
        and end; backward's own polls sample it too, in ``_early_limit``): the device's peak since
        the last reset, whoever reset it (a benchmark between backward and step, say), so the frozen
        reference covers forward, backward and step."""
        if self._peak_ref is None and not self.copies.synchronous:
            self._peak_seen = max(self._peak_seen, self.acc.max_memory_allocated())

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
        """The sub-groups the step streams through the slots: all but those in buffers of their own."""
        return [i for i in self.order if not (self.table[i].on_device and self.table[i].slot is None)]

    def _prefetch_order(self) -> List[int]:
        """What ``prefetch`` loads into the two slots during backward: the first two the step will stream."""
        return self._stream_order()

    def _begin_step(self):
        # (A sub-group still UPDATED in buffers of its own, compile mode's kept ones, or any whose
        # offload_launch did not run, is updated again where it is: ``ResidencyTable.arrive``.)
        self._sample_peak()  # backward's
        self._in_step = True  # from here on, a failure is undone by _abort_step
        if self.stats is None:
            self.stats = StepStats(self.copies)
        self._before_streaming()
        self._streamed = self._stream_order()
        self._position = {i: k for k, i in enumerate(self._streamed)}
        for k, i in enumerate(self._streamed[:2]):  # both slots are free: fill them now
            self._load_into_slot(k)

    def _before_streaming(self):
        """At the step's start, before it decides what streams: loads the step must find in buffers
        of their own (compile mode's kept sub-groups). Nothing in stream mode."""

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
        """Before DeepSpeed prepares sub-group ``i``: its state on the device, its tensors on it."""
        if not self._in_step:
            self._begin_step()
        if i in self._position:
            self._load_into_slot(self._position[i])  # normally done already, by the previous sub-group
        before = self.copies.clock()
        self.table.arrive(i)
        self._update_start = self.copies.clock()
        self.stats.span("h2d_wait", (before, self._update_start))
        for key in self.store.slices[i]:
            t = self._tensor(i, key)
            if t is not None:
                t.data = self.table.view(i, key)
        if i in self._position:
            self._load_into_slot(self._position[i] + 1)  # into the other slot, after its last write-back

    def _updated(self, i):
        """After DeepSpeed released sub-group ``i``: written back and its tensors pointed at the host
        store, or (compile mode, buffers of its own) left UPDATED on the device, its tensors on them,
        for the next forward's head or the next step."""
        for key in self.store.slices[i]:
            t = self._tensor(i, key)
            if t is None:
                continue
            view = self.table.view(i, key)
            if t.shape != view.shape or t.dtype != view.dtype:
                raise RuntimeError(f"deepspeed-offload: optimizer state '{key}' of sub-group {i} is "
                                   f"{tuple(t.shape)} {t.dtype}, the host store expected {tuple(view.shape)} "
                                   f"{view.dtype}; this optimizer's state is not per-parameter tensors")
            # State created by this step (lazy optimizer state) goes into the buffers, to leave with the rest.
            _move_into(t, view)
        self.stats.span("update", (self._update_start, self.copies.clock()))
        self.table.mark_updated(i)
        if self.stats.sub_groups == 0:
            self._guard()  # the first write to the host store in this step
        self.stats.sub_groups += 1
        if not (self.DEFER_WRITE_BACK and self.table[i].slot is None):
            self._write_back(i, self.stats)
        if i == self.order[-1]:
            self._end_step()

    def _write_back(self, i, stats: Optional[StepStats]):
        nbytes, span = self.table.write_back(i)
        self._point_at_host(i)
        if stats is not None:
            stats.bytes_d2h += nbytes
            stats.span("d2h", span)
        return nbytes

    def _end_step(self):
        self.table.free_slots()  # back to the allocator; record_stream holds the blocks until the copies end
        if not self.DEFER_WRITE_BACK:
            self.table.drain()  # the step returns with every write-back landed: nothing held after it
        self._in_step = False
        self._sample_peak()  # the step's (first iteration only)
        if self._peak_ref is None and not self.copies.synchronous:
            # Frozen from here on: the early loads count in later peaks, and must not raise the limits
            # derived from them.
            self._peak_ref = self._peak_seen
        self.steps += 1
        self.last_stats, self.stats = self.stats, None

    # ------------------------------------------------------------------ a step that did not run

    def _after_step(self):
        """A step DeepSpeed skipped (fp16 overflow, a non-finite gradient norm) never asked for what
        backward loaded: give those buffers back (the host copy is still the current one) and drop
        the stats of what it loaded, so they do not count in the next step."""
        if self._in_step:
            return
        self._early_window = False
        if self.stats is not None or self.table.slots is not None:
            self.released_unused += len(self.table.release_loaded())
            self.table.free_slots()
            self.stats = None

    def _abort_step(self):
        """A step that raised: point every tensor back at the host store and drop the slots, so the
        next step (or a checkpoint) starts from a consistent place."""
        if not self._in_step:
            return
        for i in self.table.in_phase(Phase.ON_DEVICE):
            if self.table[i].host_stale:  # kept on the device (compile mode): still its newest copy
                self.table.mark_updated(i)  # so that it is written back with the rest
        self.synchronize_for_checkpoint()
        self.table.release_loaded()
        for i in self.order:
            self._point_at_host(i, drop_grad=True)
        self.table.free_slots()
        self._in_step = False
        self.stats = None

    # ------------------------------------------------------------------ between steps

    def offload_for_forward(self, sub_groups=None) -> int:
        """Write back what the last step left updated in buffers of its own (``DEFER_WRITE_BACK``;
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

    def _guard(self):
        """Before host state is overwritten: let an in-flight checkpoint write finish reading it."""
        if self.checkpointer is not None:
            self.checkpointer.guard()

    # ------------------------------------------------------------------ tensors

    def _tensor(self, i: int, key: str) -> Optional[torch.Tensor]:
        master = self.opt.fp32_partitioned_groups_flat[i]
        if key == MASTER:
            return master
        return self.base.state.get(master, {}).get(key)

    def _to_host(self, i: int):
        """Copy every existing tensor of sub-group ``i`` into its host slice and point it there;
        per tensor, so no temporary on the device."""
        for key in self.store.slices[i]:
            t = self._tensor(i, key)
            if t is None:
                continue
            _move_into(t, self.store.view(i, key))

    def _all_to_host(self):
        for i in self.order:
            self._to_host(i)

    def _after_load(self):
        """After ``load_state_dict``: the loaded state into the host store, and the state the store
        does not hold (Adam's ``step``) where the step will need it. torch's loader placed it by the
        parameter's device, and an offloaded sub-group's master is on the host while it loads, so a
        fused or capturable Adam would find its ``step`` on the CPU beside device moments."""
        self._all_to_host()
        device = self.acc.current_device_name()
        for i in self.order:
            group = self.base.param_groups[self.opt.sub_group_to_group_id[i]]
            state = self.base.state.get(self.opt.fp32_partitioned_groups_flat[i], {})
            for key, value in state.items():
                if key in self.store.slices[i] or not torch.is_tensor(value):
                    continue
                target = unstored_state_device(key, group, device)
                if target is not None and value.device != torch.device(target):
                    state[key] = value.to(target)

    def _point_at_host(self, i, drop_grad=False):
        for key in self.store.slices[i]:
            t = self._tensor(i, key)
            if t is not None:
                if drop_grad:
                    t.grad = None  # a device gradient would not fit a host tensor
                t.data = self.store.view(i, key)

    def host_resident(self) -> bool:
        """True when every offloaded tensor that exists points at its slice of the host store."""
        return all(
            self._tensor(i, key) is None or self._tensor(i, key).data_ptr() == self.store.view(i, key).data_ptr()
            for i in self.order for key in self.store.slices[i])

    def step_stats(self) -> Optional[Dict[str, float]]:
        """The last step that ran: bytes moved each way, sub-groups loaded early (in backward) and in
        the step, seconds the compute stream waited for loads, updating and writing back; None
        before one. A skipped step leaves the previous step's figures. Reading the timings waits
        for that step's copies (in stream mode they landed before the step returned; compile mode
        defers some write-backs to the next forward)."""
        return None if self.last_stats is None else self.last_stats.resolve()


def unstored_state_device(key: str, group: dict, device: str) -> Optional[str]:
    """Where a loaded state tensor that the host store does not hold belongs: torch's own rule in
    ``Optimizer.load_state_dict`` (``step`` stays where it is unless the group is fused or
    capturable; anything else goes with the parameter), applied as if the parameter were on the
    device, where it is whenever the optimizer runs. None: leave it where it is."""
    if key == "step" and not (group.get("fused") or group.get("capturable")):
        return None
    return device


def _move_into(t: torch.Tensor, view: torch.Tensor):
    """Copy ``t``'s values into ``view`` and point ``t`` at it, unless it points there already."""
    if t.data_ptr() != view.data_ptr():
        view.copy_(t.data)
        t.data = view
