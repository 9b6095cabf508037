"""``deepspeed-offload env``: every value is the machine's real one, a probe that cannot run says why
(never a traceback), and ``--json`` prints JSON alone."""

import argparse
import json
import os
import platform
import re
import resource
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
import torch
from deepspeed.accelerator import get_accelerator
from packaging.version import Version

import deepspeed_offload
from deepspeed_offload import envinfo
from deepspeed_offload.sizing import host_memory
from deepspeed_offload.compat import at_least

ROOT = Path(__file__).resolve().parents[2]
# DeepSpeed's logger prints at warning level by default from this release on, at info level before it.
INFO_LOGGER_UNTIL = Version("0.17.6")
HAS_CUDA = torch.cuda.is_available() and get_accelerator().device_name() == "cuda"


@pytest.fixture(scope="module")
def report():
    return envinfo.collect()


def limit(v):
    return "unlimited" if v == resource.RLIM_INFINITY else v


def meminfo(key):
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024


def test_versions_are_the_installed_ones(report):
    import deepspeed
    assert report["python"].startswith(platform.python_version() + " ")
    assert report["torch"] == torch.__version__
    assert report["deepspeed"] == deepspeed.__version__
    assert report["deepspeed_offload"].startswith(deepspeed_offload.__version__ + " ")
    for key, dist in (("transformers", "transformers"), ("accelerate", "accelerate")):
        try:
            assert report[key] == metadata.version(dist)
        except metadata.PackageNotFoundError:
            assert report[key] is None and report["unavailable"][key] == "not installed"
    if torch.version.cuda:
        assert report["torch_cuda"] == torch.version.cuda
    elif not getattr(torch.version, "hip", None):
        assert report["torch_cuda"] is None and report["unavailable"]["torch_cuda"] == "torch is a CPU build"


def test_build_env_and_the_arch_list_hint(monkeypatch):
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0a")
    monkeypatch.delenv("DS_ACCELERATOR", raising=False)
    assert envinfo.probe_build_env()["TORCH_CUDA_ARCH_LIST"] == "9.0a"
    assert "DS_ACCELERATOR" not in envinfo.probe_build_env()

    class Builder:
        NAME = "dc"

        def is_compatible(self, verbose):
            return True

        def load(self, verbose):
            int("0a")

    import deepspeed_offload.config as cfg
    monkeypatch.setattr(cfg, "_compile_supported", lambda: (True, ""))
    monkeypatch.setattr(get_accelerator(), "create_op_builder", lambda name: Builder())
    with pytest.raises(envinfo.Unavailable, match=r"DeepCompileBuilder\(\)\.load\(\) failed: ValueError: .*"
                       r"TORCH_CUDA_ARCH_LIST='9.0a' .*'9.0'"):
        envinfo.probe_deepcompile()


def test_the_allocator_settings_are_reported_where_set(monkeypatch):
    for name in envinfo.ALLOC_CONF_ENV:
        monkeypatch.delenv(name, raising=False)
    assert envinfo.probe_allocator_conf() == {}
    assert envinfo.FORMATS["allocator_conf"]({}) == ("unset (torch's defaults); stream mode turns "
                                                     "expandable_segments on from attach to detach (the block's "
                                                     "expandable_segments)")
    assert envinfo.FORMATS["allocator_conf"]({"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:64"}).endswith(
        "(the block's expandable_segments)")
    # where the switch does not act, it is not promised
    assert envinfo.FORMATS["allocator_conf"]({"PYTORCH_CUDA_ALLOC_CONF": "backend:cudaMallocAsync"}) == \
        "PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync"
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    conf = envinfo.probe_allocator_conf()
    assert conf == {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    assert envinfo.FORMATS["allocator_conf"](conf) == "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"


def test_accelerator_memory_and_shm_are_the_machines(report):
    acc = get_accelerator()
    assert report["accelerator"] == acc.device_name()
    assert report["device_count"] == acc.device_count()
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    assert report["memlock_limit"] == {"soft": limit(soft), "hard": limit(hard),
                                       "cap_ipc_lock": host_memory.can_lock_any_amount()}
    assert report["host_memory"]["total"] == meminfo("MemTotal")
    assert 0 < report["host_memory"]["available"] <= report["host_memory"]["total"]
    shm = shutil.disk_usage("/dev/shm")
    assert report["dev_shm"]["total"] == shm.total
    pinnable = report["pinnable_host_memory"]
    assert 0 < pinnable["bytes"] <= report["host_memory"]["total"]
    if soft != resource.RLIM_INFINITY and not host_memory.can_lock_any_amount():
        assert pinnable["bytes"] <= soft


def test_memlock_soft_and_hard_are_kept_apart(monkeypatch):
    monkeypatch.setattr(envinfo.resource, "getrlimit", lambda which: (65536 * 1024, resource.RLIM_INFINITY))
    monkeypatch.setattr(envinfo, "can_lock_any_amount", lambda: False)
    assert envinfo.probe_memlock_limit() == {"soft": 65536 * 1024, "hard": "unlimited", "cap_ipc_lock": False}
    assert envinfo.FORMATS["memlock_limit"](envinfo.probe_memlock_limit()) == "soft 64.00 MiB, hard unlimited"
    monkeypatch.setattr(envinfo, "can_lock_any_amount", lambda: True)  # root in a container: ulimit -l is lifted
    assert envinfo.FORMATS["memlock_limit"](envinfo.probe_memlock_limit()).endswith("not binding: this process has "
                                                                                    "CAP_IPC_LOCK")


def test_pinnable_is_the_smallest_bound(monkeypatch, fake_host):
    fake_host(total=16 * 2**30, available=12 * 2**30)
    monkeypatch.setattr(envinfo.resource, "getrlimit", lambda which: (2**20, resource.RLIM_INFINITY))
    monkeypatch.setattr(host_memory, "can_lock_any_amount", lambda: False)
    assert envinfo.probe_pinnable_host_memory() == {"bytes": 2**20, "limited_by": "memlock limit (ulimit -l)"}
    monkeypatch.setattr(host_memory, "can_lock_any_amount", lambda: True)  # CAP_IPC_LOCK: what check plans with
    assert envinfo.probe_pinnable_host_memory() == {"bytes": 10 * 2**30, "limited_by": "usable host memory"}
    monkeypatch.setattr(envinfo.resource, "getrlimit", lambda which: (resource.RLIM_INFINITY,) * 2)
    assert envinfo.probe_pinnable_host_memory() == {"bytes": 10 * 2**30, "limited_by": "usable host memory"}
    fake_host(total=16 * 2**30, available=12 * 2**30, cgroup_limit=6 * 2**30, cgroup_usage=2**30)
    assert envinfo.probe_pinnable_host_memory() == {"bytes": 3 * 2**30, "limited_by": "usable host memory"}
    assert envinfo.probe_cgroup_memory_limit() == {"limit": 6 * 2**30, "usage": 2**30}


@pytest.mark.skipif(HAS_CUDA, reason="checks what is reported without a CUDA device")
def test_without_cuda_the_gpu_probes_say_so(report):
    for key in ("devices", "pin_test", "pinned_bandwidth"):
        assert report[key] is None
        assert report["unavailable"][key].startswith("no CUDA device")
    assert report["deepcompile"] is None
    assert "CUDA accelerator" in report["unavailable"]["deepcompile"]
    text = envinfo.format_text(report)
    assert re.search(r"^pinned_bandwidth +: n/a: no CUDA device", text, re.M)


def test_text_has_our_keys_aligned_then_collect_env_and_ds_report(report):
    """The versions are said once, by torch's collect_env and by ds_report, printed as they print
    them after our keys; the JSON keeps the keys (python, torch...) with the values they report."""
    text = envinfo.format_text(report)
    block = text.split("\n\n", 1)[0]
    lines = block.splitlines()
    keys = [k for k in report if k not in ("unavailable", "torch_env", "ds_report", *envinfo.FROM_SECTIONS)]
    assert [line.split(" : ")[0].rstrip() for line in lines[1:]] == keys
    assert len({line.index(" : ") for line in lines[1:]}) == 1
    assert not re.search(r"^(python|torch|deepspeed) +:", block, re.M)
    assert re.search(rf"^PyTorch version: {re.escape(torch.__version__)}$", text, re.M)
    assert f"\nds_report:\nDeepSpeed general environment info:\n" in text and "\x1b[" not in text
    assert re.search(rf"^deepspeed info \.+ {re.escape(report['deepspeed'])}, ", text, re.M)
    from torch.utils import collect_env
    env = collect_env.get_env_info()
    assert report["torch_env"]["torch_version"] == env.torch_version == report["torch"]
    assert (report["python"], report["platform"]) == (env.python_version, env.python_platform)


def test_a_report_that_fails_leaves_its_keys_in_the_text(monkeypatch):
    """Without collect_env's answer the keys it would have shown are printed above, as n/a."""
    envinfo.torch_env.cache_clear()
    monkeypatch.setattr("torch.utils.collect_env.get_env_info", lambda: 1 / 0)
    try:
        report = envinfo.collect([p for p in envinfo.PROBES if p[0] in ("torch", "deepspeed", "torch_env")])
    finally:
        envinfo.torch_env.cache_clear()
    text = envinfo.format_text(report)
    assert re.search(r"^torch +: n/a: probe failed: ZeroDivisionError", text, re.M)
    assert re.search(r"^torch.utils.collect_env:\nn/a: probe failed: ZeroDivisionError", text, re.M)
    assert re.search(rf"^deepspeed +: {re.escape(report['deepspeed'])}$", text, re.M)  # no ds_report here


def test_settings_are_the_ones_attach_reads(monkeypatch):
    monkeypatch.setenv("DS_OFFLOAD_PIN_THREADS", "3")
    monkeypatch.setenv("DS_OFFLOAD_COMMIT_TIMEOUT", "120")
    report = envinfo.collect([p for p in envinfo.PROBES if p[0] == "settings"])
    assert report["settings"]["pin_threads"] == 3 and report["settings"]["commit_timeout"] == 120
    assert envinfo.FORMATS["settings"](report["settings"]).startswith("commit_timeout 120, ")
    monkeypatch.setenv("DS_OFFLOAD_PIN_THREADS", "many")
    report = envinfo.collect([p for p in envinfo.PROBES if p[0] == "settings"])
    assert "DS_OFFLOAD_PIN_THREADS" in report["unavailable"]["settings"]


def test_a_failing_probe_gives_its_reason_not_a_traceback(monkeypatch, capsys):

    def boom():
        raise RuntimeError("no such device node")

    def exits():
        sys.exit(3)

    monkeypatch.setattr(envinfo, "PROBES", [("broken", boom), ("exiting", exits), *envinfo.PROBES[:3]])
    assert envinfo.main([]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^broken +: n/a: probe failed: RuntimeError: no such device node$", out, re.M)
    assert re.search(r"^exiting +: n/a: probe failed: SystemExit: 3$", out, re.M)
    assert f": {torch.__version__}" in out and "Traceback" not in out
    assert envinfo.main(["--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["broken"] is None and data["torch"] == torch.__version__
    assert data["unavailable"]["broken"] == "probe failed: RuntimeError: no such device node"


def test_json_stays_clean_when_a_probe_writes_to_stdout(monkeypatch, capfd):

    def noisy():
        print("python noise")
        sys.stdout.flush()
        os.write(1, b"fd noise\n")
        return 1

    monkeypatch.setattr(envinfo, "PROBES", [("noisy", noisy)])
    assert envinfo.main(["--json"]) == 0
    out, err = capfd.readouterr()
    assert json.loads(out) == {"noisy": 1, "unavailable": {}}
    assert "python noise" in err and "fd noise" in err


def test_register_adds_the_env_subcommand():
    parser = argparse.ArgumentParser()
    envinfo.register(parser.add_subparsers(dest="command", required=True))
    ns = parser.parse_args(["env", "--json"])
    assert ns.func is envinfo.cmd_env and ns.json


def test_module_prints_json_alone():
    """The whole command in a fresh process: stdout is one JSON object. Without a GPU, DeepSpeed
    itself prints a warning to stdout when it falls back to the CPU accelerator on import, before
    any code of ours runs; DS_ACCELERATOR=cpu (the documented workaround) makes that choice silent,
    except before DeepSpeed 0.17.6, whose logger prints at info level by default: there its line
    saying so comes first, and the JSON after it."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    if not HAS_CUDA:
        env["DS_ACCELERATOR"] = "cpu"
    proc = subprocess.run([sys.executable, "-m", "deepspeed_offload.envinfo", "--json"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    out = proc.stdout
    if not at_least(INFO_LOGGER_UNTIL):
        first, _, out = out.partition("\n")
        assert "Setting ds_accelerator to" in first, proc.stdout[:2000]
    data = json.loads(out)
    assert data["torch"] == torch.__version__ and "unavailable" in data


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
def test_on_a_gpu_pins_and_measures(report):
    assert len(report["devices"]) == torch.cuda.device_count() == report["device_count"]
    assert report["devices"][0]["name"] == torch.cuda.get_device_name(0)
    assert report["pin_test"]["bytes"] == envinfo.PIN_TEST_BYTES
    bw = report["pinned_bandwidth"]
    for key in ("h2d_GBps", "d2h_GBps", "both_each_way_GBps", "pageable_h2d_GBps"):
        assert 0.5 < bw[key] < 1000, (key, bw)
    assert report["nccl"] == ".".join(map(str, torch.cuda.nccl.version()))
    assert report["deepcompile"]["loadable"], report["unavailable"].get("deepcompile")
    text = envinfo.format_text(report)
    assert re.search(r"^pin_test +: ok, 64.00 MiB pinned", text, re.M)


def test_the_bandwidth_probe_needs_nothing_of_the_benchmark():
    """``env`` and ``estimate`` measure with ``deepspeed_offload.bandwidth``: importing it, the env
    report and the CLI pulls in neither the benchmark nor its extras (matplotlib, transformers are
    made unimportable here; tqdm comes with DeepSpeed itself)."""
    code = ("import sys\n"
            "sys.modules['matplotlib'] = sys.modules['transformers'] = None\n"
            "import deepspeed_offload.sizing.bandwidth, deepspeed_offload.envinfo, deepspeed_offload.cli\n"
            "assert 'deepspeed_offload.bench' not in sys.modules, 'the benchmark was imported'\n"
            "import deepspeed_offload.sizing.bandwidth as b\n"
            "assert callable(b.bandwidth) and callable(b.measure_bandwidth) and callable(b.bandwidth_all_ranks)\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
               DS_ACCELERATOR=os.environ.get("DS_ACCELERATOR", "cuda" if HAS_CUDA else "cpu"))
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
