"""The memory timeline: one more iteration under the CUDA allocator's history recorder, and the
bytes in use over it rebuilt from the recorder's trace; and, over every iteration of a mode
(``--memory-history``), where the allocator reserved more memory: which allocation, in which
iteration and phase, from which of DeepSpeed's or our calls."""

import contextlib
import re

import torch

GiB = 2**30
# Entries the allocator's history keeps for the traced iteration (a ring buffer: older ones drop).
TRACE_MAX_ENTRIES = 2_000_000


def traced(loop):
    """One more iteration of ``loop`` (a ``loop.Loop``) under the CUDA allocator's history recorder:
    allocated GiB over time from its trace (``timeline_from_trace``), with the
    forward/backward/step marks and the iteration's own row. None off CUDA."""
    if loop.acc.device_name() != "cuda":
        return None
    marks = {}
    with recording(loop.acc, stacks=False) as got:
        base = torch.cuda.memory_stats()["active_bytes.all.current"]
        row = loop.iteration(marks)
    out = timeline_from_trace(got["trace"], marks, base, max_entries=TRACE_MAX_ENTRIES)
    out["row"] = row
    return out


def timeline_from_trace(trace, marks, base_bytes, max_points=3000, max_entries=None):
    """Rebuild the bytes in use over one iteration from the allocator's trace entries.

    ``trace``: ``torch.cuda.memory._snapshot()["device_traces"][device]``, entries with ``action``,
    ``size`` and ``time_us`` (the CPU-side time of the allocator call, in microseconds since the
    epoch: torch converts its cycle counter with a system_clock calibration, so ``time.time_ns() //
    1000`` is the same clock). ``marks``: ``forward``, ``backward``, ``step``, ``end`` on that clock.
    ``base_bytes``: the bytes in use at ``forward`` (``active_bytes.all.current``). A block counts
    from its ``alloc`` to its ``free_completed`` (a block freed while another stream still uses it is
    not reusable before that), so the curve is the allocator's active bytes; entries outside the
    marks are left out. Long series keep each bucket's highest point, so the peak survives."""
    start, end = marks["forward"], marks["end"]
    inside = sorted((e for e in trace if e.get("action") in ("alloc", "free_completed") and start <= e["time_us"] <= end),
                    key=lambda e: e["time_us"])  # stable: entries of one microsecond keep the recorded order
    t, y, cur = [0.0], [base_bytes], base_bytes
    for e in inside:
        cur += e["size"] if e["action"] == "alloc" else -e["size"]
        t.append((e["time_us"] - start) / 1e6)
        y.append(cur)
    t.append((end - start) / 1e6)
    y.append(cur)
    peak = max(y)
    if len(t) > max_points:
        size = -(-len(t) // max_points)
        keep = [0] + [max(range(i, min(i + size, len(t))), key=y.__getitem__) for i in range(1, len(t) - 1, size)]
        keep = sorted(set(keep + [len(t) - 1]))
        t, y = [t[i] for i in keep], [y[i] for i in keep]
    first = min((e["time_us"] for e in trace if "time_us" in e), default=None)
    return {"t_s": t, "allocated_GiB": [v / GiB for v in y], "peak_GiB": peak / GiB, "events": len(inside),
            "marks_s": {k: (v - start) / 1e6 for k, v in marks.items()},
            # the ring buffer wrapped before the iteration ended: its start is missing
            "truncated": bool(max_entries and len(trace) >= max_entries and first is not None and first > start)}


# The trace's actions that change the reserved bytes: a segment of its own (cudaMalloc, cudaFree), or
# pages mapped into or out of an expandable segment (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True).
RESERVES = {"segment_alloc": 1, "segment_map": 1, "segment_free": -1, "segment_unmap": -1}
# ... and those that change the bytes in use (a block counts until the streams that used it are done).
IN_USE = {"alloc": 1, "free_completed": -1}
# The Python frames kept per growth: DeepSpeed's and ours (a file inside either package), innermost first.
OURS = re.compile(r"/(deepspeed|deepspeed_offload)/")
GROWTH_FRAMES = 8


@contextlib.contextmanager
def recording(acc, stacks=True, max_entries=TRACE_MAX_ENTRIES):
    """The CUDA allocator's history over the block (``stacks``: with each allocation's Python stack,
    slower). Yields a
    dict that gets, at the block's end, ``trace`` (the device's entries), ``active_end`` and
    ``reserved_end`` (bytes in use and reserved then) and ``truncated`` (the ring buffer dropped the
    oldest entries); nothing off CUDA."""
    got = {}
    if acc.device_name() != "cuda":
        yield got
        return
    mem = torch.cuda.memory
    acc.synchronize()
    mem._record_memory_history(enabled="all", context="alloc" if stacks else None, stacks="python",
                               max_entries=max_entries, clear_history=True)
    try:
        yield got
        acc.synchronize()
        trace = mem._snapshot()["device_traces"][torch.cuda.current_device()]
        got.update(trace=trace, active_end=torch.cuda.memory_stats()["active_bytes.all.current"],
                   reserved_end=torch.cuda.memory_reserved(), truncated=len(trace) >= max_entries)
    finally:
        mem._record_memory_history(enabled=None)


def growth(trace, active_end, reserved_end, marks, after=-1):
    """Each time the allocator reserved more memory (a new segment, or pages mapped into an expandable
    one: ``RESERVES``) from iteration ``after`` on (-1: also before the first): ``iteration`` (its
    index in ``marks``; ``len(marks)`` for the pipelined run after them), ``phase`` (forward,
    backward, step, after), ``MiB`` (reserved by it), ``stream`` (the pool it went to), and just before
    it ``reserved_GiB`` and ``active_GiB`` (in use, a block until its ``free_completed``: the
    difference was free, reusable, and still could not serve the allocation), and ``frames``
    (DeepSpeed's and our frames of the allocation, innermost first). Both byte counts are rebuilt
    backwards from the end's (``active_end``, ``reserved_end``), so they hold where the ring buffer
    dropped the oldest entries. ``marks``: one dict per iteration with the clock at ``forward``,
    ``backward``, ``step`` and ``end`` (``loop.Loop.iteration``)."""
    entries = sorted((e for e in trace if "time_us" in e), key=lambda e: e["time_us"])
    # at the trace's start: the end's, less what the trace added
    reserved = reserved_end - sum(RESERVES.get(e["action"], 0) * e["size"] for e in entries)
    active = active_end - sum(IN_USE.get(e["action"], 0) * e["size"] for e in entries)
    out = []
    for e in entries:
        action = e["action"]
        if RESERVES.get(action, 0) > 0:
            it, phase = _when(e["time_us"], marks)
            if it >= after:
                out.append({"iteration": it, "phase": phase, "MiB": e["size"] / 2**20, "stream": e.get("stream"),
                            "reserved_GiB": reserved / GiB, "active_GiB": active / GiB,
                            "frames": [f"{OURS.split(f['filename'])[-1]}:{f['line']} {f['name']}"
                                       for f in e.get("frames", []) if OURS.search(f["filename"])][:GROWTH_FRAMES]})
        reserved += RESERVES.get(action, 0) * e["size"]
        active += IN_USE.get(action, 0) * e["size"]
    return out


def _when(t_us, marks):
    """(iteration, phase) of a clock value: the iteration whose forward began last at or before it,
    and the last of its marks passed (``after``: between its end and the next forward); after the
    last iteration's end, ``(len(marks), "pipelined")``."""
    it, phase = -1, "before"
    for k, m in enumerate(marks):
        if t_us < m["forward"]:
            break
        it = k
        phase = [name for name in ("forward", "backward", "step", "after")
                 if m["end" if name == "after" else name] <= t_us][-1]
    if marks and it == len(marks) - 1 and phase == "after":
        return len(marks), "pipelined"
    return it, phase
