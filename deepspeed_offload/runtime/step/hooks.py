"""Where DeepSpeed calls into stream mode: every hook on the engine and its ZeRO-3 optimizer.

``install(mode)`` puts them in place through the mode's ``PatchRegistry`` (``detach`` removes them
all); each wrapper calls DeepSpeed's own method and, around it, one verb of the mode
(``runtime/step/stream.py``), so that the step reads as the sequence of its phases there:

- ``_backward_prologue`` (``engine.backward`` and a plain ``loss.backward()`` alike): a backward begins;
- the gradient hook (``reduce_ready_partitions_and_remove_grads``, as backward produces and frees)
  and, with speculation, ``partition_grads`` and the backward's epilogue: gradients became final;
- ``_prepare_sub_group`` / ``_release_sub_group`` (DeepSpeed's loop over the sub-groups in its step):
  a sub-group's state comes in, and goes back out;
- ``engine.forward``: the input's size, before the forward runs (the measured plan may give state
  back first, when the input is larger than any it measured: placement.py);
- ``step``: a step begins (before DeepSpeed's norm); ``_get_norm_groups``: that norm, queued without
  a wait per sub-group where it gives DeepSpeed's bits (``grad_norm.py``); ``_post_step``: DeepSpeed's
  loop over the sub-groups is done; ``step`` returns or raises: the step closes (``step.py``: applied,
  skipped or raised, as DeepSpeed decided), and everything between steps runs from there;
- readers and writers of host state (``state_dict``, the ``_restore_*`` and ``set_*_hp_param``
  helpers, ``load_state_dict``) wait for the write-backs (and void speculated updates written over
  the host store); writers of gradients void speculation;
- ``offload_states`` / ``reload_states`` (colocation.py), and the engine calls refused meanwhile.
"""

import torch

# Methods of the ZeRO-3 optimizer that read host state on the CPU: they wait for the write-backs.
READERS = ("state_dict", "_get_fp32_opt_state_partition")
# ... and that write it: they also wait for a checkpoint write and drop what was loaded early.
WRITERS = ("_restore_from_bit16_weights", "_restore_from_fp32_weights", "set_full_hp_param", "set_local_hp_param")
# ... of them, those that write the fp32 masters alone (the 16-bit partitions catch up at the next applied step)
MASTER_WRITERS = ("set_full_hp_param", "set_local_hp_param")
# ... and that write the gradient partitions between backward and the step (safe_set_full_grad and
# its kin): an update speculated from the gradients before them is void.
GRAD_WRITERS = ("set_fp32_grad_for_param", "set_local_grad_for_param", "update_fp32_grad_for_param_vectorized")
# The optimizer method the gradient hooks call as backward produces each gradient (and frees memory).
GRADIENT_HOOK = "reduce_ready_partitions_and_remove_grads"


def install(mode):
    opt, engine, patch = mode.opt, mode.engine, mode.patches.patch
    patch(opt, "_prepare_sub_group", lambda orig: _prepare(mode, orig))
    patch(opt, "_release_sub_group", lambda orig: _release(mode, orig))
    for name in READERS:
        patch(opt, name, lambda orig: _around(mode, orig))
    for name in WRITERS:
        patch(opt, name, lambda orig, name=name: _around(mode, orig, writes=True, masters=name in MASTER_WRITERS))
    patch(opt, "load_state_dict",
          lambda orig: _around(mode, orig, writes=True, after=lambda: mode.tensors.after_load(mode.acc)))
    patch(opt, "step", lambda orig: _step(mode, orig))
    patch(opt, "_get_norm_groups", mode.norms.wrap)
    patch(opt, "_post_step", lambda orig: _post_step(mode, orig))
    patch(engine, "_backward_prologue", lambda orig: _backward_prologue(mode, orig))
    patch(engine, "forward", lambda orig: _forward(mode, orig))
    if mode.overlap:
        patch(opt, GRADIENT_HOOK, lambda orig: _gradient_ready(mode, orig))
    if mode.speculation is not None:
        spec = mode.speculation
        patch(opt, "partition_grads", lambda orig: _partition_grads(mode, orig))
        patch(opt, "independent_gradient_partition_epilogue", lambda orig: _epilogue(mode, orig))
        for name in ("unscale_and_clip_grads", "_optimizer_step"):
            patch(opt, name, lambda orig: spec.skip_committed(orig))
        patch(opt, "_reassign_or_swap_out_partitioned_parameters", lambda orig: spec.wrap_reassign(orig))
        for name in GRAD_WRITERS:
            if hasattr(opt, name):
                patch(opt, name, lambda orig: _discarding(mode, orig, "gradient written"))
    # engine.offload_states()/reload_states() check their arguments and call these two.
    patch(opt, "offload_states", lambda orig: mode.colocation.offload_states)
    patch(opt, "reload_states", lambda orig: lambda *a, **kw: mode.colocation.reload_states(orig, *a, **kw))
    # ... and while they are in effect, these refuse on entry, before the engine changes anything.
    for name in ("step", "backward", "load_checkpoint"):
        patch(engine, name, lambda orig, name=name: _refuse_if_offloaded(mode, orig, name))


def _prepare(mode, orig):

    def prepare(i, timer_names):
        if not mode.streams(i):
            mode.guard_resident(i)  # updated in place next: a checkpoint copying it finishes first
        elif not mode.bring_in(i):
            return None  # updated in backward and committed: DeepSpeed's calls for it are skipped
        return orig(i, timer_names)

    return prepare


def _release(mode, orig):

    def release(i, timer_names):
        orig(i, timer_names)
        if mode.streams(i):
            mode.send_out(i)

    return release


def _backward_prologue(mode, orig):

    def backward_prologue(*args, **kwargs):
        mode.colocation.refuse_if_offloaded("backward()")
        mode.lifecycle.backward_begins()
        return orig(*args, **kwargs)

    return backward_prologue


def _gradient_ready(mode, orig):

    def gradient_ready(param):
        result = orig(param)
        mode.gradients_final(mode.timing.gradient_ready(param))
        return result

    return gradient_ready


def _partition_grads(mode, orig):

    def partition_grads(params_to_release, grad_partitions):
        params = list(params_to_release)  # DeepSpeed clears its list after this call
        result = orig(params_to_release, grad_partitions)
        mode.speculation.partitioned(params)
        return result

    return partition_grads


def _epilogue(mode, orig):

    def epilogue(*args, **kwargs):
        result = orig(*args, **kwargs)  # the last buckets' gradients are final now
        mode.gradients_final(mode.timing.allowance())
        return result

    return epilogue


def _forward(mode, orig):

    def forward(*args, **kwargs):
        if torch.is_grad_enabled():  # a training forward: its input sizes the iteration
            mode.forward_begins(input_numel(args, kwargs))
        return orig(*args, **kwargs)

    return forward


def input_numel(args, kwargs) -> int:
    """The size of a forward's input: the elements of its largest tensor (``input_ids`` or ``labels``
    of a language model, the batch of anything else), one level into lists, tuples and dicts."""
    best = 0
    for value in list(args) + list(kwargs.values()):
        items = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else (value, )
        for item in items:
            if torch.is_tensor(item):
                best = max(best, item.numel())
    return best


def _step(mode, orig):

    def step(*args, **kwargs):
        lifecycle = mode.lifecycle
        try:
            lifecycle.step_entered()
            result = orig(*args, **kwargs)
        except BaseException:
            lifecycle.close(raised=True)
            raise
        lifecycle.close()  # applied or skipped: whether DeepSpeed's loop ran (``_post_step``)
        return result

    return step


def _post_step(mode, orig):

    def post_step(*args, **kwargs):
        mode.lifecycle.updates_done()
        return orig(*args, **kwargs)

    return post_step


def _around(mode, fn, writes=False, masters=False, after=None):
    """``fn`` reads (or ``writes``; the fp32 ``masters`` alone) host state on the CPU: every write-back lands first."""

    def wrapper(*args, **kwargs):
        if not mode.in_step:
            if mode.speculation is not None and mode.speculation.overwrote_host():
                # the host holds updates the norm may not allow
                mode.discard_speculation("state written" if writes else "state read")
            mode.colocation.wait_for_copies()
            mode.synchronize_for_checkpoint()
            if writes:
                mode.colocation.refuse_if_offloaded(fn.__name__ + "()")
                mode.discard_speculation("state written")  # computed from the state this replaces
                if masters and mode.speculation is not None:
                    mode.speculation.master_written()
                mode.guard()
                mode.table.unload_all()  # loaded early: the old values
        result = fn(*args, **kwargs)
        if after is not None:
            after()
        return result

    return wrapper


def _discarding(mode, orig, why):
    """``orig`` changes what the updates speculated in backward were computed from."""

    def call(*args, **kwargs):
        mode.discard_speculation(why)
        return orig(*args, **kwargs)

    return call


def _refuse_if_offloaded(mode, orig, name):

    def call(*args, **kwargs):
        mode.colocation.refuse_if_offloaded(f"engine.{name}()")
        return orig(*args, **kwargs)

    return call
