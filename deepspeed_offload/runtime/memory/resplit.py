"""The one place the split between resident and streamed sub-groups changes after attach.

``placement.py`` decides how many of the first sub-groups stay on the device (``k``); this moves
them, between steps, with every write-back landed: sub-groups that stop streaming get device copies
of their host state, copied beside the next backward and unpinned over the next steps (``arrival.py``), those
that start streaming get theirs locked again (``repin``) and their state written into it. DeepSpeed's
tensor objects stay the same; only their ``.data`` moves.
"""


def resplit(mode, k: int) -> bool:
    """From the next step on, the first ``k`` sub-groups of ``mode`` are resident. Returns whether
    anything moved."""
    old, new = mode.layout, mode.probe.split(k)
    if new.resident == old.resident:
        return False
    mode.discard_speculation("placement changed")
    mode.synchronize_for_checkpoint()  # (a switch still copying lands too: arrival.wait)
    mode.table.unload_all()
    to_device = [i for i in new.resident if i in old.order]
    to_host = [i for i in old.resident if i in new.order]
    switch = mode.arrival.allocate(to_device)  # first: out of memory here leaves the split as it was
    for i in to_host:  # an asynchronous checkpoint may still be reading their regions
        mode.guard(i, other=None)
    if to_host:  # ... or copying the resident state that leaves the device (its reference holds the memory)
        mode.guard_resident()
    mode.store.repin(to_host)
    for i in to_host:
        mode.tensors.move_into(i, lambda key: mode.store.view(i, key))
    moved = mode.probe.resident_bytes(len(new.resident)) - mode.probe.resident_bytes(len(old.resident))
    mode.layout, mode.order, mode.resident, mode.slot_bytes = new, new.order, new.resident, new.slot_bytes
    mode.arrival.start(switch)  # after the bookkeeping (its copies wait for the next backward)
    mode.table.set_offloaded(new.order, new.slot_numel)
    mode.tensors.order = new.order
    mode.timing.slot_bytes = new.slot_bytes
    mode.timing.shift(moved)
    # the loads ahead of the step follow the new order; every offloaded sub-group speculates (those given
    # back join again, with the second regions the store kept for them); colocation learns of it
    mode.early.reset()
    if mode.speculation is not None:
        mode.speculation.set_members(new.order)
    mode.colocation.layout_changed()
    return True
