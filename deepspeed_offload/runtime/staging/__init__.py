"""Staging: the copy executor (``copies.py``: streams and events on a GPU, synchronous on the CPU
accelerator) and the device buffers the copies land in."""
