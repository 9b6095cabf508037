"""The worker: one mode measured in this process (one rank of it with ``--ranks N``), as the driver
starts it with ``--worker MODE --result-file PATH``.

In order: the process's rank and device (``setup``), the model under ``zero.Init`` and the engine
(``build_engine``), warm-up and measured iterations, the pipelined run and the traced one
(``measure``), and the result record (``results``), written by rank 0 (``work``). A mode that runs
out of GPU memory is a result too: ``{"oom": true, "error": <the message's first line>,
"peak_before_GiB": ..., "last_progress": ...}`` with what was known by then (parameters, build times).
"""

import contextlib
import json
import os
import socket
import time
import traceback

import torch

from ..sizing.bandwidth import bandwidth_all_ranks
from ..sizing.estimate import state_bytes_per_rank
from ..runtime.memory import allocator
from . import results
from .loop import GiB, Loop
from .models import build_model, llama_classes, make_loss
from .modes import describe, ds_config
from .profile import profiled, sync_sites
from .timeline import growth, recording, traced

# DeepCompile compiles, profiles and re-applies its passes over the first steps: warm up longer.
COMPILED_WARMUP = 6
# The exit status of a worker that ran out of GPU memory (its result is written all the same): with
# several ranks, torchrun then stops the others instead of leaving them waiting in a collective.
OOM_EXIT = 3


class Progress:
    """Lines in the worker's log saying where the mode is, with the seconds since the worker started
    (where a mode that timed out spent its time); the last one and the ``facts`` gathered so far go
    into an out-of-memory record."""

    def __init__(self, mode):
        self.mode, self.started = mode, time.perf_counter()
        self.last, self.facts = "started", {}

    def __call__(self, what):
        self.last = what
        print(f"[bench] {self.mode.name}: {what} at {time.perf_counter() - self.started:.1f} s", flush=True)


def since_process_start():
    """Seconds since this process started (imports included)."""
    import psutil
    return time.time() - psutil.Process().create_time()


def free_port():
    """A TCP port on the loopback that nothing listens on now (the OS picks it)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def setup():
    """The rendezvous variables a plain ``python`` worker lacks (torchrun sets them), and this rank's
    device; returns DeepSpeed's accelerator."""
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    # a port free now: two benches side by side (one per GPU) run the same modes at once
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    from deepspeed.accelerator import get_accelerator
    acc = get_accelerator()
    acc.set_device(int(os.environ["LOCAL_RANK"]))  # before zero.Init and the inputs: one device per rank
    return acc


def build_engine(mode, args, acc, progress):
    """The model, built under ``zero.Init`` in bf16, and its engine from ``deepspeed_offload.initialize``
    with the mode's ds_config; returns (engine, parameter count)."""
    import deepspeed

    import deepspeed_offload
    cfg = ds_config(mode, args)
    if acc.device_name() == "cpu":  # CI runs the worker on the CPU: torch's Adam, no JIT build of an Adam op
        cfg["optimizer"]["params"]["torch_adam"] = True
    deepspeed.init_distributed()
    if args.model == "llama":
        llama_classes()
    with deepspeed.zero.Init(config_dict_or_path=cfg, dtype=torch.bfloat16):
        model = build_model(args)
    nparams = sum(p.ds_numel for p in model.parameters())
    progress.facts.update(params=nparams, model_built_s=since_process_start())
    os.environ.update(dict(mode.env))
    progress("model built")
    engine, _, _, _ = deepspeed_offload.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    progress.facts["engine_built_s"] = since_process_start()
    progress("engine built")
    if mode.compiled:
        engine.compile()
    return engine, nparams


def measure(loop, args, progress):
    """Warm-up and measured iterations, then the pipelined run and, for a traced mode, one traced
    iteration (``--timeline``) and two profiled ones and one under the sync debug mode (``--profile``);
    the measured iterations' figures.
    With ``--memory-history``, a traced mode's warm-up, measured and pipelined iterations run under
    the allocator's history recorder, and each time it reserved more after the first iteration is listed
    (``reserved_growth``); the times are then the recorder's (slower), and the result says so
    (``memory_history``)."""
    warmup = max(args.warmup, COMPILED_WARMUP) if loop.mode.compiled else args.warmup
    rows, marks = [], []
    history = getattr(args, "memory_history", False) and loop.mode.traced
    with recording(loop.acc) if history else contextlib.nullcontext({}) as got:
        for k in range(warmup + args.iters):
            marks.append({} if history else None)
            rows.append(loop.iteration(marks[-1]))
            progress(f"iteration {k + 1} of {warmup + args.iters} ({rows[-1]['iter_s']:.3f} s)")
        pipelined = loop.pipelined(args.iters)
    out = results.from_rows(rows[warmup:])
    out.update(pipelined)
    if got:
        out["reserved_growth"] = growth(got["trace"], got["active_end"], got["reserved_end"], marks, after=1)
        out["reserved_growth_truncated"] = got["truncated"]
        out["memory_history"] = True
    if args.timeline and loop.mode.traced:
        out["timeline"] = traced(loop)
    if getattr(args, "profile", None) and loop.mode.traced:
        os.makedirs(args.profile, exist_ok=True)
        rank = os.environ.get("RANK", "0")
        out["profile"] = profiled(loop, os.path.join(args.profile, f"{loop.mode.file_name()}.rank{rank}.trace.json.gz"))
        try:  # (a diagnostic after the figures: its failure is recorded, the figures kept)
            out["sync_sites"] = sync_sites(loop)
        except Exception as e:
            out["sync_sites"] = {"error": f"{type(e).__name__}: {e}"}
    out["warmup"] = warmup
    return out


def run_mode(mode, args, acc, progress):
    """One mode in this process: the result dict on rank 0, None on the other ranks."""
    if mode.probe:
        return bandwidth_all_ranks(args.bw_gib)
    import deepspeed_offload
    progress.facts.update(model=args.model, grad_ckpt=getattr(args, "grad_ckpt", None) or False,
                          ranks=int(os.environ["WORLD_SIZE"]))
    engine, nparams = build_engine(mode, args, acc, progress)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    loop = Loop(engine, make_loss(args, acc.current_device_name()), acc, mode)
    with loop.peaks.watching():  # the runtime's own resets of the peak statistics fold into the iterations'
        out = measure(loop, args, progress)
    out.update(progress.facts, iters=args.iters, state_GiB=state_bytes_per_rank(nparams, 1) / GiB)
    handle = deepspeed_offload.get_handle(engine)
    if mode.checkpoint:
        out.update(loop.checkpoint_times(handle, args.ckpt_dir))
    if mode.colocate:
        out.update(loop.colocation_times())
    out.update(results.handle_stats(handle, engine, out["between_GiB"]))
    out.update(results.host_pinned(handle), attach_s=getattr(handle, "attach_s", None))
    out["expandable_segments"] = allocator.SWITCH.on()  # the environment's, or the measured plan's switch
    out["per_rank"] = results.gather_ranks(results.rank_record(rank, out), world)
    out["host"] = results.host_memory(out["per_rank"], nparams, world)
    deepspeed_offload.finish(engine)  # every rank: no gloo abort at exit (``teardown.py``)
    return out if rank == 0 else None


def oom_error(error):
    """The out-of-GPU-memory error in ``error``'s chain (DeepSpeed may wrap it), or None."""
    kinds = tuple(k for k in (getattr(torch, "OutOfMemoryError", None), getattr(torch.cuda, "OutOfMemoryError", None))
                  if k is not None)
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, kinds) or "CUDA out of memory" in str(error):
            return error
        error = error.__cause__ or error.__context__
    return None


def oom_record(error, progress, acc):
    """The result of a mode that ran out of GPU memory: the message's first line, the peak allocated
    since the last reset of the peak stats (the current iteration's, or since the start while
    building), the last progress line and what was known by then."""
    lines = [line for line in str(error).splitlines() if line.strip()]
    try:
        peak = acc.max_memory_allocated() / GiB
    except Exception:  # a device the error left unusable: the record still gets written
        peak = None
    return dict(progress.facts, oom=True, error=lines[0].strip() if lines else type(error).__name__,
                peak_before_GiB=peak, last_progress=progress.last)


def write_result(result, path):
    """``result`` as JSON in ``path`` (atomically: the driver never reads half a file), or on a
    ``RESULT`` line of the log without a path."""
    text = json.dumps(result)
    if not path:
        print("RESULT " + text, flush=True)
        return
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.replace(path + ".tmp", path)


def work(args):
    """The ``--worker MODE`` entry: measure, then write the result (rank 0). A mode that runs out of
    GPU memory writes its out-of-memory record and exits with ``OOM_EXIT``."""
    mode = describe(args.worker, args)
    progress = Progress(mode)
    acc = setup()
    try:
        result, status = run_mode(mode, args, acc, progress), 0
    except Exception as e:
        oom = oom_error(e)
        if oom is None:
            raise
        traceback.print_exc()  # the whole story, in the mode's log
        result, status = oom_record(oom, progress, acc), OOM_EXIT
        progress(f"out of GPU memory after: {result['last_progress']}")
        if int(os.environ.get("RANK", "0")) != 0:
            result = None
    if result is not None:
        write_result(result, args.result_file)
    return status
