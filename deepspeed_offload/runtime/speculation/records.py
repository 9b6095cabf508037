"""What speculation keeps besides the host store (``speculation.py``): an update computed in backward
and waiting for the norm (``Speculated``), the counters that show what it did (``Counters``), the
spacing of speculating backwards where rollbacks repeat (``Backoff``), and how the optimizer's small
state and a param group's entries are snapshotted and put back around an update.
"""

import enum
from dataclasses import asdict, dataclass, field
from typing import Dict, Optional

import torch

# Rollbacks that say the next step may roll back too (the norm clips, fp16 overflows, the loss scale
# or the hyper-parameters move between backward and step): each one in a row doubles the number of
# boundary backwards that do not speculate after it, up to MAX_BACKOFF; a commit resets it.
BACKS_OFF = ("clipped", "overflow", "loss scale", "hyper-parameters")
MAX_BACKOFF = 64


class Rollback(enum.Enum):
    """What a speculated update is rolled back from (``Speculation.rollback`` picks it per sub-group)."""
    SECOND_REGION = "second_region"  # the update went to a second host region; the current one is the state before
    DEVICE_COPY = "device_copy"  # the update went over the current region; a device copy holds the state before


@dataclass
class Speculated:
    """An update computed in backward, waiting for the norm."""
    state_after: Dict[str, object]  # the optimizer's own small state of the master after the update
    group_after: Dict[str, object]  # its param group's entries after the update
    group_before: Dict[str, object]  # ... and before (a change by the step's time voids the update)
    loss_scale: float  # the one the update used
    # the 16-bit cast of the updated master, on the device (made on the side stream); None once ``settle_casts``
    # wrote it into the sub-group's 16-bit partition as the step began
    lp: Optional[torch.Tensor]
    kept: Optional[Dict[torch.dtype, torch.Tensor]] = None  # ``DEVICE_COPY``: the state before, on the device

    @property
    def settled(self) -> bool:
        """Its cast is in the 16-bit partition already: a rollback puts the cast of the state before back."""
        return self.lp is None

    def nbytes(self) -> int:
        """Device memory it holds until the step."""
        held = [*([self.lp] if self.lp is not None else ()), *(self.kept.values() if self.kept else ())]
        return sum(t.numel() * t.element_size() for t in held)


@dataclass
class Counters:
    """Since attach: sub-groups updated in backward, committed, discarded; steps that committed or
    rolled back, and why (``reasons``: rollbacks by reason, and single sub-groups discarded for
    ``"gradient changed"``)."""
    speculated: int = 0
    committed: int = 0
    discarded: int = 0
    commit_steps: int = 0
    rollback_steps: int = 0
    reasons: Dict[str, int] = field(default_factory=dict)
    backed_off: int = 0  # boundary backwards that did not speculate (``Backoff``)
    from_device: int = 0  # updates whose state before was kept on the device (``Rollback.DEVICE_COPY``)
    restored: int = 0  # ... discarded: the state before copied back from the device
    settled: int = 0  # casts written into their 16-bit partitions as the step began (``Speculation.settle_casts``)
    unsettled: int = 0  # ... and put back (the cast of the state before) when the update was discarded

    def as_dict(self):
        return asdict(self)


@dataclass
class Backoff:
    """Where rollbacks repeat (clipping fires every step), speculating costs a step that reloads
    everything it wrote back in backward. After ``n`` rollbacks in a row, the next
    ``min(2**(n-1), limit)`` boundary backwards run today's path; then one speculates again (at
    the limit, one boundary backward in ``limit + 1``)."""
    limit: int = MAX_BACKOFF  # (0: speculate at every step, whatever happened before)
    skip_next: int = 0  # boundary backwards left that do not speculate
    length: int = 0  # the skip after the last rollback

    def rolled_back(self):
        self.length = min(max(1, 2 * self.length), self.limit)
        self.skip_next = self.length

    def committed(self):
        self.length = self.skip_next = 0

    def skips(self) -> bool:
        """Whether this boundary backward does not speculate (counts it down)."""
        if self.skip_next:
            self.skip_next -= 1
            return True
        return False


def on_device(state: dict, group: dict) -> bool:
    """A tensor off the CPU among the optimizer's state entries or the group's (but ``params``)."""
    return any(torch.is_tensor(v) and v.device.type != "cpu"
               for v in [*state.values(), *(v for k, v in group.items() if k != "params")])


def small_state(state: dict, stored) -> Dict[str, object]:
    """The optimizer's state entries the host store does not hold (Adam's ``step``), copied."""
    return {k: (v.clone() if torch.is_tensor(v) else v) for k, v in state.items() if k not in stored}


def restore_state(state: dict, saved: Dict[str, object]):
    for k, v in saved.items():
        if torch.is_tensor(v) and torch.is_tensor(state.get(k)) and state[k].shape == v.shape:
            state[k].copy_(v)  # the optimizer's own tensor object, its value put back
        else:
            state[k] = v.clone() if torch.is_tensor(v) else v


def group_entries(group: dict) -> Dict[str, object]:
    return {k: (v.clone() if torch.is_tensor(v) else v) for k, v in group.items() if k != "params"}


def same_entries(a: Dict[str, object], b: Dict[str, object]) -> bool:
    """The same hyper-parameters (a learning rate may be a tensor)."""
    return a.keys() == b.keys() and all(
        torch.equal(a[k], b[k]) if torch.is_tensor(a[k]) and torch.is_tensor(b[k]) else
        (not torch.is_tensor(a[k]) and not torch.is_tensor(b[k]) and a[k] == b[k]) for k in a)


def restore_group(group: dict, saved: Dict[str, object]):
    for k in [k for k in group if k != "params" and k not in saved]:
        del group[k]
    restore_state(group, saved)
