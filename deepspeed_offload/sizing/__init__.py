"""Sizing a job before it runs: what ``deepspeed-offload estimate`` and ``check`` answer, and what
``initialize`` judges about the host before DeepSpeed builds the engine.

- ``estimate.py``: the cost model (the state per rank, what offload frees, the host memory a node
  pins, the step's copy time): arithmetic;
- ``activations.py``: the model of what one training iteration holds on the GPU, from the model's
  shape (calibrated against measured runs: it models someone else's code);
- ``model_config.py``: a Hugging Face model's shape from its name or its files (transformers'
  ``AutoConfig``, its parameters counted on the meta device);
- ``fit.py``: the fit answer: fits, split or does not fit, the largest micro-batch, a rough
  s/iteration; ``verdict.py``: one verdict for every way ``estimate`` is asked, what does not fit and
  what would make it fit;
- ``host_memory.py``: the host's figures (memory, the cgroup's limit, the memlock limit, NUMA nodes)
  and the node's host plan; ``bandwidth.py``: the pinned copy-bandwidth probe.
"""
