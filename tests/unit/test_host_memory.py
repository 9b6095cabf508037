"""Host memory planned before anything is pinned (host_memory.py), and a store allocated at its exact
size and locked in slabs (runtime/memory/pinned.py): read from faked /proc/meminfo and cgroup files."""

import mmap

import pytest
import torch

from conftest import GiB, write_host
from deepspeed_offload import ConfigError
from deepspeed_offload.sizing import host_memory
from deepspeed_offload.sizing.estimate import host_plan
from deepspeed_offload.sizing.host_memory import HostMemory, HostPlan, check_host_plan
from deepspeed_offload.runtime.memory import pinned
from deepspeed_offload.runtime.memory.host_store import MASTER, HostStore

STATE_7B = 80_860_987_392  # 6,738,415,616 parameters x 12 bytes: 75.31 GiB
H200_HOST = dict(total=125 * GiB, available=122 * GiB)  # the GPU machine's host


def power_of_two(n):
    return 1 << (n - 1).bit_length()


def test_meminfo_and_cgroup_v2(tmp_path):
    root = write_host(tmp_path, total=64 * GiB, available=40 * GiB, cgroup_limit=32 * GiB, cgroup_usage=4 * GiB)
    mem = HostMemory.read(str(root))
    assert (mem.total, mem.available, mem.cgroup_limit, mem.cgroup_usage) == (64 * GiB, 40 * GiB, 32 * GiB, 4 * GiB)
    assert mem.free == 28 * GiB  # the cgroup allows less than MemAvailable
    assert mem.usable == mem.free - max(2 * GiB, int(0.05 * 64 * GiB))


def test_memtotal_and_memavailable_are_psutils(tmp_path):
    """psutil reads them (a faked root through psutil.PROCFS_PATH, put back after); the host's own
    figures are psutil.virtual_memory()'s."""
    import psutil
    mem = HostMemory.read(str(write_host(tmp_path, total=64 * GiB, available=40 * GiB)))
    assert (mem.total, mem.available) == (64 * GiB, 40 * GiB) and psutil.PROCFS_PATH == "/proc"
    host, vm = HostMemory.read(), psutil.virtual_memory()
    assert host.total == vm.total and abs(host.available - vm.available) < GiB


def test_cgroup_v1_and_no_limit(tmp_path):
    v1 = HostMemory.read(str(write_host(tmp_path / "a", 64 * GiB, 40 * GiB, cgroup_limit=8 * GiB, cgroup_version=1)))
    assert v1.cgroup_limit == 8 * GiB and v1.free == 8 * GiB
    unlimited = HostMemory.read(str(write_host(tmp_path / "b", 64 * GiB, 40 * GiB, cgroup_version=1)))
    assert unlimited.cgroup_limit is None and unlimited.free == 40 * GiB
    v2 = HostMemory.read(str(write_host(tmp_path / "c", 64 * GiB, 40 * GiB)))  # memory.max: "max"
    assert v2.cgroup_limit is None and v2.free == 40 * GiB


def test_the_7b_store_fits_at_its_exact_size_and_not_rounded(tmp_path):
    """75.3 GiB fits a 125 GiB host; torch's pinned allocator would ask for 128 GiB, which does not."""
    mem = HostMemory.read(str(write_host(tmp_path, **H200_HOST)))
    check_host_plan(HostPlan(STATE_7B), mem)
    assert power_of_two(STATE_7B) == 128 * GiB
    with pytest.raises(ConfigError, match=r"need 128\.00 GiB .* can give 115\.75 GiB"):
        check_host_plan(HostPlan(power_of_two(STATE_7B)), mem)


def test_a_plan_that_does_not_fit_names_numbers_and_ways_out(tmp_path):
    mem = HostMemory.read(str(write_host(tmp_path, total=256 * GiB, available=200 * GiB, cgroup_limit=150 * GiB)))
    plan = host_plan(params=6_738_415_616, world=8, ranks_per_node=8, budget_gb=0,
                     ds_config={"zero_optimization": {"offload_param": {"device": "cpu"}}})
    assert plan.store_per_rank == STATE_7B // 8 and plan.deepspeed_pinned == 6_738_415_616 * 2
    check_host_plan(plan, mem)  # 75.3 GiB of stores and 12.6 GiB of parameters in 137.2 usable
    plan16 = host_plan(params=4 * 6_738_415_616, world=8, ranks_per_node=8, budget_gb=1.0)
    with pytest.raises(ConfigError) as err:
        check_host_plan(plan16, mem)
    text = str(err.value)
    assert "8 rank(s) on this node need 293.23 GiB" in text and "cgroup limit 150.00 GiB" in text
    assert "memory_budget_gb: " in text and "more nodes" in text and "fewer ranks per node" in text
    short = plan16.needed - mem.usable
    budget = float(text.split("memory_budget_gb: ")[1].split(")")[0])  # what it says to set
    assert 1.0 + short / 8 / GiB <= budget < 1.0 + short / 8 / GiB + 0.01
    # with that budget, the same job fits
    check_host_plan(host_plan(params=4 * 6_738_415_616, world=8, ranks_per_node=8, budget_gb=budget), mem)


def test_budget_and_world_size_shrink_the_store():
    assert host_plan(1_000_000, 1).store_per_rank == 12_000_000
    assert host_plan(1_000_000, 4).store_per_rank == 3_000_000
    assert host_plan(10 * GiB // 12, 1, budget_gb=4).store_per_rank == 10 * GiB // 12 * 12 - 4 * GiB
    assert host_plan(1_000_000, 1, budget_gb=1).store_per_rank == 0


def test_memlock_hint_only_below_the_request(monkeypatch):
    monkeypatch.setattr(host_memory, "memlock_limit", lambda: 64 * 2**20)
    assert "ulimit -l" in host_memory.memlock_hint(GiB)
    assert host_memory.memlock_hint(2**20) == ""
    monkeypatch.setattr(host_memory, "memlock_limit", lambda: None)
    assert host_memory.memlock_hint(10**15) == ""


def test_numa_node_of_a_pci_device_and_node_cpus(tmp_path):
    dev = tmp_path / "sys/bus/pci/devices/0000:1b:00.0"
    dev.mkdir(parents=True)
    (dev / "numa_node").write_text("1\n")
    for node, cpus in ((0, "0-7,16-23"), (1, "8-15,24-31")):
        (tmp_path / f"sys/devices/system/node/node{node}").mkdir(parents=True)
        (tmp_path / f"sys/devices/system/node/node{node}/cpulist").write_text(cpus + "\n")
    assert host_memory.numa_nodes(str(tmp_path)) == [0, 1]
    assert host_memory.pci_numa_node("0000:1B:00.0", str(tmp_path)) == 1
    assert host_memory.node_cpus(1, str(tmp_path)) == list(range(8, 16)) + list(range(24, 32))
    (dev / "numa_node").write_text("-1\n")  # a one-node host's answer
    assert host_memory.pci_numa_node("0000:1b:00.0", str(tmp_path)) is None


# ---------------------------------------------------------------------------------------------- slabs


def test_slabs_are_cut_at_region_boundaries():
    regions = [(0, 600), (600, 900), (900, 2000), (2000, 2100), (2100, 2150)]
    slabs = pinned.cut_slabs(regions, slab_bytes=1000)
    assert slabs == [(0, 2000), (2000, 2150)]
    starts = {lo for lo, _ in regions} | {regions[-1][1]}
    assert all(lo in starts and hi in starts for lo, hi in slabs)  # no copy of a region spans two slabs
    assert pinned.cut_slabs([(0, 5000)], slab_bytes=1000) == [(0, 5000)]  # a region larger than a slab: one slab


class RecordingPinner:
    kind = "fake"

    def __init__(self, fail_at=None):
        self.fail_at = fail_at
        self.registered, self.unregistered = [], []

    def register(self, address, nbytes):
        if len(self.registered) == self.fail_at:
            raise RuntimeError("CUDA error: out of memory")
        self.registered.append((address, nbytes))

    def unregister(self, address):
        self.unregistered.append(address)


def test_allocate_locks_exact_sizes_in_slabs_and_unlocks_when_freed(monkeypatch):
    monkeypatch.setattr(pinned, "SLAB_BYTES", 4096)
    pinner = RecordingPinner()
    sizes = {torch.float32: 3000, torch.bfloat16: 10}
    bounds = {torch.float32: [(0, 4000), (4000, 8000), (8000, 12000)], torch.bfloat16: [(0, 20)]}
    buffers, stats, slabs = pinned.allocate(sizes, bounds, pinner)
    assert buffers[torch.float32].numel() == 3000 and buffers[torch.bfloat16].numel() == 10
    assert sorted(n for _, n in pinner.registered) == [20, 4000, 8000]  # whole regions, exact sizes
    assert stats.nbytes == 12020 and stats.kind == "fake"
    assert torch.count_nonzero(buffers[torch.float32]) == 0  # touched (zeroed) before locking
    mapping = buffers[torch.float32].untyped_storage()
    assert buffers[torch.float32].untyped_storage().nbytes() == 12000  # not a power of two
    del buffers, mapping, slabs
    import gc
    gc.collect()
    assert sorted(pinner.unregistered) == sorted(a for a, _ in pinner.registered)  # unlocked before unmapped


def test_a_failure_half_way_unlocks_what_was_locked(monkeypatch):
    monkeypatch.setattr(pinned, "SLAB_BYTES", 1024)
    monkeypatch.setenv("DS_OFFLOAD_PIN_THREADS", "1")  # in order: the third slab fails
    pinner = RecordingPinner(fail_at=2)
    with pytest.raises(RuntimeError, match="locking .* failed .*out of memory"):
        pinned.allocate({torch.float32: 1024}, {torch.float32: [(i * 1024, (i + 1) * 1024) for i in range(4)]},
                        pinner)
    assert len(pinner.registered) == 2 and sorted(pinner.unregistered) == sorted(a for a, _ in pinner.registered)


def test_the_mapping_is_the_exact_size():
    m = pinned.map_exact(75 * 1000 * 1000 + 3)
    assert len(m) == 75 * 1000 * 1000 + 3 and isinstance(m, mmap.mmap)


def test_host_store_checks_the_node_before_it_pins(fake_host, monkeypatch):
    fake_host(total=16 * GiB, available=5 * GiB)  # usable: 3 GiB
    calls = []
    real = pinned.allocate
    monkeypatch.setattr(pinned, "allocate", lambda *a, **k: calls.append(a[0]) or real(*a, **k))
    with pytest.raises(ConfigError, match=r"need 3\.75 GiB .* can give 3\.00 GiB .*memory_budget_gb: 0\.75"):
        HostStore({0: [(MASTER, torch.float32, 15 * 2**26)]}, pin_memory=True)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # every rank of the node pins a store this size
    HostStore({0: [(MASTER, torch.float32, 3 * 2**27)]}, pin_memory=False)  # 2 x 1.5 GiB: fits
    with pytest.raises(ConfigError, match=r"2 rank\(s\) on this node need 3\.50 GiB"):
        HostStore({0: [(MASTER, torch.float32, 7 * 2**26)]}, pin_memory=True)
    assert calls == [{torch.float32: 3 * 2**27}]  # only the store that fits was allocated, at its exact size


def test_host_store_pinning_failure_is_a_clear_error(fake_host, monkeypatch):
    fake_host()
    monkeypatch.setattr(pinned, "make_pinner", lambda acc, pin: RecordingPinner(fail_at=0))
    monkeypatch.setattr(host_memory, "memlock_limit", lambda: None)
    with pytest.raises(ConfigError, match="pin_memory: locking .* failed") as err:
        HostStore({0: [(MASTER, torch.float32, 10)]}, pin_memory=True)
    assert "ulimit" not in str(err.value)  # the limit is not the cause here
    monkeypatch.setattr(host_memory, "memlock_limit", lambda: 8)
    with pytest.raises(ConfigError, match="ulimit -l"):
        HostStore({0: [(MASTER, torch.float32, 10)]}, pin_memory=True)


def test_the_store_gives_back_the_memory_of_resident_sub_groups_and_locks_it_again(fake_host, monkeypatch):
    """What the measured plan makes resident leaves the host (StreamMode._place): a slab whose
    sub-groups are all released is unlocked and its pages given back (they read as zeros); a slab
    shared with a streaming sub-group stays; a sub-group that streams again is locked again first;
    when the store goes, only what is still locked is unlocked."""
    fake_host()
    page = mmap.PAGESIZE // 4  # float32 elements in a page
    monkeypatch.setattr(pinned, "SLAB_BYTES", 2 * page * 4)  # sub-groups 0, 1 a slab each; 2 and 3 share one
    pinner = RecordingPinner()
    monkeypatch.setattr(pinned, "make_pinner", lambda acc, pin: pinner)
    sizes = {0: 2 * page, 1: 2 * page, 2: page, 3: page}
    store = HostStore({i: [(MASTER, torch.float32, n)] for i, n in sizes.items()}, pin_memory=True, twins=[1])
    for i in sizes:
        store.view(i, MASTER).fill_(i + 1)
    store.view(1, MASTER, other=True).fill_(7)
    locked = store.pinned_bytes
    assert locked == store.nbytes and len(pinner.registered) == 4  # 0, 1, {2, 3}, 1's second region
    store.unpin([0, 1, 2])
    assert store.unpinned == {0, 1, 2} and len(pinner.unregistered) == 3  # 0, both of 1's; {2, 3} stays
    assert store.pinned_bytes == locked - 3 * 2 * page * 4
    assert torch.count_nonzero(store.view(0, MASTER)) == 0 and torch.count_nonzero(store.view(1, MASTER, other=True)) == 0
    assert torch.all(store.view(2, MASTER) == 3) and torch.all(store.view(3, MASTER) == 4)  # its slab was kept
    store.repin([1, 2])
    assert store.unpinned == {0} and len(pinner.registered) == 6  # 1's two slabs locked again, at their sizes
    assert [n for _, n in pinner.registered[-2:]] == [2 * page * 4] * 2
    assert store.pinned_bytes == locked - 2 * page * 4
    store.view(1, MASTER).fill_(5)  # its memory is held again when written
    assert torch.all(store.view(1, MASTER) == 5)
    zero = set(pinner.unregistered[:3]) - {a for a, _ in pinner.registered[4:]}  # 0's slab, released still
    still_locked = {a for a, _ in pinner.registered[:4]} - zero
    assert len(zero) == 1 and len(still_locked) == 3
    del store
    import gc
    gc.collect()
    assert set(pinner.unregistered[3:]) == still_locked and len(pinner.unregistered) == 3 + len(still_locked)


def test_a_slab_that_cannot_be_unlocked_is_kept(fake_host, monkeypatch):
    """cudaHostUnregister failing: the slab stays locked and its pages are not handed back (the driver
    still maps them); training goes on."""
    fake_host()
    page = mmap.PAGESIZE // 4
    monkeypatch.setattr(pinned, "SLAB_BYTES", page * 4)
    pinner = RecordingPinner()

    def refuse(address):
        raise RuntimeError("cudaHostUnregister failed with CUDA error 712")
    monkeypatch.setattr(pinner, "unregister", refuse)
    monkeypatch.setattr(pinned, "make_pinner", lambda acc, pin: pinner)
    store = HostStore({0: [(MASTER, torch.float32, 2 * page)], 1: [(MASTER, torch.float32, page)]}, pin_memory=True)
    store.view(0, MASTER).fill_(3)
    store.unpin([0])
    assert store.pinned_bytes == store.nbytes and torch.all(store.view(0, MASTER) == 3)


def test_a_slab_that_cannot_be_locked_again_stays_pageable(fake_host, monkeypatch):
    """cudaHostRegister failing when a sub-group streams again (the memlock limit, say): its memory
    stays pageable, counted as not locked, and holds what is written into it."""
    fake_host()
    page = mmap.PAGESIZE // 4
    monkeypatch.setattr(pinned, "SLAB_BYTES", page * 4)
    pinner = RecordingPinner()
    monkeypatch.setattr(pinned, "make_pinner", lambda acc, pin: pinner)
    store = HostStore({0: [(MASTER, torch.float32, 2 * page)], 1: [(MASTER, torch.float32, page)]}, pin_memory=True)
    store.unpin([0])

    def refuse(address, nbytes):
        raise RuntimeError("cudaHostRegister of 8 KiB failed with CUDA error 2")
    monkeypatch.setattr(pinner, "register", refuse)
    store.repin([0])
    assert store.unpinned == set() and store.pinned_bytes == store.nbytes - 2 * page * 4
    store.view(0, MASTER).fill_(6)
    assert torch.all(store.view(0, MASTER) == 6)


def test_a_failed_lock_never_zeroes_state_that_lives_in_its_slab(fake_host, monkeypatch):
    """Two sub-groups share a slab, both resident (the slab released). The first streams again and
    locking fails (the memlock limit taken by a colocation store or a save's buffers): its state is
    written into the pageable slab. When the second streams again and locking works, the slab is
    locked as it is: the first's state, its only copy, is not zeroed with the pages."""
    fake_host()
    page = mmap.PAGESIZE // 4
    monkeypatch.setattr(pinned, "SLAB_BYTES", 4 * page * 4)  # both sub-groups in one slab
    pinner = RecordingPinner()
    monkeypatch.setattr(pinned, "make_pinner", lambda acc, pin: pinner)
    store = HostStore({0: [(MASTER, torch.float32, page)], 1: [(MASTER, torch.float32, page)]}, pin_memory=True)
    assert len(store.slabs.slabs) == 1
    store.unpin([0, 1])
    assert store.pinned_bytes == 0
    register = pinner.register

    def refuse(address, nbytes):
        raise RuntimeError("cudaHostRegister failed with CUDA error 2")
    monkeypatch.setattr(pinner, "register", refuse)
    store.repin([0])
    store.view(0, MASTER).fill_(6)  # the give-back writes its state (move_into)
    assert store.pinned_bytes == 0
    monkeypatch.setattr(pinner, "register", register)
    store.repin([1])
    store.view(1, MASTER).fill_(8)
    assert torch.all(store.view(0, MASTER) == 6), "locking the shared slab again zeroed live state"
    assert torch.all(store.view(1, MASTER) == 8)
    assert store.slabs.phase == [pinned.SlabPhase.LOCKED] and store.pinned_bytes == store.nbytes
    store.unpin([0, 1])  # both resident again: pageable or locked, its memory goes back
    assert store.slabs.phase == [pinned.SlabPhase.RELEASED]


def test_pinning_progress_is_a_bar_on_a_terminal_and_lines_in_a_log(monkeypatch):
    import sys

    from deepspeed_offload.runtime.memory import pinned
    monkeypatch.setattr(sys.stderr, "isatty", lambda: False)
    lines = pinned._progress(10 * 2**30, show=True)
    assert isinstance(lines, pinned._ProgressLines)
    logged = []
    monkeypatch.setattr(pinned.logger, "info", logged.append)
    monkeypatch.setattr(pinned, "PROGRESS_LINE_S", 0.0)
    lines.update(2**30)
    assert logged and "1.00 GiB of 10.00 GiB" in logged[0]
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    assert not isinstance(pinned._progress(10, show=True), pinned._ProgressLines)  # tqdm's bar
    assert pinned._progress(10, show=False) is None


def test_a_give_back_locks_its_slabs_again_on_several_threads_at_once(fake_host, monkeypatch):
    """The measured plan's give-back runs before a forward: the slabs of the sub-groups that stream
    again are touched and registered by the pin threads together, as at attach, not one after the
    other on the training thread (a give-back of gigabytes would stall the forward for seconds)."""
    import threading
    import time as time_
    fake_host()
    page = mmap.PAGESIZE // 4
    monkeypatch.setattr(pinned, "SLAB_BYTES", page * 4)  # a slab per sub-group
    monkeypatch.setenv("DS_OFFLOAD_PIN_THREADS", "4")

    class SlowPinner(RecordingPinner):
        def __init__(self):
            super().__init__()
            self.threads, self.running, self.most = set(), 0, 0
            self.guard = threading.Lock()

        def register(self, address, nbytes):
            with self.guard:
                self.running += 1
                self.most = max(self.most, self.running)
                self.threads.add(threading.current_thread().name)
            time_.sleep(0.05)  # long enough for the others to start
            with self.guard:
                self.running -= 1
            super().register(address, nbytes)

    pinner = SlowPinner()
    monkeypatch.setattr(pinned, "make_pinner", lambda acc, pin: pinner)
    store = HostStore({i: [(MASTER, torch.float32, page)] for i in range(8)}, pin_memory=True)
    store.unpin(range(8))
    pinner.threads.clear()
    pinner.most = 0
    store.repin(range(8))
    assert store.unpinned == set() and store.pinned_bytes == store.nbytes
    assert pinner.most > 1 and all(name.startswith("deepspeed-offload-pin") for name in pinner.threads), \
        (pinner.most, pinner.threads)
