"""The mode catalogue: every mode the benchmark runs, as one frozen ``Mode`` each, built once from
the ``--modes`` spec, and the ds_config a mode's engine is built with.

A mode says what it offloads, which mode it is compared with, whether it runs under DeepCompile, what
it adds to the ds_config and, for our modes, its resident budget (``memory_budget_gb``). Nothing else
in the benchmark looks at a mode's name: the worker, the report and the charts read these fields.

Names: the fixed ones in ``FIXED``; the budget families ``compile_offload@B``, ``stream@B`` (overlap
off), ``stream_overlap@B`` (overlap on, speculation off) and ``default@B`` (the block at its defaults but
``memory_budget_gb``), B a number of GiB or ``default`` (null: measured on the card); the shorthands ``all`` and the sweeps (``compile_sweep``, ``stream_sweep``,
``stream_overlap_sweep``: one NAME@B per ``--budgets`` entry); and the older names of ``ALIASES``,
still accepted because docs and committed JSON use them. Any mode as ``NAME/bucket=N``: the same with
``zero_optimization.reduce_bucket_size`` N; any of ours as ``NAME/sub_group_mb=N``: with our block's
``sub_group_mb`` N (both may follow one name, each once).
"""

import copy
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Mapping, Optional, Tuple

# What --modes all runs, in order (compile_sweep: one compile_offload@B per --budgets entry).
DEFAULT_MODES = ["bandwidth", "resident", "stream", "stream_overlap", "offload_states", "zero_offload", "checkpoint",
                 "compiled", "compile_sweep", "dc_offload_opt_states", "dc_offload_opt_states_full"]
# Shorthand -> the family its --budgets entries expand into.
SWEEPS = {"compile_sweep": "compile_offload", "stream_sweep": "stream", "stream_overlap_sweep": "stream_overlap"}
# Older names -> (family, budget); "budget_gb" stands for --budget-gb.
ALIASES = {"compile_offload": ("compile_offload", "default"),
           "compile_offload_budget": ("compile_offload", "budget_gb"),
           "compile_offload_full": ("compile_offload", "0")}

NOTHING = "nothing"
OUR_STATE = "fp32 masters and optimizer states (stream mode)"
OUR_STATE_BUDGET = "fp32 masters and optimizer states beyond the budget (stream mode)"
OUR_STATE_COMPILED = "fp32 masters and optimizer states beyond the budget (compile mode)"


@dataclass(frozen=True)
class Mode:
    """One benchmark mode; ``config`` is what it adds to the common ds_config (read-only)."""
    name: str  # as given in --modes: the key of its result
    offloads: str  # what leaves the GPU between steps, in words
    baseline: str  # the mode its iteration time is compared with
    compiled: bool = False  # built with DeepCompile: engine.compile(), a longer warm-up
    budget_gb: Optional[float] = None  # our block's memory_budget_gb (None: derived, or no block of ours)
    family: Optional[str] = None  # the budget family (FAMILIES) of a NAME@B mode or its alias
    against_floor: bool = False  # reported as overhead over its baseline, against the copy floor
    traced: bool = False  # its one traced iteration goes into the memory timeline
    probe: bool = False  # no engine: the bandwidth probe
    reload_states: bool = False  # reload_states() before each step, offload_states() after it
    checkpoint: bool = False  # times DeepSpeed's synchronous save against our async one
    colocate: bool = False  # times engine.offload_states() + reload_states() of everything, after the iterations
    env: Tuple[Tuple[str, str], ...] = ()  # environment the worker sets before building the engine
    config: Mapping = field(default_factory=dict, compare=False)

    @property
    def ours(self):
        """Whether our optimizer_state_offload block is on (``budget_gb`` then means something)."""
        return "optimizer_state_offload" in self.config

    @property
    def budget_label(self):
        return "default" if self.budget_gb is None else f"{self.budget_gb:g} GiB"

    def file_name(self):
        """The mode's name where a file name holds it."""
        return self.name.replace("@", "_at_").replace("/", "_").replace("=", "")


def _frozen(d):
    return MappingProxyType(copy.deepcopy(d))


def _stream_block(settings, **kw):
    return {"optimizer_state_offload": dict({"enabled": True, "mode": "stream", "memory_budget_gb": 0,
                                             "sub_group_mb": settings.sub_group_mb}, **kw)}


def _fixed(name, settings):
    """The modes with a fixed name; None for any other name."""
    dc = {"compile": {"deepcompile": True, "offload_opt_states": False}}
    dc_offload = {"compile": {"deepcompile": True, "offload_opt_states": True}}
    zero_offload = {"device": "cpu", "pin_memory": True}
    table = {
        "bandwidth": dict(offloads=NOTHING, baseline="resident", probe=True),
        "resident": dict(offloads=NOTHING, baseline="resident", traced=True),
        "stream": dict(offloads=OUR_STATE, baseline="resident", against_floor=True, traced=True,
                       config=_stream_block(settings, overlap=False, prefetch=False)),
        "stream_prefetch": dict(offloads=OUR_STATE, baseline="resident", against_floor=True,
                                config=_stream_block(settings, overlap=False, prefetch=True)),
        "stream_overlap": dict(offloads=OUR_STATE, baseline="resident", against_floor=True, traced=True,
                               config=_stream_block(settings, overlap=True, speculate_memory_gb=0,
                                                    overlap_memory_gb=settings.overlap_memory_gb)),
        "stream_speculate": dict(offloads=OUR_STATE, baseline="resident", against_floor=True, traced=True,
                                 config=_stream_block(settings, overlap=True, speculate_memory_gb=None,
                                                      overlap_memory_gb=settings.overlap_memory_gb)),
        # the block at its defaults (budget measured, overlap, speculation): what a user gets
        "default": dict(offloads=OUR_STATE_BUDGET, baseline="resident", traced=True,
                        config={"optimizer_state_offload": {"enabled": True, "sub_group_mb": settings.sub_group_mb}}),
        "offload_states": dict(offloads="optimizer states and fp32 masters (engine.offload_states)",
                               baseline="resident", reload_states=True),
        "colocate": dict(offloads=NOTHING, baseline="resident", colocate=True),
        "colocate_stream": dict(offloads=OUR_STATE, baseline="resident", against_floor=True, colocate=True,
                                config=_stream_block(settings, overlap=True, speculate_memory_gb=0,
                                                     overlap_memory_gb=settings.overlap_memory_gb)),
        "zero_offload": dict(offloads="optimizer states, fp32 masters and the step (ZeRO-Offload, CPU Adam)",
                             baseline="resident", config={"zero_optimization": {"offload_optimizer": zero_offload}}),
        "checkpoint": dict(offloads=OUR_STATE, baseline="resident", checkpoint=True,
                           config=_stream_block(settings, async_checkpoint=True)),
        # the block at its defaults with async_checkpoint: the measured plan's resident state saved too
        "checkpoint_default": dict(offloads=OUR_STATE_BUDGET, baseline="resident", checkpoint=True,
                                   config={"optimizer_state_offload": {"enabled": True, "async_checkpoint": True,
                                                                       "sub_group_mb": settings.sub_group_mb}}),
        "compiled": dict(offloads=NOTHING, baseline="resident", compiled=True, config=dc),
        "dc_offload_opt_states": dict(offloads="optimizer states (DeepCompile offload_opt_states)",
                                      baseline="compiled", compiled=True, against_floor=True, config=dc_offload),
        "dc_offload_opt_states_full": dict(offloads="optimizer states, all of them (DeepCompile offload_opt_states)",
                                           baseline="compiled", compiled=True, against_floor=True, config=dc_offload,
                                           env=(("DS_DC_OFFLOAD_OPT_BUDGET_GB", "0"),)),
    }
    if name not in table:
        return None
    kw = table[name]
    return Mode(name=name, **dict(kw, config=_frozen(kw.get("config", {}))))


FIXED = ["bandwidth", "resident", "default", "stream", "stream_overlap", "stream_speculate", "stream_prefetch",
         "offload_states", "zero_offload",
         "colocate", "colocate_stream", "checkpoint", "checkpoint_default", "compiled", "dc_offload_opt_states", "dc_offload_opt_states_full"]
FAMILIES = ["compile_offload", "stream", "stream_overlap", "default"]


def _budget_mode(name, family, budget, settings):
    """A mode of a budget family: ``budget`` a number of GiB or ``default``."""
    gb = None if budget == "default" else float(budget)
    if family == "compile_offload":
        block = {"optimizer_state_offload": {"enabled": True, "mode": "compile", "sub_group_mb": settings.sub_group_mb,
                                             "memory_budget_gb": gb},
                 "compile": {"deepcompile": True, "offload_opt_states": False}}
        return Mode(name=name, offloads=OUR_STATE_COMPILED, baseline="compiled",
                    compiled=True, budget_gb=gb, family=family, against_floor=True, config=_frozen(block))
    if family == "default":  # what a user gets who sets only the budget: overlap and speculation on
        block = {"optimizer_state_offload": {"enabled": True, "sub_group_mb": settings.sub_group_mb}}
    else:
        overlap = dict(overlap=True, overlap_memory_gb=settings.overlap_memory_gb, speculate_memory_gb=0) \
            if family == "stream_overlap" else dict(overlap=False, prefetch=False)
        block = _stream_block(settings, **overlap)
    block["optimizer_state_offload"]["memory_budget_gb"] = gb
    return Mode(name=name, offloads=OUR_STATE if gb == 0 else OUR_STATE_BUDGET, baseline="resident", budget_gb=gb,
                family=family, against_floor=True, traced=True, config=_frozen(block))


def describe(name, settings):
    """The ``Mode`` named ``name``. ``settings``: anything with ``sub_group_mb``, ``overlap_memory_gb``
    and ``budget_gb`` (the parsed arguments). Raises ValueError naming an unknown mode or budget.
    ``NAME/bucket=N``: NAME with ``zero_optimization.reduce_bucket_size`` N (over ``--reduce-bucket-size``);
    ``NAME/sub_group_mb=N`` (a mode with our block): with ``sub_group_mb`` N (over ``--sub-group-mb``); so that
    two buckets or sub-group sizes are compared within one run (``--rounds``: the same drift on both)."""
    base, *options = name.split("/")
    if options:
        return _with_options(name, describe(base, settings), options)
    mode = _fixed(name, settings)
    if mode is not None:
        return mode
    if name in ALIASES:
        family, budget = ALIASES[name]
        return _budget_mode(name, family, str(settings.budget_gb) if budget == "budget_gb" else budget, settings)
    family, at, budget = name.partition("@")
    if at and family in FAMILIES:
        parse_budgets(budget)
        if budget:
            return _budget_mode(name, family, budget, settings)
    raise ValueError(f"unknown mode {name!r} (known: all, {', '.join(FIXED + list(ALIASES))}, "
                     f"{', '.join(SWEEPS)}, {', '.join(f + '@<GiB|default>' for f in FAMILIES)})")


# NAME/KEY=N: KEY -> the ds_config entry it sets, and whether only a mode with our block has it.
SUFFIXES = {"bucket": (("zero_optimization", "reduce_bucket_size"), False),
            "sub_group_mb": (("optimizer_state_offload", "sub_group_mb"), True)}


def _with_options(name, mode, options):
    config = copy.deepcopy(dict(mode.config))
    seen = set()
    for option in options:
        key, eq, value = option.partition("=")
        if key not in SUFFIXES or key in seen or not eq or not value.isdigit() or int(value) <= 0:
            raise ValueError(f"mode {name!r}: after '/' expected " + " or ".join(f"{k}=N" for k in SUFFIXES)
                             + " (N > 0, each once): bucket a reduce_bucket_size in elements, sub_group_mb in MiB")
        (section, entry), ours_only = SUFFIXES[key]
        if ours_only and not mode.ours:
            raise ValueError(f"mode {name!r}: {key} is a setting of our block, which {mode.name!r} does not have")
        seen.add(key)
        config = _merge(config, {section: {entry: int(value)}})
    return replace(mode, name=name, config=_frozen(config))


def lookup(name, settings):
    """``describe``, or None for a name this version does not know (an old result file's)."""
    try:
        return describe(name, settings)
    except ValueError:
        return None


def expand(spec, settings):
    """``--modes`` as the list of ``Mode`` to run, in order, each once; ``all`` and the sweeps
    expanded with ``settings.budgets``. Raises ValueError naming an unknown mode or budget."""
    names = []
    for name in (n.strip() for n in spec.split(",")):
        for n in (DEFAULT_MODES if name == "all" else [name] if name else []):
            if n in SWEEPS:
                names += [f"{SWEEPS[n]}@{b}" for b in parse_budgets(settings.budgets)]
            else:
                names.append(n)
    return [describe(n, settings) for n in dict.fromkeys(names)]


def parse_budgets(text):
    """``0,8,16,default`` -> the budget names, checked: a non-negative number or ``default``."""
    names = [b.strip() for b in str(text).split(",") if b.strip()]
    for b in names:
        if b != "default":
            try:
                ok = float(b) >= 0
            except ValueError:
                ok = False
            if not ok:
                raise ValueError(f"budget {b!r}: expected a number of GiB >= 0 or 'default'")
    return names


def _merge(into, extra):
    for k, v in extra.items():
        if isinstance(v, Mapping) and isinstance(into.get(k), dict):
            _merge(into[k], v)
        else:
            into[k] = copy.deepcopy(dict(v) if isinstance(v, Mapping) else v)
    return into


def ds_config(mode, args):
    """The ds_config of ``mode``'s engine: ZeRO-3, Adam, bf16, and what the mode adds."""
    cfg = {
        "train_micro_batch_size_per_gpu": args.batch if args.model == "llama" else 1,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-4, "weight_decay": 0.0}},
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": 3},
        "steps_per_print": 10**9,
    }
    if getattr(args, "gradient_clipping", None) is not None:
        cfg["gradient_clipping"] = args.gradient_clipping
    if getattr(args, "reduce_bucket_size", None) is not None:
        cfg["zero_optimization"]["reduce_bucket_size"] = args.reduce_bucket_size
    return _merge(cfg, mode.config)
