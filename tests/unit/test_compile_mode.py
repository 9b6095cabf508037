"""Compile mode's pieces that run without a GPU: the ops (registration, dead-code elimination,
program order through stock inductor on the CPU), the planner on synthetic profiles, and the pass
on synthetic graphs. The runtime the ops drive is checked for parity in tests/e2e (CPU ranks)."""

import types

import pytest
import torch
import torch.fx
from deepspeed.compile.passes import zero3_compile
from torch._higher_order_ops.effects import _EffectType, _get_effect

from deepspeed_offload.compat import PASS_CONTRACTS, at_least, deepspeed_release
from deepspeed_offload.compile_passes import ops, schedule
from deepspeed_offload.compile_passes.planner import plan_kept, plan_reloads, suffix_peaks
from deepspeed_offload.runtime.patches import PatchRegistry

NAMES = ["offload_launch", "reload", "empty_cache", "copy_stream_sync"]


class Recorder:
    """Stands in for the attached mode: records what the ops asked for, in order."""

    def __init__(self):
        self.calls = []

    def op_offload_launch(self, i):
        self.calls.append(("offload_launch", i))

    def op_reload(self, i):
        self.calls.append(("reload", i))

    def op_empty_cache(self):
        self.calls.append(("empty_cache", None))

    def op_copy_stream_sync(self):
        self.calls.append(("copy_stream_sync", None))


@pytest.fixture
def recorder():
    rec = Recorder()
    rec.key = ops.bind(rec)
    _BOUND["key"] = rec.key
    yield rec
    ops.unbind(rec.key)


_BOUND = {"key": None}  # the key the recorder's graphs name


def test_registration_is_idempotent_side_effectful_and_ordered():
    ops.register_ops()
    lib = ops._lib
    ops.register_ops()
    assert ops._lib is lib
    for name in NAMES:
        overload = ops.op(name)
        assert overload.name().startswith("ds_offload::")
        assert overload in torch.fx.node._side_effectful_functions
        assert _get_effect(overload) == _EffectType.ORDERED
    # our own namespace: a second DEF of it is refused, so nobody else can have defined it
    with pytest.raises(RuntimeError):
        torch.library.Library(ops.NAMESPACE, "DEF")


def test_meta_kernels():
    x = torch.empty(4, device="meta")
    assert ops.op("reload")(x, 0, 3) is None and ops.op("empty_cache")(x, 0) is None  # no runtime needed on meta


def test_unbound_ops_fail_clearly():
    with pytest.raises(RuntimeError, match="has no deepspeed-offload compile mode attached"):
        ops.op("empty_cache")(torch.zeros(1), 10**6)


def test_two_engines_keep_their_own_runtime():
    """Two compile-mode engines in one process: each graph's ops reach the runtime of its own engine."""
    first, second = Recorder(), Recorder()
    a, b = ops.bind(first), ops.bind(second)
    try:
        ops.op("reload")(torch.zeros(1), a, 1)
        ops.op("reload")(torch.zeros(1), b, 2)
        ops.op("copy_stream_sync")(torch.zeros(1), b)
    finally:
        ops.unbind(a)
        ops.unbind(b)
    assert a != b and first.calls == [("reload", 1)] and second.calls == [("reload", 2), ("copy_stream_sync", None)]


OP = {name: ops.op(name) for name in NAMES}  # what the graphs hold: resolved OpOverloads
T = [0, 1, 2]  # the sub-groups the ops name


def _program(x):
    k = _BOUND["key"]
    OP["offload_launch"](x, k, T[0])
    OP["empty_cache"](x, k)
    y = torch.sin(x) * 2
    OP["reload"](x, k, T[1])
    z = y.cos().sum()
    OP["reload"](x, k, T[2])
    OP["copy_stream_sync"](x, k)
    return z + 1


EXPECTED = [("offload_launch", 0), ("empty_cache", None), ("reload", 1), ("reload", 2), ("copy_stream_sync", None)]


def test_fx_dead_code_elimination_keeps_them(recorder):
    gm = torch.fx.symbolic_trace(_program)
    before = [n.target for n in gm.graph.nodes if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload)]
    gm.graph.eliminate_dead_code()
    after = [n.target for n in gm.graph.nodes if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload)]
    assert after == before and len(after) == 5
    gm.recompile()
    gm(torch.ones(3))
    assert recorder.calls == EXPECTED


def test_inductor_on_cpu_keeps_them_in_program_order(recorder):
    torch._dynamo.reset()
    compiled = torch.compile(_program, backend="inductor", fullgraph=True)
    x = torch.linspace(0, 1, 8)
    for _ in range(2):
        out = compiled(x)
    assert recorder.calls == EXPECTED * 2
    assert torch.allclose(out, _program(x))


# ---------------------------------------------------------------------- planner

BWD = [("b0", 100), ("b1", 90), ("b2", 60), ("b3", 40), ("b4", 20)]  # backward frees as it goes
TASKS = [(7, 10), (6, 10), (5, 10), (4, 10)]  # (sub-group, bytes), priority order


def _check_within_budget(records, placements, budget, reserve, already=0):
    """From the first reload on, what was reloaded so far fits beside the floor at every node."""
    peaks = suffix_peaks(records)
    sizes = dict(TASKS)
    held = already
    at = {name: sgs for name, sgs in placements}
    for name, _ in records:
        held += sum(sizes[i] for i in at.get(name, []))
        if held > already:
            assert held + max(peaks[name], reserve) <= budget, (name, held)


def test_suffix_peaks():
    assert suffix_peaks([("a", 5), ("b", 9), ("c", 2)]) == {"a": 9, "b": 9, "c": 2}


def test_budget_forces_all_some_none():
    # all: room for everything right at the start of backward
    placed, left = plan_reloads(BWD, TASKS, budget=200, reserve=50)
    assert placed == [("b0", [7, 6, 5, 4])] and left == []
    # some: as activations are freed, room opens up; what never fits is left to the step
    placed, left = plan_reloads(BWD, TASKS, budget=85, reserve=50)
    assert placed == [("b2", [7, 6]), ("b3", [5])] and left == [(4, 10)]
    _check_within_budget(BWD, placed, 85, 50)
    # none: the floor alone uses the budget
    placed, left = plan_reloads(BWD, TASKS, budget=60, reserve=55)
    assert placed == [] and left == TASKS
    # budget 0: everything streams through the step
    assert plan_reloads(BWD, TASKS, budget=0, reserve=0) == ([], TASKS)


def test_kept_are_the_first_placed_that_fit_beside_the_floor():
    placed = [(7, 10), (6, 10), (5, 30), (4, 1)]
    assert plan_kept(placed, budget=151, floor=100) == [7, 6, 5, 4]
    assert plan_kept(placed, budget=150, floor=100) == [7, 6, 5]
    assert plan_kept(placed, budget=125, floor=100) == [7, 6]  # 4 would fit, but not before 5
    assert plan_kept(placed, budget=100, floor=100) == []
    assert plan_kept([], budget=100, floor=0) == []


def test_earlier_backward_graphs_count():
    placed, left = plan_reloads(BWD, TASKS, budget=85, reserve=50, already=20)
    assert placed == [("b3", [7])] and len(left) == 3
    _check_within_budget(BWD, placed, 85, 50, already=20)


def test_priority_order_is_kept():
    tasks = [(1, 30), (2, 5)]  # the small second one would fit earlier, but does not jump the queue
    placed, left = plan_reloads(BWD, tasks, budget=110, reserve=0)
    assert placed == [("b2", [1, 2])] and left == []


# ---------------------------------------------------------------------- schedule and pass

def test_schedule_lists_z3_and_ours_in_every_entry():
    for _, passes in schedule.default_schedule(5):
        assert passes[0] == zero3_compile.NAME and passes[-1] == schedule.NAME
    user = [(0, [zero3_compile.NAME]), (3, [zero3_compile.NAME, schedule.NAME])]
    assert schedule.arrange(user, 5) == [(0, [zero3_compile.NAME, schedule.NAME]),
                                         (3, [zero3_compile.NAME, schedule.NAME])]


@pytest.mark.skipif(not at_least(PASS_CONTRACTS), reason=f"DeepCompile checks pass contracts from DeepSpeed "
                    f"{PASS_CONTRACTS} on, this is {deepspeed_release()}")
def test_contract_validates_with_deepspeed(monkeypatch):
    from deepspeed.compile.passes import contract as dc_contract
    monkeypatch.setattr(dc_contract, "_pass_contracts", {})  # DeepSpeed's registry, as this test leaves it
    dc_contract.register_pass_contract(zero3_compile.NAME, zero3_compile.CONTRACT)
    dc_contract.register_pass_contract("offload_adam_states", dc_contract.PassContract())
    dc_contract.register_pass_contract(schedule.NAME, schedule.contract())
    dc_contract.validate_schedule(schedule.default_schedule(5))
    with pytest.raises(dc_contract.PassContractError, match="requires"):
        dc_contract.validate_schedule([(0, [schedule.NAME])])  # without the ZeRO-3 pass
    with pytest.raises(dc_contract.PassContractError, match="conflicts"):
        dc_contract.validate_schedule([(0, [zero3_compile.NAME, "offload_adam_states", schedule.NAME])])


class FakeMode:
    """What the pass asks of the attached mode."""

    def __init__(self, budget):
        self.priority = [3, 2, 1, 0]
        self.slot_bytes = 0
        self.budget = budget
        self.phases = 0
        self.kept = None  # what the pass decided to keep on the device between steps
        self.ops_key = 0  # the key its graphs' ops name

    def keep(self, sub_groups, only_fewer=False):
        self.kept = [i for i in sub_groups if not only_fewer or i in self.kept]

    def sub_group_bytes(self, i):
        return 10

    def planner_budget_bytes(self):
        return self.budget

    def begin_phase(self):
        self.phases += 1


def _graph(names):
    g = torch.fx.Graph()
    x = g.placeholder("x")
    x.meta["val"] = torch.zeros(2)
    prev = x
    for name in names:
        prev = g.call_function(torch.ops.aten.sin.default, (prev, ), name=name)
        prev.meta["val"] = torch.zeros(2)
    g.output(prev)
    return torch.fx.GraphModule(torch.nn.Module(), g)


def _targets(gm):
    gm.graph.lint()  # what DeepCompile does to a graph a pass returns
    out = []
    for n in gm.graph.nodes:
        if n.op == "call_function":
            if n.target.name().startswith("ds_offload::"):
                name = n.target.name().split("::")[1]
                out.append((name, n.args[2] if len(n.args) > 2 else None))
            else:
                out.append(n.name)
    return out


def _profiles(fwd_peak, bwd):
    prof = types.SimpleNamespace(fwd_mem=[("f0", 0, 0, fwd_peak)], bwd_mem=[(n, 0, 0, p) for n, p in bwd])
    return {1: prof}


def test_pass_places_ops_in_forward_and_backward():
    mode = FakeMode(budget=85)
    the_pass = schedule.OffloadPass(mode)
    order = [(1, True)]
    fwd = the_pass(_graph(["f0", "f1"]), 1, order, _profiles(50, BWD), None, 0.0, None, False)
    assert mode.phases == 1
    assert _targets(fwd) == [("offload_launch", 3), ("offload_launch", 2), ("offload_launch", 1),
                             ("offload_launch", 0), ("empty_cache", None), "f0", "f1"]
    bwd = the_pass(_graph([n for n, _ in BWD]), 1, order, _profiles(50, BWD), None, 0.0, None, True)
    assert _targets(bwd) == ["b0", "b1", "b2", ("reload", 3), ("reload", 2), "b3", ("reload", 1), "b4",
                             ("copy_stream_sync", None)]
    assert the_pass.pending == [(0, 10)]  # left to the streamed step
    assert mode.kept == []  # backward's peak (100) alone is over the budget: each reload leaves again


def test_pass_keeps_the_reloads_that_fit_beside_backwards_peak():
    mode = FakeMode(budget=125)
    the_pass = schedule.OffloadPass(mode)
    order = [(1, True)]
    the_pass(_graph(["f0"]), 1, order, _profiles(50, BWD), None, 0.0, None, False)
    bwd = the_pass(_graph([n for n, _ in BWD]), 1, order, _profiles(50, BWD), None, 0.0, None, True)
    assert _targets(bwd) == ["b0", ("reload", 3), ("reload", 2), "b1", ("reload", 1), "b2", ("reload", 0), "b3",
                             "b4", ("copy_stream_sync", None)]
    assert mode.kept == [3, 2]  # 125 - backward's peak 100: room for two of them all along
    the_pass(_graph(["f0"]), 1, order, _profiles(50, BWD), None, 0.0, None, False)  # a new phase
    the_pass(_graph([n for n, _ in BWD]), 1, order, _profiles(50, BWD[1:]), None, 0.0, None, True)
    assert mode.kept == [3, 2, 1]  # its profile peaks at 90: decided again


def test_pass_with_a_graph_break_carries_what_backward_reloaded():
    mode = FakeMode(budget=85)
    the_pass = schedule.OffloadPass(mode)
    order = [(1, True), (2, True)]  # backward runs graph 2 first, then graph 1
    profiles = {1: types.SimpleNamespace(fwd_mem=[("f0", 0, 0, 50)], bwd_mem=[("c0", 0, 0, 30)]),
                2: types.SimpleNamespace(fwd_mem=[("g0", 0, 0, 40)], bwd_mem=[(n, 0, 0, p) for n, p in BWD])}
    assert the_pass(_graph(["g0"]), 2, order, profiles, None, 0.0, None, False) is None  # not the first graph
    the_pass(_graph(["f0"]), 1, order, profiles, None, 0.0, None, False)
    first = the_pass(_graph([n for n, _ in BWD]), 2, order, profiles, None, 0.0, None, True)
    assert ("copy_stream_sync", None) not in _targets(first)
    last = the_pass(_graph(["c0"]), 1, order, profiles, None, 0.0, None, True)
    assert _targets(last)[-1] == ("copy_stream_sync", None)
    reloaded = [t for t in _targets(first) + _targets(last) if isinstance(t, tuple) and t[0] == "reload"]
    assert [i for _, i in reloaded] == [3, 2, 1]  # 85 - max(30, reserve 50) = 35 bytes: 3 of 4
    assert the_pass.pending == [(0, 10)]


def test_install_registers_the_pass_and_arranges_engine_compile():
    seen = {}

    class Engine:

        def register_compile_pass(self, name, fn, contract=None):
            seen["registered"] = (name, fn, contract)

        def compile(self, backend="inductor", compile_kwargs={}, schedule=None, compiled_autograd_enabled=False):
            seen.setdefault("schedules", []).append(schedule)
            self.launch_compile_passes = lambda steps: seen.setdefault("launched", []).append(steps)

    engine = Engine()
    original_compile = engine.compile
    mode = FakeMode(budget=0)
    mode.patches = PatchRegistry()
    mode.drains = 0
    mode.drain = lambda: setattr(mode, "drains", mode.drains + 1)
    the_pass = schedule.install(engine, mode)
    # with DeepCompile's contract where it checks them, without it before
    assert seen["registered"] == (schedule.NAME, the_pass, schedule.contract() if at_least(PASS_CONTRACTS) else None)
    engine.compile()
    engine.compile("inductor", {}, [(0, [zero3_compile.NAME])])
    from deepspeed.compile.init_z3 import WARMUP
    assert seen["schedules"] == [schedule.default_schedule(WARMUP), [(0, [zero3_compile.NAME, schedule.NAME])]]
    # a step that starts a compile phase writes everything back before DeepCompile profiles
    from deepspeed.compile import backend
    backend.init_schedule([(0, []), (5, [])])
    engine.launch_compile_passes(0)
    engine.launch_compile_passes(3)
    assert mode.drains == 1 and seen["launched"] == [0, 3]
    # every hook went through the mode's registry: removing them leaves DeepSpeed's own methods
    mode.patches.remove_all()
    assert engine.compile == original_compile and "launch_compile_passes" in vars(engine)
    assert not getattr(engine.launch_compile_passes, "evicts_first", False)


def test_reloads_depend_on_the_node_they_follow():
    bwd = FakeMode(budget=85)
    gm = schedule.OffloadPass(bwd)(_graph([n for n, _ in BWD]), 1, [(1, True)], _profiles(50, BWD), None, 0.0, None,
                                   True)
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.target == ops.op("reload"):
            assert n.args[0].name in ("b2", "b3")  # not the graph input: a data dependency on its predecessor


def test_a_recompiled_frame_still_gets_its_ops():
    mode = FakeMode(budget=85)
    the_pass = schedule.OffloadPass(mode)
    order = [(1, True)]  # DeepCompile lists the frame's first graph only; 9 is its recompiled graph
    fwd = the_pass(_graph(["f0"]), 9, order, {9: _profiles(50, BWD)[1], 1: _profiles(50, BWD)[1]}, None, 0.0, None,
                   False)
    assert _targets(fwd).count(("empty_cache", None)) == 1 and len(_targets(fwd)) == 6
    bwd = the_pass(_graph([n for n, _ in BWD]), 9, order, {9: _profiles(50, BWD)[1]}, None, 0.0, None, True)
    assert _targets(bwd)[-1] == ("copy_stream_sync", None) and ("reload", 3) in _targets(bwd)


def test_an_incomplete_profile_reloads_nothing():
    mode = FakeMode(budget=10**9)
    the_pass = schedule.OffloadPass(mode)
    profiles = _profiles(50, BWD)
    profiles[1].bwd_mem_complete = False
    bwd = the_pass(_graph([n for n, _ in BWD]), 1, [(1, True)], profiles, None, 0.0, None, True)
    assert not [t for t in _targets(bwd) if isinstance(t, tuple) and t[0] == "reload"]
    assert len(the_pass.pending) == 4 and _targets(bwd)[-1] == ("copy_stream_sync", None)
    assert mode.kept == []


def test_a_graph_without_a_profile_keeps_nothing_across_it():
    """Two backward graphs; the one that runs last has no profile: the first one's reloads may not
    stay on the device through it."""
    mode = FakeMode(budget=10**9)
    the_pass = schedule.OffloadPass(mode)
    order = [(1, True), (2, True)]
    profiles = {1: types.SimpleNamespace(fwd_mem=[("f0", 0, 0, 50)], bwd_mem=[]),
                2: types.SimpleNamespace(fwd_mem=[("g0", 0, 0, 40)], bwd_mem=[(n, 0, 0, p) for n, p in BWD])}
    the_pass(_graph(["f0"]), 1, order, profiles, None, 0.0, None, False)
    the_pass(_graph([n for n, _ in BWD]), 2, order, profiles, None, 0.0, None, True)
    the_pass(_graph(["c0"]), 1, order, profiles, None, 0.0, None, True)
    assert [i for i, _ in the_pass.placed] == [3, 2, 1, 0] and mode.kept == []


def test_pass_on_real_aot_graphs_compiled_by_inductor(recorder):
    """The way DeepCompile uses inductor: AOT partitions the model into forward and backward
    graphs, the pass edits them after AOT, inductor compiles the edited graphs. The ops must survive
    and run in the order the pass placed them."""
    from torch._inductor.compile_fx import compile_fx, compile_fx_inner

    mode = FakeMode(budget=85)
    mode.ops_key = recorder.key
    the_pass = schedule.OffloadPass(mode)
    profiles = {1: types.SimpleNamespace(fwd_mem=[], bwd_mem=[])}
    placed = {}

    def inner(gm, example_inputs, **kwargs):
        bwd = kwargs.get("is_backward", False)
        nodes = [n.name for n in gm.graph.nodes if n.op not in ("placeholder", "output")]
        if bwd:  # backward frees as it goes: room for reloads opens up towards its end
            profiles[1].bwd_mem = [(n, 0, 0, 100 - 60 * k // len(nodes)) for k, n in enumerate(nodes)]
        else:
            profiles[1].fwd_mem = [(n, 0, 0, 50) for n in nodes]
        the_pass(gm, 1, [(1, True)], profiles, None, 0.0, None, bwd)
        placed["bwd" if bwd else "fwd"] = _targets(gm)
        return compile_fx_inner(gm, example_inputs, **kwargs)

    torch._dynamo.reset()
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4), torch.nn.Tanh())
    compiled = torch.compile(model, backend=lambda gm, ex: compile_fx(gm, ex, inner_compile=inner))
    with torch._inductor.config.patch(force_disable_caches=True):  # a cache hit would skip the pass
        compiled(torch.randn(2, 8)).sum().backward()

    reloads = [t for t in placed["bwd"] if isinstance(t, tuple) and t[0] == "reload"]
    assert 0 < len(reloads) < 4, placed["bwd"]  # the budget lets some come back early, not all
    assert recorder.calls == [("offload_launch", i) for i in mode.priority] + [("empty_cache", None)] + \
        reloads + [("copy_stream_sync", None)]
