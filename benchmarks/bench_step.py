"""The side-by-side benchmark, runnable from a checkout: the same as ``deepspeed-offload bench``."""

import sys

from deepspeed_offload.bench import main

if __name__ == "__main__":
    sys.exit(main())
