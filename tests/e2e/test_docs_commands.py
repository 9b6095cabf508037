"""Every ``bash`` block in the README and docs/ runs as written, from the repository root: each
distinct command once, and the README's main job in ``test_launcher.py``, which reads its output too.

``sh`` blocks (installing, the test command itself, GPU-only commands) are documentation only."""

import pytest

from harness import MAIN_JOB, ROOT, bash_lines, command_env, run, two_ranks_unavailable

pytestmark = pytest.mark.e2e

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def commands():
    seen = {MAIN_JOB}
    for doc in DOCS:
        for line in bash_lines(doc):
            if line not in seen:
                seen.add(line)
                yield pytest.param(line, id=f"{doc.name}: {line[:60]}")


def test_the_docs_have_commands():
    assert len(list(commands())) >= 6


@pytest.mark.parametrize("command", list(commands()))
def test_doc_command_runs(command, tmp_path):
    if command.startswith("deepspeed ") and two_ranks_unavailable():
        pytest.skip(two_ranks_unavailable())
    proc = run(["bash", "-c", command], command[:40], 300, command_env())
    assert proc.returncode == 0, f"{command}\n{proc.stdout[-4000:]}"
