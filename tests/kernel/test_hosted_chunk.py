"""The chunked path in one chunk whose (N, V) buffer lives in grad_weight's own memory
(``plan.hosted_chunk``): where N elements of the input dtype fit in a row of grad_weight (N <=
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

In several chunks the first one, larger, can live there the same way (``plan.hosted_head``): checked
against the same chunks with the head in a row-major buffer of its own, bit for bit on the
interpreter, for each way grad_weight is summed over chunks (fp32, an fp32 master weight's deferred
factor, the bf16 + int8 pair, the long-context bf16 + 4-bit pair), and for its memory: its slabs
in the later chunks' buffer, nothing allocated beyond the chunked path's own.
"""

from dataclasses import replace

import pytest
import torch

from cases import Case, check_three_way, long_context_at, make_inputs, ours
from conftest import DEVICE, ON_GPU, rel_err
from fused_linear_ce import chunked, configs, device, fused_linear_cross_entropy, plan, products
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

    def spy(da, hidden, grad_weight, slab, *rest):
        seen.append(slab)
        return real(da, hidden, grad_weight, slab, *rest)

    monkeypatch.setattr(chunked, "hosted_weight_grad", spy)
    return seen


def _slab(n, h, v, dtype=torch.bfloat16, master=False, need_dw=True, **options):
    return plan.hosted_chunk(Options(**options), n, v, h, dtype, need_dw, master)


def _mode(opts, n, v, h):
    return plan.plan_loss(opts, n, v, h, torch.bfloat16, (True, True, False)).mode


@pytest.mark.tier
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
    assert _mode(Options(), n, v, h) == plan.HOSTED
    assert _slab(*S1) is None
    assert _mode(Options(), S1[0], S1[2], S1[1]) == plan.RECOMPUTE
    assert _slab(n, h, v, dtype=torch.float32) is not None  # fp32 entries in an fp32 row: N <= H
    assert _slab(n + 8, h, v, dtype=torch.float32) is None
    assert _slab(2 * n, h, v, dtype=torch.float16) is not None  # fp16's fp32 gradient: N <= 2H
    assert _mode(Options(strategy="recompute"), n, v, h) == plan.RECOMPUTE


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


@pytest.mark.tier_if(lambda case: case.dtype == torch.bfloat16)
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


@pytest.mark.tier
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


@pytest.fixture
def allocations(monkeypatch):
    """The (shape, dtype) of every buffer the package allocates (``device.new``)."""
    sizes, real = [], device.new

    def spy(shape, dtype, where):
        sizes.append((tuple(shape), dtype))
        return real(shape, dtype, where)

    monkeypatch.setattr(device, "new", spy)
    return sizes


def test_no_buffer_beside_the_outputs_holds_the_plane(allocations, slabs):
    """Beside the outputs (grad_hidden, grad_weight) the hosted call allocates statistics and one
    slab of grad_weight's rows, nothing of the (N, V) plane's size (a quarter of it here; the
    row-major chunk allocates the whole plane and fails this)."""
    case = Case(64, 64, 300, torch.float32, "mean", bias=True)
    hidden, weight, bias, targets = make_inputs(case)
    ours(replace(case, chunk_bytes=16 * case.h * 4), hidden, weight, bias, targets)
    assert slabs == [16]
    outputs = {((case.n, case.h), torch.float32), ((case.v, case.h), torch.float32)}
    for shape, dtype in allocations:
        if (shape, dtype) in outputs:
            continue
        assert torch.Size(shape).numel() < case.n * case.v // 4, shape
    assert ((16, case.h), torch.float32) in allocations  # the slab


def test_grad_hidden_first_then_one_product_a_slab(monkeypatch, slabs):
    """grad_hidden's product reads the whole buffer before any slab's copy overwrites part of it;
    then one product a slab, the last one ragged."""
    events, real = [], products.product

    def spy(a, b, out, accumulate, unscale=None, **kwargs):
        events.append(("product", a.shape[0]))
        return real(a, b, out, accumulate, unscale, **kwargs)

    monkeypatch.setattr(products, "product", spy)
    case = Case(48, 64, 300, torch.float32, "mean")
    hidden, weight, bias, targets = make_inputs(case)
    ours(replace(case, chunk_bytes=16 * case.h * 4), hidden, weight, bias, targets)
    # grad_hidden's product (48 rows) first, then 19 slabs of 16 rows (300 = 18 x 16 + 12)
    assert events == [("product", 48)] + [("product", 16)] * 18 + [("product", 12)]


# ---- the hosted head: the first of several chunks in grad_weight's memory (``plan.hosted_head``) ----

S4 = (65536, 4096, 128256)  # N, H, V


def test_the_head_at_s4_is_as_many_tokens_as_a_row_of_grad_weight_holds():
    """S4: an fp32 master weight's 2048-row chunks (the 504 MiB default; 1792 in 448 MiB) start with
    8192 rows (2H bf16 entries in a row of H floats), the bf16 long-context default's 1024-row chunks
    with 4096 (H). The head's slabs fill the later chunks' buffer: 1792 x V bf16 holds 28048 rows of
    fp32 gradient, 2048 x V 32064, 1024 x V 32064 of bf16. Not taken under two chunks' rows, where N fits whole (hosted whole, or nothing), or where the
    chunk buffer holds under HOSTED_MIN_ROWS rows of grad_weight."""
    n, h, v = S4
    assert plan.hosted_head(n, v, h, torch.bfloat16, torch.float32, 1792, 128) == (8192, 28048)
    assert plan.chunk_rows(n, v, torch.bfloat16, plan.DEFAULT_MASTER_BYTES, 128) == 2048
    assert plan.hosted_head(n, v, h, torch.bfloat16, torch.float32, 2048, 128) == (8192, 32064)
    assert plan.hosted_head(n, v, h, torch.bfloat16, torch.bfloat16, 1024, 128) == (4096, 32064)
    assert plan.hosted_head(n, v, h, torch.float16, torch.float32, 1024, 128) == (8192, 16032)
    assert plan.hosted_head(n, v, h, torch.float32, torch.float32, 1024, 64) == (4096, 32064)
    assert plan.hosted_head(n, v, h, torch.bfloat16, torch.bfloat16, 4096, 128) is None  # 4096 < 2 x 4096
    assert plan.hosted_head(n, v, h, torch.bfloat16, torch.bfloat16, 2048, 128) == (4096, 64128)
    assert plan.hosted_head(4096, v, h, torch.bfloat16, torch.bfloat16, 1024, 128) is None  # N fits whole
    assert plan.hosted_head(n, v, h, torch.bfloat16, torch.bfloat16, 16, 16) is None  # 501 slab rows
    assert plan.hosted_head(n, v, 4000, torch.bfloat16, torch.bfloat16, 1024, 128) == (3968, 32832)
    assert chunked.chunk_spans(10, 3) == [(0, 3), (3, 3), (6, 3), (9, 1)]
    assert chunked.chunk_spans(10, 3, head=6) == [(0, 6), (6, 3), (9, 1)]


@pytest.fixture
def head(monkeypatch, slabs):
    """Small slabs (``slabs``), and a switch that puts the head in a row-major buffer of its own
    instead (the same chunks, products and K order: the reference)."""
    real = chunked.head_buffer
    state = {"row_major": False}

    def buffer(grad_weight, dtype, rows):
        if state["row_major"]:
            return device.new((rows, grad_weight.shape[0]), dtype, grad_weight.device)
        return real(grad_weight, dtype, rows)

    monkeypatch.setattr(chunked, "head_buffer", buffer)
    return state


def _head_runs(case, state, slabs, master=False):
    """(hosted, row-major) runs of ``case``: loss, metrics and gradients."""
    hidden, weight, bias, targets = make_inputs(case)
    runs = []
    for row_major in (False, True):
        state["row_major"] = row_major
        slabs.clear()
        if master:
            x, w = hidden.float().requires_grad_(True), weight.float().requires_grad_(True)
            with torch.autocast(DEVICE.type, dtype=torch.bfloat16):
                loss = fused_linear_cross_entropy(x, w, targets, chunk_bytes=case.chunk_bytes, strategy="chunked")
            loss.backward()
            runs.append(((loss.detach(), {}), {"hidden": x.grad, "weight": w.grad}, list(slabs)))
        else:
            out, grads = ours(case, hidden, weight, bias, targets, return_metrics=True)
            runs.append((out, grads, list(slabs)))
    return runs


def _rows(dtype):
    """The chunks' rows: three of the interpreter's 16-row blocks, one of the GPU's (128, fp32 64)."""
    return max(48, configs.sweep_config(dtype, chunked=True).block_n)


def _head_case(dtype, extra_rows, **kw):
    """``extra_rows`` past the head (H rows of a bf16 gradient, 2H of an fp32 one) in chunks of
    ``_rows``. H = 160 on the CPU: three column tiles of the interpreter's matmul (a slab product
    that wrote its rows of grad_weight directly would overwrite da its later tiles still read);
    256 on a GPU, where a head must be two 128-row chunks."""
    rows, h, v = _rows(dtype), (160 if not ON_GPU else 256), 1100
    head = h * (1 if dtype in (torch.bfloat16, torch.float32) else 2)
    return Case(head + extra_rows, h, v, dtype, chunk_bytes=rows * v * dtype.itemsize, **kw)


HEAD_CASES = [
    _head_case(torch.bfloat16, 3 * _rows(torch.bfloat16) + 20, reduction="mean", bias=True, ignored=0.2,
               extra=dict(strategy="chunked")),  # the bf16 + int8 pair
    _head_case(torch.float32, 2 * _rows(torch.float32), reduction="sum", label_smoothing=0.1, class_weight=True,
               extra=dict(strategy="chunked")),
    _head_case(torch.float16, _rows(torch.float16) + 7, reduction="mean", softcap=3.0,
               extra=dict(strategy="chunked")),  # fp16's fp32 gradient: 2H tokens
]


def _expected_slab(case, dw_itemsize):
    return case.chunk_bytes // (case.h * dw_itemsize) // 16 * 16


@pytest.mark.tier_if(lambda case: case.dtype == torch.bfloat16)
@pytest.mark.parametrize("case", HEAD_CASES, ids=lambda c: c.id)
def test_the_hosted_head_is_bit_identical_to_the_same_chunks_row_major(case, head, slabs):
    """The first chunk hosted (class-major in grad_weight, its dW a slab at a time through the later
    chunks' buffer) against the same chunks with the head row-major in a buffer of its own: the same
    bits for the loss, the metrics and every gradient, and against float64 (both runs share the head's
    slab products). Mutation-checked: a slab product that writes its rows of grad_weight directly
    fails the former, a missing copy the latter (a head pair whose remainder is not started fails
    ``test_the_long_context_head_starts_the_4bit_pair``)."""
    (out, grads, seen), (ref, ref_grads, _) = _head_runs(case, head, slabs)
    assert seen == [_expected_slab(case, 4 if case.dtype != torch.bfloat16 else 2)]  # one hosted head
    assert torch.equal(out[0], ref[0])
    for key in out[1]:
        assert torch.equal(out[1][key], ref[1][key]), key
    for key, g in grads.items():
        assert (g is None) == (ref_grads[key] is None), key
        if g is not None:
            _same(g, ref_grads[key], case.dtype)
    check_three_way(case)  # both share the head's products: against float64 as well


@pytest.mark.tier
def test_an_fp32_master_weights_head_is_summed_unscaled_like_its_chunks(head, slabs):
    """An fp32 master weight (bf16 products, every chunk's dW summed unscaled and the factor applied
    once at the end): its head of 2H rows is written unscaled too (scaling it there as well would
    apply the factor twice: checked by mutation). The same bits as the row-major head, and against
    float64."""
    case = _head_case(torch.float16, 2 * _rows(torch.bfloat16) + 5)  # 2H tokens, bf16 chunks' bytes
    case = replace(case, dtype=torch.bfloat16, reduction="mean")
    (out, grads, seen), (ref, ref_grads, _) = _head_runs(case, head, slabs, master=True)
    assert seen == [_expected_slab(case, 4)]
    assert grads["weight"].dtype == torch.float32
    assert torch.equal(out[0], ref[0])
    _same(grads["hidden"], ref_grads["hidden"], torch.bfloat16)
    _same(grads["weight"], ref_grads["weight"], torch.bfloat16)
    hidden, weight, _, targets = make_inputs(case)
    xx, ww = hidden.double().requires_grad_(True), weight.double().requires_grad_(True)
    torch.nn.functional.cross_entropy(xx @ ww.t(), targets).backward()
    assert rel_err(grads["weight"], ww.grad) <= 8e-3
    assert rel_err(grads["hidden"], xx.grad) <= 8e-3


@pytest.mark.tier
def test_the_long_context_head_starts_the_4bit_pair(monkeypatch, head, slabs):
    """The long-context default (bf16, grad_weight as a bf16 + 4-bit pair, ``plan.LONG_CONTEXT``;
    its budget stands in for S4's here): the head's slabs start the pair, hi through the buffer and
    the 4-bit remainder straight into its rows, and the later chunks sum into it. Bit for bit the
    row-major head's, and against float64 (``check_three_way``)."""
    case = _head_case(torch.bfloat16, 3 * _rows(torch.bfloat16), reduction="mean", ignored=0.1)
    chunk, h, v = case.chunk_bytes, case.h, case.v
    case = replace(case, chunk_bytes=None)  # the default options; the budget comes from ``long_context_at``
    lows = long_context_at(monkeypatch, chunk)
    (out, grads, seen), (ref, ref_grads, _) = _head_runs(case, head, slabs)
    slab = chunk // (h * 2) // 16 * 16
    starts = [(torch.uint8, (min(slab, v - v0), h // 2), False) for v0 in range(0, v, slab)]
    per_run = starts + [(torch.uint8, (v, h // 2), True)] * 3
    assert lows == per_run * 2
    assert torch.equal(out[0], ref[0])
    for key in ("hidden", "weight"):
        _same(grads[key], ref_grads[key], torch.bfloat16)
    lows.clear()
    check_three_way(case)
    assert lows == per_run


def test_the_head_allocates_nothing_beyond_the_chunk_buffer(allocations, head, slabs):
    """Beside the outputs the hosted head's call allocates the later chunks' buffer and statistics:
    its slabs live in that buffer (no slab buffer of their own: checked by mutation), nothing of the
    head's plane size (the row-major head fails this)."""
    case = HEAD_CASES[1]
    hidden, weight, bias, targets = make_inputs(case)
    ours(case, hidden, weight, bias, targets)
    assert len(slabs) == 1
    outputs = {((case.n, case.h), torch.float32), ((case.v, case.h), torch.float32)}
    rows = _rows(torch.float32)
    chunk = rows * case.v
    assert ((rows, case.v), torch.float32) in allocations
    assert ((_expected_slab(case, 4), case.h), torch.float32) not in allocations
    for shape, dtype in allocations:
        if (shape, dtype) not in outputs:
            assert torch.Size(shape).numel() <= chunk, shape
