"""``deepspeed-offload estimate`` with a model's shape: fits / split / does not fit (exit 1), the
placement, host memory, the largest micro-batch and s/iteration, against the H200 runs'
figures as docs/benchmarks.md gives them; the flags' errors name the flag."""

import json

import pytest

from deepspeed_offload.sizing.activations import PRESETS
from deepspeed_offload.cli import main as cli_main
from deepspeed_offload.sizing.fit import fit

GiB = 2**30
# The H200 machine of the runs: the limit its plans logged (139.80 GiB less the CUDA context), and
# the 13B's MemAvailable (docs/benchmarks.md, the 13B's estimate).
H200 = ["--device-memory-gb", "138.42", "--host-memory-gb", "123.74"]


def config_of(tmp_path, model):
    s = PRESETS[model]
    path = tmp_path / f"{model}.json"
    path.write_text(json.dumps({"model_type": "llama", "hidden_size": s.hidden_size,
                                "intermediate_size": s.intermediate_size, "num_hidden_layers": s.num_hidden_layers,
                                "num_attention_heads": s.num_attention_heads,
                                "num_key_value_heads": s.num_key_value_heads, "vocab_size": s.vocab_size}))
    return str(path)


def answer(capsys, *args, rc=0):
    assert cli_main(["estimate", *args, "--json"]) == rc
    return json.loads(capsys.readouterr().out.splitlines()[-1])["fit"]


def test_7b_at_8_x_4096_fits_with_all_its_state_resident(capsys, tmp_path):
    """llama-7b-2026-12-03-default.json: the plan kept all 162 sub-groups resident, 4.068 s; the grow
    run (llama-7b-2026-12-04-grow-default.json) gave one back at micro-batch 9."""
    fit_ = answer(capsys, "--model-config", config_of(tmp_path, "7B"), "--batch", "8", "--seq", "4096",
                  "--gradient-checkpointing", *H200)
    assert fit_["verdict"] == "fits" and fit_["resident_per_rank"] == fit_["state_per_rank"] == 12 * 6_738_415_616
    assert fit_["params"] == 6_738_415_616 and fit_["largest_batch_all_resident"] == 8
    assert fit_["largest_batch"] > 8 and fit_["host_pinned_per_node"] == 0
    assert fit_["host_pinned_per_node_at_attach"] == fit_["state_per_rank"]  # (the host could hold it all)
    assert fit_["iteration_s"] == pytest.approx(4.068, rel=0.10)


@pytest.mark.parametrize("model,batch,resident_gib,iteration_s", [("8B", 8, 17.40, 5.950), ("13B", 8, 49.88, 9.399)])
def test_8b_and_13b_split_their_state(capsys, tmp_path, model, batch, resident_gib, iteration_s):
    """llama-8b-2026-12-03-default.json and llama-13b-2026-12-02-default-8x4096.json, the defaults:
    part of the state resident, the rest streamed; the time within 10% (rough: no speculation there,
    clipping rolled it back at 8B); the placement within 15% of the plan's (the resident part is a
    difference of the device and the iteration, both ~130 GiB)."""
    fit_ = answer(capsys, "--model-config", config_of(tmp_path, model), "--batch", str(batch), "--seq", "4096",
                  "--gradient-checkpointing", "--bandwidth", "50.4", *H200)
    assert fit_["verdict"] == "split" and 0 < fit_["resident_per_rank"] < fit_["state_per_rank"]
    assert fit_["resident_per_rank"] / GiB == pytest.approx(resident_gib, rel=0.15)
    assert fit_["iteration_s"] == pytest.approx(iteration_s, rel=0.10)
    assert fit_["iteration"]["peak_reserved"] + fit_["margin"] <= int(138.42 * GiB)
    assert not fit_["plain_zero3"]["fits"]  # plain ZeRO-3 ran out of memory with both


def test_does_not_fit_exits_1_and_says_why(capsys, tmp_path):
    """The 13B with 30 GiB of host memory: 117 GiB of its state would have to stay on the GPU."""
    args = ["estimate", "--model-config", config_of(tmp_path, "13B"), "--batch", "4", "--seq", "4096",
            "--gradient-checkpointing", "--bandwidth", "50", "--device-memory-gb", "139.8", "--host-memory-gb", "30"]
    assert cli_main(args) == 1
    out = capsys.readouterr().out
    assert "DOES NOT FIT" in out and "must stay on the GPU" in out
    assert "largest micro-batch that fits: none" in out


def test_a_budget_the_host_cannot_hold_does_not_fit(capsys, tmp_path):
    """The 13B at budget 0 was refused at attach (145.46 GiB of state, the node could give 117.44)."""
    cfg = tmp_path / "ds.json"
    cfg.write_text(json.dumps({"train_micro_batch_size_per_gpu": 4, "bf16": {"enabled": True},
                               "zero_optimization": {"stage": 3, "reduce_bucket_size": 26214400},
                               "optimizer_state_offload": {"enabled": True, "memory_budget_gb": 0}}))
    fit_ = answer(capsys, "--model-config", config_of(tmp_path, "13B"), "--config", str(cfg), "--seq", "4096",
                  "--gradient-checkpointing", "--bandwidth", "50", *H200, rc=1)
    assert fit_["verdict"] == "does not fit" and "memory_budget_gb 0" in fit_["why"] and fit_["batch"] == 4


def test_the_text_answer(capsys, tmp_path):
    args = ["estimate", "--model-config", config_of(tmp_path, "8B"), "--batch", "8", "--seq", "4096",
            "--gradient-checkpointing", *H200]
    assert cli_main(args) == 0
    out = capsys.readouterr().out
    assert "fit: SPLIT:" in out and "streamed from the host each step" in out
    assert "calibrated on the H200 runs" in out and "s/iteration (rough)" in out
    assert "assumed: the H200 runs' median; pass --bandwidth" in out  # no device here, none given
    assert "host memory per node (1 rank(s)" in out and "largest micro-batch that fits:" in out


def test_the_largest_batch_is_the_edge():
    """At the largest micro-batch the answer fits, one more it does not; the same for all resident."""
    kw = dict(device=int(138.42 * GiB), host_cap=int(117.55 * GiB), reduce_bucket=500_000_000, host_bandwidth=72.9)
    first = fit(PRESETS["13B"], 4, 4096, True, **kw)
    edge = first["largest_batch"]
    assert fit(PRESETS["13B"], edge, 4096, True, **kw)["verdict"] != "does not fit"
    assert fit(PRESETS["13B"], edge + 1, 4096, True, **kw)["verdict"] == "does not fit"
    seven = fit(PRESETS["7B"], 1, 4096, True, **kw)
    whole = seven["largest_batch_all_resident"]
    assert fit(PRESETS["7B"], whole, 4096, True, **kw)["verdict"] == "fits"
    assert fit(PRESETS["7B"], whole + 1, 4096, True, **kw)["verdict"] == "split"


def test_the_shape_from_flags_and_the_batch_from_the_ds_config(capsys, tmp_path):
    s = PRESETS["1.1B"]
    cfg = tmp_path / "ds.json"
    cfg.write_text(json.dumps({"train_micro_batch_size_per_gpu": 8, "bf16": {"enabled": True},
                               "zero_optimization": {"stage": 3}, "optimizer_state_offload": {"enabled": True}}))
    fit_ = answer(capsys, "--hidden-size", str(s.hidden_size), "--intermediate-size", str(s.intermediate_size),
                  "--num-hidden-layers", str(s.num_hidden_layers), "--num-attention-heads",
                  str(s.num_attention_heads), "--num-key-value-heads", str(s.num_key_value_heads), "--vocab-size",
                  str(s.vocab_size), "--seq", "2048", "--config", str(cfg), "--bandwidth", "50", *H200)
    # llama-1b-2026-12-03-frontier.json, default@default: all 35 sub-groups resident, 52.76 / 58.04 GiB
    assert fit_["verdict"] == "fits" and fit_["batch"] == 8 and fit_["params"] == 1_100_048_384
    assert fit_["iteration"]["peak_allocated"] / GiB == pytest.approx(52.76, rel=0.10)
    assert fit_["iteration"]["peak_reserved"] / GiB == pytest.approx(58.04, rel=0.10)


def test_the_fit_answer_counts_the_reduce_bucket_initialize_picks(capsys, tmp_path):
    """Without reduce_bucket_size, stream mode with speculation possible gets one sub-group's elements from
    initialize (Plan.reduce_bucket_for): the answer counts that bucket, not DeepSpeed's 5e8 elements,
    which the same config with the size written out pays for (in bf16, about 0.9 GiB more)."""
    base = {"train_micro_batch_size_per_gpu": 8, "bf16": {"enabled": True}, "zero_optimization": {"stage": 3},
            "optimizer_state_offload": {"enabled": True}}
    peaks = []
    for zero in ({"stage": 3}, {"stage": 3, "reduce_bucket_size": 500_000_000}):
        cfg = tmp_path / "ds.json"
        cfg.write_text(json.dumps(dict(base, zero_optimization=zero)))
        fit_ = answer(capsys, "--model-config", config_of(tmp_path, "1.1B"), "--seq", "2048", "--config", str(cfg),
                      "--bandwidth", "50", *H200)
        peaks.append(fit_["iteration"]["peak_allocated"])
    assert 0.5 * GiB < peaks[1] - peaks[0] < 1.5 * GiB, [p / GiB for p in peaks]


@pytest.mark.parametrize("drop,extra,flag", [
    ("--seq", [], "--seq"),
    ("--batch", [], "--batch"),
    (None, ["--iteration-memory-gb", "60"], "--iteration-memory-gb"),
    ("--device-memory-gb", [], "--device-memory-gb"),
])
def test_what_the_fit_answer_needs_is_named(capsys, tmp_path, monkeypatch, drop, extra, flag):
    import torch
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    args = {"--model-config": config_of(tmp_path, "7B"), "--batch": "8", "--seq": "4096", "--bandwidth": "50",
            "--device-memory-gb": "139.8", "--host-memory-gb": "100"}
    args.pop(drop, None)
    assert cli_main(["estimate", *[x for kv in args.items() for x in kv], *extra]) == 2
    assert f"deepspeed-offload estimate: {flag}:" in capsys.readouterr().err


def test_neither_params_nor_shape_names_params(capsys):
    assert cli_main(["estimate", "--bandwidth", "50"]) == 2
    assert "--params:" in capsys.readouterr().err


def test_a_missing_size_names_its_flag(capsys, tmp_path):
    assert cli_main(["estimate", "--hidden-size", "4096", "--seq", "4096", "--bandwidth", "50"]) == 2
    assert "--intermediate-size:" in capsys.readouterr().err
    assert cli_main(["estimate", "--model-config", str(tmp_path / "nope.json"), "--seq", "1"]) == 2
    assert "--model-config: cannot read" in capsys.readouterr().err


def test_check_and_the_fit_answer_assume_the_same_ranks_per_node(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    fit_args = ["estimate", "--model-config", config_of(tmp_path, "7B"), "--batch", "1", "--seq", "4096",
                "--world-size", "8", "--bandwidth", "50", *H200]
    assert cli_main(fit_args) in (0, 1)
    out = capsys.readouterr().out
    assert "(4 ranks)" in out and "host memory per node (4 rank(s)" in out
    cfg = tmp_path / "ds.json"
    cfg.write_text(json.dumps({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3},
                               "optimizer_state_offload": {"enabled": True}}))
    assert cli_main(["check", str(cfg), "--params", str(PRESETS["7B"].params), "--world-size", "8"]) in (0, 2)
    out = capsys.readouterr()
    assert "node of 4 rank(s)" in out.out or "of its 4 rank(s)" in out.err, out


def apply(way: str, case: dict) -> dict:
    """``case`` (fit's arguments) changed as the way out says."""
    import re
    case = dict(case)
    if m := re.match(r"micro-batch (\d+)", way):
        case["batch"] = int(m.group(1))
    elif way.startswith("gradient checkpointing"):
        case["checkpointing"] = True
        if m := re.search(r"micro-batch (\d+)$", way):
            case["batch"] = int(m.group(1))
    elif m := re.match(r"(\d+) ranks instead", way):
        case["world"] = int(m.group(1))
    elif m := re.match(r"memory_budget_gb ([\d.]+)", way):
        case["budget_gb"] = float(m.group(1))
    elif way.startswith("memory_budget_gb null"):
        case["budget_gb"] = None
    elif m := re.match(r"([\d.]+) GiB of usable host memory a rank", way):
        case["host_cap"] = int(float(m.group(1)) * GiB) + 2**20
    else:
        raise AssertionError(f"unknown way out: {way}")
    return case


KW = dict(reduce_bucket=500_000_000, host_bandwidth=72.9)
# Jobs that do not fit, one for each thing that fails: (model, fit's arguments, what does not fit)
NOT_FITTING = [
    ("7B", dict(batch=16, seq=4096, checkpointing=False, device=int(79.1 * GiB), host_cap=int(117 * GiB)),
     "the iteration alone"),
    ("7B", dict(batch=4, seq=4096, checkpointing=True, device=int(79.1 * GiB), host_cap=int(28 * GiB)),
     "the state beside the iteration"),
    ("13B", dict(batch=4, seq=4096, checkpointing=True, device=int(138.42 * GiB), host_cap=int(117 * GiB),
                 budget_gb=0.0), "the state on the host"),
    ("7B", dict(batch=8, seq=4096, checkpointing=True, device=int(79.1 * GiB), host_cap=int(117 * GiB),
                budget_gb=60.0), "the state beside the iteration"),
]


@pytest.mark.parametrize("model,case,what", NOT_FITTING)
def test_a_job_that_does_not_fit_names_what_and_every_way_out_works(model, case, what):
    """What fails is named with figures that make sense (none negative), and each change the answer
    proposes, applied alone, makes the job fit."""
    args = dict(case)
    answer = fit(PRESETS[model], args.pop("batch"), args.pop("seq"), args.pop("checkpointing"), **args, **KW)
    assert answer["verdict"] == "does not fit" and answer["what"] == what, answer["verdict_line"]
    assert " -" not in answer["why"] and answer["ways_out"], answer["verdict_line"]
    for way in answer["ways_out"]:
        changed = apply(way, case)
        again = fit(PRESETS[model], changed.pop("batch"), changed.pop("seq"), changed.pop("checkpointing"),
                    **changed, **KW)
        assert again["verdict"] != "does not fit", (way, again["verdict_line"])
    assert answer["verdict_line"].startswith(f"verdict: DOES NOT FIT: {what}: ")
    assert "to make it fit: " in answer["verdict_line"]


def test_the_iteration_memory_path_says_the_same_verdict(capsys):
    """--params with --iteration-memory-gb (the figure a plan logs): one verdict line, exit 1 when the
    part the host cannot hold does not fit beside it; 0 when it fits."""
    args = ["estimate", "--params", "13000000000", "--bandwidth", "48", "--iteration-memory-gb", "60",
            "--device-memory-gb", "139.8"]
    assert cli_main([*args, "--host-memory-gb", "118"]) == 0
    assert "verdict: SPLIT" in capsys.readouterr().out
    assert cli_main([*args, "--host-memory-gb", "30", "--json"]) == 1
    verdict = json.loads(capsys.readouterr().out.splitlines()[-1])["verdict"]
    assert verdict["kind"] == "does not fit" and verdict["what"] == "the state beside the iteration", verdict


def test_the_h100_answers_from_the_h100_runs(capsys, tmp_path):
    """The card sets the throughput (--gpu, else the GPU here, else H200). On an H100 (79.1 GiB for training):
    the 1.1B at 8 x 2048 fits all resident, s/iteration within 10% of the H100 runs' resident median
    (llama-1b-2026-12-05-*-h100.json, 0.41-0.47 s); the 7B at 8 x 4096 splits, its resident state within 15% of
    the 45-48 sub-groups (0.465 GiB each) the H100 plans kept (llama-7b-2026-12-06-h100-*.json)."""
    from deepspeed_offload.sizing.fit import card_of
    assert card_of("NVIDIA H100 80GB HBM3") == "H100" and card_of("NVIDIA H200") == "H200"
    assert card_of(None) == card_of("NVIDIA A100-SXM4-80GB") == "H200"  # (the calibration's own card)
    h100 = ["--device-memory-gb", "79.1", "--host-memory-gb", "123.74", "--bandwidth", "50", "--gpu", "h100"]
    small = answer(capsys, "--model-config", config_of(tmp_path, "1.1B"), "--batch", "8", "--seq", "2048", *h100)
    assert small["verdict"] == "fits" and small["card"] == "H100"
    assert small["iteration_s"] == pytest.approx(0.4666, rel=0.10)
    seven = answer(capsys, "--model-config", config_of(tmp_path, "7B"), "--batch", "8", "--seq", "4096",
                   "--gradient-checkpointing", *h100)
    assert seven["verdict"] == "split" and seven["resident_per_rank"] / GiB == pytest.approx(46.5 * 0.465, rel=0.15)
    assert seven["forward_backward_s"] == pytest.approx(4.183, rel=0.05)
    h200 = answer(capsys, "--model-config", config_of(tmp_path, "7B"), "--batch", "8", "--seq", "4096",
                  "--gradient-checkpointing", *h100[:-2], "--gpu", "H200")
    assert h200["forward_backward_s"] == pytest.approx(3.862, rel=0.05) and h200["card"] == "H200"
