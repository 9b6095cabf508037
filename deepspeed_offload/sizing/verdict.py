"""One verdict for every way ``deepspeed-offload estimate`` is asked, and what would make a job fit.

Three questions can fail, and the answer names the one that does, with its figures:

- **the iteration alone**: with all of the optimizer state on the host, what the iteration holds on
  the GPU (the 16-bit parameters and gradients, the activations, the staging slots) and the plan's
  margin are more than the GPU has;
- **the state beside the iteration**: the state the host cannot hold (or a ``memory_budget_gb`` keeps
  resident) does not fit on the GPU beside the iteration;
- **the state on the host**: a ``memory_budget_gb`` leaves more state to the host than it can hold.

Where the model's shape is known, each way out is tried before it is named (``Sizer``: fit.py asks the
same question at another micro-batch, with gradient checkpointing, over more ranks, at another
budget): the largest micro-batch that fits, checkpointing, the fewest ranks that fit,
``memory_budget_gb``, host memory. ``estimate`` exits 1 on DOES NOT FIT, whichever way it was asked.
"""

from dataclasses import dataclass, field
from typing import List, Optional

from .host_memory import format_bytes

FITS, SPLIT, DOES_NOT_FIT, UNKNOWN = "fits", "split", "does not fit", "unknown"
ITERATION, BESIDE, HOST = "the iteration alone", "the state beside the iteration", "the state on the host"
# The ranks a way out tries, as multiples of the job's (ZeRO-3 splits the state and the 16-bit
# parameters and gradients over them; the activations stay).
RANK_FACTORS = (2, 4, 8, 16, 32, 64)


@dataclass(frozen=True)
class Verdict:
    kind: str  # FITS, SPLIT, DOES_NOT_FIT or UNKNOWN
    reason: str = ""  # what does not fit, with its figures (or what the answer lacks)
    what: Optional[str] = None  # ITERATION, BESIDE or HOST
    ways_out: List[str] = field(default_factory=list)  # changes that make it fit, each one tried

    @property
    def exit_code(self) -> int:
        return 1 if self.kind == DOES_NOT_FIT else 0

    def line(self) -> str:
        """``verdict: KIND`` and, where it does not fit, what and how to change it."""
        head = f"verdict: {self.kind.upper()}"
        if self.kind == DOES_NOT_FIT:
            out = f"{head}: {self.what}: {self.reason}"
            ways = "; ".join(self.ways_out) if self.ways_out else \
                "none of a smaller micro-batch, checkpointing, more ranks or memory_budget_gb is enough"
            return f"{out}\n  to make it fit: {ways}"
        return f"{head}: {self.reason}" if self.reason else head

    def as_dict(self) -> dict:
        return {"kind": self.kind, "what": self.what, "reason": self.reason, "ways_out": list(self.ways_out)}


def judge(sizer, batch: int, resident: int, fits: bool) -> Verdict:
    """The verdict of ``sizer`` (fit.py's ``Sizer``: the job as asked) at micro-batch ``batch``, where
    its placement keeps ``resident`` bytes of each rank's state on the GPU and ``fits`` says whether that
    works; where it does not, what fails and every change that makes it fit."""
    state = sizer.state()
    if fits:
        return Verdict(FITS if resident >= state else SPLIT)
    gib, alone = format_bytes, sizer.memory(batch, 0)
    room = sizer.device - sizer.margin
    if sizer.budget_gb is not None and state - resident > sizer.host_cap:
        what = HOST
        reason = (f"memory_budget_gb {sizer.budget_gb:g} leaves {gib(state - resident)} of each rank's "
                  f"{gib(state)} of state to the host, which can hold {gib(sizer.host_cap)} a rank")
    elif alone.peak_reserved > room:
        what = ITERATION
        logits = sizer.logit_bytes(batch)
        reason = (f"with all of the optimizer state on the host, the iteration reserves {gib(alone.peak_reserved)} "
                  f"of the GPU's {gib(sizer.device)}" + (f" less the plan's margin of {gib(sizer.margin)}"
                                                          if sizer.margin else "")
                  + f": activations {gib(alone.activations)} ({gib(logits)} of them the logits' 12 bytes each at the "
                  f"loss, {sizer.shape.vocab_size:,} x {batch * sizer.seq:,} tokens), the 16-bit parameters, "
                  f"gradients and buckets {gib(alone.between)}, the staging slots {gib(alone.slots)}")
    elif sizer.budget_gb is not None:
        what = BESIDE
        reason = (f"memory_budget_gb {sizer.budget_gb:g} keeps {gib(resident)} resident, and beside it the "
                  f"iteration reserves {gib(sizer.memory(batch, resident).peak_reserved)} of the GPU's "
                  f"{gib(sizer.device)}")
    else:
        what = BESIDE
        keep = state - min(state, sizer.host_cap)
        reason = (f"the host can hold {gib(min(state, sizer.host_cap))} of each rank's {gib(state)} of state; "
                  f"the other {gib(keep)} must stay on the GPU, which has {gib(max(0, room - alone.besides_state))} "
                  f"beside the iteration ({gib(alone.besides_state)} of {gib(sizer.device)}, less the plan's "
                  f"margin of {gib(sizer.margin)})")
    return Verdict(DOES_NOT_FIT, reason, what, ways_out(sizer, batch, what))


def ways_out(sizer, batch: int, what: str) -> List[str]:
    """Each change that makes the job fit, tried one at a time."""
    out = []
    if what != HOST:
        smaller = sizer.largest_batch()
        if smaller:
            out.append(f"micro-batch {smaller} (the largest that fits)")
    if not sizer.checkpointing:
        checked = sizer.largest_batch(checkpointing=True)
        if checked >= batch:
            out.append(f"gradient checkpointing (model.gradient_checkpointing_enable(); micro-batch {batch} then "
                       f"fits, up to {checked})")
        elif checked:
            out.append(f"gradient checkpointing and micro-batch {checked}")
    for factor in RANK_FACTORS:
        if sizer.fits(batch, world=sizer.world * factor):
            out.append(f"{sizer.world * factor} ranks instead of {sizer.world} (ZeRO-3 splits the state, the 16-bit "
                       f"parameters and their gradients over them; at {sizer.host_cap_text()} of host memory a rank)")
            break
    if sizer.budget_gb is not None:
        budget = sizer.fitting_budget(batch)
        if budget is not None:
            out.append(f"memory_budget_gb {budget:g}" if budget > 0 or what == HOST else "memory_budget_gb 0")
        elif sizer.fits(batch, budget_gb=None):
            out.append("memory_budget_gb null (the measured plan: the host takes what it can, the GPU the rest)")
    elif what == BESIDE:
        host = sizer.host_needed(batch)
        if host is not None:
            out.append(f"{format_bytes(host)} of usable host memory a rank (here {sizer.host_cap_text()})")
    return out


def for_split(placement: dict, host_cap: int) -> Verdict:
    """The verdict where the iteration's figure is given (``--iteration-memory-gb``, the figure the
    measured plan logs) instead of the model's shape: the measured plan's split (node_plan.split)."""
    gib = format_bytes
    if placement["fits"]:
        return Verdict(FITS if not placement["streamed"] else SPLIT)
    room = placement["device"] - placement["margin"]
    if placement["iteration"] > room:
        return Verdict(DOES_NOT_FIT, f"the iteration reserves {gib(placement['iteration'])} beside the state, of the "
                       f"GPU's {gib(placement['device'])} less the plan's margin of {gib(placement['margin'])}",
                       ITERATION, ["a smaller micro-batch, or gradient checkpointing (give the model's shape, "
                                   "--model or --model-config with --seq, for which)"])
    keep = placement["state"] - min(placement["state"], host_cap)
    return Verdict(DOES_NOT_FIT, f"the host can hold {gib(min(placement['state'], host_cap))} of each rank's "
                   f"{gib(placement['state'])} of state; the other {gib(keep)} must stay on the GPU, which has "
                   f"{gib(max(0, room - placement['iteration']))} beside the iteration", BESIDE,
                   [f"{gib(placement['state'] - max(0, room - placement['iteration']))} of usable host memory a "
                    f"rank, or more ranks (the state splits over them)"])


def for_host(store_per_rank: int, host_cap: int, budget_gb: Optional[float], reason: Optional[str]) -> Verdict:
    """The verdict from the host alone (``--params`` with a fixed budget, no iteration to size):
    whether the node holds the stores; the GPU side unknown."""
    if reason is not None:
        return Verdict(DOES_NOT_FIT, reason, HOST,
                       [f"memory_budget_gb {max(0.0, (store_per_rank - host_cap) / 2**30 + (budget_gb or 0)):.1f} or "
                        "more, more ranks (the state splits over them), or memory_budget_gb null (the measured "
                        "plan: the host takes what it can, the GPU the rest)"])
    return Verdict(UNKNOWN, "the host holds the stores; whether the iteration fits the GPU needs the model "
                   "(--model, or --model-config) and --seq, or --iteration-memory-gb")
