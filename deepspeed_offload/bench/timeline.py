"""The memory timeline: one more iteration under the CUDA allocator's history recorder, and the
bytes in use over it rebuilt from the recorder's trace."""

import torch

GiB = 2**30
# Entries the allocator's history keeps for the traced iteration (a ring buffer: older ones drop).
TRACE_MAX_ENTRIES = 2_000_000


def traced(loop):
    """One more iteration of ``loop`` (a ``loop.Loop``) under the CUDA allocator's history recorder:
    allocated GiB over time from its trace (``timeline_from_trace``), with the
    forward/backward/step marks and the iteration's own row. None off CUDA."""
    acc = loop.acc
    if acc.device_name() != "cuda":
        return None
    mem = torch.cuda.memory
    acc.synchronize()
    record = dict(enabled="all", context=None, stacks="python", max_entries=TRACE_MAX_ENTRIES)
    try:
        mem._record_memory_history(clear_history=True, **record)
    except TypeError:  # a torch without clear_history: events from before the start are dropped by time
        mem._record_memory_history(**record)
    try:
        base = torch.cuda.memory_stats()["active_bytes.all.current"]
        marks = {}
        row = loop.iteration(marks)
        trace = mem._snapshot()["device_traces"][torch.cuda.current_device()]
    finally:
        mem._record_memory_history(enabled=None)
    out = timeline_from_trace(trace, marks, base, max_entries=TRACE_MAX_ENTRIES)
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
