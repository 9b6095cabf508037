"""The ``optimizer_state_offload`` block of a ds_config, and the one validation path before DeepSpeed runs.

``deepspeed_offload.initialize``, ``attach`` and ``deepspeed-offload check`` share it
(``load_ds_config`` in ds_config.py, then ``validate`` here): the strict pydantic model of the block
(unknown keys, wrong types, non-finite or negative sizes are errors that name the key path),
DeepSpeed's own models for the rest (preflight.py), and the cross-checks of the block against the
rest of the ds_config (ZeRO stage, ZeRO-Offload, DeepCompile). Everything here is pure: it reads
dicts and the installed torch/accelerator, creates no engine, no process group, no pinned memory,
so a rejected configuration leaves nothing behind.
"""

import json
from typing import Any, Dict, Literal, Optional, Tuple

from deepspeed.utils import logger
from packaging import version
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from .sizing.activations import DEFAULT_REDUCE_BUCKET, dtype_of
from .compat import compile_mode_refusal, deepspeed_release
from .ds_config import get_path, load_ds_config, resolve_config_source
from .errors import BLOCK, ConfigError, pydantic_error
from .sizing.estimate import STATE_BYTES_PER_PARAM
from .sizing.host_memory import format_bytes
from .preflight import AUTO, DeepSpeedView, deepspeed_view, reject_unfilled_auto, run_deepspeed_config

# DeepCompile itself needs torch 2.6 (deepspeed.compile.util.is_deepcompile_supported).
MIN_TORCH_FOR_COMPILE = "2.6"

# Upper bounds that keep every derived byte count a finite number: 1 PiB of GPU memory, 1 TiB slots.
MAX_GB = 2**20
MAX_SUB_GROUP_MB = 2**20


def _gib_field():
    """An optional GiB figure: finite, >= 0, at most MAX_GB (null: derived)."""
    return Field(None, ge=0, le=MAX_GB, allow_inf_nan=False)


class OffloadConfig(BaseModel):
    """The ``optimizer_state_offload`` block. Defaults follow DeepSpeed's convention: a block that
    does not say ``enabled: true`` changes nothing. No value is ever the string "auto" (that is the
    Hugging Face placeholder for a value the framework fills in; nothing fills ours): a ``null`` or
    absent ``mode``, ``memory_budget_gb`` or ``overlap_memory_gb`` is derived."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    enabled: bool = False
    # None: compile when compile.deepcompile is on (as DeepSpeed reads it), else stream.
    mode: Optional[Literal["stream", "compile"]] = None
    sub_group_mb: int = Field(256, gt=0, le=MAX_SUB_GROUP_MB)
    pin_memory: bool = True
    prefetch: bool = True
    # GPU memory for state kept resident; null: measured (runtime/memory/placement.py), 0: offload everything.
    memory_budget_gb: Optional[float] = _gib_field()
    # The most device memory training may use (the measured plan stays below it, less a margin; compile
    # mode's planner too); null: what the process can have of the device.
    max_device_memory_gb: Optional[float] = _gib_field()
    # Stream mode: load sub-groups during the last backward, as it frees memory, ahead of the step.
    overlap: bool = True
    # Device memory early loads may hold; null: derived from an iteration measured without them.
    overlap_memory_gb: Optional[float] = _gib_field()
    async_checkpoint: bool = False
    # Stream mode: host memory per rank for second regions, so that sub-groups are updated in
    # backward before the gradient norm is known (runtime/speculation/updates.py); null (the default): what
    # the node has spare after the stores; 0: off. Off where it cannot run (compile mode, overlap
    # off, fp32 parameters) unless a size is asked for, which is then an error there.
    speculate_memory_gb: Optional[float] = Field(None, ge=0, le=MAX_GB, allow_inf_nan=False)
    # Stream mode's measured plan on CUDA: the caching allocator's expandable_segments on from attach to
    # detach, unless PYTORCH_*ALLOC_CONF names it (runtime/memory/allocator.py); false: the allocator as it is.
    expandable_segments: bool = True

    @property
    def sub_group_size(self) -> int:
        """Elements per ZeRO-3 sub-group such that one sub-group's state fills one staging slot."""
        return self.sub_group_mb * 2**20 // STATE_BYTES_PER_PARAM


class Plan(BaseModel):
    """What validation decided: the block, the resolved mode and the ds_config DeepSpeed will get."""

    model_config = ConfigDict(arbitrary_types_allowed=True, frozen=True)

    offload: OffloadConfig
    mode: Literal["stream", "compile"]
    ds_config: Dict[str, Any]
    sub_group_size: int
    sub_group_size_set_by_us: bool

    def reduce_bucket_for(self, hidden_size) -> Optional[int]:
        """The ``zero_optimization.reduce_bucket_size`` that ``initialize`` sets where the ds_config
        leaves it out, in stream mode where speculation can run (``overlap`` on, ``speculate_memory_gb``
        not 0, 16-bit parameters), for a model ``hidden_size`` wide (a Hugging Face model says it; None:
        unknown): one sub-group's elements (``sub_group_size``), or hidden_size² (what HF's "auto" fills
        in) where that is larger, if below DeepSpeed's own 5e8. Updates in backward start once a
        sub-group's gradients are final, and DeepSpeed's 5e8-element bucket makes them final late; a
        smaller one makes a sub-group final at most one bucket sooner, while each reduction costs host
        time of its own on backward's thread (DeepSpeed's Python around the reduce-scatter). With more
        than two ranks the bucket also sets the order in which the ranks' gradients are summed, so
        where the width is unknown (not a model HF's "auto" would size) DeepSpeed's own stands and
        plain ZeRO-3 with the same ds_config stays the bitwise reference. None: DeepSpeed's own."""
        zero = self.ds_config.get("zero_optimization")
        if (self.mode != "stream" or not self.offload.overlap or self.offload.speculate_memory_gb == 0
                or not isinstance(zero, dict) or "reduce_bucket_size" in zero
                or dtype_of(self.ds_config) == "fp32" or not isinstance(hidden_size, int) or hidden_size <= 0):
            return None
        bucket = max(self.sub_group_size, hidden_size * hidden_size)
        return bucket if bucket < DEFAULT_REDUCE_BUCKET else None

    def with_reduce_bucket(self, hidden_size) -> Dict[str, Any]:
        """``ds_config`` with the bucket ``reduce_bucket_for`` picks (itself where it picks none)."""
        bucket = self.reduce_bucket_for(hidden_size)
        if bucket is None:
            return self.ds_config
        return dict(self.ds_config, zero_optimization=dict(self.ds_config["zero_optimization"],
                                                             reduce_bucket_size=bucket))


# ---------------------------------------------------------------------------------------------
# Our block


def parse_block(ds_config: Dict[str, Any]) -> OffloadConfig:
    raw = ds_config.get(BLOCK, {})
    if not isinstance(raw, dict):
        raise ConfigError(BLOCK, f"must be an object, got {type(raw).__name__}")
    for key, value in raw.items():
        if isinstance(value, str) and value == AUTO and key in OffloadConfig.model_fields:
            default = OffloadConfig.model_fields[key].default
            how = ("use null or leave it out to derive it" if default is None else
                   f"leave it out for the default ({json.dumps(default)})")
            raise ConfigError(f"{BLOCK}.{key}", f"\"auto\" is not one of our values (it is the placeholder Hugging "
                              f"Face and Accelerate fill in, and nothing fills ours): {how}")
    try:
        return OffloadConfig(**raw)
    except ValidationError as e:
        err = e.errors()[0]
        if err["type"] == "extra_forbidden":
            known = ", ".join(OffloadConfig.model_fields)
            raise ConfigError(f"{BLOCK}.{err['loc'][0]}", f"unknown key (known keys: {known})") from None
        raise pydantic_error(e, BLOCK) from None


# ---------------------------------------------------------------------------------------------
# The block against the rest


def _compile_supported() -> Tuple[bool, str]:
    """Whether DeepCompile can run compile mode here, and every reason it cannot (a CPU machine with
    an older DeepSpeed learns both)."""
    import torch
    from deepspeed.accelerator import get_accelerator
    why = []
    if version.parse(torch.__version__.split("+")[0]) < version.parse(MIN_TORCH_FOR_COMPILE):
        why.append(f"DeepCompile needs torch >= {MIN_TORCH_FOR_COMPILE}, this is {torch.__version__}")
    else:
        why.append(compile_mode_refusal(torch.__version__))
    name = get_accelerator().device_name()
    if name != "cuda":
        why.append(f"DeepCompile ({deepspeed_release()}) needs a CUDA accelerator, this one is '{name}'")
    why = [w for w in why if w]
    return not why, "; ".join(why)


def validate(ds_config: Dict[str, Any], strict_when_disabled: bool = False,
             world_size: Optional[int] = None) -> Optional[Plan]:
    """Everything that must hold before DeepSpeed runs. Returns None when offload is off (then the
    ds_config goes to DeepSpeed untouched), else the Plan. Raises ConfigError before anything is
    changed.

    A block with ``enabled: false`` (or no ``enabled``), or no block, changes nothing: then a mistake
    in the block is only a warning and the rest of the ds_config is DeepSpeed's business, unless
    ``strict_when_disabled`` (what ``deepspeed-offload check`` asks for). ``world_size``: the
    data-parallel world size, for DeepSpeed's train_batch_size = micro x accumulation x world check
    (None: any world size the batch sizes allow)."""
    if not isinstance(ds_config, dict):
        raise ConfigError("config", f"a ds_config must be a dict, got {type(ds_config).__name__}")
    try:
        return _validate(ds_config, strict_when_disabled, world_size)
    except RecursionError:
        raise ConfigError("config", "is nested deeper than Python can follow: not a ds_config") from None


def _validate(ds_config, strict_when_disabled, world_size) -> Optional[Plan]:
    raw = ds_config.get(BLOCK)
    if not strict_when_disabled:
        if raw is None:
            return None
        if isinstance(raw, dict) and raw.get("enabled", False) is False:
            try:
                parse_block(ds_config)
            except ConfigError as e:
                logger.warning(f"[deepspeed-offload] {e} (the block is not enabled: ignored)")
            return None
    offload = parse_block(ds_config) if raw is not None else None
    reject_unfilled_auto(ds_config)
    ds = deepspeed_view(ds_config)
    plan = _cross_check(ds_config, offload, ds) if offload is not None and offload.enabled else None
    run_deepspeed_config(plan.ds_config if plan else ds_config, world_size)
    return plan


def _cross_check(ds_config, offload: OffloadConfig, ds: DeepSpeedView) -> Plan:
    stage = int(ds.zero.stage)
    if stage != 3:
        zero = ds_config.get("zero_optimization")
        raw = zero if isinstance(zero, bool) else get_path(ds_config, "zero_optimization.stage", stage)
        got = f"{stage}" if raw is stage or (raw == stage and not isinstance(raw, bool)) else \
            f"{json.dumps(raw)}, which DeepSpeed reads as {stage}"
        raise ConfigError("zero_optimization.stage",
                          f"optimizer-state offload needs ZeRO stage 3, got {got}: set \"stage\": 3")

    opt_dev = ds.zero.offload_optimizer.device if ds.zero.offload_optimizer is not None else "none"
    if opt_dev in ("cpu", "nvme"):
        alias = " (from the deprecated cpu_offload: true)" if "cpu_offload" in ds_config["zero_optimization"] else ""
        raise ConfigError("zero_optimization.offload_optimizer.device",
                          f"is '{opt_dev}'{alias}: ZeRO-Offload already owns the optimizer state and steps it on the "
                          f"CPU; remove offload_optimizer or set {BLOCK}.enabled to false")

    if offload.async_checkpoint and get_path(ds_config, "checkpoint.use_node_local_storage", False):
        raise ConfigError("checkpoint.use_node_local_storage",
                          f"async checkpoints commit 'latest' once rank 0 sees every rank's files, which node-local "
                          f"storage hides from it: turn one of the two off ({BLOCK}.async_checkpoint)")
    if offload.async_checkpoint:
        for key, on in (("checkpoint.writer", get_path(ds_config, "checkpoint.writer", None) is not None),
                        ("datastates_ckpt.enabled", bool(get_path(ds_config, "datastates_ckpt.enabled", False))),
                        ("nebula.enabled", bool(get_path(ds_config, "nebula.enabled", False)))):
            if on:
                raise ConfigError(key, f"selects another checkpoint engine, which {BLOCK}.async_checkpoint would "
                                  "replace (its files are written from the host store by deepspeed-offload's own "
                                  f"writer): turn one of the two off")
    if offload.overlap_memory_gb is not None and not offload.overlap:
        raise ConfigError(f"{BLOCK}.overlap_memory_gb", f"caps what loads early in backward, which only {BLOCK}.overlap "
                          "does: remove it, or set overlap to true")
    if offload.max_device_memory_gb is not None and offload.memory_budget_gb is not None:
        raise ConfigError(f"{BLOCK}.max_device_memory_gb", "bounds the measured plan, which memory_budget_gb set by "
                          "hand replaces: set one of the two (memory_budget_gb: null lets the plan measure)")

    deepcompile = bool(ds.compile.deepcompile)  # as DeepSpeed reads it: "true" and 1 turn it on too
    mode = offload.mode or ("compile" if deepcompile else "stream")

    if offload.speculate_memory_gb:  # null (derived) is off where speculation cannot run
        if mode == "compile":
            raise ConfigError(f"{BLOCK}.speculate_memory_gb", "speculation runs in stream mode only (under "
                              "DeepCompile, gradients are reduced in buckets its executor flushes when they fill "
                              "or at the end of backward, so no sub-group's gradient is known final sooner): "
                              "set it to 0 or use mode 'stream'")
        if not offload.overlap:
            raise ConfigError(f"{BLOCK}.speculate_memory_gb", "speculation updates sub-groups in backward, "
                              f"where only overlap loads them: set {BLOCK}.overlap to true or this to 0")

    param_dev = ds.zero.offload_param.device if ds.zero.offload_param is not None else "none"
    if mode == "stream" and param_dev == "nvme":
        raise ConfigError("zero_optimization.offload_param.device",
                          "is 'nvme': ZeRO-3 then swaps the 16-bit partitions to NVMe and keeps none on the host "
                          "or device where the streamed step copies each update (fp16_partitioned_groups_flat): "
                          "use 'cpu' or 'none', or leave the block disabled for ZeRO-Infinity")
    if mode == "compile":
        if not deepcompile:
            raise ConfigError(f"{BLOCK}.mode", "is 'compile' but compile.deepcompile is not true: "
                              "turn DeepCompile on, or use mode 'stream'")
        for key in ("offload_opt_states", "offload_parameters", "offload_activation"):
            if getattr(ds.compile, key):
                raise ConfigError(f"compile.{key}", f"conflicts with {BLOCK} in compile mode "
                                  "(both would move the same memory): set it to false")
        if param_dev in ("cpu", "nvme"):
            alias = (" (from the deprecated cpu_offload_param: true)"
                     if "cpu_offload_param" in ds_config["zero_optimization"] else "")
            raise ConfigError("zero_optimization.offload_param.device",
                              f"is '{param_dev}'{alias}: DeepCompile's ZeRO-3 gathers parameters from their "
                              "partitions on the device and moves them to the host only through its own "
                              "compile.offload_parameters, which excludes optimizer-state offload; remove "
                              "offload_param or use mode 'stream' (stream mode accepts it)")
        ok, why = _compile_supported()
        if not ok:
            raise ConfigError(f"{BLOCK}.mode", f"compile mode is not possible here: {why}; or use mode 'stream'")

    user_set = "sub_group_size" in ds.zero.model_fields_set  # "auto" is dropped by DeepSpeed: unset
    sub_group_size = int(ds.zero.sub_group_size) if user_set else offload.sub_group_size
    new_config = dict(ds_config)
    if not user_set:
        new_config["zero_optimization"] = dict(ds_config["zero_optimization"], sub_group_size=sub_group_size)
    else:
        _warn_huge_sub_group(sub_group_size, offload)
    return Plan(offload=offload, mode=mode, ds_config=new_config, sub_group_size=sub_group_size,
                sub_group_size_set_by_us=not user_set)


def _warn_huge_sub_group(sub_group_size: int, offload: OffloadConfig):
    """DeepSpeed's default sub_group_size (1e9, which the Hugging Face templates write out) keeps
    every rank's shard below a billion parameters in one sub-group: nothing to pipeline."""
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    deepspeed_default = DeepSpeedZeroConfig.model_fields["sub_group_size"].default
    if sub_group_size >= deepspeed_default:
        logger.warning(f"[deepspeed-offload] zero_optimization.sub_group_size is {sub_group_size:,} elements "
                       f"(DeepSpeed's default): each staging slot would hold up to "
                       f"{format_bytes(sub_group_size * STATE_BYTES_PER_PARAM)} of state, two of them on the GPU "
                       f"during the step, and a shard under that size is one sub-group with nothing to pipeline. "
                       f"Remove the key (or set it to \"auto\") to use {BLOCK}.sub_group_mb="
                       f"{offload.sub_group_mb} ({offload.sub_group_size:,} elements per sub-group).")
