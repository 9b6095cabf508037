"""The ``deepspeed-offload`` console script.

``check`` validates a ds_config exactly as ``initialize`` would (same code path, nothing created)
and says in one line what would happen; exit 2 with the ConfigError on stderr otherwise. Every
numeric argument must be a positive, finite number (argparse exits 2 naming the argument).
"""

import argparse
import hashlib
import json
import math
import os
import sys
import time

from .config import validate
from .ds_config import load_ds_config
from .framework_fill import FRAMEWORKS, fill, has_auto, parse_set, strict_json
from .errors import BLOCK, ConfigError
from .env_settings import read_env
from .sizing.fit import (H200_BANDWIDTH_GBPS, add_arguments as add_fit_arguments, describe as describe_fit,
                  from_args as fit_from_args, shape_from_args)
from .sizing.estimate import (HOST_BANDWIDTH_GBPS, deepspeed_pinned_per_rank, estimate, host_plan, speculation_bytes, state_bytes_per_rank)
from .sizing.host_memory import HostMemory, check_host_plan, format_bytes
from .sizing.verdict import UNKNOWN, Verdict, for_host, for_split
from .runtime.memory.node_plan import largest_params, node_plan_for, split


def positive_int(text: str) -> int:
    """A count: 350000000, 350_000_000 or 3.5e8 (an integral value), at least 1."""
    try:
        value = int(text)
    except ValueError:
        try:
            f = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not math.isfinite(f) or f != int(f):
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        value = int(f)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be at least 1")
    return value


def positive_float(text: str) -> float:
    """A rate: finite and above 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be a finite number above 0")
    return value


def ranks_per_node_default(world: int) -> int:
    """Ranks sharing this host when not given (``check`` and ``estimate`` alike): the launcher's
    (``LOCAL_WORLD_SIZE``), else one per accelerator of this node, else (no accelerator here: planning
    for another node) up to 8; never more than the world."""
    local = os.environ.get("LOCAL_WORLD_SIZE", "")
    if local.isdigit() and int(local) > 0:
        return min(int(local), world)
    from deepspeed.accelerator import get_accelerator
    acc = get_accelerator()
    count = acc.device_count() if acc.device_name() != "cpu" else 0
    return min(count or 8, world)


def cmd_check(ns) -> int:
    fills = ""
    try:
        ds_config = load_ds_config(ns.config)
        framework = ns.framework or ("hf" if has_auto(ds_config) else None)
        if framework == "deepspeed":  # deepspeed.initialize / deepspeed_offload.initialize as they are
            framework = None
        elif framework is not None and os.path.isfile(ns.config):
            strict_json(ns.config)
        if framework is not None or ns.set:  # (--set alone: your values, nothing filled)
            ds_config, filled = fill(ds_config, framework, parse_set(ns.set), ns.hidden_size,
                                     ns.world_size or 1)
            who = {"hf": "the HF Trainer", "accelerate": "Accelerate", None: "--set"}[framework]
            fills = f"; checked as {who} fills it ({', '.join(f'{k}={v}' for k, v in filled.items())})" if filled else ""
        plan = validate(ds_config, strict_when_disabled=True, world_size=ns.world_size)
        if plan is not None:
            read_env()  # the DS_OFFLOAD_* variables, as attach will read them
        host_line = ""
        if plan is not None and ns.params:
            world = ns.world_size or 1
            host_line = "; " + _node_line(plan, ns.params, world, ns.ranks_per_node or ranks_per_node_default(world))
    except ConfigError as e:
        where = "" if e.path == ns.config else f"{ns.config}: "  # file errors name the file already
        print(f"deepspeed-offload: {where}{e}", file=sys.stderr)
        return 2
    if plan is None:
        print(f"{ns.config}: OK; {BLOCK} absent or disabled: plain DeepSpeed, nothing offloaded{fills}")
        return 0
    o = plan.offload
    origin = "from sub_group_mb" if plan.sub_group_size_set_by_us else "set by zero_optimization"
    budget = "derived from the device" if o.memory_budget_gb is None else f"{o.memory_budget_gb:g} GiB"
    speculate = "derived from the host" if o.speculate_memory_gb is None else f"{o.speculate_memory_gb:g} GiB"
    print(f"{ns.config}: OK; mode {plan.mode}, sub_group_size {plan.sub_group_size} elements ({origin}), "
          f"pin_memory {o.pin_memory}, overlap {o.overlap}, prefetch {o.prefetch}, resident budget {budget}, "
          f"speculation {speculate}{host_line}{fills}")
    return 0


def _node_line(plan, params: int, world: int, ranks: int) -> str:
    """What attach would judge for this host with ``ranks`` ranks of ``params`` over ``world``: each
    rank's store, speculation's share of what is spare (or none), the node's total against what it can give."""
    o = plan.offload
    state = state_bytes_per_rank(params, world)
    if plan.mode == "compile":
        budget_store = state
    elif o.memory_budget_gb is not None:
        budget_store = max(0, state - int(o.memory_budget_gb * 2**30))
    else:
        budget_store = -1
    speculates = plan.mode == "stream" and o.overlap and o.speculate_memory_gb != 0
    speculate = -1 if speculates and o.speculate_memory_gb is None else int((o.speculate_memory_gb or 0) * 2**30)
    node = node_plan_for(state, ranks, HostMemory.read(), budget_store, speculate if speculates else 0,
                         deepspeed_pinned_per_rank(params, world, plan.ds_config), o.async_checkpoint)
    store, twins = node.store_cap[0], node.twins_cap[0]
    on_gpu = state - store
    speculation = (f"speculation {format_bytes(twins)} per rank (what the stores leave, shared by {ranks} rank(s))"
                   if twins else "speculation without second regions (no host memory is spare after the stores: "
                   "its updates roll back from copies on the GPU, where backward leaves room)" if speculates
                   else "speculation off")
    gpu = f", {format_bytes(on_gpu)} of each rank's state stays on the GPU (the host cannot hold it)" if on_gpu else ""
    aside = node.aside_cap.get(0, 0)
    ckpt = "" if not o.async_checkpoint else (
        f"; async_checkpoint reserves {format_bytes(aside)} per rank for its copies aside" if aside else
        "; async_checkpoint: no room to reserve its copies aside (each save copies where the host then has room, "
        "else writes from the store)")
    return (f"node of {ranks} rank(s): store {format_bytes(store)} per rank{gpu}; {speculation}{ckpt}; pins "
            f"{format_bytes(ranks * (store + twins))} of the {format_bytes(node.usable)} it can give")


def cmd_estimate(ns) -> int:
    """What offload would free and cost, from the parameter count (or the model's shape) and the link's
    bandwidth; with the shape and --seq, whether the iteration fits (fit.py): exit 1 where it does not."""
    answer = None
    try:
        sub_group_mb, budget_gb, speculate_gb = 256, None, 0.0  # the block's defaults (speculation: not sized here)
        ds_config, plan = None, None
        if ns.config:
            ds_config = load_ds_config(ns.config)
            plan = validate(ds_config)
            if plan is not None:
                sub_group_mb, budget_gb = plan.offload.sub_group_mb, plan.offload.memory_budget_gb
                speculate_gb = plan.offload.speculate_memory_gb
        shape = shape_from_args(ns)  # (and --params, --largest-param from it where not given)
        if plan is not None and shape is not None:  # the reduce bucket initialize would pick for this model
            ds_config = plan.with_reduce_bucket(shape.hidden_size)
        bandwidth, measured = ns.bandwidth, False
        if bandwidth is None:
            from .sizing.bandwidth import measure_bandwidth
            bandwidth, measured = measure_bandwidth(), True
        if bandwidth is None and shape is not None:  # the fit answer's time: an H200's, as its throughput
            bandwidth, measured = H200_BANDWIDTH_GBPS, None
        if bandwidth is None:
            raise ConfigError("--bandwidth", "no CUDA device here to measure the host-device bandwidth: pass "
                              "--bandwidth GBps (each way, both directions at once)")
        ranks_per_node = ns.ranks_per_node or ranks_per_node_default(ns.world_size)
        if shape is not None:
            answer = fit_from_args(ns, shape, ds_config, budget_gb, sub_group_mb, speculate_gb, ranks_per_node,
                                   _device_memory(ns), _host_cap(ns, ranks_per_node), bandwidth)
    except ConfigError as e:
        print(f"deepspeed-offload estimate: {e}", file=sys.stderr)
        return 2
    placement = _split(ns, ranks_per_node) if budget_gb is None and answer is None else None
    resident_gb = (answer["resident_per_rank"] / 2**30 if answer is not None else
                   budget_gb if placement is None else placement["resident"] / 2**30)
    est = estimate(ns.params, ns.world_size, ranks_per_node, bandwidth, ns.host_bandwidth, sub_group_mb, resident_gb,
                   ns.largest_param)
    if placement is not None:
        est["placement"] = placement
    if answer is not None:
        est["fit"] = answer
    est["bandwidth_measured"] = measured  # (None: assumed, the H200 runs' figure)
    est["speculation_per_rank"] = spec = speculation_bytes(est["gpu_freed_per_rank"], speculate_gb)
    if not ns.json:
        src = {True: "measured", False: "given",
               None: "assumed: the H200 runs' median; pass --bandwidth"}[measured]
        budget = f"{budget_gb:g} GiB" if budget_gb is not None else "the measured plan's, as below" \
            if placement is not None or answer is not None else "measured after the second step (taken as 0 here)"
        per_rank_bw = est["bandwidth_per_rank_GBps"]
        print(f"optimizer state per rank: {format_bytes(est['state_per_rank'])} (12 bytes x "
              f"{-(-ns.params // ns.world_size):,} parameters); kept resident: {format_bytes(est['resident_per_rank'])} "
              f"(budget {budget})")
        print(f"GPU memory freed per rank between steps: {format_bytes(est['gpu_freed_per_rank'])}; during the step "
              f"the GPU holds two staging slots, {format_bytes(est['staging_during_step'])}")
        print(f"pinned host memory per node ({ranks_per_node} ranks): {format_bytes(est['host_pinned_per_node'])}"
              + ("" if not spec else f", plus {format_bytes(spec * ranks_per_node)} for speculation (second "
                 f"regions, speculate_memory_gb {speculate_gb:g})")
              + (", plus what the host has spare for speculation (speculate_memory_gb null)"
                 if speculate_gb is None else ""))
        shared = ("" if per_rank_bw == bandwidth else
                  f", the host's {ns.host_bandwidth:.1f} GB/s shared by {ranks_per_node} ranks")
        print(f"step copy time: {est['step_copy_s']:.3f} s at {per_rank_bw:.1f} GB/s each way per rank (link "
              f"{bandwidth:.1f} GB/s, {src}{shared})")
        if answer is not None:
            print(describe_fit(answer, shape, ranks_per_node, bandwidth, src))
        elif budget_gb is None:
            print(_describe_split(ns, ranks_per_node, placement))
    verdict = _verdict(ns, answer, placement, budget_gb, speculate_gb, ranks_per_node)
    if ns.json:
        print(json.dumps(dict(est, verdict=verdict.as_dict())))
    else:
        print(verdict.line())
    return verdict.exit_code


def _verdict(ns, answer, placement, budget_gb, speculate_gb, ranks_per_node) -> Verdict:
    """One verdict whichever way estimate was asked: the fit answer (the model's shape), the measured plan's
    split (--iteration-memory-gb), or the host alone (--params)."""
    if answer is not None:
        return Verdict(answer["verdict"], answer["why"], answer["what"], answer["ways_out"])
    if placement is not None:
        return for_split(placement, placement["host_cap"])
    if budget_gb is None:
        return Verdict(UNKNOWN, "the measured plan places the state once it has measured the iteration: give the "
                       "model (--model, or --model-config) and --seq, or --iteration-memory-gb (the figure it logs)")
    given = None if ns.host_memory_gb is None else HostMemory(total=int(ns.host_memory_gb * 2**30),
                                                              available=int(ns.host_memory_gb * 2**30))
    plan = host_plan(ns.params, ns.world_size, ranks_per_node, budget_gb, speculate_gb=speculate_gb)
    reason = None
    try:
        check_host_plan(plan, given)
    except ConfigError as e:
        reason = f"{e.reason} ({'this host' if given is None else '--host-memory-gb'})"
    return for_host(plan.store_per_rank, _host_cap(ns, ranks_per_node), budget_gb, reason)


def _host_cap(ns, ranks_per_node: int) -> int:
    memory = HostMemory.read() if ns.host_memory_gb is None else HostMemory(
        total=int(ns.host_memory_gb * 2**30), available=int(ns.host_memory_gb * 2**30))
    return memory.usable // ranks_per_node


def _split(ns, ranks_per_node: int):
    """The measured plan's split before anything runs (budget derived), where the device's memory and what
    the iteration needs besides the state are known (given, or the device here); else None."""
    device = _device_memory(ns)
    if device is None or ns.iteration_memory_gb is None:
        return None
    host_cap, state = _host_cap(ns, ranks_per_node), state_bytes_per_rank(ns.params, ns.world_size)
    margin = None if ns.margin_gb is None else int(ns.margin_gb * 2**30)
    out = split(state, host_cap, device, int(ns.iteration_memory_gb * 2**30), margin)
    out["largest_params"] = largest_params(ns.world_size, host_cap, device, out["iteration"], state, out["margin"])
    return out


def _describe_split(ns, ranks_per_node: int, out) -> str:
    if out is None:
        return (f"placement (memory_budget_gb null): the host can hold {format_bytes(_host_cap(ns, ranks_per_node))} "
                f"of each rank's state, the GPU keeps the rest; pass --iteration-memory-gb (the figure the measured "
                "plan logs) and, without a CUDA device here, --device-memory-gb, for the split")
    verdict = "fits" if out["fits"] else "does NOT fit (the part the host cannot hold does not fit on the GPU)"
    return (f"placement (memory_budget_gb null): {verdict}: {format_bytes(out['resident'])} of each rank's state "
            f"resident on the GPU, {format_bytes(out['streamed'])} streamed from the host (which can hold "
            f"{format_bytes(out['host_cap'])} per rank), beside {format_bytes(out['iteration'])} the iteration needs "
            f"and a margin of {format_bytes(out['margin'])} on a {format_bytes(out['device'])} device; the largest "
            f"model that fits: {out['largest_params']:,} parameters (with this one's activations)")


def _device_memory(ns):
    if ns.device_memory_gb is not None:
        return int(ns.device_memory_gb * 2**30)
    import torch
    return torch.cuda.get_device_properties(0).total_memory if torch.cuda.is_available() else None


def digest_throughput(gib: float) -> float:
    """GB/s of the checkpoint digest over ``gib`` GiB held in memory, its pieces hashed by as many
    threads as the load-time verification uses (the writer uses fewer: the disk sets its pace): what
    verifying hashes per second, reading the files aside."""
    from concurrent.futures import ThreadPoolExecutor
    from .runtime.checkpoint.files import HASH_THREADS, PIECE, WHOLE
    data = os.urandom(PIECE)
    pieces = max(HASH_THREADS, int(gib * 2**30 / PIECE))
    t0 = time.perf_counter()
    with ThreadPoolExecutor(HASH_THREADS) as pool:
        list(pool.map(lambda _: hashlib.new(WHOLE, data).digest(), range(pieces)))
    return pieces * PIECE / (time.perf_counter() - t0) / 1e9


def cmd_digest(ns) -> int:
    from .runtime.checkpoint.files import DIGEST, HASH_THREADS
    gbps = digest_throughput(ns.gib)
    print(f"{DIGEST}: {gbps:.2f} GB/s on {HASH_THREADS} thread(s) ({ns.gib:g} GiB hashed): verifying a 10 GB "
          f"rank's files at load takes about {10 / gbps:.1f} s plus reading them")
    return 0


def cmd_bench(ns) -> int:
    from . import bench
    return bench.run(ns, ns.raw_argv) or 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="deepspeed-offload",
                                     description="Optimizer-state offload for DeepSpeed ZeRO-3.")
    sub = parser.add_subparsers(dest="command", required=True)

    check = sub.add_parser("check",
                           help="validate a ds_config",
                           description="Validate a ds_config as deepspeed_offload.initialize would. Exit 0 with a "
                           "one-line summary, or exit 2 with the offending key path and the reason on stderr.")
    check.add_argument("config", help="path to the ds_config JSON")
    check.add_argument("--params", type=positive_int, default=None,
                       help="model parameters, to size the host store per rank")
    check.add_argument("--world-size", type=positive_int, default=None,
                       help="data-parallel ranks sharing the state; also checks DeepSpeed's train_batch_size = "
                       "micro batch x accumulation steps x world size (default: any world size the batch sizes allow)")
    check.add_argument("--ranks-per-node", type=positive_int, default=None,
                       help="ranks whose host stores share this host (default: the launcher's LOCAL_WORLD_SIZE, "
                       "else this node's accelerators, else up to 8; at most the world size)")
    check.add_argument("--framework", choices=FRAMEWORKS, default=None,
                       help="check the config as this framework launches it: read with json.load, each \"auto\" "
                       "filled as it fills it (default: hf when the config has \"auto\" values); deepspeed: as "
                       "deepspeed.initialize takes it, which refuses \"auto\"")
    check.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                       help="a value the framework takes from your arguments (a dotted ds_config key, e.g. "
                       "train_micro_batch_size_per_gpu=4 or bf16.enabled=true); repeatable")
    check.add_argument("--hidden-size", type=positive_int, default=None,
                       help="the model's hidden_size: fills the zero_optimization bucket sizes the frameworks derive "
                       "from it")
    check.set_defaults(func=cmd_check)

    est = sub.add_parser("estimate",
                         help="GPU memory freed, host memory needed and step cost",
                         description="Estimate, before launching, the GPU memory offload frees per rank, the "
                         "pinned host memory per node and the step's copy time, from the parameter count and the "
                         "host-device bandwidth (measured here when there is a CUDA device, or given); with the "
                         "model's shape and --seq, whether it fits, splits the state or does not fit (exit 1).")
    est.add_argument("--params", type=positive_int, default=None,
                     help="model parameters (default: counted from the model's shape, below)")
    est.add_argument("--largest-param", type=positive_int, default=0,
                     help="elements of the model's largest parameter (a Llama's embedding: vocabulary x hidden); "
                     "one larger than a sub-group is a sub-group of its own and sets the staging slots")
    est.add_argument("--world-size", type=positive_int, default=1, help="data-parallel ranks sharing the state")
    est.add_argument("--ranks-per-node", type=positive_int, default=None,
                     help="default: the launcher's LOCAL_WORLD_SIZE, else this node's accelerators, else up to 8; "
                     "at most the world size (as check)")
    est.add_argument("--config", help="ds_config with the optimizer_state_offload block (budget, sub_group_mb)")
    est.add_argument("--host-bandwidth", type=positive_float, default=HOST_BANDWIDTH_GBPS,
                     help="GB/s each way that the host's memory gives all its ranks together, both directions "
                     f"busy (default {HOST_BANDWIDTH_GBPS}: 2 x 36.4, measured with 2 H200 ranks streaming at once, "
                     "docs/benchmarks.md)")
    est.add_argument("--bandwidth", type=positive_float, default=None,
                     help="GB/s each way with both directions busy")
    est.add_argument("--iteration-memory-gb", type=positive_float, default=None,
                     help="device memory an iteration needs besides the optimizer state (the figure the measured "
                     "plan logs after the second step), for the split of the state between the GPU and the host")
    est.add_argument("--device-memory-gb", type=positive_float, default=None,
                     help="the GPU's memory (default: this machine's first CUDA device), or max_device_memory_gb")
    est.add_argument("--margin-gb", type=positive_float, default=None,
                     help="device memory the plan leaves free below the limit (default: the plan's first margin, 3%% "
                     "of the device and at least 1 GiB; the measured plan logs its own, wider after give-backs)")
    est.add_argument("--host-memory-gb", type=positive_float, default=None,
                     help="the node's available host memory (default: this host's MemAvailable and cgroup limit)")
    est.add_argument("--json", action="store_true", help="print the figures as JSON")
    add_fit_arguments(est, positive_int, positive_float)
    est.set_defaults(func=cmd_estimate)

    digest = sub.add_parser("digest", help="the checkpoint digest's speed on this host",
                            description="Measure the digest (sha256 of 32 MiB pieces, hashed by several threads) that "
                            "asynchronous checkpoints compute while writing and re-check at load: verifying a "
                            "rank's files costs about their size over it.")
    digest.add_argument("--gib", type=positive_float, default=2.0, help="how much data to hash (default 2 GiB)")
    digest.set_defaults(func=cmd_digest)

    from .bench import build_parser as bench_parser
    bench = sub.add_parser("bench", help="side-by-side benchmark against upstream DeepSpeed (needs a GPU)",
                           description="Run resident ZeRO-3, stream mode (overlap off and on), "
                           "offload_states, ZeRO-Offload, an async checkpoint, DeepCompile without offload, with our "
                           "compile mode and with its own offload_opt_states, and a copy-bandwidth probe, each in its own process, on the benchmark MLP "
                           "(docs/benchmarks.md) by default; write JSON and a PNG chart.")
    bench_parser(bench)
    bench.set_defaults(func=cmd_bench)
    from .envinfo import register as register_env
    register_env(sub)
    return parser


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ns = build_parser().parse_args(argv)
    ns.raw_argv = argv[1:]
    return ns.func(ns)


if __name__ == "__main__":
    sys.exit(main())
