"""File primitives of a save: a file appears whole or not at all, and the host memory it was written
from is free to change as soon as its bytes reached the file.

``serialize`` writes through ``TrackedFile`` into ``<path>.tmp`` and reports each write's source memory
once the write returned (staging.py's ``Regions``: the step may overwrite that part of the host store
then) and, when asked, starts the disk writing what it has (``sync_file_range``), so the disk is busy
while the file is still being serialized. The digest is taken afterwards from the page cache
(``file_digest``: the file's 32 MiB pieces hashed by several threads), off the step's way, while the
disk flushes; ``publish`` fsyncs and renames into place; ``atomic_write`` does both for the small
files (markers, the journal, ``latest``). What this package reads back it reads as JSON.
"""

import ctypes
import ctypes.util
import hashlib
import json
import os
import threading
from typing import Callable, List, Optional, Sequence

import numpy
import torch

# The digest the markers record: sha256 over the sha256 digests of the file's 32 MiB pieces, in order,
# so that the pieces are hashed by several threads at once (hashlib and os.pread release the GIL).
# Markers name it ("digest"); "sha256" (the whole file in one pass) is what earlier versions wrote.
DIGEST = "sha256-pieces-32MiB"
WHOLE = "sha256"
PIECE = 32 << 20
HASH_THREADS = max(1, min(8, os.cpu_count() or 1))
CHUNK = 8 << 20  # bytes read per call when hashing a whole file in one pass
WRITEBACK_EVERY = 256 << 20  # with ``start_writeback``: the disk is asked to write each this many bytes


def _sync_file_range():
    """libc's ``sync_file_range`` (Linux), or None: it starts the disk writing a file range without
    waiting for it."""
    try:
        fn = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True).sync_file_range
    except (OSError, AttributeError, TypeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    return fn


_SYNC_FILE_RANGE = _sync_file_range()
SYNC_FILE_RANGE_WRITE = 2


def address(data) -> int:
    """Where the bytes of a buffer (torch.save hands the storages' own memory, read-only) begin."""
    return int(numpy.frombuffer(data, dtype=numpy.uint8).ctypes.data)


class TrackedFile:
    """Write-only file object for torch.save: each write goes to the file and, once it returned (the
    bytes are the kernel's), ``on_written(address, nbytes)`` hears of the memory it read. It has no
    ``fileno``, so torch.save writes everything through ``write``. With ``start_writeback`` the disk
    is asked to start writing every ``WRITEBACK_EVERY`` bytes (where the OS offers it)."""

    def __init__(self, path, on_written: Optional[Callable[[int, int], None]] = None, start_writeback: bool = False):
        self.path = path
        self._f = open(path, "wb")
        self.on_written = on_written
        self.nbytes = 0
        self.os_error = None  # the first OSError, which torch may re-raise as something vaguer
        self._writeback = start_writeback and _SYNC_FILE_RANGE is not None
        self._kicked = 0  # bytes the disk was asked to write so far

    def write(self, data):
        view = memoryview(data)
        try:
            n = self._f.write(view)
        except OSError as e:
            self.os_error = self.os_error or e
            raise
        self.nbytes += view.nbytes
        if self.on_written is not None and view.nbytes:
            self.on_written(address(view), view.nbytes)
        if self._writeback and self.nbytes - self._kicked >= WRITEBACK_EVERY:
            self._f.flush()
            # best effort: a failure here only means the final fsync has more to do
            _SYNC_FILE_RANGE(self._f.fileno(), self._kicked, self.nbytes - self._kicked, SYNC_FILE_RANGE_WRITE)
            self._kicked = self.nbytes
        return n

    def flush(self):
        self._f.flush()

    def close(self):
        try:
            self._f.close()  # flushes the buffer: ENOSPC/EFBIG may surface only here
        except OSError as e:
            self.os_error = self.os_error or e
            raise


def serialize(path, obj, zipfile: bool, on_written: Optional[Callable[[int, int], None]] = None,
              start_writeback: bool = False) -> int:
    """torch.save ``obj`` to ``path.tmp`` (into the page cache, the disk started on it with
    ``start_writeback``); its size."""
    f = TrackedFile(f"{path}.tmp", on_written, start_writeback)
    try:
        try:
            torch.save(obj, f, _use_new_zipfile_serialization=zipfile)
        finally:
            f.close()
    except BaseException as e:  # noqa: B902 - torch turns a failed write into "unexpected pos ..."
        if f.os_error is not None:
            raise f.os_error from e
        raise
    return f.nbytes


def fsync_file(path):
    with open(path, "rb+") as f:
        os.fsync(f.fileno())


def publish(path, before_rename: Optional[Callable[[str], None]] = None):
    """Flush ``path.tmp`` to disk and rename it to ``path``: the file appears whole or not at all."""
    tmp = f"{path}.tmp"
    fsync_file(tmp)
    if before_rename is not None:
        before_rename(path)
    os.replace(tmp, path)


def fsync_dir(path):
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path, data: bytes):
    tmp = f"{path}.tmp"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(path) or ".")


def read_text(path) -> Optional[str]:
    """The file's text, or None if it cannot be read."""
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def read_json(path) -> Optional[dict]:
    """The file's JSON object, or None if it is missing, unreadable, torn or not an object."""
    text = read_text(path)
    if text is None:
        return None
    try:
        value = json.loads(text)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def file_digest(path, algorithm: str = DIGEST) -> str:
    """The file's ``algorithm`` digest (``DIGEST``, or ``WHOLE`` for files of earlier versions); a
    ValueError for any other name."""
    if algorithm == DIGEST:
        return _pieces_digest(path)
    if algorithm != WHOLE:
        raise ValueError(f"unknown digest {algorithm!r} (written by a newer deepspeed-offload?)")
    h = hashlib.new(WHOLE)
    buf = bytearray(CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while True:
            n = f.readinto(buf)
            if not n:
                break
            h.update(view[:n])
    return h.hexdigest()


def _pieces_digest(path) -> str:
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size

        def piece(offset):
            h = hashlib.new(WHOLE)
            end = min(size, offset + PIECE)
            while offset < end:
                data = os.pread(fd, end - offset, offset)
                if not data:
                    raise OSError(f"{path} ended at byte {offset} while being hashed (it was {size} bytes)")
                h.update(data)
                offset += len(data)
            return h.digest()

        pieces = map_in_threads(piece, range(0, size, PIECE), HASH_THREADS)
    finally:
        os.close(fd)
    return hashlib.new(WHOLE, b"".join(pieces)).hexdigest()


def map_in_threads(fn: Callable, items: Sequence, threads: int) -> List:
    """``[fn(x) for x in items]``, computed by up to ``threads`` threads (the caller's among them).
    Plain threads, not an executor: the writer goes on at interpreter exit, when concurrent.futures
    refuses new work. Where no thread can be started, the caller's thread does it all. Raises the
    first error."""
    items = list(items)
    results, errors = [None] * len(items), []
    todo, lock = iter(range(len(items))), threading.Lock()

    def work():
        while not errors:
            with lock:
                k = next(todo, None)
            if k is None:
                return
            try:
                results[k] = fn(items[k])
            except BaseException as e:  # noqa: B902 - raised by the caller
                errors.append(e)

    helpers = []
    for _ in range(min(threads, len(items)) - 1):
        t = threading.Thread(target=work, name="deepspeed-offload-hash", daemon=True)
        try:
            t.start()
        except RuntimeError:  # the interpreter is past starting threads
            break
        helpers.append(t)
    work()
    for t in helpers:
        t.join()
    if errors:
        raise errors[0]
    return results


def remove(path):
    """Remove the file if it is there."""
    try:
        os.remove(path)
    except OSError:
        pass
