"""``deepspeed-offload estimate`` against the committed H200 benchmark, and the CLI's edges."""

import json
import statistics

import pytest

from bench_runs import RESULTS, RUNS
from deepspeed_offload.cli import digest_throughput
from deepspeed_offload.cli import main as cli_main


def estimate(capsys, *args):
    assert cli_main(["estimate", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_the_benchmark_runs_are_committed():
    assert len(RUNS) >= 4


def has_stream_and_resident(path):
    res = json.loads(path.read_text())["results"]
    return "both_each_way_GBps" in res.get("bandwidth", {}) and all("iter_s" in res.get(m, {})
                                                                    for m in ("resident", "stream"))


STREAM_RUNS = [p for p in RUNS if has_stream_and_resident(p)]


def test_the_estimate_is_checked_against_several_runs():
    assert len(STREAM_RUNS) >= 4


@pytest.mark.parametrize("path", STREAM_RUNS, ids=lambda p: p.name)
def test_estimate_within_15_percent_of_the_benchmark(capsys, path):
    """The memory freed, and the step's copy time: what stream mode's step (overlap off) adds to
    resident ZeRO-3's step, which does the same work but the copies."""
    run = json.loads(path.read_text())
    res, stream = run["results"]["resident"], run["results"]["stream"]
    est = estimate(capsys, "--params", str(stream["params"]), "--bandwidth",
                   str(run["results"]["bandwidth"]["both_each_way_GBps"]))
    freed = (res["between_GiB"] - stream["between_GiB"]) * 2**30
    assert abs(est["gpu_freed_per_rank"] - freed) <= 0.15 * freed
    added = stream["step_s"] - res["step_s"]
    assert abs(est["step_copy_s"] - added) <= 0.15 * added


def runs_of(name):
    return [json.loads(p.read_text()) for p in RUNS if name in p.name]


def h200_bandwidth():
    """The median of the each-way bandwidth (both directions busy) the committed H200 runs measured."""
    return statistics.median(r["results"]["bandwidth"]["both_each_way_GBps"] for r in runs_of("")
                             if "both_each_way_GBps" in r["results"].get("bandwidth", {}))


@pytest.mark.parametrize("mode", ["stream@0", "stream@16"])
def test_estimate_at_7b_within_10_percent_of_the_run(capsys, mode, tmp_path):
    """The Llama-2-7B shape's run (llama-7b-2026-12-01-budgets.json, no bandwidth probe in it: the
    median of the H200 runs that have one): the host store attach pinned, the staging slots the
    embedding sets (a parameter larger than a sub-group), and the time the streamed step adds to
    resident's, within 10%."""
    run = runs_of("llama-7b-2026-12-01-budgets")[0]
    res, ours, args = run["results"]["resident"], run["results"][mode], run["args"]
    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3},
                               "optimizer_state_offload": {"enabled": True, "memory_budget_gb": float(mode[7:]),
                                                           "sub_group_mb": args["sub_group_mb"]}}))
    est = estimate(capsys, "--params", str(ours["params"]), "--bandwidth", str(h200_bandwidth()), "--config",
                   str(cfg), "--largest-param", str(args["vocab"] * args["hidden"]), "--host-memory-gb", "125")
    assert abs(est["host_pinned_per_node"] - ours["host_pinned_GiB"] * 2**30) <= 0.01 * est["host_pinned_per_node"]
    assert est["staging_during_step"] == pytest.approx(2 * ours["slot_GiB"] * 2**30, rel=0.01)
    added = ours["step_s"] - res["step_s"]
    assert abs(est["step_copy_s"] - added) <= 0.10 * added, (est["step_copy_s"], added)


def test_estimate_uses_the_config_budget_and_splits_ranks(capsys, tmp_path):
    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3},
                               "optimizer_state_offload": {"enabled": True, "memory_budget_gb": 1}}))
    est = estimate(capsys, "--params", "1000000000", "--world-size", "4", "--config", str(cfg), "--bandwidth", "50")
    assert est["state_per_rank"] == 250_000_000 * 12
    assert est["gpu_freed_per_rank"] == 250_000_000 * 12 - 2**30
    assert est["host_pinned_per_node"] == 4 * est["gpu_freed_per_rank"]


def test_estimate_says_does_not_fit_when_host_memory_is_short(capsys, fake_host, tmp_path):
    """--params with a fixed budget: the host alone decides, and a host short of the stores is a verdict of
    DOES NOT FIT, exit 1, as every other way estimate is asked (it was a warning and exit 0); with the host
    holding them, the GPU side is unknown without the model or the iteration's figure (exit 0)."""
    fake_host(total=16 * 2**30, available=4 * 2**30)  # 2 GiB usable, 11.2 GiB of state
    cfg = tmp_path / "c.json"  # a budget set by hand: the store must hold the rest
    cfg.write_text(json.dumps({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3},
                               "optimizer_state_offload": {"enabled": True, "memory_budget_gb": 0}}))
    assert cli_main(["estimate", "--params", "1000000000", "--bandwidth", "50", "--config", str(cfg)]) == 1
    out = capsys.readouterr().out
    assert "verdict: DOES NOT FIT: the state on the host:" in out
    assert "need 11.18 GiB" in out and "can give 2.00 GiB" in out and "(this host)" in out
    assert "to make it fit: memory_budget_gb 9.2 or more" in out
    assert cli_main(["estimate", "--params", "1000000000", "--bandwidth", "50", "--config", str(cfg),
                     "--host-memory-gb", "64"]) == 0
    assert "verdict: UNKNOWN: the host holds the stores" in capsys.readouterr().out


def test_estimate_splits_the_state_between_the_gpu_and_the_host(capsys):
    """A 13B on a 139.8 GiB GPU beside a host that can give 112.1 GiB, with 60 GiB for the iteration: the GPU
    keeps what fits below the device less the margin, the host the rest; with 30 GiB of host memory the part
    the host cannot hold does not fit the device."""
    gib = 2**30
    args = ["--bandwidth", "48", "--iteration-memory-gb", "60", "--device-memory-gb", "139.8", "--host-memory-gb", "118"]
    place = estimate(capsys, "--params", "13000000000", *args)["placement"]
    assert place["fits"] and place["resident"] + place["streamed"] == place["state"] == 13_000_000_000 * 12
    assert place["resident"] == int(139.8 * gib) - place["margin"] - 60 * gib and place["margin"] == int(0.03 * 139.8 * gib)
    assert place["streamed"] <= place["host_cap"]
    # the largest model: its state fills the host's share and the device's room, where the iteration
    # grows by its 16-bit partitions (4 bytes a parameter) and keeps this one's activations
    largest, other = place["largest_params"], 60 * gib - 4 * 13_000_000_000
    assert 13_000_000_000 < largest < 20_000_000_000
    fill = 12 * largest + other + 4 * largest
    assert 0 <= place["host_cap"] + int(139.8 * gib) - place["margin"] - fill < 16
    assert cli_main(["estimate", "--params", "13000000000", *args[:-2], "--host-memory-gb", "30"]) == 1
    out = capsys.readouterr().out
    assert "does NOT fit" in out and "verdict: DOES NOT FIT: the state beside the iteration:" in out
    assert "-" not in out.split("verdict:")[1].split("to make it fit")[0].replace("--", "")  # no negative figure


def test_estimate_takes_the_margin_a_plan_logged(capsys):
    """The 13B at 4 x 4096 on one H200 (llama-13b-2026-12-03-default.json): two give-backs widened the
    plan's margin; with the figures its log line names, iteration and margin, the estimate's split is
    within 10% of the plan's, and without the margin it is not (the first margin is narrower)."""
    run = json.loads((RESULTS / "llama-13b-2026-12-03-default.json").read_text())
    result = run["results"]["default"]
    plan, gib = result["plan"], 2**30
    args = ["--params", str(result["params"]), "--bandwidth", "50", "--device-memory-gb", f"{plan['limit_GiB']:.2f}",
            "--host-memory-gb", "123.74", "--iteration-memory-gb", f"{plan['iteration_GiB']:.2f}"]
    widened = estimate(capsys, *args, "--margin-gb", f"{plan['margin_GiB']:.2f}")["placement"]
    first = estimate(capsys, *args)["placement"]
    assert widened["margin"] == int(round(plan["margin_GiB"], 2) * gib) and first["margin"] < widened["margin"]
    assert abs(widened["resident"] / gib - plan["resident_GiB"]) <= 0.1 * plan["resident_GiB"]
    assert abs(first["resident"] / gib - plan["resident_GiB"]) > 0.1 * plan["resident_GiB"]
    assert widened["largest_params"] < first["largest_params"]


def test_check_shows_each_ranks_store_and_speculations_share(capsys, fake_host, tmp_path):
    """The node's plan as attach would judge it: with 8 ranks, what is spare after the stores is shared,
    and where nothing is, speculation is off (the default never takes the node below its headroom)."""
    fake_host(total=128 * 2**30, available=100 * 2**30)
    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3},
                               "optimizer_state_offload": {"enabled": True}}))
    assert cli_main(["check", str(cfg), "--params", "1000000000", "--ranks-per-node", "1"]) == 0
    one = capsys.readouterr().out
    assert "store 11.18 GiB per rank; speculation 11.18 GiB per rank" in one
    assert cli_main(["check", str(cfg), "--params", "7000000000", "--world-size", "8", "--ranks-per-node", "8"]) == 0
    eight = capsys.readouterr().out
    assert "store 9.78 GiB per rank; speculation 1." in eight and "shared by 8 rank(s)" in eight
    assert cli_main(["check", str(cfg), "--params", "13000000000", "--ranks-per-node", "1"]) == 0
    big = capsys.readouterr().out
    assert "stays on the GPU (the host cannot hold it); speculation without second regions (no host memory is spare" in big
    assert "async_checkpoint" not in one + eight + big
    cfg.write_text(json.dumps({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3},
                               "optimizer_state_offload": {"enabled": True, "async_checkpoint": True}}))
    assert cli_main(["check", str(cfg), "--params", "1000000000", "--ranks-per-node", "1"]) == 0
    assert "async_checkpoint reserves 11.18 GiB per rank for its copies aside" in capsys.readouterr().out
    assert cli_main(["check", str(cfg), "--params", "7000000000", "--world-size", "8", "--ranks-per-node", "8"]) == 0
    assert "async_checkpoint: no room to reserve its copies aside" in capsys.readouterr().out


def test_estimate_needs_a_bandwidth_without_gpu(capsys, monkeypatch):
    import deepspeed_offload.sizing.bandwidth as probe
    monkeypatch.setattr(probe, "measure_bandwidth", lambda gib=1: None)
    assert cli_main(["estimate", "--params", "1000"]) == 2
    assert "--bandwidth" in capsys.readouterr().err


def test_estimate_rejects_a_bad_config(capsys, tmp_path):
    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps({"zero_optimization": {"stage": 2}, "optimizer_state_offload": {"enabled": True}}))
    assert cli_main(["estimate", "--params", "1000", "--config", str(cfg), "--bandwidth", "50"]) == 2
    assert "zero_optimization.stage" in capsys.readouterr().err


@pytest.mark.parametrize("sub", ["estimate", "bench"])
def test_subcommand_help(capsys, sub):
    with pytest.raises(SystemExit) as e:
        cli_main([sub, "--help"])
    assert e.value.code == 0 and f"deepspeed-offload {sub}" in capsys.readouterr().out


ESTIMATE = ["estimate", "--params", "1000", "--bandwidth", "50"]
BAD_NUMBERS = [
    (ESTIMATE + ["--bandwidth", "0"], "--bandwidth"),  # was ZeroDivisionError
    (ESTIMATE + ["--bandwidth", "-3"], "--bandwidth"),
    (ESTIMATE + ["--bandwidth", "inf"], "--bandwidth"),
    (ESTIMATE + ["--bandwidth", "nan"], "--bandwidth"),
    (ESTIMATE + ["--bandwidth", "fast"], "--bandwidth"),
    (ESTIMATE + ["--world-size", "0"], "--world-size"),  # was ZeroDivisionError
    (ESTIMATE + ["--world-size", "-2"], "--world-size"),
    (ESTIMATE + ["--ranks-per-node", "0"], "--ranks-per-node"),
    (ESTIMATE + ["--ranks-per-node", "-8"], "--ranks-per-node"),
    (["estimate", "--params", "-1000", "--bandwidth", "50"], "--params"),  # printed negative figures
    (["estimate", "--params", "0", "--bandwidth", "50"], "--params"),
    (["estimate", "--params", "1.5", "--bandwidth", "50"], "--params"),
    (["estimate", "--params", "1e400", "--bandwidth", "50"], "--params"),
    (["check", "CONFIG", "--params", "-5"], "--params"),
    (["check", "CONFIG", "--params", "0"], "--params"),
    (["check", "CONFIG", "--world-size", "0"], "--world-size"),
    (["check", "CONFIG", "--world-size", "-1"], "--world-size"),
    (["check", "CONFIG", "--ranks-per-node", "0"], "--ranks-per-node"),
    (["check", "CONFIG", "--ranks-per-node", "-4"], "--ranks-per-node"),
]


@pytest.mark.parametrize("argv,arg", BAD_NUMBERS, ids=[" ".join(a[0][-2:]) + f" {a[0][0]}" for a in BAD_NUMBERS])
def test_every_numeric_argument_is_positive_and_finite(capsys, tmp_path, argv, arg):
    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3},
                               "optimizer_state_offload": {"enabled": True}}))
    argv = [str(cfg) if a == "CONFIG" else a for a in argv]
    with pytest.raises(SystemExit) as e:
        cli_main(argv)
    assert e.value.code == 2
    captured = capsys.readouterr()
    assert f"argument {arg}" in captured.err and "Traceback" not in captured.err and captured.out == ""


def test_counts_may_be_written_as_scientific_notation(capsys):
    assert estimate(capsys, "--params", "1e9", "--bandwidth", "50")["state_per_rank"] == 12 * 10**9
    assert estimate(capsys, "--params", "1_000", "--bandwidth", "50")["state_per_rank"] == 12_000


def test_estimate_shares_the_host_bandwidth_among_the_ranks_of_a_node(capsys):
    """Calibrated on the committed 2-rank run: with both ranks streaming at once each got less than
    alone, and estimate's per-rank bandwidth for 2 ranks per node is that measured figure."""
    run = json.loads((RUNS[0].parent / "llama-4layers-2026-11-29-bandwidth-2gpus.json").read_text())
    ranks = run["results"]["bandwidth"]["ranks"]
    alone = min(r["alone"]["both_each_way_GBps"] for r in ranks)
    together = statistics.mean(r["together"]["both_each_way_GBps"] for r in ranks)
    assert together < 0.9 * alone  # the measurement this calibration rests on
    one = estimate(capsys, "--params", "1e9", "--bandwidth", str(alone), "--ranks-per-node", "1")
    two = estimate(capsys, "--params", "1e9", "--world-size", "2", "--bandwidth", str(alone), "--ranks-per-node", "2")
    assert one["bandwidth_per_rank_GBps"] == alone  # one rank alone: its link
    assert two["bandwidth_per_rank_GBps"] == pytest.approx(together, rel=0.02)
    eight = estimate(capsys, "--params", "1e9", "--world-size", "8", "--bandwidth", str(alone), "--ranks-per-node", "8")
    assert eight["bandwidth_per_rank_GBps"] == pytest.approx(two["bandwidth_per_rank_GBps"] / 4)
    assert eight["step_copy_s"] > two["step_copy_s"]


def test_digest_throughput_is_measured(capsys):
    assert digest_throughput(gib=1 / 64) > 0
    assert cli_main(["digest", "--gib", "0.02"]) == 0
    assert "GB/s" in capsys.readouterr().out


# ---------------------------------------------------------------- check: what frameworks launch

HF_CONFIG = RESULTS.parents[1] / "examples" / "ds_config_hf.json"


def test_check_reads_a_frameworks_config_with_auto_as_the_framework_fills_it(capsys):
    assert cli_main(["check", str(HF_CONFIG)]) == 0  # the project's own HF config: its "auto" values filled
    out = capsys.readouterr().out
    assert "checked as the HF Trainer fills it" in out and "gradient_clipping=1.0" in out, out
    assert cli_main(["check", str(HF_CONFIG), "--framework", "accelerate", "--set",
                     "train_micro_batch_size_per_gpu=4"]) == 0
    out = capsys.readouterr().out
    assert "as Accelerate fills it" in out and "train_micro_batch_size_per_gpu=4" in out, out


def test_check_refuses_what_json_load_refuses_in_a_frameworks_config(tmp_path, capsys):
    text = '{"train_micro_batch_size_per_gpu": "auto", "zero_optimization": {"stage": 3,},\n' \
           ' "optimizer_state_offload": {"enabled": true}}'
    cfg = tmp_path / "hf.json"
    cfg.write_text(text)
    assert cli_main(["check", str(cfg)]) == 2
    err = capsys.readouterr().err
    assert "json.load" in err and "line 1" in err, err
    plain = tmp_path / "plain.json"  # no "auto": a plain DeepSpeed config, read as DeepSpeed reads it (hjson)
    plain.write_text(text.replace('"auto"', "1"))
    assert cli_main(["check", str(plain)]) == 0


def test_check_set_names_a_bad_pair(tmp_path, capsys):
    assert cli_main(["check", str(HF_CONFIG), "--set", "gradient_clipping"]) == 2
    assert "KEY=VALUE" in capsys.readouterr().err


def test_check_and_estimate_assume_the_same_ranks_per_node(capsys, monkeypatch):
    """Neither given --ranks-per-node: both take the launcher's LOCAL_WORLD_SIZE, else this node's
    accelerators, else up to 8, never more than the world (check assumed 1 before: 8x too optimistic)."""
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    cfg = RESULTS.parents[1] / "examples" / "ds_config_offload.json"
    assert cli_main(["check", str(cfg), "--params", "100000000", "--world-size", "8"]) in (0, 2)
    out = capsys.readouterr()
    assert "node of 8 rank(s)" in out.out or "of its 8 rank(s)" in out.err, out
    assert cli_main(["estimate", "--params", "100000000", "--world-size", "8", "--bandwidth", "50"]) == 0
    assert "(8 ranks)" in capsys.readouterr().out
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert cli_main(["check", str(cfg), "--params", "100000000", "--world-size", "8"]) in (0, 2)
    out = capsys.readouterr()
    assert "node of 4 rank(s)" in out.out or "of its 4 rank(s)" in out.err, out
