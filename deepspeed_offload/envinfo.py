"""``deepspeed-offload env``: what a bug report about this package needs to know about the machine.

Versions, CUDA, the GPUs and the OS are what torch's ``collect_env`` and DeepSpeed's ``ds_report`` (its
general environment info) say, printed as they print them. Added is what offload depends on: the
integrations' versions, the accelerator and each GPU's NUMA node, the ``DS_OFFLOAD_*`` settings, how
much host memory the stores can pin (``ulimit -l`` and CAP_IPC_LOCK, MemAvailable, the cgroup limit,
a real 64 MiB pin on a GPU), /dev/shm, the pinned copy bandwidth each way and both at once
(``bandwidth.bandwidth``, the benchmark's own probe), and whether DeepCompile loads.

Each probe is one key. A probe with nothing to measure here (no CUDA device, a package not installed)
or one that fails gives its reason instead of a value: the text output says ``n/a: <reason>``, the
JSON output has ``null`` and the reason under ``"unavailable"``. Nothing raises past a probe, so the
report always completes and never shows a traceback. While the probes run, anything written to
stdout (DeepSpeed's logger, a JIT build) goes to stderr, so ``--json`` prints JSON alone; one line
comes before any code here runs: on a machine without a GPU, DeepSpeed prints a warning to stdout
when it falls back to the CPU accelerator on import (``DS_ACCELERATOR=cpu`` silences it).

    deepspeed-offload env [--json]
    python -m deepspeed_offload.envinfo [--json]
"""

import argparse
import contextlib
import functools
import io
import json
import os
import re
import resource
import shutil
import sys
import time
from importlib import import_module, metadata

from .env_settings import read_env
from .sizing.host_memory import (HostMemory, can_lock_any_amount, format_bytes, gpu_bus_id, memlock_limit, numa_nodes,
                          pci_numa_node)
from .runtime.memory.allocator import ALLOC_CONF_ENV, wanted

PIN_TEST_BYTES = 64 * 2**20
# bandwidth.bandwidth copies this many GiB each way (two pinned buffers, two device buffers).
BANDWIDTH_GIB = 1
BUILD_ENV = ("DS_ACCELERATOR", "CUDA_VISIBLE_DEVICES", "CUDA_HOME", "TORCH_CUDA_ARCH_LIST", "TORCH_EXTENSIONS_DIR",
             "DS_BUILD_OPS")


class Unavailable(Exception):
    """A probe's answer that there is nothing to report here, with the reason (not a failure)."""


def _acc():
    from deepspeed.accelerator import get_accelerator
    return get_accelerator()


def _need_cuda():
    import torch
    name = _acc().device_name()
    if name != "cuda" or not torch.cuda.is_available():
        raise Unavailable(f"no CUDA device (accelerator '{name}')")


# ---- the probes: each returns the key's value or raises (Unavailable with the reason) ----


@functools.lru_cache(maxsize=None)
def torch_env():
    """torch's ``collect_env.get_env_info()`` (run once: it asks pip, nvidia-smi, lscpu...)."""
    from torch.utils import collect_env
    return collect_env.get_env_info()


def probe_torch_cuda():
    env = torch_env()
    if env.hip_compiled_version not in (None, "N/A"):
        return f"hip {env.hip_compiled_version}"
    if env.cuda_compiled_version:
        return env.cuda_compiled_version
    raise Unavailable("torch is a CPU build")


def probe_ds_report():
    """DeepSpeed's general environment info as ``ds_report`` prints it (its table of ops is left to
    ``ds_report``: of them, compile mode needs DeepCompile, which ``deepcompile`` loads)."""
    from deepspeed import env_report
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        env_report.debug_report()
    return re.sub(r"\x1b\[[0-9;]*m", "", out.getvalue()).rstrip()  # without its colours


def probe_deepspeed_offload():
    from . import __version__
    return f"{__version__} ({os.path.dirname(os.path.abspath(__file__))})"


def _distribution(*names):
    def probe():
        for name in names:
            with contextlib.suppress(metadata.PackageNotFoundError):
                return metadata.version(name)
        raise Unavailable("not installed")
    return probe


def _set(names):
    """Those of the environment variables ``names`` that are set, with their values."""
    return {k: os.environ[k] for k in names if k in os.environ}


def _assignments(v):
    return ", ".join(f"{k}={val}" for k, val in v.items())


def probe_build_env():
    """The environment variables that decide which accelerator DeepSpeed picks and how its JIT ops
    (FusedAdam, DeepCompile) build, where set."""
    return _set(BUILD_ENV)


def probe_allocator_conf():
    """The CUDA caching allocator's settings from the environment, where set (``expandable_segments``
    lowers the reserved peak where the pool fragments: docs/troubleshooting.md)."""
    return _set(ALLOC_CONF_ENV)


def probe_devices():
    _need_cuda()
    import torch
    devices = []
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        bus = gpu_bus_id(i)
        devices.append({"name": p.name, "memory": p.total_memory, "capability": f"{p.major}.{p.minor}", "pci": bus,
                        "numa_node": pci_numa_node(bus) if bus else None})
    return devices


def probe_numa_nodes():
    """The host's NUMA nodes (the store's pages go to the node of each rank's GPU)."""
    nodes = numa_nodes()
    if not nodes:
        raise Unavailable("no /sys/devices/system/node")
    return nodes


def probe_nccl():
    _need_cuda()
    import torch
    v = torch.cuda.nccl.version()
    return ".".join(map(str, v)) if isinstance(v, tuple) else str(v)


def probe_memlock_limit():
    soft, hard = ("unlimited" if v == resource.RLIM_INFINITY else v
                  for v in resource.getrlimit(resource.RLIMIT_MEMLOCK))
    return {"soft": soft, "hard": hard, "cap_ipc_lock": can_lock_any_amount()}


def probe_host_memory():
    """MemTotal and MemAvailable; ``free``: what the node can give (the cgroup may allow less);
    ``usable``: what the pinned stores may take, after the headroom left for the rest of the host."""
    memory = HostMemory.read()
    return {"total": memory.total, "available": memory.available, "free": memory.free, "usable": memory.usable}


def probe_cgroup_memory_limit():
    memory = HostMemory.read()
    return "unlimited" if memory.cgroup_limit is None else {"limit": memory.cgroup_limit, "usage": memory.cgroup_usage}


def probe_pinnable_host_memory():
    """What the host stores could pin at most: the usable host memory, bounded by the memlock soft limit."""
    # (memlock_limit None: unlimited, or lifted by CAP_IPC_LOCK)
    bounds = {"usable host memory": HostMemory.read().usable, "memlock limit (ulimit -l)": memlock_limit()}
    limited_by = min((k for k in bounds if bounds[k] is not None), key=bounds.get)
    return {"bytes": bounds[limited_by], "limited_by": limited_by}


def probe_pin_test():
    """Page-lock 64 MiB the way the host store does (``runtime/memory/pinned.py``: exact size, registered)."""
    _need_cuda()
    import torch

    from .compat import pin_empty
    from .runtime.memory import pinned
    acc = _acc()
    buffers, stats, _ = pinned.allocate({torch.uint8: PIN_TEST_BYTES}, {torch.uint8: [(0, PIN_TEST_BYTES)]},
                                     pinned.make_pinner(acc, True), fallback=lambda n, dt: pin_empty(acc, n, dt))
    ok = acc.is_pinned(buffers[torch.uint8])
    del buffers
    if not ok:
        raise RuntimeError(f"{format_bytes(PIN_TEST_BYTES)} locked with {stats.kind} are not page-locked")
    return {"bytes": PIN_TEST_BYTES, "seconds": stats.seconds, "how": stats.kind}


def probe_dev_shm():
    if not os.path.isdir("/dev/shm"):
        raise Unavailable("no /dev/shm")
    usage = shutil.disk_usage("/dev/shm")
    return {"total": usage.total, "free": usage.free}


def probe_pinned_bandwidth():
    """The benchmark's own probe: GB/s host to device, device to host, each way with both at once,
    and pageable host to device for comparison."""
    _need_cuda()
    from .sizing.bandwidth import bandwidth
    return bandwidth(BANDWIDTH_GIB)


def probe_deepcompile():
    """What compile mode needs: torch >= 2.6, a CUDA accelerator (the same check as config.py) and
    DeepSpeed's DeepCompile op, built or loaded here (a JIT build takes a minute, once)."""
    from .config import _compile_supported
    ok, why = _compile_supported()
    if not ok:
        raise Unavailable(why)
    builder = _acc().create_op_builder("DeepCompileBuilder")
    if builder is None:
        raise Unavailable("this accelerator has no DeepCompileBuilder")
    if not builder.is_compatible(verbose=False):
        raise Unavailable("DeepCompileBuilder is not compatible with this system (ds_report says why)")
    from deepspeed.git_version_info import installed_ops
    prebuilt = bool(installed_ops.get(builder.NAME, False))
    t = time.perf_counter()
    try:
        builder.load(verbose=False)
    except Exception as e:
        arch = os.environ.get("TORCH_CUDA_ARCH_LIST", "")
        hint = ""
        if re.search(r"\d\.\d+[a-zA-Z]", arch):
            plain = re.sub(r"(\d\.\d+)[a-zA-Z]+", r"\1", arch)
            hint = (f"; DeepSpeed's JIT builder cannot parse TORCH_CUDA_ARCH_LIST={arch!r} (the letter suffix): "
                    f"set it without, e.g. {plain!r}")
        raise Unavailable(f"DeepCompileBuilder().load() failed: {type(e).__name__}: {e}{hint}") from None
    return {"loadable": True, "prebuilt": prebuilt, "load_seconds": time.perf_counter() - t}


PROBES = [
    ("python", lambda: torch_env().python_version),
    ("platform", lambda: torch_env().python_platform),
    ("torch", lambda: torch_env().torch_version),
    ("torch_cuda", probe_torch_cuda),
    ("deepspeed", lambda: import_module("deepspeed").__version__),
    ("deepspeed_offload", probe_deepspeed_offload),
    ("transformers", _distribution("transformers")),
    ("accelerate", _distribution("accelerate")),
    ("lightning", _distribution("lightning", "pytorch-lightning")),
    ("build_env", probe_build_env),
    ("allocator_conf", probe_allocator_conf),
    ("settings", lambda: read_env().model_dump()),  # this package's DS_OFFLOAD_* settings in effect
    ("accelerator", lambda: _acc().device_name()),
    ("device_count", lambda: _acc().device_count()),
    ("devices", probe_devices),
    ("numa_nodes", probe_numa_nodes),
    ("nccl", probe_nccl),
    ("memlock_limit", probe_memlock_limit),
    ("host_memory", probe_host_memory),
    ("cgroup_memory_limit", probe_cgroup_memory_limit),
    ("pinnable_host_memory", probe_pinnable_host_memory),
    ("pin_test", probe_pin_test),
    ("dev_shm", probe_dev_shm),
    ("pinned_bandwidth", probe_pinned_bandwidth),
    ("deepcompile", probe_deepcompile),
    ("torch_env", lambda: torch_env()._asdict()),
    ("ds_report", probe_ds_report),
]
# The text output prints the two reports as they print them, after the keys; the keys whose values come
# from a report (kept in the JSON) are not repeated above it.
SECTIONS = {"torch_env": "torch.utils.collect_env:", "ds_report": "ds_report:"}
FROM_SECTIONS = {"python": "torch_env", "platform": "torch_env", "torch": "torch_env", "torch_cuda": "torch_env",
                 "deepspeed": "ds_report"}


@contextlib.contextmanager
def _stdout_to_stderr():
    """Send stdout to stderr while probes run: sys.stdout, and fd 1 for handlers that hold the
    original stream (DeepSpeed's logger) and for child processes (a JIT build)."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1)
    try:
        os.dup2(2, 1)
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def collect(probes=None):
    """Run every probe. Returns ``{key: value, ..., "unavailable": {key: reason}}``: a key whose probe
    had nothing to report or failed has the value None and its reason under "unavailable"."""
    report, unavailable = {}, {}
    with _stdout_to_stderr():
        for key, probe in PROBES if probes is None else probes:
            try:
                report[key] = probe()
            except Unavailable as e:
                report[key], unavailable[key] = None, str(e)
            except (Exception, SystemExit) as e:  # a probe must not end the report (a builder may exit)
                report[key], unavailable[key] = None, f"probe failed: {type(e).__name__}: {e}"
    report["unavailable"] = unavailable
    return report


def _fmt_bytes(n):
    return n if isinstance(n, str) else format_bytes(n)


def _pretty_torch_env(v):
    from torch.utils import collect_env
    return collect_env.pretty_str(collect_env.SystemEnv(**v))


FORMATS = {
    "build_env": lambda v: _assignments(v) or "none of " + " ".join(BUILD_ENV),
    "allocator_conf": lambda v: (_assignments(v) or "unset (torch's defaults)") + (
        "; stream mode turns expandable_segments on from attach to detach (the block's expandable_segments)"
        if wanted(True, "cuda", v) else ""),
    "settings": lambda v: ", ".join(f"{k} {'default' if x is None else f'{x:g}'}" for k, x in v.items()),
    "devices": lambda ds: "; ".join(f"{i}: {d['name']}, {format_bytes(d['memory'])}, sm {d['capability']}, "
                                    f"PCI {d['pci']}, NUMA node {d['numa_node']}" for i, d in enumerate(ds)),
    "numa_nodes": lambda v: f"{len(v)} ({', '.join(map(str, v))})",
    "memlock_limit": lambda v: (f"soft {_fmt_bytes(v['soft'])}, hard {_fmt_bytes(v['hard'])}"
                                + ("; not binding: this process has CAP_IPC_LOCK" if v.get("cap_ipc_lock") else "")),
    "host_memory": lambda v: (f"{format_bytes(v['available'])} available of {format_bytes(v['total'])}; the "
                              f"stores may pin {format_bytes(v['usable'])}"),
    "cgroup_memory_limit": lambda v: v if isinstance(v, str) else
    f"{format_bytes(v['limit'])}, {format_bytes(v['usage'])} used",
    "pinnable_host_memory": lambda v: f"{format_bytes(v['bytes'])} (limited by {v['limited_by']})",
    "pin_test": lambda v: f"ok, {format_bytes(v['bytes'])} pinned ({v['how']}) in {v['seconds'] * 1e3:.1f} ms",
    "dev_shm": lambda v: f"{format_bytes(v['free'])} free of {format_bytes(v['total'])}",
    "pinned_bandwidth": lambda v: (f"H2D {v['h2d_GBps']:.1f} GB/s, D2H {v['d2h_GBps']:.1f} GB/s, both at once "
                                   f"{v['both_each_way_GBps']:.1f} GB/s each way; pageable H2D "
                                   f"{v['pageable_h2d_GBps']:.1f} GB/s"),
    "deepcompile": lambda v: (f"yes, DeepCompileBuilder loads ({'prebuilt' if v['prebuilt'] else 'JIT'}, "
                              f"{v['load_seconds']:.1f} s)"),
    "torch_env": _pretty_torch_env,
}


def _value(report, key):
    if key in report["unavailable"]:
        return f"n/a: {report['unavailable'][key]}"
    try:
        return FORMATS.get(key, str)(report[key])
    except Exception:  # a value of an unexpected shape still prints
        return str(report[key])


def format_text(report):
    """Aligned ``key : value`` lines, ready to paste into a bug report, then what torch's collect_env
    and ds_report say."""
    shown = {k for k, section in FROM_SECTIONS.items() if report.get(section) is not None}
    keys = [k for k in report if k != "unavailable" and k not in SECTIONS and k not in shown]
    width = max(map(len, keys), default=0)
    lines = ["deepspeed-offload env", *(f"{key.ljust(width)} : {_value(report, key)}" for key in keys)]
    for key, title in SECTIONS.items():
        if key in report:
            lines += ["", title, _value(report, key)]
    return "\n".join(lines)


def cmd_env(ns) -> int:
    report = collect()
    print(json.dumps(report, indent=2) if ns.json else format_text(report))
    return 0


def add_arguments(parser):
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.set_defaults(func=cmd_env)
    return parser


def register(subparsers):
    """Add ``env`` to the ``deepspeed-offload`` subcommands (cli.py's build_parser calls this)."""
    return add_arguments(
        subparsers.add_parser("env",
                              help="pinnable memory, bandwidth, collect_env and ds_report: for bug reports",
                              description="Print what a bug report needs: the accelerator, the DS_OFFLOAD_* "
                              "settings, ulimit -l and pinnable host memory, /dev/shm, pinned copy bandwidth on "
                              "a GPU, whether DeepCompile loads, then what torch's collect_env and ds_report say. "
                              "A probe that cannot run says why."))


def main(argv=None) -> int:
    parser = add_arguments(argparse.ArgumentParser(prog="python -m deepspeed_offload.envinfo",
                                                   description=__doc__.splitlines()[0]))
    ns = parser.parse_args(argv)
    return ns.func(ns)


if __name__ == "__main__":
    sys.exit(main())
