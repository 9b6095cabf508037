"""Checkpoint guards for the frameworks that drive DeepSpeed: nothing is deleted or uploaded under a
running asynchronous checkpoint write, and no complete checkpoint is deleted before the next one is.

With ``async_checkpoint`` on, ``engine.save_checkpoint`` returns while the files are still being
written. The frameworks act on checkpoint folders right after saving:

- HF Trainer (``Trainer._save_checkpoint``, transformers 5.x): ``save_checkpoint`` into
  ``checkpoint-N``, RNG and trainer state, then on the saving rank ``_push_from_checkpoint`` (uploads
  the folder) and ``rotate_checkpoints`` (deletes the oldest folders down to ``save_total_limit``);
  at the end of ``train()``, ``sort_checkpoints`` then ``rmtree`` of every checkpoint but the best
  (``save_total_limit=1``); ``Trainer.push_to_hub``: ``save_model`` (which may call
  ``save_checkpoint``), then an upload of ``output_dir`` through ``hf_api()``. (transformers 4.x:
  the methods ``_rotate_checkpoints`` and ``_sorted_checkpoints``, and ``upload_folder``);
- Accelerate ``Accelerator.save_state``: with ``total_limit`` it deletes the oldest folders on the
  main process *before* it saves the new state;
- Lightning ``ModelCheckpoint``: ``strategy.remove_checkpoint(previous)`` after saving the new one.

Each of those steps is wrapped to wait first. The HF and Lightning steps run on the saving rank only,
so they wait without collectives: the rank joins its own writer, and on global rank 0 that includes
committing ``latest``, which waits for every rank's files. If a write failed there, the deletion or
upload is skipped (the previous checkpoint stays) and the failure is raised on every rank at the next
``engine.step()``; an upload through ``hf_api()``/``upload_folder``, which cannot be skipped, raises
``CheckpointWriteError`` on that rank instead. ``Accelerator.save_state`` runs on every rank, so it
waits with ``wait_for_checkpoint`` (collective: a failure raises on every rank before anything is
deleted).

Callbacks and loggers that upload in ``on_save`` (W&B, MLflow, Comet, ClearML; Lightning loggers with
``log_model="all"``) are not guarded: making every save wait would make every save synchronous.
``finish_writes_here()`` is the rank-local wait to call from such a callback (docs/integrations.md).

``install()`` puts these guards on the frameworks already imported and, at each patched
``deepspeed.initialize``, on those imported since; ``uninstall()`` removes them.
"""

import functools
import sys

from deepspeed.utils import logger

from .api import attached_engines, get_handle
from .runtime.checkpoint import CheckpointWriteError, wait_for_checkpoint


def finish_writes_here():
    """Wait, on this rank only (no collective), for the asynchronous checkpoint writes of every
    engine of the process; on global rank 0 that includes the commit of ``latest``, which waits for
    the files of every rank. Returns the write failures this rank knows of (empty: all written);
    they stay pending and are still raised on every rank at the next step, save, load or wait.
    Safe to call from code that runs on some ranks only (a callback before an upload)."""
    errors = []
    for engine in attached_engines():
        ckpt = getattr(get_handle(engine), "checkpointer", None)
        if ckpt is None:
            continue
        error = ckpt.wait_here()
        if error is not None:
            errors.append(error)
    return errors


def _after_writes(what, skipped=None):
    """Wrap a rank-local step that deletes or uploads checkpoint folders: wait for the writes first;
    skip the step if a write failed, returning ``skipped`` (the error is raised on every rank at the
    next engine.step())."""

    def make(original):

        @functools.wraps(original)
        def guarded(*args, **kwargs):
            errors = finish_writes_here()
            if errors:
                logger.error(f"[deepspeed-offload] {what} skipped, an asynchronous checkpoint write failed: "
                             f"{errors[0]}. The previous checkpoints are kept.")
                return skipped() if callable(skipped) else skipped
            return original(*args, **kwargs)

        return guarded

    return make


def _before_upload(what):
    """Wrap a rank-local call that an upload goes through and that cannot be skipped (it returns the
    API object): wait for the writes first; if one failed, raise on this rank rather than upload."""

    def make(original):

        @functools.wraps(original)
        def guarded(*args, **kwargs):
            errors = finish_writes_here()
            if errors:
                raise CheckpointWriteError(f"{what} refused, an asynchronous checkpoint write failed: {errors[0]}")
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
    # Deleting: rotation after each save; at the end of train() (save_total_limit=1 with a best
    # checkpoint) every folder that sorting returns but the best is removed: skipped = sorted nothing.
    # transformers 4.46-4.x: Trainer methods; 5.x: trainer_utils' functions, looked up in trainer.py.
    if hasattr(trainer_cls, "_rotate_checkpoints"):
        _patch_once(registry, trainer_cls, "_rotate_checkpoints", _after_writes("checkpoint rotation"))
        if hasattr(trainer_cls, "_sorted_checkpoints"):
            _patch_once(registry, trainer_cls, "_sorted_checkpoints",
                        _after_writes("removing older checkpoints at the end of training", skipped=list))
    elif hasattr(trainer_module, "rotate_checkpoints"):
        _patch_once(registry, trainer_module, "rotate_checkpoints", _after_writes("checkpoint rotation"))
        if hasattr(trainer_module, "sort_checkpoints"):
            _patch_once(registry, trainer_module, "sort_checkpoints",
                        _after_writes("removing older checkpoints at the end of training", skipped=list))
    else:
        logger.warning("[deepspeed-offload] this transformers Trainer rotates checkpoints in a way this version "
                       "does not know: set save_total_limit=None with async_checkpoint")
    # Uploading: after each save (rank 0), and Trainer.push_to_hub: save_model, then an upload of
    # output_dir through hf_api() (5.x) or upload_folder (4.x), on world rank 0 only.
    if hasattr(trainer_cls, "_push_from_checkpoint"):
        _patch_once(registry, trainer_cls, "_push_from_checkpoint", _after_writes("push_to_hub of the checkpoint"))
    for upload in ("hf_api", "upload_folder"):
        if callable(getattr(trainer_module, upload, None)):
            _patch_once(registry, trainer_module, upload, _before_upload("uploading to the Hub"))


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
