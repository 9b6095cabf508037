"""The gradient norm that opens ZeRO-3's step, every sub-group's queued without a wait for each.

DeepSpeed's ``_get_norm_groups`` calls ``get_grad_norm_direct`` once per sub-group: the norm of each
gradient partition (in fp64 where the accelerator has it), their squares summed and all-reduced, the
square root, and ``-1`` where that is not finite. It makes the ``-1`` with ``torch.tensor(-1.0,
device=...)``, a copy from pageable host memory, which waits for everything queued on the compute
stream. DeepSpeed's default
sub-group size gives a 7B model 7 sub-groups; stream mode's ``sub_group_mb`` gives it 162, and the
CPU launches one sub-group's norm, waits for the device to finish it, launches the next: the step's
first loads fill their staging slots and the H2D stream idles until the norm is done.

``GroupNorms`` computes the same operations on the same tensors in the same order, with one ``-1``
kept on the device, so the CPU queues every sub-group's norm without waiting. It stands in for
DeepSpeed's only where DeepSpeed's norm is that plain sum (2-norm; no model or expert parallelism,
no Muon, no CPU optimizer offload), and only once the first step it sees has shown both giving the
same bits (``torch.equal`` on every sub-group's norm, agreed by all ranks; DeepSpeed's result is the
one returned). Otherwise DeepSpeed's own runs every step (where the comparison failed, one warning
says so).
"""

import enum
from typing import Callable, List

import torch
from deepspeed import comm as dist
from deepspeed.utils import logger

from ...compat import norm_dtype


class NormSource(enum.Enum):
    UNCHECKED = "unchecked"  # eligible, not yet compared with DeepSpeed's
    OURS = "ours"  # compared equal: every step from then on
    DEEPSPEEDS = "deepspeed's"  # not eligible, or compared unequal


class GroupNorms:
    """Replaces ``opt._get_norm_groups`` (``wrap``); ``source`` says which computes it now."""

    def __init__(self, opt):
        self.opt = opt
        # the group each sub-group's norm is all-reduced over, as DeepSpeed's get_grad_norm_direct picks it
        self._group_of = opt._get_param_partition_group if hasattr(opt, "_get_param_partition_group") \
            else (lambda param: opt.dp_process_group)
        self._err = None  # DeepSpeed's -1 for a non-finite norm, made once on the device
        why = self._not_plain(opt)
        self.source = NormSource.UNCHECKED if why is None else NormSource.DEEPSPEEDS
        self.why = why

    @staticmethod
    def _not_plain(opt):
        """Why DeepSpeed's norm is not the plain per-sub-group sum here, or None where it is."""
        if getattr(opt, "offload_optimizer", False):
            return "the optimizer is offloaded to the CPU"
        if getattr(opt, "model_parallel_group", None) is not None:
            return "model parallelism"
        if getattr(opt, "use_muon", False):
            return "Muon"
        expert = getattr(opt, "_autoep_expert_parallel_group", None)
        if expert is not None and any(expert(params) is not None for params in opt.fp16_groups):
            return "expert parallelism"
        return None

    def wrap(self, orig: Callable[[], List[torch.Tensor]]) -> Callable[[], List[torch.Tensor]]:

        def get_norm_groups():
            if self.source is NormSource.OURS:
                return self.compute()
            if self.source is NormSource.DEEPSPEEDS:
                return orig()
            theirs = orig()
            self._decide(theirs, self.compute())
            return theirs

        return get_norm_groups

    def compute(self) -> List[torch.Tensor]:
        opt = self.opt
        dtype = norm_dtype()
        return [self._norm(opt.averaged_gradients[i], params, dtype) for i, params in enumerate(opt.fp16_groups)]

    def _norm(self, grads, params, dtype) -> torch.Tensor:
        total = torch.sum(torch.pow(torch.stack([g.to(dtype).norm(2.0) for g in grads]), 2.0))
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=self._group_of(params[0]))
        total = total**(1. / 2.0)
        if self._err is None:
            self._err = torch.tensor(-1.0, device=self.opt.device, dtype=torch.float)
        return torch.where(total.isnan().logical_or(total.isinf()), self._err, total)

    def _decide(self, theirs, ours):
        same = len(theirs) == len(ours) and all(
            a.dtype == b.dtype and a.device == b.device and torch.equal(a, b) for a, b in zip(theirs, ours))
        agreed = torch.tensor([1 if same else 0], device=theirs[0].device if theirs else "cpu", dtype=torch.int32)
        if dist.is_initialized():
            dist.all_reduce(agreed, op=dist.ReduceOp.MIN)  # every rank takes the same path
        if bool(agreed.item()):
            self.source = NormSource.OURS
        else:
            self.source = NormSource.DEEPSPEEDS
            self.why = "its result differed from DeepSpeed's" + ("" if not same else " on another rank")
            logger.warning(f"[deepspeed-offload] the step's gradient norm stays DeepSpeed's own: {self.why}")
