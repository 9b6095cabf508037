"""Device memory that offloaded sub-groups' buffers of their own hold, counted for the load policy.

Buffers of a sub-group's own (loaded early, ahead of the step) are allocated with ``record_stream``
on both copy streams: dropped after its write-back is queued, a block goes back to the allocator,
which hands it out again only once the copies queued by then have ended. Memory taken meanwhile is
new memory, so until those copies end the dropped buffers still count: early loads then stay within
the iteration's peak in memory reserved as well as allocated. Events are asked without waiting, and
at a gradient hook only the oldest (``held``: the bytes are a running count, and a copy that ended
behind one still running counts a little longer), all of them once a step (``prune``).
"""

from collections import deque
from typing import Deque, Optional, Tuple


class DeviceHolds:

    def __init__(self, copies):
        self.copies = copies
        self.early_bytes = 0  # bytes held in buffers of their own (loaded ahead of the step)
        self.in_flight: Deque[Tuple[object, int]] = deque()  # (copy event, bytes) of buffers dropped while a copy used them
        self.in_flight_bytes = 0

    def took(self, nbytes: int):
        self.early_bytes += nbytes

    def dropped(self, nbytes: int, last_copy: Optional[object]):
        """Buffers of ``nbytes`` dropped; the allocator holds their blocks until ``last_copy`` ends."""
        self.early_bytes -= nbytes
        if last_copy is not None:
            self.in_flight.append((last_copy, nbytes))
            self.in_flight_bytes += nbytes

    def copying(self, event, nbytes: int):
        """Device memory of ``nbytes`` not the table's (a rollback's copy) dropped while ``event``'s copy reads it."""
        self.in_flight.append((event, nbytes))
        self.in_flight_bytes += nbytes

    def held(self) -> int:
        """Device memory buffers of their own hold: those in use, and those dropped whose copy has not
        ended (the oldest asked, until one has not)."""
        while self.in_flight and self.copies.done(self.in_flight[0][0]):
            self.in_flight_bytes -= self.in_flight.popleft()[1]
        return self.early_bytes + self.in_flight_bytes

    def prune(self) -> int:
        """Forget the dropped buffers whose copies have ended, every one asked; returns how many are left."""
        self.in_flight = deque((ev, n) for ev, n in self.in_flight if not self.copies.done(ev))
        self.in_flight_bytes = sum(n for _, n in self.in_flight)
        return len(self.in_flight)
