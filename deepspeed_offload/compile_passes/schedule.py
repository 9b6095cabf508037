"""Our pass in DeepCompile's schedule: where the ops go in each graph, and how ``engine.compile()``
comes to run it.

DeepCompile re-applies the passes of a schedule entry from the captured graph at each scheduled
step (a compile phase), so every entry lists the ZeRO-3 pass (ours needs its gather/release nodes
and the profile taken after them) and ours last (to see the profile after prefetch and selective
gather). Per phase, the pass sees the forward graphs in order, then the backward graphs in the
order backward runs them:

- first forward graph: every sub-group goes back to the host before DeepCompile profiles
  (``CompileMode.begin_phase``), then ``offload_launch`` per sub-group and one ``empty_cache``
  go at its head;
- each backward graph: ``reload`` nodes where ``planner.plan_reloads`` finds room, carrying what
  earlier backward graphs reloaded;
- last backward graph: ``copy_stream_sync`` before its output, and the reloaded sub-groups that
  fit beside the iteration's floor are kept on the device between steps (``CompileMode.keep``):
  ``offload_launch`` passes them over, and their ``reload`` finds them there.
"""

from typing import List, Tuple

import torch

from deepspeed.compile.passes import prefetch, selective_gather, zero3_compile
from deepspeed.utils import logger

from ..compat import register_compile_pass
from . import ops
from .planner import plan_kept, plan_reloads

NAME = "deepspeed_offload_opt_states"
Z3 = zero3_compile.NAME
DEFAULT_PASSES_AFTER_WARMUP = [prefetch.NAME, selective_gather.NAME]
# DeepCompile's passes that move the memory ours moves, by name: the later ones exist only in later
# DeepSpeed releases, and a name a schedule does not hold conflicts with nothing.
CONFLICTS = frozenset({
    "offload_adam_states", "offload_adam_states_sync", "offload_adam_states_for_init", "offload_parameters",
    "offload_activation", "offload_activation_floor"
})


def contract():
    """Our pass's DeepCompile contract: after ZeRO-3's gather/release pass, never beside one of
    ``CONFLICTS``. Only a DeepSpeed whose DeepCompile checks contracts asks for it
    (compat.register_compile_pass)."""
    from deepspeed.compile.passes.contract import CAP_Z3_GATHER_RELEASE, PassContract
    return PassContract(requires=frozenset({CAP_Z3_GATHER_RELEASE}), conflicts_with=CONFLICTS, phase="both")


def default_schedule(warmup: int) -> List[Tuple[int, List[str]]]:
    """DeepSpeed's default ZeRO-3 schedule with our pass appended to each entry."""
    return [(0, [Z3, NAME]), (warmup, [Z3, *DEFAULT_PASSES_AFTER_WARMUP, NAME])]


def arrange(schedule, warmup: int):
    """The schedule ``engine.compile()`` gets: the default one, or the user's with our pass appended
    to each entry that lacks it."""
    if schedule is None:
        return default_schedule(warmup)
    out = []
    for step, passes in schedule:
        passes = list(passes)
        if NAME not in passes:
            passes.append(NAME)
            logger.info(f"[deepspeed-offload] compile schedule step {step}: appended {NAME}")
        out.append((step, passes))
    return out


def _anchor(graph):
    for node in graph.nodes:
        if node.op == "placeholder" and isinstance(node.meta.get("val"), torch.Tensor):
            return node
    raise RuntimeError("deepspeed-offload: the graph has no tensor input to anchor its ops on")


def _records(profile) -> List[Tuple[str, int]]:
    return [(name, peak) for name, _alloc, _delta, peak in (profile or [])]


class OffloadPass:
    """The callable registered with DeepCompile; one per attached engine."""

    def __init__(self, mode):
        self.mode = mode
        self.held = 0  # bytes reloaded so far by this step's earlier backward graphs
        self.pending = []  # reload tasks the backward graphs have not placed yet
        self.placed = []  # (sub-group, bytes) placed so far, in order
        self.floor = 0  # the iteration's peak without the reloads, over the graphs seen so far

    def __call__(self, gm, graph_id, graph_order, profiling_results, create_inputs_fn, mem_budget, param_manager,
                 bwd):
        graph = gm.graph
        known = [g for g, _ in graph_order]
        if not bwd:
            if graph_id in known[1:]:
                return None  # a later forward graph: the first one already wrote everything back
            if graph_id == known[0]:
                self.mode.begin_phase()
            # else: a graph DeepCompile does not list (dynamo recompiled a frame): it may be the one
            # that runs first, so it writes back too; where it is not, its ops find nothing to do.
            self._insert_at_head(graph)
        else:
            with_bwd = [g for g, needs in graph_order if needs]
            unlisted = graph_id not in with_bwd
            if unlisted or graph_id == with_bwd[-1]:  # the first backward graph to run
                self.held, self.placed, self.floor = 0, [], 0
                self.pending = [(i, self.mode.sub_group_bytes(i)) for i in self.mode.priority]
            self._insert_reloads(graph, profiling_results, graph_id)
            if unlisted or graph_id == with_bwd[0]:  # the last one
                out = next(n for n in graph.nodes if n.op == "output")
                with graph.inserting_before(out):
                    graph.call_function(ops.op("copy_stream_sync"), (_anchor(graph), self.mode.ops_key))
                self.mode.keep(plan_kept(self.placed, self.mode.planner_budget_bytes(), self.floor),
                               only_fewer=unlisted)
                if self.pending:
                    logger.info(f"[deepspeed-offload] {len(self.pending)} sub-groups stream through the step")
        return gm  # DeepCompile lints and recompiles what a pass returns

    def _insert_at_head(self, graph):
        anchor = _anchor(graph)
        first = next(n for n in graph.nodes if n.op != "placeholder")
        with graph.inserting_before(first):
            for i in self.mode.priority:
                graph.call_function(ops.op("offload_launch"), (anchor, self.mode.ops_key, int(i)))
            graph.call_function(ops.op("empty_cache"), (anchor, self.mode.ops_key))

    def _insert_reloads(self, graph, profiling_results, graph_id):
        profile = profiling_results.get(graph_id)
        if profile is None or not getattr(profile, "bwd_mem_complete", True) or not all(
                getattr(r, "fwd_mem_complete", True) for r in profiling_results.values()):
            self.floor = float("inf")  # a graph whose peak is unknown: nothing may stay on the device across it
            if self.pending:
                logger.warning(f"[deepspeed-offload] DeepCompile's memory profile is incomplete at backward graph "
                               f"{graph_id}: nothing reloaded there, the step streams it")
            return
        names = {node.name for node in graph.nodes if node.op not in ("placeholder", "output")}
        records = [(n, p) for n, p in _records(getattr(profile, "bwd_mem", None)) if n in names]
        if not records:
            self.floor = float("inf")
            if self.pending:
                logger.warning(f"[deepspeed-offload] no memory profile for backward graph {graph_id}: "
                               "nothing reloaded there")
            return
        fwd_peak = max((p for r in profiling_results.values() for _, p in _records(getattr(r, "fwd_mem", None))),
                       default=0)
        reserve = fwd_peak + 2 * self.mode.slot_bytes
        # What the kept sub-groups sit beside: every backward graph's peak, the forward's, the step's slots.
        self.floor = max(self.floor, reserve, max(p for _, p in records))
        if not self.pending:
            return
        placements, self.pending = plan_reloads(records, self.pending, self.mode.planner_budget_bytes(), reserve,
                                                self.held)
        fallback = _anchor(graph)
        by_name = {n.name: n for n in graph.nodes}
        for name, sub_groups in placements:
            at = by_name[name]
            # The node's own output as the anchor: a data dependency, so no scheduler (inductor's
            # memory-driven reordering included) can start the reload before that node.
            anchor = at if isinstance(at.meta.get("val"), torch.Tensor) else fallback
            for i in sub_groups:
                with graph.inserting_after(at):
                    at = graph.call_function(ops.op("reload"), (anchor, self.mode.ops_key, int(i)))
                self.held += self.mode.sub_group_bytes(i)
                self.placed.append((i, self.mode.sub_group_bytes(i)))


def _evicting_first(launch, mode):
    """DeepCompile starts a compile phase at the head of a step's forward and profiles the first
    graph before our pass runs on it: write everything back to the host first, so that profile too
    is taken at the floor."""
    from deepspeed.compile import backend

    def launch_compile_passes(global_steps, *args, **kwargs):
        if backend.remaining_schedule and backend.remaining_schedule[0][0] == global_steps:
            mode.drain()
        return launch(global_steps, *args, **kwargs)

    launch_compile_passes.evicts_first = True
    return launch_compile_passes


def unregister(mode):
    """Take ``mode``'s pass out of DeepSpeed's pass table (it stays where another mode's replaced it)."""
    from deepspeed.compile import backend
    if isinstance(backend.opt_passes.get(NAME), OffloadPass) and backend.opt_passes[NAME].mode is mode:
        del backend.opt_passes[NAME]


def install(engine, mode):
    """Register the pass and make ``engine.compile()`` run the schedule with it. Both engine hooks
    go through ``mode.patches``, so ``mode.detach()`` removes them with the rest."""
    from deepspeed.compile.init_z3 import WARMUP
    the_pass = OffloadPass(mode)
    register_compile_pass(engine, NAME, the_pass, contract)

    def arranging(compile_fn):

        def compile(*args, **kwargs):
            if len(args) >= 3:
                args = list(args)
                args[2] = arrange(args[2], WARMUP)
            else:
                kwargs["schedule"] = arrange(kwargs.get("schedule"), WARMUP)
            result = compile_fn(*args, **kwargs)
            launch = getattr(engine, "launch_compile_passes", None)
            # DeepSpeed sets it anew at each compile(): wrap what is there unless it is ours already.
            if launch is not None and not getattr(launch, "evicts_first", False):
                mode.patches.patch(engine, "launch_compile_passes", lambda launch: _evicting_first(launch, mode))
            return result

        return compile

    mode.patches.patch(engine, "compile", arranging)
    return the_pass
