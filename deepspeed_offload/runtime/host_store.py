"""The host store: where offloaded optimizer state lives between steps.

One flat host buffer per dtype, allocated at its exact size and page-locked once at attach
(``pinned.py``: no power-of-two rounding, slabs cut at region boundaries). Inside it every offloaded ZeRO-3
sub-group owns one contiguous region per dtype, holding its fp32 master and its optimizer-state
tensors back to back (master first, then state keys in sorted order). A sub-group therefore moves
between host and GPU in one copy per dtype, and a staging slot is laid out like a region.

The store only holds memory and says where each tensor's slice is; which DeepSpeed tensor object
points at it (``.data`` rebinding) is the streamed step's business.
"""

import os
from dataclasses import dataclass
from typing import Dict, List, Tuple

import torch
from deepspeed.accelerator import get_accelerator
from deepspeed.utils import logger

from ..errors import ConfigError
from ..host_memory import BLOCK, HostPlan, check_host_plan, gpu_numa_node, local_ranks
from . import pinned

MASTER = "__master__"


@dataclass(frozen=True)
class Slice:
    """Where one tensor of one sub-group sits, relative to the start of its sub-group's region."""
    key: str  # MASTER or the optimizer-state key
    dtype: torch.dtype
    offset: int  # elements from the start of the region of this dtype
    numel: int


class HostStore:

    def __init__(self, layout: Dict[int, List[Tuple[str, torch.dtype, int]]], pin_memory: bool, budget_gb=None,
                 warn_pageable: bool = True, what: str = f"{BLOCK}.pin_memory"):
        """``layout[sub_group] = [(key, dtype, numel), ...]`` for every sub-group it holds. ``what``:
        the setting a pinning failure names (the block's ``pin_memory``, or ``offload_states``'s)."""
        self.slices: Dict[int, Dict[str, Slice]] = {}
        self.regions: Dict[int, Dict[torch.dtype, Tuple[int, int]]] = {}  # sub_group -> dtype -> (start, numel)
        totals: Dict[torch.dtype, int] = {}
        for sg in sorted(layout):
            self.slices[sg], self.regions[sg] = {}, {}
            entries = sorted(layout[sg], key=lambda e: (e[0] != MASTER, e[0]))
            for key, dtype, numel in entries:
                start, length = self.regions[sg].get(dtype, (totals.get(dtype, 0), 0))
                self.slices[sg][key] = Slice(key, dtype, length, numel)
                self.regions[sg][dtype] = (start, length + numel)
                totals[dtype] = start + length + numel

        size = {dt: torch.empty(0, dtype=dt).element_size() for dt in totals}
        self.nbytes_by_dtype = {dt: n * size[dt] for dt, n in totals.items()}
        self.nbytes = sum(self.nbytes_by_dtype.values())
        # Every rank on this node pins a store of about this size: all of them must fit, checked
        # with the exact bytes before the first byte is pinned.
        check_host_plan(HostPlan(self.nbytes, local_ranks(), budget_gb=budget_gb))
        acc = get_accelerator()
        bounds = {dt: [] for dt in totals}
        for sg in sorted(self.regions):
            for dt, (start, numel) in self.regions[sg].items():
                bounds[dt].append((start * size[dt], (start + numel) * size[dt]))
        node = gpu_numa_node(acc.current_device()) if acc.device_name() == "cuda" else None
        try:
            self.buffers, self.pinning = pinned.allocate(
                totals, bounds, pinned.make_pinner(acc, pin_memory), numa_node=node,
                show_progress=os.environ.get("LOCAL_RANK", "0") == "0",
                fallback=lambda n, dt: acc.pin_empty(n, dtype=dt))
        except RuntimeError as e:
            raise ConfigError(what, f"{e}; or set pin_memory to false (slower copies)") from e
        if warn_pageable and not pin_memory and acc.device_name() != "cpu":
            logger.warning(f"[deepspeed-offload] {BLOCK}.pin_memory is false: pageable host buffers copy at a "
                           "fraction of the link speed, and the step will be slower")

    def region(self, sub_group: int, dtype: torch.dtype) -> torch.Tensor:
        start, numel = self.regions[sub_group][dtype]
        return self.buffers[dtype].narrow(0, start, numel)

    def region_numel(self, sub_group: int) -> Dict[torch.dtype, int]:
        return {dt: n for dt, (_, n) in self.regions[sub_group].items()}

    def view(self, sub_group: int, key: str) -> torch.Tensor:
        s = self.slices[sub_group][key]
        return self.region(sub_group, s.dtype).narrow(0, s.offset, s.numel)
