"""Where compile mode reloads optimizer state in backward: as early as the memory budget allows.

Pure functions on profiles, so the placement is tested on synthetic graphs without a GPU.

The profiles come from DeepCompile, taken after every sub-group was already written back to the
host (capacity-first: what they measure is the floor, and a job that only fits with offloading
never runs a step with everything resident). A backward node's peak is the highest peak from it
to the end of backward, since a reloaded sub-group stays until the step has used it. A reloaded
sub-group also stays through the step and until the next forward's head writes it back, so the
reloads together must fit beside the forward's peak and the step's own staging (``reserve``) too.

What does not fit anywhere is left to the step, which streams it through its two slots exactly as
stream mode does: a budget of 0 reloads nothing and the step streams everything.

Reloaded sub-groups that fit beside the whole iteration's floor stay on the device from one step
to the next (``plan_kept``): they are on the device when backward starts, so they must fit beside
backward's peak as well as the forward's, and they are the first reloads in order, so that every
later reload is placed as the plan saw it.
"""

from typing import Dict, List, Sequence, Tuple

from ..runtime.memory.layout import fitting_prefix


def suffix_peaks(records: Sequence[Tuple[str, int]]) -> Dict[str, int]:
    """``records``: (node name, peak bytes) in execution order. Each node's peak from there on."""
    out, running = {}, 0
    for name, peak in reversed(records):
        running = max(running, peak)
        out[name] = running
    return out


def plan_kept(placed: Sequence[Tuple[int, int]], budget: int, floor: int) -> List[int]:
    """``placed``: the reloads placed ((sub-group, bytes), in placement order); ``floor``: the peak
    of the iteration without them (the larger of backward's peak and the forward's peak plus the
    step's staging). The longest prefix of ``placed`` that fits in ``budget`` beside ``floor``: the
    sub-groups that may stay on the device between steps."""
    nbytes = dict(placed)
    return fitting_prefix([sub_group for sub_group, _ in placed], nbytes.__getitem__, budget - floor)


def plan_reloads(records: Sequence[Tuple[str, int]], tasks: Sequence[Tuple[int, int]], budget: int, reserve: int,
                 already: int = 0) -> Tuple[List[Tuple[str, List[int]]], List[Tuple[int, int]]]:
    """Place ``tasks`` ((sub-group, bytes), in priority order) after backward nodes.

    ``already``: bytes reloaded by earlier backward graphs of the same step. Returns the placements
    ([(node name, [sub-group, ...])] in execution order) and the tasks left over. A task is placed
    after the first node where it fits; the order of ``tasks`` is kept."""
    peaks = suffix_peaks(records)
    placements: List[Tuple[str, List[int]]] = []
    pending = list(tasks)
    held = already
    for name, _ in records:
        if not pending:
            break
        room = budget - max(peaks[name], reserve) - held
        here = []
        while pending and pending[0][1] <= room:
            sub_group, nbytes = pending.pop(0)
            here.append(sub_group)
            room -= nbytes
            held += nbytes
        if here:
            placements.append((name, here))
    return placements, pending
