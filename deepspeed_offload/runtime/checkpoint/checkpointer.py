"""The asynchronous checkpointer: wires the save, the load and the step of one engine.

``save_checkpoint`` prepares the directory, agrees on a save id, stages the files (staging.py) and
hands them to the writer (writer.py), and returns. ``load_checkpoint`` finishes an interrupted swap
(commit.py) and verifies the tag (verify.py) before DeepSpeed's loader runs. ``step`` raises, on
every rank, a failure of the last save (agreement.py). The streamed step calls ``guard()`` before
it first overwrites the host store. The first checkpointer registers the exit hook: at interpreter
exit, a rank whose write failed logs it and exits with status 1.
"""

import atexit
import logging
import os
import shutil
import sys
import time
import weakref
from concurrent.futures import Future
from typing import Callable, Dict, Optional, Tuple

from deepspeed.utils import log_dist, logger

from ...handle import get_handle
from ...sizing.host_memory import format_bytes
from ..patches import PatchRegistry
from .. import agreement
from .commit import recover, remove_leftovers
from .errors import CheckpointLoadError, CheckpointWriteError, describe_os_error
from .names import ALIVE, staging_dir
from .options import NO_FAULTS, Faults, Settings
from .staging import HostStoreStager, StagedFiles
from .verify import verify_checkpoint
from .writer import Heartbeat, SaveJob, write_async

_live = weakref.WeakSet()  # every checkpointer not closed, for the exit hook
_exit_hook_registered = False


class AsyncCheckpointer:
    """Wraps ``engine.save_checkpoint``, ``load_checkpoint`` and ``step`` (through one PatchRegistry).
    ``host_buffers`` are the host store's buffers, whose tensors are written by reference;
    ``aside_bytes`` the host memory to reserve for the saves' copies aside (attach's node plan);
    ``owners`` says which device tensors are the resident sub-groups' state (``HostStoreStager``).
    ``settings`` default to the environment's (options.py); ``faults`` are for tests only."""

    def __init__(self, engine, host_buffers, patches: Optional[PatchRegistry] = None,
                 settings: Optional[Settings] = None, faults: Faults = NO_FAULTS, aside_bytes: int = 0,
                 owners: Optional[Callable[[], Dict[int, int]]] = None):
        self.engine = engine
        self.settings = settings if settings is not None else Settings.from_env()
        self.faults = faults
        t0 = time.perf_counter()
        self.stager = HostStoreStager(host_buffers, aside_bytes, owners)
        if self.stager.aside_bytes:
            log_dist(f"[deepspeed-offload] async checkpoint: {format_bytes(aside_bytes)} of host memory reserved for "
                     f"the saves' copies aside, touched in {time.perf_counter() - t0:.1f} s", ranks=[0])
        self.staged: Optional[StagedFiles] = None  # the last save's snapshot, until the writer releases it
        self.future: Optional[Future] = None  # the last save's writer
        self._reported = False  # the last save's failure has been raised (the ranks agreed on it)
        self._unchecked = False  # a save whose outcome the ranks have not yet agreed on
        self._staging = None  # the staging directory of the save whose outcome is not yet agreed
        self._last = None
        self._patches = patches if patches is not None else PatchRegistry("deepspeed-offload async checkpoint")
        self._install()
        _live.add(self)
        _register_exit_hook()

    def _install(self):
        p, e = self._patches, self.engine
        self._orig_save = p.patch(e, "save_checkpoint", lambda orig: self.save_checkpoint)
        self._orig_load = p.patch(e, "load_checkpoint", lambda orig: self.load_checkpoint)
        self._orig_step = p.patch(e, "step", lambda orig: self.step)

    def _uninstall(self):
        self._patches.remove_all()

    @property
    def last(self) -> Optional[dict]:
        """``tag``, ``save_id``, ``blocking_s`` of the last save, ``behind_bytes`` (the resident state
        it copied to the host after returning), ``phases`` (this rank's write: the
        seconds it waited for the copies aside, serialized, hashed and flushed) and ``background_s``:
        how long it was written and committed in the background (rank 0; None until then, or if it
        failed)."""
        if self._last is None:
            return None
        f = self.future
        done = f is not None and f.done() and f.exception() is None
        return dict(self._last, phases=dict(self._last["phases"]), background_s=f.result() if done else None)

    # ------------------------------------------------------------------ engine entry points

    def save_checkpoint(self, save_dir, tag=None, client_state={}, save_latest=True, exclude_frozen_parameters=False):
        self.wait()  # one save at a time (every rank's writer joined); raises if the previous one failed
        t0 = time.perf_counter()  # (the optimizer's state_dict drains pending write-backs itself)
        if not save_dir:
            raise ValueError(f"save_dir must be a non-empty string, got {save_dir!r}")
        tag = str(tag) if tag is not None else f"global_step{self.engine.global_steps}"
        rank, world = agreement.rank_world()
        save_id, problem = self._start(save_dir, tag, rank)
        staging = staging_dir(save_dir, tag, save_id)
        heartbeat = None
        if problem is None:
            try:
                os.makedirs(staging, exist_ok=True)
                heartbeat = Heartbeat(os.path.join(staging, ALIVE.format(rank)), self.settings.heartbeat_interval_s)
            except OSError as e:
                problem = f"creating checkpoint directory {staging} failed: {describe_os_error(e, staging)}"
        try:
            failures = agreement.agree(problem)
            if failures and rank == 0:  # no rank writes into it: every rank stops here
                shutil.rmtree(staging, ignore_errors=True)
            agreement.raise_agreed(failures, problem, CheckpointWriteError, f"checkpoint {tag} not saved")
            staged, scripts, zipfile = self._stage_agreed(save_dir, tag, staging, client_state,
                                                          exclude_frozen_parameters, rank)
        except BaseException:
            if heartbeat is not None:
                heartbeat.stop(remove_file=True)
            raise
        job = SaveJob(save_dir=save_dir, tag=tag, save_id=save_id, rank=rank, world=world, save_latest=save_latest,
                      zipfile=zipfile, paths=staged.paths, scripts=tuple(scripts))
        blocking = time.perf_counter() - t0
        behind = staged.device_regions.nbytes
        self._last = {"tag": tag, "save_id": save_id, "blocking_s": blocking, "phases": {}, "behind_bytes": behind}
        self.staged = staged
        self._unchecked = True
        self._staging = staging
        self._reported = False
        self.future = write_async(job, staged, heartbeat, self.settings, self.faults, self._last["phases"])
        how = "copied aside, then written" if self.stager.copies_aside else \
            "written from the host store (not enough host memory spare to copy it aside)"
        resident = f"; the resident state ({format_bytes(behind)}) copied to the host behind it" if behind else ""
        log_dist(f"[deepspeed-offload] checkpoint {tag}: save_checkpoint blocked {blocking:.3f} s; "
                 f"{len(staged.paths)} file(s) writing in the background, the optimizer state {how}{resident}",
                 ranks=[0])
        return True

    def _stage_agreed(self, save_dir, tag, staging, client_state, exclude_frozen_parameters, rank):
        """Stage this rank's files, then agree: a save is handed to the writers on every rank or on
        none. Where staging raised on any rank (a snapshot out of host memory, DeepSpeed's own save),
        every rank drops what it staged, rank 0 removes the staging directory, and every rank raises
        the same ``CheckpointWriteError``; the previous checkpoint is untouched and no rank is left with
        a save whose outcome the others never check (its next step's agreement would pair with
        another collective)."""
        staged, problem, cause = None, None, None
        try:
            staged, scripts, zipfile = self.stager.stage(self.engine, self._orig_save, save_dir, tag, staging,
                                                         client_state, exclude_frozen_parameters,
                                                         self.faults.copy_aside)
            if self.faults.staged is not None:
                self.faults.staged(tag)
        except Exception as e:  # noqa: B902 - agreed below, so no rank is left waiting
            problem, cause = f"staging checkpoint {tag} failed: {agreement.describe(e)}", e
        failures = agreement.agree(problem)
        if not failures:
            return staged, scripts, zipfile
        if staged is not None:
            try:
                staged.wait_copied()  # nothing of it still runs into the buffers the next save reuses
            except Exception:  # noqa: B902 - a failed copy of a save being dropped
                pass
            staged.free()
        agreement.agree(None)  # every rank has dropped its snapshot: nothing writes into the directory
        if rank == 0:
            shutil.rmtree(staging, ignore_errors=True)
        try:
            agreement.raise_agreed(failures, problem, CheckpointWriteError, f"checkpoint {tag} not saved")
        except CheckpointWriteError as error:
            raise error from cause

    def _start(self, save_dir, tag, rank) -> Tuple[str, Optional[str]]:
        """Rank 0 finishes interrupted swaps and removes what earlier saves of ``tag`` left (every
        rank's writer of this engine is joined by now); every rank learns the save id (one
        all-reduce)."""
        problem = None
        if rank == 0:
            try:
                os.makedirs(save_dir, exist_ok=True)
                recover(save_dir)
                remove_leftovers(save_dir, tag)
            except OSError as e:
                problem = f"preparing checkpoint directory {save_dir} failed: {describe_os_error(e, save_dir)}"
        return agreement.new_save_id(rank), problem

    def load_checkpoint(self, load_dir, tag=None, *args, **kwargs):
        self.wait()
        rank, world = agreement.rank_world()
        problem = None
        if rank == 0:
            try:
                recover(load_dir)
            except OSError as e:
                problem = f"completing an interrupted save in {load_dir} failed: {describe_os_error(e, load_dir)}"
        # (the agreement also orders every rank's reads after rank 0's recovery)
        agreement.raise_agreed(agreement.agree(problem), problem, CheckpointLoadError,
                               f"checkpoint in {load_dir} not loaded")
        resolved, problem = tag, None
        try:
            if resolved is None:
                resolved = self._latest_tag(load_dir)
            if resolved is not None:
                problem = verify_checkpoint(os.path.join(load_dir, str(resolved)), rank, world)
        except Exception as e:  # noqa: B902 - agreed below, so no rank is left waiting
            what = f"verifying {os.path.join(load_dir, str(resolved))}" if resolved is not None else \
                f"reading the latest tag in {load_dir}"
            problem = f"{what} failed: {describe_os_error(e, load_dir)}"
        # Every rank, whatever it found: the all-reduces pair up.
        agreement.raise_agreed(agreement.agree(problem), problem, CheckpointLoadError, "checkpoint refused")
        # The tag verified is the tag loaded (None: no 'latest' file, DeepSpeed's loader says so).
        return self._orig_load(load_dir, resolved, *args, **kwargs)

    def _latest_tag(self, load_dir) -> Optional[str]:
        """The tag DeepSpeed's loader would read: ``latest_universal`` for a universal checkpoint,
        else ``latest``; None if there is no such file. A file that exists but cannot be read raises."""
        universal = getattr(self.engine, "load_universal_checkpoint", None)
        path = os.path.join(load_dir, "latest_universal" if callable(universal) and universal() else "latest")
        if not os.path.isfile(path):
            return None
        with open(path) as f:
            return f.read().strip()

    def step(self, *args, **kwargs):
        if self._unchecked:
            # Every rank passes here exactly once per save, so the all-reduce below always pairs up.
            self._unchecked = False
            self._agree_on_failure()
        return self._orig_step(*args, **kwargs)

    # ------------------------------------------------------------------ waiting

    def synchronize_staging(self, timeout: Optional[float] = None) -> bool:
        """Block until nothing of the host store or of the resident state is still to be read by the
        last save (copied, or written to its files), so all of it may be overwritten. False if
        ``timeout`` seconds passed first."""
        staged = self.staged
        return staged is None or staged.wait_freed(timeout)

    def guard(self, ranges=None):
        """Called by the streamed step right before it overwrites host state: the byte ``ranges``
        ((start, bytes) of the host store; None: all of it, and every device tensor the save read).
        Waits only while the last save still has to read some of them."""
        staged = self.staged
        if self.faults.guard and staged is not None:
            if ranges is None:
                staged.device_regions.wait(None)
            staged.regions.wait(ranges)

    def copying_resident(self) -> bool:
        """Whether the last save is still copying resident state to the host (cheap: the step asks
        before it works out a sub-group's ranges)."""
        staged = self.staged
        return self.faults.guard and staged is not None and staged.device_regions.pending()

    def guard_resident(self, ranges):
        """Called right before the step updates a resident sub-group in place: its device tensors'
        byte ``ranges`` (None: every one, before resident state leaves the device). Waits only while
        the last save is still copying some of them to the host."""
        staged = self.staged
        if self.faults.guard and staged is not None:
            staged.device_regions.wait(ranges)

    def pending(self) -> bool:
        """True while this rank's writer (or, on rank 0, the commit) is still running. No collective."""
        return self.future is not None and not self.future.done()

    def _failure(self) -> Optional[BaseException]:
        """The last save's failure on this rank, if it is known and not yet raised."""
        f = self.future
        if f is None or self._reported or not f.done():
            return None
        return f.exception()

    def _agree_on_failure(self):
        """Raise on every rank if any rank's write has failed so far (one all-reduce). A failure
        that lands while the ranks agree (the writer is not necessarily done) stays pending."""
        err = self._failure()
        own = str(err) if err is not None else None
        failures = agreement.agree(own)
        if err is not None:
            self._reported = True
        if failures:
            self._discard_failed_save()
        agreement.raise_agreed(failures, own, CheckpointWriteError, "asynchronous checkpoint failed")

    def _discard_failed_save(self):
        """Every rank, once the ranks agreed that the save failed: wait for this rank's writer, agree
        again (so every rank's writer has stopped), then rank 0 removes the failed save's staging
        directory. Nothing of it is left, even if no later save goes to the same folder."""
        self._join()
        # Whatever the writer still reported belongs to the failed save being raised right now.
        self._reported = True
        staging, self._staging = self._staging, None
        agreement.agree(None)
        if staging is not None and agreement.rank_world()[0] == 0:
            save_dir = os.path.dirname(staging)
            try:
                recover(save_dir)  # a commit that failed half way: finish or undo it first
            except OSError as e:
                logger.warning(f"[deepspeed-offload] {describe_os_error(e, save_dir)}")
            shutil.rmtree(staging, ignore_errors=True)

    def _join(self):
        if self.future is not None:
            self.future.exception()  # waits; the writer resolves its future last

    def wait_here(self) -> Optional[CheckpointWriteError]:
        """Block until this rank's write (and, on rank 0, the commit) is done; return this rank's
        failure, if any, without raising and without a collective. The failure stays pending: it is
        still raised on every rank at the next step, save, load or ``wait``."""
        self._join()
        return self._failure()

    def close(self):
        """Wait for the last save (collective) and take the hooks off the engine."""
        self.wait()
        self.stager.close()
        self._uninstall()
        _live.discard(self)

    def forget(self):
        """Take the hooks off without waiting (an attach undone before any save: nothing to wait for)."""
        self._uninstall()
        self.stager.close()  # the copy threads and the buffer reserved for the copies aside
        _live.discard(self)

    def wait(self):
        """Block until this rank's write and (on rank 0) the commit are done; raise on every rank if
        any rank's write or the commit failed. Collective: call it on every rank."""
        self._join()
        self._unchecked = False
        self._agree_on_failure()


def _checkpointer(engine) -> Optional[AsyncCheckpointer]:
    handle = get_handle(engine)
    return getattr(handle, "checkpointer", None)


def wait_for_checkpoint(engine):
    """Block until ``engine``'s asynchronous checkpoint is written and committed (``latest`` moved);
    raise (on every rank) if it failed. Call it on every rank, like ``save_checkpoint``: before the
    files are read, copied, uploaded or deleted, and before ``os._exit``."""
    ckpt = _checkpointer(engine)
    if ckpt is not None:
        ckpt.wait()


def checkpoint_pending(engine) -> bool:
    """True while an asynchronous checkpoint of ``engine`` is still being written or committed on
    this rank. Cheap, local (no collective), never blocks."""
    ckpt = _checkpointer(engine)
    return ckpt is not None and ckpt.pending()


def wait_for_writers_at_exit():
    """The exit hook. The writer is not a daemon thread: the interpreter has already waited for it.
    No collectives here (other ranks may be gone): log this rank's failure and exit non-zero, so it
    is not lost."""
    failed = False
    for ckpt in list(_live):
        error = ckpt.wait_here()
        if error is not None:
            logger.error(f"[deepspeed-offload] {error}")
            failed = True
    if failed:
        logging.shutdown()  # os._exit skips it: flush and close every handler first
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)


def _register_exit_hook():
    global _exit_hook_registered
    if not _exit_hook_registered:
        atexit.register(wait_for_writers_at_exit)
        _exit_hook_registered = True
