"""A Hugging Face model's shape for the sizing, from its name or its files (``estimate --model``).

``transformers.AutoConfig`` reads the config (a hub id where there is network, a local directory or
a config.json where there is not), the language model's part of a multimodal one; the parameters are
counted on the model transformers builds from it on the meta device (no memory, no weights: what
``accelerate estimate-memory`` does), so that tied embeddings, grouped KV heads, biases, extra norms
and fused projections count as the model has them. What the model of activations needs
(``activations.ModelShape``) comes from the config's own fields, which the dense decoder families
users train share (Llama, Mistral, Qwen2, Qwen3, Gemma, Gemma 2, Phi-3, ...). A mixture of experts,
an encoder-decoder, or a config transformers cannot build a causal LM from is refused, naming what
the sizing lacks for it.
"""

import json
import os

from ..errors import ConfigError
from .activations import ModelShape

FLAG = "--model"
# Config fields that say a model routes tokens to experts (a mixture of experts), as the families name them.
EXPERT_FIELDS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts", "num_experts_per_tok")


def load_config(name_or_path: str):
    """The transformers config of ``name_or_path``: a config.json file, a directory holding one (a
    checkpoint, a snapshot of the hub), or a hub id (network needed); its text model's for a
    multimodal model. ConfigError naming ``--model`` where none can be read."""
    try:
        from transformers import AutoConfig
    except ImportError:
        raise ConfigError(FLAG, "needs transformers (pip install transformers), or give the shape with "
                                "--model-config and the size flags") from None
    try:
        if os.path.isfile(name_or_path):
            with open(name_or_path) as f:
                fields = json.load(f)
            if not isinstance(fields, dict) or "model_type" not in fields:
                raise ConfigError(FLAG, f"{name_or_path} has no model_type: not a transformers config.json "
                                        "(--model-config reads Llama-named sizes from any JSON)")
            config = AutoConfig.for_model(**fields)
        else:
            config = AutoConfig.from_pretrained(name_or_path)
    except ConfigError:
        raise
    except (OSError, ValueError, KeyError) as e:
        where = "a local directory or config.json" if os.path.exists(name_or_path) else \
            "a hub id (needs network), a local directory or a config.json"
        raise ConfigError(FLAG, f"cannot read a model config from {name_or_path!r} ({type(e).__name__}: "
                                f"{str(e).splitlines()[0][:300]}); give {where}") from None
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return text


def shape_of(config, name: str) -> ModelShape:
    """The sizing's ``ModelShape`` of a transformers config (``name``: what the user gave, for the
    errors): its sizes from the config's fields, its parameters counted on the meta device."""
    kind = getattr(config, "model_type", None) or type(config).__name__
    experts = {f: v for f in EXPERT_FIELDS if isinstance(v := getattr(config, f, None), int) and v > 1}
    if experts:
        found = ", ".join(f"{k} {v}" for k, v in experts.items())
        raise ConfigError(FLAG, f"{name} ({kind}) is a mixture of experts ({found}): the sizing models dense "
                                "decoders; what routed experts hold (their activations, each expert's state) is "
                                "not in its model of activations")
    if getattr(config, "is_encoder_decoder", False):
        raise ConfigError(FLAG, f"{name} ({kind}) is an encoder-decoder: the sizing models decoder-only causal "
                                "language models")
    sizes = {f: getattr(config, f, None) for f in ("hidden_size", "intermediate_size", "num_hidden_layers",
                                                   "num_attention_heads", "vocab_size")}
    missing = [f for f, v in sizes.items() if not isinstance(v, int)]
    if missing:
        raise ConfigError(FLAG, f"{name} ({kind}) names no {', '.join(missing)}: not a decoder whose shape the "
                                "sizing can read (Llama's field names)")
    params, largest = count_parameters(config, name, kind)
    head_dim = getattr(config, "head_dim", None)
    return ModelShape(**sizes, num_key_value_heads=getattr(config, "num_key_value_heads", None),
                      head_dim=head_dim if isinstance(head_dim, int) else None,
                      tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
                      counted_params=params, counted_largest=largest, model_type=kind)


def count_parameters(config, name: str, kind: str):
    """(parameters, elements of the largest) of the causal LM transformers builds from ``config`` on the
    meta device: no memory is allocated and no weights are read; tied weights counted once."""
    import torch
    from transformers import AutoModelForCausalLM
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    except (ValueError, KeyError, TypeError, ImportError) as e:
        raise ConfigError(FLAG, f"transformers cannot build a causal language model from {name} ({kind}): "
                                f"{str(e).splitlines()[0][:300]}") from None
    sizes = [p.numel() for p in model.parameters()]
    return sum(sizes), max(sizes)


def from_name(name_or_path: str) -> ModelShape:
    """``estimate --model``: the shape of the model a hub id, directory or config.json names."""
    return shape_of(load_config(name_or_path), name_or_path)
