"""Where stream mode puts loaded optimizer state that the host store does not hold (Adam's ``step``).

A fused or capturable torch Adam wants ``step`` on the parameter's device; torch's loader placed it by
the device the parameter had while loading, which for an offloaded sub-group is the host. On a GPU
that broke the first step after a resume (``state_steps is on cpu``, Hugging Face Trainer with its
default fused AdamW). The rule is torch's own, so torch's loader is the oracle here: for a parameter
that is on the device, where does it put each value?
"""

import pytest
import torch

from deepspeed_offload.runtime.memory.state_tensors import unstored_state_device

GROUPS = {
    "plain": {},
    "fused": {"fused": True},
    "capturable": {"capturable": True},
    "foreach": {"foreach": True},
    "fused_off": {"fused": False, "capturable": False},
}


@pytest.mark.parametrize("key", ["step", "max_exp_avg_sq", "exp_avg"])
@pytest.mark.parametrize("flags", list(GROUPS), ids=list(GROUPS))
def test_unstored_state_goes_where_torch_puts_it_for_a_parameter_on_the_device(key, flags):
    device = "meta"  # stands in for the accelerator: any device other than the value's
    param = torch.empty(4, device=device)
    group = dict(GROUPS[flags], params=[0])
    value = torch.tensor(3.0) if key == "step" else torch.zeros(4)
    torch_placed = torch.optim.Optimizer._process_value_according_to_param_policy(param, value, 0, [group], key)
    ours = unstored_state_device(key, group, device)
    assert (torch_placed.device.type == device) == (ours == device)
    if ours is None:
        assert torch_placed.device == value.device


def test_a_fused_groups_step_goes_to_the_device_and_a_plain_groups_stays():
    assert unstored_state_device("step", {"fused": True}, "cuda:0") == "cuda:0"
    assert unstored_state_device("step", {"capturable": True}, "cuda:0") == "cuda:0"
    assert unstored_state_device("step", {"fused": None, "capturable": False}, "cuda:0") is None
