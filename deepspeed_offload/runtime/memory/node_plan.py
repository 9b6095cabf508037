"""The node's host plan at attach: how much of each rank's state the host stores, the rest resident.

Decided once per node, from one exchange of every rank's figures (``RankFigures``: its state, what it
asks for, and, from each node's first local rank, the node's host memory read before anyone pinned):

- ``memory_budget_gb`` set: its sub-groups stay resident, the rest is stored; the node's stores
  must fit in what the node can give, or every rank raises the same ``ConfigError``;
- unset (null, the default): **host first**. Each rank stores as much of its state as its share of
  the node's host memory holds (shares in proportion to the ranks' state), the rest stays resident.
  A model whose state the host can hold is measured fully offloaded; a larger one (a 13B's 145 GiB
  on a 125 GiB host) starts with the part the host cannot hold on the device;
- speculation's second regions (``speculate_memory_gb`` null) come out of what the stores leave,
  shared among the node's ranks; none is left: its updates roll back from device copies alone
  (``speculation/``), and the node's line says so.

``node_plan_for``, ``split`` and ``largest_params`` answer the same questions before anything runs
(``deepspeed-offload check`` / ``estimate``). After attach, ``placement.py``'s measured plan moves the
split while training runs.
"""

import os
from dataclasses import dataclass, field, fields
from typing import Dict, List, Optional, Sequence

from ...errors import BLOCK, ConfigError
from ...sizing.estimate import STATE_BYTES_PER_PARAM
from ...sizing.host_memory import HostMemory, format_bytes, node_ways_out
from .placement import margin_bytes

GiB = 2**30


@dataclass(frozen=True)
class RankFigures:
    """What one rank brings to attach's exchange (integers, so that one all-reduce carries them)."""
    node: int  # the node this rank runs on (the launcher's node rank)
    local_rank: int
    state: int  # bytes of every offloadable sub-group's state
    budget_store: int  # bytes its store needs under memory_budget_gb; -1: the budget is derived
    speculate: int  # bytes of second regions asked for; -1: derived from what is spare; 0: none
    deepspeed_pinned: int  # host memory DeepSpeed pins itself for this rank (ZeRO-3's parameter offload)
    device_free: int  # device memory this rank could still have (its own reserved included)
    device_total: int
    # the node's host as its first local rank read it (zeros on the other ranks); cgroup_limit -1: none
    mem_total: int = 0
    mem_available: int = 0
    cgroup_limit: int = -1
    cgroup_usage: int = 0
    checkpoint_aside: int = 0  # 1: async_checkpoint is on (a buffer for its copies aside, if there is room)

    def row(self) -> List[int]:
        return [int(getattr(self, f.name)) for f in fields(self)]

    @classmethod
    def from_row(cls, row: Sequence[int]) -> "RankFigures":
        return cls(*[int(v) for v in row])

    @classmethod
    def read_host(cls, **figures) -> "RankFigures":
        """This rank's figures; the node's host memory too when it is the node's first local rank."""
        if figures["local_rank"] != 0:
            return cls(**figures)
        mem = HostMemory.read()
        return cls(**figures, mem_total=mem.total, mem_available=mem.available,
                   cgroup_limit=-1 if mem.cgroup_limit is None else mem.cgroup_limit, cgroup_usage=mem.cgroup_usage)


def node_of_this_rank() -> int:
    """The launcher's node rank (torchrun's GROUP_RANK, DeepSpeed's CROSS_RANK), else the global rank
    of this node's first local rank (ranks are numbered node by node)."""
    for var in ("GROUP_RANK", "CROSS_RANK"):
        if os.environ.get(var, "").isdigit():
            return int(os.environ[var])
    return int(os.environ.get("RANK", "0") or 0) - int(os.environ.get("LOCAL_RANK", "0") or 0)


@dataclass(frozen=True)
class NodePlan:
    """What one node's ranks may pin, judged once from its first local rank's reading."""
    node: int
    ranks: List[int]  # global ranks on this node
    memory: HostMemory
    deepspeed_pinned: int
    store_cap: Dict[int, int]  # rank -> the most its store may take (its bytes under a fixed budget)
    twins_cap: Dict[int, int]  # rank -> the most its second regions may take
    # rank -> host memory reserved at attach for its checkpoint's copies aside (absent: none)
    aside_cap: Dict[int, int] = field(default_factory=dict)

    @property
    def usable(self) -> int:
        return max(0, self.memory.usable - self.deepspeed_pinned)


def plan_node(figures: List[RankFigures], node: int) -> NodePlan:
    """The host plan of ``node`` from every rank's figures (the same on every rank, so that every rank
    reaches the same verdict). Raises ConfigError when a fixed budget's stores or the second regions
    asked for do not fit what the node can give."""
    mine = {r: f for r, f in enumerate(figures) if f.node == node}
    leader = next(f for f in mine.values() if f.local_rank == 0) if any(
        f.local_rank == 0 for f in mine.values()) else next(iter(mine.values()))
    memory = HostMemory(total=leader.mem_total, available=leader.mem_available,
                        cgroup_limit=None if leader.cgroup_limit < 0 else leader.cgroup_limit,
                        cgroup_usage=leader.cgroup_usage)
    pinned = sum(f.deepspeed_pinned for f in mine.values())
    plan = NodePlan(node, sorted(mine), memory, pinned, {}, {})
    usable = plan.usable
    asked = {r: f.speculate for r, f in mine.items() if f.speculate > 0}
    if all(f.budget_store >= 0 for f in mine.values()):
        caps = {r: f.budget_store for r, f in mine.items()}
        _must_fit(plan, sum(caps.values()), "stores", budget_hint=True)
    else:  # host first: shares of what the second regions asked for leave, in proportion to the ranks' state
        _must_fit(plan, sum(asked.values()), "second regions asked for", speculation=True)
        room = usable - sum(asked.values())
        total_state = sum(f.state for f in mine.values()) or 1
        caps = {r: min(f.state, room * f.state // total_state) for r, f in mine.items()}
    plan.store_cap.update(caps)
    spare = max(0, usable - sum(caps.values()) - sum(asked.values()))
    if asked:
        _must_fit(plan, sum(caps.values()) + sum(asked.values()), "stores and the second regions asked for",
                  speculation=True)
    derived = [r for r, f in mine.items() if f.speculate < 0]
    plan.twins_cap.update({r: asked.get(r, 0) for r in mine})
    for r in derived:
        plan.twins_cap[r] = min(mine[r].state, spare // max(1, len(derived)))
    # async_checkpoint's snapshots (the store's copies aside, the resident state's copies): a buffer of
    # the store's size (at most its cap) for every rank that asks, reserved at attach where what the
    # stores and the second regions leave holds all of them (speculation, which every step uses, comes
    # first); else each save judges the host memory it finds then.
    asking = [r for r, f in mine.items() if f.checkpoint_aside]
    if asking and sum(caps[r] for r in asking) <= usable - sum(caps.values()) - sum(plan.twins_cap.values()):
        plan.aside_cap.update({r: caps[r] for r in asking})
    return plan


def _must_fit(plan: NodePlan, needed: int, what: str, budget_hint=False, speculation=False):
    if needed <= plan.usable:
        return
    short = needed - plan.usable
    ways = []
    if speculation:
        ways.append(f"lower {BLOCK}.speculate_memory_gb or set it to null (what is spare) or 0")
    if budget_hint:
        keep = short / len(plan.ranks)
        ways.append(f"keep {format_bytes(keep)} more of each rank's state on the GPU ({BLOCK}.memory_budget_gb), "
                    "or leave memory_budget_gb unset (null): the state the host cannot hold then stays on the GPU")
    ways, ds = node_ways_out(ways, plan.deepspeed_pinned)
    raise ConfigError(f"{BLOCK}.enabled",
                      f"node {plan.node}: the {what} of its {len(plan.ranks)} rank(s) need {format_bytes(needed)}{ds}, "
                      f"but the node can give {format_bytes(plan.memory.usable)} ({plan.memory.describe()}): "
                      f"{format_bytes(short)} short. Ways out: " + "; ".join(ways))


def describe_node(plan: NodePlan, stores: Dict[int, int], twins: Dict[int, int], resident: Dict[int, int],
                  speculates: bool = True) -> str:
    """The line the node's first local rank logs: its ranks, what each pins and in all, what it can give
    (``speculates``: whether speculation can run on these ranks at all)."""
    store, twin = sum(stores.values()), sum(twins.values())
    per_rank = ", ".join(f"rank {r}: {format_bytes(stores[r])}" for r in plan.ranks)
    on_device = sum(resident.values())
    # the second regions' caps: each rank's members take what fits of them (its own line says how much)
    spec = (f"; speculation's second regions up to {format_bytes(twin)}" if twin else
            "; speculation: no second regions" if speculates else "; speculation off")
    dev = f"; {format_bytes(on_device)} of state kept on the GPUs" if on_device else ""
    aside = sum(min(plan.aside_cap.get(r, 0), stores[r]) for r in plan.ranks)
    dev += f"; {format_bytes(aside)} for the checkpoints' copies aside" if aside else ""
    return (f"[deepspeed-offload] node {plan.node}: {len(plan.ranks)} rank(s) pin {'up to ' if twin else ''}"
            f"{format_bytes(store + twin)} in all "
            f"(stores {per_rank}{spec}){dev}; the node can give {format_bytes(plan.usable)} "
            f"({plan.memory.describe()})")


def host_first_resident(nbytes: Sequence[int], store_cap: int) -> int:
    """How many of the first sub-groups (``nbytes`` in step order) stay resident so that the rest fit
    ``store_cap``: the fewest."""
    k, rest = 0, sum(nbytes)
    while rest > store_cap and k < len(nbytes):
        rest -= nbytes[k]
        k += 1
    return k


def node_plan_for(state: int, ranks: int, memory: HostMemory, budget_store: int = -1, speculate: int = -1,
                  deepspeed_pinned: int = 0, checkpoint_aside: bool = False) -> NodePlan:
    """The host plan of a node of ``ranks`` alike ranks (``check --params``): what attach would judge."""
    figures = [RankFigures(node=0, local_rank=k, state=state, budget_store=budget_store, speculate=speculate,
                           deepspeed_pinned=deepspeed_pinned, device_free=0, device_total=0,
                           mem_total=memory.total if k == 0 else 0, mem_available=memory.available if k == 0 else 0,
                           cgroup_limit=-1 if k or memory.cgroup_limit is None else memory.cgroup_limit,
                           cgroup_usage=memory.cgroup_usage if k == 0 else 0, checkpoint_aside=int(checkpoint_aside))
               for k in range(ranks)]
    return plan_node(figures, 0)


# The device memory a ZeRO-3 rank keeps per parameter of its shard besides the optimizer state: the
# 16-bit partitions of the parameters and of their gradients.
PARTITION_BYTES_PER_PARAM = 4


def split(state: int, host_cap: int, device: int, iteration: int, margin: Optional[int] = None) -> dict:
    """The measured plan's split of one rank's ``state`` bytes, before anything runs: the host holds at
    most ``host_cap``, the device keeps what fits below ``device`` less the margin and ``iteration``
    (what the iteration needs besides the state: partitions, activations, slots; the figure the plan
    logs). ``margin``: the plan's first one (``margin_bytes``) unless given (the one a plan logged
    after give-backs widened it). ``fits``: the part the host cannot hold fits on the device."""
    margin = margin_bytes(device) if margin is None else margin
    room = device - margin - iteration
    floor = max(0, state - host_cap)
    resident = min(state, max(floor, room))
    return {"state": state, "host_cap": host_cap, "device": device, "margin": margin, "iteration": iteration,
            "resident": resident, "streamed": state - resident, "fits": floor <= room}


def largest_params(world: int, host_cap: int, device: int, iteration: int, state_now: int,
                   margin: Optional[int] = None) -> int:
    """The most parameters whose state fits one rank's host share and device together, given
    ``iteration`` measured (or given) with ``state_now`` bytes of state per rank: the iteration's
    partitions grow with the model (``PARTITION_BYTES_PER_PARAM``), the rest (activations) is taken as it is."""
    params_now = state_now // STATE_BYTES_PER_PARAM
    other = max(0, iteration - PARTITION_BYTES_PER_PARAM * params_now)
    per_param = STATE_BYTES_PER_PARAM + PARTITION_BYTES_PER_PARAM
    margin = margin_bytes(device) if margin is None else margin
    return max(0, (host_cap + device - margin - other) // per_param) * world


def check_resident_fits(resident_new: int, device_free: int, state: int, store_cap: int):
    """At attach, host first: the state the host cannot hold must at least fit the device's free memory
    (the iteration needs more; the measurement shows how much)."""
    if resident_new <= device_free:
        return
    raise ConfigError(f"{BLOCK}.enabled",
                      f"this rank's optimizer state is {format_bytes(state)}; the host can hold "
                      f"{format_bytes(store_cap)} of it, so {format_bytes(resident_new)} more must stay on the GPU, "
                      f"which has {format_bytes(device_free)} free: the state does not fit this node's GPU and host "
                      "memory together. Ways out: spread the job over more nodes or GPUs; run fewer ranks per node; "
                      "use ZeRO-Offload to NVMe")
