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
HIDDEN = 32  # the Llama's width: initialize picks hidden_size**2 (above one sub-group of one element)
BUCKET_LINE = re.compile(r"\[deepspeed-offload\] zero_optimization\.reduce_bucket_size unset: using ([\d,]+) elements")


def llama(**variant):
    return dict(variant, model="llama", hidden=HIDDEN, two_groups=False, frozen=False)


def with_bucket(bucket):
    return {"extra_config": {"zero_optimization": {"stage": 3, "sub_group_size": 1, "reduce_bucket_size": bucket}}}


def test_four_ranks_on_two_nodes(tmp_path):
    variants = [dict(api="deepspeed"), dict(offload=OFFLOAD),
                llama(api="deepspeed", **with_bucket(HIDDEN * HIDDEN)), llama(offload=OFFLOAD)]
    out, logs = launch_two_nodes(dict(SPEC, variants=variants), tmp_path, "two_nodes")
    plain, ours, plain_llama, ours_llama = out["variants"]
    assert_bitwise_equal(plain, ours)
    assert ours["handle"]["speculation"]["committed"] > 0
    # the Llama: the bucket its attach line names, and plain ZeRO-3 with that bucket bitwise the same
    assert BUCKET_LINE.findall(logs[0]) == [f"{HIDDEN * HIDDEN:,}"], logs[0][-3000:]
    assert_bitwise_equal(plain_llama, ours_llama)
    assert ours_llama["handle"]["speculation"]["committed"] > 0
    for node, log in enumerate(logs):
        lines = re.findall(r"\[deepspeed-offload\] node (\d): (\d) rank\(s\) pin .*", log)
        # its own node's line, once per attach (two variants of ours), and no other's
        assert lines == [(str(node), "2")] * 2, (node, log[-3000:])
        line = next(l for l in log.splitlines() if f"[deepspeed-offload] node {node}:" in l)
        ranks = [2 * node, 2 * node + 1]
        assert all(f"rank {r}: " in line for r in ranks) and "the node can give" in line, line
