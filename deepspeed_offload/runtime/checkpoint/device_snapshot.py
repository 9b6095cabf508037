"""A save's device tensors (the state the measured plan keeps resident) copied to the host behind the
training loop's back.

``save_checkpoint`` returns once these copies are queued. One thread of its own copies each tensor in
pieces through two small pinned bounce buffers: device to bounce on a stream of its own (after the
compute stream's position at the save), bounce to the tensor's host snapshot while the next piece is
in flight. The tensors go in the order the step overwrites them (sub-group by sub-group).
``Regions`` (keyed by device addresses) says which are still to be copied: before the step updates
a resident sub-group it waits for that sub-group's tensors only (``AsyncCheckpointer.guard_resident``),
and the writer waits for all of them before it serializes. The snapshot holds its own reference to
each source, so a tensor whose ``.data`` is rebound meanwhile (a give-back, ``offload_states()``)
keeps its old storage alive until it is copied.

On the CPU accelerator (no streams) the same thread copies each tensor at once.
"""

from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import List, Tuple

import torch
from deepspeed.accelerator import get_accelerator
from deepspeed.utils import logger

from ...sizing.host_memory import format_bytes
from .regions import Regions

PIECE = 64 << 20  # bytes of each bounce buffer (two of them, pinned, made at the first save that uses them)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _flat_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


class DeviceSnapshot:
    """Copies (host destination, device source) pairs in the background, one save at a time."""

    def __init__(self, acc=None, piece_bytes: int = PIECE):
        self.acc = acc or get_accelerator()
        self.synchronous = self.acc.is_synchronized_device() or self.acc.device_name() == "cpu"
        self.piece_bytes = int(piece_bytes)
        self._pool = None
        self._stream = None
        self._bounce: List[torch.Tensor] = []

    def start(self, pairs: List[Tuple[torch.Tensor, torch.Tensor]]) -> Tuple[Regions, Future]:
        """Queue the copies of ``pairs`` (contiguous tensors, in the order the step overwrites their
        sources). Returns the device ranges still to be copied and the future of the copies."""
        regions = Regions()
        for _, src in pairs:
            regions.add(src.data_ptr(), _nbytes(src))
        mark = None
        if not self.synchronous:
            if self._stream is None:
                self._stream = self.acc.Stream()
                self._bounce = [self._bounce_buffer() for _ in range(2)]
            mark = self.acc.Event()
            mark.record(self.acc.current_stream())  # the sources as they are now, at the save
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="deepspeed-offload-ckpt-d2h")
        return regions, self._pool.submit(self._run, pairs, regions, mark)

    def _bounce_buffer(self) -> torch.Tensor:
        buf = torch.empty(self.piece_bytes, dtype=torch.uint8)
        try:
            return self.acc.pin_memory(buf)
        except RuntimeError as e:  # pageable: each piece's copy then blocks this thread, not the loop
            logger.warning(f"[deepspeed-offload] async checkpoint: a {format_bytes(self.piece_bytes)} bounce "
                           f"buffer could not be pinned ({e}); the resident state is copied through pageable memory")
            return buf

    def _run(self, pairs, regions: Regions, mark):
        try:
            if self.synchronous:
                for dst, src in pairs:
                    dst.copy_(src)
                    regions.done(src.data_ptr(), _nbytes(src))
                return
            self._through_bounce(pairs, regions, mark)
        except BaseException:
            if self._stream is not None:
                self._stream.synchronize()  # no piece still reads a source the caller may now free
            regions.free()  # nothing waits for a snapshot that failed: the save fails in the writer
            raise

    def _through_bounce(self, pairs, regions: Regions, mark):
        stream, inflight = self._stream, deque()  # (event, bounce piece, destination piece, source done)
        with self.acc.stream(stream):
            stream.wait_event(mark)
            k = 0
            for dst, src in pairs:
                n, src_bytes, dst_bytes = _nbytes(src), _flat_bytes(src), _flat_bytes(dst)
                for lo in range(0, n, self.piece_bytes):
                    m = min(self.piece_bytes, n - lo)
                    if len(inflight) == len(self._bounce):
                        self._land(inflight.popleft(), regions)  # that bounce buffer is free again
                    bounce = self._bounce[k % len(self._bounce)].narrow(0, 0, m)
                    bounce.copy_(src_bytes.narrow(0, lo, m), non_blocking=True)
                    event = self.acc.Event()
                    event.record(stream)
                    last = (src.data_ptr(), n) if lo + m >= n else None
                    inflight.append((event, bounce, dst_bytes.narrow(0, lo, m), last))
                    k += 1
            while inflight:
                self._land(inflight.popleft(), regions)

    @staticmethod
    def _land(item, regions: Regions):
        event, bounce, dst, last = item
        event.synchronize()
        dst.copy_(bounce)
        if last is not None:
            regions.done(*last)

    def close(self):
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        self._bounce, self._stream = [], None
