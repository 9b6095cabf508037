"""Staging a save: DeepSpeed's own save runs, but nothing it produces is written yet.

While DeepSpeed builds its state dicts, its checkpoint engine is swapped for ``Capture``, which only
records them, so the files keep DeepSpeed's names and format (``load_checkpoint`` and
``zero_to_fp32.py`` work unchanged). Each state dict is snapshotted: device tensors are copied to
the host now, small CPU tensors and Python objects are copied, and tensors in the host store (fp32
masters, optimizer moments: the bulk) are aliased, with no second host copy. Because of the aliases
the host store must not be overwritten until the writer has serialized them: ``StagedFiles`` is the
handle the writer releases and the guard waits on (torch.distributed.checkpoint's
``AsyncStager.stage`` / ``synchronize_staging`` split).
"""

import copy
import os
import threading
from typing import Callable, List, Optional, Tuple

import torch

from ..patches import PatchRegistry
from .errors import CheckpointWriteError


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
    """This rank's files of one save, snapshotted: ``(staging path, state)`` pairs. The writer
    serializes them, then calls ``release()``, which drops them; ``wait_released()`` blocks until
    then (the host store may be overwritten from that moment)."""

    def __init__(self, files: List[Tuple[str, object]]):
        self.paths = tuple(path for path, _ in files)
        self._files = files
        self._released = threading.Event()

    @property
    def files(self) -> List[Tuple[str, object]]:
        if self._files is None:
            raise RuntimeError("the staged files were released")
        return self._files

    def release(self):
        self._files = None
        self._released.set()

    def released(self) -> bool:
        return self._released.is_set()

    def wait_released(self, timeout: Optional[float] = None) -> bool:
        return self._released.wait(timeout)


class HostStoreStager:
    """Stages saves of one engine whose host store is ``host_buffers`` (its tensors are aliased)."""

    def __init__(self, host_buffers):
        self._host_storages = {b.untyped_storage().data_ptr() for b in host_buffers}

    def snapshot(self, obj):
        """``obj`` as it is now: host-store tensors aliased, every other tensor and object copied."""
        if torch.is_tensor(obj):
            if obj.device.type == "cpu" and obj.untyped_storage().data_ptr() in self._host_storages:
                # By reference, through a new alias: the step rebinds the original's .data to a
                # staging slot, the alias keeps pointing at the host slice that the guard protects.
                alias = obj.detach()
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

    def stage(self, engine, deepspeed_save: Callable, save_dir, tag, staging, client_state,
              exclude_frozen_parameters) -> Tuple[StagedFiles, List[Tuple[Callable, str]], bool]:
        """DeepSpeed's own save (``deepspeed_save``) with ``engine``'s checkpoint engine swapped for
        ``Capture`` and its copy of zero_to_fp32.py deferred to the writer. Returns the staged files
        (their paths moved into ``staging``), the deferred script copies as (copy, save_dir), and
        the checkpoint engine's serialization format (zipfile or not)."""
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
        return StagedFiles(files), scripts, getattr(capture._inner, "zipfile_serialization", True)
