"""``engine.offload_states()`` / ``engine.reload_states()`` with the block attached (RL colocation).

Trainers that share their GPUs with rollouts (TRL's GRPO in colocate mode, OpenRLHF, verl) free the
trainer's memory between steps with DeepSpeed's own ``engine.offload_states(include, device,
pin_memory, non_blocking)`` and bring it back with ``engine.reload_states(non_blocking)``. The engine
checks its arguments and calls the ZeRO-3 optimizer's methods of the same names; ``StateOffload``
stands in for those two, installed by stream mode with its other hooks.

Who moves what, per ``OffloadStateTypeEnum``:

- ``hp_params`` (fp32 masters) and ``optim_states`` (the optimizer's per-parameter state), ours:
  an offloaded sub-group's are in the host store already and move 0 bytes. What is on the device
  moves: the sub-groups kept resident within ``memory_budget_gb`` go to a host store of their own
  (exact size, pinned when ``pin_memory``; made at the first call, reused after), and compile mode's
  sub-groups kept on the device are written back to the main store and, at reload, loaded again into
  buffers of their own, where the next step expects them. Any optimizer the block accepts works
  (DeepSpeed's own code for these two asserts FusedAdam).
- ``lp_params`` (the 16-bit partitions): the trainable ones in one copy of DeepSpeed's flat buffer, as
  DeepSpeed does, and the frozen ones (a LoRA's base weights) one by one. DeepSpeed's own code maps
  every module parameter into the flat buffer, which holds only the trainable ones, and fails on a
  model with frozen parameters; its ``reload_states`` brings the flat buffer back, we the frozen ones.
- ``lp_grads`` (the flat buffer of gradient partitions): ours both ways, with each parameter's view of
  the buffer kept the same tensor object (DeepCompile holds them; DeepSpeed's reload makes new ones).
- ``contiguous_grad_buffer`` (the reduce buckets): as DeepSpeed does, its ``reload_states`` makes them
  again.
DeepSpeed's ``offload_states`` is not called at all: it ends with a ``gc.collect()``, a full collection
of the trainer's Python heap (0.3 s in a trainer with 600k objects), which frees nothing of ours (every
device tensor we drop is released with its last reference). Its ``reload_states`` is, for the kinds
not done here.

A kind is in ``optimizer.offloaded_states`` (DeepSpeed's set) while it is off the device, ours
included (marked as it moves, so a failure half-way leaves it known). While anything is offloaded,
``engine.step()``, ``engine.backward()`` (and the gradient hooks' prologue), ``engine.load_checkpoint()``,
the optimizer's writers of host state and ``detach()`` raise ``StatesOffloaded`` on entry, before
they change anything: call ``reload_states()`` first (stream mode installs those refusals).
"""

import itertools
from typing import Dict, List, Optional

import torch
from deepspeed.runtime.zero.offload_config import OffloadDeviceEnum, OffloadStateTypeEnum
from deepspeed.runtime.zero.utils import get_mapping_to_flat_buffer

from ..compat import drop_reduce_buffers
from .host_store import MASTER, HostStore

OURS = (OffloadStateTypeEnum.hp_params, OffloadStateTypeEnum.optim_states)
LP = OffloadStateTypeEnum.lp_params
LP_GRADS = OffloadStateTypeEnum.lp_grads
BUCKETS = OffloadStateTypeEnum.contiguous_grad_buffer
# DeepSpeed's map from a parameter to its view of the gradient buffer (a private, name-mangled attribute).
GRAD_VIEWS = "_DeepSpeedZeroOptimizer_Stage3__param_id_to_grad_partition"


class StatesOffloaded(RuntimeError):
    """An operation that needs the optimizer's state on the device, called between
    ``offload_states()`` and ``reload_states()``."""


class StateOffload:
    """The offload_states/reload_states of one attached engine. ``mode``: its ``StreamMode``."""

    def __init__(self, mode):
        self.mode = mode
        self.opt = mode.opt
        self.resident_stores: Dict[bool, HostStore] = {}  # pin_memory -> the resident sub-groups' host copy
        self.resident_on_host: Dict[OffloadStateTypeEnum, HostStore] = {}  # kind -> the store it is in
        self.kept: List[int] = []  # compile mode's sub-groups that were on the device at offload
        self.copied = None  # event of a non-blocking offload's copies into the resident host store
        self.fp32_aliases: List[int] = []  # sub-groups whose master is its 16-bit partition (fp32), offloaded
        self.frozen_on_host: List[tuple] = []  # (ds_tensor, its device) of frozen parameters offloaded
        self.offload_bytes = 0  # moved by the last offload_states() for hp_params and optim_states
        self.reload_bytes = 0  # ... and by the last reload_states()

    def layout_changed(self):
        """The measured plan changed which sub-groups are resident (between steps, nothing offloaded):
        the host copy of the resident ones is made anew at the next offload_states()."""
        self.resident_stores.clear()

    def refuse_if_offloaded(self, what: str):
        if self.opt.offloaded_states:
            names = ", ".join(sorted(s.value for s in self.opt.offloaded_states))
            raise StatesOffloaded(f"deepspeed-offload: {what} called while engine.offload_states() has moved "
                                  f"{names} off the device; call engine.reload_states() first")

    # ------------------------------------------------------------------ the optimizer's two methods

    def offload_states(self, include=None, device=OffloadDeviceEnum.cpu, pin_memory: bool = True,
                       non_blocking: bool = False):
        """``DeepSpeedZeroOptimizer_Stage3.offload_states``, every kind (see the module's docstring)."""
        mode, opt = self.mode, self.opt
        if mode._in_step:
            raise StatesOffloaded("deepspeed-offload: engine.offload_states() called inside a step")
        wanted = [k for k in (list(OffloadStateTypeEnum) if include is None else list(include))
                  if k not in opt.offloaded_states]
        mode.discard_speculation("offload_states")  # updated from the state that moves now
        opt.empty_partition_cache()  # as DeepSpeed: the gathered parameters are released first
        ours = [k for k in OURS if k in wanted]
        moved = 0
        if ours:
            # Made (and its host memory checked) before anything moves.
            store = self._resident_store(pin_memory) if self._resident_keys(ours) else None
            # Write-backs land: what compile mode left updated on the device goes to the host store
            # (those it keeps there between steps come back at reload_states).
            updated = [i for i in mode.order if mode.table[i].on_device and mode.table[i].host_stale]
            self.kept = sorted(set(self.kept) | {i for i in updated if i in mode.timing.kept})
            mode.synchronize_for_checkpoint()
            mode.table.release_loaded()  # loaded ahead of a step: the host copy is the current one
            moved += sum(mode.layout.nbytes[i] for i in updated)
            for kind in ours:
                if store is not None:
                    moved += self._move_resident(kind, store, non_blocking)
                    self.resident_on_host[kind] = store
                opt.offloaded_states.add(kind)  # marked as it moves: a failure below leaves it known
            if non_blocking and store is not None:
                self.copied = mode.copies.mark()  # CPU readers of the host copy wait for it (wait_for_copies)
        self.offload_bytes = moved
        if LP in wanted:
            self._offload_lp_params(pin_memory, non_blocking)
        if LP_GRADS in wanted:
            self._offload_lp_grads(pin_memory, non_blocking)
        if BUCKETS in wanted and drop_reduce_buffers(opt):  # DeepSpeed's reload makes empty ones of their shape
            opt.offloaded_states.add(BUCKETS)
        mode.acc.empty_cache()  # the rollout in this process or another sees the memory free

    def wait_for_copies(self):
        """Before the CPU reads the resident sub-groups' host copy: a non-blocking offload has landed."""
        if self.copied is not None:
            self.mode.copies.wait_host(self.copied)
            self.copied = None

    def reload_states(self, orig, non_blocking: bool = False):
        """``DeepSpeedZeroOptimizer_Stage3.reload_states``, ``orig`` its own version."""
        moved = 0
        device = self.mode.acc.current_device_name()
        for kind in OURS:
            if kind not in self.opt.offloaded_states:
                continue
            self.opt.offloaded_states.discard(kind)  # DeepSpeed's reload below must not see ours
            store = self.resident_on_host.pop(kind, None)
            if store is not None:
                moved += self._move_resident(kind, None, non_blocking, device=device, store=store)
        for i in self.kept:
            moved += self.mode.preload(i)  # back into buffers of their own, where the step expects them
        self.kept = []
        self.reload_bytes = moved
        frozen, self.frozen_on_host = self.frozen_on_host, []
        aliases, self.fp32_aliases = self.fp32_aliases, []
        if LP_GRADS in self.opt.offloaded_states:
            self._reload_lp_grads(non_blocking)
        orig(non_blocking=non_blocking)  # the buckets and the trainable lp_params; synchronizes when non_blocking
        for i in aliases:  # the master is the 16-bit partition again (DeepSpeed made new views)
            self.opt.fp32_partitioned_groups_flat[i].data = self.opt.fp16_partitioned_groups_flat[i].data
        for tensor, home in frozen:
            tensor.data = tensor.data.to(home, non_blocking=non_blocking)
        if frozen and non_blocking:
            self.mode.acc.synchronize()

    # ------------------------------------------------------------------ the 16-bit partitions

    def _offload_lp_params(self, pin_memory: bool, non_blocking: bool):
        """DeepSpeed's lp_params offload, with the frozen parameters' partitions handled apart (see
        above). Its ``reload_states`` reads ``lp_param_contiguous_pin_buffer`` when that exists."""
        opt, acc = self.opt, self.mode.acc
        trainable = opt._get_parameter_partitions()
        if not pin_memory and hasattr(opt, "lp_param_contiguous_pin_buffer"):
            del opt.lp_param_contiguous_pin_buffer  # DeepSpeed's reload would read it: an older copy
        host = self._to_host("lp_param_contiguous_pin_buffer", opt.lp_param_buffer.data, pin_memory, non_blocking)
        device_buffer = opt.lp_param_buffer.data
        opt.lp_param_buffer.data = host
        for tensor, offset, numel in get_mapping_to_flat_buffer(trainable):
            tensor.data = host.narrow(0, offset, numel)
        # Without mixed precision a master is its 16-bit partition, a view of the flat buffer: it goes too.
        size = device_buffer.element_size()
        for i, flat in enumerate(opt.fp16_partitioned_groups_flat):
            if flat is not None and flat is opt.fp32_partitioned_groups_flat[i] and flat.device == device_buffer.device:
                offset = (flat.data_ptr() - device_buffer.data_ptr()) // size
                self.fp32_aliases.append(i)
                flat.data = host.narrow(0, offset, flat.numel())
        ids = {id(t) for t in trainable}
        for p in opt.module.parameters():
            t = getattr(p, "ds_tensor", None)
            if t is not None and id(t) not in ids and t.device.type != "cpu":
                self.frozen_on_host.append((t, t.device))
                target = torch.empty_like(t.data, device="cpu", pin_memory=pin_memory and acc.device_name() != "cpu")
                target.copy_(t.data, non_blocking=non_blocking)
                t.data = target
        opt.fp16_partitioned_groups_flat.clear()
        opt.offloaded_states.add(LP)

    def _offload_lp_grads(self, pin_memory: bool, non_blocking: bool):
        """The flat buffer of gradient partitions to the host (DeepSpeed's pinned buffer when
        ``pin_memory``, made once), each parameter's view of it with it."""
        opt = self.opt
        buffer = opt.grad_partitions_flat_buffer
        buffer.data = self._to_host("lp_grad_partitions_flat_pin_buffers", buffer.data, pin_memory, non_blocking)
        self._rebind_grad_views()
        opt.averaged_gradients = {}
        opt.offloaded_states.add(LP_GRADS)

    def _reload_lp_grads(self, non_blocking: bool):
        opt = self.opt
        buffer = opt.grad_partitions_flat_buffer
        buffer.data = buffer.data.to(self.mode.acc.current_device_name(), non_blocking=non_blocking)
        self._rebind_grad_views()
        opt.averaged_gradients = {}
        opt.offloaded_states.discard(LP_GRADS)

    def _to_host(self, pin_attr: str, tensor, pin_memory: bool, non_blocking: bool):
        """``tensor`` copied to the host: into the optimizer's pinned buffer named ``pin_attr``
        (DeepSpeed's name for it; made at the first call, reused after) when ``pin_memory``, else
        into a new pageable tensor."""
        if not pin_memory:
            return tensor.to("cpu", non_blocking=non_blocking)
        host = getattr(self.opt, pin_attr, None)
        if host is None:
            host = self.mode.acc.pin_memory(torch.empty_like(tensor, device="cpu"))
            setattr(self.opt, pin_attr, host)
        host.copy_(tensor, non_blocking=non_blocking)
        return host

    def _rebind_grad_views(self):
        """Each parameter's view of the gradient buffer onto where the buffer is now, the same tensor
        objects. DeepCompile hands these views to its reduction ops once, when it compiles; DeepSpeed's
        own reload makes new ones, and compiled training would then reduce into the old buffer while
        the optimizer reads the new one."""
        opt = self.opt
        buffer, views, offset = opt.grad_partitions_flat_buffer, getattr(opt, GRAD_VIEWS), 0
        for param in itertools.chain.from_iterable(opt.fp16_groups):  # DeepSpeed's order of the buffer
            numel = param.partition_numel()
            if param.ds_id in views:
                views[param.ds_id].data = buffer.narrow(0, offset, numel)
            else:
                views[param.ds_id] = buffer.narrow(0, offset, numel)
            offset += numel

    # ------------------------------------------------------------------ the resident sub-groups

    def _resident_keys(self, kinds) -> bool:
        return any(self._keys(i, kind) for i in self.mode.resident for kind in kinds)

    def _keys(self, i: int, kind) -> List[str]:
        """The keys of resident sub-group ``i``'s tensors of ``kind`` that exist now (the master only
        where it is not the model's own partition, as in the host store's layout)."""
        keys = [key for key, _, _ in self.mode.layout.resident_entries.get(i, ())
                if (key == MASTER) == (kind is OffloadStateTypeEnum.hp_params)]
        return [key for key in keys if self.mode.tensors.get(i, key) is not None]

    def _resident_store(self, pin_memory: bool) -> HostStore:
        store = self.resident_stores.get(bool(pin_memory))
        if store is None:
            store = HostStore(self.mode.layout.resident_entries, bool(pin_memory), warn_pageable=False,
                              what="engine.offload_states(pin_memory=...)")
            self.resident_stores[bool(pin_memory)] = store
        return store

    def _move_resident(self, kind, to: Optional[HostStore], non_blocking: bool, device=None,
                       store: Optional[HostStore] = None) -> int:
        """The resident sub-groups' tensors of ``kind`` into host store ``to``, or (``to`` None) from
        ``store`` back onto ``device``. Returns the bytes."""
        moved = 0
        for i in self.mode.resident:
            for key in self._keys(i, kind):
                t = self.mode.tensors.get(i, key)
                if to is not None:
                    target = to.view(i, key)
                    target.copy_(t.data, non_blocking=non_blocking)
                else:
                    target = torch.empty_like(store.view(i, key), device=device)
                    target.copy_(store.view(i, key), non_blocking=non_blocking)
                t.data = target
                moved += target.numel() * target.element_size()
        return moved
