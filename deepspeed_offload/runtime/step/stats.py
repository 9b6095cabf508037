"""``StepStats``: what one streamed step moved and where its time went, recorded without a device
synchronization (device timings are events, resolved when the stats are read), and the step line
logged every ``steps_per_print`` steps (``line``).

The keys of ``step_stats()``: ``bytes_h2d`` / ``bytes_d2h`` (state copied to / from the device),
``offloaded`` / ``resident`` (sub-groups streamed / kept on the device this step), ``sub_groups``
(updated by the step itself), ``committed`` (updated in backward, taken by the step: ``sub_groups +
committed == offloaded``), ``speculated`` / ``discarded`` (updated in backward / rolled back),
``settled`` (of the speculated, the casts written into their 16-bit partitions as the step began),
``give_backs`` / ``take_backs`` / ``moves_failed`` (the measured plan's moves since attach that landed
with state going back to the host / made resident, and those undone: ``moves.py``),
``loaded_early`` (in backward), ``loaded_in_step`` (in the step, ``loaded_at_entry`` of them while
DeepSpeed computed the norm; ``bytes_in_step`` of ``bytes_h2d``: what the step itself waits to move),
``h2d_wait_s`` (the compute stream waiting for loads: exposed copy time), ``update_s``, ``d2h_s``
(device seconds), ``step_s`` (wall seconds in DeepSpeed's ``step()``), ``iteration_s`` (wall seconds
from the step's first forward to its end), ``input_numel`` (its largest forward input, in elements).
"""

import logging
from typing import Dict, List, Optional

from deepspeed.utils import log_dist, logger

from ...sizing.host_memory import format_bytes


class StepStats:
    """What one step moved and where its time went. Device timings are read lazily (``resolve``),
    so recording them costs no synchronization."""

    KINDS = ("h2d_wait", "update", "d2h")

    def __init__(self, copies):
        self.copies = copies
        self.bytes_h2d = 0
        self.bytes_d2h = 0
        self.sub_groups = 0  # sub-groups the step updated (the ones it committed from backward are not)
        self.offloaded = 0  # sub-groups offloaded in this step
        self.resident = 0  # sub-groups whose state stayed on the device
        self.step_s = None  # seconds in DeepSpeed's step(), to its outcome (StepLifecycle)
        self.iteration_s = None  # ... from the step's first backward
        self.input_numel = 0  # the largest forward input of the step, in elements (0: not seen)
        self.loaded_early = 0  # sub-groups loaded before the step (in backward)
        self.loaded_in_step = 0
        self.loaded_at_entry = 0  # ... of them, loaded as DeepSpeed's step began, before its norm
        self.bytes_in_step = 0  # the bytes of loaded_in_step
        self.speculated = 0  # sub-groups updated in backward (speculation.py) ...
        self.committed = 0  # ... whose update the step took
        self.discarded = 0  # ... and dropped (clipping, overflow)
        self.settled = 0  # ... whose casts went into their 16-bit partitions as the step began
        self.moves = (0, 0, 0)  # give-backs, take-backs and failed moves since attach (moves.py)
        self._spans: Dict[str, List] = {kind: [] for kind in self.KINDS}

    def loaded(self, nbytes: int, early: bool, span):
        """A sub-group's state started to load: early (in backward) or in the step, where ``span`` times
        what the step waits for it."""
        self.bytes_h2d += nbytes
        if early:
            self.loaded_early += 1
        else:
            self.loaded_in_step += 1
            self.bytes_in_step += nbytes
            self.span("h2d_wait", span)  # a synchronous copy in the step: time the step waits

    def span(self, kind, span):
        if span is not None:
            self._spans[kind].append(span)

    def resolve(self) -> Dict[str, float]:
        out = {"bytes_h2d": self.bytes_h2d, "bytes_d2h": self.bytes_d2h, "sub_groups": self.sub_groups, "offloaded": self.offloaded,
               "resident": self.resident, "step_s": self.step_s, "iteration_s": self.iteration_s,
               "input_numel": self.input_numel,
               "loaded_early": self.loaded_early, "loaded_in_step": self.loaded_in_step,
               "bytes_in_step": self.bytes_in_step,
               "loaded_at_entry": self.loaded_at_entry,
               "speculated": self.speculated, "committed": self.committed, "discarded": self.discarded,
               "settled": self.settled, "give_backs": self.moves[0], "take_backs": self.moves[1],
               "moves_failed": self.moves[2]}
        for kind, spans in self._spans.items():
            out[f"{kind}_s"] = sum(self.copies.elapsed(a, b) for a, b in spans)
        return out

    def log_every(self, engine, index: int, host_store: int, memory):
        """The step line on rank 0 at every ``steps_per_print``-th step, as DeepSpeed logs its own."""
        every = engine.steps_per_print() if callable(getattr(engine, "steps_per_print", None)) else None
        if every and index % every == 0 and logger.isEnabledFor(logging.INFO):
            log_dist(self.line(index, host_store, memory.memory_allocated(), memory.memory_reserved()), ranks=[0])

    def line(self, index: int, host_store: int, allocated: int, reserved: int) -> str:
        """The step line (rank 0, every ``steps_per_print`` steps, DeepSpeed's logger at info)."""
        s = self.resolve()

        def sec(v: Optional[float]) -> str:
            return "-" if v is None else f"{v:.3f} s"

        return (f"[deepspeed-offload] step {index}: iteration {sec(s['iteration_s'])}, step {sec(s['step_s'])}, "
                f"copy wait {s['h2d_wait_s']:.3f} s; sub-groups {s['resident']} resident, {s['offloaded']} streamed "
                f"({s['loaded_early']} loaded in backward); updates in backward {s['speculated']} speculated, "
                f"{s['committed']} committed, {s['discarded']} rolled back; moved {format_bytes(s['bytes_h2d'])} in, "
                f"{format_bytes(s['bytes_d2h'])} out; host store {format_bytes(host_store)}; device "
                f"{format_bytes(allocated)} allocated, {format_bytes(reserved)} reserved")
