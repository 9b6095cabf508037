"""The names a save puts on disk besides DeepSpeed's own files.

Everything a save creates, swaps or removes is named by its own tag (and save id), so two engines
saving different tags into one folder never touch each other's files.
"""

import os
import re

MARKER = ".deepspeed_offload_rank{}.json"  # a rank's completion marker: save id, sizes, digests
FAILED = ".deepspeed_offload_rank{}.failed"  # a rank's write failed: the cause
ALIVE = ".deepspeed_offload_rank{}.alive"  # a rank's heartbeat while it writes
JOURNAL = ".deepspeed_offload_commit.{}.json"  # one per tag: the swap in progress
JOURNAL_RE = re.compile(r"^\.deepspeed_offload_commit(\..+)?\.json$")
MARKER_RE = re.compile(r"^\.deepspeed_offload_rank(\d+)\.json$")
CKPT_FILE_RE = re.compile(r"_(model|optim)_states\.pt$")  # DeepSpeed's checkpoint files


def flat(tag) -> str:
    """``tag`` as one path component (a tag may contain the separator: Lightning's ``x.ckpt/checkpoint``)."""
    return str(tag).replace(os.sep, "_")


def staging_dir(save_dir, tag, save_id) -> str:
    """Where a save writes its files until the commit renames the directory to ``<tag>``."""
    return os.path.join(save_dir, f".{flat(tag)}.incoming-{save_id}")


def replaced_dir(save_dir, tag, save_id) -> str:
    """Where the commit puts the previous ``<tag>`` between its two renames."""
    return os.path.join(save_dir, f".{flat(tag)}.replaced-{save_id}")


def journal_path(save_dir, tag) -> str:
    return os.path.join(save_dir, JOURNAL.format(flat(tag)))


def leftovers_re(tag) -> "re.Pattern":
    """The staging and replaced directories of any save of ``tag``."""
    return re.compile(r"^\.%s\.(?:incoming|replaced)-[0-9a-f]{16}$" % re.escape(flat(tag)))
