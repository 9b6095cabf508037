"""The frameworks that build the DeepSpeed engine themselves, with the real libraries and
``deepspeed_offload.install()`` as the only change: the HF Trainer and an Accelerate loop through
the ``deepspeed`` launcher (2 CPU ranks over gloo, or 1 rank per GPU), Lightning on one GPU.

HF Trainer, three launches: without offload (6 steps); with offload and asynchronous checkpoints
every 2 steps under ``save_total_limit=1``, stopped after step 4 (the schedule still counts 6 steps);
resumed from that run's ``checkpoint-4`` through ``resume_from_checkpoint``. The writes are slowed
down (the spec's ``faults``) so that the Trainer's rotation runs while one is in flight
unless our guard waits for it. Accelerate, one launch: the same loop without and then with offload,
with gradient accumulation 2 as Accelerate drives it (its boundary set on the engine).
"""

import os

import pytest
import torch

from harness import HERE, launch, slow_writes, two_ranks_unavailable

pytestmark = [pytest.mark.e2e, pytest.mark.anyaccel]
NPROCS = 1 if two_ranks_unavailable() else 2
SCRIPT = HERE / "integrations_train.py"
OFFLOAD = {"enabled": True, "mode": "stream", "memory_budget_gb": 0, "async_checkpoint": True}


def run(spec, tmp, name, env=None):
    return launch(spec, tmp, name, nprocs=NPROCS, script=SCRIPT, env=env, timeout=400)


def assert_params_equal(a, b):
    assert a.keys() == b.keys() and len(a) > 10
    for name in a:
        assert torch.equal(a[name], b[name]), f"{name} differs: max |diff| {(a[name] - b[name]).abs().max()}"


def moved(result):
    stats = result["stats"]
    return stats is not None and stats["bytes_h2d"] > 0 and stats["bytes_d2h"] > 0


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hf")
    out = {"tmp": tmp}
    out["plain"] = run({"framework": "hf", "dir": str(tmp / "plain"), "max_steps": 6, "params_at": [4]}, tmp, "plain")
    off = {"framework": "hf", "dir": str(tmp / "off"), "max_steps": 6, "offload": OFFLOAD}
    out["stopped"] = run(dict(off, stop_at=4, **slow_writes("global_step", 0.5)), tmp, "stopped")
    out["resumed"] = run(dict(off, resume=str(tmp / "off" / "checkpoint-4")), tmp, "resumed")
    return out


def test_hf_trainer_offloads_and_matches_plain_zero3(hf):
    assert hf["plain"]["stats"] is None  # the plain run had no offload
    assert moved(hf["stopped"]) and hf["stopped"]["global_steps"] == 4
    assert hf["stopped"]["diagnosis"]["steps"] == 4  # the Trainer's steps, each closed once
    assert_params_equal(hf["stopped"]["params"], hf["plain"]["params_at"][4])


def test_hf_trainer_rotation_waits_for_the_async_write(hf):
    # What on_save saw, right after the Trainer's save and rotate (save_total_limit=1): the previous
    # folder is deleted only once the new checkpoint is complete (latest written, no .tmp left).
    saves = hf["stopped"]["saves"]
    assert saves == {2: {"checkpoint-2": {"latest": "global_step2", "tmp": []}},
                     4: {"checkpoint-4": {"latest": "global_step4", "tmp": []}}}


def test_hf_trainer_resume_is_exact(hf):
    resumed = hf["resumed"]
    assert moved(resumed) and resumed["global_steps"] == 6 and resumed["diagnosis"]["steps"] == 2
    assert_params_equal(resumed["params"], hf["plain"]["params"])  # = an uninterrupted run, offload or not
    assert list(resumed["saves"]) == [6] and list(resumed["saves"][6]) == ["checkpoint-6"]


def test_accelerate_loop(tmp_path):
    """Gradient accumulation 2 the way Accelerate does it (the boundary set on the engine before each
    backward, the engine stepped at the boundary only), with speculation on (the default). The clipping
    threshold is set where it never fires: at Accelerate's own (1.0) this small model's norm is above it
    at every step, each speculated update rolls back and the backwards after a rollback do not speculate
    (``Backoff``), so which steps speculate depends on when the first one could (on a GPU, after the
    measured iteration: one step later than on the CPU)."""
    r = run({"framework": "accelerate", "dir": str(tmp_path / "acc"), "max_steps": 12, "save_at": [4, 8, 12],
             "gas": 2, "clip": 1e9, "offload": OFFLOAD, **slow_writes("pytorch_model", 0.5)}, tmp_path, "accelerate")
    assert r["plain_has_offload"] is False and moved(r) and r["global_steps"] == 6
    assert r["diagnosis"]["steps"] == 6  # one step closed per optimizer step, under Accelerate's accumulation
    counters = r["diagnosis"]["speculation"]
    assert r["stats"]["speculated"] > 0 and counters["committed"] > 0, str((r["stats"], r["diagnosis"]))
    assert counters["committed"] + counters["discarded"] == counters["speculated"], counters
    assert_params_equal(r["params"], r["plain_params"])
    # total_limit=2: save_state deleted checkpoint_0 before the third save; the two kept are complete
    assert r["saved"] == {"checkpoint_1": "pytorch_model", "checkpoint_2": "pytorch_model"}


@pytest.mark.gpu
def test_lightning_deepspeed_strategy(tmp_path):
    """Lightning's DeepSpeedStrategy refuses every accelerator but CUDA, so this runs on one GPU:
    examples/lightning_train.py as the user runs it, with and without offload."""
    if not torch.cuda.is_available():
        pytest.skip("Lightning's DeepSpeedStrategy needs CUDA (it refuses the CPU accelerator)")
    import subprocess
    import sys
    from harness import ROOT
    results = {}
    for name, extra in (("plain", ["--no-offload"]), ("offload", [])):
        out = tmp_path / f"{name}.pt"
        proc = subprocess.run([sys.executable, str(ROOT / "examples" / "lightning_train.py"), "--steps", "6",
                               "--out", str(out), "--ckpt-dir", str(tmp_path / name)] + extra,
                              cwd=ROOT, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        results[name] = torch.load(out, weights_only=False)
    assert results["plain"]["bytes_moved"] == 0 and results["offload"]["bytes_moved"] > 0
    assert_params_equal(results["offload"]["params"], results["plain"]["params"])
    # ModelCheckpoint(every_n_train_steps=2, save_top_k=1) with async writes: Lightning deleted each
    # older checkpoint right after the next save; only the newest is left, written by us and whole
    from deepspeed_offload.runtime import checkpoint as ck
    from deepspeed_offload.runtime.checkpoint.names import MARKER_RE
    kept = sorted(p.name for p in (tmp_path / "offload").iterdir() if p.name.endswith(".ckpt"))
    assert kept == ["epoch=0-step=6.ckpt"], kept
    tag = tmp_path / "offload" / kept[0] / "checkpoint"
    assert any(MARKER_RE.match(n) for n in os.listdir(tag)), sorted(os.listdir(tag))  # ours, complete
    assert ck.verify_checkpoint(str(tag)) is None
