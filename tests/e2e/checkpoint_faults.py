"""Launched by test_async_checkpoint.py (2 ranks): what goes wrong around asynchronous checkpoints,
several scenarios per launch. Each rank writes what it saw to ``<out>.rank<r>`` (torch.save).

``scenario: "faults"``: damaged, truncated and mixed files are refused at load on every rank (and
nothing hangs); the intact checkpoint then loads; a write that runs into RLIMIT_FSIZE on rank 1
fails on both ranks with the errno text and the path, ``latest`` untouched, and nothing of it is
left once the ranks have agreed on the failure; the next good save commits as usual. A save whose
staging raises on rank 1 raises on both ranks from ``save_checkpoint``, leaves nothing behind, and
training and the next save go on.

``scenario: "die"``: rank 1 leaves with ``os._exit(0)`` while its write is in flight (what
examples did); rank 0 exits normally and must fail the commit within seconds and exit non-zero.
"""

import dataclasses
import json
import os
import resource
import shutil
import signal
import sys
import time

import deepspeed
import torch
from deepspeed.accelerator import get_accelerator

import deepspeed_offload
from deepspeed_offload.runtime import checkpoint as ck
from harness import inject_checkpoint_faults
from parity_train import DTYPES, Net, ds_config, optimizer_for


def build(spec):
    torch.manual_seed(1234)
    model = Net(spec.get("hidden", 32), False, False)
    groups = [{"params": [p for n, p in model.named_parameters() if n.startswith("inp")]},
              {"params": [p for n, p in model.named_parameters() if not n.startswith("inp")], "lr": 3e-3,
               "weight_decay": 0.0}]
    engine, _, _, _ = deepspeed_offload.initialize(model=model, optimizer=optimizer_for(spec, groups),
                                                   config=ds_config(spec))
    inject_checkpoint_faults(engine, spec)
    return engine


def train(engine, steps, gen, spec):
    device = get_accelerator().current_device_name()
    dtype = DTYPES[spec.get("dtype", "bf16")]
    hidden = spec.get("hidden", 32)
    for _ in range(steps):
        x = torch.randn(4, hidden, generator=gen).to(device, dtype)
        loss = torch.nn.functional.mse_loss(engine(x, use_late=False), torch.sin(x.float().sum(1, keepdim=True)).to(dtype))
        engine.backward(loss)
        engine.step()


def on_rank0(fn):
    if deepspeed.comm.get_rank() == 0:
        fn()
    deepspeed.comm.barrier()


def attempt_load(engine, d, tag=None):
    try:
        engine.load_checkpoint(d, tag=tag)
        return None
    except ck.CheckpointLoadError as e:
        return str(e)


def faults(spec, engine, gen, out):
    d, d2 = spec["dir"], spec["dir2"]
    rank = deepspeed.comm.get_rank()
    train(engine, 2, gen, spec)
    engine.save_checkpoint(d, tag="t")
    deepspeed_offload.wait_for_checkpoint(engine)
    tag_dir = os.path.join(d, "t")
    optim1 = os.path.join(tag_dir, "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt")
    model1 = os.path.join(tag_dir, "zero_pp_rank_1_mp_rank_00_model_states.pt")
    keep = os.path.join(d, "keep")

    def damage(path, how):
        def do():
            os.makedirs(keep, exist_ok=True)
            shutil.copy2(path, os.path.join(keep, os.path.basename(path)))
            data = bytearray(open(path, "rb").read())
            if how == "flip":
                mid = len(data) // 2
                data[mid:mid + 4096] = bytes(b ^ 0xFF for b in data[mid:mid + 4096])
            else:
                data = data[:len(data) // 2]
            open(path, "wb").write(bytes(data))
        return do

    def restore():
        for name in os.listdir(keep):
            shutil.copy2(os.path.join(keep, name), os.path.join(tag_dir, name))
        shutil.rmtree(keep)

    out["flipped"] = (on_rank0(damage(optim1, "flip")), attempt_load(engine, d))[1]
    on_rank0(restore)
    out["truncated"] = (on_rank0(damage(model1, "truncate")), attempt_load(engine, d, "t"))[1]
    on_rank0(restore)

    # the same tag saved two steps later elsewhere; rank 1's files and marker of that save copied in
    train(engine, 2, gen, spec)
    engine.save_checkpoint(d2, tag="t")
    deepspeed_offload.wait_for_checkpoint(engine)

    def mix():
        os.makedirs(keep)
        for name in os.listdir(tag_dir):
            if "rank_1" in name or "rank1" in name:
                shutil.copy2(os.path.join(tag_dir, name), os.path.join(keep, name))
                shutil.copy2(os.path.join(d2, "t", name), os.path.join(tag_dir, name))

    out["mixed"] = (on_rank0(mix), attempt_load(engine, d))[1]
    on_rank0(restore)
    out["intact"] = attempt_load(engine, d)
    out["steps_after_load"] = engine.global_steps

    # rank 1 cannot write more than 16 KiB per file; rank 0 can
    train(engine, 1, gen, spec)
    limits = resource.getrlimit(resource.RLIMIT_FSIZE)
    if rank == 1:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (16 << 10, limits[1]))
    engine.save_checkpoint(d, tag="full")
    try:
        deepspeed_offload.wait_for_checkpoint(engine)
        out["full"] = None
    except ck.CheckpointWriteError as e:
        out["full"] = str(e)
    resource.setrlimit(resource.RLIMIT_FSIZE, limits)
    out["latest_after_full"] = open(os.path.join(d, "latest")).read()
    out["left_after_full"] = sorted(os.listdir(d))
    out["after_full"] = attempt_load(engine, d)
    engine.save_checkpoint(d, tag="t2")
    deepspeed_offload.wait_for_checkpoint(engine)
    out["left_after_next"] = sorted(os.listdir(d))

    # rank 1's staging raises after the ranks agreed on the save id: both ranks raise the same error
    # from save_checkpoint, and training goes on in step (no rank is left with a check the other skips)
    ckpt = deepspeed_offload.get_handle(engine).checkpointer

    def staged(tag):
        if tag == "bad" and rank == 1:
            raise MemoryError("no host memory for the snapshot (injected)")
    ckpt.faults = dataclasses.replace(ckpt.faults, staged=staged)
    try:
        engine.save_checkpoint(d, tag="bad")
        out["bad"] = None
    except ck.CheckpointWriteError as e:
        out["bad"] = str(e)
    train(engine, 2, gen, spec)
    engine.save_checkpoint(d, tag="t3")
    deepspeed_offload.wait_for_checkpoint(engine)
    out["latest_after_bad"] = open(os.path.join(d, "latest")).read()
    out["left_after_bad"] = sorted(os.listdir(d))


def die(spec, engine, gen, out):
    d = spec["dir"]
    train(engine, 3, gen, spec)
    engine.save_checkpoint(d, tag="ok3")
    deepspeed_offload.wait_for_checkpoint(engine)
    train(engine, 2, gen, spec)
    engine.save_checkpoint(d, tag="slow5")  # the spec's faults make this write slow
    print(f"rank {engine.global_rank}: save slow5 returned at {time.time():.3f}", flush=True)
    if engine.global_rank == 1:
        os._exit(0)  # gone mid-write, exit status 0: only the heartbeat tells rank 0
    # rank 0 ends normally: the interpreter waits for the writer, whose commit must give up


def main():
    spec = json.load(open([a for a in sys.argv[1:] if not a.startswith("--local_rank")][0]))
    engine = build(spec)
    gen = torch.Generator().manual_seed(100 + engine.global_rank)
    out = {}
    if spec["scenario"] == "die":
        die(spec, engine, gen, out)
        return
    faults(spec, engine, gen, out)
    torch.save(out, f"{spec['out']}.rank{engine.global_rank}")
    if engine.global_rank == 0:
        torch.save(out, spec["out"])
    deepspeed.comm.barrier()
    deepspeed.comm.destroy_process_group()


if __name__ == "__main__":
    main()
