"""The worker: one mode measured in this process (one rank of it with ``--ranks N``), as the driver
starts it with ``--worker MODE --result-file PATH``.

In order: the process's rank and device (``setup``), the model under ``zero.Init`` and the engine
(``build_engine``), warm-up and measured iterations, the pipelined run and the traced one
(``measure``), and the result record (``results``), written by rank 0 (``work``).
"""

import json
import os
import socket
import time

import torch

from ..bandwidth import bandwidth_all_ranks
from ..config import state_bytes_per_rank
from . import results
from .loop import GiB, Loop
from .models import build_model, llama_classes, make_loss
from .modes import describe, ds_config
from .timeline import traced

# DeepCompile compiles, profiles and re-applies its passes over the first steps: warm up longer.
COMPILED_WARMUP = 6


class Progress:
    """Lines in the worker's log saying where the mode is, with the seconds since the worker started
    (where a mode that timed out spent its time)."""

    def __init__(self, mode):
        self.mode, self.started = mode, time.perf_counter()

    def __call__(self, what):
        print(f"[bench] {self.mode.name}: {what} at {time.perf_counter() - self.started:.1f} s", flush=True)


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
    os.environ.update(dict(mode.env))
    progress("model built")
    engine, _, _, _ = deepspeed_offload.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    progress("engine built")
    if mode.compiled:
        engine.compile()
    return engine, nparams


def measure(loop, args, progress):
    """Warm-up and measured iterations, then the pipelined run and, with ``--timeline`` for a traced
    mode, one traced iteration; the measured iterations' figures."""
    warmup = max(args.warmup, COMPILED_WARMUP) if loop.mode.compiled else args.warmup
    rows = []
    for k in range(warmup + args.iters):
        rows.append(loop.iteration())
        progress(f"iteration {k + 1} of {warmup + args.iters} ({rows[-1]['iter_s']:.3f} s)")
    out = results.from_rows(rows[warmup:])
    out.update(loop.pipelined(args.iters))
    if args.timeline and loop.mode.traced:
        out["timeline"] = traced(loop)
    out["warmup"] = warmup
    return out


def run_mode(mode, args):
    """One mode in this process: the result dict on rank 0, None on the other ranks."""
    progress = Progress(mode)
    acc = setup()
    if mode.probe:
        return bandwidth_all_ranks(args.bw_gib)
    import deepspeed_offload
    engine, nparams = build_engine(mode, args, acc, progress)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    loop = Loop(engine, make_loss(args, acc.current_device_name()), acc, mode)
    out = measure(loop, args, progress)
    out.update(params=nparams, iters=args.iters, model=args.model, ranks=world,
               state_GiB=state_bytes_per_rank(nparams, 1) / GiB, grad_ckpt=bool(getattr(args, "grad_ckpt", False)))
    handle = deepspeed_offload.get_handle(engine)
    if mode.checkpoint:
        out.update(loop.checkpoint_times(handle, args.ckpt_dir))
    out.update(results.handle_stats(handle, engine, out["between_GiB"]))
    out["per_rank"] = results.gather_ranks(results.rank_record(rank, out), world)
    out["host"] = results.host_memory(out["per_rank"], nparams, world)
    return out if rank == 0 else None


def work(args):
    """The ``--worker MODE`` entry: measure, then write the result (rank 0) to ``--result-file``
    (atomically) or print it on a ``RESULT`` line."""
    result = run_mode(describe(args.worker, args), args)
    if result is None:
        return 0
    text = json.dumps(result)
    if args.result_file:
        with open(args.result_file + ".tmp", "w") as f:
            f.write(text)
        os.replace(args.result_file + ".tmp", args.result_file)
    else:
        print("RESULT " + text, flush=True)
    return 0
