"""File primitives of a save: a file appears whole or not at all, and its digest costs no re-read.

``serialize`` writes through ``DigestingFile`` (sha256 of every byte on its way to disk) into
``<path>.tmp``; ``publish`` fsyncs it and renames it into place; ``atomic_write`` does both for the
small files (markers, the journal, ``latest``). What this package reads back it reads as JSON.
"""

import hashlib
import json
import os
from typing import Callable, Dict, Optional

import torch

DIGEST = "sha256"
CHUNK = 8 << 20  # bytes read per call when re-hashing a file


class DigestingFile:
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


def serialize(path, obj, zipfile: bool) -> Dict[str, object]:
    """torch.save ``obj`` to ``path.tmp`` (into the page cache); its size and digest."""
    f = DigestingFile(f"{path}.tmp")
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
