"""One rank on a GPU: a model whose backward is not monotone (a large output layer's loss first,
then blocks under activation checkpointing, each recomputed before its gradients), trained with
the offload block at several settings in one process; per setting, the peak allocated GPU memory of
the iterations after the first three (the overlap's measured iteration is the second).

    python tests/e2e/peak_train.py SPEC.json   (SPEC: variants [{"offload": {...}}], out)

``memory_fraction``: the process may take only that share of the device (torch's per-process limit: an
allocation beyond it runs out of memory, as on a smaller GPU); ``tokens_by_step``: the input's length at
each step. An out-of-memory error ends the variant's loop and is reported (``oom_at``). ``heads``: each
block starts with an eager self-attention over the whole input (one sequence, its ``heads`` x tokens x
tokens scores materialized, softmax in fp32, as transformers' eager attention): memory that grows with
the square of the sequence. ``first_power``: the growth the measured plan assumes before a second input
size is seen (iteration_memory.MAX_POWER; a negative control sets 1).
"""

import gc
import json
import os
import sys
import time

import deepspeed
import torch
from torch.utils.checkpoint import checkpoint

import deepspeed_offload


class Attention(torch.nn.Module):
    """Eager self-attention over ``x`` (tokens x hidden: one sequence), its scores materialized."""

    def __init__(self, hidden, heads):
        super().__init__()
        self.heads = heads
        self.qkv, self.proj = torch.nn.Linear(hidden, 3 * hidden), torch.nn.Linear(hidden, hidden)

    def forward(self, x):
        t, h = x.shape[0], self.heads
        q, k, v = self.qkv(x).view(t, 3, h, -1).permute(1, 2, 0, 3)  # each heads x tokens x head_dim
        scores = (q @ k.transpose(-1, -2)) / q.shape[-1] ** 0.5
        attn = torch.softmax(scores.float(), dim=-1).to(x.dtype) @ v
        return x + self.proj(attn.transpose(0, 1).reshape(t, -1))


class Blocks(torch.nn.Module):

    def __init__(self, hidden, blocks, vocab, heads=0):
        super().__init__()
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(*([Attention(hidden, heads)] if heads else []), torch.nn.Linear(hidden, 4 * hidden),
                                torch.nn.GELU(), torch.nn.Linear(4 * hidden, hidden))
            for _ in range(blocks))
        self.head = torch.nn.Linear(hidden, vocab)

    def forward(self, x, labels, blocks=None):
        for block in self.blocks[:blocks]:
            x = x + checkpoint(block, x, use_reentrant=False)
        return torch.nn.functional.cross_entropy(self.head(x).float(), labels)


def run(spec, offload):
    torch.manual_seed(0)
    cfg = {"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True}, "gradient_clipping": spec.get("clip", 1.0),
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
           "optimizer_state_offload": offload}
    model = Blocks(spec["hidden"], spec["blocks"], spec["vocab"], spec.get("heads", 0))
    if spec.get("first_power") is not None:
        from deepspeed_offload.runtime.memory import iteration_memory
        iteration_memory.MAX_POWER = spec["first_power"]
    engine, _, _, _ = deepspeed_offload.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    x = torch.randn(spec["tokens"], spec["hidden"], device="cuda", dtype=torch.bfloat16)
    labels = torch.randint(0, spec["vocab"], (spec["tokens"], ), device="cuda")
    peaks, reserved, resident, seconds = [], [], [], []
    # after each step: (measurements, the plan's give-backs, its margin, what the step reserved, the early
    # loads held back: bytes)
    plan_by_step = []
    allocator_by_step = []  # after each step: sub-groups loaded early, the allocator's segments, its split free bytes
    oom_at = None
    late = spec.get("late_block_from")  # the last block is used from this step on only (hooks that change)
    handle = deepspeed_offload.get_handle(engine)
    for step in range(spec["steps"]):
        tokens = spec["grow_to"] if step >= spec.get("grow_at", spec["steps"]) else spec["tokens"]
        if spec.get("tokens_by_step"):
            tokens = spec["tokens_by_step"][step]
        if tokens != x.shape[0]:  # a longer input from here on (the shapes grow)
            del x, labels
            x = torch.randn(tokens, spec["hidden"], device="cuda", dtype=torch.bfloat16)
            labels = torch.randint(0, spec["vocab"], (tokens, ), device="cuda")
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()  # (the policy resets them too, while it measures)
        blocks = None if late is None or step >= late else spec["blocks"] - 1
        started = time.perf_counter()
        try:
            engine.backward(engine(x, labels, blocks))
            engine.step()
        except torch.cuda.OutOfMemoryError as e:
            oom_at = {"step": step, "tokens": tokens, "error": str(e)[:300]}
            break
        torch.cuda.synchronize()
        seconds.append(time.perf_counter() - started)
        peaks.append(torch.cuda.max_memory_allocated())
        reserved.append(torch.cuda.memory_reserved())  # (the reserved peak: the allocator never gives any back)
        resident.append(len(handle.resident))
        plan = handle.plan
        plan_by_step.append((handle.timing.measurements, None if plan is None else plan.give_backs,
                             None if plan is None else plan.margin, None if plan is None else plan.last_reserved,
                             None if plan is None else plan.held_back))
        ms = torch.cuda.memory_stats()
        allocator_by_step.append((handle.step_stats()["loaded_early"], ms["segment.all.current"],
                                  round(ms["inactive_split_bytes.all.current"] / 2**30, 2)))
    stats = handle.step_stats()
    spec_counters = None if handle.speculation is None else \
        dict(handle.speculation.counters.as_dict(), members=len(handle.speculation.members))
    out = {"peaks": peaks, "reserved": reserved, "slot_bytes": handle.slot_bytes, "loaded_early": stats["loaded_early"],
           "sub_groups": len(handle.order), "between": torch.cuda.memory_allocated(),
           "sub_groups_total": len(handle.order) + len(handle.resident), "state_bytes": handle.probe.total,
           "divergences": handle.timing.divergences, "measurements": handle.timing.measurements,
           "speculation": spec_counters, "resident": resident, "seconds": seconds, "oom_at": oom_at,
           "give_backs": None if handle.plan is None else handle.plan.give_backs,
           "limit": None if handle.plan is None else handle.plan.limit,
           "margin": None if handle.plan is None else handle.plan.margin, "plan_by_step": plan_by_step,
           "allocator_by_step": allocator_by_step}
    del engine, handle, model
    gc.collect()
    torch.cuda.empty_cache()
    return out


def main():
    spec = json.load(open([a for a in sys.argv[1:] if not a.startswith("--local_rank")][0]))
    if spec.get("memory_fraction"):
        torch.cuda.set_per_process_memory_fraction(spec["memory_fraction"])
    deepspeed.init_distributed()
    result = {"variants": [run(spec, v["offload"]) for v in spec["variants"]]}
    torch.save(result, spec["out"])
    deepspeed.comm.destroy_process_group()
    os._exit(0)  # (a GPU run: nothing of gloo's exit path is under test here)


if __name__ == "__main__":
    main()
