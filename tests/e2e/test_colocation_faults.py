"""``engine.offload_states()`` / ``reload_states()`` fail on every rank or on none (runtime/colocation/offload_states.py):
a failure on rank 1 alone (at offload, the resident sub-groups' host copy finds the host short of
memory, the real check; at reload, a device allocation fails after part of the state came back) or
on both ranks raises on both ranks within seconds (no rank goes on into its next collective), each
naming the failing rank and the cause, and leaves every rank's states exactly where they were: the
kinds off the device, the tensors in the resident host copy, every state tensor's device and values.
Then the cycles that work, and training goes on bitwise plain ZeRO-3's; in stream mode with resident
sub-groups, and in compile mode's runtime, whose kept sub-groups a failed reload puts back. 2 gloo ranks,
one launch."""

import pytest
import torch

from harness import assert_bitwise_equal, case_results, launch_cases, same_tensors, two_ranks_unavailable

pytestmark = [pytest.mark.e2e,
              pytest.mark.skipif(two_ranks_unavailable() is not None, reason=str(two_ranks_unavailable()))]

FAULTS = [{"at": "offload", "ranks": [1]}, {"at": "offload", "ranks": [0, 1]}, {"at": "reload", "ranks": [1]}]
CAUSES = {"offload": "short", "reload": "injected failure: out of device memory"}
# stream mode, the first sub-groups resident (memory_budget_gb): offload_states() makes their host copy,
# checking the host's memory
OFFLOAD = {"enabled": True, "mode": "stream", "memory_budget_gb": 12e-6}
STREAM = dict(dtype="bf16", sub_group_size=1, late=True, steps=4)
# compile mode's runtime (parity_train.CompileOps): three sub-groups kept on the device between steps,
# written back at offload and loaded again at reload (nothing resident: no host copy to check)
COMPILE = dict(dtype="bf16", sub_group_size=1, two_groups=True, late=True, clip=0.5, steps=4, api="deepspeed")
CASES = {"stream": (dict(STREAM, offload=OFFLOAD), FAULTS),
         "compile": (dict(COMPILE, compile_ops={"reload": "all", "keep": 3}), [{"at": "reload", "ranks": [1]}])}
PLAIN = {"stream": dict(STREAM, api="deepspeed"), "compile": COMPILE}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    cases = {case: [("plain", PLAIN[case]), ("faults", dict(spec, colocate={"faults": faults}))]
             for case, (spec, faults) in CASES.items()}
    runs = launch_cases(cases, tmp_path_factory.mktemp("colocation_faults"), "colocation_faults", timeout=240)
    return {case: case_results(runs, case) for case in CASES}


@pytest.mark.parametrize("case,fault", [(c, f) for c, (_, faults) in CASES.items() for f in faults],
                         ids=[f"{c}-{f['at']}-ranks{''.join(map(str, f['ranks']))}" for c, (_, faults) in CASES.items()
                              for f in faults])
def test_a_failed_offload_or_reload_raises_on_every_rank_and_changes_nothing(runs, case, fault):
    records = next(r for r in runs[case]["faults"]["colocation_faults"] if r[0]["at"] == fault["at"]
                   and r[0]["ranks"] == fault["ranks"])
    for rank, record in enumerate(records):
        assert record["raised"], (rank, record)  # every rank raised, not only the failing one
        assert record["raised"].startswith("OffloadStatesError"), (rank, record)
        assert record["seconds"] < 30, (rank, record)  # agreed at once, not after a collective's timeout
        assert record["changed"] == [], (rank, record)  # as before the call, on every rank
        assert CAUSES[fault["at"]] in record["raised"], (rank, record)  # the cause ...
        named = rank if rank in fault["ranks"] else fault["ranks"][0]  # its own cause, or the failing rank's
        assert f"rank {named}:" in record["raised"], (rank, record)  # ... and the rank it failed on
        if rank not in fault["ranks"] or len(fault["ranks"]) > 1:
            assert f"failed on rank(s) {fault['ranks']}" in record["raised"], (rank, record)


@pytest.mark.parametrize("case", list(CASES))
def test_the_cycles_and_steps_after_them_train_as_plain_zero3(runs, case):
    ours = runs[case]["faults"]
    spec, _ = CASES[case]
    cycles = ours["colocation"]
    assert len(cycles) == spec["steps"] and all(c["after_reload"] == [] for c in cycles), cycles
    if case == "stream":
        assert ours["handle"]["resident"], "the budget should keep the first sub-groups resident"
        assert any(c["resident_in_store"] for c in cycles), cycles  # the host copy made after the failed one
    else:  # the kept sub-groups came back at each reload that moved our kinds, after the failed one too
        assert len(ours["handle"]["kept"]) == 3 and any(c["reload_bytes"] for c in cycles), ours["handle"]
    assert_bitwise_equal(runs[case]["plain"], ours)


def test_a_snapshot_compares_bits_so_untouched_nan_padding_is_unchanged():
    """The fault records' snapshots (``harness.same_tensors``): the last rank's partitions end in padding
    ZeRO-3 never writes, whose garbage may hold a NaN pattern, unequal to itself under ``torch.equal``; the
    same bits are unchanged, one element, a device or a dtype changed is a change."""
    pad = torch.tensor([1.0, float("nan")], dtype=torch.bfloat16)
    assert not torch.equal(pad, pad.clone())  # what the comparison must not rest on
    before = [("cpu", pad.clone()), ("cpu", torch.tensor(3.0))]  # (a 0-dim tensor: Adam's step)
    assert same_tensors(before, [("cpu", pad.clone()), ("cpu", torch.tensor(3.0))])
    written = pad.clone()
    written[0] = 2.0
    for after in ([("cpu", written), before[1]], [("cuda:0", pad.clone()), before[1]],
                  [("cpu", pad.float()), before[1]], [("cpu", pad.clone())]):
        assert not same_tensors(before, after)
