"""The optimizer step in stream mode: ``stream.py`` reads one step top to bottom (``StreamMode``),
``lifecycle.py`` owns each step from its first gradient to DeepSpeed's outcome, ``hooks.py`` says
where DeepSpeed calls each verb, ``load_timing.py`` when sub-groups may load ahead of the step,
``early_loads.py`` the loads in backward, ``stats.py`` what a step did."""
