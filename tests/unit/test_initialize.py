"""``initialize``/``attach`` before DeepSpeed runs, and the host store's bad-input paths."""

import argparse
import json

import pytest
import torch
import torch.distributed as torch_dist
from deepspeed.accelerator import get_accelerator

import deepspeed_offload
from deepspeed_offload import ConfigError, api
from deepspeed_offload import config as cfgmod
from deepspeed_offload.runtime import host_store
from deepspeed_offload.runtime.host_store import MASTER, HostStore
from deepspeed_offload.runtime.stream import probe_state_layout


@pytest.fixture
def spies(monkeypatch):
    """Record every call that would create an engine, a process group or pinned memory."""
    calls = []
    monkeypatch.setattr(api.deepspeed, "initialize", lambda *a, **k: calls.append(("deepspeed.initialize", k)) or
                        ("engine", None, None, None))
    monkeypatch.setattr(api, "_attach_mode", lambda engine, plan: calls.append(("attach", plan)))
    acc = get_accelerator()
    real_pin = acc.pin_empty
    monkeypatch.setattr(acc, "pin_empty", lambda *a, **k: calls.append(("pin", a)) or real_pin(*a, **k))
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self, *a, **k: calls.append(("pin", self.shape)) or self)
    return calls


BAD = {"zero_optimization": {"stage": 2}, "optimizer_state_offload": {"enabled": True}}


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
    path.write_text(json.dumps({"zero_optimization": {"stage": 3}, "optimizer_state_offload": {"enabled": True}}))
    args = argparse.Namespace(deepspeed_config=str(path), local_rank=0)
    deepspeed_offload.initialize(args=args, model=torch.nn.Linear(4, 4))
    (_, kwargs), (attach, plan) = spies
    assert kwargs["args"].deepspeed_config is None and args.deepspeed_config == str(path)  # caller's args untouched
    assert kwargs["config"]["zero_optimization"]["sub_group_size"] == plan.sub_group_size == 256 * 2**20 // 12


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


def test_host_store_checks_memory_before_pinning(monkeypatch, spies):
    monkeypatch.setattr(cfgmod, "host_memory_available", lambda: 1000)
    with pytest.raises(ConfigError) as err:
        HostStore({0: [(MASTER, torch.float32, 1000)]}, pin_memory=True)
    assert "needs 3.91 KiB" in str(err.value) and "only 1000 B" in str(err.value)
    assert [c for c in spies if c[0] == "pin"] == []


def test_host_store_names_needed_and_available(monkeypatch):
    monkeypatch.setattr(cfgmod, "host_memory_available", lambda: 2 * 2**30)
    with pytest.raises(ConfigError, match=r"needs 3\.00 GiB .* only 2\.00 GiB"):
        HostStore({0: [(MASTER, torch.float32, 3 * 2**28)]}, pin_memory=True)


def test_pinning_failure_is_a_clear_error(monkeypatch):
    acc = get_accelerator()

    def fail(*a, **k):
        raise RuntimeError("CUDA error: out of memory")

    monkeypatch.setattr(acc, "pin_empty", fail)
    with pytest.raises(ConfigError, match="pin_memory.*ulimit -l|ulimit -l.*pin_memory"):
        HostStore({0: [(MASTER, torch.float32, 10)]}, pin_memory=True)
    store = HostStore({0: [(MASTER, torch.float32, 10)]}, pin_memory=False)  # pageable: no pinning at all
    assert store.buffers[torch.float32].numel() == 10


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
        _config = type("C", (), {"_param_dict": {"zero_optimization": {"stage": 3},
                                                 "optimizer_state_offload": {"enabled": True}}})()
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


def test_host_memory_is_checked_before_deepspeed_runs(spies, monkeypatch):
    monkeypatch.setattr(cfgmod, "host_memory_available", lambda: 10_000)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    model = torch.nn.Linear(100, 10)  # 1010 parameters: 505 per rank, 6060 bytes, 2 ranks here: 12120
    cfg = {"zero_optimization": {"stage": 3}, "optimizer_state_offload": {"enabled": True}}
    with pytest.raises(ConfigError, match=r"2 rank\(s\) on this node needs 11\.84 KiB .* only 9\.77 KiB"):
        deepspeed_offload.initialize(model=model, config=cfg)
    assert spies == []


def test_host_store_counts_the_ranks_of_the_node(monkeypatch):
    monkeypatch.setattr(cfgmod, "host_memory_available", lambda: 3000)
    HostStore({0: [(MASTER, torch.float32, 500)]}, pin_memory=False)  # 2000 bytes: fits alone
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match="2 rank"):
        HostStore({0: [(MASTER, torch.float32, 500)]}, pin_memory=False)
