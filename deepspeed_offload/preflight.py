"""DeepSpeed's side of the ds_config, checked by DeepSpeed's own models before DeepSpeed runs.

The sections we read (``zero_optimization``, ``compile``, ``bf16``, ``fp16``) go through DeepSpeed's
pydantic models, so aliases and deprecated keys resolve as DeepSpeed resolves them; the whole
ds_config goes through DeepSpeed's ``DeepSpeedConfig`` without a process group, so a value DeepSpeed
would refuse after the process group exists is refused here first, as a ConfigError naming the key.
"""

import copy
import re
from typing import Any, Dict, NamedTuple, Optional

from deepspeed.utils import logger
from pydantic import ValidationError

from .compat import precision_config_builders, removed_config_keys
from .ds_config import get_path
from .errors import BLOCK, ConfigError, pydantic_error

# The HF / Accelerate placeholder, filled in by those frameworks before they call DeepSpeed.
AUTO = "auto"

# DeepSpeed's batch-size keys, checked by its DeepSpeedConfig with the data-parallel world size.
BATCH_KEYS = ("train_micro_batch_size_per_gpu", "train_batch_size", "gradient_accumulation_steps")



class DeepSpeedView(NamedTuple):
    """The sections of the ds_config we read, as DeepSpeed's pydantic models resolve them (aliases,
    deprecated keys, "auto" values dropped, lax types such as "true" or 1e9)."""
    zero: Any  # deepspeed.runtime.zero.config.DeepSpeedZeroConfig
    compile: Any  # deepspeed.compile.config.CompileConfig
    bf16: Any  # None where DeepSpeed has no model for it (compat.precision_config_builders)
    fp16: Any


def _section(ds_config, key, build):
    """Run DeepSpeed's model for one section; its errors become ConfigErrors naming the dotted key."""
    try:
        return build(ds_config)
    except ConfigError:
        raise
    except ValidationError as e:
        err = pydantic_error(e, key)
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
    top_level, zero_keys = removed_config_keys()
    zero = ds_config.get("zero_optimization")
    for prefix, keys, d in (("", top_level, ds_config), ("zero_optimization.", zero_keys, zero)):
        for key, why in keys.items():
            if isinstance(d, dict) and key in d:
                raise ConfigError(f"{prefix}{key}", f"DeepSpeed refuses it: {why}")


def deepspeed_view(ds_config: Dict[str, Any]) -> DeepSpeedView:
    """``zero_optimization``, ``compile``, ``bf16`` and ``fp16`` through DeepSpeed's own models
    (``bf16`` and ``fp16`` are None on a DeepSpeed without models for them: compat.py)."""
    from deepspeed.compile.config import CompileConfig
    from deepspeed.runtime.zero.config import get_zero_config
    _reject_removed_features(ds_config)
    precision = precision_config_builders()

    def zero(d):
        z = d.get("zero_optimization")
        if z is not None and not isinstance(z, (dict, bool)):  # a bool is DeepSpeed's deprecated format
            raise ConfigError("zero_optimization", f"must be an object, got {type(z).__name__} {z!r}")
        return get_zero_config(d)

    def bf16(d):
        key = "bf16" if "bf16" in d else "bfloat16"  # DeepSpeed's old name, read when bf16 is absent
        _dict_section(d, key)
        return precision[0](d)

    return DeepSpeedView(
        zero=_section(ds_config, "zero_optimization", zero),
        compile=_section(ds_config, "compile", lambda d: CompileConfig(**_dict_section(d, "compile"))),
        bf16=None if precision is None else _section(ds_config, "bf16" if "bf16" in ds_config else "bfloat16", bf16),
        fp16=None if precision is None else _section(
            ds_config, "fp16", lambda d: precision[1]({"fp16": _dict_section(d, "fp16")})),
    )


def reject_unfilled_auto(ds_config: Dict[str, Any]):
    """Hugging Face's Trainer and Accelerate replace "auto" values before calling DeepSpeed; DeepSpeed
    itself drops them inside its pydantic sections but takes top-level ones (batch sizes, clipping)
    and optimizer/scheduler params as they are, and fails on them after the process group exists."""
    places = [("", ds_config)]
    for section in ("optimizer", "scheduler"):
        params = get_path(ds_config, f"{section}.params")
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
        raise ConfigError(_guess_section(ds_config, e), f"DeepSpeed refuses it: {pydantic_error(e, '').reason}") \
            from None
    except ds_config_module.DeepSpeedConfigError as e:
        raise ConfigError("ds_config", f"DeepSpeed refuses it: {e}") from None
    except Exception as e:  # DeepSpeed's own checks assert or raise ValueError/TypeError
        raise ConfigError("ds_config", f"DeepSpeed's config check fails: {type(e).__name__}: {e}") from None
    finally:
        logger.setLevel(level)
