"""Which DeepSpeed tensor holds each offloaded tensor of a sub-group, and where its ``.data`` points.

A sub-group's offloaded tensors are its fp32 master (``fp32_partitioned_groups_flat[i]``, the key
of ``optimizer.state``) and the optimizer's per-parameter state of that master. DeepSpeed keeps
those objects; offload only rebinds their ``.data``: at a slice of the host store between steps, at
device buffers while the step updates them (``point_at``). State the optimizer creates lazily (Adam's
moments at its first step) is copied into the buffers it belongs in (``move_into``).
"""

from typing import Callable, Dict, Iterable, List, Optional, Tuple

import torch

from .host_store import MASTER, HostStore

View = Callable[[str], torch.Tensor]  # key -> the tensor its .data should point at


class StateTensors:

    def __init__(self, opt, store: HostStore, order: List[int]):
        self.opt = opt
        self.base = opt.optimizer
        self.store = store
        self.order = order

    def get(self, i: int, key: str) -> Optional[torch.Tensor]:
        master = self.opt.fp32_partitioned_groups_flat[i]
        if key == MASTER:
            return master
        return self.base.state.get(master, {}).get(key)

    def of(self, i: int) -> List[torch.Tensor]:
        """Sub-group ``i``'s existing tensors (its fp32 master and optimizer state), streamed or resident
        (a sub-group resident since attach has no slices in the store: its keys come from the optimizer)."""
        master = self.opt.fp32_partitioned_groups_flat[i]
        return [master] + [t for t in self.base.state.get(master, {}).values() if torch.is_tensor(t) and t.dim()]

    def byte_ranges(self, i: int) -> List[Tuple[int, int]]:
        """(address, bytes) of sub-group ``i``'s tensors where they are now."""
        return [(t.data_ptr(), t.numel() * t.element_size()) for t in self.of(i)]

    def owners(self, sub_groups: Iterable[int]) -> Dict[int, int]:
        """The tensors of ``sub_groups`` (``data_ptr`` where they are now) and the sub-group of each."""
        return {t.data_ptr(): i for i in sorted(sub_groups) for t in self.of(i)}

    def stored(self, i: int) -> List[Tuple[str, torch.Tensor]]:
        """(key, tensor) of sub-group ``i``'s tensors that the host store has a slice for and that exist
        (the optimizer's state appears at its first step)."""
        return [(key, t) for key in self.store.slices[i] if (t := self.get(i, key)) is not None]

    def point_at(self, i: int, view: View, drop_grad: bool = False):
        """Rebind each existing tensor of sub-group ``i`` to ``view(key)``; ``drop_grad``: its
        gradient too (a device gradient would not fit a host tensor)."""
        for key, t in self.stored(i):
            if drop_grad:
                t.grad = None
            t.data = view(key)

    def move_into(self, i: int, view: View):
        """Copy each tensor of sub-group ``i`` into ``view(key)`` and point it there, unless it points
        there already; a tensor of another shape or dtype than the store's is refused."""
        for key, t in self.stored(i):
            target = view(key)
            if t.shape != target.shape or t.dtype != target.dtype:
                raise RuntimeError(f"deepspeed-offload: optimizer state '{key}' of sub-group {i} is "
                                   f"{tuple(t.shape)} {t.dtype}, the host store expected {tuple(target.shape)} "
                                   f"{target.dtype}; this optimizer's state is not per-parameter tensors")
            if t.data_ptr() != target.data_ptr():
                target.copy_(t.data)
                t.data = target

    def all_to_host(self):
        """Every existing tensor into its host slice, one tensor at a time (no temporary on the device)."""
        for i in self.order:
            self.move_into(i, lambda key: self.store.view(i, key))

    def back_to_device(self, device):
        """Every tensor that points at its host slice gets a device copy of it again (detach, a failed
        attach: one moved half-way leaves the others where they were)."""
        for i in self.order:
            for key in self.store.slices[i]:
                t, host = self.get(i, key), self.store.view(i, key)
                if t is not None and t.data_ptr() == host.data_ptr():
                    t.data = host.to(device, copy=True)

    def host_resident(self) -> bool:
        return all(
            self.get(i, key) is None or self.get(i, key).data_ptr() == self.store.view(i, key).data_ptr()
            for i in self.order for key in self.store.slices[i])

    def after_load(self, acc):
        """After ``load_state_dict``: the loaded state into the host store, and the state the store
        does not hold (Adam's ``step``) where the step will need it. torch's loader placed it by the
        parameter's device, and an offloaded sub-group's master is on the host while it loads, so a
        fused or capturable Adam would find its ``step`` on the CPU beside device moments."""
        self.all_to_host()
        device = acc.current_device_name()
        for i in self.order:
            group = self.base.param_groups[self.opt.sub_group_to_group_id[i]]
            state = self.base.state.get(self.opt.fp32_partitioned_groups_flat[i], {})
            for key, value in state.items():
                if key in self.store.slices[i] or not torch.is_tensor(value):
                    continue
                target = unstored_state_device(key, group, device)
                if target is not None and value.device != torch.device(target):
                    state[key] = value.to(target)


def unstored_state_device(key: str, group: dict, device: str) -> Optional[str]:
    """Where a loaded state tensor that the host store does not hold belongs: torch's own rule in
    ``Optimizer.load_state_dict`` (``step`` stays where it is unless the group is fused or
    capturable; anything else goes with the parameter), applied as if the parameter were on the
    device, where it is whenever the optimizer runs. None: leave it where it is."""
    if key == "step" and not (group.get("fused") or group.get("capturable")):
        return None
    return device
