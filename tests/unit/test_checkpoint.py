"""The async checkpointer's own rules, on a stand-in engine (one rank): what is copied and what is
aliased, the staging directory and its swap into place, markers with digests, the verification at
load, the heartbeat that lets rank 0 give up on a dead rank, disk-full and permission errors in
plain words, recovery from a swap killed half way, and the exit hook.

Tests reach the checkpointer through named seams only: its ``faults`` (hooks before each file and
before the commit, the guard switch), ``synchronize_staging()``, ``wait_here()``, the writer's
``future``, and the package's public functions (``commit.commit``, ``writer.report_failure``, ...)."""

import ast
import dataclasses
import gc
import hashlib
import json
import os
import resource
import signal
import subprocess
import sys
import threading
import time
import weakref
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from deepspeed_offload.sizing.host_memory import HostMemory

import deepspeed_offload
from deepspeed_offload.runtime import checkpoint as ck
from deepspeed_offload.runtime import agreement
from deepspeed_offload.runtime.checkpoint import checkpointer, commit, files, names, writer
from deepspeed_offload.runtime.checkpoint.errors import describe_os_error
from deepspeed_offload.runtime.checkpoint.options import Faults, Settings
from deepspeed_offload.runtime.patches import PatchRegistry

SAVE_ID = "0123456789abcdef"


class FakeEngine:
    """Just what the checkpointer touches: save/load/step and a checkpoint engine."""

    def __init__(self, files):
        self.files = files  # [(relative path, state_dict)]
        self.checkpoint_engine = SimpleNamespace(zipfile_serialization=True)
        self.global_steps = 7
        self.steps = 0
        self.loads = 0

    def save_checkpoint(self, save_dir, tag=None, client_state={}, save_latest=True, exclude_frozen_parameters=False):
        assert save_latest is False  # 'latest' is ours to write, after every rank is done
        self.checkpoint_engine.makedirs(os.path.join(save_dir, tag), exist_ok=True)
        for rel, sd in self.files:
            self.checkpoint_engine.save(sd, os.path.join(save_dir, tag, rel))

    def load_checkpoint(self, load_dir, tag=None, **kwargs):
        self.loads += 1
        self.loaded_tag = tag
        return "loaded"

    def step(self):
        self.steps += 1


@pytest.fixture(autouse=True)
def single_rank(monkeypatch):
    from deepspeed import comm
    monkeypatch.setattr(comm, "get_rank", lambda *a, **k: 0)
    monkeypatch.setattr(comm, "get_world_size", lambda *a, **k: 1)


def two_files():
    return FakeEngine([("model.pt", {"w": torch.ones(2)}), ("optim.pt", {"s": torch.arange(50_000.)})])


def saved(tmp_path, tag="t1", engine=None):
    engine = engine or two_files()
    ckpt = ck.AsyncCheckpointer(engine, [])
    engine.save_checkpoint(str(tmp_path), tag=tag)
    ckpt.wait()
    return engine, ckpt


def marker(tag_dir, rank=0):
    return json.loads((Path(tag_dir) / names.MARKER.format(rank)).read_text())


def denied(path, *args):
    """Stands in for files.TrackedFile: the file cannot be created."""
    raise PermissionError(13, "Permission denied", path)


def test_snapshot_aliases_the_store_and_copies_the_rest(tmp_path):
    store = torch.arange(8, dtype=torch.float32)
    in_store = store.narrow(0, 2, 4)
    mine = torch.ones(3)
    holder = torch.zeros(4, requires_grad=True)
    holder.data = in_store  # like a DeepSpeed fp32 master pointing at its host slice
    engine = FakeEngine([("f.pt", {"state": {"m": holder, "step": mine}, "meta": [1, {"x": 2}]})])
    ckpt = ck.AsyncCheckpointer(engine, [store])
    snap = ckpt.stager.snapshot(engine.files[0][1])
    assert snap["state"]["m"].data_ptr() == in_store.data_ptr()  # aliased: no second host copy
    assert snap["state"]["m"].requires_grad  # pickled as DeepSpeed's own save pickles the original
    holder.data = torch.full((4, ), 9.0)  # the step rebinding the tensor to a slot...
    assert torch.equal(snap["state"]["m"], torch.tensor([2., 3., 4., 5.]))  # ...does not reach the alias
    assert snap["state"]["step"].data_ptr() != mine.data_ptr()  # small CPU tensors: copied
    mine.add_(1)
    assert torch.equal(snap["state"]["step"], torch.ones(3))
    assert snap["meta"] == [1, {"x": 2}] and snap["meta"] is not engine.files[0][1]["meta"]


def test_save_writes_aside_then_swaps_in_with_digests(tmp_path):
    engine = two_files()
    ckpt = ck.AsyncCheckpointer(engine, [])
    assert engine.save_checkpoint(str(tmp_path), tag="t1") is True
    engine._deepspeed_offload = SimpleNamespace(checkpointer=ckpt)
    deepspeed_offload.wait_for_checkpoint(engine)
    assert not ck.checkpoint_pending(engine)
    assert (tmp_path / "latest").read_text() == "t1"
    assert torch.equal(torch.load(tmp_path / "t1" / "optim.pt", weights_only=True)["s"], torch.arange(50_000.))
    m = marker(tmp_path / "t1")
    assert m["save_id"] == ckpt.last["save_id"] and m["world"] == 1 and m["tag"] == "t1"
    assert m["digest"] == files.DIGEST == "sha256-pieces-32MiB"
    for name in ("model.pt", "optim.pt"):
        data = (tmp_path / "t1" / name).read_bytes()
        assert m["files"][name] == {"bytes": len(data), files.DIGEST: pieces_digest(data, 32 << 20)}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "t1"]  # no staging, journal or .tmp left
    assert sorted(p.name for p in (tmp_path / "t1").iterdir()) == [names.MARKER.format(0), "model.pt", "optim.pt"]
    assert ck.verify_checkpoint(str(tmp_path / "t1")) is None
    assert ckpt.last["background_s"] is not None and ckpt.last["blocking_s"] >= 0


def pieces_digest(data: bytes, piece: int) -> str:
    """The markers' digest, from its definition: sha256 over the sha256 digests of the pieces, in order."""
    return hashlib.sha256(b"".join(hashlib.sha256(data[i:i + piece]).digest()
                                   for i in range(0, len(data), piece))).hexdigest()


def test_the_digest_hashes_pieces_in_parallel_and_reads_the_earlier_whole_file_one(tmp_path, monkeypatch):
    """Several threads hash a file's pieces (the writer and the load's verification); the result is the
    definition's whatever the piece count, a marker of an earlier version (whole-file sha256) still
    verifies, and a digest this version does not know is refused, not passed."""
    monkeypatch.setattr(files, "PIECE", 1000)
    path = tmp_path / "f"
    for size in (0, 999, 1000, 2500, 10_001):
        data = os.urandom(size)
        path.write_bytes(data)
        assert files.file_digest(str(path)) == pieces_digest(data, 1000), size
        assert files.file_digest(str(path), "sha256") == hashlib.sha256(data).hexdigest()
    with pytest.raises(ValueError, match="unknown digest 'blake3'"):
        files.file_digest(str(path), "blake3")
    tag_dir = make_tag(tmp_path)  # markers without a "digest" key: whole-file sha256, as earlier versions wrote
    assert ck.verify_checkpoint(str(tag_dir), 0, 1) is None
    marker_path = tag_dir / names.MARKER.format(1)
    entry = json.loads(marker_path.read_text())
    entry["digest"] = "blake3"
    marker_path.write_text(json.dumps(entry))
    assert "f1.pt (written by rank 1) cannot be verified: unknown digest 'blake3'" in ck.verify_checkpoint(
        str(tag_dir), 0, 1)


@pytest.mark.parametrize("threads_start", [True, False], ids=["workers", "no_thread_can_start"])
def test_the_digest_is_taken_while_the_file_is_written(tmp_path, monkeypatch, threads_start):
    """Pieces are hashed from the page cache as soon as the writer has passed them (not before: the
    bytes still in the write buffer are flushed first), and the digest is the definition's; where no
    thread can start (interpreter exit), the pieces are hashed at the end."""
    monkeypatch.setattr(files, "PIECE", 4096)
    seen = []
    real = files._hash_range
    monkeypatch.setattr(files, "_hash_range", lambda fd, at, end, path: (seen.append((at, os.fstat(fd).st_size)),
                                                                          real(fd, at, end, path))[1])
    if not threads_start:
        monkeypatch.setattr(files.threading.Thread, "start", lambda self: (_ for _ in ()).throw(RuntimeError("exit")))
    obj = {"a": torch.arange(20_000, dtype=torch.float32), "b": [torch.ones(3000), "meta"]}
    size, digest = files.serialize(str(tmp_path / "x.pt"), obj, True)
    data = (tmp_path / "x.pt.tmp").read_bytes()
    assert size == len(data) and digest == pieces_digest(data, 4096)
    assert sorted(at for at, _ in seen) == list(range(0, size, 4096))  # each piece once
    assert all(on_disk >= min(size, at + 4096) for at, on_disk in seen)  # hashed once written out


def test_a_file_digest_needs_no_thread_and_raises_a_failed_read(tmp_path, monkeypatch):
    """At load the pieces are hashed by worker threads; where none can start (interpreter exit) the
    caller's thread hashes them all, and a read that fails in a worker is raised, not passed."""
    monkeypatch.setattr(files, "PIECE", 1000)
    data = os.urandom(9500)
    (tmp_path / "f").write_bytes(data)
    real = files._hash_range

    def failing(fd, at, end, path):
        if at == 3000 and threading.current_thread() is not threading.main_thread():  # in a worker only
            raise OSError("read failed")
        return real(fd, at, end, path)

    monkeypatch.setattr(files, "_hash_range", failing)
    with pytest.raises(OSError, match="read failed"):
        files.file_digest(str(tmp_path / "f"))
    monkeypatch.setattr(files, "_hash_range", real)
    monkeypatch.setattr(files.threading.Thread, "start", lambda self: (_ for _ in ()).throw(RuntimeError("exit")))
    assert files.file_digest(str(tmp_path / "f")) == pieces_digest(data, 1000)


def test_each_hashing_thread_reads_into_one_buffer_it_reuses(tmp_path, monkeypatch):
    """Hashing reads the file into one buffer per thread, reused from read to read: no bytes object
    per read (freeing one returns its pages with the interpreter's lock held, a stall of the
    training loop's thread for each piece of a save); the digest is still the definition's."""
    monkeypatch.setattr(files, "PIECE", 3000)
    monkeypatch.setattr(files.os, "pread", lambda *a: pytest.fail("a fresh bytes object per read"))
    reads, real = [], os.preadv
    monkeypatch.setattr(files.os, "preadv", lambda fd, bufs, at: (reads.append(
        (threading.get_ident(), id(bufs[0].obj))), real(fd, bufs, at))[1])
    data = os.urandom(50_000)
    (tmp_path / "f").write_bytes(data)
    assert files.file_digest(str(tmp_path / "f")) == pieces_digest(data, 3000)
    buffers = {}
    for thread, buf in reads:
        buffers.setdefault(thread, set()).add(buf)
    assert len(reads) >= 17 and all(len(b) == 1 for b in buffers.values())  # 17 pieces, one buffer a thread


def test_the_writer_starts_the_disk_while_it_serializes(tmp_path, monkeypatch):
    """With ``start_writeback`` (the state copied aside) the disk is asked to write each
    WRITEBACK_EVERY bytes as they are serialized, in order and covering what was written; without it, never."""
    calls = []
    monkeypatch.setattr(files, "_SYNC_FILE_RANGE", lambda fd, offset, n, flags: calls.append((offset, n, flags)))
    monkeypatch.setattr(files, "WRITEBACK_EVERY", 4096)
    obj = {"a": torch.arange(10_000, dtype=torch.float32), "b": torch.ones(5000)}
    size, digest = files.serialize(str(tmp_path / "x.pt"), obj, True, start_writeback=True)
    assert calls and calls[0][0] == 0 and all(f == files.SYNC_FILE_RANGE_WRITE for _, _, f in calls)
    assert all(a[0] + a[1] == b[0] for a, b in zip(calls, calls[1:]))  # contiguous, in order
    assert size - 4096 < calls[-1][0] + calls[-1][1] <= size
    assert torch.equal(torch.load(f"{tmp_path / 'x.pt'}.tmp", weights_only=True)["a"], obj["a"])
    assert digest == files.file_digest(f"{tmp_path / 'x.pt'}.tmp")
    calls.clear()
    files.serialize(str(tmp_path / "y.pt"), obj, True)
    assert calls == []


def test_saving_over_the_tag_latest_names_keeps_it_whole_until_the_swap(tmp_path):
    engine, ckpt = saved(tmp_path, "last")
    before = (tmp_path / "last" / "optim.pt").read_bytes()
    engine.files[1] = ("optim.pt", {"s": torch.zeros(50_000)})
    release = threading.Event()
    ckpt.faults = Faults(before_commit=lambda job: release.wait(10))  # rank 0's commit held
    engine.save_checkpoint(str(tmp_path), tag="last")
    assert ckpt.synchronize_staging(10)
    # every file of the new save is written (aside); the checkpoint 'latest' names is untouched
    assert (tmp_path / "last" / "optim.pt").read_bytes() == before
    assert ck.verify_checkpoint(str(tmp_path / "last")) is None
    assert ck.checkpoint_pending(SimpleNamespace(_deepspeed_offload=SimpleNamespace(checkpointer=ckpt)))
    release.set()
    ckpt.wait()
    assert torch.equal(torch.load(tmp_path / "last" / "optim.pt", weights_only=True)["s"], torch.zeros(50_000))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last", "latest"]


def test_a_save_removes_what_killed_saves_of_its_tag_left_and_nothing_else(tmp_path):
    stale = tmp_path / f".t1.incoming-{SAVE_ID}"
    stale.mkdir()
    (stale / "optim.pt.tmp").write_bytes(b"x" * 100)
    (tmp_path / f".t1.replaced-{SAVE_ID}").mkdir()
    (tmp_path / (names.JOURNAL.format("t1") + ".tmp")).write_text("{")  # torn before its rename
    (tmp_path / ".users-own-dir").mkdir()
    other = tmp_path / f".t1_1.incoming-{SAVE_ID}"  # another engine's save in flight into this folder
    other.mkdir()
    engine = two_files()
    at_commit = []
    ckpt = ck.AsyncCheckpointer(engine, [], faults=Faults(before_commit=lambda job: at_commit.append(
        sorted(os.listdir(tmp_path)))))
    engine.save_checkpoint(str(tmp_path), tag="t1")
    ckpt.wait()
    # already gone when the new save starts (not only once it succeeds)
    assert [n for n in at_commit[0] if not n.startswith(".t1.incoming-")] == [".t1_1.incoming-" + SAVE_ID,
                                                                             ".users-own-dir"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [other.name, ".users-own-dir", "latest", "t1"]


def test_two_engines_saving_into_one_folder_leave_each_other_alone(tmp_path):
    """Accelerate's save_state with two engines: tags pytorch_model and pytorch_model_1, one folder."""
    first, second = two_files(), two_files()
    release = threading.Event()
    ck1 = ck.AsyncCheckpointer(first, [], faults=Faults(before_commit=lambda job: release.wait(10)))
    ck2 = ck.AsyncCheckpointer(second, [])
    first.save_checkpoint(str(tmp_path), tag="pytorch_model")
    assert ck1.synchronize_staging(10)  # the first engine's files are written, its commit not yet done
    second.save_checkpoint(str(tmp_path), tag="pytorch_model_1")
    ck2.wait()
    release.set()
    ck1.wait()
    for tag in ("pytorch_model", "pytorch_model_1"):
        assert ck.verify_checkpoint(str(tmp_path / tag)) is None and (tmp_path / tag / "optim.pt").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "pytorch_model", "pytorch_model_1"]


def test_recover_handles_the_journal_of_every_tag(tmp_path):
    for tag in ("a", "b"):
        staging_with(tmp_path, tag, [0, 1])
        (tmp_path / names.JOURNAL.format(tag)).write_text(json.dumps({"tag": tag, "save_id": SAVE_ID}))
    done = commit.recover(str(tmp_path))
    assert "a" in done and "b" in done and not list(tmp_path.glob(".deepspeed_offload_commit*"))
    assert all(ck.verify_checkpoint(str(tmp_path / tag), 0, 1) is None for tag in ("a", "b"))


def test_swaps_of_one_process_take_turns(tmp_path):
    """Another engine's save (rank 0 is one process) never sees a swap half done."""
    staging_with(tmp_path, "v", [0, 1])
    with commit.SWAP_LOCK:
        t = threading.Thread(target=commit.swap_in, args=(str(tmp_path), "v", SAVE_ID))
        t.start()
        t.join(0.3)
        assert t.is_alive() and not (tmp_path / "v").exists()
    t.join(5)
    assert (tmp_path / "latest").read_text() == "v"


def test_a_failed_write_says_why_at_the_next_step_and_cleans_up(tmp_path, monkeypatch):
    engine, ckpt = saved(tmp_path, "good")
    real_write = files.TrackedFile.write

    def full_disk(self, data):
        if self.nbytes > 1000:
            raise OSError(28, "No space left on device")
        return real_write(self, data)

    monkeypatch.setattr(files.TrackedFile, "write", full_disk)
    engine.save_checkpoint(str(tmp_path), tag="bad")
    assert "No space left on device" in str(ckpt.wait_here())  # known here, not raised yet
    with pytest.raises(ck.CheckpointWriteError, match=r"No space left on device \(ENOSPC\): .*bad.*(model|optim)\.pt"):
        engine.step()
    assert engine.steps == 0  # the step did not run on top of a failed checkpoint
    engine.step()  # reported once; training can go on
    assert engine.steps == 1
    assert (tmp_path / "latest").read_text() == "good" and not (tmp_path / "bad").exists()
    assert not list(tmp_path.rglob("*.tmp"))  # the failed write freed its space at once
    assert ck.verify_checkpoint(str(tmp_path / "good")) is None
    # nothing of the failed save is left, though no later save goes to this folder (HF's checkpoint-N)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["good", "latest"]


def test_a_failure_agreed_at_the_step_removes_the_save_once_every_writer_stopped(tmp_path, monkeypatch):
    """Another rank failed while this rank's writer is still busy: the step waits for it before the
    failed save's staging directory goes (nothing may still be writing into it)."""
    engine = two_files()
    release = threading.Event()

    def held_commit(job):  # rank 0 waiting for rank 1's marker, which never comes
        release.wait(10)
        raise ck.CheckpointWriteError("rank 1's write failed: disk full")

    ckpt = ck.AsyncCheckpointer(engine, [], faults=Faults(before_commit=held_commit))
    engine.save_checkpoint(str(tmp_path), tag="t")
    calls = []  # from here on, rank 1 (simulated) reports its failure at the first agreement
    monkeypatch.setattr(agreement, "agree",
                        lambda msg: calls.append(msg) or ([(1, "disk full")] if len(calls) == 1 else []))
    staging = Path(names.staging_dir(str(tmp_path), "t", ckpt.last["save_id"]))
    raised = []

    def step():
        try:
            engine.step()
        except ck.CheckpointWriteError as e:
            raised.append(str(e))

    t = threading.Thread(target=step)
    t.start()
    t.join(0.5)
    assert t.is_alive() and staging.is_dir()  # this rank's writer still running: nothing removed yet
    release.set()
    t.join(10)
    assert "rank 1: disk full" in raised[0] and calls[1:] == [None]  # the second agreement: every writer done
    assert not staging.exists() and not (tmp_path / "t").exists() and engine.steps == 0


def test_a_failure_that_lands_while_the_ranks_agree_is_not_lost(tmp_path, monkeypatch):
    release = threading.Event()

    def failing_commit(job):
        release.wait(10)
        raise ck.CheckpointWriteError("late: No space left on device")

    engine = two_files()
    ckpt = ck.AsyncCheckpointer(engine, [], faults=Faults(before_commit=failing_commit))
    engine.save_checkpoint(str(tmp_path), tag="t")
    real_agree = agreement.agree
    agreed = []

    def agree_while_the_writer_fails(message):
        agreed.append(message)
        release.set()
        assert ckpt.wait_here() is not None  # the writer's failure lands during the agreement
        return real_agree(message)

    monkeypatch.setattr(agreement, "agree", agree_while_the_writer_fails)
    engine.step()  # nothing had failed when its agreement started
    assert agreed == [None] and engine.steps == 1
    monkeypatch.setattr(agreement, "agree", real_agree)
    with pytest.raises(ck.CheckpointWriteError, match="late: No space left"):
        ckpt.wait()


def test_file_too_large_is_named_not_unexpected_pos(tmp_path):
    """A real write past RLIMIT_FSIZE (EFBIG): torch.save would say "unexpected pos"."""
    engine, ckpt = saved(tmp_path, "good")
    engine.files[1] = ("optim.pt", {"s": torch.arange(100_000.)})
    old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, hard))
    try:
        engine.save_checkpoint(str(tmp_path), tag="big")
        ckpt.wait_here()
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, old_handler)
    with pytest.raises(ck.CheckpointWriteError, match=r"File too large \(EFBIG\): .*big.*optim\.pt") as err:
        ckpt.wait()
    assert "unexpected pos" not in str(err.value)
    assert (tmp_path / "latest").read_text() == "good" and not list(tmp_path.rglob("*.tmp"))


def test_a_failed_rank_removes_only_its_own_tmp_files(tmp_path):
    """The staging directory is shared: another rank may be between writing and renaming."""
    staging = tmp_path / f".t.incoming-{SAVE_ID}"
    staging.mkdir()
    for name in ("f0.pt.tmp", "f1.pt.tmp", names.MARKER.format(0) + ".tmp", names.MARKER.format(1) + ".tmp"):
        (staging / name).write_bytes(b"x")
    job = writer.SaveJob(save_dir=str(tmp_path), tag="t", save_id=SAVE_ID, rank=1, world=2, save_latest=True,
                         zipfile=True, paths=(str(staging / "f1.pt"), ))
    writer.report_failure(job, "File too large")
    assert sorted(p.name for p in staging.iterdir()) == sorted(
        [names.FAILED.format(1), "f0.pt.tmp", names.MARKER.format(0) + ".tmp"])
    assert (staging / names.FAILED.format(1)).read_text() == "File too large"


def test_permission_denied_is_named_with_the_path(tmp_path, monkeypatch):
    engine = two_files()
    ckpt = ck.AsyncCheckpointer(engine, [])
    monkeypatch.setattr(files, "TrackedFile", denied)
    engine.save_checkpoint(str(tmp_path), tag="t")
    with pytest.raises(ck.CheckpointWriteError, match=r"Permission denied \(EACCES\): .*model\.pt\.tmp"):
        ckpt.wait()


def test_a_directory_that_cannot_be_created_fails_the_save_at_once(tmp_path):
    blocker = tmp_path / "not_a_dir"
    blocker.write_text("x")  # a file where the save directory should go: fails even as root
    engine = two_files()
    ck.AsyncCheckpointer(engine, [])
    with pytest.raises(ck.CheckpointWriteError, match=r"not_a_dir.*(Not a directory|File exists)"):
        engine.save_checkpoint(str(blocker / "sub"), tag="t2")


def staging_with(tmp_path, tag, ranks_done, world=2):
    staging = Path(names.staging_dir(str(tmp_path), tag, SAVE_ID))
    staging.mkdir(parents=True)
    for r in ranks_done:
        (staging / f"f{r}.pt").write_bytes(b"data%d" % r)
        (staging / names.MARKER.format(r)).write_text(json.dumps(
            {"save_id": SAVE_ID, "tag": tag, "rank": r, "world": world, "files": {
                f"f{r}.pt": {"bytes": 5, "sha256": hashlib.sha256(b"data%d" % r).hexdigest()}}}))
    return staging


def commit_of(tmp_path, tag, world=2, **settings):
    """Rank 0's commit of the save staging_with wrote (``settings``: the Settings that differ)."""
    return lambda: commit.commit(str(tmp_path), tag, SAVE_ID, world, True, Settings(**settings))


def test_latest_waits_for_every_rank(tmp_path):
    staging = staging_with(tmp_path, "t3", [0])
    (staging / names.ALIVE.format(1)).touch()
    beat = writer.Heartbeat(str(staging / names.ALIVE.format(1)), 0.5)  # rank 1 alive and still writing
    t = threading.Thread(target=commit_of(tmp_path, "t3"))
    t.start()
    t.join(1.0)
    assert t.is_alive() and not (tmp_path / "latest").exists()
    staging_with(tmp_path / "elsewhere", "t3", [1])
    os.replace(tmp_path / "elsewhere" / staging.name / "f1.pt", staging / "f1.pt")
    os.replace(tmp_path / "elsewhere" / staging.name / names.MARKER.format(1), staging / names.MARKER.format(1))
    beat.stop()
    t.join(5)
    assert (tmp_path / "latest").read_text() == "t3"
    assert ck.verify_checkpoint(str(tmp_path / "t3"), 0, 1) is None
    assert not list((tmp_path / "t3").glob("*.alive"))


def test_a_dead_rank_fails_the_commit_within_the_heartbeat_timeout(tmp_path):
    (tmp_path / "latest").write_text("previous")
    staging = staging_with(tmp_path, "t4", [0])
    (staging / names.ALIVE.format(1)).touch()  # rank 1 started, then nobody touches its heartbeat
    t0 = time.monotonic()
    with pytest.raises(ck.CheckpointWriteError, match=r"rank 1 stopped writing \(its heartbeat stopped"):
        commit_of(tmp_path, "t4", heartbeat_timeout_s=0.5)()
    assert time.monotonic() - t0 < 3
    assert (tmp_path / "latest").read_text() == "previous" and not (tmp_path / "t4").exists()


def test_a_heartbeat_never_seen_asks_whether_save_dir_is_shared(tmp_path):
    """Every rank creates its heartbeat before the save's all-reduce: one rank 0 never sees is on a
    disk rank 0 does not see (save_dir local to each node), not a dead process."""
    staging_with(tmp_path, "t5", [0])
    with pytest.raises(ck.CheckpointWriteError, match=r"rank 1's files are not visible from rank 0 .*"
                       r"is save_dir on storage all nodes share\?"):
        commit_of(tmp_path, "t5", heartbeat_timeout_s=0.3)()


def test_a_failed_rank_stops_the_commit_at_once(tmp_path):
    staging = staging_with(tmp_path, "t6", [0])
    (staging / names.FAILED.format(1)).write_text("No space left on device (ENOSPC): /x/f1.pt")
    with pytest.raises(ck.CheckpointWriteError, match=r"rank 1's write failed: No space left"):
        commit_of(tmp_path, "t6")()
    assert not (tmp_path / "latest").exists()


def test_commit_gives_up_after_the_commit_timeout(tmp_path):
    staging = staging_with(tmp_path, "t7", [0])
    beat = writer.Heartbeat(str(staging / names.ALIVE.format(1)), 0.05)
    try:
        with pytest.raises(TimeoutError, match=r"rank\(s\) \[1\] did not finish"):
            commit_of(tmp_path, "t7", commit_timeout_s=0.3)()
    finally:
        beat.stop()


def test_settings_are_read_when_a_checkpointer_is_made(monkeypatch):
    monkeypatch.setenv("DS_OFFLOAD_HEARTBEAT_TIMEOUT", "3")
    monkeypatch.setenv("DS_OFFLOAD_COMMIT_TIMEOUT", "60")
    monkeypatch.delenv("DS_OFFLOAD_HEARTBEAT_INTERVAL", raising=False)
    ckpt = ck.AsyncCheckpointer(FakeEngine([]), [])
    assert ckpt.settings == Settings(commit_timeout_s=60, heartbeat_interval_s=0.5, heartbeat_timeout_s=3)
    given = Settings(heartbeat_timeout_s=1)
    assert ck.AsyncCheckpointer(FakeEngine([]), [], settings=given).settings is given


def test_the_commit_waits_as_the_environment_said_when_the_checkpointer_was_made(tmp_path, monkeypatch):
    """A world of two ranks in which rank 1 never shows up: rank 0's commit gives up after the
    heartbeat timeout of the checkpointer's settings, read from the environment at its creation."""
    monkeypatch.setattr(agreement, "rank_world", lambda: (0, 2))
    monkeypatch.setattr(agreement, "new_save_id", lambda rank: SAVE_ID)
    monkeypatch.setattr(agreement, "agree", lambda message: [(0, message)] if message else [])
    monkeypatch.setenv("DS_OFFLOAD_HEARTBEAT_TIMEOUT", "0.3")
    engine = two_files()
    ckpt = ck.AsyncCheckpointer(engine, [])
    monkeypatch.delenv("DS_OFFLOAD_HEARTBEAT_TIMEOUT")
    t0 = time.monotonic()
    engine.save_checkpoint(str(tmp_path), tag="t")
    with pytest.raises(ck.CheckpointWriteError, match=r"rank 1's files are not visible from rank 0 .*"
                       r"DS_OFFLOAD_HEARTBEAT_TIMEOUT=0\.3\)"):
        ckpt.wait()
    assert time.monotonic() - t0 < 5
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # the failed save removed, no 'latest'


@pytest.mark.parametrize("state", ["renamed_aside", "only_aside", "done_but_journal"])
def test_recover_finishes_or_undoes_a_killed_swap(tmp_path, state):
    staging = staging_with(tmp_path, "ck", [0, 1])
    old = Path(names.replaced_dir(str(tmp_path), "ck", SAVE_ID))
    old.mkdir()
    (old / "old.pt").write_bytes(b"old")
    (tmp_path / names.JOURNAL.format("ck")).write_text(json.dumps({"tag": "ck", "save_id": SAVE_ID}))
    if state == "only_aside":
        import shutil
        shutil.rmtree(staging)
    if state == "done_but_journal":
        os.rename(staging, tmp_path / "ck")
    done = commit.recover(str(tmp_path))
    assert not (tmp_path / names.JOURNAL.format("ck")).exists()
    if state == "only_aside":
        assert "undid" in done and (tmp_path / "ck" / "old.pt").exists()
    else:
        assert (state == "done_but_journal") == (done is None)
        assert ck.verify_checkpoint(str(tmp_path / "ck"), 0, 1) is None and (tmp_path / "ck" / "f1.pt").exists()
    assert commit.recover(str(tmp_path)) is None  # nothing left to do


def make_tag(tmp_path, world=2):
    staging_with(tmp_path, "v", list(range(world)), world=world)
    commit.swap_in(str(tmp_path), "v", SAVE_ID)
    return tmp_path / "v"


def test_verify_accepts_a_complete_checkpoint_and_ignores_foreign_ones(tmp_path):
    tag_dir = make_tag(tmp_path)
    assert ck.verify_checkpoint(str(tag_dir), 0, 2) is None and ck.verify_checkpoint(str(tag_dir), 1, 2) is None
    plain = tmp_path / "plain"  # a DeepSpeed save without our markers: not ours to judge
    plain.mkdir()
    (plain / "zero_pp_rank_0_mp_rank_00_model_states.pt").write_bytes(b"x")
    assert ck.verify_checkpoint(str(plain)) is None


def test_verify_refuses_flipped_bytes_naming_rank_and_file(tmp_path):
    tag_dir = make_tag(tmp_path)
    (tag_dir / "f1.pt").write_bytes(b"dXta1")  # same size, other content
    assert ck.verify_checkpoint(str(tag_dir), 0, 2) is None  # rank 0 hashes rank 0's files only
    msg = ck.verify_checkpoint(str(tag_dir), 1, 2)
    assert "f1.pt (written by rank 1) does not match its sha256 digest" in msg  # (an earlier version's marker)
    assert "f1.pt (written by rank 1)" in ck.verify_checkpoint(str(tag_dir), 0, 1)  # one rank hashes all


def test_verify_refuses_truncated_missing_incomplete_mixed_and_stray(tmp_path):
    tag_dir = make_tag(tmp_path)
    (tag_dir / "f1.pt").write_bytes(b"dat")
    assert "f1.pt (written by rank 1) is 3 bytes, its marker says 5: truncated" in ck.verify_checkpoint(str(tag_dir))
    (tag_dir / "f1.pt").unlink()
    assert "f1.pt (written by rank 1) is missing" in ck.verify_checkpoint(str(tag_dir))
    (tag_dir / "f1.pt").write_bytes(b"data1")
    (tag_dir / "zero_pp_rank_2_mp_rank_00_optim_states.pt").write_bytes(b"old")
    assert "not part of its save" in ck.verify_checkpoint(str(tag_dir))
    (tag_dir / "zero_pp_rank_2_mp_rank_00_optim_states.pt").unlink()
    m1 = json.loads((tag_dir / names.MARKER.format(1)).read_text())
    (tag_dir / names.MARKER.format(1)).write_text(json.dumps(dict(m1, save_id="fedcba9876543210")))
    assert "mixes files of different saves (rank 0: save 0123456789abcdef" in ck.verify_checkpoint(str(tag_dir))
    (tag_dir / names.MARKER.format(1)).unlink()
    assert "incomplete: rank(s) [1] of 2 have no completion marker" in ck.verify_checkpoint(str(tag_dir))
    (tag_dir / names.MARKER.format(1)).write_text("{not json")
    assert "completion marker of rank 1 is unreadable" in ck.verify_checkpoint(str(tag_dir))


def test_load_refuses_before_deepspeed_reads_anything(tmp_path):
    engine, ckpt = saved(tmp_path, "t1")
    assert engine.load_checkpoint(str(tmp_path)) == "loaded" and engine.loads == 1
    data = bytearray((tmp_path / "t1" / "optim.pt").read_bytes())
    data[-100] ^= 0xFF
    (tmp_path / "t1" / "optim.pt").write_bytes(bytes(data))
    with pytest.raises(ck.CheckpointLoadError, match=r"t1/optim\.pt \(written by rank 0\) does not match"):
        engine.load_checkpoint(str(tmp_path))  # the tag from 'latest'
    with pytest.raises(ck.CheckpointLoadError):
        engine.load_checkpoint(str(tmp_path), tag="t1")
    assert engine.loads == 1


def test_load_passes_on_the_tag_it_verified_and_agrees_on_every_rank(tmp_path, monkeypatch):
    engine, ckpt = saved(tmp_path, "t1")
    calls = []
    real_agree = agreement.agree
    monkeypatch.setattr(agreement, "agree", lambda msg: calls.append(msg) or real_agree(msg))
    engine.load_checkpoint(str(tmp_path))
    assert engine.loaded_tag == "t1"  # DeepSpeed does not read 'latest' again (it may have moved)
    with_latest = len(calls)
    (tmp_path / "latest").unlink()  # a rank that finds no 'latest' takes part in the same all-reduces
    calls.clear()
    engine.load_checkpoint(str(tmp_path))
    assert len(calls) == with_latest and calls[-1] is None and engine.loaded_tag is None


def test_a_universal_load_verifies_the_tag_latest_universal_names(tmp_path):
    engine, ckpt = saved(tmp_path, "t1")
    engine.save_checkpoint(str(tmp_path), tag="t2")
    ckpt.wait()
    (tmp_path / "latest_universal").write_text("t1")
    data = bytearray((tmp_path / "t1" / "optim.pt").read_bytes())
    data[-100] ^= 0xFF
    (tmp_path / "t1" / "optim.pt").write_bytes(bytes(data))
    engine.load_checkpoint(str(tmp_path))  # 'latest' names t2: intact
    assert engine.loaded_tag == "t2"
    engine.load_universal_checkpoint = lambda: True
    with pytest.raises(ck.CheckpointLoadError, match=r"t1/optim\.pt \(written by rank 0\) does not match"):
        engine.load_checkpoint(str(tmp_path))


def test_load_finishes_a_swap_killed_half_way(tmp_path):
    engine, ckpt = saved(tmp_path, "t1")
    aside = Path(names.replaced_dir(str(tmp_path), "t1", SAVE_ID))
    os.rename(tmp_path / "t1", aside)  # killed between the two renames of a save that failed later
    (tmp_path / names.JOURNAL.format("t1")).write_text(json.dumps({"tag": "t1", "save_id": SAVE_ID}))
    assert engine.load_checkpoint(str(tmp_path)) == "loaded"
    assert ck.verify_checkpoint(str(tmp_path / "t1")) is None


def store_engine():
    """An engine whose one file holds two tensors of a host store (like an fp32 master and a moment of
    two sub-groups), and a third range of the store the save does not read."""
    store = torch.arange(3000, dtype=torch.float32)
    state = {"a": store.narrow(0, 0, 1000), "b": store.narrow(0, 1000, 1000)}
    return FakeEngine([("optim.pt", {"state": state})]), store


def ranges(store, start, n):
    return [(store.data_ptr() + 4 * start, 4 * n)]


@pytest.mark.parametrize("aside", [True, False], ids=["copied_aside", "written_from_the_store"])
def test_guard_waits_only_for_the_ranges_it_overwrites(tmp_path, monkeypatch, aside):
    """The writer held before its file: with the state copied aside the step may overwrite the store once
    the copies are done; written from the store, it waits for each range until that range is in the
    file, and never for a range the save does not read."""
    from deepspeed_offload.runtime.checkpoint import staging
    monkeypatch.setattr(staging.HostMemory, "read",
                        classmethod(lambda cls: HostMemory(total=2**40, available=2**40 if aside else 0)))
    hold = threading.Event()
    engine, store = store_engine()
    ckpt = ck.AsyncCheckpointer(engine, [store], faults=Faults(before_file=lambda path: hold.wait(10)))
    engine.save_checkpoint(str(tmp_path), tag="t")
    assert ckpt.stager.copies_aside is aside
    ckpt.guard(ranges(store, 2000, 1000))  # not read by the save: at once
    released = []
    t = threading.Thread(target=lambda: (ckpt.guard(ranges(store, 500, 10)), released.append(True)))
    t.start()
    t.join(0.3)  # (returns once the guard let it through: the other copy may still be running)
    assert bool(released) is aside and ckpt.synchronize_staging(5 if aside else 0) is aside
    store.fill_(-1.0)  if aside else None  # copied aside: the store may change, the file keeps the saved values
    hold.set()
    t.join(5)
    assert released
    ckpt.wait()
    saved = torch.load(tmp_path / "t" / "optim.pt", weights_only=False)["state"]
    assert torch.equal(saved["a"], torch.arange(1000, dtype=torch.float32))
    assert saved["a"].untyped_storage().nbytes() == 4000  # its own bytes, not the whole store


def test_copies_aside_go_into_the_buffer_reserved_at_attach(tmp_path, monkeypatch):
    """With ``aside_bytes`` the copies land in one buffer touched when the checkpointer was made (even
    with no host memory spare at the save), every save reuses it, each file holds its tensors' own
    bytes; a save larger than the buffer gets fresh memory, or is written from the store where the host
    has none."""
    from deepspeed_offload.runtime.checkpoint import staging
    spare = {"bytes": 0}
    monkeypatch.setattr(staging.HostMemory, "read",
                        classmethod(lambda cls: HostMemory(total=2**40, available=spare["bytes"])))
    engine, store = store_engine()
    ckpt = ck.AsyncCheckpointer(engine, [store], aside_bytes=2 * staging.aligned(4000))
    buf = ckpt.stager.aside.tensor
    assert ckpt.stager.aside_bytes == 8064 and torch.equal(buf, torch.zeros_like(buf))  # touched
    inside = lambda t: buf.data_ptr() <= t.data_ptr() < buf.data_ptr() + buf.numel()  # noqa: E731
    targets, real = [], staging._copy
    monkeypatch.setattr(staging, "_copy", lambda regions, start, n, src, dst: (targets.append(dst), real(
        regions, start, n, src, dst)))
    for tag, value in (("t1", 1.0), ("t2", 2.0)):
        targets.clear()
        store.fill_(value)
        engine.save_checkpoint(str(tmp_path), tag=tag)
        assert ckpt.synchronize_staging(10)  # copied (the writer may still be serializing the copies)
        assert ckpt.stager.copies_aside and len(targets) == 2 and all(inside(t) for t in targets)
        assert targets[0].data_ptr() % staging.ALIGN == 0 and targets[1].data_ptr() % staging.ALIGN == 0
        store.fill_(-1.0)  # the step overwrites the store once copied: the files keep the saved values
        ckpt.wait()
        saved = torch.load(tmp_path / tag / "optim.pt", weights_only=False)["state"]
        assert torch.equal(saved["a"], torch.full((1000, ), value)) and torch.equal(saved["b"], saved["a"])
        assert saved["a"].untyped_storage().nbytes() == 4000
    engine.files[0][1]["state"]["c"] = store.narrow(0, 2000, 1000)  # a third tensor: more than the buffer holds
    engine.save_checkpoint(str(tmp_path), tag="t3")
    assert not ckpt.stager.copies_aside  # no buffer room and no host memory spare: written from the store
    ckpt.wait()
    spare["bytes"] = 2**40
    targets.clear()
    engine.save_checkpoint(str(tmp_path), tag="t4")
    assert ckpt.synchronize_staging(10)
    assert ckpt.stager.copies_aside and len(targets) == 3 and not any(inside(t) for t in targets)
    ckpt.wait()
    assert ckpt.last["phases"].keys() == {"copy_aside_s", "serialize_s", "flush_s"}


class OnDevice(torch.Tensor):
    """A CPU tensor that says it is on a GPU: what the snapshot sees of the state the plan keeps resident."""

    @property
    def device(self):
        return torch.device("cuda", 0)


def test_device_tensors_are_snapshotted_into_the_reserved_buffer(tmp_path, monkeypatch):
    """The measured plan's resident state (device tensors) is copied into the reserved buffer first,
    the store's copies aside into what is left; a device tensor that does not fit, or is not
    contiguous, is copied into memory of its own. Every file holds the values of the save's moment."""
    from deepspeed_offload.runtime.checkpoint import staging
    monkeypatch.setattr(staging.HostMemory, "read", classmethod(lambda cls: HostMemory(total=2**40, available=0)))
    engine, store = store_engine()  # two store tensors of 4000 bytes
    resident = torch.full((500, ), 3.0).as_subclass(OnDevice)  # 2000 bytes
    wide = torch.arange(6000, dtype=torch.float32).reshape(2, 3000)[:, :1000].as_subclass(OnDevice)  # strided
    engine.files[0][1]["state"].update(r=resident, w=wide)
    ckpt = ck.AsyncCheckpointer(engine, [store], aside_bytes=staging.aligned(2000) + 2 * staging.aligned(4000))
    buf = ckpt.stager.aside.tensor
    inside = lambda t: buf.data_ptr() <= t.data_ptr() < buf.data_ptr() + buf.numel()  # noqa: E731
    snapped = {}
    real = ckpt.stager.snapshot
    # (recursive: the call that ends last is the whole state dict's)
    monkeypatch.setattr(ckpt.stager, "snapshot", lambda obj: snapped.__setitem__("sd", real(obj)) or snapped["sd"])
    engine.save_checkpoint(str(tmp_path), tag="t")
    assert ckpt.synchronize_staging(10)
    state = snapped["sd"]["state"]
    assert inside(state["r"]) and not inside(state["w"]) and ckpt.stager.copies_aside
    assert inside(state["a"]) and inside(state["b"])  # the store's copies aside in what was left
    resident.fill_(-1.0)
    store.fill_(-1.0)
    ckpt.wait()
    saved = torch.load(tmp_path / "t" / "optim.pt", weights_only=False)["state"]
    assert torch.equal(saved["r"], torch.full((500, ), 3.0)) and torch.equal(saved["a"], torch.arange(1000.))
    assert torch.equal(saved["w"], torch.arange(6000.).reshape(2, 3000)[:, :1000])
    engine.files[0][1]["state"]["r"] = torch.zeros(5000).as_subclass(OnDevice)  # larger than what is left
    snapped.clear()
    engine.save_checkpoint(str(tmp_path), tag="t2")
    assert ckpt.synchronize_staging(10)
    state = snapped["sd"]["state"]
    assert not inside(state["r"]) and inside(state["a"]) and ckpt.stager.copies_aside  # the store's still fit
    ckpt.wait()


def test_the_store_copies_keep_their_room_and_empty_device_tensors_stay_apart(tmp_path, monkeypatch):
    """A buffer of the store's size exactly: a device tensor saved beside the store's (a parameter
    ZeRO-3 keeps whole on the GPU) does not take the store's copies' room; empty device tensors (the
    partitioned parameters' placeholders) of different dtypes side by side still save."""
    from deepspeed_offload.runtime.checkpoint import staging
    monkeypatch.setattr(staging.HostMemory, "read", classmethod(lambda cls: HostMemory(total=2**40, available=0)))
    engine, store = store_engine()
    engine.files.insert(0, ("model.pt", {"ln": torch.ones(10).as_subclass(OnDevice),
                                         "p": [torch.empty(0, dtype=torch.bfloat16).as_subclass(OnDevice),
                                               torch.empty(0, dtype=torch.int64).as_subclass(OnDevice),
                                               torch.empty(0).as_subclass(OnDevice)]}))
    ckpt = ck.AsyncCheckpointer(engine, [store], aside_bytes=2 * staging.aligned(4000))
    buf = ckpt.stager.aside.tensor
    targets, real = [], staging._copy
    monkeypatch.setattr(staging, "_copy", lambda regions, start, n, src, dst: (targets.append(dst), real(
        regions, start, n, src, dst)))
    engine.save_checkpoint(str(tmp_path), tag="t")
    assert ckpt.synchronize_staging(10) and ckpt.stager.copies_aside
    assert len(targets) == 2 and all(buf.data_ptr() <= t.data_ptr() < buf.data_ptr() + buf.numel() for t in targets)
    ckpt.wait()
    model = torch.load(tmp_path / "t" / "model.pt", weights_only=False)
    assert torch.equal(model["ln"], torch.ones(10)) and [t.dtype for t in model["p"]] == [
        torch.bfloat16, torch.int64, torch.float32]


class Held(OnDevice):
    """Resident state whose copy to the host starts only once its gate opens (``gates``, by value),
    recording the order the copies start in."""
    gates, started = {}, []

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func is torch.Tensor.copy_ and isinstance(args[1], Held):
            value = float(args[1].as_subclass(torch.Tensor)[0])
            cls.started.append(value)
            assert cls.gates[value].wait(10)
        return super().__torch_function__(func, types, args, kwargs)


def test_resident_state_is_copied_after_the_save_returns_and_the_step_waits_for_its_sub_group(tmp_path):
    """The resident state (device tensors of sub-groups 0 and 1) is copied to the host after
    save_checkpoint returned, in the step's order (sub-group 0 first, whatever order the state dict lists
    them in); guard_resident waits only for the sub-group it names; a device tensor of no sub-group (a
    parameter ZeRO-3 keeps whole) is copied before the save returns. Every file holds the values of the
    save's moment."""
    Held.gates, Held.started = {0.5: threading.Event(), 1.5: threading.Event()}, []
    sg0, sg1 = torch.full((500, ), 0.5).as_subclass(Held), torch.full((500, ), 1.5).as_subclass(Held)
    whole = torch.ones(10).as_subclass(OnDevice)
    engine = FakeEngine([("optim.pt", {"state": {"m1": sg1, "m0": sg0}}), ("model.pt", {"ln": whole})])
    owners = {sg0.data_ptr(): 0, sg1.data_ptr(): 1}
    ckpt = ck.AsyncCheckpointer(engine, [], owners=lambda: owners)
    ranges = {i: [(t.data_ptr(), 2000)] for i, t in ((0, sg0), (1, sg1))}
    engine.save_checkpoint(str(tmp_path), tag="t")  # returns with both copies still to run
    assert ckpt.copying_resident()
    whole.fill_(-1.0)
    passed = []
    waiters = [threading.Thread(target=lambda i=i: (ckpt.guard_resident(ranges[i]), passed.append(i)))
               for i in (0, 1)]
    for t in waiters:
        t.start()
    time.sleep(0.3)
    assert passed == [] and Held.started == [0.5]  # the step waits; sub-group 0's copy goes first
    Held.gates[0.5].set()
    waiters[0].join(5)
    assert passed == [0] and not ckpt.synchronize_staging(0.2)  # sub-group 1 still waits for its copy
    sg0.fill_(-1.0)  # the step updates sub-group 0: its copy is done
    Held.gates[1.5].set()
    waiters[1].join(5)
    assert passed == [0, 1] and Held.started == [0.5, 1.5] and ckpt.synchronize_staging(5)
    assert not ckpt.copying_resident()  # the step no longer works out its sub-groups' ranges
    sg1.fill_(-1.0)
    ckpt.wait()
    saved = torch.load(tmp_path / "t" / "optim.pt", weights_only=False)["state"]
    assert torch.equal(saved["m0"], torch.full((500, ), 0.5)) and torch.equal(saved["m1"], torch.full((500, ), 1.5))
    assert torch.equal(torch.load(tmp_path / "t" / "model.pt", weights_only=False)["ln"], torch.ones(10))


def test_a_failed_copy_of_the_resident_state_fails_the_save_and_lets_the_step_go(tmp_path):
    """A copy of the resident state that raises: the step's guard does not hang, and the save fails
    (raised on wait) instead of writing a file with what the copy did not bring."""
    Held.gates, Held.started = {0.5: threading.Event()}, []
    sg0 = torch.full((500, ), 0.5).as_subclass(Held)
    engine = FakeEngine([("optim.pt", {"state": {"m0": sg0}})])
    ckpt = ck.AsyncCheckpointer(engine, [], owners=lambda: {sg0.data_ptr(): 0})
    Held.gates[0.5].wait = lambda timeout=None: (_ for _ in ()).throw(RuntimeError("copy failed"))
    engine.save_checkpoint(str(tmp_path), tag="t")
    ckpt.guard_resident([(sg0.data_ptr(), 2000)])  # returns: nothing is left to wait for
    with pytest.raises(ck.CheckpointWriteError, match="copy failed"):
        ckpt.wait()
    assert not (tmp_path / "t").exists()


def test_deepspeeds_prepare_of_a_resident_sub_group_waits_for_the_save_first():
    """The hook on ``_prepare_sub_group``: a resident sub-group waits for the save's copy of it before
    DeepSpeed prepares (then updates) it; a streamed one does not (its host regions have their guard)."""
    from deepspeed_offload.runtime.step import hooks
    calls = []
    mode = SimpleNamespace(streams=lambda i: i == 1, bring_in=lambda i: True,
                           guard_resident=lambda i=None: calls.append(("wait", i)))
    prepare = hooks._prepare(mode, lambda i, timer_names: calls.append(("prepare", i)))
    prepare(0, None)
    prepare(1, None)
    assert calls == [("wait", 0), ("prepare", 0), ("prepare", 1)]


def test_the_owners_of_resident_state_include_sub_groups_resident_since_attach():
    """A sub-group kept resident at attach has no slices in the host store: its tensors (master and
    optimizer state, not a 0-dim step) are still found, and mapped to it."""
    from deepspeed_offload.runtime.memory.state_tensors import StateTensors
    masters = [torch.zeros(4), torch.zeros(6)]
    state = {m: {"exp_avg": torch.zeros_like(m), "exp_avg_sq": torch.zeros_like(m), "step": torch.tensor(3.)}
             for m in masters}
    opt = SimpleNamespace(fp32_partitioned_groups_flat=masters, optimizer=SimpleNamespace(state=state))
    tensors = StateTensors(opt, SimpleNamespace(slices={1: {}}), order=[1])  # sub-group 0: resident since attach
    owners = tensors.owners([0, 1])
    assert len(owners) == 6 and owners[masters[0].data_ptr()] == 0
    assert owners[state[masters[1]]["exp_avg"].data_ptr()] == 1
    assert tensors.byte_ranges(0) == [(t.data_ptr(), t.numel() * 4) for t in (masters[0], state[masters[0]]["exp_avg"],
                                                                           state[masters[0]]["exp_avg_sq"])]


class StreamlessGPU:
    """An accelerator with streams and events that do nothing (the CPU runs each copy at once): the
    bounce-buffer path of DeviceSnapshot, piece by piece, on the CPU."""

    def __init__(self, pin_fails=False):
        self.pin_fails, self.pinned, self.events = pin_fails, 0, 0

    def is_synchronized_device(self):
        return False

    def device_name(self):
        return "cuda"

    def Stream(self):
        return SimpleNamespace(wait_event=lambda event: None, synchronize=lambda: None)

    def Event(self):
        self.events += 1
        return SimpleNamespace(record=lambda stream=None: None, synchronize=lambda: None)

    def current_stream(self):
        return None

    def stream(self, stream):
        import contextlib
        return contextlib.nullcontext()

    def pin_memory(self, t):
        if self.pin_fails:
            raise RuntimeError("CUDA error: out of memory")
        self.pinned += 1
        return t


@pytest.mark.parametrize("pin_fails", [False, True], ids=["pinned", "pageable_fallback"])
def test_the_resident_state_goes_through_two_bounce_buffers_piece_by_piece(pin_fails):
    """Tensors larger than a bounce buffer go through in pieces, alternating between the two buffers,
    each tensor's range done once its last piece landed; the copies equal their sources. A bounce
    buffer that cannot be pinned is pageable (the copies still run on the snapshot's thread)."""
    from deepspeed_offload.runtime.checkpoint.device_snapshot import DeviceSnapshot
    acc = StreamlessGPU(pin_fails)
    snap = DeviceSnapshot(acc=acc, piece_bytes=256)
    srcs = [torch.randn(1000), torch.arange(7, dtype=torch.bfloat16), torch.randn(64)]  # 16 pieces, 1, 1
    dsts = [torch.empty_like(t) for t in srcs]
    regions, future = snap.start(list(zip(dsts, srcs)))
    future.result(5)
    assert all(torch.equal(d, s) for d, s in zip(dsts, srcs)) and not regions.pending()
    assert acc.pinned == (0 if pin_fails else 2) and len(snap._bounce) == 2
    assert acc.events == 1 + 16 + 1 + 1  # the save's mark, then one per piece
    snap.close()


def test_a_buffer_that_cannot_be_reserved_is_done_without(tmp_path, monkeypatch, caplog):
    """The host ran short between attach's judgment and the reservation: a warning, and each save
    copies into fresh memory where the host has it (as without a reservation); forget() lets the
    copy threads and a reserved buffer go."""
    from deepspeed_offload.runtime.checkpoint import staging

    def short(nbytes, pool):
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory")

    monkeypatch.setattr(staging, "AsideBuffer", short)
    monkeypatch.setattr(staging.HostMemory, "read", classmethod(lambda cls: HostMemory(total=2**40, available=2**40)))
    engine, store = store_engine()
    with caplog.at_level("WARNING"):
        ckpt = ck.AsyncCheckpointer(engine, [store], aside_bytes=8064)
    assert ckpt.stager.aside_bytes == 0 and "could not be reserved (DefaultCPUAllocator" in caplog.text
    engine.save_checkpoint(str(tmp_path), tag="t")
    ckpt.wait()
    assert ckpt.stager.copies_aside
    ckpt.forget()
    assert ckpt.stager._pool is None and ckpt.stager.aside is None


def test_without_the_guard_the_step_does_not_wait(tmp_path, monkeypatch):
    """What the e2e race test turns off (Faults(guard=False)): guard() returns at once."""
    from deepspeed_offload.runtime.checkpoint import staging
    monkeypatch.setattr(staging.HostMemory, "read", classmethod(lambda cls: HostMemory(total=2**40, available=0)))
    hold = threading.Event()
    engine, store = store_engine()
    ckpt = ck.AsyncCheckpointer(engine, [store], faults=Faults(guard=False, before_file=lambda path: hold.wait(10)))
    engine.save_checkpoint(str(tmp_path), tag="t")
    ckpt.guard()
    assert not ckpt.synchronize_staging(0)  # returned while the files were still being serialized
    hold.set()
    ckpt.wait()


def test_the_writer_drops_the_snapshot_once_serialized(tmp_path, monkeypatch):
    """The save job is frozen; the tensors go through StagedFiles, which the writer releases, so
    nothing of the checkpointer holds the snapshot after the write."""
    engine = two_files()
    ckpt = ck.AsyncCheckpointer(engine, [])
    snapped = []
    real_snapshot = ckpt.stager.snapshot

    def snapshot(obj):
        out = real_snapshot(obj)
        if torch.is_tensor(out):
            snapped.append(weakref.ref(out))
        return out

    monkeypatch.setattr(ckpt.stager, "snapshot", snapshot)
    engine.save_checkpoint(str(tmp_path), tag="t")
    ckpt.wait()
    gc.collect()
    assert len(snapped) == 2 and all(ref() is None for ref in snapped)
    assert ckpt.staged.freed() and ckpt.future.done() and ckpt.last["background_s"] is not None
    with pytest.raises(RuntimeError, match="freed"):
        ckpt.staged.files
    job = writer.SaveJob(save_dir="d", tag="t", save_id=SAVE_ID, rank=0, world=1, save_latest=True, zipfile=True,
                         paths=())
    with pytest.raises(dataclasses.FrozenInstanceError):
        job.paths = ("x", )


def test_hooks_go_through_one_registry_and_come_off():
    engine = FakeEngine([])
    patches = PatchRegistry("test")
    ckpt = ck.AsyncCheckpointer(engine, [], patches=patches)
    assert engine.save_checkpoint == ckpt.save_checkpoint and len(patches) == 3
    ckpt.close()
    assert "save_checkpoint" not in vars(engine) and "step" not in vars(engine)
    engine.step()
    assert engine.steps == 1


def test_a_failed_rank_flushes_its_logs_before_exiting(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(checkpointer.logging, "shutdown", lambda: calls.append("logging.shutdown"))
    monkeypatch.setattr(checkpointer.os, "_exit", lambda code: calls.append(("_exit", code)))
    engine, ckpt = saved(tmp_path, "good")
    checkpointer.wait_for_writers_at_exit()
    assert calls == []  # every write went well: the interpreter exits as it would
    monkeypatch.setattr(files, "TrackedFile", denied)
    engine.save_checkpoint(str(tmp_path), tag="bad")
    checkpointer.wait_for_writers_at_exit()
    assert calls == ["logging.shutdown", ("_exit", 1)]
    with pytest.raises(ck.CheckpointWriteError):  # raised: this process's own exit hook finds nothing
        ckpt.wait()


EXIT_SCRIPT = """
import atexit, os, sys, types
import torch
ours = []
register = atexit.register
atexit.register = lambda fn, *a, **k: (ours.append(fn.__name__) if fn.__module__.startswith("deepspeed_offload")
                                       else None, register(fn, *a, **k))[1]
import deepspeed_offload
from deepspeed_offload.runtime import checkpoint as ck
assert ours == [], ours  # importing registers nothing


class Engine:
    global_steps = 1

    def __init__(self, numel=2):
        self.checkpoint_engine = types.SimpleNamespace()
        self.numel = numel

    def save_checkpoint(self, save_dir, tag=None, client_state={}, save_latest=True, exclude_frozen_parameters=False):
        self.checkpoint_engine.save({"w": torch.ones(self.numel)}, os.path.join(save_dir, tag, "model.pt"))

    def load_checkpoint(self, *a, **k):
        pass

    def step(self):
        pass


def full(path):
    raise OSError(28, "No space left on device")


engine, good = Engine(), Engine(numel=100_000)
ck.AsyncCheckpointer(engine, [], faults=ck.Faults(before_file=full))
ck.AsyncCheckpointer(good, [], faults=ck.Faults(before_file=lambda path: __import__("time").sleep(0.5)))
assert ours == ["wait_for_writers_at_exit"], ours  # once, by the first checkpointer
from deepspeed_offload.runtime.checkpoint import files
files.PIECE = 4096  # the good save's file in 98 pieces, hashed by threads started while the interpreter exits
good.save_checkpoint(os.path.join(sys.argv[1], "good"), tag="g")
engine.save_checkpoint(sys.argv[1], tag="t")
print("saved", flush=True)  # and the script ends without waiting for the writes
"""


def test_the_exit_hook_comes_with_the_first_checkpointer_and_fails_the_process(tmp_path, monkeypatch):
    env = dict(os.environ, PYTHONPATH=str(Path(deepspeed_offload.__file__).parents[1]))
    proc = subprocess.run([sys.executable, "-c", EXIT_SCRIPT, str(tmp_path)], capture_output=True, text=True,
                          env=env, timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1 and "saved" in proc.stdout, out[-3000:]
    assert "[deepspeed-offload] writing checkpoint" in out and "No space left on device (ENOSPC)" in out, out[-3000:]
    # the other engine's write, still running when the script ended, finished during the exit
    assert (tmp_path / "good" / "latest").read_text() == "g", out[-3000:]
    monkeypatch.setattr(files, "PIECE", 4096)  # as the script hashed it
    assert ck.verify_checkpoint(str(tmp_path / "good" / "g")) is None and "good/g" not in out


def test_our_own_errors_are_described_as_they_are():
    assert describe_os_error(TimeoutError("rank(s) [1] did not finish"), "/d") == "rank(s) [1] did not finish"
    assert describe_os_error(OSError(28, "x"), "/d/f") == "No space left on device (ENOSPC): /d/f"
    assert describe_os_error(ValueError("v"), "/d") == "ValueError('v') (/d)"


def test_our_code_never_unpickles():
    """Whatever the package itself loads is JSON or torch.load(weights_only=True)."""
    root = Path(deepspeed_offload.__file__).parent
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", None) in ("load", "loads") and \
                    getattr(getattr(node.func, "value", None), "id", None) in ("torch", "pickle"):
                kw = {k.arg: k.value for k in node.keywords}
                assert getattr(node.func.value, "id") == "torch" and getattr(kw.get("weights_only"), "value", None) \
                    is True, f"{path}:{node.lineno} unpickles"
