"""The launcher tests' rendezvous ports (tests/e2e/harness.py): with 8 tests launching at once, a port
chosen by binding to 0 and closing was taken by another launch before its launcher bound it
(``EADDRINUSE`` in ``TCPStore``). Reserved ports are below the ephemeral range, never handed to two
holders at once (other processes included), and a launch whose output says its port was taken is
started again on another."""

import subprocess
import sys
import textwrap
from pathlib import Path

E2E = Path(__file__).resolve().parents[1] / "e2e"
sys.path.insert(0, str(E2E))

import harness  # noqa: E402


def test_reserved_ports_are_below_the_ephemeral_range_and_distinct():
    with harness.reserved_port() as a, harness.reserved_port() as b, harness.reserved_port() as c:
        assert len({a, b, c}) == 3
        assert all(harness.PORTS_FROM <= p < max(harness.PORTS_FROM + 1000, harness.ephemeral_low()) for p in (a, b, c))


def test_a_reserved_port_is_not_handed_to_another_process(tmp_path):
    """Another process scanning from the very port held skips it (the lock is the file's, not the process's)."""
    with harness.reserved_port() as held:
        script = textwrap.dedent(f"""
            import sys; sys.path.insert(0, {str(E2E)!r})
            import harness
            harness.PORTS_FROM = {held}
            harness.ephemeral_low = lambda: {held} + 2
            harness.time.monotonic_ns = lambda: 0
            harness.os.getpid = lambda: 0
            with harness.reserved_port() as port:
                print(port)
        """)
        out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        assert int(out.stdout.strip()) != held


def test_a_launch_that_lost_its_port_is_started_again_on_another(monkeypatch):
    ports, outputs = [], iter(["... EADDRINUSE: address already in use ...", "trained"])

    def run(cmd, name, timeout, env):
        ports.append(cmd[-1])
        text = next(outputs)
        return subprocess.CompletedProcess(cmd, 1 if "EADDRINUSE" in text else 0, text, "")

    monkeypatch.setattr(harness, "run", run)
    proc = harness.launch_with_port(lambda port: ["launcher", port], "x", 10, {})
    assert proc.returncode == 0 and proc.stdout == "trained"
    assert len(ports) == 2


def test_a_launch_that_failed_for_another_reason_is_not_started_again(monkeypatch):
    calls = []

    def run(cmd, name, timeout, env):
        calls.append(cmd)
        return subprocess.CompletedProcess(cmd, 1, "AssertionError: parity", "")

    monkeypatch.setattr(harness, "run", run)
    assert harness.launch_with_port(lambda port: ["launcher", port], "x", 10, {}).returncode == 1
    assert len(calls) == 1
