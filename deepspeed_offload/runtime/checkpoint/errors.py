"""The two errors an asynchronous checkpoint raises, and how an OS error is put into words.

Both are raised on every rank at once (the ranks agree first, agreement.py), and their messages
name the rank, the path and the cause, so that a log line alone says what to fix.
"""

import errno
import os


class CheckpointWriteError(RuntimeError):
    """An asynchronous checkpoint could not be written or committed (raised on every rank)."""


class CheckpointLoadError(RuntimeError):
    """A checkpoint this package wrote is incomplete, mixed across saves or damaged (raised on every
    rank, before DeepSpeed's loader reads anything)."""


def describe_os_error(e: BaseException, path: str) -> str:
    """``No space left on device (ENOSPC): <path>``: the errno's text first, then the path. Our own
    errors (which name their paths) as they are; anything else with its type and ``path``."""
    if isinstance(e, OSError) and e.errno is not None:
        return f"{os.strerror(e.errno)} ({errno.errorcode.get(e.errno, e.errno)}): {getattr(e, 'filename', None) or path}"
    if isinstance(e, (CheckpointWriteError, TimeoutError)):
        return str(e)
    return f"{e!r} ({path})"
