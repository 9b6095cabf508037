"""``finish(engine)``: end a distributed run so that no process aborts at exit.

On gloo (the CPU, or any gloo group), a collective's work object holds its tensors, and the last
reference to a finished work is often dropped by one of gloo's worker threads; a tensor that Python
has seen needs the GIL to be freed. If that happens after the interpreter began to finalize,
CPython ends the thread inside a destructor and the process aborts ("terminate called without an
active exception", exit -6), after all the training went well. ZeRO-3 ends every step with a
gather of the persistent parameters, so the last collectives of a run are still being retired when
a short script returns. ``finish`` retires them while the interpreter is alive: on every gloo group
the engine uses it runs a barrier (which waits for all earlier work of the group and keeps what was
still in progress alive through its own work object) and keeps that barrier's handle, so the last
of those objects is freed by Python on the main thread. Then it destroys the process groups.
"""

from typing import List

_retired: List[object] = []  # the final barriers' handles: freed by the interpreter, on the main thread


def _groups(engine):
    """The process groups the engine's collectives ran on, the world group included, in one order
    on every rank (by name: torch names groups in the order they were created)."""
    import torch.distributed as dist
    found = {id(dist.group.WORLD): dist.group.WORLD}
    for owner, attr in ((engine, "data_parallel_group"), (engine.optimizer, "dp_process_group")):
        group = getattr(owner, attr, None)
        if group is not None:
            found[id(group)] = group
    for p in engine.module.parameters():
        group = getattr(p, "ds_process_group", None)
        if group is not None:
            found[id(group)] = group
    return sorted(found.values(), key=lambda g: (len(g.group_name), g.group_name))


def finish(engine=None):
    """Call on every rank as the last thing the script does with ``engine``: waits for its
    asynchronous checkpoint (raising, on every rank, if it failed), retires the collectives gloo may
    still be finishing, and destroys the process groups."""
    import deepspeed.comm as ds_comm
    import torch.distributed as dist

    from .runtime.checkpoint import wait_for_checkpoint
    if engine is not None:
        wait_for_checkpoint(engine)
    if not dist.is_initialized():
        return
    for group in _groups(engine) if engine is not None else [dist.group.WORLD]:
        if dist.get_backend(group) == "gloo":
            work = dist.barrier(group=group, async_op=True)
            work.wait()
            _retired.append(work)
    ds_comm.destroy_process_group()
