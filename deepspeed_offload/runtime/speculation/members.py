"""Who speculates: every offloaded sub-group, and which of them get a second host region.

Second regions go to the sub-groups whose gradients are final first (the last layers), within
``speculate_memory_gb`` of host memory per rank, chosen at attach; the others roll back from a copy
on the device. Nothing speculates where nothing loads in backward or the parameters are fp32 (the
16-bit partition is the master itself).
"""

import logging
from typing import List, Tuple

from deepspeed.utils import log_dist

from ...sizing.host_memory import format_bytes
from ..memory.layout import fitting_prefix


def choose_members(mode, early_in_backward: bool, budget: int) -> Tuple[List[int], List[int]]:
    """The sub-groups of stream mode ``mode`` that speculate (every offloaded one), and those of them
    with a second host region: the last ones (their gradients are final first) whose second regions
    fit ``budget`` bytes. None where nothing loads in backward or the 16-bit partition is the master
    itself (fp32)."""
    cfg, opt = mode.cfg, mode.opt
    if cfg.speculate_memory_gb == 0 or not (cfg.overlap and early_in_backward) or not mode.order:
        return [], []
    if any(opt.fp16_partitioned_groups_flat[i].dtype == opt.fp32_partitioned_groups_flat[i].dtype for i in mode.order):
        log_dist("[deepspeed-offload] speculation off: the parameters are fp32", ranks=[0])
        return [], []
    members = sorted(mode.order, reverse=True)
    twins = fitting_prefix(members, mode.layout.nbytes.__getitem__, budget)
    if not twins:
        log_dist(f"[deepspeed-offload] speculation: no host memory is spare for second regions "
                 f"({format_bytes(budget)} per rank after the stores; the node's line says what it can give): "
                 "every update in backward rolls back from a copy on the device, where backward leaves room "
                 "for it", ranks=[0])
    return members, twins


def describe(spec) -> str:
    """Who speculates, and what each rolls back from."""
    store = spec.mode.store
    twins = len(spec.members) - len(spec.from_device)
    out = (f"{len(spec.members)} sub-groups speculate: {twins} with second host regions "
           f"({format_bytes(store.twin_nbytes)})")
    if spec.from_device:
        out += (f", {len(spec.from_device)} rolled back from a copy on the device, where backward leaves "
                "room for it")
    return out


def log_attach(spec):
    """The attach line of speculation, and a warning where the reduce bucket makes updates start late."""
    if not spec.members:
        return
    log_dist(f"[deepspeed-offload] speculation: {describe(spec)}", ranks=[0])
    bucket = getattr(spec.opt, "reduce_bucket_size", 0)
    largest = spec.grad_numel
    if bucket > 4 * largest:
        # WARNING, like DeepSpeed's own advice on its settings: it costs speed, not correctness
        log_dist(f"[deepspeed-offload] speculation: zero_optimization.reduce_bucket_size is {bucket:,} "
                 f"elements, {bucket // max(largest, 1)} sub-groups' worth: gradients become final a bucket at "
                 "a time, so updates start late in backward; a bucket of about one sub-group (what "
                 "initialize picks where it is unset) lets them start sooner", ranks=[0], level=logging.WARNING)
