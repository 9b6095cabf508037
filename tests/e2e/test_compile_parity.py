"""Compile mode under DeepCompile (CUDA only): per-step losses, fp32 masters and optimizer states
``torch.equal`` to compiled ZeRO-3 without offload over 8 steps, models built under
``deepspeed.zero.Init``, and the counters prove the ops ran inside the compiled graphs.

On the CPU these skip: DeepCompile's extension builds only for CUDA. The runtime the ops drive is
checked on the CPU by test_stream_parity.py::test_compile_mode_runtime_parity."""

import pytest

from harness import assert_bitwise_equal, gpus, launch

pytestmark = [pytest.mark.e2e]

BASE = dict(dtype="bf16", sub_group_size=2000, hidden=64, zero_init=True, compile=True, optimizer="fused_adam",
            steps=8)
CASES = {
    # the default budget (device memory less a margin) holds everything: what comes back in the
    # first backward of a compile phase stays on the device, updated there step after step
    "reload_in_backward": dict(offload={"enabled": True, "mode": "compile"}),
    "reload_in_backward_gas2": dict(gas=2, offload={"enabled": True, "mode": "compile"}),
    # budget 0: nothing comes back early, the step streams everything
    "budget_0_streams_everything": dict(offload={"enabled": True, "mode": "compile", "memory_budget_gb": 0}),
    # RL colocation: engine.offload_states()/reload_states() after every step, through every include,
    # pin_memory and non_blocking (the plain run trains without them)
    "reload_in_backward_colocate": dict(offload={"enabled": True, "mode": "compile"}, colocate={}),
}


def run_case(tmp_path, name, nprocs):
    spec = dict(BASE, **CASES[name])
    offload, colocate = spec.pop("offload"), spec.pop("colocate", None)
    plain = launch(dict(spec, api="deepspeed"), tmp_path, f"{name}-plain", nprocs=nprocs)
    ours = launch(dict(spec, offload=offload, colocate=colocate), tmp_path, f"{name}-compile", nprocs=nprocs)
    assert_bitwise_equal(plain, ours)
    assert len(ours["losses"]) == spec["steps"] * spec.get("gas", 1)  # one loss per micro-batch
    counters = ours["handle"]["counters"]
    assert counters is not None and counters["phases"] >= 1
    assert counters["empty_cache"] == counters["phases"]  # once per compile phase, not per step
    if colocate is not None:
        check_colocation(ours)
    elif offload.get("memory_budget_gb") == 0:
        assert counters["reloads"] == 0 and ours["handle"]["stats"]["sub_groups"] == len(ours["handle"]["order"])
    else:
        handle = ours["handle"]
        kept, nbytes = handle["kept"], dict(zip(handle["order"], handle["nbytes"]))
        assert kept and counters["reloads"] > 0 and counters["launches"] == 0, (kept, counters)
        # in the steps after a phase's first, the kept sub-groups did not move
        h2d = [s["bytes_h2d"] for s in ours["step_stats"] if s is not None]
        assert min(h2d) == sum(nbytes.values()) - sum(nbytes[i] for i in kept), (h2d, kept)
    return ours


def check_colocation(ours):
    """Each cycle: what compile mode had on the device went to the host store when the include named
    our kinds, the kept sub-groups among it came back into buffers of their own (their bytes both
    ways), and nothing of ours was left off the device. A phase's first step may end with only some
    of its kept sub-groups on the device (its reloads were skipped while DeepCompile profiled); by
    the last step every kept sub-group is there, and the cycle brings them all back."""
    handle = ours["handle"]
    kept, nbytes = handle["kept"], dict(zip(handle["order"], handle["nbytes"]))
    cycles = ours["colocation"]
    assert kept and len(cycles) == BASE["steps"], (kept, len(cycles))
    brief = [{k: c[k] for k in ("include", "before", "kept", "offload_bytes", "reload_bytes", "back_on_device")}
             for c in cycles]
    for c in cycles:
        moves = c["include"] is None or bool({"hp_params", "optim_states"} & set(c["include"]))
        back = sorted(set(c["before"]) & set(c["kept"])) if moves else c["before"]
        assert c["after_reload"] == [] and c["grad_views_kept"], c  # DeepCompile reduces into these views
        assert c["offload_bytes"] == (sum(nbytes[i] for i in c["before"]) if moves else 0), brief
        assert c["reload_bytes"] == (sum(nbytes[i] for i in back) if moves else 0), brief
        assert c["back_on_device"] == back, brief
    last = cycles[-1]
    assert last["kept"] == sorted(kept) and set(kept) <= set(last["before"]), brief  # the steady state
    assert any(c["offload_bytes"] for c in cycles) and any(c["reload_bytes"] for c in cycles), brief


@pytest.mark.gpu
@pytest.mark.skipif(gpus() < 1, reason="DeepCompile needs a CUDA GPU")
@pytest.mark.parametrize("name", list(CASES))
def test_compile_parity_one_gpu(tmp_path, name):
    run_case(tmp_path, name, nprocs=1)


@pytest.mark.gpu2
@pytest.mark.skipif(gpus() < 2, reason=f"needs 2 CUDA GPUs (NCCL ranks cannot share one), this machine has {gpus()}")
@pytest.mark.parametrize("name", ["reload_in_backward_gas2", "reload_in_backward_colocate"])
def test_compile_parity_two_gpus(tmp_path, name):
    run_case(tmp_path, name, nprocs=2)

