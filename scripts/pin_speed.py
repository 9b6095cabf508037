"""How fast the host store's memory is allocated and page-locked on this machine (runtime/memory/pinned.py):
GiB/s per thread count, and one copy each way from the locked buffer to check it is really pinned.

    python scripts/pin_speed.py --gib 16 --threads 1,8,16 [--final-gib 75]
"""

import argparse
import os
import time

import torch
from deepspeed.accelerator import get_accelerator

from deepspeed_offload.runtime.memory import pinned


def pin(gib, threads, region_mb=256):
    os.environ["DS_OFFLOAD_PIN_THREADS"] = str(threads)
    n = int(gib * 2**30) // 4
    step = region_mb * 2**20
    bounds = [(lo, min(lo + step, n * 4)) for lo in range(0, n * 4, step)]
    acc = get_accelerator()
    buffers, stats = pinned.allocate({torch.float32: n}, {torch.float32: bounds}, pinned.make_pinner(acc, True),
                                     show_progress=True)
    buf = buffers[torch.float32]
    dev = torch.empty(step // 4, device="cuda")
    t = time.perf_counter()
    dev.copy_(buf[:step // 4], non_blocking=True)
    buf[:step // 4].copy_(dev, non_blocking=True)
    torch.cuda.synchronize()
    copy_gbps = 2 * step / (time.perf_counter() - t) / 1e9
    print(f"{gib:g} GiB, {threads} thread(s): {stats.describe()}; is_pinned={buf.is_pinned()}; "
          f"{region_mb} MiB each way at {copy_gbps:.1f} GB/s", flush=True)
    del buffers, buf
    return stats


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=16)
    parser.add_argument("--threads", default="1,8,16")
    parser.add_argument("--final-gib", type=float, default=None, help="then pin this much with the default threads")
    args = parser.parse_args()
    for threads in [int(t) for t in args.threads.split(",")]:
        pin(args.gib, threads)
    if args.final_gib:
        pin(args.final_gib, pinned.DEFAULT_PIN_THREADS)


if __name__ == "__main__":
    main()
