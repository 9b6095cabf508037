"""A switch to resident (runtime/memory/arrival.py): the state copied beside the next backward,
waited for where it is read, and its host regions unpinned over the steps after, a budget a step."""

import mmap
from types import SimpleNamespace

import pytest
import torch
from deepspeed.accelerator import get_accelerator

from test_host_memory import RecordingPinner
from deepspeed_offload.runtime.memory import pinned
from deepspeed_offload.runtime.memory.arrival import Arrival, ArrivalPhase
from deepspeed_offload.runtime.memory.host_store import MASTER, HostStore
from deepspeed_offload.runtime.memory.state_tensors import StateTensors
from deepspeed_offload.runtime.staging.copies import SyncCopies
from deepspeed_offload.runtime.step.stream import StreamMode


class Event:
    landed = False


class LateCopies(SyncCopies):
    """Copies whose event lands when the test says so; records who waited for it, and how."""

    def __init__(self):
        super().__init__()
        self.calls, self.event = [], None

    def h2d(self, dst, src, waits):
        super().h2d(dst, src, waits)
        self.event = Event()
        return self.event, None

    def compute_waits(self, event):
        self.calls.append(("compute_waits", event))

    def wait_host(self, event):
        self.calls.append(("wait_host", event))
        event.landed = True

    def done(self, event):
        return event.landed


class RecordingMemory:
    def __init__(self):
        self.calls = []

    def empty_cache(self):
        self.calls.append("empty_cache")


def make_mode(fake_host, monkeypatch, n=4):
    fake_host()
    page = mmap.PAGESIZE // 4
    monkeypatch.setattr(pinned, "SLAB_BYTES", page * 4)  # a slab a sub-group
    pinner = RecordingPinner()
    monkeypatch.setattr(pinned, "make_pinner", lambda acc, pin: pinner)
    store = HostStore({i: [(MASTER, torch.float32, page)] for i in range(n)}, pin_memory=True)
    masters = []
    for i in range(n):
        store.view(i, MASTER).fill_(i + 1)
        masters.append(torch.nn.Parameter(store.view(i, MASTER), requires_grad=False))
    opt = SimpleNamespace(fp32_partitioned_groups_flat=masters, optimizer=SimpleNamespace(state={}))
    guarded = []
    mode = SimpleNamespace(acc=get_accelerator(), store=store, copies=LateCopies(), resident=[], memory=RecordingMemory(),
                           tensors=StateTensors(opt, store, list(range(n))), guard=lambda i, other: guarded.append(i))
    mode.arrival = Arrival(mode)
    mode.arrival.unpin_after = 0  # (the window the split holds first: its own test)
    return mode, masters, pinner, guarded


def test_the_state_travels_beside_the_next_backward_and_is_waited_for_where_it_is_read(fake_host, monkeypatch):
    mode, masters, pinner, guarded = make_mode(fake_host, monkeypatch)
    arrival = mode.arrival
    assert arrival.phase is ArrivalPhase.IDLE
    mode.resident = [0, 1, 2]
    arrival.start(arrival.allocate([0, 1, 2]))
    for i in range(3):  # DeepSpeed's own tensors, their .data on new device tensors
        assert masters[i].data_ptr() != mode.store.view(i, MASTER).data_ptr()
    assert masters[3].data_ptr() == mode.store.view(3, MASTER).data_ptr()
    assert arrival.phase is ArrivalPhase.QUEUED and mode.copies.event is None
    arrival.between_steps(iteration_s=100.0)  # (a step before any backward: nothing happens)
    assert arrival.phase is ArrivalPhase.QUEUED
    arrival.launch()  # the next backward begins: the copies run beside it
    assert all(torch.all(masters[i] == i + 1) for i in range(3))
    assert arrival.phase is ArrivalPhase.COPYING and arrival.copied_bytes == 3 * mmap.PAGESIZE
    event = mode.copies.event
    arrival.launch()
    assert mode.copies.event is event  # once
    arrival.between_steps(iteration_s=100.0)  # still copying: its regions are read, nothing is unpinned
    assert pinner.unregistered == [] and mode.store.unpinned == set()
    arrival.before_step()  # the step waits on the device, the CPU does not
    assert mode.copies.calls == [("compute_waits", event)] and arrival.phase is ArrivalPhase.COPYING
    arrival.wait()  # a CPU reader (synchronize_for_checkpoint) waits for it
    assert mode.copies.calls[-1] == ("wait_host", event) and arrival.phase is ArrivalPhase.UNPINNING
    arrival.before_step()
    assert len(mode.copies.calls) == 2  # landed: nothing more to wait for


def test_the_copies_start_with_the_backward_not_the_forward(fake_host, monkeypatch):
    """Launched in the forward, a switch's copies would hold up the forward's own small host-to-device
    copies, queued behind them on the one copy engine (first in, first out)."""
    mode, _, _, _ = make_mode(fake_host, monkeypatch)
    mode.resident = [0, 1, 2]
    mode.arrival.start(mode.arrival.allocate([0, 1, 2]))
    inputs = []
    mode.plan, mode._in_step = None, False
    mode.lifecycle = SimpleNamespace(current=None, forward_input=inputs.append)
    mode.early = SimpleNamespace(backward_begins=lambda boundary: None)
    mode.engine = SimpleNamespace(is_gradient_accumulation_boundary=lambda: True)
    mode.timing = SimpleNamespace(forward_input=lambda numel: None)
    StreamMode.forward_begins(mode, 128)
    assert inputs == [128] and mode.arrival.phase is ArrivalPhase.QUEUED and mode.copies.event is None
    StreamMode.backward_begins(mode)
    assert mode.arrival.phase is ArrivalPhase.COPYING and mode.copies.event is not None


def test_the_regions_are_unpinned_a_budget_a_step_and_only_while_resident(fake_host, monkeypatch):
    mode, masters, pinner, guarded = make_mode(fake_host, monkeypatch)
    arrival = mode.arrival
    mode.resident = [0, 1, 2]
    arrival.start(arrival.allocate([0, 1, 2]))
    arrival.launch()
    mode.copies.event.landed = True
    arrival.between_steps(iteration_s=0.0)  # no time to spare: one sub-group a step
    assert mode.store.unpinned == {0} and len(pinner.unregistered) == 1 and guarded == [0]
    assert arrival.phase is ArrivalPhase.UNPINNING
    mode.resident = [0]  # the plan gave 1 and 2 back before their turn: their slabs are still locked
    arrival.between_steps(iteration_s=0.0)
    arrival.between_steps(iteration_s=0.0)
    assert mode.store.unpinned == {0} and len(pinner.unregistered) == 1 and guarded == [0]
    assert arrival.phase is ArrivalPhase.IDLE
    mode.resident = [0, 1, 2, 3]
    arrival.start(arrival.allocate([1, 2, 3]))
    arrival.launch()
    arrival.between_steps(iteration_s=0.0)  # not landed yet
    assert mode.store.unpinned == {0}
    arrival.settle()  # before something needs the host memory: everything now
    assert mode.store.unpinned == {0, 1, 2, 3} and len(pinner.unregistered) == 4 and guarded == [0, 1, 2, 3]
    assert mode.store.pinned_bytes == 0 and arrival.phase is ArrivalPhase.IDLE


def test_a_step_with_time_to_spare_unpins_everything(fake_host, monkeypatch):
    mode, _, pinner, _ = make_mode(fake_host, monkeypatch)
    mode.resident = [0, 1, 2, 3]
    mode.arrival.start(mode.arrival.allocate([0, 1, 2, 3]))
    mode.arrival.launch()
    mode.copies.event.landed = True
    mode.arrival.between_steps(iteration_s=1000.0)
    assert mode.store.unpinned == {0, 1, 2, 3} and len(pinner.unregistered) == 4


def test_running_out_of_memory_while_allocating_leaves_every_tensor_where_it_was(fake_host, monkeypatch):
    """A move allocates first (its prepare): out of memory half way (near the limit) changes nothing."""
    mode, masters, pinner, _ = make_mode(fake_host, monkeypatch)
    real_empty, made = torch.empty, []

    def empty(*args, **kwargs):
        if len(made) == 2:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory")
        made.append(1)
        return real_empty(*args, **kwargs)

    monkeypatch.setattr(torch, "empty", empty)
    with pytest.raises(torch.cuda.OutOfMemoryError):
        mode.arrival.allocate([0, 1, 2])
    assert all(masters[i].data_ptr() == mode.store.view(i, MASTER).data_ptr() for i in range(4))
    assert mode.arrival.phase is ArrivalPhase.IDLE and mode.copies.event is None and pinner.unregistered == []


def test_a_switch_empties_the_cache_before_its_state_is_allocated(fake_host, monkeypatch):
    """Placed into the blocks the last iteration cached, the switch's state would split them; the next
    iteration would then reserve new segments beside the fragments, over what the plan measured."""
    mode, _, _, _ = make_mode(fake_host, monkeypatch)
    stored = mode.tensors.stored
    monkeypatch.setattr(mode.tensors, "stored", lambda i: (mode.memory.calls.append(f"allocate {i}"), stored(i))[1])
    mode.arrival.allocate([])
    assert mode.memory.calls == []  # nothing to allocate: the cache stays
    mode.arrival.allocate([1, 2])
    assert mode.memory.calls == ["empty_cache", "allocate 1", "allocate 2"]


def test_the_host_memory_is_unpinned_only_once_the_split_held_for_its_window(fake_host, monkeypatch):
    """A give-back soon after a take-back (a larger batch within the plan's window) finds the slabs
    still locked and locks nothing: the unpinning starts after ``UNPIN_AFTER_STEPS`` applied steps
    without a move, and a move (either way) starts the count again."""
    from deepspeed_offload.runtime.memory import arrival as arrival_module
    mode, _, pinner, _ = make_mode(fake_host, monkeypatch)
    arrival = mode.arrival
    arrival.unpin_after = arrival_module.UNPIN_AFTER_STEPS
    assert arrival.unpin_after == 32
    mode.resident = [0, 1, 2, 3]
    arrival.start(arrival.allocate([0, 1, 2, 3]))
    arrival.launch()
    mode.copies.event.landed = True
    for _ in range(arrival.unpin_after - 1):
        arrival.between_steps(iteration_s=1000.0)
    assert mode.store.unpinned == set() and pinner.unregistered == []
    arrival.moved()  # a give-back of another sub-group: the split changed again
    for _ in range(arrival.unpin_after - 1):
        arrival.between_steps(iteration_s=1000.0)
    assert mode.store.unpinned == set()
    arrival.between_steps(iteration_s=1000.0)  # held for the whole window
    assert mode.store.unpinned == {0, 1, 2, 3} and len(pinner.unregistered) == 4
