"""One update in backward: what DeepSpeed's step would compute for a sub-group, computed early.

For a sub-group whose gradient is final and whose state is in buffers of its own: its fp32 gradient
built as ``_prepare_fp32_grad_for_sub_group`` builds it, times the factor ``unscale_and_clip_grads``
uses when clipping does not fire (1 / loss scale), DeepSpeed's own ``_optimizer_step``, the 16-bit
cast kept on the device, all on the side stream so that backward never waits; the result written to
the host where its rollback keeps the state before (``Rollback``), and Adam's small state and the
group's entries put back as they were until the step commits. ``updates.py`` decides when; this
module only computes.
"""

import torch

from ..memory.host_store import MASTER
from ..staging.copies import JOINED
from .records import Rollback, Speculated, group_entries, on_device, restore_group, restore_state, small_state


def update_in_backward(spec, i: int):
    """Update final sub-group ``i``, its state loaded into buffers of its own, on the side stream, as
    DeepSpeed's step would, and write the result where its rollback keeps the state before."""
    mode, opt, table, store = spec.mode, spec.opt, spec.mode.table, spec.mode.store
    master = opt.fp32_partitioned_groups_flat[i]
    state = spec.base.state.get(master)
    if not state or any(key not in state for key in store.slices[i] if key != MASTER):
        return  # the optimizer creates its state at its first step: nothing to speculate on yet
    rollback = spec.rollback(i)
    second = rollback is Rollback.SECOND_REGION
    mode.guard(i, other=second)  # an asynchronous checkpoint may still read the region this writes
    group = spec.base.param_groups[opt.sub_group_to_group_id[i]]
    lp_dtype = opt.fp16_partitioned_groups_flat[i].dtype
    # A device tensor among Adam's small state or the group's entries (a capturable step, a
    # tensor learning rate) may have been written on the compute stream: the snapshot waits.
    queued = mode.copies.mark() if on_device(state, group) else None
    state_before = group_before = None
    cast, kept = {}, {}
    try:
        try:
            # From the compute stream's pool (``copies.alloc``), for work on the side stream, all
            # dropped after the compute stream joined the side stream, so that their blocks go back
            # in the compute stream's order: the fp32 gradient (one buffer for the whole backward,
            # ``decide``), the 16-bit cast, kept until the step (``step_ends``), and the device copy
            # of the state before (``commit``).
            grad, grad_ready = _grad_buffer(spec, master)
            cast, cast_ready = mode.copies.alloc({lp_dtype: master.numel()}, used_by=JOINED)
            lp = cast[lp_dtype]
            if not second:
                kept, kept_ready = mode.copies.alloc(store.region_numel(i), used_by=JOINED)
            with mode.copies.side():  # backward goes on: nothing on the compute stream waits for this
                table.arrive(i)
                mode.copies.compute_waits(spec.final_event.pop(i, None))
                mode.copies.compute_waits(grad_ready)  # the compute stream's last use of the blocks
                mode.copies.compute_waits(cast_ready)
                mode.copies.compute_waits(queued)
                mode.copies.uses(writes=(grad, lp))
                if kept:  # the state before, to roll back to
                    mode.copies.compute_waits(kept_ready)
                    loaded = table[i].buffers
                    mode.copies.uses(reads=loaded.values(), writes=kept.values())
                    for dt, buf in kept.items():
                        buf.copy_(loaded[dt].narrow(0, 0, buf.numel()))
                state_before, group_before = small_state(state, store.slices[i]), group_entries(group)
                mode.tensors.point_at(i, lambda key: table.view(i, key))
                master.grad = _fp32_grad(spec, i, grad)
                # unscale_and_clip_grads's factor when clipping does not fire: 1 / loss scale,
                # bitwise the same whether DeepSpeed computes it as a tensor (clipping on) or a float (off)
                master.grad.mul_(1. / opt.loss_scale)
                opt._optimizer_step(i)
                master.grad = None
                lp.copy_(master.data)  # the cast DeepSpeed's _reassign_or_swap_out... does
                state_after, group_after = small_state(state, store.slices[i]), group_entries(group)
                table.mark_updated(i)
        except BaseException:
            if table[i].on_device:
                table.unload(i)  # its device copy may be half updated: the step loads it again
            raise
        finally:  # whatever happened (an out-of-memory error in backward), the state is as it was
            master.grad = None
            if state_before is not None:
                with mode.copies.side():
                    restore_state(state, state_before)
                    restore_group(group, group_before)
            mode.tensors.point_at(i, lambda key: store.view(i, key))  # the committed state, until a commit
        nbytes, span = table.write_back(i, other=second)
    except BaseException:
        mode.copies.free(*cast.values(), *kept.values())  # dropped with this frame, with no join
        raise
    if mode.stats is not None:
        mode.stats.bytes_d2h += nbytes
        mode.stats.span("d2h", span)
        mode.stats.speculated += 1
    spec.updated[i] = Speculated(state_after, group_after, group_before, float(opt.loss_scale), lp,
                                 kept or None)
    spec.counters.speculated += 1
    spec.counters.from_device += not second

def _grad_buffer(spec, master: torch.Tensor):
    """The fp32 gradient buffer for ``master``'s update (a view of its first ``numel`` elements),
    and what a write into it waits for (None after the first: the updates run one after the other
    on the side stream). One buffer, the largest member's size, for every update of a backward:
    allocated at the first, dropped after the compute stream joined the side stream (``decide``,
    ``discard_all``). A block per update, recorded on the side stream, would go back to the
    allocator only once the host saw the side stream's event: meanwhile the next updates' would
    take other blocks, leaving the pool in pieces."""
    ready = None
    if spec.grad_buffer is None:
        bufs, ready = spec.mode.copies.alloc({master.dtype: spec.grad_numel}, used_by=JOINED)
        spec.grad_buffer = bufs[master.dtype]
    return spec.grad_buffer.narrow(0, 0, master.numel()), ready

def _fp32_grad(spec, i: int, out: torch.Tensor) -> torch.Tensor:
    """The sub-group's flat fp32 gradient, in ``out``: what ``_prepare_fp32_grad_for_sub_group``
    builds (the partitions the epilogue will list, flattened, zeros for a frozen parameter,
    widened to fp32: exact, so widening each slice is bitwise the same)."""
    partitions = getattr(spec.opt, "_DeepSpeedZeroOptimizer_Stage3__param_id_to_grad_partition")
    offset = 0
    for p in spec.opt.fp16_groups[i]:
        n = p.ds_tensor.numel()
        if p.requires_grad:
            out.narrow(0, offset, n).copy_(partitions[p.ds_id].view(-1))
        else:
            out.narrow(0, offset, n).zero_()
        offset += n
    assert offset == out.numel(), f"deepspeed-offload: sub-group {i}: {offset} gradient elements for {out.numel()}"
    return out
