"""How much a save's writer holds up the training loop's thread (CPU only, no GPU, no DeepSpeed engine).

An async save serializes its files in a thread of its own while training goes on: whatever that
thread (or its hashing threads) does with the interpreter's lock held stalls the loop, which on a GPU
is a thread launching kernels. This runs a stand-in for that loop (a tiny torch op, timed, over and
over) beside ``serialize`` (the writer's torch.save + piece hashing) of ``--tensors`` fp32 tensors of
``--mib`` MiB each, and reports the loop's gaps: their sum over ``--gap-ms`` (time the loop lost to
the writer), the longest, and the loop's rate against the same loop alone. ``torch.save`` to a path
(no hashing) is the reference.

    python benchmarks/save_stall.py --out benchmarks/results/save-stall-cpu-DATE.json
"""

import argparse
import json
import os
import platform
import statistics
import subprocess
import tempfile
import threading
import time

import torch

from deepspeed_offload.runtime.checkpoint.files import serialize


def loop_beside(work, gap_s: float, seconds: float = 2.0) -> dict:
    """The stand-in loop while ``work`` runs in a thread (None: alone, for ``seconds``)."""
    small, gaps, stop = torch.zeros(16), [], threading.Event()
    t0 = time.perf_counter()
    if work is None:
        threading.Timer(seconds, stop.set).start()
    else:
        threading.Thread(target=lambda: (work(), stop.set())).start()
    last = t0
    while not stop.is_set():
        small.add_(1.0)
        now = time.perf_counter()
        gaps.append(now - last)
        last = now
    wall = time.perf_counter() - t0
    long = [g for g in gaps if g > gap_s]
    return {"wall_s": wall, "loop_per_s": len(gaps) / wall, "lost_s": sum(long), "long_gaps": len(long),
            "max_gap_ms": max(gaps) * 1e3}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tensors", type=int, default=6)
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--gap-ms", type=float, default=5.0, help="a gap longer than this counts as lost time")
    ap.add_argument("--dir", default=None, help="where the files go (default: a temporary directory)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    obj = {"state": {k: torch.randn(args.mib << 18) for k in range(args.tensors)}}
    gap_s = args.gap_ms / 1e3
    with tempfile.TemporaryDirectory(dir=args.dir) as d:
        ways = {"alone": None,
                "torch.save to a path": lambda: torch.save(obj, os.path.join(d, "ref.pt")),
                "serialize (the writer's)": lambda: serialize(os.path.join(d, "x.pt"), obj, True)}
        runs = {name: [loop_beside(work, gap_s) for _ in range(args.rounds)] for name, work in ways.items()}
    alone = statistics.median(r["loop_per_s"] for r in runs["alone"])
    summary = {}
    for name, rs in runs.items():
        summary[name] = {k: statistics.median(r[k] for r in rs) for k in rs[0]}
        summary[name]["loop_rate_vs_alone"] = summary[name]["loop_per_s"] / alone
        summary[name]["lost_s_range"] = [min(r["lost_s"] for r in rs), max(r["lost_s"] for r in rs)]
        m = summary[name]
        print(f"{name:26s} wall {m['wall_s']:5.2f} s  lost {m['lost_s']:5.2f} s ({m['long_gaps']:.0f} gaps > "
              f"{args.gap_ms:g} ms)  longest {m['max_gap_ms']:6.1f} ms  "
              f"loop rate {m['loop_rate_vs_alone']:.2f} of alone")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    result = {"what": "the training loop's thread beside a save's writer (benchmarks/save_stall.py)",
              "date": time.strftime("%Y-%m-%d"), "commit": commit, "args": vars(args),
              "hardware": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs",
              "torch": torch.__version__,
              "median_of_rounds": summary, "runs": runs}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
