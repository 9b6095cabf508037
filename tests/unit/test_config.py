"""Validation of the block and of its neighbours: every case of the README's "What is rejected" list (docs/troubleshooting.md) is a
ConfigError naming the key, and ``deepspeed-offload check`` exits 2 with that message."""

import json
from pathlib import Path

import pytest
import torch

from ds_configs import GOOD, with_

from deepspeed_offload import ConfigError, OffloadConfig
from deepspeed_offload import config as cfgmod
from deepspeed_offload.cli import main as cli_main
from deepspeed_offload.compat import PRECISION_CONFIG, at_least, deepspeed_release

ROOT = Path(__file__).resolve().parents[2]



def check(tmp_path, cfg, *extra):
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(cfg) if isinstance(cfg, dict) else cfg)
    return cli_main(["check", str(path), *extra])


COMPILE = with_(optimizer_state_offload__mode="compile", compile__deepcompile=True)

REJECTED = [
    ("stage 2", with_(zero_optimization__stage=2), "zero_optimization.stage"),
    ("no zero_optimization", {"optimizer_state_offload": {"enabled": True}}, "zero_optimization.stage"),
    ("ZeRO-Offload cpu", with_(zero_optimization__offload_optimizer={"device": "cpu"}),
     "zero_optimization.offload_optimizer.device"),
    ("ZeRO-Offload nvme", with_(zero_optimization__offload_optimizer={"device": "nvme"}),
     "zero_optimization.offload_optimizer.device"),
    ("offload_param with compile", with_(COMPILE, zero_optimization__offload_param={"device": "cpu"}),
     "zero_optimization.offload_param.device"),
    ("compile without deepcompile", with_(optimizer_state_offload__mode="compile"), "optimizer_state_offload.mode"),
    ("compile + offload_opt_states", with_(COMPILE, compile__offload_opt_states=True), "compile.offload_opt_states"),
    ("compile + offload_parameters", with_(COMPILE, compile__offload_parameters=True), "compile.offload_parameters"),
    ("compile + offload_activation", with_(COMPILE, compile__offload_activation=True), "compile.offload_activation"),
    ("unknown key", with_(optimizer_state_offload__sub_group_size=5), "optimizer_state_offload.sub_group_size"),
    ("wrong type", with_(optimizer_state_offload__pin_memory="yes"), "optimizer_state_offload.pin_memory"),
    ("wrong type, int as bool", with_(optimizer_state_offload__enabled=1), "optimizer_state_offload.enabled"),
    ("unknown mode", with_(optimizer_state_offload__mode="fast"), "optimizer_state_offload.mode"),
    ("negative sub_group_mb", with_(optimizer_state_offload__sub_group_mb=-1), "optimizer_state_offload.sub_group_mb"),
    ("zero sub_group_mb", with_(optimizer_state_offload__sub_group_mb=0), "optimizer_state_offload.sub_group_mb"),
    ("negative budget", with_(optimizer_state_offload__memory_budget_gb=-0.5),
     "optimizer_state_offload.memory_budget_gb"),
    ("block not an object", with_(optimizer_state_offload=True), "optimizer_state_offload"),
    ("speculation in compile mode", with_(COMPILE, optimizer_state_offload__speculate_memory_gb=4),
     "optimizer_state_offload.speculate_memory_gb"),
    ("speculation without overlap",
     with_(optimizer_state_offload__overlap=False, optimizer_state_offload__speculate_memory_gb=4),
     "optimizer_state_offload.speculate_memory_gb"),
    ("negative speculation", with_(optimizer_state_offload__speculate_memory_gb=-1),
     "optimizer_state_offload.speculate_memory_gb"),
    ("async checkpoint on node-local storage",
     with_(optimizer_state_offload__async_checkpoint=True, checkpoint={"use_node_local_storage": True}),
     "checkpoint.use_node_local_storage"),
    # accepted before, then inert or broken: refused alike by check and initialize
    ("async checkpoint with DeepSpeed's checkpoint writer",
     with_(optimizer_state_offload__async_checkpoint=True, checkpoint={"writer": {"type": "fast"}}),
     "checkpoint.writer"),
    ("async checkpoint with DataStates",
     with_(optimizer_state_offload__async_checkpoint=True, datastates_ckpt={"enabled": True}),
     "datastates_ckpt.enabled"),
    ("early-load cap without overlap",
     with_(optimizer_state_offload__overlap=False, optimizer_state_offload__overlap_memory_gb=2),
     "optimizer_state_offload.overlap_memory_gb"),
    ("device limit beside a hand-set budget",
     with_(optimizer_state_offload__memory_budget_gb=8, optimizer_state_offload__max_device_memory_gb=100),
     "optimizer_state_offload.max_device_memory_gb"),
    ("stream mode with the 16-bit parameters on NVMe",
     with_(zero_optimization__offload_param={"device": "nvme", "nvme_path": "/tmp"}),
     "zero_optimization.offload_param.device"),
]


@pytest.mark.parametrize("name,cfg,path", REJECTED, ids=[r[0] for r in REJECTED])
def test_rejected(tmp_path, capsys, name, cfg, path):
    with pytest.raises(ConfigError) as err:
        cfgmod.validate(cfg)
    assert err.value.path == path
    assert isinstance(err.value, ValueError)
    assert check(tmp_path, cfg) == 2
    captured = capsys.readouterr()
    assert path in captured.err and captured.out == ""


def test_compile_needs_cuda_accelerator(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(cfgmod, "_compile_supported", lambda: (False, "DeepCompile needs a CUDA accelerator, "
                                                               "this one is 'cpu'"))
    assert check(tmp_path, COMPILE) == 2
    assert "optimizer_state_offload.mode" in capsys.readouterr().err


def test_compile_on_cpu_accelerator_is_rejected_for_real():
    from deepspeed.accelerator import get_accelerator
    if get_accelerator().device_name() == "cuda":
        pytest.skip("this machine has CUDA: the CPU-accelerator rejection cannot be observed here")
    with pytest.raises(ConfigError, match="CUDA"):
        cfgmod.validate(COMPILE)


def test_compile_on_old_torch(monkeypatch):
    monkeypatch.setattr(torch, "__version__", "2.5.1+cu121")
    with pytest.raises(ConfigError, match=r"torch >= 2\.6") as err:
        cfgmod.validate(COMPILE)
    assert err.value.path == "optimizer_state_offload.mode"


def test_host_memory_too_small(tmp_path, capsys, fake_host):
    """With everything offloaded (memory_budget_gb 0) the store must fit the host; with the budget
    derived (the default) the host takes what it can and the GPU keeps the rest."""
    fake_host(total=16 * 2**30, available=10 * 2**30)  # 8 GiB usable
    all_out = dict(GOOD, optimizer_state_offload=dict(GOOD["optimizer_state_offload"], memory_budget_gb=0))
    assert check(tmp_path, all_out, "--params", str(10**9)) == 2  # 12 GB of state on 8 GiB
    err = capsys.readouterr().err
    assert "need 11.18 GiB" in err and "can give 8.00 GiB" in err and "memory_budget_gb" in err
    assert check(tmp_path, all_out, "--params", str(10**9), "--world-size", "2", "--ranks-per-node", "1") == 0  # fits
    assert "store 5.59 GiB per rank" in capsys.readouterr().out
    assert check(tmp_path, GOOD, "--params", str(10**9)) == 0
    assert "store 8.00 GiB per rank, 3.18 GiB of each rank's state stays on the GPU" in capsys.readouterr().out


def test_invalid_json_names_line_and_column(tmp_path, capsys):
    bad = '{\n  "zero_optimization": {"stage": 3},\n  "optimizer_state_offload": {"enabled": true,,}\n}'
    with pytest.raises(ConfigError, match="line 3, column"):
        cfgmod.load_ds_config(_write(tmp_path, bad))
    assert check(tmp_path, bad) == 2
    assert "line 3" in capsys.readouterr().err


def _write(tmp_path, text):
    p = tmp_path / "bad.json"
    p.write_text(text)
    return str(p)


@pytest.mark.parametrize("name", ["ds_config_offload.json", "ds_config_plain.json"])
def test_examples_pass(capsys, name):
    assert cli_main(["check", str(ROOT / "examples" / name)]) == 0
    out = capsys.readouterr().out
    assert "OK" in out and len(out.strip().splitlines()) == 1


def test_accepted_and_resolved():
    plan = cfgmod.validate(GOOD)
    assert plan.mode == "stream" and plan.sub_group_size_set_by_us
    assert plan.ds_config["zero_optimization"]["sub_group_size"] == 256 * 2**20 // 12
    assert "sub_group_size" not in GOOD["zero_optimization"]  # the user's dict is not modified
    kept = cfgmod.validate(with_(zero_optimization__sub_group_size=1000))
    assert kept.sub_group_size == 1000 and not kept.sub_group_size_set_by_us
    # stream mode does not mind parameter offload
    assert cfgmod.validate(with_(zero_optimization__offload_param={"device": "cpu"})).mode == "stream"


def test_disabled_or_absent_is_none():
    assert cfgmod.validate({"zero_optimization": {"stage": 1}}) is None
    assert cfgmod.validate(with_(zero_optimization__stage=0, optimizer_state_offload__enabled=False)) is None
    typo = with_(optimizer_state_offload={"enabled": False, "prefech": True})
    assert cfgmod.validate(typo) is None  # disabled: initialize is plain DeepSpeed (a warning names the typo)
    with pytest.raises(ConfigError, match="prefech"):  # ...but check says so
        cfgmod.validate(typo, strict_when_disabled=True)


def test_defaults_follow_design():
    c = OffloadConfig()
    assert (c.enabled, c.mode, c.sub_group_mb, c.pin_memory, c.prefetch, c.memory_budget_gb, c.overlap,
            c.overlap_memory_gb, c.async_checkpoint) == (False, None, 256, True, True, None, True, None, False)


@pytest.mark.parametrize("mode", [None, "absent"])
def test_mode_null_or_absent_is_derived(monkeypatch, mode):
    block = {"enabled": True} if mode == "absent" else {"enabled": True, "mode": None}
    assert cfgmod.validate(with_(optimizer_state_offload=block)).mode == "stream"
    monkeypatch.setattr(cfgmod, "_compile_supported", lambda: (True, ""))
    plan = cfgmod.validate(with_(optimizer_state_offload=block, compile={"deepcompile": True}))
    assert plan.mode == "compile" and plan.offload.mode is None


@pytest.mark.parametrize("key", ["mode", "memory_budget_gb", "sub_group_mb", "pin_memory", "enabled"])
def test_auto_is_never_one_of_our_values(key):
    with pytest.raises(ConfigError, match="not one of our values") as err:
        cfgmod.validate(with_(**{f"optimizer_state_offload__{key}": "auto"}))
    assert err.value.path == f"optimizer_state_offload.{key}"
    if key == "mode":
        assert "use null or leave it out" in err.value.reason


@pytest.mark.parametrize("value", ["true", 1])
def test_deepcompile_read_as_deepspeed_reads_it(monkeypatch, value):
    """DeepSpeed's CompileConfig turns DeepCompile on for "true" and 1: so does the derived mode."""
    from deepspeed.compile.config import CompileConfig
    assert CompileConfig(deepcompile=value).deepcompile is True
    monkeypatch.setattr(cfgmod, "_compile_supported", lambda: (True, ""))
    assert cfgmod.validate(with_(compile={"deepcompile": value})).mode == "compile"


def test_deprecated_aliases_resolved_as_deepspeed_does(monkeypatch):
    with pytest.raises(ConfigError, match="deprecated cpu_offload") as err:
        cfgmod.validate(with_(zero_optimization__cpu_offload=True))
    assert err.value.path == "zero_optimization.offload_optimizer.device"
    assert cfgmod.validate(with_(zero_optimization__cpu_offload=False)).mode == "stream"
    monkeypatch.setattr(cfgmod, "_compile_supported", lambda: (True, ""))
    with pytest.raises(ConfigError, match="deprecated cpu_offload_param") as err:
        cfgmod.validate(with_(COMPILE, zero_optimization__cpu_offload_param=True))
    assert err.value.path == "zero_optimization.offload_param.device"
    # DeepSpeed's old format: "zero_optimization": true is stage 1
    with pytest.raises(ConfigError, match="got true, which DeepSpeed reads as 1"):
        cfgmod.validate(with_(zero_optimization=True))
    # DeepSpeed reads "3" and 3.0 as stage 3; "auto" is dropped (stage 0)
    assert cfgmod.validate(with_(zero_optimization__stage="3")).mode == "stream"
    assert cfgmod.validate(with_(zero_optimization__stage=3.0)).mode == "stream"
    with pytest.raises(ConfigError, match='"auto", which DeepSpeed reads as 0'):
        cfgmod.validate(with_(zero_optimization__stage="auto"))


@pytest.mark.skipif(not at_least(PRECISION_CONFIG), reason=f"DeepSpeed checks the bf16 section from "
                    f"{PRECISION_CONFIG} on, this is {deepspeed_release()}")
def test_the_old_bf16_name_is_checked_as_deepspeed_reads_it():
    # the old "bfloat16" section name is read (and checked) when "bf16" is absent
    with pytest.raises(ConfigError) as err:
        cfgmod.validate(with_(bfloat16={"enabled": "maybe"}))
    assert err.value.path == "bfloat16.enabled"


def test_sub_group_size_as_deepspeed_reads_it(monkeypatch):
    warnings = []
    monkeypatch.setattr(cfgmod.logger, "warning", warnings.append)
    auto = cfgmod.validate(with_(zero_optimization__sub_group_size="auto"))  # OpenRLHF: unset, ours goes in
    assert auto.sub_group_size_set_by_us and auto.ds_config["zero_optimization"]["sub_group_size"] == 22369621
    assert warnings == []
    huge = cfgmod.validate(with_(zero_optimization__sub_group_size=1e9))  # the HF templates' float
    assert huge.sub_group_size == 10**9 and not huge.sub_group_size_set_by_us
    assert huge.ds_config["zero_optimization"]["sub_group_size"] == 1e9  # DeepSpeed gets the user's value
    (warning, ) = warnings
    assert "11.18 GiB" in warning and "sub_group_mb=256" in warning and "22,369,621" in warning
    assert cfgmod.validate(with_(zero_optimization__sub_group_size=5 * 10**8)).sub_group_size == 5 * 10**8
    assert len(warnings) == 1  # below DeepSpeed's default: the user chose it
    for bad in ("1e9", 1.5, -5):
        with pytest.raises(ConfigError) as err:
            cfgmod.validate(with_(zero_optimization__sub_group_size=bad))
        assert err.value.path == "zero_optimization.sub_group_size"


def test_world_size_for_the_batch_check():
    cfg = with_(train_batch_size=16, train_micro_batch_size_per_gpu=2, gradient_accumulation_steps=1)
    assert cfgmod.validate(cfg) is not None  # world size unknown: 8 fits
    assert cfgmod.validate(cfg, world_size=8) is not None
    with pytest.raises(ConfigError, match="world size 4") as err:
        cfgmod.validate(cfg, world_size=4)
    assert err.value.path == "train_batch_size"
    with pytest.raises(ConfigError, match="whatever the world size"):
        cfgmod.validate(with_(cfg, train_batch_size=15))


def test_files_read_like_deepspeed(tmp_path):
    with pytest.raises(ConfigError, match="appears twice"):
        cfgmod.load_ds_config(_write(tmp_path, '{"zero_optimization": {"stage": 3, "stage": 2}}'))
    with pytest.raises(ConfigError, match="JSON object, this is a list"):
        cfgmod.load_ds_config(_write(tmp_path, '[1, 2]'))
    hj = cfgmod.load_ds_config(_write(tmp_path, '{\n  // hjson comments, as DeepSpeed accepts\n  "a": 1\n}'))
    assert hj == {"a": 1}


def test_config_routes(tmp_path):
    import argparse
    import base64
    path = _write(tmp_path, json.dumps(GOOD))
    assert cfgmod.load_ds_config(path) == GOOD
    assert cfgmod.load_ds_config(base64.urlsafe_b64encode(json.dumps(GOOD).encode()).decode()) == GOOD
    args = argparse.Namespace(deepspeed_config=path)
    assert cfgmod.resolve_config_source(args=args) == path
    with pytest.raises(ConfigError, match="both"):
        cfgmod.resolve_config_source(args=args, config=GOOD)
    with pytest.raises(ConfigError, match="neither"):
        cfgmod.load_ds_config("no-such-file.json")


@pytest.mark.parametrize("sub", [[], ["check"]])
def test_help(capsys, sub):
    with pytest.raises(SystemExit) as e:
        cli_main(sub + ["--help"])
    assert e.value.code == 0
    assert "usage: deepspeed-offload" in capsys.readouterr().out


def test_compile_mode_where_deepcompile_can_run(monkeypatch):
    monkeypatch.setattr(cfgmod, "_compile_supported", lambda: (True, ""))
    plan = cfgmod.validate(COMPILE)
    assert plan.mode == "compile"
    # and on such a machine the real rejections still hold
    with pytest.raises(ConfigError, match="compile.offload_opt_states"):
        cfgmod.validate(with_(COMPILE, compile__offload_opt_states=True))
