"""Checkpoint guards for the frameworks that drive DeepSpeed: nothing is deleted or uploaded under a
running asynchronous checkpoint write, and no complete checkpoint is deleted before the next one is.

With ``async_checkpoint`` on, ``engine.save_checkpoint`` returns while the files are still being
written. The frameworks act on checkpoint folders right after saving:

- HF Trainer (``Trainer._save_checkpoint``, transformers 5.x): ``save_checkpoint`` into
  ``checkpoint-N``, RNG and trainer state, then on the saving rank ``_push_from_checkpoint`` (uploads
  the folder) and ``rotate_checkpoints`` (deletes the oldest folders down to ``save_total_limit``);
- Accelerate ``Accelerator.save_state``: with ``total_limit`` it deletes the oldest folders on the
  main process *before* it saves the new state;
- Lightning ``ModelCheckpoint``: ``strategy.remove_checkpoint(previous)`` after saving the new one.

Each of those steps is wrapped to wait first. The HF and Lightning steps run on the saving rank only,
so they wait without collectives: the rank joins its own writer, and on global rank 0 that includes
committing ``latest``, which waits for every rank's files. If a write failed there, the deletion or
upload is skipped (the previous checkpoint stays) and the failure is raised on every rank at the next
``engine.step()``. ``Accelerator.save_state`` runs on every rank, so it waits with
``wait_for_checkpoint`` (collective: a failure raises on every rank before anything is deleted).

``install()`` puts these guards on the frameworks already imported and, at each patched
``deepspeed.initialize``, on those imported since; ``uninstall()`` removes them.
"""

import functools
import sys

from deepspeed.utils import logger

from .api import attached_engines, get_handle
from .runtime.checkpoint import wait_for_checkpoint


def finish_writes_here():
    """Wait, on this rank only (no collective), for the asynchronous checkpoint writes of every
    engine of the process; on global rank 0 that includes the commit of ``latest``, which waits for
    the files of every rank. Returns the write failures this rank knows of (empty: all written)."""
    errors = []
    for engine in attached_engines():
        ckpt = getattr(get_handle(engine), "checkpointer", None)
        if ckpt is None:
            continue
        error = ckpt.wait_here()
        if error is not None:
            errors.append(error)
    return errors


def _after_writes(what, skip_on_failure=True):
    """Wrap a rank-local step that deletes or uploads checkpoint folders: wait for the writes first;
    skip the step if a write failed (the error is raised on every rank at the next engine.step())."""

    def make(original):

        @functools.wraps(original)
        def guarded(*args, **kwargs):
            errors = finish_writes_here()
            if errors and skip_on_failure:
                logger.error(f"[deepspeed-offload] {what} skipped, an asynchronous checkpoint write failed: "
                             f"{errors[0]}. The previous checkpoints are kept.")
                return None
            return original(*args, **kwargs)

        return guarded

    return make


def _before_save_state(original):

    @functools.wraps(original)
    def save_state(self, *args, **kwargs):
        for engine in getattr(self, "_models", []):
            if get_handle(engine) is not None:
                wait_for_checkpoint(engine)  # collective, like save_state itself
        return original(self, *args, **kwargs)

    return save_state


def _guard_transformers(registry, trainer_module):
    trainer_cls = getattr(trainer_module, "Trainer", None)
    if trainer_cls is None:
        return
    if hasattr(trainer_cls, "_rotate_checkpoints"):  # transformers 4.x: a method
        _patch_once(registry, trainer_cls, "_rotate_checkpoints", _after_writes("checkpoint rotation"))
    elif hasattr(trainer_module, "rotate_checkpoints"):  # 5.x: trainer_utils' function, looked up in trainer.py
        _patch_once(registry, trainer_module, "rotate_checkpoints", _after_writes("checkpoint rotation"))
    else:
        logger.warning("[deepspeed-offload] this transformers Trainer rotates checkpoints in a way this version "
                       "does not know: set save_total_limit=None with async_checkpoint")
    if hasattr(trainer_cls, "_push_from_checkpoint"):
        _patch_once(registry, trainer_cls, "_push_from_checkpoint", _after_writes("push_to_hub of the checkpoint"))


def _guard_accelerate(registry, accelerator_module):
    cls = getattr(accelerator_module, "Accelerator", None)
    if cls is not None and hasattr(cls, "save_state"):
        _patch_once(registry, cls, "save_state", _before_save_state)


def _guard_lightning(registry, strategy_module):
    cls = getattr(strategy_module, "DeepSpeedStrategy", None)
    if cls is not None and hasattr(cls, "remove_checkpoint"):
        _patch_once(registry, cls, "remove_checkpoint", _after_writes("removing an older checkpoint"))


GUARDS = {
    "transformers.trainer": _guard_transformers,
    "accelerate.accelerator": _guard_accelerate,
    "lightning.pytorch.strategies.deepspeed": _guard_lightning,
    "pytorch_lightning.strategies.deepspeed": _guard_lightning,
}


def _patch_once(registry, obj, name, make):
    if (obj, name) not in registry:
        registry.patch(obj, name, make)


def guard_frameworks(registry):
    """Put the guards on every framework module of ``GUARDS`` that is imported now (never imports one)."""
    for module_name, guard in GUARDS.items():
        module = sys.modules.get(module_name)
        if module is not None:
            guard(registry, module)
