"""The Hugging Face Trainer with optimizer-state offload: two added lines (marked "deepspeed-offload").

    deepspeed --num_gpus 2 examples/hf_trainer.py --deepspeed examples/ds_config_hf.json

The ds_config is the one you give ``TrainingArguments(deepspeed=...)`` plus the
``optimizer_state_offload`` block; its "auto" values are the Trainer's to fill, none is ours.
A tiny Llama built from a config and random tokens, so it runs anywhere (2 CPU ranks over gloo
included) without downloads; with ``--resume`` it continues from the last checkpoint in ``--output_dir``.
"""

import argparse

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

import deepspeed_offload  # deepspeed-offload

deepspeed_offload.install()  # deepspeed-offload: every deepspeed.initialize applies the block


class RandomTokens(torch.utils.data.Dataset):

    def __init__(self, n=256, seq=32, vocab=128):
        self.ids = torch.randint(0, vocab, (n, seq), generator=torch.Generator().manual_seed(0))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--deepspeed", default="examples/ds_config_hf.json")
    parser.add_argument("--output_dir", default="out/hf_trainer")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--local_rank", type=int, default=-1)
    args = parser.parse_args()

    training_args = TrainingArguments(output_dir=args.output_dir, deepspeed=args.deepspeed, max_steps=args.steps,
                                      per_device_train_batch_size=4, learning_rate=1e-3, bf16=True,
                                      save_steps=4, save_total_limit=1, logging_steps=1, report_to=[],
                                      use_cpu=not torch.cuda.is_available())
    model = LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=32))
    trainer = Trainer(model=model, args=training_args, train_dataset=RandomTokens())
    trainer.train(resume_from_checkpoint=True if args.resume else None)

    stats = deepspeed_offload.get_handle(trainer.model_wrapped).step_stats()
    if trainer.is_world_process_zero():
        print(f"last step moved {stats['bytes_h2d']} bytes to the device and {stats['bytes_d2h']} back")


if __name__ == "__main__":
    main()
