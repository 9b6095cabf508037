"""The fit answer of ``deepspeed-offload estimate``: from a model's shape, its micro-batch, the
ds_config, the GPU and this node's host, whether training fits (the whole optimizer state resident),
splits it (part or all of it streamed from the host) or does not fit; where the state goes; the host
memory a node pins; the largest micro-batch that fits; and a rough s/iteration.

The iteration's memory is activations.py's calibrated model; the placement is the measured plan's own
rule (``split`` in runtime/memory/node_plan.py: the host holds what it can give, the GPU keeps what
fits below its memory less the plan's margin and what the iteration reserves besides the state), or
the budget the ds_config sets; host memory per rank is the node's usable memory over its ranks, as
attach judges it. The time is labelled rough: forward+backward from the throughput the runs on the
card measured (``THROUGHPUT``: H200, H100), scaled by the model's FLOPs; the step from the 7B's step with everything
resident, plus estimate.py's copy time for what streams, without speculation (an upper bound where
it runs).
"""

import math
from dataclasses import dataclass
from typing import Any, Dict, Optional

from .activations import (DTYPE_BYTES, FIELDS, LOGIT_BYTES, GiB, PRESETS, ModelShape, dtype_of, iteration_memory,
                          model_shape, read_model_config, reduce_bucket_of)
from ..errors import ConfigError
from .estimate import (STATE_BYTES_PER_PARAM, deepspeed_pinned_per_rank, estimate, speculation_bytes,
                       state_bytes_per_rank)
from .host_memory import format_bytes
from .model_config import from_name
from .verdict import judge
from ..runtime.memory.node_plan import split
from ..runtime.memory.placement import margin_bytes

# The host-device bandwidth assumed where none is given or measured: the median each way, both
# directions busy, of the H200 runs' probes (benchmarks/results, 50.4 GB/s).
H200_BANDWIDTH_GBPS = 50.4
# The optimizer step of resident state, seconds a parameter of the rank's partition: the 7B's step with
# all 162 sub-groups resident, 0.206 s (llama-7b-2026-12-03-default.json, default@default).
RESIDENT_STEP_S_PER_PARAM = 0.206 / 6_738_415_616
LARGEST_BATCH = 2**16  # the search's upper end


@dataclass(frozen=True)
class Throughput:
    """A measured forward+backward on one GPU (bf16, one rank): the card, the preset, its micro-batch,
    gradient checkpointing, the synchronized median seconds and where they come from."""
    card: str
    model: str
    batch: int
    seq: int
    checkpointing: bool
    seconds: float
    source: str


THROUGHPUT = (
    Throughput("H200", "1.1B", 8, 2048, False, 0.357, "llama-1b-2026-12-03-frontier.json: resident, fwd_bwd_s"),
    Throughput("H200", "7B", 8, 4096, True, 3.862, "llama-7b-2026-12-03-default.json: default@default, fwd_bwd_s"),
    Throughput("H200", "8B", 8, 4096, True, 4.174, "llama-8b-2026-12-03-default.json: default@0, fwd_bwd_s"),
    Throughput("H200", "13B", 8, 4096, True, 6.934, "llama-13b-2026-12-02-default-8x4096.json: default, fwd_bwd_s"),
    # the median of the H100 runs' resident fwd_bwd_s (llama-1b-2026-12-05-{buckets-a,buckets-b,rounds,
    # buckets-h100-hidden2}-h100.json and -buckets-h100-sub-group.json: 0.363-0.430 s)
    Throughput("H100", "1.1B", 8, 2048, False, 0.423, "llama-1b-2026-12-05-*-h100.json: resident, fwd_bwd_s"),
    # the 7B cannot be resident on an H100: its split runs at the defaults, iterations 3-9, the
    # iteration less the step (llama-7b-2026-12-06-h100-{norm-queued,allocator-switch,default-expandable}.json:
    # 4.149-4.238 s, reentrant checkpointing, 37-48 of 162 sub-groups resident)
    Throughput("H100", "7B", 8, 4096, True, 4.183, "llama-7b-2026-12-06-h100-*.json: s - step_s, iterations 3-9"),
)
CARDS = sorted({t.card for t in THROUGHPUT})


def card_of(name: Optional[str]) -> str:
    """The calibrated card a device's name is (an H100 or H200 of any form factor); the H200 where it is
    neither or unknown (the card most of the calibration ran on)."""
    upper = (name or "").upper()
    return next((card for card in CARDS if card in upper), "H200")


def training_flops(shape: ModelShape, batch: int, seq: int, checkpointing: bool) -> float:
    """FLOPs of one forward+backward: 2 per weight and token for each matmul pass (forward, two in
    backward, and the recompute when checkpointed), over every linear layer and the lm_head, plus
    causal attention's scores and weighted sum."""
    passes = 4 if checkpointing else 3
    matmul_params = shape.num_hidden_layers * shape.layer_params + shape.vocab_size * shape.hidden_size
    attention = shape.num_hidden_layers * seq * shape.q_dim  # causal: half of QK^T and AV's 4 x seq x q_dim
    return 2.0 * passes * batch * seq * (matmul_params + attention)


def measured_tflops(params: int, card: str = "H200") -> Throughput:
    """The calibration run on ``card`` nearest in parameters (by ratio)."""
    runs = [t for t in THROUGHPUT if t.card == card] or [t for t in THROUGHPUT if t.card == "H200"]
    return min(runs, key=lambda t: abs(math.log(PRESETS[t.model].params / params)))


def tflops_of(t: Throughput) -> float:
    return training_flops(PRESETS[t.model], t.batch, t.seq, t.checkpointing) / t.seconds / 1e12


class Sizer:
    """One job as ``estimate`` was asked about it, asked again under one change at a time (another
    micro-batch, checkpointing, more ranks, another budget, more host memory) so that a verdict of
    DOES NOT FIT names the changes that work (verdict.py). ``device`` bytes of GPU memory training may
    use, ``host_cap`` bytes of host memory for a rank's store; ``budget_gb`` None: the measured plan."""

    def __init__(self, shape: ModelShape, seq: int, checkpointing: bool, *, dtype: str, params: int, world: int,
                 device: int, host_cap: int, budget_gb: Optional[float], sub_group_mb: int, largest: int,
                 reduce_bucket: int, margin: int):
        self.shape, self.seq, self.checkpointing, self.params, self.world = shape, seq, checkpointing, params, world
        self.dtype_bytes, self.device, self.host_cap, self.budget_gb = DTYPE_BYTES[dtype], device, host_cap, budget_gb
        self.sub_group_mb, self.largest, self.reduce_bucket = sub_group_mb, largest, reduce_bucket
        self.margin = margin if budget_gb is None else 0  # (a fixed budget plans no margin)

    def state(self, world: Optional[int] = None) -> int:
        return state_bytes_per_rank(self.params, world or self.world)

    def slot(self, world: Optional[int] = None) -> int:
        """A staging slot: a sub-group, or the largest parameter's state where that is larger."""
        world = world or self.world
        return min(self.state(world), max(self.sub_group_mb * 2**20, state_bytes_per_rank(self.largest, world)))

    def memory(self, b: int, resident: int, checkpointing: Optional[bool] = None, world: Optional[int] = None):
        world = world or self.world
        state, slot = self.state(world), self.slot(world)
        return iteration_memory(self.shape, b, self.seq, self.checkpointing if checkpointing is None else checkpointing,
                                params=self.params, world=world, dtype_bytes=self.dtype_bytes,
                                reduce_bucket=self.reduce_bucket, resident=resident, slot=slot,
                                streamed=resident < state)

    def place(self, b: int, checkpointing: Optional[bool] = None, world: Optional[int] = None, budget_gb="asked",
              host_cap: Optional[int] = None):
        """(resident bytes, fits, the measured plan's split or None) at micro-batch ``b``."""
        budget = self.budget_gb if budget_gb == "asked" else budget_gb
        host_cap = self.host_cap if host_cap is None else host_cap
        state = self.state(world)
        if budget is None:  # the plan measures with the state streamed, then keeps what fits
            margin = self.margin if self.budget_gb is None else margin_bytes(self.device)
            out = split(state, host_cap, self.device, self.memory(b, 0, checkpointing, world).besides_state, margin)
            return out["resident"], out["fits"], out
        resident = min(state, int(budget * GiB))
        it = self.memory(b, resident, checkpointing, world)
        return resident, state - resident <= host_cap and it.peak_reserved <= self.device, None

    def fits(self, b: int, **change) -> bool:
        return self.place(b, **change)[1]

    def largest_batch(self, all_resident: bool = False, **change) -> int:
        """The largest micro-batch that fits (``all_resident``: with all of the state resident), 0 if 1 does not."""
        def ok(b):
            resident, fits, _ = self.place(b, **change)
            return resident == self.state(change.get("world")) if all_resident else fits

        if not ok(1):
            return 0
        lo = 1
        while lo < LARGEST_BATCH and ok(min(2 * lo, LARGEST_BATCH)):
            lo = min(2 * lo, LARGEST_BATCH)
        hi = min(2 * lo, LARGEST_BATCH + 1)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if ok(mid) else (lo, mid)
        return lo

    def fitting_budget(self, b: int) -> Optional[float]:
        """The largest ``memory_budget_gb`` (0.1 GiB steps) that fits at micro-batch ``b``: from the least
        that leaves the host no more than it holds up to the whole state; None if none does."""
        step = 0.1
        lo = math.ceil(max(0, self.state() - self.host_cap) / GiB / step)
        hi = math.ceil(self.state() / GiB / step)
        if not self.fits(b, budget_gb=lo * step):
            return None
        while hi - lo > 0:  # (fits at lo; the largest that fits, in steps)
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if self.fits(b, budget_gb=mid * step) else (lo, mid - 1)
        return round(lo * step, 1)

    def host_needed(self, b: int) -> Optional[int]:
        """Host memory a rank needs for the measured plan to fit at ``b`` (None: the GPU has no room for
        the iteration even with everything on the host)."""
        room = self.device - self.margin - self.memory(b, 0).besides_state
        return self.state() - room if room >= 0 else None

    def logit_bytes(self, b: int) -> int:
        return LOGIT_BYTES * self.shape.vocab_size * b * self.seq

    def host_cap_text(self) -> str:
        return format_bytes(self.host_cap)


def fit(shape: ModelShape, batch: int, seq: int, checkpointing: bool, *, dtype: str = "bf16",
        params: Optional[int] = None, world: int = 1, ranks_per_node: int = 1, device: int, host_cap: int,
        budget_gb: Optional[float] = None, sub_group_mb: int = 256, largest_param: Optional[int] = None,
        reduce_bucket: int, margin: Optional[int] = None, bandwidth: float = H200_BANDWIDTH_GBPS,
        host_bandwidth: float, speculate_gb: Optional[float] = 0.0, deepspeed_pinned: int = 0,
        tflops: Optional[float] = None, card: str = "H200") -> Dict[str, Any]:
    """The answer for one rank of ``world`` (bytes, seconds): ``device`` bytes of GPU memory training
    may use, ``host_cap`` bytes of host memory for this rank's store; ``budget_gb`` None: the measured
    plan places the state, else that much stays resident."""
    params = params or shape.params
    largest = shape.largest_param if largest_param is None else largest_param
    margin = margin_bytes(device) if margin is None else margin
    sizer = Sizer(shape, seq, checkpointing, dtype=dtype, params=params, world=world, device=device,
                  host_cap=host_cap, budget_gb=budget_gb, sub_group_mb=sub_group_mb, largest=largest,
                  reduce_bucket=reduce_bucket, margin=margin)
    state = sizer.state()
    resident, fits, placement = sizer.place(batch)
    streamed = state - resident
    it = sizer.memory(batch, resident)
    verdict = judge(sizer, batch, resident, fits)
    plain = iteration_memory(shape, batch, seq, checkpointing, params=params, world=world,
                             dtype_bytes=DTYPE_BYTES[dtype], reduce_bucket=reduce_bucket, resident=state)
    whole = sizer.largest_batch(all_resident=True) if budget_gb is None else None

    rate = tflops or tflops_of(measured_tflops(params, card))
    forward_backward = training_flops(shape, batch, seq, checkpointing) / (rate * 1e12)
    step = RESIDENT_STEP_S_PER_PARAM * (resident // STATE_BYTES_PER_PARAM)
    copies = estimate(params, world, ranks_per_node, bandwidth, host_bandwidth, sub_group_mb, resident / GiB, largest)
    if streamed:
        step += copies["step_copy_s"]
    at_attach = min(state, host_cap) if budget_gb is None else streamed
    spec = speculation_bytes(streamed, speculate_gb) if speculate_gb is not None else None
    return {
        "verdict": verdict.kind, "why": verdict.reason, "what": verdict.what, "ways_out": verdict.ways_out,
        "verdict_line": verdict.line(), "params": params, "dtype": dtype, "batch": batch, "seq": seq,
        "checkpointing": checkpointing, "state_per_rank": state, "resident_per_rank": resident,
        "streamed_per_rank": streamed, "host_cap_per_rank": host_cap, "device": device, "margin": margin,
        "slot": sizer.slot(), "measured_plan": budget_gb is None, "budget_gb": budget_gb,
        "iteration": {"between_steps": it.between, "activations": it.activations, "slots": it.slots,
                      "peak_allocated": it.peak_allocated, "peak_reserved": it.peak_reserved,
                      "besides_state": it.besides_state},
        "plain_zero3": {"peak_allocated": plain.peak_allocated, "peak_reserved": plain.peak_reserved,
                        "fits": plain.peak_reserved <= device},
        "host_pinned_per_node_at_attach": ranks_per_node * at_attach,
        "host_pinned_per_node": ranks_per_node * streamed,
        "speculation_per_node": None if spec is None else ranks_per_node * spec,
        "deepspeed_pinned_per_node": ranks_per_node * deepspeed_pinned,
        "largest_batch": sizer.largest_batch(),
        "largest_batch_all_resident": whole,
        "forward_backward_s": forward_backward, "step_s": step, "iteration_s": forward_backward + step,
        "tflops": rate, "tflops_measured": tflops is None, "card": card, "bandwidth_per_rank_GBps": copies["bandwidth_per_rank_GBps"],
    }


def describe(answer: Dict[str, Any], shape: ModelShape, ranks_per_node: int, bandwidth: float,
             bandwidth_source: str) -> str:
    """The answer as lines of text, the verdict first."""
    a, it, gib = answer, answer["iteration"], format_bytes
    ck = "on" if a["checkpointing"] else "off"
    state, resident, streamed = a["state_per_rank"], a["resident_per_rank"], a["streamed_per_rank"]
    how = "the measured plan (memory_budget_gb null)" if a["measured_plan"] else f"memory_budget_gb {a['budget_gb']:g}"
    if a["verdict"] == "fits":
        head = f"FITS: all {gib(state)} of each rank's optimizer state resident on the GPU; {how}"
    elif a["verdict"] == "split":
        head = (f"SPLIT: {gib(resident)} of each rank's {gib(state)} of optimizer state resident on the GPU, "
                f"{gib(streamed)} streamed from the host each step; {how}")
    else:
        head = f"DOES NOT FIT: {a['what']} (the verdict below says why, and what would fit)"
    lines = [f"fit: {head}",
             f"  model: {shape.describe()}"
             + (f", {a['params']:,} parameters counted (--params)" if a["params"] != shape.params else "")
             + f"; micro-batch {a['batch']} x {a['seq']} tokens, gradient checkpointing {ck}, {a['dtype']}",
             f"  iteration per rank (model of activations calibrated on the H200 runs, within 6% of them; "
             f"docs/usage.md): peak allocated {gib(it['peak_allocated'])}, reserved {gib(it['peak_reserved'])} "
             f"of {gib(a['device'])} (between steps {gib(it['between_steps'])}, activations {gib(it['activations'])}"
             + (f", staging slots {gib(it['slots'])}" if it["slots"] else "")
             + (f"; the plan keeps a margin of {gib(a['margin'])})" if a["measured_plan"] else ")"),
             f"  plain ZeRO-3 (no offload) would reserve {gib(a['plain_zero3']['peak_reserved'])}: "
             + ("fits" if a["plain_zero3"]["fits"] else "does not fit")]
    spec = a["speculation_per_node"]
    spare = (" plus what the host has spare, for speculation's second regions (speculate_memory_gb null)"
             if spec is None else f" plus {gib(spec)} for speculation" if spec else "")
    ds = f" plus {gib(a['deepspeed_pinned_per_node'])} DeepSpeed pins (offload_param)" if a[
        "deepspeed_pinned_per_node"] else ""
    if a["measured_plan"]:
        lines.append(f"  host memory per node ({ranks_per_node} rank(s), each store at most "
                     f"{gib(a['host_cap_per_rank'])}): {gib(a['host_pinned_per_node_at_attach'])} pinned at attach, "
                     f"{gib(a['host_pinned_per_node'])} once the plan has made state resident{spare}{ds}")
    else:
        lines.append(f"  host memory per node ({ranks_per_node} rank(s)): {gib(a['host_pinned_per_node'])} pinned"
                     f"{spare}{ds}")
    largest = (f"  largest micro-batch that fits: {a['largest_batch']} x {a['seq']} tokens" if a["largest_batch"] else
               f"  largest micro-batch that fits: none (not 1 x {a['seq']} tokens)")
    whole = a["largest_batch_all_resident"]
    if whole is not None:
        largest += f" ({whole} with all of the state resident)" if whole else " (none with all of the state resident)"
    lines.append(largest)
    rate = (f"measured on the {a['card']} runs for the nearest model" if a["tflops_measured"] else "given")
    lines.append(f"  s/iteration (rough): {a['iteration_s']:.2f} s = forward+backward {a['forward_backward_s']:.2f} s "
                 f"at {a['tflops']:.0f} TFLOPS ({rate}) + step {a['step_s']:.2f} s"
                 + (f" (copies at {a['bandwidth_per_rank_GBps']:.1f} GB/s each way per rank, the link's "
                    f"{bandwidth:.1f} {bandwidth_source}; without speculation, which hides part of them in backward "
                    "where the host has memory to spare)" if streamed else ""))
    return "\n".join(lines)


def add_arguments(parser, positive_int, positive_float) -> None:
    """``estimate``'s flags for the model's shape and its micro-batch (``positive_int``,
    ``positive_float``: the CLI's argument types, which name the flag in their errors)."""
    parser.add_argument("--model", metavar="NAME_OR_PATH",
                        help="the model as Hugging Face names it: a hub id (needs network), a local directory or a "
                        "config.json, read by transformers' AutoConfig, its parameters counted on the meta device "
                        "(dense decoders: Llama, Mistral, Qwen2/Qwen3, Gemma, Phi-3, ...); with --seq, the fit answer")
    parser.add_argument("--model-config", metavar="PATH",
                        help="the model's Hugging Face config.json (or its directory): hidden_size, intermediate_size, "
                        "num_hidden_layers, num_attention_heads, num_key_value_heads, vocab_size; with --seq, the "
                        "fit answer: fits / split / does not fit (exit 1), the placement, host memory, the largest "
                        "micro-batch, s/iteration")
    for name in FIELDS:
        parser.add_argument(f"--{name.replace('_', '-')}", type=positive_int, default=None,
                            help=f"the model's {name} (instead of, or over, --model-config's)")
    parser.add_argument("--batch", type=positive_int, default=None,
                        help="micro-batch per GPU (default: the ds_config's train_micro_batch_size_per_gpu)")
    parser.add_argument("--seq", type=positive_int, default=None, help="tokens per sample")
    parser.add_argument("--gradient-checkpointing", action="store_true",
                        help="every decoder layer checkpointed (HF's gradient_checkpointing_enable())")
    parser.add_argument("--dtype", choices=sorted(DTYPE_BYTES), default=None,
                        help="training dtype (default: the ds_config's bf16 / fp16 section, else fp32; bf16 without "
                        "--config)")
    parser.add_argument("--tflops", type=positive_float, default=None,
                        help="forward+backward throughput of your GPU, TFLOPS (default: the runs' measured figure on "
                        "the --gpu card for the nearest model size)")
    parser.add_argument("--gpu", type=str.upper, choices=CARDS, default=None,
                        help="the card whose measured throughput the rough s/iteration uses (default: the GPU here, "
                        "else H200)")


def shape_from_args(ns) -> Optional[ModelShape]:
    """The model's shape from ``--model-config`` and the size flags (None when none of them is given),
    and ``ns.params`` and ``ns.largest_param`` from it where not given; ConfigError naming
    ``--params`` when neither the count nor the shape is."""
    shape = None
    if ns.model is not None:
        given = [f"--{name.replace('_', '-')}" for name in FIELDS if getattr(ns, name) is not None]
        if ns.model_config is not None or given:
            raise ConfigError("--model", f"counts the model's own sizes and parameters: give {' '.join(given) or '--model-config'}"
                                         " with --model-config instead, or --model alone")
        shape = from_name(ns.model)
    elif ns.model_config is not None or any(getattr(ns, name) is not None for name in FIELDS):
        config = read_model_config(ns.model_config) if ns.model_config is not None else None
        shape = model_shape(config, {name: getattr(ns, name) for name in FIELDS})
    if ns.params is None:
        if shape is None:
            raise ConfigError("--params", "give the model's parameters, or its shape (--model-config, or "
                              "--hidden-size and the other sizes)")
        ns.params = shape.params
    if shape is not None and not ns.largest_param:
        ns.largest_param = shape.largest_param
    return shape


def from_args(ns, shape: ModelShape, ds_config: Optional[Dict[str, Any]], budget_gb: Optional[float],
              sub_group_mb: int, speculate_gb: Optional[float], ranks_per_node: int, device: Optional[int],
              host_cap: int, bandwidth: float) -> Dict[str, Any]:
    """``fit`` for estimate's arguments (``device``: None where there is no device to ask and no
    --device-memory-gb); ConfigError naming the flag that is missing."""
    if ns.seq is None:
        raise ConfigError("--seq", "the fit answer needs the tokens per sample (--seq) beside the model")
    if ns.iteration_memory_gb is not None:
        raise ConfigError("--iteration-memory-gb", "the model's shape predicts what the iteration needs: give the "
                          "shape or --iteration-memory-gb, not both")
    batch = ns.batch
    if batch is None:
        micro = (ds_config or {}).get("train_micro_batch_size_per_gpu")
        if not isinstance(micro, int) or isinstance(micro, bool) or micro < 1:
            raise ConfigError("--batch", "the micro-batch per GPU: pass --batch (or a --config whose "
                              "train_micro_batch_size_per_gpu is a number)")
        batch = micro
    if device is None:
        raise ConfigError("--device-memory-gb", "no CUDA device here to ask for its memory: pass --device-memory-gb")
    return fit(shape, batch, ns.seq, ns.gradient_checkpointing, dtype=ns.dtype or dtype_of(ds_config),
               params=ns.params, world=ns.world_size, ranks_per_node=ranks_per_node, device=device,
               host_cap=host_cap, budget_gb=budget_gb, sub_group_mb=sub_group_mb,
               largest_param=ns.largest_param or None, reduce_bucket=reduce_bucket_of(ds_config, shape.hidden_size),
               margin=None if ns.margin_gb is None else int(ns.margin_gb * GiB), bandwidth=bandwidth,
               host_bandwidth=ns.host_bandwidth, speculate_gb=speculate_gb,
               deepspeed_pinned=deepspeed_pinned_per_rank(ns.params, ns.world_size, ds_config), tflops=ns.tflops,
               card=ns.gpu or card_of(_device_name()))


def _device_name() -> Optional[str]:
    import torch
    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
