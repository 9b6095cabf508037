"""One optimizer step as an object: from its first backward to DeepSpeed's outcome.

DeepSpeed, not the order in which sub-groups go by, says how a step ends. ZeRO-3's ``step()``
either walks every sub-group and then calls ``_post_step`` (the update loop ran: **applied**), or
returns before the loop because it found an overflow or a non-finite gradient norm (it sets
``optimizer.overflow``: **skipped**), or raises (**raised**). ``hooks.py`` tells the lifecycle each
of those three, and the engine counts the step in ``global_steps`` right after.

``StepLifecycle`` owns the current ``Step`` and closes it exactly once per call of DeepSpeed's
``step()``, whatever the placement (every sub-group resident, every one streamed, or a split), the
mode, the gradient accumulation or the framework that drives the engine. Everything that happens
between two steps runs from ``close`` and only from there, in this order:

1. the step's own end in the mode (``StreamMode.step_applied`` / ``step_skipped`` / ``abort_step``):
   the load policy's bookkeeping, the statistics handed to ``step_stats()``;
2. for an applied step: the placement (``StreamMode.between_steps``: the measured plan's moves,
   speculation's members with them) and the copy events that have landed (``prune_in_flight``).

Phases of a step: ``BACKWARD`` (a backward ran since the last close), ``STEPPING`` (DeepSpeed's
``step()`` entered), ``UPDATED`` (its loop over the sub-groups is done: ``_post_step``), then
``CLOSED`` with an ``Outcome``.
"""

import enum
import time
from dataclasses import dataclass, field
from typing import Optional


class Outcome(enum.Enum):
    APPLIED = "applied"  # DeepSpeed updated every sub-group
    SKIPPED = "skipped"  # DeepSpeed returned before updating anything (overflow, non-finite norm)
    RAISED = "raised"  # DeepSpeed's step raised


class StepPhase(enum.Enum):
    BACKWARD = "backward"
    STEPPING = "stepping"
    UPDATED = "updated"
    CLOSED = "closed"


# What may follow what; ``Step.move`` refuses the rest.
_NEXT = {
    StepPhase.BACKWARD: {StepPhase.BACKWARD, StepPhase.STEPPING},
    StepPhase.STEPPING: {StepPhase.UPDATED, StepPhase.CLOSED},
    StepPhase.UPDATED: {StepPhase.CLOSED},
    StepPhase.CLOSED: set(),
}


@dataclass
class Step:
    """One optimizer step. ``index``: the ``global_steps`` DeepSpeed will give it (counted skipped or not)."""
    index: int
    phase: StepPhase = StepPhase.BACKWARD
    input_numel: int = 0  # the largest input a forward of it took (``hooks.input_numel``), 0: unknown
    began: float = field(default_factory=time.perf_counter)
    entered: Optional[float] = None  # when DeepSpeed's step() began
    closed: Optional[float] = None
    outcome: Optional[Outcome] = None

    def move(self, phase: StepPhase):
        if phase not in _NEXT[self.phase]:
            raise RuntimeError(f"deepspeed-offload: step {self.index} cannot go from {self.phase.value} to "
                               f"{phase.value}")
        self.phase = phase

    @property
    def step_s(self) -> Optional[float]:
        """Seconds in DeepSpeed's step(), to its outcome."""
        return None if self.entered is None or self.closed is None else self.closed - self.entered

    @property
    def iteration_s(self) -> Optional[float]:
        """Seconds from the first backward (or the step's entry) to the outcome: one iteration's work
        after its first forward."""
        return None if self.closed is None else self.closed - self.began


class StepLifecycle:
    """The steps of one attached engine: which one is open, and the one place a step ends.

    ``mode``: the ``StreamMode`` (or compile mode) whose verbs run at each point."""

    def __init__(self, mode):
        self.mode = mode
        self.current: Optional[Step] = None
        self.last: Optional[Step] = None
        self.applied = 0  # steps DeepSpeed applied since attach
        self.skipped = 0
        self.raised = 0

    def _global_steps(self) -> int:
        return int(getattr(self.mode.engine, "global_steps", 0) or 0)

    def _open(self) -> Step:
        if self.current is None:
            self.current = Step(index=self._global_steps() + 1)
        return self.current

    # ------------------------------------------------------------------ what DeepSpeed tells us

    def forward_input(self, numel: int):
        """A forward of this step took an input of ``numel`` elements."""
        step = self._open()
        step.input_numel = max(step.input_numel, numel)

    def backward_begins(self):
        self._open()
        self.mode.backward_begins()

    def step_entered(self) -> Step:
        step = self._open()
        step.move(StepPhase.STEPPING)
        step.entered = time.perf_counter()
        self.mode.step_entered()
        return step

    @property
    def stepping(self) -> bool:
        return self.current is not None and self.current.phase is StepPhase.STEPPING

    def updates_done(self):
        """DeepSpeed's loop over the sub-groups is over (``_post_step`` begins): everything updated."""
        if not self.stepping:
            return  # _post_step outside step() (a load path): not ours to end
        self.current.move(StepPhase.UPDATED)
        self.mode.updates_done()

    def close(self, raised: bool = False) -> Step:
        """DeepSpeed's ``step()`` returned or raised: the one place a step ends, its outcome decided,
        and the work between steps runs. Returned after its loop (``updates_done``): applied; returned
        before it (it set ``optimizer.overflow``: fp16 overflow, a non-finite norm): skipped."""
        if self.current is None or self.current.phase is StepPhase.BACKWARD:
            self.step_entered()  # (a caller that did not say the step began)
        step = self.current
        outcome = Outcome.RAISED if raised else \
            Outcome.APPLIED if step.phase is StepPhase.UPDATED else Outcome.SKIPPED
        step.move(StepPhase.CLOSED)
        step.outcome, step.closed = outcome, time.perf_counter()
        self.current, self.last = None, step
        mode = self.mode
        if outcome is Outcome.RAISED:
            self.raised += 1
            mode.abort_step()
        elif outcome is Outcome.SKIPPED:
            self.skipped += 1
            mode.step_skipped()
        else:
            self.applied += 1
            mode.step_applied(step)
            mode.between_steps(step)
        return step
