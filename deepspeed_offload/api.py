"""``initialize`` and ``attach``: the two ways a DeepSpeed user turns optimizer-state offload on.

Both validate first (deepspeed_offload.config), so a rejected configuration creates no engine, no
process group and no pinned memory. Then DeepSpeed builds the engine as usual and ``_attach_mode``
(the single seam between the public API and the two modes) hands it to stream or compile mode.
"""

import copy
import os

import deepspeed
from deepspeed.constants import TORCH_DISTRIBUTED_DEFAULT_PORT
from deepspeed.utils import logger
from deepspeed.utils.logging import print_dist

from .config import (BLOCK, STATE_BYTES_PER_PARAM, ConfigError, Plan, check_host_memory, load_ds_config, local_ranks,
                     resolve_config_source, validate)

HANDLE_ATTR = "_deepspeed_offload"


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
    ``deepspeed.initialize``."""
    passthrough = dict(args=args,
                       model=model,
                       optimizer=optimizer,
                       model_parameters=model_parameters,
                       training_data=training_data,
                       lr_scheduler=lr_scheduler,
                       distributed_port=distributed_port,
                       mpu=mpu,
                       dist_init_required=dist_init_required,
                       collate_fn=collate_fn,
                       mesh_param=mesh_param)
    source = resolve_config_source(args, config, config_params)
    plan = validate(load_ds_config(source))
    if plan is None:
        return deepspeed.initialize(config=config, config_params=config_params, **passthrough)
    _check_host_memory_before_deepspeed(plan, model)

    if args is not None and (getattr(args, "deepspeed_config", None) or getattr(args, "deepscale_config", None)):
        # DeepSpeed refuses a config both in args and config=; ours (with sub_group_size) wins.
        args = copy.copy(args)
        for attr in ("deepspeed_config", "deepscale_config"):
            if hasattr(args, attr):
                setattr(args, attr, None)
        passthrough["args"] = args
    result = deepspeed.initialize(config=plan.ds_config, **passthrough)
    if plan.sub_group_size_set_by_us:
        print_dist(f"[deepspeed-offload] zero_optimization.sub_group_size unset: using {plan.sub_group_size} "
                   f"elements ({BLOCK}.sub_group_mb={plan.offload.sub_group_mb})", ranks=[0])
    _attach_mode(result[0], plan)
    return result


def _check_host_memory_before_deepspeed(plan: Plan, model):
    """The host stores of this node's ranks must fit: say so before DeepSpeed builds anything.
    (The store checks again, exactly, before it pins.)"""
    if model is None:
        return
    params = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters() if p.requires_grad)
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    per_rank = -(-params // world) * STATE_BYTES_PER_PARAM
    budget = plan.offload.memory_budget_gb
    if budget:
        per_rank = max(0, per_rank - int(budget * 2**30))
    ranks = local_ranks()
    check_host_memory(per_rank * ranks, what=f"the pinned host stores of {ranks} rank(s) on this node")


def attach(engine, config=None):
    """Turn offload on for an engine that already exists, from its own ds_config (or ``config``).
    Returns the mode's handle, or None when the block is absent or disabled."""
    ds_config = load_ds_config(config) if config is not None else engine._config._param_dict
    plan = validate(ds_config)
    if plan is None:
        logger.info(f"[deepspeed-offload] {BLOCK} is absent or disabled: engine left as it is")
        return None
    return _attach_mode(engine, plan)


def get_handle(engine):
    """The stream/compile mode object attached to ``engine`` (stats, counters), or None."""
    return getattr(engine, HANDLE_ATTR, None)


def _check_engine(engine, plan: Plan):
    if getattr(engine, HANDLE_ATTR, None) is not None:
        raise ConfigError(BLOCK, "this engine already has optimizer-state offload attached")
    if engine.zero_optimization_stage() != 3:
        raise ConfigError("zero_optimization.stage",
                          f"the engine runs ZeRO stage {engine.zero_optimization_stage()}; offload needs stage 3")
    opt = engine.optimizer
    if not hasattr(opt, "fp32_partitioned_groups_flat"):
        raise ConfigError("zero_optimization.stage", f"the engine's optimizer ({type(opt).__name__}) is not "
                          "DeepSpeed's ZeRO-3 optimizer: build the engine with an optimizer")
    if getattr(opt, "use_muon", False):
        raise ConfigError("optimizer.type", "ZeRO-3's Muon path reads and writes the fp32 state outside the "
                          "sub-group loop that offload streams: use an Adam-family optimizer")
    if getattr(opt, "offload_optimizer", False) or getattr(opt, "swap_optimizer", False):
        raise ConfigError("zero_optimization.offload_optimizer.device",
                          "the engine already uses ZeRO-Offload for the optimizer state; rebuild it without")
    if plan.mode == "compile" and engine.is_compiled:
        raise ConfigError(f"{BLOCK}.mode", "the engine is already compiled: attach compile mode before "
                          "engine.compile(), or use deepspeed_offload.initialize")
    if len(opt.fp16_groups) == 1:
        logger.warning("[deepspeed-offload] the engine has a single ZeRO-3 sub-group: nothing to pipeline, the "
                       "whole state passes through the GPU at once. Set zero_optimization.sub_group_size "
                       "(or leave it unset and use deepspeed_offload.initialize).")


def _attach_mode(engine, plan: Plan):
    _check_engine(engine, plan)
    if plan.mode == "stream":
        from .runtime.stream import StreamMode
        handle = StreamMode(engine, plan.offload)
    else:
        from .compile_passes import attach_compile
        handle = attach_compile(engine, plan.offload)
    setattr(engine, HANDLE_ATTR, handle)
    return handle
