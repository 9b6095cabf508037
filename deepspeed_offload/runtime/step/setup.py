"""Stream mode's attach and detach: its parts built in order, and taken apart again.

Attach is one transaction (``runtime/attach.py``): ``build`` creates the parts a step uses (the host
store, pinned; the residency table; the load policy and, with the budget derived, the measured plan;
DeepSpeed's tensors moved onto the store; speculation, the early loads, colocation; the hooks; the
asynchronous checkpointer), passing a ``fault_point`` after each stage that changed something, and
a failure anywhere is undone by ``undo`` on this rank. ``detach`` takes a working mode apart on
every rank, the engine and the optimizer left as DeepSpeed built them.
"""

from deepspeed.utils import log_dist

from ...handle import HANDLE_ATTR
from ...sizing.host_memory import format_bytes
from .. import agreement
from ..attach import Placement, fault_point
from ..checkpoint import ALIGN, AsyncCheckpointer
from ..colocation.offload_states import StateOffload
from ..memory import allocator
from ..memory.arrival import Arrival
from ..memory.host_store import HostStore
from ..memory.iteration_memory import DeviceMemory
from ..memory.placement import MeasuredPlan, device_limit, margin_bytes
from ..memory.residency import ResidencyTable
from ..memory.state_tensors import StateTensors
from ..patches import PatchRegistry
from ..speculation import members
from ..speculation.updates import Speculation
from . import hooks
from .early_loads import EarlyLoads
from .grad_norm import GroupNorms
from .load_timing import LoadTiming
from .moves import Moves


def build(mode, placement: Placement, early_in_backward: bool):
    cfg = mode.cfg
    speculating, twins = members.choose_members(mode, early_in_backward, placement.twins_budget)
    mode.store = HostStore(mode.layout.entries, cfg.pin_memory, twins=twins, check_host=False)
    fault_point("pinning")
    mode.table = ResidencyTable(mode.store, mode.copies, mode.order, mode.layout.slot_numel)
    mode.memory = DeviceMemory(mode.acc)
    mode.arrival = Arrival(mode)  # sub-groups the measured plan makes resident, on their way (moves.py)
    mode.moves = Moves(mode)  # the one place the split changes after attach
    mode.timing = LoadTiming(mode.memory, mode.copies.synchronous, mode.slot_bytes,
                             early_in_backward=cfg.overlap and early_in_backward, prefetch=cfg.prefetch,
                             early_cap=None if cfg.overlap_memory_gb is None else int(cfg.overlap_memory_gb * 2**30))
    # The measured plan (budget derived, a device with memory of its own): it needs the measurement.
    mode.plan = None
    if placement.host_first and not mode.copies.synchronous and early_in_backward:
        measure_with(mode, mode.memory)
    elif not mode.copies.synchronous and early_in_backward:
        allocator.hold_for(mode)  # every budget: the early loads' allowances are allocated peaks, kept in reserved
    mode.tensors = StateTensors(mode.opt, mode.store, mode.order)
    mode.speculation = Speculation(mode, speculating) if speculating else None
    mode.early = EarlyLoads(mode)
    mode.colocation = StateOffload(mode)
    mode.tensors.all_to_host()  # what exists now: masters; states too if the optimizer stepped
    mode.acc.empty_cache()
    fault_point("moving")
    mode.norms = GroupNorms(mode.opt)  # DeepSpeed's norm at the step's start, without a wait per sub-group
    hooks.install(mode)
    mode.checkpoint_patches = PatchRegistry("deepspeed-offload async checkpoint")  # close() takes them off
    if cfg.async_checkpoint:  # with a buffer for its copies aside where attach's node plan had room
        mode.checkpointer = AsyncCheckpointer(mode.engine, mode.store.buffers.values(), mode.checkpoint_patches,
                                              aside_bytes=placement.aside_budget and mode.store.side_bytes(ALIGN),
                                              owners=lambda: mode.tensors.owners(mode.resident))
    fault_point("patching")


def measure_with(mode, memory: DeviceMemory):
    """Place by measurement (``MeasuredPlan``), reading the device's memory through ``memory`` (tests
    on the CPU accelerator give one whose figures they script: the plan and the load policy then
    decide as on a device with memory of its own)."""
    mode.memory = mode.timing.acc = memory
    mode.timing.synchronous = False
    limit = device_limit(memory, mode.cfg.max_device_memory_gb)
    mode.plan, mode.timing.measure_always = MeasuredPlan(limit=limit, margin=margin_bytes(limit)), True
    agreement.cpu_group()  # the moves agree over it at every step and forward (made here: on every rank)
    allocator.hold_for(mode)  # the plan reads reserved memory: no free pieces of segments in it (one hold per mode)


def log_attach(mode):
    n = len(mode.opt.fp32_partitioned_groups_flat)
    store = mode.store
    # INFO, like DeepSpeed's own attach lines: shown once the user sets DeepSpeed's logger to info.
    log_dist(f"[deepspeed-offload] stream mode: {len(mode.order)} of {n} sub-groups offloaded "
             f"({len(mode.resident)} resident{', the rest measured after the second step' if mode.plan else ''}), "
             f"{sum(len(store.slices[i]) for i in mode.order)} tensors, this rank's host store "
             f"{format_bytes(store.nbytes - store.twin_nbytes)}"
             f"{f' and second regions {format_bytes(store.twin_nbytes)}' if store.twin_nbytes else ''}: "
             f"{store.pinning.describe()}, 2 staging slots of {format_bytes(mode.slot_bytes)}, "
             f"overlap={'on' if mode.overlap else 'off'}; attached in {mode.attach_s:.1f} s", ranks=[0])
    if mode.speculation is not None:
        members.log_attach(mode.speculation)


def undo(mode):
    """Attach failed (here, or on another rank once this one was built): every hook off, every
    tensor moved to the host back on the device, on this rank alone (no collective: ``detach``
    waits for checkpoints with the other ranks)."""
    mode.run_on_detach()
    if mode.checkpointer is not None:
        mode.checkpointer.forget()  # no save ran: nothing to wait for
    if getattr(mode, "checkpoint_patches", None) is not None:
        mode.checkpoint_patches.remove_all()
    mode.patches.remove_all()
    if mode.store is not None and getattr(mode, "tensors", None) is not None:
        mode.tensors.back_to_device(mode.acc.current_device_name())


def detach(mode):
    """Write everything back, point the optimizer's tensors at device copies of their state again, and
    remove every hook (the engine and optimizer methods are DeepSpeed's own again)."""
    mode.colocation.refuse_if_offloaded("detach()")
    mode.run_on_detach()
    mode.discard_speculation("detach")
    if mode.checkpointer is not None:
        mode.checkpointer.close()  # waits for the last save (collective), removes its hooks
        mode.checkpointer = None
    mode.synchronize_for_checkpoint()
    mode.table.unload_all()
    mode.tensors.back_to_device(mode.acc.current_device_name())
    mode.patches.remove_all()
    if getattr(mode.engine, HANDLE_ATTR, None) is mode:
        delattr(mode.engine, HANDLE_ATTR)
