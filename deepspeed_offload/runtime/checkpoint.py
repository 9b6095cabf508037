"""Asynchronous checkpoints straight from the host store, never visible half-written.

``engine.save_checkpoint`` keeps DeepSpeed's own files and format (so ``engine.load_checkpoint`` and
``zero_to_fp32.py`` work unchanged) but returns after a short snapshot: while DeepSpeed builds its
state dicts, the checkpoint engine is swapped for one that only *captures* them. Tensors on the
device are copied to host right there (a real snapshot); tensors that live in the host store (fp32
masters, optimizer moments: the bulk) are handed to the background writer by reference, with no
second host copy; small CPU tensors and Python objects are copied.

What keeps that safe and durable:
- the guard: the streamed step waits for this rank's in-flight serialization right before its first
  write-back to the host store, so the next forward and backward overlap the write (flushing to
  disk and committing go on after the guard has let the step through);
- a new save (or a load) waits for the previous one;
- each file is written to ``<name>.tmp``, flushed, fsync'ed and renamed; each rank then drops a
  ``.deepspeed_offload_rank<r>.done`` marker in the tag directory (removed at the start of every
  save, so a reused tag cannot count an old one), and rank 0 writes ``latest`` (again temp file +
  rename) only when every rank's marker is there. A killed or failed write leaves an incomplete
  new tag directory that ``latest`` does not name: it still names the previous checkpoint. (A save
  that reuses the tag ``latest`` names replaces that checkpoint file by file, as DeepSpeed's own
  save does; a warning says so.)
- a failed write is raised at the next ``engine.step()`` (the first after the save), the next save
  or load, or ``wait_for_checkpoint``, on every rank at once (the ranks agree through one small
  all-reduce, so none is left waiting in a collective), with the path and the cause. At interpreter
  exit the writer is joined and a failure is logged.
"""

import atexit
import copy
import os
import threading
import time
import weakref

import torch
from deepspeed.utils import logger
from deepspeed.utils.logging import print_dist

COMMIT_TIMEOUT_S = float(os.environ.get("DS_OFFLOAD_COMMIT_TIMEOUT", 600))
# Test-only switches (tests/e2e): pauses before serializing a file and before renaming it (for tags
# containing DS_OFFLOAD_TEST_DELAY_TAG), to make a write slow enough to race with or to kill; and
# turning the guard off, to prove that the tests see a race when there is one.
_TEST_WRITE_DELAY = float(os.environ.get("DS_OFFLOAD_TEST_WRITE_DELAY", 0))
_TEST_DELAY_TAG = os.environ.get("DS_OFFLOAD_TEST_DELAY_TAG", "")
_TEST_NO_GUARD = os.environ.get("DS_OFFLOAD_TEST_NO_GUARD") == "1"


def _test_pause(path):
    if _TEST_WRITE_DELAY and _TEST_DELAY_TAG in path:
        time.sleep(_TEST_WRITE_DELAY)

_live = weakref.WeakSet()


class CheckpointWriteError(RuntimeError):
    pass


def _fsync_dir(path):
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_tmp(path, write):
    """Write ``path``'s content to ``path.tmp``; it lands in the page cache, not yet on disk."""
    _test_pause(path)
    with open(f"{path}.tmp", "wb") as f:
        write(f)


def _publish(path):
    """Flush ``path.tmp`` to disk and rename it to ``path``: the file appears whole or not at all."""
    tmp = f"{path}.tmp"
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())
    _test_pause(path)
    os.replace(tmp, path)
    _fsync_dir(os.path.dirname(path) or ".")


def _atomic_write(path, write):
    _write_tmp(path, write)
    _publish(path)


class _Capture:
    """Stands in for DeepSpeed's checkpoint engine during a save: records what would be written."""

    def __init__(self, inner, snapshot):
        self._inner = inner
        self._snapshot = snapshot
        self.files = []

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def save(self, state_dict, path):
        self.files.append((path, self._snapshot(state_dict)))

    def commit(self, info):
        return True

    def is_decoupled(self):
        return False


class AsyncCheckpointer:

    def __init__(self, engine, host_buffers):
        self.engine = engine
        self._host_storages = {b.untyped_storage().data_ptr() for b in host_buffers}
        self._thread = None
        self._unchecked = False  # a save whose outcome the ranks have not yet agreed on
        self._written = threading.Event()  # this rank's files are serialized: the host store is free
        self._written.set()
        self._error = None
        self.last = None  # {"tag", "blocking_s", "background_s"} of the last save
        self.guard_enabled = not _TEST_NO_GUARD
        self._orig_save = engine.save_checkpoint
        self._orig_load = engine.load_checkpoint
        self._orig_step = engine.step
        engine.save_checkpoint = self.save_checkpoint
        engine.load_checkpoint = self.load_checkpoint
        engine.step = self.step
        _live.add(self)

    # ------------------------------------------------------------------ snapshot

    def _snapshot(self, obj):
        if torch.is_tensor(obj):
            if obj.device.type == "cpu" and obj.untyped_storage().data_ptr() in self._host_storages:
                # By reference, through a new alias: the step rebinds the original's .data to a
                # staging slot, the alias keeps pointing at the host slice that the guard protects.
                return obj.detach()
            return obj.detach().to("cpu", copy=True)
        if isinstance(obj, dict):
            out = copy.copy(obj)  # keeps OrderedDict/defaultdict types
            for k, v in obj.items():
                out[k] = self._snapshot(v)
            return out
        if isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):
            return type(obj)(self._snapshot(v) for v in obj)
        return copy.deepcopy(obj)

    # ------------------------------------------------------------------ engine entry points

    def save_checkpoint(self, save_dir, tag=None, client_state={}, save_latest=True, exclude_frozen_parameters=False):
        self.wait()  # one save at a time; raises if the previous one failed
        from deepspeed import comm as dist
        t0 = time.perf_counter()  # (the optimizer's state_dict drains pending write-backs itself)
        tag = str(tag) if tag is not None else f"global_step{self.engine.global_steps}"
        rank, world = dist.get_rank(), dist.get_world_size()
        tag_dir = os.path.join(save_dir, tag)
        # A reused tag: this rank's old marker must not count for the new save. DeepSpeed's save
        # below has barriers, so every rank has removed its marker before any writer starts.
        for suffix in ("done", "failed"):
            try:
                os.remove(os.path.join(tag_dir, f".deepspeed_offload_rank{rank}.{suffix}"))
            except OSError:
                pass  # not there (or no such directory yet)
        if rank == 0 and _reads(os.path.join(save_dir, "latest")) == tag:
            logger.warning(f"[deepspeed-offload] saving over checkpoint {tag}, which 'latest' names: its files are "
                           "replaced one by one; use a new tag per save to keep the previous checkpoint whole")
        capture = _Capture(self.engine.checkpoint_engine, self._snapshot)
        self.engine.checkpoint_engine = capture
        try:
            self._orig_save(save_dir, tag=tag, client_state=client_state, save_latest=False,
                            exclude_frozen_parameters=exclude_frozen_parameters)
        finally:
            self.engine.checkpoint_engine = capture._inner
        job = dict(files=capture.files, tag=tag, tag_dir=tag_dir, save_dir=save_dir, rank=rank, world=world,
                   save_latest=save_latest)
        blocking = time.perf_counter() - t0
        self.last = {"tag": tag, "blocking_s": blocking, "background_s": None}
        self._written.clear()
        self._unchecked = True
        self._thread = threading.Thread(target=self._write, args=(job, ), name="deepspeed-offload-ckpt")
        self._thread.start()
        print_dist(f"[deepspeed-offload] checkpoint {tag}: save_checkpoint blocked {blocking:.3f} s; "
                   f"{len(capture.files)} file(s) writing in the background", ranks=[0])
        return True

    def load_checkpoint(self, *args, **kwargs):
        self.wait()
        return self._orig_load(*args, **kwargs)

    def step(self, *args, **kwargs):
        if self._unchecked:
            # Every rank passes here exactly once per save, so the all-reduce below always pairs up.
            self._unchecked = False
            self._agree_on_failure()
        return self._orig_step(*args, **kwargs)

    # ------------------------------------------------------------------ the writer

    def _write(self, job):
        t0 = time.perf_counter()
        paths = [path for path, _ in job["files"]]
        try:
            for path, obj in job["files"]:
                os.makedirs(os.path.dirname(path), exist_ok=True)
                _write_tmp(path, lambda f, obj=obj: torch.save(obj, f))
        except BaseException as e:  # noqa: B902 - reported at the next step or wait
            self._fail(job, f"writing checkpoint {job['tag_dir']} failed: {e!r}")
            return
        finally:
            # Serialized (or failed): the host store is no longer read, the step may overwrite it.
            job["files"] = None
            self._written.set()
        try:
            for path in paths:
                _publish(path)
            marker = os.path.join(job["tag_dir"], f".deepspeed_offload_rank{job['rank']}.done")
            _atomic_write(marker, lambda f: f.write(b"ok"))
        except BaseException as e:  # noqa: B902
            self._fail(job, f"writing checkpoint {job['tag_dir']} failed: {e!r}")
            return
        try:
            if job["rank"] == 0 and job["save_latest"]:
                self._commit(job)
        except BaseException as e:  # noqa: B902
            self._error = CheckpointWriteError(f"committing checkpoint {job['tag_dir']} failed: {e!r}")
            return
        self.last["background_s"] = time.perf_counter() - t0
        print_dist(f"[deepspeed-offload] checkpoint {job['tag']} written in the background in "
                   f"{self.last['background_s']:.3f} s", ranks=[0])

    def _fail(self, job, message):
        self._error = CheckpointWriteError(message)
        try:  # let rank 0 stop waiting for this rank at once
            marker = os.path.join(job["tag_dir"], f".deepspeed_offload_rank{job['rank']}.failed")
            with open(marker, "w") as f:
                f.write(message)
        except OSError:
            pass

    def _commit(self, job):
        """Rank 0: once every rank's marker is there, point ``latest`` at the new tag."""
        deadline = time.monotonic() + COMMIT_TIMEOUT_S
        markers = [os.path.join(job["tag_dir"], f".deepspeed_offload_rank{r}.done") for r in range(job["world"])]
        while not all(os.path.exists(m) for m in markers):
            failed = [m for m in markers if os.path.exists(m[:-len("done")] + "failed")]
            if failed:
                raise RuntimeError(f"another rank's write failed: {_reads(failed[0][:-len('done')] + 'failed')}")
            if time.monotonic() > deadline:
                missing = [m for m in markers if not os.path.exists(m)]
                raise TimeoutError(f"ranks did not finish within {COMMIT_TIMEOUT_S:.0f} s: {missing}")
            time.sleep(0.05)
        _atomic_write(os.path.join(job["save_dir"], "latest"), lambda f: f.write(job["tag"].encode()))

    # ------------------------------------------------------------------ waiting

    def guard(self):
        """Called by the streamed step right before it first overwrites host state."""
        if self.guard_enabled:
            self._written.wait()

    def _agree_on_failure(self):
        """Raise on every rank if any rank's write has failed so far (one all-reduce)."""
        from deepspeed import comm as dist
        failed = self._error is not None
        if dist.is_initialized() and dist.get_world_size() > 1:
            from deepspeed.accelerator import get_accelerator
            flag = torch.tensor([int(failed)], device=get_accelerator().current_device_name())
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            failed_somewhere = bool(flag.item())
        else:
            failed_somewhere = failed
        if failed_somewhere:
            err, self._error = self._error, None
            raise err or CheckpointWriteError("another rank's checkpoint write failed (its log says why)")

    def _join(self):
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def wait(self):
        """Block until this rank's write and (on rank 0) the commit of ``latest`` are done; raise on
        every rank if any rank's write failed. Collective: call it on every rank."""
        self._join()
        self._unchecked = False
        self._agree_on_failure()


def wait_for_checkpoint(engine):
    """Block until ``engine``'s asynchronous checkpoint is written and committed; raise (on every
    rank) if it failed. Call it on every rank, like ``save_checkpoint``."""
    handle = getattr(engine, "_deepspeed_offload", None)
    ckpt = getattr(handle, "checkpointer", None)
    if ckpt is not None:
        ckpt.wait()


def _reads(path):
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


@atexit.register
def _wait_all_at_exit():
    # No collectives here: other ranks may be gone already. Finish the write, log a failure.
    for ckpt in list(_live):
        ckpt._join()
        if ckpt._error is not None:
            logger.error(f"[deepspeed-offload] {ckpt._error}")
