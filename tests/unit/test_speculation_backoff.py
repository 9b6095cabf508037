"""Speculation's ``Backoff``, alone: where clipping fires at every step, which boundary backwards
speculate (the spacing docs/benchmarks.md and configuration.md quote), and that a commit resets it."""

from deepspeed_offload.runtime.speculation.records import MAX_BACKOFF, Backoff


def speculating_steps(backoff, steps, rolls_back):
    """Steps 1..steps: which speculate; ``rolls_back(step)`` says whether a speculating step rolls back."""
    out = []
    for step in range(1, steps + 1):
        if backoff.skips():
            continue
        out.append(step)
        if rolls_back(step):
            backoff.rolled_back()
        else:
            backoff.committed()
    return out


def test_clipping_at_every_step_speculates_once_in_65_steps():
    steps = speculating_steps(Backoff(), 400, lambda step: step >= 2)  # step 1 commits (nothing to roll back)
    assert steps[:9] == [1, 2, 4, 7, 12, 21, 38, 71, 136]
    assert all(b - a == MAX_BACKOFF + 1 for a, b in zip(steps[7:], steps[8:]))


def test_a_commit_resets_and_limit_zero_always_speculates():
    b = Backoff()
    assert speculating_steps(b, 10, lambda step: step in (2, 3, 5)) == [1, 2, 4, 5, 7, 8, 9, 10]
    assert b.length == 0 and b.skip_next == 0
    assert speculating_steps(Backoff(limit=0), 6, lambda step: True) == [1, 2, 3, 4, 5, 6]
