"""Remove each wait of the step and of speculation, one at a time, and see which CPU tests catch it.

    python scripts/remove_waits.py --list           the waits, where they are, the tests that must catch them
    python scripts/remove_waits.py [ID ...]         for each (default: all): a copy of this checkout with
                                                    that wait removed, its tests run there; prints a table
                                                    (pytest's output of each in --logs, default /tmp/remove_waits)
    python scripts/remove_waits.py ID --copy DIR    only the copy without it, in DIR (to look into by hand)

Each copy holds this checkout's tracked and untracked files (not the ignored ones) in a temporary
directory; the wait's source text is replaced there (it must occur exactly once), and pytest runs the
wait's tests from the copy, one file at a time (the e2e files launch their ranks once per file).
docs/architecture.md ("Ordering, checked on the CPU") holds the table this printed, condensed;
tests/unit/test_residency.py checks that every wait's text is still in the source. A launch that hangs
(on a machine shared with other test sessions: see tests/conftest.py's /dev/shm clean-up) times out and
shows as errors, not as failures: run that wait again.
"""

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Tuple

ROOT = Path(__file__).resolve().parents[1]
RES, STREAM, SPEC, HOOKS = ("deepspeed_offload/runtime/memory/residency.py", "deepspeed_offload/runtime/step/stream.py",
                            "deepspeed_offload/runtime/speculation/updates.py", "deepspeed_offload/runtime/step/hooks.py")
UPDATE = "deepspeed_offload/runtime/speculation/compute.py"
MOVES = "deepspeed_offload/runtime/step/moves.py"
UNIT = "tests/unit/test_residency.py"
# (fails in every copy, by design: it wants each wait's text in the source)
LISTED = "tests/unit/test_residency.py::test_the_list_of_waits_removed_one_at_a_time_is_the_source_s"
PARITY = "tests/e2e/test_stream_parity.py::test_parity_two_ranks"
COMPILE = "tests/e2e/test_stream_parity.py::test_compile_mode_runtime_parity"
SPECULATION = "tests/e2e/test_speculation.py::test_speculation_parity"
STRAIGHT_BACK = "tests/e2e/test_stream_parity.py::test_a_take_back_given_straight_back_waits_for_its_own_copies"


@dataclass
class Wait:
    id: str
    path: str
    text: str  # the wait, as written in the source (once)
    without: str  # what replaces it
    what: str
    tests: Tuple[str, ...]


WAITS = [
    Wait("load.ready", RES, "waits=(r.written, *destination)", "waits=(r.written, )",
         "a load waits for its destination (new buffers: their allocation; a place in a slot: the "
         "write-backs of the sub-groups there before it)", (UNIT, PARITY)),
    Wait("write_back.slot_free", RES, "self.staging.written(i, r.written)", "pass",
         "a write-back from a slot becomes what the next load into its place waits for", (UNIT, PARITY)),
    Wait("load.written", RES, "waits=(r.written, *destination)", "waits=(*destination, )",
         "a load waits for the sub-group's own previous write-back", (UNIT, COMPILE)),
    Wait("arrive", RES, "self.copies.compute_waits(r.loaded)", "pass",
         "the stream that updates a sub-group (compute, or side) waits for its load", (UNIT, PARITY, SPECULATION)),
    Wait("write_back.updated", RES, "waits=(r.updated, )", "waits=()",
         "a write-back waits for the update", (UNIT, PARITY, SPECULATION)),
    Wait("drain", RES, "self.copies.wait_host(self.last_write)", "pass",
         "drain: the CPU waits for the last write-back", (UNIT, PARITY, SPECULATION)),
    Wait("end_step.drain", STREAM, "self.table.drain()  # the step returns", "pass  # the step returns",
         "the step returns once every write-back landed", (PARITY, )),
    Wait("synchronize.drain", STREAM, "self.offload_for_forward()\n        self.table.drain()",
         "self.offload_for_forward()", "a CPU reader of host state waits for every write-back", (COMPILE, PARITY)),
    Wait("skipped.drain", STREAM, "self.table.drain()  # the discarded updates'", "pass  # the discarded updates'",
         "a skipped step returns once the discarded updates' copies into their second regions landed", (PARITY, )),
    Wait("around.colocation", HOOKS, "mode.colocation.wait_for_copies()", "pass",
         "a CPU reader waits for offload_states()' non-blocking copies", (PARITY, )),
    Wait("backward_begins.join", SPEC, "self.mode.copies.join_side()  # this backward's", "pass  # this backward's",
         "a backward's reductions after the last backward's updates", (SPECULATION, )),
    Wait("partitioned.reduced_again", SPEC, "self.final_event[i] = self.mode.copies.mark()  # the update waits",
         "pass  # the update waits", "an update waits for a second reduction of its gradient (event)",
         (SPECULATION, )),
    Wait("update.final", UPDATE, "mode.copies.compute_waits(spec.final_event.pop(i, None))", "pass",
         "an update waits for its gradient's reduction (DeepSpeed's reduction stream)", (SPECULATION, )),
    Wait("update.grad_ready", UPDATE, "mode.copies.compute_waits(grad_ready)", "pass",
         "an update waits for the gradient buffer's allocation", (SPECULATION, )),
    Wait("update.cast_ready", UPDATE, "mode.copies.compute_waits(cast_ready)", "pass",
         "an update waits for its 16-bit cast's allocation", (SPECULATION, )),
    Wait("update.queued", UPDATE, "mode.copies.compute_waits(queued)", "pass",
         "an update waits for the compute stream's writes of device small state", (SPECULATION, )),
    Wait("decide.join", SPEC, "self.mode.copies.join_side()  # the step (and", "pass  # the step (and",
         "the step (and the gradient buffer's drop) after every update", (SPECULATION, )),
    Wait("reassign.queued", SPEC, "copies.compute_waits(queued)\n                copies.uses",
         "pass\n                copies.uses", "a commit's copy into the 16-bit partition after the compute stream's "
         "work so far", (SPECULATION, )),
    Wait("settle.queued", SPEC, "copies.compute_waits(queued)\n                for i, spec in todo.items():",
         "pass\n                for i, spec in todo.items():", "a settled cast's copy into the 16-bit partition after "
         "the compute stream's work so far (backward's reads of the partition)", (SPECULATION, )),
    Wait("settle.join", SPEC, "copies.join_side()  # the casts' blocks", "pass  # the casts' blocks",
         "the casts dropped at the step's entry (and the step's own work) after the settling copies",
         (SPECULATION, )),
    Wait("step_ends.join", SPEC, "self.mode.copies.join_side()  # the next forward", "pass  # the next forward",
         "the next forward (and the casts' drop) after the commits' copies", (SPECULATION, )),
    Wait("discard_all.join", SPEC, "self.mode.copies.join_side()\n        for i, spec in self.updated.items():",
         "for i, spec in self.updated.items():", "a rollback (a step that raised) after the side stream's work",
         (SPECULATION, )),
    Wait("update.kept_ready", UPDATE, "mode.copies.compute_waits(kept_ready)", "pass",
         "an update's device copy of the state before it waits for that copy's allocation (implied by "
         "cast_ready)", (SPECULATION, )),
    Wait("move.drain", MOVES, "mode.synchronize_for_checkpoint()  # every write-back landed",
         "pass  # every write-back landed", "a move's prepare: every write-back and every earlier switch's "
         "copies landed (a take-back given straight back would copy empty device tensors to the host)",
         (STRAIGHT_BACK, )),
    Wait("post_step.updates_done", HOOKS, "mode.lifecycle.updates_done()\n        return orig(*args, **kwargs)",
         "result = orig(*args, **kwargs)\n        mode.lifecycle.updates_done()\n        return result",
         "the step's end (the join of the commits' copies) before DeepSpeed's _post_step, whose all-gather "
         "of the persistent parameters reads the 16-bit partitions", (SPECULATION, )),
    Wait("decide.hyper_parameters", SPEC, 'why = "hyper-parameters"', "why = None",
         "updates from backward are discarded when the hyper-parameters changed before the step (a "
         "hand-written schedule)", (SPECULATION, )),
    Wait("restore.written", RES, "waits=(r.written, )", "waits=()",
         "a rollback's copy of the state before over the host region after the update's write-back (on a "
         "GPU the D2H stream's order keeps it too)", (UNIT, SPECULATION)),
]


def checkout_files():
    out = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, check=True,
                         capture_output=True).stdout
    return [f for f in out.decode().split("\0") if f and (ROOT / f).is_file()]


def without(wait: Wait, dest: Path):
    """A copy of this checkout in ``dest`` with ``wait`` removed."""
    for f in checkout_files():
        (dest / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / f, dest / f)
    path = dest / wait.path
    src = path.read_text()
    assert src.count(wait.text) == 1, f"{wait.id}: {wait.text!r} occurs {src.count(wait.text)} times in {wait.path}"
    path.write_text(src.replace(wait.text, wait.without))


def run(wait: Wait, timeout: int, logs: Path) -> Tuple[list, list]:
    """Its tests in a copy without it: (failed test ids, lines of errors that are not test failures)."""
    failed, errors = [], []
    logs.mkdir(parents=True, exist_ok=True)
    log = (logs / f"{wait.id}.log").open("w")
    with tempfile.TemporaryDirectory(prefix=f"without-{wait.id}-") as tmp:
        without(wait, Path(tmp))
        env = dict(os.environ, TORCH_EXTENSIONS_DIR=str(ROOT / ".cache" / "torch_extensions"))
        by_file = {}
        for t in wait.tests:
            by_file.setdefault(t.split("::")[0], []).append(t)
        for tests in by_file.values():
            proc = subprocess.run([sys.executable, "-m", "pytest", *tests, "--deselect", LISTED, "-q", "-rfE",
                                   "-p", "no:cacheprovider"],
                                  cwd=tmp, env=env, capture_output=True, text=True, timeout=timeout)
            log.write(proc.stdout + proc.stderr)
            failed += re.findall(r"^FAILED (\S+)", proc.stdout, re.M)
            errors += re.findall(r"^ERROR (\S+.*)$", proc.stdout, re.M)
    return failed, errors


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("ids", nargs="*", help="waits to remove (default: all)")
    ap.add_argument("--list", action="store_true")
    ap.add_argument("--timeout", type=int, default=1800, help="seconds per test file")
    ap.add_argument("--logs", type=Path, default=Path(tempfile.gettempdir()) / "remove_waits")
    ap.add_argument("--copy", type=Path, help="only make the copy without the (one) wait named, here")
    args = ap.parse_args()
    chosen = [w for w in WAITS if not args.ids or w.id in args.ids]
    unknown = set(args.ids) - {w.id for w in WAITS}
    if unknown:
        ap.error(f"no such wait: {sorted(unknown)}")
    if args.copy:
        assert len(chosen) == 1, "--copy: name one wait"
        args.copy.mkdir(parents=True)
        without(chosen[0], args.copy)
        return
    if args.list:
        for w in chosen:
            print(f"{w.id:28s} {w.path.split('/')[-1]:15s} {w.what}\n{'':44s}tests: {', '.join(w.tests)}")
        return
    print("| wait | where | tests that fail without it |\n|---|---|---|", flush=True)
    for w in chosen:
        t0 = time.monotonic()
        failed, errors = run(w, args.timeout, args.logs)
        caught = ", ".join(failed) or "none"
        if errors:
            caught += f" (errors: {'; '.join(errors)})"
        print(f"| `{w.id}` | {w.path.split('/')[-1]} | {caught} | ({time.monotonic() - t0:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
