"""Happens-before on the CPU: a GPU's streams as vector clocks, and a race check on every buffer the
runtime hands from one stream to another.

On a GPU the step's work runs on six queues: the compute stream, the side stream (speculated
updates), the H2D and D2H copy streams, DeepSpeed's reduction stream, and the host. Work on one
queue comes after work on another only through an event it waited for (``compute_waits``, a copy's
``waits``, ``join_side``, DeepSpeed's ``wait_stream``), or, for work the host queues, through what the
host itself waited for first (``wait_host``, a ``synchronize``). ``StreamOrder`` keeps one vector
clock per queue and applies exactly those rules, so it knows for any two operations whether a GPU
must run them in the order the host issued them.

On the CPU everything runs at once, in the host's order, so nothing can be made to run late; each
access is checked instead, as a race detector does. Every buffer handed between queues has a record
of its last write and of the reads since (queue and position in it); a read must be ordered after the
last write, a write after the last write and every read since. An access that is not is a
*violation*: on a GPU it may read a buffer before it is written or overwrite it before it is read.
The accesses checked are the copies' own (``h2d``/``d2h``: the host region and the device buffer),
an allocation (a block the caching allocator hands out may still be in use by the compute stream's
earlier work), a drop of a ``JOINED`` buffer (its block goes back to the compute stream at once),
a ``release`` of one (its block's next user writes it after the streams it was recorded on: ``reused``),
those the runtime declares where it hands buffers to a stream (``copies.uses``: ``arrive``,
``mark_updated``, a speculated update, a commit's copy), and DeepSpeed's own, which
``declare_deepspeed`` adds around its methods (with ``offload_states()``' copies of the resident
sub-groups, ``declare_colocation``).

Which wait each check guards, and the test that fails without it: docs/architecture.md, "Ordering,
checked on the CPU".
"""

import contextlib
from typing import Dict, List, Optional, Tuple

import torch

STREAMS = ("compute", "side", "h2d", "d2h", "reduce", "host")
KEEP = 8  # violations described in full; the rest are counted


class Event:
    """A point on ``stream``: the vector clock it had there. A copy's event also names the deferred
    queue and how many of its copies must have run (``deferred_copies.py``)."""

    __slots__ = ("stream", "clock", "queue", "index")

    def __init__(self, stream: str, clock: Dict[str, int], queue=None, index: int = 0):
        self.stream, self.clock, self.queue, self.index = stream, clock, queue, index

    def __repr__(self):
        return f"Event({self.stream}#{self.clock.get(self.stream, 0)})"


def _merge(into: Dict[str, int], other: Dict[str, int]):
    for s, n in other.items():
        if into.get(s, 0) < n:
            into[s] = n


def key_of(t: torch.Tensor) -> Optional[Tuple[int, int, int]]:
    """A buffer is known by its allocation and its bytes in it, (allocation, first, end): views that
    share bytes are one buffer where they overlap (a staging slot and the places packed in it).
    None: an empty tensor, which nothing can race on."""
    if not t.numel():
        return None
    first = t.data_ptr()
    return t.untyped_storage().data_ptr(), first, first + t.numel() * t.element_size()


class StreamOrder:
    """The queues' vector clocks, the current stream, each buffer's last accesses, the violations."""

    def __init__(self):
        self.clocks: Dict[str, Dict[str, int]] = {s: {} for s in STREAMS}
        self._current = ["compute"]
        # allocation -> its buffers (byte ranges), each [label, last write (stream, position) or None,
        # {stream: position of its last read since}, first, end]
        self._buffers: Dict[int, List[list]] = {}
        self.accesses = 0  # accesses checked
        self.violations = 0
        self.first = []  # the first KEEP violations, described

    @property
    def current(self) -> str:
        return self._current[-1]

    @contextlib.contextmanager
    def on(self, stream: str):
        """What follows runs on ``stream`` (``side()``, DeepSpeed's reduction)."""
        self._current.append(stream)
        try:
            yield
        finally:
            self._current.pop()

    def _tick(self, stream: str) -> Dict[str, int]:
        """One more operation on ``stream``, queued by the host: after everything the host waited for."""
        clock = self.clocks[stream]
        if stream != "host":
            _merge(clock, self.clocks["host"])
        clock[stream] = clock.get(stream, 0) + 1
        return clock

    def mark(self, stream: str = None, queue=None, index: int = 0) -> Event:
        stream = stream or self.current
        return Event(stream, dict(self._tick(stream)), queue, index)

    def wait(self, event: Optional[Event], stream: str = None):
        """``stream`` (the current one) goes on only after ``event``."""
        if event is not None:
            _merge(self.clocks[stream or self.current], event.clock)

    def wait_stream(self, waited: str, stream: str = None):
        """``stream`` (the current one) goes on only after everything queued on ``waited`` so far."""
        _merge(self.clocks[stream or self.current], self.clocks[waited])

    def _overlapping(self, key) -> List[list]:
        base, first, end = key
        return [rec for rec in self._buffers.get(base, ()) if rec[3] < end and first < rec[4]]

    def _record(self, key, label: str) -> list:
        """The record of exactly ``key``'s bytes (made if there is none)."""
        base, first, end = key
        recs = self._buffers.setdefault(base, [])
        for rec in recs:
            if rec[3] == first and rec[4] == end:
                return rec
        rec = [label, None, {}, first, end]
        recs.append(rec)
        return rec

    def name(self, t: torch.Tensor, label: str):
        """Give ``t``'s buffer a name for the violations' descriptions (before its first access)."""
        k = key_of(t)
        if k is not None:
            self._record(k, label)

    def fresh(self, t: torch.Tensor, label: str, stream: str = None):
        """A new allocation in ``t``: written now by ``stream`` (whatever was known of the address before
        is forgotten; a copy into it waits for the allocation's event)."""
        k = key_of(t)
        if k is not None:
            self.forget(k)
            stream = stream or self.current
            self._record(k, label)[1] = (stream, self._tick(stream)[stream])

    def forget(self, t_or_key):
        """The buffer is gone (its block went back to the allocator)."""
        k = t_or_key if isinstance(t_or_key, tuple) else key_of(t_or_key)
        if k is not None:
            gone = self._overlapping(k)
            self._buffers[k[0]] = [rec for rec in self._buffers.get(k[0], ()) if all(rec is not g for g in gone)]

    def _check(self, k, clock: Dict[str, int], write: bool, who: str, recs: List[list]) -> bool:
        """Whether a read (a write) at ``clock`` comes after the last write (and the reads since) of each
        of ``recs``; counts and describes each one it does not."""
        ordered = True
        for rec in recs:
            before = [("write", rec[1])] if rec[1] is not None else []
            if write:
                before += [("read", r) for r in rec[2].items()]
            unordered = [(kind, s, n) for kind, (s, n) in before if clock.get(s, 0) < n]
            for kind, s, n in unordered:
                self.violations += 1
                if len(self.first) < KEEP:
                    self.first.append(f"{who} {'writes' if write else 'reads'} {rec[0]} (at {k[1]:#x}) unordered "
                                      f"after {s}'s {kind} #{n} ({who} has waited for {s} up to #{clock.get(s, 0)})")
            ordered = ordered and not unordered
        return ordered

    def reused(self, t_or_key, after) -> bool:
        """The buffer's block goes back to the allocator now, and its next user may write it as soon as
        the work queued so far on the streams ``after`` has run (the stream whose pool it returns to,
        those it was recorded on; and whatever the host has waited for): returns whether every access
        to it is ordered before that (if not, the violations are counted and described). The accesses
        stay recorded: a later one is checked as before."""
        k = t_or_key if isinstance(t_or_key, tuple) or t_or_key is None else key_of(t_or_key)
        if k is None:
            return True
        clock = dict(self.clocks["host"])
        for s in after:
            _merge(clock, self.clocks[s])
        self.accesses += 1
        return self._check(k, clock, True, f"a reuse after {'+'.join(after)}", self._overlapping(k))

    def forget_reads(self, t: torch.Tensor, stream: str):
        """``stream``'s reads of ``t`` so far no longer count (their results were thrown away)."""
        k = key_of(t)
        for rec in self._overlapping(k) if k is not None else ():
            rec[2].pop(stream, None)

    def access(self, t_or_key, write: bool, stream: str = None, label: str = "a buffer") -> bool:
        """``stream`` (the current one) reads or writes the buffer now; returns whether that is ordered
        after the accesses it must follow, to any buffer sharing bytes with it (if not, the violation
        is counted and described)."""
        k = t_or_key if isinstance(t_or_key, tuple) or t_or_key is None else key_of(t_or_key)
        if k is None:
            return True
        stream = stream or self.current
        clock = self._tick(stream)
        self.accesses += 1
        ordered = self._check(k, clock, write, stream, self._overlapping(k) or [self._record(k, label)])
        rec = self._record(k, next((r[0] for r in self._overlapping(k) if r[3] == k[1] and r[4] == k[2]), label))
        if write:
            rec[1], rec[2] = (stream, clock[stream]), {}
        else:
            rec[2][stream] = clock[stream]
        return ordered


# ---------------------------------------------------------------------- DeepSpeed's own work on the streams

MANGLED = "_DeepSpeedZeroOptimizer_Stage3__"


def declare_deepspeed(mode):
    """Tell ``mode.copies`` (an executor with a ``StreamOrder``) what DeepSpeed's ZeRO-3 code does on the
    streams, as its CUDA path does it, by wrapping the optimizer's methods and the module's forward.
    Installed before the stream mode's own hooks, which then wrap these (DeepSpeed's epilogue
    synchronizes the reduction stream before the stream mode's hook on it runs speculated updates):

    - ``__add_grad_to_ipg_bucket``: the reduction stream waits for the compute stream (``wait_stream``);
    - ``__reduce_and_partition_ipg_grads``: runs on the reduction stream, and its ``partition_grads``
      writes each parameter's gradient partition there;
    - ``independent_gradient_partition_epilogue``: the host waits for the reduction stream
      (``synchronize``), so what it queues afterwards comes after every reduction;
    - a forward reads every 16-bit partition (its all-gathers, on the compute stream);
    - ``_reassign_or_swap_out_partitioned_parameters`` writes the sub-group's 16-bit partition on the
      compute stream (the step's copy of the updated master);
    - ``_post_step`` (the step's loop is over) all-gathers the persistent parameters on the compute
      stream: it reads the 16-bit partitions of the sub-groups that hold them, before the next forward;
    - a speculated update reads its sub-group's gradient partitions (``speculation/compute.py``'s ``_fp32_grad``, on the
      side stream). A parameter reduced again after its sub-group's update read its partition voids
      that update (``Speculation.discard``): those reads no longer count, their result is dropped;
    - the readers of host state (``state_dict``, ``_get_fp32_opt_state_partition``) read, on the host,
      the host store ``offload_states()`` put the resident sub-groups in (``declare_colocation``).
    """
    opt, order, spec = mode.opt, mode.copies.order, mode.speculation
    flats = opt.fp16_partitioned_groups_flat

    def partitions():  # (the views of DeepSpeed's gradient buffer, by parameter)
        return getattr(opt, MANGLED + "param_id_to_grad_partition")

    for ds_id, part in partitions().items():
        order.name(part, f"the gradient partition of parameter {ds_id}")
    for i, flat in enumerate(flats):
        if flat is not None:
            order.name(flat, f"sub-group {i}'s 16-bit partition")

    def wrap(name, make):
        setattr(opt, name, make(getattr(opt, name)))

    def add_grad(orig):

        def call(*args, **kwargs):
            order.wait_stream("compute", stream="reduce")
            return orig(*args, **kwargs)

        return call

    def on_reduction_stream(orig):

        def call(*args, **kwargs):
            with order.on("reduce"):
                return orig(*args, **kwargs)

        return call

    def partition_grads(orig):

        def call(params_to_release, grad_partitions):
            params = list(params_to_release)  # DeepSpeed clears its list
            result = orig(params_to_release, grad_partitions)
            for p in params:
                part = partitions().get(p.ds_id)
                if part is None:
                    continue
                i = spec.group_of.get(p.ds_id) if spec is not None else None
                if i in getattr(spec, "updated", ()) and p.ds_id in spec._seen.get(i, ()):
                    order.forget_reads(part, "side")  # reduced again: that update is discarded now
                order.access(part, write=True)
            return result

        return call

    def epilogue(orig):

        def call(*args, **kwargs):
            result = orig(*args, **kwargs)
            order.wait_stream("reduce", stream="host")
            return result

        return call

    def reassign(orig):

        def call(sub_group_id, *args, **kwargs):
            result = orig(sub_group_id, *args, **kwargs)
            if flats[sub_group_id] is not None:
                order.access(flats[sub_group_id], write=True)
            return result

        return call

    def post_step(orig):  # its all-gather of the persistent parameters reads their 16-bit partitions

        def call(*args, **kwargs):
            persistent = {id(p) for p in getattr(opt, "persistent_parameters", ())}
            for i, params in enumerate(opt.fp16_groups):
                if flats[i] is not None and any(id(p) in persistent for p in params):
                    order.access(flats[i], write=False)
            return orig(*args, **kwargs)

        return call

    wrap(MANGLED + "add_grad_to_ipg_bucket", add_grad)
    wrap(MANGLED + "reduce_and_partition_ipg_grads", on_reduction_stream)
    wrap("partition_grads", partition_grads)
    wrap("independent_gradient_partition_epilogue", epilogue)
    wrap("_reassign_or_swap_out_partitioned_parameters", reassign)
    wrap("_post_step", post_step)

    def forward_reads(module, args):
        for flat in flats:
            if flat is not None:
                order.access(flat, write=False)

    mode.engine.module.register_forward_pre_hook(forward_reads)

    def host_reads(orig):  # (the readers of host state: the optimizer's tensors, the resident ones in a host store)

        def call(*args, **kwargs):
            for store in {id(s): s for s in mode.colocation.resident_on_host.values()}.values():
                for buf in store.buffers.values():
                    order.access(buf, write=False, stream="host")
            return orig(*args, **kwargs)

        return call

    for name in ("state_dict", "_get_fp32_opt_state_partition"):
        wrap(name, host_reads)
    declare_colocation(mode)

    if spec is not None:
        # (a module function: wrapped once per process, it records only this engine's speculation)
        from deepspeed_offload.runtime.speculation import compute
        fp32_grad = compute._fp32_grad

        def reads_partitions(spec_, i, out):
            if spec_ is spec:
                for p in opt.fp16_groups[i]:
                    if p.requires_grad:
                        order.access(partitions()[p.ds_id], write=False)
            return fp32_grad(spec_, i, out)

        compute._fp32_grad = reads_partitions


def declare_colocation(mode):
    """``offload_states()``' copies of the resident sub-groups' state into a host store
    (``StateOffload._move_resident``): the compute stream writes the store's buffers, and with
    ``non_blocking`` off the copy makes the host wait for the compute stream (a copy to host memory
    that is not asynchronous returns once it is done). A reader of host state reads them on the host
    (``declare_deepspeed``): after a non-blocking offload only ``wait_for_copies`` orders that."""
    colocation, order = mode.colocation, mode.copies.order
    move = colocation._move_resident

    def moved(kind, to, non_blocking, *args, **kwargs):
        result = move(kind, to, non_blocking, *args, **kwargs)
        if to is not None:
            for buf in to.buffers.values():
                order.access(buf, write=True, stream="compute", label="the resident sub-groups' host store")
            if not non_blocking:
                order.wait_stream("compute", stream="host")
        return result

    colocation._move_resident = moved
