"""The chunked path in one chunk whose (N, V) buffer lives in grad_weight's own memory
(``chunked.hosted_slab_rows``): where N elements of the input dtype fit in a row of grad_weight (N <=
H for bf16, N <= 2H for an fp32 master weight's gradient) the buffer is class-major there, class v
in the first bytes of row v, and grad_weight is computed a slab of rows at a time into a slab-sized
buffer that is copied over the rows its product has just read.

Checked against the same one chunk in its own row-major buffer (``chunk_bytes`` past the whole (N, V)
plane): on the interpreter the same tiles, products and K order, so the loss and every gradient are
the same bits, with every option the chunked path takes (on a GPU cuBLAS may pick another algorithm
for a slab's shape than for the whole: within one rounding there); against float64 as every path is
(``check_three_way``); the decision at S1-sized shapes; and the memory: no allocation holds more than
a slab beside the outputs. Slabs of 16 rows stand in for the GPU's >= 1024 (``HOSTED_MIN_ROWS``), so
every call runs several slabs, a ragged last one included. bf16 on the CPU goes through the kernels'
BF16_EMULATION switch (``tests/kernel/test_bf16_emulation.py`` says why that cover is faithful).
"""

from dataclasses import replace

import pytest
import torch

from cases import Case, check_three_way, make_inputs, ours
from conftest import DEVICE, ON_GPU, rel_err
from fused_linear_ce import chunked, device, fused_linear_cross_entropy, plan, products
from fused_linear_ce.validate import Options

MiB = 1 << 20
S1 = (8192, 4096, 128256)  # N, H, V


def _same(got, want, dtype):
    """The same bits on the interpreter; on a GPU within about one rounding of ``dtype`` (a slab's
    product may run another cuBLAS algorithm than the whole's, another summation order)."""
    if not ON_GPU:
        assert torch.equal(got, want)
    else:
        assert rel_err(got, want) <= {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 8e-3}[dtype]


@pytest.fixture
def slabs(monkeypatch):
    """Small slabs, and the slab sizes of each hosted grad_weight."""
    monkeypatch.setattr(plan, "HOSTED_MIN_ROWS", 16)
    seen, real = [], chunked.hosted_weight_grad

    def spy(da, hidden, grad_weight, slab, unscale):
        seen.append(slab)
        return real(da, hidden, grad_weight, slab, unscale)

    monkeypatch.setattr(chunked, "hosted_weight_grad", spy)
    return seen


def _slab(n, h, v, dtype=torch.bfloat16, master=False, need_dw=True, **options):
    return chunked.hosted_slab_rows(Options(**options), n, v, h, dtype, need_dw, master)


def test_an_fp32_master_weight_at_s1_runs_one_chunk_in_its_gradient():
    """8192 x 4096 x 128256 with an fp32 master weight: 8192 bf16 entries fill a 4096-float row of
    grad_weight exactly, so the whole 2 GiB buffer lives in the 2 GiB gradient; the default 256 MiB
    hold 16384-row slabs (16 KiB a row), 1 GiB 65536."""
    n, h, v = S1
    assert _slab(n, h, v, master=True) == plan.DEFAULT_CHUNKED_BYTES // (h * 4)
    assert _slab(n, h, v, master=True, chunk_bytes=1 << 30) == 65536
    assert _slab(n, h, v, master=True, chunk_bytes=16 * MiB) == 1024  # the fewest rows
    assert _slab(n, h, v, master=True, chunk_bytes=15 * MiB) is None
    assert _slab(n + 8, h, v, master=True) is None  # one row more than fits
    assert _slab(n, h, v, master=True, chunk_bytes=1 << 50) is None  # the whole plane fits beside it
    assert _slab(n, h, v, master=True, need_dw=False) is None


def test_bf16_hosts_up_to_h_tokens_and_auto_takes_it():
    """A bf16 gradient holds N <= H tokens: 4096 x 4096 x 128256 (a 1 GiB plane, past the 256 MiB
    default) runs one chunk in grad_weight's memory, where "auto" took the recompute path; S1 (N = 2H)
    does not fit and keeps it."""
    n, h, v = 4096, 4096, 128256
    assert _slab(n, h, v) == plan.DEFAULT_CHUNKED_BYTES // (h * 2)
    assert chunked.use(Options(), n, v, h, torch.bfloat16, (True, True, False))
    assert _slab(*S1) is None
    assert not chunked.use(Options(), S1[0], S1[2], S1[1], torch.bfloat16, (True, True, False))
    assert _slab(n, h, v, dtype=torch.float32) is not None  # fp32 entries in an fp32 row: N <= H
    assert _slab(n + 8, h, v, dtype=torch.float32) is None
    assert _slab(2 * n, h, v, dtype=torch.float16) is not None  # fp16's fp32 gradient: N <= 2H
    assert not chunked.use(Options(strategy="recompute"), n, v, h, torch.bfloat16, (True, True, False))


# H = 160: three column tiles of the interpreter's 64-wide matmul tiles, so a slab product that wrote
# its rows of grad_weight directly would overwrite da its later tiles still read (as on the GPU).
CASES = [
    Case(96, 160, 300, torch.float32, "mean", ignored=0.2),
    Case(128, 160, 300, torch.bfloat16, "mean", bias=True),
    Case(48, 64, 300, torch.float32, "sum", bias=True, logit_scale=0.5),
    Case(40, 64, 300, torch.float32, "mean", label_smoothing=0.1, class_weight=True),
    Case(40, 64, 300, torch.float32, "mean", softcap=3.0, z_loss=1e-3),
    Case(64, 64, 300, torch.float16, "mean", bias=True, ignored=0.1),
    Case(64, 64, 300, torch.bfloat16, "mean", ignored=0.3),
    Case(64, 64, 300, torch.bfloat16, "sum", bias=True, class_weight=True),
    Case(48, 64, 300, torch.float32, "mean", grad=("weight",)),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_hosted_is_bit_identical_to_the_row_major_chunk(case, slabs):
    """Hosted (class-major in grad_weight, slabs of rows) against one row-major chunk: the same bits
    for the loss and every gradient, with metrics. Mutation-checked: a slab product that writes its
    rows of grad_weight directly (over the da it reads), a missing copy, or a gradient kernel that
    ignores the class stride each fail this."""
    hidden, weight, bias, targets = make_inputs(case)
    itemsize = 4 if case.dtype == torch.float16 else case.dtype.itemsize  # fp16: an fp32 grad_weight
    hosted_bytes = 16 * case.h * itemsize  # 16-row slabs; the plane does not fit
    assert case.n * case.v * case.dtype.itemsize > hosted_bytes
    out, grads = ours(replace(case, chunk_bytes=hosted_bytes), hidden, weight, bias, targets, return_metrics=True)
    assert slabs == [16]
    whole, whole_grads = ours(replace(case, chunk_bytes=1 << 40), hidden, weight, bias, targets, return_metrics=True)
    assert slabs == [16]  # the row-major chunk hosts nothing
    assert torch.equal(out[0], whole[0])  # the sweep is the same on both
    for key in out[1]:
        assert torch.equal(out[1][key], whole[1][key]), key
    for key, g in grads.items():
        assert (g is None) == (whole_grads[key] is None), key
        if g is not None:
            _same(g, whole_grads[key], case.dtype)


def test_an_fp32_master_weight_hosts_its_bf16_buffer(slabs):
    """bf16 activations with an fp32 weight under autocast: the bf16 buffer, twice as many tokens as
    a row of fp32 gradient would hold in bf16, in the fp32 gradient; the same bits as one row-major
    chunk, and grad_weight fp32."""
    g = torch.Generator().manual_seed(3)
    n, h, v = 320, 160, 320  # 320 bf16 entries in a row of 160 floats
    hidden = torch.randn(n, h, generator=g).to(DEVICE)
    weight = (0.3 * torch.randn(v, h, generator=g)).to(DEVICE)
    targets = torch.randint(0, v, (n,), generator=g).to(DEVICE)
    targets[::5] = -100
    runs = []
    for chunk_bytes in (16 * h * 4, 1 << 40):
        x, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        with torch.autocast(DEVICE.type, dtype=torch.bfloat16):
            loss = fused_linear_cross_entropy(x, w, targets, chunk_bytes=chunk_bytes)
        loss.backward()
        runs.append((loss.detach(), x.grad, w.grad))
    assert slabs == [16]
    (loss, dx, dw), (loss1, dx1, dw1) = runs
    assert dw.dtype == torch.float32 and dx.dtype == torch.float32
    assert torch.equal(loss, loss1)
    _same(dx, dx1, torch.bfloat16)
    _same(dw, dw1, torch.bfloat16)


def test_hosted_against_float64(slabs):
    check_three_way(Case(64, 64, 300, torch.float32, "mean", bias=True, ignored=0.1, chunk_bytes=16 * 64 * 4))
    check_three_way(Case(64, 64, 300, torch.bfloat16, "mean", chunk_bytes=16 * 64 * 2))
    assert slabs == [16, 16]


def test_no_buffer_beside_the_outputs_holds_the_plane(monkeypatch, slabs):
    """Beside the outputs (grad_hidden, grad_weight) the hosted call allocates statistics and one
    slab of grad_weight's rows, nothing of the (N, V) plane's size (a quarter of it here; the
    row-major chunk allocates the whole plane and fails this)."""
    case = Case(64, 64, 300, torch.float32, "mean", bias=True)
    hidden, weight, bias, targets = make_inputs(case)
    sizes, real = [], device.new

    def spy(shape, dtype, where):
        sizes.append((tuple(shape), dtype))
        return real(shape, dtype, where)

    monkeypatch.setattr(device, "new", spy)
    ours(replace(case, chunk_bytes=16 * case.h * 4), hidden, weight, bias, targets)
    assert slabs == [16]
    outputs = {((case.n, case.h), torch.float32), ((case.v, case.h), torch.float32)}
    for shape, dtype in sizes:
        if (shape, dtype) in outputs:
            continue
        assert torch.Size(shape).numel() < case.n * case.v // 4, shape
    assert ((16, case.h), torch.float32) in sizes  # the slab


def test_grad_hidden_first_then_one_product_a_slab(monkeypatch, slabs):
    """grad_hidden's product reads the whole buffer before any slab's copy overwrites part of it;
    then one product a slab, the last one ragged."""
    events, real = [], products.product

    def spy(a, b, out, accumulate, unscale=None):
        events.append(("product", a.shape[0]))
        return real(a, b, out, accumulate, unscale)

    monkeypatch.setattr(products, "product", spy)
    case = Case(48, 64, 300, torch.float32, "mean")
    hidden, weight, bias, targets = make_inputs(case)
    ours(replace(case, chunk_bytes=16 * case.h * 4), hidden, weight, bias, targets)
    # grad_hidden's product (48 rows) first, then 19 slabs of 16 rows (300 = 18 x 16 + 12)
    assert events == [("product", 48)] + [("product", 16)] * 18 + [("product", 12)]
