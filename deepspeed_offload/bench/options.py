"""The benchmark's command line: its arguments, the defaults that depend on the model, and the
JSON record of a run's arguments (what ``--resume`` compares).

The same parser serves ``deepspeed-offload bench``, ``python -m deepspeed_offload.bench`` and each
worker process (the driver passes its own argv on, plus ``--worker MODE --result-file PATH``).
"""

import argparse
import shlex

from . import models
from .modes import ALIASES, FAMILIES, FIXED, SWEEPS

DESCRIPTION = ("Our stream and compile modes side by side with the upstream DeepSpeed ways of handling optimizer "
               "state, each mode in its own process.")
TIMELINE_HELP = "resident and the stream modes (stream, stream_overlap, stream@B, stream_overlap@B)"

# What identifies a run (the rest says where its output goes or how it is driven; a preset is
# identified by the sizes it sets, which are compared).
NOT_IDENTITY = ("modes", "budgets", "resume", "out", "plot", "timeline", "trace", "profile", "timeout", "worker",
                "result_file", "preset")


def build_parser(ap=None):
    """The bench's arguments, added to ``ap`` (the CLI's subparser) or to a parser of its own."""
    ap = ap or argparse.ArgumentParser(prog="deepspeed-offload bench", description=DESCRIPTION)
    ap.add_argument("--modes", default="all", help="comma-separated: all (the default set), "
                    f"{', '.join(SWEEPS)}, {', '.join(f + '@<GiB|default>' for f in FAMILIES)}, or from: "
                    + ", ".join(FIXED + list(ALIASES)) + "; any of them as NAME/bucket=N: with reduce_bucket_size N, "
                    "any of ours as NAME/sub_group_mb=N: with that sub_group_mb (two settings in one run, in turn "
                    "with --rounds)")
    ap.add_argument("--budgets", default="0,8,16,32,default",
                    help="memory_budget_gb of each NAME@ mode that a sweep in --modes stands for")
    ap.add_argument("--model", choices=list(models.MODEL_DEFAULTS), default="mlp",
                    help="mlp: Linear+ReLU layers in a ModuleList; sequential: the same in an nn.Sequential; "
                    "llama: a transformers LlamaForCausalLM (TinyLlama's shape by default)")
    ap.add_argument("--preset", choices=list(models.LLAMA_PRESETS), default=None,
                    help=f"llama's shape (default {models.DEFAULT_PRESET}); the size flags below override it")
    ap.add_argument("--grad-ckpt", nargs="?", const="non-reentrant", default=None,
                    choices=["reentrant", "non-reentrant"],
                    help="llama: gradient checkpointing on every decoder layer, 'reentrant' (transformers 4's default, "
                    "what most ZeRO-3 recipes set) or 'non-reentrant' (the flag alone; transformers 5's default)")
    ap.add_argument("--layers", type=int, default=None, help="default: 64 (mlp), the preset's (llama)")
    ap.add_argument("--hidden", type=int, default=None, help="default: 4096 (mlp), the preset's (llama)")
    ap.add_argument("--tokens", type=int, default=4096, help="rows of the MLP's input")
    ap.add_argument("--intermediate", type=int, default=None, help="llama MLP width (the preset's)")
    ap.add_argument("--heads", type=int, default=None, help="llama attention heads (the preset's)")
    ap.add_argument("--kv-heads", type=int, default=None, help="llama key/value heads (the preset's)")
    ap.add_argument("--vocab", type=int, default=None, help="llama vocabulary (the preset's)")
    ap.add_argument("--batch", type=int, default=None, help="llama sequences per micro-batch (8)")
    ap.add_argument("--seq", type=int, default=None, help="llama tokens per sequence (2048)")
    ap.add_argument("--ranks", type=int, default=1, help="ranks per mode, one GPU each (torchrun, one node)")
    ap.add_argument("--sub-group-mb", type=int, default=256)
    ap.add_argument("--budget-gb", type=float, default=16.0, help="memory_budget_gb of compile_offload_budget")
    ap.add_argument("--overlap-memory-gb", type=float, default=None,
                    help="overlap_memory_gb of stream_overlap and stream_overlap@B (default: null, derived)")
    ap.add_argument("--gradient-clipping", type=float, default=None,
                    help="gradient_clipping of every mode's ds_config (default: unset, DeepSpeed's 1.0); a tiny "
                    "value makes clipping fire at every step")
    ap.add_argument("--reduce-bucket-size", type=int, default=None,
                    help="zero_optimization.reduce_bucket_size of every mode (default: unset, DeepSpeed's 5e8 "
                    "elements; HF's 'auto' fills in hidden_size**2)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="run the modes this many times, in turn (every other round in reverse order), so that "
                    "the machine's drift over minutes falls on every mode alike; each mode's iterations are pooled, "
                    "and its time over its baseline is also given round by round")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--iters", type=int, default=8)
    ap.add_argument("--bw-gib", type=int, default=2)
    ap.add_argument("--timeout", default="400",
                    help="seconds per mode, and MODE=SECONDS for single modes: 900,zero_offload=1800 (a worker "
                    "past it is killed with every process it started and recorded as timed out)")
    ap.add_argument("--ckpt-dir", default="/tmp/ds_offload_bench_ckpt")
    ap.add_argument("--out", default="bench.json")
    ap.add_argument("--resume", action="store_true",
                    help="keep the modes --out already holds results for (same arguments; measured, or out of "
                    "memory) and run the rest")
    ap.add_argument("--plot", default=None, help="PNG path for the chart (and <name>-sweep.png for the budget sweep)")
    ap.add_argument("--timeline", default=None,
                    help="PNG path for the memory timeline of one iteration of " + TIMELINE_HELP)
    ap.add_argument("--trace", action="store_true",
                    help="also write the raw figures to --out: every measured iteration's row (per_iter) and, "
                    "with --timeline, the allocator timeline it is drawn from (timeline); off (the default): each "
                    "mode's medians, spreads and peaks only (--timeline's chart is drawn all the same; --charts-from "
                    "redraws a timeline only from a run written with --trace)")
    ap.add_argument("--profile", default=None,
                    help="directory for a torch.profiler trace of two more iterations of " + TIMELINE_HELP +
                    " (each mode's summary per stream goes into its result)")
    ap.add_argument("--memory-history", action="store_true",
                    help="run every iteration of " + TIMELINE_HELP + " under the CUDA allocator's history recorder "
                    "(slower) and list each time it reserved more after the first iteration (a segment, or pages of an "
                    "expandable one): its size, iteration, phase, and DeepSpeed's or our call that needed it")
    ap.add_argument("--charts-from", nargs="+", default=None, metavar="JSON",
                    help="run nothing: draw --plot/--timeline from these bench.json files (a committed run, or several "
                    "of one model: each mode from the first file that has it, the title giving every run's date; "
                    "--timeline needs a run written with --trace)")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--result-file", default=None, help=argparse.SUPPRESS)
    return ap


def command_line(recorded):
    """The ``deepspeed-offload bench`` command that a run's recorded arguments (``args_record``) stand for:
    every argument that differs from this version's default, in the parser's order (the model's sizes
    as ``resolve`` filled them in)."""
    words = ["deepspeed-offload", "bench"]
    for action in build_parser()._actions:
        if action.dest in ("help", "worker", "result_file") or action.dest not in recorded or not action.option_strings:
            continue
        value = recorded[action.dest]
        if value is None or value == action.default:
            continue
        flag = action.option_strings[0]
        if isinstance(action, argparse._StoreTrueAction):
            words.append(flag)
        else:
            words += [flag] + [shlex.quote(str(v)) for v in (value if isinstance(value, list) else [value])]
    return " ".join(words)


def resolve(args):
    """Fill the defaults that depend on other arguments (the model's sizes) in place; returns ``args``.
    Raises ValueError for arguments that do not go together."""
    return models.resolve(args)


def args_record(args):
    """The bench's own arguments, JSON-ready (a namespace from the ``deepspeed-offload`` CLI carries more)."""
    keys = [a.dest for a in build_parser()._actions if a.dest != "help"]
    return {k: getattr(args, k, None) for k in keys}


def identity_diff(args, recorded):
    """The argument names in which ``args`` and a run's recorded arguments differ, leaving out those
    that only say where output goes or how the run is driven (``NOT_IDENTITY``)."""
    defaults = vars(build_parser().parse_args([]))  # an argument newer than the record had its default
    mine = {k: v for k, v in args_record(args).items() if k not in NOT_IDENTITY}
    theirs = {k: recorded.get(k, defaults.get(k)) for k in set(recorded) | set(mine) if k not in NOT_IDENTITY}
    return sorted(k for k in set(mine) | set(theirs) if mine.get(k) != theirs.get(k))
