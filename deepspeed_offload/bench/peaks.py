"""Peak device memory over a span in which something else resets the allocator's peak statistics.

The measured plan times its intervals with the accelerator's ``reset_peak_memory_stats`` (the load
policy's measurement, ``runtime/step/load_timing.py``; each step's window, ``DeviceMemory``): a
benchmark that reads ``max_memory_allocated`` at the end of an iteration then sees only the peak since
the runtime's last reset. While ``Peaks.watching()`` is in effect, every reset through the accelerator
first folds the peaks so far into ours, so ``allocated()`` and ``reserved()`` are the span's own.
"""

import contextlib


class Peaks:

    def __init__(self, acc):
        self.acc = acc
        self._allocated = self._reserved = 0
        self._reset = None  # the accelerator's own reset, while watching

    @contextlib.contextmanager
    def watching(self):
        """The accelerator's ``reset_peak_memory_stats`` folds the peaks in first, until the block ends."""
        acc, own = self.acc, "reset_peak_memory_stats" in vars(self.acc)
        self._reset = original = acc.reset_peak_memory_stats

        def reset(*args, **kwargs):
            self._fold()
            return original(*args, **kwargs)

        acc.reset_peak_memory_stats = reset
        try:
            yield self
        finally:
            if own:
                acc.reset_peak_memory_stats = original
            else:
                del acc.reset_peak_memory_stats  # the class's method again
            self._reset = None

    def start(self):
        """A new span begins: the peaks from here on."""
        (self._reset or self.acc.reset_peak_memory_stats)()
        self._allocated = self._reserved = 0

    def allocated(self) -> int:
        """The most allocated since ``start``, in bytes."""
        return max(self._allocated, self.acc.max_memory_allocated())

    def reserved(self) -> int:
        """The most reserved since ``start``, in bytes."""
        return max(self._reserved, self.acc.max_memory_reserved())

    def _fold(self):
        self._allocated, self._reserved = self.allocated(), self.reserved()
