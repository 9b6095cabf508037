"""Attach as one transaction on every rank: all of it happens, or none of it, on all ranks at once.

Three phases, each ending in an agreement (``agreement.py``), so that a failure on one rank is
raised on every rank, naming the failing rank and its cause, within seconds instead of leaving the
others in their next collective until the timeout:

1. **prepare** (``Prepared``): everything that can fail without changing anything: the
   ``DS_OFFLOAD_*`` settings, the engine's checks, what each sub-group moves (the layout's probe).
   Then one exchange of every rank's figures (``node_plan.RankFigures``), the node's host memory
   read by its first local rank before any rank pinned anything.
2. **place**: every rank judges every node's host plan from those figures (``node_plan.plan_node``:
   the same verdict everywhere), then decides its own split (resident sub-groups, store, second
   regions). A second exchange gives each node's first local rank the exact figures of its ranks,
   and it logs the node's plan.
3. **apply**: the mode is built (the store pinned, the state moved, the hooks installed, compile
   mode's pass registered); a failure undoes what that rank did (``StreamMode`` cleans up after
   itself), and if any rank failed, the ranks that succeeded detach. Then every rank raises.

``FAULT_POINT`` is for tests: called with the name of each stage, it may raise there.
"""

import os
from dataclasses import dataclass
from typing import Callable, List, Optional

from deepspeed.accelerator import get_accelerator
from deepspeed.utils import logger

from ..config import Plan
from ..env_settings import read_env
from ..errors import BLOCK, ConfigError
from ..handle import get_handle
from ..sizing.estimate import deepspeed_pinned_per_rank
from . import agreement
from .staging.copies import make_copies
from .memory.layout import Probe, probe_layout
from .memory.node_plan import (RankFigures, check_resident_fits, describe_node, host_first_resident, node_of_this_rank,
                               plan_node)

# Tests only: called with each stage's name ("settings", "host memory" where they begin; "pinning",
# "moving", "patching", "compile setup" once they have done their work, so that it must be undone);
# it may raise to fail the attach there.
FAULT_POINT: Optional[Callable[[str], None]] = None


def fault_point(stage: str):
    if FAULT_POINT is not None:
        FAULT_POINT(stage)


class AttachError(RuntimeError):
    """Attach failed on another rank; this one changed nothing (or undid what it changed)."""


@dataclass
class Prepared:
    """Phase 1's outcome on this rank: nothing changed yet."""
    plan: Plan
    probe: Probe
    synchronous: bool  # the CPU accelerator: device memory is host memory
    fixed_resident: Optional[int]  # sub-groups memory_budget_gb keeps resident (compile mode: 0); None: derived
    figures: RankFigures


@dataclass(frozen=True)
class Placement:
    """Phase 2's outcome on this rank: what the mode builds."""
    resident: int  # the first sub-groups (step order) that keep their state on the device
    twins_budget: int  # host bytes for speculation's second regions (0: none)
    host_first: bool  # the budget is derived: the measured plan may keep more resident later
    store_cap: int  # what this rank's store may take
    min_device_total: int = 0  # the smallest device among the ranks (compile mode's planner budget)
    aside_budget: int = 0  # host bytes the checkpoint may reserve for its copies aside (0: none)

    @classmethod
    def without_agreement(cls, cfg, probe: Probe, resident_budget: bool = True) -> "Placement":
        """A mode built directly, as tests do: ``memory_budget_gb``'s sub-groups resident (with
        ``resident_budget``; compile mode: none), no second regions but those ``speculate_memory_gb``
        asks for."""
        gb = cfg.memory_budget_gb if resident_budget else None
        resident = probe.fitting(int(gb * 2**30)) if gb is not None else 0
        return cls(resident=resident, twins_budget=int((cfg.speculate_memory_gb or 0) * 2**30), host_first=False,
                   store_cap=probe.total - probe.resident_bytes(resident))


def attach_mode(engine, plan: Plan, build: Callable[[Placement, Prepared], object],
                check: Optional[Callable[[object], None]] = None):
    """Attach ``build``'s mode to ``engine`` on every rank, or on none. ``check(engine)``: the mode's own
    refusals, run with the others before anything changes."""
    prepared = _agreed("attach", lambda: prepare(engine, plan, check))
    rows = agreement.exchange_numbers(prepared.figures.row())
    figures = [RankFigures.from_row(r) for r in rows]
    rank, _ = agreement.rank_world()
    placement, node_plan = _agreed("attach", lambda: place(prepared, figures, rank))
    # the exact figures of every rank, for the line each node's first local rank logs
    stores = agreement.exchange_numbers([placement.store_cap, placement.twins_budget, prepared.probe.resident_bytes(
        placement.resident)])
    if prepared.figures.local_rank == 0:
        logger.info(describe_node(node_plan, {r: stores[r][0] for r in node_plan.ranks},
                                  {r: stores[r][1] for r in node_plan.ranks},
                                  {r: stores[r][2] for r in node_plan.ranks},
                                  speculates=any(figures[r].speculate != 0 for r in node_plan.ranks)))
    mode = None
    error = None
    try:
        mode = build(placement, prepared)
    except Exception as e:  # the mode undid what it did before raising
        error = e
    failures = agreement.agree(None if error is None else agreement.describe(error))
    if failures and mode is not None:
        mode.undo_attach()
    _raise_agreed(failures, error, "attach")
    return mode


def prepare(engine, plan: Plan, check: Optional[Callable[[object], None]] = None) -> Prepared:
    """Phase 1 on this rank: what can fail before anything changes."""
    fault_point("settings")
    read_env()
    check_engine(engine, plan, check)
    acc = get_accelerator()
    synchronous = make_copies(acc).synchronous
    probe = probe_layout(engine.optimizer)
    offload = plan.offload
    if plan.mode == "compile":
        fixed = 0  # capacity-first: at attach nothing stays, the pass decides later
    elif offload.memory_budget_gb is not None:
        fixed = probe.fitting(int(offload.memory_budget_gb * 2**30))
    else:
        fixed = None  # host first (placement.py)
    budget_store = -1 if fixed is None else probe.total - probe.resident_bytes(fixed)
    spec = offload.speculate_memory_gb
    # (where speculation cannot run, no second regions are planned: compile mode, overlap off, fp32 parameters)
    speculate = -1 if spec is None else int(spec * 2**30)
    opt = engine.optimizer
    if plan.mode != "stream" or not offload.overlap or any(
            lp.dtype == hp.dtype for lp, hp in zip(opt.fp16_partitioned_groups_flat, opt.fp32_partitioned_groups_flat)):
        speculate = 0
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    params = sum(m.numel() for m in engine.optimizer.fp32_partitioned_groups_flat) * world
    device_free = 0 if synchronous else int(acc.available_memory()) + int(acc.memory_reserved() or 0)
    figures = RankFigures.read_host(node=node_of_this_rank(), local_rank=int(os.environ.get("LOCAL_RANK", "0") or 0),
                                    state=probe.total, budget_store=budget_store, speculate=speculate,
                                    deepspeed_pinned=deepspeed_pinned_per_rank(params, world, plan.ds_config),
                                    device_free=device_free,
                                    device_total=0 if synchronous else int(acc.total_memory()),
                                    checkpoint_aside=int(offload.async_checkpoint))
    return Prepared(plan, probe, synchronous, fixed, figures)


def place(prepared: Prepared, figures: List[RankFigures], rank: int):
    """Phase 2 on this rank: every node's host plan judged (any node that does not fit fails every
    rank), then this rank's split."""
    fault_point("host memory")
    plans = {node: plan_node(figures, node) for node in sorted({f.node for f in figures})}
    node_plan = plans[figures[rank].node]
    cap = node_plan.store_cap[rank]
    probe = prepared.probe
    resident = prepared.fixed_resident
    if resident is None:
        resident = host_first_resident(probe.nbytes_in_order(), cap)
        if resident and not prepared.synchronous:
            check_resident_fits(probe.resident_bytes(resident) - sum(probe.existing[:resident]),
                                int(get_accelerator().available_memory()), probe.total, cap)
    store = probe.total - probe.resident_bytes(resident)
    return Placement(resident=resident, twins_budget=node_plan.twins_cap[rank],
                     host_first=prepared.fixed_resident is None, store_cap=store,
                     min_device_total=min(f.device_total for f in figures),
                     aside_budget=node_plan.aside_cap.get(rank, 0)), node_plan


def check_engine(engine, plan: Plan, check: Optional[Callable[[object], None]] = None):
    """What the engine must be for ``plan``: refused with a ConfigError before anything changes."""
    if get_handle(engine) is not None:
        raise ConfigError(BLOCK, "this engine already has optimizer-state offload attached (by initialize, "
                          "install() or an earlier attach)")
    if engine.zero_optimization_stage() != 3:
        raise ConfigError("zero_optimization.stage",
                          f"the engine runs ZeRO stage {engine.zero_optimization_stage()}; offload needs stage 3")
    opt = engine.optimizer
    if not hasattr(opt, "fp32_partitioned_groups_flat"):
        raise ConfigError("zero_optimization.stage", f"the engine's optimizer ({type(opt).__name__}) is not "
                          "DeepSpeed's ZeRO-3 optimizer: build the engine with an optimizer")
    if getattr(opt, "use_muon", False):
        raise ConfigError("optimizer.type", "ZeRO-3's Muon path reads and writes the fp32 state outside the "
                          "sub-group loop that offload streams: use an Adam-family optimizer")
    if getattr(opt, "offload_optimizer", False) or getattr(opt, "swap_optimizer", False):
        raise ConfigError("zero_optimization.offload_optimizer.device",
                          "the engine already uses ZeRO-Offload for the optimizer state; rebuild it without")
    if check is not None:
        check(engine)
    # (one sub-group because the whole shard is smaller than a staging slot's worth is no setting's fault)
    if len(opt.fp16_groups) == 1 and not plan.sub_group_size_set_by_us and \
            opt.fp32_partitioned_groups_flat[0].numel() > plan.offload.sub_group_size:
        logger.warning("[deepspeed-offload] the engine has a single ZeRO-3 sub-group: nothing to pipeline, the "
                       "whole state passes through the GPU at once. Set zero_optimization.sub_group_size "
                       "(or leave it unset and use deepspeed_offload.initialize).")


def _agreed(what: str, fn):
    """``fn()`` on this rank, then the ranks agree whether any of them failed (one all-reduce)."""
    result, error = None, None
    try:
        result = fn()
    except Exception as e:
        error = e
    _raise_agreed(agreement.agree(None if error is None else agreement.describe(error)), error, what)
    return result


def _raise_agreed(failures, own: Optional[BaseException], what: str):
    """Every rank raises when any failed: its own error (a ConfigError keeps its key) naming the other
    failing ranks, or an AttachError naming them and their causes."""
    if not failures:
        return
    rank, world = agreement.rank_world()
    others = [r for r, _ in failures if r != rank]
    also = f" (attach also failed on rank(s) {others})" if others else ""
    where = f" [rank {rank}]" if world > 1 else ""
    if isinstance(own, ConfigError):
        raise ConfigError(own.path, f"{own.reason}{where}{also}") from own
    if own is not None:
        raise AttachError(f"[deepspeed-offload] {what} failed{where}: {agreement.describe(own)}{also}; "
                          "this rank's engine is as it was before") from own
    causes = "; ".join(f"rank {r}: {msg}" for r, msg in failures)
    raise AttachError(f"[deepspeed-offload] {what} failed on rank(s) {[r for r, _ in failures]}: {causes}; this "
                      f"rank's engine is as it was before ({BLOCK} is not attached on any rank)")
