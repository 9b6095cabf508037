"""Worker the integration tests launch: a tiny Llama trained by the HF Trainer, an Accelerate loop or
Lightning, with ``deepspeed_offload.install()`` (spec ``offload``) or without it.

Reads a JSON spec (argv[1]); writes on rank 0 (torch.save to ``spec["out"]``) the full fp32 master of
every parameter after training (DeepSpeed's ``safe_get_full_fp32_param``), the last step's offload
stats, and for the Trainer what each checkpoint folder held when ``on_save`` ran, i.e. right after
the Trainer's own rotation (``save_total_limit``) had deleted older folders.
"""

import json
import os
import sys

import torch

import deepspeed_offload
from harness import inject_checkpoint_faults

VOCAB, SEQ, SAMPLES = 64, 16, 64


def tiny_llama(seed):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=SEQ,
                      tie_word_embeddings=False)
    return LlamaForCausalLM(cfg)


class Tokens(torch.utils.data.Dataset):
    """Fixed random token sequences (the same on every rank and run)."""

    def __init__(self):
        g = torch.Generator().manual_seed(7)
        self.ids = torch.randint(0, VOCAB, (SAMPLES, SEQ), generator=g)

    def __len__(self):
        return SAMPLES

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def ds_config(spec, auto):
    """``auto`` marks the keys the framework fills in (Trainer, Accelerate)."""
    cfg = {
        "train_micro_batch_size_per_gpu": "auto" if auto else 2,
        "gradient_accumulation_steps": "auto" if auto else 1,
        "bf16": {"enabled": "auto" if auto else True},
        "zero_optimization": {"stage": 3, "sub_group_size": 2000, "stage3_gather_16bit_weights_on_model_save": True},
        "steps_per_print": 1000,
    }
    if spec.get("ds_optimizer"):
        cfg["optimizer"] = {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto", "torch_adam": True}}
    if spec.get("offload"):
        cfg["optimizer_state_offload"] = dict(spec["offload"])
    if spec.get("clip") is not None:
        cfg["gradient_clipping"] = spec["clip"]
    return cfg


def full_params(engine):
    from deepspeed.utils import safe_get_full_fp32_param
    return {n: safe_get_full_fp32_param(p).cpu() for n, p in engine.module.named_parameters()}


def checkpoint_view(run_dir):
    """Each checkpoint-N folder: its DeepSpeed tag from ``latest`` (None: not committed) and leftover .tmp files."""
    out = {}
    for name in sorted(os.listdir(run_dir)):
        path = os.path.join(run_dir, name)
        if not (name.startswith("checkpoint-") and os.path.isdir(path)):
            continue
        latest = os.path.join(path, "latest")
        tmp = [f for _, _, files in os.walk(path) for f in files if f.endswith(".tmp")]
        out[name] = {"latest": open(latest).read() if os.path.exists(latest) else None, "tmp": tmp}
    return out


def run_hf(spec):
    from transformers import Trainer, TrainerCallback, TrainingArguments

    args = TrainingArguments(output_dir=spec["dir"], per_device_train_batch_size=2, max_steps=spec["max_steps"],
                             learning_rate=1e-2, weight_decay=0.01, lr_scheduler_type="linear", warmup_steps=1,
                             bf16=True, save_strategy="steps", save_steps=2, save_total_limit=1, logging_steps=1,
                             report_to=[], seed=11, data_seed=11, deepspeed=ds_config(spec, auto=True),
                             dataloader_num_workers=0, disable_tqdm=True, use_cpu=not torch.cuda.is_available())
    seen = {"saves": {}}

    class Observe(TrainerCallback):

        def on_train_begin(self, args, state, control, **kw):
            if spec.get("offload"):  # the engine is built by now: its checkpointer gets the spec's faults
                inject_checkpoint_faults(trainer.model_wrapped, spec)

        def on_step_end(self, args, state, control, **kw):
            if state.global_step in spec.get("params_at", []):  # every rank: the gather is collective
                seen.setdefault("params_at", {})[state.global_step] = full_params(trainer.model_wrapped)
            if state.global_step == spec.get("stop_at"):
                control.should_training_stop = True  # "interrupted": the schedule still counts max_steps

        def on_save(self, args, state, control, **kw):
            if state.is_world_process_zero:  # after the Trainer's save, push and rotation
                seen["saves"][state.global_step] = checkpoint_view(args.output_dir)

    trainer = Trainer(model=tiny_llama(5), args=args, train_dataset=Tokens(), callbacks=[Observe()])
    trainer.train(resume_from_checkpoint=spec.get("resume"))
    return trainer.model_wrapped, seen


def run_accelerate(spec):
    """The same loop twice in one process: DeepSpeed alone, then after ``install()``."""
    from accelerate.state import AcceleratorState, GradientState, PartialState
    if not torch.cuda.is_available():
        # Under the deepspeed launcher without GPUs, Accelerate sees one process unless told the ranks
        # are CPU processes (what TrainingArguments(use_cpu=True) does for the Trainer), and uses
        # DeepSpeed only when told so (what `accelerate launch --use_deepspeed` exports).
        os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
        PartialState(cpu=True)
    plain, _ = accelerate_loop(dict(spec, save_at=[], faults=None), os.path.join(spec["dir"], "plain"))
    seen = {"plain_params": full_params(plain), "plain_has_offload": deepspeed_offload.get_handle(plain) is not None}
    AcceleratorState._reset_state()  # keeps PartialState: the process group and ranks stay
    GradientState._reset_state()
    deepspeed_offload.install()
    engine, saved = accelerate_loop(spec, os.path.join(spec["dir"], "offload"))
    return engine, dict(seen, saved_in=saved)


def accelerate_loop(spec, project_dir):
    from accelerate import Accelerator
    from accelerate.utils import DeepSpeedPlugin, ProjectConfiguration, set_seed

    set_seed(11)
    # with gradient accumulation, Accelerate sets the engine's boundary itself before each backward
    # (set_gradient_accumulation_boundary) and steps the engine at the boundary only
    accelerator = Accelerator(mixed_precision="bf16", gradient_accumulation_steps=spec.get("gas", 1),
                              deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=ds_config(spec, auto=True)),
                              project_config=ProjectConfiguration(project_dir=project_dir,
                                                                  automatic_checkpoint_naming=True, total_limit=2))
    model = tiny_llama(5)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    loader = torch.utils.data.DataLoader(Tokens(), batch_size=2, shuffle=True,
                                         generator=torch.Generator().manual_seed(3))
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    inject_checkpoint_faults(model, spec)
    for step, batch in enumerate(loader):
        if step == spec["max_steps"]:
            break
        with accelerator.accumulate(model):
            loss = model(**batch).loss
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        if step + 1 in spec.get("save_at", []):
            accelerator.save_state()
    return model, os.path.join(project_dir, "checkpoints")


def accelerate_checkpoints(folder):
    """Accelerate's checkpoint_N folders and the DeepSpeed tag each one's ``latest`` names (None: none)."""
    out = {}
    for name in sorted(os.listdir(folder)) if os.path.isdir(folder) else []:
        latest = os.path.join(folder, name, "latest")
        out[name] = open(latest).read() if os.path.exists(latest) else None
    return out


def main():
    spec = json.load(open([a for a in sys.argv[1:] if not a.startswith("--local_rank")][0]))
    if spec.get("offload") and spec["framework"] != "accelerate":
        deepspeed_offload.install()
    engine, seen = {"hf": run_hf, "accelerate": run_accelerate}[spec["framework"]](spec)
    deepspeed_offload.wait_for_checkpoint(engine)
    if "saved_in" in seen:  # after the wait: every write is complete
        seen["saved"] = accelerate_checkpoints(seen.pop("saved_in"))
    handle = deepspeed_offload.get_handle(engine)
    result = {"params": full_params(engine), "global_steps": engine.global_steps,
              "stats": handle.step_stats() if handle is not None else None, **seen}
    if handle is not None:  # what explains the stats: the load policy's measurements, speculation's counters
        spec_ = getattr(handle, "speculation", None)
        result["diagnosis"] = {"measurements": handle.timing.measurements, "divergences": handle.timing.divergences,
                               "steps": handle.steps, "overlap": handle.overlap,
                               "speculation": None if spec_ is None else spec_.counters.as_dict()}
    import deepspeed
    if engine.global_rank == 0:
        torch.save(result, spec["out"])
    deepspeed.comm.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # gloo can abort in its destructors at exit; everything is written


if __name__ == "__main__":
    main()
