"""The residency state machine on its own: legal and illegal transitions, what each copy waits for
(recorded by a fake executor whose events are named objects), the copies themselves (the real
synchronous executor on CPU buffers), and the order of a whole step as a GPU would keep it (the e2e
tests' deferred executor, whose copies run only when waited for and which checks every buffer's
accesses for happens-before: each of the table's waits dropped in turn must be caught)."""

import re
import sys
from pathlib import Path

import pytest
import torch

from deepspeed_offload.runtime.staging.copies import SyncCopies, make_copies
from deepspeed_offload.runtime.memory.host_store import MASTER, HostStore
from deepspeed_offload.runtime.memory.residency import LEGAL, IllegalTransition, Phase, Residency, ResidencyTable
from deepspeed_offload.runtime.staging.slots import PLACE_ALIGN, pack

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))
from deferred_copies import DeferredCopies  # noqa: E402

P = Phase


class Event:

    def __init__(self, name):
        self.name = name

    def __repr__(self):
        return self.name


class RecordingCopies(SyncCopies):
    """The synchronous executor (real copies), but every event is a named object and every wait is
    recorded: (who waits, [events])."""

    def __init__(self):
        super().__init__()
        self.waits = []
        self.n = 0

    def _ev(self, kind):
        self.n += 1
        return Event(f"{kind}{self.n}")

    def alloc(self, numel):
        bufs, _ = super().alloc(numel)
        return bufs, self._ev("alloc")

    def h2d(self, dst, src, waits):
        super().h2d(dst, src, waits)
        ev = self._ev("h2d")
        self.waits.append((ev.name, list(waits)))
        return ev, None

    def d2h(self, dst, src, waits):
        super().d2h(dst, src, waits)
        ev = self._ev("d2h")
        self.waits.append((ev.name, list(waits)))
        return ev, None

    def mark(self):
        return self._ev("update")

    def compute_waits(self, event):
        self.waits.append(("compute", [event]))

    def wait_host(self, event):
        self.waits.append(("host", [event]))


def make_table(copies=None, groups=3, numel=4, sizes=None, per_slot=1):
    """``groups`` sub-groups of two tensors of ``numel`` (``sizes``: each one's), a slot for ``per_slot``
    of the largest."""
    sizes = sizes or [numel] * groups
    layout = {i: [(MASTER, torch.float32, n), ("exp_avg", torch.float32, n)] for i, n in enumerate(sizes)}
    store = HostStore(layout, pin_memory=False)
    for i in range(len(sizes)):
        store.region(i, torch.float32).fill_(float(i))
    slot_numel = {torch.float32: 2 * max(sizes) * per_slot}
    return ResidencyTable(store, copies or RecordingCopies(), range(len(sizes)), slot_numel)


def test_every_legal_transition_and_nothing_else():
    for a in Phase:
        for b in Phase:
            r = Residency(7)
            r.phase = a
            if (a, b) in LEGAL:
                r.move(b)
                assert r.phase is b
            else:
                with pytest.raises(IllegalTransition, match=f"sub-group 7 cannot go from {a.name} to {b.name}"):
                    r.move(b)
                assert r.phase is a  # unchanged by a refused move


def test_illegal_verbs_are_refused_by_the_table():
    t = make_table()
    with pytest.raises(IllegalTransition):
        t.arrive(0)  # never loaded
    with pytest.raises(IllegalTransition):
        t.write_back(0)  # never updated
    t.load(0)
    with pytest.raises(IllegalTransition):
        t.load(0)  # loaded twice
    with pytest.raises(IllegalTransition):
        t.mark_updated(0)  # the compute stream has not waited for the load
    t.arrive(0)
    t.mark_updated(0)
    with pytest.raises(IllegalTransition):
        t.unload(0)  # updated state cannot be dropped: it must be written back


def test_a_load_that_finds_no_device_memory_changes_nothing():
    """An early load (buffers of its own) or a load into the slots whose allocation runs out of memory
    raises before anything moved: the sub-group is still on the host, nothing is held, no slot half
    made, and it loads as usual afterwards (the early loads give way: step/early_loads.py)."""

    class Full(RecordingCopies):
        full = True

        def alloc(self, numel, **kwargs):
            if self.full:
                raise torch.OutOfMemoryError("CUDA out of memory (injected)")
            return super().alloc(numel)

    t = make_table(Full())
    with pytest.raises(torch.OutOfMemoryError):
        t.load(0)
    assert t[0].phase is Phase.ON_HOST and t.early_bytes == 0 and t.held_early() == 0
    t.plan([1, 2])
    with pytest.raises(torch.OutOfMemoryError):
        t.load(1, staged=True)
    assert t[1].phase is Phase.ON_HOST and t.slots is None
    t.copies.full = False
    t.load(0)
    t.load(1, staged=True)
    assert t[0].phase is t[1].phase is Phase.LOADING and t.slots is not None


def test_a_kept_sub_group_is_updated_again_and_never_dropped():
    """Compile mode keeps an updated sub-group on the device: the next step brings it in from
    UPDATED, and until it is written back its device copy is the only newest one."""
    t = make_table()
    t.load(0)
    t.arrive(0)
    t.view(0, MASTER).fill_(5.0)
    t.mark_updated(0)
    t.arrive(0)  # the next step: UPDATED -> ON_DEVICE, no load
    assert t[0].phase is P.ON_DEVICE and t[0].host_stale
    with pytest.raises(IllegalTransition, match="newer than the host store"):
        t.unload_all()  # a failed step must not drop it: it marks it updated and writes it back
    assert t[0].phase is P.ON_DEVICE
    t.mark_updated(0)
    t.write_back(0)
    t.drain()
    assert not t[0].host_stale and t.store.view(0, MASTER).tolist() == [5.0] * 4


def test_own_buffers_round_trip_and_what_each_copy_waits_for():
    copies = RecordingCopies()
    t = make_table(copies)
    nbytes, _ = t.load(1)
    assert nbytes == 2 * 4 * 4 and t[1].phase is P.LOADING and t[1].slot is None
    # into buffers of its own: no earlier write-back; after the compute work queued before their allocation
    assert [repr(e) for e in copies.waits[-1][1]] == ["None", "alloc1"] and copies.waits[-1][0] == "h2d2"
    t.arrive(1)
    assert copies.waits[-1] == ("compute", [t[1].loaded]) and t[1].phase is P.ON_DEVICE
    t.view(1, "exp_avg").add_(10)  # the "update"
    t.mark_updated(1)
    updated = t[1].updated
    t.write_back(1)
    assert copies.waits[-1] == ("d2h4", [updated]) and t[1].phase is P.WRITING_BACK and t[1].buffers is None
    written = t[1].written
    assert t.store.view(1, "exp_avg").tolist() == [11.0] * 4 and t.store.view(1, MASTER).tolist() == [1.0] * 4
    # the next load of the same sub-group waits for its own write-back
    t.load(1)
    assert copies.waits[-1][1][0] is written
    t.unload(1)
    assert t[1].phase is P.ON_HOST and t[1].buffers is None


def test_slots_wait_for_their_previous_write_back():
    copies = RecordingCopies()
    t = make_table(copies)
    t.plan([0, 1, 2])  # each slot holds one sub-group (8 elements, regions of 8)
    assert [t.places[i][0] for i in (0, 1, 2)] == [0, 1, 0]
    t.load(0, staged=True)
    slot0_allocated = copies.waits[-1][1][1]
    assert slot0_allocated.name.startswith("alloc") and t.slots is not None
    assert not t.can_stage(2)  # sub-group 0 is in its place
    with pytest.raises(IllegalTransition, match="sub-groups \\[0\\] are still in its place"):
        t.load(2, staged=True)
    t.arrive(0)
    t.mark_updated(0)
    t.write_back(0)
    freed = t[0].written
    assert t.can_stage(2)
    t.load(2, staged=True)  # another sub-group into the same place: after sub-group 0's write-back
    assert copies.waits[-1][1] == [None, slot0_allocated, freed]
    t.arrive(2)
    assert t.view(2, MASTER).tolist() == [2.0] * 4  # the slot holds sub-group 2 now
    with pytest.raises(AssertionError, match="slots freed while sub-groups \\[2\\]"):
        t.free_slots()
    t.mark_updated(2)
    t.write_back(2)
    t.free_slots()
    assert t.slots is None


def test_smaller_sub_groups_pack_into_a_slot_and_wait_only_for_what_was_in_their_place():
    """A slot holds the largest region: sub-group 0 fills slot 0, sub-groups 1-3 (a third of it each,
    aligned) share slot 1, 4 and 5 go back to slot 0, each into a part of 0's place; 7 into 1's."""
    copies = RecordingCopies()
    big, small = 3 * PLACE_ALIGN, PLACE_ALIGN
    t = make_table(copies, sizes=[big] + [small] * 7)
    t.plan(list(range(8)))
    f32 = torch.float32
    assert {i: (s, o[f32]) for i, (s, o) in t.places.items()} == {
        0: (0, 0), 1: (1, 0), 2: (1, 2 * small), 3: (1, 4 * small), 4: (0, 0), 5: (0, 2 * small),
        6: (0, 4 * small), 7: (1, 0)}
    assert pack([0, 1, 2], t.store.region_numel, t.slot_numel) == {i: t.places[i] for i in (0, 1, 2)}  # a prefix's
    for i in range(4):
        t.load(i, staged=True)
    ready = [copies.waits[0][1][1], copies.waits[1][1][1]]  # each slot's allocation
    assert not t.can_stage(4) and not t.can_stage(7)
    for i in range(4):
        t.arrive(i)
        t.view(i, "exp_avg").add_(10)
        t.mark_updated(i)
    t.write_back(0)
    assert t.can_stage(4) and t.can_stage(5) and t.can_stage(6) and not t.can_stage(7)
    t.load(4, staged=True)
    assert copies.waits[-1][1] == [None, ready[0], t[0].written]  # what was in its place
    t.write_back(1)
    t.load(7, staged=True)
    assert copies.waits[-1][1] == [None, ready[1], t[1].written]  # 1's place, not 2's or 3's
    t.arrive(4)
    t.arrive(7)
    assert t.view(4, MASTER).tolist() == [4.0] * small and t.view(7, MASTER).tolist() == [7.0] * small
    for i in (2, 3):
        t.write_back(i)
    t.drain()
    assert [t.store.view(i, "exp_avg")[0].item() for i in range(4)] == [10.0, 11.0, 12.0, 13.0]
    t.unload_all()
    t.free_slots()


def test_a_prefetched_sub_group_must_be_where_the_step_plans_it():
    t = make_table(numel=PLACE_ALIGN // 2, per_slot=2)  # two to a slot
    t.plan([0, 1])
    t.load(1, staged=True)  # (0 not loaded)
    assert t.places[1][0] == 0
    with pytest.raises(IllegalTransition, match="sub-groups \\[1\\] are in a slot where this step"):
        t.plan([1, 2])  # the step's order puts 1 first: the same slot, at another offset
    t.plan([0, 1, 2])


def test_release_keeps_the_host_copy_and_drain_waits_for_every_write_back():
    copies = RecordingCopies()
    t = make_table(copies)
    t.load(0)
    t.plan([1])
    t.load(1, staged=True)
    t.arrive(1)
    t.view(1, MASTER).fill_(-1)  # changed on the device, never marked updated: dropped
    assert sorted(t.unload_all()) == [0, 1]
    assert t.store.view(1, MASTER).tolist() == [1.0] * 4 and t.early_bytes == 0
    for i in (0, 2):
        t.load(i)
        t.arrive(i)
        t.mark_updated(i)
        t.write_back(i)
    t.drain()
    # one D2H stream, copies in order: the newest write-back's event covers both
    assert [e for who, evs in copies.waits if who == "host" for e in evs] == [t.last_write]
    assert t.last_write is t[2].written
    assert set(t.phases().values()) == {P.ON_HOST}


def test_early_bytes_count_own_buffers_only():
    t = make_table()
    t.plan([0])
    t.load(0, staged=True)
    t.load(1)
    t.load(2)
    assert t.early_bytes == 2 * t.store_bytes(1)


def test_a_dropped_buffer_counts_until_its_write_back_ends():
    """A buffer of its own dropped right after its write-back was queued is still the device's until the
    copy ends (the allocator reuses the block only then): ``held_early`` counts it until its event is
    done, so that early loads meanwhile do not take new memory (a reserved peak above the allocated one)."""
    t = make_table()
    pending = set()
    t.copies.done = lambda ev: ev not in pending
    t.load(1)
    t.arrive(1)
    t.mark_updated(1)
    t.write_back(1)
    pending.add(t[1].written)
    assert t.early_bytes == 0 and t.held_early() == t.store_bytes(1)
    pending.clear()
    assert t.held_early() == 0


def test_a_restore_puts_the_copy_back_after_the_write_back_and_holds_its_source_till_it_ends():
    """A speculated update rolled back from a device copy: the copy goes over the host region after the
    update's write-back (the next load waits for it), and the copy's buffers, dropped once it is queued,
    count in ``held_early`` until it ends."""
    t = make_table()
    pending = set()
    t.copies.done = lambda ev: ev not in pending
    t.load(1)
    before = {dt: buf.clone() for dt, buf in t[1].buffers.items()}
    t.arrive(1)
    t.view(1, MASTER).add_(10)
    t.mark_updated(1)
    t.write_back(1)
    assert t.store.view(1, MASTER)[0].item() == before[torch.float32][0].item() + 10
    written = t[1].written
    t.restore(1, before)
    restored = t[1].written
    assert t.copies.waits[-1] == (restored.name, [written])  # after the update's write-back
    pending.add(restored)
    assert t.held_early() == t.store_bytes(1)  # the copy's source is still the device's
    assert t.store.view(1, MASTER)[0].item() == before[torch.float32][0].item()
    pending.clear()
    assert t.held_early() == 0
    t.load(1)
    assert restored in t.copies.waits[-1][1]  # the next load waits for the restore
    assert t.last_write is restored  # and so does drain
    with pytest.raises(IllegalTransition):
        t.restore(1, before)  # not while loaded


class _CpuAccelerator:
    """What make_copies asks of DeepSpeed's CPU accelerator (the test runs on a GPU machine too)."""

    def is_synchronized_device(self):
        return True

    def device_name(self):
        return "cpu"


def test_the_cpu_accelerator_gets_the_synchronous_executor():
    copies = make_copies(_CpuAccelerator())
    assert copies.synchronous and isinstance(copies, SyncCopies)
    a, b = copies.clock(), copies.clock()
    assert copies.elapsed(a, b) >= 0


# ---------------------------------------------------------------------- on the CPU: the order a GPU keeps

# Each wait the table passes, and how the negative control drops it (from the executor's side: each
# verb passes exactly these, so this is the wait removed from residency.py).
DROPS = {
    "ready": "a load's wait for its destination (new buffers' allocation, a place's last write-backs)",
    "written": "a load's wait for the sub-group's own previous write-back",
    "loaded": "arrive's wait for the load",
    "updated": "a write-back's wait for the update",
    "drained": "drain's wait for the last write-back",
}


def _dropping(copies, wait):
    """``copies`` with the table's wait ``wait`` (a key of DROPS) ignored."""
    if wait in ("ready", "written"):  # (the table passes the sub-group's own write-back first)
        h2d, keep = copies.h2d, (lambda j: j == 0) if wait == "ready" else (lambda j: j != 0)
        copies.h2d = lambda dst, src, waits: h2d(dst, src, [w for j, w in enumerate(waits) if keep(j)])
    elif wait == "updated":
        d2h = copies.d2h
        copies.d2h = lambda dst, src, waits: d2h(dst, src, ())
    elif wait == "loaded":
        copies.compute_waits = lambda event: None
    elif wait == "drained":
        copies.wait_host = lambda event: None
    return copies


def _ordered_step(t):
    """A step's worth of the table's verbs: sub-group 0 in buffers of its own, loaded again before its
    write-back landed (as compile mode reloads what the forward's head wrote back) and updated once
    more; 1..3 through the two slots (3 refills slot 0 after 1's write-back); a CPU reader at the end.
    Returns what the host store holds."""

    def update(i):
        t.arrive(i)
        t.view(i, MASTER).add_(10)
        t.view(i, "exp_avg").add_(1)
        t.mark_updated(i)
        t.write_back(i)

    t.load(0)
    t.plan([1, 2, 3])
    t.load(1, staged=True)
    t.load(2, staged=True)
    update(0)
    t.load(0)  # WRITING_BACK -> LOADING: reads what the write-back above writes
    update(0)
    update(1)
    t.load(3, staged=True)
    update(2)
    update(3)
    t.free_slots()
    t.drain()
    for i in t.of:  # the CPU reads the host store now
        for region in t._regions(i).values():
            t.copies.order.access(region, write=False, stream="host")
    return [t.store.view(i, MASTER)[0].item() for i in t.of]


def test_a_step_keeps_the_order_a_gpu_needs():
    copies = DeferredCopies()
    t = make_table(copies, groups=4)
    assert _ordered_step(t) == [20.0, 11.0, 12.0, 13.0]
    assert copies.violations == 0, copies.first_violations
    assert copies.accesses > 20 and copies.deferred > 0  # the copies waited in their queues


@pytest.mark.parametrize("wait", list(DROPS))
def test_each_of_the_tables_waits_dropped_is_caught(wait):
    copies = _dropping(DeferredCopies(), wait)
    t = make_table(copies, groups=4)
    held = _ordered_step(t)
    assert copies.violations > 0, f"{DROPS[wait]} dropped: no access out of order (host holds {held})"


WAIT = re.compile(r"compute_waits\(|join_side\(\)|wait_host\(|waits=\(|\.drain\(\)|wait_for_copies\(\)")


def test_the_list_of_waits_removed_one_at_a_time_is_the_source_s():
    """scripts/remove_waits.py removes each wait of the step and of speculation by its text, and
    docs/architecture.md's table is what it found: each text is in the source once, and every line
    of those files that waits (or drains) is one of them."""
    root = Path(__file__).resolve().parents[2]
    sys.path.insert(0, str(root / "scripts"))
    from remove_waits import WAITS
    covered = {}
    for w in WAITS:
        src = (root / w.path).read_text()
        assert src.count(w.text) == 1, f"{w.id}: {w.text!r} is in {w.path} {src.count(w.text)} times"
        first = src[:src.index(w.text)].count("\n") + 1
        covered.setdefault(w.path, set()).update(range(first, first + w.text.count("\n") + 1))
    for path, lines in covered.items():
        waiting = [n for n, line in enumerate((root / path).read_text().splitlines(), 1) if WAIT.search(line)]
        assert set(waiting) <= lines, f"{path}: lines {sorted(set(waiting) - lines)} wait, and no row removes them"


def test_a_slots_refill_without_its_write_back_is_caught_by_parity_too():
    """The deferred copies alone (no access check needed): slot 0 refilled before sub-group 1's
    write-back read it, which then writes sub-group 3's state into 1's host region."""
    copies = _dropping(DeferredCopies(), "ready")
    t = make_table(copies, groups=4)
    assert _ordered_step(t)[1] != 11.0


# Sub-groups of three sizes (in units of PLACE_ALIGN elements per tensor, two tensors each): 0 fills a
# slot, 1 and 2 share slot 1 at offsets 0 and 2 units, 3 and 4 go back to slot 0 at 0 and 2 units
# (4 inside 0's place, at another offset than 0), 5 fills slot 1 again over both 1 and 2.
MIXED = [3, 1, 2, 1, 2, 3]


def test_a_load_waits_for_every_earlier_occupant_its_place_overlaps():
    """Sub-groups of different sizes pack into a slot at different offsets, so a new place may overlap
    an earlier occupant that started elsewhere in the slot: 4 (at 2 units) lies inside 0's place (at
    0), 5 (at 0) covers 1's place (at 0) and 2's (at 2 units). Each load must wait for the write-back
    of every earlier occupant it overlaps, not only of the one at its own offset: that copy still reads
    the bytes the load overwrites."""
    copies = RecordingCopies()
    t = make_table(copies, sizes=[n * PLACE_ALIGN for n in MIXED])
    t.plan(list(range(len(MIXED))))
    f32 = torch.float32
    assert {i: (s, o[f32] // PLACE_ALIGN) for i, (s, o) in t.places.items()} == {
        0: (0, 0), 1: (1, 0), 2: (1, 2), 3: (0, 0), 4: (0, 2), 5: (1, 0)}
    for i in (0, 1, 2):
        t.load(i, staged=True)
    ready = [copies.waits[0][1][1], copies.waits[1][1][1]]  # each slot's allocation
    for i in (0, 1, 2):
        t.arrive(i)
        t.mark_updated(i)
        t.write_back(i)
    t.load(4, staged=True)  # into 0's place, at another offset
    assert copies.waits[-1][1] == [None, ready[0], t[0].written]
    t.load(5, staged=True)  # over 1's place and 2's
    assert copies.waits[-1][1] == [None, ready[1], t[1].written, t[2].written]


def test_packed_sub_groups_of_different_sizes_keep_the_order_a_gpu_needs():
    """A step over ``MIXED`` in the order the stream mode takes (each load as soon as its place is free,
    write-backs in order), with copies that run only when waited for. Slot 1's refill with 5 covers 1's
    place and 2's: if it waited only for 1's write-back (the occupant at its offset), it would overwrite
    2's state before 2's write-back read it (a violation; and 2's host region would get 5's state)."""
    copies = DeferredCopies()
    t = make_table(copies, sizes=[n * PLACE_ALIGN for n in MIXED])
    t.plan(list(range(len(MIXED))))
    loaded = []

    def load_what_fits():
        for i in range(len(MIXED)):
            if i not in loaded and t.can_stage(i):
                t.load(i, staged=True)
                loaded.append(i)

    load_what_fits()
    assert loaded == [0, 1, 2]
    for i in range(len(MIXED)):
        t.arrive(i)
        t.view(i, MASTER).add_(10)
        t.mark_updated(i)
        t.write_back(i)
        load_what_fits()
    assert loaded == [0, 1, 2, 3, 4, 5]
    t.free_slots()
    t.drain()
    for i in t.of:  # the CPU reads the host store now
        for region in t._regions(i).values():
            copies.order.access(region, write=False, stream="host")
    assert copies.violations == 0, copies.first_violations
    assert [t.store.view(i, MASTER).unique().tolist() for i in t.of] == [[10.0 + i] for i in t.of]
    assert copies.deferred > 0


def _speculation(table):
    """A ``Speculation`` over ``table`` with a stand-in for the stream mode (no members: the updates are
    made by hand, as ``Speculation._update`` makes them)."""
    from types import SimpleNamespace
    from deepspeed_offload.runtime.speculation.updates import Speculation
    opt = SimpleNamespace(optimizer=None, fp16_groups=[], fp32_partitioned_groups_flat=[])
    mode = SimpleNamespace(opt=opt, table=table, copies=table.copies, stats=None, guard=lambda i, other=False: None)
    return Speculation(mode, [])


def _update_over_the_host_region(spec, i):
    """What ``Speculation._update`` does on the device for a sub-group rolled back from a device copy
    (``Rollback.DEVICE_COPY``): on the side stream, copy the loaded state into buffers of its own
    (``JOINED``), update it, make the 16-bit cast; then write the update back over the current host
    region."""
    from deepspeed_offload.runtime.staging.copies import JOINED
    from deepspeed_offload.runtime.speculation.records import Speculated
    t, copies = spec.mode.table, spec.mode.copies
    t.load(i)
    n = t.store.region_numel(i)[torch.float32] // 2
    cast, cast_ready = copies.alloc({torch.bfloat16: n}, used_by=JOINED)
    kept, kept_ready = copies.alloc(t.store.region_numel(i), used_by=JOINED)
    with copies.side():
        t.arrive(i)
        copies.compute_waits(cast_ready)
        copies.compute_waits(kept_ready)
        copies.uses(reads=t[i].buffers.values(), writes=kept.values())
        for dt, buf in kept.items():
            buf.copy_(t[i].buffers[dt].narrow(0, 0, buf.numel()))
        t.view(i, MASTER).add_(10)
        copies.uses(writes=cast.values())
        cast[torch.bfloat16].copy_(t.view(i, MASTER))
        t.mark_updated(i)
    t.write_back(i)
    spec.updated[i] = Speculated({}, {}, {}, 1.0, cast[torch.bfloat16], kept)


@pytest.mark.parametrize("discard", ["discard_all", "discard"])
@pytest.mark.parametrize("control", [False, True], ids=["read_by_copies", "control_without_read_by_copies"])
def test_a_rollback_from_a_device_copy_holds_the_copy_until_its_restore_read_it(discard, control):
    """A speculated update written over its host region is rolled back (``discard_all`` at the step, or
    ``discard`` of one sub-group where DeepSpeed reduces its gradient again): the device copy of the
    state before goes back over the host region on the D2H stream (``restore``), and the copy's
    buffers, dropped right after, are released ``read_by_copies``: on a GPU recorded on the D2H stream
    too, so that the allocator hands their blocks out only after that copy read them. Released
    without it (the control drops the flag), the next user of the blocks may overwrite them first: a
    violation, and the deferred executor, which reuses such a block at once, restores NaN."""
    copies = DeferredCopies()
    if control:
        free = copies.free
        copies.free = lambda *tensors, read_by_copies=False: free(*tensors)
    t = make_table(copies, groups=2)
    spec = _speculation(t)
    _update_over_the_host_region(spec, 1)
    assert t.store.view(1, MASTER).tolist() == [1.0] * 4  # the update's write-back: still queued
    if discard == "discard_all":
        spec.discard_all("clipped")
    else:
        with copies.order.on("reduce"):  # (DeepSpeed's reduction stream, which reduced a gradient again)
            spec.discard(1, "gradient changed")
    assert spec.counters.restored == 1 and not spec.updated
    assert copies.deferred > 0  # the restore was queued behind that write-back: its source was released unread
    t.drain()
    for region in t._regions(1).values():  # the CPU reads the host store now
        copies.order.access(region, write=False, stream="host")
    restored = t.store.view(1, MASTER).tolist() == [1.0] * 4
    if control:
        assert copies.released_in_use > 0 and copies.violations > 0 and not restored
    else:
        assert copies.violations == 0 and copies.released_in_use == 0, copies.first_violations
        assert restored  # the state before the update


# ---------------------------------------------------------------------- on a GPU: the waits are real

# cycles of torch.cuda._sleep: ~0.5 s of stream work that holds a copy or an update back. The
# negative controls need the unheld copy to run within it, also while `gpu.sh tests` runs 7 other
# test processes on the same GPU (at ~0.1 s one control's D2H came after the update).
SPIN = int(1e9)


def _gpu_table(numel=1 << 20):
    from deepspeed_offload.runtime.staging.copies import AsyncCopies
    layout = {i: [(MASTER, torch.float32, numel), ("exp_avg", torch.float32, numel)] for i in range(2)}
    store = HostStore(layout, pin_memory=True)
    for i in range(2):
        store.region(i, torch.float32).fill_(10.0 * i)
    return ResidencyTable(store, AsyncCopies(), range(2), {torch.float32: 2 * numel})


def _without_waits(table):
    """The negative control: every H2D ignores what it should wait for."""
    real = table.copies.h2d
    table.copies.h2d = lambda dst, src, waits: real(dst, src, ())


def _update(t, i, slow=False):
    if slow:
        torch.cuda._sleep(SPIN)  # the compute stream is busy: the update lands late
    t.view(i, MASTER).add_(1)
    t.view(i, "exp_avg").add_(1)
    t.mark_updated(i)


def _host_holds(t, i, value):
    host = t.store.view(i, MASTER)
    return torch.equal(host, torch.full_like(host, value))


def _assert_only_the_control_races(ok, control, failure):
    """``ok``: the waits held. It must be true with them and false in the negative control."""
    assert ok is not control, "the control must see the race: widen SPIN" if control else failure


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (streams and events)")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("control", [False, True], ids=["waits", "control_without_the_write_back_wait"])
def test_gpu_a_load_waits_for_its_own_previous_write_back(control):
    """The update is quick and the write-back slow (the D2H stream is kept busy first), so only the
    wait on the sub-group's own write-back orders the next load after it: the control drops that one
    wait and keeps the other (the new buffers' allocation), and must load the stale host copy."""
    t = _gpu_table()
    if control:
        real = t.copies.h2d
        t.copies.h2d = lambda dst, src, waits: real(dst, src, tuple(waits)[1:])  # (its own write-back is first)
    t.load(1)
    t.arrive(1)
    _update(t, 1)
    with torch.cuda.stream(t.copies.d2h_stream):
        torch.cuda._sleep(SPIN)  # the write-back below lands late
    t.write_back(1)
    t.load(1)  # must read what that write-back writes, not the host copy from before
    t.arrive(1)
    torch.cuda.synchronize()
    fresh = torch.equal(t.view(1, MASTER).cpu(), torch.full((1 << 20, ), 11.0))
    _assert_only_the_control_races(fresh, control, "loaded stale state")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("control", [False, True], ids=["waits", "control_without_waits"])
def test_gpu_a_slot_is_reloaded_only_after_its_write_back(control):
    """The write-back of slot 0 is held back (the D2H stream is kept busy first), so only the slot's
    wait keeps the next load into slot 0 from overwriting it before that D2H has read it. (On the
    H200, 2026-11-29, a delay on the compute stream before the update did not open the window: the
    control's load still landed after the write-back, for a reason not found; a held-back D2H
    opens it, as in the test above.)"""
    t = _gpu_table()
    if control:
        _without_waits(t)
    t.plan([0])
    t.load(0, staged=True)
    t.arrive(0)
    _update(t, 0)
    with torch.cuda.stream(t.copies.d2h_stream):
        torch.cuda._sleep(SPIN)  # the write-back below lands late
    t.write_back(0)  # D2H from slot 0
    t.plan([1])  # 0's place
    t.load(1, staged=True)  # must not overwrite slot 0 before that D2H has read it
    t.arrive(1)
    torch.cuda.synchronize()
    t.drain()
    intact = _host_holds(t, 0, 1.0) and torch.equal(t.view(1, MASTER).cpu(), torch.full((1 << 20, ), 10.0))
    _assert_only_the_control_races(intact, control, "slot 0 was overwritten before its write-back")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("control", [False, True], ids=["waits", "control_without_the_update_wait"])
def test_gpu_a_write_back_waits_for_the_update(control):
    """The update is held back on the compute stream: only the write-back's wait on it keeps the
    D2H from copying the values from before the update."""
    t = _gpu_table()
    if control:
        real = t.copies.d2h
        t.copies.d2h = lambda dst, src, waits: real(dst, src, ())
    t.load(0)
    t.arrive(0)
    _update(t, 0, slow=True)
    t.write_back(0)
    torch.cuda.synchronize()
    t.drain()
    _assert_only_the_control_races(_host_holds(t, 0, 1.0), control,
                                   "the write-back copied the state from before the update")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("used_by", ["joined", "released"], ids=["joined", "released_without_a_join"])
def test_gpu_a_joined_buffer_is_reused_while_the_side_stream_still_runs(used_by):
    """A ``JOINED`` buffer (an update's 16-bit cast, the updates' fp32 gradient buffer) dropped after ``join_side`` goes back in the
    compute stream's order: the next allocation reuses its block at once, while the side stream (and
    the device) are still busy with it, and what the compute stream then writes lands after the side
    stream's write. One dropped without a join (a rollback on another stream) is handed to
    ``release`` first: recorded on the side stream, it is held until the host sees the side stream
    finish, so an allocation queued meanwhile (the next forward's, when the host runs ahead of the
    step) takes another block."""
    from deepspeed_offload.runtime.staging.copies import AsyncCopies
    copies = AsyncCopies()
    numel = {torch.float32: 1 << 22}
    # The case holds only where the side stream still ran when the block was asked for again: a host held
    # up for longer than the spin (a loaded machine) tries again with a longer one.
    for spin in (SPIN, 4 * SPIN, 16 * SPIN):
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        bufs, ready = copies.alloc(numel, used_by="joined")
        ptr = bufs[torch.float32].data_ptr()
        with copies.side():
            copies.compute_waits(ready)
            torch.cuda._sleep(spin)  # the side stream still runs when the host drops the buffer
            bufs[torch.float32].fill_(1.0)
        if used_by == "released":
            copies.free(*bufs.values())
        else:
            copies.join_side()
        del bufs
        again, _ = copies.alloc(numel, used_by="joined")
        side_ran = not copies.side_stream.query()  # still running after the allocation: it ran during it
        reused = again[torch.float32].data_ptr() == ptr
        again[torch.float32].fill_(2.0)  # on the compute stream
        torch.cuda.synchronize()
        if side_ran:
            break
    assert side_ran, "the side stream ended before the host asked for the block again, at every spin"
    assert reused == (used_by == "joined"), ("the joined block was not reused" if used_by == "joined" else
                                             "the block was reused while the side stream still ran")
    assert bool((again[torch.float32] == 2.0).all()), "the side stream's write landed after the compute stream's"


def test_drain_waits_for_a_write_back_whose_sub_group_is_loading_again():
    """A load may start before the sub-group's last write-back landed (the copy waits for it on the
    device): a CPU reader draining then must still wait for that write-back."""
    copies = RecordingCopies()
    t = make_table(copies)
    t.load(0)
    t.arrive(0)
    t.mark_updated(0)
    t.write_back(0)
    written = t[0].written
    t.load(0)  # WRITING_BACK -> LOADING: nothing in WRITING_BACK any more
    assert t.in_phase(P.WRITING_BACK) == []
    t.drain()
    assert ("host", [written]) in copies.waits
