"""What an iteration needs on the device beside the optimizer state, as a function of its input.

The measured plan (``placement.py``) keeps resident the state that fits below the device limit
beside the iteration. An iteration whose input is larger (a longer sequence, a larger batch: RL
rollouts, packed SFT, a curriculum) needs more, and a plan that learns it only after the iteration
ran out of memory has learned it too late. So the plan asks, before each training forward, what an
input of that size will need, and gives state back first where it would not fit.

``IterationMemory`` learns it from the steps that ran. Each applied step gives one sample: the
largest forward input (elements of its largest tensor, ``hooks.input_numel``), what was allocated
when that forward began less the resident state (``base``: the 16-bit partitions, buffers, what
survives from step to step), and the peak allocated from there to the step's end (``growth``:
activations, gradients, the step's temporaries). The growth is fitted as ``growth(n) = g * (n /
n0) ** p`` through the largest input seen (``n0``, its largest growth ``g``); ``p`` is measured from
the two largest distinct inputs, between 1 (activations in proportion to the tokens) and 2 (an
attention that materializes its scores), and 2 while only one size was seen: the first larger input
may be a longer sequence under such an attention (4x the tokens, 16x its scores), and a give-back
too small for it is an out-of-memory error, where one too large costs a take-back later. (An input
that trades batch for sequence at the same elements can still grow faster than that; the element
count does not tell them apart.) Only the ``MAX_SIZES`` largest sizes are kept: variable-length
batches (RL rollouts, packed SFT) would otherwise add one entry per length for ever; a size
dropped is predicted from a larger one's growth, never less. Inputs at or under
``n0`` need at most ``g``: the prediction never goes below what was measured. The caching allocator
reserves more than it hands out (blocks cut to size, a 7B's iteration held 9 GiB more reserved than
allocated at its peak); the prediction adds what a step reserved beyond its allocated peak
(``slack``), since running out of memory is a matter of what can be reserved: the most any step
reserved of those whose input was the largest seen until then, the first step of each size aside.
(A smaller input after a larger one finds the larger one's blocks cached, a first step at a size what
earlier steps or a give-back left in the cache: their slack is not counted. A larger input is not
spared the fragmentation a smaller one met: a 7B at batch 12 ran out of memory with 10.6 GiB
reserved and free in pieces, after batch 11 had measured little.)

``DeviceMemory`` reads the device's counters for everyone that needs a peak: the load policy resets
the peak statistics at every gradient hook of the iteration it measures, and the iteration's own peak
must survive those resets.
"""

import math
from dataclasses import dataclass, field
from typing import Dict, Optional

# The exponent of growth with the input that the fit allows (MAX_POWER: before two sizes were seen).
MIN_POWER, MAX_POWER = 1.0, 2.0
# Input sizes whose samples are kept (the largest ones).
MAX_SIZES = 32


class DeviceMemory:
    """The accelerator's memory counters, with the window of one iteration's peak kept across the
    resets the load policy makes (``reset_peak_memory_stats``). Has the accelerator's method names, so
    the load policy reads it as it reads the accelerator."""

    def __init__(self, acc):
        self.acc = acc
        self._window_peak = self._window_reserved = 0

    def memory_allocated(self) -> int:
        return int(self.acc.memory_allocated())

    def memory_reserved(self) -> int:
        return int(self.acc.memory_reserved() or 0)

    def max_memory_allocated(self) -> int:
        return int(self.acc.max_memory_allocated())

    def max_memory_reserved(self) -> int:
        return int(self.acc.max_memory_reserved())

    def total_memory(self) -> int:
        return int(self.acc.total_memory())

    def available_memory(self) -> int:
        return int(self.acc.available_memory())

    def empty_cache(self):
        self.acc.empty_cache()

    def reset_peak_memory_stats(self):
        self._window_peak = max(self._window_peak, self.max_memory_allocated())
        self._window_reserved = max(self._window_reserved, self.max_memory_reserved())
        self.acc.reset_peak_memory_stats()

    def open_window(self) -> int:
        """A new window of the peak begins here; returns what is allocated now."""
        self.reset_peak_memory_stats()
        self._window_peak = self._window_reserved = 0
        return self.memory_allocated()

    def window_peak(self) -> int:
        """The highest allocation since ``open_window``."""
        return max(self._window_peak, self.max_memory_allocated())

    def window_reserved(self) -> int:
        """The most reserved since ``open_window``."""
        return max(self._window_reserved, self.max_memory_reserved())


@dataclass
class IterationMemory:
    """Samples of (input elements -> device memory the iteration needs beside the resident state)."""
    growth: Dict[int, int] = field(default_factory=dict)  # input elements -> largest growth seen
    slack: Dict[int, int] = field(default_factory=dict)  # input elements -> reserved beyond the allocated peak
    base: int = 0  # the last step's base (allocated at its forward's start, less the resident state)
    top_slack: int = 0  # the most slack of a step whose input was the largest seen until then (not its size's first)

    def add(self, numel: int, base: int, growth: int, slack: int = 0):
        if numel <= 0:
            return
        self.base = max(0, base)
        if numel >= self.largest and numel in self.growth:  # (the first step of a size: what the cache made of it)
            self.top_slack = max(self.top_slack, slack)
        self.growth[numel] = max(self.growth.get(numel, 0), max(0, growth))
        self.slack[numel] = max(0, slack)
        if len(self.growth) > MAX_SIZES:
            smallest = min(self.growth)
            del self.growth[smallest], self.slack[smallest]

    @property
    def largest(self) -> int:
        return max(self.growth, default=0)

    def power(self) -> float:
        sizes = sorted(self.growth)
        if len(sizes) < 2:
            return MAX_POWER  # one size seen: the steepest the fit allows, until a second size says
        n1, n2 = sizes[-2], sizes[-1]
        g1, g2 = self.growth[n1], self.growth[n2]
        if g1 <= 0 or g2 <= g1:
            return MIN_POWER
        return min(MAX_POWER, max(MIN_POWER, math.log(g2 / g1) / math.log(n2 / n1)))

    def predict(self, numel: int) -> Optional[int]:
        """Bytes an iteration with an input of ``numel`` elements needs beside the resident state
        (base and growth); None before any sample."""
        if not self.growth:
            return None
        n0 = self.largest
        g0 = max(g for n, g in self.growth.items() if n >= min(numel, n0))
        if numel > n0:
            g0 = int(math.ceil(self.growth[n0] * (numel / n0) ** self.power()))
        return self.base + g0 + max(self.slack.get(n0, 0), self.top_slack)
