"""The driver: ``deepspeed-offload bench``'s entry (``main``, ``run``). It checks the modes, keeps
what an earlier run with the same arguments measured (``--resume``), starts one worker process per
mode (plain Python for one rank, torchrun for several; with ``--rounds``, the modes in turn that
many times, pooled per mode), records each mode's result or why it has none, writes the summary
after every mode, and prints the report and draws the charts at the end.

A mode without a result is recorded with an ``error``: the tail of its log, or, for a worker that
ran past its ``--timeout`` (killed with every process it started), ``"timeout": true``; one whose
log shows it ran out of GPU memory is an out-of-memory record (``"oom": true``) like the one a
worker writes itself.
"""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import torch

from .modes import expand
from .options import build_parser, identity_diff, resolve
from .report import report, summarize
from .results import failed, pool_rounds


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
    # measured modes, and those that ran out of memory (a result of these arguments too)
    return {m: r for m, r in done["results"].items() if "error" not in r or r.get("oom")}


def merge_runs(paths):
    """One summary from several bench.json files, for the charts: the first file's arguments, each
    mode from the first file that measured it, the date every run's date (``2026-12-02, 2026-12-03``).
    Raises ValueError when the files are not runs of one model at one batch (their points would not
    belong on one chart)."""
    runs = []
    for path in paths:
        with open(path) as f:
            runs.append(json.load(f))
    same = ("model", "preset", "batch", "seq", "grad_ckpt", "layers", "hidden")
    first = runs[0]["args"]
    for path, run in zip(paths[1:], runs[1:]):
        diff = [k for k in same if run["args"].get(k) != first.get(k)]
        if diff:
            raise ValueError(f"{path} is another model or batch than {paths[0]} ({', '.join(diff)} differ)")
    summary = dict(runs[0], results={})
    for run in runs:
        for mode, result in run["results"].items():
            summary["results"].setdefault(mode, result)
    summary["date"] = ", ".join(dict.fromkeys(run["date"] for run in runs))
    return summary


def parse_timeouts(text, names):
    """``--timeout``: ``SECONDS`` for every mode, with ``MODE=SECONDS`` entries for single modes
    (``900,zero_offload=1800``) -> {mode name: seconds} for ``names``. Raises ValueError."""
    default, per_mode = None, {}
    for item in (i.strip() for i in str(text).split(",") if i.strip()):
        name, eq, value = item.rpartition("=")
        try:
            seconds = float(value)
        except ValueError:
            seconds = -1
        if seconds <= 0:
            raise ValueError(f"--timeout {item!r}: expected SECONDS or MODE=SECONDS, seconds above 0")
        if not eq:
            default = seconds
        elif name not in names:
            raise ValueError(f"--timeout {item!r}: {name!r} is not a mode of this run ({', '.join(names)})")
        else:
            per_mode[name] = seconds
    if default is None:
        default = float(build_parser().get_default("timeout"))
    return {n: per_mode.get(n, default) for n in names}


def _kill_session(proc):
    """SIGKILL to every process of the worker's session: torchrun's ranks and inductor's compile
    workers with it, not only the process started (the others would keep the GPU)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        proc.kill()


def run_process(cmd, env, timeout):
    """``cmd`` in a session of its own: its whole output and whether it ran past ``timeout`` seconds
    (then it was killed with everything it started; so it is if this process is interrupted)."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)
    try:
        return proc.communicate(timeout=timeout)[0], False
    except subprocess.TimeoutExpired:
        _kill_session(proc)
        try:
            return proc.communicate(timeout=60)[0], True
        except subprocess.TimeoutExpired as e:  # something outside the session holds the pipe open
            proc.kill()
            out = e.output or ""
            return (out.decode(errors="replace") if isinstance(out, bytes) else out), True
    except BaseException:
        _kill_session(proc)
        raise


def run_worker(cmd, timeout, name):
    """The worker's whole output and whether it ran past ``timeout`` seconds. Each mode compiles its
    own graphs: inductor's cache would hand one mode's compiled graphs (without our ops, or for another
    budget) to the next, which compile mode refuses, so each worker gets an empty cache of its own."""
    inductor_cache = tempfile.mkdtemp(prefix=f"ds_offload_bench_inductor_{name}_")
    try:
        return run_process(cmd, dict(os.environ, TORCHINDUCTOR_CACHE_DIR=inductor_cache), timeout)
    finally:
        shutil.rmtree(inductor_cache, ignore_errors=True)


OOM_LINE = re.compile(r"^.*(CUDA out of memory|OutOfMemoryError).*$", re.M)
PROGRESS_LINE = re.compile(r"^\[bench\] .*$", re.M)


def outcome(result_file, log, timed_out, timeout):
    """A mode's result: what its worker wrote, or why there is none."""
    if os.path.exists(result_file):
        with open(result_file) as f:
            result = json.load(f)
        os.remove(result_file)
        return result
    oom = OOM_LINE.search(log)
    progress = PROGRESS_LINE.findall(log)
    last = progress[-1].split(": ", 1)[-1] if progress else None
    if oom:  # a rank that died of it before rank 0 could write its record
        line = oom.group(0).strip()
        message = line[line.index("CUDA out of memory"):] if "CUDA out of memory" in line else line
        return {"oom": True, "error": message, "peak_before_GiB": None, "last_progress": last}
    if timed_out:
        return {"timeout": True, "timeout_s": timeout, "last_progress": last,
                "error": f"timed out after {timeout:g} s" + (f" ({last})" if last else "") + "\n" + log[-2000:]}
    return {"error": log[-3000:] or "the worker wrote no result and no output"}


def run_mode(mode, args, argv, stem, timeout):
    """One mode in its own process(es); its result, with the wall time, and its whole log beside --out."""
    result_file = f"{stem}-{mode.file_name()}.result.json"
    if os.path.exists(result_file):
        os.remove(result_file)
    cmd = launcher(args) + ["-m", "deepspeed_offload.bench", "--worker", mode.name, "--result-file", result_file] + argv
    t = time.perf_counter()
    log, timed_out = run_worker(cmd, timeout, mode.file_name())
    result = outcome(result_file, log, timed_out, timeout)
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
    if args.charts_from:
        if not (args.plot or args.timeline):
            return _refuse("--charts-from draws charts: give --plot PNG, --timeline PNG or both")
        try:
            summary = merge_runs(args.charts_from)
        except (OSError, ValueError, KeyError) as e:
            return _refuse(f"--charts-from: {e}")
        draw(summary, args)
        return 0
    if args.rounds < 1 or (args.rounds > 1 and args.resume):
        return _refuse("--rounds takes a whole number from 1, and more than one round runs every mode afresh "
                       "(not with --resume)")
    try:
        modes = expand(args.modes, args)
        timeouts = parse_timeouts(args.timeout, [m.name for m in modes])
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
    todo = [m for m in modes if m.name not in results]
    # --rounds: the modes in turn, every other round reversed, so that a drift falls on all of them;
    # the bandwidth probe in the first round only, and a mode that failed in a round not again
    schedule = [(k, m) for k in range(args.rounds) for m in (todo if k % 2 == 0 else todo[::-1])
                if k == 0 or not m.probe]
    rounds = {}
    for k, mode in tqdm(schedule, desc="modes"):
        if k > 0 and failed(results[mode.name]):
            continue
        result = run_mode(mode, args, argv, stem if args.rounds == 1 else f"{stem}-round{k + 1}", timeouts[mode.name])
        rounds.setdefault(mode.name, []).append(result)
        results[mode.name] = result if args.rounds == 1 else pool_rounds(rounds[mode.name])
        long = ("per_iter", "timeline", "per_rank", "profile", "sync_sites", "reserved_growth")
        brief = {k: v for k, v in result.items() if k not in long}
        tqdm.write(f"{mode.name}: {json.dumps(brief)[:600]}")
        summarize(results, args)  # after every mode: a run cut short keeps what it measured
    summary = summarize(results, args)
    print(report(summary))
    draw(summary, args)
    return 0
