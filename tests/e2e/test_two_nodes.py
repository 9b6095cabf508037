"""Two nodes, simulated on this host: two ``torchrun`` agents (``--nnodes 2``), two CPU ranks each, gloo.
Stream mode (with speculation, as by default) is bitwise plain ZeRO-3 across the four ranks, and the
first local rank of each node logs that node's host plan: its ranks, what each pins and in all, what
the node can give (attach judges every node once, from its first local rank's reading)."""

import re

import pytest

from harness import assert_bitwise_equal, launch_two_nodes

pytestmark = pytest.mark.e2e

OFFLOAD = {"enabled": True, "mode": "stream", "memory_budget_gb": 0}
SPEC = dict(dtype="bf16", sub_group_size=1, two_groups=True, frozen=True, clip=1e9, steps=4, log_info=True)


def test_four_ranks_on_two_nodes(tmp_path):
    out, logs = launch_two_nodes(dict(SPEC, variants=[dict(api="deepspeed"), dict(offload=OFFLOAD)]), tmp_path,
                                 "two_nodes")
    plain, ours = out["variants"]
    assert_bitwise_equal(plain, ours)
    assert ours["handle"]["speculation"]["committed"] > 0
    for node, log in enumerate(logs):
        lines = re.findall(r"\[deepspeed-offload\] node (\d): (\d) rank\(s\) pin .*", log)
        assert lines == [(str(node), "2")], (node, log[-3000:])  # its own node's line, once, and no other's
        line = next(l for l in log.splitlines() if f"[deepspeed-offload] node {node}:" in l)
        ranks = [2 * node, 2 * node + 1]
        assert all(f"rank {r}: " in line for r in ranks) and "the node can give" in line, line
