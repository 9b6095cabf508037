"""Early loads: offloaded sub-groups loading into buffers of their own while backward runs.

In the boundary micro-batch's backward, as gradients are reduced and backward frees activations,
the sub-groups the step will update load ahead of it, as far as ``LoadTiming`` allows without
raising the iteration's peak: speculation's members first (in the order their gradients became
final last time, so each arrives about when it can be updated), then the step's order; and as the
step begins, the step's first ones the slots do not take (``at_step_entry``). A backward
that differs from the measured one unloads what was loaded (``LoadTiming.take_divergence``), and so
does one where the device could not give an early load or an update its memory (``out_of_memory``):
backward goes on with that memory back, and the step loads the rest as it would without them.
Stream mode owns one of these; compile mode places its loads from its graphs instead.
"""

import math
from typing import List, Optional

import torch
from deepspeed.utils import logger


class EarlyLoads:

    def __init__(self, mode):
        self.mode = mode
        self.order: List[int] = mode.order  # members in the order they speculate, then step order
        self.next = 0  # position in ``order`` of the next sub-group to load

    def reset(self):
        """The split changed (``moves.py``): the step's order is the new one."""
        self.order, self.next = self.mode.order, 0

    def backward_begins(self, boundary: bool):
        """A backward begins: the order this one loads in; where no early loads will come, the first
        streamed sub-groups into the slots (``prefetch``), held to the step."""
        mode = self.mode
        self.next = 0
        if mode.speculation is not None and not mode.in_step:
            speculates = mode.speculation.backward_begins(boundary)
            self.order = mode.speculation.early_order(mode.order) if speculates else mode.order
        if mode.timing.backward_begins(boundary) and not mode.in_step:
            try:
                mode.prefetch_into_slots(mode.timing.prefetch_order(mode.stream_order()), early=True)
            except torch.OutOfMemoryError as e:
                self.out_of_memory(e)
            # the table allocates both slots at its first load into one: held from here to the step
            mode.timing.prefetched(2 * mode.slot_bytes if mode.table.slots is not None else 0)
        if mode.timing.take_divergence():
            self.give_back()

    def gradients_final(self, allowance: Optional[float]):
        """After a gradient hook or the epilogue: load as ``allowance`` allows, then update what
        speculation found final and loaded."""
        mode = self.mode
        if mode.in_step:
            return
        if mode.timing.take_divergence():
            self.give_back()
            return
        try:
            if allowance is not None and self.next < len(self.order):
                self.load(allowance)
            if mode.speculation is not None:
                mode.speculation.run()
        except torch.OutOfMemoryError as e:
            self.out_of_memory(e)

    def out_of_memory(self, error: BaseException):
        """An early load or an update in backward found no device memory (the allocator's pieces, or
        another process, left less than the measurement): what they hold goes back at once (the state
        it was loaded from is current), nothing more loads in this backward, and the next iteration is
        measured again. Training goes on as without early loads; no rank waits for this one."""
        self.mode.timing.out_of_memory()
        self.give_back()
        if self.mode.timing.out_of_memory_stops == 1:
            logger.warning(f"[deepspeed-offload] an early load in backward ran out of device memory ({error}); "
                           "what the early loads held went back, and the next iteration is measured again")

    def give_back(self):
        """This backward differs from the measured one: what the early loads and the updates hold
        goes back (the host copy is the current one), so that the peak holds; the step loads it again."""
        mode = self.mode
        mode.discard_speculation("backward changed")
        mode.unloaded_unused += len(mode.table.unload_all())
        self.next = len(self.order)

    def load(self, allowance: float):
        """Load the next sub-groups of ``order`` into buffers of their own while the bytes held that way
        (and by speculated updates) stay within ``allowance`` (``LoadTiming.gradient_ready``), and what
        of it outlasts backward within ``LoadTiming.step_allowance``: a sub-group updated in backward
        writes its loaded state back there and frees its buffers, keeping only what its update keeps for the step."""
        mode, spec = self.mode, self.mode.speculation
        held = mode.table.held_early() + (spec.held_bytes if spec is not None else 0)
        room, step_room = mode.timing.backward_allowance(), mode.timing.step_allowance()
        room = allowance if room is None else room
        lasting = None  # what early loads and updates hold into the step: counted once a load fits `room`
        while self.next < len(self.order):
            i = self.order[self.next]
            if not mode.table[i].on_device:
                extra = spec.extra_bytes(i) if spec is not None else 0  # (its update's)
                needed = mode.layout.nbytes[i] + extra
                if held + needed > room:
                    return  # asked again at the next gradient hook, when backward has freed more
                if step_room != math.inf:
                    lasting = self.held_into_step() if lasting is None else lasting
                    lasting += extra if spec is not None and spec.updates_in_backward(i) else needed
                    if lasting > step_room:
                        return
                mode.load(i, staged=False, early=True)
                held += needed
            self.next += 1

    def at_step_entry(self, first: List[int]) -> int:
        """As the step begins, after the slots took their share of ``first`` (the step's first sub-groups,
        in its order): the next of them into buffers of their own while what is held into the step
        stays within ``LoadTiming.entry_allowance``, so that the link keeps loading while DeepSpeed
        computes the gradient norm; the step updates them where they are. Returns how many loaded."""
        mode = self.mode
        room = mode.timing.entry_allowance()
        if room is None:
            return 0
        spec = mode.speculation
        held, n = mode.table.held_early() + (spec.held_bytes if spec is not None else 0), 0  # all held now
        for i in first:
            if mode.table[i].on_device:
                continue
            if held + mode.layout.nbytes[i] > room:
                break
            try:
                mode.load(i, staged=False, early=False)
            except torch.OutOfMemoryError:
                mode.timing.out_of_memory()  # (the step loads it, and the rest, through the slots)
                break
            held += mode.layout.nbytes[i]
            n += 1
        return n

    def held_into_step(self) -> int:
        """Device memory that what was loaded early and what the updates keep will still hold when the
        step begins: the updates' casts and copies, and the loaded sub-groups no update writes back
        (running counts: every loaded one, ``early_bytes``, less those whose update is to come and
        writes their state back, ``Coming.state``)."""
        mode, spec = self.mode, self.mode.speculation
        if spec is None:
            return mode.table.early_bytes
        return spec.held_bytes + mode.table.early_bytes - (spec.coming.state if spec._boundary else 0)
