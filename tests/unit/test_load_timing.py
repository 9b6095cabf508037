"""LoadTiming: when sub-groups may load ahead of the step. Driven by a fake device whose memory goes
up and down as a checkpointed backward's does, so the peak-keeping can be checked on the CPU."""

import math


from deepspeed_offload.runtime.step.load_timing import LoadTiming


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

    def memory_allocated(self):
        return self.allocated

    def max_memory_reserved(self):
        return self.peak

    def reset_peak_memory_stats(self):
        self.peak = self.allocated

    def total_memory(self):
        return self.total


# One iteration: forward to 100, the loss's backward spikes to 140; then per layer a recompute
# (+40) and its backward freeing 50 (hooks fire after each layer); the step allocates 30 and frees it.
BASE = 20


class Param:
    def __init__(self, ds_id):
        self.ds_id = ds_id


def iteration(dev, timing, load, layers=3, keys=None, extra=0, slots=0, norm=0, measured_from_entry=True):
    """Runs one iteration against ``timing``; ``load(allowance)`` is what stream mode does at a hook
    (returns the bytes it loads now). ``keys``: the parameter of each hook in backward's order (one
    per layer, 0, 1, ... by default); a key of 9 is a layer used in this iteration only, whose
    ``extra`` activations are held from forward until its hook (it needs no recompute). Returns the
    iteration's peak, whether it prefetched, and what it loaded early (given back where the backward
    diverged, as stream mode does). ``slots``: the bytes of the two slots, loaded when ``timing`` says
    to prefetch and held to the step (whose 30 bytes count them): when backward begins, or else when
    the step begins, before DeepSpeed's gradient norm allocates ``norm`` bytes for a while (and then
    asks for the first sub-group, which calls ``step_begins`` again). ``measured_from_entry=False``:
    the negative control, the step's figure started at its first sub-group, after the norm, and the
    slots taken at the entry all the same."""
    keys = list(range(layers)) if keys is None else keys
    dev.true_peak = top = dev.allocated
    dev.alloc(80 + extra)  # forward
    prefetch = timing.backward_begins(True)
    held = slots if prefetch else 0
    if held:
        dev.alloc(held)
        timing.prefetched(held)
    early = 0
    if timing.take_divergence():
        early = 0
    dev.alloc(40)  # the loss's backward
    dev.alloc(-40)
    for key in keys:
        if key == 9:
            dev.alloc(-extra)  # the new layer's backward frees its activations
        elif key == 8:
            pass  # an unfrozen parameter of a layer that ran before: its gradient, nothing recomputed
        else:
            dev.alloc(40)  # recompute
            dev.alloc(-40 - 80 // layers)  # its backward frees the recompute and the layer's activations
        allowance = timing.gradient_ready(Param(key))
        if timing.take_divergence():
            dev.alloc(-early)  # given back
            early = 0
        if allowance is not None:
            n = load(allowance - early)
            early += n
            dev.alloc(n)
    at_entry = timing.step_begins() if measured_from_entry else True  # DeepSpeed's step begins
    if at_entry and not held:
        held = slots
        dev.alloc(held)
    dev.alloc(norm)  # the norm's temporaries
    dev.alloc(-norm)
    assert not timing.step_begins() or not measured_from_entry  # its first sub-group: the step began already
    dev.alloc(30 - held)  # fp32 gradient of a sub-group, the slots
    dev.alloc(-30 - early)  # written back: the early buffers go
    timing.step_ends()
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


def test_the_slots_prefetched_in_the_measured_backward_are_room_in_later_ones():
    """The measured iteration prefetches both slots (10 bytes) when its backward begins and holds them
    to its step; later ones load early instead and take the slots in the step only. The slots count
    in the measured peak and in the step's figure, not in what the rest of backward allocates: at
    hook 0 early loads may hold 36 bytes (26 if the slots were counted there too), and the iteration
    still peaks at the measured one's peak."""
    dev = FakeDevice()
    dev.alloc(BASE)
    timing = LoadTiming(dev, synchronous=False, slot_bytes=5, early_in_backward=True, prefetch=True)
    iteration(dev, timing, fits, slots=10)
    peak2, prefetch2, _ = iteration(dev, timing, fits, slots=10)  # the measured one
    assert prefetch2 and timing.peak_off == peak2 == BASE + 80 + 10 + 40
    assert timing.future == [BASE + 80 - 26 + 40, BASE + 80 - 52 + 40, BASE + 80 - 78 + 30]
    allowances = []

    def record(room):
        allowances.append(room)
        return fits(room)

    peak3, prefetch3, early3 = iteration(dev, timing, record, slots=10)
    assert not prefetch3 and allowances[0] == 36 and early3 == 98
    assert peak3 == timing.peak_off  # reached, never passed


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
    naive._guarding = lambda: False  # (no iteration of its own was measured)

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
    assert timing.prefetch_order([4, 5, 6]) == [4, 5, 6]  # (as many as the slots take)
    timing.kept = frozenset({4})
    assert timing.prefetch_order([4, 5, 6]) == [5, 6]
    assert timing.load_at_step_start(lambda i: False) == [4]


def measured(always=False, tolerance=0, **kwargs):
    dev = FakeDevice()
    dev.alloc(BASE)
    timing = LoadTiming(dev, synchronous=False, slot_bytes=5, early_in_backward=True, prefetch=True, **kwargs)
    timing.measure_always = always
    timing.level_tolerance = tolerance  # (the fake's bytes are few)
    iteration(dev, timing, fits)
    iteration(dev, timing, fits)  # the measured one
    assert timing.future and timing.measurements == 1
    return dev, timing


def peak_without_early_loads(**kwargs):
    dev = FakeDevice()
    dev.alloc(BASE)
    off = LoadTiming(dev, synchronous=False, slot_bytes=5, early_in_backward=False, prefetch=False)
    return iteration(dev, off, fits, **kwargs)[0]


NEW_LAYER = dict(keys=[9, 0, 1, 2], extra=10)  # a last layer first used now: its backward comes first


def test_a_layer_first_used_after_the_measurement_pauses_early_loads_until_measured_again():
    """More is allocated when the backward begins than in the measured iteration: no early loads in
    it, the next iteration is measured again, and the one after loads early within the new table."""
    dev, timing = measured()
    peak, _, early = iteration(dev, timing, fits, **NEW_LAYER)
    assert timing.divergences == 1 and early == 0
    assert peak <= peak_without_early_loads(**NEW_LAYER)
    peak, _, early = iteration(dev, timing, fits, **NEW_LAYER)  # measured again
    assert early == 0 and timing.measurements == 2 and timing.keys == [9, 0, 1, 2]
    peak, _, early = iteration(dev, timing, fits, **NEW_LAYER)
    assert early > 0 and peak <= timing.peak_off and timing.divergences == 1


def test_without_the_check_a_new_layer_raised_the_peak():
    """The negative control: the table looked up by hook ordinal, nothing checked. The new layer's
    hook takes hook 0's allowance, and the first layer's recompute lands on top of it: 176 against the
    150 the iteration reaches without early loads."""
    dev, timing = measured()
    timing._diverge = lambda: None
    peak, _, early = iteration(dev, timing, fits, **NEW_LAYER)
    assert early > 0 and peak == 176 > peak_without_early_loads(**NEW_LAYER) == 150


def test_a_router_that_picks_other_experts_diverges_at_the_first_other_hook():
    """The same memory, other parameters: the hook that differs gives back what was loaded early."""
    dev, timing = measured()
    peak, _, early = iteration(dev, timing, fits, keys=[0, 7, 2])
    assert timing.divergences == 1 and early == 0  # loaded at hook 0, given back at hook 1
    assert peak <= peak_without_early_loads(keys=[0, 7, 2])
    iteration(dev, timing, fits, keys=[0, 7, 2])
    assert timing.measurements == 2 and timing.keys == [0, 7, 2]


def test_a_frozen_layer_unfrozen_adds_a_hook():
    """A parameter that had no gradient gets one (its layer ran before too: no new activations)."""
    unfrozen = dict(keys=[0, 8, 1, 2], extra=0)
    dev, timing = measured()
    peak, _, early = iteration(dev, timing, fits, **unfrozen)
    assert timing.divergences == 1 and early == 0
    assert peak <= peak_without_early_loads(**unfrozen)


def test_a_fixed_cap_is_not_paused():
    dev, timing = measured(always=True, early_cap=30)
    _, _, early = iteration(dev, timing, fits, keys=[0, 7, 2])
    assert early > 0 and timing.divergences == 0


def test_prefetched_slots_count_only_in_the_measurement_they_were_held_in():
    """Reported outside a measured boundary backward, they are ignored; a measurement voided by a
    skipped step starts again from none."""
    dev = FakeDevice()
    timing = LoadTiming(dev, synchronous=False, slot_bytes=5, early_in_backward=True, prefetch=True)
    timing.backward_begins(True)
    timing.prefetched(10)  # the first iteration: nothing is measured yet
    assert timing._prefetched == 0
    timing.step_ends()  # measured next
    timing.backward_begins(True)
    timing.prefetched(10)
    assert timing._prefetched == 10
    timing.step_skipped()  # void: the next iteration is measured instead
    assert timing._prefetched == 0 and timing.measuring


def test_the_slots_taken_as_the_step_begins_meet_the_norm_within_the_measured_peak():
    """Later iterations take the slots when DeepSpeed's step begins, so that they load while it
    computes the gradient norm, whose temporaries (here 25 bytes) then meet them. The step's figure
    starts there too: the iteration reaches the measured peak and never passes it."""
    dev = FakeDevice()
    dev.alloc(BASE)
    timing = LoadTiming(dev, synchronous=False, slot_bytes=5, early_in_backward=True, prefetch=True)
    iteration(dev, timing, fits, slots=10, norm=25)
    peak2, prefetch2, _ = iteration(dev, timing, fits, slots=10, norm=25)  # the measured one
    assert prefetch2 and timing.peak_off == peak2
    peak3, prefetch3, early3 = iteration(dev, timing, fits, slots=10, norm=25)
    assert not prefetch3 and early3 > 0
    assert peak3 == timing.peak_off  # reached, never passed


def test_measured_from_the_first_sub_group_the_slots_at_the_entry_raised_the_peak():
    """The negative control: the measured step's figure starting at its first sub-group, the norm
    falls in backward's tail, where the slots are taken out; later iterations hold them through it."""
    dev = FakeDevice()
    dev.alloc(BASE)
    timing = LoadTiming(dev, synchronous=False, slot_bytes=5, early_in_backward=True, prefetch=True)
    iteration(dev, timing, fits, slots=10, norm=25, measured_from_entry=False)
    iteration(dev, timing, fits, slots=10, norm=25, measured_from_entry=False)
    peak3, _, early3 = iteration(dev, timing, fits, slots=10, norm=25, measured_from_entry=False)
    assert early3 > 0 and peak3 == timing.peak_off + 5  # 155 against 150


def test_the_step_prefetches_once_and_only_within_the_share_before_a_measurement():
    dev = FakeDevice(total=100)
    timing = LoadTiming(dev, synchronous=False, slot_bytes=5, early_in_backward=True, prefetch=True)
    dev.alloc(80)
    assert timing.step_begins() and not timing.step_begins()  # 80 + 10 <= 90: once per step
    timing.step_ends()
    dev.alloc(5)
    assert not timing.step_begins()  # 95 > 90
    timing.step_skipped()
    off = LoadTiming(dev, synchronous=True, slot_bytes=5, early_in_backward=True, prefetch=False)
    assert not off.step_begins()


def test_where_the_step_is_the_peak_what_backward_gives_back_still_loads_early():
    """A measured iteration that peaks in its step (a small model: slots and fp32 gradients above the
    activations): ``allowance`` is 0 all through backward, since whatever loads early might still be held
    in the step. A sub-group updated in backward gives its state back before the step, so the split
    allowances let it load (``backward_allowance``) as long as nothing of it outlasts backward
    (``step_allowance`` is 0), and the iteration's peak holds."""
    dev = FakeDevice()
    dev.alloc(BASE)
    timing = LoadTiming(dev, synchronous=False, slot_bytes=5, early_in_backward=True, prefetch=False)

    def run(load_at_hook0=0):
        dev.alloc(30)  # forward
        timing.backward_begins(True)
        seen = []
        for k in range(3):
            if k == 0 and load_at_hook0:
                dev.alloc(load_at_hook0)  # loaded early, updated, given back before the next hook
            dev.alloc(-10)
            seen.append((timing.gradient_ready(Param(k)), timing.backward_allowance(), timing.step_allowance()))
            if k == 0 and load_at_hook0:
                dev.alloc(-load_at_hook0)
        timing.step_begins()
        dev.alloc(60)  # the step's slots and fp32 gradients
        dev.alloc(-60)
        timing.step_ends()
        return seen

    run()
    run()  # measured
    assert timing.peak_off == BASE + 80 - 20 and timing.step_figure == timing.peak_off
    dev.true_peak = 0
    seen = run(load_at_hook0=30)
    assert [s[0] for s in seen] == [0, 0, 0]  # the old bound: nothing may load
    assert [s[1] for s in seen] == [40, 50, 60] and [s[2] for s in seen] == [0, 0, 0], seen
    assert dev.true_peak <= timing.peak_off


def test_what_the_plan_holds_back_comes_off_every_allowance():
    """The measured plan, with nothing left to give back, takes ``held_back`` bytes off what early loads
    may hold: they load that much less (the peak stays where it was); all of it held back is the iteration
    with overlap off."""
    dev = FakeDevice()
    dev.alloc(BASE)
    timing = LoadTiming(dev, synchronous=False, slot_bytes=5, early_in_backward=True, prefetch=True)
    iteration(dev, timing, fits)
    peak_off, _, _ = iteration(dev, timing, fits)  # the measured one
    _, _, early = iteration(dev, timing, fits)
    timing.held_back = 10
    peak, _, held = iteration(dev, timing, fits)
    assert 0 < held <= early - 10 and peak <= peak_off
    timing.held_back = 10**6
    _, _, none = iteration(dev, timing, fits)
    assert none == 0 and timing.step_allowance() == 0


def test_the_largest_allowance_is_the_most_early_loads_hold_in_a_like_backward():
    dev = FakeDevice()
    dev.alloc(BASE)
    timing = LoadTiming(dev, synchronous=False, slot_bytes=5, early_in_backward=True, prefetch=True)
    assert timing.largest_allowance() == 0  # nothing measured yet
    iteration(dev, timing, fits)
    iteration(dev, timing, fits)  # the measured one
    seen = []
    iteration(dev, timing, lambda room: seen.append(room) or 0)
    assert max(seen) == timing.largest_allowance() > 0


def test_a_larger_input_is_measured_before_its_forward_at_every_budget():
    """Allowances measured on one input hold for it and for smaller ones (the rest of a smaller
    iteration allocates less), not for a larger one: before the forward of an input larger than the
    measured iteration's, the iteration is measured again (no early loads, whatever the budget), and
    its figures hold from then on, the smaller inputs' too."""
    dev = FakeDevice()
    dev.alloc(BASE)
    timing = LoadTiming(dev, synchronous=False, slot_bytes=5, early_in_backward=True, prefetch=True)
    for _ in range(2):
        timing.forward_input(100)
        iteration(dev, timing, fits)
    assert timing.measured_for == 100 and timing.future and not timing.measuring
    timing.forward_input(100)  # the size measured: as measured
    assert not timing.measuring
    _, _, early = iteration(dev, timing, fits)
    assert early > 0
    timing.forward_input(400)  # larger: measured again, before its forward allocates anything
    assert timing.measuring and timing.larger_inputs == 1 and timing.future == []
    peak_large, _, early_large = iteration(dev, timing, fits, keys=[0, 1, 2, 9], extra=200)
    assert early_large == 0 and timing.measured_for == 400 and timing.peak_off == peak_large
    timing.forward_input(100)  # smaller: the larger one's figures hold
    assert not timing.measuring and timing.larger_inputs == 1
    peak_small, _, early_small = iteration(dev, timing, fits)
    assert early_small > 0 and peak_small <= timing.peak_off
    capped = LoadTiming(dev, synchronous=False, slot_bytes=5, early_in_backward=True, prefetch=True, early_cap=30)
    capped.forward_input(10**6)  # a fixed cap (overlap_memory_gb) is the user's figure: nothing to measure
    assert not capped.measuring and capped.larger_inputs == 0
