"""One validation path: every bad ds_config below is refused by ``deepspeed-offload check`` (exit 2,
the key on stderr, no traceback) and by ``deepspeed_offload.initialize`` (a ConfigError naming the
key, raised before any process group exists). Cases are what users hit: values DeepSpeed's own
models refuse after the process group exists, Hugging Face "auto" placeholders, DeepSpeed's
deprecated aliases, unreadable files. And a ConfigError crosses process boundaries intact."""

import functools
import json
import multiprocessing
import pickle

import deepspeed
import deepspeed.comm as ds_comm
import pytest
import torch
import torch.distributed as torch_dist

import deepspeed_offload
from ds_configs import GOOD, with_
from packaging.version import Version

from deepspeed_offload import ConfigError
from deepspeed_offload import config as cfgmod
from deepspeed_offload.cli import main as cli_main
from deepspeed_offload.compat import PRECISION_CONFIG, REMOVED_FEATURE_KEYS, at_least, deepspeed_release



def block(**kw):
    return with_(**{f"optimizer_state_offload__{k}": v for k, v in kw.items()})


def zero(**kw):
    return with_(**{f"zero_optimization__{k}": v for k, v in kw.items()})


def text(s):
    return ("text", s)


DEEP = "[" * 100_000 + "]" * 100_000
GOOD_TEXT = json.dumps(GOOD)
FILE = "<file>"  # the key of a file-level error is the file's own path

# (id, ds_config dict or text(...) or "dir", key in the error, a further phrase in the error or None)
CASES = [
    # our block: finite, bounded, typed, never "auto"
    ("budget 1e300", block(memory_budget_gb=1e300), "optimizer_state_offload.memory_budget_gb", "less than"),
    ("budget Infinity", text(GOOD_TEXT.replace('"enabled": true', '"enabled": true, "memory_budget_gb": Infinity')),
     "optimizer_state_offload.memory_budget_gb", "finite"),
    ("budget NaN", block(memory_budget_gb=float("nan")), "optimizer_state_offload.memory_budget_gb", "finite"),
    ("budget negative", block(memory_budget_gb=-0.5), "optimizer_state_offload.memory_budget_gb", None),
    ("budget string", block(memory_budget_gb="8"), "optimizer_state_offload.memory_budget_gb", None),
    ("overlap_memory inf", block(overlap_memory_gb=float("inf")), "optimizer_state_offload.overlap_memory_gb",
     "finite"),
    ("overlap_memory negative", block(overlap_memory_gb=-1), "optimizer_state_offload.overlap_memory_gb", None),
    ("overlap not a bool", block(overlap="yes"), "optimizer_state_offload.overlap", None),
    ("mode auto", block(mode="auto"), "optimizer_state_offload.mode", "null"),
    ("mode unknown", block(mode="fast"), "optimizer_state_offload.mode", None),
    ("pin_memory auto", block(pin_memory="auto"), "optimizer_state_offload.pin_memory", "not one of our values"),
    ("sub_group_mb 0", block(sub_group_mb=0), "optimizer_state_offload.sub_group_mb", None),
    ("sub_group_mb float", block(sub_group_mb=1.5), "optimizer_state_offload.sub_group_mb", None),
    ("sub_group_mb huge", block(sub_group_mb=2**40), "optimizer_state_offload.sub_group_mb", None),
    ("unknown key", block(prefech=True), "optimizer_state_offload.prefech", "unknown key"),
    ("enabled as 1", block(enabled=1), "optimizer_state_offload.enabled", None),
    ("block a list", with_(optimizer_state_offload=[1]), "optimizer_state_offload", None),
    # zero_optimization through DeepSpeed's DeepSpeedZeroConfig
    ("offload_optimizer CPU", zero(offload_optimizer={"device": "CPU"}), "zero_optimization.offload_optimizer.device",
     "'cpu'"),
    ("offload_param GPU", zero(offload_param={"device": "gpu"}), "zero_optimization.offload_param.device", None),
    ("sub_group_size -5", zero(sub_group_size=-5), "zero_optimization.sub_group_size", None),
    ("sub_group_size '1e9'", zero(sub_group_size="1e9"), "zero_optimization.sub_group_size", "without quotes"),
    ("sub_group_size 1.5", zero(sub_group_size=1.5), "zero_optimization.sub_group_size", None),
    ("stage 2", zero(stage=2), "zero_optimization.stage", None),
    ("stage auto", zero(stage="auto"), "zero_optimization.stage", "reads as 0"),
    ("zero_optimization a string", with_(zero_optimization="three"), "zero_optimization", None),
    ("zero unknown key", zero(stage3_prefetch_bucket="x"), "zero_optimization.stage3_prefetch_bucket", None),
    ("deprecated cpu_offload", zero(cpu_offload=True), "zero_optimization.offload_optimizer.device",
     "deprecated cpu_offload"),
    ("cpu_offload and offload_optimizer", zero(cpu_offload=True, offload_optimizer={"device": "none"}),
     "zero_optimization.cpu_offload", None),
    ("ZeRO-Offload nvme", zero(offload_optimizer={"device": "nvme", "nvme_path": "/tmp"}),
     "zero_optimization.offload_optimizer.device", None),
    # compile, bf16, fp16 through DeepSpeed's models
    ("deepcompile maybe", with_(compile={"deepcompile": "maybe"}), "compile.deepcompile", None),
    ("compile not an object", with_(compile=True), "compile", None),
    ("compile unknown key", with_(compile={"deepcompile": False, "ofload": True}), "compile.ofload", None),
    ("bf16 enabled maybe", with_(bf16={"enabled": "maybe"}), "bf16.enabled", None),
    ("fp16 loss_scale negative", with_(fp16={"enabled": True, "loss_scale": -1}), "fp16.loss_scale", None),
    # the block against the rest, with DeepCompile read as DeepSpeed reads it ("true", 1)
    ("compile mode without deepcompile", block(mode="compile"), "optimizer_state_offload.mode", None),
    ("deepcompile 'true' with offload_opt_states",
     with_(compile={"deepcompile": "true", "offload_opt_states": True}), "compile.offload_opt_states", None),
    ("deepcompile 1 with cpu_offload_param", with_(compile={"deepcompile": 1}, zero_optimization={
        "stage": 3, "cpu_offload_param": True}), "zero_optimization.offload_param.device", "cpu_offload_param"),
    ("async checkpoint on node-local storage",
     with_(optimizer_state_offload={"enabled": True, "async_checkpoint": True},
           checkpoint={"use_node_local_storage": True}), "checkpoint.use_node_local_storage", None),
    # what DeepSpeedConfig refuses beyond the sections: batch sizes, HF placeholders, removed features
    ("micro batch auto", with_(train_micro_batch_size_per_gpu="auto"), "train_micro_batch_size_per_gpu", "auto"),
    ("accumulation auto", with_(gradient_accumulation_steps="auto"), "gradient_accumulation_steps", "auto"),
    ("train batch auto", with_(train_batch_size="auto"), "train_batch_size", "auto"),
    ("no batch size", with_(train_micro_batch_size_per_gpu=None), "train_micro_batch_size_per_gpu", None),
    ("micro batch 0", with_(train_micro_batch_size_per_gpu=0), "train_micro_batch_size_per_gpu", None),
    ("micro batch negative", with_(train_micro_batch_size_per_gpu=-2), "train_micro_batch_size_per_gpu", None),
    ("micro batch string", with_(train_micro_batch_size_per_gpu="2"), "train_micro_batch_size_per_gpu", None),
    ("batch sizes inconsistent", with_(train_batch_size=15, train_micro_batch_size_per_gpu=2,
                                       gradient_accumulation_steps=1), "train_batch_size", "world size"),
    ("lr auto", with_(optimizer={"type": "AdamW", "params": {"lr": "auto"}}), "optimizer.params.lr", None),
    ("warmup auto", with_(scheduler={"type": "WarmupLR", "params": {"warmup_num_steps": "auto"}}),
     "scheduler.params.warmup_num_steps", None),
    ("removed amp block", with_(amp={"enabled": True}), "amp", "removed"),
    ("removed MiCS key", zero(mics_shard_size=2), "zero_optimization.mics_shard_size", "removed"),
    # files
    ("empty file", text(""), FILE, "empty"),
    ("whitespace-only file", text("  \n\t\n"), FILE, "empty"),
    ("directory", "dir", FILE, "directory"),
    ("non-UTF-8 bytes", text(b'{"a": "\xff\xfe"}'), FILE, "UTF-8"),
    ("deep nesting", text(DEEP), FILE, "nested"),
    ("not JSON", text("this is not json\n"), FILE, "line 1, column 1"),
    ("broken JSON", text('{\n  "train_micro_batch_size_per_gpu": 1,\n  "zero_optimization": {"stage": 3},,\n}'), FILE,
     "line 3, column"),
    ("JSON array", text("[1, 2]"), FILE, "JSON object"),
    ("duplicate key", text('{"zero_optimization": {"stage": 3, "stage": 2}}'), "stage", "appears twice"),
]


def _materialize(tmp_path, cfg):
    """(what initialize gets as config=, the path check gets, the expected key for file errors)."""
    if cfg == "dir":
        d = tmp_path / "configs"
        d.mkdir()
        return str(d), str(d)
    path = tmp_path / "ds_config.json"
    if isinstance(cfg, tuple):
        data = cfg[1]
        path.write_bytes(data if isinstance(data, bytes) else data.encode())
        return str(path), str(path)
    path.write_text(json.dumps(cfg))
    return cfg, str(path)


@pytest.fixture
def no_deepspeed(monkeypatch):
    """A config validation lets through must not reach DeepSpeed (it would build a process group)."""

    @functools.wraps(deepspeed.initialize)
    def refuse(*a, **k):
        raise AssertionError("validation let this config through to deepspeed.initialize")

    monkeypatch.setattr(deepspeed, "initialize", refuse)


def test_at_least_forty_cases():
    assert len(CASES) >= 40 and len({c[0] for c in CASES}) == len(CASES)


# Cases DeepSpeed itself refuses only from a release on (before it, DeepSpeed accepts them, or refuses
# them for another reason, and so does the check).
REFUSED_FROM = {
    "bf16 enabled maybe": PRECISION_CONFIG,  # bf16 as a pydantic model
    "fp16 loss_scale negative": Version("0.18.8"),  # fp16.loss_scale validated (DeepSpeed #7889)
    "removed MiCS key": REMOVED_FEATURE_KEYS,
    "removed amp block": Version("0.19.8"),  # "amp" among the removed features
}


def _refused_from(name):
    release = REFUSED_FROM.get(name)
    return pytest.mark.skipif(release is not None and not at_least(release),
                              reason=f"DeepSpeed refuses it from {release} on, this is {deepspeed_release()}")


@pytest.mark.parametrize("name,cfg,key,phrase", [pytest.param(*c, marks=_refused_from(c[0])) for c in CASES],
                         ids=[c[0] for c in CASES])
def test_check_and_initialize_refuse_alike(tmp_path, capsys, no_deepspeed, name, cfg, key, phrase):
    config, path = _materialize(tmp_path, cfg)
    key = path if key == FILE else key

    # (a config with "auto" is a framework's: check fills it as the HF Trainer would unless told the
    # config goes to deepspeed.initialize as it is, as initialize here takes it)
    assert cli_main(["check", path, "--framework", "deepspeed"]) == 2
    captured = capsys.readouterr()
    assert key in captured.err and "Traceback" not in captured.err and "OK" not in captured.out
    if phrase:
        assert phrase in captured.err

    model = torch.nn.Linear(4, 4)
    with pytest.raises(ConfigError) as err:
        deepspeed_offload.initialize(model=model, model_parameters=model.parameters(), config=config)
    assert err.value.path == key
    if phrase:
        assert phrase in str(err.value)
    assert not torch_dist.is_initialized() and not ds_comm.is_initialized()


def test_the_good_config_passes_both(capsys, tmp_path, monkeypatch):
    """The table's base config is good: each case fails for its own key only."""
    assert cli_main(["check", _materialize(tmp_path, GOOD)[1]]) == 0
    calls = []

    @functools.wraps(deepspeed.initialize)
    def initialize(*a, **k):
        calls.append(k)
        return ("engine", None, None, None)

    monkeypatch.setattr(deepspeed, "initialize", initialize)
    monkeypatch.setattr(deepspeed_offload.api, "_attach_if_trainable", lambda engine, plan: None)
    deepspeed_offload.initialize(model=torch.nn.Linear(4, 4), config=GOOD)
    assert calls and calls[0]["config"]["zero_optimization"]["sub_group_size"] == 256 * 2**20 // 12


def _raise_config_error(path, reason):
    raise ConfigError(path, reason)


def test_config_error_pickles():
    with pytest.raises(ConfigError) as caught:
        cfgmod.validate(with_(zero_optimization__offload_optimizer={"device": "CPU"}))
    back = pickle.loads(pickle.dumps(caught.value))
    assert type(back) is ConfigError and isinstance(back, ValueError)
    assert (back.path, back.reason, str(back)) == (caught.value.path, caught.value.reason, str(caught.value))


def test_config_error_crosses_a_process_pool():
    """Raised in a worker, it reaches the parent with path and reason (it used to kill the pool's
    result handler, and the parent waited forever: the timeout turns that into a failure)."""
    pool = multiprocessing.get_context("fork").Pool(1)
    try:
        result = pool.apply_async(_raise_config_error, ("zero_optimization.stage", "needs ZeRO stage 3"))
        with pytest.raises(ConfigError) as err:
            result.get(timeout=20)
    finally:
        pool.terminate()
    assert (err.value.path, err.value.reason) == ("zero_optimization.stage", "needs ZeRO stage 3")
    assert str(err.value) == "zero_optimization.stage: needs ZeRO stage 3"
