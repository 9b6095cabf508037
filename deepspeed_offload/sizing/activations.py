"""What one training iteration of a Hugging Face Llama-shaped causal LM holds on the GPU, from the
model's shape alone: the model of its memory that ``deepspeed-offload estimate`` answers "does it
fit" with, and the measured runs it is checked against.

It lives apart from the cost model (estimate.py: state, host memory, copy time) because it is a
model of someone else's code (``LlamaForCausalLM``'s forward, HF's loss, ZeRO-3's buffers, PyTorch's
caching allocator) and has to be calibrated, where the cost model is arithmetic. Between steps a
rank holds its 16-bit partitions of the parameters and gradients, DeepSpeed's reduce bucket and the
optimizer state kept resident. The iteration adds the activations, whose peak is in the backward
of the loss: HF's loss upcasts the logits to fp32 and ``cross_entropy`` keeps its log-softmax for
backward, so the peak holds every layer's saved tensors (or, checkpointed, every layer's input)
plus 12 bytes a logit. Streaming adds the staging slots. PyTorch's allocator reserves about a
sixth more than the peak of what is not resident optimizer state (allocated once, in large blocks
that do not fragment).

Every coefficient below comes from the H200 runs in ``CALIBRATION`` (copied from
benchmarks/results at commit caa85bc, named by file); tests/unit/test_activations.py holds each
prediction to 10% of the measured peak, allocated and reserved. Assumed, as those runs ran:
``LlamaForCausalLM`` with SDPA attention, no padding mask (grouped KV heads go to SDPA as they are),
labels given (HF's loss), untied lm_head unless the config ties it, one micro-batch per step.
"""

import json
import os
from dataclasses import dataclass
from typing import Any, Dict, Optional

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..errors import ConfigError, pydantic_error
from .estimate import STATE_BYTES_PER_PARAM

GiB = 2**30

DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}

# Bytes per logit at the loss's backward: the fp32 log-softmax kept for backward, the gradient that
# comes into it and the one it gives (HF's ForCausalLMLoss does ``logits.float()`` first). The 1.1B
# run's allocation timeline shows each step of it (llama-1b-2026-12-03-frontier.json, resident:
# +2.9 GiB bf16 logits and their fp32 copy, +1.95 the log-softmax, then in backward +1.95 +1.95 to
# the peak of 52.76, for 8 x 2048 x 32000 logits); the forward's 10 bytes (bf16 logits, fp32 copy,
# log-softmax) stay below it.
LOGIT_BYTES = 12
# What a checkpointed layer's backward holds beyond the layer inputs: its recomputed activations and
# the gradients through it, in layers' worth of saved activations. The 7B run's first recompute peaks
# at 117.45 GiB allocated, 16.05 above between steps (llama-7b-2026-12-03-default.json's timeline):
# the 32 layer inputs (8.0 GiB) and 1.41 x the layer's 5.69 GiB.
RECOMPUTE_LAYERS = 1.41
# What the engine keeps between steps besides the partitions, the reduce bucket and the state: 67.2
# to 69.1 MB on every Llama run at 1.1B, 7B, 8B and 13B.
ENGINE_BYTES = 68 * 10**6
# The caching allocator's peak reserved over its peak allocated, on what is not resident optimizer
# state: the least-squares fit over CALIBRATION is 0.164 (from 0.154 to 0.17 every row stays within 6%).
RESERVED_SLACK = 0.16
# DeepSpeed's reduce_bucket_size when the ds_config leaves it out.
DEFAULT_REDUCE_BUCKET = 500_000_000


class ModelShape(BaseModel):
    """A Llama-shaped model, as its Hugging Face config.json names the sizes (other keys ignored)."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    hidden_size: int = Field(gt=0)
    intermediate_size: int = Field(gt=0)
    num_hidden_layers: int = Field(gt=0)
    num_attention_heads: int = Field(gt=0)
    num_key_value_heads: Optional[int] = Field(None, gt=0)  # None: as many as the attention heads
    vocab_size: int = Field(gt=0)
    head_dim: Optional[int] = Field(None, gt=0)  # None: hidden_size / num_attention_heads
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    # counted on the model transformers builds (``model_config.py``): exact for every architecture,
    # where the formulas below are Llama's (None: the formulas)
    counted_params: Optional[int] = Field(None, gt=0)
    counted_largest: Optional[int] = Field(None, gt=0)
    model_type: Optional[str] = None

    @property
    def kv_heads(self) -> int:
        return self.num_key_value_heads or self.num_attention_heads

    @property
    def q_dim(self) -> int:
        return self.num_attention_heads * (self.head_dim or self.hidden_size // self.num_attention_heads)

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * (self.head_dim or self.hidden_size // self.num_attention_heads)

    @property
    def layer_params(self) -> int:
        h, i, q, kv = self.hidden_size, self.intermediate_size, self.q_dim, self.kv_dim
        attention = h * (q + 2 * kv) + q * h + ((q + 2 * kv + h) if self.attention_bias else 0)
        mlp = 3 * h * i + ((2 * i + h) if self.mlp_bias else 0)
        return attention + mlp + 2 * h  # and the two RMSNorm weights

    @property
    def params(self) -> int:
        """Parameters of the model: as counted, else ``LlamaForCausalLM``'s in this shape (Llama-2-7B's:
        6,738,415,616)."""
        if self.counted_params:
            return self.counted_params
        embeddings = self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)
        return self.num_hidden_layers * self.layer_params + embeddings + self.hidden_size

    @property
    def largest_param(self) -> int:
        """Elements of the largest parameter: as counted, else the embedding (vocabulary x hidden) or an
        MLP matrix."""
        if self.counted_largest:
            return self.counted_largest
        return max(self.vocab_size * self.hidden_size, self.hidden_size * self.intermediate_size)

    def describe(self) -> str:
        kv = f", {self.kv_heads} KV heads" if self.kv_heads != self.num_attention_heads else ""
        kind = f"{self.model_type}, " if self.model_type else ""
        tied = ", tied embeddings" if self.tie_word_embeddings else ""
        return (f"{self.params:,} parameters ({kind}{self.num_hidden_layers} layers, hidden {self.hidden_size}, MLP "
                f"{self.intermediate_size}, {self.num_attention_heads} heads{kv}, vocabulary {self.vocab_size}{tied})")


FIELDS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
          "vocab_size")


def read_model_config(path: str) -> Dict[str, Any]:
    """A Hugging Face config.json (or the directory holding one) as a dict; a multimodal model's
    ``text_config`` is the language model's. ConfigError naming ``--model-config`` otherwise."""
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    try:
        with open(path) as f:
            cfg = json.load(f)
    except (OSError, ValueError) as e:
        raise ConfigError("--model-config", f"cannot read {path}: {e}") from None
    if not isinstance(cfg, dict):
        raise ConfigError("--model-config", f"{path} is not a JSON object")
    text = cfg.get("text_config")
    return {**cfg, **text} if isinstance(text, dict) and "hidden_size" not in cfg else cfg


def model_shape(config: Optional[Dict[str, Any]], overrides: Dict[str, Optional[int]]) -> ModelShape:
    """The shape from a config.json's fields, each overridden by a flag given (``overrides``: field
    name to value, None when not given). A field missing in both is an error naming its flag."""
    fields = {k: v for k, v in (config or {}).items() if v is not None}  # (null: the default)
    fields.update({k: v for k, v in overrides.items() if v is not None})
    for name in FIELDS:
        if name != "num_key_value_heads" and fields.get(name) is None:
            where = "not in --model-config and " if config is not None else ""
            raise ConfigError(f"--{name.replace('_', '-')}", f"{where}not given: the model's shape needs it")
    try:
        return ModelShape.model_validate(fields)
    except ValidationError as e:
        err = pydantic_error(e, "")
        flag = f"--{err.path.replace('_', '-')}" if err.path in FIELDS else "--model-config"
        raise ConfigError(flag, err.reason if flag != "--model-config" else f"{err.path}: {err.reason}") from None


def layer_bytes(shape: ModelShape, dtype_bytes: int) -> int:
    """Bytes one decoder layer saves for backward, per token: each RMSNorm its fp32 input, the
    normalised and the scaled output (and 1/rms, fp32); attention q and k after RoPE, v, SDPA's output
    and logsumexp (fp32, a head); the MLP gate, up, act(gate) and their product. 87,176 at TinyLlama's
    shape in bf16; the 1.1B run's timeline grows 1.33 GiB a layer for 16,384 tokens (87,184)."""
    h, d = shape.hidden_size, dtype_bytes
    norms = 2 * (4 * h + 2 * d * h + 4)
    attention = 2 * d * shape.q_dim + 2 * d * shape.kv_dim + 4 * shape.num_attention_heads
    return norms + attention + 4 * d * shape.intermediate_size


def activation_bytes(shape: ModelShape, batch: int, seq: int, checkpointing: bool, dtype_bytes: int = 2) -> int:
    """The peak of the activations over forward and backward, bytes, for a micro-batch of
    ``batch`` x ``seq`` tokens: the larger of the loss's backward (every layer's saved tensors, or
    with gradient checkpointing every layer's input; the final norm's; 12 bytes a logit) and a
    layer's backward (recomputed, when checkpointed)."""
    tokens = batch * seq
    layer = layer_bytes(shape, dtype_bytes)
    final_norm = 4 * shape.hidden_size + 2 * dtype_bytes * shape.hidden_size
    logits = LOGIT_BYTES * shape.vocab_size
    kept = shape.num_hidden_layers * (dtype_bytes * shape.hidden_size if checkpointing else layer)
    through_layer = (RECOMPUTE_LAYERS if checkpointing else RECOMPUTE_LAYERS - 1) * layer
    return int(tokens * max(kept + final_norm + logits, kept + through_layer))


def between_steps_bytes(params: int, world: int, dtype_bytes: int = 2,
                        reduce_bucket: int = DEFAULT_REDUCE_BUCKET) -> int:
    """What a rank holds between steps besides the optimizer state: its partitions of the
    parameters and their gradients, the reduce bucket, the engine's own (the between-steps figure of
    every calibration run less the state it kept, within 0.3%)."""
    return 2 * dtype_bytes * -(-params // world) + dtype_bytes * reduce_bucket + ENGINE_BYTES


@dataclass(frozen=True)
class IterationMemory:
    """One rank's iteration, bytes: between steps, the activations' peak, the staging slots, and the
    iteration's peak allocated and reserved, with ``resident`` bytes of optimizer state on the GPU."""
    between: int
    activations: int
    slots: int
    resident: int
    peak_allocated: int
    peak_reserved: int

    @property
    def besides_state(self) -> int:
        """What the iteration reserves besides the resident state: the figure the measured plan logs."""
        return self.peak_reserved - self.resident


def iteration_memory(shape: ModelShape, batch: int, seq: int, checkpointing: bool, *, params: Optional[int] = None,
                     world: int = 1, dtype_bytes: int = 2, reduce_bucket: int = DEFAULT_REDUCE_BUCKET,
                     resident: int = 0, slot: int = 0, streamed: bool = False) -> IterationMemory:
    """The iteration of one rank with ``resident`` bytes of its optimizer state on the GPU; where any
    is ``streamed``, two staging slots of ``slot`` bytes beside the activations' peak (what the step's
    loads take of the room backward frees: 1.35 to 2 slots measured)."""
    between = between_steps_bytes(params or shape.params, world, dtype_bytes, reduce_bucket)
    act = activation_bytes(shape, batch, seq, checkpointing, dtype_bytes)
    slots = 2 * slot if streamed else 0
    allocated = between + resident + act + slots
    reserved = resident + int((1 + RESERVED_SLACK) * (allocated - resident))
    return IterationMemory(between + resident, act, slots, resident, allocated, reserved)


def dtype_of(ds_config: Optional[Dict[str, Any]]) -> str:
    """The training dtype a ds_config asks for: bf16 or fp16 when enabled, else fp32 (no ds_config: bf16)."""
    if ds_config is None:
        return "bf16"
    for name in ("bf16", "fp16"):
        section = ds_config.get(name)
        if isinstance(section, dict) and section.get("enabled") is True:
            return name
    return "fp32"


def reduce_bucket_of(ds_config: Optional[Dict[str, Any]], hidden_size: int) -> int:
    """``zero_optimization.reduce_bucket_size``: DeepSpeed's default when absent, hidden_size² for
    "auto" (what the HF Trainer fills in)."""
    zero = (ds_config or {}).get("zero_optimization") or {}
    value = zero.get("reduce_bucket_size") if isinstance(zero, dict) else None
    if value == "auto":
        return hidden_size * hidden_size
    return int(value) if isinstance(value, (int, float)) and value > 0 else DEFAULT_REDUCE_BUCKET


# ------------------------------------------------------------------------------------------ calibration

# The benchmark's Llama presets (deepspeed_offload/bench/models.py), as config.json names them.
PRESETS = {
    "1.1B": ModelShape(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
                       num_key_value_heads=4, vocab_size=32000),
    "7B": ModelShape(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                     num_key_value_heads=32, vocab_size=32000),
    "8B": ModelShape(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                     num_key_value_heads=8, vocab_size=128256),
    "13B": ModelShape(hidden_size=5120, intermediate_size=13824, num_hidden_layers=40, num_attention_heads=40,
                      num_key_value_heads=40, vocab_size=32000),
}


@dataclass(frozen=True)
class Measured:
    """One measured iteration on one H200 (bf16, one rank): the model, its micro-batch, gradient
    checkpointing, reduce_bucket_size, the optimizer state resident then (GiB; None: all of it), whether
    any was streamed, and the peaks measured (GiB); ``source``: the JSON in benchmarks/results and
    the mode in it."""
    model: str
    batch: int
    seq: int
    checkpointing: bool
    what: str
    reduce_bucket: int
    resident_gib: Optional[float]
    streamed: bool
    allocated_gib: float
    reserved_gib: float
    source: str


# Copied from the benchmark JSONs at commit caa85bc (peak_iter_GiB / peak_reserved_GiB, the state
# resident from each mode's plan); the 13B at 4 x 4096 from its per-iteration rows, since its peaks
# (124.61 / 133.92) come from the iterations before its plan's two give-backs, with more resident.
CALIBRATION = (
    Measured("1.1B", 8, 2048, False, "plain ZeRO-3", DEFAULT_REDUCE_BUCKET, None, False, 52.76, 56.28,
             "llama-1b-2026-12-03-frontier.json: resident"),
    Measured("1.1B", 8, 2048, False, "ours, defaults (all resident)", DEFAULT_REDUCE_BUCKET, None, False, 52.76, 58.04,
             "llama-1b-2026-12-03-frontier.json: default@default"),
    Measured("1.1B", 8, 2048, False, "ours, budget 0", DEFAULT_REDUCE_BUCKET, 0.0, True, 40.47, 49.93,
             "llama-1b-2026-12-03-frontier.json: default@0"),
    Measured("7B", 8, 4096, True, "plain ZeRO-3", DEFAULT_REDUCE_BUCKET, None, False, 122.13, 130.02,
             "llama-7b-2026-12-03-peers.json: resident"),
    Measured("7B", 8, 4096, True, "ours, defaults (all resident)", DEFAULT_REDUCE_BUCKET, None, False, 122.13, 130.98,
             "llama-7b-2026-12-03-default.json: default@default"),
    Measured("7B", 8, 4096, True, "ours, budget 0", DEFAULT_REDUCE_BUCKET, 0.0, True, 49.07, 58.62,
             "llama-7b-2026-12-02-curve.json: default@0"),
    Measured("7B", 8, 4096, True, "ours, budget 0, bucket 16M", 16_777_216, 0.0, True, 48.44, 57.45,
             "llama-7b-2026-12-03-default-budget0-z.json: default@0"),
    Measured("7B", 8, 4096, True, "ours, budget 16", DEFAULT_REDUCE_BUCKET, 15.79, True, 64.59, 73.41,
             "llama-7b-2026-12-02-curve.json: default@16"),
    Measured("7B", 8, 4096, True, "ours, budget 32", DEFAULT_REDUCE_BUCKET, 31.62, True, 80.42, 92.51,
             "llama-7b-2026-12-02-curve.json: default@32"),
    Measured("7B", 8, 4096, True, "ours, budget 48", DEFAULT_REDUCE_BUCKET, 47.95, True, 96.63, 109.14,
             "llama-7b-2026-12-02-curve.json: default@48"),
    Measured("8B", 8, 4096, True, "ours, budget 0", DEFAULT_REDUCE_BUCKET, 0.0, True, 96.14, 116.26,
             "llama-8b-2026-12-03-default.json: default@0"),
    Measured("8B", 8, 4096, True, "ours, defaults", DEFAULT_REDUCE_BUCKET, 17.40, True, 112.12, 129.14,
             "llama-8b-2026-12-03-default.json: default@default"),
    Measured("13B", 4, 4096, True, "ours, defaults, 1st iteration", 26_214_400, 57.76, True, 124.61, 132.86,
             "llama-13b-2026-12-03-default.json: default, per_iter[0] (106.36 GiB between steps)"),
    Measured("13B", 4, 4096, True, "ours, defaults, settled", 26_214_400, 49.09, True, 113.04, 130.44,
             "llama-13b-2026-12-03-default.json: default, per_iter[5:]"),
    Measured("13B", 8, 4096, True, "ours, defaults", 26_214_400, 49.88, True, 126.43, 134.60,
             "llama-13b-2026-12-02-default-8x4096.json: default"),
)


def predict(m: Measured, sub_group_mb: int = 256) -> IterationMemory:
    """The model's figures for a calibration run: its shape, batch, bucket and resident state; the
    staging slot the embedding sets (a parameter larger than a sub-group is a sub-group of its own)."""
    shape = PRESETS[m.model]
    state = STATE_BYTES_PER_PARAM * shape.params
    resident = state if m.resident_gib is None else int(m.resident_gib * GiB)
    slot = max(sub_group_mb * 2**20, STATE_BYTES_PER_PARAM * shape.largest_param)
    return iteration_memory(shape, m.batch, m.seq, m.checkpointing, reduce_bucket=m.reduce_bucket,
                            resident=resident, slot=slot, streamed=m.streamed)
