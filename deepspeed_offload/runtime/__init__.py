"""The runtime both modes share, in parts that name themselves (lowest first; a part imports only the
parts below it, ``tests/unit/test_imports.py`` checks it):

- ``agreement``, ``patches``: how ranks agree that something failed; every patch on DeepSpeed's
  objects installed and removed in one place;
- ``staging/``: the copy executor and the two staging slots the step streams through;
- ``memory/``: where the optimizer state lives (the pinned host store, each sub-group's phase) and
  which sub-groups stay resident (the node's plan at attach, the measured plan after);
- ``speculation/``, ``colocation/``, ``checkpoint/``: updates in backward, ``offload_states()`` for
  RL trainers, asynchronous checkpoints from the host store;
- ``attach``: attach as one transaction on every rank;
- ``step/``: the optimizer step, ``step/stream.py`` read top to bottom (compile mode drives the same
  ``StreamMode`` from its graphs: ``compile_passes/mode.py``).

The words they use: docs/architecture.md#words.
"""
