"""``initialize`` and ``attach``: the two ways a DeepSpeed user turns optimizer-state offload on
(``install()``, in install.py, makes every ``deepspeed.initialize`` of the process do ``build``).

Both validate first (deepspeed_offload.config), so a rejected configuration creates no engine, no
process group and no pinned memory. Then DeepSpeed builds the engine as usual and ``_attach_mode``
(the single seam between the public API and the two modes) hands it to stream or compile mode.
"""

import copy
import os
import weakref
from typing import Any, Dict

import deepspeed
from deepspeed.constants import TORCH_DISTRIBUTED_DEFAULT_PORT
from deepspeed.utils import log_dist, logger

from .config import Plan, validate
from .ds_config import load_ds_config, resolve_config_source
from .errors import BLOCK
from .sizing.estimate import host_plan
from .handle import HANDLE_ATTR, get_handle
from .sizing.host_memory import check_host_plan

# The attribute install() sets on the deepspeed.initialize it puts in place.
INSTALLED_MARK = "_deepspeed_offload_installed"
_UNRESOLVED = object()


def deepspeed_initialize():
    """DeepSpeed's own ``initialize``: ``deepspeed.initialize``, or, after ``install()`` replaced it,
    the function it wraps. ``initialize`` calls this one, so an engine is never attached twice."""
    fn = deepspeed.initialize
    while getattr(fn, INSTALLED_MARK, False):
        fn = fn.__wrapped__
    return fn
# Every engine of this process with offload attached: what the framework guards (integrations.py)
# wait for before a framework deletes or uploads a checkpoint folder.
_attached = weakref.WeakSet()


def initialize(args=None,
               model=None,
               optimizer=None,
               model_parameters=None,
               training_data=None,
               lr_scheduler=None,
               distributed_port=TORCH_DISTRIBUTED_DEFAULT_PORT,
               mpu=None,
               dist_init_required=None,
               collate_fn=None,
               config=None,
               mesh_param=None,
               config_params=None):
    """Drop-in for ``deepspeed.initialize``: same arguments, same ``(engine, optimizer, loader,
    lr_scheduler)``. With the ``optimizer_state_offload`` block absent or disabled it *is*
    ``deepspeed.initialize``. An engine built without a ZeRO-3 optimizer (no optimizer: inference,
    evaluation, a reference model) or without trainable parameters is returned as DeepSpeed built it,
    with one log line. Calls DeepSpeed's own ``initialize`` even after ``install()``, so an engine is
    never attached twice."""
    return build(deepspeed_initialize(),
                 dict(args=args,
                      model=model,
                      optimizer=optimizer,
                      model_parameters=model_parameters,
                      training_data=training_data,
                      lr_scheduler=lr_scheduler,
                      distributed_port=distributed_port,
                      mpu=mpu,
                      dist_init_required=dist_init_required,
                      collate_fn=collate_fn,
                      config=config,
                      mesh_param=mesh_param,
                      config_params=config_params))


def build(ds_initialize, kwargs: Dict[str, Any], source=_UNRESOLVED):
    """What ``initialize`` does, with DeepSpeed's ``initialize`` given (``install()`` passes the one
    it replaced) and its keyword arguments as a dict (keys this module does not know pass through)."""
    kwargs = dict(kwargs)
    args, config = kwargs.pop("args", None), kwargs.pop("config", None)
    config_params = kwargs.pop("config_params", None)
    if source is _UNRESOLVED:
        source = resolve_config_source(args, config, config_params)
    plan = validate(load_ds_config(source))
    if plan is None:
        return ds_initialize(args=args, config=config, config_params=config_params, **kwargs)
    model = kwargs.get("model")
    builds_optimizer = kwargs.get("optimizer") is not None or "optimizer" in plan.ds_config
    if builds_optimizer:
        _check_host_memory_before_deepspeed(plan, model)

    if args is not None and (getattr(args, "deepspeed_config", None) or getattr(args, "deepscale_config", None)):
        # DeepSpeed refuses a config both in args and config=; ours (with sub_group_size) wins.
        args = copy.copy(args)
        for attr in ("deepspeed_config", "deepscale_config"):
            if hasattr(args, attr):
                setattr(args, attr, None)
    hidden = getattr(getattr(model, "config", None), "hidden_size", None)  # a Hugging Face model says it
    bucket = plan.reduce_bucket_for(hidden)
    result = ds_initialize(args=args, config=plan.with_reduce_bucket(hidden), **kwargs)
    if plan.sub_group_size_set_by_us:
        log_dist(f"[deepspeed-offload] zero_optimization.sub_group_size unset: using {plan.sub_group_size} "
                 f"elements ({BLOCK}.sub_group_mb={plan.offload.sub_group_mb})", ranks=[0])
    if bucket is not None:
        why = "hidden_size**2, what HF's 'auto' fills in" if bucket == hidden * hidden else \
            f"one sub-group, {plan.sub_group_size:,} elements"
        log_dist(f"[deepspeed-offload] zero_optimization.reduce_bucket_size unset: using {bucket:,} elements "
                 f"({why}; DeepSpeed's 500,000,000 would make gradients final a bucket at a time and speculated "
                 "updates start late in backward, a smaller bucket only adds reductions)", ranks=[0])
    _attach_if_trainable(result[0], plan)
    return result


def _attach_if_trainable(engine, plan: Plan):
    """Attach ``engine`` unless there is no optimizer state to offload; say which, once."""
    opt = engine.optimizer
    if not getattr(opt, "fp32_partitioned_groups_flat", None):
        why = (f"it has no ZeRO-3 optimizer ({type(opt).__name__ if opt is not None else 'none'}): built "
               "without an optimizer, as for inference, evaluation or a reference model")
    elif not any(p.requires_grad for p in engine.module.parameters()):
        why = "it has no trainable parameters"
    else:
        return _attach_mode(engine, plan)
    log_dist(f"[deepspeed-offload] {BLOCK}: engine left as DeepSpeed built it, {why}", ranks=[0])
    return None


def _check_host_memory_before_deepspeed(plan: Plan, model):
    """The host stores of this node's ranks, and what DeepSpeed pins itself, must fit: say so before
    DeepSpeed builds anything. (Attach judges each node again, once, with the exact bytes, before
    anything is pinned.)"""
    if model is None:
        return
    params = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters() if p.requires_grad)
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    host_first = plan.mode == "stream" and plan.offload.memory_budget_gb is None
    check_host_plan(host_plan(params, world, budget_gb=plan.offload.memory_budget_gb, ds_config=plan.ds_config,
                              speculate_gb=plan.offload.speculate_memory_gb, host_first=host_first))


def attach(engine, config=None):
    """Turn offload on for an engine that already exists, from its own ds_config (or ``config``).
    Returns the mode's handle, or None when the block is absent or disabled."""
    ds_config = load_ds_config(config) if config is not None else engine._config._param_dict
    plan = validate(ds_config)
    if plan is None:
        logger.info(f"[deepspeed-offload] {BLOCK} is absent or disabled: engine left as it is")
        return None
    return _attach_mode(engine, plan)


def _attach_mode(engine, plan: Plan):
    """Attach ``plan``'s mode to ``engine``: on every rank, or, when anything fails on any rank, on none
    (runtime/attach.py), every rank raising."""
    from .runtime.attach import attach_mode

    def build(placement, prepared):
        if plan.mode == "stream":
            from .runtime.step.stream import StreamMode
            return StreamMode(engine, plan.offload, placement, prepared.probe)
        from .compile_passes import attach_compile
        return attach_compile(engine, plan.offload, placement, prepared.probe)

    check = None
    if plan.mode == "compile":
        from .compile_passes import check_engine as check
    handle = attach_mode(engine, plan, build, check)
    setattr(engine, HANDLE_ATTR, handle)
    _attached.add(engine)
    return handle


def attached_engines():
    """The engines of this process that have offload attached (alive ones)."""
    return list(_attached)
