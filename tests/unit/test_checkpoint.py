"""The async checkpointer's own rules, on a stand-in engine: what is copied and what is aliased,
failures reported at the next step, and ``latest`` moved only when every rank is done."""

import os
import threading
from types import SimpleNamespace

import pytest
import torch

import deepspeed_offload
from deepspeed_offload.runtime import checkpoint as ck


class FakeEngine:
    """Just what the checkpointer touches: save/load/step and a checkpoint engine."""

    def __init__(self, files):
        self.files = files  # [(relative path, state_dict)]
        self.checkpoint_engine = object()
        self.global_steps = 7
        self.steps = 0

    def save_checkpoint(self, save_dir, tag=None, client_state={}, save_latest=True, exclude_frozen_parameters=False):
        assert save_latest is False  # 'latest' is ours to write, after every rank is done
        for rel, sd in self.files:
            self.checkpoint_engine.save(sd, os.path.join(save_dir, tag, rel))

    def load_checkpoint(self, *args, **kwargs):
        return "loaded"

    def step(self):
        self.steps += 1


@pytest.fixture(autouse=True)
def single_rank(monkeypatch):
    from deepspeed import comm
    monkeypatch.setattr(comm, "get_rank", lambda *a, **k: 0)
    monkeypatch.setattr(comm, "get_world_size", lambda *a, **k: 1)


def test_snapshot_aliases_the_store_and_copies_the_rest(tmp_path):
    store = torch.arange(8, dtype=torch.float32)
    in_store = store.narrow(0, 2, 4)
    mine = torch.ones(3)
    holder = torch.zeros(4)
    holder.data = in_store  # like a DeepSpeed tensor pointing at its host slice
    engine = FakeEngine([("f.pt", {"state": {"m": holder, "step": mine}, "meta": [1, {"x": 2}]})])
    ckpt = ck.AsyncCheckpointer(engine, [store])
    snap = ckpt._snapshot(engine.files[0][1])
    assert snap["state"]["m"].data_ptr() == in_store.data_ptr()  # aliased: no second host copy
    holder.data = torch.full((4, ), 9.0)  # the step rebinding the tensor to a slot...
    assert torch.equal(snap["state"]["m"], torch.tensor([2., 3., 4., 5.]))  # ...does not reach the alias
    assert snap["state"]["step"].data_ptr() != mine.data_ptr()  # small CPU tensors: copied
    mine.add_(1)
    assert torch.equal(snap["state"]["step"], torch.ones(3))
    assert snap["meta"] == [1, {"x": 2}] and snap["meta"] is not engine.files[0][1]["meta"]


def test_save_returns_then_writes_and_commits(tmp_path):
    engine = FakeEngine([("model.pt", {"w": torch.ones(2)}), ("optim.pt", {"s": torch.zeros(3)})])
    ckpt = ck.AsyncCheckpointer(engine, [])
    assert engine.save_checkpoint(str(tmp_path), tag="t1") is True
    engine._deepspeed_offload = SimpleNamespace(checkpointer=ckpt)
    deepspeed_offload.wait_for_checkpoint(engine)
    assert (tmp_path / "latest").read_text() == "t1"
    assert torch.equal(torch.load(tmp_path / "t1" / "optim.pt")["s"], torch.zeros(3))
    assert not list(tmp_path.glob("t1/*.tmp"))
    assert ckpt.last["background_s"] is not None and ckpt.last["blocking_s"] >= 0


def test_failed_write_raises_at_next_step_naming_path_and_cause(tmp_path):
    blocker = tmp_path / "not_a_dir"
    blocker.write_text("x")  # a file where the tag directory should go: makedirs fails, even as root
    engine = FakeEngine([("sub/f.pt", {"w": torch.ones(1)})])
    ckpt = ck.AsyncCheckpointer(engine, [])
    (tmp_path / "latest").write_text("previous")
    engine.save_checkpoint(str(blocker), tag="t2")
    ckpt._thread.join()
    with pytest.raises(ck.CheckpointWriteError, match=r"not_a_dir/t2.*(NotADirectory|File exists)"):
        engine.step()
    assert engine.steps == 0  # the step did not run on top of a failed checkpoint
    engine.step()  # reported once; training can go on
    assert engine.steps == 1
    assert (tmp_path / "latest").read_text() == "previous"


def test_latest_waits_for_every_rank(tmp_path, monkeypatch):
    monkeypatch.setattr(ck, "COMMIT_TIMEOUT_S", 5)
    job = dict(tag="t3", tag_dir=str(tmp_path / "t3"), save_dir=str(tmp_path), world=2, rank=0, save_latest=True)
    os.makedirs(job["tag_dir"])
    (tmp_path / "t3" / ".deepspeed_offload_rank0.done").write_text("ok")
    ckpt = ck.AsyncCheckpointer(FakeEngine([]), [])
    t = threading.Thread(target=ckpt._commit, args=(job, ))
    t.start()
    t.join(0.3)
    assert t.is_alive() and not (tmp_path / "latest").exists()  # rank 1 is not done yet
    (tmp_path / "t3" / ".deepspeed_offload_rank1.done").write_text("ok")
    t.join(5)
    assert (tmp_path / "latest").read_text() == "t3"


def test_commit_gives_up_with_the_missing_ranks(tmp_path, monkeypatch):
    monkeypatch.setattr(ck, "COMMIT_TIMEOUT_S", 0.2)
    job = dict(tag="t4", tag_dir=str(tmp_path / "t4"), save_dir=str(tmp_path), world=2, rank=0, save_latest=True)
    os.makedirs(job["tag_dir"])
    with pytest.raises(TimeoutError, match="rank0.done.*rank1.done|rank1.done"):
        ck.AsyncCheckpointer(FakeEngine([]), [])._commit(job)
    assert not (tmp_path / "latest").exists()


def test_guard_blocks_until_serialized():
    ckpt = ck.AsyncCheckpointer(FakeEngine([]), [])
    ckpt._written.clear()
    released = []
    t = threading.Thread(target=lambda: (ckpt.guard(), released.append(True)))
    t.start()
    t.join(0.2)
    assert not released
    ckpt._written.set()
    t.join(2)
    assert released


def test_a_failed_rank_stops_the_commit_at_once(tmp_path):
    job = dict(tag="t5", tag_dir=str(tmp_path / "t5"), save_dir=str(tmp_path), world=2, rank=0, save_latest=True)
    os.makedirs(job["tag_dir"])
    (tmp_path / "t5" / ".deepspeed_offload_rank0.done").write_text("ok")
    (tmp_path / "t5" / ".deepspeed_offload_rank1.failed").write_text("disk full")
    with pytest.raises(RuntimeError, match="disk full"):
        ck.AsyncCheckpointer(FakeEngine([]), [])._commit(job)
    assert not (tmp_path / "latest").exists()


def test_a_reused_tag_does_not_count_old_markers(tmp_path):
    (tmp_path / "t6").mkdir()
    (tmp_path / "t6" / ".deepspeed_offload_rank0.done").write_text("old")
    (tmp_path / "t6" / ".deepspeed_offload_rank0.failed").write_text("old")
    seen = []
    engine = FakeEngine([])
    engine.save_checkpoint = lambda save_dir, tag=None, **kw: seen.append(sorted(os.listdir(tmp_path / "t6")))
    ckpt = ck.AsyncCheckpointer(engine, [])
    ckpt.save_checkpoint(str(tmp_path), tag="t6")
    ckpt.wait()
    assert seen == [[]]  # both old markers were gone before DeepSpeed's save (and its barriers) ran
    assert (tmp_path / "latest").read_text() == "t6"
