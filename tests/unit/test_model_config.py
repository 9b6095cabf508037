"""``estimate --model``: a Hugging Face model by hub id, directory or config.json, read by transformers'
AutoConfig and counted on the meta device. The counts are the published ones of each family's
reference model (the configs' defaults, or the sizes given), so tied embeddings, grouped KV heads,
wide heads, biases and fused projections count as the models have them; a mixture of experts, an
encoder-decoder and an unreadable name are refused, naming what the sizing lacks."""

import json

import pytest
import transformers

from deepspeed_offload.cli import main as cli_main
from deepspeed_offload.errors import ConfigError
from deepspeed_offload.sizing.activations import PRESETS
from deepspeed_offload.sizing.model_config import from_name

# family: (config, published parameters, KV heads, head_dim, tied embeddings)
FAMILIES = {
    "llama-2-7b": (lambda: transformers.LlamaConfig(), 6_738_415_616, 32, 128, False),
    "mistral-7b-v0.1": (lambda: transformers.MistralConfig(), 7_241_732_096, 8, 128, False),
    "qwen2-1.5b": (lambda: transformers.Qwen2Config(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                                                     num_attention_heads=12, num_key_value_heads=2,
                                                     vocab_size=151936, tie_word_embeddings=True),
                   1_543_714_304, 2, None, True),
    "qwen3-8b": (lambda: transformers.Qwen3Config(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                                                  num_attention_heads=32, num_key_value_heads=8, vocab_size=151936,
                                                  head_dim=128, tie_word_embeddings=False),
                 8_190_735_360, 8, 128, False),
    "gemma-7b": (lambda: transformers.GemmaConfig(), 8_537_680_896, 16, 256, True),
    "phi-3-mini": (lambda: transformers.Phi3Config(), 3_821_079_552, 32, None, False),
}


def save(tmp_path, config, name="model"):
    path = tmp_path / name
    config.save_pretrained(path)
    return str(path)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_each_dense_family_is_counted_as_published(tmp_path, family):
    make, params, kv, head_dim, tied = FAMILIES[family]
    shape = from_name(save(tmp_path, make()))
    assert shape.params == params, (family, shape.params)
    assert shape.kv_heads == kv and shape.head_dim == head_dim and shape.tie_word_embeddings is tied
    assert shape.largest_param == max(shape.vocab_size * shape.hidden_size, shape.hidden_size * shape.intermediate_size,
                                      shape.hidden_size * 2 * shape.intermediate_size * (family == "phi-3-mini"))
    assert shape.model_type in family.replace("-", "") or shape.model_type.rstrip("0123456789") in family


def test_a_config_json_a_directory_and_the_llama_formula_agree(tmp_path):
    """The file itself or its directory; for Llama the count equals the formula --model-config uses."""
    directory = save(tmp_path, transformers.LlamaConfig(**{k: getattr(PRESETS["1.1B"], k) for k in (
        "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
        "vocab_size")}))
    by_dir, by_file = from_name(directory), from_name(f"{directory}/config.json")
    assert by_dir == by_file and by_dir.params == PRESETS["1.1B"].params == 1_100_048_384


def test_a_multimodal_model_is_sized_by_its_language_model(tmp_path):
    llava = transformers.LlavaConfig(text_config=transformers.LlamaConfig().to_dict())
    shape = from_name(save(tmp_path, llava))
    assert shape.params == 6_738_415_616 and shape.model_type == "llama"


@pytest.mark.parametrize("config,words", [
    (lambda: transformers.MixtralConfig(), ["mixture of experts", "num_local_experts 8"]),
    (lambda: transformers.Qwen2MoeConfig(), ["mixture of experts", "num_experts 60"]),
    (lambda: transformers.T5Config(), ["encoder-decoder"]),
])
def test_what_the_sizing_cannot_size_is_refused_naming_why(tmp_path, config, words):
    with pytest.raises(ConfigError) as err:
        from_name(save(tmp_path, config()))
    assert err.value.path == "--model" and all(w in str(err.value) for w in words), str(err.value)


def test_a_name_that_cannot_be_read_says_what_to_give(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # (no network here either way: fail at once)
    with pytest.raises(ConfigError, match="cannot read a model config from 'no-such-org/no-such-model'.*hub id"):
        from_name("no-such-org/no-such-model")
    (tmp_path / "x.json").write_text(json.dumps({"hidden_size": 8}))
    with pytest.raises(ConfigError, match="has no model_type"):
        from_name(str(tmp_path / "x.json"))


def test_the_cli_answers_from_a_model_and_refuses_sizes_beside_it(tmp_path, capsys):
    """The Qwen2-1.5B shape at 8 x 2048 on 79.1 GiB (the issue's case): the iteration alone does not fit
    (72 GiB of activations, most of them logits), said so with the micro-batch and checkpointing that
    fit; exit 1. Size flags beside --model are refused: its sizes are the model's own."""
    model = save(tmp_path, FAMILIES["qwen2-1.5b"][0]())
    args = ["estimate", "--model", model, "--seq", "2048", "--batch", "8", "--device-memory-gb", "79.1",
            "--bandwidth", "50", "--host-memory-gb", "125"]
    assert cli_main([*args, "--json"]) == 1
    out = json.loads(capsys.readouterr().out.splitlines()[-1])
    verdict = out["verdict"]
    assert verdict["kind"] == "does not fit" and verdict["what"] == "the iteration alone", verdict
    assert "the logits" in verdict["reason"] and "151,936 x 16,384 tokens" in verdict["reason"]
    assert any(w.startswith("micro-batch ") for w in verdict["ways_out"]), verdict
    assert any(w.startswith("gradient checkpointing") for w in verdict["ways_out"]), verdict
    assert out["fit"]["params"] == 1_543_714_304
    assert cli_main([*args, "--hidden-size", "1024"]) == 2
    assert "--model: counts the model's own sizes" in capsys.readouterr().err
