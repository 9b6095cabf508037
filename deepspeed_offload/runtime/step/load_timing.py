"""When offloaded sub-groups load: one policy object, asked by stream mode and compile mode alike.

Four ways a sub-group reaches the device before DeepSpeed updates it:

- **early**, during the boundary micro-batch's backward, into buffers of its own (stream mode with
  ``overlap``): as much as fits *without raising the iteration's peak*;
- **prefetch**, the step's first streamed sub-groups into the two staging slots when backward
  begins (``prefetch``, when early loads are off or not yet allowed), or else when DeepSpeed's step
  begins, so that they load while it computes the gradient norm (``step_begins``);
- **at the step's entry**, after the slots, into buffers of their own (``entry_allowance``: what
  the measured step leaves below the peak), so that the link keeps loading through the norm;
- **in the step**, through the slots, each load started as a sub-group before it leaves its place.

Sub-groups compile mode keeps on the device (``kept``) are never prefetched into a slot (they would
leave with it) and, found on the host when the step begins, load into buffers of their own then.

The peak. Backward's memory is not monotone: gradient checkpointing recomputes a layer's activations
before its gradients, and the loss's backward comes first; the step adds its slots and fp32
gradients. So the room for early loads at a point of backward is not "the peak less what is
allocated now" but "the peak less the most the rest of the iteration will allocate". The policy
learns both from one iteration that loads nothing early (the second after attach: the first
creates the optimizer's lazy state): its peak ``peak_off`` (what the iteration reaches with
``overlap`` off) and, for every gradient hook of its boundary backward, the highest allocation from
that hook to the step's end (``future[k]``), read from the device's peak statistics, which it resets
at each hook of that iteration. From then on, at hook ``k`` early loads may hold
``peak_off - future[k]`` bytes in all, so the iteration's peak stays at ``peak_off``: a table
lookup per hook, no device query. ``overlap_memory_gb`` caps that further, and the measured plan
may take ``held_back`` bytes off every allowance (where the allocator reserves too much around them).
On the CPU accelerator (no device memory of its own) there is nothing to measure and no limit. Loading nothing early, the
measured iteration prefetches the step's first sub-groups into the slots (as many as they take) as its backward begins
(``prefetch``) and holds them to the step; later iterations take them when the step begins, so the
slots are taken out of its backward's figures (``prefetched``): they count in ``peak_off`` and in the
step's figure, where every iteration holds them, not in what the rest of backward allocates. The
step's figure starts where the step does, before DeepSpeed's norm (whose temporaries meet the slots).

The table holds for iterations like the measured one, and for smaller inputs (what the rest of a
smaller iteration allocates is less, so it stays below the measured peak). Before a training forward
whose input is larger than the one it was measured on (``forward_input``), at every budget, the
iteration is measured again: it loads nothing early, holds what the measured one held, and its figures
hold from then on. Each later boundary backward is checked
against it: the memory allocated when it begins (more activations: a layer first used now, a longer
sequence) and, hook by hook, which parameter's gradient arrives (a router that picks other experts, a
layer unfrozen or first used). On the first difference the backward **diverges**: what was loaded
early is dropped (``take_divergence``, stream mode unloads it), nothing more loads in it, and the
next iteration is measured again (without early loads) before they resume. (What differs before
the first hook that shows it, a recompute of the layer that hook is for, can still meet early loads
made under the old table.) The measured plan (placement.py) also reads each measurement: the
iteration's reserved peak.
"""

import math
from typing import Iterable, List, Optional

# Prefetch into the slots only if the peak seen so far plus both slots fits in this share of the card.
PREFETCH_SHARE = 0.9
# The iteration that is measured: the one that ends with this step (1-based).
MEASURED_STEP = 2
# A boundary backward that begins with more than this allocated beyond the measured iteration diverges.
LEVEL_TOLERANCE = 16 * 2**20


def hook_key(param) -> int:
    """Which parameter a gradient hook is for: ZeRO-3's id of it (Python's id for anything else)."""
    return getattr(param, "ds_id", None) if getattr(param, "ds_id", None) is not None else id(param)


class LoadTiming:

    def __init__(self, acc, synchronous: bool, slot_bytes: int, early_in_backward: bool, prefetch: bool,
                 early_cap: Optional[int] = None):
        self.acc = acc
        self.synchronous = synchronous
        self.slot_bytes = slot_bytes
        self.early_in_backward = early_in_backward
        self.prefetch = prefetch
        self.early_cap = early_cap  # overlap_memory_gb in bytes; None: derived
        self.held_back = 0  # bytes taken off every allowance (the measured plan, placement.py)
        self.kept = frozenset()  # sub-groups that stay on the device between steps (compile mode)
        self.steps = 0  # steps that ran to their end
        self.peak_off: Optional[int] = None  # the measured iteration's peak (no early loads)
        self.future: List[int] = []  # per hook of its boundary backward: the highest allocation after it
        self.future_in_backward: List[int] = []  # ... to the end of backward (the step left out)
        self.step_figure: Optional[int] = None  # the highest allocation in its step
        self.peak_reserved: Optional[int] = None  # ... and its reserved peak
        self.level: Optional[int] = None  # allocated when its boundary backward began
        self.keys: List[int] = []  # which parameter each hook of its boundary backward was for
        self.measure_always = False  # measure even where no early loads need it (the measured plan)
        self.level_tolerance = LEVEL_TOLERANCE
        self.measurements = 0  # measurements finished
        self.divergences = 0  # boundary backwards that differed from the measured one
        self.out_of_memory_stops = 0  # ... or where an early load found no device memory
        self.measured_for = 0  # the largest forward input of the iteration measured last (elements)
        self.larger_inputs = 0  # measurements started before a forward larger than that
        self._input = 0  # the largest forward input of this iteration so far
        self._measuring = False
        self._intervals: List[int] = []  # the measured iteration's peaks between its hooks
        self._prefetched = 0  # bytes it holds in the slots from its backward's start (``prefetched``)
        self._reserved = 0  # the measured iteration's reserved peak so far
        self._hook = -1  # gradient hooks seen in this boundary backward
        self._boundary = False
        self._stepping = False  # between step_begins and step_ends (or step_skipped)
        self._diverged = False  # this boundary backward differs from the measured one
        self._released = True  # its divergence has been acted on (take_divergence)

    # ------------------------------------------------------------------ events

    def backward_begins(self, boundary: bool) -> bool:
        """A backward starts. Returns whether to prefetch the first streamed sub-groups into the
        slots now (``prefetch``, on the boundary micro-batch, when no early loads will come)."""
        self._boundary = boundary
        self._hook = -1
        if not boundary:
            return False
        self._interval()  # forward (and the earlier micro-batches)
        if self._measuring:
            self.level, self.keys = self.acc.memory_allocated(), []
        elif self._guarding() and self.acc.memory_allocated() > self.level + self.level_tolerance:
            self._diverge()
        if not self.prefetch or self.allowance() is not None:
            return False
        if self.synchronous:
            return True
        return self.acc.max_memory_allocated() + 2 * self.slot_bytes <= PREFETCH_SHARE * self.acc.total_memory()

    def forward_input(self, numel: int):
        """A training forward of this iteration takes an input of ``numel`` elements. Larger than the
        measured iteration's, while allowances come from a measurement: this iteration is measured (it
        loads nothing early), before its forward allocates anything (at any budget; the measured plan's
        give-back, placement.py, asks the same)."""
        self._input = max(self._input, numel)
        if numel > self.measured_for and self.future and not self._measuring and self._measurable():
            self.larger_inputs += 1
            self.remeasure()

    def prefetched(self, nbytes: int):
        """The caller loaded ``nbytes`` into the slots as this backward began (``backward_begins`` said
        so), held to the step. Iterations with early loads never prefetch: the measurement takes them
        out of what the rest of its backward allocates."""
        if self._measuring and self._boundary:
            self._prefetched = nbytes

    def gradient_ready(self, param=None) -> Optional[int]:
        """A gradient hook of backward ran for ``param`` (and freed what it frees). Returns the bytes
        early loads may hold in all from now on, or None when none may load now."""
        if not self._boundary:
            return None
        self._hook += 1
        self._interval()
        key = hook_key(param)
        if self._measuring:
            self.keys.append(key)
        elif self._guarding() and not self._diverged and (self._hook >= len(self.keys) or self.keys[self._hook] != key):
            self._diverge()
        return self.allowance()

    def _guarding(self) -> bool:
        """The allowances come from a measurement (not a fixed cap): they hold only for like iterations."""
        return bool(self.future) and self.early_in_backward and self.early_cap is None

    def _diverge(self):
        self._diverged, self._released = True, False
        self.divergences += 1

    def out_of_memory(self):
        """An early load (or an update in backward) found no device memory: this backward loads nothing
        more, as a diverging one (the caller gives back what was loaded), and the next iteration is
        measured again."""
        self.out_of_memory_stops += 1
        if not self._diverged:
            self._diverge()
        self._released = True  # (the caller gives back now)

    def take_divergence(self) -> bool:
        """Whether this backward just diverged from the measured one (once): the caller unloads what
        was loaded early."""
        if self._released:
            return False
        self._released = True
        return True

    def shift(self, nbytes: int):
        """The state resident on the device changed by ``nbytes`` (the measured plan): every figure of the
        measured iteration moves with it (the allowances stay the same)."""
        if self.peak_off is not None:
            self.peak_off += nbytes
            self.future = [f + nbytes for f in self.future]
            self.future_in_backward = [f + nbytes for f in self.future_in_backward]
            self.step_figure += nbytes
            self.level += nbytes
            self.peak_reserved += nbytes

    def remeasure(self):
        """Measure the next iteration (without early loads) before they resume."""
        self.future, self.future_in_backward = [], []
        self._start_measurement()

    def step_begins(self) -> bool:
        """DeepSpeed's step begins, before it computes the gradient norm (``StreamMode.step_entered``;
        its first sub-group calls this again, a no-op then). Returns whether the step's first
        streamed sub-groups may load into the slots now, beside the norm's work (``prefetch``): after
        a measurement, always (from here on the measured step's figure counts the slots, so the
        allowances kept room for them); else if the peak seen so far plus both slots fits in
        ``PREFETCH_SHARE`` of the device."""
        if self._stepping:
            return False
        self._stepping, self._boundary = True, False
        self._interval()  # the tail of backward
        if not self.prefetch:
            return False
        if self.synchronous or (self.future and not self._diverged):
            return True
        return self.acc.max_memory_allocated() + 2 * self.slot_bytes <= PREFETCH_SHARE * self.acc.total_memory()

    def step_ends(self):
        """The step wrote everything back (or left it where it stays): one iteration done."""
        self.steps += 1
        self._stepping = False
        if self._measuring:
            self.measured_for = self._input
        self._input = 0
        if self._measuring:
            self._interval()
            self._finish_measurement()
        elif (self.steps == MEASURED_STEP - 1 or self._diverged) and self._measurable():
            self.remeasure()
        self._diverged = False

    def step_skipped(self):
        """DeepSpeed skipped the step (overflow, non-finite norm): a measurement of it is void."""
        self._stepping = False
        if self._measuring:
            self._start_measurement()  # measure the next iteration instead
        self._diverged = False
        self._input = 0

    # ------------------------------------------------------------------ decisions

    def allowance(self) -> Optional[int]:
        """Bytes early loads may hold in all at the current point of backward; None: none now."""
        if not self.early_in_backward or not self._boundary or self._diverged:
            return None
        cap = math.inf if self.early_cap is None else self.early_cap
        if self.synchronous:
            return cap
        if self.early_cap is not None:
            return max(0, cap - self.held_back)
        if not self.future:
            return None  # not measured yet: this iteration behaves as with overlap off
        k = min(max(self._hook, 0), len(self.future) - 1)
        return max(0, self.peak_off - self.future[k] - self.held_back)

    def largest_allowance(self) -> float:
        """The most early loads may hold at any point of a backward like the measured one (0 before a
        measurement)."""
        if self.early_cap is not None:
            return self.early_cap
        return max((self.peak_off - f for f in self.future), default=0)

    def backward_allowance(self) -> Optional[float]:
        """``allowance`` split in two, for a caller that knows what of its early loads outlasts backward
        (a sub-group updated in backward gives its loaded state back there): the bytes they may hold in
        all until backward ends (the highest allocation of the rest of backward below the peak), and
        ``step_allowance``, what of them may still be held when the step begins. Where the measured
        iteration peaks in its step (a small model: the slots, the fp32 gradients), ``allowance`` is 0
        all through backward while updates in backward would fit."""
        total = self.allowance()
        if total is None or not self.future or self.synchronous or self.early_cap is not None:
            return total
        k = min(max(self._hook, 0), len(self.future_in_backward) - 1)
        return max(0, self.peak_off - self.future_in_backward[k] - self.held_back)

    def step_allowance(self) -> float:
        """Bytes that what was loaded early (and what updates in backward keep) may still hold when the
        step begins: the measured step's figure below the peak (see ``backward_allowance``)."""
        if self.synchronous or self.early_cap is not None:
            return math.inf if self.early_cap is None else max(0, self.early_cap - self.held_back)
        if not self.future or self.step_figure is None:
            return 0
        return max(0, self.peak_off - self.step_figure - self.held_back)

    def entry_allowance(self) -> Optional[float]:
        """Bytes that what the step holds in buffers of their own may reach as it begins, before
        DeepSpeed's norm (``EarlyLoads.at_step_entry``): ``step_allowance``, where early loads run and
        this step's backward was like the measured one; None: none load then."""
        if not self.early_in_backward or self._diverged or not (self.future or self.synchronous or self.early_cap):
            return None
        return self.step_allowance()

    def prefetch_order(self, streamed: Iterable[int]) -> List[int]:
        """What prefetch loads into the slots, in order, as many as they take: the streamed
        sub-groups that are not kept."""
        return [i for i in streamed if i not in self.kept]

    def load_at_step_start(self, on_device) -> List[int]:
        """Kept sub-groups the step finds on the host (a reader of host state wrote them back between
        backward and the step): into buffers of their own at the step's start, so that they stay."""
        return [i for i in sorted(self.kept) if not on_device(i)]

    # ------------------------------------------------------------------ measurement

    def _measurable(self) -> bool:
        return (self.measure_always or (self.early_in_backward and self.early_cap is None)) and not self.synchronous

    @property
    def measuring(self) -> bool:
        return self._measuring

    def _start_measurement(self):
        self._measuring = True
        self._intervals = []
        self._reserved = 0
        self._prefetched = 0
        self.acc.reset_peak_memory_stats()

    def _interval(self):
        """Close the interval since the last one: its peaks, then the statistics reset."""
        if self._measuring:
            self._intervals.append(self.acc.max_memory_allocated())
            self._reserved = max(self._reserved, self.acc.max_memory_reserved())
            self.acc.reset_peak_memory_stats()

    def _finish_measurement(self):
        self._measuring = False
        self.measurements += 1
        self.peak_reserved = self._reserved
        hooks = self._hook + 1 if self._hook >= 0 else 0
        intervals = self._intervals
        self.peak_off = max(intervals)
        # intervals: [forward, hook 0], then one after each hook, the tail of backward, the step.
        # future[k]: the highest allocation after hook k, to the step's end.
        after = intervals[2:]  # the intervals after hook 0
        # Backward's (all but the step's) without the slots it prefetched: later iterations load early
        # instead, and take the slots only in the step.
        after = [max(0, peak - self._prefetched) for peak in after[:-1]] + after[-1:]
        self.future = _suffix_max(after)[:hooks] if hooks else []
        self.future_in_backward = _suffix_max(after[:-1])[:hooks] if hooks else []
        self.future_in_backward += self.future[len(self.future_in_backward):]  # (no tail measured: the step's)
        self.step_figure = after[-1] if after else self.peak_off


def _suffix_max(peaks: List[int]) -> List[int]:
    """``out[k]``: the highest of ``peaks[k:]``."""
    suffix, running = [], 0
    for peak in reversed(peaks):
        running = max(running, peak)
        suffix.append(running)
    suffix.reverse()
    return suffix
