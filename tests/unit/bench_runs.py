"""The H200 benchmark runs committed in benchmarks/results/ (one GPU each; a two-GPU run's name ends
in -2gpus): the CLI's estimate and the bench's chart and completeness are checked against them."""

from pathlib import Path

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"
RUNS = sorted(p for p in RESULTS.glob("*.json") if not p.stem.endswith("-2gpus"))
