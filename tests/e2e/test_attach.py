"""Attach is all or nothing, on every rank (runtime/attach.py): a failure injected at each stage of
``deepspeed_offload.attach`` (the settings, the node's host memory, pinning, moving the state,
installing the hooks, compile mode's setup), on both ranks or on rank 1 alone, raises on both ranks
within seconds (no collective left waiting), each naming the failing rank and the cause, and leaves
every engine exactly as it was: its methods and the optimizer's, every master and moment on the
device with its values, DeepSpeed's compile-pass table, no handle. Then the attach that works, and
training goes on bitwise plain ZeRO-3's. 2 gloo ranks, one launch."""

import pytest

from harness import assert_bitwise_equal, case_results, launch_cases, two_ranks_unavailable

pytestmark = [pytest.mark.e2e,
              pytest.mark.skipif(two_ranks_unavailable() is not None, reason=str(two_ranks_unavailable()))]

STAGES = ["settings", "host memory", "pinning", "moving", "patching", "compile setup"]
FAULTS = [{"stage": s, "ranks": [0, 1]} for s in STAGES] + [{"stage": s, "ranks": [1]} for s in STAGES]
OFFLOAD = {"enabled": True, "mode": "stream", "memory_budget_gb": 0, "async_checkpoint": True}
SPEC = dict(dtype="bf16", sub_group_size=1, two_groups=True, steps=5, offload=OFFLOAD)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    cases = {"attach": [("plain", dict(SPEC, api="deepspeed", offload=None)),
                        ("faults", dict(SPEC, api="attach_later", attach_at=2, attach_faults=FAULTS))]}
    return case_results(launch_cases(cases, tmp_path_factory.mktemp("attach"), "attach"), "attach")


@pytest.mark.parametrize("fault", FAULTS, ids=[f"{f['stage']}-ranks{''.join(map(str, f['ranks']))}" for f in FAULTS])
def test_a_failed_attach_raises_on_every_rank_and_changes_nothing(runs, fault):
    records = next(r for r in runs["faults"]["attach_faults"] if r[0]["stage"] == fault["stage"]
                   and r[0]["ranks"] == fault["ranks"])
    for rank, record in enumerate(records):
        assert record["raised"], (rank, record)
        assert record["changed"] == [], (rank, record)
        assert record["seconds"] < 30, (rank, record)  # agreed at once, not after a collective's timeout
        cause = "DS_OFFLOAD_COMMIT_TIMEOUT" if fault["stage"] == "settings" else f"injected failure at {fault['stage']}"
        assert cause in record["raised"], (rank, record)
        if rank in fault["ranks"]:
            if len(fault["ranks"]) > 1:
                assert "also failed on rank(s)" in record["raised"], record
        else:  # the rank that did not fail names the one that did
            assert record["raised"].startswith("AttachError") and "failed on rank(s) [1]: rank 1:" in record["raised"], \
                record


def test_the_attach_after_them_trains_as_plain_zero3(runs):
    ours = runs["faults"]
    assert ours["handle"]["order"]  # attached, offloading
    assert_bitwise_equal(runs["plain"], ours)
