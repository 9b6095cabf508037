"""The ``DS_OFFLOAD_*`` environment variables, validated the way the ds_config block is.

A job's operator sets these beside the launcher (a checkpoint commit's timeouts, the threads that
pin the host store); a typo must be refused before anything is created, naming the variable, not
surface as a bare ``float()`` error half-way through attach. ``read_env`` is the one reader: the
checkpointer and the host store take their figures from it, and ``validate`` (config.py) calls it,
so ``deepspeed-offload check``, ``initialize`` and ``attach`` reject a bad value before DeepSpeed or
the mode runs.
"""

import math
import os
from typing import Mapping, Optional

from pydantic import BaseModel, ConfigDict, Field

from .errors import ConfigError

PREFIX = "DS_OFFLOAD_"


class EnvSettings(BaseModel):
    """Each field is read from ``DS_OFFLOAD_<FIELD NAME IN CAPITALS>``; unset: the default."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    # Rank 0 waits this long for the other ranks' checkpoint files (a rank alive but never finishing).
    commit_timeout: float = Field(600.0, gt=0, description="seconds")
    # How often a checkpoint writer touches its heartbeat file.
    heartbeat_interval: float = Field(0.5, gt=0, description="seconds")
    # A heartbeat this stale is a dead rank.
    heartbeat_timeout: float = Field(10.0, gt=0, description="seconds")
    # Threads that touch and page-lock the host store at attach (None: up to 8, at most the cores).
    pin_threads: Optional[int] = Field(None, gt=0, description="threads")

    @staticmethod
    def variable(field: str) -> str:
        return PREFIX + field.upper()


def read_env(environ: Mapping[str, str] = os.environ) -> EnvSettings:
    """The settings from ``environ``; a ConfigError naming the variable for a value that is not one."""
    values = {}
    for name, field in EnvSettings.model_fields.items():
        var = EnvSettings.variable(name)
        raw = environ.get(var)
        if raw is None or raw.strip() == "":
            continue
        kind = float if field.annotation is float else int
        unit = field.description
        try:
            value = kind(raw.strip())
        except ValueError:
            raise ConfigError(var, f"must be a {'whole ' if kind is int else ''}number of {unit}, got {raw!r}"
                              f"{' (no unit suffix: seconds are implied)' if unit == 'seconds' else ''}") from None
        if not math.isfinite(value) or value <= 0:
            raise ConfigError(var, f"must be a positive, finite number of {unit}, got {raw!r}")
        values[name] = value
    return EnvSettings(**values)
