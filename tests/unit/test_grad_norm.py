"""runtime/step/grad_norm.py on its own: where it stands in for DeepSpeed's norm, and how it decides.
Against DeepSpeed's real norm, bit for bit, on real engines: tests/e2e/test_stream_parity.py (every
variant asserts which norm ran; ``norm_differs`` keeps DeepSpeed's)."""

from types import SimpleNamespace

import pytest
import torch

from deepspeed_offload.runtime.step import grad_norm
from deepspeed_offload.runtime.step.grad_norm import GroupNorms, NormSource


def plain_optimizer(grads):
    """What GroupNorms reads of a ZeRO-3 optimizer: one sub-group per list of gradient partitions."""
    return SimpleNamespace(offload_optimizer=False, model_parallel_group=None, use_muon=False, device="cpu",
                           dp_process_group=None, fp16_groups=[[torch.nn.Parameter(torch.zeros(1))] for _ in grads],
                           averaged_gradients=dict(enumerate(grads)))


@pytest.fixture
def one_rank(monkeypatch):
    """A single rank: the all-reduces leave the sums as they are."""
    monkeypatch.setattr(grad_norm.dist, "all_reduce", lambda *args, **kwargs: None)
    monkeypatch.setattr(grad_norm.dist, "is_initialized", lambda: False)


@pytest.mark.parametrize("change, why", [
    (dict(offload_optimizer=True), "the optimizer is offloaded to the CPU"),
    (dict(model_parallel_group=object()), "model parallelism"),
    (dict(use_muon=True), "Muon"),
    (dict(_autoep_expert_parallel_group=lambda params: object()), "expert parallelism"),
])
def test_deepspeeds_norm_stays_where_it_is_not_the_plain_sum(change, why):
    opt = plain_optimizer([[torch.ones(3)]])
    vars(opt).update(change)
    norms = GroupNorms(opt)
    assert norms.source is NormSource.DEEPSPEEDS and norms.why == why
    calls = []
    get = norms.wrap(lambda: calls.append(1) or ["theirs"])
    assert get() == ["theirs"] and get() == ["theirs"] and len(calls) == 2


def test_the_plain_sum_is_compared_once_then_used(one_rank):
    grads = [[torch.tensor([3.0, 4.0], dtype=torch.bfloat16)],
             [torch.tensor([2.0]), torch.tensor([-1.0]), torch.tensor([2.0])]]
    opt = plain_optimizer(grads)
    norms = GroupNorms(opt)
    assert norms.source is NormSource.UNCHECKED
    theirs = [torch.tensor(5.0, dtype=torch.float64), torch.tensor(3.0, dtype=torch.float64)]
    calls = []
    get = norms.wrap(lambda: calls.append(1) or theirs)
    assert get() is theirs and len(calls) == 1  # the first step returns DeepSpeed's own
    assert norms.source is NormSource.OURS
    ours = get()
    assert len(calls) == 1 and all(a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(ours, theirs))


def test_a_norm_that_differs_keeps_deepspeeds_and_warns(one_rank, monkeypatch):
    warned = []
    monkeypatch.setattr(grad_norm.logger, "warning", warned.append)
    opt = plain_optimizer([[torch.tensor([3.0, 4.0])]])
    norms = GroupNorms(opt)
    off = [torch.nextafter(torch.tensor(5.0, dtype=torch.float64), torch.tensor(9.0, dtype=torch.float64))]
    get = norms.wrap(lambda: off)
    assert get() is off and get() is off
    assert norms.source is NormSource.DEEPSPEEDS and len(warned) == 1 and "differed" in warned[0]


def test_a_non_finite_norm_is_deepspeeds_minus_one(one_rank):
    opt = plain_optimizer([[torch.tensor([float("nan"), 1.0])], [torch.tensor([float("inf")])], [torch.ones(4)]])
    out = GroupNorms(opt).compute()
    assert [t.dtype for t in out] == [torch.float64] * 3
    assert out[0].item() == out[1].item() == -1.0 and out[2].item() == 2.0
