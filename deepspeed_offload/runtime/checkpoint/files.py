"""File primitives of a save: a file appears whole or not at all, and the host memory it was written
from is free to change as soon as its bytes reached the file.

``serialize`` writes through ``TrackedFile`` into ``<path>.tmp`` and reports each write's source memory
once the write returned (staging.py's ``Regions``: the step may overwrite that part of the host store
then); the digest is taken afterwards from the page cache (``file_digest``), off the step's way;
``publish`` fsyncs and renames into place; ``atomic_write`` does both for the small files (markers,
the journal, ``latest``). What this package reads back it reads as JSON.
"""

import hashlib
import json
import os
from typing import Callable, Optional

import numpy
import torch

DIGEST = "sha256"
CHUNK = 8 << 20  # bytes read per call when hashing a file


def address(data) -> int:
    """Where the bytes of a buffer (torch.save hands the storages' own memory, read-only) begin."""
    return int(numpy.frombuffer(data, dtype=numpy.uint8).ctypes.data)


class TrackedFile:
    """Write-only file object for torch.save: each write goes to the file and, once it returned (the
    bytes are the kernel's), ``on_written(address, nbytes)`` hears of the memory it read. It has no
    ``fileno``, so torch.save writes everything through ``write``."""

    def __init__(self, path, on_written: Optional[Callable[[int, int], None]] = None):
        self.path = path
        self._f = open(path, "wb")
        self.on_written = on_written
        self.nbytes = 0
        self.os_error = None  # the first OSError, which torch may re-raise as something vaguer

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
        return n

    def flush(self):
        self._f.flush()

    def close(self):
        try:
            self._f.close()  # flushes the buffer: ENOSPC/EFBIG may surface only here
        except OSError as e:
            self.os_error = self.os_error or e
            raise


def serialize(path, obj, zipfile: bool, on_written: Optional[Callable[[int, int], None]] = None) -> int:
    """torch.save ``obj`` to ``path.tmp`` (into the page cache); its size."""
    f = TrackedFile(f"{path}.tmp", on_written)
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


def file_digest(path) -> str:
    h = hashlib.new(DIGEST)
    buf = bytearray(CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while True:
            n = f.readinto(buf)
            if not n:
                break
            h.update(view[:n])
    return h.hexdigest()


def remove(path):
    """Remove the file if it is there."""
    try:
        os.remove(path)
    except OSError:
        pass
