"""A copy executor for the CPU that behaves like a GPU's copy streams at their most hostile, and checks
that every buffer is handed between streams in an order a GPU would keep.

``DeferredCopies`` has ``AsyncCopies``' interface, but a copy does not run when it is queued: it runs
only when something waits for its event (the compute stream before it reads the buffers, the CPU
before it reads host state, a later copy that must come after it), and then reads its source as
it is at that moment, as a copy engine would. A missing wait between copies and the CPU therefore
makes a load read stale host state, or a slot be refilled before its write-back read it, and the
results differ from plain ZeRO-3. New device buffers are filled with NaN, so reading one before its
load ran shows too.

The computation cannot run late on the CPU, so its order is checked instead: every event and wait
goes through a ``StreamOrder`` (``stream_order.py``: the compute, side, H2D, D2H and reduction
streams and the host as vector clocks), and every access to a buffer handed between them (the
copies', an allocation's, the runtime's ``uses``, DeepSpeed's) must come after the accesses it
depends on. ``violations`` counts the ones that do not (``first_violations`` describes a few; the
tests want none), ``accesses`` the ones checked. One rule of its own: a buffer allocated ``JOINED``
(not recorded on the side stream) goes back to the compute stream's pool when it is dropped, so the
compute stream must have waited for every use of it by then, or the buffer must have been handed to
``release`` first; ``unjoined_drops`` counts the drops that broke that (also violations),
``joined_allocs`` shows the check saw some. ``release`` is checked as the allocator would reuse the
block: on a GPU a released buffer is recorded on the side stream, and on the D2H stream too where
the caller says a queued copy reads it (``read_by_copies``: a rollback's copy of the state before back
over its host region), and its next user may write it once the work queued by then on those streams
and on the stream it was allocated on has run. Every access to it must be ordered before that;
``released_in_use`` counts the releases that were not (also violations), and such a buffer is filled
with NaN at once, as the block's next user might, so that a copy still to read it copies NaN.

``drop_slot_wait=True`` is the negative control: every load ignores what its destination waits for
(the runtime passes ``(previous write-back, destination ready...)``; for a place in a staging slot,
the write-backs of the sub-groups there before it), so a slot is refilled before its write-back read
it, which parity must catch.
The device-memory policy is the CPU accelerator's (``synchronous``: no limits derived from memory).
"""

import contextlib
import time
import weakref

import torch

from deepspeed_offload.runtime.staging.copies import COPIES, JOINED
from stream_order import StreamOrder, key_of


class _Queue:
    """A copy stream's copies, in queue order: (fn, events it waits for), and how many have run."""

    def __init__(self, name):
        self.name = name
        self.ops = []
        self.done = 0


class DeferredCopies:
    synchronous = True  # the CPU accelerator's memory policy; the copies themselves are deferred

    def __init__(self, drop_slot_wait=False):
        self.order = StreamOrder()
        self.h2d_stream = _Queue("h2d")
        self.d2h_stream = _Queue("d2h")
        self.drop_slot_wait = drop_slot_wait
        self.deferred = 0  # copies that were still queued when the next copy was queued behind them
        self.allocs = 0
        self.joined_allocs = 0
        self.unjoined_drops = 0  # JOINED buffers dropped before the compute stream waited for their uses
        self._released = set()  # keys of JOINED buffers handed to release
        self._pools = {}  # keys of JOINED buffers -> the stream they were allocated on (whose pool they go back to)
        self.released_in_use = 0  # buffers released while a stream they were not recorded on still used them

    @property
    def violations(self) -> int:
        return self.order.violations

    @property
    def first_violations(self):
        return list(self.order.first)

    @property
    def accesses(self) -> int:
        return self.order.accesses

    # ------------------------------------------------------------------ copies, run when waited for

    def _queue(self, queue, fn, waits):
        self.deferred += queue.done < len(queue.ops)
        queue.ops.append((fn, waits))
        return self.order.mark(queue.name, queue, len(queue.ops))

    def _complete(self, event):
        if event is None or event.queue is None:  # (the computation's events: it ran already)
            return
        queue = event.queue
        while queue.done < event.index:
            fn, waits = queue.ops[queue.done]
            for w in waits:
                self._complete(w)
            fn()
            queue.done += 1

    def _copy(self, queue, reads, writes, waits, copy):
        """Queue ``copy`` on ``queue`` after ``waits``; it reads ``(label, tensors)`` and writes ``(label, tensors)``."""
        waits = [w for w in waits if w is not None]
        for w in waits:
            self.order.wait(w, queue.name)
        for (label, tensors), write in ((reads, False), (writes, True)):
            for t in tensors:
                self.order.access(t, write=write, stream=queue.name, label=label)
        return self._queue(queue, copy, waits), None

    def h2d(self, dst, src, waits):
        waits = tuple(waits)
        if self.drop_slot_wait:
            waits = waits[:1]

        def copy():
            for dt, region in src.items():
                dst[dt].narrow(0, 0, region.numel()).copy_(region)

        return self._copy(self.h2d_stream, ("a host region", src.values()), ("a device buffer", [dst[dt] for dt in src]),
                          waits, copy)

    def d2h(self, dst, src, waits):

        def copy():
            for dt, region in dst.items():
                region.copy_(src[dt].narrow(0, 0, region.numel()))

        return self._copy(self.d2h_stream, ("a device buffer", [src[dt] for dt in dst]), ("a host region", dst.values()),
                          waits, copy)

    # ------------------------------------------------------------------ device memory

    def alloc(self, numel, used_by=COPIES):
        bufs = {dt: torch.full((n, ), float("nan"), dtype=dt) for dt, n in numel.items()}
        for buf in bufs.values():
            self.allocs += 1
            self.order.fresh(buf, f"{used_by} buffer {self.allocs} ({buf.dtype}, {buf.numel()})")
            if used_by == JOINED:
                self.joined_allocs += 1
                self._pools[key_of(buf)] = self.order.current
            weakref.finalize(buf, self._dropped, key_of(buf), used_by == JOINED)
        return bufs, self.order.mark()  # a copy into them waits for the compute work queued before

    def written_by_copies(self, *tensors):
        """Device tensors made on the compute stream for a copy to fill (a switch to resident): NaN until
        it runs, as a new block may hold anything, so that a read before its wait shows."""
        for t in tensors:
            self.allocs += 1
            if t.is_floating_point():
                t.fill_(float("nan"))
            self.order.fresh(t, f"a switch's tensor {self.allocs} ({t.dtype}, {t.numel()})")

    def _dropped(self, key, joined):
        if key is None:
            return
        if joined and key not in self._released:
            # its block goes back to the compute stream, which may reuse it at once
            self.unjoined_drops += not self.order.access(key, write=True, stream="compute")
        self._released.discard(key)
        self._pools.pop(key, None)
        self.order.forget(key)

    def free(self, *tensors, read_by_copies=False):
        """JOINED buffers about to be dropped without a join: ``AsyncCopies`` records them on the side
        stream (and on the D2H stream, ``read_by_copies``), so their blocks are reused after the work
        queued by now on those streams and on the stream they were allocated on. An access to one
        that is not ordered before that reuse (a D2H copy still queued to read it, not recorded) is a
        violation; the buffer is filled with NaN, as the block's next user may write it first."""
        recorded = ("side", "d2h") if read_by_copies else ("side", )
        for t in tensors:
            key = key_of(t)
            self._released.add(key)
            if key is None:
                continue
            if not self.order.reused(key, (self._pools.get(key, "compute"), *recorded)):
                self.released_in_use += 1
                if t.is_floating_point():
                    t.fill_(float("nan"))

    # ------------------------------------------------------------------ the streams' order

    def mark(self):
        return self.order.mark()

    @contextlib.contextmanager
    def side(self):
        with self.order.on("side"):
            yield

    def join_side(self):
        self.order.wait_stream("side")

    def compute_waits(self, event):
        self.order.wait(event)
        self._complete(event)

    def wait_host(self, event):
        self.order.wait(event, "host")
        self._complete(event)

    def done(self, event):
        """Whether ``event``'s copy has run (the computation's events: always)."""
        return event is None or event.queue is None or event.queue.done >= event.index

    def uses(self, reads=(), writes=()):
        for t in reads:
            self.order.access(t, write=False)
        for t in writes:
            self.order.access(t, write=True)

    def clock(self):
        return time.perf_counter()

    def elapsed(self, start, end):
        return end - start
