"""``python -m deepspeed_offload.bench``: the driver, or one worker with ``--worker MODE``."""

import sys

from .driver import main

if __name__ == "__main__":
    sys.exit(main())
