"""``deepspeed-offload bench``: our stream and compile modes side by side with the upstream DeepSpeed
ways of handling optimizer state, each mode in its own process (one rank, or ``--ranks N`` ranks of
one node through torchrun), per-iteration min/median/max over the measured iterations, JSON plus
PNG charts.

    deepspeed-offload bench --out bench.json --plot bench.png --timeline timeline.png \\
        [--model mlp|sequential|llama] [--modes all|resident,stream,...] [--budgets 0,8,16,32,default] [--ranks 2]
        [--trace]   # also write each iteration's row and the allocator timeline (default: medians, spreads, peaks)

One module per job: ``modes`` (the mode catalogue and each mode's ds_config), ``models`` (the model
zoo), ``options`` (the command line), ``driver`` (the worker processes, resume, the entry point),
``worker`` (one mode in one process) with ``loop`` (the timed iterations), ``timeline`` (the
allocator trace) and ``results`` (the result record), ``report`` (the JSON summary and its text),
``charts``. The copy-bandwidth probe is ``deepspeed_offload.sizing.bandwidth``. docs/benchmarks.md says how
the bench is used and what it measured.
"""

from .charts import plot, plot_sweep, plot_timeline
from .driver import main, run
from .options import build_parser

# The entry points and the charts (docs/benchmarks.md redraws them from a bench.json).
__all__ = ["main", "run", "build_parser", "plot", "plot_sweep", "plot_timeline"]
