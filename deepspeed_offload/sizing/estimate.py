"""The cost model: what offload frees and costs per rank and per node, before anyone launches a job.

``deepspeed-offload estimate`` prints it, ``check`` and ``initialize`` (before DeepSpeed builds the
engine) plan host memory with it, the benchmark compares it with what it measures."""

from typing import Any, Dict, Optional

from .host_memory import HostPlan, local_ranks

# Adam's fp32 master weight plus its two moments: what one parameter costs in the host store.
STATE_BYTES_PER_PARAM = 12


def speculation_bytes(offloaded: int, speculate_gb: Optional[float]) -> int:
    """Host memory per rank that ``speculate_memory_gb`` adds to a store of ``offloaded`` bytes: the
    second regions it allows, at most the store (null: what is spare, 0 here)."""
    return min(offloaded, int((speculate_gb or 0) * 2**30))


def state_bytes_per_rank(params: int, world: int) -> int:
    """The optimizer state one of ``world`` ZeRO-3 ranks holds for ``params`` parameters."""
    return -(-params // world) * STATE_BYTES_PER_PARAM


# Each way, both directions busy, summed over the ranks of one node: 2 ranks on a 2-GPU H200 host
# each got 36.4 GB/s when both streamed at once, against 47.4-48.9 alone (docs/benchmarks.md).
HOST_BANDWIDTH_GBPS = 72.9


def estimate(params, world_size, ranks_per_node, bandwidth, host_bandwidth=HOST_BANDWIDTH_GBPS, sub_group_mb=256,
             budget_gb=0.0, largest_param=0) -> dict:
    """What offload frees and costs per rank and per node (bytes, GB/s, seconds): ``params`` over
    ``world_size`` ranks, ``ranks_per_node`` of them sharing a host whose memory gives
    ``host_bandwidth`` GB/s each way in all, each rank's link ``bandwidth`` GB/s each way; the part of
    the state under ``budget_gb`` stays resident (None: derived at attach, taken as 0 here).
    ``largest_param``: the elements of the largest parameter (a Llama's embedding, vocabulary x
    hidden): one larger than a sub-group is a sub-group of its own, and sets the staging slot."""
    per_rank = state_bytes_per_rank(params, world_size)
    resident = 0 if budget_gb is None else min(per_rank, int(budget_gb * 2**30))
    offloaded = per_rank - resident
    slot = min(offloaded, max(sub_group_mb * 2**20, state_bytes_per_rank(largest_param, world_size)))
    # Every rank of the node copies at once: each gets its own link's bandwidth until their sum
    # reaches what the host's memory gives all of them together.
    per_rank_bw = min(bandwidth, host_bandwidth / ranks_per_node)
    # Loads and write-backs overlap, both directions at once; the first load and the last
    # write-back of the step have nothing to overlap with.
    step = offloaded / (per_rank_bw * 1e9) + slot / (per_rank_bw * 1e9)
    return {"state_per_rank": per_rank, "resident_per_rank": resident, "gpu_freed_per_rank": offloaded,
            "staging_during_step": 2 * slot, "host_pinned_per_node": offloaded * ranks_per_node,
            "bandwidth_GBps": bandwidth, "host_bandwidth_GBps": host_bandwidth, "bandwidth_per_rank_GBps": per_rank_bw,
            "step_copy_s": step}


def deepspeed_pinned_per_rank(params: int, world: int, ds_config: Optional[Dict[str, Any]]) -> int:
    """Host memory DeepSpeed pins itself beside our store: ZeRO-3's parameter offload to the CPU
    keeps each rank's 16-bit partition of the parameters in pinned memory (2 bytes a parameter;
    torch's pinned allocator may round each tensor up further)."""
    zero = (ds_config or {}).get("zero_optimization") or {}
    param = zero.get("offload_param") if isinstance(zero, dict) else None
    if not isinstance(param, dict) or param.get("device") != "cpu" or param.get("pin_memory") is False:
        return 0
    return -(-params // world) * 2


def host_plan(params: int, world: int, ranks_per_node: Optional[int] = None, budget_gb: Optional[float] = None,
              ds_config: Optional[Dict[str, Any]] = None, speculate_gb: Optional[float] = 0.0,
              host_first: bool = False) -> HostPlan:
    """What the ``ranks_per_node`` ranks of a node pin for ``params`` parameters over ``world`` ranks:
    each rank's store (its state less what ``budget_gb`` keeps on the GPU, plus what ``speculate_gb``
    adds), and DeepSpeed's own. ``host_first`` (the budget derived, stream mode): the store takes
    what the host can give and the GPU keeps the rest, so only what is asked for besides it counts."""
    ranks = ranks_per_node or local_ranks()
    store = 0 if host_first else max(0, state_bytes_per_rank(params, world) - int((budget_gb or 0) * 2**30))
    speculation = speculation_bytes(state_bytes_per_rank(params, world) if host_first else store, speculate_gb)
    return HostPlan(store_per_rank=store + speculation, ranks=ranks, speculation_per_rank=speculation,
                    deepspeed_pinned=deepspeed_pinned_per_rank(params, world, ds_config) * ranks, budget_gb=budget_gb)
