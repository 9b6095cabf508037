"""Staging: the copy executor (``copies.py``: streams and events on a GPU, synchronous on the CPU
accelerator) and the two staging slots the step streams through (``slots.py``: each sub-group's place
in them, and whom a load into a place waits for)."""
