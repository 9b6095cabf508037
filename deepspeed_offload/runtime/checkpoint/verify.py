"""What is wrong with a checkpoint this package wrote, checked before DeepSpeed's loader reads it.

Every rank checks the markers, the sizes and stray files; the digests are split among the ranks.
A directory without our markers (a plain DeepSpeed save) is not ours to judge. Verification proves
a file is the one written, not that its writer is trusted (docs/troubleshooting.md).
"""

import os
from typing import Optional

from .errors import describe_os_error
from .files import WHOLE, file_digest, read_json
from .names import CKPT_FILE_RE, MARKER_RE


def verify_checkpoint(tag_dir, rank: int = 0, world: int = 1) -> Optional[str]:
    """What is wrong with the checkpoint in ``tag_dir``, or None. Markers, sizes and stray files are
    checked by every rank; digests are split: this rank re-hashes the files of saved ranks ``r`` with
    ``r % world == rank``. A directory without our markers is not ours to judge: None."""
    try:
        names = os.listdir(tag_dir)
    except OSError:
        return None  # DeepSpeed's loader says what is missing
    markers = {}
    for name in sorted(names):
        m = MARKER_RE.match(name)
        if not m:
            continue
        entry = read_json(os.path.join(tag_dir, name))
        if (entry is None or entry.get("rank") != int(m.group(1)) or not isinstance(entry.get("files"), dict)
                or "save_id" not in entry or not isinstance(entry.get("world"), int)):
            return f"{os.path.join(tag_dir, name)}: the completion marker of rank {m.group(1)} is unreadable (damaged)"
        markers[entry["rank"]] = entry
    if not markers:
        return None
    saves = sorted({(e["save_id"], e.get("tag")) for e in markers.values()})
    if len(saves) > 1:
        by_rank = ", ".join(f"rank {r}: save {e['save_id']} of tag {e.get('tag')!r}" for r, e in sorted(markers.items()))
        return f"{tag_dir} mixes files of different saves ({by_rank})"
    worlds = {e["world"] for e in markers.values()}
    saved_world = max(worlds)
    missing = [r for r in range(saved_world) if r not in markers]
    if missing or len(worlds) > 1:
        return (f"{tag_dir} is incomplete: rank(s) {missing} of {saved_world} have no completion marker "
                "(their files are missing or were never finished)")
    listed = set()
    for r, entry in sorted(markers.items()):
        for name, info in sorted(entry["files"].items()):
            listed.add(name)
            path = os.path.join(tag_dir, name)
            try:
                size = os.path.getsize(path)
            except OSError:
                return f"{path} (written by rank {r}) is missing"
            if size != info.get("bytes"):
                return (f"{path} (written by rank {r}) is {size} bytes, its marker says {info.get('bytes')}: "
                        "truncated or replaced")
    stray = sorted(n for n in names if CKPT_FILE_RE.search(n) and n not in listed)
    if stray:
        return f"{tag_dir} holds checkpoint files that are not part of its save {saves[0][0]}: {stray}"
    for r, entry in sorted(markers.items()):
        if r % world != rank:
            continue
        algorithm = entry.get("digest", WHOLE)  # the markers of earlier versions: sha256 of the whole file
        for name, info in sorted(entry["files"].items()):
            path = os.path.join(tag_dir, name)
            try:
                digest = file_digest(path, algorithm)
            except OSError as e:
                return f"reading {path} (written by rank {r}) failed: {describe_os_error(e, path)}"
            except ValueError as e:
                return f"{path} (written by rank {r}) cannot be verified: {e}"
            if digest != info.get(algorithm):
                return f"{path} (written by rank {r}) does not match its {algorithm} digest: the file is damaged"
    return None
