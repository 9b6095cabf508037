"""The H200 benchmark runs committed in docs/: the CLI's estimate and the bench's chart and
completeness are checked against them."""

from pathlib import Path

RUNS = sorted((Path(__file__).resolve().parents[2] / "docs").glob("bench-h200-*.json"))
