"""A copy executor for the CPU that behaves like a GPU's copy streams at their most hostile.

``DeferredCopies`` has ``AsyncCopies``' interface, but a copy does not run when it is queued: it runs
only when something waits for its event (the compute stream before it reads the buffers, the CPU
before it reads host state, a later copy that must come after it), and then reads its source as
it is at that moment, as a copy engine would. The runtime's waits are therefore all that orders
the copies against the computation and against each other: a missing wait makes a load read stale
host state, or a slot be refilled before its write-back read it, and the results differ from plain
ZeRO-3. New device buffers are filled with NaN, so reading one before its load ran shows too.

``drop_slot_wait=True`` is the negative control: every load ignores what its destination waits for
(the runtime passes ``(destination ready, previous write-back)``; for a staging slot, the slot's last
write-back), so a slot is refilled before its write-back read it, which parity must catch.
The device-memory policy is the CPU accelerator's (``synchronous``: no limits derived from memory).

The side stream's work runs eagerly here, but the executor checks the one rule a GPU's caching
allocator would punish silently: a buffer allocated ``JOINED`` (not recorded on the side stream) must
be dropped only after the compute stream joined the side stream, if the side stream ran anything since,
or be handed to ``release`` first (``unjoined_drops`` counts the ones that were neither;
``joined_allocs`` shows the check saw some).
"""

import contextlib
import time
import weakref

import torch

from deepspeed_offload.runtime.copies import COPIES, JOINED


class _Stream:

    def __init__(self, name):
        self.name = name
        self.ops = []  # (fn, events it waits for), in queue order
        self.done = 0  # how many of them have run


class _Event:
    """Done once ``stream`` has run its first ``index`` ops."""

    def __init__(self, stream, index):
        self.stream, self.index = stream, index


class DeferredCopies:
    synchronous = True  # the CPU accelerator's memory policy; the copies themselves are deferred

    def __init__(self, drop_slot_wait=False):
        self.h2d_stream = _Stream("h2d")
        self.d2h_stream = _Stream("d2h")
        self.drop_slot_wait = drop_slot_wait
        self.deferred = 0  # copies that were still queued when the next copy was queued behind them
        self.side_since_join = False  # the side stream ran something the compute stream has not joined
        self.joined_allocs = 0
        self.unjoined_drops = 0  # JOINED buffers dropped while side_since_join, not released
        self._released = set()  # ids of JOINED buffers handed to release

    def _queue(self, stream, fn, waits):
        self.deferred += stream.done < len(stream.ops)
        stream.ops.append((fn, [w for w in waits if w is not None]))
        return _Event(stream, len(stream.ops))

    def _complete(self, event):
        if event is None:
            return
        stream = event.stream
        while stream.done < event.index:
            fn, waits = stream.ops[stream.done]
            for w in waits:
                self._complete(w)
            fn()
            stream.done += 1

    def alloc(self, numel, used_by=COPIES):
        bufs = {dt: torch.full((n, ), float("nan"), dtype=dt) for dt, n in numel.items()}
        if used_by == JOINED:
            for buf in bufs.values():
                self.joined_allocs += 1
                weakref.finalize(buf, self._joined_dropped, id(buf))
        return bufs, None

    def _joined_dropped(self, key):
        if key in self._released:
            self._released.discard(key)
        else:
            self.unjoined_drops += self.side_since_join

    def release(self, *tensors):
        self._released.update(id(t) for t in tensors)

    def h2d(self, dst, src, waits):
        waits = tuple(waits)
        if self.drop_slot_wait:
            waits = waits[1:]

        def copy():
            for dt, region in src.items():
                dst[dt].narrow(0, 0, region.numel()).copy_(region)

        return self._queue(self.h2d_stream, copy, waits), None

    def d2h(self, dst, src, waits):

        def copy():
            for dt, region in dst.items():
                region.copy_(src[dt].narrow(0, 0, region.numel()))

        return self._queue(self.d2h_stream, copy, waits), None

    def mark(self):
        return None  # the computation runs eagerly on the CPU: done when it is queued

    @contextlib.contextmanager
    def side(self):  # the computation is eager: one stream of it
        self.side_since_join = True
        yield

    def join_side(self):
        self.side_since_join = False

    def compute_waits(self, event):
        self._complete(event)

    def wait_host(self, event):
        self._complete(event)

    def done(self, event):
        return event is None or event.stream.done >= event.index

    def clock(self):
        return time.perf_counter()

    def elapsed(self, start, end):
        return end - start
