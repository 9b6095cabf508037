"""The pinned host<->device copy-bandwidth probe: each direction alone, both at once, and pageable
host to device for comparison, on one rank or on every rank of a node at once.

Used by ``deepspeed-offload env``, ``deepspeed-offload estimate`` (when no ``--bandwidth`` is given)
and the benchmark's ``bandwidth`` mode. Needs only torch (and torch.distributed for several ranks).
"""

import os
import statistics
import time

import torch

GiB = 2**30


def measure_bandwidth(gib=1):
    """GB/s each way with both directions busy, or None without a CUDA device."""
    if not torch.cuda.is_available():
        return None
    return bandwidth(gib)["both_each_way_GBps"]


def _median_seconds(fn, barrier=None, reps=5):
    """The median wall time of ``reps`` synchronized calls of ``fn`` after one untimed call;
    ``barrier`` (with several ranks) runs before every timed call, so that all ranks copy at once."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        if barrier is not None:
            barrier()
            torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def bandwidth(gib, barrier=None):
    """Pinned H2D, D2H, both at once (each way), pageable H2D, in GB/s: medians of 5 copies of
    ``gib`` GiB. ``barrier``: see ``_median_seconds``."""
    n = int(gib * GiB) // 4
    host_a = torch.empty(n, dtype=torch.float32, pin_memory=True)
    host_b = torch.empty(n, dtype=torch.float32, pin_memory=True)
    pageable = torch.empty(n, dtype=torch.float32)
    dev_a = torch.empty(n, dtype=torch.float32, device="cuda")
    dev_b = torch.empty(n, dtype=torch.float32, device="cuda")
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    nbytes = n * 4

    def both():
        with torch.cuda.stream(s1):
            dev_a.copy_(host_a, non_blocking=True)
        with torch.cuda.stream(s2):
            host_b.copy_(dev_b, non_blocking=True)

    def rate(fn):
        return nbytes / _median_seconds(fn, barrier) / 1e9

    return {
        "h2d_GBps": rate(lambda: dev_a.copy_(host_a, non_blocking=True)),
        "d2h_GBps": rate(lambda: host_b.copy_(dev_b, non_blocking=True)),
        "both_each_way_GBps": rate(both),
        "pageable_h2d_GBps": rate(lambda: dev_a.copy_(pageable)),
    }


def bandwidth_all_ranks(gib):
    """One rank: ``bandwidth``. Several (``WORLD_SIZE`` > 1, NCCL): each rank alone (the others wait
    at a barrier), then every rank at once; rank 0 returns its own 'at once' figures (the ones the
    copy floor needs) and every rank's both ways under ``ranks``; other ranks return None."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return bandwidth(gib)
    import torch.distributed as dist
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    alone = None
    for r in range(world):
        dist.barrier()
        if r == rank:
            alone = bandwidth(gib)
        dist.barrier()
    together = bandwidth(gib, barrier=dist.barrier)
    per_rank = [None] * world
    dist.all_gather_object(per_rank, {"rank": rank, "alone": alone, "together": together})
    dist.destroy_process_group()
    return dict(together, ranks=per_rank) if rank == 0 else None
