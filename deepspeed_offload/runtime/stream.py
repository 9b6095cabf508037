"""Stream mode: the ZeRO-3 step with optimizer state streamed from the host store.

``DeepSpeedZeroOptimizer_Stage3.step()`` walks its sub-groups: ``_prepare_sub_group`` (build the
fp32 gradient), unscale/clip, ``_optimizer_step``, copy the fp32 master into the bf16/fp16
partition, ``_release_sub_group``. We wrap the first and the last of these on the optimizer
instance and leave everything in between to DeepSpeed, so the update is DeepSpeed's own, bit for bit.

Per offloaded sub-group *i*, with two staging slots on the GPU::

    h2d stream:      load i+1 -> slot B          (waits until slot B's previous write-back is done)
    compute stream:  wait(load i); prepare, clip, optimizer.step(), copy to bf16 on slot A
    d2h stream:      write back i from slot A     (waits for the update of i)

The DeepSpeed tensor objects never change: ``fp32_partitioned_groups_flat[i]`` (the key of
``optimizer.state``) and each state tensor get their ``.data`` pointed at the slot for the update
and back at their host slice afterwards. Events order the streams; nothing in the loop synchronizes
the device. The last write-backs may still run during the next forward: the next step's loads, and
anything on the CPU that reads host state (checkpoint, ``safe_get_full_*``), wait for them first.

State the optimizer creates lazily (Adam's moments at step 1) is made by the optimizer on the GPU
for the one sub-group being updated, copied into its slot and written back with it, so the GPU
never holds more than that sub-group's fresh state on top of the slots.

Compile mode adds one thing (``preload`` / ``offload``): a sub-group reloaded during backward into a
buffer of its own skips its slot, is updated in place there, and stays on the device until the next
forward's head writes it back, so both of its copies overlap compute instead of the step.

On the CPU accelerator there are no streams or events: every copy runs synchronously, through the
same code, so CI checks the bookkeeping for real.
"""

import time
from typing import Dict, List, Optional

import torch
from deepspeed.accelerator import get_accelerator
from deepspeed.utils.logging import print_dist

from ..config import OffloadConfig, format_bytes
from .checkpoint import AsyncCheckpointer
from .host_store import MASTER, HostStore

# On a GPU, the resident budget left unspecified keeps this share of the card for everything else.
DERIVED_BUDGET_SPARE = 0.5


class _Streams:
    """The accelerator's streams and events, or synchronous no-ops where it has none."""

    def __init__(self):
        self.acc = get_accelerator()
        self.async_ok = self.acc.Stream is not None and self.acc.device_name() != "cpu"
        self.h2d = self.acc.Stream() if self.async_ok else None
        self.d2h = self.acc.Stream() if self.async_ok else None

    def compute(self):
        return self.acc.current_stream() if self.async_ok else None

    def event(self, stream, timing=False):
        if not self.async_ok:
            return None
        ev = self.acc.Event(enable_timing=timing)
        ev.record(stream)
        return ev

    def wait(self, stream, event):
        if event is not None and stream is not None:
            stream.wait_event(event)

    def on(self, stream):
        return self.acc.stream(stream) if stream is not None else _nullcontext()


class _nullcontext:

    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def probe_state_layout(base_optimizer, group_index, device, dtype) -> Dict[str, torch.dtype]:
    """Which per-parameter tensors ``base_optimizer`` creates for a parameter of ``group_index``.

    Steps the optimizer once on a throwaway parameter (zero gradient) and restores the group's
    hyperparameters afterwards (FusedAdam counts steps in the group): the real parameters, which
    ZeRO-3 keeps out of ``param_groups`` between steps, are not touched."""
    group = base_optimizer.param_groups[group_index]
    saved = dict(group)
    dummy = torch.zeros(8, device=device, dtype=dtype, requires_grad=True)
    dummy.grad = torch.zeros_like(dummy)
    others = [g["params"] for g in base_optimizer.param_groups]
    try:
        for g in base_optimizer.param_groups:
            g["params"] = []
        group["params"] = [dummy]
        base_optimizer.step()
    finally:
        for g, params in zip(base_optimizer.param_groups, others):
            g["params"] = params
        group.clear()
        group.update(saved)
        state = base_optimizer.state.pop(dummy, {})
    return {k: v.dtype for k, v in state.items() if torch.is_tensor(v) and v.shape == dummy.shape}


class StepStats:
    """What one step moved and where its time went. Device timings are read lazily (``resolve``),
    so recording them costs no synchronization."""

    def __init__(self, timing: bool):
        self.timing = timing
        self.bytes_h2d = 0
        self.bytes_d2h = 0
        self.sub_groups = 0
        self.prefetched = 0
        self._spans: Dict[str, List] = {"h2d_wait": [], "update": [], "d2h": []}
        self._cpu: Dict[str, float] = {"h2d_wait": 0.0, "update": 0.0, "d2h": 0.0}

    def span(self, kind, start, end):
        self._spans[kind].append((start, end))

    def add_cpu(self, kind, seconds):
        self._cpu[kind] += seconds

    def resolve(self) -> Dict[str, float]:
        out = {"bytes_h2d": self.bytes_h2d, "bytes_d2h": self.bytes_d2h, "sub_groups": self.sub_groups,
               "prefetched": self.prefetched}
        for kind, spans in self._spans.items():
            each = []
            for start, end in spans:
                end.synchronize()
                each.append(start.elapsed_time(end) / 1000.0)
            out[f"{kind}_s"] = self._cpu[kind] + sum(each)
            if kind == "h2d_wait":
                out["h2d_wait_prefetched_s"] = sum(each[:self.prefetched])
        return out


class StreamMode:
    """Attached to one engine: owns the host store, the staging slots and the hooks."""

    def __init__(self, engine, cfg: OffloadConfig):
        self.engine = engine
        self.opt = opt = engine.optimizer
        self.base = opt.optimizer
        self.cfg = cfg
        self.streams = _Streams()
        acc = self.streams.acc
        masters = opt.fp32_partitioned_groups_flat
        n = len(masters)

        # Without mixed precision the fp32 master *is* the model's partition: it stays on the device.
        self._master_moves = [masters[i] is not opt.fp16_partitioned_groups_flat[i] for i in range(n)]
        states_by_group = {}
        for g in sorted(set(opt.sub_group_to_group_id.values())):
            sample = masters[next(i for i in range(n) if opt.sub_group_to_group_id[i] == g)]
            states_by_group[g] = probe_state_layout(self.base, g, sample.device, sample.dtype)

        def entries(i):
            numel = masters[i].numel()
            out = [(MASTER, masters[i].dtype, numel)] if self._master_moves[i] else []
            out += [(k, dt, numel) for k, dt in states_by_group[opt.sub_group_to_group_id[i]].items()]
            return out

        def nbytes(i):
            return sum(numel * torch.empty(0, dtype=dt).element_size() for _, dt, numel in entries(i))

        budget = self._resident_budget_bytes()
        self.resident: List[int] = []
        kept = 0
        for i in range(n):
            if kept + nbytes(i) <= budget:
                self.resident.append(i)
                kept += nbytes(i)
            else:
                break
        self.order: List[int] = [i for i in range(n) if i not in self.resident and entries(i)]
        self._position = {sg: k for k, sg in enumerate(self.order)}
        self.store = HostStore({i: entries(i) for i in self.order}, cfg.pin_memory)

        # Move what exists now (masters; states too if the optimizer already stepped or loaded).
        self._all_to_host()
        acc.empty_cache()

        # Two slots, each as large as the largest sub-group's region, per dtype.
        self._slot_numel: Dict[torch.dtype, int] = {}
        for i in self.order:
            for dt, numel in self.store.region_numel(i).items():
                self._slot_numel[dt] = max(self._slot_numel.get(dt, 0), numel)
        self.slot_bytes = sum(n * torch.empty(0, dtype=dt).element_size() for dt, n in self._slot_numel.items())
        self._slots: Optional[List[Dict[torch.dtype, torch.Tensor]]] = None
        self._loaded: Dict[int, object] = {}  # sub_group -> load-done event (or None on CPU), while in a slot
        self._slot_free: List[object] = [None, None]  # last write-back event of each slot
        self._host_written = None  # the newest write-back: what a CPU reader of host state waits for
        self._written: Dict[int, object] = {}  # sub_group -> its latest write-back event
        self._preloaded: Dict[int, tuple] = {}  # sub_group -> (own buffers, load-done event), from preload()
        self._in_buffers: Dict[int, dict] = {}  # sub_group -> own buffers, while the step updates it there
        self._dirty: Dict[int, tuple] = {}  # sub_group -> (own buffers, update-done event), until offload()
        self._in_step = False
        self.steps = 0
        self.stats: Optional[StepStats] = None
        self.last_stats: Optional[StepStats] = None

        self._hook()
        self.checkpointer = AsyncCheckpointer(engine, self.store.buffers.values()) if cfg.async_checkpoint else None
        pinned = ", ".join(f"{dt}: {format_bytes(b)}" for dt, b in self.store.nbytes_by_dtype.items())
        print_dist(f"[deepspeed-offload] stream mode: {len(self.order)} of {n} sub-groups offloaded "
                   f"({len(self.resident)} resident within the budget), "
                   f"{sum(len(self.store.slices[i]) for i in self.order)} tensors, host store {pinned} "
                   f"(pinned={cfg.pin_memory}), 2 staging slots of {format_bytes(self.slot_bytes)}",
                   ranks=[0])

    # ------------------------------------------------------------------ budget and layout

    def _resident_budget_bytes(self) -> int:
        if self.cfg.memory_budget_gb is not None:
            return int(self.cfg.memory_budget_gb * 2**30)
        acc = self.streams.acc
        if not self.streams.async_ok:
            return 0  # device memory is host memory: residency saves nothing, offloading exercises the path
        total = acc.total_memory()
        free = acc.available_memory()
        return max(0, int(free - DERIVED_BUDGET_SPARE * total))

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
            view = self.store.view(i, key)
            if t.data_ptr() != view.data_ptr():
                view.copy_(t.data)
                t.data = view

    # ------------------------------------------------------------------ the hooks

    def _hook(self):
        opt = self.opt
        self._orig = {name: getattr(opt, name) for name in ("_prepare_sub_group", "_release_sub_group")}
        opt._prepare_sub_group = self._prepare_sub_group
        opt._release_sub_group = self._release_sub_group
        # Readers of host state wait for the last write-backs; writers also wait for an in-flight
        # checkpoint write and drop prefetched slots (they hold the old values).
        opt.state_dict = self._around(opt.state_dict)
        opt._get_fp32_opt_state_partition = self._around(opt._get_fp32_opt_state_partition)
        for name in ("_restore_from_bit16_weights", "_restore_from_fp32_weights", "set_full_hp_param",
                     "set_local_hp_param"):
            setattr(opt, name, self._around(getattr(opt, name), writes=True))
        opt.load_state_dict = self._around(opt.load_state_dict, writes=True, after=self._all_to_host)
        opt.step = self._around(opt.step, drain=False, on_error=self._abort_step, after=self._after_step)

        orig_prologue = self.engine._backward_prologue

        def backward_prologue(*args, **kwargs):
            # Both engine.backward(loss) and a plain loss.backward() come through here, once.
            if self.cfg.prefetch and self.engine.is_gradient_accumulation_boundary():
                self.prefetch()
            return orig_prologue(*args, **kwargs)

        self.engine._backward_prologue = backward_prologue
        for name in ("offload_states", "reload_states"):
            setattr(self.engine, name, self._refuse(name))

    def _around(self, fn, drain=True, writes=False, after=None, on_error=None):

        def wrapper(*args, **kwargs):
            if drain and not self._in_step:
                self.drain()
                if writes:
                    self._guard()
                    self._loaded.clear()
                    self._preloaded.clear()
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

    def _all_to_host(self):
        for i in self.order:
            self._to_host(i)

    def _abort_step(self):
        """A step that raised: point every tensor back at the host store and drop the slots, so the
        next step (or a checkpoint) starts from a consistent place."""
        if not self._in_step:
            return
        self.drain()
        for i in self.order:
            self._point_at_host(i, drop_grad=True)
        self._loaded.clear()
        self._preloaded.clear()
        self._in_buffers.clear()
        self._close_step()
        self.stats = None

    def _after_step(self):
        """A step DeepSpeed skipped (fp16 overflow, a non-finite gradient norm) never asked for what
        backward loaded: give those buffers back, the host copy is still the current one."""
        if self._in_step:
            return
        self._preloaded.clear()
        if self._slots is not None:
            self._loaded.clear()
            self._slots = None
            self._slot_free = [None, None]

    def _guard(self):
        """Before host state is overwritten: let an in-flight checkpoint write finish reading it."""
        if self.checkpointer is not None:
            self.checkpointer.guard()

    @staticmethod
    def _refuse(name):

        def refuse(*args, **kwargs):
            raise RuntimeError(f"engine.{name}() is not available with deepspeed-offload attached: the optimizer "
                               "state already lives in host memory and streams through each step")

        return refuse

    def _prepare_sub_group(self, i, timer_names):
        if i in self._position:
            if not self._in_step:
                self._begin_step()
            self._bring_in(i)
            k = self._position[i] + 1
            if k < len(self.order):
                self._load(self.order[k])
        return self._orig["_prepare_sub_group"](i, timer_names)

    def _release_sub_group(self, i, timer_names):
        self._orig["_release_sub_group"](i, timer_names)
        if i in self._position:
            self._write_back(i)
            if i == self.order[-1]:
                self._end_step()

    # ------------------------------------------------------------------ the streamed step

    def _allocate_slots(self):
        # On the compute stream, so between steps the caching allocator gives the blocks to activations;
        # record_stream makes it wait for the copy streams before it does.
        acc = self.streams.acc
        device = acc.current_device_name()
        self._slots = [{dt: torch.empty(n, dtype=dt, device=device) for dt, n in self._slot_numel.items()}
                       for _ in range(2)]
        st = self.streams
        if st.async_ok:
            for slot in self._slots:
                for buf in slot.values():
                    buf.record_stream(st.h2d)
                    buf.record_stream(st.d2h)
        # The blocks may still be in use by queued compute work: the first load waits for it.
        allocated = st.event(st.compute())
        self._slot_free = [allocated, allocated]

    def _slot_of(self, i):
        return self._slots[self._position[i] % 2]

    def _slot_view(self, i, key):
        s = self.store.slices[i][key]
        bufs = self._in_buffers.get(i) or self._slot_of(i)
        return bufs[s.dtype].narrow(0, s.offset, s.numel)

    def _load(self, i):
        """H2D of sub-group ``i`` into its slot, on the h2d stream."""
        if i in self._loaded or i in self._preloaded:
            return
        if self._slots is None:
            self._allocate_slots()
        st = self.streams
        if self.stats is None:
            self.stats = StepStats(timing=st.async_ok)
        slot_index = self._position[i] % 2
        t0 = time.perf_counter()
        with st.on(st.h2d):
            st.wait(st.h2d, self._slot_free[slot_index])
            st.wait(st.h2d, self._written.get(i))
            for dt, numel in self.store.region_numel(i).items():
                self._slots[slot_index][dt].narrow(0, 0, numel).copy_(self.store.region(i, dt), non_blocking=True)
                self.stats.bytes_h2d += self.store.region(i, dt).nbytes
            self._loaded[i] = st.event(st.h2d)
        if not st.async_ok:
            self.stats.add_cpu("h2d_wait", time.perf_counter() - t0)

    def prefetch(self):
        """Start loading the first offloaded sub-groups, one per slot (called as the last backward
        starts, so the copies overlap it)."""
        if not self.order or self._in_step:
            return
        acc = self.streams.acc
        if self.streams.async_ok and acc.max_memory_allocated() + 2 * self.slot_bytes > 0.9 * acc.total_memory():
            return  # the peak seen so far plus both slots would not fit: load at the step instead
        first = [i for i in self.order[:2] if i not in self._preloaded and i not in self._dirty]
        for i in first:
            self._load(i)
        if first:
            self.stats.prefetched = len(first)

    def preload(self, i) -> int:
        """H2D of sub-group ``i`` into buffers of its own, ahead of the step (compile mode: from a
        reload op in backward). Returns the bytes it started to copy (0 if already there)."""
        if i in self._preloaded or i in self._loaded or i in self._dirty or self._in_step:
            return 0
        st = self.streams
        device = st.acc.current_device_name()
        # Allocated on the compute stream, which may still be reading what the allocator just gave
        # back: the copy waits for the compute work queued so far before it writes.
        bufs = {dt: torch.empty(numel, dtype=dt, device=device) for dt, numel in self.store.region_numel(i).items()}
        allocated = st.event(st.compute())
        copied = 0
        with st.on(st.h2d):
            st.wait(st.h2d, allocated)
            st.wait(st.h2d, self._written.get(i))
            for dt, buf in bufs.items():
                buf.copy_(self.store.region(i, dt), non_blocking=True)
                if st.async_ok:
                    buf.record_stream(st.h2d)
                copied += buf.nbytes
            self._preloaded[i] = (bufs, st.event(st.h2d))
        return copied

    def preloaded_event(self):
        """The newest preload's copy-done event (None when nothing is preloaded or on the CPU)."""
        return next(reversed(self._preloaded.values()))[1] if self._preloaded else None

    def offload(self, i) -> int:
        """D2H of a sub-group the last step updated in its own buffers, then back to the host store.
        The buffers return to the allocator once the copy is done (record_stream), nobody waits."""
        if i not in self._dirty:
            return 0
        self._guard()  # an async checkpoint may still be reading the host copy this overwrites
        bufs, updated = self._dirty.pop(i)
        st = self.streams
        with st.on(st.d2h):
            st.wait(st.d2h, updated)
            for dt, buf in bufs.items():
                self.store.region(i, dt).copy_(buf, non_blocking=True)
                if st.async_ok:
                    buf.record_stream(st.d2h)
            done = st.event(st.d2h)
        self._written[i] = self._host_written = done
        self._point_at_host(i)
        return sum(b.nbytes for b in bufs.values())

    def _offload_dirty(self):
        for i in list(self._dirty):
            self.offload(i)

    def _begin_step(self):
        self._offload_dirty()  # no forward ran since the last step: those buffers are still the newest copy
        self._in_step = True
        if self.stats is None:
            self.stats = StepStats(timing=self.streams.async_ok)
        self._load(self.order[0])

    def _bring_in(self, i):
        st = self.streams
        bufs, ready = self._preloaded.pop(i) if i in self._preloaded else (None, self._loaded.pop(i))
        if st.async_ok:
            before = st.event(st.compute(), timing=True)
            st.wait(st.compute(), ready)
            self.stats.span("h2d_wait", before, st.event(st.compute(), timing=True))
            self._update_start = st.event(st.compute(), timing=True)
        else:
            self._update_t0 = time.perf_counter()
        if bufs is not None:
            self._in_buffers[i] = bufs
        for key in self.store.slices[i]:
            t = self._tensor(i, key)
            if t is not None:
                t.data = self._slot_view(i, key)

    def _write_back(self, i):
        """D2H of sub-group ``i`` from its slot, on the d2h stream, once its update is done."""
        st = self.streams
        for key in self.store.slices[i]:
            t = self._tensor(i, key)
            if t is None:
                continue
            view = self._slot_view(i, key)
            if t.data_ptr() != view.data_ptr():
                # Created by this step (lazy optimizer state): into the slot, so it leaves with the rest.
                if t.shape != view.shape or t.dtype != view.dtype:
                    raise RuntimeError(f"deepspeed-offload: optimizer state '{key}' of sub-group {i} is "
                                       f"{tuple(t.shape)} {t.dtype}, the host store expected {tuple(view.shape)} "
                                       f"{view.dtype}; this optimizer's state is not per-parameter tensors")
                view.copy_(t.data)
                t.data = view
        slot_index = self._position[i] % 2
        if self.stats.sub_groups == 0:
            self._guard()  # the first write to the host store in this step
        if st.async_ok:
            self.stats.span("update", self._update_start, st.event(st.compute(), timing=True))
            updated = st.event(st.compute())
        else:
            self.stats.add_cpu("update", time.perf_counter() - self._update_t0)
            updated = None
        if i in self._in_buffers:
            # Updated in its own buffers: the write-back waits for offload(), at the next forward's head.
            self._dirty[i] = (self._in_buffers.pop(i), updated)
            self.stats.sub_groups += 1
            return
        t0 = time.perf_counter()
        with st.on(st.d2h):
            st.wait(st.d2h, updated)
            start = st.event(st.d2h, timing=True)
            for dt, numel in self.store.region_numel(i).items():
                self.store.region(i, dt).copy_(self._slots[slot_index][dt].narrow(0, 0, numel), non_blocking=True)
                self.stats.bytes_d2h += self.store.region(i, dt).nbytes
            done = st.event(st.d2h, timing=True)
        if st.async_ok:
            self.stats.span("d2h", start, done)
        else:
            self.stats.add_cpu("d2h", time.perf_counter() - t0)
        self._slot_free[slot_index] = done
        self._written[i] = self._host_written = done
        self._point_at_host(i)
        self.stats.sub_groups += 1

    def _point_at_host(self, i, drop_grad=False):
        for key in self.store.slices[i]:
            t = self._tensor(i, key)
            if t is not None:
                if drop_grad:
                    t.grad = None  # a device gradient would not fit a host tensor
                t.data = self.store.view(i, key)

    def _close_step(self):
        self._in_step = False
        self._slots = None  # back to the allocator; record_stream holds the blocks until the copies end
        self._slot_free = [None, None]

    def _end_step(self):
        self._close_step()
        self.steps += 1
        self.last_stats, self.stats = self.stats, None

    def host_resident(self) -> bool:
        """True when every offloaded tensor that exists points at its slice of the host store."""
        return all(
            self._tensor(i, key) is None or self._tensor(i, key).data_ptr() == self.store.view(i, key).data_ptr()
            for i in self.order for key in self.store.slices[i])

    def drain(self):
        """Write back what the last step left on the device, and block until every write-back to the
        host store has landed."""
        self._offload_dirty()
        if self._host_written is not None:
            self._host_written.synchronize()

    def step_stats(self) -> Optional[Dict[str, float]]:
        """Bytes moved and seconds spent (H2D wait, update, D2H) in the last step; None before one."""
        return None if self.last_stats is None else self.last_stats.resolve()
