"""The host store: where offloaded optimizer state lives between steps.

One flat host buffer per dtype, allocated at its exact size and page-locked once at attach
(``pinned.py``: no power-of-two rounding, slabs cut at region boundaries). Inside it every offloaded ZeRO-3
sub-group owns one contiguous region per dtype, holding its fp32 master and its optimizer-state
tensors back to back (master first, then state keys in sorted order). A sub-group therefore moves
between host and GPU in one copy per dtype, and a staging slot is laid out like a region.

The store only holds memory and says where each tensor's slice is; which DeepSpeed tensor object
points at it (``.data`` rebinding) is the streamed step's business.

Sub-groups that speculate (``runtime/speculation/updates.py``) have a second region per dtype, ``twins``:
an update computed before the gradient norm is known is written into the side that is not current,
and committing it is ``flip`` (that side becomes current: nothing is copied); a rollback leaves
the current side as it was. ``region``/``view`` always name the current side unless asked for the
``other`` one, so every reader (loads, checkpoints, ``state_dict``) sees the committed state.
"""

import bisect
import os
from dataclasses import dataclass
from typing import Dict, Iterable, List, Optional, Set, Tuple

import torch
from deepspeed.accelerator import get_accelerator
from deepspeed.utils import logger

from ...compat import pin_empty
from ...errors import ConfigError
from ...sizing.host_memory import BLOCK, HostPlan, check_host_plan, gpu_numa_node, local_ranks
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
                 warn_pageable: bool = True, what: str = f"{BLOCK}.pin_memory", twins: Iterable[int] = (),
                 check_host: bool = True):
        """``layout[sub_group] = [(key, dtype, numel), ...]`` for every sub-group it holds. ``what``:
        the setting a pinning failure names (the block's ``pin_memory``, or ``offload_states``'s).
        ``twins``: the sub-groups that get a second region (speculation). ``check_host``: check that
        every local rank's store of this size fits the node now (attach judged the node already)."""
        self.slices: Dict[int, Dict[str, Slice]] = {}
        # side -> sub_group -> dtype -> (start, numel); side 1 exists for the twins only
        self.sides: Tuple[Dict[int, Dict[torch.dtype, Tuple[int, int]]], ...] = ({}, {})
        self.twins = frozenset(int(i) for i in twins if i in layout)
        self.current: Dict[int, int] = {sg: 0 for sg in layout}  # which side holds the committed state
        numel_of: Dict[int, Dict[torch.dtype, int]] = {}  # sub_group -> dtype -> its region's length
        for sg in sorted(layout):
            self.slices[sg], numel_of[sg] = {}, {}
            entries = sorted(layout[sg], key=lambda e: (e[0] != MASTER, e[0]))
            for key, dtype, numel in entries:
                length = numel_of[sg].get(dtype, 0)
                self.slices[sg][key] = Slice(key, dtype, length, numel)
                numel_of[sg][dtype] = length + numel
        totals: Dict[torch.dtype, int] = {}
        for side, members in ((0, sorted(layout)), (1, sorted(self.twins))):
            for sg in members:  # each region placed after the last one of its dtype
                self.sides[side][sg] = {}
                for dtype, numel in numel_of[sg].items():
                    self.sides[side][sg][dtype] = (totals.get(dtype, 0), numel)
                    totals[dtype] = totals.get(dtype, 0) + numel

        size = {dt: torch.empty(0, dtype=dt).element_size() for dt in totals}
        self.nbytes_by_dtype = {dt: n * size[dt] for dt, n in totals.items()}
        self.nbytes = sum(self.nbytes_by_dtype.values())
        self.twin_nbytes = sum(n * size[dt] for sg in self.twins for dt, n in self.region_numel(sg).items())
        # Every rank on this node pins a store of about this size: all of them must fit, checked
        # with the exact bytes before the first byte is pinned.
        if check_host:
            check_host_plan(HostPlan(self.nbytes, local_ranks(), budget_gb=budget_gb))
        acc = get_accelerator()
        bounds = {dt: [] for dt in totals}
        for regions in self.sides:
            for sg in sorted(regions):
                for dt, (start, numel) in regions[sg].items():
                    bounds[dt].append((start * size[dt], (start + numel) * size[dt]))
        for dt in bounds:
            bounds[dt].sort()
        node = gpu_numa_node(acc.current_device()) if acc.device_name() == "cuda" else None
        try:
            self.buffers, self.pinning, self.slabs = pinned.allocate(
                totals, bounds, pinned.make_pinner(acc, pin_memory), numa_node=node,
                show_progress=os.environ.get("LOCAL_RANK", "0") == "0",
                fallback=lambda n, dt: pin_empty(acc, n, dt))
        except RuntimeError as e:
            raise ConfigError(what, f"{e}; or set pin_memory to false (slower copies)") from e
        # slab -> the sub-groups with a region in it (either side); sub-group -> its slabs. Slabs are
        # cut at region boundaries: a region lies in the slab where it starts.
        self.unpinned: Set[int] = set()
        self._slab_members: List[Set[int]] = [set() for _ in self.slabs.slabs]
        self._slabs_of: Dict[int, List[int]] = {sg: [] for sg in layout}
        starts = {dt: sorted((lo, k) for k, (d, lo, _) in enumerate(self.slabs.slabs) if d == dt) for dt in totals}
        for side in self.sides:
            for sg, regions in side.items():
                for dt, (start, numel) in regions.items():
                    at = bisect.bisect_right(starts[dt], (start * size[dt], len(self.slabs.slabs))) - 1
                    if numel and at >= 0:
                        k = starts[dt][at][1]
                        self._slab_members[k].add(sg)
                        self._slabs_of[sg].append(k)
        if warn_pageable and not pin_memory and acc.device_name() != "cpu":
            logger.warning(f"[deepspeed-offload] {BLOCK}.pin_memory is false: pageable host buffers copy at a "
                           "fraction of the link speed, and the step will be slower")

    def unpin(self, sub_groups: Iterable[int]):
        """These sub-groups' state lives on the device from now on (the measured plan made them
        resident): every slab of theirs that holds only unpinned sub-groups is unlocked and its memory
        given back to the host. Their regions read as zeros until ``repin``."""
        new = {int(i) for i in sub_groups if i in self._slabs_of}
        self.unpinned |= new
        for k in sorted({k for i in new for k in self._slabs_of[i]}):
            if self._slab_members[k] <= self.unpinned:
                self.slabs.unpin(k)

    def repin(self, sub_groups: Iterable[int]):
        """These sub-groups stream again: their slabs are locked (memory held again) before their
        state is written into their regions."""
        slabs = []
        for i in sub_groups:
            if i in self.unpinned:
                self.unpinned.discard(i)
                slabs += self._slabs_of[i]
        self.slabs.lock(slabs)

    @property
    def pinned_bytes(self) -> int:
        """The store's bytes locked now: all of it, less the slabs unpinned or left pageable."""
        return self.nbytes - self.slabs.unlocked_bytes

    @property
    def regions(self) -> Dict[int, Dict[torch.dtype, Tuple[int, int]]]:
        """Side 0's regions (every sub-group's layout within its region is the same on both sides)."""
        return self.sides[0]

    def region(self, sub_group: int, dtype: torch.dtype, other: bool = False) -> torch.Tensor:
        """The sub-group's region of ``dtype`` on its current side (``other``: on its second side)."""
        side = self.current[sub_group] ^ int(other)
        if side and sub_group not in self.twins:
            raise KeyError(f"deepspeed-offload: sub-group {sub_group} has no second region")
        start, numel = self.sides[side][sub_group][dtype]
        return self.buffers[dtype].narrow(0, start, numel)

    def byte_ranges(self, sub_group: int, other: Optional[bool] = False) -> List[Tuple[int, int]]:
        """(address, bytes) of the sub-group's regions on its current side (``other``: its second
        side; None: both sides it has)."""
        sides = [other] if other is not None else [False, True][:1 + (sub_group in self.twins)]
        return [(r.data_ptr(), r.numel() * r.element_size()) for o in sides
                for r in (self.region(sub_group, dt, o) for dt in self.region_numel(sub_group))]

    def side_bytes(self, align: int = 1) -> int:
        """Bytes of one side's tensors (what a checkpoint reads), each rounded up to ``align``."""
        return sum(-(-s.numel * s.dtype.itemsize // align) * align for sg in self.slices.values() for s in sg.values())

    def region_numel(self, sub_group: int) -> Dict[torch.dtype, int]:
        return {dt: n for dt, (_, n) in self.regions[sub_group].items()}

    def view(self, sub_group: int, key: str, other: bool = False) -> torch.Tensor:
        s = self.slices[sub_group][key]
        return self.region(sub_group, s.dtype, other).narrow(0, s.offset, s.numel)

    def flip(self, sub_group: int):
        """The second side becomes the current one (a speculated update is committed)."""
        if sub_group not in self.twins:
            raise KeyError(f"deepspeed-offload: sub-group {sub_group} has no second region")
        self.current[sub_group] ^= 1
