"""The ``optimizer_state_offload`` block of a ds_config, and every check made before DeepSpeed runs.

This module owns two things: the strict pydantic model of the block (unknown keys, wrong types and
negative sizes are errors that name the key path), and the cross-checks of the block against the
rest of the ds_config (ZeRO stage, ZeRO-Offload, DeepCompile). Everything here is pure: it reads
dicts and the installed torch/accelerator, creates no engine, no process group, no pinned memory,
so a rejected configuration leaves nothing behind.
"""

import base64
import json
import os
from typing import Any, Dict, Literal, Optional, Tuple

import hjson
from packaging import version
from pydantic import BaseModel, ConfigDict, Field, ValidationError

BLOCK = "optimizer_state_offload"

# Adam's fp32 master weight plus its two moments: what one parameter costs in the host store.
STATE_BYTES_PER_PARAM = 12

# DeepCompile itself needs torch 2.6 (deepspeed.compile.util.is_deepcompile_supported).
MIN_TORCH_FOR_COMPILE = "2.6"


class ConfigError(ValueError):
    """A configuration that cannot work. ``path`` is the offending ds_config key, dotted."""

    def __init__(self, path: str, reason: str):
        self.path = path
        self.reason = reason
        super().__init__(f"{path}: {reason}")


class OffloadConfig(BaseModel):
    """The ``optimizer_state_offload`` block. Defaults follow DeepSpeed's convention: a block that
    does not say ``enabled: true`` changes nothing."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    enabled: bool = False
    mode: Literal["auto", "stream", "compile"] = "auto"
    sub_group_mb: int = Field(256, gt=0)
    pin_memory: bool = True
    prefetch: bool = True
    memory_budget_gb: Optional[float] = Field(None, ge=0)
    # Stream mode: load sub-groups during backward and write them back during the next forward.
    overlap: bool = True
    # Device memory early loads may hold; null: derived from the previous iteration's peak.
    overlap_memory_gb: Optional[float] = Field(None, ge=0)
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


def _no_duplicate_keys(pairs):
    keys = [k for k, _ in pairs]
    for k in keys:
        if keys.count(k) > 1:
            raise ConfigError(k, "appears twice in one object of the ds_config (DeepSpeed refuses that too)")
    return dict(pairs)


def _parse(text: str, where: str) -> Dict[str, Any]:
    try:
        data = json.loads(text, object_pairs_hook=_no_duplicate_keys)
    except json.JSONDecodeError as strict_err:
        try:  # DeepSpeed reads configs with hjson; strict JSON first, for the clearer position
            data = hjson.loads(text, object_pairs_hook=_no_duplicate_keys)
        except hjson.HjsonDecodeError:
            raise ConfigError(where, f"not valid JSON at line {strict_err.lineno}, column {strict_err.colno}: "
                              f"{strict_err.msg}") from None
    if not isinstance(data, dict):
        raise ConfigError(where, f"a ds_config must be a JSON object, this is a {type(data).__name__}")
    return data


def load_ds_config(config) -> Dict[str, Any]:
    """Read a ds_config the way ``deepspeed.initialize`` accepts it: a dict, a path to a JSON (or
    hjson) file, or a base64-encoded JSON string. A file that does not parse is a ConfigError that
    says where it broke."""
    if isinstance(config, dict):
        return config
    if isinstance(config, (str, os.PathLike)) and os.path.exists(config):
        with open(config, "r") as f:
            return _parse(f.read(), str(config))
    if isinstance(config, str):
        try:
            text = base64.urlsafe_b64decode(config).decode("utf-8")
        except Exception:
            raise ConfigError("config", f"{config!r} is neither an existing file, a dict, nor base64-encoded JSON")
        return _parse(text, "config (base64)")
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


def parse_block(ds_config: Dict[str, Any]) -> OffloadConfig:
    raw = ds_config.get(BLOCK, {})
    if not isinstance(raw, dict):
        raise ConfigError(BLOCK, f"must be an object, got {type(raw).__name__}")
    try:
        return OffloadConfig(**raw)
    except ValidationError as e:
        err = e.errors()[0]
        loc = ".".join(str(p) for p in err["loc"])
        path = f"{BLOCK}.{loc}" if loc else BLOCK
        if err["type"] == "extra_forbidden":
            known = ", ".join(OffloadConfig.model_fields)
            raise ConfigError(path, f"unknown key (known keys: {known})") from None
        raise ConfigError(path, f"{err['msg']} (got {err.get('input')!r})") from None


def _compile_supported() -> Tuple[bool, str]:
    import torch
    from deepspeed.accelerator import get_accelerator
    if version.parse(torch.__version__.split("+")[0]) < version.parse(MIN_TORCH_FOR_COMPILE):
        return False, f"DeepCompile needs torch >= {MIN_TORCH_FOR_COMPILE}, this is {torch.__version__}"
    name = get_accelerator().device_name()
    if name != "cuda":
        return False, f"DeepCompile needs a CUDA accelerator, this one is '{name}'"
    return True, ""


def validate(ds_config: Dict[str, Any], strict_when_disabled: bool = False) -> Optional[Plan]:
    """Check the block and its neighbours. Returns None when offload is off (then the ds_config
    goes to DeepSpeed untouched), else the Plan. Raises ConfigError before anything is changed.

    A block with ``enabled: false`` (or no ``enabled``) changes nothing, so a mistake elsewhere in it
    is only a warning, unless ``strict_when_disabled`` (what ``deepspeed-offload check`` asks for)."""
    raw = ds_config.get(BLOCK)
    if raw is None:
        return None
    if isinstance(raw, dict) and raw.get("enabled", False) is False and not strict_when_disabled:
        try:
            parse_block(ds_config)
        except ConfigError as e:
            from deepspeed.utils import logger
            logger.warning(f"[deepspeed-offload] {e} (the block is not enabled: ignored)")
        return None
    offload = parse_block(ds_config)
    if not offload.enabled:
        return None

    stage = _get(ds_config, "zero_optimization.stage", 0)
    if stage != 3:
        raise ConfigError("zero_optimization.stage",
                          f"optimizer-state offload needs ZeRO stage 3, got {stage}: set \"stage\": 3")

    opt_dev = _get(ds_config, "zero_optimization.offload_optimizer.device", "none")
    if opt_dev in ("cpu", "nvme"):
        raise ConfigError("zero_optimization.offload_optimizer.device",
                          f"is '{opt_dev}': ZeRO-Offload already owns the optimizer state and steps it on the CPU; "
                          f"remove offload_optimizer or set {BLOCK}.enabled to false")

    if offload.async_checkpoint and _get(ds_config, "checkpoint.use_node_local_storage", False):
        raise ConfigError("checkpoint.use_node_local_storage",
                          f"async checkpoints commit 'latest' once rank 0 sees every rank's files, which node-local "
                          f"storage hides from it: turn one of the two off ({BLOCK}.async_checkpoint)")

    deepcompile = _get(ds_config, "compile.deepcompile", False) is True
    mode = offload.mode if offload.mode != "auto" else ("compile" if deepcompile else "stream")

    if mode == "compile":
        if not deepcompile:
            raise ConfigError(f"{BLOCK}.mode", "is 'compile' but compile.deepcompile is not true: "
                              "turn DeepCompile on, or use mode 'stream'")
        for key in ("offload_opt_states", "offload_parameters", "offload_activation"):
            if _get(ds_config, f"compile.{key}", False):
                raise ConfigError(f"compile.{key}", f"conflicts with {BLOCK} in compile mode "
                                  "(both would move the same memory): set it to false")
        param_dev = _get(ds_config, "zero_optimization.offload_param.device", "none")
        if param_dev in ("cpu", "nvme"):
            raise ConfigError("zero_optimization.offload_param.device",
                              f"is '{param_dev}': under DeepCompile this turns on offload_parameters, which "
                              "excludes optimizer-state offload; remove offload_param or use mode 'stream'")
        ok, why = _compile_supported()
        if not ok:
            raise ConfigError(f"{BLOCK}.mode", f"compile mode is not possible here: {why}; use mode 'stream'")

    new_config = dict(ds_config)
    user_sgs = _get(ds_config, "zero_optimization.sub_group_size")
    if user_sgs is None:
        new_config["zero_optimization"] = dict(ds_config["zero_optimization"], sub_group_size=offload.sub_group_size)
    return Plan(offload=offload,
                mode=mode,
                ds_config=new_config,
                sub_group_size=int(user_sgs if user_sgs is not None else offload.sub_group_size),
                sub_group_size_set_by_us=user_sgs is None)


def host_memory_available() -> int:
    """Bytes the host can still give (MemAvailable), the figure the pinned store is checked against."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


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
