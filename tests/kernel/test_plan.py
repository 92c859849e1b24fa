"""The backward's blocking plan (backward_passes.plan_backward): which blocks, which fp32 accumulators."""

import pytest
import torch
import triton

from fused_linear_ce import backward_passes, configs, device
from fused_linear_ce import plan as planner
from fused_linear_ce.backward_passes import hosted_rows

BLOCK_N, BLOCK_V = 16, 256


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_whole_plane_when_it_fits(dtype):
    plan = backward_passes.plan_backward(77, 500, 96, dtype, 77 * 500 * dtype.itemsize, BLOCK_N, BLOCK_V)
    assert (plan.rows, plan.cols, plan.dx_accumulator, plan.dw_accumulator) == (77, 500, False, False)


def test_token_chunks_when_the_vocabulary_block_would_be_too_narrow():
    plan = backward_passes.plan_backward(77, 500, 96, torch.bfloat16, 16 * 500 * 2, BLOCK_N, BLOCK_V)
    assert (plan.rows, plan.cols, plan.dw_accumulator, plan.dx_accumulator) == (16, 500, True, False)


def test_vocabulary_chunks_when_their_accumulator_is_smaller():
    plan = backward_passes.plan_backward(77, 500, 96, torch.bfloat16, 77 * 256 * 2, BLOCK_N, BLOCK_V)
    assert (plan.rows, plan.cols, plan.dx_accumulator, plan.dw_accumulator) == (77, 256, True, False)


def test_llama_shape_default_picks_vocabulary_chunks_within_budget():
    n, h, v = 8192, 4096, 128256
    plan = backward_passes.plan_backward(n, v, h, torch.bfloat16, None, 128, 256)
    assert plan.rows == n and plan.cols < v
    assert plan.rows * plan.cols * 2 <= backward_passes.DEFAULT_CHUNK_BYTES
    # N x H fp32 (128 MiB) instead of V x H fp32 (2 GiB)
    assert plan.extra_bytes(n, v, h, 2) <= backward_passes.DEFAULT_CHUNK_BYTES + n * h * 4


def test_fp32_inputs_need_no_accumulator():
    plan = backward_passes.plan_backward(77, 500, 96, torch.float32, 16 * 500 * 4, BLOCK_N, BLOCK_V)
    assert plan.extra_bytes(77, 500, 96, 4) == plan.rows * plan.cols * 4


def _passes(n, h, v, budget, needs=(True, True), dtype=torch.bfloat16, block_n=128, block_v=256):
    """The plans of a call with a bias gradient or a vocabulary shard (no paired plan)."""
    return backward_passes.plan_passes(n, v, h, dtype, budget, block_n, block_v, *needs)


@pytest.mark.parametrize("n", [8192, 16384, 65536, 262144])
def test_extra_memory_stays_within_the_budget_at_any_n(n):
    """The recompute backward's da blocks and fp32 accumulators never pass ``chunk_bytes``: the
    default's memory is flat in N."""
    h, v = 4096, 128256
    budget = backward_passes.DEFAULT_CHUNK_BYTES
    passes = _passes(n, h, v, None)
    assert max(p.extra_bytes(n, v, h, 2) for p in passes) <= budget
    assert any(p.rows_grads for p in passes) and any(p.weight_grad for p in passes)


@pytest.mark.parametrize("n,h,v,cols", [(8192, 4096, 128256, 8192), (16384, 2048, 151936, 4096),
                                         (8192, 2304, 256000, 9984)], ids=["S1", "S3", "S2"])
def test_one_pass_with_the_accumulator_half_hosted_in_grad_hidden(n, h, v, cols):
    """S1-S3 by default: one pass of vocabulary blocks of all N rows; the fp32 N x H accumulator's
    first N / 2 rows live in grad_hidden's own bf16 memory, so only the other half is extra (64 MiB
    at S1 and S3), and the da block takes the rest of the budget: at S1 and S3 the same blocks as an
    fp32 accumulator beside them in 256 MiB, 64 MiB less."""
    (plan,) = _passes(n, h, v, None)
    assert (plan.rows, plan.dx_accumulator, plan.dw_accumulator, plan.hosted) == (n, True, False, True)
    assert not (plan.borrowed or plan.paired)
    extra_acc = (n - hosted_rows(n, 2)) * h * 4
    assert extra_acc <= backward_passes.DEFAULT_CHUNK_BYTES // 2
    assert plan.cols == (backward_passes.DEFAULT_CHUNK_BYTES - extra_acc) // (2 * n) // 256 * 256 == cols
    assert plan.extra_bytes(n, v, h, 2) == n * cols * 2 + extra_acc <= backward_passes.DEFAULT_CHUNK_BYTES
    assert plan.cols >= h  # the spent da block holds the hosted rows' copy at the end
    if (n, h) != (8192, 2304):
        assert plan.cols == (256 << 20) // 2 // (2 * n) // 256 * 256  # as a whole accumulator in 256 MiB


def test_each_path_has_its_default_budget():
    """The recompute path 192 MiB (the hosted accumulator), the chunked path 256 MiB chunks (a master
    weight's step is 6-7% slower in 192 MiB chunks); an explicit budget is both's."""
    assert planner.chunk_budget(None) == backward_passes.DEFAULT_CHUNK_BYTES == 192 << 20
    assert planner.chunk_budget(None, chunked=True) == planner.DEFAULT_CHUNKED_BYTES == 256 << 20
    assert planner.chunk_budget(5 << 20) == planner.chunk_budget(5 << 20, chunked=True) == 5 << 20
    assert planner.chunk_rows(8192, 128256, torch.bfloat16, None, 128) == 1024  # 256 MiB of rows
    assert planner.chunk_rows(8192, 128256, torch.bfloat16, 192 << 20, 128) == 768


@pytest.mark.parametrize("n", [1, 2, 77, 8192])
@pytest.mark.parametrize("itemsize", [2, 4])
def test_hosted_rows_fit_in_the_gradient(n, itemsize):
    rows = hosted_rows(n, itemsize)
    assert rows * 4 <= n * itemsize < (rows + 1) * 4 + itemsize


@pytest.mark.parametrize("budget_mib", [64, 96])
def test_below_half_the_accumulator_it_borrows_grad_weight_memory(budget_mib):
    """S1 at 64 / 96 MiB: the hosted accumulator's extra half (64 MiB) is more than half the budget,
    so the N x H fp32 accumulator (128 MiB) lives in grad_weight (V >= 2N): the whole budget is da
    block and the extra memory is that block alone."""
    n, h, v = 8192, 4096, 128256
    budget = budget_mib << 20
    (plan,) = _passes(n, h, v, budget)
    assert plan.borrowed and plan.dx_accumulator and not plan.dw_accumulator
    assert (plan.rows, plan.rows_grads, plan.weight_grad) == (n, True, True)
    assert plan.extra_bytes(n, v, h, 2) == n * plan.cols * 2 <= budget
    assert plan.cols == budget // (2 * n) // 256 * 256
    assert backward_passes.borrows_weight_grad(n, v, torch.bfloat16)


def test_borrowing_needs_a_vocabulary_of_at_least_twice_the_tokens():
    assert backward_passes.borrows_weight_grad(100, 200, torch.float16)
    assert not backward_passes.borrows_weight_grad(100, 199, torch.bfloat16)
    assert not backward_passes.borrows_weight_grad(1, 10**6, torch.float32)  # fp32 gradients need no accumulator
    n, h, v = 65536, 4096, 128256  # S4: V < 2N, so two passes (below)
    assert not any(p.borrowed for p in _passes(n, h, v, None))


def test_long_context_takes_two_passes_without_accumulators():
    n, h, v = 65536, 4096, 128256  # N x H fp32 = 1 GiB: more than half the budget, and V < 2N
    rows_pass, dw_pass = _passes(n, h, v, None)
    assert (rows_pass.rows_grads, rows_pass.weight_grad, rows_pass.cols) == (True, False, v)
    assert (dw_pass.rows_grads, dw_pass.weight_grad, dw_pass.rows) == (False, True, n)
    assert not (rows_pass.dx_accumulator or rows_pass.dw_accumulator or dw_pass.dx_accumulator or dw_pass.dw_accumulator)


def test_one_gradient_family_needs_one_pass_without_accumulator():
    n, h, v = 65536, 4096, 128256
    (only_rows,) = _passes(n, h, v, None, needs=(True, False))
    assert only_rows.cols == v and only_rows.rows_grads and not only_rows.dx_accumulator
    (only_weight,) = _passes(n, h, v, None, needs=(False, True))
    assert only_weight.rows == n and only_weight.weight_grad and not only_weight.dw_accumulator


def test_fp32_passes_are_the_one_pass_plan():
    assert _passes(77, 96, 500, 16 * 500 * 4, dtype=torch.float32, block_n=BLOCK_N) == (
        backward_passes.plan_backward(77, 500, 96, torch.float32, 16 * 500 * 4, BLOCK_N, BLOCK_V),)


def test_the_rare_row_settings_take_the_plans_they_name():
    """test_gpu_scale's rare-row test covers every plan through these budgets (GPU tiles 128 x 256)."""
    n, h, v = 4096, 1024, 32000
    (whole,) = _passes(n, h, v, 256 << 20)
    assert (whole.rows, whole.cols) == (n, v)
    for budget in (None, 64 << 20, 16 << 20):
        (in_budget,) = _passes(n, h, v, budget)
        assert in_budget.dx_accumulator and in_budget.hosted and not in_budget.borrowed
    (borrowed,) = _passes(n, h, v, 12 << 20)
    assert borrowed.borrowed
    (token,) = _passes(n, h, v, 1 << 20)
    assert token.dw_accumulator and token.cols == v


def test_long_context_default_pairs_grad_hidden_in_one_pass_of_four_products():
    """S4 (65536 x 4096 x 128256, bf16, no bias gradient, no shard): no fp32 accumulator fits and V < 2N,
    so one pass of vocabulary blocks sums grad_hidden as a bf16 + int8 pair: its N x H bytes (256 MiB)
    and the da blocks within DEFAULT_PAIRED_BYTES, and no logit is recomputed twice."""
    n, h, v = 65536, 4096, 128256
    (plan,) = backward_passes.plan_passes(n, v, h, torch.bfloat16, None, 128, 256, True, True, may_pair=True)
    assert plan.paired and plan.dx_accumulator and not plan.dw_accumulator and not plan.borrowed
    assert (plan.rows, plan.rows_grads, plan.weight_grad) == (n, True, True)
    assert plan.extra_bytes(n, v, h, 2) == n * plan.cols * 2 + n * h <= backward_passes.DEFAULT_PAIRED_BYTES
    assert plan.cols == (backward_passes.DEFAULT_PAIRED_BYTES - n * h) // (2 * n) // 256 * 256 == 2048
    # An explicit budget holds the remainder too: 384 MiB leaves 128 MiB of blocks; 256 MiB none.
    (at_384,) = backward_passes.plan_passes(n, v, h, torch.bfloat16, 384 << 20, 128, 256, True, True, may_pair=True)
    assert at_384.paired and at_384.extra_bytes(n, v, h, 2) <= 384 << 20
    at_256 = backward_passes.plan_passes(n, v, h, torch.bfloat16, 256 << 20, 128, 256, True, True, may_pair=True)
    assert len(at_256) == 2


@pytest.mark.parametrize("n", [65536, 98304, 131072, 262144])
def test_paired_default_stays_flat_and_falls_back_to_two_passes(n):
    """The remainder grows with N: past DEFAULT_PAIRED_BYTES the default takes two passes, so the
    extra memory never passes it at any N."""
    h, v = 4096, 128256
    passes = backward_passes.plan_passes(n, v, h, torch.bfloat16, None, 128, 256, True, True, may_pair=True)
    assert max(p.extra_bytes(n, v, h, 2) for p in passes) <= backward_passes.DEFAULT_PAIRED_BYTES
    assert (len(passes) == 1 and passes[0].paired) == (n * h + 256 * n * 2 <= backward_passes.DEFAULT_PAIRED_BYTES)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_only_bf16_pairs_and_only_when_allowed(dtype):
    """fp16 keeps its plans (its gradients are lifted out of the subnormals, a range the int8
    remainder was not built for); a bias gradient or a vocabulary shard (``may_pair=False``) too."""
    n, h, v = 65536, 4096, 128256
    passes = backward_passes.plan_passes(n, v, h, dtype, None, 128, 256, True, True, may_pair=True)
    assert not any(p.paired for p in passes)
    assert not any(p.paired for p in _passes(n, h, v, None))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_an_fp32_master_weight_gradient_replaces_two_passes_with_token_blocks(dtype):
    """An fp32 master weight's gradient is its own accumulator: where no fp32 accumulator fits, no
    borrowing is possible and no pair is allowed (fp16; bf16 in a budget the remainder does not
    leave room in), one pass of token blocks of whole vocabulary rows sums it in place: four
    products in the budget, where a 16-bit weight takes two passes (five). The paired plan keeps
    its place where it applies."""
    n, h, v = 65536, 4096, 128256
    budget = 256 << 20
    for pair in (False, True):
        plain = backward_passes.plan_passes(n, v, h, dtype, budget, 128, 256, True, True, may_pair=pair)
        assert len(plain) == 2
        (master,) = backward_passes.plan_passes(n, v, h, dtype, budget, 128, 256, True, True, may_pair=pair,
                                        fp32_weight_grad=True)
        assert master.cols == v and master.rows_grads and master.weight_grad and master.rows < n
        assert not (master.dw_accumulator or master.dx_accumulator or master.paired or master.borrowed)
        assert master.extra_bytes(n, v, h, dtype.itemsize) <= budget
    (default,) = backward_passes.plan_passes(n, v, h, dtype, None, 128, 256, True, True, may_pair=True,
                                             fp32_weight_grad=True)
    assert default.paired == (dtype == torch.bfloat16)


def test_the_chunked_path_holds_one_chunks_per_tile_statistics_at_a_time(monkeypatch):
    """Each chunk's sweep returns per-tile statistics (2 x T x R fp32 for the loss: 31 MiB at S4's
    4096-row chunk) that only its gradient kernel reads. They are released before the next chunk's
    sweep allocates its own (where they do not fit in grad_hidden's rows), so the peak holds one set,
    as ``chunk_bytes``' accounting (tests/kernel/test_memory.py) says."""
    import weakref

    from conftest import DEVICE
    from fused_linear_ce import chunked, fused_linear_cross_entropy, sweep

    held, original = [], sweep.sweep

    def spy(*args, **kwargs):
        assert all(ref() is None for ref in held), "the previous chunk's per-tile statistics are still held"
        out = original(*args, **kwargs)
        held.append(weakref.ref(out[1]))
        return out

    monkeypatch.setattr(chunked.sweep, "sweep", spy)
    g = torch.Generator().manual_seed(0)
    n, v, chunk_bytes = 300, 300, 128 * 300 * 2  # 128-row chunks (a row block on the GPU): three
    hidden = torch.randn(n, 64, generator=g).bfloat16().to(DEVICE).requires_grad_(True)
    weight = torch.randn(v, 64, generator=g).bfloat16().to(DEVICE).requires_grad_(True)
    targets = torch.randint(0, v, (n,), generator=g).to(DEVICE)
    fused_linear_cross_entropy(hidden, weight, targets, strategy="chunked", chunk_bytes=chunk_bytes).backward()
    assert len(held) == 3


# ``borrowed``: on the interpreter (256-wide vocabulary tiles: 6 a row); the GPU's chunked sweep has
# 128-wide ones (11 a row: 88 bytes for 2 planes, 176 for 4), so there the fp16 and the metrics cases
# with h = 64 allocate (``_stats_fit``); h = 64 without the metrics borrows and h = 16 allocates on both.
@pytest.mark.parametrize("h, v, dtype, metrics, borrowed", [
    (64, 1300, torch.bfloat16, False, True),  # 2 planes x 6 tiles x 4 bytes = 48 <= 128 bytes a row
    (16, 1300, torch.bfloat16, False, False),  # 48 > 32
    (16, 1300, torch.float16, False, True),  # fp16's unit gradient is fp32: 64 bytes a row
    (64, 1300, torch.bfloat16, True, True),  # 4 planes with the metrics: 96 <= 128 (the argmax apart)
    (16, 1300, torch.bfloat16, True, False),  # 96 > 32
])
def test_the_chunked_path_keeps_its_per_tile_statistics_in_grad_hiddens_rows(h, v, dtype, metrics, borrowed,
                                                                              monkeypatch):
    """The chunked sweep's per-tile statistics live in the memory of the chunk's rows of grad_hidden
    where they fit (``sweep.sweep``'s ``scratch``; the chunk's dX product writes those rows only after
    the gradient kernel has read them), else they are allocated; the target logit goes straight to
    the row's result from the tile that holds it, no plane of its own. Both ways the loss, metrics
    and gradients match float64 (under FUSED_LINEAR_CE_POISON=1 an element left unwritten is NaN)."""
    from cases import Case, check_three_way, make_inputs
    from fused_linear_ce import chunked, fused_linear_cross_entropy, reference, sweep

    seen, original = [], sweep.sweep

    def spy(*args, **kwargs):
        out = original(*args, **kwargs)
        scratch = args[9] if len(args) > 9 else kwargs.get("scratch")
        seen.append(scratch is not None and out[1].data_ptr() == scratch.data_ptr())
        return out

    monkeypatch.setattr(chunked.sweep, "sweep", spy)
    cfg = configs.sweep_config(dtype, chunked=True, h=h)
    tiles, planes, unit = triton.cdiv(v, cfg.block_v), 4 if metrics else 2, 4 if dtype == torch.float16 else 2
    assert (planes * tiles * 4 <= h * unit) == borrowed or not device.interpreted()
    borrowed = planes * tiles * 4 <= h * unit
    rows = max(64, cfg.block_n)  # three chunks: a chunk is whole row blocks (128 rows on the GPU)
    case = Case(rows * 5 // 2, h, v, dtype, "sum", ignored=0.2, chunk_bytes=rows * v * 2, extra=dict(strategy="chunked"))
    # The loss from fp32 logits of the same 16-bit inputs: within fp32's rounding of float64 (a loss
    # through a wrong target logit, e.g. half of it, is ~1% off here, inside the gradients' bounds).
    hidden, weight, _, targets = make_inputs(case)
    loss, got = fused_linear_cross_entropy(hidden, weight, targets, reduction="sum", return_metrics=True,
                                           strategy="chunked", chunk_bytes=case.chunk_bytes)
    want_loss, want = reference.linear_cross_entropy(hidden, weight, targets, reduction="sum",
                                                     return_metrics=True, compute_dtype=torch.float64)
    assert loss.item() == pytest.approx(want_loss.item(), rel=1e-5)
    assert got["mean_token_accuracy"].item() == pytest.approx(want["mean_token_accuracy"].item(), abs=1e-6)
    assert got["entropy"].item() == pytest.approx(want["entropy"].item(), rel=1e-4)
    seen.clear()
    if metrics:  # the gradients with the metrics' planes (they leave them bit-identical: test_metrics.py)
        hidden.requires_grad_(True)
        fused_linear_cross_entropy(hidden, weight, targets, reduction="sum", return_metrics=True,
                                   strategy="chunked", chunk_bytes=case.chunk_bytes)[0].backward()
        assert torch.isfinite(hidden.grad).all()
    else:
        check_three_way(case)
    assert len(seen) == 3 and all(b == borrowed for b in seen), seen


def _lean(n, h, v, dtype=torch.bfloat16, needs=(True, True, False), master=False, sharded=False, **options):
    from fused_linear_ce.validate import Options

    p = planner.plan_loss(Options(**options), n, v, h, dtype, needs, master=master, sharded=sharded)
    return p.budget if p.mode == planner.LONG_CONTEXT else None


def test_long_context_default_takes_the_chunked_path_with_a_4bit_weight_remainder():
    """S4 (65536 x 4096 x 128256, bf16, the default options): where the recompute default would pair
    grad_hidden (four products), "auto" takes the chunked path (three) with grad_weight summed as a
    bf16 + 4-bit pair (V x H / 2 bytes: 250.5 MiB) and 1024-row chunks in the rest of the same
    DEFAULT_PAIRED_BYTES; with a bias gradient too (the recompute default would take two passes)."""
    from fused_linear_ce import plan
    from fused_linear_ce.validate import Options

    n, h, v = 65536, 4096, 128256
    budget = _lean(n, h, v)
    assert budget == backward_passes.DEFAULT_PAIRED_BYTES - v * h // 2
    assert plan.chunk_rows(n, v, torch.bfloat16, budget, 128) == 1024
    assert budget + v * h // 2 <= backward_passes.DEFAULT_PAIRED_BYTES
    assert _lean(n, h, v, needs=(True, True, True)) == budget
    # An explicit chunk_bytes is the whole budget, remainder included: more memory, longer chunks (at
    # 1 GiB the recompute path would hold its exact fp32 accumulator, 26% slower on the H200).
    for total, rows in ((512 << 20, 1024), (1 << 30, 3072), (1280 << 20, 4096), (1536 << 20, 5248)):
        got = _lean(n, h, v, chunk_bytes=total)
        assert got == total - v * h // 2 and plan.chunk_rows(n, v, torch.bfloat16, got, 128) == rows, total
    assert _lean(n, h, v, chunk_bytes=1 << 50) is None  # one chunk: no pair
    assert plan.plan_loss(Options(), n, v, h, torch.bfloat16, (True, True, False)).mode == plan.LONG_CONTEXT
    assert plan.plan_loss(Options(), n, v, h, torch.bfloat16, (True, True, False), sharded=True).mode == plan.RECOMPUTE


@pytest.mark.parametrize("why, n, h, v, kwargs", [
    ("fp16", 65536, 4096, 128256, dict(dtype=torch.float16)),
    ("fp32 master weight (its own fp32 accumulator)", 65536, 4096, 128256, dict(master=True)),
    ("vocabulary shard", 65536, 4096, 128256, dict(sharded=True)),
    ("a chunk_bytes with under 1024 rows beside the remainder", 65536, 4096, 128256, dict(chunk_bytes=256 << 20)),
    ("strategy chunked (int8 remainder)", 65536, 4096, 128256, dict(strategy="chunked")),
    ("strategy recompute", 65536, 4096, 128256, dict(strategy="recompute")),
    ("reduction none (not on the chunked path)", 65536, 4096, 128256, dict(reduction="none")),
    ("no weight gradient (one pass without accumulator)", 65536, 4096, 128256, dict(needs=(True, False, False))),
    ("S1: the hosted fp32 accumulator fits", 8192, 4096, 128256, {}),
    ("S3: the hosted fp32 accumulator fits", 16384, 2048, 151936, {}),
    ("V >= 2N: borrowed from grad_weight", 32768, 4096, 128256, {}),
    ("the remainder leaves under 1024 rows", 65536, 4096, 256000, {}),
])
def test_the_long_context_chunked_plan_applies_only_where_it_replaces_a_paired_or_two_pass_default(why, n, h, v, kwargs):
    assert _lean(n, h, v, **kwargs) is None, why


def test_the_long_context_chunked_path_sums_grad_weight_in_a_4bit_pair(monkeypatch):
    """The long-context plan on a small case (its budget, 48-row chunks here, 128 on the GPU, stands in
    for S4's 1024-row ones): eight chunks, each grad_weight product into the bf16 + 4-bit pair. Against the
    int8 pair (strategy="chunked", the same chunks): the loss and grad_hidden bit for bit (the pair
    is grad_weight's alone), grad_weight within 5% of its error against float64 (dropping the
    remainder doubles it: checked by mutation); and the whole against float64 as every path is
    (``check_three_way``)."""
    from cases import Case, check_three_way, long_context_at, make_inputs
    from fused_linear_ce import fused_linear_cross_entropy, reference

    rows = max(48, configs.sweep_config(torch.bfloat16, chunked=True).block_n)  # whole row blocks
    n, h, v = 8 * rows, 64, 320
    chunk = rows * v * 2
    lows = long_context_at(monkeypatch, chunk)  # the same rules as at S4, this budget
    case = Case(n, h, v, torch.bfloat16, "mean", ignored=0.1)
    hidden, weight, _, targets = make_inputs(case)
    runs = {}
    for name, kwargs in (("lean", {}), ("int8", dict(strategy="chunked", chunk_bytes=chunk))):
        x, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        loss = fused_linear_cross_entropy(x, w, targets, **kwargs)
        loss.backward()
        runs[name] = (loss, x.grad, w.grad)
    assert lows == [(torch.uint8, (v, h // 2), i > 0) for i in range(8)] + [
        (torch.int8, (v, h), i > 0) for i in range(8)]
    (loss, dx, dw), (loss8, dx8, dw8) = runs["lean"], runs["int8"]
    assert torch.equal(loss, loss8) and torch.equal(dx, dx8)
    # grad_weight against float64: the 4-bit pair's ~12 bits of each partial sum barely show behind
    # the final rounding to bf16 (measured on the interpreter: 1.897e-3 against 1.860e-3; the same
    # chunks summed in plain bf16 would drift, a pair whose remainder is dropped is that).
    xx, ww = hidden.double().requires_grad_(True), weight.double().requires_grad_(True)
    reference.linear_cross_entropy(xx, ww, targets, compute_dtype=torch.float64).backward()
    exact = ww.grad.cpu()
    err, err8 = (((t.double().cpu() - exact).norm() / exact.norm()).item() for t in (dw, dw8))
    assert err <= 1.05 * err8, (err, err8)
    # Entry by entry: mostly the same bits; one ulp apart where the sum lies near a tie (measured
    # 5.4%); more only where an entry cancels to far below its partial sums (measured 0.4%: the
    # pair's 2^-12 is of the partial sums).
    ordinal = [torch.where(b >= 0, b, -(b & 0x7FFF)) for b in (t.cpu().view(torch.int16).int() for t in (dw, dw8))]
    ulps = (ordinal[0] - ordinal[1]).abs()
    assert (ulps > 0).float().mean() <= 0.1 and (ulps > 1).float().mean() <= 0.01, torch.bincount(ulps.flatten())
    lows.clear()
    check_three_way(case)
    assert [lo[0] for lo in lows] == [torch.uint8] * 8


def _planner_entries(call) -> list:
    """The functions of plan.py that ``call`` enters from outside plan.py (a profiler hook)."""
    import sys

    path, entries = planner.__file__, []

    def hook(frame, event, arg):
        if event == "call" and frame.f_code.co_filename == path and frame.f_back.f_code.co_filename != path:
            entries.append(frame.f_code.co_name)

    sys.setprofile(hook)
    try:
        call()
    finally:
        sys.setprofile(None)
    return entries


@pytest.mark.parametrize("call", ["auto", "recompute", "chunked", "per-token", "divergence"])
def test_each_call_asks_the_planner_once(call):
    """A forward and backward enter plan.py once, at the public call: the ops, their fake
    implementations, their autograd and the executors read the plan they are given."""
    from conftest import DEVICE
    from fused_linear_ce import fused_linear_cross_entropy, fused_linear_divergence, fused_linear_logprobs

    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(40, 32, generator=g).to(DEVICE).requires_grad_(True)
    weight = (torch.randn(300, 32, generator=g) * 0.3).to(DEVICE).requires_grad_(True)
    targets = torch.randint(0, 300, (40,), generator=g).to(DEVICE)

    def run():
        if call == "per-token":
            out = fused_linear_logprobs(hidden, weight, targets, outputs=("log_probs", "entropy"))
            loss = out["log_probs"].sum() + out["entropy"].sum()
        elif call == "divergence":
            loss = fused_linear_divergence(hidden, weight, hidden.detach() * 0.5, weight.detach(), beta=0.5)
        else:
            loss = fused_linear_cross_entropy(hidden, weight, targets, strategy=call)
        loss.backward()

    run()  # compiled first
    want = {"per-token": "plan_tokens", "divergence": "plan_divergence"}.get(call, "plan_loss")
    assert _planner_entries(run) == [want]
