"""The run's summary and its text: the JSON written after every mode (copy floor, each offloading
mode's overhead over its baseline against the floor, the command, commit and machine; each measured
iteration's row and the allocator timeline only with ``--trace``), the markdown table and the lines
printed at the end of a run.

Modes are looked up in the catalogue by the names the results hold; a name this version does not
know (an old result file's) is shown, compared with resident ZeRO-3 and not against the floor.
"""

import argparse
import json
import os
import subprocess
import time

import torch

from ..sizing.estimate import state_bytes_per_rank
from .loop import GiB
from .modes import lookup
from .options import args_record, command_line
from .results import by_round, unmeasured

_DEFAULTS = dict(sub_group_mb=256, overlap_memory_gb=None, budget_gb=16.0)
# The raw figures of a mode's result, written to --out only with --trace: each measured iteration's
# row and the allocator timeline of one more (the summary keeps their medians, spreads and peaks).
RAW_KEYS = ("per_iter", "timeline")


def settings_of(summary_or_args):
    """What the catalogue needs to describe a result's mode: the run's recorded arguments (a summary's
    ``args``), or the parsed arguments themselves."""
    if isinstance(summary_or_args, argparse.Namespace):
        return summary_or_args
    recorded = (summary_or_args or {}).get("args") or {}
    return argparse.Namespace(**{k: recorded.get(k, v) if recorded.get(k) is not None else v
                                 for k, v in _DEFAULTS.items()})


def baseline_of(name, settings):
    mode = lookup(name, settings)
    return mode.baseline if mode else "resident"


def against_floor(name, settings):
    mode = lookup(name, settings)
    return bool(mode and mode.against_floor)


def without_raw(results):
    """``results`` without ``RAW_KEYS`` (what --out holds unless --trace)."""
    return {m: {k: v for k, v in r.items() if k not in RAW_KEYS} if isinstance(r, dict) else r
            for m, r in results.items()}


def code_commit():
    """The commit of the package's checkout (``+dirty`` with uncommitted changes), or None outside git."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    try:
        head = subprocess.run(["git", "-C", root, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              timeout=10)
        if head.returncode != 0 or not head.stdout.strip():
            return None
        dirty = subprocess.run(["git", "-C", root, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def hardware():
    """The machine, as a run's summary records it."""
    out = {"host_cpus": os.cpu_count()}
    try:
        out["host_memory_GiB"] = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GiB, 1)
    except (ValueError, OSError, AttributeError):
        pass
    try:
        out["gpu"], out["gpus"] = torch.cuda.get_device_name(0), torch.cuda.device_count()
    except Exception:
        pass
    return out


def summarize(results, args):
    """The JSON summary of ``results``, written to ``args.out``: the copy floor (one rank's state
    bytes over the each-way bandwidth with both directions busy, measured with every rank copying at
    once), each offloading mode's overhead over its baseline against it, and the share of the floor
    that overlap hid: ``1 - overhead / floor`` (1: the copies cost nothing; 0: none hidden). The file
    leaves out ``RAW_KEYS`` unless ``--trace``; the summary returned (for the report and the charts)
    has them."""
    bw = results.get("bandwidth", {})
    ranks = getattr(args, "ranks", 1) or 1
    params = next((r["params"] for r in results.values() if "params" in r), None)
    state_bytes = state_bytes_per_rank(params, ranks) if params else None
    floor_s = state_bytes / (bw["both_each_way_GBps"] * 1e9) if state_bytes and "both_each_way_GBps" in bw else None
    record = args_record(args)
    summary = {"floor_s": floor_s, "state_bytes_per_rank": state_bytes, "results": results,
               "date": time.strftime("%Y-%m-%d"), "args": record, "command": command_line(record),
               "commit": code_commit(), "hardware": hardware()}
    try:
        summary["device"] = torch.cuda.get_device_name(0)
        summary["torch"] = torch.__version__
    except Exception:
        pass
    settings = settings_of(args)
    for mode, r in results.items():
        base = results.get(baseline_of(mode, settings), {})
        if not against_floor(mode, settings) or "iter_s" not in r or "iter_s" not in base or not floor_s:
            continue
        r["overhead_s"] = r["iter_s"] - base["iter_s"]
        r["overhead_over_floor"] = r["overhead_s"] / floor_s
        r["hidden_share"] = 1 - r["overhead_s"] / floor_s
        r["step_over_floor"] = r["step_s"] / floor_s
        if "pipelined_iter_s" in r and "pipelined_iter_s" in base:
            r["pipelined_overhead_s"] = r["pipelined_iter_s"] - base["pipelined_iter_s"]
            r["pipelined_hidden_share"] = 1 - r["pipelined_overhead_s"] / floor_s
    for mode, r in results.items():
        base = results.get(baseline_of(mode, settings), {})
        ratios = by_round(r, base) if base is not r else None
        if ratios:
            r["by_round"] = ratios
    written = summary if record.get("trace") else dict(summary, results=without_raw(results))
    with open(args.out, "w") as f:
        json.dump(written, f, indent=1)
    return summary


def _cell(r, key, fmt="{:.3f}"):
    """``median (min-max)`` where the spread was measured, the median alone otherwise."""
    if key not in r:
        return ""
    text = fmt.format(r[key])
    if key + "_min" in r:
        text += f" ({fmt.format(r[key + '_min'])}-{fmt.format(r[key + '_max'])})"
    return text


def table(results, settings=None):
    """One markdown row per mode (the bandwidth probe left out); a mode without figures says why in
    one cell."""
    settings = settings or settings_of(None)
    lines = ["| mode | iteration s | fwd+bwd s | step s | pipelined iteration s | peak iteration GiB | peak fwd+bwd GiB "
             "| peak in step GiB | between steps GiB | peak reserved GiB | over baseline s | floor hidden |",
             "|---" * 12 + "|"]
    for mode, r in results.items():
        if mode == "bandwidth":
            continue
        why = unmeasured(r)
        if why:
            lines.append(f"| {mode} | {why.replace('|', '/')} |" + " |" * 10)
            continue
        base_name = baseline_of(mode, settings)
        base = results.get(base_name, {})
        over = f"{r['iter_s'] - base['iter_s']:+.3f} ({base_name})" if "iter_s" in base and base is not r else ""
        hidden = f"{r['hidden_share']:.0%}" if "hidden_share" in r else ""
        lines.append(f"| {mode} | {_cell(r, 'iter_s')} | {_cell(r, 'fwd_bwd_s')} | {_cell(r, 'step_s')} | "
                     f"{_cell(r, 'pipelined_iter_s_median' if 'pipelined_iter_s_median' in r else 'pipelined_iter_s')} | "
                     f"{_cell(r, 'peak_iter_GiB', '{:.2f}')} | {_cell(r, 'peak_fwd_bwd_GiB', '{:.2f}')} | "
                     f"{_cell(r, 'peak_step_GiB', '{:.2f}')} | {_cell(r, 'between_GiB', '{:.2f}')} | "
                     f"{_cell(r, 'peak_reserved_GiB', '{:.2f}')} | {over} | {hidden} |")
    return "\n".join(lines)


def _bandwidth_lines(bw):
    if "h2d_GBps" not in bw:
        return []
    lines = [f"bandwidth GB/s: H2D {bw['h2d_GBps']:.1f}, D2H {bw['d2h_GBps']:.1f}, both at once "
             f"{bw['both_each_way_GBps']:.1f} each way, pageable H2D {bw['pageable_h2d_GBps']:.1f}"]
    for r in bw.get("ranks") or []:
        lines.append(f"  rank {r['rank']}: alone H2D/D2H/both {r['alone']['h2d_GBps']:.1f}/"
                     f"{r['alone']['d2h_GBps']:.1f}/{r['alone']['both_each_way_GBps']:.1f}, all ranks at once "
                     f"{r['together']['h2d_GBps']:.1f}/{r['together']['d2h_GBps']:.1f}/"
                     f"{r['together']['both_each_way_GBps']:.1f}")
    return lines


def _overhead_line(mode, r, settings):
    return (f"{mode}: over {baseline_of(mode, settings)} {r['overhead_s']:+.3f} s = {r['overhead_over_floor']:.2f}x "
            f"floor (hidden {r['hidden_share']:.0%}; pipelined {r.get('pipelined_hidden_share', float('nan')):.0%}); "
            f"step {r['step_s']:.3f} s; peak iteration {r.get('peak_iter_GiB', float('nan')):.2f} GiB "
            f"(pipelined {r.get('pipelined_peak_GiB', float('nan')):.2f}, reserved "
            f"{r.get('pipelined_peak_reserved_GiB', float('nan')):.2f}); "
            f"last step {r.get('last_step')}; counters {r.get('counters')}")


def _speculation_line(mode, split):
    """How many measured iterations committed, rolled back or did not speculate, and their medians."""
    parts = [f"{v['iters']} {kind.replace('_', ' ')}" + (f" ({v['iter_s']:.3f} s)" if v["iters"] else "")
             for kind, v in split.items()]
    return f"{mode}: iterations by speculation (median s): " + ", ".join(parts)


def _rounds_line(mode, r, settings):
    """The mode's time over its baseline's in each round of ``--rounds``, and the median."""
    parts = [f"{'synchronized' if key == 'iter_s' else 'pipelined'} " + ", ".join(f"{x:.2f}" for x in v["ratios"])
             + f" (median {v['median']:.2f})" for key, v in r["by_round"].items()]
    return f"{mode}: x {baseline_of(mode, settings)} by round: " + "; ".join(parts)


def _host_line(mode, host):
    store = host["store_bytes_per_node"]
    return (f"{mode}: host per node ({host['ranks_per_node']} ranks): store "
            f"{'-' if store is None else f'{store / GiB:.2f} GiB'}, RSS {host['rss_bytes_per_node'] / GiB:.2f}"
            f" GiB; estimate {host['estimate_pinned_per_node'] / GiB:.2f} GiB")


def _startup_line(mode, r):
    """How long the mode took to start, and the host memory it pinned (where recorded)."""
    def num(key, fmt):
        return "?" if r.get(key) is None else fmt.format(r[key])

    if r.get("engine_built_s") is None:
        return None
    text = f"{mode}: engine built {num('engine_built_s', '{:.1f}')} s after the process started"
    if r.get("attach_s") is not None:
        text += f" (our attach {num('attach_s', '{:.1f}')} s)"
    if r.get("host_pinned_GiB") is not None:
        text += f"; host pinned {num('host_pinned_GiB', '{:.2f}')} GiB"
        if r.get("pin_s") is not None:
            text += f" in {num('pin_s', '{:.1f}')} s ({num('pin_GiBps', '{:.1f}')} GiB/s)"
    return text


def _checkpoint_line(ck):
    return (f"checkpoint ({ck['checkpoint_GiB']:.1f} GiB): DeepSpeed synchronous save {ck['sync_save_s']:.2f} s; "
            f"async save blocked {ck['async_blocking_s']:.3f} s ({ck['async_blocking_over_sync']:.1%} of it), "
            f"wrote in the background in {ck['async_background_s']:.2f} s; iterations during the write "
            f"{', '.join(f'{t:.3f}' for t in ck['iters_during_write_s'])} s")


def _colocation_line(mode, r):
    return (f"{mode}: offload_states() {r['colocate_offload_s']:.3f} s (first {r['colocate_first_offload_s']:.3f} s) + "
            f"reload_states() {r['colocate_reload_s']:.3f} s; allocated {r['colocate_before_GiB']:.2f} -> "
            f"{r['colocate_after_offload_GiB']:.2f} GiB, free for the rollout {r['colocate_free_GiB']:.1f} GiB")


def _growth_lines(mode, r, shown=8):
    """``--memory-history``: each time the allocator reserved more after the first iteration."""
    grew = r["reserved_growth"]
    lines = [f"{mode}: reserved memory grew {len(grew)} time(s) after the first iteration (its times were "
             "measured with the allocator's history recorder on)"
             + (" (the history's oldest entries were dropped)" if r.get("reserved_growth_truncated") else "")]
    for g in grew[:shown]:
        lines.append(f"  {g['MiB']:.0f} MiB in iteration {g['iteration']} {g['phase']}, with {g['active_GiB']:.2f} "
                     f"of {g['reserved_GiB']:.2f} GiB reserved in use" + "".join(f" < {f}" if k else f": {f}"
                                                                          for k, f in enumerate(g["frames"][:4])))
    return lines


def report(summary):
    """The text printed at the end of a run: the table and one line per figure worth reading."""
    results, floor_s = summary["results"], summary.get("floor_s")
    settings = settings_of(summary)
    lines = [table(results, settings)]
    lines += _bandwidth_lines(results.get("bandwidth", {}))
    if floor_s:
        lines.append(f"copy floor (state bytes per rank / bidirectional bandwidth): {floor_s:.3f} s")
    lines += [f"{mode}: out of memory: {r['error']}" for mode, r in results.items() if r.get("oom")]
    lines += [_overhead_line(mode, r, settings) for mode, r in results.items() if "overhead_s" in r]
    lines += list(filter(None, (_startup_line(mode, r) for mode, r in results.items())))
    lines += [_rounds_line(mode, r, settings) for mode, r in results.items() if r.get("by_round")]
    lines += [_speculation_line(mode, r["by_speculation"]) for mode, r in results.items() if r.get("by_speculation")]
    lines += [_host_line(mode, r["host"]) for mode, r in results.items() if r.get("host")]
    lines += [_colocation_line(mode, r) for mode, r in results.items() if "colocate_offload_s" in r]
    lines += [x for mode, r in results.items() if "reserved_growth" in r for x in _growth_lines(mode, r)]
    lines += [f"{mode}: {_checkpoint_line(r)}" for mode, r in results.items() if "sync_save_s" in r]
    return "\n".join(lines)
