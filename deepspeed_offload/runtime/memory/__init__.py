"""Where the optimizer state lives and what it takes: ``layout.py`` (what moves, sub-groups and their
sizes), ``pinned.py`` and ``host_store.py`` (the pinned host store), ``state_tensors.py``
(DeepSpeed's tensors pointed at it, never swapped), ``residency.py`` (each sub-group's phase),
``device_holds.py`` (what buffers of their own hold until their copies end),
``placement.py`` and ``iteration_memory.py`` (which sub-groups stay resident on the device, and what
an iteration needs beside them; ``runtime/step/moves.py`` changes that split while training runs),
``arrival.py`` (what a change made resident, on its way to the device and unpinned after)."""
