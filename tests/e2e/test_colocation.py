"""The RL colocation example (``examples/colocate.py``) through the real ``deepspeed`` launcher, with
the real transformers model generating: train, ``offload_states()``, a rollout in the freed memory,
``reload_states()``, train again. Its losses are those of the same run that never offloads, bit for
bit (2 CPU ranks, or 1 rank per GPU); on a GPU the rollout has more free memory with
``offload_states()`` than without, and plain ZeRO-3 runs the same script too.

Parity of every fp32 master and optimizer state across offload/reload cycles is test_stream_parity.py's
``colocate`` variants; this is the example a user copies."""

import ast
import os
import re
import sys

import pytest

from harness import ROOT, gpus, launch_with_port, two_ranks_unavailable

pytestmark = [pytest.mark.e2e, pytest.mark.anyaccel]
NPROCS = 1 if two_ranks_unavailable() else 2


def colocate(*flags):
    def cmd(port):  # a port of its own: tests run side by side
        return [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", str(NPROCS), "--master_port",
                str(port), "examples/colocate.py", "--deepspeed_config", "examples/ds_config_colocate.json", *flags]

    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", OMP_NUM_THREADS="1")
    proc = launch_with_port(cmd, "colocate" + "".join(flags), 400, env)
    assert proc.returncode == 0, proc.stdout[-6000:]
    rounds = re.findall(r"round (\d+): allocated ([\d.]+) GiB before the rollout, ([\d.]+) GiB during it, .* "
                        r"generated (\d+) tokens", proc.stdout)
    losses = ast.literal_eval(re.search(r"^losses: (\[.*\])$", proc.stdout, re.M).group(1))
    return rounds, losses, proc.stdout


def test_colocation_example_trains_as_if_it_never_offloaded():
    rounds, losses, out = colocate()
    assert [r[0] for r in rounds] == ["0", "1", "2"] and all(r[3] == "16" for r in rounds), out[-3000:]
    assert len(losses) == 6
    _, kept, _ = colocate("--no_offload_states")
    assert losses == kept  # offload/reload between the steps changed nothing


@pytest.mark.gpu
@pytest.mark.skipif(gpus() < 1, reason="needs a CUDA GPU (and DeepSpeed's FusedAdam for plain ZeRO-3)")
def test_colocation_example_frees_gpu_memory_for_the_rollout():
    big = ["--hidden", "1024", "--layers", "4"]
    with_offload, losses, _ = colocate(*big)
    without, kept, _ = colocate(*big, "--no_offload_states")
    plain, _, _ = colocate(*big, "--plain")
    assert losses == kept
    during = {name: float(r[-1][2]) for name, r in (("ours", with_offload), ("kept", without), ("plain", plain))}
    before = {name: float(r[-1][1]) for name, r in (("ours", with_offload), ("kept", without), ("plain", plain))}
    # the trainer holds less between steps than plain ZeRO-3 (its optimizer state is on the host) ...
    assert before["ours"] < before["plain"], before
    # ... offload_states() gives the rollout what it still held, and leaves on the device no more than
    # plain ZeRO-3's own offload_states() (allocated bytes of this process: the rollout model's the same)
    assert during["ours"] < during["kept"], during
    assert during["ours"] <= during["plain"], during
