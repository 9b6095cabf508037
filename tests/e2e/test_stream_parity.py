"""Stream mode is bit-for-bit plain ZeRO-3: after several steps every fp32 master and optimizer
state (read with DeepSpeed's ``safe_get_full_*``) and every loss is ``torch.equal`` to a plain run
with the same optimizer. 2 gloo ranks on the CPU; on GPUs 1 rank per GPU (see the gpu cases)."""

import pytest
import torch
from deepspeed.accelerator import get_accelerator

from harness import two_ranks_unavailable, assert_bitwise_equal, launch

pytestmark = pytest.mark.e2e
needs_two_ranks = pytest.mark.skipif(two_ranks_unavailable() is not None, reason=str(two_ranks_unavailable()))

OFFLOAD = {"enabled": True, "mode": "stream", "memory_budget_gb": 0}

CASES = {
    # one parameter per sub-group, with two param groups, a frozen layer, a late layer and clipping
    "one_param_per_sub_group": dict(dtype="bf16", sub_group_size=1, two_groups=True, frozen=True, late=True,
                                    clip=0.5),
    "few_large_sub_groups_gas2": dict(dtype="bf16", sub_group_size=1500, gas=2),
    "fp32_adam_clip": dict(dtype="fp32", sub_group_size=1, optimizer="torch_adam", clip=0.05),
    "fp16_forced_overflow": dict(dtype="fp16", sub_group_size=1000, overflow_step=2),
    "budget_keeps_some_resident_no_prefetch": dict(dtype="bf16", sub_group_size=1, late=True,
                                                   offload=dict(OFFLOAD, memory_budget_gb=12e-6, prefetch=False)),
}


def run_pair(tmp_path, name, spec, nprocs=2, steps=6):
    spec = dict(spec, steps=steps)
    offload = spec.pop("offload", OFFLOAD)
    plain = launch(dict(spec, api="deepspeed"), tmp_path, f"{name}-plain", nprocs=nprocs)
    ours = launch(dict(spec, offload=offload), tmp_path, f"{name}-offload", nprocs=nprocs)
    assert_bitwise_equal(plain, ours)
    assert ours["handle"]["order"], "nothing was offloaded"
    return plain, ours


@pytest.mark.parametrize("name", list(CASES))
@needs_two_ranks
def test_parity_two_ranks(tmp_path, name):
    if CASES[name].get("dtype") == "fp16" and not get_accelerator().is_fp16_supported():
        pytest.skip(f"DeepSpeed's {get_accelerator().device_name()} accelerator has no fp16 (run on a GPU)")
    plain, ours = run_pair(tmp_path, name, CASES[name])
    handle = ours["handle"]
    assert handle["order"], "nothing was offloaded"
    stats = handle["stats"]
    assert stats["sub_groups"] == len(handle["order"]) and stats["bytes_h2d"] == stats["bytes_d2h"] > 0
    assert "already lives in host memory" in ours["offload_states_refused"]
    if name == "budget_keeps_some_resident_no_prefetch":
        assert handle["resident"], "the budget should keep the first sub-groups resident"
    if name == "fp16_forced_overflow":
        assert plain["losses"][2] == float("inf")
        assert handle["steps"] == 5  # the overflowed step moved nothing
    # The moments always move; the master too under mixed precision. (In fp32 DeepSpeed may make the
    # master the model's own partition, which must stay where the model is.)
    assert {"exp_avg", "exp_avg_sq"} <= set(handle["keys"])
    if CASES[name].get("dtype", "bf16") != "fp32":
        assert "__master__" in handle["keys"]


@needs_two_ranks
def test_a_step_that_raises_leaves_the_store_consistent(tmp_path):
    out = launch(dict(CASES["one_param_per_sub_group"], steps=5, abort_at=2, offload=OFFLOAD), tmp_path, "abort")
    assert out["abort"] == {"raised": "injected failure", "host_resident": True, "in_step": False, "slots": False}
    assert len(out["losses"]) == 4 and out["handle"]["steps"] == 4  # the steps after it ran and streamed


def _gpus():
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


GPU_ONE_RANK = [("one_param_per_sub_group", "fused_adam"), ("few_large_sub_groups_gas2", "fused_adam"),
                ("fp16_forced_overflow", "fused_adam"), ("fp32_adam_clip", "fused_adam"),
                ("one_param_per_sub_group", "torch_adamw")]


@pytest.mark.gpu
@pytest.mark.parametrize("name,optimizer", GPU_ONE_RANK)
def test_parity_gpu_one_rank(tmp_path, name, optimizer):
    if _gpus() < 1:
        pytest.skip("needs a CUDA GPU")
    run_pair(tmp_path, f"{name}-{optimizer}", dict(CASES[name], optimizer=optimizer, hidden=256), nprocs=1)


@pytest.mark.gpu2
@pytest.mark.parametrize("name", list(CASES))
def test_parity_gpu_two_ranks(tmp_path, name):
    if _gpus() < 2:
        pytest.skip(f"needs 2 CUDA GPUs (NCCL ranks cannot share one), this machine has {_gpus()}")
    run_pair(tmp_path, name, dict(CASES[name], optimizer="fused_adam", hidden=256))


COMPILE_OPS_CASES = {
    # every sub-group that prefetch does not already hold comes back in backward; step 2 is skipped
    # (an infinite loss: non-finite gradient norm), so what it reloaded must be given back unused;
    # a recompile (a new compile phase) at step 4 re-arms the one empty_cache
    "reload_all_one_param_per_sub_group": dict(dtype="bf16", sub_group_size=1, two_groups=True, late=True, clip=0.5,
                                               overflow_step=2, compile_ops={"reload": "all", "recompile_at": 4}),
    # one sub-group early, the rest streamed by the step; reloads only on the boundary micro-batch
    "reload_some_gas2": dict(dtype="bf16", sub_group_size=600, frozen=True, gas=2, compile_ops={"reload": 1}),
}


@pytest.mark.parametrize("name", list(COMPILE_OPS_CASES))
@needs_two_ranks
def test_compile_mode_runtime_parity(tmp_path, name):
    """Compile mode's runtime (reload into own buffers, update there, write back at the next forward's
    head), driven through torch.ops.ds_offload where the compiled graphs call it, is plain ZeRO-3 bit
    for bit. DeepCompile itself needs CUDA: test_compile_parity.py runs it on a GPU."""
    spec = dict(COMPILE_OPS_CASES[name], steps=6, api="deepspeed")
    plain = launch({k: v for k, v in spec.items() if k != "compile_ops"}, tmp_path, f"{name}-plain")
    ours = launch(spec, tmp_path, f"{name}-compile-ops")
    assert_bitwise_equal(plain, ours)
    handle = ours["handle"]
    order, counters = handle["order"], handle["counters"]
    k = len(order) if spec["compile_ops"]["reload"] == "all" else spec["compile_ops"]["reload"]
    per_step = len([i for i in list(reversed(order))[:k] if i not in order[:2]])  # prefetch holds order[:2]
    assert per_step > 0
    recompile_at, skipped = spec["compile_ops"].get("recompile_at"), spec.get("overflow_step")
    if skipped is not None:
        assert plain["losses"][skipped] == float("inf")
    assert counters["reloads"] == 6 * per_step  # a skipped step's reloads were given back, not kept
    # Written back by the op at the next forward's head, except after a skipped step (nothing was
    # updated), before a recompile (the new phase evicts everything before it is profiled) and after
    # the last step (the final read drains).
    heads = [s for s in range(1, 6) if s - 1 != skipped and s != recompile_at]
    assert counters["launches"] == len(heads) * per_step
    assert counters["bytes_reloaded"] * len(heads) == counters["bytes_offloaded"] * 6
    assert counters["empty_cache"] == counters["phases"] == (2 if recompile_at else 1)
    assert counters["syncs"] == 6 * spec.get("gas", 1)
