"""LoadTiming: when sub-groups may load ahead of the step. Driven by a fake device whose memory goes
up and down as a checkpointed backward's does, so the peak-keeping can be checked on the CPU."""

import math


from deepspeed_offload.runtime.load_timing import LoadTiming


class FakeDevice:
    """Allocated bytes and their peak since the last reset, as torch's allocator statistics count."""

    def __init__(self, total=1000):
        self.allocated = self.peak = 0
        self.true_peak = 0  # what the test reads: never reset by the policy
        self.total = total

    def alloc(self, n):
        self.allocated += n
        self.peak = max(self.peak, self.allocated)
        self.true_peak = max(self.true_peak, self.allocated)

    def max_memory_allocated(self):
        return self.peak

    def reset_peak_memory_stats(self):
        self.peak = self.allocated

    def total_memory(self):
        return self.total


# One iteration: forward to 100, the loss's backward spikes to 140; then per layer a recompute
# (+40) and its backward freeing 50 (hooks fire after each layer); the step allocates 30 and frees it.
BASE = 20


def iteration(dev, timing, load, layers=3):
    """Runs one iteration against ``timing``; ``load(allowance)`` is what stream mode does at a hook
    (returns the bytes it loads now). Returns the iteration's peak."""
    dev.true_peak = top = dev.allocated
    dev.alloc(80)  # forward
    prefetch = timing.backward_begins(True)
    dev.alloc(40)  # the loss's backward
    dev.alloc(-40)
    early = 0
    for _ in range(layers):
        dev.alloc(40)  # recompute
        dev.alloc(-40 - 80 // layers)  # its backward frees the recompute and the layer's activations
        allowance = timing.gradient_ready()
        if allowance is not None:
            n = load(allowance - early)
            early += n
            dev.alloc(n)
    timing.step_begins()
    dev.alloc(30)  # fp32 gradient of a sub-group, the slots
    dev.alloc(-30 - early)  # written back: the early buffers go
    timing.step_ends()
    assert dev.allocated == top + 80 - 80 // layers * layers
    dev.alloc(-(dev.allocated - top))
    return dev.true_peak, prefetch, early


def fits(room):
    return max(0, min(room, 500))  # as much as the allowance lets in (there are 500 bytes to load)


def test_no_early_loads_until_an_iteration_is_measured_then_the_peak_holds():
    dev = FakeDevice()
    dev.alloc(BASE)
    timing = LoadTiming(dev, synchronous=False, slot_bytes=5, early_in_backward=True, prefetch=True)
    peak1, prefetch1, early1 = iteration(dev, timing, fits)
    peak2, prefetch2, early2 = iteration(dev, timing, fits)  # the measured one
    assert early1 == early2 == 0 and prefetch1 and prefetch2  # overlap off: the slots are prefetched
    assert timing.peak_off == peak2 == BASE + 80 + 40
    assert timing.future == [BASE + 80 - 26 + 40, BASE + 80 - 52 + 40, BASE + 80 - 78 + 30]
    peak3, prefetch3, early3 = iteration(dev, timing, fits)
    assert early3 > 0 and not prefetch3
    assert peak3 <= timing.peak_off  # never above the iteration without early loads


def test_the_old_rule_raised_the_peak():
    """'peak less what is allocated now' at each hook: a recompute after the hook lands on top."""
    dev = FakeDevice()
    dev.alloc(BASE)
    timing = LoadTiming(dev, synchronous=False, slot_bytes=5, early_in_backward=True, prefetch=True)
    iteration(dev, timing, fits)
    iteration(dev, timing, fits)
    peak_off = timing.peak_off
    naive = LoadTiming(dev, synchronous=False, slot_bytes=5, early_in_backward=True, prefetch=True)
    naive.peak_off, naive.future = peak_off, [0]  # allowance = peak less nothing still to come

    def now(room):
        return max(0, min(500, peak_off - dev.allocated))

    naive.allowance = lambda: math.inf if naive._boundary else None
    peak, _, early = iteration(dev, naive, now)
    assert early > 0 and peak > peak_off


def test_a_cap_and_the_cpu_need_no_measurement():
    dev = FakeDevice()
    capped = LoadTiming(dev, synchronous=False, slot_bytes=5, early_in_backward=True, prefetch=True, early_cap=30)
    capped.backward_begins(True)
    assert capped.gradient_ready() == 30
    cpu = LoadTiming(dev, synchronous=True, slot_bytes=5, early_in_backward=True, prefetch=True)
    assert not cpu.backward_begins(True) and cpu.gradient_ready() == math.inf
    off = LoadTiming(dev, synchronous=True, slot_bytes=5, early_in_backward=False, prefetch=True)
    assert off.backward_begins(True) and off.gradient_ready() is None


def test_a_skipped_step_voids_the_measurement():
    dev = FakeDevice()
    timing = LoadTiming(dev, synchronous=False, slot_bytes=5, early_in_backward=True, prefetch=True)
    iteration(dev, timing, fits)
    timing.backward_begins(True)
    timing.gradient_ready()
    timing.step_skipped()  # overflow: measured again next time
    assert timing.future == [] and timing._measuring
    iteration(dev, timing, fits)
    assert timing.future and timing.peak_off == BASE + 80 + 40 - BASE  # (BASE was not allocated here)


def test_non_boundary_backwards_are_not_counted():
    dev = FakeDevice()
    timing = LoadTiming(dev, synchronous=True, slot_bytes=5, early_in_backward=True, prefetch=True)
    assert not timing.backward_begins(False)
    assert timing.gradient_ready() is None
    assert timing.prefetch_order([4, 5, 6]) == [4, 5]
    timing.kept = frozenset({4})
    assert timing.prefetch_order([4, 5, 6]) == [5, 6]
    assert timing.load_at_step_start(lambda i: False) == [4]
