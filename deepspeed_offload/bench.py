"""``deepspeed-offload bench``: our stream and compile modes side by side with the upstream DeepSpeed
ways of handling optimizer state, each mode in its own process (one rank, or ``--ranks N`` ranks of
one node through torchrun), per-iteration min/median/max over the measured iterations, JSON plus
PNG charts.

    deepspeed-offload bench --out bench.json --plot bench.png --timeline timeline.png \\
        [--model mlp|sequential|llama] [--modes all|resident,stream,...] [--budgets 0,8,16,32,default] [--ranks 2]

Models: ``mlp`` (default; 64 x Linear(4096, 4096) + ReLU in a ModuleList, 1.07B parameters),
``sequential`` (the same layers in an nn.Sequential), ``llama`` (a Llama-shaped ``transformers``
LlamaForCausalLM with random weights, TinyLlama's 1.1B shape by default, batch 8 x 2048 tokens,
its own LM loss on random token ids; needs ``transformers``). Everything is built under
``deepspeed.zero.Init`` in bf16 and trained with ZeRO-3 and Adam.

Modes:
  bandwidth       pinned host<->device copy bandwidth, each direction and both at once (with --ranks N:
                  every rank alone, then all ranks at once after a barrier)
  resident        plain ZeRO-3, FusedAdam, states on the GPU
  stream          deepspeed-offload stream mode, everything offloaded (memory_budget_gb 0), overlap off
  stream_overlap  the same with overlap on: loads during the last backward, ahead of the step
  offload_states  plain ZeRO-3 with engine.reload_states() before and offload_states(optim_states,
                  hp_params) after each step: the same state our modes offload
  zero_offload    ZeRO-Offload: offload_optimizer.device=cpu, DeepSpeedCPUAdam
  checkpoint      stream mode with async_checkpoint: DeepSpeed's synchronous save of the same engine,
                  then our async save (time until save_checkpoint returns, iterations run during the
                  write, time until the write is done)
  compiled        DeepCompile (engine.compile()), states resident
  compile_offload@B  deepspeed-offload compile mode under DeepCompile with memory_budget_gb B
                  (``default``: null, derived from the card); ``compile_sweep`` in --modes is one
                  such mode per --budgets entry
  dc_offload_opt_states       DeepCompile with its own compile.offload_opt_states, default budget
  dc_offload_opt_states_full  the same, forced to offload everything (DS_DC_OFFLOAD_OPT_BUDGET_GB=0)
  (still accepted: stream_prefetch, compile_offload = @default, compile_offload_budget = @--budget-gb,
  compile_offload_full = @0)

Per iteration, synchronized at the end of backward and of the step: iteration, forward+backward and
step time; the iteration's peak GPU allocation (peak stats reset at its start; the larger of the
forward+backward and the step peaks), the step's, and what stays allocated after it. Then the same
iterations without any synchronization (``pipelined``, timed with device events), so copies may
overlap the next forward. With ``--timeline`` one more iteration of resident, stream and
stream_overlap runs under the CUDA allocator's history recorder and its allocated bytes over time
are rebuilt from the trace (``timeline_from_trace``).
"""

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import torch

from .bandwidth import bandwidth_all_ranks
from .config import estimate, state_bytes_per_rank

# Every name --modes accepts, besides compile_offload@<budget> and the shorthands below.
MODES = ["bandwidth", "resident", "stream", "stream_overlap", "stream_prefetch", "offload_states", "zero_offload",
         "checkpoint", "compiled", "compile_offload", "compile_offload_budget", "compile_offload_full",
         "dc_offload_opt_states", "dc_offload_opt_states_full"]
# What --modes all runs (compile_sweep: one compile_offload@B per --budgets entry).
DEFAULT_MODES = ["bandwidth", "resident", "stream", "stream_overlap", "offload_states", "zero_offload", "checkpoint",
                 "compiled", "compile_sweep", "dc_offload_opt_states", "dc_offload_opt_states_full"]
SWEEP = "compile_offload@"
# Modes whose one traced iteration goes into the memory timeline.
TIMELINE_MODES = ["resident", "stream", "stream_overlap"]
# DeepCompile compiles, profiles and re-applies its passes over the first steps: warm up longer.
COMPILED_WARMUP = 6
# Entries the allocator's history keeps for the traced iteration (a ring buffer: older ones drop).
TRACE_MAX_ENTRIES = 2_000_000
GiB = 2**30

MODEL_DEFAULTS = {
    "mlp": dict(layers=64, hidden=4096),
    "sequential": dict(layers=64, hidden=4096),
    # TinyLlama-1.1B's shape.
    "llama": dict(layers=22, hidden=2048, intermediate=5632, heads=32, kv_heads=4, vocab=32000, batch=8, seq=2048),
}


# ---------------------------------------------------------------------------------------- modes


def expand_modes(spec, budgets):
    """``--modes`` as the list of modes to run, in order; ``all`` and ``compile_sweep`` expanded.
    Raises ValueError naming an unknown mode or budget."""
    out = []
    for name in spec.split(","):
        name = name.strip()
        if not name:
            continue
        names = (DEFAULT_MODES if name == "all" else [name])
        for n in names:
            if n == "compile_sweep":
                out += [SWEEP + b for b in parse_budgets(budgets)]
            elif n in MODES:
                out.append(n)
            elif n.startswith(SWEEP):
                parse_budgets(n[len(SWEEP):])
                out.append(n)
            else:
                raise ValueError(f"unknown mode {n!r} (known: all, {', '.join(MODES)}, compile_sweep, "
                                 f"{SWEEP}<GiB|default>)")
    return list(dict.fromkeys(out))


def parse_budgets(text):
    """``0,8,16,default`` -> the budget names, checked: a non-negative number or ``default``."""
    names = [b.strip() for b in str(text).split(",") if b.strip()]
    for b in names:
        if b != "default":
            try:
                ok = float(b) >= 0
            except ValueError:
                ok = False
            if not ok:
                raise ValueError(f"budget {b!r}: expected a number of GiB >= 0 or 'default'")
    return names


def compile_budget(mode, args):
    """The memory_budget_gb of a compile-mode run (None: derived), or raises KeyError for other modes."""
    legacy = {"compile_offload": "default", "compile_offload_budget": str(args.budget_gb), "compile_offload_full": "0"}
    name = legacy[mode] if mode in legacy else mode[len(SWEEP):] if mode.startswith(SWEEP) else None
    if name is None:
        raise KeyError(mode)
    return None if name == "default" else float(name)


def is_compile_offload(mode):
    return mode.startswith("compile_offload")


def is_offloading(mode):
    """The modes reported as overhead over their baseline, against the copy floor."""
    return mode.startswith("stream") or is_compile_offload(mode) or mode.startswith("dc_offload_opt_states")


def baseline(mode):
    """What a mode is compared with: compiled modes with DeepCompile without offload, the rest with
    resident ZeRO-3."""
    return "compiled" if mode.startswith("compile_") or mode.startswith("dc_") else "resident"


def ds_config(mode, args):
    cfg = {
        "train_micro_batch_size_per_gpu": args.batch if args.model == "llama" else 1,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-4, "weight_decay": 0.0}},
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": 3},
        "steps_per_print": 10**9,
    }
    if mode.startswith("stream") or mode == "checkpoint":
        block = {"enabled": True, "mode": "stream", "memory_budget_gb": 0, "sub_group_mb": args.sub_group_mb}
        if mode == "stream":
            block.update(overlap=False, prefetch=False)
        elif mode == "stream_prefetch":
            block.update(overlap=False, prefetch=True)
        elif mode == "stream_overlap":
            block.update(overlap=True, overlap_memory_gb=args.overlap_memory_gb)
        else:
            block.update(async_checkpoint=True)
        cfg["optimizer_state_offload"] = block
    if mode.startswith("compile") or mode.startswith("dc_"):
        cfg["compile"] = {"deepcompile": True, "offload_opt_states": mode.startswith("dc_offload_opt_states")}
    if is_compile_offload(mode):
        cfg["optimizer_state_offload"] = {"enabled": True, "mode": "compile", "sub_group_mb": args.sub_group_mb,
                                          "memory_budget_gb": compile_budget(mode, args)}
    if mode == "zero_offload":
        cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    return cfg


# ---------------------------------------------------------------------------------------- models


def build_model(args):
    """``mlp``: ``args.layers`` x (Linear(hidden, hidden), ReLU) in a ModuleList, called in a loop the
    way transformer blocks are; ``sequential``: the same layers in an ``nn.Sequential`` (runs 1-4;
    DeepCompile did not compile it under torch 2.11, see docs/benchmarks.md); ``llama``: see
    ``build_llama``."""
    if args.model == "llama":
        return build_llama(args)
    if args.model == "sequential":
        layers = []
        for _ in range(args.layers):
            layers += [torch.nn.Linear(args.hidden, args.hidden), torch.nn.ReLU()]
        return torch.nn.Sequential(*layers)
    return MLP(args.layers, args.hidden)


class MLP(torch.nn.Module):

    def __init__(self, layers, hidden):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(hidden, hidden) for _ in range(layers))

    def forward(self, x):
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x


def build_llama(args):
    """A Llama-shaped ``LlamaForCausalLM`` with random weights (whatever each module's own init gives;
    under ``zero.Init`` every module is partitioned as it is built). SDPA attention, no KV cache,
    untied embeddings, gradient checkpointing off (the default)."""
    LlamaConfig, LlamaForCausalLM = llama_classes()
    config = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
                         num_hidden_layers=args.layers, num_attention_heads=args.heads,
                         num_key_value_heads=args.kv_heads, max_position_embeddings=max(args.seq, 2048),
                         use_cache=False, tie_word_embeddings=False, attn_implementation="sdpa")
    return LlamaForCausalLM(config)


def llama_classes():
    """transformers' LlamaConfig and LlamaForCausalLM, imported on first use (an optional extra).
    Import them before ``zero.Init``: the modeling module imports torch._dynamo, whose polyfills
    refuse the tensor constructors zero.Init patches while it is active."""
    try:
        from transformers import LlamaConfig, LlamaForCausalLM
    except ImportError as e:
        raise SystemExit(f"deepspeed-offload bench --model llama needs the transformers package ({e}): "
                         "pip install transformers") from None
    return LlamaConfig, LlamaForCausalLM


def make_loss(args, device):
    """The model's input for one micro-batch and the loss of one forward: the LM loss on random token
    ids for llama, the mean square of the output for the MLPs."""
    if args.model == "llama":
        ids = torch.randint(0, args.vocab, (args.batch, args.seq), device=device)
        return lambda engine: engine(input_ids=ids, labels=ids).loss
    x = torch.randn(args.tokens, args.hidden, device=device, dtype=torch.bfloat16)
    return lambda engine: engine(x).float().pow(2).mean()


# ---------------------------------------------------------------------------------------- the worker


def spread(values):
    """min / median / max of a list of numbers."""
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


def free_port():
    """A TCP port on the loopback that nothing listens on now (the OS picks it)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def worker(mode, args):
    """One mode, in this process (one rank of it with --ranks N). Returns the result dict on rank 0,
    None on the other ranks."""
    started = time.perf_counter()

    def progress(what):  # in the worker's log: where a mode that timed out spent its time
        print(f"[bench] {mode}: {what} at {time.perf_counter() - started:.1f} s", flush=True)

    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    # a port free now, not one derived from the mode: two benches side by side (one per GPU) run the
    # same modes at once, and a fixed port made the second one's rendezvous fail (EADDRINUSE)
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    from deepspeed.accelerator import get_accelerator
    acc = get_accelerator()
    acc.set_device(int(os.environ["LOCAL_RANK"]))  # before zero.Init and the inputs: one device per rank
    if mode == "bandwidth":
        return bandwidth_all_ranks(args.bw_gib)
    import deepspeed
    from deepspeed.runtime.zero.offload_config import OffloadStateTypeEnum

    import deepspeed_offload
    # What stream mode offloads: optimizer states and fp32 masters (the grad buffer must stay for backward).
    OFFLOADED = [OffloadStateTypeEnum.optim_states, OffloadStateTypeEnum.hp_params]
    cfg = ds_config(mode, args)
    if acc.device_name() == "cpu":  # CI runs the worker on the CPU: torch's Adam, no JIT build of an Adam op
        cfg["optimizer"]["params"]["torch_adam"] = True
    deepspeed.init_distributed()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if args.model == "llama":
        llama_classes()
    with deepspeed.zero.Init(config_dict_or_path=cfg, dtype=torch.bfloat16):
        model = build_model(args)
    nparams = sum(p.ds_numel for p in model.parameters())
    if mode == "dc_offload_opt_states_full":
        os.environ["DS_DC_OFFLOAD_OPT_BUDGET_GB"] = "0"  # DeepSpeed's own hook to force full offload
    progress("model built")
    engine, _, _, _ = deepspeed_offload.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    progress("engine built")
    warmup = args.warmup
    if "compile" in cfg:
        engine.compile()
        warmup = max(warmup, COMPILED_WARMUP)
    loss_of = make_loss(args, acc.current_device_name())

    def step():
        if mode == "offload_states":
            engine.reload_states()
        engine.step()
        if mode == "offload_states":
            engine.offload_states(include=OFFLOADED)

    def iteration(marks=None):
        """One synchronized iteration; ``marks`` (a dict) gets the wall clock, in microseconds since
        the epoch like the allocator's trace, at the start of forward, backward and step and at the end."""

        def mark(name):
            if marks is not None:
                acc.synchronize()
                marks[name] = time.time_ns() // 1000

        acc.synchronize()
        acc.reset_peak_memory_stats()
        t0 = time.perf_counter()
        mark("forward")
        loss = loss_of(engine)
        mark("backward")
        engine.backward(loss)
        acc.synchronize()
        t_bwd = time.perf_counter()
        peak_fwd_bwd = acc.max_memory_allocated()
        reserved_fwd_bwd = acc.max_memory_reserved()
        acc.reset_peak_memory_stats()
        mark("step")
        step()
        acc.synchronize()
        t1 = time.perf_counter()
        mark("end")
        peak_step = acc.max_memory_allocated()
        # Reserved too: a block freed while a copy stream still uses it stops counting as allocated
        # at once, but the allocator cannot hand it out again before that copy ends.
        reserved = max(reserved_fwd_bwd, acc.max_memory_reserved())
        return {"iter_s": t1 - t0, "step_s": t1 - t_bwd, "fwd_bwd_s": t_bwd - t0, "peak_step_GiB": peak_step / GiB,
                "peak_fwd_bwd_GiB": peak_fwd_bwd / GiB, "peak_iter_GiB": max(peak_fwd_bwd, peak_step) / GiB,
                "peak_reserved_GiB": reserved / GiB,
                "between_GiB": acc.memory_allocated() / GiB, "loss": loss.detach().float().item()}

    rows = []
    for k in range(warmup + args.iters):
        rows.append(iteration())
        progress(f"iteration {k + 1} of {warmup + args.iters} ({rows[-1]['iter_s']:.3f} s)")
    rows = rows[warmup:]
    out = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    for k in ("iter_s", "step_s", "fwd_bwd_s"):
        s = spread([r[k] for r in rows])
        out[k + "_min"], out[k + "_max"] = s["min"], s["max"]
    for k in ("peak_iter_GiB", "peak_reserved_GiB"):  # the worst iteration: what must fit
        out[k] = max(r[k] for r in rows)
    out["per_iter"] = rows
    out.update(pipelined(engine, loss_of, step, args.iters, acc))
    if args.timeline and mode in TIMELINE_MODES:
        out["timeline"] = traced(iteration, acc)
    out.update(params=nparams, iters=args.iters, warmup=warmup, model=args.model, ranks=world,
               state_GiB=state_bytes_per_rank(nparams, 1) / GiB)
    handle = deepspeed_offload.get_handle(engine)
    if mode == "checkpoint":
        out.update(checkpoint_times(engine, handle, loss_of, args, acc))
    store_bytes = None
    if handle is not None:
        store = getattr(handle, "store", None)
        store_bytes = getattr(store, "nbytes", None)
        slot_bytes = getattr(handle, "slot_bytes", 0)
        out.update(sub_groups=len(getattr(handle, "order", [])), slot_GiB=slot_bytes / GiB,
                   last_step=handle.step_stats(), counters=getattr(handle, "counters", None),
                   host_store_bytes=store_bytes)
        try:
            grad_bytes = max(int(sum(p.numel() for p in g)) for g in engine.optimizer.fp16_partitioned_groups) * 4
            out["peak_bound_GiB"] = out["between_GiB"] + (2 * slot_bytes + grad_bytes) / GiB
        except (AttributeError, ValueError):
            pass
    mine = {"rank": rank, "iter_s": out["iter_s"], "step_s": out["step_s"], "pipelined_iter_s": out["pipelined_iter_s"],
            "peak_iter_GiB": out["peak_iter_GiB"], "between_GiB": out["between_GiB"], "host_store_bytes": store_bytes,
            "rss_bytes": rss_bytes()}
    per_rank = [mine]
    if world > 1:
        import torch.distributed as dist
        per_rank = [None] * world
        dist.all_gather_object(per_rank, mine)
    out["per_rank"] = per_rank
    out["host"] = host_memory(per_rank, nparams, world)
    return out if rank == 0 else None


def pipelined(engine, loss_of, step, iters, acc):
    """The same iterations with no synchronization between them (copies may overlap the next
    forward): the mean over the run (``pipelined_iter_s``, wall clock to the last synchronize) and
    each iteration's spread, between device events recorded at each iteration's start."""
    events = acc.device_name() != "cpu" and acc.Event is not None
    stamps = []

    def stamp():
        if events:
            e = acc.Event(enable_timing=True)
            e.record()
            stamps.append(e)
        else:
            stamps.append(time.perf_counter())

    acc.synchronize()
    acc.reset_peak_memory_stats()
    t0 = time.perf_counter()
    for _ in range(iters):
        stamp()
        engine.backward(loss_of(engine))
        step()
    stamp()
    acc.synchronize()
    wall = (time.perf_counter() - t0) / iters
    # The peaks of real training: a write-back still running in the next forward holds its buffers
    # (allocated until the allocator sees the copy end), which the synchronized iterations never show.
    peaks = {"pipelined_peak_GiB": acc.max_memory_allocated() / GiB,
             "pipelined_peak_reserved_GiB": acc.max_memory_reserved() / GiB}
    if events:
        per = [a.elapsed_time(b) / 1e3 for a, b in zip(stamps, stamps[1:])]
    else:
        per = [b - a for a, b in zip(stamps, stamps[1:])]
    s = spread(per)
    return {"pipelined_iter_s": wall, "pipelined_iter_s_min": s["min"], "pipelined_iter_s_median": s["median"],
            "pipelined_iter_s_max": s["max"], **peaks}


def traced(iteration, acc):
    """One more iteration under the CUDA allocator's history recorder: allocated GiB over time from
    its trace (``timeline_from_trace``), with the forward/backward/step marks. None off CUDA."""
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
        row = iteration(marks)
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


def rss_bytes():
    import psutil
    return psutil.Process().memory_info().rss


def host_memory(per_rank, nparams, world):
    """Host memory per node, measured (every rank's host store and RSS; one node) against what
    ``deepspeed-offload estimate`` gives for everything offloaded."""
    stores = [r.get("host_store_bytes") for r in per_rank]
    return {"ranks_per_node": world,
            "store_bytes_per_node": sum(stores) if all(s is not None for s in stores) else None,
            "rss_bytes_per_node": sum(r["rss_bytes"] for r in per_rank),
            "estimate_pinned_per_node": estimate(nparams, world, world, bandwidth=1)["host_pinned_per_node"]}


def checkpoint_times(engine, handle, loss_of, args, acc):
    """DeepSpeed's synchronous save against ours, on the same engine and state."""
    import deepspeed_offload
    root = args.ckpt_dir
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
    for _ in range(3):  # training goes on while the write runs; the guard holds each step's write-back
        t = time.perf_counter()
        engine.backward(loss_of(engine))
        engine.step()
        acc.synchronize()
        iters.append(time.perf_counter() - t)
    deepspeed_offload.wait_for_checkpoint(engine)
    size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(root) for f in fs)
    shutil.rmtree(root, ignore_errors=True)
    return {"sync_save_s": sync_s, "async_blocking_s": blocking_s,
            "async_background_s": handle.checkpointer.last["background_s"], "iters_during_write_s": iters,
            "async_blocking_over_sync": blocking_s / sync_s, "checkpoint_GiB": size / GiB}


# ---------------------------------------------------------------------------------------- the driver


def build_parser(ap=None):
    ap = ap or argparse.ArgumentParser(prog="deepspeed-offload bench", description=__doc__.splitlines()[0])
    ap.add_argument("--modes", default="all", help="comma-separated: all (the default set), compile_sweep, "
                    f"{SWEEP}<GiB|default>, or from: " + ", ".join(MODES))
    ap.add_argument("--budgets", default="0,8,16,32,default",
                    help="memory_budget_gb of each compile_offload@ mode that compile_sweep stands for")
    ap.add_argument("--model", choices=list(MODEL_DEFAULTS), default="mlp",
                    help="mlp: Linear+ReLU layers in a ModuleList; sequential: the same in an nn.Sequential; "
                    "llama: a transformers LlamaForCausalLM (TinyLlama's shape by default)")
    ap.add_argument("--layers", type=int, default=None, help="default: 64 (mlp), 22 (llama)")
    ap.add_argument("--hidden", type=int, default=None, help="default: 4096 (mlp), 2048 (llama)")
    ap.add_argument("--tokens", type=int, default=4096, help="rows of the MLP's input")
    ap.add_argument("--intermediate", type=int, default=None, help="llama MLP width (5632)")
    ap.add_argument("--heads", type=int, default=None, help="llama attention heads (32)")
    ap.add_argument("--kv-heads", type=int, default=None, help="llama key/value heads (4)")
    ap.add_argument("--vocab", type=int, default=None, help="llama vocabulary (32000)")
    ap.add_argument("--batch", type=int, default=None, help="llama sequences per micro-batch (8)")
    ap.add_argument("--seq", type=int, default=None, help="llama tokens per sequence (2048)")
    ap.add_argument("--ranks", type=int, default=1, help="ranks per mode, one GPU each (torchrun, one node)")
    ap.add_argument("--sub-group-mb", type=int, default=256)
    ap.add_argument("--budget-gb", type=float, default=16.0, help="memory_budget_gb of compile_offload_budget")
    ap.add_argument("--overlap-memory-gb", type=float, default=None,
                    help="overlap_memory_gb of stream_overlap (default: null, derived)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--iters", type=int, default=8)
    ap.add_argument("--bw-gib", type=int, default=2)
    ap.add_argument("--timeout", type=int, default=400, help="seconds per mode")
    ap.add_argument("--ckpt-dir", default="/tmp/ds_offload_bench_ckpt")
    ap.add_argument("--out", default="bench.json")
    ap.add_argument("--resume", action="store_true",
                    help="keep the modes --out already holds results for (same arguments) and run the rest")
    ap.add_argument("--plot", default=None, help="PNG path for the chart (and <name>-sweep.png for the budget sweep)")
    ap.add_argument("--timeline", default=None,
                    help="PNG path for the memory timeline of one iteration of " + ", ".join(TIMELINE_MODES))
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--result-file", default=None, help=argparse.SUPPRESS)
    return ap


# What identifies a run (the rest says where its output goes or how it is driven).
NOT_IDENTITY = ("modes", "budgets", "resume", "out", "plot", "timeline", "timeout", "worker", "result_file")


def resolve(args):
    """Fill the model-dependent defaults (None) in place; returns ``args``."""
    for k, v in MODEL_DEFAULTS[args.model].items():
        if getattr(args, k, None) is None:
            setattr(args, k, v)
    return args


def args_record(args):
    """The bench's own arguments, JSON-ready (a namespace from the ``deepspeed-offload`` CLI carries more)."""
    keys = [a.dest for a in build_parser()._actions if a.dest != "help"]
    return {k: getattr(args, k, None) for k in keys}


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    return run(build_parser().parse_args(argv), argv)


def launcher(args):
    """How a worker process starts: plain Python for one rank, torchrun for several (one node)."""
    if args.ranks == 1:
        return [sys.executable]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.ranks}"]


def file_name(mode):
    return mode.replace("@", "_at_")


def run(args, argv):
    resolve(args)
    if args.worker:
        result = worker(args.worker, args)
        if result is not None:
            text = json.dumps(result)
            if args.result_file:
                with open(args.result_file + ".tmp", "w") as f:
                    f.write(text)
                os.replace(args.result_file + ".tmp", args.result_file)
            else:
                print("RESULT " + text, flush=True)
        return 0
    try:
        modes = expand_modes(args.modes, args.budgets)
    except ValueError as e:
        print(f"deepspeed-offload bench: {e}", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("deepspeed-offload bench: needs a CUDA device (it compares GPU steps and GPU memory)", file=sys.stderr)
        return 2
    if args.ranks > torch.cuda.device_count():
        print(f"deepspeed-offload bench: --ranks {args.ranks} needs {args.ranks} GPUs, this machine has "
              f"{torch.cuda.device_count()}", file=sys.stderr)
        return 2

    from tqdm import tqdm
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    results = {}
    if args.resume and os.path.exists(args.out):
        with open(args.out) as f:
            done = json.load(f)
        mine = {k: v for k, v in args_record(args).items() if k not in NOT_IDENTITY}
        theirs = {k: v for k, v in done["args"].items() if k not in NOT_IDENTITY}
        if mine != theirs:
            diff = sorted(k for k in set(mine) | set(theirs) if mine.get(k) != theirs.get(k))
            print(f"deepspeed-offload bench: {args.out} was written with other arguments ({', '.join(diff)}); "
                  "not resuming it", file=sys.stderr)
            return 2
        results = {m: r for m, r in done["results"].items() if "error" not in r}
    stem = os.path.splitext(args.out)[0]
    for mode in tqdm([m for m in modes if m not in results], desc="modes"):
        result_file = f"{stem}-{file_name(mode)}.result.json"
        if os.path.exists(result_file):
            os.remove(result_file)
        cmd = launcher(args) + ["-m", "deepspeed_offload.bench", "--worker", mode, "--result-file", result_file] + argv
        # Each mode compiles its own graphs: inductor's cache would hand one mode's compiled graphs
        # (without our ops, or for another budget) to the next, which compile mode refuses.
        inductor_cache = tempfile.mkdtemp(prefix=f"ds_offload_bench_inductor_{file_name(mode)}_")
        t = time.perf_counter()
        try:
            proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                  timeout=args.timeout, env=dict(os.environ, TORCHINDUCTOR_CACHE_DIR=inductor_cache))
            log, timed_out = proc.stdout, False
        except subprocess.TimeoutExpired as e:
            log = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
            timed_out = True
        finally:
            shutil.rmtree(inductor_cache, ignore_errors=True)
        if os.path.exists(result_file):
            with open(result_file) as f:
                results[mode] = json.load(f)
            os.remove(result_file)
        elif timed_out:
            results[mode] = {"error": f"timed out after {args.timeout}s\n" + log[-2000:]}
        else:
            results[mode] = {"error": log[-3000:] or "the worker wrote no result and no output"}
        with open(f"{stem}-{file_name(mode)}.log", "w") as f:  # the whole story, for a failure
            f.write(log)
        results[mode]["wall_s"] = time.perf_counter() - t
        brief = {k: v for k, v in results[mode].items() if k not in ("per_iter", "timeline", "per_rank")}
        tqdm.write(f"{mode}: {json.dumps(brief)[:600]}")
        summarize(results, args)  # after every mode: a run cut short keeps what it measured
    summary = summarize(results, args)
    print(report(summary))
    if args.plot:
        plot(summary, args.plot)
        sweep_path = f"{os.path.splitext(args.plot)[0]}-sweep.png"
        if plot_sweep(summary, sweep_path):
            print(f"budget sweep chart: {sweep_path}")
    if args.timeline:
        if plot_timeline(summary, args.timeline):
            print(f"memory timeline: {args.timeline}")
    return 0


def summarize(results, args):
    """The JSON summary of ``results``, written to ``args.out``: the copy floor (one rank's state
    bytes over the each-way bandwidth with both directions busy, measured with every rank copying at
    once), each offloading mode's overhead over its baseline against it, and the share of the floor
    that overlap hid: ``1 - overhead / floor`` (1: the copies cost nothing; 0: none hidden)."""
    bw = results.get("bandwidth", {})
    ranks = getattr(args, "ranks", 1) or 1
    params = next((r["params"] for r in results.values() if "params" in r), None)
    state_bytes = state_bytes_per_rank(params, ranks) if params else None
    floor_s = state_bytes / (bw["both_each_way_GBps"] * 1e9) if state_bytes and "both_each_way_GBps" in bw else None
    summary = {"floor_s": floor_s, "state_bytes_per_rank": state_bytes, "results": results,
               "date": time.strftime("%Y-%m-%d"), "args": args_record(args)}
    try:
        summary["device"] = torch.cuda.get_device_name(0)
        summary["torch"] = torch.__version__
    except Exception:
        pass
    for mode, r in results.items():
        base = results.get(baseline(mode), {})
        if not is_offloading(mode) or "iter_s" not in r or "iter_s" not in base or not floor_s:
            continue
        r["overhead_s"] = r["iter_s"] - base["iter_s"]
        r["overhead_over_floor"] = r["overhead_s"] / floor_s
        r["hidden_share"] = 1 - r["overhead_s"] / floor_s
        r["step_over_floor"] = r["step_s"] / floor_s
        if "pipelined_iter_s" in r and "pipelined_iter_s" in base:
            r["pipelined_overhead_s"] = r["pipelined_iter_s"] - base["pipelined_iter_s"]
            r["pipelined_hidden_share"] = 1 - r["pipelined_overhead_s"] / floor_s
    with open(args.out, "w") as f:
        json.dump(summary, f, indent=1)
    return summary


def _cell(r, key, fmt="{:.3f}"):
    """``median (min-max)`` where the spread was measured, the median alone otherwise."""
    if key not in r:
        return ""
    text = fmt.format(r[key])
    if key + "_min" in r:
        text += f" ({fmt.format(r[key + '_min'])}-{fmt.format(r[key + '_max'])})"
    return text


def table(results):
    lines = ["| mode | iteration s | fwd+bwd s | step s | pipelined iteration s | peak iteration GiB | peak fwd+bwd GiB "
             "| peak in step GiB | between steps GiB | peak reserved GiB | over baseline s | floor hidden |",
             "|---" * 12 + "|"]
    for mode, r in results.items():
        if mode == "bandwidth":
            continue
        if "error" in r:
            last = [l for l in r["error"].splitlines() if l.strip()][-1:] or ["?"]
            lines.append(f"| {mode} | failed: {last[0][-100:].replace('|', '/')} |" + " |" * 10)
            continue
        base = results.get(baseline(mode), {})
        over = f"{r['iter_s'] - base['iter_s']:+.3f} ({baseline(mode)})" if "iter_s" in base and base is not r else ""
        hidden = f"{r['hidden_share']:.0%}" if "hidden_share" in r else ""
        lines.append(f"| {mode} | {_cell(r, 'iter_s')} | {_cell(r, 'fwd_bwd_s')} | {_cell(r, 'step_s')} | "
                     f"{_cell(r, 'pipelined_iter_s_median' if 'pipelined_iter_s_median' in r else 'pipelined_iter_s')} | "
                     f"{_cell(r, 'peak_iter_GiB', '{:.2f}')} | {_cell(r, 'peak_fwd_bwd_GiB', '{:.2f}')} | "
                     f"{_cell(r, 'peak_step_GiB', '{:.2f}')} | {_cell(r, 'between_GiB', '{:.2f}')} | "
                     f"{_cell(r, 'peak_reserved_GiB', '{:.2f}')} | {over} | {hidden} |")
    return "\n".join(lines)


def report(summary):
    """The text printed at the end of a run: the table and one line per figure worth reading."""
    results, floor_s = summary["results"], summary.get("floor_s")
    lines = [table(results)]
    bw = results.get("bandwidth", {})
    if "h2d_GBps" in bw:
        lines.append(f"bandwidth GB/s: H2D {bw['h2d_GBps']:.1f}, D2H {bw['d2h_GBps']:.1f}, both at once "
                     f"{bw['both_each_way_GBps']:.1f} each way, pageable H2D {bw['pageable_h2d_GBps']:.1f}")
        for r in bw.get("ranks") or []:
            lines.append(f"  rank {r['rank']}: alone H2D/D2H/both {r['alone']['h2d_GBps']:.1f}/"
                         f"{r['alone']['d2h_GBps']:.1f}/{r['alone']['both_each_way_GBps']:.1f}, all ranks at once "
                         f"{r['together']['h2d_GBps']:.1f}/{r['together']['d2h_GBps']:.1f}/"
                         f"{r['together']['both_each_way_GBps']:.1f}")
    if floor_s:
        lines.append(f"copy floor (state bytes per rank / bidirectional bandwidth): {floor_s:.3f} s")
    for mode, r in results.items():
        if "overhead_s" in r:
            lines.append(f"{mode}: over {baseline(mode)} {r['overhead_s']:+.3f} s = {r['overhead_over_floor']:.2f}x "
                         f"floor (hidden {r['hidden_share']:.0%}; pipelined {r.get('pipelined_hidden_share', float('nan')):.0%}); "
                         f"step {r['step_s']:.3f} s; peak iteration {r.get('peak_iter_GiB', float('nan')):.2f} GiB "
                         f"(pipelined {r.get('pipelined_peak_GiB', float('nan')):.2f}, reserved "
                         f"{r.get('pipelined_peak_reserved_GiB', float('nan')):.2f}); "
                         f"last step {r.get('last_step')}; counters {r.get('counters')}")
    for mode, r in results.items():
        host = r.get("host")
        if host:
            store = host["store_bytes_per_node"]
            lines.append(f"{mode}: host per node ({host['ranks_per_node']} ranks): store "
                         f"{'-' if store is None else f'{store / GiB:.2f} GiB'}, RSS {host['rss_bytes_per_node'] / GiB:.2f}"
                         f" GiB; estimate {host['estimate_pinned_per_node'] / GiB:.2f} GiB")
    ck = results.get("checkpoint", {})
    if "sync_save_s" in ck:
        lines.append(f"checkpoint ({ck['checkpoint_GiB']:.1f} GiB): DeepSpeed synchronous save {ck['sync_save_s']:.2f} s; "
                     f"async save blocked {ck['async_blocking_s']:.3f} s ({ck['async_blocking_over_sync']:.1%} of it), "
                     f"wrote in the background in {ck['async_background_s']:.2f} s; iterations during the write "
                     f"{', '.join(f'{t:.3f}' for t in ck['iters_during_write_s'])} s")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------- charts


def _pyplot():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _spread_err(res, names, key):
    """Error bars (below, above the median) where the run kept the spread, else None."""
    if not all(key + "_min" in res[m] for m in names):
        return None
    return [[res[m][key] - res[m][key + "_min"] for m in names], [res[m][key + "_max"] - res[m][key] for m in names]]


def plot(summary, path):
    """Two panels, one row per mode (horizontal bars: a dozen mode names stay readable). Iteration
    time with its min-max where measured; the copy floor is marked on each offloading mode's bar as
    its baseline's time plus the floor, since the compiled modes start from DeepCompile's faster
    iteration, not from eager ZeRO-3's. Memory: the iteration peak (runs before it: the step's),
    the step's and what stays between steps."""
    plt = _pyplot()
    res = {m: r for m, r in summary["results"].items() if "iter_s" in r}
    names = list(res)[::-1]  # first mode at the top
    ys = list(range(len(names)))
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 0.35 * len(names) + 2.2), sharey=True)
    a1.barh(ys, [res[m]["iter_s"] for m in names], color="tab:blue", xerr=_spread_err(res, names, "iter_s"),
            error_kw={"elinewidth": 1, "capsize": 2})
    floor = summary.get("floor_s")
    marks = [(y, res[baseline(m)]["iter_s"] + floor) for y, m in zip(ys, names)
             if floor and is_offloading(m) and baseline(m) in res]
    if marks:
        a1.scatter([x for _, x in marks], [y for y, _ in marks], marker="|", s=300, color="tab:red", zorder=3,
                   label=f"baseline + copy floor ({floor:.3f} s)")
        a1.legend(loc="upper center", bbox_to_anchor=(0.5, -0.12), frameon=False)
    a1.set_xlabel("iteration time, s (median, min-max)")
    a1.set_yticks(ys)
    a1.set_yticklabels(names)
    iter_peak = all("peak_iter_GiB" in res[m] for m in names)
    h = 0.27 if iter_peak else 0.4
    if iter_peak:
        a2.barh([y + h for y in ys], [res[m]["peak_iter_GiB"] for m in names], height=h, label="iteration peak")
        a2.barh(ys, [res[m]["peak_step_GiB"] for m in names], height=h, label="peak in step")
        a2.barh([y - h for y in ys], [res[m]["between_GiB"] for m in names], height=h, label="between steps")
    else:
        a2.barh([y + 0.2 for y in ys], [res[m]["peak_step_GiB"] for m in names], height=h, label="peak in step")
        a2.barh([y - 0.2 for y in ys], [res[m]["between_GiB"] for m in names], height=h, label="between steps")
    a2.set_xlabel("GPU memory allocated, GiB")
    a2.legend(loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=3, frameon=False)
    fig.suptitle(f"{summary.get('device', '')}, {summary['date']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_sweep(summary, path):
    """Iteration time against iteration peak: our compile mode at each budget (a line, in budget
    order, labelled), DeepCompile's own offload_opt_states and compiled ZeRO-3 without offload as
    points on the same axes. Returns False (and draws nothing) without a measured sweep point."""
    res = {m: r for m, r in summary["results"].items() if "iter_s" in r}
    sweep = [m for m in res if is_compile_offload(m)]
    if not sweep:
        return False
    args = argparse.Namespace(budget_gb=summary.get("args", {}).get("budget_gb", 16.0))
    order = sorted(sweep, key=lambda m: (compile_budget(m, args) is None, compile_budget(m, args) or 0))
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7.5, 5))

    def peak(m):
        return res[m].get("peak_iter_GiB", res[m]["peak_step_GiB"])

    ax.errorbar([peak(m) for m in order], [res[m]["iter_s"] for m in order], yerr=_spread_err(res, order, "iter_s"),
                marker="o", capsize=3, label="deepspeed-offload compile mode, by memory_budget_gb")
    labels = {}  # budgets that land on (nearly) one point, all fitting or none, share one label
    for m in order:
        b = compile_budget(m, args)
        near = (round(peak(m), 1), round(res[m]["iter_s"], 2))
        xy, names = labels.setdefault(near, ((peak(m), res[m]["iter_s"]), []))
        names.append("default" if b is None else f"{b:g} GiB")
    for xy, names in labels.values():
        ax.annotate(", ".join(names), xy, textcoords="offset points", xytext=(6, 4), fontsize=8)
    for m, marker in (("dc_offload_opt_states", "s"), ("dc_offload_opt_states_full", "D"), ("compiled", "*")):
        if m in res:
            ax.errorbar([peak(m)], [res[m]["iter_s"]], yerr=_spread_err(res, [m], "iter_s"), marker=marker,
                        linestyle="none", capsize=3, markersize=9 if marker == "*" else 7,
                        label=m if m != "compiled" else "compiled (DeepCompile, no offload)")
    _finish(plt, fig, ax, "iteration peak GPU memory, GiB", "iteration time, s (median, min-max)",
            f"compile-mode budget sweep, {summary.get('device', '')} {summary['date']}", path)
    return True


def plot_timeline(summary, path):
    """Allocated GiB over one iteration for resident, stream and stream_overlap on one chart, with
    each mode's backward, step and end marked in its colour. Returns False without a traced mode."""
    traced_modes = [m for m in TIMELINE_MODES if (summary["results"].get(m) or {}).get("timeline")]
    if not traced_modes:
        return False
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(10, 5))
    styles = {"backward": ":", "step": "--", "end": "-."}
    for m, color in zip(traced_modes, ("tab:blue", "tab:orange", "tab:green")):
        tl = summary["results"][m]["timeline"]
        ax.step(tl["t_s"], tl["allocated_GiB"], where="post", color=color, label=f"{m} (peak {tl['peak_GiB']:.1f} GiB)")
        for k, ls in styles.items():
            if k in tl["marks_s"]:
                ax.axvline(tl["marks_s"][k], color=color, linestyle=ls, alpha=0.6, linewidth=1)
    for k, ls in styles.items():
        ax.plot([], [], color="gray", linestyle=ls, label=f"{k} starts" if k != "end" else "step ends")
    _finish(plt, fig, ax, "time since the start of forward, s", "GPU memory allocated, GiB",
            f"one iteration, {summary.get('device', '')} {summary['date']}", path)
    return True


def _finish(plt, fig, ax, xlabel, ylabel, title, path):
    """Labels, grid, legend and title of a one-panel chart; written to ``path``."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
