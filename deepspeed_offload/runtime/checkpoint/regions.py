"""Byte ranges a save still reads, and the wait of whoever is about to overwrite them.

A save reads host-store ranges (copied aside, or written to its files from the store) and device
ranges (the resident state, copied to the host in the background): each is a ``Regions``, and the
step, before it overwrites a range, waits only while that range is still to be read.
"""

import threading
from typing import List, Optional, Sequence, Tuple


class Regions:
    """The byte ranges a save reads (of the host store, or of the device), and how much of each is
    still to be copied or written: a range may be overwritten once that is none. Thread-safe; ``wait``
    blocks the caller."""

    def __init__(self):
        self._cond = threading.Condition()
        self._spans: List[List[int]] = []  # [start, end, bytes still to copy or write]
        self._open = 0  # spans with bytes still to copy or write

    def add(self, start: int, nbytes: int):
        with self._cond:
            self._spans.append([start, start + nbytes, nbytes])
            self._open += nbytes > 0

    def done(self, start: int, nbytes: int):
        """``nbytes`` from ``start`` were copied aside or reached their file."""
        end = start + nbytes
        with self._cond:
            for span in self._spans:
                overlap = min(end, span[1]) - max(start, span[0])
                if overlap > 0 and span[2]:
                    span[2] = max(0, span[2] - overlap)
                    self._open -= not span[2]
            self._cond.notify_all()

    @property
    def nbytes(self) -> int:
        """Bytes of every range added."""
        with self._cond:
            return sum(span[1] - span[0] for span in self._spans)

    def free(self):
        """Nothing more will be read (the writer finished, or failed)."""
        with self._cond:
            for span in self._spans:
                span[2] = 0
            self._open = 0
            self._cond.notify_all()

    def _pending(self, ranges) -> bool:
        return self._open > 0 and (ranges is None or any(
            span[2] and any(span[0] < a + n and a < span[1] for a, n in ranges) for span in self._spans))

    def pending(self) -> bool:
        """Whether any range is still to be read (no scan: the step asks it for every resident sub-group)."""
        return self._open > 0

    def wait(self, ranges: Optional[Sequence[Tuple[int, int]]] = None, timeout: Optional[float] = None) -> bool:
        """Block until every range of ``ranges`` ((start, bytes); None: all) may be overwritten. False if
        ``timeout`` seconds passed first."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._pending(ranges), timeout)
