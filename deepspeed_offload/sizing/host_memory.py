"""The node's host memory as the pinned host stores see it, read before anything is pinned.

``check``, ``estimate``, ``initialize`` (before DeepSpeed builds the engine) and the host store (at
attach, with the exact bytes, before the first byte is pinned) all ask one question through
``check_host_plan``: do the stores of every rank on this node, plus what DeepSpeed pins itself, fit
in what the node can still give? "What the node can give" is the smaller of ``MemAvailable`` and
what the cgroup this process runs in still allows (a container's or a Slurm job's limit), less a
headroom for everything else the ranks allocate on the host. The answer names the numbers and the
ways out; nothing here allocates. MemTotal and MemAvailable come from psutil (which DeepSpeed requires);
what psutil does not read (the cgroup's limit, CAP_IPC_LOCK, where a GPU sits) is read here.

It also says where a GPU sits (its NUMA node, from sysfs) so the store's pages can be placed on
that node's memory. Every reader takes a ``root`` (``/`` by default) so the tests can fake
``/proc/meminfo``, the cgroup files and sysfs.
"""

import math
import os
import resource
import warnings
from dataclasses import dataclass
from typing import List, Optional, Tuple

import psutil

from ..errors import BLOCK, ConfigError

GiB = 2**30

# What is left for the rest of the host: the larger of this share of MemTotal and this many bytes.
HEADROOM_SHARE = 0.05
HEADROOM_MIN = 2 * GiB


def format_bytes(n: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


def _read(path: str) -> Optional[str]:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def virtual_memory(root: str = "/"):
    """psutil's ``virtual_memory()`` (``total``: MemTotal, ``available``: MemAvailable on Linux). Under
    another ``root`` (the tests' faked host) psutil reads ``<root>/proc`` through ``psutil.PROCFS_PATH``,
    its knob for a /proc mounted elsewhere."""
    if os.path.abspath(root) == "/":
        return psutil.virtual_memory()
    saved, psutil.PROCFS_PATH = psutil.PROCFS_PATH, os.path.join(root, "proc")
    try:
        with warnings.catch_warnings():  # a faked meminfo lacks Buffers, Cached...: psutil warns of them
            warnings.simplefilter("ignore", RuntimeWarning)
            return psutil.virtual_memory()
    finally:
        psutil.PROCFS_PATH = saved


def _cgroup_number(text: Optional[str]) -> Optional[int]:
    if text is None:
        return None
    text = text.strip()
    if not text or text == "max":
        return None
    value = int(text)
    return None if value >= 2**60 else value  # cgroup v1 writes "no limit" as a huge number


def cgroup_memory(root: str = "/") -> "tuple[Optional[int], Optional[int]]":
    """(limit, usage) in bytes of the memory cgroup this process is in, v2 or v1; (None, None)
    without a limit. The cgroup is read from /proc/self/cgroup, under /sys/fs/cgroup."""
    base = os.path.join(root, "sys/fs/cgroup")
    own = _read(os.path.join(root, "proc/self/cgroup")) or ""
    v2, v1 = None, None
    for line in own.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        if parts[0] == "0" and parts[1] == "":
            v2 = parts[2]
        elif "memory" in parts[1].split(","):
            v1 = parts[2]
    candidates = []
    if v2 is not None:
        candidates.append((os.path.join(base, v2.lstrip("/")), "memory.max", "memory.current"))
    candidates.append((base, "memory.max", "memory.current"))  # a container sees its own cgroup as the root
    if v1 is not None:
        candidates.append((os.path.join(base, "memory", v1.lstrip("/")), "memory.limit_in_bytes",
                           "memory.usage_in_bytes"))
    candidates.append((os.path.join(base, "memory"), "memory.limit_in_bytes", "memory.usage_in_bytes"))
    for where, limit_file, usage_file in candidates:
        raw = _read(os.path.join(where, limit_file))
        if raw is None:
            continue
        limit = _cgroup_number(raw)
        if limit is None:
            return None, None
        return limit, _cgroup_number(_read(os.path.join(where, usage_file))) or 0
    return None, None


CAP_IPC_LOCK = 14  # linux/capability.h: locking memory beyond RLIMIT_MEMLOCK


def can_lock_any_amount() -> bool:
    """This process has CAP_IPC_LOCK (root in most containers): the kernel does not hold it to ``ulimit -l``.
    (Read from /proc/self/status: neither psutil nor the standard library gives a process's capabilities.)"""
    try:
        with open("/proc/self/status") as f:
            caps = next((line.split()[1] for line in f if line.startswith("CapEff:")), "0")
        return bool(int(caps, 16) >> CAP_IPC_LOCK & 1)
    except (OSError, ValueError):
        return False


def memlock_limit() -> Optional[int]:
    """What this process may lock (``ulimit -l``) in bytes; None when unlimited, or when CAP_IPC_LOCK lifts it."""
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    return None if soft == resource.RLIM_INFINITY or can_lock_any_amount() else soft


@dataclass(frozen=True)
class HostMemory:
    """What the node has, read once: MemTotal, MemAvailable, the cgroup's limit and usage."""
    total: int
    available: int
    cgroup_limit: Optional[int] = None
    cgroup_usage: int = 0

    @classmethod
    def read(cls, root: str = "/") -> "HostMemory":
        mem = virtual_memory(root)
        limit, usage = cgroup_memory(root)
        return cls(total=mem.total, available=mem.available, cgroup_limit=limit, cgroup_usage=usage or 0)

    @property
    def headroom(self) -> int:
        return max(HEADROOM_MIN, int(HEADROOM_SHARE * self.total))

    @property
    def free(self) -> int:
        """What the node can still give: MemAvailable, or less where the cgroup allows less."""
        free = self.available
        if self.cgroup_limit is not None:
            free = min(free, max(0, self.cgroup_limit - self.cgroup_usage))
        return free

    @property
    def usable(self) -> int:
        """What the pinned stores may take: ``free`` less the headroom."""
        return max(0, self.free - self.headroom)

    def describe(self) -> str:
        cgroup = "" if self.cgroup_limit is None else \
            f", cgroup limit {format_bytes(self.cgroup_limit)} of which {format_bytes(self.cgroup_usage)} used"
        return (f"MemAvailable {format_bytes(self.available)}{cgroup}, less {format_bytes(self.headroom)} "
                "headroom for the rest of the host")


@dataclass(frozen=True)
class HostPlan:
    """What this node's ranks will pin: each rank's host store at its exact size, and what DeepSpeed
    pins itself (ZeRO-3's parameter offload) on the whole node."""
    store_per_rank: int
    ranks: int = 1
    deepspeed_pinned: int = 0
    budget_gb: Optional[float] = None  # the memory_budget_gb in effect (None: derived at attach)
    speculation_per_rank: int = 0  # of store_per_rank: what speculate_memory_gb adds

    @property
    def needed(self) -> int:
        return self.store_per_rank * self.ranks + self.deepspeed_pinned


def local_ranks() -> int:
    """Ranks of this job on this node (the launcher's LOCAL_WORLD_SIZE), whose stores share its memory."""
    for var in ("LOCAL_WORLD_SIZE", "LOCAL_SIZE"):
        if os.environ.get(var, "").isdigit():
            return max(1, int(os.environ[var]))
    return 1


def node_ways_out(ways: List[str], deepspeed_pinned: int) -> Tuple[List[str], str]:
    """``ways`` (what the block's settings can change) and the ways out every short node has, and the
    words for what DeepSpeed pins itself (empty where it pins nothing): the tail of both refusals,
    ``check_host_plan``'s and attach's node plan's."""
    ways = ways + ["spread the job over more nodes", "run fewer ranks per node"]
    if deepspeed_pinned:
        ways.append("turn off zero_optimization.offload_param.pin_memory")
    return ways, f" plus {format_bytes(deepspeed_pinned)} DeepSpeed pins itself" if deepspeed_pinned else ""


def check_host_plan(plan: HostPlan, memory: Optional[HostMemory] = None):
    """Raise a ConfigError naming the numbers and the ways out when ``plan`` does not fit."""
    memory = memory if memory is not None else HostMemory.read()
    if plan.needed <= memory.usable:
        return
    short = plan.needed - memory.usable
    ways = []
    if plan.speculation_per_rank:
        ways.append(f"lower {BLOCK}.speculate_memory_gb (it adds {format_bytes(plan.speculation_per_rank)} per rank) "
                    "or set it to 0")
    if plan.store_per_rank > 0:
        keep = short / plan.ranks
        budget = math.ceil(((plan.budget_gb or 0) + keep / GiB) * 100) / 100  # rounded up to 0.01 GiB
        ways.append(f"keep {format_bytes(keep)} more of each rank's state on the GPU ({BLOCK}.memory_budget_gb: "
                    f"{budget:g})")
    ways, ds = node_ways_out(ways, plan.deepspeed_pinned)
    raise ConfigError(f"{BLOCK}.enabled",
                      f"the pinned host stores of {plan.ranks} rank(s) on this node need "
                      f"{format_bytes(plan.store_per_rank * plan.ranks)} ({format_bytes(plan.store_per_rank)} each, "
                      f"exact size){ds}, but this node can give {format_bytes(memory.usable)} "
                      f"({memory.describe()}): {format_bytes(short)} short. Ways out: " + "; ".join(ways))


def memlock_hint(nbytes: int) -> str:
    """The ``ulimit -l`` advice, only where the locked-memory limit is below ``nbytes``."""
    limit = memlock_limit()
    if limit is None or limit >= nbytes:
        return ""
    return (f"; the locked-memory limit (ulimit -l) is {format_bytes(limit)}, below the {format_bytes(nbytes)} "
            "to pin: raise it")


# ---------------------------------------------------------------------------------------------- NUMA


def numa_nodes(root: str = "/") -> List[int]:
    # (sysfs, not DeepSpeed's get_numa_cores: that one runs ``numactl --hardware``, often not installed)
    base = os.path.join(root, "sys/devices/system/node")
    try:
        names = os.listdir(base)
    except OSError:
        return []
    return sorted(int(n[4:]) for n in names if n.startswith("node") and n[4:].isdigit())


def node_cpus(node: int, root: str = "/") -> List[int]:
    text = _read(os.path.join(root, f"sys/devices/system/node/node{node}/cpulist"))
    # (sysfs's cpulist, ``0-3,8,10-11``, is the syntax of DeepSpeed's own --bind_core_list)
    from deepspeed.utils.numa import parse_range_list
    return parse_range_list(text.strip()) if text and text.strip() else []


def pci_numa_node(bus_id: str, root: str = "/") -> Optional[int]:
    """The NUMA node of PCI device ``bus_id`` (``0000:1b:00.0``), None where sysfs does not say."""
    text = _read(os.path.join(root, "sys/bus/pci/devices", bus_id.lower(), "numa_node"))
    if text is None:
        return None
    node = int(text.strip())
    return node if node >= 0 else None


def gpu_bus_id(device_index: int) -> Optional[str]:
    """The PCI bus id of CUDA device ``device_index`` as sysfs names it, None off CUDA."""
    import torch
    if not torch.cuda.is_available():
        return None
    props = torch.cuda.get_device_properties(device_index)
    domain, bus, dev = (getattr(props, k, None) for k in ("pci_domain_id", "pci_bus_id", "pci_device_id"))
    if bus is None:
        return None
    return f"{domain or 0:04x}:{bus:02x}:{dev or 0:02x}.0"


def gpu_numa_node(device_index: int, root: str = "/") -> Optional[int]:
    """The NUMA node a GPU is attached to; None on one-node hosts, off CUDA, or where unknown."""
    if len(numa_nodes(root)) < 2:
        return None
    bus = gpu_bus_id(device_index)
    return pci_numa_node(bus, root) if bus else None
