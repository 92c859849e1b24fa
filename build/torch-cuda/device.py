"""What the device can do and how the kernels are built for it: the interpreter, TMA and SM probes,
the precision flags every launch passes, and the allocation of every buffer the launchers write.

Nothing here touches the GPU at import: the probes query CUDA on first use and cache the answer.
"""

import functools
import math
import os

import torch
from triton.tools.tensor_descriptor import TensorDescriptor

from . import archs
from .logits import tanh as _a_jitted_function


def _built_by_the_interpreter() -> bool:
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(_a_jitted_function, InterpretedFunction)


# Read once at import: the planner runs inside code torch.compile traces, where a jitted function is
# not a Python object whose type can be asked.
_INTERPRETED = _built_by_the_interpreter()


def interpreted() -> bool:
    """True when the kernels were built by the Triton interpreter (TRITON_INTERPRET=1 at import)."""
    return _INTERPRETED


def _device_constant(query):
    """``query(device_index)`` asked once per device, and a constant to torch.compile: the planner runs
    inside traced code, which gets the answer instead of tracing into the CUDA query."""
    cached = functools.lru_cache(maxsize=None)(query)

    @functools.wraps(query)
    def constant(device_index: int):
        return cached(device_index)

    return torch.compiler.assume_constant_result(constant)


@_device_constant
def _capability(device_index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device_index)


def capability(device: torch.device) -> tuple[int, int]:
    """A CUDA device's compute capability."""
    return _capability(_index(device))


def _index(device: torch.device) -> int:
    """A CUDA device's index (the current device when it has none)."""
    return device.index if device.index is not None else torch.cuda.current_device()


@_device_constant
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA ``device``."""
    return _sm_count(_index(device))


# Architecture families (``archs.ARCHS``): each GPU takes one family's tiles, recognised by its CUDA
# compute capability or its ROCm gfx name.
def family_of(capability: tuple[int, int], shared_optin: int | None = None) -> str | None:
    """The configuration family of a CUDA GPU of ``capability`` whose blocks may use ``shared_optin``
    bytes of shared memory (None: the family's own figure), or None below compute capability 8.0 (no
    bf16 tensor cores: ``check_dtype``). A capability no family names takes the family of the nearest
    named one below it; a GPU with less shared memory than its family's tables are held to takes the
    CUDA family with the most that fits (the least if none does), of those the nearest to its
    capability from below, else from above."""
    own = _cuda_arch(capability)
    if own is None or shared_optin is None or shared_optin >= own.shared:
        return own and own.name
    cuda = archs.of_backend("cuda")
    fits = [a for a in cuda if a.shared <= shared_optin]
    pool = fits or [a for a in cuda if a.shared == min(b.shared for b in cuda)]
    return max(pool, key=lambda a: (a.shared, _nearness(a, capability))).name


def _nearness(arch: archs.Arch, capability: tuple[int, int]) -> tuple:
    """Orders families by how near their first capability is to ``capability``: those at or below it
    first, the highest of them first; then those above it, the lowest first."""
    first = min(arch.recognises)
    return (first <= capability, first if first <= capability else tuple(-c for c in first))


def _cuda_arch(capability: tuple[int, int]) -> archs.Arch | None:
    """The CUDA family that names ``capability``, else the one naming the nearest capability below
    it; None below every named one (8.0)."""
    named = [(cap, arch.name) for arch in archs.of_backend("cuda") for cap in arch.recognises if cap <= capability]
    return archs.get(max(named)[1]) if named else None


def rocm_family(gfx: str) -> str:
    """The configuration family of a ROCm GPU whose ``gcnArchName`` starts with ``gfx``: the family
    that names it; an unnamed one takes the family of its wave size with the least LDS (CDNA2 for a
    gfx9 part, a wave of 64; RDNA3 for the rest, 32), so that every table fits it."""
    for arch in archs.of_backend("rocm"):
        if gfx in arch.recognises:
            return arch.name
    wave = 64 if gfx.startswith("gfx9") else 32
    same = [a for a in archs.of_backend("rocm") if a.wave == wave]
    return min(same, key=lambda a: a.shared).name


@_device_constant
def _shared_optin(device_index: int) -> int | None:
    props = torch.cuda.get_device_properties(device_index)
    return getattr(props, "shared_memory_per_block_optin", None)


@_device_constant
def _gfx(device_index: int) -> str:
    """A ROCm device's gfx name: its ``gcnArchName`` up to the first ':' (``gfx942:sramecc+:xnack-``
    is gfx942), as ``kernels`` checks it against metadata.json's archs."""
    return torch.cuda.get_device_properties(device_index).gcnArchName.split(":")[0]


def rocm(device: torch.device | None) -> bool:
    """Whether ``device`` is a GPU under ROCm (torch for ROCm calls its devices "cuda")."""
    return device is not None and device.type == "cuda" and torch.version.hip is not None


def family(device: torch.device | None) -> str:
    """The configuration family (``archs.ARCHS``) whose tiles a ``device`` takes: a ROCm GPU's from
    its gfx name (``rocm_family``), a CUDA GPU's from its compute capability and per-block shared
    memory (``family_of``; "sm86" below 8.0); "sm90" (the measured tables) for None and a CPU
    tensor's device (the interpreter)."""
    if device is None or device.type != "cuda":
        return "sm90"
    index = _index(device)
    if rocm(device):
        return rocm_family(_gfx(index))
    return family_of(_capability(index), _shared_optin(index)) or "sm86"


def hardware(device: torch.device) -> archs.Arch | None:
    """The family a GPU ``device`` belongs to, for what its hardware has (TMA, tf32 dots), whatever
    tiles its shared memory lets it take; None for a CUDA GPU below compute capability 8.0."""
    if rocm(device):
        return archs.get(rocm_family(_gfx(_index(device))))
    return _cuda_arch(capability(device))


def gpu_name(device: torch.device) -> str:
    """The name of a CUDA ``device`` (for messages)."""
    return torch.cuda.get_device_name(_index(device))


def check_dtype(dtype: torch.dtype, device: torch.device) -> None:
    """Raises ValueError, before any kernel runs, where ``dtype`` cannot run well on ``device``:
    bf16 below compute capability 8.0 (a T4, a V100), whose tensor cores have no bf16 products, so
    Triton emulates them (18 KB of stack a thread offline for sm_75). fp16 and fp32 run there."""
    if dtype != torch.bfloat16 or device.type != "cuda" or rocm(device):
        return
    cap = capability(device)
    if cap[0] < 8:
        raise ValueError(
            f"bf16 needs a GPU of compute capability 8.0 or newer (A100, L4, H100, ...); {gpu_name(device)} is "
            f"{cap[0]}.{cap[1]}: use fp16 (e.g. torch.autocast('cuda', dtype=torch.float16)) or fp32 there")


def tma_hardware(device: torch.device) -> bool:
    """Whether ``device`` loads through TMA tensor descriptors in hardware: the CUDA families from
    compute capability 9.0 on (Hopper, Blackwell; ``archs.Arch.tma``). Older GPUs and AMD ones keep
    the pointer loads, the path they were measured and tested on; the interpreter runs the
    descriptors too (so the CPU tests cover them)."""
    if device.type != "cuda":
        return interpreted()
    arch = hardware(device)
    return arch is not None and arch.tma


def atomic_sem(device: torch.device) -> str:
    """The ordering of ``device``'s fp32 atomic adds (``archs.Arch.atomic_sem``); the default
    acquire-release off a GPU (the interpreter)."""
    arch = hardware(device) if device.type == "cuda" else None
    return arch.atomic_sem if arch is not None else "acq_rel"


def tma_layout(t: torch.Tensor) -> bool:
    """Whether a 2-D operand can go through a TMA tensor descriptor: contiguous rows, a row stride
    and a base address that are multiples of 16 bytes, no empty dimension. Elsewhere the kernels
    load through pointers (the same products; ``logits.logit_tile``)."""
    return (t.dim() == 2 and t.shape[0] > 0 and t.shape[1] > 0 and t.stride(1) == 1
            and (t.stride(0) * t.element_size()) % 16 == 0 and t.data_ptr() % 16 == 0)


def logit_descriptors(hidden, weight, cfg):
    """(hidden's and weight's TMA tensor descriptors for ``cfg``'s tiles, True), or (hidden, weight,
    False) where ``cfg``, the GPU or the layout rules them out (``tma_hardware``, ``tma_layout``):
    the logit kernels then load through pointers."""
    if not (cfg.tma and tma_hardware(hidden.device) and tma_layout(hidden) and tma_layout(weight)):
        return hidden, weight, False
    return (TensorDescriptor.from_tensor(hidden, [cfg.block_n, cfg.block_h]),
            TensorDescriptor.from_tensor(weight, [cfg.block_v, cfg.block_h]), True)


def input_precision(dtype: torch.dtype, *, device: torch.device | None = None) -> str:
    """tl.dot's input precision on ``device`` (None: a CUDA GPU's): "tf32" where the family's dots take
    it (``archs.Arch.tf32``: every CUDA family, CDNA3), for fp32 inputs only when torch allows TF32;
    "ieee" elsewhere (Triton's AMD backend refuses "tf32" but on gfx942)."""
    arch = hardware(device) if device is not None and device.type == "cuda" else None
    if arch is not None and not arch.tf32:
        return "ieee"
    if dtype == torch.float32 and not torch.backends.cuda.matmul.allow_tf32:
        return "ieee"
    return "tf32"


def fp_fusion(dtype: torch.dtype) -> bool:
    """Whether kernels that compute logits may contract multiply-adds (``enable_fp_fusion``): no.

    A contraction of ``scale * acc - m`` into one fma skips the rounding of the logit, so the
    recomputing backward's z - m would differ from the forward's by up to half an ulp of z (6e-5 at
    |z| ~ 2e3), which shows in p at large logits (fp32 with logit_scale 1e3: a grad_hidden error of
    9.5e-5 against plain torch's 2.4e-7 on the H200; the interpreter never contracts). Off for every
    dtype: on the H200 at S1 bf16 it costs nothing measurable (recompute 60.6 ms off against
    60.5-66.6 on, chunked 49.8 against 49.0-51.7)."""
    return False


def bf16_emulation(dtype: torch.dtype) -> bool:
    """BF16_EMULATION, the one switch for bf16 under the interpreter, whose tl.dot and fp32 -> bf16
    cast are not the GPU's (``logits.round_to``, ``logits.logit_tile``); off elsewhere."""
    return interpreted() and dtype == torch.bfloat16


def dot_flags(dtype: torch.dtype, device: torch.device | None = None) -> dict:
    """The flags of every kernel that runs tl.dot on ``dtype`` operands on ``device``."""
    return dict(BF16_EMULATION=bf16_emulation(dtype), INPUT_PRECISION=input_precision(dtype, device=device))


def logit_flags(dtype: torch.dtype, device: torch.device | None = None) -> dict:
    """For kernels that compute logits: ``dot_flags`` and no fused multiply-add contraction where
    ``fp_fusion`` says so, so that every kernel rounds z = scale * acc (- m) the same way."""
    return dict(dot_flags(dtype, device), enable_fp_fusion=fp_fusion(dtype))


def new(shape, dtype, device) -> torch.Tensor:
    """torch.empty, or NaN-filled (-1 for integers) when FUSED_LINEAR_CE_POISON=1, so that an element
    a kernel should have written and did not fails loudly."""
    out = torch.empty(shape, dtype=dtype, device=device)
    if os.environ.get("FUSED_LINEAR_CE_POISON") == "1":
        out.fill_(float("nan") if dtype.is_floating_point else -1)
    return out


def fp32_view(buffer: torch.Tensor, shape, start: int = 0) -> torch.Tensor:
    """An fp32 tensor of ``shape`` over a contiguous ``buffer``'s memory from its element ``start`` on:
    the memory of a 16-bit gradient not yet written, where an fp32 accumulator is hosted or borrowed
    (``plan``'s two words) or statistics are borrowed. The
    caller's plan guarantees the room and that ``start`` falls on 4 bytes (``fp32_fit`` checks both)."""
    nbytes = math.prod(shape) * 4
    first = start * buffer.element_size()
    return buffer.view(-1).view(torch.uint8)[first : first + nbytes].view(torch.float32).view(shape)


def fp32_fit(buffer: torch.Tensor, shape) -> torch.Tensor | None:
    """``fp32_view`` of ``buffer``'s first bytes where it is contiguous, holds ``shape`` and starts on
    16 bytes (what a tensor descriptor needs), else None."""
    if (not buffer.is_contiguous() or buffer.numel() * buffer.element_size() < math.prod(shape) * 4
            or buffer.data_ptr() % 16):
        return None
    return fp32_view(buffer, shape)

