"""DeepSpeed ZeRO-3 partitioned parameters: what the package knows about them, in one place.

ZeRO-3 keeps every parameter partitioned across the ranks (``numel`` 0 on the module; DeepSpeed's
``ds_id``, ``ds_status`` and ``ds_shape`` attributes on it) and re-materialises it only inside its
owning module's forward hooks. A fused head reads ``lm_head.weight`` directly, without calling the
module, so it gathers the weight (and bias) itself: around the kernel's forward, and again in any
backward that reads it (the recompute backward, the per-token heads' backward). ``gathered`` does both;
the public functions, which cannot know whether their caller runs inside the model's forward (where
ZeRO-3's gradient reduction needs it), refuse a partitioned weight instead (``check_gathered``).
Nothing here imports DeepSpeed unless a ZeRO-3 parameter is met.
"""

import contextlib

import torch


def is_zero3(t) -> bool:
    """A DeepSpeed ZeRO-3 parameter (gathered or not)."""
    return isinstance(t, torch.Tensor) and hasattr(t, "ds_id") and hasattr(t, "ds_status")


def _available(p) -> bool:
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    return p.ds_status == ZeroParamStatus.AVAILABLE


def is_partitioned(t) -> bool:
    """A ZeRO-3 parameter whose full value is not on this rank now (the module holds a ``(0,)`` stand-in)."""
    return is_zero3(t) and not _available(t)


def check_gathered(name: str, t) -> None:
    """ValueError when ``t`` is a partitioned ZeRO-3 parameter: the kernels would see a ``(0,)`` tensor."""
    if is_partitioned(t):
        raise ValueError(
            f"{name} is a DeepSpeed ZeRO-3 partition (shape {tuple(t.shape)}, full shape {tuple(t.ds_shape)}): "
            "gather it for the call and for its backward, e.g. `with deepspeed.zero.GatheredParameters([weight, "
            "bias]):` around both, inside the model's forward; or use patch_model / use_in_trl, which gather it")


@contextlib.contextmanager
def _gather(params, trl: bool):
    """Gathers the partitioned ones among ``params``: through TRL's ``maybe_gather_lm_head_ctx`` when
    ``trl`` (TRL's contract for the heads it calls), then DeepSpeed's ``GatheredParameters`` for any
    still partitioned (an engine set up without transformers' ZeRO-3 config, where TRL's is a no-op)."""
    with contextlib.ExitStack() as stack:
        if trl:
            from trl.trainer.utils import maybe_gather_lm_head_ctx

            stack.enter_context(maybe_gather_lm_head_ctx(*params))
        rest = list({id(p): p for p in params if is_partitioned(p)}.values())
        if rest:
            import deepspeed

            stack.enter_context(deepspeed.zero.GatheredParameters(rest))
        yield


class _Saved:
    """A ZeRO-3 parameter saved for the backward: a reference, not its gathered value."""

    __slots__ = ("param",)

    def __init__(self, param):
        self.param = param


@contextlib.contextmanager
def gathered(*params, trl: bool = False):
    """For the code run inside: every ZeRO-3 parameter among ``params`` (None skipped) gathered, and
    any ZeRO-3 parameter the kernels save for their backward saved as a reference that the backward
    gathers again when it reads it (a transient copy of the full parameter while that backward node
    runs). The gradients reach the parameters through autograd as usual, where ZeRO-3's hooks
    reduce them. Nothing is done (no hooks) when none of ``params`` is a ZeRO-3 parameter."""
    zero3 = [p for p in params if is_zero3(p)]
    if not zero3:
        yield
        return

    def pack(t):
        return _Saved(t) if is_zero3(t) else t

    def unpack(saved):
        if not isinstance(saved, _Saved):
            return saved
        p = saved.param
        if _available(p):
            return p
        with _gather([p], trl):
            return p.data.clone()  # the gathered buffer is freed on the way out

    with _gather(zero3, trl), torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        yield


__all__ = ["check_gathered", "gathered", "is_partitioned", "is_zero3"]
