"""The model of an iteration's memory (activations.py) against the H200 runs it was calibrated on:
every calibration run's peak allocated and peak reserved within 10% (the figures copied into
``CALIBRATION`` from benchmarks/results, each naming its JSON), and its parts against what the runs
show of them."""

import json

import pytest

from deepspeed_offload.sizing.activations import (CALIBRATION, DEFAULT_REDUCE_BUCKET, PRESETS, ModelShape, activation_bytes,
                                           between_steps_bytes, iteration_memory, layer_bytes, model_shape,
                                           predict, read_model_config, reduce_bucket_of)
from deepspeed_offload.bench.models import LLAMA_PRESETS
from deepspeed_offload.errors import ConfigError

GiB = 2**30
H200 = 139.80  # GiB, as torch reports the device ("GPU 0 has a total capacity of 139.80 GiB")


def error(predicted_bytes: int, measured_gib: float) -> float:
    return (predicted_bytes / GiB - measured_gib) / measured_gib


@pytest.mark.parametrize("run", CALIBRATION, ids=lambda m: f"{m.model} {m.batch}x{m.seq} {m.what}")
def test_each_measured_peak_within_10_percent(run):
    """Allocated and reserved both, with the state the run kept resident."""
    predicted = predict(run)
    assert abs(error(predicted.peak_allocated, run.allocated_gib)) <= 0.10, (predicted, run)
    assert abs(error(predicted.peak_reserved, run.reserved_gib)) <= 0.10, (predicted, run)


def test_the_calibration_spans_the_four_shapes_checkpointed_or_not():
    assert {m.model for m in CALIBRATION} == {"1.1B", "7B", "8B", "13B"}
    assert {m.checkpointing for m in CALIBRATION} == {True, False}
    assert {m.streamed for m in CALIBRATION} == {True, False}
    assert all(m.source.split(":")[0].endswith(".json") for m in CALIBRATION)


def test_the_presets_are_the_benchmarks_shapes():
    """Parameter counts as docs/benchmarks.md gives them, from the bench's own presets."""
    names = {"1.1B": "tinyllama", "7B": "llama2-7b", "8B": "llama3-8b", "13B": "llama2-13b"}
    for ours, bench in names.items():
        p = LLAMA_PRESETS[bench]
        assert PRESETS[ours] == ModelShape(hidden_size=p["hidden"], intermediate_size=p["intermediate"],
                                           num_hidden_layers=p["layers"], num_attention_heads=p["heads"],
                                           num_key_value_heads=p["kv_heads"], vocab_size=p["vocab"])
    assert [PRESETS[m].params for m in ("1.1B", "7B", "8B", "13B")] == [1_100_048_384, 6_738_415_616, 8_030_261_248,
                                                                        13_015_864_320]


# Between steps, measured (between_GiB): (preset, reduce_bucket_size, resident GiB, GiB, source).
BETWEEN = [("1.1B", DEFAULT_REDUCE_BUCKET, 0.0, 5.092, "llama-1b-2026-12-03-frontier.json: default@0"),
           ("1.1B", 4_194_304, 0.0, 4.168, "llama-1b-2026-12-03-speculate.json: stream_speculate"),
           ("7B", DEFAULT_REDUCE_BUCKET, 0.0, 26.097, "llama-7b-2026-12-02-curve.json: default@0"),
           ("7B", 16_777_216, 0.0, 25.197, "llama-7b-2026-12-03-default-budget0-z.json: default@0"),
           ("7B", DEFAULT_REDUCE_BUCKET, 75.308, 101.405, "llama-7b-2026-12-03-default.json: default@default"),
           ("8B", DEFAULT_REDUCE_BUCKET, 17.403, 48.312, "llama-8b-2026-12-03-default.json: default@default"),
           ("13B", 26_214_400, 49.088, 97.689, "llama-13b-2026-12-03-default.json: default")]


@pytest.mark.parametrize("model,bucket,resident,measured,source", BETWEEN)
def test_between_steps_partitions_bucket_and_resident_state(model, bucket, resident, measured, source):
    predicted = between_steps_bytes(PRESETS[model].params, 1, 2, bucket) + resident * GiB
    assert abs(error(predicted, measured)) <= 0.003


def test_a_layer_saves_what_the_1b_timeline_shows():
    """llama-1b-2026-12-03-frontier.json, resident, its forward's timeline: 3.991 GiB every three
    layers for 8 x 2048 tokens (87,184 bytes a token and layer); and the activations' peak at the
    loss's backward, 52.76 GiB less 17.39 between steps."""
    assert layer_bytes(PRESETS["1.1B"], 2) * 16384 == pytest.approx(3.991 / 3 * GiB, rel=0.001)
    assert activation_bytes(PRESETS["1.1B"], 8, 2048, False) / GiB == pytest.approx(52.76 - 17.386, rel=0.003)


@pytest.mark.parametrize("model,batch,measured", [("7B", 8, 122.125 - 101.405), ("8B", 8, 86.88 - 30.909),
                                                  ("13B", 8, 123.95 - 98.480), ("13B", 4, 110.43 - 97.689)])
def test_checkpointed_activations_are_the_layer_inputs_and_the_logits(model, batch, measured):
    """Forward+backward's peak over between steps, where nothing was loaded early (peak_fwd_bwd_GiB:
    llama-7b-2026-12-03-default.json, llama-8b-2026-12-03-default.json default@0,
    llama-13b-2026-12-02-default-8x4096.json, llama-13b-2026-12-03-default.json's settled iterations)."""
    assert activation_bytes(PRESETS[model], batch, 4096, True) / GiB == pytest.approx(measured, rel=0.01)


def test_plain_zero3s_frontier_at_7b_8b_and_13b():
    """docs/benchmarks.md: plain ZeRO-3 trained the 7B at micro-batch 11 x 4096 and ran out of memory
    at 12 (a6216e3's issue, the grow table); it ran out at 8B (8 x 4096) and 13B (4 x 4096)."""
    def reserved(model, batch):
        shape = PRESETS[model]
        bucket = 26_214_400 if model == "13B" else DEFAULT_REDUCE_BUCKET
        return iteration_memory(shape, batch, 4096, True, reduce_bucket=bucket,
                                resident=12 * shape.params).peak_reserved / GiB
    assert reserved("7B", 11) <= H200 < reserved("7B", 12)
    assert reserved("8B", 8) > H200 and reserved("13B", 4) > H200


def test_fp32_doubles_the_partitions_and_the_saved_activations():
    shape = PRESETS["7B"]
    assert between_steps_bytes(shape.params, 1, 4, 0) - between_steps_bytes(shape.params, 1, 2, 0) == 4 * shape.params
    assert activation_bytes(shape, 1, 4096, True, 4) > activation_bytes(shape, 1, 4096, True, 2)


def test_a_hugging_face_config_and_the_flags_over_it(tmp_path):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336,
                               "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
                               "vocab_size": 128256, "head_dim": 128, "tie_word_embeddings": None}))
    shape = model_shape(read_model_config(str(tmp_path)), {"num_hidden_layers": None})
    assert shape.params == 8_030_261_248 and shape.largest_param == 128256 * 4096
    assert model_shape(read_model_config(str(cfg)), {"num_hidden_layers": 16}).num_hidden_layers == 16
    tied = model_shape(None, dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                                  num_attention_heads=32, num_key_value_heads=8, vocab_size=128256))
    assert tied.kv_heads == 8 and tied.model_copy(update={"tie_word_embeddings": True}).params == \
        tied.params - 128256 * 2048


BASE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, vocab_size=100)


@pytest.mark.parametrize("config,flags,flag", [
    ({k: v for k, v in BASE.items() if k != "vocab_size"}, {}, "--vocab-size"),  # in neither
    (BASE, {"hidden_size": -4}, "--hidden-size"),
    ({**BASE, "tie_word_embeddings": "maybe"}, {}, "--model-config"),  # no flag of its own
])
def test_a_shape_error_names_the_flag(config, flags, flag):
    with pytest.raises(ConfigError) as e:
        model_shape(config, flags)
    assert e.value.path == flag


def test_a_config_that_cannot_be_read_names_model_config(tmp_path):
    with pytest.raises(ConfigError) as e:
        read_model_config(str(tmp_path / "missing.json"))
    assert e.value.path == "--model-config"


def test_the_reduce_bucket_follows_the_ds_config():
    assert reduce_bucket_of(None, 4096) == DEFAULT_REDUCE_BUCKET
    assert reduce_bucket_of({"zero_optimization": {"reduce_bucket_size": "auto"}}, 4096) == 4096 * 4096
    assert reduce_bucket_of({"zero_optimization": {"reduce_bucket_size": 16777216}}, 4096) == 16777216


def test_usage_md_shows_this_comparison():
    """docs/usage.md's table: a row per calibration run, its figures the ones computed here."""
    from pathlib import Path
    text = (Path(__file__).resolve().parents[2] / "docs" / "usage.md").read_text()
    rows = [line.split("|")[1:-1] for line in text.splitlines()
            if line.startswith("| ") and line.split("|")[1].strip() in PRESETS]
    assert len(rows) == len(CALIBRATION)
    for cells, run in zip(rows, CALIBRATION):
        p = predict(run)
        figures = [c.strip() for c in cells[5:11]]
        assert figures == [f"{run.allocated_gib:.2f}", f"{p.peak_allocated / GiB:.2f}",
                           f"{100 * error(p.peak_allocated, run.allocated_gib):+.1f}%", f"{run.reserved_gib:.2f}",
                           f"{p.peak_reserved / GiB:.2f}", f"{100 * error(p.peak_reserved, run.reserved_gib):+.1f}%"]
        assert cells[0].strip() == run.model and cells[3].strip() == run.what


@pytest.mark.parametrize("kv_heads", [2, 8])
def test_what_hf_llama_saves_for_backward_is_the_layer_model(kv_heads):
    """The installed transformers' LlamaForCausalLM on the CPU (SDPA, bf16, a tiny shape): the bytes its
    forward saves for backward (every storage the autograd graph keeps, parameters aside) are the
    layers' ``layer_bytes``, the final norm's and the fp32 log-softmax, within 1%."""
    transformers = pytest.importorskip("transformers")
    import torch
    shape = ModelShape(hidden_size=256, intermediate_size=704, num_hidden_layers=2, num_attention_heads=8,
                       num_key_value_heads=kv_heads, vocab_size=1000)
    config = transformers.LlamaConfig(**shape.model_dump(), max_position_embeddings=128, use_cache=False,
                                      attn_implementation="sdpa")
    model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in params:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    ids = torch.randint(0, shape.vocab_size, (2, 128))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(input_ids=ids, labels=ids)
    tokens, h = ids.numel(), shape.hidden_size
    expected = tokens * (shape.num_hidden_layers * layer_bytes(shape, 2) + 8 * h + 4 * shape.vocab_size)
    assert sum(saved.values()) == pytest.approx(expected, rel=0.01)
