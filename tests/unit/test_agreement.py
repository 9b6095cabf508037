"""How the ranks agree (runtime/agreement.py) over the CPU group the moves of state use: where the default
group is NCCL's (a GPU job), ``cpu_group`` makes a gloo group of the same ranks once and agrees over it
(no device tensor, no wait for the device's queued work); where it is gloo's already, that one. Two real
gloo processes; the NCCL default group is the one thing stood in for (its backend's name)."""

import os
import socket

import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _rank(rank, port, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE="2", LOCAL_WORLD_SIZE="2")
    import deepspeed
    deepspeed.init_distributed(dist_backend="gloo")  # (as DeepSpeed's engine does: agreement asks deepspeed.comm)
    try:
        from deepspeed_offload.runtime import agreement
        assert agreement.cpu_group() is dist.group.WORLD  # gloo already: that group
        real = dist.get_backend
        dist.get_backend = lambda group=None: "nccl" if group is dist.group.WORLD else real(group)
        group = agreement.cpu_group()
        assert group is not dist.group.WORLD and group is agreement.cpu_group()  # made once
        assert real(group) == "gloo"
        none = agreement.agree(None, group=group)
        failed = agreement.agree("out of memory (injected)" if rank == 1 else None, group=group)
        results[rank] = (none, failed)
    finally:
        dist.destroy_process_group()


def test_the_moves_agree_over_a_gloo_group_beside_an_nccl_default_group():
    results = mp.Manager().dict()
    mp.spawn(_rank, args=(_free_port(), results), nprocs=2, join=True)
    for rank in (0, 1):
        none, failed = results[rank]
        assert none == [] and failed == [(1, "out of memory (injected)")], results[rank]
