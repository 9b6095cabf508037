"""Stream mode: the runtime half of deepspeed-offload.

Owns the host store (one pinned flat buffer per dtype holding every offloaded fp32 master and
optimizer-state tensor), the streamed ZeRO-3 step (two GPU staging slots, H2D and D2H on their own
streams around the update), the backward prefetch and the asynchronous checkpoint. Compile mode
reuses the host store and the streamed step for whatever is still on the host when backward ends.
"""
