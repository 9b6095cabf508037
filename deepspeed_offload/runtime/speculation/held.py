"""What speculation holds on the device, kept as running counts (the early loads read it at every
gradient hook: about 300 hooks a backward at 7B, and a walk over 162 members at each was most of a
hook's own time).

- ``HeldBytes`` (``Speculation``'s): what its updates hold and will hold (``held_bytes``), and what one
  update adds (``extra_bytes``, ``copy_bytes``), as the early loads count them.
- ``Waiting``: the updates waiting for the norm (``Speculation.updated``), a dict that keeps the sum
  of their device bytes (``Speculated.nbytes``: the 16-bit cast, the device copy) as entries come and
  go; ``shrunk`` where an entry gives memory back in place (``settle_casts`` drops its cast).
- ``Coming``: the members loaded into buffers of their own in this backward and not updated yet: what
  their updates will add (``extra``: cast and device copy) and, of those whose update writes their
  loaded state back before the step, that state's bytes (``state``, for ``EarlyLoads.held_into_step``).
  An entry goes when its update is made, fails, or the backward's loads are given back.
"""

from typing import Dict, Tuple

from .records import Rollback


class Waiting(dict):
    """sub-group -> ``Speculated``, with ``nbytes``: the device bytes of every entry."""

    def __init__(self):
        super().__init__()
        self.nbytes = 0

    def __setitem__(self, i, spec):
        if i in self:
            self.nbytes -= self[i].nbytes()
        super().__setitem__(i, spec)
        self.nbytes += spec.nbytes()

    def pop(self, i, *default):
        if i not in self and default:
            return default[0]
        spec = super().pop(i)
        self.nbytes -= spec.nbytes()
        return spec

    def clear(self):
        super().clear()
        self.nbytes = 0

    def shrunk(self, nbytes: int):
        """An entry gave ``nbytes`` back in place."""
        self.nbytes -= nbytes


class Coming:
    """Members loaded early in this backward whose update is still to come."""

    def __init__(self):
        self.of: Dict[int, Tuple[int, int]] = {}  # member -> (extra bytes its update adds, state it writes back)
        self.extra = 0
        self.state = 0

    def loaded(self, i: int, extra: int, state: int):
        self.gone(i)
        self.of[i] = (extra, state)
        self.extra += extra
        self.state += state

    def gone(self, i: int):
        extra, state = self.of.pop(i, (0, 0))
        self.extra -= extra
        self.state -= state

    def clear(self):
        self.of.clear()
        self.extra = self.state = 0

    def __contains__(self, i) -> bool:
        return i in self.of


class HeldBytes:
    """``Speculation``'s device memory as the early loads count it (its ``updated``, ``coming``,
    ``members``, ``_boundary``, ``_final``, ``_ready`` and ``_grad_bytes`` are the speculation's own)."""

    @property
    def held_bytes(self) -> int:
        """Device memory the updates hold: the 16-bit casts and device copies waiting for the norm (and
        those the loaded members' updates will make), and while a backward speculates, the fp32 gradient
        buffer (counted before its first update allocates it)."""
        coming = self.coming.extra if self._boundary else 0  # (what updates still to come will hold: extra_bytes)
        return self.updated.nbytes + coming + (self._grad_bytes if self._boundary or self.grad_buffer is not None else 0)

    def loaded(self, i: int):
        """Sub-group ``i``'s state was loaded into buffers of its own: where it is a member of a
        speculating backward, its update is to come (``held_bytes`` reserves what it will add), and it
        is updated once its gradient is final too (``run``)."""
        if not self._boundary or i not in self.members:
            return
        self.coming.loaded(i, self.extra_bytes(i), self.mode.table.store_bytes(i) if self.updates_in_backward(i) else 0)
        if i in self._final:
            self._ready.append(i)

    def extra_bytes(self, i: int) -> int:
        """What an update of sub-group ``i`` in this backward adds beside its loaded state, kept until the
        step: its 16-bit cast and, rolled back from the device, the copy of its state (``copy_bytes``;
        the early loads reserve both, since the loaded buffers stay the device's until their write-back
        ends)."""
        if not self._boundary or i not in self.members:
            return 0
        flat = self.opt.fp16_partitioned_groups_flat[i]
        return flat.numel() * flat.element_size() + self.copy_bytes(i)

    def updates_in_backward(self, i: int) -> bool:
        """Sub-group ``i``, loaded early in this backward, will be updated before the step (and its loaded
        state written back): a member of a speculating backward whose gradient was not reduced again, and
        whose optimizer state exists (the first step creates it)."""
        if not self._boundary or i not in self.members or i in self.reduced_again:
            return False
        return bool(self.base.state.get(self.opt.fp32_partitioned_groups_flat[i]))

    def copy_bytes(self, i: int) -> int:
        """The device copy of the state an update of sub-group ``i`` in this backward keeps (none with a
        second region), dropped when the step commits it (``commit``)."""
        if not self._boundary or i not in self.members or self.rollback(i) is Rollback.SECOND_REGION:
            return 0
        return self.mode.table.store_bytes(i)
