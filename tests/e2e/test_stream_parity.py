"""Stream mode is bit-for-bit plain ZeRO-3: after several steps every fp32 master and optimizer
state (read with DeepSpeed's ``safe_get_full_*``) and every loss is ``torch.equal`` to a plain run
with the same optimizer. 2 gloo ranks on the CPU; on GPUs 1 rank per GPU (see the gpu cases).

On two CPU ranks every case runs in one launch (elsewhere one launch per case): parity_train.py
trains plain ZeRO-3 first, then each offload variant of the case (overlap on with the derived
limit, with a tiny ``overlap_memory_gb``, overlap off; one case adds
a detach, an asynchronous checkpoint and its resume), in the same process from the same seed.

On the CPU every copy is synchronous, so the waits between copies and computation are never put to
the test, except in the ``deferred`` variants: there the copies run only when something waits for
them (``deferred_copies.py``), as late as a GPU's copy streams may, and every buffer handed between
streams must be used in an order a GPU keeps (``stream_order.py``: no violation); a negative
control that drops one wait must break parity. Which test fails without each wait:
docs/architecture.md, "Ordering, checked on the CPU" (``scripts/remove_waits.py``)."""

import pytest
from deepspeed.accelerator import get_accelerator

from harness import assert_bitwise_equal, case_results, gpus, launch, launch_cases, slow_writes, two_ranks_unavailable
from parity_train import refused_calls

pytestmark = pytest.mark.e2e
needs_two_ranks = pytest.mark.skipif(two_ranks_unavailable() is not None, reason=str(two_ranks_unavailable()))
ON_CPU = get_accelerator().device_name() == "cpu"

OFFLOAD = {"enabled": True, "mode": "stream", "memory_budget_gb": 0}


NO_SPECULATION = dict(OFFLOAD, speculate_memory_gb=0)

VARIANTS = {
    # the defaults: speculation on, derived limit (no limit on the CPU: everything loads early)
    "overlap": dict(offload=OFFLOAD),
    # a tiny overlap_memory_gb, set to exactly the first sub-group's bytes once the layout is known
    # (parity_train.py): it loads in backward, the rest stream through the slots in the step (without
    # speculation, whose members would load first and hand their buffers back for the next ones)
    "overlap_tiny": dict(offload=dict(NO_SPECULATION, overlap_memory_gb=1e-6), early_cap_first=True),
    "overlap_off": dict(offload=dict(OFFLOAD, overlap=False)),  # prefetch of two slots
    "overlap_off_no_prefetch": dict(offload=dict(OFFLOAD, overlap=False, prefetch=False)),
    # DeepSpeed's norm made one step of the last bit larger (no clipping: the updates are the same): the
    # first step's comparison keeps DeepSpeed's norm (runtime/step/grad_norm.py)
    "norm_differs": dict(offload=OFFLOAD, norm_differs=True),
    # deferred_copies.py: each copy runs only when something waits for it, reading its source then
    "deferred": dict(offload=OFFLOAD, copies="deferred"),
    "deferred_tiny": dict(offload=dict(NO_SPECULATION, overlap_memory_gb=1e-6), early_cap_first=True,
                          copies="deferred"),
    "deferred_off": dict(offload=dict(OFFLOAD, overlap=False), copies="deferred"),
    # engine.offload_states()/reload_states() after every step (an RL trainer's rollouts between
    # steps), every include, pin_memory and non_blocking in turn; at the end a step, a backward and a
    # load while offloaded must be refused
    "colocate": dict(offload=OFFLOAD, colocate={"refusals": True}),
    # ... deferred, and the optimizer's state_dict() read while offloaded (a CPU reader of the host
    # store that offload_states() filled, non-blocking every third cycle)
    "deferred_colocate": dict(offload=OFFLOAD, colocate={"read_while_offloaded": True}, copies="deferred"),
    # the negative control: loads into a staging slot do not wait for the slot's last write-back,
    # and parity must break (overlap off: the step streams every sub-group through the slots)
    "deferred_control": dict(offload=dict(OFFLOAD, overlap=False), copies="deferred_control"),
}

CASES = {
    # one parameter per sub-group, with two param groups, a frozen layer, a late layer and clipping;
    # a detach mid-run (training goes on as plain ZeRO-3); a checkpoint at step 3 and its resume
    "one_param_per_sub_group": dict(
        spec=dict(dtype="bf16", sub_group_size=1, two_groups=True, frozen=True, late=True, clip=0.5),
        variants=["overlap", "overlap_tiny", "overlap_off", "detach", "checkpoint", "resume", "colocate",
                  "colocate_checkpoint", "colocate_resume"]),
    "few_large_sub_groups_gas2": dict(spec=dict(dtype="bf16", sub_group_size=1500, gas=2),
                                      variants=["overlap", "overlap_tiny", "overlap_off", "colocate", "norm_differs"]),
    "fp32_adam_clip": dict(spec=dict(dtype="fp32", sub_group_size=1, optimizer="torch_adam", clip=0.05),
                           variants=["overlap", "overlap_off_no_prefetch", "colocate"]),
    # an infinite loss at step 2: DeepSpeed skips the update (a non-finite gradient norm); what
    # backward loaded is given back unused, and it counts in no step's stats
    "bf16_skipped_step": dict(spec=dict(dtype="bf16", sub_group_size=1000, overflow_step=2),
                              variants=["overlap", "overlap_tiny", "overlap_off"]),
    "fp16_forced_overflow": dict(spec=dict(dtype="fp16", sub_group_size=1000, overflow_step=2),
                                 variants=["overlap", "overlap_tiny", "overlap_off"]),
    # the copies as late as a GPU may run them: only the runtime's waits order them (CPU only)
    "deferred_copies": dict(spec=dict(dtype="bf16", sub_group_size=1000, gas=2, clip=0.5),
                            variants=["deferred", "deferred_tiny", "deferred_off", "deferred_control",
                                      "deferred_checkpoint", "resume", "deferred_colocate"]),
    "budget_keeps_some_resident": dict(spec=dict(dtype="bf16", sub_group_size=1, late=True),
                                       variants=["overlap", "overlap_off_no_prefetch", "colocate", "deferred_colocate"],
                                       offload=dict(memory_budget_gb=12e-6)),
    # the measured plan's moves (StreamMode._place), at chosen steps: three sub-groups made resident after
    # step 2, two of them given back after step 4; with speculation (on by default), a checkpoint and its
    # resume across the moves, gradient accumulation 1 and 2
    "plan_moves": dict(spec=dict(dtype="bf16", sub_group_size=1, two_groups=True, frozen=True, clip=1e9,
                                 place_at=[[1, 3], [3, 1]], slab_bytes=1, unpin_after=0),
                       variants=["overlap", "deferred", "checkpoint", "resume"]),
    "plan_moves_gas2": dict(spec=dict(dtype="bf16", sub_group_size=1, late=True, gas=2, clip=1e9,
                                      place_at=[[1, 3], [3, 1]], slab_bytes=1, unpin_after=0),
                            variants=["overlap", "deferred"]),
    # all but the last sub-group made resident after step 1, overlap off (no load, no speculation in
    # backward): DeepSpeed updates the resident ones before anything waits for a load on the H2D stream,
    # so only the step's own wait (Arrival.before_step) lands the switch's copies first; the deferred
    # executor runs a copy only when waited for and fills the switch's tensors with NaN until then; the
    # optimizer's state_dict() read right after the move (a CPU reader: Arrival.wait) finds no NaN
    "plan_moves_all_resident": dict(spec=dict(dtype="bf16", sub_group_size=1, two_groups=True, clip=1e9,
                                              place_at=[[1, -1]], slab_bytes=1, read_after_place=True,
                                              unpin_after=0),
                                    variants=["deferred_off"]),
}


def variant_specs(case, tmp_path, cases=CASES):
    """The variants parity_train.py runs for ``cases[case]``, plain ZeRO-3 first; and their names."""
    extra = cases[case].get("offload", {})
    out = [("plain", {"api": "deepspeed"})]
    for name in cases[case]["variants"]:
        if name.startswith("deferred") and not ON_CPU:
            continue  # the deferred executor stands in for a GPU's streams on the CPU accelerator
        if name == "detach":
            out.append((name, dict(offload=dict(OFFLOAD, **extra), detach_after=3)))
        elif name in ("checkpoint", "deferred_checkpoint"):
            # deferred: training goes on while the checkpoint is written (the step's guard orders them)
            save = {"at": 3, "tag": "t3", "dir": str(tmp_path / "ckpt"), "wait": name == "checkpoint"}
            out.append((name, dict(offload=dict(OFFLOAD, async_checkpoint=True, **extra), saves=[save],
                                   copies="deferred" if name == "deferred_checkpoint" else None)))
        elif name == "resume":
            out.append((name, dict(offload=dict(OFFLOAD, **extra), resume={"dir": str(tmp_path / "ckpt")})))
        elif name == "colocate_checkpoint":
            # offload_states() while the asynchronous write of step 3's checkpoint is in flight
            save = {"at": 3, "tag": "t3", "dir": str(tmp_path / "ckpt_colocate"), "wait": False}
            out.append((name, dict(offload=dict(OFFLOAD, async_checkpoint=True, **extra), saves=[save],
                                   colocate={}, **slow_writes("t3", 0.5))))
        elif name == "colocate_resume":  # cycles after load_checkpoint
            out.append((name, dict(offload=dict(OFFLOAD, **extra), resume={"dir": str(tmp_path / "ckpt_colocate")},
                                   colocate={})))
        elif name == "abort":
            out.append((name, dict(offload=dict(OFFLOAD, **extra), abort_at=2)))
        else:
            v = VARIANTS[name]
            out.append((name, dict(v, offload=dict(v["offload"], **extra))))
    return out


def case_spec(case, steps=6, cases=CASES, **overrides):
    return dict(cases[case]["spec"], steps=steps, **overrides)


def run_case(tmp_path, case, nprocs=2, **overrides):
    spec = case_spec(case, **overrides)
    names, variants = zip(*variant_specs(case, tmp_path))
    out = launch(dict(spec, variants=list(variants)), tmp_path, case, nprocs=nprocs)
    return check_case(spec, dict(zip(names, out["variants"])))


def check_case(spec, results):
    """Every variant of a case against its plain ZeRO-3 run (``results``: name -> result)."""
    plain = results["plain"]
    for name, ours in results.items():
        if name == "plain":
            continue
        if name in ("resume", "colocate_resume"):
            assert ours["start"] == 3 and ours["losses"] == plain["losses"][3 * spec.get("gas", 1):]
            assert_bitwise_equal(plain, ours, what=("fp32", "state"))
        elif name == "deferred_control":
            assert ours["handle"]["deferred_copies"] > 0 and ours["handle"]["violations"] > 0
            with pytest.raises(AssertionError):  # a load that skips its wait reads stale state
                assert_bitwise_equal(plain, ours)
            continue
        elif name != "abort":
            assert_bitwise_equal(plain, ours)
        if name.startswith("deferred"):
            assert ours["handle"]["deferred_copies"] > 0  # copies really waited in their queues
            # every buffer handed between the streams in an order a GPU keeps (stream_order.py)
            assert ours["handle"]["violations"] == 0, (name, ours["handle"]["first_violations"])
        if name == "detach":
            d = ours["detach"]
            assert d["handle_gone"] and d["methods_are_class_methods"] and not d["still_instance_attributes"], d
            assert {"_prepare_sub_group", "_release_sub_group", "step", "_backward_prologue"} <= set(d["patched"])
            continue
        # the step's norm queued without a wait per sub-group (grad_norm.py) once it gave DeepSpeed's bits;
        # DeepSpeed's own where its formula was changed to differ in the last bit
        assert ours["handle"]["norm"] == ("deepspeed's" if ours.get("norm_differs") else "ours"), \
            (name, ours["handle"]["norm"])
        check_stats(spec, name, ours)
        if "colocate" in name:
            check_colocation(spec, name, ours)
    return results


OURS = {"hp_params": ("__master__", ), "optim_states": None}  # None: every key but the master


def check_colocation(spec, name, ours):
    """Each offload_states()/reload_states() cycle: what the include names is off the device, then
    back; the offloaded sub-groups moved 0 bytes (they stay in the host store), the resident ones
    exactly the bytes of the included kinds, both ways."""
    cycles, handle = ours["colocation"], ours["handle"]
    assert len(cycles) == spec["steps"] - ours["start"], (name, len(cycles))
    kinds = {"optim_states", "hp_params", "lp_params", "lp_grads", "contiguous_grad_buffer"}
    for c in cycles:
        wanted = kinds if c["include"] is None else set(c["include"])
        # contiguous_grad_buffer counts only where a bucket held a buffer (DeepSpeed's rule)
        assert wanted - {"contiguous_grad_buffer"} <= set(c["offloaded"]) <= wanted, (name, c)
        assert c["after_reload"] == [] and c["host_resident"] and not c["on_device"], (name, c)
        # the views of the gradient buffer are the same objects, in the buffer where it is now
        assert c["grad_views_kept"], (name, c)
        expected = sum(n for per_key in handle["resident_bytes"].values() for key, n in per_key.items()
                       if ("hp_params" in wanted and key == "__master__")
                       or ("optim_states" in wanted and key != "__master__"))
        assert c["offload_bytes"] == c["reload_bytes"] == expected, (name, c, handle["resident_bytes"])
        # the resident sub-groups' tensors of our kinds were in a host store while offloaded, not after
        ours_wanted = sorted(wanted & {"hp_params", "optim_states"})
        resident_keys = {("hp_params" if k == "__master__" else "optim_states")
                         for per_key in handle["resident_bytes"].values() for k in per_key}
        assert c["resident_in_store"] == sorted(set(ours_wanted) & resident_keys), (name, c)
        assert c["resident_in_store_after_reload"] == [], (name, c)
    if handle["resident"]:
        assert any(c["offload_bytes"] > 0 for c in cycles), (name, cycles)
    if name == "colocate_checkpoint":
        assert cycles[2]["checkpoint_pending"], cycles[2]  # the write of step 3's save was in flight  # the resident ones did move
    if "refusals" in ours:
        r = ours["refusals"]
        assert set(refused_calls()) <= r.keys(), r
        for call in refused_calls():
            assert r[call] and "StatesOffloaded" in r[call] and "reload_states() first" in r[call], (call, r)
        assert r["unchanged"], r  # nothing refused changed the masters or the step count
        assert r["still_offloaded"] == ["hp_params", "optim_states"], r


def check_stats(spec, name, ours):
    """Every step's stats: each offloaded sub-group loaded once (early or in the step) and written
    back once, the bytes equal both ways; a skipped step adds nothing to the next one."""
    handle = ours["handle"]
    name = {"deferred": "overlap", "deferred_tiny": "overlap_tiny", "deferred_off": "overlap_off",
            "deferred_checkpoint": "checkpoint", "colocate": "overlap", "deferred_colocate": "overlap",
            "colocate_checkpoint": "checkpoint", "colocate_resume": "resume"}.get(name, name)
    order, per_step = handle["order"], ours["step_stats"]
    assert order, "nothing was offloaded"
    assert len(per_step) == spec["steps"] - ours["start"]
    for k, stats in enumerate(per_step):
        offloaded = stats["offloaded"]
        # every offloaded sub-group updated once: by the step, or in backward and committed by it
        assert stats["sub_groups"] + stats["committed"] == offloaded > 0, (name, k, stats)
        assert stats["bytes_h2d"] == stats["bytes_d2h"] > 0, (name, k, stats)
        # loaded once, and once more where its update from backward was discarded
        assert stats["loaded_early"] + stats["loaded_in_step"] == offloaded + stats["discarded"], (name, k, stats)
        early = stats["loaded_early"]
        # the bytes the step loaded itself: all of them where nothing loaded early, none where nothing loaded in it
        assert 0 <= stats["bytes_in_step"] <= stats["bytes_h2d"], (name, k, stats)
        assert (stats["bytes_in_step"] == 0) == (stats["loaded_in_step"] == 0), (name, k, stats)
        if early == 0:
            assert stats["bytes_in_step"] == stats["bytes_h2d"], (name, k, stats)
        if name in ("overlap", "checkpoint", "resume") and ON_CPU:
            assert early == offloaded, (name, k, stats)  # no device memory limit on the CPU
        elif name == "overlap_tiny" and not stats["speculated"]:
            assert early == 1 < offloaded, (name, k, stats)
        elif name == "overlap_tiny":  # each update in backward hands its buffers back for the next load
            assert 1 <= early <= offloaded, (name, k, stats)
        elif name == "overlap_off":
            assert early == min(2, offloaded), (name, k, stats)
        elif name == "overlap_off_no_prefetch":
            assert early == 0, (name, k, stats)
    assert handle["overlap"] is (not name.startswith("overlap_off")), (name, handle["overlap"])
    # The step returns with every write-back landed: nothing of the state stays on the device, or
    # in flight, between steps (a skipped step gave back what backward loaded).
    held = ours["held_after_step"]
    assert len(held) == spec["steps"] - ours["start"] and not any(held), (name, held)
    if spec.get("overflow_step") is not None:
        assert ours["losses"][spec["overflow_step"]] == float("inf")
        assert handle["steps"] == spec["steps"] - 1  # the skipped step moved nothing
        # Something was loaded ahead of the skipped step and given back: certain where the early
        # loads do not depend on the device's memory (the CPU, a fixed cap, the two prefetched slots).
        if name in ("overlap_tiny", "overlap_off") or (name == "overlap" and ON_CPU):
            # (or, speculating, updated in backward into second regions and discarded)
            discarded = (handle["speculation"] or {}).get("reasons", {}).get("overflow", 0)
            assert handle["unloaded_unused"] > 0 or discarded > 0, (name, handle)
    assert {"exp_avg", "exp_avg_sq"} <= set(handle["keys"])
    # The moments always move; the master too under mixed precision. (In fp32 DeepSpeed may make the
    # master the model's own partition, which must stay where the model is.)
    if spec.get("dtype", "bf16") != "fp32":
        assert "__master__" in handle["keys"]


def two_rank_skip(case):
    """Why ``case`` does not run on two ranks here, or None. (A precision this machine lacks is the
    launch's to report: ``case_results`` skips that case alone.)"""
    if case == "deferred_copies" and not ON_CPU:
        return "the deferred executor stands in for a GPU's copy streams on the CPU accelerator"
    return None


@pytest.fixture(scope="module")
def two_rank_runs(tmp_path_factory):
    """Every case that runs here, all in one launch (a resume still follows its checkpoint's
    variant): ``{case: {name: result}}``."""
    cases = {case: [(name, dict(case_spec(case), **variant))
                    for name, variant in variant_specs(case, tmp_path_factory.mktemp(case))]
             for case in CASES if two_rank_skip(case) is None}
    return launch_cases(cases, tmp_path_factory.mktemp("two_ranks"), "cases")


@pytest.mark.parametrize("case", list(CASES))
@needs_two_ranks
def test_parity_two_ranks(two_rank_runs, case):
    if two_rank_skip(case):
        pytest.skip(two_rank_skip(case))
    results = check_case(case_spec(case), case_results(two_rank_runs, case))
    if case == "budget_keeps_some_resident":
        assert results["overlap"]["handle"]["resident"], "the budget should keep the first sub-groups resident"
    if case == "one_param_per_sub_group":
        assert results["resume"]["loaded_into_store"] is True
    if case in ("plan_moves", "plan_moves_gas2"):
        for name in ("overlap", "deferred"):
            placed = results[name]["placed"]
            assert [p[0] for p in placed] == [3, 1], placed
            # the resident sub-groups' host memory goes back to the host over the steps after a move
            # (arrival.py), and comes back for those that stream again (one slab a sub-group: slab_bytes)
            for _, _, released, _, resident in placed:
                assert set(released) <= set(resident), placed
            handle = results[name]["handle"]
            assert handle["released"] == sorted(handle["resident"]) and handle["unpinned_bytes"] > 0, handle
            assert results[name]["handle"]["speculation"]["committed"] > 0, name  # the defaults speculate
    if case == "plan_moves_all_resident":
        handle = results["deferred_off"]["handle"]
        assert len(handle["order"]) == 1 and handle["released"] == sorted(handle["resident"]), handle
        assert results["deferred_off"]["read_after_place"] == [True]  # a CPU reader right after the move


# The measured plan on a device whose figures the test scripts (parity_train.ScriptedMemory): 300 kB, a
# 20 kB margin, 100 kB that every iteration holds, 300 bytes of activations per input element. Batch 4
# (128 elements) leaves room for all the state (~25 kB a rank); batch 16 (512) does not. The plan
# measures step 2, decides after step 3 and keeps everything resident; before step 5's forward it gives
# everything back; two steps of batch 4 later (``recent``: 2) it measures again (step 9), and after step
# 10 takes it all back.
FOLLOW = dict(dtype="bf16", sub_group_size=1, clip=1e9, steps=12, batch_by_step=[4] * 4 + [16] * 2 + [4] * 6,
              scripted_memory=dict(limit=300_000, margin=20_000, fixed=100_000, per_element=300, recent=2),
              unpin_after=0)


@needs_two_ranks
def test_the_measured_plan_follows_the_batch_and_every_step_closes(tmp_path):
    """One step lifecycle for every placement: with every sub-group resident (steps 3-4), each step is
    still counted and the plan still runs; an input larger than any measured gives state back before
    its forward; the sub-groups given back speculate again, with their second regions; smaller inputs
    for a while bring the state back. Bitwise equal to plain ZeRO-3 with the same batches."""
    offload = dict(OFFLOAD, memory_budget_gb=None, overlap_memory_gb=1e-3)
    out = launch(dict(FOLLOW, variants=[{"api": "deepspeed"}, {"offload": offload, "log_info": True}]), tmp_path,
                 "follow")
    plain, ours = out["variants"]
    assert_bitwise_equal(plain, ours)
    n = len(ours["handle"]["order"]) + len(ours["handle"]["resident"])
    assert ours["steps_counted"] == list(range(1, 13))  # every step closed once, whatever was resident
    stats = ours["step_stats"]
    assert [s["input_numel"] for s in stats] == [128] * 4 + [512] * 2 + [128] * 6
    resident = [p["resident"] for p in ours["plan"]]
    assert resident == [0, 0] + [n] * 2 + [0] * 5 + [n] * 3, resident
    # what each step streamed: everything until the plan kept it, nothing while it is all resident
    assert [s["offloaded"] for s in stats] == [n] * 3 + [0] + [n] * 6 + [0] * 2, stats
    assert [s["resident"] for s in stats] == [0] * 3 + [n] + [0] * 6 + [n] * 2, stats
    assert all(s["step_s"] is not None and s["iteration_s"] >= s["step_s"] for s in stats), stats
    plan = ours["plan"]
    assert plan[4]["give_backs"] == 1 and plan[7]["take_backs"] == 1, plan
    # given back before step 5: every offloaded sub-group speculates again, from its second region
    assert plan[5]["members"] == list(range(n)) and set(plan[5]["twins"]) == set(range(n)), plan[5]
    assert stats[5]["speculated"] == n and stats[5]["committed"] == n, stats[5]
    assert plan[5]["released"] == [] and plan[10]["released"] == list(range(n)), plan
    # the plan turned the allocator's expandable segments on at attach, the job's other settings along, and
    # detach turned them off (the switch as on a CUDA device: parity_train records what it passes torch)
    assert ours["allocator_switch"] == {"held": 1, "after_detach": 0, "calls": [
        "max_split_size_mb:512,expandable_segments:True", "max_split_size_mb:512,expandable_segments:False"]}


@needs_two_ranks
def test_the_measured_plan_follows_the_batch_with_gradient_accumulation(tmp_path):
    """The same schedule with two micro-batches a step: the plan measures, decides, gives back before the
    larger step's first forward and takes back per applied step, not per micro-batch; bitwise equal to
    plain ZeRO-3 with the same accumulation."""
    offload = dict(OFFLOAD, memory_budget_gb=None, overlap_memory_gb=1e-3)
    out = launch(dict(FOLLOW, gas=2, variants=[{"api": "deepspeed"}, {"offload": offload}]), tmp_path, "follow_gas2")
    plain, ours = out["variants"]
    assert_bitwise_equal(plain, ours)
    n = len(ours["handle"]["order"]) + len(ours["handle"]["resident"])
    assert ours["steps_counted"] == list(range(1, 13))
    assert [p["resident"] for p in ours["plan"]] == [0, 0] + [n] * 2 + [0] * 5 + [n] * 3, ours["plan"]
    assert ours["plan"][4]["give_backs"] == 1 and ours["plan"][7]["take_backs"] == 1, ours["plan"]


@needs_two_ranks
def test_the_measured_plan_takes_state_back_when_reload_states_returns_memory(tmp_path):
    """The device first leaves no room for state beside the iteration (170 kB of a scripted 180 kB, less
    its margin); after step 4 an offload_states / reload_states cycle sees the device grow to 300 kB (a
    rollout engine gave its memory back): the plan reads its limit again, measures, and keeps everything
    resident from there. Bitwise equal to plain ZeRO-3."""
    spec = dict(FOLLOW, steps=7, batch_by_step=[4] * 7,
                scripted_memory=dict(FOLLOW["scripted_memory"], limit=180_000, grow_at=[[4, 300_000]]))
    offload = dict(OFFLOAD, memory_budget_gb=None, overlap_memory_gb=1e-3)
    out = launch(dict(spec, variants=[{"api": "deepspeed"}, {"offload": offload}]), tmp_path, "take_back")
    plain, ours = out["variants"]
    assert_bitwise_equal(plain, ours)
    n = len(ours["handle"]["order"]) + len(ours["handle"]["resident"])
    resident = [p["resident"] for p in ours["plan"]]
    assert resident[:5] == [0] * 5 and resident[-1] == n, resident


@needs_two_ranks
def test_a_take_back_given_straight_back_waits_for_its_own_copies(tmp_path):
    """The plan takes everything back after step 3, and step 4's input is the larger one: the give-back
    before its forward reads the state the take-back put on the device before any backward launched
    its copies. The move's drain lands them first (without it the host regions get what the new device
    tensors held: the losses turn NaN). Bitwise equal to plain ZeRO-3."""
    offload = dict(OFFLOAD, memory_budget_gb=None, overlap_memory_gb=1e-3)
    spec = dict(FOLLOW, batch_by_step=[4] * 3 + [16] * 2 + [4] * 7)
    out = launch(dict(spec, variants=[{"api": "deepspeed"}, {"offload": offload}, {"offload": offload,
                                                                                  "copies": "deferred"}]),
                 tmp_path, "straight_back")
    plain, ours, deferred = out["variants"]
    assert_bitwise_equal(plain, ours)
    assert_bitwise_equal(plain, deferred)
    n = len(ours["handle"]["order"]) + len(ours["handle"]["resident"])
    assert [p["resident"] for p in ours["plan"]][:4] == [0, 0, n, 0], ours["plan"]
    assert ours["plan"][3]["moves"] == (1, 1, 0), ours["plan"]  # taken back, then given back


@needs_two_ranks
def test_a_take_back_out_of_memory_on_one_rank_is_undone_there_and_every_rank_trains_on(tmp_path):
    """The FOLLOW schedule; the take-back after step 3 runs out of memory on rank 1 alone: that rank's
    move is undone (its state where it was, its plan's bookkeeping unchanged), rank 0's lands, no rank
    waits for the other, and every later step is bitwise plain ZeRO-3's; rank 1 takes the state back
    at a later decision. Any other failure in a move is raised on both ranks as the same MoveError."""
    offload = dict(OFFLOAD, memory_budget_gb=None, overlap_memory_gb=1e-3)
    oom = {"offload": offload, "move_faults": [{"rank": 1, "after_step": 2, "error": "oom"}]}
    other = {"offload": offload, "move_faults": [{"rank": 1, "after_step": 2, "error": "runtime"}]}
    out = launch(dict(FOLLOW, log_info=True, variants=[{"api": "deepspeed"}, oom, other]), tmp_path, "move_faults",
                 shared=True)
    plain, ours, failed = out["variants"]
    assert_bitwise_equal(plain, ours)
    n = len(ours["handle"]["order"]) + len(ours["handle"]["resident"])
    first, second = ours["plan_by_rank"]
    assert [p["resident"] for p in first][:4] == [0, 0, n, n], first
    assert [p["resident"] for p in second][:3] == [0, 0, 0], second  # undone after step 3
    assert second[2]["moves"] == (0, 0, 1) and first[2]["moves"] == (0, 1, 0)
    assert second[-1]["resident"] == n and second[-1]["moves"][1] >= 1, second  # taken back later
    assert ours["step_stats"][-1]["moves_failed"] == 0 and ours["step_stats"][-1]["take_backs"] >= 2
    log = (tmp_path / "move_faults.log").read_text()
    assert "rank 1: take-back after step 3" in log and "undone, the state stays where it was" in log, log[-3000:]
    assert "CUDA out of memory (injected into a take-back)" in log
    # any other failure: the same exception on both ranks (each variant's errors are gathered per rank)
    for rank in (0, 1):
        assert f"rank {rank}: MoveError: deepspeed-offload: a move of optimizer state failed" in failed["error"], \
            failed["error"][:3000]
    assert "rank 1: RuntimeError: injected failure in a take-back" in failed["error"]


@needs_two_ranks
def test_an_early_load_out_of_memory_on_one_rank_gives_way_and_every_rank_trains_on(tmp_path):
    """Step 3's backward on rank 1: an early load finds no device memory. What that rank's early loads
    and updates in backward held goes back, nothing more loads in that backward, the step streams the
    rest; no rank waits for the other, and training is bitwise plain ZeRO-3's (with speculation, and
    deferred copies)."""
    fault = {"early_load_fault": {"rank": 1, "step": 3}}
    out = launch(dict(CASES["one_param_per_sub_group"]["spec"], steps=6, variants=[
        {"api": "deepspeed"}, dict(fault, offload=OFFLOAD), dict(fault, offload=OFFLOAD, copies="deferred")]),
        tmp_path, "early_oom")
    plain, ours, deferred = out["variants"]
    assert_bitwise_equal(plain, ours)
    assert_bitwise_equal(plain, deferred)
    assert ours["early_oom_by_rank"] == [0, 1] and deferred["early_oom_by_rank"] == [0, 1]
    assert deferred["handle"]["violations"] == 0, deferred["handle"]["first_violations"]


@needs_two_ranks
def test_a_step_that_raises_leaves_the_store_consistent(tmp_path):
    out = launch(dict(CASES["one_param_per_sub_group"]["spec"], steps=5, abort_at=2, offload=OFFLOAD), tmp_path,
                 "abort")
    assert out["abort"] == {"raised": "injected failure", "host_resident": True, "in_step": False, "slots": False,
                            "partitions_are_casts": True}
    assert len(out["losses"]) == 4 and out["handle"]["steps"] == 4  # the steps after it ran and streamed


GPU_ONE_RANK = [("one_param_per_sub_group", "fused_adam"), ("few_large_sub_groups_gas2", "fused_adam"),
                ("fp16_forced_overflow", "fused_adam"), ("fp32_adam_clip", "fused_adam"),
                ("bf16_skipped_step", "fused_adam"), ("one_param_per_sub_group", "torch_adamw"),
                ("plan_moves", "fused_adam"), ("plan_moves_gas2", "fused_adam")]


@pytest.mark.gpu
@pytest.mark.parametrize("case,optimizer", GPU_ONE_RANK)
def test_parity_gpu_one_rank(tmp_path, case, optimizer):
    if gpus() < 1:
        pytest.skip("needs a CUDA GPU")
    run_case(tmp_path, case, nprocs=1, optimizer=optimizer, hidden=256)


@pytest.mark.gpu2
@pytest.mark.parametrize("case", [c for c in CASES if c != "deferred_copies"])
def test_parity_gpu_two_ranks(tmp_path, case):
    if gpus() < 2:
        pytest.skip(f"needs 2 CUDA GPUs (NCCL ranks cannot share one), this machine has {gpus()}")
    run_case(tmp_path, case, optimizer="fused_adam", hidden=256)


COMPILE_OPS_CASES = {
    # every sub-group that prefetch does not already hold comes back in backward, the first three
    # of them to stay on the device between steps; step 2 is skipped (an infinite loss: non-finite
    # gradient norm), so what it reloaded must be given back unused and what it kept stays; a
    # recompile (a new compile phase) at step 4 writes everything back and keeps the three again
    "reload_all_one_param_per_sub_group": dict(dtype="bf16", sub_group_size=1, two_groups=True, late=True, clip=0.5,
                                               overflow_step=2,
                                               compile_ops={"reload": "all", "keep": 3, "recompile_at": 4}),
    # every sub-group comes back in backward and stays, the step's first two too (prefetch leaves
    # kept ones to their reload ops): after the first step of a phase nothing moves
    "reload_and_keep_all": dict(dtype="bf16", sub_group_size=1, two_groups=True, late=True, clip=0.5, overflow_step=2,
                                compile_ops={"reload": "all", "keep": "all", "recompile_at": 4}),
    # one sub-group early, the rest streamed by the step; reloads only on the boundary micro-batch
    "reload_some_gas2": dict(dtype="bf16", sub_group_size=600, frozen=True, gas=2, compile_ops={"reload": 1}),
}


def _against_plain(spec, *variants, plain_drops=("compile_ops",)):
    """A case of ``compile_runs``: plain ZeRO-3 (``spec`` with ``plain_drops`` None), then ``spec`` with each
    of ``variants`` ({} for ``spec`` itself), each a whole spec of its own."""
    plain = dict(spec, **{k: None for k in plain_drops})
    return [("plain", plain)] + [(name, dict(spec, **variant)) for name, variant in variants]


def _reader_spec(keep):
    spec = dict(COMPILE_OPS_CASES["reload_all_one_param_per_sub_group"], steps=5, api="deepspeed",
                read_before_step_at=2)
    spec.pop("overflow_step")
    spec["compile_ops"] = {"reload": "all", "keep": keep}
    return spec


KEEP_LATE = dict(dtype="bf16", sub_group_size=1, two_groups=True, late=True, clip=0.5, steps=5, api="deepspeed",
                 compile_ops={"reload": "all", "keep": "all", "keep_late": True})
COLOCATE = dict(dtype="bf16", sub_group_size=1, two_groups=True, late=True, clip=0.5, steps=5, api="deepspeed",
                compile_ops={"reload": "all", "keep": 3}, colocate={"refusals": True})


@pytest.fixture(scope="module")
def compile_runs(tmp_path_factory):
    """The compile-mode runtime cases below against plain ZeRO-3, all in one launch (each variant
    still trains from the same seed in an engine of its own): ``{case: {name: result}}``."""
    cases = {f"runtime_{name}": _against_plain(dict(spec, steps=6, api="deepspeed"), ("ours", {}),
                                               ("deferred", {"copies": "deferred"}))
             for name, spec in COMPILE_OPS_CASES.items()}
    cases.update({f"read_{keep}": _against_plain(_reader_spec(keep), ("ours", {})) for keep in ("all", 3)})
    cases["keep_late"] = _against_plain(KEEP_LATE, ("ours", {}))
    cases["colocate"] = _against_plain(COLOCATE, ("ours", {}), plain_drops=("compile_ops", "colocate"))
    return launch_cases(cases, tmp_path_factory.mktemp("compile_runs"), "compile_runs")


@needs_two_ranks
def test_a_step_that_raises_writes_compile_modes_kept_state_back(tmp_path):
    """The update of a sub-group that compile mode keeps on the device raises: its device copy (the
    newest since the phase began) must reach the host store, not be dropped for the host's old one."""
    spec = dict(COMPILE_OPS_CASES["reload_all_one_param_per_sub_group"], steps=5, api="deepspeed", abort_at=3,
                abort_fail_at="first_kept")
    spec.pop("overflow_step")
    spec["compile_ops"] = {"reload": "all", "keep": 3}
    out = launch(spec, tmp_path, "abort_kept")
    abort = out["abort"]
    assert abort["raised"] == "injected failure" and len(abort["kept_on_device"]) == 3, abort
    assert abort["kept_reached_host"] and abort["host_resident"] and not abort["in_step"], abort
    assert len(out["losses"]) == 4  # the steps after it ran


@needs_two_ranks
def test_compile_modes_copy_events_stay_bounded_over_a_thousand_steps(tmp_path):
    """Compile mode's step never drains (its write-backs run at the next forward's head), so the copy
    events of the buffers it drops are forgotten only where each step closes: a thousand steps keep no
    more of them than the first few."""
    # (the deferred executor: copies with events, as on a GPU; the CPU's synchronous ones have none)
    spec = dict(COMPILE_OPS_CASES["reload_all_one_param_per_sub_group"], steps=1000, api="deepspeed",
                copies="deferred")
    spec.pop("overflow_step")
    spec["compile_ops"] = {"reload": "all", "keep": 3}
    out = launch(spec, tmp_path, "compile_1000", timeout=600)
    in_flight = out["in_flight"]
    assert len(in_flight) == 1000 and out["steps_counted"][-1] == 1000
    assert max(in_flight) <= len(out["handle"]["order"]), (max(in_flight), in_flight[:10], in_flight[-10:])


@pytest.mark.parametrize("keep", ["all", 3])
@needs_two_ranks
def test_a_reader_between_backward_and_step_leaves_compile_modes_kept_state_kept(compile_runs, keep):
    """A reader of host state (``state_dict``) between the last backward and the step writes the
    kept sub-groups back; the step loads them into buffers of their own again, beside the ones
    prefetch put into the slots, updates them there (bit for bit) and they stay on the device."""
    results = case_results(compile_runs, f"read_{keep}")
    plain, ours = results["plain"], results["ours"]
    assert_bitwise_equal(plain, ours)
    handle = ours["handle"]
    nbytes = dict(zip(handle["order"], handle["nbytes"]))
    total, kept = sum(nbytes.values()), handle["kept"]
    kept_bytes = sum(nbytes[i] for i in kept)
    assert len(kept) == (len(handle["order"]) if keep == "all" else keep)
    h2d = [s["bytes_h2d"] for s in ours["step_stats"]]
    in_step = [s["loaded_in_step"] for s in ours["step_stats"]]
    # step 2 loads the kept ones again at its start (the reader wrote them back), then they stay
    assert h2d[2] == total and in_step[2] == len(kept), (h2d, in_step)
    assert h2d[3] == h2d[4] == total - kept_bytes, h2d


@needs_two_ranks
def test_compile_mode_keeps_what_prefetch_loaded_before_the_pass_decided(compile_runs):
    """As on a GPU, where DeepCompile compiles backward (and the pass decides what stays) after the
    first backward's prologue: prefetch has put the step's first two sub-groups into the slots, so
    that step writes them back; the next step's reloads bring them into buffers of their own, and
    from the third step on nothing moves."""
    results = case_results(compile_runs, "keep_late")
    plain, ours = results["plain"], results["ours"]
    assert_bitwise_equal(plain, ours)
    handle = ours["handle"]
    nbytes = dict(zip(handle["order"], handle["nbytes"]))
    assert sorted(handle["kept"]) == sorted(handle["order"])
    h2d = [s["bytes_h2d"] for s in ours["step_stats"]]
    first_two = sum(nbytes[i] for i in handle["order"][:2])
    assert h2d == [sum(nbytes.values()), first_two, 0, 0, 0], h2d


@needs_two_ranks
def test_compile_mode_colocation(compile_runs):
    """offload_states()/reload_states() after every step in compile mode: the sub-groups kept on the
    device are written back to the host store (nothing else of ours moves), come back into buffers
    of their own, where the next step updates them, and training is plain ZeRO-3 bit for bit."""
    results = case_results(compile_runs, "colocate")
    plain, ours = results["plain"], results["ours"]
    assert_bitwise_equal(plain, ours)
    handle = ours["handle"]
    nbytes = dict(zip(handle["order"], handle["nbytes"]))
    kept = handle["kept"]
    assert len(kept) == 3 and not handle["resident"]
    for c in ours["colocation"]:
        # after a step, the reloaded sub-groups are still on the device (updated there): offload
        # writes them all back, reload brings back only the kept ones (the others would have left
        # at the next forward's head anyway)
        moves = c["include"] is None or bool({"hp_params", "optim_states"} & set(c["include"]))
        assert set(kept) <= set(c["before"]), c
        assert c["offload_bytes"] == (sum(nbytes[i] for i in c["before"]) if moves else 0), c
        assert c["reload_bytes"] == (sum(nbytes[i] for i in kept) if moves else 0), c
        assert c["on_device"] == ([] if moves else c["before"]), c
        assert c["back_on_device"] == (sorted(kept) if moves else c["before"]), c
        assert c["host_resident"] == bool(moves) and c["after_reload"] == [], c
        assert c["grad_views_kept"], c
    assert any(c["offload_bytes"] for c in ours["colocation"])
    assert all("reload_states() first" in ours["refusals"][k] for k in ("step", "backward", "load_state_dict"))
    assert ours["refusals"]["unchanged"]


@pytest.mark.parametrize("name", list(COMPILE_OPS_CASES))
@needs_two_ranks
def test_compile_mode_runtime_parity(compile_runs, name):
    """Compile mode's runtime (reload into own buffers, update there, keep there or write back at the
    next forward's head), driven through torch.ops.ds_offload where the compiled graphs would call
    it, is plain ZeRO-3 bit for bit, and kept sub-groups do not move between the steps of a phase.
    DeepCompile itself needs CUDA: test_compile_parity.py runs it on a GPU."""
    spec = dict(COMPILE_OPS_CASES[name], steps=6, api="deepspeed")
    results = case_results(compile_runs, f"runtime_{name}")
    plain, ours, deferred = results["plain"], results["ours"], results["deferred"]
    assert_bitwise_equal(plain, ours)
    # with the copies as late as a GPU may run them (deferred_copies.py): the ops' waits order them
    assert_bitwise_equal(plain, deferred)
    assert deferred["handle"]["deferred_copies"] > 0
    assert deferred["handle"]["violations"] == 0, deferred["handle"]["first_violations"]
    handle = ours["handle"]
    order, counters, nbytes = handle["order"], handle["counters"], dict(zip(handle["order"], handle["nbytes"]))
    k = len(order) if spec["compile_ops"]["reload"] == "all" else spec["compile_ops"]["reload"]
    kept = handle["kept"]
    # prefetch holds the first two that are not kept; the reload ops bring back the rest
    prefetched = [i for i in order if i not in kept][:2]
    reloaded = [i for i in list(reversed(order))[:k] if i not in prefetched]
    keep = spec["compile_ops"].get("keep", 0)
    assert reloaded and len(kept) == (len(reloaded) if keep == "all" else keep) and set(kept) <= set(reloaded)
    leaving = [i for i in reloaded if i not in kept]  # written back at each forward's head
    recompile_at, skipped = spec["compile_ops"].get("recompile_at"), spec.get("overflow_step")
    if skipped is not None:
        assert plain["losses"][skipped] == float("inf")
    # Kept sub-groups are reloaded only in the first step of a phase (begin_phase wrote them back);
    # a skipped step's reloads were given back, and reloaded again by the next step.
    phase_starts = {0} | ({recompile_at} if recompile_at else set())
    assert counters["reloads"] == 6 * len(leaving) + len(phase_starts) * len(kept)
    assert counters["bytes_reloaded"] == 6 * sum(nbytes[i] for i in leaving) + \
        len(phase_starts) * sum(nbytes[i] for i in kept)
    # Written back by the op at the next forward's head, except the kept ones, after a skipped step
    # (nothing was updated), before a recompile (the new phase evicts everything before it is
    # profiled) and after the last step (the final read drains).
    heads = [s for s in range(1, 6) if s - 1 != skipped and s != recompile_at]
    assert counters["launches"] == len(heads) * len(leaving)
    assert counters["bytes_offloaded"] == len(heads) * sum(nbytes[i] for i in leaving)
    assert counters["empty_cache"] == counters["phases"] == (2 if recompile_at else 1)
    assert counters["syncs"] == 6 * spec.get("gas", 1)
    # Every step loads what is not on the device already, once, and the first step of a phase
    # everything; the last step's write-backs include the kept ones (the final read drains).
    h2d = [s["bytes_h2d"] for s in ours["step_stats"]]
    total, kept_bytes = sum(nbytes.values()), sum(nbytes[i] for i in kept)
    assert max(h2d) == total and min(h2d) == total - kept_bytes
    if keep == "all":  # the step's first two as well: a budget that holds everything moves nothing
        assert sorted(kept) == sorted(order) and min(h2d) == 0 and handle["stats"]["bytes_h2d"] == 0
    assert handle["stats"]["bytes_h2d"] == total - kept_bytes and handle["stats"]["bytes_d2h"] == total
