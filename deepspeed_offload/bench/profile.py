"""The GPU timeline of an iteration, per stream: ``--profile DIR`` runs two more (unsynchronized)
iterations of each traced mode under ``torch.profiler``, writes the Chrome trace (open it in
Perfetto) and summarizes the last iteration: when forward, backward and the step ran on the GPU, what
each stream (compute, DeepSpeed's reduction stream, our copy and side streams) did in each of them, and
where the CPU waited for the device (``host_waits``: each phase's synchronizing calls by the operator
that made them; a wait there stops the CPU from queueing more work, so the GPU idles after it), and why the
compute stream idled in each phase (``compute_idle``: launched late by the CPU, or launched in time and
waiting on the device; what the launching thread ran meanwhile). One more iteration under torch.cuda's
sync debug mode names the Python line of each such call (``sync_sites``).

``python -m deepspeed_offload.bench.profile TRACE.json.gz`` prints the summary of a saved trace.
"""

import bisect
import gzip
import json
import os
import re
import sys
import traceback
import warnings

PHASES = ("forward", "backward", "step")
GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
# Runtime calls that hold the calling CPU thread until the device (or the driver) is done: a stream's or
# an event's or the device's synchronization (``torch.tensor(x, device=...)``, ``.item()``, a copy to
# pageable memory), and the driver's allocations and (un)registrations of memory.
HOST_WAITS = ("cudaStreamSynchronize", "cudaEventSynchronize", "cudaDeviceSynchronize", "cudaMalloc", "cudaFree",
              "cudaHostAlloc", "cudaFreeHost", "cudaHostRegister", "cudaHostUnregister")


def profiled(loop, path, iters=2):
    """``iters`` iterations of ``loop`` under the profiler, each phase in a ``record_function``
    range; the trace gzipped into ``path``; returns the summary (None off CUDA)."""
    if loop.acc.device_name() != "cuda":
        return None
    from torch.profiler import ProfilerActivity, profile, record_function
    loop.acc.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            with record_function("forward"):
                loss = loop.loss_of(loop.engine)
            with record_function("backward"):
                loop.engine.backward(loss)
            with record_function("step"):
                loop.step()
        loop.acc.synchronize()
    raw = path + ".tmp.json"
    prof.export_chrome_trace(raw)
    with open(raw, "rb") as f:
        trace = json.load(f)
    with gzip.open(path, "wb") as f:
        f.write(json.dumps(trace).encode())
    os.remove(raw)
    return summarize(trace)


# What torch.cuda's sync debug mode warns with: a stream's or the device's synchronization, a copy that
# waits for one (``torch.tensor(x, device=...)``, ``.item()``); an event's synchronization is not flagged.
SYNC_WARNING = "synchronizing CUDA operation"


def sync_sites(loop):
    """One more iteration with ``torch.cuda.set_sync_debug_mode("warn")``: each phase's synchronizing calls
    by the Python line that made them (``collect_sites``); None off CUDA."""
    if loop.acc.device_name() != "cuda":
        return None
    import torch
    phase = {"now": None}

    def iteration():
        phase["now"] = "forward"
        loss = loop.loss_of(loop.engine)
        phase["now"] = "backward"
        loop.engine.backward(loss)
        phase["now"] = "step"
        loop.step()
        phase["now"] = None

    loop.acc.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        return collect_sites(iteration, phase)
    finally:
        torch.cuda.set_sync_debug_mode("default")
        loop.acc.synchronize()


def collect_sites(run, phase, match=SYNC_WARNING):
    """Runs ``run()``; every warning whose text holds ``match`` while ``phase["now"]`` names a phase is
    counted under that phase and the two innermost frames of the thread that raised it outside torch,
    the warnings machinery and this module (the line, then its caller): ``{phase: {"path:line function <
    path:line function": count}}``, most first; outside a phase, not counted. Other warnings go on to
    where they would have gone."""
    sites, shown = {}, warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None):
        if match not in str(message):
            return shown(message, category, filename, lineno, file, line)
        if phase["now"] is None:
            return  # (ours: the debug mode's, between the phases)
        ours = [f for f in reversed(traceback.extract_stack()) if not _library_frame(f.filename)][:2]
        key = " < ".join(f"{_short(f.filename)}:{f.lineno} {f.name}" for f in ours) or "?"
        counts = sites.setdefault(phase["now"], {})
        counts[key] = counts.get(key, 0) + 1

    with warnings.catch_warnings():
        warnings.filterwarnings("always", message=".*" + re.escape(match))  # every one (others: as filtered)
        warnings.showwarning = show
        run()
    return {p: dict(sorted(c.items(), key=lambda kv: -kv[1])) for p, c in sites.items()}


def _library_frame(filename):
    import torch
    path = os.path.abspath(filename)
    return (path.startswith(os.path.dirname(os.path.abspath(torch.__file__)) + os.sep)
            or path == os.path.abspath(warnings.__file__) or path == os.path.abspath(__file__))


def _short(filename):
    """A path from its package on (``deepspeed/runtime/zero/stage3.py``), else as it is."""
    parts = filename.split(os.sep)
    for anchor in ("site-packages", "dist-packages"):
        if anchor in parts:
            return os.sep.join(parts[len(parts) - parts[::-1].index(anchor):])
    return os.path.relpath(filename) if os.path.isabs(filename) else filename


def _union(intervals):
    total, end = 0.0, None
    for a, b in sorted(intervals):
        if end is None or a > end:
            total += b - a
            end = b
        elif b > end:
            total += b - end
            end = b
    return total


def summarize(trace):
    """The last iteration of a Chrome trace from ``profiled``: each phase's span on the GPU (forward
    and step: the ``gpu_user_annotation`` of their ranges, one per stream that ran their work, taken
    together; else the CPU ranges; backward: between them) and, per stream, the seconds it was
    busy in each phase and after the step, and what it launched in this iteration: GB copied each
    way, seconds of kernels."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "ts" in e and "dur" in e]
    spans = {"gpu_user_annotation": {}, "user_annotation": {}}
    for e in events:
        if e.get("cat") in spans and e.get("name") in PHASES:
            spans[e["cat"]].setdefault(e["name"], []).append((e["ts"], e["ts"] + e["dur"]))
    found = next((f for f in spans.values() if all(p in f for p in PHASES)), None)
    if found is None:
        return {"error": "no forward/backward/step ranges in the trace"}
    # The last iteration: nothing of it runs before its forward is launched (the main thread's range),
    # and its phases' annotations begin with the first of its forward's on the GPU; a phase's span runs
    # from the first of its annotations to the end of the last (the step's copies and updates run on
    # other streams than its compute, each annotated apart).
    cpu = spans["user_annotation"].get("forward")
    launched = max(a for a, _ in cpu) if cpu else max(a for a, _ in found["forward"])
    start = min((a for a, _ in found["forward"] if a >= launched), default=launched)
    phase = {}
    for p in PHASES:
        mine = [s for s in found[p] if s[0] >= start]
        phase[p] = (min(a for a, _ in mine), max(b for _, b in mine)) if mine else None
    if any(v is None for v in phase.values()):
        return {"error": "no forward/backward/step ranges in the trace's last iteration"}
    gpu = [e for e in events if e.get("cat") in GPU_CATS and e["ts"] + e["dur"] >= start]
    end = max([e["ts"] + e["dur"] for e in gpu] + [phase["step"][1]])
    # Backward's kernels come from autograd's device thread, outside the main thread's range: its
    # window is what lies between forward's end and the step's start.
    windows = {"forward": phase["forward"], "backward": (phase["forward"][1], phase["step"][0]),
               "step": phase["step"], "after_step": (phase["step"][1], end)}
    streams = {}
    for e in gpu:
        sid = (e.get("args") or {}).get("stream", e.get("tid"))
        s = streams.setdefault(sid, {"intervals": [], "h2d_GB": 0.0, "d2h_GB": 0.0, "kernel_s": 0.0})
        s["intervals"].append((e["ts"], e["ts"] + e["dur"]))
        if e["ts"] < start:
            continue  # the last iteration's work, still running: busy here, counted there
        nbytes = (e.get("args") or {}).get("bytes", 0) or 0
        name = e.get("name", "")
        if "HtoD" in name:
            s["h2d_GB"] += nbytes / 1e9
        elif "DtoH" in name:
            s["d2h_GB"] += nbytes / 1e9
        elif e.get("cat") == "kernel":
            s["kernel_s"] += e["dur"] / 1e6
    out_streams = []
    for sid, s in sorted(streams.items(), key=lambda kv: -sum(b - a for a, b in kv[1]["intervals"])):
        busy = {w: _union([(max(a, lo), min(b, hi)) for a, b in s["intervals"] if b > lo and a < hi]) / 1e6
                for w, (lo, hi) in windows.items()}
        out_streams.append({"stream": sid, "busy_s": {k: round(v, 6) for k, v in busy.items()},
                            "kernel_s": round(s["kernel_s"], 6), "h2d_GB": round(s["h2d_GB"], 3),
                            "d2h_GB": round(s["d2h_GB"], 3),
                            "first_s": round((min(a for a, _ in s["intervals"]) - start) / 1e6, 6),
                            "last_s": round((max(b for _, b in s["intervals"]) - start) / 1e6, 6)})
    return {"iteration_s": round((end - start) / 1e6, 6),
            "phases_s": {w: [round((lo - start) / 1e6, 6), round((hi - start) / 1e6, 6)] for w, (lo, hi) in windows.items()},
            "streams": out_streams, "host_waits": host_waits(events, spans["user_annotation"]),
            "compute_idle": compute_idle(events, windows, streams)}


# Gaps on the compute stream shorter than this are the launch pipeline's, not idling.
MIN_GAP_US = 20
HOST_CATS = ("cpu_op", "cuda_runtime", "cuda_driver", "user_annotation", "python_function")


def compute_idle(events, windows, streams, top=8):
    """Why the compute stream (the one with the most kernel time) idled in each phase: every gap between
    its operations (over ``MIN_GAP_US``) split into the part before the next operation was launched
    (``host_late_s``: the CPU thread that launched it was busy elsewhere, so the GPU had nothing queued)
    and the part after (``device_wait_s``: queued in time, held by a wait on another stream's event);
    ``host_late_by``: what that thread ran during the late parts, by the innermost operator (its self
    time: ``torch::autograd::AccumulateGrad``'s is the Python of the gradient hooks; ``python``: no
    operator at all), the ``top`` most."""
    compute = max(streams, key=lambda sid: streams[sid]["kernel_s"], default=None)
    if compute is None:
        return None
    launches = {(e.get("args") or {}).get("correlation"): e for e in events
                if e.get("cat") in ("cuda_runtime", "cuda_driver") and (e.get("args") or {}).get("correlation") is not None}
    ops = sorted((e for e in events if e.get("cat") in GPU_CATS and (e.get("args") or {}).get("stream", e.get("tid")) == compute),
                 key=lambda e: e["ts"])
    segments = {}  # per CPU thread: its innermost operator over time (``_innermost``)
    out = {}
    for phase, (lo, hi) in windows.items():
        if phase == "after_step":
            continue
        row, late_by, end = {"idle_s": 0.0, "host_late_s": 0.0, "device_wait_s": 0.0}, {}, lo
        for e in ops:
            if e["ts"] < lo or e["ts"] >= hi:
                continue
            gap = e["ts"] - end
            if gap > MIN_GAP_US:
                launch = launches.get((e.get("args") or {}).get("correlation"))
                launched = launch["ts"] if launch is not None else e["ts"]
                late = max(0.0, min(launched, e["ts"]) - end)
                row["idle_s"] += gap
                row["host_late_s"] += late
                row["device_wait_s"] += gap - late
                if late > 0 and launch is not None:
                    tid = launch.get("tid")
                    if tid not in segments:
                        segments[tid] = _innermost([x for x in events if x.get("tid") == tid and x.get("cat") in HOST_CATS])
                    _attribute(segments[tid], end, end + late, late_by)
            end = max(end, e["ts"] + e["dur"])
        row = {k: round(v / 1e6, 6) for k, v in row.items()}
        row["host_late_by"] = {k: round(v / 1e6, 6) for k, v in sorted(late_by.items(), key=lambda kv: -kv[1])[:top]}
        out[phase] = row
    return out


def _innermost(thread_events):
    """A thread's events (nested ranges) as the sequence of what ran innermost: ``(start, end, name)``
    in order, and their starts."""
    segments, stack = [], []
    t = None

    def emit(until):
        if stack and t is not None and until > t:
            segments.append((t, until, stack[-1][1]))

    for e in sorted(thread_events, key=lambda e: (e["ts"], -e["dur"])):
        while stack and stack[-1][0] <= e["ts"]:  # ranges that ended before this one begins
            emit(stack[-1][0])
            t = stack.pop()[0]
        emit(e["ts"])
        t = e["ts"]
        stack.append((e["ts"] + e["dur"], e.get("name", "")))
    while stack:
        emit(stack[-1][0])
        t = stack.pop()[0]
    return segments, [a for a, _, _ in segments]


def _attribute(thread, lo, hi, into):
    """The time of [lo, hi) on a thread (``_innermost``) by the innermost operator running then
    (``python``: none)."""
    segments, starts = thread
    covered = 0.0
    k = max(0, bisect.bisect_right(starts, lo) - 1)
    while k < len(segments) and segments[k][0] < hi:
        a, b, name = segments[k]
        overlap = min(b, hi) - max(a, lo)
        if overlap > 0:
            into[name] = into.get(name, 0.0) + overlap
            covered += overlap
        k += 1
    into["python"] = into.get("python", 0.0) + (hi - lo - covered)


def host_waits(events, cpu_ranges):
    """The last iteration's ``HOST_WAITS`` calls, in the phase (the main thread's range, or backward's
    autograd threads between its start and the step's) whose time they fell in: per phase, per call and
    the operators around it on its thread (the innermost three, innermost first; ``python`` where none:
    called from Python), how many and their seconds. Seconds in a profiled iteration are the profiler's
    (its CPU is slower, so the device has often caught up); the count and the place are what carries over."""
    if not all(p in cpu_ranges for p in PHASES):
        return None
    last = {p: max(cpu_ranges[p]) for p in PHASES}
    windows = {"forward": last["forward"], "backward": (last["backward"][0], last["step"][0]), "step": last["step"]}
    ops = {}
    for e in events:
        if e.get("cat") == "cpu_op":
            ops.setdefault(e.get("tid"), []).append((e["ts"], e["ts"] + e["dur"], e.get("name", "")))
    for v in ops.values():
        v.sort()
    out = {}
    for e in events:
        if e.get("cat") != "cuda_runtime" or e.get("name") not in HOST_WAITS:
            continue
        phase = next((p for p, (lo, hi) in windows.items() if lo <= e["ts"] <= hi), None)
        if phase is None:
            continue
        around = [name for a, b, name in ops.get(e.get("tid"), ()) if a <= e["ts"] <= b]
        # sorted by start: the last ones enclose least
        key = f"{e['name']} in {' < '.join(reversed(around[-3:])) if around else 'python'}"
        row = out.setdefault(phase, {}).setdefault(key, {"count": 0, "seconds": 0.0})
        row["count"] += 1
        row["seconds"] = round(row["seconds"] + e["dur"] / 1e6, 6)
    return {p: dict(sorted(rows.items(), key=lambda kv: -kv[1]["count"])) for p, rows in out.items()}


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    for path in argv:
        opener = gzip.open if path.endswith(".gz") else open
        with opener(path, "rt") as f:
            print(json.dumps(summarize(json.load(f)), indent=1))


if __name__ == "__main__":
    main()
