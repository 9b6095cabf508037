"""The installed DeepSpeed's version, and what differs between the releases we support.

deepspeed-offload runs on DeepSpeed ``SUPPORTED`` (setup.cfg's range). Those releases differ in a
few things we import or call: a module that appeared, a method that gained an argument, an
accelerator call added. Each difference is decided here, once, by comparing DeepSpeed's version
(``packaging``) with the release that brought it; every other module imports the answer from here
and never compares versions or guards an import itself. A DeepSpeed older than the range is refused
when deepspeed_offload is imported (pip refuses it at install; this catches one forced in beside
it, before anything else of the package imports DeepSpeed), one newer than the range is used with a
warning.
"""

import deepspeed
import torch
from deepspeed.utils import logger
from packaging.specifiers import SpecifierSet
from packaging.version import Version

# What setup.cfg's install_requires says, and what tests/e2e/test_deepspeed_versions.py runs on.
SUPPORTED = ">=0.16.9,<0.20"
OLDEST = Version("0.16.9")

DEEPSPEED_VERSION = Version(deepspeed.__version__)

# The first release with each difference (DeepSpeed's pull request in brackets).
DEEPCOMPILE = Version("0.16.6")  # deepspeed.compile, engine.compile() (#7154)
PRECISION_CONFIG = Version("0.17.1")  # bf16/fp16 as pydantic models, deepspeed.runtime.precision_config (#6976)
IPG_BUCKETS = Version("0.17.2")  # ZeRO-3's reduce buckets, one per dtype: optimizer.ipg_buckets (#6993)
QUIET_LOGGER = Version("0.17.6")  # DeepSpeed's logger at warning level by default, set_log_level_from_string (#7526)
TENSOR_BACKWARD = Version("0.18.3")  # a plain loss.backward() runs the engine's backward prologue (#7665)
PASS_CONTRACTS = Version("0.19.3")  # DeepCompile's PassContract, register_compile_pass(..., contract) (#8139)
NORM_DTYPE = Version("0.19.6")  # gradient norms in fp64 only where the accelerator has it: get_norm_dtype (#8293)
PIN_EMPTY = Version("0.19.7")  # accelerator.pin_empty (#8211)
REMOVED_FEATURE_KEYS = Version("0.19.7")  # DeepSpeedConfig refuses keys of removed features (issue #8489)


def at_least(release: Version) -> bool:
    """The installed DeepSpeed is ``release`` or newer (a local build of a later commit counts as
    its release: 0.19.7+abc123 is 0.19.7)."""
    return Version(DEEPSPEED_VERSION.base_version) >= release


def check_deepspeed_version():
    """Refuse a DeepSpeed older than the range (ImportError naming both versions); warn once about
    one newer than it."""
    if not at_least(OLDEST):
        raise ImportError(f"deepspeed-offload needs DeepSpeed {SUPPORTED}, this is DeepSpeed {deepspeed.__version__} "
                          f"({deepspeed.__file__}): pip install 'deepspeed{SUPPORTED}' "
                          "(docs/troubleshooting.md, an unsupported DeepSpeed)")
    if Version(DEEPSPEED_VERSION.base_version) not in SpecifierSet(SUPPORTED):
        logger.warning(f"[deepspeed-offload] DeepSpeed {deepspeed.__version__} is newer than the releases "
                       f"deepspeed-offload is tested with ({SUPPORTED}): "
                       "bash scripts/deepspeed-versions.sh runs the parity tests against it")


check_deepspeed_version()


def deepspeed_release() -> str:
    """``DeepSpeed 0.16.9``: how messages name the installed release."""
    return f"DeepSpeed {deepspeed.__version__}"


def show_info_logs():
    """DeepSpeed's logger, through which every message of ours goes, at info level: from 0.17.6 it
    starts at warning (set_log_level_from_string raises it); before, it starts at info."""
    if at_least(QUIET_LOGGER):
        from deepspeed.utils.logging import set_log_level_from_string
        set_log_level_from_string("info")


# ---------------------------------------------------------------------------------------------
# ds_config models


def precision_config_builders():
    """DeepSpeed's builders of the ``bf16`` and ``fp16`` models, ``(get_bfloat16_config,
    get_float16_config)``; None before 0.17.1, where DeepSpeedConfig reads those sections key by
    key (then only run_deepspeed_config checks them)."""
    if not at_least(PRECISION_CONFIG):
        return None
    from deepspeed.runtime.precision_config import get_bfloat16_config, get_float16_config
    return get_bfloat16_config, get_float16_config


def removed_config_keys():
    """The top-level and ``zero_optimization`` keys DeepSpeedConfig refuses as features it removed,
    ``(top_level, zero)``: {key: why}; empty before 0.19.7, which accepted them."""
    if not at_least(REMOVED_FEATURE_KEYS):
        return {}, {}
    from deepspeed.runtime import config as ds_config_module
    return ds_config_module._REMOVED_TOP_LEVEL_CONFIG_KEYS, ds_config_module._REMOVED_ZERO_CONFIG_KEYS


# ---------------------------------------------------------------------------------------------
# Host memory


def norm_dtype():
    """The dtype ZeRO-3's gradient norm accumulates in (fp64 before 0.19.6; since, fp64 where the accelerator
    has it, else fp32)."""
    if not at_least(NORM_DTYPE):
        return torch.double
    from deepspeed.runtime.zero.utils import get_norm_dtype
    return get_norm_dtype()


def pin_empty(acc, numel: int, dtype):
    """A pinned host tensor of ``numel`` elements, allocated the accelerator's way: its ``pin_empty``
    (0.19.7 on), else its ``pin_memory`` of a new tensor."""
    if at_least(PIN_EMPTY):
        return acc.pin_empty(numel, dtype=dtype)
    return acc.pin_memory(torch.empty(numel, dtype=dtype))


# ---------------------------------------------------------------------------------------------
# DeepCompile


# The oldest DeepSpeed whose DeepCompile runs ZeRO-3 on a torch release, newest torch first
# (DeepSpeed's fixes in brackets); DeepCompile itself needs torch 2.6 (config.py checks that).
DEEPCOMPILE_FOR_TORCH = (
    (Version("2.11"), Version("0.19.1")),  # the AOT autograd backend built without a bw_compiler (#8024)
    (Version("2.9"), Version("0.19.0")),  # Dynamo's guards on ZeRO-3's released parameters (#7951)
    (Version("2.8"), Version("0.18.4")),  # the partition function's new argument (#7755)
    (Version("2.6"), DEEPCOMPILE),
)


def compile_mode_refusal(torch_version: str):
    """Why compile mode (DeepCompile's ZeRO-3) cannot run on this DeepSpeed with torch
    ``torch_version``, or None."""
    torch_release = Version(Version(torch_version).base_version)
    needed = next((ds for torch_from, ds in DEEPCOMPILE_FOR_TORCH if torch_release >= torch_from), None)
    if needed is None or at_least(needed):
        return None
    return (f"the DeepCompile of {deepspeed_release()} does not run ZeRO-3 on torch {torch_version} (DeepSpeed "
            f"{needed} is the first that does): pip install 'deepspeed>={needed},<0.20'")


def register_compile_pass(engine, name: str, fn, contract):
    """``engine.register_compile_pass(name, fn)``, with the pass's contract (``contract()``, a
    DeepCompile ``PassContract``) where DeepCompile checks a schedule against its passes' contracts
    (0.19.3 on); before that nothing checks one, and config.py refuses the conflicting
    ``compile.*`` options."""
    if at_least(PASS_CONTRACTS):
        engine.register_compile_pass(name, fn, contract())
    else:
        engine.register_compile_pass(name, fn)


# ---------------------------------------------------------------------------------------------
# ZeRO-3's optimizer

# Before 0.17.2: ZeRO-3's one flat reduce buffer (a name-mangled attribute), and the meta tensor its
# reload_states makes it again from.
_FLAT_REDUCE_BUFFER = "_DeepSpeedZeroOptimizer_Stage3__ipg_bucket_flat_buffer"


def drop_reduce_buffers(opt) -> bool:
    """Hand ZeRO-3's reduce-bucket buffers back, keeping a meta tensor of each, as DeepSpeed's own
    ``offload_states`` does for ``contiguous_grad_buffer`` (its ``reload_states`` makes them again,
    empty). True if any bucket held a buffer. From 0.17.2 one bucket per dtype (``ipg_buckets``),
    before one flat buffer."""
    if at_least(IPG_BUCKETS):
        dropped = False
        for bucket in opt.ipg_buckets.values():
            if bucket.buffer is not None:
                bucket.buffer_meta = bucket.buffer.to("meta")
                bucket.buffer = None
                dropped = True
        return dropped
    buffer = getattr(opt, _FLAT_REDUCE_BUFFER, None)
    if buffer is None:
        return False
    opt.grad_buffer_meta = buffer.to("meta")
    setattr(opt, _FLAT_REDUCE_BUFFER, None)
    return True
