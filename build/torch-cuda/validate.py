"""Input checks, all raised before any kernel runs, and the options object the layers pass along."""

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch

from .device import check_dtype, interpreted
from .partitioned import check_gathered

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
REDUCTIONS = ("mean", "sum", "none")


class KernelScales(NamedTuple):
    """The logit kernels' float arguments for one head (``Options.kernel_scales``)."""

    tile_scale: float
    softcap: float
    softcap_out: float
    grad_scale: float


@dataclass(frozen=True)
class Options:
    """Everything besides the tensors, validated."""

    ignore_index: int = -100
    logit_scale: float = 1.0
    softcap: float | None = None
    reduction: str = "mean"
    return_metrics: bool = False
    label_smoothing: float = 0.0
    z_loss: float = 0.0
    return_lse: bool = False
    chunk_bytes: int | None = None
    strategy: str = "auto"
    temperature: float = 1.0  # the logits are divided by it after the softcap (per-token outputs)
    outputs: tuple = ()  # the per-token fields wanted (``tokens.FIELDS``); () for the loss

    def kernel_scales(self) -> KernelScales:
        """(tile scale, softcap, softcap out, gradient scale): the kernels' float arguments, with the
        temperature folded in (``logits.py``): ``z = softcap_out * tanh(a * tile_scale / softcap)``
        or ``a * tile_scale``, and ``da = dz * gradient_scale * softcap'``. At temperature 1 they are
        (logit_scale, softcap, softcap, logit_scale); 1.0 stands in for an absent softcap."""
        t = self.temperature
        if self.softcap is None:
            scale = self.logit_scale / t if t != 1.0 else self.logit_scale
            return KernelScales(float(scale), 1.0, 1.0, float(scale))
        cap = float(self.softcap)
        out = cap / t if t != 1.0 else cap
        chain = self.logit_scale / t if t != 1.0 else self.logit_scale
        return KernelScales(float(self.logit_scale), cap, float(out), float(chain))


STRATEGIES = ("auto", "recompute", "chunked")


def chunked_unsupported(opts: Options) -> str | None:
    """Why the chunked path (gradients in the forward) cannot take these options, or None."""
    if opts.reduction == "none":
        return 'reduction="none" (the per-row upstream gradient is only known in the backward)'
    if opts.return_lse:
        return "return_lse=True (the lse's upstream gradient is only known in the backward)"
    if opts.softcap is not None and opts.label_smoothing > 0:
        return "softcap together with label_smoothing (the smoothing term needs every z again)"
    return None


INT64 = torch.iinfo(torch.int64)


def is_real(x) -> bool:
    """A finite real number. Symbolic numbers (a float that ``torch.compile`` traces as an input
    because it changes between calls) are checked by comparisons, which it can trace; ``math.isfinite``
    it cannot."""
    number = isinstance(x, (int, float, torch.SymInt, torch.SymFloat)) and not isinstance(x, bool)
    return number and x == x and -math.inf < x < math.inf


def is_int(x) -> bool:
    return isinstance(x, (int, torch.SymInt)) and not isinstance(x, bool)


def check_chunk_bytes(value) -> None:
    """The memory knob: None (the default budget) or a positive int of bytes."""
    if value is not None and (not is_int(value) or value < 1):
        raise ValueError(f"chunk_bytes must be None or a positive int (bytes), got {value!r}")


def check_flag(name: str, value) -> None:
    """A bool option must be a bool: ``shift=2`` or ``return_metrics="no"`` is a mistake, not True."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {value!r}")


def check_process_group(group) -> None:
    """``process_group`` must be a torch.distributed ProcessGroup of an initialised default group."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("process_group was given but torch.distributed is not initialised "
                           "(call torch.distributed.init_process_group first)")
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"process_group must be a torch.distributed.ProcessGroup (e.g. dist.group.WORLD or "
                        f"dist.new_group(...)), got {type(group).__name__}")


def _dtensor_error(name: str, t, vocab_parallel: bool = True) -> None:
    """DTensors (FSDP2's sharded parameters, tensor parallelism) are refused with what to pass;
    ``vocab_parallel``: the function takes a vocabulary shard and its ``process_group`` (the loss, the
    per-token function), else the whole vocabulary only (the divergence)."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch built without distributed
        return
    if not isinstance(t, DTensor):
        return
    sharded = ("For a vocabulary sharded over a tensor-parallel mesh dimension (Shard(0)) with the same hidden on "
               "every rank, pass weight.to_local() and process_group=mesh.get_group(dim). " if vocab_parallel else
               "This function takes the whole vocabulary (no process_group); ")
    raise TypeError(
        f"{name} is a DTensor (placements {tuple(t.placements)}): the kernel takes plain tensors. "
        "Under FSDP2, call the loss inside the forward of the FSDP module that owns the weight, where "
        "its parameters are unsharded plain tensors (e.g. through layers.ForCausalLMLoss from the "
        f"model's forward). {sharded}Calling .full_tensor() yourself gives the full weight, "
        "but its gradient then skips FSDP's reduction across data-parallel ranks."
    )


def is_master_weight(hidden_dtype: torch.dtype, weight_dtype: torch.dtype) -> bool:
    """An fp32 weight with 16-bit hidden states: the op casts it to hidden's dtype for the products
    and returns its gradient in fp32 (``torch.autocast`` over an fp32 lm-head)."""
    return weight_dtype == torch.float32 and hidden_dtype in (torch.bfloat16, torch.float16)


def check_head(hidden, weight, bias, prefix: str = "", master_weight: bool = False,
               vocab_parallel: bool = True) -> None:
    """One LM head's ``hidden`` (..., H), ``weight`` (V, H) and ``bias`` (V,) or None, named
    ``prefix`` + "hidden" etc. in the messages: tensors (DTensors refused with what to pass), shapes,
    a supported dtype shared by all three. ``master_weight``: an fp32 weight is accepted with 16-bit
    hidden states (under ``torch.autocast``, where the op casts it itself and returns its gradient in
    fp32). ``vocab_parallel``: the DTensor message names the vocabulary-parallel way (``_dtensor_error``).
    The loss's, the per-token function's and each model's of the divergence."""
    names = (f"{prefix}hidden", f"{prefix}weight", f"{prefix}bias")
    for name, t in zip(names[:2], (hidden, weight)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if bias is not None and not isinstance(bias, torch.Tensor):
        raise TypeError(f"{names[2]} must be a torch.Tensor or None, got {type(bias).__name__}")
    for name, t in zip(names, (hidden, weight, bias)):
        _dtensor_error(name, t, vocab_parallel)
    check_gathered(names[1], weight)
    check_gathered(names[2], bias)
    if hidden.ndim < 2:
        raise ValueError(f"{names[0]} must be (N, H) or (..., H), got shape {tuple(hidden.shape)}")
    if weight.ndim != 2:
        raise ValueError(f"{names[1]} must be 2-D (V, H), got shape {tuple(weight.shape)}")
    h = hidden.shape[-1]
    v, hw = weight.shape
    if hw != h:
        raise ValueError(f"hidden size mismatch: {names[0]} is (..., H={h}) but {names[1]} is (V={v}, H={hw})")
    if v == 0:
        raise ValueError(f"{names[1]} has no rows: the vocabulary must not be empty")
    if hidden.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{names[0]} dtype {hidden.dtype} is not supported; use one of {SUPPORTED_DTYPES}")
    if weight.dtype != hidden.dtype and not (master_weight and is_master_weight(hidden.dtype, weight.dtype)):
        raise TypeError(f"dtype mismatch: {names[0]} is {hidden.dtype}, {names[1]} is {weight.dtype}")
    if bias is not None:
        if bias.shape != (v,):
            raise ValueError(f"{names[2]} must have shape (V,) = ({v},), got {tuple(bias.shape)}")
        if bias.dtype != hidden.dtype:
            raise TypeError(f"dtype mismatch: {names[0]} is {hidden.dtype}, {names[2]} is {bias.dtype}")


def check_device(tensors) -> None:
    """``tensors`` ((name, tensor or None) pairs) on one device the kernels run on: a CUDA GPU, or
    the CPU under the Triton interpreter; the first one's dtype (the inputs') one that runs well
    there (``device.check_dtype``: no bf16 below compute capability 8.0)."""
    tensors = [(name, t) for name, t in tensors if t is not None]
    if len({t.device for _, t in tensors}) > 1:
        where = ", ".join(f"{name} on {t.device}" for name, t in tensors)
        raise ValueError(f"all tensors must be on one device: {where}")
    device = tensors[0][1].device
    if device.type == "cpu" and not interpreted():
        raise RuntimeError(
            "CPU tensors need the Triton interpreter: set TRITON_INTERPRET=1 before importing the kernel"
        )
    if device.type not in ("cuda", "cpu"):
        raise RuntimeError(f"unsupported device {device}: this kernel runs on CUDA GPUs")
    check_dtype(tensors[0][1].dtype, device)


def check_targets(targets, hidden, name: str = "hidden") -> None:
    """Integer targets (int64, or int32) of ``hidden``'s leading shape (``name`` in the message)."""
    if not isinstance(targets, torch.Tensor):
        raise TypeError(f"targets must be a torch.Tensor, got {type(targets).__name__}")
    _dtensor_error("targets", targets)
    if targets.shape != hidden.shape[:-1]:
        raise ValueError(
            f"targets shape {tuple(targets.shape)} does not match {name}'s leading shape {tuple(hidden.shape[:-1])}"
        )
    if targets.dtype.is_floating_point or targets.dtype.is_complex or targets.dtype == torch.bool:
        raise TypeError(f"targets must be an integer tensor (int64), got {targets.dtype}")
    if targets.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"targets must be int64 (or int32), got {targets.dtype}")


def check_inputs(hidden, weight, targets, bias, opts: Options, class_weight=None, num_items_in_batch=None,
                 master_weight=False) -> None:
    """Raises TypeError / ValueError with a readable message for any input the kernels cannot take:
    the head (``check_head``), the targets, the class weights, one device, the options."""
    check_head(hidden, weight, bias, master_weight=master_weight)
    check_targets(targets, hidden)
    v = weight.shape[0]
    if class_weight is not None:
        if not isinstance(class_weight, torch.Tensor):
            raise TypeError(f"class_weight must be a torch.Tensor or None, got {type(class_weight).__name__}")
        _dtensor_error("class_weight", class_weight)
        if class_weight.shape != (v,):
            raise ValueError(f"class_weight must have shape (V,) = ({v},), got {tuple(class_weight.shape)}")
        if not class_weight.dtype.is_floating_point:
            raise TypeError(f"class_weight must be a floating-point tensor, got {class_weight.dtype}")
        if class_weight.requires_grad:
            raise ValueError("class_weight receives no gradient: pass class_weight.detach()")
    check_device((("hidden", hidden), ("weight", weight), ("targets", targets), ("bias", bias),
                  ("class_weight", class_weight)))
    check_options(opts, num_items_in_batch)


def check_num_items(num_items, reduction: str, summed: str = "loss") -> None:
    """``num_items_in_batch``: None, an int or a 0-d tensor, and not with reduction "none" (it divides
    a summed ``summed``)."""
    if num_items is None:
        return
    if reduction == "none":
        raise ValueError(f"num_items_in_batch divides a summed {summed}; it cannot be used with reduction='none'")
    if isinstance(num_items, torch.Tensor):
        if num_items.ndim != 0:
            raise ValueError(f"num_items_in_batch must be an int or a 0-d tensor, got shape {tuple(num_items.shape)}")
    elif not is_int(num_items):
        raise TypeError(f"num_items_in_batch must be an int or a 0-d tensor, got {num_items!r}")


def check_shared(reduction, ignore_index, strategy, chunk_bytes, num_items=None, summed: str = "loss") -> None:
    """The rules the loss, the per-token function and the divergence share: the reduction, an int64
    ``ignore_index``, the strategy, the memory knob and ``num_items_in_batch`` (which divides a
    summed ``summed``)."""
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    if not is_int(ignore_index):
        raise TypeError(f"ignore_index must be an int, got {ignore_index!r}")
    if not INT64.min <= ignore_index <= INT64.max:
        raise ValueError(f"ignore_index must fit in int64, got {ignore_index!r}")
    check_chunk_bytes(chunk_bytes)
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
    check_num_items(num_items, reduction, summed)


def check_options(opts: Options, num_items=None) -> None:
    """The loss's and the per-token function's options (``check_shared``, then their own)."""
    check_shared(opts.reduction, opts.ignore_index, opts.strategy, opts.chunk_bytes, num_items)
    check_flag("return_metrics", opts.return_metrics)
    check_flag("return_lse", opts.return_lse)
    if not is_real(opts.logit_scale):
        raise ValueError(f"logit_scale must be a finite real number, got {opts.logit_scale!r}")
    if not (is_real(opts.label_smoothing) and 0.0 <= opts.label_smoothing <= 1.0):
        raise ValueError(f"label_smoothing must be in [0, 1], got {opts.label_smoothing!r}")
    if not (is_real(opts.z_loss) and opts.z_loss >= 0.0):
        raise ValueError(f"z_loss must be a finite number >= 0, got {opts.z_loss!r}")
    if opts.softcap is not None and not (is_real(opts.softcap) and opts.softcap > 0):
        raise ValueError(f"softcap must be None or a finite number > 0, got {opts.softcap!r}")
    if not (is_real(opts.temperature) and opts.temperature > 0):
        raise ValueError(f"temperature must be a finite number > 0, got {opts.temperature!r}")
    # The per-token outputs (``outputs``) keep exponentials instead, with their own rules
    # (``plan.exponentials_unsupported``).
    if opts.strategy == "chunked" and not opts.outputs and (why := chunked_unsupported(opts)) is not None:
        raise ValueError(f'strategy="chunked" computes the gradients in the forward and cannot take {why}; '
                         'use strategy="recompute" or "auto"')


def check_divergence_options(beta, temperature, s_scale, s_cap, t_scale, t_cap, ignore_index, reduction, num_items,
                             chunk_bytes, strategy) -> None:
    """``fused_linear_divergence``'s options: its own numbers, then the shared rules (``check_shared``)."""
    if not (is_real(beta) and 0.0 <= beta <= 1.0):
        raise ValueError(f"beta must be a number in [0, 1], got {beta!r}")
    if not (is_real(temperature) and temperature > 0):
        raise ValueError(f"temperature must be a finite number > 0, got {temperature!r}")
    for name, scale in (("student_logit_scale", s_scale), ("teacher_logit_scale", t_scale)):
        if not is_real(scale):
            raise ValueError(f"{name} must be a finite real number, got {scale!r}")
    for name, cap in (("student_softcap", s_cap), ("teacher_softcap", t_cap)):
        if cap is not None and not (is_real(cap) and cap > 0):
            raise ValueError(f"{name} must be None or a finite number > 0, got {cap!r}")
    check_shared(reduction, ignore_index, strategy, chunk_bytes, num_items, "divergence")
    if strategy == "chunked" and reduction == "none":
        raise ValueError('strategy="chunked" forms the gradients in the forward and needs one upstream scalar: '
                         'not with reduction="none"; use strategy="recompute" or "auto"')
