"""The caching allocator's expandable segments (runtime/memory/allocator.py): read from the environment
under each name torch reads, turned on by the first mode that holds them and off by the last, and only
where the block, the device and the environment leave it to the package."""

import types

import pytest

from deepspeed_offload.config import OffloadConfig
from deepspeed_offload.runtime.memory import allocator
from deepspeed_offload.runtime.memory.allocator import (ExpandableSegments, expandable_segments_env, hold_for, wanted,
                                                         with_expandable_segments)


def test_expandable_segments_is_read_from_each_name_torch_reads():
    assert expandable_segments_env({}) is None
    assert expandable_segments_env({"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128"}) is None
    assert expandable_segments_env({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False"}) is False
    assert expandable_segments_env({"PYTORCH_ALLOC_CONF": "max_split_size_mb:128, expandable_segments:True"}) is True
    assert expandable_segments_env({"PYTORCH_HIP_ALLOC_CONF": "expandable_segments:true"}) is True
    # one name turns it on, another off: on (torch reads one of them, depending on its version)
    assert expandable_segments_env({"PYTORCH_ALLOC_CONF": "expandable_segments:False",
                                    "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}) is True


def test_the_other_settings_go_along():
    """torch parses a new setting whole, putting the options it does not name back to their defaults: the
    string passed is the allocator's settings with the switch set (a bracketed list's commas kept)."""
    conf = "max_split_size_mb:512,roundup_power2_divisions:[256:1,512:2],garbage_collection_threshold:0.8"
    assert with_expandable_segments(conf, True) == conf + ",expandable_segments:True"
    assert with_expandable_segments(conf + ",expandable_segments:True", False) == conf + ",expandable_segments:False"
    assert with_expandable_segments("", True) == "expandable_segments:True"


def test_the_first_holder_turns_it_on_and_the_last_release_off():
    calls = []
    switch = ExpandableSegments(setter=calls.append, current=lambda: "garbage_collection_threshold:0.8")
    assert switch.hold()
    switch.release()
    assert calls == ["garbage_collection_threshold:0.8,expandable_segments:True",
                     "garbage_collection_threshold:0.8,expandable_segments:False"]
    calls.clear()
    switch.current = lambda: ""
    assert not switch.on({})
    switch.hold()
    switch.hold()  # a second engine in the process (an actor and a critic)
    assert calls == ["expandable_segments:True"] and switch.on({})
    switch.release()
    assert calls == ["expandable_segments:True"] and switch.on({})  # the other engine still runs
    switch.release()
    assert calls == ["expandable_segments:True", "expandable_segments:False"] and not switch.on({})
    switch.release()  # (nothing held: nothing to turn off)
    assert len(calls) == 2 and switch.holders == 0
    assert switch.on({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"})


def test_a_setting_torch_refuses_leaves_attach_and_detach_to_go_on(monkeypatch):
    """Turning it on or off is an optimization: where torch raises, a warning, and nothing is held."""
    warned = []
    monkeypatch.setattr(allocator, "_warn", warned.append)

    def refuse(settings):
        raise RuntimeError("Unrecognized key")

    switch = ExpandableSegments(setter=refuse, current=lambda: "")
    assert not switch.hold() and switch.holders == 0 and "stays as it was" in warned[0]
    calls = []
    switch = ExpandableSegments(setter=calls.append, current=lambda: "")
    assert switch.hold()
    switch.setter = refuse
    switch.release()  # detach goes on
    assert switch.holders == 0 and "off again" in warned[1]


@pytest.mark.parametrize("block, device, environ, expected", [
    (True, "cuda", {}, True),
    (True, "cuda", {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:512"}, True),
    (False, "cuda", {}, False),  # the block says no
    (True, "cpu", {}, False),  # device memory is host memory
    (True, "npu", {}, False),  # another accelerator's allocator: not ours to set
    (True, "cuda", {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False"}, False),  # the operator chose
    (True, "cuda", {"PYTORCH_ALLOC_CONF": "expandable_segments:True"}, False),  # on already: nothing to do
    (True, "cuda", {"PYTORCH_CUDA_ALLOC_CONF": "backend:cudaMallocAsync"}, False),  # not the caching allocator
    (True, "cuda", {"PYTORCH_CUDA_ALLOC_CONF": "backend:native,max_split_size_mb:256"}, True),
])
def test_the_package_turns_it_on_only_where_nobody_else_decided(block, device, environ, expected):
    assert wanted(block, device, environ) is expected


def test_a_mode_holds_it_from_attach_to_detach(monkeypatch):
    """``hold_for`` at attach: on, one log line, and off again when the mode's detach (or undone attach)
    runs its callbacks; with the block's false nothing changes."""
    for name in allocator.ALLOC_CONF_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(allocator, "_rocm", lambda: False)
    calls, logged = [], []
    monkeypatch.setattr(allocator, "log_dist", lambda msg, **kw: logged.append(msg))
    switch = ExpandableSegments(setter=calls.append, current=lambda: "")

    def mode(block):
        detach = []
        return types.SimpleNamespace(cfg=OffloadConfig(enabled=True, expandable_segments=block),
                                     acc=types.SimpleNamespace(device_name=lambda: "cuda"),
                                     on_detach=detach.append, detach=detach)

    assert OffloadConfig(enabled=True).expandable_segments is True  # the default
    off = mode(False)
    hold_for(off, switch)
    assert calls == [] and off.detach == [] and logged == []
    on = mode(True)
    hold_for(on, switch)
    hold_for(on, switch)  # the plan made again (measure_with): still one hold
    assert calls == ["expandable_segments:True"] and switch.holders == 1 and len(logged) == 1
    assert len(on.detach) == 1
    assert "expandable segments" in logged[0]
    for fn in on.detach:
        fn()
    assert calls == ["expandable_segments:True", "expandable_segments:False"] and switch.holders == 0
    hold_for(on, switch)  # attached again (detach let go of it)
    assert calls[-1] == "expandable_segments:True" and switch.holders == 1


def test_the_settings_passed_along_are_those_torch_runs_with(monkeypatch):
    """torch's own record where it keeps one; else the variable that torch version reads."""
    torch = pytest.importorskip("torch")
    env = {"PYTORCH_ALLOC_CONF": "max_split_size_mb:256", "PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128"}
    monkeypatch.setattr(torch._C, "_accelerator_getAllocatorSettings", lambda: "garbage_collection_threshold:0.5",
                        raising=False)
    assert allocator._current_settings(env) == "garbage_collection_threshold:0.5"
    monkeypatch.delattr(torch._C, "_accelerator_getAllocatorSettings")
    monkeypatch.setattr(torch._C, "_accelerator_setAllocatorSettings", lambda s: None, raising=False)
    assert allocator._current_settings(env) == "max_split_size_mb:256"  # torch >= 2.9 reads PYTORCH_ALLOC_CONF first
    monkeypatch.delattr(torch._C, "_accelerator_setAllocatorSettings")
    assert allocator._current_settings(env) == "max_split_size_mb:128"  # older torch: only the CUDA name
