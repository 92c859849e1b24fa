"""Loss and gradients against the float64 reference, over the case matrix: dtypes, odd and real
shapes, every reduction, ignored rows, bias, scale, softcap, memory budgets, both strategies.

bf16 on CPU: the Triton interpreter's ``tl.dot`` multiplies the raw bits of bf16 operands
(triton#11584) and its fp32 -> bf16 cast truncates. Under the interpreter the launcher sets
BF16_EMULATION, which upcasts bf16 tiles to fp32 right before ``tl.dot`` (exact: a bf16 x bf16
product fits in fp32, as in the tensor cores) and rounds to nearest even on the bits when storing
bf16 (as the GPU's cvt.rn does). Everything else (bf16 loads, strides, masks, stores) is the same
code. ``test_bf16_emulation.py`` checks both workarounds against torch bit for bit. On a GPU these
same cases run the real bf16 path.
"""

import dataclasses

import pytest
import torch

from cases import Case, check_three_way, make_inputs, ours, plain
from conftest import DEVICE, ON_GPU, rel_err
from fused_linear_ce import configs, device, sweep_kernels

DTYPES = (torch.float32, torch.float16, torch.bfloat16)

CASES = []
# Odd sizes and every reduction, each dtype.
for dtype in DTYPES:
    for n, h, v in ((1, 40, 10), (7, 96, 500), (77, 40, 500)):
        for reduction in ("mean", "sum", "none"):
            CASES.append(Case(n, h, v, dtype, reduction))
    CASES.append(Case(7, 40, 32001, dtype, "none", bias=True))
# Ignored fractions, bias, scale and softcap, grads on a subset of inputs, per dtype.
for dtype in DTYPES:
    CASES += [
        Case(77, 96, 500, dtype, "mean", ignored=0.2),
        Case(77, 96, 500, dtype, "none", ignored=0.2, bias=True),
        Case(77, 96, 500, dtype, "sum", ignored=1.0),
        Case(77, 96, 500, dtype, "mean", ignored=1.0, bias=True),
        Case(77, 96, 500, dtype, "mean", bias=True),
        Case(77, 96, 500, dtype, "mean", logit_scale=0.3),
        Case(77, 96, 500, dtype, "none", logit_scale=2.5, softcap=4.0, bias=True),
        Case(77, 96, 500, dtype, "sum", softcap=1.5),
        Case(77, 96, 500, dtype, "mean", grad=("hidden",)),
        Case(77, 96, 500, dtype, "mean", grad=("weight",), bias=True),
        Case(77, 96, 500, dtype, "mean", grad=("bias",), bias=True),
        Case(77, 96, 500, dtype, "none", ignore_index=3, ignored=0.2),
    ]
# The backward's blocking (``backward_passes.plan_passes``; CPU tiles 16 x 256): whole plane; token chunks with
# the V x H accumulator (16-bit: the fallback when no vocabulary block of all rows fits); vocabulary
# chunks (16-bit: one pass with the N x H accumulator borrowed from grad_weight; fp32: one pass); one
# pass of vocabulary chunks with the N x H accumulator's extra half in half the budget (72000 bytes,
# 16-bit: its first 38 rows hosted in grad_hidden, test_hosted_accumulator.py); the smallest blocks.
for dtype in DTYPES:
    for chunk in (None, 16 * 500 * dtype.itemsize, 77 * 256 * dtype.itemsize, 72000, 1):
        CASES.append(Case(77, 96, 500, dtype, "none", bias=True, ignored=0.2, chunk_bytes=chunk))
# 16-bit: the borrowed accumulator over three vocabulary blocks, two of whose grad_weight waits for
# grad_hidden (one recomputed); and two passes without accumulators where V < 2N (no borrowing).
for dtype in (torch.float16, torch.bfloat16):
    CASES += [
        Case(160, 96, 1000, dtype, "mean", bias=True, ignored=0.2, chunk_bytes=160 * 256 * dtype.itemsize),
        Case(300, 40, 500, dtype, "none", bias=True, ignored=0.2, chunk_bytes=300 * 256 * dtype.itemsize),
    ]
# bf16 without a bias gradient, V < 2N and no fp32 accumulator in half the budget: one pass of two
# vocabulary blocks (256 + 244 columns) with grad_hidden summed as a bf16 + int8 pair (the long-context
# default, BackwardPlan.paired); per-row upstream gradients; "sum" (tests/kernel/test_compensated.py
# checks that these take the pair).
CASES += [
    Case(300, 96, 500, torch.bfloat16, "mean", ignored=0.2, chunk_bytes=200000),
    Case(300, 96, 500, torch.bfloat16, "none", logit_scale=1.5, softcap=4.0, ignored=0.2, chunk_bytes=200000),
    Case(300, 96, 500, torch.bfloat16, "sum", grad=("hidden", "weight"), chunk_bytes=200000),
]
if ON_GPU:  # sizes that fill the GPU's tiles several times over; too slow for the interpreter
    for dtype in DTYPES:
        CASES += [
            Case(1000, 512, 50257, dtype, "mean", ignored=0.2, bias=True),
            Case(4096, 1024, 32001, dtype, "none", softcap=30.0, chunk_bytes=64 << 20),
        ]
    # The paired plan at GPU tiles: 21 vocabulary blocks of 1536 columns (V < 2N, 64 MiB).
    CASES.append(Case(16384, 1024, 32000, torch.bfloat16, "mean", ignored=0.2, chunk_bytes=64 << 20))


# Both gradient paths: "auto" takes the chunked one (gradients in the forward) for "mean"/"sum"
# when the plane fits in chunk_bytes, else the recompute one; each such case also runs the other
# path explicitly, and the chunked path in several chunks of rows.
for dtype in DTYPES:
    CASES += [
        Case(77, 96, 500, dtype, "mean", bias=True, ignored=0.2, extra=dict(strategy="recompute")),
        Case(77, 96, 500, dtype, "sum", logit_scale=2.5, softcap=4.0, extra=dict(strategy="recompute")),
        Case(77, 96, 500, dtype, "mean", bias=True, ignored=0.2, chunk_bytes=16 * 500 * dtype.itemsize,
             extra=dict(strategy="chunked")),
        Case(77, 96, 500, dtype, "sum", logit_scale=2.5, softcap=4.0, chunk_bytes=1, extra=dict(strategy="chunked")),
        Case(77, 40, 500, dtype, "mean", grad=("weight",), chunk_bytes=32 * 500 * dtype.itemsize,
             extra=dict(strategy="chunked")),
        # V a multiple of every config's vocabulary tile (no column mask, EVEN_V), both paths.
        Case(40, 48, 768, dtype, "mean", bias=True, ignored=0.2, extra=dict(strategy="chunked")),
        Case(40, 48, 768, dtype, "sum", ignored=0.2, extra=dict(strategy="recompute")),
        # Four vocabulary tiles (CPU), whole and in two chunks of rows.
        Case(40, 48, 1000, dtype, "sum", logit_scale=1.5, softcap=4.0, bias=True, ignored=0.2,
             extra=dict(strategy="chunked")),
        Case(40, 48, 1000, dtype, "mean", bias=True, ignored=0.2, chunk_bytes=32 * 1000 * dtype.itemsize,
             extra=dict(strategy="chunked")),
    ]


# The GPU tier: the cases that name a path (both paths, every dtype) and the GPU-size cases.
TIER = pytest.mark.tier_if(
    lambda case: "strategy" in case.extra or (case.n, case.h, case.v) in ((1000, 512, 50257), (4096, 1024, 32001)))


@TIER
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_matches_float64_reference(case):
    check_three_way(case)


# The logit tiles and the Triton matmul load their operands through TMA tensor descriptors where the
# layout allows it (most cases above, on the interpreter and on the GPU for 16-bit inputs) and
# through pointers elsewhere (a misaligned or strided layout; fp32 on the GPU). These cases run the
# pointer loads everywhere:
# a ragged H with bias, scale and softcap; recompute over the whole plane; the chunked path over
# four vocabulary tiles; vocabulary chunks with an accumulator.
POINTER_CASES = []
for dtype in DTYPES:
    POINTER_CASES += [
        Case(77, 40, 500, dtype, "none", logit_scale=2.5, softcap=4.0, bias=True),
        Case(77, 96, 500, dtype, "mean", ignored=0.2, extra=dict(strategy="recompute")),
        Case(40, 48, 1000, dtype, "mean", bias=True, ignored=0.2, extra=dict(strategy="chunked")),
        Case(77, 96, 500, dtype, "none", bias=True, ignored=0.2, chunk_bytes=72000),
    ]


@TIER
@pytest.mark.parametrize("case", POINTER_CASES, ids=lambda c: c.id)
def test_pointer_loads_match_float64_reference(case):
    with configs.override(each=lambda cfg: dataclasses.replace(cfg, tma=False)):
        hidden, weight, _, _ = make_inputs(case)
        assert not device.logit_descriptors(hidden, weight, configs.sweep_config(case.dtype))[2]
        check_three_way(case)


@pytest.mark.parametrize("dtype", DTYPES)
def test_tma_descriptors_where_the_layout_allows(dtype):
    """Contiguous, 16-byte aligned rows take the descriptors (as configured: not fp32 on the GPU);
    a row of 36 16-bit elements (72 bytes), a strided operand or a misaligned base do not."""
    hidden = torch.randn(20, 48, device=DEVICE).to(dtype)
    weight = torch.randn(300, 48, device=DEVICE).to(dtype)
    cfg = configs.sweep_config(dtype)
    assert configs.tma_layout(hidden) and configs.tma_layout(weight)
    assert device.logit_descriptors(hidden, weight, cfg)[2] == cfg.tma
    assert cfg.tma == (dtype != torch.float32 or not ON_GPU)
    short = torch.randn(20, 36 if dtype != torch.float32 else 34, device=DEVICE).to(dtype)
    assert not configs.tma_layout(short)
    assert not configs.tma_layout(hidden[:, ::2])
    assert not configs.tma_layout(torch.randn(20 * 48 + 1, device=DEVICE).to(dtype)[1:].view(20, 48))
    assert not configs.tma_layout(hidden[:0])
    assert not device.logit_descriptors(short, weight[:, :short.shape[1]], cfg)[2]


@pytest.mark.parametrize("v, e_tma", [(1000, True), (500, False)])
def test_chunked_sweep_stores_through_a_descriptor_where_the_layout_allows(v, e_tma, monkeypatch):
    """The chunked path's sweep writes exp(z - m_tile) through a TMA descriptor when the (R, V)
    buffer's rows are 16-byte multiples (V = 1000 bf16: 2000 bytes), else through pointers (V = 500:
    1000 bytes); the gradients match float64 either way (the case matrix has both)."""
    if ON_GPU and not configs.tma_hardware(torch.device(DEVICE)):
        pytest.skip("this GPU has no TMA hardware (compute capability < 9.0)")
    launches = []
    real = sweep_kernels.lse_sweep_kernel

    class Spy:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: launches.append(kwargs["E_TMA"]) or real[grid](*args, **kwargs)

    monkeypatch.setattr(sweep_kernels, "lse_sweep_kernel", Spy())
    case = Case(40, 48, v, torch.bfloat16, "mean", ignored=0.2, extra=dict(strategy="chunked"))
    check_three_way(case)
    assert launches and set(launches) == {e_tma}


@pytest.mark.parametrize("sweep_cols", [128, 256])
def test_chunked_gradient_finds_each_column_tile_max_in_wider_sweep_tiles(sweep_cols, monkeypatch):
    """The chunked path's gradient kernel runs programs of at most 128 columns
    (``chunked.gradient_cols``) whatever the sweep's tile width, each reading the tile max of the
    sweep tile its columns lie in (the GPU's sweep tiles are 256 wide, as the interpreter's): the
    gradients match float64 at either width, and the launches say which columns and statistics."""
    from conftest import KernelSpy
    from fused_linear_ce import chunked

    cfg = dataclasses.replace(configs.tiles("chunked", torch.bfloat16), block_v=sweep_cols)
    real_tiles = configs.tiles
    monkeypatch.setattr(configs, "tiles", lambda role, dt, h=None, where=None: cfg if role == "chunked" else real_tiles(role, dt, h, where=where))
    spy = KernelSpy(chunked.softmax_gradient_kernel)
    monkeypatch.setattr(chunked, "softmax_gradient_kernel", spy)
    check_three_way(Case(40, 48, 1000, torch.bfloat16, "mean", ignored=0.2, bias=True, extra=dict(strategy="chunked")))
    assert spy.launches and {(k["BLOCK_V"], k["STATS_V"]) for k in spy.launches} == {(128, sweep_cols)}
    if device.interpreted():  # the shipped interpreter tiles: every chunked CPU test reads wider tiles
        assert chunked.gradient_cols(real_tiles("chunked", torch.bfloat16)) < real_tiles("chunked", torch.bfloat16).block_v


@pytest.mark.parametrize("major", [7, 8, 9, 10])
def test_tma_descriptors_only_with_tma_hardware(major, monkeypatch):
    """A CUDA GPU below compute capability 9.0 (no TMA hardware) keeps the pointer loads."""
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(device, "_capability", lambda index: (major, 0))
    assert configs.tma_hardware(torch.device("cuda", 0)) is (major >= 9)
    hidden = torch.randn(20, 48, device=DEVICE).to(torch.bfloat16)
    weight = torch.randn(300, 48, device=DEVICE).to(torch.bfloat16)
    cfg = dataclasses.replace(configs.sweep_config(torch.bfloat16), tma=True)
    monkeypatch.setattr(device, "tma_hardware", lambda device: major >= 9)
    assert device.logit_descriptors(hidden, weight, cfg)[2] is (major >= 9)


def test_fp16_gradient_of_logits_is_kept_out_of_the_subnormal_range():
    """At V = 20000 with a mean over ~96 rows, p / count ~ 5e-7 is subnormal in fp16 (below 6e-5):
    stored as is, dX / dW errors were 9.2e-4 / 5.0e-4 (plain torch: 1.3e-3 / 6.4e-4). The backward
    stores da scaled by a power of two and divides the products by it: 3.0e-4 / 3.0e-4 (CPU)."""
    case = Case(120, 40, 20000, torch.float16, "mean", ignored=0.2, bias=True)
    hidden, weight, bias, targets = make_inputs(case)
    _, grads = ours(case, hidden, weight, bias, targets)
    _, gt = plain(case, hidden, weight, bias, targets, torch.float64)
    for k in ("hidden", "weight", "bias"):
        assert rel_err(grads[k], gt[k]) < 4e-4, k
