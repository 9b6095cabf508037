"""``install()``: every ``deepspeed.initialize`` of the process applies the ``optimizer_state_offload`` block.

Frameworks build the DeepSpeed engine themselves: the HF Trainer through Accelerate
(``Accelerator._prepare_deepspeed`` reads ``deepspeed.initialize`` when it runs), Lightning's
``DeepSpeedStrategy`` (``deepspeed.initialize(...)`` through the module). Replacing the attribute on the
``deepspeed`` module therefore reaches them all without touching their code: after ``install()`` such
a call does what ``deepspeed_offload.initialize`` does with the same arguments (the block absent or
disabled: DeepSpeed's own call, untouched; an engine without a ZeRO-3 optimizer or without trainable
parameters: left alone, one log line). It also puts the checkpoint guards of integrations.py on the
frameworks already imported, and on those imported later at their first ``deepspeed.initialize``.

The patch is global to the process and goes through one ``PatchRegistry``; ``uninstall()`` removes
it and the guards (engines already attached keep their offload). Code that bound the function by
name before ``install()`` (``from deepspeed import initialize``) keeps DeepSpeed's own.
"""

import functools
import inspect

import deepspeed
from deepspeed.utils import log_dist

from . import api
from .ds_config import resolve_config_source
from .errors import ConfigError
from .runtime.patches import PatchRegistry

_registry = None  # the PatchRegistry while installed


def install():
    """Make every later ``deepspeed.initialize`` in this process apply the offload block. Idempotent."""
    global _registry
    if _registry is not None:
        return
    registry = PatchRegistry("deepspeed-offload install()")
    registry.patch(deepspeed, "initialize", _offloading_initialize)
    _registry = registry
    from .integrations import guard_frameworks
    guard_frameworks(registry)
    log_dist("[deepspeed-offload] installed: deepspeed.initialize applies the optimizer_state_offload block",
             ranks=[0])


def uninstall():
    """Put ``deepspeed.initialize`` and the framework guards back as they were. Safe to call twice."""
    global _registry
    if _registry is None:
        return
    _registry.remove_all()
    _registry = None


def is_installed() -> bool:
    return _registry is not None


def _offloading_initialize(original):
    signature = inspect.signature(original)

    @functools.wraps(original)
    def initialize(*args, **kwargs):
        if _registry is not None:  # a framework imported since install(): guard its checkpoints too
            from .integrations import guard_frameworks
            guard_frameworks(_registry)
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        call = {}
        for name, value in bound.arguments.items():
            if signature.parameters[name].kind is inspect.Parameter.VAR_KEYWORD:
                call.update(value)
            else:
                call[name] = value
        try:
            source = resolve_config_source(call.get("args"), call.get("config"), call.get("config_params"))
        except ConfigError as e:
            if e.path != "config":
                raise
            return original(*args, **kwargs)  # no ds_config at all: DeepSpeed says what it thinks of that
        return api.build(original, call, source=source)

    setattr(initialize, api.INSTALLED_MARK, True)  # functools.wraps set __wrapped__ = original
    return initialize
