"""Run a script under the real ``deepspeed`` launcher with 2 ranks and read back what it wrote.

On a machine without GPUs DeepSpeed picks its CPU accelerator and the two ranks talk over gloo;
with GPUs they use NCCL, one GPU each. ``launch`` writes the spec to a temp dir, runs the launcher
as a subprocess with a timeout and returns the ``torch.save``d result of rank 0.

Two things of DeepSpeed's own make launcher runs fragile on a shared machine, and ``run`` guards
against both: a JIT build killed mid-way leaves a ``lock`` file that makes every later build wait
forever (so the tests build into a private extensions dir, see conftest.py, and kill the whole
process group on a timeout), and the CPU accelerator's shm all-reduce leaves a 66 MB file per rank
in /dev/shm that nobody unlinks (conftest.py removes what a test created). After one launch hung,
the rest fail at once with its reason instead of each waiting out its own timeout.

Ports: each launch's rendezvous port is reserved by ``reserved_port`` below the kernel's ephemeral
range (where no other process's outgoing connection can take it between our choice and the
launcher's bind: NCCL's and TCPStore's client sockets use that range), under a lock file that keeps
two tests of this machine (``pytest -n 8``) from choosing the same one; a launch that still meets
``EADDRINUSE`` is started again on another port.

Launched scripts call ``inject_checkpoint_faults`` to hand the checkpoint faults their spec asks
for (a slow write, the guard off) to the engine's checkpointer.
"""

import contextlib
import fcntl
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
PARITY = HERE / "parity_train.py"
EXTENSIONS_DIR = ROOT / ".cache" / "torch_extensions"

_hung = None  # the first launch that timed out, if any
# Set (to anything) in a launch's environment: the ranks' accelerator reports no fp16, as DeepSpeed's
# CPU accelerator does on a CPU without it (AMD), whatever this machine has.
NO_FP16 = "DS_OFFLOAD_TEST_NO_FP16"


class LaunchError(AssertionError):
    pass


# Ports the launches reserve: below the ephemeral range, above the well-known services'.
PORTS_FROM = 20000
PORT_LOCKS = Path(os.environ.get("TMPDIR", "/tmp")) / "ds_offload_test_ports"
# The launcher's rendezvous lost its port anyway (another program bound it): started again this often.
PORT_RETRIES = 3
IN_USE = re.compile(r"EADDRINUSE|[Aa]ddress already in use")


def ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (outgoing connections' source ports)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


@contextlib.contextmanager
def reserved_port():
    """A TCP port for one launch's rendezvous, held for the ``with`` block: below the ephemeral range,
    free when chosen, and locked (``flock`` on a file of its own) against every other test process of
    this machine until the block ends."""
    PORT_LOCKS.mkdir(parents=True, exist_ok=True)
    low, high = PORTS_FROM, max(PORTS_FROM + 1000, ephemeral_low())
    start = low + (os.getpid() * 7919 + time.monotonic_ns()) % (high - low)
    for k in range(high - low):
        port = low + (start - low + k) % (high - low)
        handle = open(PORT_LOCKS / f"{port}.lock", "w")
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            handle.close()
            continue
        try:
            with socket.socket() as sock:
                sock.bind(("127.0.0.1", port))
        except OSError:
            handle.close()
            continue
        try:
            yield port
        finally:
            handle.close()  # (closing releases the lock)
        return
    raise LaunchError(f"no free port between {low} and {high}")


def launch_with_port(make_cmd, name: str, timeout: int, env: dict) -> subprocess.CompletedProcess:
    """``run(make_cmd(port), ...)`` on a reserved port; started again (on another port) while its
    output says the port was taken, at most ``PORT_RETRIES`` times."""
    for attempt in range(PORT_RETRIES):
        with reserved_port() as port:
            proc = run(make_cmd(port), name, timeout, env)
        if proc.returncode == 0 or not IN_USE.search(proc.stdout or ""):
            return proc
    return proc


def stale_locks():
    return sorted(str(p) for p in EXTENSIONS_DIR.glob("*/*/lock"))


def run(cmd, name: str, timeout: int, env: dict) -> subprocess.CompletedProcess:
    """``cmd`` from the repository root in its own process group; on a timeout the whole group
    (launcher and ranks) is killed, and every later ``run`` fails at once."""
    global _hung
    if _hung is not None:
        raise LaunchError(f"{name}: not run, an earlier launch hung: {_hung}")
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        locks = stale_locks()
        _hung = f"{name} timed out after {timeout}s" + (f" (JIT build locks left: {locks})" if locks else "")
        raise LaunchError(f"{_hung}\n{out[-4000:]}") from None
    return subprocess.CompletedProcess(cmd, proc.returncode, out, "")


# The README's main job, as written there (test_launcher.py runs it and reads its output;
# test_docs_commands.py leaves it to that test).
MAIN_JOB = "deepspeed --num_gpus 2 examples/train.py --deepspeed_config examples/ds_config_offload.json"
BASH_BLOCK = re.compile(r"^```bash\n(.*?)^```", re.S | re.M)


def bash_lines(doc: Path):
    """The commands of ``doc``'s ``bash`` blocks, a line each, comments dropped."""
    for block in BASH_BLOCK.findall(doc.read_text()):
        for line in block.splitlines():
            line = line.split(" #")[0].strip()
            if line and not line.startswith("#"):
                yield line


def command_env() -> dict:
    """The environment a documented command runs in: this checkout importable, this interpreter's
    ``deepspeed`` and ``deepspeed-offload`` first on PATH (also where the venv is not activated)."""
    return dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1",
                PATH=os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")]))


def gpus() -> int:
    """CUDA GPUs here (0 without CUDA)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def two_ranks_unavailable():
    """Why 2 ranks cannot run here, or None: gloo ranks share the CPU, NCCL ranks need a GPU each."""
    if gpus() == 1:
        return "2 NCCL ranks need 2 GPUs (\"Duplicate GPU detected\"), this machine has 1"
    return None


def launch(spec: dict, tmp_path: Path, name: str, nprocs: int = 2, timeout: int = 300, script: Path = PARITY,
           env: dict = None, expect_failure: bool = False, shared: bool = False):
    """Run ``script`` with ``spec`` under the launcher; its rank-0 result, or (``expect_failure``)
    the launcher's output of a run that must not succeed. A spec with ``variants`` reports each
    variant's outcome: the test skips when one could not run here and fails when one failed (unless
    ``shared``: ``launch_cases`` sorts them out per case)."""
    out = tmp_path / f"{name}.pt"
    spec = dict(spec, out=str(out))
    spec_file = tmp_path / f"{name}.json"
    spec_file.write_text(json.dumps(spec))
    def cmd(port):
        return [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", str(nprocs), "--master_port",
                str(port), str(script), str(spec_file)]

    full_env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
                    OMP_NUM_THREADS="1")
    full_env.update(env or {})
    proc = launch_with_port(cmd, name, timeout, env=full_env)
    (tmp_path / f"{name}.log").write_text(proc.stdout + proc.stderr)
    if expect_failure:
        if proc.returncode == 0:
            raise LaunchError(f"{name}: was expected to fail but exited 0")
        return proc.stdout + proc.stderr
    if proc.returncode != 0 or not out.exists():
        raise LaunchError(f"{name}: launcher exit {proc.returncode}\n{(proc.stdout + proc.stderr)[-6000:]}")
    result = torch.load(out, weights_only=False)
    if not shared and isinstance(result, dict):
        for k, variant in enumerate(result.get("variants", [])):
            outcome(variant, f"{name}, variant {k}")
    return result


def launch_two_nodes(spec: dict, tmp_path: Path, name: str, ranks_per_node: int = 2, timeout: int = 600):
    """``parity_train.py`` on two simulated nodes: two ``torchrun`` agents on this host (``--nnodes 2``,
    ``--node_rank`` 0 and 1, ``ranks_per_node`` CPU ranks each, gloo). Returns rank 0's result and each
    agent's output (node 0's, node 1's)."""
    out = tmp_path / f"{name}.pt"
    spec_file = tmp_path / f"{name}.json"
    spec_file.write_text(json.dumps(dict(spec, out=str(out))))
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", OMP_NUM_THREADS="1")
    # Each agent writes into a file of its own: through pipes read one after the other, the second
    # agent's would fill while the first is waited for, and a rank blocked writing to it stalls the
    # collectives of all four.
    agents, files = [], [tmp_path / f"{name}-node{node}.log" for node in (0, 1)]
    with reserved_port() as port:  # held until both agents are done
        for node, log_file in zip((0, 1), files):
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node_rank", str(node),
                   "--nproc_per_node", str(ranks_per_node), "--master_addr", "127.0.0.1", "--master_port",
                   str(port), str(PARITY), str(spec_file)]
            with open(log_file, "w") as sink:
                agents.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=sink, stderr=subprocess.STDOUT,
                                               start_new_session=True))
        deadline = time.monotonic() + timeout
        try:
            for agent in agents:
                agent.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for agent in agents:
                os.killpg(agent.pid, signal.SIGKILL)
            raise LaunchError(f"{name}: the two agents timed out after {timeout}s") from None
    logs = [f.read_text() for f in files]
    for node, (agent, log) in enumerate(zip(agents, logs)):
        if agent.returncode != 0:
            raise LaunchError(f"{name}: node {node}'s agent exited {agent.returncode}\n{log[-6000:]}")
    result = torch.load(out, weights_only=False)
    for k, variant in enumerate(result.get("variants", [])):
        outcome(variant, f"{name}, variant {k}")
    return result, logs


def outcome(result: dict, what: str) -> dict:
    """A variant's result as parity_train.py reported it: the test skips where this machine cannot run
    it (``skipped``), fails where it failed (``error``, with the ranks' messages), else gets it."""
    if "skipped" in result:
        pytest.skip(f"{what}: {result['skipped']}")
    if "error" in result:
        raise LaunchError(f"{what} failed: {result['error']}")
    return result


def launch_cases(cases: dict, tmp_path: Path, name: str, timeout: int = 900, env: dict = None) -> dict:
    """Several cases' variants in one launch of parity_train.py (the launcher and the ranks start once,
    not once per case; each variant still trains from the same seed in an engine of its own).
    ``cases``: {case: [(variant name, the variant's whole spec)]}; returns {case: {variant name: outcome}},
    each outcome as parity_train.py reported it: read a case with ``case_results``, so that a variant
    that cannot run here or failed skips or fails its own case alone."""
    keys = [(case, variant) for case, named in cases.items() for variant, _ in named]
    specs = [spec for named in cases.values() for _, spec in named]
    out = launch(dict(variants=specs), tmp_path, name, timeout=timeout, env=env, shared=True)
    runs = {}
    for (case, variant), result in zip(keys, out["variants"]):
        runs.setdefault(case, {})[variant] = result
    return runs


def case_results(runs: dict, case: str) -> dict:
    """One case of ``launch_cases``: ``{variant name: result}``; skips the test where one of its variants
    could not run on this machine, fails it (naming the variant) where one failed."""
    for variant, result in runs[case].items():
        if "skipped" in result:
            outcome(result, f"{case}/{variant}")
    for variant, result in runs[case].items():
        outcome(result, f"{case}/{variant}")
    return runs[case]


def assert_bitwise_equal(a: dict, b: dict, what=("losses", "fp32", "state")):
    """Every loss, fp32 master and optimizer-state tensor identical (torch.equal), and none missing."""
    if "losses" in what:
        assert a["losses"] == b["losses"], f"losses differ:\n{a['losses']}\n{b['losses']}"
    for section in ("fp32", "state"):
        if section not in what:
            continue
        assert a[section].keys() == b[section].keys(), f"{section} keys differ: {a[section].keys() ^ b[section].keys()}"
        assert a[section], f"no {section} tensors were read"
        for key in a[section]:
            x, y = a[section][key], b[section][key]
            assert torch.equal(x, y), f"{section} {key} differs: max |diff| {(x.float() - y.float()).abs().max()}"


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bytes. Bits, not ``torch.equal``, wherever whole partitions are compared: the
    last rank's ZeRO-3 partitions end in padding DeepSpeed never writes (``torch.empty``), and a NaN
    pattern there is unequal to itself although nothing touched it."""
    def bits(t):
        return t.detach().cpu().reshape(-1).contiguous().view(torch.uint8)

    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))


def same_tensors(before, after) -> bool:
    """Two snapshots' ``(device, tensor)`` lists hold the same devices and the same bits (``same_bits``)."""
    return len(before) == len(after) and all(d0 == d1 and same_bits(a, b) for (d0, a), (d1, b) in zip(before, after))


def slow_writes(tag: str, seconds: float, guard: bool = True, copy_aside=None) -> dict:
    """A spec's ``faults``: each file of a save whose path contains ``tag`` waits ``seconds`` before it
    is written and again before it is renamed into place (a write slow enough to race with or to
    kill); ``guard=False`` turns the guard off; ``copy_aside`` True/False: the state copied aside, or
    written from the host store (None: as the host memory allows)."""
    return {"faults": {"delay_tag": tag, "write_delay_s": seconds, "guard": guard, "copy_aside": copy_aside}}


def inject_checkpoint_faults(engine, spec: dict):
    """In a launched script: the faults of ``spec["faults"]`` (see slow_writes), given to ``engine``'s
    asynchronous checkpointer. Nothing without them."""
    faults = spec.get("faults")
    if not faults:
        return
    import deepspeed_offload
    from deepspeed_offload.runtime.checkpoint import Faults
    ckpt = getattr(deepspeed_offload.get_handle(engine), "checkpointer", None)
    assert ckpt is not None, "checkpoint faults asked for, but the engine has no asynchronous checkpointer"
    tag, seconds = faults["delay_tag"], faults["write_delay_s"]

    def slow(path):
        if tag in path:
            time.sleep(seconds)

    ckpt.faults = Faults(guard=faults.get("guard", True), before_file=slow, copy_aside=faults.get("copy_aside"))
