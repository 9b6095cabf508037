"""A shared launch (``harness.launch_cases``: many cases' variants in one run of parity_train.py) reports
each variant on its own: one that cannot run on this machine skips its case alone, with the reason, and
one that fails fails its case alone, naming itself; the cases after them still run and are compared.

The launch forces the accelerator to report no fp16 (``harness.NO_FP16``), as DeepSpeed's CPU
accelerator does on a CPU without it (an AMD one), so this holds whatever machine CI runs on."""

import pytest

from harness import NO_FP16, LaunchError, assert_bitwise_equal, case_results, launch_cases, two_ranks_unavailable

pytestmark = [pytest.mark.e2e,
              pytest.mark.skipif(two_ranks_unavailable() is not None, reason=str(two_ranks_unavailable()))]

OFFLOAD = {"enabled": True, "mode": "stream", "memory_budget_gb": 0}
SMALL = dict(sub_group_size=1, steps=3)


def test_a_variant_that_cannot_run_or_fails_leaves_the_others_alone(tmp_path):
    cases = {
        "needs_fp16": [("plain", dict(SMALL, dtype="fp16", api="deepspeed")),
                       ("ours", dict(SMALL, dtype="fp16", offload=OFFLOAD))],
        "fails": [("plain", dict(SMALL, api="deepspeed")), ("ours", dict(SMALL, offload=OFFLOAD, fail_at=1))],
        "runs": [("plain", dict(SMALL, api="deepspeed")), ("ours", dict(SMALL, offload=OFFLOAD))],
    }
    runs = launch_cases(cases, tmp_path, "shared", env={NO_FP16: "1"})
    with pytest.raises(pytest.skip.Exception, match="needs_fp16/plain: .* has no fp16"):
        case_results(runs, "needs_fp16")
    with pytest.raises(LaunchError, match="fails/ours failed: rank 0: RuntimeError: injected failure at step 1"):
        case_results(runs, "fails")
    assert "error" not in runs["fails"]["plain"]  # the variant before it in the same case ran
    results = case_results(runs, "runs")  # and the case after it
    assert len(results["ours"]["losses"]) == SMALL["steps"]
    assert_bitwise_equal(results["plain"], results["ours"])
