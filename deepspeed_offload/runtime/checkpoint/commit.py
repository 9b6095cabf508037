"""Rank 0's side of a save: wait for every rank's files, then swap them in as ``<tag>``.

``commit`` waits for every rank's marker of the save (a rank's failure report, a heartbeat that
stops or was never seen, or the commit timeout end the wait), then ``swap_in`` puts the staging
directory in place in two journaled renames and moves ``latest``. ``recover`` finishes or undoes a
swap a killed process left half done; ``remove_leftovers`` removes what failed or killed saves of a
tag left. All of them hold ``SWAP_LOCK``, so another engine of this process never sees a swap half
done. The protocol as a whole: docs/architecture.md.
"""

import json
import os
import shutil
import threading
import time
from typing import Dict, Optional, Tuple

from deepspeed.utils import logger

from .errors import CheckpointWriteError
from .files import atomic_write, fsync_dir, read_json, read_text, remove
from .names import ALIVE, FAILED, JOURNAL_RE, MARKER, journal_path, leftovers_re, replaced_dir, staging_dir
from .options import Settings

# Swaps, recoveries and removals of one process (every engine's rank 0) one at a time: another
# engine's save must never see a swap half done, or lose a ``.tmp`` it is about to rename.
SWAP_LOCK = threading.RLock()


def commit(save_dir, tag, save_id, world: int, save_latest: bool = True, settings: Settings = Settings()):
    """Rank 0: once every rank's marker of this save is there, swap the staging directory in.
    Raises CheckpointWriteError (a rank failed, died or is not visible) or TimeoutError."""
    staging = staging_dir(save_dir, tag, save_id)
    start = time.monotonic()
    seen: Dict[int, Tuple[Optional[int], float]] = {}  # rank -> (heartbeat mtime, when it last changed)
    # Every rank created its heartbeat file before the all-reduce that preceded this commit: one
    # that rank 0 has never seen is on storage rank 0 does not see.
    visible = set()
    timeout = settings.heartbeat_timeout_s
    while True:
        pending = []
        for r in range(world):
            entry = read_json(os.path.join(staging, MARKER.format(r)))
            if entry is not None and entry.get("save_id") == save_id:
                continue
            failed = read_text(os.path.join(staging, FAILED.format(r)))
            if failed is not None:
                raise CheckpointWriteError(f"rank {r}'s write failed: {failed}")
            pending.append(r)
        if not pending:
            break
        now = time.monotonic()
        for r in pending:
            try:
                mtime = os.stat(os.path.join(staging, ALIVE.format(r))).st_mtime_ns
            except OSError:
                mtime = None
            if mtime is not None:
                visible.add(r)
            before = seen.get(r)
            if before is not None and before[0] is not None and mtime is None:
                failed = read_text(os.path.join(staging, FAILED.format(r)))
                raise CheckpointWriteError(f"rank {r}'s write failed: {failed}" if failed else
                                           f"rank {r} stopped writing without finishing (it failed or died)")
            if before is None or before[0] != mtime:
                seen[r] = (mtime, now)
            elif now - before[1] > timeout:
                if r not in visible:
                    raise CheckpointWriteError(
                        f"rank {r}'s files are not visible from rank 0 (its heartbeat file "
                        f"{os.path.join(staging, ALIVE.format(r))} never appeared in "
                        f"{now - before[1]:.1f} s, DS_OFFLOAD_HEARTBEAT_TIMEOUT={timeout:g}): "
                        f"is save_dir on storage all nodes share? (If it is, rank {r} failed or died "
                        "before rank 0 first looked.)")
                raise CheckpointWriteError(
                    f"rank {r} stopped writing (its heartbeat stopped for {now - before[1]:.1f} s, "
                    f"DS_OFFLOAD_HEARTBEAT_TIMEOUT={timeout:g}): the process died or its writer hung")
        if now - start > settings.commit_timeout_s:
            raise TimeoutError(f"rank(s) {pending} did not finish within {settings.commit_timeout_s:.0f} s "
                               "(DS_OFFLOAD_COMMIT_TIMEOUT)")
        time.sleep(0.05)
    swap_in(save_dir, tag, save_id, save_latest)


def swap_in(save_dir, tag, save_id, save_latest=True):
    """Rank 0: put the complete staging directory in place as ``<tag>`` (journaled, two renames),
    point ``latest`` at it, and remove what earlier saves of this tag left behind."""
    staging, tag_dir = staging_dir(save_dir, tag, save_id), os.path.join(save_dir, tag)
    aside = replaced_dir(save_dir, tag, save_id)
    for name in os.listdir(staging):
        if name.endswith(".alive"):
            remove(os.path.join(staging, name))
    journal = journal_path(save_dir, tag)
    with SWAP_LOCK:
        atomic_write(journal, json.dumps({"tag": tag, "save_id": save_id}).encode())
        if os.path.lexists(tag_dir):
            os.rename(tag_dir, aside)
        os.makedirs(os.path.dirname(tag_dir), exist_ok=True)
        os.rename(staging, tag_dir)
        fsync_dir(save_dir)
        if save_latest:
            atomic_write(os.path.join(save_dir, "latest"), tag.encode())
        os.remove(journal)
        shutil.rmtree(aside, ignore_errors=True)
        remove_leftovers(save_dir, tag)


def recover(save_dir) -> Optional[str]:
    """Finish or undo every swap that a killed process left half done (``<tag>`` renamed aside, the
    new one not yet in place): one journal per tag. Rank 0 only, before anyone reads the directory.
    Returns what it did."""
    done = []
    with SWAP_LOCK:  # (a swap of this process is never seen half done: it holds the lock)
        try:
            journals = sorted(n for n in os.listdir(save_dir) if JOURNAL_RE.match(n))
        except OSError:
            return None
        for name in journals:
            journal = os.path.join(save_dir, name)
            entry = read_json(journal)
            if entry is None:
                remove(journal)  # torn before its rename: the swap had not started
                continue
            tag, save_id = str(entry.get("tag")), str(entry.get("save_id"))
            tag_dir = os.path.join(save_dir, tag)
            if not os.path.lexists(tag_dir):
                for source, what in ((staging_dir(save_dir, tag, save_id), "finished"),
                                     (replaced_dir(save_dir, tag, save_id), "undid")):
                    if os.path.isdir(source):
                        os.makedirs(os.path.dirname(tag_dir), exist_ok=True)
                        os.rename(source, tag_dir)
                        done.append(f"{what} the interrupted replacement of checkpoint {tag_dir}")
                        break
            remove(journal)
    for line in done:
        logger.warning(f"[deepspeed-offload] {line}")
    return "; ".join(done) or None


def remove_leftovers(save_dir, tag):
    """What earlier saves of ``tag`` (failed, killed) left in ``save_dir``: their staging and replaced
    directories, the journal's and ``latest``'s temp files. Called when no save of ``tag`` is in
    flight. Other tags' files are left alone: another engine may be saving into the folder now."""
    aside = leftovers_re(tag)
    with SWAP_LOCK:
        try:
            names = os.listdir(save_dir)
        except OSError:
            return
        for name in names:
            path = os.path.join(save_dir, name)
            if aside.match(name) and os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path, ignore_errors=True)
        remove(journal_path(save_dir, tag) + ".tmp")
        remove(os.path.join(save_dir, "latest.tmp"))
