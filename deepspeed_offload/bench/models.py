"""The model zoo: the models the benchmark trains, their default sizes, and the loss of one
micro-batch.

``mlp``: ``layers`` x Linear(hidden, hidden) + ReLU in a ModuleList, called in a loop the way
transformer blocks are (1.07B parameters by default); ``sequential``: the same layers in an
``nn.Sequential``; ``llama``: a Llama-shaped ``transformers`` LlamaForCausalLM with random weights,
its own LM loss on random token ids (needs ``transformers``).
"""

import torch

MODEL_DEFAULTS = {
    "mlp": dict(layers=64, hidden=4096),
    "sequential": dict(layers=64, hidden=4096),
    "llama": dict(batch=8, seq=2048),  # and the shape of its preset
}
# --model llama --preset NAME: the published models' shapes (random weights all the same).
LLAMA_PRESETS = {
    "tinyllama": dict(layers=22, hidden=2048, intermediate=5632, heads=32, kv_heads=4, vocab=32000),
    "llama2-7b": dict(layers=32, hidden=4096, intermediate=11008, heads=32, kv_heads=32, vocab=32000),
    "llama3-8b": dict(layers=32, hidden=4096, intermediate=14336, heads=32, kv_heads=8, vocab=128256),
    "llama2-13b": dict(layers=40, hidden=5120, intermediate=13824, heads=40, kv_heads=40, vocab=32000),
}
DEFAULT_PRESET = "tinyllama"


def resolve(args):
    """Fill the model-dependent sizes left unset (None) in ``args`` in place, from the model's
    defaults and, for llama, its preset (``tinyllama`` unless ``--preset`` names another); a size
    given on the command line wins. Returns ``args``; raises ValueError for a preset or gradient
    checkpointing asked of a model without them."""
    defaults = dict(MODEL_DEFAULTS[args.model])
    if args.model == "llama":
        args.preset = getattr(args, "preset", None) or DEFAULT_PRESET
        defaults.update(LLAMA_PRESETS[args.preset])
    else:
        given = {"--preset": getattr(args, "preset", None), "--grad-ckpt": getattr(args, "grad_ckpt", False)}
        for flag, value in given.items():
            if value:
                raise ValueError(f"{flag} is for --model llama")
    for k, v in defaults.items():
        if getattr(args, k, None) is None:
            setattr(args, k, v)
    return args


def build_model(args):
    """The model ``args.model`` names, at ``args``' sizes."""
    if args.model == "llama":
        return build_llama(args)
    if args.model == "sequential":
        layers = []
        for _ in range(args.layers):
            layers += [torch.nn.Linear(args.hidden, args.hidden), torch.nn.ReLU()]
        return torch.nn.Sequential(*layers)
    return MLP(args.layers, args.hidden)


class MLP(torch.nn.Module):

    def __init__(self, layers, hidden):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(hidden, hidden) for _ in range(layers))

    def forward(self, x):
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x


def build_llama(args):
    """A Llama-shaped ``LlamaForCausalLM`` with random weights (whatever each module's own init gives;
    under ``zero.Init`` every module is partitioned as it is built). SDPA attention, no KV cache,
    untied embeddings; with ``args.grad_ckpt`` gradient checkpointing on every decoder layer, in its
    style, asked for explicitly: ``reentrant`` (transformers 4's default for ``gradient_checkpointing_enable()``
    with no arguments, and what most ZeRO-3 recipes set; transformers 5 defaults to non-reentrant),
    ``non-reentrant``; off otherwise."""
    LlamaConfig, LlamaForCausalLM = llama_classes()
    config = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
                         num_hidden_layers=args.layers, num_attention_heads=args.heads,
                         num_key_value_heads=args.kv_heads, max_position_embeddings=max(args.seq, 2048),
                         use_cache=False, tie_word_embeddings=False, attn_implementation="sdpa")
    model = LlamaForCausalLM(config)
    style = getattr(args, "grad_ckpt", None)
    if style:
        enable_checkpointing(model, reentrant=style == "reentrant")
    return model


def enable_checkpointing(model, reentrant: bool):
    """Checkpointing on every decoder layer of a Hugging Face model, in the style asked. transformers
    5.25 renamed ``gradient_checkpointing_enable`` to ``activation_checkpointing_enable`` (the old name
    warns, until v6 removes it): the new one where the model has it."""
    kwargs = {"use_reentrant": reentrant}
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is not None:
        enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def llama_classes():
    """transformers' LlamaConfig and LlamaForCausalLM, imported on first use (an optional extra).
    Import them before ``zero.Init``: the modeling module imports torch._dynamo, whose polyfills
    refuse the tensor constructors zero.Init patches while it is active."""
    try:
        from transformers import LlamaConfig, LlamaForCausalLM
    except ImportError as e:
        raise SystemExit(f"deepspeed-offload bench --model llama needs the transformers package ({e}): "
                         "pip install transformers") from None
    return LlamaConfig, LlamaForCausalLM


def make_loss(args, device):
    """The loss of one forward on a fixed micro-batch, as a function of the engine: the LM loss on
    random token ids for llama, the mean square of the output for the MLPs."""
    if args.model == "llama":
        ids = torch.randint(0, args.vocab, (args.batch, args.seq), device=device)
        return lambda engine: engine(input_ids=ids, labels=ids).loss
    x = torch.randn(args.tokens, args.hidden, device=device, dtype=torch.bfloat16)
    return lambda engine: engine(x).float().pow(2).mean()
