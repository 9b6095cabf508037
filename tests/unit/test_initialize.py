"""``initialize``/``attach`` before DeepSpeed runs, and the host store's bad-input paths."""

import argparse
import functools
import json
from types import SimpleNamespace

import deepspeed
import pytest
import torch
import torch.distributed as torch_dist

import deepspeed_offload
from deepspeed_offload import ConfigError, api
from deepspeed_offload import config as cfgmod
from deepspeed_offload.runtime.memory import host_store
from deepspeed_offload.runtime.memory.host_store import MASTER, HostStore
from deepspeed_offload.runtime.memory import pinned
from deepspeed_offload.runtime.memory.layout import probe_state_layout


@pytest.fixture
def spies(monkeypatch):
    """Record every call that would create an engine, a process group or pinned memory."""
    calls = []

    @functools.wraps(deepspeed.initialize)  # its signature, which install() binds the call with
    def initialize(*a, **k):
        calls.append(("deepspeed.initialize", k))
        return ("engine", None, None, None)

    monkeypatch.setattr(deepspeed, "initialize", initialize)
    monkeypatch.setattr(api, "_attach_if_trainable", lambda engine, plan: calls.append(("attach", plan)))
    real_allocate = pinned.allocate
    monkeypatch.setattr(pinned, "allocate", lambda *a, **k: calls.append(("pin", a[0])) or real_allocate(*a, **k))
    real_pin = host_store.pin_empty  # the accelerator's pinned allocation, on accelerators the store does not pin
    monkeypatch.setattr(host_store, "pin_empty", lambda *a, **k: calls.append(("pin", a)) or real_pin(*a, **k))
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self, *a, **k: calls.append(("pin", self.shape)) or self)
    return calls


BAD = {"zero_optimization": {"stage": 2}, "optimizer_state_offload": {"enabled": True}}
ON = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3},
      "optimizer_state_offload": {"enabled": True}}
# everything offloaded: the stores must fit the host (with the budget derived the GPU keeps what it cannot hold)
ALL_OUT = dict(ON, optimizer_state_offload={"enabled": True, "memory_budget_gb": 0})


def test_failed_validation_leaves_nothing_behind(spies, tmp_path):
    model = torch.nn.Linear(4, 4)
    assert not torch_dist.is_initialized()
    with pytest.raises(ConfigError, match="zero_optimization.stage"):
        deepspeed_offload.initialize(model=model, model_parameters=model.parameters(), config=BAD)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(BAD))
    with pytest.raises(ConfigError):
        deepspeed_offload.initialize(args=argparse.Namespace(deepspeed_config=str(path), local_rank=0), model=model)
    assert spies == []  # no engine, no attach, nothing pinned
    assert not torch_dist.is_initialized()  # no process group was created


def test_disabled_is_plain_deepspeed(spies):
    model = torch.nn.Linear(4, 4)
    cfg = {"zero_optimization": {"stage": 3}, "optimizer_state_offload": {"enabled": False}}
    out = deepspeed_offload.initialize(model=model, config=cfg)
    assert out == ("engine", None, None, None)
    (name, kwargs), = spies
    assert name == "deepspeed.initialize" and kwargs["config"] is cfg and kwargs["model"] is model


def test_enabled_passes_sub_group_size_and_clears_args(spies, tmp_path):
    path = tmp_path / "on.json"
    path.write_text(json.dumps(ON))
    args = argparse.Namespace(deepspeed_config=str(path), local_rank=0)
    deepspeed_offload.initialize(args=args, model=torch.nn.Linear(4, 4))
    (_, kwargs), (attach, plan) = spies
    assert kwargs["args"].deepspeed_config is None and args.deepspeed_config == str(path)  # caller's args untouched
    assert kwargs["config"]["zero_optimization"]["sub_group_size"] == plan.sub_group_size == 256 * 2**20 // 12


def test_an_unset_reduce_bucket_becomes_one_sub_group_or_hidden_size_squared(spies, monkeypatch):
    """Stream mode with speculation possible, a model whose config says its hidden_size (a Hugging Face
    model) and no reduce_bucket_size in the ds_config: DeepSpeed gets one sub-group's elements (a smaller
    bucket makes no sub-group's gradient final much sooner, and each reduction costs host time), or
    hidden_size² (what HF's "auto" fills in) where that is larger; one log line says which; the caller's
    dict keeps its keys. A size the user set, speculation off (or impossible: overlap off, fp32
    parameters), a sub-group as large as DeepSpeed's own bucket, or a model without a hidden_size (with
    more than two ranks the bucket orders the gradients' sums: plain ZeRO-3 with the same ds_config stays
    the bitwise reference) leave DeepSpeed's default alone."""
    def hf_like(hidden):
        model = torch.nn.Linear(4, 4)
        model.config = SimpleNamespace(hidden_size=hidden)
        return model

    bf16 = dict(ON, bf16={"enabled": True})
    sub_group = cfgmod.validate(json.loads(json.dumps(bf16))).sub_group_size
    assert sub_group == 256 * 2**20 // 12
    logged = []
    monkeypatch.setattr(api, "log_dist", lambda message, **kw: logged.append(message))
    for model, bucket, why in [(hf_like(64), sub_group, f"one sub-group, {sub_group:,} elements"),
                               (hf_like(8192), 8192 * 8192, "hidden_size**2")]:
        spies.clear()
        logged.clear()
        cfg = json.loads(json.dumps(bf16))
        deepspeed_offload.initialize(model=model, config=cfg)
        (_, kwargs), _ = spies
        assert kwargs["config"]["zero_optimization"]["reduce_bucket_size"] == bucket
        assert "reduce_bucket_size" not in cfg["zero_optimization"]  # the caller's dict: untouched
        assert [m for m in logged if f"reduce_bucket_size unset: using {bucket:,} elements ({why}" in m], logged
    plan = cfgmod.validate(bf16)
    assert plan.reduce_bucket_for(64) == sub_group and plan.reduce_bucket_for(None) is None
    left = [dict(bf16, zero_optimization={"stage": 3, "reduce_bucket_size": 1000}),
            dict(bf16, zero_optimization={"stage": 3, "sub_group_size": 500_000_000}),
            dict(bf16, optimizer_state_offload={"enabled": True, "speculate_memory_gb": 0}),
            dict(bf16, optimizer_state_offload={"enabled": True, "overlap": False}),
            ON]  # fp32 parameters: speculation does not run
    for config, model in [(c, hf_like(64)) for c in left] + [(bf16, torch.nn.Linear(4, 4))]:
        spies.clear()
        deepspeed_offload.initialize(model=model, config=json.loads(json.dumps(config)))
        (_, kwargs), _ = spies
        assert kwargs["config"]["zero_optimization"].get("reduce_bucket_size") in (None, 1000), config


def test_host_store_layout():
    layout = {0: [("exp_avg", torch.float32, 3), (MASTER, torch.float32, 3), ("exp_avg_sq", torch.float32, 3)],
              2: [(MASTER, torch.float32, 5), ("exp_avg", torch.float32, 5), ("exp_avg_sq", torch.float32, 5),
                  ("half", torch.bfloat16, 5)]}
    store = HostStore(layout, pin_memory=True)
    assert store.buffers[torch.float32].numel() == 24 and store.buffers[torch.bfloat16].numel() == 5
    # master first, then state keys sorted; one contiguous region per sub-group and dtype
    assert [s.key for s in store.slices[0].values()] == [MASTER, "exp_avg", "exp_avg_sq"]
    assert store.regions[0][torch.float32] == (0, 9) and store.regions[2][torch.float32] == (9, 15)
    store.view(2, "exp_avg").fill_(7)
    assert store.region(2, torch.float32)[5:10].eq(7).all() and store.buffers[torch.float32][:9].ne(7).all()
    assert store.nbytes == 24 * 4 + 5 * 2


def test_probe_state_layout_leaves_optimizer_untouched():
    p = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.AdamW([{"params": [p], "lr": 0.1}, {"params": [], "lr": 0.2, "amsgrad": True}])
    saved = [dict(g) for g in opt.param_groups]
    assert probe_state_layout(opt, 0, "cpu", torch.float32) == {"exp_avg": torch.float32,
                                                                "exp_avg_sq": torch.float32}
    assert set(probe_state_layout(opt, 1, "cpu", torch.float32)) == {"exp_avg", "exp_avg_sq", "max_exp_avg_sq"}
    assert [dict(g) for g in opt.param_groups] == saved and len(opt.state) == 0
    assert torch.equal(p.data, torch.ones(3))


def test_attach_refuses_a_non_zero3_engine():

    class FakeEngine:
        _config = type("C", (), {"_param_dict": ON})()
        optimizer = object()

        def zero_optimization_stage(self):
            return 2

    with pytest.raises(ConfigError, match="stage 2"):
        deepspeed_offload.attach(FakeEngine())
    assert deepspeed_offload.get_handle(FakeEngine()) is None


def test_module_docstrings():
    import deepspeed_offload.compile_passes as cp
    import deepspeed_offload.runtime as rt
    for mod in (rt, cp, host_store, cfgmod, api):
        assert mod.__doc__ and len(mod.__doc__) > 80


def test_host_memory_is_checked_before_deepspeed_runs(spies, monkeypatch, fake_host):
    fake_host(total=16 * 2**30, available=2 * 2**30 + 10 * 1024)  # 10 KiB usable
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    model = torch.nn.Linear(100, 10)  # 1010 parameters: 505 per rank, 6060 bytes, 2 ranks here: 12120
    with pytest.raises(ConfigError, match=r"2 rank\(s\) on this node need 11\.84 KiB .* can give 10\.00 KiB"):
        deepspeed_offload.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters()), config=ALL_OUT)
    assert spies == []


# ---------------------------------------------------------------- install(): every deepspeed.initialize


@pytest.fixture
def installed():
    yield deepspeed_offload.install
    deepspeed_offload.uninstall()


def test_install_is_idempotent_and_uninstall_restores(spies, installed):
    original = deepspeed.initialize
    installed()
    patched = deepspeed.initialize
    assert patched is not original and deepspeed_offload.is_installed()
    installed()
    assert deepspeed.initialize is patched  # not wrapped twice
    deepspeed_offload.uninstall()
    assert deepspeed.initialize is original and not deepspeed_offload.is_installed()
    deepspeed_offload.uninstall()  # safe twice
    assert deepspeed.initialize is original


def test_installed_initialize_applies_the_block_like_initialize(spies, installed):
    installed()
    model = torch.nn.Linear(4, 4)
    # positional, the way a framework may call it: (args, model, optimizer, model_parameters, ...)
    out = deepspeed.initialize(None, model, None, model.parameters(), config_params=ON)
    assert out == ("engine", None, None, None)
    (name, kwargs), (attach, plan) = spies
    assert name == "deepspeed.initialize" and kwargs["model"] is model
    assert kwargs["config"]["zero_optimization"]["sub_group_size"] == plan.sub_group_size
    assert kwargs.get("config_params") is None  # the validated copy goes as config=
    spies.clear()
    deepspeed_offload.initialize(model=model, config=ON)  # the user's own call while installed
    assert [c[0] for c in spies] == ["deepspeed.initialize", "attach"]  # DeepSpeed's once, attached once


def test_installed_initialize_without_the_block_is_deepspeeds(spies, installed):
    installed()
    model = torch.nn.Linear(4, 4)
    cfg = {"zero_optimization": {"stage": 3}}
    deepspeed.initialize(model=model, config=cfg)
    deepspeed.initialize(model=model)  # no ds_config at all: DeepSpeed's call decides, as without install
    (_, first), (_, second) = spies
    assert first["config"] is cfg and second == {"model": model}  # passed on exactly as called


def test_installed_initialize_still_rejects_a_bad_block_first(spies, installed):
    installed()
    with pytest.raises(ConfigError, match="zero_optimization.stage"):
        deepspeed.initialize(model=torch.nn.Linear(4, 4), config=BAD)
    assert spies == []


class _Engine:

    def __init__(self, optimizer, trainable=True):
        self.optimizer = optimizer
        self.module = torch.nn.Linear(2, 2).requires_grad_(trainable)


def test_engines_without_optimizer_state_are_left_alone(monkeypatch):
    attached, logged = [], []
    monkeypatch.setattr(api, "_attach_mode", lambda engine, plan: attached.append(engine) or "handle")
    monkeypatch.setattr(api, "log_dist", lambda msg, ranks=None: logged.append(msg))
    zero3 = type("Stage3", (), {"fp32_partitioned_groups_flat": [torch.zeros(2)]})()
    param_offload_only = type("DeepSpeedZeRoOffload", (), {})()  # ZeRO-3 built without an optimizer
    assert api._attach_if_trainable(_Engine(param_offload_only), plan=None) is None
    assert api._attach_if_trainable(_Engine(None), plan=None) is None
    assert api._attach_if_trainable(_Engine(zero3, trainable=False), plan=None) is None
    assert attached == [] and len(logged) == 3
    assert "DeepSpeedZeRoOffload" in logged[0] and "no trainable parameters" in logged[2]
    engine = _Engine(zero3)
    assert api._attach_if_trainable(engine, plan=None) == "handle" and attached == [engine]


def test_no_optimizer_skips_the_host_memory_check(spies, fake_host):
    fake_host(total=16 * 2**30, available=2**30)
    model = torch.nn.Linear(100, 10)
    deepspeed_offload.initialize(model=model, config=ALL_OUT)  # inference engine: no store will be built
    with pytest.raises(ConfigError, match="can give 0 B"):
        deepspeed_offload.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters()), config=ALL_OUT)


class _Checkpointer:
    """Stands in for runtime.checkpoint.AsyncCheckpointer: records the waits."""

    def __init__(self, log, error=None):
        self.log, self._error = log, error

    def wait_here(self):
        self.log.append("join")
        return self._error

    def wait(self):
        self.log.append("wait")


def _engine_with_checkpointer(log, error=None):
    engine = _Engine(None)
    setattr(engine, api.HANDLE_ATTR, type("Handle", (), {"checkpointer": _Checkpointer(log, error)})())
    api._attached.add(engine)
    return engine


def test_guards_wait_for_the_write_before_deleting(monkeypatch):
    from deepspeed_offload import integrations
    log = []
    engine = _engine_with_checkpointer(log)
    try:
        rotate = integrations._after_writes("rotation")(lambda *a, **k: log.append(("rotate", a, k)))
        rotate("run", save_total_limit=1)
        assert log == ["join", ("rotate", ("run", ), {"save_total_limit": 1})]  # rank-local: no collective

        log.clear()
        save_state = integrations._before_save_state(lambda self, *a: log.append("save_state"))
        save_state(type("Accelerator", (), {"_models": [engine, torch.nn.Linear(1, 1)]})())
        assert log == ["wait", "save_state"]  # every rank calls save_state: the collective wait

        log.clear()
        errors = []
        monkeypatch.setattr(integrations.logger, "error", errors.append)
        getattr(engine, api.HANDLE_ATTR).checkpointer._error = RuntimeError("disk full")
        rotate("run", save_total_limit=1)
        assert log == ["join"] and "disk full" in errors[0]  # rotation skipped: the older checkpoints stay
    finally:
        api._attached.discard(engine)


def test_end_of_training_deletion_and_hub_uploads_wait_for_the_write():
    from deepspeed_offload import integrations
    from deepspeed_offload.runtime.checkpoint import CheckpointWriteError
    log = []
    engine = _engine_with_checkpointer(log)
    try:
        # sort_checkpoints feeds the rmtree at the end of train(): on failure it sorts nothing
        sort = integrations._after_writes("removing", skipped=list)(lambda *a, **k: log.append("sort") or ["c-1"])
        upload_api = integrations._before_upload("uploading")(lambda: log.append("hf_api") or "api")
        assert sort(output_dir="out") == ["c-1"] and upload_api() == "api"
        assert log == ["join", "sort", "join", "hf_api"]  # rank-local waits first, no collective
        log.clear()
        getattr(engine, api.HANDLE_ATTR).checkpointer._error = RuntimeError("disk full")
        assert sort(output_dir="out") == []  # nothing to delete: every checkpoint stays
        with pytest.raises(CheckpointWriteError, match="uploading refused.*disk full"):
            upload_api()
        assert log == ["join", "join"]
    finally:
        api._attached.discard(engine)


def test_install_guards_the_frameworks_where_they_delete_checkpoints(installed):
    import inspect
    import accelerate.accelerator as acc
    import lightning.pytorch.strategies.deepspeed as pl_ds
    import transformers.trainer as hf

    # transformers 4.x: a Trainer method; 5.x: trainer_utils' function, looked up in trainer.py
    rotation = ((hf.Trainer, "_rotate_checkpoints") if hasattr(hf.Trainer, "_rotate_checkpoints") else
                (hf, "rotate_checkpoints"))

    sorting = (hf.Trainer, "_sorted_checkpoints") if rotation[0] is hf.Trainer else (hf, "sort_checkpoints")
    upload = (hf, "hf_api") if hasattr(hf, "hf_api") else (hf, "upload_folder")

    def current():
        return (getattr(*rotation), getattr(*sorting), getattr(*upload), hf.Trainer._push_from_checkpoint,
                acc.Accelerator.save_state, pl_ds.DeepSpeedStrategy.remove_checkpoint)

    before = current()
    installed()
    assert all(a is not b for a, b in zip(current(), before))
    # the Trainer deletes and uploads, through exactly these names, after the engine's save returned
    source = inspect.getsource(hf.Trainer._save_checkpoint)
    saved = source.index("self._save_optimizer_and_scheduler(")
    assert saved < source.index("self._push_from_checkpoint(") and saved < source.index(rotation[1] + "(")
    # at the end of train(): the list that is deleted comes from the guarded sort
    source = inspect.getsource(getattr(hf.Trainer, "_finalize_training", None) or hf.Trainer._inner_training_loop)
    assert source.index(sorting[1] + "(") < source.index("shutil.rmtree(checkpoint")
    # push_to_hub: save_model (which may start an async save), then the upload through the guarded name
    source = inspect.getsource(hf.Trainer.push_to_hub)
    assert source.index("self.save_model(") < source.rindex(upload[1] + "(")
    deepspeed_offload.uninstall()
    assert current() == before
    assert "remove_checkpoint" not in vars(pl_ds.DeepSpeedStrategy)  # the inherited method shows through again


def test_host_store_twins_flip_without_copying():
    """A speculating sub-group has a second region per dtype; ``other`` names it, ``flip`` makes it
    current (nothing is copied), and every other sub-group has one region only."""
    layout = {0: [(MASTER, torch.float32, 3), ("exp_avg", torch.float32, 3)],
              1: [(MASTER, torch.float32, 4), ("exp_avg", torch.float32, 4)]}
    store = HostStore(layout, pin_memory=False, twins=[1])
    assert store.twins == {1} and store.twin_nbytes == 8 * 4 and store.nbytes == (6 + 8 + 8) * 4
    first, second = store.view(1, "exp_avg"), store.view(1, "exp_avg", other=True)
    assert first.data_ptr() != second.data_ptr()
    spans = sorted((store.region(i, torch.float32, o).data_ptr(), store.region(i, torch.float32, o).numel())
                   for i, o in ((0, False), (1, False), (1, True)))
    assert all(a + 4 * n <= b for (a, n), (b, _) in zip(spans, spans[1:]))  # disjoint regions
    first.fill_(1)
    second.fill_(2)
    store.flip(1)
    assert store.view(1, "exp_avg").eq(2).all() and store.view(1, "exp_avg", other=True).eq(1).all()
    assert store.view(1, "exp_avg").data_ptr() == second.data_ptr()
    store.flip(1)
    assert store.view(1, "exp_avg").data_ptr() == first.data_ptr()
    with pytest.raises(KeyError):
        store.flip(0)
    with pytest.raises(KeyError):
        store.view(0, MASTER, other=True)


def test_speculation_members_and_host_plan():
    """Members: a prefix from the last sub-group down (the first gradients to be final) that fits;
    the host plan adds their second regions (12 bytes a parameter, like the store)."""
    from deepspeed_offload.sizing.estimate import host_plan, state_bytes_per_rank
    from deepspeed_offload.runtime.memory.layout import fitting_prefix
    nbytes = {0: 100, 1: 100, 2: 50, 3: 50}.__getitem__
    assert fitting_prefix([3, 2, 1, 0], nbytes, 120) == [3, 2]
    assert fitting_prefix([3, 2, 1, 0], nbytes, 49) == []
    assert fitting_prefix([3, 2, 1, 0], nbytes, 10**6) == [3, 2, 1, 0]
    params, gib = 10**9, 2**30
    store = state_bytes_per_rank(params, 1)
    assert host_plan(params, 1, 1).store_per_rank == store
    plan = host_plan(params, 1, 1, speculate_gb=6)
    assert plan.speculation_per_rank == 6 * gib and plan.store_per_rank == store + 6 * gib
    assert host_plan(params, 1, 1, speculate_gb=10**4).speculation_per_rank == store  # at most the store
    assert host_plan(params, 1, 1, speculate_gb=None).speculation_per_rank == 0  # null: what is spare, at attach


def test_a_second_compile_mode_engine_is_refused_while_the_first_has_its_pass(monkeypatch):
    """DeepCompile keeps one pass table and one schedule per process: while compile mode is attached to
    one engine, attaching it to another is refused before anything changes (stream mode is not)."""
    import weakref

    import deepspeed_offload.compile_passes as cp
    from deepspeed_offload.handle import HANDLE_ATTR
    from deepspeed_offload.runtime.attach import check_engine

    class Opt:
        fp32_partitioned_groups_flat, fp16_groups = [torch.zeros(1)], [[], []]

    class Engine:
        is_compiled = False

        def __init__(self):
            self.optimizer = Opt()

        def zero_optimization_stage(self):
            return 3

    first, second = Engine(), Engine()
    setattr(first, HANDLE_ATTR, object())  # compile mode attached to it
    monkeypatch.setattr(cp, "_engine_with_pass", weakref.ref(first))
    compile_plan = SimpleNamespace(mode="compile")
    with pytest.raises(ConfigError, match="compile mode is attached to another engine of this process"):
        check_engine(second, compile_plan, cp.check_engine)  # the check the API passes for compile mode
    check_engine(second, SimpleNamespace(mode="stream"))  # stream mode beside it is fine
    delattr(first, HANDLE_ATTR)  # the first one detached: its pass is gone
    check_engine(second, compile_plan, cp.check_engine)
