"""Asynchronous checkpoints straight from the host store: never lost silently, never visible
half-written, verified before they load.

``engine.save_checkpoint`` keeps DeepSpeed's own files and format (so ``engine.load_checkpoint`` and
``zero_to_fp32.py`` work unchanged) but returns after a short snapshot: while DeepSpeed builds its
state dicts, the checkpoint engine is swapped for one that only *captures* them (and touches no
disk). Tensors on the device are copied to host right there (a real snapshot); tensors that live in
the host store (fp32 masters, optimizer moments: the bulk) are handed to the background writer by
reference, with no second host copy; small CPU tensors and Python objects are copied. The files are
serialized exactly as DeepSpeed's own engine would (same serialization format, same tensors,
``requires_grad`` included), so an async checkpoint equals a synchronous one byte for byte in every
tensor, ZeRO-3's padding elements included: both read the same host memory, which nothing writes
until the guard lets it.

The protocol, per save (every rank takes part, like DeepSpeed's own save):

- one small all-reduce gives every rank the same random *save id* (and raises at once, on every
  rank, if any rank cannot create its directory: ``Permission denied`` and the path);
- each rank writes its files into a staging directory ``<save_dir>/.<tag>.incoming-<save id>``, each
  through a file object that hashes every byte on its way to disk (sha256, one pass, in the writer
  thread), as ``<name>.tmp``, then fsyncs and renames it, then drops its marker
  ``.deepspeed_offload_rank<r>.json``: save id, tag, world size, and every file's size and digest;
- the guard: the streamed step waits for this rank's in-flight serialization right before its first
  write-back to the host store (``guard()``), so the next forward and backward overlap the write;
  fsync, markers and the commit go on after the guard has let the step through;
- liveness: while its files are being written, each rank's writer keeps a heartbeat file
  ``.deepspeed_offload_rank<r>.alive`` in the staging directory fresh (every
  ``DS_OFFLOAD_HEARTBEAT_INTERVAL`` s, 0.5). A rank whose write fails writes
  ``.deepspeed_offload_rank<r>.failed`` (the cause) and removes its heartbeat. Rank 0, waiting for
  the markers, fails the commit as soon as a rank reports a failure, removes its heartbeat without a
  marker, or lets it go stale for ``DS_OFFLOAD_HEARTBEAT_TIMEOUT`` s (10; rank 0 measures staleness on
  its own clock, by watching the file's mtime *change*, so clock skew between nodes does not
  matter). ``DS_OFFLOAD_COMMIT_TIMEOUT`` (600 s) bounds a rank that is alive but never finishes;
- the commit (rank 0, once every marker with this save id is there): a journal
  ``<save_dir>/.deepspeed_offload_commit.<tag>.json`` names the tag and save id; an existing
  ``<tag>`` directory is renamed aside to ``.<tag>.replaced-<save id>``, the staging directory is
  renamed to ``<tag>``, ``latest`` is written (temp file + rename), the journal and the replaced
  directory are removed, and so are the staging directories of this tag that earlier failed or
  killed saves left behind (their ``.tmp`` files with them). A save into the tag that ``latest``
  names (Lightning's ``last.ckpt/checkpoint``) therefore replaces it in two renames, never file by
  file. If the process dies between those two renames, ``<tag>`` is briefly missing: the next
  ``load_checkpoint`` or ``save_checkpoint`` through this package reads the journal and finishes
  (the staging directory is complete by then) or undoes the swap. A kill at any other instant leaves
  ``<tag>`` and ``latest`` as they were. Everything a save removes or swaps is named by its own tag
  (journal, staging and replaced directories), under one lock of the process: two engines saving
  different tags into one folder (Accelerate's ``save_state`` with two engines) leave each other's
  files alone;
- cleaning up: at the start of a save, rank 0 finishes interrupted swaps and removes what earlier
  saves of the same tag left; once the ranks have agreed that a save failed (every rank's writer
  joined), rank 0 removes that save's staging directory, so a failed save leaves nothing behind
  even when no later save goes to the same folder (HF's ``checkpoint-N``, Lightning's
  ``epoch=...ckpt``);
- failures are raised on every rank at once (the ranks agree through one small all-reduce, and only
  after a failure exchange the messages, so each rank's error names the failing rank, the path and
  the cause, e.g. ``No space left on device``), at the first ``engine.step()`` after the save, the
  next save or load, or ``wait_for_checkpoint``. A failed write removes its ``.tmp`` files at once
  (the rest of the failed save goes once the ranks have agreed); the previous checkpoint stays
  loadable.
- at interpreter exit the writer is waited for (it is not a daemon thread). If this rank's write or
  commit failed, the error is logged (the logs flushed) and the process exits with status 1
  (``os._exit``), so a
  launcher sees it. ``os._exit`` cannot be intercepted: a script that ends with it must call
  ``deepspeed_offload.wait_for_checkpoint(engine)`` first.

At load, before DeepSpeed's loader runs, the tag is resolved once (``tag``, or the one that
``latest``, ``latest_universal`` for a universal checkpoint, names) and handed to DeepSpeed's loader
as such, so the tag verified is the tag loaded. A tag written by this package is verified: every rank's
marker present and from the same save, every file the size its marker says, no stray checkpoint
file from another save, and every file's digest (each rank re-hashes a share of the files). Any
failure is raised on every rank (agreed, as above), naming the rank and the file; nothing hangs.
A tag without our markers (a plain DeepSpeed save) loads as before. DeepSpeed's loader unpickles
the files (``weights_only=False``): verification proves a file is the one written, not that its
writer is trusted (see docs/troubleshooting.md). What this module itself reads it loads as JSON.
``deepspeed-offload digest`` measures the digest's speed on this host (the load-time cost of
verification is about the checkpoint's size per rank over it).
"""

import atexit
import copy
import errno
import hashlib
import json
import logging
import os
import re
import secrets
import shutil
import sys
import threading
import time
import weakref
from typing import Dict, List, Optional, Tuple

import torch
from deepspeed.utils import log_dist, logger

from .patches import PatchRegistry

COMMIT_TIMEOUT_S = float(os.environ.get("DS_OFFLOAD_COMMIT_TIMEOUT", 600))
HEARTBEAT_INTERVAL_S = float(os.environ.get("DS_OFFLOAD_HEARTBEAT_INTERVAL", 0.5))
HEARTBEAT_TIMEOUT_S = float(os.environ.get("DS_OFFLOAD_HEARTBEAT_TIMEOUT", 10))
DIGEST = "sha256"
MESSAGE_BYTES = 1024  # of each rank's error message, exchanged only after a failure
_CHUNK = 8 << 20

MARKER = ".deepspeed_offload_rank{}.json"
FAILED = ".deepspeed_offload_rank{}.failed"
ALIVE = ".deepspeed_offload_rank{}.alive"
JOURNAL = ".deepspeed_offload_commit.{}.json"  # one per tag: engines saving into one folder
_JOURNAL_RE = re.compile(r"^\.deepspeed_offload_commit(\..+)?\.json$")
_MARKER_RE = re.compile(r"^\.deepspeed_offload_rank(\d+)\.json$")
_CKPT_FILE_RE = re.compile(r"_(model|optim)_states\.pt$")

# Test-only switches (tests/e2e): a pause before serializing a file and before renaming it (for tags
# containing DS_OFFLOAD_TEST_DELAY_TAG), to make a write slow enough to race with or to kill; and
# turning the guard off, to prove that the tests see a race when there is one.
_TEST_WRITE_DELAY = float(os.environ.get("DS_OFFLOAD_TEST_WRITE_DELAY", 0))
_TEST_DELAY_TAG = os.environ.get("DS_OFFLOAD_TEST_DELAY_TAG", "")
_TEST_NO_GUARD = os.environ.get("DS_OFFLOAD_TEST_NO_GUARD") == "1"

_live = weakref.WeakSet()
# Swaps, recoveries and removals of one process (every engine's rank 0) one at a time: another
# engine's save must never see a swap half done, or lose a ``.tmp`` it is about to rename.
_SWAP_LOCK = threading.RLock()


class CheckpointWriteError(RuntimeError):
    """An asynchronous checkpoint could not be written or committed (raised on every rank)."""


class CheckpointLoadError(RuntimeError):
    """A checkpoint this package wrote is incomplete, mixed across saves or damaged (raised on every
    rank, before DeepSpeed's loader reads anything)."""


def _test_pause(path):
    if _TEST_WRITE_DELAY and _TEST_DELAY_TAG and _TEST_DELAY_TAG in path:
        time.sleep(_TEST_WRITE_DELAY)


# ---------------------------------------------------------------------- files


def describe_os_error(e: BaseException, path: str) -> str:
    """``No space left on device (ENOSPC): <path>``: the errno's text first, then the path. Our own
    errors (which name their paths) as they are; anything else with its type and ``path``."""
    if isinstance(e, OSError) and e.errno is not None:
        return f"{os.strerror(e.errno)} ({errno.errorcode.get(e.errno, e.errno)}): {getattr(e, 'filename', None) or path}"
    if isinstance(e, (CheckpointWriteError, TimeoutError)):
        return str(e)
    return f"{e!r} ({path})"


def _fsync_dir(path):
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class _DigestingFile:
    """Write-only file object that hashes every byte on its way to the file: one pass, no re-read.
    It has no ``fileno``, so torch.save writes everything through ``write``."""

    def __init__(self, path):
        self.path = path
        self._f = open(path, "wb")
        self._hash = hashlib.new(DIGEST)
        self.nbytes = 0
        self.os_error = None  # the first OSError, which torch may re-raise as something vaguer

    def write(self, data):
        try:
            n = self._f.write(data)
        except OSError as e:
            self.os_error = self.os_error or e
            raise
        self._hash.update(data)
        self.nbytes += memoryview(data).nbytes
        return n

    def flush(self):
        self._f.flush()

    def close(self):
        try:
            self._f.close()  # flushes the buffer: ENOSPC/EFBIG may surface only here
        except OSError as e:
            self.os_error = self.os_error or e
            raise

    def hexdigest(self):
        return self._hash.hexdigest()


def _serialize(path, obj, zipfile: bool) -> Dict[str, object]:
    """torch.save ``obj`` to ``path.tmp`` (into the page cache); its size and digest."""
    _test_pause(path)
    f = _DigestingFile(f"{path}.tmp")
    try:
        try:
            torch.save(obj, f, _use_new_zipfile_serialization=zipfile)
        finally:
            f.close()
    except BaseException as e:  # noqa: B902 - torch turns a failed write into "unexpected pos ..."
        if f.os_error is not None:
            raise f.os_error from e
        raise
    return {"bytes": f.nbytes, DIGEST: f.hexdigest()}


def _publish(path):
    """Flush ``path.tmp`` to disk and rename it to ``path``: the file appears whole or not at all."""
    tmp = f"{path}.tmp"
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())
    _test_pause(path)
    os.replace(tmp, path)


def _atomic_write(path, data: bytes):
    tmp = f"{path}.tmp"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(os.path.dirname(path) or ".")


def _reads(path) -> Optional[str]:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def _read_json(path) -> Optional[dict]:
    text = _reads(path)
    if text is None:
        return None
    try:
        value = json.loads(text)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def file_digest(path) -> str:
    h = hashlib.new(DIGEST)
    buf = bytearray(_CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while True:
            n = f.readinto(buf)
            if not n:
                break
            h.update(view[:n])
    return h.hexdigest()


def _remove(path):
    try:
        os.remove(path)
    except OSError:
        pass


def _flat(tag) -> str:
    return str(tag).replace(os.sep, "_")


def staging_dir(save_dir, tag, save_id) -> str:
    return os.path.join(save_dir, f".{_flat(tag)}.incoming-{save_id}")


def replaced_dir(save_dir, tag, save_id) -> str:
    return os.path.join(save_dir, f".{_flat(tag)}.replaced-{save_id}")


def journal_path(save_dir, tag) -> str:
    return os.path.join(save_dir, JOURNAL.format(_flat(tag)))


# ---------------------------------------------------------------------- commit and recovery


def swap_in(save_dir, tag, save_id, save_latest=True):
    """Rank 0: put the complete staging directory in place as ``<tag>`` (journaled, two renames),
    point ``latest`` at it, and remove what earlier saves of this tag left behind."""
    staging, tag_dir = staging_dir(save_dir, tag, save_id), os.path.join(save_dir, tag)
    aside = replaced_dir(save_dir, tag, save_id)
    for name in os.listdir(staging):
        if name.endswith(".alive"):
            _remove(os.path.join(staging, name))
    journal = journal_path(save_dir, tag)
    with _SWAP_LOCK:
        _atomic_write(journal, json.dumps({"tag": tag, "save_id": save_id}).encode())
        if os.path.lexists(tag_dir):
            os.rename(tag_dir, aside)
        os.makedirs(os.path.dirname(tag_dir), exist_ok=True)
        os.rename(staging, tag_dir)
        _fsync_dir(save_dir)
        if save_latest:
            _atomic_write(os.path.join(save_dir, "latest"), tag.encode())
        os.remove(journal)
        shutil.rmtree(aside, ignore_errors=True)
        remove_leftovers(save_dir, tag)


def recover(save_dir) -> Optional[str]:
    """Finish or undo every swap that a killed process left half done (``<tag>`` renamed aside, the
    new one not yet in place): one journal per tag. Rank 0 only, before anyone reads the directory.
    Returns what it did."""
    done = []
    with _SWAP_LOCK:  # (a swap of this process is never seen half done: it holds the lock)
        try:
            journals = sorted(n for n in os.listdir(save_dir) if _JOURNAL_RE.match(n))
        except OSError:
            return None
        for name in journals:
            journal = os.path.join(save_dir, name)
            entry = _read_json(journal)
            if entry is None:
                _remove(journal)  # torn before its rename: the swap had not started
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
            _remove(journal)
    for line in done:
        logger.warning(f"[deepspeed-offload] {line}")
    return "; ".join(done) or None


def remove_leftovers(save_dir, tag):
    """What earlier saves of ``tag`` (failed, killed) left in ``save_dir``: their staging and replaced
    directories, the journal's and ``latest``'s temp files. Called when no save of ``tag`` is in
    flight. Other tags' files are left alone: another engine may be saving into the folder now."""
    aside = re.compile(r"^\.%s\.(?:incoming|replaced)-[0-9a-f]{16}$" % re.escape(_flat(tag)))
    with _SWAP_LOCK:
        try:
            names = os.listdir(save_dir)
        except OSError:
            return
        for name in names:
            path = os.path.join(save_dir, name)
            if aside.match(name) and os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path, ignore_errors=True)
        _remove(journal_path(save_dir, tag) + ".tmp")
        _remove(os.path.join(save_dir, "latest.tmp"))


# ---------------------------------------------------------------------- verification


def verify_checkpoint(tag_dir, rank: int = 0, world: int = 1) -> Optional[str]:
    """What is wrong with the checkpoint in ``tag_dir``, or None. Markers, sizes and stray files are
    checked by every rank; digests are split: this rank re-hashes the files of saved ranks ``r`` with
    ``r % world == rank``. A directory without our markers is not ours to judge: None."""
    try:
        names = os.listdir(tag_dir)
    except OSError:
        return None  # DeepSpeed's loader says what is missing
    markers = {}
    for name in sorted(names):
        m = _MARKER_RE.match(name)
        if not m:
            continue
        entry = _read_json(os.path.join(tag_dir, name))
        if (entry is None or entry.get("rank") != int(m.group(1)) or not isinstance(entry.get("files"), dict)
                or "save_id" not in entry or not isinstance(entry.get("world"), int)):
            return f"{os.path.join(tag_dir, name)}: the completion marker of rank {m.group(1)} is unreadable (damaged)"
        markers[entry["rank"]] = entry
    if not markers:
        return None
    saves = sorted({(e["save_id"], e.get("tag")) for e in markers.values()})
    if len(saves) > 1:
        by_rank = ", ".join(f"rank {r}: save {e['save_id']} of tag {e.get('tag')!r}" for r, e in sorted(markers.items()))
        return f"{tag_dir} mixes files of different saves ({by_rank})"
    worlds = {e["world"] for e in markers.values()}
    saved_world = max(worlds)
    missing = [r for r in range(saved_world) if r not in markers]
    if missing or len(worlds) > 1:
        return (f"{tag_dir} is incomplete: rank(s) {missing} of {saved_world} have no completion marker "
                "(their files are missing or were never finished)")
    listed = set()
    for r, entry in sorted(markers.items()):
        for name, info in sorted(entry["files"].items()):
            listed.add(name)
            path = os.path.join(tag_dir, name)
            try:
                size = os.path.getsize(path)
            except OSError:
                return f"{path} (written by rank {r}) is missing"
            if size != info.get("bytes"):
                return (f"{path} (written by rank {r}) is {size} bytes, its marker says {info.get('bytes')}: "
                        "truncated or replaced")
    stray = sorted(n for n in names if _CKPT_FILE_RE.search(n) and n not in listed)
    if stray:
        return f"{tag_dir} holds checkpoint files that are not part of its save {saves[0][0]}: {stray}"
    for r, entry in sorted(markers.items()):
        if r % world != rank:
            continue
        for name, info in sorted(entry["files"].items()):
            path = os.path.join(tag_dir, name)
            try:
                digest = file_digest(path)
            except OSError as e:
                return f"reading {path} (written by rank {r}) failed: {describe_os_error(e, path)}"
            if digest != info.get(DIGEST):
                return f"{path} (written by rank {r}) does not match its {DIGEST} digest: the file is damaged"
    return None


# ---------------------------------------------------------------------- agreement across ranks


def _rank_world() -> Tuple[int, int]:
    """This process's rank and the world size (0 and 1 without a process group)."""
    from deepspeed import comm as dist
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _dist():
    """deepspeed.comm when there is more than one rank to agree with, else None."""
    from deepspeed import comm as dist
    return dist if _rank_world()[1] > 1 else None


def _device():
    from deepspeed.accelerator import get_accelerator
    return get_accelerator().current_device_name()


def exchange_messages(message: Optional[str]) -> List[Tuple[int, str]]:
    """Every rank's message (None: none), on every rank: one all-reduce of world x MESSAGE_BYTES."""
    dist = _dist()
    if dist is None:
        return [(0, message)] if message else []
    rank, world = _rank_world()
    buf = torch.zeros(world, MESSAGE_BYTES, dtype=torch.uint8)
    if message:
        data = message.encode()[:MESSAGE_BYTES]
        buf[rank, :len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    buf = buf.to(_device())
    dist.all_reduce(buf, op=dist.ReduceOp.MAX)
    rows = buf.cpu()
    out = []
    for r in range(world):
        text = bytes(rows[r].tolist()).rstrip(b"\0").decode(errors="replace")
        if text:
            out.append((r, text))
    return out


def agree(message: Optional[str]) -> List[Tuple[int, str]]:
    """Which ranks failed and why: one one-element all-reduce, and the messages only if any failed."""
    dist = _dist()
    if dist is None:
        return [(0, message)] if message else []
    flag = torch.tensor([int(message is not None)], dtype=torch.int64, device=_device())
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return exchange_messages(message) if flag.item() else []


def _raise_agreed(failures, own: Optional[str], kind, what):
    if not failures:
        return
    others = [r for r, _ in failures]
    if own is not None:
        text = own
    else:
        r, msg = failures[0]
        text = f"rank {r}: {msg}"
    more = f" (failed on rank(s) {others})" if len(others) > 1 or own is None else ""
    raise kind(f"{what}: {text}{more}")


# ---------------------------------------------------------------------- the checkpointer


class _Capture:
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


class _Heartbeat:
    """Touches ``path`` every HEARTBEAT_INTERVAL_S until stopped: rank 0 reads it as "still writing"."""

    def __init__(self, path):
        self.path = path
        with open(path, "wb"):
            pass
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="deepspeed-offload-heartbeat", daemon=True)
        self._thread.start()

    def _run(self):
        while not self._stop.wait(HEARTBEAT_INTERVAL_S):
            try:
                os.utime(self.path)
            except OSError:
                pass

    def stop(self, remove=False):
        self._stop.set()
        self._thread.join()
        if remove:
            _remove(self.path)


class AsyncCheckpointer:
    """Wraps ``engine.save_checkpoint``, ``load_checkpoint`` and ``step`` (through one PatchRegistry).
    The streamed step calls ``guard()`` before it first overwrites host state; ``host_buffers`` are
    the host store's buffers, whose tensors are written by reference."""

    def __init__(self, engine, host_buffers, patches: Optional[PatchRegistry] = None):
        self.engine = engine
        self._host_storages = {b.untyped_storage().data_ptr() for b in host_buffers}
        self._thread = None
        self._unchecked = False  # a save whose outcome the ranks have not yet agreed on
        self._written = threading.Event()  # this rank's files are serialized: the host store is free
        self._written.set()
        self._error = None
        self._staging = None  # the staging directory of the save whose outcome is not yet agreed
        self.last = None  # {"tag", "save_id", "blocking_s", "background_s"} of the last save
        self.guard_enabled = not _TEST_NO_GUARD
        self._patches = patches if patches is not None else PatchRegistry("deepspeed-offload async checkpoint")
        self._install()
        _live.add(self)

    def _install(self):
        p, e = self._patches, self.engine
        self._orig_save = p.patch(e, "save_checkpoint", lambda orig: self.save_checkpoint)
        self._orig_load = p.patch(e, "load_checkpoint", lambda orig: self.load_checkpoint)
        self._orig_step = p.patch(e, "step", lambda orig: self.step)

    def _uninstall(self):
        self._patches.remove_all()

    # ------------------------------------------------------------------ snapshot

    def _snapshot(self, obj):
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
                out[k] = self._snapshot(v)
            return out
        if isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):
            return type(obj)(self._snapshot(v) for v in obj)
        return copy.deepcopy(obj)

    # ------------------------------------------------------------------ engine entry points

    def save_checkpoint(self, save_dir, tag=None, client_state={}, save_latest=True, exclude_frozen_parameters=False):
        self.wait()  # one save at a time (every rank's writer joined); raises if the previous one failed
        t0 = time.perf_counter()  # (the optimizer's state_dict drains pending write-backs itself)
        if not save_dir:
            raise ValueError(f"save_dir must be a non-empty string, got {save_dir!r}")
        tag = str(tag) if tag is not None else f"global_step{self.engine.global_steps}"
        rank, world = _rank_world()
        save_id, problem = self._start(save_dir, tag, rank)
        staging = staging_dir(save_dir, tag, save_id)
        heartbeat = None
        if problem is None:
            try:
                os.makedirs(staging, exist_ok=True)
                heartbeat = _Heartbeat(os.path.join(staging, ALIVE.format(rank)))
            except OSError as e:
                problem = f"creating checkpoint directory {staging} failed: {describe_os_error(e, staging)}"
        try:
            failures = agree(problem)
            if failures and rank == 0:  # no rank writes into it: every rank stops here
                shutil.rmtree(staging, ignore_errors=True)
            _raise_agreed(failures, problem, CheckpointWriteError, f"checkpoint {tag} not saved")
            files, scripts, zipfile = self._capture(save_dir, tag, staging, client_state, exclude_frozen_parameters)
        except BaseException:
            if heartbeat is not None:
                heartbeat.stop(remove=True)
            raise
        tag_dir = os.path.join(save_dir, tag)
        job = dict(files=files, paths=[path for path, _ in files], tag=tag, tag_dir=tag_dir, staging=staging,
                   save_dir=save_dir, rank=rank, world=world, save_id=save_id, save_latest=save_latest, heartbeat=heartbeat,
                   scripts=scripts, zipfile=zipfile)
        blocking = time.perf_counter() - t0
        self.last = {"tag": tag, "save_id": save_id, "blocking_s": blocking, "background_s": None}
        self._written.clear()
        self._unchecked = True
        self._staging = staging
        self._thread = threading.Thread(target=self._write, args=(job, ), name="deepspeed-offload-ckpt")
        self._thread.start()
        log_dist(f"[deepspeed-offload] checkpoint {tag}: save_checkpoint blocked {blocking:.3f} s; "
                 f"{len(files)} file(s) writing in the background", ranks=[0])
        return True

    def _capture(self, save_dir, tag, staging, client_state, exclude_frozen_parameters):
        """DeepSpeed's own save with its checkpoint engine swapped for ``_Capture`` (and its copy of
        zero_to_fp32.py deferred to the writer): the files to write, as (staging path, snapshot)."""
        engine = self.engine
        capture = _Capture(engine.checkpoint_engine, self._snapshot)
        scripts = []
        swap = PatchRegistry("deepspeed-offload checkpoint capture")  # for the length of this save only
        swap.patch(engine, "checkpoint_engine", lambda inner: capture)
        if getattr(engine, "_copy_recovery_script", None) is not None:
            swap.patch(engine, "_copy_recovery_script",
                       lambda copy_fn: lambda save_path: scripts.append((copy_fn, save_path)))
        try:
            self._orig_save(save_dir, tag=tag, client_state=client_state, save_latest=False,
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
        return files, scripts, getattr(capture._inner, "zipfile_serialization", True)

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
        sid = secrets.randbits(62) if rank == 0 else 0
        dist = _dist()
        if dist is not None:
            t = torch.tensor([sid], dtype=torch.int64, device=_device())
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            sid = int(t.item())
        return f"{sid:016x}", problem

    def load_checkpoint(self, load_dir, tag=None, *args, **kwargs):
        self.wait()
        rank, world = _rank_world()
        problem = None
        if rank == 0:
            try:
                recover(load_dir)
            except OSError as e:
                problem = f"completing an interrupted save in {load_dir} failed: {describe_os_error(e, load_dir)}"
        # (the agreement also orders every rank's reads after rank 0's recovery)
        _raise_agreed(agree(problem), problem, CheckpointLoadError, f"checkpoint in {load_dir} not loaded")
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
        _raise_agreed(agree(problem), problem, CheckpointLoadError, "checkpoint refused")
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

    # ------------------------------------------------------------------ the writer

    def _write(self, job):
        t0 = time.perf_counter()
        written = {}
        where = job["staging"]
        failed = False  # (not self._error: the ranks' agreement may clear that at any moment)
        try:
            try:
                for path, obj in job["files"]:
                    where = path
                    os.makedirs(os.path.dirname(path), exist_ok=True)
                    written[os.path.relpath(path, job["staging"])] = _serialize(path, obj, job["zipfile"])
            finally:
                # Serialized (or failed): the host store is no longer read, the step may overwrite it.
                job["files"] = None
                self._written.set()
            for name in written:
                where = os.path.join(job["staging"], name)
                _publish(where)
            _fsync_dir(job["staging"])
            where = os.path.join(job["staging"], MARKER.format(job["rank"]))
            marker = {"save_id": job["save_id"], "tag": job["tag"], "rank": job["rank"], "world": job["world"],
                      "digest": DIGEST, "files": written}
            _atomic_write(where, json.dumps(marker, indent=1, sort_keys=True).encode())
        except BaseException as e:  # noqa: B902 - reported at the next step or wait
            failed = True
            self._fail(job, f"writing checkpoint {job['tag_dir']} failed: {describe_os_error(e, where)}")
            return
        finally:
            job["heartbeat"].stop(remove=failed)
        if job["rank"] != 0:
            return
        try:
            for copy_fn, save_path in job["scripts"]:
                copy_fn(save_path)  # zero_to_fp32.py beside the tags, as DeepSpeed's save does
            self._commit(job)
        except BaseException as e:  # noqa: B902
            self._error = CheckpointWriteError(
                f"committing checkpoint {job['tag_dir']} failed: {describe_os_error(e, job['save_dir'])}; "
                f"'latest' still names {_reads(os.path.join(job['save_dir'], 'latest'))!r}")
            return
        self.last["background_s"] = time.perf_counter() - t0
        log_dist(f"[deepspeed-offload] checkpoint {job['tag']} written and committed in the background in "
                 f"{self.last['background_s']:.3f} s", ranks=[0])

    def _fail(self, job, message):
        self._error = CheckpointWriteError(message)
        for path in job["paths"] + [os.path.join(job["staging"], MARKER.format(job["rank"]))]:
            _remove(f"{path}.tmp")  # this rank's own: free the space now, not at the next save
        try:  # let rank 0 stop waiting for this rank at once
            with open(os.path.join(job["staging"], FAILED.format(job["rank"])), "w") as f:
                f.write(message)
        except OSError:
            pass  # (then the heartbeat, removed, says it)

    def _commit(self, job):
        """Rank 0: once every rank's marker of this save is there, swap the staging directory in."""
        staging, world, save_id = job["staging"], job["world"], job["save_id"]
        start = time.monotonic()
        seen: Dict[int, Tuple[Optional[int], float]] = {}  # rank -> (heartbeat mtime, when it last changed)
        # Every rank created its heartbeat file before the all-reduce that preceded this commit: one
        # that rank 0 has never seen is on storage rank 0 does not see.
        visible = set()
        while True:
            pending = []
            for r in range(world):
                entry = _read_json(os.path.join(staging, MARKER.format(r)))
                if entry is not None and entry.get("save_id") == save_id:
                    continue
                failed = _reads(os.path.join(staging, FAILED.format(r)))
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
                    failed = _reads(os.path.join(staging, FAILED.format(r)))
                    raise CheckpointWriteError(f"rank {r}'s write failed: {failed}" if failed else
                                               f"rank {r} stopped writing without finishing (it failed or died)")
                if before is None or before[0] != mtime:
                    seen[r] = (mtime, now)
                elif now - before[1] > HEARTBEAT_TIMEOUT_S:
                    if r not in visible:
                        raise CheckpointWriteError(
                            f"rank {r}'s files are not visible from rank 0 (its heartbeat file "
                            f"{os.path.join(staging, ALIVE.format(r))} never appeared in "
                            f"{now - before[1]:.1f} s, DS_OFFLOAD_HEARTBEAT_TIMEOUT={HEARTBEAT_TIMEOUT_S:g}): "
                            f"is save_dir on storage all nodes share? (If it is, rank {r} failed or died "
                            "before rank 0 first looked.)")
                    raise CheckpointWriteError(
                        f"rank {r} stopped writing (its heartbeat stopped for {now - before[1]:.1f} s, "
                        f"DS_OFFLOAD_HEARTBEAT_TIMEOUT={HEARTBEAT_TIMEOUT_S:g}): the process died or its writer hung")
            if now - start > COMMIT_TIMEOUT_S:
                raise TimeoutError(f"rank(s) {pending} did not finish within {COMMIT_TIMEOUT_S:.0f} s "
                                   "(DS_OFFLOAD_COMMIT_TIMEOUT)")
            time.sleep(0.05)
        swap_in(job["save_dir"], job["tag"], save_id, job["save_latest"])

    # ------------------------------------------------------------------ waiting

    def guard(self):
        """Called by the streamed step right before it first overwrites host state."""
        if self.guard_enabled:
            self._written.wait()

    def pending(self) -> bool:
        """True while this rank's writer (or, on rank 0, the commit) is still running. No collective."""
        return self._thread is not None and self._thread.is_alive()

    def _agree_on_failure(self):
        """Raise on every rank if any rank's write has failed so far (one all-reduce). A failure
        that lands while the ranks agree (the writer is not necessarily joined) stays pending."""
        err = self._error
        own = str(err) if err is not None else None
        failures = agree(own)
        if self._error is err:
            self._error = None
        if failures:
            self._discard_failed_save()
        _raise_agreed(failures, own, CheckpointWriteError, "asynchronous checkpoint failed")

    def _discard_failed_save(self):
        """Every rank, once the ranks agreed that the save failed: join this rank's writer, agree
        again (so every rank's writer has stopped), then rank 0 removes the failed save's staging
        directory. Nothing of it is left, even if no later save goes to the same folder."""
        self._join()
        # Whatever the writer still reported belongs to the failed save being raised right now.
        self._error = None
        staging, self._staging = self._staging, None
        agree(None)
        if staging is not None and _rank_world()[0] == 0:
            save_dir = os.path.dirname(staging)
            try:
                recover(save_dir)  # a commit that failed half way: finish or undo it first
            except OSError as e:
                logger.warning(f"[deepspeed-offload] {describe_os_error(e, save_dir)}")
            shutil.rmtree(staging, ignore_errors=True)

    def _join(self):
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def wait_here(self) -> Optional[CheckpointWriteError]:
        """Block until this rank's write (and, on rank 0, the commit) is done; return this rank's
        failure, if any, without raising and without a collective. The failure stays pending: it is
        still raised on every rank at the next step, save, load or ``wait``."""
        self._join()
        return self._error

    def close(self):
        """Wait for the last save (collective) and take the hooks off the engine."""
        self.wait()
        self._uninstall()
        _live.discard(self)

    def wait(self):
        """Block until this rank's write and (on rank 0) the commit are done; raise on every rank if
        any rank's write or the commit failed. Collective: call it on every rank."""
        self._join()
        self._unchecked = False
        self._agree_on_failure()


def _checkpointer(engine) -> Optional[AsyncCheckpointer]:
    handle = getattr(engine, "_deepspeed_offload", None)
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


@atexit.register
def _wait_all_at_exit():
    # The writer is not a daemon thread: the interpreter has already waited for it. No collectives
    # here (other ranks may be gone): log this rank's failure and exit non-zero, so it is not lost.
    failed = False
    for ckpt in list(_live):
        ckpt._join()
        if ckpt._error is not None:
            logger.error(f"[deepspeed-offload] {ckpt._error}")
            failed = True
    if failed:
        logging.shutdown()  # os._exit skips it: flush and close every handler first
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
