"""A ds_config as Hugging Face's Trainer or Accelerate hands it to DeepSpeed: ``deepspeed-offload check``
reads a framework's config the way the framework launches it.

Both frameworks read the file with ``json.load`` (no comments, no trailing commas: what DeepSpeed's
hjson reader would forgive, they refuse) and replace each ``"auto"`` with a value of their own before
``deepspeed.initialize`` sees it. Their defaults, which a user's arguments override (here: ``--set
KEY=VALUE``): the Trainer's ``TrainingArguments`` (``per_device_train_batch_size`` 8,
``gradient_accumulation_steps`` 1, ``max_grad_norm`` 1.0, ``learning_rate`` 5e-5, ``weight_decay``
0.0, AdamW's betas and eps, bf16 / fp16 off) and Accelerate's ``DeepSpeedPlugin`` (the same clipping
1.0; the batch from its dataloader, which it cannot know before ``prepare``: 1 here unless set). The
``zero_optimization`` sizes that follow the model's ``hidden_size`` (``reduce_bucket_size``,
``stage3_prefetch_bucket_size``, ``stage3_param_persistence_threshold``) are filled from
``--hidden-size`` when given; else DeepSpeed's defaults stand, as DeepSpeed drops an ``"auto"`` in its
own sections.
"""

import copy
import json
from typing import Any, Dict, Iterable, Optional

from .errors import ConfigError
from .preflight import AUTO

FRAMEWORKS = ("hf", "accelerate", "deepspeed")  # deepspeed: no framework, nothing filled
_ADAM = {"lr": 5e-5, "weight_decay": 0.0, "betas": [0.9, 0.999], "eps": 1e-8}
DEFAULTS = {
    "hf": {"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
           "bf16.enabled": False, "fp16.enabled": False, **{f"optimizer.params.{k}": v for k, v in _ADAM.items()},
           "scheduler.params.warmup_min_lr": 0, "scheduler.params.warmup_max_lr": 5e-5,
           "scheduler.params.warmup_num_steps": 0},
    "accelerate": {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
                   "bf16.enabled": False, "fp16.enabled": False,
                   **{f"optimizer.params.{k}": v for k, v in _ADAM.items()}},
}


def has_auto(d: Any) -> bool:
    if isinstance(d, dict):
        return any(has_auto(v) for v in d.values())
    if isinstance(d, list):
        return any(has_auto(v) for v in d)
    return d == AUTO


def strict_json(path: str):
    """Refuse what ``json.load`` refuses (both frameworks read the file with it)."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    try:
        json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(path, f"Hugging Face's Trainer and Accelerate read the ds_config with json.load, which "
                          f"refuses it at line {e.lineno}, column {e.colno}: {e.msg} (DeepSpeed's own reader forgives "
                          "comments and trailing commas; theirs does not)") from None


def parse_set(items: Iterable[str]) -> Dict[str, Any]:
    """``KEY=VALUE`` pairs (a dotted key path; the value as JSON, else as a string)."""
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError("--set", f"{item!r} is not KEY=VALUE (e.g. gradient_clipping=0.5)")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


def fill(ds_config: Dict[str, Any], framework: Optional[str], given: Optional[Dict[str, Any]] = None,
         hidden_size: Optional[int] = None, world_size: int = 1) -> Dict[str, Any]:
    """A copy of ``ds_config`` with every ``"auto"`` replaced as ``framework`` would (``given``: the user's
    arguments, by dotted key path, which also replace values that are not ``"auto"``). Returns it with
    ``filled``: the key paths filled and their values, for the summary line."""
    cfg = copy.deepcopy(ds_config)
    values = dict(DEFAULTS.get(framework, {}))  # (None: only ``given``)
    if hidden_size:
        values.update({"zero_optimization.reduce_bucket_size": hidden_size * hidden_size,
                       "zero_optimization.stage3_prefetch_bucket_size": int(0.9 * hidden_size * hidden_size),
                       "zero_optimization.stage3_param_persistence_threshold": 10 * hidden_size})
    given = given or {}
    filled = {}
    for path, value in list(_leaves(cfg)):
        if value == AUTO and (path in given or path in values):
            _put(cfg, path, given.get(path, values.get(path)))
            filled[path] = given.get(path, values.get(path))
    for path, value in given.items():
        _put(cfg, path, value)
        filled[path] = value
    if cfg.get("train_batch_size") == AUTO or "train_batch_size" in filled:
        cfg["train_batch_size"] = (cfg.get("train_micro_batch_size_per_gpu", 1) *
                                   cfg.get("gradient_accumulation_steps", 1) * world_size)
        filled["train_batch_size"] = cfg["train_batch_size"]
    return cfg, filled


def _leaves(d: Dict[str, Any], prefix: str = ""):
    for k, v in d.items():
        if isinstance(v, dict):
            yield from _leaves(v, f"{prefix}{k}.")
        else:
            yield f"{prefix}{k}", v


def _put(d: Dict[str, Any], path: str, value):
    *parents, last = path.split(".")
    for key in parents:
        d = d.setdefault(key, {})
        if not isinstance(d, dict):
            raise ConfigError("--set", f"{path}: {key} is not a section of the ds_config")
    d[last] = value
