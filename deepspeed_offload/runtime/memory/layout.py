"""The layout of the offloaded state: what each sub-group moves, and one placement's figures.

``probe_layout`` runs once at attach: which tensors each ZeRO-3 sub-group moves (its fp32 master
unless that *is* the model's partition, plus the per-parameter tensors the optimizer creates) and
how many bytes that is. ``Probe.split(k)`` makes the ``Layout`` of one placement: the first ``k``
sub-groups (in step order) resident, the rest offloaded in step order, how large a staging slot
must be (the largest offloaded sub-group, per dtype) and the largest fp32 gradient the step builds
for one sub-group. The placement is decided at attach and, with the budget derived, again after the
measuring iteration (placement.py); everything else in the runtime reads the current Layout's
figures instead of recomputing them.
"""

from dataclasses import dataclass
from typing import Callable, Dict, Iterable, List, Tuple

import torch

from .host_store import MASTER

Entry = Tuple[str, torch.dtype, int]  # (MASTER or optimizer-state key, dtype, numel)


def element_size(dtype: torch.dtype) -> int:
    return torch.empty(0, dtype=dtype).element_size()


def probe_state_layout(base_optimizer, group_index, device, dtype) -> Dict[str, torch.dtype]:
    """Which per-parameter tensors ``base_optimizer`` creates for a parameter of ``group_index``.

    Steps the optimizer once on a throwaway parameter (zero gradient) and restores the group's
    hyperparameters afterwards (FusedAdam counts steps in the group): the real parameters, which
    ZeRO-3 keeps out of ``param_groups`` between steps, are not touched."""
    group = base_optimizer.param_groups[group_index]
    saved = dict(group)
    dummy = torch.zeros(8, device=device, dtype=dtype, requires_grad=True)
    dummy.grad = torch.zeros_like(dummy)
    others = [g["params"] for g in base_optimizer.param_groups]
    try:
        for g in base_optimizer.param_groups:
            g["params"] = []
        group["params"] = [dummy]
        base_optimizer.step()
    finally:
        for g, params in zip(base_optimizer.param_groups, others):
            g["params"] = params
        group.clear()
        group.update(saved)
        state = base_optimizer.state.pop(dummy, {})
    return {k: v.dtype for k, v in state.items() if torch.is_tensor(v) and v.shape == dummy.shape}


@dataclass(frozen=True)
class Layout:
    entries: Dict[int, List[Entry]]  # offloaded sub-group -> what moves
    nbytes: Dict[int, int]  # offloaded sub-group -> bytes it moves each way
    order: List[int]  # offloaded sub-groups, in the order the step updates them
    resident: List[int]  # sub-groups whose state stays on the device
    resident_entries: Dict[int, List[Entry]]  # resident sub-group -> what engine.offload_states() moves
    slot_numel: Dict[torch.dtype, int]  # one staging slot: the largest offloaded region, per dtype
    slot_bytes: int
    grad_bytes: int  # the largest fp32 gradient the step builds for one sub-group


@dataclass(frozen=True)
class Probe:
    """What every sub-group of the optimizer moves, before anything is decided: ``split`` makes the
    Layout of one placement (the first ``k`` sub-groups resident)."""
    entries: List[List[Entry]]  # per sub-group (empty: nothing to move)
    grad_bytes: int
    existing: List[int]  # per sub-group: bytes of its tensors that exist now (on the device)

    @property
    def total(self) -> int:
        return sum(self.nbytes_in_order())

    def nbytes(self, i: int) -> int:
        return sum(numel * element_size(dt) for _, dt, numel in self.entries[i])

    def nbytes_in_order(self) -> List[int]:
        return [self.nbytes(i) for i in range(len(self.entries))]

    def resident_bytes(self, k: int) -> int:
        return sum(self.nbytes(i) for i in range(k))

    def fitting(self, budget_bytes: int) -> int:
        """How many of the first sub-groups fit ``budget_bytes`` (``memory_budget_gb``)."""
        return len(fitting_prefix(range(len(self.entries)), self.nbytes, budget_bytes))

    def split(self, k: int) -> Layout:
        """The layout with the first ``k`` sub-groups resident and the rest offloaded."""
        n = len(self.entries)
        resident = list(range(min(k, n)))
        order = [i for i in range(len(resident), n) if self.entries[i]]
        slot_numel: Dict[torch.dtype, int] = {}
        for i in order:
            per_dtype: Dict[torch.dtype, int] = {}
            for _, dt, numel in self.entries[i]:
                per_dtype[dt] = per_dtype.get(dt, 0) + numel
            for dt, numel in per_dtype.items():
                slot_numel[dt] = max(slot_numel.get(dt, 0), numel)
        return Layout(entries={i: self.entries[i] for i in order},
                      nbytes={i: self.nbytes(i) for i in order},
                      order=order,
                      resident=resident,
                      resident_entries={i: self.entries[i] for i in resident if self.entries[i]},
                      slot_numel=slot_numel,
                      slot_bytes=sum(numel * element_size(dt) for dt, numel in slot_numel.items()),
                      grad_bytes=self.grad_bytes)


def probe_layout(opt) -> Probe:
    """What each of ZeRO-3 optimizer ``opt``'s sub-groups moves."""
    masters = opt.fp32_partitioned_groups_flat
    n = len(masters)
    # Without mixed precision the fp32 master *is* the model's partition: it stays on the device.
    master_moves = [masters[i] is not opt.fp16_partitioned_groups_flat[i] for i in range(n)]
    states_by_group = {}
    for g in sorted(set(opt.sub_group_to_group_id.values())):
        sample = masters[next(i for i in range(n) if opt.sub_group_to_group_id[i] == g)]
        states_by_group[g] = probe_state_layout(opt.optimizer, g, sample.device, sample.dtype)

    def entries(i) -> List[Entry]:
        numel = masters[i].numel()
        out = [(MASTER, masters[i].dtype, numel)] if master_moves[i] else []
        return out + [(k, dt, numel) for k, dt in states_by_group[opt.sub_group_to_group_id[i]].items()]

    def existing(i) -> int:
        state = opt.optimizer.state.get(masters[i], {})
        tensors = [masters[i]] if master_moves[i] else []
        tensors += [state[k] for k, _, _ in entries(i) if k != MASTER and torch.is_tensor(state.get(k))]
        return sum(t.numel() * t.element_size() for t in tensors)

    return Probe(entries=[entries(i) for i in range(n)],
                 grad_bytes=max((m.numel() * element_size(m.dtype) for m in masters), default=0),
                 existing=[existing(i) for i in range(n)])


def fitting_prefix(items: Iterable[int], nbytes: Callable[[int], int], budget: int) -> List[int]:
    """The longest prefix of ``items`` whose bytes together fit in ``budget``: what stays resident,
    what compile mode keeps on the device, which sub-groups speculate."""
    out, held = [], 0
    for i in items:
        if held + nbytes(i) > budget:
            break
        out.append(i)
        held += nbytes(i)
    return out
