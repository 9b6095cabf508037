"""The driver: ``deepspeed-offload bench``'s entry (``main``, ``run``). It checks the modes, keeps
what an earlier run with the same arguments measured (``--resume``), starts one worker process per
mode (plain Python for one rank, torchrun for several), records each mode's result or why it has
none, writes the summary after every mode, and prints the report and draws the charts at the end.
"""

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import torch

from .modes import expand
from .options import build_parser, identity_diff, resolve
from .report import report, summarize


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    return run(build_parser().parse_args(argv), argv)


def launcher(args):
    """How a worker process starts: plain Python for one rank, torchrun for several (one node)."""
    if args.ranks == 1:
        return [sys.executable]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.ranks}"]


def _refuse(message):
    print(f"deepspeed-offload bench: {message}", file=sys.stderr)
    return 2


def _earlier_results(args):
    """The modes ``args.out`` measured with the same arguments (failed ones left out, to run again);
    raises ValueError naming the arguments that differ."""
    if not (args.resume and os.path.exists(args.out)):
        return {}
    with open(args.out) as f:
        done = json.load(f)
    diff = identity_diff(args, done["args"])
    if diff:
        raise ValueError(f"{args.out} was written with other arguments ({', '.join(diff)}); not resuming it")
    return {m: r for m, r in done["results"].items() if "error" not in r}


def run_worker(cmd, timeout, name):
    """The worker's whole output and whether it ran past ``timeout`` seconds. Each mode compiles its
    own graphs: inductor's cache would hand one mode's compiled graphs (without our ops, or for another
    budget) to the next, which compile mode refuses, so each worker gets an empty cache of its own."""
    inductor_cache = tempfile.mkdtemp(prefix=f"ds_offload_bench_inductor_{name}_")
    try:
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout,
                              env=dict(os.environ, TORCHINDUCTOR_CACHE_DIR=inductor_cache))
        return proc.stdout, False
    except subprocess.TimeoutExpired as e:
        return (e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")), True
    finally:
        shutil.rmtree(inductor_cache, ignore_errors=True)


def outcome(result_file, log, timed_out, timeout):
    """A mode's result: what its worker wrote, or why there is none."""
    if os.path.exists(result_file):
        with open(result_file) as f:
            result = json.load(f)
        os.remove(result_file)
        return result
    if timed_out:
        return {"error": f"timed out after {timeout}s\n" + log[-2000:]}
    return {"error": log[-3000:] or "the worker wrote no result and no output"}


def run_mode(mode, args, argv, stem):
    """One mode in its own process(es); its result, with the wall time, and its whole log beside --out."""
    result_file = f"{stem}-{mode.file_name()}.result.json"
    if os.path.exists(result_file):
        os.remove(result_file)
    cmd = launcher(args) + ["-m", "deepspeed_offload.bench", "--worker", mode.name, "--result-file", result_file] + argv
    t = time.perf_counter()
    log, timed_out = run_worker(cmd, args.timeout, mode.file_name())
    result = outcome(result_file, log, timed_out, args.timeout)
    with open(f"{stem}-{mode.file_name()}.log", "w") as f:  # the whole story, for a failure
        f.write(log)
    result["wall_s"] = time.perf_counter() - t
    return result


def draw(summary, args):
    """The charts ``--plot`` and ``--timeline`` ask for."""
    from .charts import plot, plot_sweep, plot_timeline
    if args.plot:
        plot(summary, args.plot)
        sweep_path = f"{os.path.splitext(args.plot)[0]}-sweep.png"
        if plot_sweep(summary, sweep_path):
            print(f"budget sweep chart: {sweep_path}")
    if args.timeline:
        if plot_timeline(summary, args.timeline):
            print(f"memory timeline: {args.timeline}")


def run(args, argv):
    """The bench (or, with ``--worker``, one of its workers) for parsed ``args``; ``argv`` is passed
    on to every worker. Returns the exit status."""
    try:
        resolve(args)
    except ValueError as e:
        return _refuse(e)
    if args.worker:
        from .worker import work
        return work(args)
    try:
        modes = expand(args.modes, args)
    except ValueError as e:
        return _refuse(e)
    if not torch.cuda.is_available():
        return _refuse("needs a CUDA device (it compares GPU steps and GPU memory)")
    if args.ranks > torch.cuda.device_count():
        return _refuse(f"--ranks {args.ranks} needs {args.ranks} GPUs, this machine has {torch.cuda.device_count()}")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    try:
        results = _earlier_results(args)
    except ValueError as e:
        return _refuse(e)

    from tqdm import tqdm
    stem = os.path.splitext(args.out)[0]
    for mode in tqdm([m for m in modes if m.name not in results], desc="modes"):
        results[mode.name] = run_mode(mode, args, argv, stem)
        brief = {k: v for k, v in results[mode.name].items() if k not in ("per_iter", "timeline", "per_rank")}
        tqdm.write(f"{mode.name}: {json.dumps(brief)[:600]}")
        summarize(results, args)  # after every mode: a run cut short keeps what it measured
    summary = summarize(results, args)
    print(report(summary))
    draw(summary, args)
    return 0
