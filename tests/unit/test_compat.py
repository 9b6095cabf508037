"""compat.py is the one place that knows DeepSpeed releases apart: setup.cfg's range is its range,
no other module compares DeepSpeed's version or guards a DeepSpeed import, and what it decides
follows the installed release."""

import ast
import configparser
from pathlib import Path

import deepspeed
import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from deepspeed_offload import compat
from deepspeed_offload.runtime.memory import host_store

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "deepspeed_offload"


def test_setup_cfg_asks_for_the_supported_range():
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    requirements = [Requirement(line) for line in cfg["options"]["install_requires"].split("\n") if line.strip()]
    ours = [r for r in requirements if r.name == "deepspeed"]
    assert len(ours) == 1 and ours[0].specifier == SpecifierSet(compat.SUPPORTED), ours
    assert f">={compat.OLDEST}" in compat.SUPPORTED.split(",")  # the floor the import refuses below


def _imports_deepspeed(nodes) -> bool:
    for node in ast.walk(ast.Module(body=list(nodes), type_ignores=[])):
        if isinstance(node, ast.Import) and any(a.name.split(".")[0] == "deepspeed" for a in node.names):
            return True
        if isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").split(".")[0] == "deepspeed":
            return True
    return False


def _catches_import_error(handler) -> bool:
    if handler.type is None:
        return True
    names = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
    return any(isinstance(n, ast.Name) and n.id in ("ImportError", "ModuleNotFoundError", "Exception") for n in names)


def test_no_other_module_tells_deepspeed_releases_apart():
    """No ``try: import deepspeed... except ImportError`` and no use of DeepSpeed's version outside
    compat.py (envinfo.py only prints it)."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "compat.py" and path.parent == PACKAGE:
            continue
        source = path.read_text()
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.Try) and _imports_deepspeed(node.body) and \
                    any(_catches_import_error(h) for h in node.handlers):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: a guarded DeepSpeed import")
        if "deepspeed.__version__" in source and path.name != "envinfo.py":
            found.append(f"{path.relative_to(ROOT)}: reads deepspeed.__version__")
    assert not found, found


def test_the_releases_compat_names_are_in_order():
    assert compat.DEEPCOMPILE < compat.OLDEST < compat.PRECISION_CONFIG < compat.IPG_BUCKETS \
        < compat.QUIET_LOGGER < compat.TENSOR_BACKWARD < compat.PASS_CONTRACTS < compat.PIN_EMPTY
    assert compat.DEEPSPEED_VERSION == Version(deepspeed.__version__)


def test_at_least_reads_a_local_build_as_its_release(monkeypatch):
    monkeypatch.setattr(compat, "DEEPSPEED_VERSION", Version("0.19.7+abc123"))
    assert compat.at_least(Version("0.19.7")) and not compat.at_least(Version("0.19.8"))


def test_an_older_deepspeed_is_refused_by_name(monkeypatch):
    monkeypatch.setattr(compat, "DEEPSPEED_VERSION", Version("0.16.8"))
    monkeypatch.setattr(deepspeed, "__version__", "0.16.8")
    with pytest.raises(ImportError, match=r"needs DeepSpeed >=0.16.9,<0.20, this is DeepSpeed 0.16.8 .*pip install"):
        compat.check_deepspeed_version()


def test_a_newer_deepspeed_is_used_with_a_warning(monkeypatch):
    warnings = []
    monkeypatch.setattr(compat, "DEEPSPEED_VERSION", Version("0.20.1"))
    monkeypatch.setattr(deepspeed, "__version__", "0.20.1")
    monkeypatch.setattr(compat.logger, "warning", warnings.append)
    compat.check_deepspeed_version()
    assert len(warnings) == 1 and "0.20.1 is newer" in warnings[0] and "deepspeed-versions.sh" in warnings[0]


def test_pin_empty_is_the_accelerators_pinned_allocation():
    """What the host store falls back to where it does not lock memory itself (neither CPU nor
    CUDA): a pinned host tensor of the size asked for, from this DeepSpeed's accelerator."""
    calls = []

    class Accelerator:

        def pin_empty(self, n, dtype):
            calls.append(("pin_empty", n, dtype))
            return "pinned"

        def pin_memory(self, tensor):
            calls.append(("pin_memory", tensor.numel(), tensor.dtype))
            return "pinned"

    import torch
    assert host_store.pin_empty(Accelerator(), 12, torch.float32) == "pinned"
    kind = "pin_empty" if compat.at_least(compat.PIN_EMPTY) else "pin_memory"
    assert calls == [(kind, 12, torch.float32)]


@pytest.mark.parametrize("deepspeed_version,torch_version,needed", [
    ("0.16.9", "2.7.1", None), ("0.16.9", "2.8.0", "0.18.4"), ("0.18.4", "2.8.0", None), ("0.18.9", "2.9.1", "0.19.0"),
    ("0.19.0", "2.10.0+cu128", None), ("0.19.0", "2.11.0+cu130", "0.19.1"), ("0.19.1", "2.13.0+cpu", None),
    ("0.19.8", "2.14.0a0+git1234", None), ("0.17.6", "2.5.1", None)])
def test_compile_mode_needs_the_deepcompile_that_runs_on_this_torch(monkeypatch, deepspeed_version, torch_version,
                                                                    needed):
    """DeepSpeed's own fixes of DeepCompile's ZeRO-3 for newer torch releases; torch before 2.6 is
    config.py's refusal (DeepCompile needs 2.6), not this one."""
    monkeypatch.setattr(compat, "DEEPSPEED_VERSION", Version(deepspeed_version))
    monkeypatch.setattr(deepspeed, "__version__", deepspeed_version)
    why = compat.compile_mode_refusal(torch_version)
    if needed is None:
        assert why is None
    else:
        assert f"DeepSpeed {deepspeed_version}" in why and f"torch {torch_version}" in why
        assert f"pip install 'deepspeed>={needed},<0.20'" in why


def test_show_info_logs_leaves_deepspeeds_logger_at_info():
    import logging
    from deepspeed.utils import logger
    level = logger.level
    try:
        if compat.at_least(compat.QUIET_LOGGER):
            logger.setLevel(logging.WARNING)  # its default there; before, it is at info as imported
        compat.show_info_logs()
        assert logger.getEffectiveLevel() == logging.INFO
    finally:
        logger.setLevel(level)
