"""The two staging slots the step streams through, and who is where in them.

Each slot holds the largest offloaded region, so smaller sub-groups pack several to a slot
(``pack``): the step's sub-groups go into the slots in order, each right after the one before it
while it fits, else at the start of the other slot. A sub-group's **place** is its slot and offset
per dtype. A load may go into its place once every sub-group that was there before has been sent
out: the load then waits on the device for their write-backs (``take`` returns them), not on the
CPU; so with sub-groups a third of a slot, up to six are loading, updated or writing back at once
instead of two. The slots exist while a step needs them (allocated at the first load into one,
freed at the step's end). ``memory/residency.py``'s table owns the phases and the copies; this
class only knows places and occupants.
"""

from typing import Callable, Dict, Iterable, List, Optional, Tuple

import torch

# A place's offsets in a slot are multiples of this many elements (every view stays aligned).
PLACE_ALIGN = 256
Place = Tuple[int, Dict[torch.dtype, int]]  # (slot, element offset per dtype)


def _aligned(n: int) -> int:
    return -(-n // PLACE_ALIGN) * PLACE_ALIGN


def pack(order: Iterable[int], numel_of: Callable[[int], Dict[torch.dtype, int]],
         slot_numel: Dict[torch.dtype, int]) -> Dict[int, Place]:
    """The places of ``order``'s sub-groups in the two slots: each right after the one before it in
    the same slot while it fits (in every dtype), else at the start of the other slot. A prefix of
    ``order`` gets the places it gets in the whole."""
    places, slot, fill = {}, 0, {}
    for i in order:
        need = numel_of(i)
        if any(_aligned(fill.get(dt, 0)) + n > slot_numel[dt] for dt, n in need.items()):
            slot, fill = 1 - slot, {}
        offsets = {dt: _aligned(fill.get(dt, 0)) for dt in need}
        places[i] = (slot, offsets)
        fill.update({dt: offsets[dt] + n for dt, n in need.items()})
    return places


class _Occupant:
    """A sub-group's place in a slot: in use until sent out (``active``), then the event of its
    write-back (None: unloaded unused, its load ran before any later one on the H2D stream)."""

    __slots__ = ("sub_group", "place", "extent", "active", "written")

    def __init__(self, sub_group: int, place: Place, extent: Dict[torch.dtype, Tuple[int, int]]):
        self.sub_group, self.place, self.extent = sub_group, place, extent
        self.active, self.written = True, None

    def overlaps(self, extent) -> bool:
        return any(dt in self.extent and self.extent[dt][0] < hi and lo < self.extent[dt][1]
                   for dt, (lo, hi) in extent.items())

    def within(self, extent) -> bool:
        return all(dt in extent and extent[dt][0] <= lo and hi <= extent[dt][1]
                   for dt, (lo, hi) in self.extent.items())


class StagingSlots:
    """Two device buffers (dtype -> buffer each) while a step needs them, this step's places, and the
    occupants of each slot since it was allocated. ``numel_of(i)``: sub-group ``i``'s elements per dtype."""

    def __init__(self, copies, slot_numel: Dict[torch.dtype, int], numel_of: Callable[[int], Dict[torch.dtype, int]]):
        self.copies, self.slot_numel, self.numel_of = copies, slot_numel, numel_of
        self.buffers: Optional[List[dict]] = None  # two dicts dtype -> buffer, while a step needs them
        self.ready: List[object] = [None, None]  # per slot: what its first load waits for
        self.places: Dict[int, Place] = {}  # this step's streamed sub-groups -> their places (``plan``)
        self._occupants: List[List[_Occupant]] = [[], []]  # per slot: who was where since it was allocated
        self._in_slot: Dict[int, _Occupant] = {}  # sub-groups in a slot now

    def plan(self, order: List[int]) -> List[int]:
        """The places of the sub-groups the step streams, in its order (``pack``). Returns those in a
        slot already (prefetched) whom the plan puts elsewhere (the caller refuses them); [] when the
        plan is taken."""
        places = pack(order, self.numel_of, self.slot_numel)
        moved = [i for i, o in self._in_slot.items() if places.get(i) != o.place]
        if not moved:
            self.places = places
        return moved

    def place(self, i: int):
        """Sub-group ``i``'s place (``plan``): its slot, offsets, numel and element ranges per dtype."""
        slot, offsets = self.places[i]
        numel = self.numel_of(i)
        return slot, offsets, numel, {dt: (offsets[dt], offsets[dt] + n) for dt, n in numel.items()}

    def can_stage(self, i: int) -> bool:
        """Whether sub-group ``i``'s place holds no sub-group now: it may load there."""
        slot, _, _, extent = self.place(i)
        return not any(o.active and o.overlaps(extent) for o in self._occupants[slot])

    def busy(self, i: int) -> List[int]:
        """The sub-groups still in ``i``'s place (a load there must wait until they are sent out)."""
        slot, _, _, extent = self.place(i)
        return [o.sub_group for o in self._occupants[slot] if o.active and o.overlaps(extent)]

    def allocate(self):
        """Both slots, from the compute stream's pool, unless they exist (at the first load into one)."""
        if self.buffers is not None:
            return
        made = [self.copies.alloc(self.slot_numel) for _ in range(2)]  # (out of memory: no slot made)
        self.buffers, self.ready = [bufs for bufs, _ in made], [ready for _, ready in made]

    def take(self, i: int):
        """Sub-group ``i`` moves into its place (allocated, free: ``busy`` says so). Returns its slot, its
        buffers there, and what its load waits for: the slot's allocation and the write-backs of the
        sub-groups that were in its place before it."""
        slot, offsets, numel, extent = self.place(i)
        before = [o for o in self._occupants[slot] if o.overlaps(extent)]
        occupant = _Occupant(i, (slot, offsets), extent)
        # (one wholly inside the new place is covered by it: the next load there waits for this one)
        self._occupants[slot] = [o for o in self._occupants[slot] if not o.within(extent)] + [occupant]
        self._in_slot[i] = occupant
        bufs = {dt: self.buffers[slot][dt].narrow(0, offsets[dt], n) for dt, n in numel.items()}
        return slot, bufs, (self.ready[slot], *(o.written for o in before))

    def written(self, i: int, event):
        """``i``'s write-back from its place is queued: the next load into that place waits for ``event``."""
        self._in_slot[i].written = event

    def leave(self, i: int):
        """``i`` is out of its place (written back, or unloaded unused)."""
        self._in_slot.pop(i).active = False

    def in_slots(self) -> List[int]:
        """The sub-groups in a staging slot now."""
        return list(self._in_slot)

    def free(self):
        """Hand both slots back to the allocator (their copies keep the blocks until they end)."""
        held = self.in_slots()
        assert not held, f"deepspeed-offload: slots freed while sub-groups {held} are in them"
        self.buffers, self.ready, self._occupants, self.places = None, [None, None], [[], []], {}
