"""With ``overlap`` on and its limit derived, the iteration's peak allocated GPU memory stays within
two staging slots of the peak with ``overlap`` off, on a backward that rises after its gradient hooks
(activation checkpointing, a large output layer), at a resident budget of 0 and of some GiB."""

import pytest
import torch

from harness import HERE, launch

pytestmark = [pytest.mark.e2e, pytest.mark.gpu]

SPEC = dict(hidden=2048, blocks=8, vocab=32000, tokens=8192, steps=6)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (device memory to measure)")
@pytest.mark.parametrize("budget", [0, 1])
def test_overlap_does_not_raise_the_peak(tmp_path, budget):
    block = {"enabled": True, "mode": "stream", "sub_group_mb": 64, "memory_budget_gb": budget}
    # one process each: an engine freed in-process leaves memory behind that the next one would count
    off, on = (launch(dict(SPEC, variants=[{"offload": dict(block, overlap=overlap)}]), tmp_path,
                      f"peak{budget}-{overlap}", nprocs=1, script=HERE / "peak_train.py")["variants"][0]
               for overlap in (False, True))
    steady = slice(3, None)  # after the measured iteration
    peak_off, peak_on = max(off["peaks"][steady]), max(on["peaks"][steady])
    summary = (f"budget {budget}: peak off {peak_off / 2**30:.3f} GiB, on {peak_on / 2**30:.3f} GiB, slots "
               f"{2 * on['slot_bytes'] / 2**30:.3f} GiB, loaded early {on['loaded_early']} of {on['sub_groups']}")
    (tmp_path / "summary.txt").write_text(summary + "\n")
    print(summary)
    assert on["loaded_early"] > 0  # the overlap did load in backward
    assert peak_on <= peak_off + 2 * on["slot_bytes"], (off["peaks"], on["peaks"])
