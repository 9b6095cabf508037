"""``deepspeed-offload bench``: our stream mode side by side with the upstream DeepSpeed ways of
handling optimizer state, on one GPU, each mode in its own process, medians over the measured
iterations, JSON plus a PNG chart.

    deepspeed-offload bench --out bench.json --plot bench.png [--modes resident,stream,...] [--layers 64 --hidden 4096]

Modes:
  resident        plain ZeRO-3, FusedAdam, states on the GPU
  stream          deepspeed-offload stream mode, everything offloaded (memory_budget_gb 0), no prefetch
  stream_prefetch the same with prefetch during the last backward
  offload_states  plain ZeRO-3 with engine.reload_states() before and offload_states(optim_states,
                  hp_params) after each step: the same state our modes offload
  zero_offload    ZeRO-Offload: offload_optimizer.device=cpu, DeepSpeedCPUAdam
  bandwidth       pinned host<->device copy bandwidth, each direction and both at once
  checkpoint      stream mode with async_checkpoint: DeepSpeed's synchronous save of the same engine,
                  then our async save (time until save_checkpoint returns, iterations run during the
                  write, time until the write is done)
  compiled        DeepCompile (engine.compile()), states resident
  compile_offload deepspeed-offload compile mode under DeepCompile, default budget (everything leaves at
                  the head of forward, comes back in backward as the budget allows)
  compile_offload_budget  the same with memory_budget_gb = --budget-gb: what does not come back in
                  backward within the budget streams through the step
  compile_offload_full    the same with memory_budget_gb 0: nothing comes back early, the step streams all
  dc_offload_opt_states       DeepCompile with its own compile.offload_opt_states, default budget
  dc_offload_opt_states_full  the same, forced to offload everything (DS_DC_OFFLOAD_OPT_BUDGET_GB=0)

Per iteration (synchronized): iteration time, step time, peak GPU memory during the step (peak
stats reset right before engine.step()), GPU memory allocated between steps.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch

MODES = ["bandwidth", "resident", "stream", "stream_prefetch", "offload_states", "zero_offload", "checkpoint",
         "compiled", "compile_offload", "compile_offload_budget", "compile_offload_full", "dc_offload_opt_states",
         "dc_offload_opt_states_full"]
# The modes reported as overhead over their baseline, against the copy floor.
OFFLOADING = ["stream", "stream_prefetch", "compile_offload", "compile_offload_budget", "compile_offload_full",
              "dc_offload_opt_states", "dc_offload_opt_states_full"]
# DeepCompile compiles, profiles and re-applies its passes over the first steps: warm up longer.
COMPILED_WARMUP = 6
GiB = 2**30


def ds_config(mode, args):
    cfg = {
        "train_micro_batch_size_per_gpu": 1,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-4, "weight_decay": 0.0}},
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": 3},
        "steps_per_print": 10**9,
    }
    if mode.startswith("stream") or mode == "checkpoint":
        cfg["optimizer_state_offload"] = {"enabled": True, "mode": "stream", "memory_budget_gb": 0,
                                          "sub_group_mb": args.sub_group_mb, "prefetch": mode == "stream_prefetch",
                                          "async_checkpoint": mode == "checkpoint"}
    if mode.startswith("compile") or mode.startswith("dc_"):
        cfg["compile"] = {"deepcompile": True, "offload_opt_states": mode.startswith("dc_offload_opt_states")}
    if mode.startswith("compile_offload"):
        budget = {"compile_offload_budget": args.budget_gb, "compile_offload_full": 0}.get(mode)
        cfg["optimizer_state_offload"] = {"enabled": True, "mode": "compile", "sub_group_mb": args.sub_group_mb,
                                          "memory_budget_gb": budget}
    if mode == "zero_offload":
        cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    return cfg


def build_model(args):
    """DESIGN.md's MLP: ``args.layers`` × (Linear(hidden, hidden), ReLU). ``--model sequential`` is the
    ``nn.Sequential`` runs 1-4 measured, which DeepCompile did not compile under torch 2.11 (see
    docs/benchmarks.md); ``mlp`` (the default) is the same layers in a ModuleList, called in a loop
    the way transformer blocks are."""
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


def measure_bandwidth(gib=1):
    """GB/s each way with both directions busy, or None without a CUDA device."""
    if not torch.cuda.is_available():
        return None
    return bandwidth(argparse.Namespace(bw_gib=gib))["both_each_way_GBps"]


def bandwidth(args):
    n = args.bw_gib * GiB // 4
    host_a = torch.empty(n, dtype=torch.float32, pin_memory=True)
    host_b = torch.empty(n, dtype=torch.float32, pin_memory=True)
    pageable = torch.empty(n, dtype=torch.float32)
    dev_a = torch.empty(n, dtype=torch.float32, device="cuda")
    dev_b = torch.empty(n, dtype=torch.float32, device="cuda")
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()

    def timed(fn, reps=5):
        fn()
        torch.cuda.synchronize()
        times = []
        for _ in range(reps):
            t = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
        return statistics.median(times)

    nbytes = n * 4

    def both():
        with torch.cuda.stream(s1):
            dev_a.copy_(host_a, non_blocking=True)
        with torch.cuda.stream(s2):
            host_b.copy_(dev_b, non_blocking=True)

    return {
        "h2d_GBps": nbytes / timed(lambda: dev_a.copy_(host_a, non_blocking=True)) / 1e9,
        "d2h_GBps": nbytes / timed(lambda: host_b.copy_(dev_b, non_blocking=True)) / 1e9,
        "both_each_way_GBps": nbytes / timed(both) / 1e9,
        "pageable_h2d_GBps": nbytes / timed(lambda: dev_a.copy_(pageable)) / 1e9,
    }


def worker(mode, args):
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29600 + MODES.index(mode)))
    if mode == "bandwidth":
        return bandwidth(args)
    import deepspeed

    import deepspeed_offload

    from deepspeed.runtime.zero.offload_config import OffloadStateTypeEnum
    # What stream mode offloads: optimizer states and fp32 masters (the grad buffer must stay for backward).
    OFFLOADED = [OffloadStateTypeEnum.optim_states, OffloadStateTypeEnum.hp_params]
    cfg = ds_config(mode, args)
    deepspeed.init_distributed()
    with deepspeed.zero.Init(config_dict_or_path=cfg, dtype=torch.bfloat16):
        model = build_model(args)
    nparams = sum(p.ds_numel for p in model.parameters())
    if mode == "dc_offload_opt_states_full":
        os.environ["DS_DC_OFFLOAD_OPT_BUDGET_GB"] = "0"  # DeepSpeed's own hook to force full offload
    engine, _, _, _ = deepspeed_offload.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    warmup = args.warmup
    if "compile" in cfg:
        engine.compile()
        warmup = max(warmup, COMPILED_WARMUP)
    x = torch.randn(args.tokens, args.hidden, device="cuda", dtype=torch.bfloat16)

    def step():
        if mode == "offload_states":
            engine.reload_states()
        engine.step()
        if mode == "offload_states":
            engine.offload_states(include=OFFLOADED)

    rows = []
    for it in range(warmup + args.iters):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        loss = engine(x).float().pow(2).mean()
        engine.backward(loss)
        torch.cuda.synchronize()
        t_bwd = time.perf_counter()
        peak_fwd_bwd = torch.cuda.max_memory_allocated() / GiB
        torch.cuda.reset_peak_memory_stats()
        step()
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        rows.append({"iter_s": t1 - t0, "step_s": t1 - t_bwd, "fwd_bwd_s": t_bwd - t0,
                     "peak_step_GiB": torch.cuda.max_memory_allocated() / GiB, "peak_fwd_bwd_GiB": peak_fwd_bwd,
                     "between_GiB": torch.cuda.memory_allocated() / GiB})
    rows = rows[warmup:]
    # Pipelined: no synchronize between iterations, so copies may overlap the next forward.
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(args.iters):
        loss = engine(x).float().pow(2).mean()
        engine.backward(loss)
        step()
    torch.cuda.synchronize()
    pipelined = (time.perf_counter() - t0) / args.iters
    out = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    out.update(pipelined_iter_s=pipelined, params=nparams, iters=args.iters,
               state_GiB=nparams * 12 / GiB, loss=float(loss))
    handle = deepspeed_offload.get_handle(engine)
    if mode == "checkpoint":
        out.update(checkpoint_times(engine, handle, x, args))
    if handle is not None:
        stats = handle.step_stats()
        grad_bytes = max(int(sum(p.numel() for p in g)) for g in engine.optimizer.fp16_partitioned_groups) * 4
        out.update(sub_groups=len(handle.order), slot_GiB=handle.slot_bytes / GiB,
                   peak_bound_GiB=out["between_GiB"] + (2 * handle.slot_bytes + grad_bytes) / GiB,
                   last_step=stats, counters=getattr(handle, "counters", None))
    return out


def checkpoint_times(engine, handle, x, args):
    """DeepSpeed's synchronous save against ours, on the same engine and state."""
    import shutil

    import deepspeed_offload
    root = args.ckpt_dir
    shutil.rmtree(root, ignore_errors=True)
    torch.cuda.synchronize()
    t = time.perf_counter()
    handle.checkpointer._orig_save(os.path.join(root, "sync"), tag="t")
    sync_s = time.perf_counter() - t
    shutil.rmtree(os.path.join(root, "sync"))
    torch.cuda.synchronize()
    t = time.perf_counter()
    engine.save_checkpoint(os.path.join(root, "async"), tag="t")
    blocking_s = time.perf_counter() - t
    iters = []
    for _ in range(3):  # training goes on while the write runs; the guard holds each step's write-back
        t = time.perf_counter()
        engine.backward(engine(x).float().pow(2).mean())
        engine.step()
        torch.cuda.synchronize()
        iters.append(time.perf_counter() - t)
    deepspeed_offload.wait_for_checkpoint(engine)
    size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(root) for f in fs)
    shutil.rmtree(root, ignore_errors=True)
    return {"sync_save_s": sync_s, "async_blocking_s": blocking_s,
            "async_background_s": handle.checkpointer.last["background_s"], "iters_during_write_s": iters,
            "async_blocking_over_sync": blocking_s / sync_s, "checkpoint_GiB": size / GiB}


def baseline(mode):
    """What a mode is compared with: compiled modes with DeepCompile without offload, the rest with
    resident ZeRO-3."""
    return "compiled" if mode.startswith("compile_") or mode.startswith("dc_") else "resident"


def table(results, floor_s):
    lines = ["| mode | iteration s | step s | pipelined iteration s | peak fwd+bwd GiB | peak in step GiB | "
             "between steps GiB | over baseline s |", "|---|---|---|---|---|---|---|---|"]
    for mode in MODES[1:]:
        r = results.get(mode)
        if not r or "error" in r:
            if r:
                last = [l for l in r["error"].splitlines() if l.strip()][-1:] or ["?"]
                lines.append(f"| {mode} | failed: {last[0][-100:].replace('|', '/')} | | | | | | |")
            continue
        base = results.get(baseline(mode), {})
        over = f"{r['iter_s'] - base['iter_s']:+.3f} ({baseline(mode)})" if "iter_s" in base and base is not r else ""
        lines.append(f"| {mode} | {r['iter_s']:.3f} | {r['step_s']:.3f} | {r['pipelined_iter_s']:.3f} | "
                     f"{r.get('peak_fwd_bwd_GiB', float('nan')):.2f} | {r['peak_step_GiB']:.2f} | "
                     f"{r['between_GiB']:.2f} | {over} |")
    return "\n".join(lines)


def build_parser(ap=None):
    ap = ap or argparse.ArgumentParser(prog="deepspeed-offload bench", description=__doc__.splitlines()[0])
    ap.add_argument("--modes", default=",".join(MODES), help="comma-separated, from: " + ", ".join(MODES))
    ap.add_argument("--model", choices=["mlp", "sequential"], default="mlp",
                    help="the same layers as a ModuleList module (mlp) or an nn.Sequential")
    ap.add_argument("--layers", type=int, default=64)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--sub-group-mb", type=int, default=256)
    ap.add_argument("--budget-gb", type=float, default=16.0, help="memory_budget_gb of compile_offload_budget")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--iters", type=int, default=8)
    ap.add_argument("--bw-gib", type=int, default=2)
    ap.add_argument("--timeout", type=int, default=400)
    ap.add_argument("--ckpt-dir", default="/tmp/ds_offload_bench_ckpt")
    ap.add_argument("--out", default="bench.json")
    ap.add_argument("--resume", action="store_true",
                    help="keep the modes --out already holds results for (same arguments) and run the rest")
    ap.add_argument("--plot", default=None, help="PNG path for the chart")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    return ap


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    return run(build_parser().parse_args(argv), argv)


def run(args, argv):
    if not args.worker and not torch.cuda.is_available():
        print("deepspeed-offload bench: needs a CUDA device (it compares GPU steps and GPU memory)", file=sys.stderr)
        return 2

    if args.worker:
        print("RESULT " + json.dumps(worker(args.worker, args)), flush=True)
        return

    from tqdm import tqdm
    results = {}
    if args.resume and os.path.exists(args.out):
        with open(args.out) as f:
            done = json.load(f)
        if {k: v for k, v in done["args"].items() if k not in ("modes", "resume")} != \
                {k: v for k, v in vars(args).items() if k not in ("modes", "resume")}:
            print(f"deepspeed-offload bench: {args.out} was written with other arguments; not resuming it",
                  file=sys.stderr)
            return 2
        results = {m: r for m, r in done["results"].items() if "error" not in r}
    modes = [m for m in args.modes.split(",") if m not in results]
    for mode in tqdm(modes, desc="modes"):
        cmd = [sys.executable, "-m", "deepspeed_offload.bench", "--worker", mode] + argv
        t = time.perf_counter()
        try:
            log = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                 timeout=args.timeout).stdout
            line = [l for l in log.splitlines() if l.startswith("RESULT ")]
            results[mode] = json.loads(line[-1][7:]) if line else {"error": log[-3000:]}
        except subprocess.TimeoutExpired as e:
            results[mode] = {"error": f"timed out after {args.timeout}s"}
            log = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        with open(f"{os.path.splitext(args.out)[0]}-{mode}.log", "w") as f:  # the whole story, for a failure
            f.write(log)
        results[mode]["wall_s"] = time.perf_counter() - t
        tqdm.write(f"{mode}: {json.dumps(results[mode])[:600]}")
        summarize(results, args)  # after every mode: a run cut short keeps what it measured
    summary = summarize(results, args)
    floor_s = summary["floor_s"]
    print(table(results, floor_s))
    if floor_s:
        print(f"copy floor (state bytes / bidirectional bandwidth): {floor_s:.3f} s")
    for mode in OFFLOADING:
        r = results.get(mode, {})
        if "overhead_s" in r:
            print(f"{mode}: over {baseline(mode)} {r['overhead_s']:.3f} s = {r['overhead_over_floor']:.2f}x floor; "
                  f"step {r['step_s']:.3f} s = {r['step_over_floor']:.2f}x floor; peak {r['peak_step_GiB']:.2f} "
                  f"GiB (bound {r.get('peak_bound_GiB', float('nan')):.2f}); last step {r.get('last_step')}; "
                  f"counters {r.get('counters')}")
    ck = results.get("checkpoint", {})
    if "sync_save_s" in ck:
        print(f"checkpoint ({ck['checkpoint_GiB']:.1f} GiB): DeepSpeed synchronous save {ck['sync_save_s']:.2f} s; "
              f"async save blocked {ck['async_blocking_s']:.3f} s ({ck['async_blocking_over_sync']:.1%} of it), "
              f"wrote in the background in {ck['async_background_s']:.2f} s; iterations during the write "
              f"{', '.join(f'{t:.3f}' for t in ck['iters_during_write_s'])} s")
    if args.plot:
        plot(summary, args.plot)


def summarize(results, args):
    """The JSON summary of ``results`` (with overheads against the copy floor), written to ``args.out``."""
    bw = results.get("bandwidth", {})
    state_bytes = next((r["params"] * 12 for r in results.values() if "params" in r), None)
    floor_s = state_bytes / (bw["both_each_way_GBps"] * 1e9) if state_bytes and "both_each_way_GBps" in bw else None
    summary = {"floor_s": floor_s, "results": results, "date": time.strftime("%Y-%m-%d"), "args": vars(args)}
    try:
        summary["device"] = torch.cuda.get_device_name(0)
        summary["torch"] = torch.__version__
    except Exception:
        pass
    for mode in OFFLOADING:
        r, res = results.get(mode, {}), results.get(baseline(mode), {})
        if "iter_s" in r and "iter_s" in res and floor_s:
            r["overhead_s"] = r["iter_s"] - res["iter_s"]
            r["overhead_over_floor"] = r["overhead_s"] / floor_s
            r["step_over_floor"] = r["step_s"] / floor_s
    with open(args.out, "w") as f:
        json.dump(summary, f, indent=1)
    return summary


def plot(summary, path):
    """Two panels, one row per mode (horizontal bars: thirteen mode names stay readable). The copy
    floor is marked on each offloading mode's bar as its baseline's time plus the floor, since the
    compiled modes start from DeepCompile's faster iteration, not from eager ZeRO-3's."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    res = {m: r for m, r in summary["results"].items() if "iter_s" in r}
    names = list(res)[::-1]  # first mode at the top
    ys = range(len(names))
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 0.35 * len(names) + 2.2), sharey=True)
    a1.barh(list(ys), [res[m]["iter_s"] for m in names], color="tab:blue")
    floor = summary.get("floor_s")
    marks = [(y, res[baseline(m)]["iter_s"] + floor) for y, m in zip(ys, names)
             if floor and m in OFFLOADING and baseline(m) in res]
    if marks:
        a1.scatter([x for _, x in marks], [y for y, _ in marks], marker="|", s=300, color="tab:red", zorder=3,
                   label=f"baseline + copy floor ({floor:.3f} s)")
        a1.legend(loc="upper center", bbox_to_anchor=(0.5, -0.12), frameon=False)
    a1.set_xlabel("iteration time, s (median)")
    a1.set_yticks(list(ys))
    a1.set_yticklabels(names)
    a2.barh([y + 0.2 for y in ys], [res[m]["peak_step_GiB"] for m in names], height=0.4, label="peak in step")
    a2.barh([y - 0.2 for y in ys], [res[m]["between_GiB"] for m in names], height=0.4, label="between steps")
    a2.set_xlabel("GPU memory allocated, GiB")
    a2.legend(loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=2, frameon=False)
    fig.suptitle(f"{summary.get('device', '')}, {summary['date']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
