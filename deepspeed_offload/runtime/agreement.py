"""How the ranks agree: on whether anything failed, on a save's id, and on the figures each rank
brings to attach, so that every rank raises the same error at the same call and no rank is left
waiting in a collective.

Attach (runtime/attach.py), the asynchronous checkpoints and colocation use it. ``agree`` costs one
one-element all-reduce when nothing failed; only after a failure do the ranks exchange their messages
(``exchange_messages``), so each rank's error names the failing rank, the path and the cause.
``exchange_numbers`` gives every rank every rank's row of integers. Both exchanges are
``torch.distributed.all_gather_object``. Without a process group (or with one rank) nothing is
communicated. ``agree(..., group=cpu_group())`` agrees over a gloo group of the same ranks: a flag
the CPU decides on, agreed without waiting for the device's queued work (the moves of state between
steps, ``runtime/step/moves.py``, agree at every training forward).
"""

import secrets
from typing import List, Optional, Sequence, Tuple

import torch

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


_cpu_group = None  # (the default group's identity, the gloo group made for it)


def cpu_group():
    """A process group of every rank whose collectives run on the CPU (gloo), so that agreeing waits
    for no device work: the default group where it is gloo already, else one made for it, once per
    default group (making it is a collective: every rank calls this at the same point, as attach
    does). None with one rank or no process group."""
    global _cpu_group
    if _dist() is None:
        return None
    default = torch.distributed.group.WORLD
    if torch.distributed.get_backend(default) == "gloo":
        return default
    if _cpu_group is None or _cpu_group[0] is not default:
        _cpu_group = (default, torch.distributed.new_group(backend="gloo"))
    return _cpu_group[1]


def new_save_id(rank: int) -> str:
    """The same random save id on every rank (rank 0 draws it; one all-reduce), as 16 hex digits."""
    sid = secrets.randbits(62) if rank == 0 else 0
    dist = _dist()
    if dist is not None:
        t = torch.tensor([sid], dtype=torch.int64, device=_device())
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        sid = int(t.item())
    return f"{sid:016x}"


def _gather(obj, group=None) -> list:
    """Every rank's ``obj``, on every rank (``all_gather_object`` over DeepSpeed's process group, or ``group``)."""
    out = [None] * rank_world()[1]
    torch.distributed.all_gather_object(out, obj, group=group)
    return out


def exchange_messages(message: Optional[str], group=None) -> List[Tuple[int, str]]:
    """Every rank's message (None: none), on every rank, as (rank, message) for the ranks that have one."""
    if _dist() is None:
        return [(0, message)] if message else []
    return [(r, m) for r, m in enumerate(_gather(message, group)) if m]


def exchange_numbers(row: Sequence[int]) -> List[List[int]]:
    """Every rank's ``row`` of integers, on every rank."""
    if _dist() is None:
        return [list(row)]
    return [list(r) for r in _gather([int(v) for v in row])]


def describe(error: BaseException) -> str:
    """A failure as the other ranks read it: its type and message."""
    return f"{type(error).__name__}: {error}"


def agree(message: Optional[str], group=None) -> List[Tuple[int, str]]:
    """Which ranks failed and why: one one-element all-reduce, and the messages only if any failed.
    ``group``: a CPU group (``cpu_group``) to agree over instead of DeepSpeed's."""
    dist = _dist()
    if dist is None:
        return [(0, message)] if message else []
    if group is not None:
        flag = torch.tensor([int(message is not None)], dtype=torch.int64)
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX, group=group)
    else:
        flag = torch.tensor([int(message is not None)], dtype=torch.int64, device=_device())
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return exchange_messages(message, group) if flag.item() else []


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
