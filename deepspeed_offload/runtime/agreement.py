"""How the ranks agree: on whether anything failed, on a save's id, and on the figures each rank
brings to attach, so that every rank raises the same error at the same call and no rank is left
waiting in a collective.

Attach (runtime/attach.py) and the asynchronous checkpoints use it. ``agree`` costs one one-element
all-reduce when nothing failed; only after a failure do the ranks exchange their messages
(``exchange_messages``), so each rank's error names the failing rank, the path and the cause.
``exchange_numbers`` gives every rank every rank's row of integers. Without a process group (or
with one rank) nothing is communicated.
"""

import secrets
from typing import List, Optional, Sequence, Tuple

import torch

MESSAGE_BYTES = 1024  # of each rank's error message, exchanged only after a failure


def rank_world() -> Tuple[int, int]:
    """This process's rank and the world size (0 and 1 without a process group)."""
    from deepspeed import comm as dist
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _dist():
    """deepspeed.comm when there is more than one rank to agree with, else None."""
    from deepspeed import comm as dist
    return dist if rank_world()[1] > 1 else None


def _device():
    from deepspeed.accelerator import get_accelerator
    return get_accelerator().current_device_name()


def new_save_id(rank: int) -> str:
    """The same random save id on every rank (rank 0 draws it; one all-reduce), as 16 hex digits."""
    sid = secrets.randbits(62) if rank == 0 else 0
    dist = _dist()
    if dist is not None:
        t = torch.tensor([sid], dtype=torch.int64, device=_device())
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        sid = int(t.item())
    return f"{sid:016x}"


def exchange_messages(message: Optional[str]) -> List[Tuple[int, str]]:
    """Every rank's message (None: none), on every rank: one all-reduce of world x MESSAGE_BYTES."""
    dist = _dist()
    if dist is None:
        return [(0, message)] if message else []
    rank, world = rank_world()
    buf = torch.zeros(world, MESSAGE_BYTES, dtype=torch.uint8)
    if message:
        data = message.encode()[:MESSAGE_BYTES]
        buf[rank, :len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    buf = buf.to(_device())
    dist.all_reduce(buf, op=dist.ReduceOp.MAX)
    rows = buf.cpu()
    out = []
    for r in range(world):
        text = bytes(rows[r].tolist()).rstrip(b"\0").decode(errors="replace")
        if text:
            out.append((r, text))
    return out


def exchange_numbers(row: Sequence[int]) -> List[List[int]]:
    """Every rank's ``row`` (the same length on every rank), on every rank: one all-reduce of world x len."""
    dist = _dist()
    if dist is None:
        return [list(row)]
    rank, world = rank_world()
    buf = torch.zeros(world, len(row), dtype=torch.int64)
    buf[rank] = torch.tensor([int(v) for v in row], dtype=torch.int64)
    buf = buf.to(_device())
    dist.all_reduce(buf, op=dist.ReduceOp.SUM)
    return buf.cpu().tolist()


def agree(message: Optional[str]) -> List[Tuple[int, str]]:
    """Which ranks failed and why: one one-element all-reduce, and the messages only if any failed."""
    dist = _dist()
    if dist is None:
        return [(0, message)] if message else []
    flag = torch.tensor([int(message is not None)], dtype=torch.int64, device=_device())
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return exchange_messages(message) if flag.item() else []


def raise_agreed(failures, own: Optional[str], kind, what):
    """Raise ``kind`` on every rank if the ranks agreed that one failed: with this rank's own message
    if it failed, else the first failing rank's."""
    if not failures:
        return
    others = [r for r, _ in failures]
    if own is not None:
        text = own
    else:
        r, msg = failures[0]
        text = f"rank {r}: {msg}"
    more = f" (failed on rank(s) {others})" if len(others) > 1 or own is None else ""
    raise kind(f"{what}: {text}{more}")
