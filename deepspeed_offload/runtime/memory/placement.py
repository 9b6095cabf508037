"""The measured plan: which sub-groups keep their state on the device while training runs.

Placement is a number per rank: the first ``resident`` sub-groups (in step order) keep their state
on the device, the rest live in the host store. At attach the node's host plan decides it
(``node_plan.py``); after a measurement (``LoadTiming``'s iteration without early loads, budget
unset, on a device with memory of its own) the plan decides on the iteration after it, the first
that runs as training will (early loads and updates in backward, whose buffers make the allocator
reserve more than the measured iteration did): with that iteration's reserved memory, it keeps
resident as many more of the streamed sub-groups as fit below the device limit
(``max_device_memory_gb``, or what this process can have of the device) less ``MARGIN`` and less
what the largest input of the last ``RECENT_STEPS`` steps needs beyond this one's. Each sub-group
made resident adds its bytes to that figure.

The placement follows the input while training runs. Every applied step teaches ``IterationMemory``
(``iteration_memory.py``) what an iteration needs beside the state for its input's size. Before a
training forward whose input is larger than the placement was made for, ``before_forward`` predicts
its need and, where it does not fit beside the resident state, gives back what the plan made
resident (last first) before the forward runs. When the large inputs leave the recent window, or
``reload_states()`` gives memory back, the plan empties the device's cache and measures again, and
the decision after it takes state back. As a last resort, when an iteration reserves more than the
limit less half the margin (the allocator reserving more around the resident state than its bytes),
the plan gives back enough to restore the margin after the step, widens its margin by what it missed
and measures again. Where the plan has made nothing resident that it could give back, the early loads
give way instead: ``held_back`` bytes come off what they may hold (``LoadTiming.held_back``; all of it:
the iteration of overlap off, which the measurement showed fits), until the inputs shrink or memory
comes back. When it makes room after an iteration (either way) and free pieces of the caching
allocator's segments made the difference, without ``expandable_segments``, it says once how to change
that. ``runtime/step/moves.py`` moves the state, and tells the plan what landed (``landed``) or
failed (``move_failed``); this module only decides, and ``promoted`` counts what landed. What remains: a first iteration
larger than the device allows (nothing has been measured yet), and an input whose need grows faster
than the fit's power of two.
"""

import logging
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, List, Optional, Sequence, Tuple

from deepspeed.utils import log_dist

from ...sizing.host_memory import format_bytes
from . import allocator
from .iteration_memory import IterationMemory
from .layout import fitting_prefix

GiB = 2**30
# Device memory the measured plan leaves free below the limit: the larger of this share and this size.
MARGIN_SHARE = 0.03
MARGIN_MIN = 1 * GiB
# Steps whose largest input the measured plan keeps room for: inputs shrink for this long before
# the state they made room for comes back.
RECENT_STEPS = 32


def margin_bytes(device_total: int) -> int:
    return max(MARGIN_MIN, int(MARGIN_SHARE * device_total))


@dataclass
class MeasuredPlan:
    """After each measurement, which streamed sub-groups become resident (or, when the iteration grew,
    which of those made resident go back to the host). ``limit``: the device memory training may use;
    ``margin``: what the plan leaves free below it (bytes)."""
    limit: int
    margin: int
    promoted: List[int] = field(default_factory=list)  # sub-groups this plan made resident (landed), in step order
    reason: str = ""  # why the last decision moves state (the move's log line)
    decided_peak: Optional[int] = None  # the reserved peak the last decision was made on
    iteration: Optional[int] = None  # ... less the state resident then: what the iteration needs besides it
    give_backs: int = 0  # iterations after which state went back to the host
    take_backs: int = 0  # times the largest recent input shrank below the one the plan was made for
    # what an iteration needs beside the state, by input size (iteration_memory.py)
    needs: IterationMemory = field(default_factory=IterationMemory)
    planned_numel: int = 0  # the largest input the placement was made for (0: the measured one's)
    recent: deque = field(default_factory=lambda: deque(maxlen=RECENT_STEPS))  # the last steps' inputs
    held_back: int = 0  # bytes the early loads may not hold, where nothing was left to give back
    last_reserved: int = 0  # what the last applied step left reserved (before any emptying)
    allocator_hinted: bool = False  # the hint on the allocator's free pieces was logged
    _measurements_seen: int = 0
    _deciding: bool = False  # a measurement finished: decide after the next iteration

    def decide(self, peak_reserved: int, streamed: Sequence[int], nbytes: Callable[[int], int],
                          resident_bytes: int = 0, extra: int = 0) -> Tuple[List[int], List[int]]:
        """The iteration decided on reserved ``peak_reserved`` with ``streamed`` (step order) offloaded and
        ``resident_bytes`` of state resident; ``extra``: what the largest recent input needs beyond its
        input. (Sub-groups to make resident, a prefix of ``streamed`` that fits below the limit less the
        margin and ``extra``, none while early loads are held back; sub-groups to give back, the last
        made resident first, where the peak is above it.)"""
        self.decided_peak = peak_reserved
        self.iteration = peak_reserved - resident_bytes
        room = self.limit - self.margin - peak_reserved - extra
        if room < 0:
            return [], self._make_room(-room, nbytes)
        if self.held_back:
            return [], []  # what holding the early loads back freed is theirs, not the state's
        return fitting_prefix(streamed, nbytes, room), []

    def between_steps(self, mode, step) -> Optional[int]:
        """After ``step`` of ``mode`` (stream mode) was applied: learn what it needed beside the state,
        decide on the iteration after a measurement, or read the memory the iteration reserved, and
        return how many of the first sub-groups should be resident from now on (None: as they are).
        Giving state back empties the device's cache and asks for a measurement; so does the largest
        recent input shrinking below the one the placement was made for (the state may come back);
        holding early loads back empties the cache, and the next iteration is decided on again."""
        probe, resident = mode.probe, len(mode.resident)
        resident_bytes = probe.resident_bytes(resident)
        numel = step.input_numel
        if numel and mode.forward_level is not None:
            peak = mode.memory.window_peak()
            self.needs.add(numel, mode.forward_level - resident_bytes, peak - mode.forward_level,
                            mode.memory.window_reserved() - peak)
            self.recent.append(numel)
        planning = max(self.recent, default=0)
        reserved, held_back = mode.memory.memory_reserved(), self.held_back
        self.last_reserved = reserved
        promote, give_back, decided = [], [], False
        if mode.timing.measurements > self._measurements_seen:
            self._measurements_seen, self._deciding = mode.timing.measurements, True  # decided on the next
        elif self._deciding and not mode.timing.measuring:
            # the iteration after a measurement, on the cache that one left: what training reserves
            self._deciding, decided = False, True
            extra = max(0, (self.needs.predict(planning) or 0) - (self.needs.predict(numel) or 0)) if numel else 0
            promote, give_back = self.decide(reserved, mode.order, probe.nbytes, resident_bytes, extra)
            self.planned_numel = max(planning, numel)
        else:
            give_back = self.after_step(reserved, probe.nbytes)
            if planning and planning < self.planned_numel and not mode.timing.measuring:
                # the large inputs left the window: measure again, and keep what the smaller ones leave room for
                log_dist(f"[deepspeed-offload] measured plan: the largest input of the last {len(self.recent)} steps "
                         f"has {planning:,} elements, below the {self.planned_numel:,} the placement was made for; "
                         "measuring the next iteration to take state back", ranks=[0])
                self.planned_numel = planning
                self.take_backs += 1
                self.held_back = 0  # (the early loads too: what the larger inputs took from them)
                mode.memory.empty_cache()  # the larger iterations' cached blocks would count in the measurement
                mode.timing.remeasure()
        if give_back or self.held_back > held_back:
            self._allocator_hint(reserved, mode.memory.window_peak())
        if self.held_back > held_back:  # (no more than the early loads can hold: past that, overlap off's iteration)
            self.held_back = min(self.held_back, max(held_back, mode.timing.largest_allowance()))
            if self.held_back > held_back and not give_back:
                mode.memory.empty_cache()  # the next iteration, with the early loads held back, on an empty cache
                self._deciding = True
        mode.timing.held_back = self.held_back
        if give_back:
            mode.memory.empty_cache()  # what goes back is the device's again
            mode.timing.remeasure()
        if decided or give_back or self.held_back != held_back:
            self._log(mode, resident + len(promote) - len(give_back), len(self.promoted) + len(promote) - len(give_back))
        self.reason = f"after step {step.index}" + (
            " (the iteration after a measurement)" if decided else " (the iteration reserved more than planned)")
        return resident + len(promote) - len(give_back) if promote or give_back else None

    def landed(self, to_device: Sequence[int], to_host: Sequence[int]):
        """A move landed (``runtime/step/moves.py``): ``to_device`` made resident, ``to_host`` streamed
        again. The one place ``promoted`` changes."""
        gone = set(to_host)
        self.promoted = [i for i in self.promoted if i not in gone] + [i for i in to_device if i not in self.promoted]

    def move_failed(self, mode, nbytes: int):
        """This rank's move of ``nbytes`` of state was undone: the device could not give it that memory
        although the measurement left room (fragmentation, or another process took it). The margin
        widens by it (at most a quarter of the limit), and the next iteration is measured on an empty
        cache before the plan decides again."""
        self.margin = min(self.margin + nbytes, self.limit // 4)
        mode.memory.empty_cache()
        mode.timing.remeasure()

    def memory_returned(self, mode):
        """Device memory came back (``reload_states()`` after a rollout): with the limit derived, it is
        read again (what this process can have now), and the next iteration is measured, after which the
        plan keeps resident what fits again."""
        if mode.cfg.max_device_memory_gb is None:
            self.limit = device_limit(mode.memory, None)
        self.held_back = mode.timing.held_back = 0
        mode.memory.empty_cache()
        mode.timing.remeasure()

    def before_forward(self, mode, numel: int) -> Optional[int]:
        """A training forward is about to take an input of ``numel`` elements: if it is larger than the
        placement was made for and the iteration it predicts (``IterationMemory``) would not fit below
        the limit less the margin beside the resident state, how many of the first sub-groups stay
        resident (the ones this plan made resident go back, last first, as many as needed); None: as
        they are."""
        if numel <= self.planned_numel:
            return None
        need = self.needs.predict(numel)
        self.planned_numel = numel
        if need is None:
            return None
        resident = len(mode.resident)
        excess = need + mode.probe.resident_bytes(resident) - (self.limit - self.margin)
        if excess <= 0:
            return None
        out = self._give_back(excess, mode.probe.nbytes)
        if not out:
            return None
        self.give_backs += 1
        mode.timing.remeasure()  # the allowances were for smaller iterations
        self.reason = (f"before a forward of {numel:,} input elements, larger than planned for (about "
                       f"{format_bytes(need)} needed beside the state)")
        return resident - len(out)

    def _allocator_hint(self, reserved: int, peak_allocated: int):
        """The plan made room (state back to the host, or less for the early loads) because the iteration
        reserved more than planned: where the caching allocator held part of that in free pieces and does
        not map memory as needed, say once how to change it (the pieces are room the plan could keep)."""
        if self.allocator_hinted or allocator.SWITCH.on() or reserved - peak_allocated < self.margin // 2:
            return
        self.allocator_hinted = True
        log_dist(f"[deepspeed-offload] measured plan: the iteration reserved {format_bytes(reserved)} with at most "
                 f"{format_bytes(peak_allocated)} allocated, the rest free pieces of the caching allocator's "
                 "segments, and the plan made room for it (state back to the host, or fewer early loads); "
                 "expandable_segments:True maps memory as it is needed instead, so the plan keeps that room: leave "
                 "the block's expandable_segments at true and PYTORCH_CUDA_ALLOC_CONF without the setting, or "
                 "set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (docs/troubleshooting.md)",
                 ranks=[0], level=logging.WARNING)

    def _log(self, mode, resident: int, made: int):
        limit = "max_device_memory_gb" if mode.cfg.max_device_memory_gb is not None else \
            "what this process could have of the device"
        streamed = mode.probe.total - mode.probe.resident_bytes(resident)
        log_dist(f"[deepspeed-offload] measured plan: {format_bytes(mode.probe.resident_bytes(resident))} of "
                 f"optimizer state resident ({resident} sub-groups, {made} of them since the "
                 f"measurement), {format_bytes(streamed)} streamed; the iteration decided on: "
                 f"{format_bytes(self.decided_peak or 0)} reserved, {format_bytes(self.iteration or 0)} of it besides "
                 f"the state (deepspeed-offload estimate --iteration-memory-gb {(self.iteration or 0) / GiB:.1f} "
                 f"--margin-gb {self.margin / GiB:.1f}); "
                 f"limit {format_bytes(self.limit)} ({limit}) less a margin of {format_bytes(self.margin)}"
                 + (f"; early loads held back by {format_bytes(self.held_back)}" if self.held_back else ""), ranks=[0])

    def after_step(self, reserved: int, nbytes: Callable[[int], int]) -> List[int]:
        """An iteration ended with ``reserved`` bytes reserved: when that came within half the margin of
        the limit (it grew, or the allocator reserved more around the resident state than its bytes),
        the sub-groups to give back, enough to restore the whole margin; and the margin grows by what
        was reserved beyond the plan, so that the next measurement does not make them resident again. With
        nothing made resident to give back, the early loads give way (``held_back``) and the margin stays:
        what the allocator reserved beyond the plan was not around resident state."""
        excess = reserved - (self.limit - self.margin // 2)
        if excess <= 0:
            return []
        if self.promoted:
            self.give_backs += 1
            self.margin = min(self.margin + excess + self.margin // 2, self.limit // 4)
        return self._make_room(excess + self.margin // 2, nbytes)

    def _make_room(self, nbytes_needed: int, nbytes: Callable[[int], int]) -> List[int]:
        """Sub-groups to give back (the last made resident first) for ``nbytes_needed``; what they do not
        cover comes off the early loads (``held_back``)."""
        out = self._give_back(nbytes_needed, nbytes)
        self.held_back += max(0, nbytes_needed - sum(nbytes(i) for i in out))
        return out

    def _give_back(self, nbytes_needed: int, nbytes: Callable[[int], int]) -> List[int]:
        """The last sub-groups made resident that cover ``nbytes_needed`` (``promoted`` changes when the
        move lands)."""
        out, freed = [], 0
        for i in reversed(self.promoted):
            if freed >= nbytes_needed:
                break
            out.append(i)
            freed += nbytes(i)
        return out


def device_limit(acc, max_device_memory_gb: Optional[float]) -> int:
    """The device memory training may use: ``max_device_memory_gb``, or what this process can have of
    the device (what it reserved plus what the device has free), at most the device."""
    total = acc.total_memory()
    if max_device_memory_gb is not None:
        return min(total, int(max_device_memory_gb * GiB))
    return min(total, int(acc.available_memory()) + int(acc.memory_reserved() or 0))
