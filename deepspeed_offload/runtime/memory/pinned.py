"""Host memory for the store at its exact size, page-locked in slabs.

torch's pinned allocator (``torch.empty(..., pin_memory=True)``, DeepSpeed's ``pin_empty``) rounds
every request up to a power of two: 75.3 GiB asks the host for 128 GiB. The store therefore maps its
memory itself (an anonymous mapping of the exact size, transparent huge pages asked for) and, on a
CUDA accelerator, page-locks it with ``cudaHostRegister`` in slabs cut at sub-group region
boundaries, so that no copy of a sub-group spans two registrations. Worker threads touch each slab
first (so the kernel zeroes pages on several cores, and, bound to the GPU's NUMA node, places them
on that node's memory) and register it. A failure half way unregisters what was registered.
Registration ends when the mapping is freed: the finalizer runs before the memory is unmapped.
``Slabs`` keeps each slab's phase (``SlabPhase``): a slab whose sub-groups all live on the device
(the measured plan made them resident) is unlocked and its pages given back to the kernel, and locked
again before a sub-group in it streams; where locking again fails the slab stays pageable, and since
its regions hold state from then on it is never zeroed again.

Which way memory is locked is decided once, by ``make_pinner``: ``cudaHostRegister`` on CUDA,
DeepSpeed's ``pin_empty`` (power-of-two sizes) on other accelerators that pin, nothing on the CPU
accelerator or with ``pin_memory: false``.
"""

import ctypes
import enum
import mmap
import os
import sys
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import torch
from deepspeed.utils import logger

from ...env_settings import read_env
from ...sizing.host_memory import format_bytes, memlock_hint, node_cpus

# Slabs are cut at region boundaries once they reach this size (a region larger than it is a slab).
SLAB_BYTES = 1 << 30
# Threads that touch and register slabs; DS_OFFLOAD_PIN_THREADS overrides it.
DEFAULT_PIN_THREADS = 8
# Progress is shown for pinning that takes longer than this (seconds).
PROGRESS_AFTER_S = 2.0
PROGRESS_LINE_S = 10.0  # without a terminal: a line this often


def pin_threads() -> int:
    return read_env().pin_threads or max(1, min(DEFAULT_PIN_THREADS, os.cpu_count() or 1))


def cut_slabs(region_bounds: Sequence[Tuple[int, int]], slab_bytes: Optional[int] = None) -> List[Tuple[int, int]]:
    """``region_bounds``: (start, end) byte offsets of consecutive regions covering one buffer.
    Slabs as (start, end): whole regions, joined until a slab reaches ``slab_bytes`` (SLAB_BYTES)."""
    slab_bytes = slab_bytes or SLAB_BYTES
    slabs: List[Tuple[int, int]] = []
    start = None
    for lo, hi in region_bounds:
        if start is None:
            start = lo
        if hi - start >= slab_bytes:
            slabs.append((start, hi))
            start = None
    if start is not None:
        slabs.append((start, region_bounds[-1][1]))
    return slabs


class _Mapping(mmap.mmap):
    """An anonymous mapping; its finalizer (unregistration) runs before the memory is unmapped."""


def map_exact(nbytes: int) -> _Mapping:
    """Anonymous, private memory of ``nbytes`` (rounded up to the page only), huge pages asked for."""
    mapping = _Mapping(-1, max(1, nbytes), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            mapping.madvise(mmap.MADV_HUGEPAGE)
        except OSError:
            pass  # transparent huge pages off: 4 KiB pages, slower to lock, same result
    return mapping


def _address(mapping) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(mapping))


class NoPinner:
    """Pageable memory: the CPU accelerator (device memory is host memory) or ``pin_memory: false``."""

    kind = "pageable"

    def register(self, address: int, nbytes: int):
        pass

    def unregister(self, address: int):
        pass


class CudaHostRegister:
    """``cudaHostRegister`` of memory we allocated ourselves: exact sizes, no rounding."""

    kind = "cudaHostRegister"

    def __init__(self):
        self.cudart = torch.cuda.cudart()

    def register(self, address: int, nbytes: int):
        err = self.cudart.cudaHostRegister(address, nbytes, 0)
        if int(err) != 0:
            raise RuntimeError(f"cudaHostRegister of {format_bytes(nbytes)} failed with CUDA error {int(err)}")

    def unregister(self, address: int):
        err = self.cudart.cudaHostUnregister(address)
        if int(err) != 0:  # the pages stay locked: they must not be given back (Slabs.unpin)
            raise RuntimeError(f"cudaHostUnregister failed with CUDA error {int(err)}")


def make_pinner(acc, pin_memory: bool):
    """The one place that decides how the store's memory is locked. None: the accelerator pins in
    its own way (``pin_empty``, rounded), which ``allocate`` falls back to."""
    if not pin_memory or acc.device_name() == "cpu":
        return NoPinner()
    if acc.device_name() == "cuda":
        return CudaHostRegister()
    return None


class PinnedStats:
    """What allocating the store took: bytes, seconds, how it was locked, threads, NUMA node."""

    def __init__(self, kind: str, nbytes: int, seconds: float, threads: int, node: Optional[int]):
        self.kind, self.nbytes, self.seconds, self.threads, self.node = kind, nbytes, seconds, threads, node

    @property
    def gib_per_s(self) -> float:
        return self.nbytes / 2**30 / self.seconds if self.seconds > 0 else float("inf")

    def describe(self) -> str:
        if self.kind == "pageable":
            return f"{format_bytes(self.nbytes)} pageable"
        node = "" if self.node is None else f", NUMA node {self.node}"
        return (f"{format_bytes(self.nbytes)} pinned ({self.kind}) in {self.seconds:.1f} s, "
                f"{self.gib_per_s:.1f} GiB/s, {self.threads} thread(s){node}")


def _progress(total: int, show: bool):
    """A progress bar where a person watches (stderr is a terminal), else a log line every
    ``PROGRESS_LINE_S`` seconds (a log file gets lines, not a hundred redraws of one)."""
    if not show:
        return None
    if not sys.stderr.isatty():
        return _ProgressLines(total)
    try:
        from tqdm import tqdm
    except ImportError:
        return _ProgressLines(total)
    return tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, delay=PROGRESS_AFTER_S,
                desc="[deepspeed-offload] pinning the host store", file=sys.stderr, leave=False)


class _ProgressLines:
    """``tqdm``'s ``update``/``close`` as a log line every ``PROGRESS_LINE_S`` seconds."""

    def __init__(self, total: int):
        self.total, self.done = total, 0
        self.started = self.last = time.monotonic()
        self._lock = threading.Lock()  # the pinning threads update it

    def update(self, n: int):
        with self._lock:
            self.done += n
            now = time.monotonic()
            if now - self.last < PROGRESS_LINE_S:
                return
            self.last = now
        logger.info(f"[deepspeed-offload] pinning the host store: {format_bytes(self.done)} of "
                    f"{format_bytes(self.total)} in {now - self.started:.0f} s")

    def close(self):
        pass


class SlabPhase(enum.Enum):
    """Where one slab's memory is. Only ``RELEASED`` memory is unused: a slab is zeroed when it is
    locked again from there, never from ``PAGEABLE``, whose pages hold live state."""
    LOCKED = "locked"  # page-locked (registered), its regions live
    RELEASED = "released"  # unlocked and its pages given back: every sub-group in it lives on the device
    PAGEABLE = "pageable"  # unlocked but live: locking it again failed, its regions hold state (slower copies)


class Slabs:
    """The slabs of a store's mappings, each in a ``SlabPhase``. ``unpin``: unlocked, and its pages
    given back to the kernel (``MADV_DONTNEED``: the memory reads as zeros afterwards, and is held
    again when written); ``lock``: locked again (``PAGEABLE`` where that fails: the memory still
    holds what is written into it, the copies are slower). A store whose accelerator pins its own way
    (``pin_empty``) has no slabs: nothing is unpinned. ``move`` is the one place a phase changes."""

    def __init__(self, pinner=None, mappings=None, work=(), cpus=()):
        self.pinner, self.mappings = pinner, mappings or {}
        self.cpus = list(cpus)  # the GPU's NUMA node's CPUs, where the threads that lock again run
        self.slabs: List[Tuple[torch.dtype, int, int]] = list(work)  # (dtype, start, end) in bytes
        self.phase = [SlabPhase.LOCKED] * len(self.slabs)
        # what the finalizer unregisters: the slabs locked when the mapping goes (shared, kept current)
        self.locked = [True] * len(self.slabs)
        for dt, mapping in self.mappings.items():  # unregisters what is still locked when it goes
            weakref.finalize(mapping, _unregister_locked, pinner, self._addresses(dt), self.locked)

    def move(self, k: int, phase: SlabPhase):
        self.phase[k] = phase
        self.locked[k] = phase is SlabPhase.LOCKED

    def _addresses(self, dtype) -> List[Tuple[int, int]]:
        base = _address(self.mappings[dtype])
        return [(k, base + lo) for k, (dt, lo, _) in enumerate(self.slabs) if dt == dtype]

    def _address(self, k: int) -> int:
        dt, lo, _ = self.slabs[k]
        return _address(self.mappings[dt]) + lo

    def unpin(self, k: int):
        """Every sub-group with a region in slab ``k`` lives on the device: its memory goes back."""
        if self.phase[k] is SlabPhase.RELEASED:
            return
        dt, lo, hi = self.slabs[k]
        if self.phase[k] is SlabPhase.LOCKED:
            try:
                self.pinner.unregister(self._address(k))
            except RuntimeError as e:  # it stays locked and held; training goes on
                logger.warning(f"[deepspeed-offload] {format_bytes(hi - lo)} of the host store stay locked: {e}")
                return
        self.move(k, SlabPhase.RELEASED)
        page = mmap.PAGESIZE
        first, last = -(-lo // page) * page, hi // page * page  # the whole pages inside the slab
        if last > first and hasattr(mmap, "MADV_DONTNEED"):
            self.mappings[dt].madvise(mmap.MADV_DONTNEED, first, last - first)

    def lock(self, slabs: Iterable[int]):
        """Lock these slabs again, as attach locked them: their pages touched and registered by up to
        ``pin_threads()`` threads on the GPU's NUMA node at once (one thread faulting a give-back's
        gigabytes back in would stall the forward it runs before for seconds). A released slab is
        zeroed first (its pages back); a pageable one keeps its bytes (live state). Where registering
        fails the slab is pageable from then on: nothing raises, nothing is lost."""
        todo = [k for k in dict.fromkeys(slabs) if self.phase[k] is not SlabPhase.LOCKED]
        if not todo:
            return
        bound = threading.local()
        faults = []

        def relock(k):
            if self.cpus and not getattr(bound, "done", False) and hasattr(os, "sched_setaffinity"):
                os.sched_setaffinity(0, self.cpus)
                bound.done = True
            _, lo, hi = self.slabs[k]
            address = self._address(k)
            if self.phase[k] is SlabPhase.RELEASED:
                ctypes.memset(address, 0, hi - lo)  # the pages back, zeroed in parallel (they read as zeros anyway)
            try:
                self.pinner.register(address, hi - lo)
            except RuntimeError as e:  # pageable memory still works, its copies are slower; training goes on
                faults.append(e)
                self.move(k, SlabPhase.PAGEABLE)  # live from now on: never zeroed again
                return
            self.move(k, SlabPhase.LOCKED)

        with ThreadPoolExecutor(max_workers=min(pin_threads(), len(todo)),
                                thread_name_prefix="deepspeed-offload-pin") as pool:
            for future in [pool.submit(relock, k) for k in todo]:
                future.result()
        if faults:
            logger.warning(f"[deepspeed-offload] {format_bytes(self.bytes_in(SlabPhase.PAGEABLE))} of the host store "
                           f"stay pageable (slower copies) after locking failed: {faults[0]}")

    def bytes_in(self, phase: SlabPhase) -> int:
        return sum(hi - lo for (_, lo, hi), p in zip(self.slabs, self.phase) if p is phase)

    @property
    def unpinned_bytes(self) -> int:
        """Bytes given back to the host (released slabs)."""
        return self.bytes_in(SlabPhase.RELEASED)

    @property
    def unlocked_bytes(self) -> int:
        """Bytes not page-locked: released, or pageable where locking again failed."""
        return self.unpinned_bytes + self.bytes_in(SlabPhase.PAGEABLE)


def allocate(sizes: Dict[torch.dtype, int], bounds: Dict[torch.dtype, List[Tuple[int, int]]], pinner,
             numa_node: Optional[int] = None, show_progress: bool = False,
             fallback=None) -> Tuple[Dict[torch.dtype, torch.Tensor], PinnedStats, Slabs]:
    """One buffer per dtype of ``sizes[dtype]`` elements, its regions' byte ``bounds`` given, locked
    by ``pinner`` (``make_pinner``; None: ``fallback(numel, dtype)`` allocates a pinned tensor), and
    its ``Slabs``. Raises RuntimeError (nothing left locked) if locking fails."""
    t0 = time.perf_counter()
    nbytes = {dt: n * torch.empty(0, dtype=dt).element_size() for dt, n in sizes.items()}
    total = sum(nbytes.values())
    if pinner is None:
        buffers = {dt: fallback(n, dt) for dt, n in sizes.items()}
        return buffers, PinnedStats("pin_empty", total, time.perf_counter() - t0, 1, None), Slabs()
    mappings = {dt: map_exact(nbytes[dt]) for dt in sizes}
    work = [(dt, lo, hi) for dt in sizes for lo, hi in cut_slabs(bounds[dt]) if hi > lo]
    registered: List[int] = []
    lock = threading.Lock()
    cpus = node_cpus(numa_node) if numa_node is not None else []
    bound = threading.local()
    bar = _progress(total, show_progress)

    def place(task):
        dt, lo, hi = task
        if cpus and not getattr(bound, "done", False) and hasattr(os, "sched_setaffinity"):
            os.sched_setaffinity(0, cpus)  # this thread only: its first touch lands on the GPU's node
            bound.done = True
        address = _address(mappings[dt]) + lo
        ctypes.memset(address, 0, hi - lo)  # releases the GIL: the kernel zeroes pages on this core
        pinner.register(address, hi - lo)
        with lock:
            registered.append(address)
        if bar is not None:
            bar.update(hi - lo)

    threads = min(pin_threads(), max(1, len(work)))
    try:
        with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="deepspeed-offload-pin") as pool:
            for future in [pool.submit(place, task) for task in work]:
                future.result()
    except BaseException as e:
        _unregister_locked(pinner, list(enumerate(registered)), [True] * len(registered))
        raise RuntimeError(f"locking {format_bytes(total)} of host memory failed ({e}){memlock_hint(total)}") from e
    finally:
        if bar is not None:
            bar.close()
    buffers = {dt: torch.frombuffer(mapping, dtype=dt, count=sizes[dt]) if sizes[dt] else torch.empty(0, dtype=dt)
               for dt, mapping in mappings.items()}
    slabs = Slabs(pinner, mappings, work, cpus)
    return buffers, PinnedStats(pinner.kind, total, time.perf_counter() - t0, threads, numa_node), slabs


def _unregister_locked(pinner, addresses, locked):
    """The finalizer: the slabs of one mapping still locked (unregistering one that is not would
    leave CUDA's last error set for the next kernel launch to report)."""
    for k, address in addresses:
        if not locked[k]:
            continue
        try:
            pinner.unregister(address)
        except Exception:  # noqa: B902 - at interpreter exit CUDA may be gone; the process frees it all
            pass
