"""Where each offloaded sub-group's state is, as an explicit state machine, and what waits on what.

Every offloaded ZeRO-3 sub-group has one ``Residency``::

    ON_HOST ──load──▶ LOADING ──arrive──▶ ON_DEVICE ──updated──▶ UPDATED ──write_back──▶ WRITING_BACK
       ▲                 │                    │                                              │
       └────unload───────┴────────────────────┘        (state unchanged: buffers dropped)    │
       ▲                                                                                     │
       └──────────────────────────────── landed (a CPU reader waited for it) ◀───────────────┘
                         WRITING_BACK ──load──▶ LOADING  (the load waits for that write-back)
                         UPDATED ──arrive──▶ ON_DEVICE   (kept on the device: updated again there)

``Residency.move`` is the one place a phase changes, and it refuses anything not drawn above.
The ``ResidencyTable`` holds them all, the two staging slots and the copy executor, and its verbs
are the only callers of ``move``; each verb decides what its copy waits for:

- a load waits for the sub-group's own previous write-back, and for its destination: the write-backs
  of the sub-groups that were in its place in a slot before it, or (buffers of its own, a slot's
  first use) the compute work queued before they were allocated;
- ``arrive``: the stream that will update it waits for the load (the compute stream; a speculated
  update's side stream, ``speculation.py``);
- a write-back waits for the update (an event on the stream that updated it: no host wait);
- ``restore``: a copy of the state kept elsewhere on the device (a speculated update rolled back,
  ``speculation.py``) written over its host region, after the write-back it undoes; the phase stays
  (ON_HOST or WRITING_BACK): the next load waits for it as for a write-back, and so does ``drain``;
- ``drain``: the CPU waits for every write-back (before anything on the CPU reads host state).

A sub-group's device buffers are a place in a staging slot (``staging/slots.py``: where each one
goes, and which write-backs a load into a place waits for) or buffers of its own (loaded early,
ahead of the step; ``device_holds.py`` counts what they hold until their copies end). Stream mode's
step waits for its write-backs before it returns (``drain``), so between steps the device holds none
of them. The DeepSpeed tensors' ``.data`` rebinding is not done here: the streamed step
(``runtime/step/stream.py``) points them at ``view(i, key)`` or at the host store.
"""

import enum
from typing import Dict, Iterable, List, Optional, Tuple

from ..staging.slots import Place, StagingSlots
from .device_holds import DeviceHolds
from .host_store import HostStore

class Phase(enum.Enum):
    ON_HOST = "on_host"  # the host store holds the newest state; no device buffers
    LOADING = "loading"  # H2D into device buffers queued (maybe still running)
    ON_DEVICE = "on_device"  # the compute stream has waited for the load; the step may update it
    UPDATED = "updated"  # the step updated it in its device buffers; the host copy is stale
    WRITING_BACK = "writing_back"  # D2H queued; the host store is the newest once it lands


P = Phase
LEGAL = frozenset({
    (P.ON_HOST, P.LOADING),
    (P.WRITING_BACK, P.LOADING),  # the load waits for the write-back
    (P.LOADING, P.ON_DEVICE),
    (P.ON_DEVICE, P.UPDATED),
    (P.UPDATED, P.WRITING_BACK),
    (P.UPDATED, P.ON_DEVICE),  # compile mode kept it on the device since its last update
    (P.WRITING_BACK, P.ON_HOST),
    (P.LOADING, P.ON_HOST),  # unloaded unused (a skipped step, a writer of host state)
    (P.ON_DEVICE, P.ON_HOST),  # unloaded by a step that raised before updating it
})


class IllegalTransition(RuntimeError):
    pass


class Residency:
    """One sub-group: its phase, its device buffers and the events of its last copies."""

    __slots__ = ("sub_group", "phase", "buffers", "slot", "host_stale", "loaded", "updated", "written")

    def __init__(self, sub_group: int):
        self.sub_group = sub_group
        self.phase = Phase.ON_HOST
        self.buffers = None  # dtype -> device tensor, while LOADING/ON_DEVICE/UPDATED
        self.slot: Optional[int] = None  # staging slot index, or None for buffers of its own
        self.host_stale = False  # its device buffers hold a newer state than the host store
        self.loaded = None  # event: its H2D is done
        self.updated = None  # event: the step's update of it is done
        self.written = None  # event: its latest write-back is done

    def move(self, to: Phase):
        if (self.phase, to) not in LEGAL:
            raise IllegalTransition(f"deepspeed-offload: sub-group {self.sub_group} cannot go from "
                                    f"{self.phase.name} to {to.name}")
        self.phase = to

    @property
    def on_device(self) -> bool:
        return self.phase in (Phase.LOADING, Phase.ON_DEVICE, Phase.UPDATED)

    def __repr__(self):
        where = "own buffers" if self.slot is None else f"slot {self.slot}"
        return f"Residency({self.sub_group}, {self.phase.name}{', ' + where if self.on_device else ''})"


class ResidencyTable:
    """Every offloaded sub-group's ``Residency`` and the copies that move it, between the host store,
    the staging slots (``StagingSlots``: places and occupants) and buffers of its own (``DeviceHolds``:
    what they hold)."""

    def __init__(self, store: HostStore, copies, offloaded: Iterable[int], slot_numel):
        self.store = store
        self.copies = copies
        self.of: Dict[int, Residency] = {i: Residency(i) for i in offloaded}
        self.staging = StagingSlots(copies, slot_numel, store.region_numel)
        self.holds = DeviceHolds(copies)
        self.last_load = None  # event of the newest H2D
        self.last_write = None  # event of the newest D2H

    # what the step and the tests read of the slots and the holds
    @property
    def slots(self):
        return self.staging.buffers

    @property
    def places(self) -> Dict[int, Place]:
        return self.staging.places

    @property
    def slot_numel(self):
        return self.staging.slot_numel

    @property
    def early_bytes(self) -> int:
        return self.holds.early_bytes

    def __getitem__(self, i) -> Residency:
        return self.of[i]

    def in_phase(self, *phases: Phase) -> List[int]:
        return [i for i, r in self.of.items() if r.phase in phases]

    def view(self, i: int, key: str):
        """Sub-group ``i``'s tensor ``key`` in its device buffers."""
        r = self.of[i]
        s = self.store.slices[i][key]
        return r.buffers[s.dtype].narrow(0, s.offset, s.numel)

    def _regions(self, i: int, other: bool = False):
        return {dt: self.store.region(i, dt, other) for dt in self.store.region_numel(i)}

    # ------------------------------------------------------------------ transitions

    def load(self, i: int, staged: bool = False) -> Tuple[int, object]:
        """H2D of sub-group ``i`` into its place in a staging slot (``staged``: ``plan`` gave it one,
        ``can_stage`` says it is free), or into buffers of its own. Returns (bytes, span of a
        synchronous copy or None)."""
        r = self.of[i]
        if staged:
            self.staging.allocate()
            busy = self.staging.busy(i)
            if busy:
                raise IllegalTransition(f"deepspeed-offload: sub-group {i} cannot load into slot "
                                        f"{self.staging.places[i][0]}: sub-groups {busy} are still in its place")
            r.move(Phase.LOADING)
            slot, bufs, destination = self.staging.take(i)
        else:
            bufs, ready = self.copies.alloc(self.store.region_numel(i))  # first: out of memory changes nothing
            r.move(Phase.LOADING)
            slot = None
            self.holds.took(self.store_bytes(i))
            destination = (ready, )
        r.buffers, r.slot = bufs, slot
        # (the sub-group's own last write-back first: the negative control in tests drops the rest)
        r.loaded, span = self.copies.h2d(bufs, self._regions(i), waits=(r.written, *destination))
        self.last_load = r.loaded
        return self.store_bytes(i), span

    def arrive(self, i: int):
        """The current stream (the compute stream, or the side stream of a speculated update) waits
        for ``i``'s load; the step may now read and update it. A
        sub-group still UPDATED in buffers of its own (kept there since the last step) is the
        newest copy already: the step updates it again where it is."""
        r = self.of[i]
        r.move(Phase.ON_DEVICE)
        self.copies.compute_waits(r.loaded)
        self.copies.uses(writes=r.buffers.values())

    def mark_updated(self, i: int):
        r = self.of[i]
        r.move(Phase.UPDATED)
        r.host_stale = True
        self.copies.uses(writes=r.buffers.values())  # the update's last writes, before its event
        r.updated = self.copies.mark()

    def write_back(self, i: int, other: bool = False) -> Tuple[int, object]:
        """D2H of ``i`` once its update is done; its device buffers are let go (a slot becomes
        loadable again after this copy, buffers of its own return to the allocator after it).
        ``other``: into its second host region (a speculated update; the current one is untouched).
        Returns (bytes, span)."""
        r = self.of[i]
        r.move(Phase.WRITING_BACK)
        r.written, span = self.copies.d2h(self._regions(i, other), r.buffers, waits=(r.updated, ))
        r.host_stale = False  # the host store is the newest copy once this lands
        if r.slot is not None:
            self.staging.written(i, r.written)  # the next load into its place waits for this copy
        self._let_go(r)
        self.last_write = r.written
        return self.store_bytes(i), span

    def restore(self, i: int, kept) -> Tuple[int, object]:
        """D2H of ``kept`` (dtype -> device buffer laid out as ``i``'s buffers: a copy of its state taken
        before a speculated update) over ``i``'s current host region, after the write-back of that
        update. ``i`` has no device buffers of the table's. The caller drops ``kept`` once this is
        queued: like buffers of its own dropped while a copy used them, it counts in ``held_early``
        until the copy ends. Returns (bytes, span)."""
        r = self.of[i]
        if r.on_device:
            raise IllegalTransition(f"deepspeed-offload: sub-group {i} cannot be restored while loaded")
        r.written, span = self.copies.d2h(self._regions(i), kept, waits=(r.written, ))
        self.last_write = r.written
        self.holds.copying(r.written, self.store_bytes(i))
        return self.store_bytes(i), span

    def unload(self, i: int):
        """Drop ``i``'s device copy unused: the host store still holds its state."""
        r = self.of[i]
        if r.host_stale:
            raise IllegalTransition(f"deepspeed-offload: sub-group {i} cannot be unloaded: its device copy is newer "
                                    "than the host store (write it back)")
        r.move(Phase.ON_HOST)
        self._let_go(r)

    def _let_go(self, r: Residency):
        """Drop ``r``'s device buffers (buffers of its own go back to the allocator, which holds the
        blocks until their copies end: until then they count in ``held_early``)."""
        if r.slot is None and r.buffers is not None:
            self.holds.dropped(self.store_bytes(r.sub_group), r.written if r.phase is Phase.WRITING_BACK else r.loaded)
        if r.slot is not None:
            self.staging.leave(r.sub_group)
        r.buffers, r.slot, r.loaded, r.updated = None, None, None, None

    def held_early(self) -> int:
        """Device memory buffers of their own hold, those dropped whose copy has not ended included
        (``DeviceHolds``)."""
        return self.holds.held()

    def prune_in_flight(self) -> int:
        """Forget the dropped buffers whose copies have ended: once per step (``StepLifecycle.close``; each
        ``held_early`` forgets the oldest ones), so the list holds one step's copies at most. Returns how
        many are left."""
        return self.holds.prune()

    def unload_all(self) -> List[int]:
        """Unload every sub-group that is loading or loaded but not updated; returns them. (One
        brought in from UPDATED is refused by ``unload``: a step that raised marks it updated first.)"""
        out = self.in_phase(Phase.LOADING, Phase.ON_DEVICE)
        for i in out:
            self.unload(i)
        return out

    def drain(self):
        """Block until every write-back has landed in the host store. The D2H copies run in order
        on one stream, so the newest one's event covers them all, including the write-back of a
        sub-group already loading again (WRITING_BACK -> LOADING keeps no other trace of it)."""
        self.copies.wait_host(self.last_write)
        for i in self.in_phase(Phase.WRITING_BACK):
            self.of[i].move(Phase.ON_HOST)

    def set_offloaded(self, offloaded: Iterable[int], slot_numel):
        """The offloaded sub-groups changed (the measured plan, between steps): those that stay keep
        their ``Residency``, new ones start ON_HOST; the slots are sized for the new set."""
        assert self.slots is None and not self.in_phase(Phase.LOADING, Phase.ON_DEVICE, Phase.UPDATED), \
            "deepspeed-offload: the offloaded set changes only between steps, with nothing on the device"
        self.of = {i: self.of.get(i) or Residency(i) for i in offloaded}
        self.staging.slot_numel = slot_numel

    # ------------------------------------------------------------------ slots (``StagingSlots``)

    def plan(self, order: List[int]):
        """The places of the sub-groups the step streams, in its order (``pack``). Those in a slot
        already (prefetched for a prefix of ``order``) are where the plan puts them."""
        moved = self.staging.plan(order)
        if moved:
            raise IllegalTransition(f"deepspeed-offload: sub-groups {moved} are in a slot where this step "
                                    "does not expect them")

    def can_stage(self, i: int) -> bool:
        """Whether sub-group ``i``'s place (``plan``) holds no sub-group now: it may load there."""
        return self.staging.can_stage(i)

    def in_slots(self) -> List[int]:
        """The sub-groups in a staging slot now."""
        return self.staging.in_slots()

    def free_slots(self):
        """Hand both slots back to the allocator (their copies keep the blocks until they end)."""
        self.staging.free()

    # ------------------------------------------------------------------ figures

    def store_bytes(self, i: int) -> int:
        return sum(self.store.region(i, dt).nbytes for dt in self.store.region_numel(i))

    def phases(self, ids: Iterable[int] = None) -> Dict[int, Phase]:
        return {i: self.of[i].phase for i in (ids if ids is not None else self.of)}
