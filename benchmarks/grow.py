"""Batches that grow while training runs, on a plain Hugging Face ``LlamaForCausalLM`` (not the bench's
model): ``zero.Init``, bf16, FusedAdam, reentrant gradient checkpointing (what
``gradient_checkpointing_enable()`` gives in transformers 4 and most ZeRO-3 recipes set; asked for
explicitly, since transformers 5 defaults to non-reentrant; ``--non-reentrant`` for the other),
DeepSpeed's defaults for everything the ds_config leaves out. Per iteration: the batch, seconds
(synchronized: ``--sync device``, every stream; ``--sync compute``, the compute stream alone, as a
loop that reads its loss), peak allocated and reserved GiB, the resident and streamed sub-groups;
an out-of-memory error ends the run and is reported.

    deepspeed --num_gpus 1 benchmarks/grow.py --mode default --batches 8,8,8,8,9,9,10,10,11,11,12,12,14,14 \\
        --out grow-default.json

``--mode``: ``plain`` (no offload block), ``default`` (the block, nothing else set), ``budget0``
(``memory_budget_gb: 0``), ``budget0-nospec`` (and ``speculate_memory_gb: 0``).
"""

import argparse
import json
import sys
import time

import deepspeed
import torch
from deepspeed.accelerator import get_accelerator

import deepspeed_offload
from deepspeed_offload.bench.models import LLAMA_PRESETS, enable_checkpointing
from deepspeed_offload.bench.peaks import Peaks
from deepspeed_offload.runtime.memory import allocator

BLOCKS = {"plain": None, "default": {"enabled": True}, "budget0": {"enabled": True, "memory_budget_gb": 0},
          "budget0-nospec": {"enabled": True, "memory_budget_gb": 0, "speculate_memory_gb": 0}}

# the caching allocator's events per iteration: a retry frees every cached block and synchronizes
ALLOCATOR_COUNTERS = ("num_alloc_retries", "num_device_alloc", "num_device_free")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=list(BLOCKS), required=True)
    ap.add_argument("--preset", default="llama2-7b", choices=list(LLAMA_PRESETS))
    ap.add_argument("--batches", default="8,8,8,8,9,9,10,10,11,11,12,12,14,14")
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--non-reentrant", action="store_true", help="gradient_checkpointing_kwargs use_reentrant False")
    ap.add_argument("--no-checkpointing", action="store_true", help="no gradient checkpointing at all")
    ap.add_argument("--split", action="store_true",
                    help="synchronize after backward too: forward+backward seconds apart")
    ap.add_argument("--sync", choices=["device", "compute"], default="device",
                    help="what ends an iteration: every stream idle (torch.cuda.synchronize), or the compute stream "
                         "alone, as a loop that reads its loss (copies on other streams may run on)")
    ap.add_argument("--sub-group-mb", type=int, default=None,
                    help="the block's sub_group_mb (its default, 256, where left out): fewer, larger sub-groups "
                         "mean fewer of DeepSpeed's per-sub-group norms in the step")
    ap.add_argument("--out", required=True)
    ap.add_argument("--commit", default=None, help="the code's commit, written into the result")
    ap.add_argument("--local_rank", type=int, default=0)
    args = ap.parse_args()
    import transformers
    from transformers import LlamaConfig, LlamaForCausalLM
    from deepspeed.ops.adam import FusedAdam

    deepspeed.init_distributed()
    deepspeed.utils.logging.set_log_level_from_string("info")
    batches = [int(b) for b in args.batches.split(",")]
    shape = LLAMA_PRESETS[args.preset]
    cfg = {"train_micro_batch_size_per_gpu": batches[0], "bf16": {"enabled": True}, "zero_optimization": {"stage": 3},
           "steps_per_print": 10**9}
    if BLOCKS[args.mode] is not None:
        cfg["optimizer_state_offload"] = dict(BLOCKS[args.mode])
        if args.sub_group_mb is not None:
            cfg["optimizer_state_offload"]["sub_group_mb"] = args.sub_group_mb
    config = LlamaConfig(vocab_size=shape["vocab"], hidden_size=shape["hidden"],
                         intermediate_size=shape["intermediate"],
                         num_hidden_layers=shape["layers"], num_attention_heads=shape["heads"],
                         num_key_value_heads=shape["kv_heads"], max_position_embeddings=args.seq, use_cache=False,
                         torch_dtype=torch.bfloat16)
    t0 = time.perf_counter()
    with deepspeed.zero.Init(config_dict_or_path=cfg):
        model = LlamaForCausalLM(config)
    # the style asked for explicitly: transformers 4 defaults to reentrant, transformers 5 to non-reentrant
    if not args.no_checkpointing:
        enable_checkpointing(model, reentrant=not args.non_reentrant)
    optimizer = FusedAdam(model.parameters(), lr=1e-5)
    engine, _, _, _ = deepspeed_offload.initialize(model=model, optimizer=optimizer, config=cfg)
    handle = deepspeed_offload.get_handle(engine)
    setup_s = time.perf_counter() - t0
    rows, oom = [], None
    peaks = Peaks(get_accelerator())
    counted = {k: torch.cuda.memory_stats().get(k, 0) for k in ALLOCATOR_COUNTERS}
    gen = torch.Generator().manual_seed(0)
    sync = torch.cuda.synchronize if args.sync == "device" else lambda: torch.cuda.current_stream().synchronize()
    # the measured plan resets the peak statistics inside an iteration: its resets fold into ours
    with peaks.watching():
        for k, batch in enumerate(batches):
            ids = torch.randint(0, shape["vocab"], (batch, args.seq), generator=gen).cuda()
            sync()  # (compute: what the last iteration left on other streams runs into this one, as in a loop)
            peaks.start()
            started = time.perf_counter()
            try:
                loss = engine(input_ids=ids, labels=ids).loss
                forward_cpu_s = time.perf_counter() - started  # (not synchronized: where the host waited in it)
                engine.backward(loss)
                if args.split:
                    sync()
                    backward_s = time.perf_counter() - started
                engine.step()
                sync()
            except torch.cuda.OutOfMemoryError as e:
                oom = {"iteration": k, "batch": batch, "error": str(e).splitlines()[0][:300]}
                print(f"[grow] out of memory at iteration {k}, batch {batch}: {oom['error']}", flush=True)
                break
            row = {"iteration": k, "batch": batch, "s": time.perf_counter() - started,
                   "forward_backward_s": backward_s if args.split else None, "forward_cpu_s": forward_cpu_s,
                   "peak_allocated_gib": peaks.allocated() / 2**30, "peak_reserved_gib": peaks.reserved() / 2**30,
                   "reserved_gib": torch.cuda.memory_reserved() / 2**30,
                   **{k: torch.cuda.memory_stats().get(k, 0) - counted.get(k, 0) for k in ALLOCATOR_COUNTERS}}
            counted = {k: torch.cuda.memory_stats().get(k, 0) for k in ALLOCATOR_COUNTERS}
            if handle is not None:
                stats = handle.step_stats() or {}
                row.update(resident=len(handle.resident), streamed=len(handle.order),
                           **{k: stats.get(k) for k in ("speculated", "committed", "discarded", "loaded_early",
                                                       "loaded_in_step", "loaded_at_entry", "bytes_in_step", "settled",
                                                       "h2d_wait_s", "update_s", "d2h_s", "step_s")},
                           divergences=handle.timing.divergences, measurements=handle.timing.measurements,
                           **{k: stats.get(k) for k in ("give_backs", "take_backs", "moves_failed")},
                           larger_inputs=getattr(handle.timing, "larger_inputs", None),
                           pinned_gib=handle.store.pinned_bytes / 2**30)
            rows.append(row)
            print(f"[grow] {json.dumps(row)}", flush=True)
    result = {"mode": args.mode, "preset": args.preset, "seq": args.seq, "batches": batches, "setup_s": setup_s,
              "sync": args.sync, "sub_group_mb": args.sub_group_mb,
              "sub_groups": len(engine.optimizer.fp16_groups),
              "checkpointing": None if args.no_checkpointing else "non-reentrant" if args.non_reentrant else "reentrant",
              "rows": rows, "oom": oom,
              "give_backs": None if handle is None or handle.plan is None else handle.plan.give_backs,
              "expandable_segments": allocator.SWITCH.on(),  # the environment's, or the measured plan's switch
              "norm": None if handle is None else handle.norms.source.value,  # runtime/step/grad_norm.py
              "commit": args.commit, "command": "deepspeed --num_gpus 1 benchmarks/grow.py " + " ".join(sys.argv[1:]),
              "date": time.strftime("%Y-%m-%d"),
              "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "deepspeed": deepspeed.__version__,
              "transformers": transformers.__version__}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
