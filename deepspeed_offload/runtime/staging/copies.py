"""The copy executor: how state moves between the host store and device buffers, chosen once.

Two implementations with one interface, picked by ``make_copies()`` at attach (the way
``torch.optim.adam`` picks its implementation once instead of branching in the loop):

- ``AsyncCopies`` (a GPU): an H2D stream and a D2H stream of their own (and a side stream for work
  that must not hold the compute stream up: speculated updates), events to order them
  against the compute stream, ``record_stream`` so that the caching allocator does not hand a
  buffer to anyone else before the copies that use it are done. Nothing here blocks the CPU
  except ``wait_host`` (and ``elapsed``, when stats are read).
- ``SyncCopies`` (the CPU accelerator: device memory is host memory, there are no streams): every
  copy runs at once, events are ``None``, waits are no-ops. The runtime's bookkeeping is the same
  code, so CI tests it for real.

The executor knows nothing of sub-groups or phases: ``runtime/memory/residency.py`` decides what waits on
what and passes the events in.
"""

import contextlib
import time
from typing import Dict, Iterable, Optional, Tuple

import torch
from deepspeed.accelerator import get_accelerator

Buffers = Dict[torch.dtype, torch.Tensor]
# Which streams use a device buffer (``alloc``'s ``used_by``): the copy streams and the side stream;
# the side stream alone, and dropped only after ``join_side``.
COPIES, JOINED = "copies", "joined"
Span = Optional[Tuple[object, object]]  # two clock tokens, resolved by ``elapsed``


class SyncCopies:
    """Synchronous copies on a device without streams (DeepSpeed's CPU accelerator)."""

    synchronous = True

    def __init__(self, acc=None):
        self.acc = acc or get_accelerator()

    def alloc(self, numel: Dict[torch.dtype, int], used_by: str = COPIES) -> Tuple[Buffers, object]:
        """Device buffers, and what a copy into them must wait for (None: nothing). ``used_by``: the
        streams that will use them (``COPIES`` or ``JOINED``, see ``AsyncCopies.alloc``)."""
        device = self.acc.current_device_name()
        return {dt: torch.empty(n, dtype=dt, device=device) for dt, n in numel.items()}, None

    def h2d(self, dst: Buffers, src: Buffers, waits: Iterable[object]) -> Tuple[object, Span]:
        t0 = time.perf_counter()
        for dt, region in src.items():
            dst[dt].narrow(0, 0, region.numel()).copy_(region)
        return None, (t0, time.perf_counter())

    def d2h(self, dst: Buffers, src: Buffers, waits: Iterable[object]) -> Tuple[object, Span]:
        t0 = time.perf_counter()
        for dt, region in dst.items():
            region.copy_(src[dt].narrow(0, 0, region.numel()))
        return None, (t0, time.perf_counter())

    def mark(self) -> object:
        """An event at the current stream's position (None: everything is done already)."""
        return None

    def side(self):
        """Run what follows on a third stream, beside the compute stream (here: where it is)."""
        return contextlib.nullcontext()

    def join_side(self) -> None:
        """The compute stream waits for everything queued on the side stream so far."""

    def free(self, *tensors: torch.Tensor, read_by_copies: bool = False) -> None:
        """JOINED buffers about to be dropped without a join (``AsyncCopies.free``)."""

    def written_by_copies(self, *tensors: torch.Tensor) -> None:
        """Device tensors allocated on the compute stream that a copy stream writes: their blocks are
        not reused before the copies queued by the time they are freed end (here: nothing runs later)."""

    def compute_waits(self, event) -> None:
        pass

    def uses(self, reads=(), writes=()) -> None:
        """The current stream reads ``reads`` and writes ``writes`` (device buffers) from here on. The
        runtime says so where it hands buffers to a stream, for a test executor that checks the
        order (``tests/e2e/stream_order.py``); the streams themselves need nothing."""

    def wait_host(self, event) -> None:
        pass

    def done(self, event) -> bool:
        """Whether ``event``'s work has ended, asked without waiting."""
        return True

    def clock(self) -> object:
        return time.perf_counter()

    def elapsed(self, start, end) -> float:
        return end - start


class AsyncCopies:
    """Copies on two streams of their own, ordered by events (a GPU)."""

    synchronous = False

    def __init__(self, acc=None):
        self.acc = acc or get_accelerator()
        self.h2d_stream = self.acc.Stream()
        self.d2h_stream = self.acc.Stream()
        self.side_stream = self.acc.Stream()  # speculated updates: backward does not wait for them
        # the streams ``alloc`` records its buffers on, by ``used_by``
        self._recorded_on = {COPIES: (self.h2d_stream, self.d2h_stream, self.side_stream), JOINED: ()}

    def _event(self, stream, timing=False):
        ev = self.acc.Event(enable_timing=timing)
        ev.record(stream)
        return ev

    def alloc(self, numel: Dict[torch.dtype, int], used_by: str = COPIES) -> Tuple[Buffers, object]:
        # On the compute stream, so the blocks come from (and go back to) the pool activations use.
        # The allocator may hand out blocks the compute stream's queued work still reads: a copy
        # into them waits for the event returned here. Work for the side stream allocates here too:
        # its own pool would hold the blocks for it alone, and the compute stream's next forward
        # could not reuse them. When the buffers are dropped, their blocks must not be reused before
        # the other streams' work on them is done:
        # - COPIES (loads, slots): record_stream on both copy streams and the side stream, so the
        #   allocator reuses the blocks once the work queued on those by then has run;
        # - JOINED (the updates' fp32 gradient buffer, their 16-bit casts): not recorded. The holder
        #   drops them only after the compute stream waited for the side stream (``join_side`` on it),
        #   so the blocks go back in the compute stream's order, at once, even while the host runs
        #   ahead of the device. A recorded block goes back only once the host has seen the event
        #   complete: the next forward's first allocations, queued while the step still runs, would
        #   take new segments.
        #   Where that join cannot be promised (a discard on DeepSpeed's reduction stream or from
        #   outside the step; an error), the holder calls ``free`` first.
        device = self.acc.current_device_name()
        bufs = {dt: torch.empty(n, dtype=dt, device=device) for dt, n in numel.items()}
        for buf in bufs.values():
            for stream in self._recorded_on[used_by]:
                buf.record_stream(stream)
        return bufs, self._event(self.acc.current_stream())

    def _wait(self, stream, waits):
        for ev in waits:
            if ev is not None:
                stream.wait_event(ev)

    def h2d(self, dst: Buffers, src: Buffers, waits: Iterable[object]) -> Tuple[object, Span]:
        with self.acc.stream(self.h2d_stream):
            self._wait(self.h2d_stream, waits)
            for dt, region in src.items():
                dst[dt].narrow(0, 0, region.numel()).copy_(region, non_blocking=True)
            return self._event(self.h2d_stream), None

    def d2h(self, dst: Buffers, src: Buffers, waits: Iterable[object]) -> Tuple[object, Span]:
        with self.acc.stream(self.d2h_stream):
            self._wait(self.d2h_stream, waits)
            start = self._event(self.d2h_stream, timing=True)
            for dt, region in dst.items():
                region.copy_(src[dt].narrow(0, 0, region.numel()), non_blocking=True)
            done = self._event(self.d2h_stream, timing=True)
        return done, (start, done)

    def mark(self) -> object:
        return self._event(self.acc.current_stream())

    def side(self):
        # Everything in the block (its waits, allocations, kernels, marks) is on the side stream;
        # memory allocated there returns to that stream's pool.
        return self.acc.stream(self.side_stream)

    def join_side(self) -> None:
        self.acc.current_stream().wait_stream(self.side_stream)

    def free(self, *tensors: torch.Tensor, read_by_copies: bool = False) -> None:
        """JOINED buffers about to be dropped where the stream they came from may not have joined the
        side stream: recorded on it now (and on the D2H stream, ``read_by_copies``: a copy queued there
        reads them), so the allocator waits for the work queued there by then."""
        for t in tensors:
            t.record_stream(self.side_stream)
            if read_by_copies:
                t.record_stream(self.d2h_stream)

    def written_by_copies(self, *tensors: torch.Tensor) -> None:
        for t in tensors:
            t.record_stream(self.h2d_stream)

    def compute_waits(self, event) -> None:
        # (the current stream: the compute stream, or the side stream inside ``side()``)
        if event is not None:
            self.acc.current_stream().wait_event(event)

    def uses(self, reads=(), writes=()) -> None:
        pass  # (``SyncCopies.uses``)

    def wait_host(self, event) -> None:
        if event is not None:
            event.synchronize()

    def done(self, event) -> bool:
        return event is None or event.query()

    def clock(self) -> object:
        return self._event(self.acc.current_stream(), timing=True)

    def elapsed(self, start, end) -> float:
        end.synchronize()
        return start.elapsed_time(end) / 1000.0


def make_copies(acc=None):
    """The executor for this process's accelerator."""
    acc = acc or get_accelerator()
    if acc.is_synchronized_device() or acc.device_name() == "cpu":
        return SyncCopies(acc)
    return AsyncCopies(acc)
