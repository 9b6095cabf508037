"""The benchmark runs committed in benchmarks/results/ (one GPU each, an H200 unless the name holds -h100; a
two-GPU run's name ends in -2gpus): the CLI's estimate and the bench's chart and completeness are checked against
them."""

import json
from pathlib import Path

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"
# (what `deepspeed-offload bench` wrote: its modes under "results"; benchmarks/grow.py's runs are not)
RUNS = sorted(p for p in RESULTS.glob("*.json") if not p.stem.endswith("-2gpus")
              and "results" in json.loads(p.read_text()))
