"""Asynchronous checkpoints straight from the host store: never lost silently, never visible
half-written, verified before they load. The protocol: docs/architecture.md (Checkpoints).

The modules, in the order a save goes through them:

- ``checkpointer.py``: ``AsyncCheckpointer``, the engine's save/load/step hooks, the exit hook;
- ``staging.py``: DeepSpeed's save captured and snapshotted (host-store tensors copied aside or aliased);
- ``writer.py``: the background writer (a Future per save) and its heartbeat;
- ``commit.py``: rank 0 waits for every rank, then the journaled swap; recovery and clean-up;
- ``verify.py``: what is wrong with a checkpoint, checked at load;
- ``agreement.py``: the all-reduces by which every rank raises the same error at the same call;
- ``files.py``, ``names.py``, ``errors.py``, ``options.py``: file primitives, on-disk names, the
  errors, the user's timeouts and the tests' fault hooks.
"""

from .checkpointer import AsyncCheckpointer, checkpoint_pending, wait_for_checkpoint
from .errors import CheckpointLoadError, CheckpointWriteError
from .options import Faults, Settings
from .staging import ALIGN
from .verify import verify_checkpoint

__all__ = [
    "ALIGN", "AsyncCheckpointer", "CheckpointLoadError", "CheckpointWriteError", "Faults", "Settings", "checkpoint_pending",
    "verify_checkpoint", "wait_for_checkpoint"
]
