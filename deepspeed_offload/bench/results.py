"""A mode's result record, from what the worker measured: the iterations' medians, spreads and worst
peaks, what our handle reports (sub-groups, step stats, host store), each rank's figures and the
host memory per node against ``deepspeed-offload estimate``, or why a mode has none; with ``--rounds``, one mode's rounds
pooled into one record, and its time over its baseline's round by round."""

import statistics

import torch

from ..sizing.estimate import estimate
from .loop import GiB, SPECULATION_COUNTS, spread


def from_rows(rows):
    """The measured iterations' medians, with the spread of the times and the worst peaks (what must
    fit); every row under ``per_iter``; with speculation on, the iterations split by what their step
    did with the updates from backward (``by_speculation``)."""
    out = {k: statistics.median(r[k] for r in rows) for k in rows[0] if k not in SPECULATION_COUNTS}
    for k in ("iter_s", "step_s", "fwd_bwd_s"):
        s = spread([r[k] for r in rows])
        out[k + "_min"], out[k + "_max"] = s["min"], s["max"]
    for k in ("peak_iter_GiB", "peak_reserved_GiB"):
        out[k] = max(r[k] for r in rows)
    if "speculated" in rows[0]:
        out["by_speculation"] = by_speculation(rows)
    out["per_iter"] = rows
    return out


PIPELINED_PEAKS = ("pipelined_peak_GiB", "pipelined_peak_reserved_GiB")
# each round's own, under ``rounds`` (the checkpoint mode's save timings too)
ROUND_KEYS = ("iter_s", "fwd_bwd_s", "step_s", "pipelined_iter_s", "sync_save_s", "async_blocking_s",
              "async_background_s", "iters_during_write_s", "write_phases_s")


def unmeasured(r):
    """Why a mode has no figures, in a few words: out of memory, timed out or failed (None: measured)."""
    if r.get("oom"):
        peak = r.get("peak_before_GiB")
        where = "; ".join(filter(None, [f"peak {peak:.2f} GiB before" if peak is not None else None,
                                        r.get("last_progress")]))
        return "out of memory" + (f" ({where})" if where else "")
    if r.get("timeout"):
        return f"timed out after {r['timeout_s']:g} s" + (f" ({r['last_progress']})" if r.get("last_progress") else "")
    if "error" in r:
        last = [l for l in r["error"].splitlines() if l.strip()][-1:] or ["?"]
        return f"failed: {last[0][-100:]}"
    return None


def failed(r):
    """A mode's result without figures: it failed, ran out of memory or timed out."""
    return unmeasured(r) is not None


def pool_rounds(runs):
    """One mode's results from the rounds of ``--rounds``, as one result: the medians and spreads of
    all their synchronized iterations together (``from_rows``), the mean of their pipelined means
    (every round runs as many), the worst peaks; what the handle and the host reported from the last
    round; each round's own times under ``rounds``. A round without figures (failed, out of memory,
    timed out) is the result, with the round it was (``round``)."""
    for k, r in enumerate(runs):
        if failed(r):
            return dict(r, round=k + 1)
    if not all("per_iter" in r for r in runs):
        return runs[-1]  # the bandwidth probe: no iterations to pool
    out = dict(runs[-1])
    out.update(from_rows([row for r in runs for row in r["per_iter"]]))
    if all("pipelined_iter_s" in r for r in runs):
        means = [r["pipelined_iter_s"] for r in runs]
        out["pipelined_iter_s"] = statistics.mean(means)
        out["pipelined_iter_s_min"] = min(r.get("pipelined_iter_s_min", r["pipelined_iter_s"]) for r in runs)
        out["pipelined_iter_s_max"] = max(r.get("pipelined_iter_s_max", r["pipelined_iter_s"]) for r in runs)
        if all("pipelined_iter_s_median" in r for r in runs):
            out["pipelined_iter_s_median"] = statistics.median(r["pipelined_iter_s_median"] for r in runs)
    for k in PIPELINED_PEAKS:
        if all(k in r for r in runs):
            out[k] = max(r[k] for r in runs)
    out["rounds"] = [{k: r[k] for k in ROUND_KEYS if k in r} for r in runs]
    out["wall_s"] = sum(r.get("wall_s", 0.0) for r in runs)
    return out


def by_round(r, base):
    """``r``'s iteration time over its baseline's, round by round (both measured in every round of
    ``--rounds``, one beside the other): synchronized medians and pipelined means, with their medians."""
    rounds, base_rounds = r.get("rounds"), base.get("rounds")
    if not rounds or not base_rounds or len(rounds) != len(base_rounds):
        return None
    out = {}
    for key in ("iter_s", "pipelined_iter_s"):
        if all(key in a and key in b for a, b in zip(rounds, base_rounds)):
            ratios = [a[key] / b[key] for a, b in zip(rounds, base_rounds)]
            out[key] = {"ratios": ratios, "median": statistics.median(ratios)}
    return out or None


def by_speculation(rows):
    """Iterations whose step committed the updates from backward, rolled them back, or had none
    (a backward that did not speculate runs today's path): how many, and their median times."""
    kinds = {"committed": [r for r in rows if r["committed"]],
             "rolled_back": [r for r in rows if r["discarded"] and not r["committed"]],
             "not_speculating": [r for r in rows if not r["speculated"]]}
    return {kind: {"iters": len(rs), **({k: statistics.median(r[k] for r in rs) for k in ("iter_s", "fwd_bwd_s", "step_s")}
                                        if rs else {})}
            for kind, rs in kinds.items()}


def handle_stats(handle, engine, between_GiB):
    """What our mode's handle says after the run (nothing without one): sub-groups, staging slot,
    last step's stats, counters, host store bytes, and the bound on the step's peak (between steps +
    two slots + the largest gradient partition in fp32)."""
    if handle is None:
        return {}
    store = getattr(handle, "store", None)
    slot_bytes = getattr(handle, "slot_bytes", 0)
    out = {"sub_groups": len(getattr(handle, "order", [])), "slot_GiB": slot_bytes / GiB,
           "last_step": handle.step_stats(), "counters": handle.compile.counters if getattr(handle, "compile", None) is not None else None,
           "host_store_bytes": getattr(store, "nbytes", None),
           "speculation": None if getattr(handle, "speculation", None) is None else
           dict(handle.speculation.counters.as_dict(), members=len(handle.speculation.members),
                from_device_members=len(handle.speculation.from_device)),
           "plan": plan_record(handle)}
    try:
        grad_bytes = max(int(sum(p.numel() for p in g)) for g in engine.optimizer.fp16_partitioned_groups) * 4
        out["peak_bound_GiB"] = between_GiB + (2 * slot_bytes + grad_bytes) / GiB
    except (AttributeError, ValueError):
        pass
    return out


def plan_record(handle):
    """Where the state lives at the end (the measured plan's split, with what it measured), or None."""
    probe = getattr(handle, "probe", None)
    if probe is None:
        return None
    plan = getattr(handle, "plan", None)
    gib = lambda n: None if n is None else n / GiB  # noqa: E731
    out = {"resident_GiB": gib(probe.resident_bytes(len(handle.resident))), "resident_sub_groups": len(handle.resident),
           "streamed_GiB": gib(sum(handle.layout.nbytes.values())), "streamed_sub_groups": len(handle.order),
           "measurements": handle.timing.measurements, "divergences": handle.timing.divergences}
    if plan is not None:
        out.update(promoted=len(plan.promoted), give_backs=plan.give_backs,
                   decided_peak_reserved_GiB=gib(plan.decided_peak), iteration_GiB=gib(plan.iteration),
                   limit_GiB=gib(plan.limit), margin_GiB=gib(plan.margin), held_back_GiB=gib(plan.held_back))
    return out


def torch_pinned_bytes():
    """What torch's pinned (host) allocator holds now (``allocated_bytes.current``: blocks in use and
    cached), or None where torch has no such figure (no CUDA, a torch without host_memory_stats)."""
    stats = getattr(torch.cuda.memory, "host_memory_stats", None)
    if stats is None or not torch.cuda.is_available():
        return None
    try:
        return stats().get("allocated_bytes.current")
    except RuntimeError:
        return None


def host_pinned(handle):
    """The host memory pinned for the state: for our modes, what our host store holds locked now (the
    measured plan gives back what it made resident), its size at attach, the seconds its pinning took
    and the rate; for the others, torch's pinned allocator's figure (``pin_s``
    unknown). ``torch_pinned_GiB``: that figure for every mode (ours included)."""
    torch_bytes = torch_pinned_bytes()
    torch_gib = None if torch_bytes is None else torch_bytes / GiB
    store = getattr(handle, "store", None)
    if store is None:
        return {"host_pinned_GiB": torch_gib, "pin_s": None, "pin_GiBps": None, "torch_pinned_GiB": torch_gib}
    gib, pin_s = store.nbytes / GiB, store.pinning.seconds
    return {"host_pinned_GiB": store.pinned_bytes / GiB, "host_pinned_at_attach_GiB": gib, "pin_s": pin_s,
            "pin_GiBps": gib / pin_s if pin_s else None, "pinned_with": store.pinning.kind, "torch_pinned_GiB": torch_gib}


def rank_record(rank, out):
    """This rank's own figures, for rank 0's ``per_rank``."""
    return {"rank": rank, "iter_s": out["iter_s"], "step_s": out["step_s"], "pipelined_iter_s": out["pipelined_iter_s"],
            "peak_iter_GiB": out["peak_iter_GiB"], "between_GiB": out["between_GiB"],
            "host_store_bytes": out.get("host_store_bytes"), "host_pinned_GiB": out.get("host_pinned_GiB"),
            "rss_bytes": rss_bytes()}


def gather_ranks(mine, world):
    """Every rank's ``rank_record``, in rank order (a collective with several ranks)."""
    if world == 1:
        return [mine]
    import torch.distributed as dist
    per_rank = [None] * world
    dist.all_gather_object(per_rank, mine)
    return per_rank


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
