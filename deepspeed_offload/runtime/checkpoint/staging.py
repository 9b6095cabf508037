"""Staging a save: DeepSpeed's own save runs, but nothing it produces is written yet.

While DeepSpeed builds its state dicts, its checkpoint engine is swapped for ``Capture``, which only
records them, so the files keep DeepSpeed's names and format (``load_checkpoint`` and
``zero_to_fp32.py`` work unchanged). Each state dict is snapshotted: device tensors (the state the
measured plan keeps resident) are copied to the host in the background (``DeviceSnapshot``), into
``AsideBuffer`` where it has room; small CPU tensors and Python objects are copied; tensors in the host store (fp32 masters, optimizer
moments: the bulk) are taken one of two ways:

- **copied aside** (where the node has the host memory spare for it): threads copy each into a tensor
  of its own, in the store's order (the step's), while training goes on; the writer serializes the
  copies at the disk's speed. The copies go into ``AsideBuffer``, host memory attach reserved and
  touched once (where the node's plan had room for it, ``placement.py``), so that a save neither
  faults pages in nor has the kernel zero them beside the step; without it, into fresh memory;
- **aliased** (otherwise): each is written from the store itself, through a storage of exactly its own
  bytes (so the file holds those bytes and not the whole store, second regions included).

Either way ``Regions`` knows, per host-store tensor, when its bytes may be overwritten (copied aside,
or written to its file) and the step waits only for the sub-groups it is about to overwrite
(``AsyncCheckpointer.guard``). The resident state's device tensors are copied to the host behind
the loop's back (``DeviceSnapshot``), with ``Regions`` of their own that the step waits on before it
updates a resident sub-group (``AsyncCheckpointer.guard_resident``). ``StagedFiles`` is the handle
the writer frees once everything is serialized (torch.distributed.checkpoint's
``AsyncStager.stage`` / ``synchronize_staging`` split).
"""

import copy
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
from deepspeed.utils import logger

from ...sizing.host_memory import HostMemory, format_bytes
from ..patches import PatchRegistry
from .device_snapshot import DeviceSnapshot
from .errors import CheckpointWriteError
from .regions import Regions

# Threads that copy the host store's tensors aside, in the store's order (and touch AsideBuffer).
COPY_THREADS = 8
# Each tensor copied into the AsideBuffer starts at a multiple of this many bytes.
ALIGN = 64
TOUCH = 256 << 20  # bytes each thread touches at a time when the buffer is reserved


def aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


class AsideBuffer:
    """Host memory for the snapshots of every save, of the host store's size, reserved once and
    touched (every page faulted in) by the copy threads when it is made. Each save (``reset``) takes
    its tensors from it in turn: the host store's copies aside first, then the device tensors (the
    state the measured plan keeps resident, whose store regions the save does not read) in what is
    left; one storage of exactly its bytes each (so the files hold those bytes only). One save at a
    time uses it: a save starts once the previous one is written."""

    def __init__(self, nbytes: int, pool: ThreadPoolExecutor):
        self.nbytes = int(nbytes)
        self.tensor = torch.empty(self.nbytes, dtype=torch.uint8)
        chunks = [self.tensor.narrow(0, lo, min(TOUCH, self.nbytes - lo)) for lo in range(0, self.nbytes, TOUCH)]
        for future in [pool.submit(chunk.fill_, 0) for chunk in chunks]:
            future.result()
        self._at = 0  # bytes this save has taken

    def reset(self):
        self._at = 0

    def take(self, like: torch.Tensor) -> Optional[torch.Tensor]:
        """An empty tensor shaped like ``like`` (contiguous, not empty: two tensors must not share an
        address) from what this save has not taken; None if it does not fit."""
        n = like.numel() * like.element_size()
        if not n or self._at + n > self.nbytes:
            return None
        out = torch.empty(0, dtype=like.dtype).set_(self.tensor.untyped_storage()[self._at:self._at + n], 0, like.shape)
        self._at += aligned(n)
        return out

    def carve(self, tensors: Sequence[torch.Tensor]) -> Optional[List[torch.Tensor]]:
        """``take`` for each of ``tensors``, or None (nothing taken) if they do not all fit."""
        if self._at + sum(aligned(t.numel() * t.element_size()) for t in tensors) > self.nbytes:
            return None
        return [self.take(t) for t in tensors]

    @property
    def free(self) -> int:
        return self.nbytes - self._at


class Capture:
    """Stands in for DeepSpeed's checkpoint engine during a save: records what would be written and
    touches no disk (the writer creates the directories)."""

    def __init__(self, inner, snapshot):
        self._inner = inner
        self._snapshot = snapshot
        self.files = []

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def makedirs(self, path, exist_ok=False):
        pass

    def create(self, info):
        pass

    def save(self, state_dict, path):
        self.files.append((path, self._snapshot(state_dict)))

    def commit(self, info):
        return True

    def is_decoupled(self):
        return False


class StagedFiles:
    """This rank's files of one save, snapshotted: ``(staging path, state)`` pairs, the host-store
    ``regions`` they read and the copies aside still running, the ``device_regions`` the resident
    state's copies still read. The writer serializes the files once the copies are done, then calls
    ``free()``, which drops them; ``wait_freed()`` blocks until the whole host store and every
    device tensor the save read may be overwritten."""

    def __init__(self, files: List[Tuple[str, object]], regions: Optional[Regions] = None, copies=None,
                 device_regions: Optional[Regions] = None, device_copies=None):
        self.paths = tuple(path for path, _ in files)
        self._files = files
        self.regions = regions if regions is not None else Regions()
        self.device_regions = device_regions if device_regions is not None else Regions()
        self.copied_aside = bool(copies)
        # futures of the copies aside and of the device tensors' copies
        self._copies = list(copies or []) + ([device_copies] if device_copies is not None else [])
        self._released = threading.Event()

    @property
    def files(self) -> List[Tuple[str, object]]:
        if self._files is None:
            raise RuntimeError("the staged files were freed")
        return self._files

    def wait_copied(self):
        """Every copy aside done (raises what one raised, once none is still running): the snapshot
        holds the saved values."""
        wait(self._copies)
        for future in self._copies:
            future.result()

    def free(self):
        self._files = None
        self._copies = []
        self.regions.free()
        self.device_regions.free()
        self._released.set()

    def freed(self) -> bool:
        return self._released.is_set()

    def wait_freed(self, timeout: Optional[float] = None) -> bool:
        return self.device_regions.wait(None, timeout) and self.regions.wait(None, timeout)


class HostStoreStager:
    """Stages saves of one engine whose host store is ``host_buffers``."""

    def __init__(self, host_buffers, aside_bytes: int = 0, owners: Optional[Callable[[], Dict[int, int]]] = None):
        """``aside_bytes``: host memory to reserve now for the saves' snapshots (``AsideBuffer``; 0:
        none, each save that copies aside allocates its own). ``owners``: called at each save, the
        resident state's device tensors (``data_ptr``) and the sub-group each belongs to; those are
        copied in the background, in the step's order (without ``owners``: every device tensor)."""
        self._host_storages = {b.untyped_storage().data_ptr() for b in host_buffers}
        self._owners = owners
        self._device = DeviceSnapshot()
        self._pool = None  # the copy threads, made at the first save that copies aside (or here)
        self.aside = None
        if aside_bytes:
            try:
                self.aside = AsideBuffer(aside_bytes, self._threads())
            except RuntimeError as e:  # the host ran short since attach judged it: saves do without
                logger.warning(f"[deepspeed-offload] async checkpoint: {format_bytes(aside_bytes)} of host memory "
                               f"for the copies aside could not be reserved ({e}); each save copies where the host "
                               "then has room, else writes from the host store")
        self._last_copied = False
        self._reset()

    def _threads(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(COPY_THREADS, thread_name_prefix="deepspeed-offload-ckpt-copy")
        return self._pool

    def _reset(self):
        self._regions = Regions()
        self._views = {}  # (start, nbytes) -> the alias made for it (one per range: written once)
        self._from_device = []  # (alias, device tensor): given host memory once the store's copies have theirs

    def snapshot(self, obj):
        """``obj`` as it is now: host-store tensors copied aside or aliased (module docstring), every
        other tensor and object copied."""
        if torch.is_tensor(obj):
            on_device = obj.device.type != "cpu"
            if not on_device and obj.untyped_storage().data_ptr() in self._host_storages:
                alias = self._from_store(obj.detach())
            elif on_device and obj.is_contiguous() and obj.numel():
                # host memory at the end of the save, from what the store's copies leave of the buffer
                alias = torch.empty(0, dtype=obj.dtype)
                self._from_device.append((alias, obj.detach()))
            else:
                alias = obj.detach().to("cpu", copy=True)
            if obj.requires_grad:
                alias.requires_grad_(True)  # pickled like the original, as DeepSpeed's own save does
            return alias
        if isinstance(obj, dict):
            out = copy.copy(obj)  # keeps OrderedDict/defaultdict types
            for k, v in obj.items():
                out[k] = self.snapshot(v)
            return out
        if isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):
            return type(obj)(self.snapshot(v) for v in obj)
        return copy.deepcopy(obj)

    def _from_store(self, t: torch.Tensor) -> torch.Tensor:
        """A host-store tensor (contiguous), staged as an alias through a storage of exactly its bytes
        (the step rebinds the original's ``.data`` to the device; the alias keeps pointing at the host
        slice the guard protects). ``stage`` may give it a copy of its own afterwards."""
        start, nbytes = t.data_ptr(), t.numel() * t.element_size()
        alias = self._views.get((start, nbytes))
        if alias is None or alias.shape != t.shape:
            self._regions.add(start, nbytes)
            offset = t.storage_offset() * t.element_size()
            alias = torch.empty(0, dtype=t.dtype).set_(t.untyped_storage()[offset:offset + nbytes], 0, t.shape)
            self._views[(start, nbytes)] = alias
        return alias

    def _copy_aside(self):
        """Give every alias a tensor of its own, filled by the copy threads in the store's order; the
        futures of the copies."""
        pool, regions, futures = self._threads(), self._regions, []
        views = sorted(self._views.items())
        sources = [alias.detach() for _, alias in views]  # the store's bytes
        targets = self.aside.carve(sources) if self.aside is not None else None
        for ((start, nbytes), alias), src, dst in zip(views, sources, targets or [None] * len(views)):
            alias.data = torch.empty_like(src) if dst is None else dst
            futures.append(pool.submit(_copy, regions, start, nbytes, src, alias.data))
        return futures

    def _copy_from_device(self, owners: Optional[Dict[int, int]]) -> Tuple[Optional[Regions], Optional[Future]]:
        """The device tensors of this save: each gets its host tensor from what the store's copies
        left of the buffer where it fits (memory already faulted in), else memory of its own. The
        resident sub-groups' state (``owners``) is copied in the background in the step's order (the
        step updates it once the save returns, after waiting for it: the regions returned); the
        rest (parameters ZeRO-3 keeps whole, buffers: small, and changed outside the step) now."""
        later = []
        for alias, src in self._from_device:
            dst = self.aside.take(src) if self.aside is not None else None
            alias.data = dst if dst is not None else torch.empty(src.shape, dtype=src.dtype)
            if owners is None or src.data_ptr() in owners:
                later.append((owners[src.data_ptr()] if owners else 0, alias.data, src))
            else:
                alias.data.copy_(src)
        if not later:
            return None, None
        later.sort(key=lambda x: x[0])  # stable: in the state dict's order within a sub-group
        return self._device.start([(dst, src) for _, dst, src in later])

    @property
    def aside_bytes(self) -> int:
        """Host memory reserved for the copies aside (0: none)."""
        return 0 if self.aside is None else self.aside.nbytes

    def stage(self, engine, deepspeed_save: Callable, save_dir, tag, staging, client_state,
              exclude_frozen_parameters, copy_aside: Optional[bool] = None
              ) -> Tuple[StagedFiles, List[Tuple[Callable, str]], bool]:
        """DeepSpeed's own save (``deepspeed_save``) with ``engine``'s checkpoint engine swapped for
        ``Capture`` and its copy of zero_to_fp32.py deferred to the writer. Returns the staged files
        (their paths moved into ``staging``), the deferred script copies as (copy, save_dir), and
        the checkpoint engine's serialization format (zipfile or not). The copies aside, where the
        node has the memory for them (``copy_aside`` None) or where asked, run in the background from here."""
        self._reset()
        if self.aside is not None:
            self.aside.reset()  # the previous save is written: its tensors are gone
        capture = Capture(engine.checkpoint_engine, self.snapshot)
        scripts = []
        swap = PatchRegistry("deepspeed-offload checkpoint capture")  # for the length of this save only
        swap.patch(engine, "checkpoint_engine", lambda inner: capture)
        if getattr(engine, "_copy_recovery_script", None) is not None:
            swap.patch(engine, "_copy_recovery_script",
                       lambda copy_fn: lambda save_path: scripts.append((copy_fn, save_path)))
        try:
            deepspeed_save(save_dir, tag=tag, client_state=client_state, save_latest=False,
                           exclude_frozen_parameters=exclude_frozen_parameters)
        finally:
            swap.remove_all()
        tag_dir = os.path.join(save_dir, tag)
        files = []
        for path, obj in capture.files:
            rel = os.path.relpath(path, tag_dir)
            if rel.startswith(os.pardir):
                raise CheckpointWriteError(f"DeepSpeed saves {path} outside the tag directory {tag_dir}: an "
                                           "asynchronous checkpoint cannot write it atomically")
            files.append((os.path.join(staging, rel), obj))
        nbytes = sum(n for _, n in self._views)
        reserved = self.aside is not None and sum(aligned(n) for _, n in self._views) <= self.aside.free
        fits = (reserved or nbytes <= HostMemory.read().usable) if copy_aside is None else copy_aside
        self._last_copied = bool(nbytes) and fits
        owners = self._owners() if self._owners is not None and self._from_device else None
        copies = self._copy_aside() if self._last_copied else ()
        try:
            device = self._copy_from_device(owners)
        except BaseException:
            wait(copies)  # nothing of this save keeps running into the buffer the next save reuses
            raise
        staged = StagedFiles(files, self._regions, copies, *device)
        self._reset()
        return staged, scripts, getattr(capture._inner, "zipfile_serialization", True)

    @property
    def copies_aside(self) -> bool:
        """Whether the last save copied the host store's tensors aside (else: written from the store)."""
        return self._last_copied

    def close(self):
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        self._device.close()
        self.aside = None


def _copy(regions: Regions, start: int, nbytes: int, src: torch.Tensor, dst: torch.Tensor):
    dst.copy_(src)
    regions.done(start, nbytes)
