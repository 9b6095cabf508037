"""The 16-bit partitions in ``offload_states()`` / ``reload_states()``: ``lp_params`` and ``lp_grads``.

``lp_params``: the trainable ones in one copy of DeepSpeed's flat buffer, as DeepSpeed does, and the
frozen ones (a LoRA's base weights) one by one: DeepSpeed's own code maps every module parameter into
the flat buffer, which holds only the trainable ones, and fails on a model with frozen parameters;
its ``reload_states`` brings the flat buffer back, this the frozen ones. Without mixed precision a
master is its 16-bit partition, a view of the flat buffer: it moves with it. ``lp_grads`` (the flat
buffer of gradient partitions): both ways here, each parameter's view of the buffer kept the same
tensor object (DeepCompile holds them; DeepSpeed's reload makes new ones). ``offload_states.py``
decides when; this moves.
"""

import itertools
from typing import List

import torch
from deepspeed.runtime.zero.offload_config import OffloadStateTypeEnum
from deepspeed.runtime.zero.utils import get_mapping_to_flat_buffer

LP = OffloadStateTypeEnum.lp_params
LP_GRADS = OffloadStateTypeEnum.lp_grads
# DeepSpeed's map from a parameter to its view of the gradient buffer (a private, name-mangled attribute).
GRAD_VIEWS = "_DeepSpeedZeroOptimizer_Stage3__param_id_to_grad_partition"


class Partitions16:
    """The 16-bit partitions of one attached engine off the device and back. ``mode``: its ``StreamMode``."""

    def __init__(self, mode):
        self.mode = mode
        self.opt = mode.opt
        self.fp32_aliases: List[int] = []  # sub-groups whose master is its 16-bit partition (fp32), offloaded
        self.frozen_on_host: List[tuple] = []  # (ds_tensor, its device) of frozen parameters offloaded

    def host(self, pin_memory: bool, made: list):
        """What ``offload_params`` moves into: the flat buffer's host copy, and one for each frozen
        parameter's partition on the device."""
        opt, acc = self.opt, self.mode.acc
        trainable = opt._get_parameter_partitions()
        host = self.host_buffer("lp_param_contiguous_pin_buffer", opt.lp_param_buffer.data, pin_memory, made)
        ids = {id(t) for t in trainable}
        frozen = []
        for p in opt.module.parameters():
            t = getattr(p, "ds_tensor", None)
            if t is not None and id(t) not in ids and t.device.type != "cpu":
                pin = pin_memory and acc.device_name() != "cpu"
                frozen.append((t, t.device, torch.empty_like(t.data, device="cpu", pin_memory=pin)))
        return host, trainable, frozen

    def offload_params(self, lp, pin_memory: bool, non_blocking: bool):
        """DeepSpeed's lp_params offload, with the frozen parameters' partitions handled apart (see
        above), into ``lp`` (``host``). Its ``reload_states`` reads ``lp_param_contiguous_pin_buffer``
        when that exists."""
        opt = self.opt
        host, trainable, frozen = lp
        if not pin_memory and hasattr(opt, "lp_param_contiguous_pin_buffer"):
            del opt.lp_param_contiguous_pin_buffer  # DeepSpeed's reload would read it: an older copy
        device_buffer = opt.lp_param_buffer.data
        _copy(host, device_buffer, non_blocking)
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
        for t, home, target in frozen:
            target.copy_(t.data, non_blocking=non_blocking)
            t.data = target
            self.frozen_on_host.append((t, home))
        opt.fp16_partitioned_groups_flat.clear()
        opt.offloaded_states.add(LP)

    def reload_rest(self, non_blocking: bool):
        """After DeepSpeed's reload brought the flat 16-bit buffer back: the masters that are 16-bit
        partitions and the frozen partitions (their device copies made before any is rebound)."""
        opt = self.opt
        for i in self.fp32_aliases:  # the master is the 16-bit partition again (DeepSpeed made new views)
            opt.fp32_partitioned_groups_flat[i].data = opt.fp16_partitioned_groups_flat[i].data
        self.fp32_aliases = []
        targets = [tensor.data.to(home, non_blocking=non_blocking) for tensor, home in self.frozen_on_host]
        for (tensor, _), target in zip(self.frozen_on_host, targets):
            tensor.data = target
        frozen, self.frozen_on_host = self.frozen_on_host, []
        if frozen and non_blocking:
            self.mode.acc.synchronize()

    def offload_grads(self, host, non_blocking: bool):
        """The flat buffer of gradient partitions into ``host`` (DeepSpeed's pinned buffer when
        ``pin_memory``, made once), each parameter's view of it with it."""
        opt = self.opt
        buffer = opt.grad_partitions_flat_buffer
        _copy(host, buffer.data, non_blocking)
        buffer.data = host
        self.rebind_grad_views()
        opt.averaged_gradients = {}
        opt.offloaded_states.add(LP_GRADS)

    def reload_grads(self, non_blocking: bool):
        opt = self.opt
        buffer = opt.grad_partitions_flat_buffer
        buffer.data = buffer.data.to(self.mode.acc.current_device_name(), non_blocking=non_blocking)
        self.rebind_grad_views()
        opt.averaged_gradients = {}
        opt.offloaded_states.discard(LP_GRADS)

    def host_buffer(self, pin_attr: str, tensor, pin_memory: bool, made: list):
        """Where ``tensor`` goes on the host: the optimizer's pinned buffer named ``pin_attr`` (DeepSpeed's
        name for it; made at the first call, reused after, noted in ``made`` when made now) when
        ``pin_memory``, else a new pageable tensor (``tensor`` itself where it is on the host already)."""
        if not pin_memory:
            return tensor if tensor.device.type == "cpu" else torch.empty_like(tensor, device="cpu")
        host = getattr(self.opt, pin_attr, None)
        if host is None:
            host = self.mode.acc.pin_memory(torch.empty_like(tensor, device="cpu"))
            setattr(self.opt, pin_attr, host)
            made.append(("attr", pin_attr))
        return host

    def rebind_grad_views(self):
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


def _copy(host, source, non_blocking: bool):
    """``source`` into ``host``, unless they are the same memory (a pageable "copy" of a host tensor)."""
    if host.data_ptr() != source.data_ptr():
        host.copy_(source, non_blocking=non_blocking)
