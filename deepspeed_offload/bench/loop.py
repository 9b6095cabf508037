"""The training loop a worker times: one step (with the mode's own wrapping), one synchronized
iteration with its peaks, the pipelined run without synchronization, and the checkpoint timing.

``Loop`` holds what every iteration needs (the engine, the loss of the fixed micro-batch, the
accelerator, the mode); the worker builds it once and calls these in order.
"""

import os
import shutil
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from ..handle import get_handle
from .peaks import Peaks

GiB = 2**30
SPECULATION_COUNTS = ("speculated", "committed", "discarded")  # per iteration, with speculation on


def spread(values):
    """min / median / max of a list of numbers."""
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


@dataclass
class Loop:
    engine: Any
    loss_of: Callable  # engine -> the loss of one forward
    acc: Any  # DeepSpeed's accelerator
    mode: Any  # the Mode being measured
    peaks: Peaks = field(init=False)  # (the runtime resets the peak statistics too: measure within peaks.watching())

    def __post_init__(self):
        self.peaks = Peaks(self.acc)

    def step(self):
        """``engine.step()``; with ``reload_states`` (the offload_states mode) the state comes back
        before it and leaves after it, the same state our modes offload."""
        if self.mode.reload_states:
            self.engine.reload_states()
        self.engine.step()
        if self.mode.reload_states:
            from deepspeed.runtime.zero.offload_config import OffloadStateTypeEnum
            # optimizer states and fp32 masters (the grad buffer must stay for backward)
            self.engine.offload_states(include=[OffloadStateTypeEnum.optim_states, OffloadStateTypeEnum.hp_params])

    def _mark(self, marks, name):
        """The wall clock in microseconds since the epoch (the allocator trace's clock), synchronized."""
        if marks is not None:
            self.acc.synchronize()
            marks[name] = time.time_ns() // 1000

    def iteration(self, marks=None):
        """One synchronized iteration: its times and memory peaks (peak stats reset at its start and
        again after backward). ``marks`` (a dict) gets the clock at the start of forward, backward and
        step and at the end."""
        acc, peaks = self.acc, self.peaks
        acc.synchronize()
        peaks.start()
        t0 = time.perf_counter()
        self._mark(marks, "forward")
        loss = self.loss_of(self.engine)
        self._mark(marks, "backward")
        self.engine.backward(loss)
        acc.synchronize()
        t_bwd = time.perf_counter()
        peak_fwd_bwd = peaks.allocated()
        reserved_fwd_bwd = peaks.reserved()
        peaks.start()
        self._mark(marks, "step")
        self.step()
        acc.synchronize()
        t1 = time.perf_counter()
        self._mark(marks, "end")
        peak_step = peaks.allocated()
        # Reserved too: a block freed while a copy stream still uses it stops counting as allocated
        # at once, but the allocator cannot hand it out again before that copy ends.
        reserved = max(reserved_fwd_bwd, peaks.reserved())
        return {"iter_s": t1 - t0, "step_s": t1 - t_bwd, "fwd_bwd_s": t_bwd - t0, "peak_step_GiB": peak_step / GiB,
                "peak_fwd_bwd_GiB": peak_fwd_bwd / GiB, "peak_iter_GiB": max(peak_fwd_bwd, peak_step) / GiB,
                "peak_reserved_GiB": reserved / GiB,
                "between_GiB": acc.memory_allocated() / GiB, "loss": loss.detach().float().item(),
                **self._speculation_counts()}

    def _speculation_counts(self):
        """With speculation on: what this iteration's step did with the updates from its backward
        (sub-groups speculated, committed, discarded), so its time can be told apart from the others'."""
        handle = get_handle(self.engine)
        if getattr(handle, "speculation", None) is None:
            return {}
        stats = handle.step_stats() or {}
        return {k: stats.get(k, 0) for k in SPECULATION_COUNTS}

    def pipelined(self, iters):
        """``iters`` iterations with no synchronization between them (copies may overlap the next
        forward): the mean over the run (``pipelined_iter_s``, wall clock to the last synchronize),
        each iteration's spread between device events recorded at each iteration's start, and the
        peaks of the run."""
        acc = self.acc
        events = acc.device_name() != "cpu" and acc.Event is not None
        stamps = []
        acc.synchronize()
        self.peaks.start()
        t0 = time.perf_counter()
        for _ in range(iters):
            stamps.append(self._stamp(events))
            self.engine.backward(self.loss_of(self.engine))
            self.step()
        stamps.append(self._stamp(events))
        acc.synchronize()
        wall = (time.perf_counter() - t0) / iters
        # The peaks of real training: a write-back still running in the next forward holds its
        # buffers (allocated until the allocator sees the copy end), which synchronized iterations never show.
        peaks = {"pipelined_peak_GiB": self.peaks.allocated() / GiB,
                 "pipelined_peak_reserved_GiB": self.peaks.reserved() / GiB}
        if events:
            per = [a.elapsed_time(b) / 1e3 for a, b in zip(stamps, stamps[1:])]
        else:
            per = [b - a for a, b in zip(stamps, stamps[1:])]
        s = spread(per)
        return {"pipelined_iter_s": wall, "pipelined_iter_s_min": s["min"], "pipelined_iter_s_median": s["median"],
                "pipelined_iter_s_max": s["max"], **peaks}

    def _stamp(self, events):
        """A device event recorded now (``events``), else the host clock."""
        if not events:
            return time.perf_counter()
        e = self.acc.Event(enable_timing=True)
        e.record()
        return e

    def checkpoint_times(self, handle, root):
        """DeepSpeed's synchronous save against our async one, on the same engine and state: the
        time each save call blocks, the async write's background time and the iterations run during it."""
        import deepspeed_offload
        engine, acc = self.engine, self.acc
        shutil.rmtree(root, ignore_errors=True)
        acc.synchronize()
        t = time.perf_counter()
        handle.checkpointer._orig_save(os.path.join(root, "sync"), tag="t")
        sync_s = time.perf_counter() - t
        shutil.rmtree(os.path.join(root, "sync"))
        acc.synchronize()
        t = time.perf_counter()
        engine.save_checkpoint(os.path.join(root, "async"), tag="t")
        blocking_s = time.perf_counter() - t
        iters = []
        # training goes on while the write runs (up to 10 iterations): each waits only for the host
        # regions it overwrites until the save has copied or written them
        while len(iters) < 3 or (len(iters) < 10 and deepspeed_offload.checkpoint_pending(engine)):
            t = time.perf_counter()
            engine.backward(self.loss_of(engine))
            engine.step()
            acc.synchronize()
            iters.append(time.perf_counter() - t)
        deepspeed_offload.wait_for_checkpoint(engine)
        size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(root) for f in fs)
        shutil.rmtree(root, ignore_errors=True)
        return {"sync_save_s": sync_s, "async_blocking_s": blocking_s,
                "async_background_s": handle.checkpointer.last["background_s"], "iters_during_write_s": iters,
                "copied_aside": handle.checkpointer.stager.copies_aside,
                "aside_reserved_GiB": handle.checkpointer.stager.aside_bytes / GiB,
                "write_phases_s": dict(handle.checkpointer.last["phases"]),
                "async_blocking_over_sync": blocking_s / sync_s, "checkpoint_GiB": size / GiB}

    def colocation_times(self, cycles=3):
        """What an RL trainer sharing its GPU with rollouts pays: ``engine.offload_states()`` of
        everything and ``reload_states()``, ``cycles`` times after a training step (the first
        offload pins DeepSpeed's host buffers: its time is kept apart); the memory allocated before,
        after the offload and the device's free memory then (what a rollout could use)."""
        engine, acc = self.engine, self.acc
        rows = []
        for _ in range(cycles + 1):
            engine.backward(self.loss_of(engine))
            engine.step()
            acc.synchronize()
            before = acc.memory_allocated()
            t = time.perf_counter()
            engine.offload_states()
            acc.synchronize()
            t_off = time.perf_counter()
            after = acc.memory_allocated()
            free = acc.available_memory()
            engine.reload_states()
            acc.synchronize()
            rows.append({"offload_s": t_off - t, "reload_s": time.perf_counter() - t_off, "before_GiB": before / GiB,
                         "after_offload_GiB": after / GiB, "free_during_rollout_GiB": free / GiB})
        first, rest = rows[0], rows[1:]
        off, rel = spread([r["offload_s"] for r in rest]), spread([r["reload_s"] for r in rest])
        return {"colocate_first_offload_s": first["offload_s"], "colocate_offload_s": off["median"],
                "colocate_offload_s_min": off["min"], "colocate_offload_s_max": off["max"],
                "colocate_reload_s": rel["median"], "colocate_reload_s_min": rel["min"],
                "colocate_reload_s_max": rel["max"],
                "colocate_cycle_s": statistics.median(r["offload_s"] + r["reload_s"] for r in rest),
                "colocate_before_GiB": max(r["before_GiB"] for r in rest),
                "colocate_after_offload_GiB": max(r["after_offload_GiB"] for r in rest),
                "colocate_free_GiB": min(r["free_during_rollout_GiB"] for r in rest)}
