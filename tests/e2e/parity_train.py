"""Training script the e2e tests launch with the real ``deepspeed`` launcher.

Reads a JSON spec (argv[1]) that says which model features, precision and ds_config to use and
whether to go through ``deepspeed.initialize`` or ``deepspeed_offload.initialize``; writes what it
observed to ``spec["out"]`` (rank 0, torch.save): per-step losses, and after the last step every
parameter's full fp32 master and every optimizer-state tensor, read with DeepSpeed's own
``safe_get_full_*`` helpers. Two runs that must agree are compared with ``torch.equal``.

A spec with ``variants`` (a list of overrides, e.g. ``{"api": "deepspeed"}`` for plain ZeRO-3 and
``{"offload": {...}}`` for each offload configuration) trains each of them in turn, in the same
process, from the same seed, and writes ``{"variants": [result, ...]}``: one launch instead of one
per run. A variant may carry a whole case's spec (its model, precision, steps): the two-rank tests
run all their cases in one launch so.
"""

import contextlib
import gc
import glob
import json
import os
import signal
import sys
import time
import traceback

import deepspeed
import torch
from deepspeed.accelerator import get_accelerator
from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

import deepspeed_offload
from deepspeed_offload.compat import TENSOR_BACKWARD, at_least
from deepspeed_offload.runtime.colocation.partitions import GRAD_VIEWS
from deepspeed_offload.runtime.memory import allocator
from deepspeed_offload.runtime.memory.host_store import MASTER
from harness import NO_FP16, inject_checkpoint_faults, same_bits, same_tensors

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


class Net(torch.nn.Module):
    """Layers of different sizes, so sub-groups split unevenly; optional frozen and late layers."""

    def __init__(self, hidden, frozen, late, tied=False, reentrant=False):
        super().__init__()
        self.reentrant = reentrant
        self.inp = torch.nn.Linear(hidden, 2 * hidden)
        self.mid = torch.nn.Linear(2 * hidden, hidden)
        self.out = torch.nn.Linear(hidden, 1)
        self.frozen = torch.nn.Linear(hidden, hidden) if frozen else None
        if frozen:
            self.frozen.requires_grad_(False)
        self.late = torch.nn.Linear(hidden, hidden) if late else None
        self.tied = torch.nn.Linear(hidden, hidden) if tied else None  # one weight used twice

    def forward(self, x, use_late):
        h = torch.nn.functional.gelu(self.inp(x))
        h = torch.nn.functional.gelu(self.mid(h))
        if self.frozen is not None:
            h = h + self.frozen(h)
        if self.late is not None and use_late:
            h = h + self.late(h)
        if self.tied is not None and self.reentrant:
            # each use of the tied weight in a reentrant checkpoint of its own: backward recomputes and
            # differentiates them one after the other, so its gradient is reduced twice
            a = torch.utils.checkpoint.checkpoint(lambda t: torch.tanh(self.tied(t)), h, use_reentrant=True)
            h = h + torch.utils.checkpoint.checkpoint(self.tied, a, use_reentrant=True)
        elif self.tied is not None:
            h = h + self.tied(torch.tanh(self.tied(h)))
        return self.out(h)


class ScriptedMemory:
    """The counters of a device with memory of its own, for the CPU accelerator, scripted by the test so
    that the measured plan and the load policy decide as on a GPU (``StreamMode.measure_with`` reads it
    through the production ``DeviceMemory``). Allocated: ``fixed`` bytes, the resident optimizer state,
    the early loads, and while a step is open ``per_element`` bytes for each element of its input
    (activations). Reserved: the highest allocation since the last ``empty_cache``. The training loop
    reads it after each backward, where activations peak (a device's counters see every allocation)."""

    def __init__(self, handle, limit, fixed, per_element):
        self.handle, self.limit, self.fixed, self.per_element = handle, limit, fixed, per_element
        self._peak = self._reserved = 0

    def memory_allocated(self):
        h = self.handle
        step = h.lifecycle.current
        act = self.per_element * step.input_numel if step is not None else 0
        n = self.fixed + h.probe.resident_bytes(len(h.resident)) + h.table.early_bytes + act
        self._peak, self._reserved = max(self._peak, n), max(self._reserved, n)
        return n

    def max_memory_allocated(self):
        self.memory_allocated()
        return self._peak

    def memory_reserved(self):
        self.memory_allocated()
        return self._reserved

    def max_memory_reserved(self):
        return self.memory_reserved()

    def reset_peak_memory_stats(self):
        self._peak = 0
        self.memory_allocated()

    def total_memory(self):
        return self.limit

    def available_memory(self):
        return self.limit - self.memory_reserved()

    def empty_cache(self):
        self._reserved = 0
        self.memory_allocated()


LLAMA_VOCAB = 64


def tiny_llama(hidden):
    """transformers' LlamaForCausalLM, two layers ``hidden`` wide: a model whose config says its width."""
    from transformers import LlamaConfig, LlamaForCausalLM
    return LlamaForCausalLM(LlamaConfig(vocab_size=LLAMA_VOCAB, hidden_size=hidden, intermediate_size=2 * hidden,
                                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                        max_position_embeddings=32, use_cache=False))


def ds_config(spec):
    cfg = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": spec.get("gas", 1),
        "zero_optimization": {"stage": 3, "sub_group_size": spec.get("sub_group_size", 1_000_000_000)},
        "steps_per_print": 1000,
        "wall_clock_breakdown": False,
        # DeepSpeed's throughput timer (on by default) synchronizes the whole device at every
        # forward, which would order the side and copy streams before each step for us: off, so the
        # waits deepspeed-offload queues are the only ones, and the ones tested
        "timers": {"throughput": {"enabled": False}},
    }
    if spec.get("sub_group_size") is None:
        del cfg["zero_optimization"]["sub_group_size"]
    dtype = spec.get("dtype", "bf16")
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    elif dtype == "fp16":
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 8, "loss_scale_window": 2}
    if spec.get("clip"):
        cfg["gradient_clipping"] = spec["clip"]
    if spec.get("offload") is not None:
        cfg["optimizer_state_offload"] = spec["offload"]
    if spec.get("compile"):
        cfg["compile"] = {"deepcompile": True}
    cfg.update(spec.get("extra_config", {}))
    return cfg


def optimizer_for(spec, groups):
    kind = spec.get("optimizer", "torch_adamw")
    if kind == "torch_adamw":
        return torch.optim.AdamW(groups, lr=1e-2, weight_decay=0.01)
    if kind == "torch_adam":
        return torch.optim.Adam(groups, lr=1e-2)
    if kind == "fused_adam":
        from deepspeed.ops.adam import FusedAdam
        return FusedAdam(groups, lr=1e-2, weight_decay=0.01, adam_w_mode=True)
    raise ValueError(kind)


def _tensors(value):
    """Every tensor in a nested dict/list/tuple (an optimizer's state_dict)."""
    if torch.is_tensor(value):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _tensors(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors(v)


def engine_snapshot(engine):
    """What a failed attach must leave as it was: the engine's and the optimizer's instance methods (the
    objects themselves), every fp32 master and optimizer-state tensor (values and device), DeepSpeed's
    compile-pass table, no handle."""
    from deepspeed_offload.api import attached_engines
    opt = engine.optimizer
    tensors = []
    for master in opt.fp32_partitioned_groups_flat:
        tensors.append(master)
        tensors += [t for t in opt.optimizer.state.get(master, {}).values() if torch.is_tensor(t) and t.dim() > 0]
    try:
        from deepspeed.compile import backend
        passes = dict(backend.opt_passes)
    except ImportError:
        passes = {}
    return {"engine": {k: v for k, v in vars(engine).items() if callable(v)},
            "optimizer": {k: v for k, v in vars(opt).items() if callable(v)},
            "tensors": [(t.device, t.detach().clone()) for t in tensors], "passes": passes,
            "handle": deepspeed_offload.get_handle(engine), "attached": engine in attached_engines()}


def attach_with_fault(engine, config, fault):
    """``deepspeed_offload.attach`` with a failure injected at ``fault["stage"]`` on ``fault["ranks"]``
    (the settings: a bad DS_OFFLOAD_COMMIT_TIMEOUT there; compile mode's setup: attached as compile
    mode, which the CPU cannot validate, through the same transaction). Reports what was raised, how
    long it took, and what differs from before."""
    from deepspeed_offload.config import OffloadConfig, Plan
    from deepspeed_offload.runtime import attach as attach_mod
    import deepspeed_offload.api as api
    rank = deepspeed.comm.get_rank()
    here = rank in fault["ranks"]
    stage = fault["stage"]

    def inject(at):
        if here and at == stage and stage != "settings":  # (the settings fail on the variable itself)
            raise RuntimeError(f"injected failure at {at}")

    before = engine_snapshot(engine)
    attach_mod.FAULT_POINT = inject
    if stage == "settings" and here:
        os.environ["DS_OFFLOAD_COMMIT_TIMEOUT"] = "10m"
    t0 = time.perf_counter()
    try:
        if stage == "compile setup":
            block = OffloadConfig(enabled=True, mode="compile", memory_budget_gb=0)
            api._attach_mode(engine, Plan(offload=block, mode="compile", ds_config=config, sub_group_size=1,
                                          sub_group_size_set_by_us=False))
        else:
            deepspeed_offload.attach(engine, config)
        raised = None
    except Exception as e:
        raised = f"{type(e).__name__}: {e}"
    finally:
        attach_mod.FAULT_POINT = None
        os.environ.pop("DS_OFFLOAD_COMMIT_TIMEOUT", None)
    seconds = time.perf_counter() - t0
    after = engine_snapshot(engine)
    changed = [k for k in ("engine", "optimizer") if before[k].keys() != after[k].keys()
               or any(before[k][n] is not after[k][n] for n in before[k])]
    changed += [] if same_tensors(before["tensors"], after["tensors"]) else ["tensors"]
    changed += [k for k in ("passes", "handle", "attached") if before[k] != after[k]]
    record = {"stage": stage, "ranks": fault["ranks"], "raised": raised, "seconds": seconds, "changed": changed}
    records = [None] * deepspeed.comm.get_world_size()
    torch.distributed.all_gather_object(records, record)
    return records  # every rank's


def install_move_faults(engine, faults):
    """The measured plan's moves failing where the spec says: each fault ``{"rank", "after_step", "error"}``
    makes the take-back's allocation (its prepare, ``runtime/step/moves.py``) raise on that rank in the
    move after that step (0-based), out of memory (``"oom"``) or another error."""
    handle, rank = deepspeed_offload.get_handle(engine), deepspeed.comm.get_rank()
    allocate = handle.arrival.allocate

    def failing(sub_groups):
        for f in faults:
            if f["rank"] == rank and handle.lifecycle.applied == f["after_step"] + 1 and sub_groups:
                if f["error"] == "oom":
                    raise torch.OutOfMemoryError("CUDA out of memory (injected into a take-back)")
                raise RuntimeError("injected failure in a take-back")
        return allocate(sub_groups)

    handle.arrival.allocate = failing


def install_early_load_fault(engine, fault):
    """An early load's allocation (buffers of its own, in backward) out of device memory on rank
    ``fault["rank"]``, once, in the backward of step ``fault["step"]`` (0-based)."""
    handle, rank = deepspeed_offload.get_handle(engine), deepspeed.comm.get_rank()
    alloc, left = handle.copies.alloc, [1 if fault["rank"] == rank else 0]

    def failing(*args, **kwargs):
        if left[0] and handle.lifecycle.applied == fault["step"] and not handle.in_step:
            left[0] = 0
            raise torch.OutOfMemoryError("CUDA out of memory (injected into an early load)")
        return alloc(*args, **kwargs)

    handle.copies.alloc = failing


def install_held_check(engine, result_extra):
    """Before and after every gradient hook's early loads: the running counts they read (speculation's
    ``held_bytes``, ``EarlyLoads.held_into_step``) against a recount from every sub-group's phase, as
    they were computed before they ran (a walk over the members, the order and the events)."""
    handle = deepspeed_offload.get_handle(engine)
    spec, table, early = handle.speculation, handle.table, handle.early
    result_extra["held_checks"] = 0

    def recount(where):
        own = [i for i in handle.order if table[i].on_device and table[i].slot is None]
        if spec is not None:
            assert spec.updated.nbytes == sum(s.nbytes() for s in spec.updated.values()), where
            for i in spec.coming.of:
                r = table[i]
                assert r.on_device and r.slot is None and not r.host_stale and i not in spec.updated, (where, i, r)
            if spec._boundary:
                master = handle.opt.fp32_partitioned_groups_flat
                missing = [i for i in own if i in spec.members and not table[i].host_stale and i not in spec.updated
                           and spec.base.state.get(master[i]) and i not in spec.coming]
                assert not missing, (where, missing)  # loaded, its update to come, its bytes not reserved
        into = (spec.held_bytes if spec is not None else 0) + sum(
            table.store_bytes(i) for i in own if spec is None or not spec.updates_in_backward(i))
        assert early.held_into_step() == into, (where, early.held_into_step(), into)
        result_extra["held_checks"] += 1

    gradients_final = early.gradients_final

    def checked(allowance):
        recount("before a hook's loads")
        gradients_final(allowance)
        recount("after a hook's loads")

    early.gradients_final = checked


def abort_step(engine, fail_at=None):
    """Make the update of the second sub-group raise (or of sub-group ``fail_at``: "first_kept", the
    first that compile mode keeps on the device), and report what the step left behind: whether every
    kept sub-group's newest state (its device copy before the step) reached the host store."""
    base = engine.optimizer.optimizer
    real_step, calls = base.step, []
    handle = deepspeed_offload.get_handle(engine)
    kept = sorted(handle.timing.kept)
    fail_call = 2 if fail_at is None else kept[0] + 1  # the step updates sub-groups 0, 1, ... in order
    before = {i: handle.table.view(i, MASTER).clone() for i in kept if handle.table[i].on_device}

    def failing_step(*args, **kwargs):
        calls.append(1)
        if len(calls) == fail_call:
            raise RuntimeError("injected failure")
        return real_step(*args, **kwargs)

    base.step = failing_step
    try:
        engine.step()
        raised = None
    except RuntimeError as e:
        raised = str(e)
    finally:
        base.step = real_step
    opt = engine.optimizer
    out = {"raised": raised, "host_resident": handle.tensors.host_resident(), "in_step": handle._in_step,
           "slots": handle.table.slots is not None,
           # as DeepSpeed keeps them: each 16-bit partition the cast of its master (a speculated update
           # settled into it as the step began was put back where the step did not reach it)
           "partitions_are_casts": all(torch.equal(lp, hp.to(lp.dtype)) for lp, hp in
                                       zip(opt.fp16_partitioned_groups_flat, opt.fp32_partitioned_groups_flat))}
    if fail_at is not None:
        out["kept_on_device"] = sorted(before)
        out["kept_reached_host"] = all(same_bits(handle.store.view(i, MASTER), t) for i, t in before.items())
    return out


class CompileOps:
    """Compile mode's runtime without DeepCompile (which needs CUDA): the ops, called through
    ``torch.ops.ds_offload`` where the compiled graphs would call them: offloads and one empty_cache
    at the head of forward, reloads in backward (a hook on the model's output), the copy-stream
    sync at its end. ``reload`` picks how many sub-groups come back early and ``keep`` how many (or "all") of
    those stay on the device between steps (the planner's job on a GPU, once per compile phase)."""

    def __init__(self, engine, spec):
        from deepspeed_offload.compile_passes.mode import CompileMode
        from deepspeed_offload.config import OffloadConfig
        self.mode = CompileMode(engine, OffloadConfig(enabled=True, mode="compile", memory_budget_gb=0))
        setattr(engine, "_deepspeed_offload", self.mode.stream)  # the engine's handle, as attach sets it
        k = len(self.mode.priority) if spec["reload"] == "all" else spec["reload"]
        self.reloads = self.mode.priority[:k]
        keep = len(self.reloads) if spec.get("keep") == "all" else spec.get("keep", 0)
        self.kept = self.reloads[:keep]
        # keep_late: the pass decides what stays while the phase's first backward runs, after the
        # backward's prologue (prefetch) already ran, as DeepCompile compiles backward lazily on a GPU
        self.keep_late = spec.get("keep_late", False)
        self.new_phase()

    def new_phase(self):
        self.mode.begin_phase()
        self.undecided = self.keep_late
        if not self.keep_late:
            self.mode.keep(self.kept)

    def call(self, name, anchor, sub_group=None):
        fn = getattr(torch.ops.ds_offload, name)
        key = self.mode.ops_key  # the engine the graph was compiled for
        return fn(anchor, key) if sub_group is None else fn(anchor, key, sub_group)

    def forward_head(self, anchor):
        for i in self.mode.priority:
            self.call("offload_launch", anchor, i)
        self.call("empty_cache", anchor)

    def in_backward(self, anchor):
        if self.undecided:
            self.undecided = False
            self.mode.keep(self.kept)
        for i in self.reloads:
            self.call("reload", anchor, i)

    def backward_end(self, anchor):
        self.call("copy_stream_sync", anchor)


def checkpoint(engine, save):
    if save.get("sync_dir"):
        # DeepSpeed's own synchronous save of the very same state, for the test to compare against
        deepspeed_offload.get_handle(engine).checkpointer._orig_save(save["sync_dir"], tag=save["tag"])
    t0 = time.perf_counter()
    engine.save_checkpoint(save["dir"], tag=save["tag"])
    print(f"save {save['tag']} returned after {time.perf_counter() - t0:.3f} s", flush=True)
    last = dict(deepspeed_offload.get_handle(engine).checkpointer.last)
    if save.get("wait"):
        deepspeed_offload.wait_for_checkpoint(engine)
    if save.get("kill"):
        # Kill this rank while its writer is between writing a file and renaming it.
        pattern = os.path.join(save["dir"], save["tag"], "*.tmp")
        deadline = time.monotonic() + 60
        while not glob.glob(pattern) and time.monotonic() < deadline:
            time.sleep(0.01)
        print(f"killing rank {engine.global_rank} during the write of {glob.glob(pattern)}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    return {"blocking_s": last["blocking_s"], "behind_bytes": last["behind_bytes"]}


# engine.offload_states()'s include of each cycle, in turn: everything, each kind alone or in pairs
# (strings, as DeepSpeed's enum is a str enum; enum members on odd cycles)
# (the 16-bit parameters go to a pinned buffer at step 0, to a pageable one at step 1: the reload must
# not bring back the older pinned copy)
INCLUDES = [None, ["hp_params", "lp_params"], ["optim_states"], ["lp_params", "lp_grads", "contiguous_grad_buffer"],
            ["contiguous_grad_buffer", "hp_params"], ["optim_states", "hp_params", "lp_grads"]]


def colocation_cycle(engine, spec, step):
    """What an RL trainer sharing its GPUs with rollouts does after a step: ``offload_states()``, a
    rollout that takes device memory, ``reload_states()``. The include, ``pin_memory`` and
    ``non_blocking`` vary from cycle to cycle. Returns what moved and what was off the device."""
    from deepspeed.runtime.zero.offload_config import OffloadStateTypeEnum
    include = INCLUDES[step % len(INCLUDES)] if spec["colocate"].get("include", "cycle") == "cycle" \
        else spec["colocate"]["include"]
    if include is not None and step % 2:
        include = [OffloadStateTypeEnum(k) for k in include]
    handle = deepspeed_offload.get_handle(engine)
    pending = handle is not None and handle.checkpointer is not None and handle.checkpointer.pending()
    before = [] if handle is None else [i for i in handle.order if handle.table[i].on_device]
    kept = sorted(handle.timing.kept)  # compile mode's sub-groups that stay on the device (this phase)
    views = dict(getattr(engine.optimizer, GRAD_VIEWS))
    engine.offload_states(include=include, pin_memory=step % 2 == 0, non_blocking=step % 3 == 1)
    if spec["colocate"].get("read_while_offloaded"):
        engine.optimizer.state_dict()  # a CPU reader of what offload_states() moved to the host
    rec = {"checkpoint_pending": pending, "include": None if include is None else sorted(str(getattr(k, "value", k)) for k in include),
           "offloaded": sorted(s.value for s in engine.optimizer.offloaded_states)}
    if handle is not None:
        rec.update(offload_bytes=handle.colocation.offload_bytes, host_resident=handle.tensors.host_resident(),
                   before=before, kept=kept,
                   on_device=[i for i in handle.order if handle.table[i].on_device],
                   resident_in_store=resident_in_store(handle))
    rollout = torch.randn(1 << 16, device=get_accelerator().current_device_name())  # the rollout's memory
    rollout.mul_(2).sum().item()
    del rollout
    engine.reload_states(non_blocking=step % 3 == 2)
    rec["after_reload"] = sorted(s.value for s in engine.optimizer.offloaded_states)
    rec["grad_views_kept"] = grad_views_kept(engine.optimizer, views)
    if handle is not None:
        rec["reload_bytes"] = handle.colocation.reload_bytes
        rec["resident_in_store_after_reload"] = resident_in_store(handle)
        rec["back_on_device"] = [i for i in handle.order if handle.table[i].on_device]
    return rec


def grad_views_kept(opt, before):
    """Each parameter's view of the gradient buffer is the object it was before the cycle (DeepCompile
    holds them) and lies in the buffer as it is now."""
    views, buffer = getattr(opt, GRAD_VIEWS), opt.grad_partitions_flat_buffer
    base = buffer.untyped_storage().data_ptr()
    return views.keys() == before.keys() and all(
        views[k] is before[k] and views[k].untyped_storage().data_ptr() == base for k in views)


def resident_in_store(handle):
    """The resident sub-groups' tensors that point into a host store of offload_states(), by key kind."""
    stores = list(handle.colocation.resident_stores.values())
    out = set()
    for i, entries in handle.layout.resident_entries.items():
        for key, _, _ in entries:
            t = handle.tensors.get(i, key)
            if t is not None and any(t.data_ptr() == s.view(i, key).data_ptr() for s in stores):
                out.add("hp_params" if key == MASTER else "optim_states")
    return sorted(out)


def colocation_snapshot(engine):
    """What ``offload_states()``/``reload_states()`` may change: the kinds off the device, the resident
    sub-groups' kinds in a host store of ``offload_states()``, every state tensor's device and values."""
    opt = engine.optimizer
    tensors = [*opt.fp32_partitioned_groups_flat, opt.lp_param_buffer, opt.grad_partitions_flat_buffer,
               *(p.ds_tensor for p in engine.module.parameters()),
               *(t for state in opt.optimizer.state.values() for t in state.values() if torch.is_tensor(t))]
    return {"offloaded": sorted(s.value for s in opt.offloaded_states),
            "in_store": resident_in_store(deepspeed_offload.get_handle(engine)),
            "tensors": [(str(t.device), t.detach().clone()) for t in tensors]}


def colocation_with_fault(engine, fault):
    """``engine.offload_states()`` (``fault["at"]`` "offload") or, after one that works,
    ``engine.reload_states()`` ("reload") failing on ``fault["ranks"]`` alone: at offload, the resident
    sub-groups' host copy finds no host memory (the real check, ``HostMemory.read`` reporting none
    available); at reload, the gradient buffer's device copy fails, after the resident sub-groups came
    back. Reports every rank's outcome: what it raised, how long it took, what differs from before the
    call. Then nothing is offloaded on any rank (a reload that works, on every rank, if anything is)."""
    import dataclasses
    from deepspeed_offload.sizing.host_memory import HostMemory
    here = deepspeed.comm.get_rank() in fault["ranks"]
    colocation = deepspeed_offload.get_handle(engine).colocation
    if fault["at"] == "reload":
        engine.offload_states()
    before = colocation_snapshot(engine)
    read = vars(HostMemory)["read"]
    if here and fault["at"] == "offload":
        HostMemory.read = classmethod(lambda cls, root="/": dataclasses.replace(read.__func__(cls, root), available=0))
    if here and fault["at"] == "reload":
        def out_of_memory(non_blocking):
            raise RuntimeError("injected failure: out of device memory for the gradient buffer")
        colocation.lp.reload_grads = out_of_memory
    t0 = time.perf_counter()
    try:
        engine.offload_states() if fault["at"] == "offload" else engine.reload_states()
        raised = None
    except Exception as e:
        raised = f"{type(e).__name__}: {e}"
    finally:
        HostMemory.read = read
        vars(colocation.lp).pop("reload_grads", None)
    seconds = time.perf_counter() - t0
    after = colocation_snapshot(engine)
    changed = [k for k in ("offloaded", "in_store") if before[k] != after[k]]
    changed += [] if same_tensors(before["tensors"], after["tensors"]) else ["tensors"]
    record = dict(fault, raised=raised, seconds=seconds, changed=changed, offloaded_after=after["offloaded"])
    records = [None] * deepspeed.comm.get_world_size()
    torch.distributed.all_gather_object(records, record)
    if any(r["offloaded_after"] for r in records):
        engine.reload_states()
    return records  # every rank's


def refused_calls():
    """What refusals_while_offloaded asks for: a plain loss.backward() only where DeepSpeed runs its
    engine's backward prologue for one (before that, DeepSpeed's API is engine.backward(loss) alone)."""
    tensor_backward = ["tensor_backward"] if at_least(TENSOR_BACKWARD) else []
    return ["step", "backward", *tensor_backward, "load_state_dict", "load_checkpoint", "detach"]


def refusals_while_offloaded(engine, spec, device, dtype):
    """After training: offload the optimizer's state, then ask for a step, a backward and a loader of
    host state; each must raise (the message is returned) and leave the state where it was."""
    masters = {n: safe_get_full_fp32_param(p).clone() for n, p in engine.module.named_parameters()
               if p.requires_grad}
    steps = engine.global_steps
    engine.offload_states(include=["optim_states", "hp_params"])
    out = {}
    x = torch.randn(4, spec.get("hidden", 32)).to(device, dtype)
    calls = {"step": engine.step,
             "backward": lambda: engine.backward(engine(x, use_late=True).float().sum()),
             "tensor_backward": lambda: engine(x, use_late=True).float().sum().backward(),
             "load_state_dict": lambda: engine.optimizer.load_state_dict(engine.optimizer.state_dict()),
             "load_checkpoint": lambda: engine.load_checkpoint(spec.get("out", "") + ".nothing"),
             "detach": deepspeed_offload.get_handle(engine).detach}
    for name in refused_calls():
        call = calls[name]
        try:
            call()
            out[name] = None
        except RuntimeError as e:
            out[name] = f"{type(e).__name__}: {e}"
    out["still_offloaded"] = sorted(s.value for s in engine.optimizer.offloaded_states)
    engine.reload_states()
    out["unchanged"] = engine.global_steps == steps and all(
        torch.equal(safe_get_full_fp32_param(p), masters[n]) for n, p in engine.module.named_parameters()
        if p.requires_grad)
    return out


def detach_and_check(engine):
    """Detach offload; report whether every patched method is DeepSpeed's own again."""
    handle = deepspeed_offload.get_handle(engine)
    opt = engine.optimizer
    patched = [(obj, name) for obj, name, _ in handle.patches._applied]
    handle.detach()
    own = [name for obj, name in patched if name in vars(obj) and callable(getattr(obj, name))]
    return {"patched": sorted(name for _, name in patched), "still_instance_attributes": own,
            "handle_gone": deepspeed_offload.get_handle(engine) is None,
            "methods_are_class_methods": all(getattr(opt, n).__func__ is getattr(type(opt), n)
                                             for n in ("step", "_prepare_sub_group", "_release_sub_group",
                                                       "reduce_ready_partitions_and_remove_grads"))}


def main():
    spec = json.load(open([a for a in sys.argv[1:] if not a.startswith("--local_rank")][0]))
    if spec.get("log_info"):  # DeepSpeed logs at WARNING by default; our progress lines are INFO
        from deepspeed.utils.logging import set_log_level_from_string
        set_log_level_from_string("info")
    deepspeed.init_distributed()  # before any variant: one that is skipped or fails early still agrees
    if NO_FP16 in os.environ:  # the tests' stand-in for a CPU without fp16 (an AMD one)
        get_accelerator().is_fp16_supported = lambda: False
    if spec.get("variants"):
        result = {"variants": [run_variant(spec, k) for k in range(len(spec["variants"]))]}
    else:
        result = train(spec)
    if deepspeed.comm.get_rank() == 0:
        torch.save(result, spec["out"])
    deepspeed.comm.barrier()
    deepspeed.comm.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    # gloo can abort in its destructors at interpreter exit after the gathers above; everything is
    # written, so leave now and let the launcher see the real outcome.
    os._exit(0)


def run_variant(spec, k):
    """Variant ``k`` of a shared launch, reported on its own: its result, ``{"skipped": why}`` where this
    machine cannot run it (fp16 on a CPU without it), or ``{"error": ...}`` when it failed on any rank
    (the ranks agree, so that the next variant starts on all of them). One variant never ends the
    launch for the others."""
    variant = dict(spec, **spec["variants"][k])
    why = unsupported(variant)
    if why:
        return {"skipped": why}
    error = None
    try:
        result = train(variant)
    except Exception as e:
        error = f"{type(e).__name__}: {e}\n{traceback.format_exc()[-3000:]}"
        print(f"parity_train: variant {k} of {len(spec['variants'])} failed: {json.dumps(spec['variants'][k])[:2000]}"
              f"\n{error}", file=sys.stderr, flush=True)
    gc.collect()  # the last variant's engine and its device memory gone before the next one's
    get_accelerator().empty_cache()
    errors = [None] * deepspeed.comm.get_world_size()
    torch.distributed.all_gather_object(errors, error)
    failed = [(rank, e) for rank, e in enumerate(errors) if e is not None]
    if failed:
        return {"error": "; ".join(f"rank {rank}: {e}" for rank, e in failed)}
    return result


def unsupported(spec):
    """Why this machine cannot train ``spec`` (a precision DeepSpeed's accelerator lacks), or None."""
    acc = get_accelerator()
    dtype = spec.get("dtype", "bf16")
    if dtype == "fp16" and not acc.is_fp16_supported():
        return f"DeepSpeed's {acc.device_name()} accelerator has no fp16 on this machine"
    if dtype == "bf16" and not acc.is_bf16_supported():
        return f"DeepSpeed's {acc.device_name()} accelerator has no bf16 on this machine"
    return None


@contextlib.contextmanager
def copy_executor(spec):
    """With ``copies``, offload attaches with deferred_copies.py's executor: a copy runs only when
    something waits for it (the most hostile timing a GPU's copy streams allow), and every buffer
    handed between streams is checked for the order a GPU would keep (``stream_order.py``; DeepSpeed's
    own work on the streams declared before the stream mode's hooks go on)."""
    if not spec.get("copies"):
        yield
        return
    from deferred_copies import DeferredCopies
    from stream_order import declare_deepspeed
    import deepspeed_offload.runtime.step.hooks as hooks_mod
    import deepspeed_offload.runtime.step.stream as stream_mod
    made, install = stream_mod.make_copies, hooks_mod.install

    def install_hooks(mode):
        declare_deepspeed(mode)
        install(mode)

    stream_mod.make_copies = lambda acc=None: DeferredCopies(drop_slot_wait=spec["copies"] == "deferred_control")
    hooks_mod.install = install_hooks
    try:
        yield
    finally:
        stream_mod.make_copies, hooks_mod.install = made, install


@contextlib.contextmanager
def slab_size(spec):
    """``slab_bytes``: the host store's slabs that small (runtime/memory/pinned.py), so that the measured
    plan's moves release and lock single sub-groups' memory, as a large model's do."""
    from deepspeed_offload.runtime.memory import pinned
    default = pinned.SLAB_BYTES
    pinned.SLAB_BYTES = spec.get("slab_bytes") or default
    try:
        yield
    finally:
        pinned.SLAB_BYTES = default


@contextlib.contextmanager
def norm_differs(spec):
    """``norm_differs``: DeepSpeed's per-sub-group gradient norm one step of the last bit larger, so that the
    first step's comparison in runtime/step/grad_norm.py finds it unequal and keeps DeepSpeed's own."""
    if not spec.get("norm_differs"):
        yield
        return
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3 as Stage3
    direct = Stage3.get_grad_norm_direct

    def larger(self, *args, **kwargs):
        norm = direct(self, *args, **kwargs)
        return torch.nextafter(norm, torch.full_like(norm, float("inf")))

    Stage3.get_grad_norm_direct = larger
    try:
        yield
    finally:
        Stage3.get_grad_norm_direct = direct


def train(spec):
    with copy_executor(spec), slab_size(spec), norm_differs(spec):
        result = train_with(spec)
    result["norm_differs"] = bool(spec.get("norm_differs"))
    return result


def train_with(spec):
    torch.manual_seed(1234)
    hidden = spec.get("hidden", 32)
    config = ds_config(spec)
    if spec.get("zero_init"):
        deepspeed.init_distributed()
    # DeepCompile expects the model partitioned as it is built, the way large models are
    with deepspeed.zero.Init(config_dict_or_path=config, enabled=spec.get("zero_init", False)):
        if spec.get("model") == "llama":  # a Hugging Face model: initialize reads its config.hidden_size
            model = tiny_llama(hidden)
        else:
            model = Net(hidden, spec.get("frozen", False), spec.get("late", False), spec.get("tied", False),
                        spec.get("reentrant", False))
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if spec.get("two_groups"):
        groups = [{"params": [p for n, p in trainable if n.startswith("inp")]},
                  {"params": [p for n, p in trainable if not n.startswith("inp")], "lr": 3e-3, "weight_decay": 0.0}]
    else:
        groups = [{"params": [p for _, p in trainable]}]
    optimizer = optimizer_for(spec, groups)
    api = spec.get("api", "offload")
    switched = switch_saved = None
    if spec.get("scripted_memory"):
        # the measured plan's allocator switch as on a CUDA device (a GPU's attach holds it already, the CPU's
        # when measure_with below makes the plan), recording what it would pass torch; put back at the end
        switched, switch_saved = [], (allocator.wanted, allocator.SWITCH.setter, allocator.SWITCH.current)
        allocator.wanted = lambda *args, **kwargs: True
        allocator.SWITCH.setter, allocator.SWITCH.current = switched.append, lambda: "max_split_size_mb:512"
    init = deepspeed_offload.initialize if api == "offload" else deepspeed.initialize
    engine, _, _, _ = init(model=model, optimizer=optimizer,
                           config=dict(config, optimizer_state_offload={}) if api == "attach_later" else config)
    inject_checkpoint_faults(engine, spec)
    if spec.get("compile"):
        engine.compile()
    if spec.get("early_cap_first"):
        # overlap_memory_gb of exactly the first offloaded sub-group: it loads in backward, the
        # rest stream through the slots in the step, whatever the model's sizes on this machine
        handle = deepspeed_offload.get_handle(engine)
        handle.timing.early_cap = handle.layout.nbytes[handle.order[0]]
    compile_ops = CompileOps(engine, spec["compile_ops"]) if spec.get("compile_ops") else None
    scripted = None
    if spec.get("scripted_memory") and deepspeed_offload.get_handle(engine) is not None:
        # the measured plan on the CPU, over a device whose figures are scripted
        from collections import deque
        s, handle = spec["scripted_memory"], deepspeed_offload.get_handle(engine)
        from deepspeed_offload.runtime.memory.iteration_memory import DeviceMemory
        scripted = ScriptedMemory(handle, s["limit"], s["fixed"], s["per_element"])
        handle.measure_with(DeviceMemory(scripted))
        handle.plan.margin = s["margin"]
        handle.plan.recent = deque(maxlen=s["recent"])
    if spec.get("unpin_after") is not None and getattr(deepspeed_offload.get_handle(engine), "arrival", None):
        # the steps the split holds before a take-back's host memory is unpinned (arrival.py; 32 by default)
        deepspeed_offload.get_handle(engine).arrival.unpin_after = spec["unpin_after"]
    if spec.get("early_load_fault") and deepspeed_offload.get_handle(engine) is not None:
        install_early_load_fault(engine, spec["early_load_fault"])
    if spec.get("move_faults") and deepspeed_offload.get_handle(engine) is not None:
        install_move_faults(engine, spec["move_faults"])
    if spec.get("force_commit"):  # the negative control: updates from backward committed without the norm check
        deepspeed_offload.get_handle(engine).speculation.force_commit = True
    speculation = getattr(deepspeed_offload.get_handle(engine), "speculation", None)
    if spec.get("backoff") is not None and speculation is not None:
        speculation.backoff.limit = spec["backoff"]  # 0: speculate at every step, each case's rollbacks as written
    if spec.get("slow_side_cycles") and speculation is not None:
        # the side stream held up at every use (a sleep kernel queued first), so that a missing
        # wait between it and the compute stream shows as a wrong result, not as luck
        copies = deepspeed_offload.get_handle(engine).copies
        side = copies.side

        @contextlib.contextmanager
        def slow_side():
            with side():
                torch.cuda._sleep(int(spec["slow_side_cycles"]))
                yield

        copies.side = slow_side
    if spec.get("no_step_end_join") and speculation is not None:
        # the negative control: the next forward does not wait for the copies of the kept 16-bit casts
        # into DeepSpeed's partitions, and the casts are dropped before the compute stream joined the
        # side stream (step_ends without its join, and settle_casts, at the step's entry, without its own)
        speculation.step_ends = lambda: setattr(speculation, "committing", {})
        settle, spec_copies = speculation.settle_casts, speculation.mode.copies

        def unjoined_settle():
            casts = [(s.lp.numel(), s.lp.dtype) for s in speculation.updated.values() if s.lp is not None]
            join, spec_copies.join_side = spec_copies.join_side, lambda: None
            try:
                return settle()
            finally:
                spec_copies.join_side = join
                # the compute stream takes the casts' freed blocks at once and writes them, while the side
                # stream has yet to copy from them (a step's temporaries may land there any time: which ones
                # do is the allocator's business, so the control does not leave it to chance)
                taken = [torch.full((n, ), float("nan"), dtype=dtype, device=get_accelerator().current_device_name())
                         for n, dtype in casts]
                del taken

        speculation.settle_casts = unjoined_settle
    if spec.get("loads_from_hook") is not None and speculation is not None:
        # the early loads held back until that gradient hook of each boundary backward (as a GPU's memory
        # may hold them back): what became final before then is updated there, later in backward; and
        # how often a gradient was reduced again while its sub-group was final but not yet updated
        timing, first = deepspeed_offload.get_handle(engine).timing, spec["loads_from_hook"]
        gradient_ready, partitioned = timing.gradient_ready, speculation.partitioned

        def held_back(param=None):
            allowance = gradient_ready(param)
            return allowance if timing._hook >= first else None

        def counted(params):
            again = sum(speculation.group_of.get(p.ds_id) in speculation._final
                        and p.ds_id in speculation._seen.get(speculation.group_of[p.ds_id], ()) for p in params)
            result_extra["reduced_again_before_update"] = result_extra.get("reduced_again_before_update", 0) + again
            return partitioned(params)

        timing.gradient_ready, speculation.partitioned = held_back, counted
    if spec.get("early_cap_share") and speculation is not None:
        # early loads within a cap, a share of all the offloaded state: what they hold plus what the updates
        # hold (the 16-bit casts kept until the step, their fp32 gradient buffer) must stay within it (the
        # peak guarantee's bookkeeping)
        handle = deepspeed_offload.get_handle(engine)
        handle.timing.early_cap = int(spec["early_cap_share"] * sum(handle.layout.nbytes[i] for i in handle.order))
        load_early = handle.early.load

        def watched(allowance):
            load_early(allowance)
            held = handle.table.held_early() + speculation.held_bytes
            result_extra["early_held_max"] = max(result_extra.get("early_held_max", 0), held)
            result_extra["early_cap"] = handle.timing.early_cap

        handle.early.load = watched
        at_entry = handle.early.at_step_entry

        def watched_entry(first):
            # the step's entry loads (after speculation settled its casts) within the same cap
            n = at_entry(first)
            held = handle.table.held_early() + speculation.held_bytes
            result_extra["entry_held_max"] = max(result_extra.get("entry_held_max", 0), held)
            result_extra["entry_own_loads"] = result_extra.get("entry_own_loads", 0) + n
            return n

        handle.early.at_step_entry = watched_entry

    device = get_accelerator().current_device_name()
    dtype = DTYPES[spec.get("dtype", "bf16")]
    gen = torch.Generator().manual_seed(100 + engine.global_rank)
    losses = []
    step_stats = []  # the handle's step_stats() after each optimizer step
    step_seconds = []  # how long each iteration (forward, backward, step) took, wall clock
    held_after_step = []  # per optimizer step: offloaded sub-groups not back on the host when it returned
    result_extra = {}
    if spec.get("check_held") and getattr(deepspeed_offload.get_handle(engine), "early", None) is not None:
        install_held_check(engine, result_extra)
    gas = spec.get("gas", 1)
    start = 0
    loaded_into_store = None
    if spec.get("resume"):
        engine.load_checkpoint(spec["resume"]["dir"], tag=spec["resume"].get("tag"))
        start = engine.global_steps
        handle = deepspeed_offload.get_handle(engine)
        loaded_into_store = handle.tensors.host_resident() if handle is not None else None
    for step in range(spec.get("steps", 6)):
        iteration_start = time.perf_counter()
        for micro in range(gas):
            batch = spec["batch_by_step"][step] if spec.get("batch_by_step") else 4
            x = torch.randn(batch, hidden, generator=gen).to(device, dtype)
            y = torch.sin(x.float().sum(dim=1, keepdim=True)).to(dtype)
            if step < start:
                continue  # resumed: the data of the steps already taken is drawn and dropped
            if compile_ops is not None:
                if step == spec["compile_ops"].get("recompile_at") and micro == 0:
                    compile_ops.new_phase()
                compile_ops.forward_head(x)
            if spec.get("model") == "llama":
                ids = torch.randint(0, LLAMA_VOCAB, (batch, 16), generator=gen).to(device)
                loss = engine(input_ids=ids, labels=ids).loss
            else:
                out = engine(x, use_late=step >= 2)
                if compile_ops is not None:
                    out.register_hook(lambda grad, x=x: compile_ops.in_backward(x))
                loss = torch.nn.functional.mse_loss(out, y)
            if step == spec.get("overflow_step", -1) and micro == 0:
                loss = loss * float("inf")  # every rank overflows: the step must be skipped
            if step in spec.get("set_fp32_at", ()) and micro == 0:
                # an fp32 master written between steps (DeepSpeed's 16-bit partition catches up at the next
                # applied step), before the backward
                from deepspeed import utils as ds_utils
                p = next(p for p in engine.module.parameters() if p.requires_grad)
                ds_utils.safe_set_full_fp32_param(p, ds_utils.safe_get_full_fp32_param(p) * 0.5)
            engine.backward(loss)
            if scripted is not None:
                scripted.memory_allocated()  # the peak: activations alive, the gradients reduced
            if compile_ops is not None:
                compile_ops.backward_end(x)
            if step == spec.get("read_before_step_at") and micro == gas - 1:
                engine.optimizer.state_dict()  # a reader of host state between backward and the step
            if str(step) in spec.get("lr_before_step", {}) and micro == gas - 1:
                # a hand-written schedule: the learning rate set between backward and the step
                for group in engine.optimizer.optimizer.param_groups:
                    group["lr"] = spec["lr_before_step"][str(step)]
            if spec.get("clip_by_step") and micro == gas - 1:  # clipping that fires on some steps only
                engine.optimizer.clip_grad = spec["clip_by_step"][step % len(spec["clip_by_step"])]
            if step in spec.get("set_grad_at", ()) and micro == gas - 1:  # a gradient edited before the step
                from deepspeed.utils import safe_get_full_grad, safe_set_full_grad
                p = next(p for p in engine.module.parameters() if p.requires_grad)
                safe_set_full_grad(p, safe_get_full_grad(p) * 0.5)
            if step in spec.get("read_state_at", ()) and micro == gas - 1:  # the state read before the step
                from deepspeed import utils as ds_utils
                reads = result_extra.setdefault("state_reads", [])
                for p in (p for p in engine.module.parameters() if p.requires_grad):
                    reads.append((ds_utils.safe_get_full_fp32_param(p).cpu(),
                                  ds_utils.safe_get_full_optimizer_state(p, "exp_avg").cpu()))
            if api == "attach_later" and step == spec["attach_at"] and micro == 0:
                # the faults first (each must leave the engine as it was, on every rank), then the attach
                result_extra["attach_faults"] = [attach_with_fault(engine, config, f) for f in spec.get("attach_faults", [])]
                deepspeed_offload.attach(engine, config)
            if step == spec.get("fail_at") and micro == gas - 1:
                raise RuntimeError(f"injected failure at step {step}")  # (a variant that fails: harness tests)
            if step == spec.get("abort_at") and micro == gas - 1:
                result_extra["abort"] = abort_step(engine, spec.get("abort_fail_at"))
                continue
            engine.step()
            if micro == gas - 1:
                step_seconds.append(time.perf_counter() - iteration_start)
            losses.append(loss.item())
            handle = deepspeed_offload.get_handle(engine)
            if handle is not None and micro == gas - 1 and hasattr(handle, "table"):
                held_after_step.append(sum(r.phase.name != "ON_HOST" for r in handle.table.of.values()))
            if handle is not None and micro == gas - 1:
                # The stats object, resolved after training: resolving reads the copies' events,
                # which would wait for this step's write-backs before the next forward starts.
                step_stats.append(handle.last_stats)
                result_extra.setdefault("steps_counted", []).append(handle.steps)
                if hasattr(handle, "table"):  # copy events remembered for dropped buffers (bounded per step)
                    result_extra.setdefault("in_flight", []).append(len(handle.table.holds.in_flight))
                if getattr(handle, "plan", None) is not None:
                    result_extra.setdefault("plan", []).append(
                        {"resident": len(handle.resident), "give_backs": handle.plan.give_backs,
                         "moves": (handle.moves.give_backs, handle.moves.take_backs, handle.moves.failed)
                         if hasattr(handle, "moves") else None,
                         "take_backs": handle.plan.take_backs,
                         "members": sorted(handle.speculation.members) if handle.speculation else [],
                         "twins": sorted(handle.store.twins), "released": sorted(handle.store.unpinned)})
            for at, limit in (spec.get("scripted_memory") or {}).get("grow_at", []):
                if scripted is not None and micro == gas - 1 and step == at:
                    # a rollout engine beside training gives its memory back: offload_states / reload_states
                    # around the device growing (the scripted limit), as an RL loop's cycle does
                    engine.offload_states()
                    scripted.limit = limit
                    engine.reload_states()
            for at, k in spec.get("place_at", []):  # the measured plan's move, at a step of the test's choosing
                if step == at and micro == gas - 1 and handle is not None:
                    handle.moves.carry_out(k if k >= 0 else len(handle.probe.entries) + k, "place_at")  # (k < 0: all but -k)
                    if spec.get("read_after_place"):  # a CPU reader before the next step: the copies land first
                        state = engine.optimizer.state_dict()
                        tensors = [t for t in _tensors(state) if t.is_floating_point()]
                        result_extra.setdefault("read_after_place", []).append(
                            bool(tensors) and all(bool(torch.isfinite(t).all()) for t in tensors))
                    result_extra.setdefault("placed", []).append(
                        (len(handle.resident), list(handle.order), sorted(handle.store.unpinned),
                         handle.store.slabs.unpinned_bytes, list(handle.resident)))
            if step == spec.get("detach_after") and micro == gas - 1:
                result_extra["detach"] = detach_and_check(engine)
        for save in spec.get("saves", []):
            if save["at"] == step + 1 and step >= start:
                result_extra.setdefault("saved", []).append(checkpoint(engine, save))
        if spec.get("colocate") is not None and step >= start:  # after the save: a write may be in flight
            if step == start and spec["colocate"].get("faults"):  # before the first cycle made any host copy
                result_extra["colocation_faults"] = [colocation_with_fault(engine, f)
                                                     for f in spec["colocate"]["faults"]]
            result_extra.setdefault("colocation", []).append(colocation_cycle(engine, spec, step))

    deepspeed_offload.wait_for_checkpoint(engine)
    timing = getattr(deepspeed_offload.get_handle(engine), "timing", None)
    if spec.get("early_load_fault") and timing is not None:  # every rank's
        result_extra["early_oom_by_rank"] = [None] * deepspeed.comm.get_world_size()
        torch.distributed.all_gather_object(result_extra["early_oom_by_rank"], timing.out_of_memory_stops)
    if result_extra.get("plan"):  # every rank's (each rank places its own state)
        result_extra["plan_by_rank"] = [None] * deepspeed.comm.get_world_size()
        torch.distributed.all_gather_object(result_extra["plan_by_rank"], result_extra["plan"])
    step_stats = [None if s is None else s.resolve() for s in step_stats]
    result = {"losses": losses, "fp32": {}, "state": {}, "start": start, "step_stats": step_stats,
              "step_seconds": step_seconds, "deepspeed": (deepspeed.__version__, deepspeed.__file__),
              "held_after_step": held_after_step,
              "loaded_into_store": loaded_into_store, **result_extra}
    for name, p in engine.module.named_parameters():
        master = safe_get_full_fp32_param(p)
        if master is None:
            continue
        result["fp32"][name] = master.cpu()
        for key in ("exp_avg", "exp_avg_sq"):
            st = safe_get_full_optimizer_state(p, key)
            if st is not None:
                result["state"][f"{name}.{key}"] = st.cpu()
    handle = deepspeed_offload.get_handle(engine)
    if handle is not None and (spec.get("colocate") or {}).get("refusals"):
        result["refusals"] = refusals_while_offloaded(engine, spec, device, dtype)
    if handle is not None:
        result["handle"] = {"order": handle.order, "resident": handle.resident, "steps": handle.steps,
                            "released": sorted(handle.store.unpinned), "unpinned_bytes": handle.store.slabs.unpinned_bytes,
                            "stats": handle.step_stats(), "keys": sorted(handle.store.slices[min(handle.store.slices)]),
                            "counters": handle.compile.counters if handle.compile is not None else None,
                            "unloaded_unused": getattr(handle, "unloaded_unused", None),
                            "overlap": getattr(handle, "overlap", None),
                            "kept": sorted(handle.timing.kept),
                            "norm": handle.norms.source.value,  # whose gradient norm the steps ran (grad_norm.py)
                            "speculation": None if getattr(handle, "speculation", None) is None else
                            dict(handle.speculation.counters.as_dict(), members=sorted(handle.speculation.members),
                                 from_device_members=sorted(handle.speculation.from_device),
                                 current=[handle.store.current[i] for i in handle.order]),
                            "resident_bytes": {i: {k: n * torch.empty(0, dtype=dt).element_size() for k, dt, n in e}
                                               for i, e in handle.layout.resident_entries.items()},
                            "deferred_copies": getattr(handle.copies, "deferred", None),
                            "joined_allocs": getattr(handle.copies, "joined_allocs", None),
                            "unjoined_drops": getattr(handle.copies, "unjoined_drops", None),
                            # (stream_order.py) accesses checked, and those a GPU would not keep in order
                            "ordered_accesses": getattr(handle.copies, "accesses", None),
                            "violations": getattr(handle.copies, "violations", None),
                            "first_violations": getattr(handle.copies, "first_violations", None),
                            "nbytes": [handle.layout.nbytes[i] for i in handle.order] if hasattr(handle, "layout")
                            else None}
    if switched is not None and handle is not None:  # what the plan's switch passed torch, held until detach
        held = allocator.SWITCH.holders
        handle.detach()
        result["allocator_switch"] = {"calls": list(switched), "held": held, "after_detach": allocator.SWITCH.holders}
    if switch_saved is not None:
        allocator.wanted, (allocator.SWITCH.setter, allocator.SWITCH.current) = switch_saved[0], switch_saved[1:]
    return result


if __name__ == "__main__":
    main()
