"""The ``optimizer_state_offload`` block of a ds_config, and every check made before DeepSpeed runs.

This module owns the one validation path that ``deepspeed_offload.initialize``, ``attach`` and
``deepspeed-offload check`` share (``load_ds_config`` then ``validate``): reading the file, the
strict pydantic model of the block (unknown keys, wrong types, non-finite or negative sizes are
errors that name the key path), DeepSpeed's own config models for the sections we read (so a value
DeepSpeed would refuse after the process group exists is refused here first, and DeepSpeed's
deprecated aliases such as ``cpu_offload`` are resolved as DeepSpeed resolves them), and the
cross-checks of the block against the rest of the ds_config (ZeRO stage, ZeRO-Offload, DeepCompile).
Everything here is pure: it reads dicts and the installed torch/accelerator, creates no engine, no
process group, no pinned memory, so a rejected configuration leaves nothing behind.
"""

import base64
import binascii
import copy
import json
import os
import re
from typing import Any, Dict, Literal, NamedTuple, Optional, Tuple

import hjson
from deepspeed.utils import logger
from packaging import version
from pydantic import BaseModel, ConfigDict, Field, ValidationError

BLOCK = "optimizer_state_offload"

# Adam's fp32 master weight plus its two moments: what one parameter costs in the host store.
STATE_BYTES_PER_PARAM = 12


def state_bytes_per_rank(params: int, world: int) -> int:
    """The optimizer state one of ``world`` ZeRO-3 ranks holds for ``params`` parameters."""
    return -(-params // world) * STATE_BYTES_PER_PARAM


# Each way, both directions busy, summed over the ranks of one node: 2 ranks on a 2-GPU H200 host
# each got 36.4 GB/s when both streamed at once, against 47.4-48.9 alone (docs/benchmarks.md).
HOST_BANDWIDTH_GBPS = 72.9


def estimate(params, world_size, ranks_per_node, bandwidth, host_bandwidth=HOST_BANDWIDTH_GBPS, sub_group_mb=256,
             budget_gb=0.0) -> dict:
    """What offload frees and costs per rank and per node (bytes, GB/s, seconds): ``params`` over
    ``world_size`` ranks, ``ranks_per_node`` of them sharing a host whose memory gives
    ``host_bandwidth`` GB/s each way in all, each rank's link ``bandwidth`` GB/s each way; the part of
    the state under ``budget_gb`` stays resident (None: derived at attach, taken as 0 here)."""
    per_rank = state_bytes_per_rank(params, world_size)
    resident = 0 if budget_gb is None else min(per_rank, int(budget_gb * 2**30))
    offloaded = per_rank - resident
    slot = min(offloaded, sub_group_mb * 2**20)
    # Every rank of the node copies at once: each gets its own link's bandwidth until their sum
    # reaches what the host's memory gives all of them together.
    per_rank_bw = min(bandwidth, host_bandwidth / ranks_per_node)
    # Loads and write-backs overlap, both directions at once; the first load and the last
    # write-back of the step have nothing to overlap with.
    step = offloaded / (per_rank_bw * 1e9) + slot / (per_rank_bw * 1e9)
    return {"state_per_rank": per_rank, "resident_per_rank": resident, "gpu_freed_per_rank": offloaded,
            "staging_during_step": 2 * slot, "host_pinned_per_node": offloaded * ranks_per_node,
            "bandwidth_GBps": bandwidth, "host_bandwidth_GBps": host_bandwidth, "bandwidth_per_rank_GBps": per_rank_bw,
            "step_copy_s": step}


# DeepCompile itself needs torch 2.6 (deepspeed.compile.util.is_deepcompile_supported).
MIN_TORCH_FOR_COMPILE = "2.6"

# Upper bounds that keep every derived byte count a finite number: 1 PiB of GPU memory, 1 TiB slots.
MAX_GB = 2**20
MAX_SUB_GROUP_MB = 2**20

# The HF / Accelerate placeholder, filled in by those frameworks before they call DeepSpeed.
AUTO = "auto"

# DeepSpeed's batch-size keys, checked by its DeepSpeedConfig with the data-parallel world size.
BATCH_KEYS = ("train_micro_batch_size_per_gpu", "train_batch_size", "gradient_accumulation_steps")


class ConfigError(ValueError):
    """A configuration that cannot work. ``path`` is the offending ds_config key, dotted."""

    def __init__(self, path: str, reason: str):
        self.path = path
        self.reason = reason
        super().__init__(f"{path}: {reason}")

    def __reduce__(self):
        # Rebuilt from (path, reason), so it crosses process boundaries (multiprocessing, pickle).
        return type(self), (self.path, self.reason)


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
    memory_budget_gb: Optional[float] = _gib_field()
    # Stream mode: load sub-groups during the last backward, as it frees memory, ahead of the step.
    overlap: bool = True
    # Device memory early loads may hold; null: derived from the peak measured since attach.
    overlap_memory_gb: Optional[float] = _gib_field()
    async_checkpoint: bool = False

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


# ---------------------------------------------------------------------------------------------
# Reading a ds_config


def _no_duplicate_keys(pairs):
    keys = [k for k, _ in pairs]
    for k in keys:
        if keys.count(k) > 1:
            raise ConfigError(k, "appears twice in one object of the ds_config (DeepSpeed refuses that too)")
    return dict(pairs)


def _parse(text: str, where: str) -> Dict[str, Any]:
    if not text.strip():
        raise ConfigError(where, "is empty: a ds_config is a JSON object, e.g. {\"train_micro_batch_size_per_gpu\": 1, "
                          "\"zero_optimization\": {\"stage\": 3}}")
    try:
        try:
            data = json.loads(text, object_pairs_hook=_no_duplicate_keys)
        except json.JSONDecodeError as strict_err:
            bad_json = ConfigError(where, f"not valid JSON at line {strict_err.lineno}, column {strict_err.colno}: "
                                   f"{strict_err.msg}")
            try:  # DeepSpeed reads configs with hjson (comments, unquoted keys): strict JSON first, for the position
                data = hjson.loads(text, object_pairs_hook=_no_duplicate_keys)
            except hjson.HjsonDecodeError:
                raise bad_json from None
            if not isinstance(data, dict):  # hjson reads any bare text as a string: report it as the JSON it is not
                raise bad_json from None
    except RecursionError:
        raise ConfigError(where, "is nested deeper than Python's parser can follow: not a ds_config") from None
    if not isinstance(data, dict):
        raise ConfigError(where, f"a ds_config must be a JSON object, this is a {type(data).__name__}")
    return data


def _read_file(path) -> Dict[str, Any]:
    where = os.fspath(path)
    if os.path.isdir(path):
        raise ConfigError(where, "is a directory: give the path of the ds_config JSON file")
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise ConfigError(where, f"cannot be read: {e.strerror or e}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(where, f"is not UTF-8 text (byte {e.start}: {raw[e.start:e.start + 1]!r}): "
                          "a ds_config is a JSON file") from None
    return _parse(text, where)


def load_ds_config(config) -> Dict[str, Any]:
    """Read a ds_config the way ``deepspeed.initialize`` accepts it: a dict, a path to a JSON (or
    hjson) file, or a base64-encoded JSON string. A file that cannot be read or does not parse is a
    ConfigError that says why (and where it broke)."""
    if isinstance(config, dict):
        return config
    if isinstance(config, (str, os.PathLike)) and os.path.exists(config):
        return _read_file(config)
    if isinstance(config, str):
        try:
            text = base64.urlsafe_b64decode(config).decode("utf-8")
            return _parse(text, "config (base64)")
        except (binascii.Error, ValueError):  # UnicodeDecodeError and ConfigError are ValueErrors
            raise ConfigError("config", f"{config!r} is neither an existing file, a dict, nor base64-encoded "
                              "JSON") from None
    raise ConfigError("config", f"expected a dict, a path to a JSON file or base64 JSON, got {type(config).__name__}")


def resolve_config_source(args=None, config=None, config_params=None):
    """Pick the ds_config among ``deepspeed.initialize``'s three routes, with its precedence."""
    if config is None and config_params is not None:
        config = config_params
    for attr in ("deepspeed_config", "deepscale_config"):
        value = getattr(args, attr, None)
        if value is not None:
            if config is not None:
                raise ConfigError(f"args.{attr}", "a ds_config was given both in args and as config=; pass one")
            config = value
    if config is None:
        raise ConfigError("config", "no ds_config given: pass config= or --deepspeed_config")
    return config


def _get(d: Dict[str, Any], path: str, default=None):
    for key in path.split("."):
        if not isinstance(d, dict) or key not in d:
            return default
        d = d[key]
    return d


# ---------------------------------------------------------------------------------------------
# Our block


def _pydantic_error(err: ValidationError, prefix: str) -> ConfigError:
    e = err.errors()[0]
    loc = ".".join(str(p) for p in e["loc"])
    path = ".".join(p for p in (prefix, loc) if p)
    msg = e["msg"]
    if "input" in e and not isinstance(e["input"], (dict, list)):
        msg += f" (got {e['input']!r})"
    return ConfigError(path, msg)


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
        raise _pydantic_error(e, BLOCK) from None


# ---------------------------------------------------------------------------------------------
# DeepSpeed's side of the ds_config, read by DeepSpeed's own models


class DeepSpeedView(NamedTuple):
    """The sections of the ds_config we read, as DeepSpeed's pydantic models resolve them (aliases,
    deprecated keys, "auto" values dropped, lax types such as "true" or 1e9)."""
    zero: Any  # deepspeed.runtime.zero.config.DeepSpeedZeroConfig
    compile: Any  # deepspeed.compile.config.CompileConfig
    bf16: Any
    fp16: Any


def _section(ds_config, key, build):
    """Run DeepSpeed's model for one section; its errors become ConfigErrors naming the dotted key."""
    try:
        return build(ds_config)
    except ConfigError:
        raise
    except ValidationError as e:
        err = _pydantic_error(e, key)
        if e.errors()[0]["type"].startswith("int_") and isinstance(e.errors()[0].get("input"), str):
            err = ConfigError(err.path, f"{err.reason}: DeepSpeed reads an integer here, write the number "
                              "without quotes")
        raise err from None
    except (AssertionError, ValueError, TypeError) as e:
        # DeepSpeed's deprecated-field handling asserts ("Cannot provide deprecated parameter 'x' and ...").
        named = re.search(r"parameter '(\w+)'", str(e))
        raise ConfigError(f"{key}.{named.group(1)}" if named else key,
                          f"DeepSpeed refuses it: {e or type(e).__name__}") from None


def _dict_section(ds_config, key):
    value = ds_config.get(key, {})
    if not isinstance(value, dict):
        raise ConfigError(key, f"must be an object, got {type(value).__name__} {value!r}")
    return value


def _reject_removed_features(ds_config: Dict[str, Any]):
    """DeepSpeedConfig's first check: blocks and ZeRO keys of features DeepSpeed has removed."""
    from deepspeed.runtime import config as ds_config_module
    zero = ds_config.get("zero_optimization")
    for prefix, keys, d in (("", "_REMOVED_TOP_LEVEL_CONFIG_KEYS", ds_config),
                            ("zero_optimization.", "_REMOVED_ZERO_CONFIG_KEYS", zero)):
        for key, why in getattr(ds_config_module, keys, {}).items():
            if isinstance(d, dict) and key in d:
                raise ConfigError(f"{prefix}{key}", f"DeepSpeed refuses it: {why}")


def deepspeed_view(ds_config: Dict[str, Any]) -> DeepSpeedView:
    """``zero_optimization``, ``compile``, ``bf16`` and ``fp16`` through DeepSpeed's own models."""
    from deepspeed.compile.config import CompileConfig
    from deepspeed.runtime.precision_config import get_bfloat16_config, get_float16_config
    from deepspeed.runtime.zero.config import get_zero_config
    _reject_removed_features(ds_config)

    def zero(d):
        z = d.get("zero_optimization")
        if z is not None and not isinstance(z, (dict, bool)):  # a bool is DeepSpeed's deprecated format
            raise ConfigError("zero_optimization", f"must be an object, got {type(z).__name__} {z!r}")
        return get_zero_config(d)

    def bf16(d):
        key = "bf16" if "bf16" in d else "bfloat16"  # DeepSpeed's old name, read when bf16 is absent
        _dict_section(d, key)
        return get_bfloat16_config(d)

    return DeepSpeedView(
        zero=_section(ds_config, "zero_optimization", zero),
        compile=_section(ds_config, "compile", lambda d: CompileConfig(**_dict_section(d, "compile"))),
        bf16=_section(ds_config, "bf16" if "bf16" in ds_config else "bfloat16", bf16),
        fp16=_section(ds_config, "fp16", lambda d: get_float16_config({"fp16": _dict_section(d, "fp16")})),
    )


def _reject_unfilled_auto(ds_config: Dict[str, Any]):
    """Hugging Face's Trainer and Accelerate replace "auto" values before calling DeepSpeed; DeepSpeed
    itself drops them inside its pydantic sections but takes top-level ones (batch sizes, clipping)
    and optimizer/scheduler params as they are, and fails on them after the process group exists."""
    places = [("", ds_config)]
    for section in ("optimizer", "scheduler"):
        params = _get(ds_config, f"{section}.params")
        if isinstance(params, dict):
            places.append((f"{section}.params.", params))
    for prefix, d in places:
        for key, value in d.items():
            if isinstance(value, str) and value == AUTO and key != BLOCK:
                raise ConfigError(f"{prefix}{key}", "is \"auto\": Hugging Face's Trainer and Accelerate fill that in "
                                  "before they call DeepSpeed, deepspeed.initialize does not: set a value")


def _is_positive_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v > 0


def _batch_key(ds_config) -> str:
    for key in BATCH_KEYS:
        if key in ds_config and not _is_positive_int(ds_config[key]):
            return key
    if not any(k in ds_config for k in BATCH_KEYS[:2]):
        return BATCH_KEYS[0]
    return "train_batch_size"


_preflight_class = None


def _deepspeed_config_class():
    """DeepSpeed's DeepSpeedConfig, run without a process group: its batch-size check gets the
    data-parallel world size we know (or, unknown, the one the batch sizes imply, else 1), instead of
    the 1 it falls back to."""
    global _preflight_class
    if _preflight_class is None:
        from deepspeed.runtime.config import DeepSpeedConfig

        class PreflightConfig(DeepSpeedConfig):

            def __init__(self, config, world_size):
                self._preflight_world_size = world_size
                super().__init__(config)

            def _configure_train_batch_size(self):
                world = self._preflight_world_size
                if world is None:
                    tb, mb, ga = self.train_batch_size, self.train_micro_batch_size_per_gpu, \
                        self.gradient_accumulation_steps
                    world = 1
                    if all(_is_positive_int(v) for v in (tb, mb, ga)) and tb % (mb * ga) == 0 and tb >= mb * ga:
                        world = tb // (mb * ga)
                self.world_size = world
                try:
                    super()._configure_train_batch_size()
                except (AssertionError, TypeError, ValueError, ZeroDivisionError) as e:
                    on = (f" with data-parallel world size {world}" if self._preflight_world_size else
                          " whatever the world size")
                    raise ConfigError(_batch_key(self._param_dict),
                                      f"DeepSpeed's batch-size check fails{on}: {e or type(e).__name__}") from None

        _preflight_class = PreflightConfig
    return _preflight_class


def _guess_section(ds_config, err: ValidationError) -> str:
    loc = [str(p) for p in err.errors()[0]["loc"]]
    owners = [k for k, v in ds_config.items() if isinstance(v, dict) and loc and loc[0] in v]
    if len(owners) == 1:
        return ".".join([owners[0]] + loc)
    return ".".join([err.title] + loc)


def run_deepspeed_config(ds_config: Dict[str, Any], world_size: Optional[int] = None):
    """Build DeepSpeed's DeepSpeedConfig from ``ds_config`` as ``deepspeed.initialize`` will, minus
    the process group; whatever it refuses becomes a ConfigError. Its log lines are held back (it
    logs them again when it runs for real)."""
    import logging
    from deepspeed.runtime import config as ds_config_module

    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        _deepspeed_config_class()(copy.deepcopy(ds_config), world_size)
    except (ConfigError, RecursionError):
        raise
    except ValidationError as e:
        raise ConfigError(_guess_section(ds_config, e), f"DeepSpeed refuses it: {_pydantic_error(e, '').reason}") \
            from None
    except ds_config_module.DeepSpeedConfigError as e:
        raise ConfigError("ds_config", f"DeepSpeed refuses it: {e}") from None
    except Exception as e:  # DeepSpeed's own checks assert or raise ValueError/TypeError
        raise ConfigError("ds_config", f"DeepSpeed's config check fails: {type(e).__name__}: {e}") from None
    finally:
        logger.setLevel(level)


# ---------------------------------------------------------------------------------------------
# The block against the rest


def _compile_supported() -> Tuple[bool, str]:
    import torch
    from deepspeed.accelerator import get_accelerator
    if version.parse(torch.__version__.split("+")[0]) < version.parse(MIN_TORCH_FOR_COMPILE):
        return False, f"DeepCompile needs torch >= {MIN_TORCH_FOR_COMPILE}, this is {torch.__version__}"
    name = get_accelerator().device_name()
    if name != "cuda":
        return False, f"DeepCompile needs a CUDA accelerator, this one is '{name}'"
    return True, ""


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
    _reject_unfilled_auto(ds_config)
    ds = deepspeed_view(ds_config)
    plan = _cross_check(ds_config, offload, ds) if offload is not None and offload.enabled else None
    run_deepspeed_config(plan.ds_config if plan else ds_config, world_size)
    return plan


def _cross_check(ds_config, offload: OffloadConfig, ds: DeepSpeedView) -> Plan:
    stage = int(ds.zero.stage)
    if stage != 3:
        zero = ds_config.get("zero_optimization")
        raw = zero if isinstance(zero, bool) else _get(ds_config, "zero_optimization.stage", stage)
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

    if offload.async_checkpoint and _get(ds_config, "checkpoint.use_node_local_storage", False):
        raise ConfigError("checkpoint.use_node_local_storage",
                          f"async checkpoints commit 'latest' once rank 0 sees every rank's files, which node-local "
                          f"storage hides from it: turn one of the two off ({BLOCK}.async_checkpoint)")

    deepcompile = bool(ds.compile.deepcompile)  # as DeepSpeed reads it: "true" and 1 turn it on too
    mode = offload.mode or ("compile" if deepcompile else "stream")

    if mode == "compile":
        if not deepcompile:
            raise ConfigError(f"{BLOCK}.mode", "is 'compile' but compile.deepcompile is not true: "
                              "turn DeepCompile on, or use mode 'stream'")
        for key in ("offload_opt_states", "offload_parameters", "offload_activation"):
            if getattr(ds.compile, key):
                raise ConfigError(f"compile.{key}", f"conflicts with {BLOCK} in compile mode "
                                  "(both would move the same memory): set it to false")
        param_dev = ds.zero.offload_param.device if ds.zero.offload_param is not None else "none"
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
            raise ConfigError(f"{BLOCK}.mode", f"compile mode is not possible here: {why}; use mode 'stream'")

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


def meminfo(key: str) -> Optional[int]:
    """One /proc/meminfo figure in bytes (``MemTotal``, ``MemAvailable``); None where there is none."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def host_memory_available() -> int:
    """Bytes the host can still give (MemAvailable), the figure the pinned store is checked against."""
    available = meminfo("MemAvailable")
    return available if available is not None else os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def format_bytes(n: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


def local_ranks() -> int:
    """Ranks of this job on this node (the launcher's LOCAL_WORLD_SIZE), whose stores share its memory."""
    for var in ("LOCAL_WORLD_SIZE", "LOCAL_SIZE"):
        if os.environ.get(var, "").isdigit():
            return max(1, int(os.environ[var]))
    return 1


def check_host_memory(needed: int, available: Optional[int] = None, what: str = "the pinned host store"):
    available = host_memory_available() if available is None else available
    if needed > available:
        raise ConfigError(f"{BLOCK}.enabled",
                          f"{what} needs {format_bytes(needed)} of host memory but only {format_bytes(available)} "
                          "is available: free host memory, spread the job over more nodes, or disable offload")
