"""Speculation (``runtime/speculation/updates.py``) is bit-for-bit plain ZeRO-3: sub-groups updated in
backward before the gradient norm is known, committed when the norm allows, discarded when clipping
fires, the loss scale moves or a step overflows. 2 gloo ranks (the norm is all-reduced), many
sub-groups (one parameter each), two param groups, a frozen layer, a layer unused in the first steps,
a weight used twice (in one case in two reentrant checkpoints, so its gradient is reduced twice);
torch AdamW. Each case trains plain ZeRO-3 and the offload variants from the same seed (every
case in one launch), and compares every loss, fp32 master and optimizer state with
``torch.equal``; the counters show that the path under test really ran (commits, discards).

A negative control commits without the norm check while clipping fires on some steps: parity must
break. The ``deferred`` variants run every copy only when something waits for it
(``deferred_copies.py``), as late as a GPU's copy streams may, and check that every buffer handed
between the compute, side, copy and reduction streams is used in an order a GPU keeps
(``stream_order.py``), the 16-bit casts and the fp32 gradient buffer dropped only after the compute
stream joined the side stream; a control that skips the step's join must be caught. Two deferred
variants put single waits to the test: one whose early loads are held back to late in backward (a
gradient reduced twice is final before its sub-group's state arrives, and the update must wait for
the second reduction), one whose step raises after commits were queued on the side stream (the
rollback must join it before the next forward reads the 16-bit partitions)."""

import pytest
import torch

from harness import assert_bitwise_equal, case_results, gpus, launch, launch_cases, two_ranks_unavailable

pytestmark = pytest.mark.e2e
needs_two_ranks = pytest.mark.skipif(two_ranks_unavailable() is not None, reason=str(two_ranks_unavailable()))

OFFLOAD = {"enabled": True, "mode": "stream", "memory_budget_gb": 0, "speculate_memory_gb": 1}
# host memory for the second regions of the last few sub-groups alone: the others roll back from device copies
FROM_DEVICE = dict(OFFLOAD, speculate_memory_gb=1e-6)
# (check_held: the early loads' running counts recounted at every gradient hook, parity_train.py)
BASE = dict(dtype="bf16", sub_group_size=1, two_groups=True, frozen=True, late=True, tied=True, steps=6,
            check_held=True)
HUGE, TINY = 1e9, 1e-9  # gradient_clipping that never fires / always fires

CASES = {
    # commits from the second step on (the first creates Adam's state)
    "never_clips": dict(clip=HUGE),
    "no_clipping": dict(clip=None, extra_config={"gradient_clipping": 0.0}),  # (DeepSpeed's default is 1.0)
    # with the default backoff: rollbacks at steps 2 and 4 (step 1 creates Adam's state), steps 3, 5
    # and 6 back off
    "always_clips": dict(clip=TINY),
    # clipping fires at step 2 only: step 3 backs off, every step after it commits again
    "backoff_resets": dict(clip=HUGE, clip_by_step=[HUGE, TINY, TINY, HUGE, HUGE, HUGE]),
    # the cases below speculate at every step (backoff 0): rollbacks and commits side by side
    "clips_on_odd_steps": dict(clip=HUGE, clip_by_step=[HUGE, TINY], backoff=0),
    "gas2": dict(clip=HUGE, clip_by_step=[HUGE, HUGE, TINY], gas=2, backoff=0),
    # several parameters per sub-group, reduced in small buckets (one parameter's gradient each): a
    # sub-group is final only once all of them are, over several reductions in backward
    "few_large_sub_groups": dict(sub_group_size=1500, clip=HUGE, clip_by_step=[HUGE, TINY, HUGE], backoff=0,
                                 extra_config={"zero_optimization": {"stage": 3, "sub_group_size": 1500,
                                                                     "reduce_bucket_size": 64}}),
    # early loads capped at half the offloaded state, gradients final one small bucket at a time (updates
    # all through backward): the loaded state, the 16-bit casts kept for the commit and the updates'
    # fp32 gradient buffer stay within the cap together. Clipping fires at step 3 (step 4 backs off):
    # the sub-groups loaded as that step began stream first whether it commits or not
    "early_cap": dict(clip=HUGE, clip_by_step=[HUGE, HUGE, TINY, HUGE, HUGE, HUGE], early_cap_share=0.5,
                      extra_config={"zero_optimization": {"stage": 3, "sub_group_size": 1, "reduce_bucket_size": 64}}),
    # the tied weight's two uses in reentrant checkpoints of their own: its gradient is reduced twice in
    # backward (in buckets of one gradient each: DeepSpeed refuses a parameter twice in one bucket), so an
    # update from the first reduction is void
    "reentrant_tied": dict(clip=HUGE, reentrant=True,
                           extra_config={"zero_optimization": {"stage": 3, "sub_group_size": 1, "reduce_bucket_size": 64}}),
    # a gradient edited with safe_set_full_grad between backward and the step voids the updates
    "gradient_written": dict(clip=HUGE, set_grad_at=[2, 4]),
    # bf16 gradients that are infinite at step 3: its updates, settled into the 16-bit partitions as
    # the step began, are discarded when DeepSpeed skips the step (a non-finite norm), their casts put back
    "nonfinite_skips": dict(clip=HUGE, overflow_step=3, steps=6),
    # the same after an fp32 master was written at that step (safe_set_full_fp32_param): its 16-bit
    # partition is not its master's cast until a step applies, so nothing settles at the skipped step
    "fp32_written_skips": dict(clip=HUGE, overflow_step=3, set_fp32_at=[3], steps=6),
    # ... and where that step applies: its updates commit with their casts unsettled, copied into the
    # 16-bit partitions on the side stream as DeepSpeed's loop reaches each sub-group; the step's end joins
    # that stream before DeepSpeed's _post_step all-gathers the persistent parameters from them
    "fp32_written_commits": dict(clip=HUGE, set_fp32_at=[3], steps=6),
    # fp16: the dynamic loss scale doubles every second step (window 2) and an overflow skips step 3
    "fp16_scale_moves": dict(dtype="fp16", clip=HUGE, overflow_step=3, steps=7, backoff=0),
    # a hand-written learning-rate schedule: the rate set between backward and the step (steps 2 and 4),
    # after the updates in backward used the old one: the step discards them and runs with the new rate
    "lr_set_before_step": dict(clip=HUGE, backoff=0, lr_before_step={"2": 3e-3, "4": 1e-4}),
    # the fp32 parameters and Adam's moments read between backward and the step: the state before the
    # updates, as plain ZeRO-3's (updates written over the host store are discarded first)
    "state_read": dict(clip=HUGE, read_state_at=[2, 4]),
}
# the cases whose variants also speculate with second regions for a few sub-groups only
FROM_DEVICE_CASES = ("never_clips", "clips_on_odd_steps", "early_cap", "reentrant_tied", "gradient_written",
                     "lr_set_before_step",
                     "fp16_scale_moves", "state_read", "nonfinite_skips", "fp32_written_skips")


def variants(case):
    spec = CASES[case]
    out = [("plain", dict(api="deepspeed", offload=None)), ("speculate", dict(offload=OFFLOAD)),
           ("deferred", dict(offload=OFFLOAD, copies="deferred"))]
    if case in FROM_DEVICE_CASES:
        out.append(("from_device", dict(offload=FROM_DEVICE)))
        out.append(("deferred_from_device", dict(offload=FROM_DEVICE, copies="deferred")))
    if "clip_by_step" in spec and spec.get("backoff") == 0:
        out.append(("control", dict(offload=OFFLOAD, force_commit=True)))
        if case in FROM_DEVICE_CASES:
            out.append(("control_from_device", dict(offload=FROM_DEVICE, force_commit=True)))
    if case == "clips_on_odd_steps":  # the casts dropped before the compute stream joined the side stream
        out.append(("unjoined_control", dict(offload=OFFLOAD, copies="deferred", no_step_end_join=True)))
    if case == "reentrant_tied":
        # no early loads before the 7th gradient hook of each boundary backward: the tied layer's gradients
        # (reduced at the 3rd and 5th or so, one bucket each) are final and reduced again before their state
        # arrives, and its update, at that 7th hook, waits for the second reduction (out of about ten)
        out.append(("deferred_late_loads", dict(offload=OFFLOAD, copies="deferred", loads_from_hook=7)))
    if case == "never_clips":
        # the second step raises at the late layer's update (unused then, so not speculated) after the
        # commits of the sub-groups before it queued their copies on the side stream
        out.append(("deferred_abort", dict(offload=OFFLOAD, copies="deferred", abort_at=1)))
        # the same with device copies: the sub-groups the raising step did not reach are rolled back
        out.append(("deferred_abort_from_device", dict(offload=FROM_DEVICE, copies="deferred", abort_at=1)))
    return out


@pytest.fixture(scope="module")
def case_runs(tmp_path_factory):
    """Every case's variants, all in one launch: ``{case: {variant name: result}}``."""
    cases = {case: [(name, dict(BASE, **CASES[case], **variant)) for name, variant in variants(case)]
             for case in CASES}
    return launch_cases(cases, tmp_path_factory.mktemp("speculation"), "cases")


@needs_two_ranks
@pytest.mark.parametrize("case", list(CASES))
def test_speculation_parity(case_runs, case):
    spec = dict(BASE, **CASES[case])
    runs = case_results(case_runs, case)
    plain = runs["plain"]
    steps = spec["steps"]
    for name in [n for n in ("speculate", "deferred", "from_device", "deferred_from_device") if n in runs]:
        ours = runs[name]
        assert_bitwise_equal(plain, ours)
        assert ours["held_checks"] > 0  # the running counts were recounted at every hook, and agreed
        c = ours["handle"]["speculation"]
        assert c is not None and len(c["members"]) == len(ours["handle"]["order"]), c
        if "from_device" in name:  # both kinds of rollback side by side
            assert 0 < len(c["from_device_members"]) < len(c["members"]) and c["from_device"] > 0, c
            assert all(side == 0 for i, side in zip(ours["handle"]["order"], c["current"]) if i in c["from_device_members"]), c
            if c["discarded"]:
                assert c["restored"] > 0, c  # a rollback copied the state before back from the device
        else:
            assert c["from_device_members"] == [] and c["from_device"] == c["restored"] == 0, c
        per_step = ours["step_stats"]
        assert c["speculated"] == c["committed"] + c["discarded"], c  # every update ends one way or the other
        # (a skipped step leaves the figures of the step before it: counted once)
        stepped = [s for k, s in enumerate(per_step) if s and (k == 0 or s != per_step[k - 1])]
        assert sum(s["committed"] for s in stepped) <= c["committed"], (c, per_step)
        if case in ("never_clips", "no_clipping"):
            # every sub-group of every step but the first (Adam has no state to update yet) committed,
            # but the unused late layer's before step 2: its gradient is never final
            assert c["discarded"] == 0 and c["commit_steps"] == steps - 1 and c["rollback_steps"] == 0, c
            assert all(s["committed"] > 0 for s in per_step[1:]), per_step
            assert all(s["committed"] == len(c["members"]) for s in per_step[3:]), per_step
            assert all(s["sub_groups"] == 0 for s in per_step[3:]), per_step  # the step updated nothing itself
            assert any(side for side in c["current"]), c  # committed updates live in their second region
            # every cast went into its 16-bit partition as its step began, none had to be put back
            assert c["settled"] == c["committed"] and c["unsettled"] == 0, c
        elif case == "always_clips":
            assert c["committed"] == 0 and c["discarded"] > 0, c
            assert c["rollback_steps"] == 2 and c["backed_off"] == 3 and c["reasons"] == {"clipped": 2}, c
            assert all(side == 0 for side in c["current"]), c
            assert [s["speculated"] > 0 for s in per_step] == [False, True, False, True, False, False], per_step
            assert c["settled"] == c["unsettled"] == c["discarded"], c  # settled, then the casts before put back
        elif case == "backoff_resets":
            assert c["rollback_steps"] == 1 and c["backed_off"] == 1 and c["commit_steps"] == 3, c
            assert [s["committed"] > 0 for s in per_step] == [False, False, False, True, True, True], per_step
        elif case == "early_cap":
            assert c["commit_steps"] == 3 and c["rollback_steps"] == 1 and c["reasons"] == {"clipped": 1}, c
            cap, held = ours["early_cap"], ours["early_held_max"]
            # the cap bound, and was reached (a load with a device copy to come needs about twice its bytes)
            slack = (3 if "from_device" in name else 1) * max(ours["handle"]["nbytes"])
            assert cap - slack < held <= cap, (held, cap)
            # what the cap left out streams in the step: its first ones loaded as the step began, as
            # many as the slots take (sub-groups smaller than the largest pack several to a slot)
            at_entry = [s["loaded_at_entry"] for s in per_step]
            assert min(at_entry) >= 2 and max(at_entry) > 2, at_entry
            # and, once the casts were settled, into buffers of their own, the cap still bound
            assert ours["entry_own_loads"] > 0 and ours["entry_held_max"] <= cap, (ours["entry_own_loads"], cap)
        elif case == "reentrant_tied":
            # the tied layer's two sub-groups (weight, bias), updated before their second reduction in
            # the second step, are discarded alone and do not speculate again; the other updates commit
            assert c["reasons"] == {"gradient changed": 2} and c["discarded"] == 2 and c["rollback_steps"] == 0, c
            assert c["commit_steps"] == steps - 1 and c["committed"] == c["speculated"] - 2, c
            assert [s["discarded"] for s in per_step] == [0, 2, 0, 0, 0, 0], per_step
            assert all(s["committed"] == len(c["members"]) - 2 for s in per_step[3:]), per_step
        elif case == "lr_set_before_step":
            assert c["reasons"] == {"hyper-parameters": 2} and c["committed"] > 0, c
            assert [s["discarded"] > 0 for s in per_step] == [False, False, True, False, True, False], per_step
        elif case == "gradient_written":
            assert c["reasons"] == {"gradient written": 2} and c["committed"] > 0, c
        elif case == "state_read":
            # the reads saw what plain ZeRO-3's saw; updates over the host store were discarded for them
            assert len(ours["state_reads"]) == len(plain["state_reads"]) > 0
            for (fp32, m), (fp32_plain, m_plain) in zip(ours["state_reads"], plain["state_reads"]):
                assert torch.equal(fp32, fp32_plain) and torch.equal(m, m_plain)
            assert c["committed"] > 0, c
            assert c["reasons"] == ({"state read": 2} if "from_device" in name else {}), c
        elif case == "fp16_scale_moves":
            assert c["committed"] > 0 and c["discarded"] > 0, c  # scale changes and the overflow roll back
            assert c["settled"] == 0, c  # fp16 settles nothing early (its scale skips steps)
        elif case == "fp32_written_commits":
            assert c["reasons"] == {} and c["committed"] > c["settled"] > 0, c  # step 3 committed unsettled
        elif case == "fp32_written_skips":
            assert c["reasons"] == {"overflow": 1} and c["unsettled"] == 0, c
            assert c["settled"] == c["committed"] > 0, c
        elif case == "nonfinite_skips":
            # steps 2, 3 and 6 commit (1 creates Adam's state, 5 backs off after the skip)
            assert c["reasons"] == {"overflow": 1} and c["commit_steps"] == 3 and c["backed_off"] == 1, c
            assert c["unsettled"] == c["discarded"] > 0 and c["settled"] == c["committed"] + c["discarded"], c
        else:
            assert c["committed"] > 0 and c["discarded"] > 0 and c["commit_steps"] > 0 and c["rollback_steps"] > 0, c
    if "deferred" in runs:
        deferred = runs["deferred"]["handle"]
        assert deferred["deferred_copies"] > 0  # copies really waited in their queues
        # every 16-bit cast and gradient buffer (allocated JOINED, not recorded on the side stream) was
        # dropped only after the compute stream joined the side stream: on a GPU its block is reused at once
        assert deferred["joined_allocs"] > 0 and deferred["unjoined_drops"] == 0, deferred
        # every buffer handed between the streams (compute, side, copies, DeepSpeed's reduction) in an
        # order a GPU keeps (stream_order.py)
        assert deferred["ordered_accesses"] > 0 and deferred["violations"] == 0, deferred["first_violations"]
    if "deferred_late_loads" in runs:
        late = runs["deferred_late_loads"]
        assert_bitwise_equal(plain, late)
        c, h = late["handle"]["speculation"], late["handle"]
        assert late["reduced_again_before_update"] > 0 and c["committed"] == c["speculated"] > 0, (late, c)
        assert h["violations"] == 0, h["first_violations"]
    for name in [n for n in ("deferred_abort", "deferred_abort_from_device") if n in runs]:
        aborted = runs[name]
        assert aborted["abort"] == {"raised": "injected failure", "host_resident": True, "in_step": False,
                                    "slots": False, "partitions_are_casts": True}, aborted["abort"]
        h = aborted["handle"]
        assert h["speculation"]["reasons"].get("step raised") == 1 and h["steps"] == steps - 1, h
        if name.endswith("from_device"):
            assert h["speculation"]["restored"] > 0, h["speculation"]  # the ones the step did not reach
        assert h["violations"] == 0 and h["unjoined_drops"] == 0, h["first_violations"]
    if "unjoined_control" in runs:
        unjoined = runs["unjoined_control"]["handle"]
        assert unjoined["speculation"]["committed"] > 0 and unjoined["unjoined_drops"] > 0, unjoined
        assert unjoined["violations"] > unjoined["unjoined_drops"], unjoined  # the next forward's reads too
    for name in [n for n in ("control", "control_from_device") if n in runs]:
        control = runs[name]
        assert control["handle"]["speculation"]["committed"] > 0
        assert (control["handle"]["speculation"]["from_device"] > 0) == name.endswith("from_device")
        with pytest.raises(AssertionError):  # an update clipping should have scaled, committed as it was
            assert_bitwise_equal(plain, control)


def run_on_gpus(tmp_path, optimizer, nprocs, block=OFFLOAD):
    """Plain ZeRO-3, speculation and its negative control on `nprocs` GPUs, one rank each."""
    spec = dict(BASE, clip=HUGE, clip_by_step=[HUGE, HUGE, TINY], steps=8, optimizer=optimizer, hidden=256, backoff=0)
    offload = dict(block, overlap_memory_gb=1)  # a fixed cap: early loads (and updates) from the first step
    names = [("plain", dict(api="deepspeed", offload=None)), ("speculate", dict(offload=offload)),
             ("control", dict(offload=offload, force_commit=True))]
    out = launch(dict(spec, variants=[v for _, v in names]), tmp_path, optimizer, nprocs=nprocs, timeout=600)
    plain, ours, control = out["variants"]
    assert_bitwise_equal(plain, ours)
    c = ours["handle"]["speculation"]
    assert c["committed"] > 0 and c["discarded"] > 0 and c["reasons"].get("clipped"), c
    assert c["speculated"] == c["committed"] + c["discarded"], c
    if block is FROM_DEVICE:
        assert c["from_device"] > 0 and c["restored"] > 0, c
    with pytest.raises(AssertionError):
        assert_bitwise_equal(plain, control)
    return c


@pytest.mark.gpu
@pytest.mark.parametrize("optimizer", ["fused_adam", "torch_adamw"])
def test_speculation_parity_gpu_one_rank(tmp_path, optimizer):
    """On a GPU: the updates run on a side stream in backward, after DeepSpeed's reduction stream
    made the gradient final and the state's load landed, and write back on the copy stream; 8 steps,
    clipping on every third."""
    if gpus() < 1:
        pytest.skip("needs a CUDA GPU")
    run_on_gpus(tmp_path, optimizer, nprocs=1)


@pytest.mark.gpu
def test_speculation_rolled_back_from_the_device_gpu(tmp_path):
    """On a GPU, second regions for 1 KiB of sub-groups at most (with these shapes none or one): the
    updates go over their host regions in backward, the state before them kept in device buffers,
    copied back on the D2H stream (after the update's own write-back) when clipping fires."""
    if gpus() < 1:
        pytest.skip("needs a CUDA GPU")
    run_on_gpus(tmp_path, "fused_adam", nprocs=1, block=FROM_DEVICE)


@pytest.mark.gpu
def test_speculation_slow_side_stream_gpu(tmp_path):
    """The waits between the side stream and the compute stream, each held up: a sleep kernel first
    on the side stream at every use (about 5 ms), so the updates, the casts and the commits' copies
    finish long after the CPU moved on. Still bitwise; and with the one wait at the step's end
    removed (the negative control), the next forward reads 16-bit partitions the commits have not
    copied yet, and parity breaks. (DeepSpeed's throughput timer, which syncs the whole device at
    every forward and would hide that, is off in every parity run.)"""
    if gpus() < 1:
        pytest.skip("needs a CUDA GPU")
    spec = dict(BASE, clip=HUGE, clip_by_step=[HUGE, HUGE, TINY], steps=6, hidden=256, backoff=0,
                slow_side_cycles=10_000_000)
    offload = dict(OFFLOAD, overlap_memory_gb=1)
    names = [("plain", dict(api="deepspeed", offload=None)), ("slow", dict(offload=offload)),
             ("no_join", dict(offload=offload, no_step_end_join=True))]
    out = launch(dict(spec, variants=[v for _, v in names]), tmp_path, "slow_side", nprocs=1, timeout=600)
    plain, slow, no_join = out["variants"]
    assert_bitwise_equal(plain, slow)
    c = slow["handle"]["speculation"]
    assert c["committed"] > 0 and c["discarded"] > 0, c
    with pytest.raises(AssertionError):
        assert_bitwise_equal(plain, no_join)


@pytest.mark.gpu
def test_speculation_reentrant_gpu(tmp_path):
    """A gradient reduced twice in one backward (``reentrant_tied``) on a GPU: the second reduction
    runs on DeepSpeed's reduction stream while the first one's update may still run on the (slowed)
    side stream; an update it voids is dropped alone, its cast released on the side stream. Whether
    an update is already queued by then depends on the early loads' timing: bitwise either way."""
    if gpus() < 1:
        pytest.skip("needs a CUDA GPU")
    spec = dict(BASE, **CASES["reentrant_tied"], steps=6, hidden=256, slow_side_cycles=10_000_000)
    offload = dict(OFFLOAD, overlap_memory_gb=1)
    names = [("plain", dict(api="deepspeed", offload=None)), ("speculate", dict(offload=offload))]
    out = launch(dict(spec, variants=[v for _, v in names]), tmp_path, "reentrant_gpu", nprocs=1, timeout=600)
    plain, ours = out["variants"]
    assert_bitwise_equal(plain, ours)
    c = ours["handle"]["speculation"]
    assert c["committed"] > 0 and c["rollback_steps"] == 0 and set(c["reasons"]) <= {"gradient changed"}, c


@pytest.mark.gpu2
def test_speculation_parity_gpu_two_ranks(tmp_path):
    """Two GPUs: the gradient norm is all-reduced over NCCL, and each rank commits or discards alike."""
    if gpus() < 2:
        pytest.skip(f"needs 2 CUDA GPUs (NCCL ranks cannot share one), this machine has {gpus()}")
    run_on_gpus(tmp_path, "fused_adam", nprocs=2)
