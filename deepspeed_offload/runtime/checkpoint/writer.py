"""This rank's background writer, and the heartbeat that tells rank 0 it is still writing.

``write_async`` starts the writer thread and returns a ``concurrent.futures.Future`` (as
torch.distributed.checkpoint's async executor does): its result is the seconds the write and the
commit took on rank 0 (None on other ranks), its exception the ``CheckpointWriteError`` saying what
failed. The writer waits for the copies aside (staging.py), serializes each staged file into
``<file>.tmp`` (each host-store tensor it writes from the store is free to change once written:
``Regions``; the pieces written are hashed from the page cache meanwhile, files.py), releases the
staged tensors, fsyncs and renames the files and writes this rank's marker; rank 0 then commits
(commit.py). A rank whose write
fails removes its own ``.tmp`` files, leaves the cause in its ``.failed`` file and removes its
heartbeat, so rank 0 stops waiting for it at once. The thread is not a daemon: the interpreter
waits for it at exit.
"""

import json
import os
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Callable, Optional, Tuple

from deepspeed.utils import log_dist

from .commit import commit
from .errors import CheckpointWriteError, describe_os_error
from .files import DIGEST, atomic_write, fsync_dir, publish, read_text, remove, serialize
from .names import FAILED, MARKER, staging_dir
from .options import NO_FAULTS, Faults, Settings
from .staging import StagedFiles


@dataclass(frozen=True)
class SaveJob:
    """What this rank writes for one save, fixed when ``save_checkpoint`` returns. The tensors are
    not part of it: they are in the StagedFiles, which the writer frees once serialized."""

    save_dir: str
    tag: str
    save_id: str
    rank: int
    world: int
    save_latest: bool
    zipfile: bool  # the serialization format of DeepSpeed's checkpoint engine
    paths: Tuple[str, ...]  # this rank's files, in the staging directory
    # Rank 0: DeepSpeed's copies of zero_to_fp32.py beside the tags, as (copy, save_dir), deferred
    # to the writer so that save_checkpoint does not wait for them.
    scripts: Tuple[Tuple[Callable[[str], None], str], ...] = ()

    @property
    def staging(self) -> str:
        return staging_dir(self.save_dir, self.tag, self.save_id)

    @property
    def tag_dir(self) -> str:
        return os.path.join(self.save_dir, self.tag)


class Heartbeat:
    """Touches ``path`` every ``interval_s`` until stopped: rank 0 reads it as "still writing". The
    file exists once the constructor returns."""

    def __init__(self, path, interval_s: float):
        self.path = path
        self.interval_s = interval_s
        with open(path, "wb"):
            pass
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="deepspeed-offload-heartbeat", daemon=True)
        self._thread.start()

    def _run(self):
        while not self._stop.wait(self.interval_s):
            try:
                os.utime(self.path)
            except OSError:
                pass

    def stop(self, remove_file=False):
        self._stop.set()
        self._thread.join()
        if remove_file:
            remove(self.path)


def write_async(job: SaveJob, staged: StagedFiles, heartbeat: Heartbeat, settings: Settings = Settings(),
                faults: Faults = NO_FAULTS, phases: Optional[dict] = None) -> Future:
    """Start writing ``staged`` (and, on rank 0, committing the save) in a thread of its own; the
    heartbeat is stopped once this rank's files are written. Returns the write's Future; ``phases``
    (if given) gets the seconds of each phase of this rank's write."""
    future = Future()
    future.set_running_or_notify_cancel()
    threading.Thread(target=_run, args=(job, staged, heartbeat, settings, faults, future,
                                        {} if phases is None else phases),
                     name="deepspeed-offload-ckpt").start()
    return future


def _run(job, staged, heartbeat, settings, faults, future, phases):
    error, seconds = None, None
    try:
        t0 = time.perf_counter()
        error = _write_files(job, staged, heartbeat, faults, phases)
        if error is None and job.rank == 0:
            error = _commit(job, settings, faults)
            if error is None:
                seconds = time.perf_counter() - t0
                took = ", ".join(f"{k[:-2].replace('_', ' ')} {v:.2f} s" for k, v in phases.items())
                log_dist(f"[deepspeed-offload] checkpoint {job.tag} written and committed in the background in "
                         f"{seconds:.3f} s ({took})", ranks=[0])
    finally:
        # A fresh exception, never raised: it holds no traceback, hence no frame of the write.
        if error is not None:
            future.set_exception(CheckpointWriteError(error))
        else:
            future.set_result(seconds)


def _write_files(job: SaveJob, staged: StagedFiles, heartbeat: Heartbeat, faults: Faults,
                 phases: dict) -> Optional[str]:
    """This rank's files and marker, in the staging directory; the seconds of each phase into
    ``phases``. The failure, or None."""
    written = {}
    where = job.staging
    failed = False
    try:
        try:
            t = time.perf_counter()
            staged.wait_copied()
            phases["copy_aside_s"] = time.perf_counter() - t
            t = time.perf_counter()
            for path, obj in staged.files:
                where = path
                os.makedirs(os.path.dirname(path), exist_ok=True)
                if faults.before_file is not None:
                    faults.before_file(path)
                # copied aside: nothing waits for the serialization, so the disk may set the pace from
                # the first byte; written from the store, the step may wait for it: the page cache's
                nbytes, digest = serialize(path, obj, job.zipfile, staged.regions.done,
                                           start_writeback=staged.copied_aside)
                written[os.path.relpath(path, job.staging)] = {"bytes": nbytes, DIGEST: digest}
            phases["serialize_s"] = time.perf_counter() - t
        finally:
            # Serialized (or failed): the host store is no longer read, the step may overwrite it.
            obj = None  # noqa: F841 - no reference to the last snapshot either
            staged.free()
        t = time.perf_counter()
        for name in written:
            publish(os.path.join(job.staging, name), faults.before_file)
        fsync_dir(job.staging)
        phases["flush_s"] = time.perf_counter() - t
        where = os.path.join(job.staging, MARKER.format(job.rank))
        marker = {"save_id": job.save_id, "tag": job.tag, "rank": job.rank, "world": job.world,
                  "digest": DIGEST, "files": written}
        atomic_write(where, json.dumps(marker, indent=1, sort_keys=True).encode())
    except BaseException as e:  # noqa: B902 - reported at the next step or wait
        failed = True
        message = f"writing checkpoint {job.tag_dir} failed: {describe_os_error(e, where)}"
        report_failure(job, message)
        return message
    finally:
        heartbeat.stop(remove_file=failed)
    return None


def report_failure(job: SaveJob, message: str):
    """This rank's write failed: remove its own ``.tmp`` files (the staging directory is shared:
    another rank may be between writing a file and renaming it) and tell rank 0 why."""
    for path in job.paths + (os.path.join(job.staging, MARKER.format(job.rank)), ):
        remove(f"{path}.tmp")  # free the space now, not at the next save
    try:  # let rank 0 stop waiting for this rank at once
        with open(os.path.join(job.staging, FAILED.format(job.rank)), "w") as f:
            f.write(message)
    except OSError:
        pass  # (then the heartbeat, removed, says it)


def _commit(job: SaveJob, settings: Settings, faults: Faults) -> Optional[str]:
    """Rank 0, once its own files are written: the recovery scripts, then the commit. The failure, or None."""
    try:
        for copy_fn, save_path in job.scripts:
            copy_fn(save_path)  # zero_to_fp32.py beside the tags, as DeepSpeed's save does
        if faults.before_commit is not None:
            faults.before_commit(job)
        commit(job.save_dir, job.tag, job.save_id, job.world, job.save_latest, settings)
    except BaseException as e:  # noqa: B902 - reported at the next step or wait
        return (f"committing checkpoint {job.tag_dir} failed: {describe_os_error(e, job.save_dir)}; "
                f"'latest' still names {read_text(os.path.join(job.save_dir, 'latest'))!r}")
    return None
