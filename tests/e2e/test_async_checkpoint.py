"""Asynchronous checkpoints through the launcher (2 ranks): the files equal a synchronous save of
the same state, resuming from them is exact, the guard is what makes that so, and a writer killed
mid-write leaves the previous checkpoint as ``latest``."""

import glob
import os

import pytest
import torch

from harness import assert_bitwise_equal, two_ranks_unavailable
from harness import launch as _launch

# 2 ranks on the CPU (gloo) or on 2+ GPUs; on a machine with one GPU, 1 rank on it.
pytestmark = [pytest.mark.e2e, pytest.mark.anyaccel]
NPROCS = 1 if two_ranks_unavailable() else 2


def launch(*args, **kwargs):
    return _launch(*args, nprocs=NPROCS, **kwargs)

BASE = dict(dtype="bf16", sub_group_size=1, steps=6, two_groups=True)
ASYNC = {"enabled": True, "mode": "stream", "memory_budget_gb": 0, "async_checkpoint": True}
SLOW = {"DS_OFFLOAD_TEST_WRITE_DELAY": "1.0", "DS_OFFLOAD_TEST_DELAY_TAG": "slow"}


def files_of(ckpt_dir, tag):
    return sorted(os.path.basename(p) for p in glob.glob(os.path.join(ckpt_dir, tag, "*.pt")))


def tensors_equal(a, b, where=""):
    """Recursively: same structure, tensors torch.equal, other leaves =="""
    if torch.is_tensor(a):
        return torch.is_tensor(b) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(tensors_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(tensors_equal(x, y) for x, y in zip(a, b))
    return True  # objects such as the loss scaler are compared through the tensors they produce


def optimizer_files_equal(dir_a, dir_b, tag):
    names = [n for n in files_of(dir_a, tag) if "optim_states" in n]
    assert names and names == [n for n in files_of(dir_b, tag) if "optim_states" in n]
    return all(
        tensors_equal(torch.load(os.path.join(dir_a, tag, n), weights_only=False)["optimizer_state_dict"],
                      torch.load(os.path.join(dir_b, tag, n), weights_only=False)["optimizer_state_dict"])
        for n in names)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ckpt")
    out = {"tmp": tmp}
    # at step 3: DeepSpeed's synchronous save into s/, then ours into a/, then training goes on
    save = {"at": 3, "tag": "slow3", "dir": str(tmp / "a"), "sync_dir": str(tmp / "s")}
    out["async"] = launch(dict(BASE, offload=ASYNC, saves=[save]), tmp, "async", env=SLOW)
    return out


def test_async_files_equal_sync_files(runs):
    tmp = runs["tmp"]
    assert (tmp / "a" / "latest").read_text() == "slow3"
    assert files_of(tmp / "a", "slow3") == files_of(tmp / "s", "slow3")
    assert optimizer_files_equal(tmp / "a", tmp / "s", "slow3")
    assert not glob.glob(str(tmp / "a" / "slow3" / "*.tmp"))
    # DeepSpeed's own converter reads the async checkpoint
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    a = get_fp32_state_dict_from_zero_checkpoint(str(tmp / "a"))
    s = get_fp32_state_dict_from_zero_checkpoint(str(tmp / "s"))
    assert a.keys() == s.keys() and all(torch.equal(a[k], s[k]) for k in a)


def test_resume_from_async_checkpoint_is_exact(runs):
    tmp = runs["tmp"]
    resumed = launch(dict(BASE, offload=ASYNC, resume={"dir": str(tmp / "a")}), tmp, "resumed")
    assert resumed["start"] == 3
    assert resumed["loaded_into_store"] is True  # loaded straight into the pinned host buffers
    assert resumed["losses"] == runs["async"]["losses"][3:]
    assert_bitwise_equal(runs["async"], resumed, what=("fp32", "state"))


def test_without_the_guard_the_race_is_seen(runs):
    tmp = runs["tmp"]
    save = {"at": 3, "tag": "slow3", "dir": str(tmp / "noguard"), "sync_dir": str(tmp / "noguard-sync")}
    launch(dict(BASE, offload=ASYNC, saves=[save]), tmp, "noguard", env=dict(SLOW, DS_OFFLOAD_TEST_NO_GUARD="1"))
    assert not optimizer_files_equal(tmp / "noguard", tmp / "noguard-sync", "slow3"), \
        "with the guard off the next steps should have overwritten the state being written"


def test_killed_writer_leaves_previous_checkpoint(runs):
    tmp = runs["tmp"]
    d = str(tmp / "k")
    log = launch(dict(BASE, offload=ASYNC, saves=[{"at": 3, "tag": "ok3", "dir": d, "wait": True},
                                                 {"at": 5, "tag": "slow5", "dir": d, "kill": True}]),
                 tmp, "killed", env=SLOW, expect_failure=True)
    assert "killing rank" in log
    assert (tmp / "k" / "latest").read_text() == "ok3"
    assert glob.glob(os.path.join(d, "slow5", "*.tmp")), "the kill should have caught a write in flight"
    resumed = launch(dict(BASE, offload=ASYNC, resume={"dir": d}), tmp, "resumed-after-kill")
    assert resumed["start"] == 3
    assert_bitwise_equal(runs["async"], resumed, what=("fp32", "state"))
