"""Every JSON example a user may copy is JSON: each ```json block (and any jsonc/json5/hjson block,
which must then be plain JSON too) in README.md and docs/*.md, and every file under examples/, docs/
and benchmarks/results/ ending in .json, loads with ``json.load`` (Accelerate and Lightning read
ds_configs with it), and every ``optimizer_state_offload`` block in them passes the block's own
validation."""

import json
import re
from pathlib import Path

import pytest

from deepspeed_offload.config import BLOCK, parse_block

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(json|jsonc|json5|hjson)[ \t]*\n(.*?)^```", re.S | re.M)
FILES = [*sorted((ROOT / "examples").rglob("*.json")), *sorted((ROOT / "docs").glob("*.json")),
         *sorted((ROOT / "benchmarks" / "results").glob("*.json"))]


def blocks():
    for doc in DOCS:
        text = doc.read_text()
        for m in FENCE.finditer(text):
            line = text.count("\n", 0, m.start()) + 1
            yield pytest.param(m.group(1), m.group(2), id=f"{doc.name}:{line}")


def offload_blocks(data):
    """Every dict that holds an optimizer_state_offload key, however deep."""
    if isinstance(data, dict):
        if BLOCK in data:
            yield data
        for value in data.values():
            yield from offload_blocks(value)
    elif isinstance(data, list):
        for value in data:
            yield from offload_blocks(value)


def check(data):
    for holder in offload_blocks(data):
        parse_block(holder)  # raises ConfigError naming the key


def test_there_are_examples():
    found = list(blocks())
    assert len(found) >= 3
    assert sum(f'"{BLOCK}"' in p.values[1] for p in found) >= 3
    assert len(FILES) >= 2


@pytest.mark.parametrize("lang, text", list(blocks()))
def test_doc_block_is_json(lang, text):
    assert lang == "json", "a ```" + lang + " block: make it plain JSON and mark it ```json"
    check(json.loads(text))


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_json_file_loads(path):
    with open(path) as f:
        check(json.load(f))


def test_a_comment_or_an_invalid_block_is_caught(tmp_path):
    """The checks above fail on what they guard against."""
    with pytest.raises(json.JSONDecodeError):
        json.loads('{"mode": null // derived\n}')
    from deepspeed_offload import ConfigError
    with pytest.raises(ConfigError, match="optimizer_state_offload.mode"):
        check({"zero_optimization": {"stage": 3}, BLOCK: {"enabled": True, "mode": "auto"}})
    with pytest.raises(ConfigError, match="optimizer_state_offload.overlap"):
        check({BLOCK: {"overlap": "yes"}})


def test_the_committed_results_stay_under_1_mb():
    """benchmarks/results/ holds one compact summary per cited run (its README): under 1 MB together."""
    total = sum(p.stat().st_size for p in (ROOT / "benchmarks" / "results").iterdir() if p.is_file())
    assert total < 1_000_000, f"benchmarks/results holds {total:,} bytes: compact them, or drop runs no longer cited"
