"""File primitives of a save: a file appears whole or not at all, and the host memory it was written
from is free to change as soon as its bytes reached the file.

``serialize`` writes through ``TrackedFile`` into ``<path>.tmp`` and reports each write's source memory
once the write returned (regions.py's ``Regions``: the step may overwrite that part of the host store
then) and, when asked, starts the disk writing what it has (``sync_file_range``), so the disk is busy
while the file is still being serialized. The digest (sha256 of the file's 32 MiB pieces) is taken
meanwhile: each piece written is read back from the page cache and hashed by worker threads
(``PieceHasher``; ``file_digest`` does the same for a whole file at load), off the step's way;
``publish`` fsyncs and renames into place; ``atomic_write`` does both for the small
files (markers, the journal, ``latest``). What this package reads back it reads as JSON.
"""

import ctypes
import ctypes.util
import hashlib
import json
import os
import queue
import threading
from typing import Callable, Dict, List, Optional

import numpy
import torch

# The digest the markers record: sha256 over the sha256 digests of the file's 32 MiB pieces, in order,
# so that the pieces are hashed by several threads at once (hashlib and os.preadv release the GIL).
# Markers name it ("digest"); "sha256" (the whole file in one pass) is what earlier versions wrote.
DIGEST = "sha256-pieces-32MiB"
WHOLE = "sha256"
PIECE = 32 << 20
HASH_THREADS = max(1, min(8, os.cpu_count() or 1))  # a whole file (at load)
# while a file is written: enough to keep ahead of a disk (~1.2 GB/s a thread), few enough to leave
# the training loop's thread its share of the interpreter
WRITE_HASH_THREADS = min(2, HASH_THREADS)
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


# Each hashing thread reads into one buffer of its own, reused: a fresh bytes object per read would be
# freed (its pages unmapped) with the interpreter's lock held, milliseconds each time, which stalls the
# training loop's thread while a save is written.
_read_buffers = threading.local()


def _read_buffer() -> memoryview:
    view = getattr(_read_buffers, "view", None)
    if view is None:
        view = _read_buffers.view = memoryview(bytearray(CHUNK))
    return view


def _hash_range(fd: int, offset: int, end: int, path) -> bytes:
    h, buf = hashlib.new(WHOLE), _read_buffer()
    while offset < end:
        n = os.preadv(fd, [buf[:min(len(buf), end - offset)]], offset)  # releases the GIL, as update does
        if not n:
            raise OSError(f"{path} ended at byte {offset} while being hashed (it should reach {end})")
        h.update(buf[:n])
        offset += n
    return h.digest()


class PieceHasher:
    """``DIGEST`` of a file, its pieces hashed by worker threads as soon as they are written
    (``written``): while the writer serializes it (read back from the page cache), or all at once
    for a file already written (``file_digest``). Plain threads, not an executor: the writer goes on
    at interpreter exit, when concurrent.futures refuses new work; the pieces no worker took (none
    could start, or the last, partial one) are hashed by ``digest`` in the caller's thread."""

    def __init__(self, path, threads: int = HASH_THREADS):
        self.path = path
        self._fd = os.open(path, os.O_RDONLY)
        self._todo: "queue.SimpleQueue" = queue.SimpleQueue()
        self._done: Dict[int, bytes] = {}
        self._errors: List[BaseException] = []
        self._handed = 0  # pieces handed to the workers
        self._threads = threads
        self._workers: List[threading.Thread] = []

    def _work(self):
        while True:
            k = self._todo.get()
            if k is None:
                return
            if not self._errors:
                try:
                    self._done[k] = _hash_range(self._fd, k * PIECE, (k + 1) * PIECE, self.path)
                except BaseException as e:  # noqa: B902 - raised by digest()
                    self._errors.append(e)

    def written(self, nbytes: int):
        """The file holds its first ``nbytes`` bytes, for good (torch.save only appends)."""
        while self._handed < nbytes // PIECE:
            if len(self._workers) < self._threads:
                t = threading.Thread(target=self._work, name="deepspeed-offload-hash", daemon=True)
                try:
                    t.start()
                    self._workers.append(t)
                except RuntimeError:  # the interpreter is past starting threads: digest() hashes it
                    self._threads = len(self._workers)
            if not self._workers:
                return
            self._todo.put(self._handed)
            self._handed += 1

    def _stop(self):
        for _ in self._workers:
            self._todo.put(None)
        for t in self._workers:
            t.join()
        self._workers = []

    def digest(self, size: int) -> str:
        """The digest of the file, ``size`` bytes long and written whole."""
        self._stop()
        if self._errors:
            raise self._errors[0]
        count = -(-size // PIECE)
        for k in range(count):
            if k not in self._done:
                self._done[k] = _hash_range(self._fd, k * PIECE, min(size, (k + 1) * PIECE), self.path)
        return hashlib.new(WHOLE, b"".join(self._done[k] for k in range(count))).hexdigest()

    def close(self):
        self._stop()
        os.close(self._fd)


class TrackedFile:
    """Write-only file object for torch.save: each write goes to the file and, once it returned (the
    bytes are the kernel's), ``on_written(address, nbytes)`` hears of the memory it read. It has no
    ``fileno`` or ``seek``, so torch.save writes everything through ``write``, in order. The pieces
    written are hashed meanwhile (``PieceHasher``). With ``start_writeback`` the disk is asked to
    start writing every ``WRITEBACK_EVERY`` bytes (where the OS offers it)."""

    def __init__(self, path, on_written: Optional[Callable[[int, int], None]] = None, start_writeback: bool = False):
        self.path = path
        self._f = open(path, "wb")
        self.on_written = on_written
        self.nbytes = 0
        self.os_error = None  # the first OSError, which torch may re-raise as something vaguer
        self._writeback = start_writeback and _SYNC_FILE_RANGE is not None
        self._kicked = 0  # bytes the disk was asked to write so far
        try:
            self.hasher = PieceHasher(path, WRITE_HASH_THREADS)
        except BaseException:
            self._f.close()
            raise

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
        kick = self._writeback and self.nbytes - self._kicked >= WRITEBACK_EVERY
        if kick or self.nbytes // PIECE > (self.nbytes - view.nbytes) // PIECE:
            self._f.flush()  # in the file (not the write buffer) before it is hashed or written out
            self.hasher.written(self.nbytes)
        if kick:  # best effort: a failure here only means the final fsync has more to do
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
              start_writeback: bool = False) -> "tuple[int, str]":
    """torch.save ``obj`` to ``path.tmp`` (into the page cache, the disk started on it with
    ``start_writeback``); its size and ``DIGEST`` (taken from the page cache as it was written)."""
    f = TrackedFile(f"{path}.tmp", on_written, start_writeback)
    try:
        try:
            try:
                torch.save(obj, f, _use_new_zipfile_serialization=zipfile)
            finally:
                f.close()
            return f.nbytes, f.hasher.digest(f.nbytes)
        finally:
            f.hasher.close()
    except BaseException as e:  # noqa: B902 - torch turns a failed write into "unexpected pos ..."
        if f.os_error is not None:
            raise f.os_error from e
        raise


def publish(path, before_rename: Optional[Callable[[str], None]] = None):
    """Flush ``path.tmp`` to disk and rename it to ``path``: the file appears whole or not at all."""
    tmp = f"{path}.tmp"
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())
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
    size = os.path.getsize(path)
    hasher = PieceHasher(path, HASH_THREADS)
    try:
        hasher.written(size)
        return hasher.digest(size)
    finally:
        hasher.close()


def remove(path):
    """Remove the file if it is there."""
    try:
        os.remove(path)
    except OSError:
        pass
