"""Asynchronous checkpoints through the launcher (2 ranks): the files equal a synchronous save of
the same state (every tensor, ZeRO-3's padding included), resuming from them is exact, the guard is
what makes that so, a rank that dies mid-write makes rank 0 fail the commit within seconds and exit
non-zero with ``latest`` untouched, damaged, truncated or mixed files are refused on both ranks, and
a failed save leaves nothing behind (checkpoint_faults.py)."""

import glob
import os
import re

import pytest
import torch

from harness import HERE, assert_bitwise_equal, same_bits, slow_writes, two_ranks_unavailable
from harness import launch as _launch

from deepspeed_offload.runtime import checkpoint as ck
from deepspeed_offload.runtime.checkpoint.files import DIGEST

# 2 ranks on the CPU (gloo) or on 2+ GPUs; on a machine with one GPU, 1 rank on it.
pytestmark = [pytest.mark.e2e, pytest.mark.anyaccel]
NPROCS = 1 if two_ranks_unavailable() else 2


def launch(*args, **kwargs):
    return _launch(*args, nprocs=NPROCS, **kwargs)

BASE = dict(dtype="bf16", sub_group_size=1, steps=6, two_groups=True)
ASYNC = {"enabled": True, "mode": "stream", "memory_budget_gb": 0, "async_checkpoint": True}
SLOW = slow_writes("slow", 1.0)  # spec faults: the saves tagged slow* take seconds to write
FAULTS = HERE / "checkpoint_faults.py"


def files_of(ckpt_dir, tag):
    return sorted(os.path.basename(p) for p in glob.glob(os.path.join(ckpt_dir, tag, "*.pt")))


def tensors_equal(a, b, where=""):
    """Recursively: same structure, tensors with the same bits (``harness.same_bits``: the optimizer's
    flat partitions end in padding nobody writes, maybe a NaN pattern) and ``requires_grad``, other leaves
    ==. The device a tensor was saved from is not compared: the asynchronous files are written from host
    copies, so on a GPU they hold CPU tensors where DeepSpeed's synchronous save pickles device tensors
    (the model file's empty ZeRO-3 placeholders, say); DeepSpeed's loader maps every file to the CPU
    either way."""
    if torch.is_tensor(a):
        return torch.is_tensor(b) and a.requires_grad == b.requires_grad and same_bits(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(tensors_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(tensors_equal(x, y) for x, y in zip(a, b))
    if isinstance(a, (int, float, str, bool, type(None))):
        return a == b
    return True  # objects such as the loss scaler are compared through the tensors they produce


def recovery_scripts(runs):
    """The scripts this DeepSpeed's own save copies beside its checkpoints (its synchronous save in
    ``runs``)."""
    return sorted(n for n in os.listdir(runs["tmp"] / "s") if n.endswith(".py"))


def optimizer_files_equal(dir_a, dir_b, tag, which="optim_states"):
    names = [n for n in files_of(dir_a, tag) if which in n]
    assert names and names == [n for n in files_of(dir_b, tag) if which in n]
    # (the test's own files: DeepSpeed's format needs the unpickler)
    return all(
        tensors_equal(torch.load(os.path.join(dir_a, tag, n), weights_only=False),
                      torch.load(os.path.join(dir_b, tag, n), weights_only=False)) for n in names)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ckpt")
    out = {"tmp": tmp}
    # at step 3: DeepSpeed's synchronous save into s/, then ours into a/, then training goes on; each
    # file waits a second before it is written: the state copied aside (as the host memory here
    # allows), or written from the host store
    save = {"at": 3, "tag": "slow3", "dir": str(tmp / "a"), "sync_dir": str(tmp / "s")}
    out["async"] = launch(dict(BASE, offload=ASYNC, saves=[save], **slow_writes("slow", 1.0, copy_aside=True)),
                          tmp, "async")
    save = dict(save, dir=str(tmp / "store"), sync_dir=str(tmp / "store-sync"))
    out["from_store"] = launch(dict(BASE, offload=ASYNC, saves=[save], **slow_writes("slow", 1.0, copy_aside=False)),
                               tmp, "from_store")
    return out


def test_the_step_after_a_save_waits_only_for_what_it_overwrites(runs):
    """Copied aside, the iterations after the save do not wait for the (slow) write; written from the
    host store, one of them waits until the file holds what it overwrites (the guard: in the step, or,
    speculating, in the backward that writes a second region the save reads), and the files are right
    either way."""
    tmp = runs["tmp"]
    aside, from_store = runs["async"]["step_seconds"], runs["from_store"]["step_seconds"]
    assert max(aside[3:]) < 0.5, aside  # the iterations after the save at 3
    assert max(from_store[3:]) > 1.0, from_store  # the writer held each file for a second first
    assert optimizer_files_equal(tmp / "store", tmp / "store-sync", "slow3", which=".pt")
    assert ck.verify_checkpoint(str(tmp / "store" / "slow3")) is None
    # only each tensor's own bytes in the file: not the whole store (its second regions included)
    store = sum(os.path.getsize(p) for p in glob.glob(str(tmp / "a" / "slow3" / "*optim_states.pt")))
    sync = sum(os.path.getsize(p) for p in glob.glob(str(tmp / "s" / "slow3" / "*optim_states.pt")))
    assert store <= 1.1 * sync, (store, sync)


def test_async_files_equal_sync_files(runs):
    tmp = runs["tmp"]
    assert (tmp / "a" / "latest").read_text() == "slow3"
    assert files_of(tmp / "a", "slow3") == files_of(tmp / "s", "slow3")
    # every tensor of every file (model and optimizer states), padding of the flat fp32 groups included
    assert optimizer_files_equal(tmp / "a", tmp / "s", "slow3", which=".pt")
    last = NPROCS - 1  # the last rank's file: one on a one-GPU machine, two on the CPU or two GPUs
    flat = torch.load(tmp / "a" / "slow3" / f"bf16_zero_pp_rank_{last}_mp_rank_00_optim_states.pt",
                      weights_only=False)["optimizer_state_dict"]["fp32_flat_groups"]
    assert flat and all(t.requires_grad for t in flat)  # pickled as DeepSpeed's own save pickles them
    # beside the tag, what DeepSpeed's own save leaves: latest and its recovery scripts (zero_to_fp32.py;
    # zero_to_torch.py too from 0.19.7 on)
    assert sorted(os.listdir(tmp / "a")) == sorted(os.listdir(tmp / "s"))
    assert "zero_to_fp32.py" in recovery_scripts(runs)
    assert ck.verify_checkpoint(str(tmp / "a" / "slow3")) is None
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


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: only there is the resident state on "
                    "a device of its own, copied to the host after the save returns")
def test_the_resident_state_saved_behind_the_step_equals_a_synchronous_save(tmp_path):
    """At the defaults the measured plan keeps every sub-group resident: the save copies their state to
    the host after it returned, the steps after it wait for each sub-group's copy before updating it, and
    the files equal DeepSpeed's synchronous save of the same moment."""
    save = {"at": 3, "tag": "t3", "dir": str(tmp_path / "a"), "sync_dir": str(tmp_path / "s")}
    block = {"enabled": True, "mode": "stream", "async_checkpoint": True}
    run = launch(dict(BASE, offload=block, saves=[save]), tmp_path, "resident")
    assert run["handle"]["resident"] and run["saved"][0]["behind_bytes"] > 0, (run["handle"]["resident"], run["saved"])
    assert optimizer_files_equal(tmp_path / "a", tmp_path / "s", "t3", which=".pt")
    assert ck.verify_checkpoint(str(tmp_path / "a" / "t3")) is None


def test_without_the_guard_the_race_is_seen(runs):
    tmp = runs["tmp"]
    save = {"at": 3, "tag": "slow3", "dir": str(tmp / "noguard"), "sync_dir": str(tmp / "noguard-sync")}
    launch(dict(BASE, offload=ASYNC, saves=[save], **slow_writes("slow", 1.0, guard=False, copy_aside=False)), tmp,
           "noguard")
    assert not optimizer_files_equal(tmp / "noguard", tmp / "noguard-sync", "slow3"), \
        "with the guard off the next steps should have overwritten the state being written"


@pytest.mark.skipif(NPROCS != 2, reason="needs 2 ranks: " + str(two_ranks_unavailable()))
def test_a_rank_that_dies_fails_the_commit_within_seconds(runs):
    tmp = runs["tmp"]
    d = tmp / "die"
    log = launch(dict(BASE, offload=ASYNC, scenario="die", dir=str(d), **SLOW), tmp, "die", script=FAULTS,
                 env={"DS_OFFLOAD_HEARTBEAT_TIMEOUT": "3"}, expect_failure=True)
    assert "rank 1 stopped writing (its heartbeat stopped for" in log, log[-3000:]
    # the two ranks' lines can interleave with no newline between them: read the number alone
    returned = float(re.search(r"rank 0: save slow5 returned at (\d+(?:\.\d+)?)", log).group(1))
    failed = os.path.getmtime(tmp / "die.log")  # written right after the launcher ended
    assert failed - returned < 30, "rank 0 should give up on a dead rank within seconds, not the commit timeout"
    assert (d / "latest").read_text() == "ok3"
    assert not (d / "slow5").exists()
    assert ck.verify_checkpoint(str(d / "ok3")) is None


@pytest.mark.skipif(NPROCS != 2, reason="needs 2 ranks: " + str(two_ranks_unavailable()))
def test_damaged_truncated_mixed_and_disk_full_on_both_ranks(runs):
    tmp = runs["tmp"]
    d = tmp / "f"
    launch(dict(BASE, offload=ASYNC, scenario="faults", dir=str(d), dir2=str(tmp / "f2")), tmp, "faults",
           script=FAULTS)
    seen = [torch.load(f"{tmp / 'faults.pt'}.rank{r}", weights_only=True) for r in range(NPROCS)]
    optim1 = str(d / "t" / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt")
    model1 = str(d / "t" / "zero_pp_rank_1_mp_rank_00_model_states.pt")
    for rank, out in enumerate(seen):
        assert f"{optim1} (written by rank 1) does not match its {DIGEST} digest" in out["flipped"], (rank, out)
        assert f"{model1} (written by rank 1) is " in out["truncated"] and "truncated" in out["truncated"]
        assert "mixes files of different saves" in out["mixed"]
        assert out["intact"] is None and out["steps_after_load"] == 2
        assert "File too large (EFBIG)" in out["full"] and str(d / ".full.incoming-") in out["full"], out["full"]
        assert out["latest_after_full"] == "t" and out["after_full"] is None
    assert "rank 1's write failed" in seen[0]["full"]  # rank 0 wrote its files; its commit names rank 1
    # the failed save is gone once both ranks agreed it failed, without waiting for a later save
    scripts = recovery_scripts(runs)
    assert seen[0]["left_after_full"] == ["latest", "t", *scripts]
    assert seen[0]["left_after_next"] == ["latest", "t", "t2", *scripts]
    # a staging failure on rank 1: the same error on both ranks, nothing left of it, training goes on
    for rank, out in enumerate(seen):
        assert out["bad"] is not None and "checkpoint bad not saved" in out["bad"], (rank, out["bad"])
        assert "no host memory for the snapshot (injected)" in out["bad"], (rank, out["bad"])
        assert out["latest_after_bad"] == "t3"
    assert "rank 1" in seen[0]["bad"]
    assert seen[0]["left_after_bad"] == ["latest", "t", "t2", "t3", *scripts]
