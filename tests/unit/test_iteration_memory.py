"""IterationMemory: what an iteration needs beside the state, predicted for an input before its forward
runs; DeviceMemory: the iteration's peak kept across the load policy's resets."""

import pytest

from deepspeed_offload.runtime.memory.iteration_memory import MAX_SIZES, DeviceMemory, IterationMemory


def test_one_size_seen_grows_quadratically_and_never_below_what_was_measured():
    """Before a second size is seen, the first larger input may be a longer sequence under an attention
    that materializes its scores: 4x the tokens is up to 16x the growth, and a give-back sized for 4x
    would be an out-of-memory error."""
    m = IterationMemory()
    assert m.predict(100) is None  # nothing measured: no prediction
    m.add(100, base=50, growth=200, slack=10)
    assert m.predict(100) == 50 + 200 + 10
    assert m.predict(50) == 50 + 200 + 10  # a smaller input: at most what was measured, never less
    assert m.predict(300) == 50 + 200 * 9 + 10  # with the square of the input (power 2)
    assert m.predict(400) == 50 + 200 * 16 + 10


def test_the_sizes_kept_are_bounded_and_the_largest_ones():
    """Variable-length batches: one sample per distinct size would grow for ever. The largest sizes are
    kept; a smaller input's prediction comes from a larger one, never below what was measured for it."""
    m = IterationMemory()
    for n in range(1, 1001):
        m.add(n, base=0, growth=10 * n)
    assert len(m.growth) == len(m.slack) == MAX_SIZES and min(m.growth) == 1001 - MAX_SIZES
    assert m.predict(5) == 10 * 1000  # from the sizes above it (all of them kept), more than its own 50
    assert m.predict(1000) == 10 * 1000


@pytest.mark.parametrize("power", [1.0, 1.5, 2.0])
def test_two_sizes_give_the_power_and_it_stays_between_one_and_two(power):
    m = IterationMemory()
    m.add(100, base=0, growth=1000)
    m.add(200, base=0, growth=int(1000 * 2 ** power))
    assert m.power() == pytest.approx(power, rel=1e-3)
    assert m.predict(400) == pytest.approx(1000 * 4 ** power, rel=1e-3)
    m.add(400, base=0, growth=int(1000 * 4 ** power) * 8)  # faster than quadratic: clamped at 2
    assert m.power() == 2.0


def test_the_largest_sizes_slack_is_added_and_an_inflated_one_is_not():
    m = IterationMemory()
    m.add(200, base=0, growth=200, slack=30)
    m.add(100, base=0, growth=100, slack=500)  # a small input after a large one: the cache inflates its slack
    assert m.predict(200) == 230 and m.predict(400) == 400 + 30


def test_fragmentation_met_while_growing_is_kept_for_larger_inputs():
    """A 7B at batch 12 ran out of memory with 10.6 GiB reserved and free in pieces, where batch 11 (its
    cache emptied by a give-back before its forward) had measured little slack and batch 8 much."""
    m = IterationMemory()
    m.add(100, base=0, growth=100, slack=900)  # the first step of a size: one-off allocations, not counted
    m.add(100, base=0, growth=100, slack=70)  # the largest until then: its slack counts
    m.add(150, base=0, growth=150, slack=5)  # right after a give-back emptied the cache
    m.add(150, base=0, growth=150, slack=5)
    assert m.predict(150) == 150 + 70 and m.predict(300) == 300 + 70


class Counters:
    """An accelerator's peak statistics."""

    def __init__(self):
        self.allocated = self.peak = self.reserved = self.peak_reserved = 0

    def alloc(self, n):
        self.allocated += n
        self.peak = max(self.peak, self.allocated)
        self.reserved = max(self.reserved, self.allocated)
        self.peak_reserved = max(self.peak_reserved, self.reserved)

    def memory_allocated(self):
        return self.allocated

    def max_memory_allocated(self):
        return self.peak

    def max_memory_reserved(self):
        return self.peak_reserved

    def reset_peak_memory_stats(self):
        self.peak, self.peak_reserved = self.allocated, self.reserved


def test_the_window_keeps_the_peak_across_the_load_policys_resets():
    acc = Counters()
    mem = DeviceMemory(acc)
    acc.alloc(10)
    assert mem.open_window() == 10
    acc.alloc(90)  # 100: the iteration's peak
    acc.alloc(-60)
    mem.reset_peak_memory_stats()  # the load policy, measuring, resets at a gradient hook
    acc.alloc(20)
    assert mem.window_peak() == 100 and acc.max_memory_allocated() == 60
    assert mem.window_reserved() == 100
    mem.open_window()
    assert mem.window_peak() == 60


def test_the_step_line_says_one_number_per_thing():
    from deepspeed_offload.runtime.step.stats import StepStats
    stats = StepStats(copies=None)
    stats.offloaded, stats.resident, stats.speculated, stats.committed = 40, 122, 40, 40
    stats.bytes_h2d = stats.bytes_d2h = 3 * 2**30
    stats.step_s, stats.iteration_s = 0.5, 7.0
    line = stats.line(20, host_store=117 * 2**30, allocated=80 * 2**30, reserved=130 * 2**30)
    assert line.startswith("[deepspeed-offload] step 20: iteration 7.000 s, step 0.500 s, copy wait 0.000 s")
    assert "122 resident, 40 streamed" in line and "40 speculated, 40 committed, 0 rolled back" in line
    assert "host store 117.00 GiB" in line and "80.00 GiB allocated, 130.00 GiB reserved" in line
