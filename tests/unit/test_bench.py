"""The bench driver's bookkeeping, without a GPU: each mode's ds_config, and a run cut short resumed."""

import json
import subprocess

import pytest

from bench_runs import RUNS
from deepspeed_offload import bench
from deepspeed_offload.config import OffloadConfig


def test_every_mode_has_a_config_and_a_baseline():
    args = bench.build_parser().parse_args([])
    for mode in bench.MODES[1:]:
        cfg = bench.ds_config(mode, args)
        assert cfg["zero_optimization"]["stage"] == 3
        block = cfg.get("optimizer_state_offload")
        if block is not None:
            OffloadConfig(**block)  # the keys and types our config accepts
        assert bench.baseline(mode) in bench.MODES
    budget = {m: bench.ds_config(m, args)["optimizer_state_offload"]["memory_budget_gb"]
              for m in ("compile_offload", "compile_offload_budget", "compile_offload_full")}
    assert budget == {"compile_offload": None, "compile_offload_budget": args.budget_gb, "compile_offload_full": 0}


@pytest.fixture
def fake_workers(monkeypatch):
    """Every worker 'measures' a fixed result; returns the modes launched."""
    launched = []

    def run(cmd, **kwargs):
        mode = cmd[cmd.index("--worker") + 1]
        launched.append(mode)
        result = {"iter_s": 1.0, "step_s": 0.5, "pipelined_iter_s": 1.0, "peak_step_GiB": 1.0, "between_GiB": 1.0,
                  "params": 10}
        if mode == "stream":
            return subprocess.CompletedProcess(cmd, 1, "boom", None)
        return subprocess.CompletedProcess(cmd, 0, "RESULT " + json.dumps(result), None)

    monkeypatch.setattr(bench.subprocess, "run", run)
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    return launched


def test_a_run_cut_short_resumes_where_it_stopped(tmp_path, fake_workers):
    out = str(tmp_path / "b.json")
    bench.main(["--out", out, "--modes", "resident,stream"])
    first = json.loads(open(out).read())
    assert "iter_s" in first["results"]["resident"] and "error" in first["results"]["stream"]
    assert fake_workers == ["resident", "stream"]
    assert (tmp_path / "b-stream.log").read_text() == "boom"  # each worker's whole output is kept
    # the failed mode and the new one run again, the measured one is kept
    bench.main(["--out", out, "--modes", "resident,stream,offload_states", "--resume"])
    assert fake_workers == ["resident", "stream", "stream", "offload_states"]
    assert set(json.loads(open(out).read())["results"]) == {"resident", "stream", "offload_states"}
    # other arguments: not the same run, refused
    assert bench.main(["--out", out, "--modes", "resident", "--iters", "3", "--resume"]) == 2


@pytest.mark.parametrize("model", ["mlp", "sequential"])
def test_both_models_are_design_mlp(model):
    """The same parameters and the same function, whichever way the layers are held."""
    import torch
    args = bench.build_parser().parse_args(["--model", model, "--layers", "3", "--hidden", "8"])
    m = bench.build_model(args)
    assert sum(p.numel() for p in m.parameters()) == 3 * (8 * 8 + 8)
    ref = torch.nn.Sequential(*[mod for _ in range(3) for mod in (torch.nn.Linear(8, 8), torch.nn.ReLU())])
    mine = [l for l in m.modules() if isinstance(l, torch.nn.Linear)]
    for lin, src in zip([l for l in ref if isinstance(l, torch.nn.Linear)], mine, strict=True):
        lin.load_state_dict(src.state_dict())
    x = torch.randn(4, 8)
    assert torch.equal(m(x), ref(x))




def test_a_committed_run_measured_every_mode():
    """docs/benchmarks.md's headline: one run in which every bench mode produced figures."""
    def complete(run):
        res = run["results"]
        return "h2d_GBps" in res.get("bandwidth", {}) and all("iter_s" in res.get(m, {}) for m in bench.MODES[1:])
    assert any(complete(json.loads(p.read_text())) for p in RUNS), [p.name for p in RUNS]


@pytest.mark.parametrize("path", RUNS, ids=lambda p: p.name)
def test_the_chart_draws_every_committed_run(tmp_path, path):
    """Runs with failed modes (run 4) and with every mode (run 5), floor marks included."""
    bench.plot(json.loads(path.read_text()), tmp_path / "c.png")
    assert (tmp_path / "c.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
