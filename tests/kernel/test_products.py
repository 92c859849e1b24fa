"""Who runs the gradient products (``products``), and that every runner sums in fp32 and rounds once
without touching torch's process-wide cuBLAS flags (cuBLAS only ever writes fp32 results here)."""

import dataclasses

import pytest
import torch

from conftest import DEVICE, ON_GPU, KernelSpy
from fused_linear_ce import configs, fused_linear_cross_entropy, gemm, products

pytestmark = pytest.mark.tier  # the GPU tier: every test of this file

FLAGS = ("allow_bf16_reduced_precision_reduction", "allow_fp16_reduced_precision_reduction")


def _operands(m, k, p, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(m, k, generator=g).to(dtype).to(DEVICE)
    b = torch.randn(k, p, generator=g).to(dtype).to(DEVICE)
    return a, b


def _out(a, b):
    return torch.empty((a.shape[0], b.shape[1]), dtype=a.dtype, device=a.device)


def _beyond_one_rounding(got, a, b, factor=1.0):
    """How far ``got`` is from the float64 product (a @ b) * factor beyond half a bf16 ulp, in units of the l2
    norm of each output's K terms. An fp32 sum of the terms (any order) stays near 2^-24 of that
    norm; bf16 partial sums (a split-K reduction rounded to the output type) reach ~2^-9."""
    a, b = a.double(), b.double()
    want = (a @ b) * factor
    binade = torch.exp2(torch.floor(torch.log2(want.abs().clamp_min(1e-30))))
    half_ulp = binade * 2.0**-8
    terms = torch.sqrt((a * a) @ (b * b)) * abs(factor)
    return (((got.double() - want).abs() - half_ulp).clamp_min(0) / terms).max().item()


@pytest.mark.parametrize("transposed", [False, True], ids=["rows", "a-transposed"])
def test_bf16_product_is_the_exact_sum_rounded_once(transposed):
    """A long reduction (k = 4096): the result is the float64 product rounded once to bf16, up to
    the fp32 summation's own error (bf16 partial sums would be ~1000x further off)."""
    a, b = _operands(48, 4096, 40, torch.bfloat16)
    if transposed:  # grad_weight's product reads da^T
        a = a.t().contiguous().t()
    got = _out(a, b)
    products.product(a, b, got, False)
    assert got.dtype == torch.bfloat16 and got.shape == (48, 40)
    assert _beyond_one_rounding(got, a, b) <= 2.0**-16
    out = torch.empty(48, 40, dtype=torch.bfloat16, device=DEVICE)
    products.product(a, b, out, False)
    assert torch.equal(out, got)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_products_send_fp16_and_fp32_to_the_package_matmul(dtype, monkeypatch):
    """fp32 through cuBLAS would follow the user's TF32 switch; a 16-bit result that fills the GPU
    goes to the matmul too (``few_tiles`` patched off: these operands are one tile)."""
    monkeypatch.setattr(gemm, "few_tiles", lambda a, b: False)
    calls = []
    real = gemm.matmul
    monkeypatch.setattr(gemm, "matmul", lambda *args: calls.append(args) or real(*args))
    a, b = _operands(16, 64, 24, dtype)
    got = _out(a, b)
    products.product(a, b, got, False)
    assert len(calls) == 1
    torch.testing.assert_close(got.double(), a.double() @ b.double(), rtol=2e-3, atol=2e-3)


@pytest.fixture
def flags_read_only(monkeypatch):
    """Fails on any write to torch's cuBLAS matmul settings (process-wide: saving, setting and
    restoring them around a call races with other threads and can leave the user's value changed)."""
    module = type(torch.backends.cuda.matmul)
    real = module.__setattr__

    def refuse(self, name, value):
        raise AssertionError(f"a product wrote torch.backends.cuda.matmul.{name}")

    for f in FLAGS:  # the default, under which cuBLAS may round split-K partial sums to bf16
        real(torch.backends.cuda.matmul, f, True)
    monkeypatch.setattr(module, "__setattr__", refuse)
    yield
    monkeypatch.setattr(module, "__setattr__", real)
    assert all(getattr(torch.backends.cuda.matmul, f) for f in FLAGS)


def test_no_product_touches_the_global_matmul_flags(flags_read_only):
    a, b = _operands(16, 64, 24, torch.bfloat16)
    acc = torch.zeros(16, 24, device=DEVICE)
    third = torch.tensor([1.0 / 3.0], device=DEVICE)
    products.product(a, b, _out(a, b), False)
    products.product(a, b, _out(a, b), False, third)
    products.rows_product(a, b, _out(a, b), third)
    products.rows_product(a, b, _out(a, b), None)
    products.accumulate(a, b, acc, True)
    products.accumulate(a, b, acc, False)


@pytest.mark.parametrize("strategy", ["recompute", "chunked"])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_a_training_step_leaves_the_global_matmul_flags_alone(strategy, reduction, flags_read_only):
    """Every path of a bf16 step, products summed in fp32 and rounded once, with torch's default
    flags left as they are (and never written)."""
    if strategy == "chunked" and reduction == "none":
        pytest.skip("the chunked path does not take reduction='none'")
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(40, 48, generator=g).bfloat16().to(DEVICE).requires_grad_(True)
    weight = (torch.randn(300, 48, generator=g) * 0.3).bfloat16().to(DEVICE).requires_grad_(True)
    targets = torch.randint(0, 300, (40,), generator=g).to(DEVICE)
    for chunk_bytes in (None, 40 * 64 * 2):  # one block, and many (fp32 accumulators)
        loss = fused_linear_cross_entropy(hidden, weight, targets, reduction=reduction, strategy=strategy,
                                          chunk_bytes=chunk_bytes)
        loss.sum().backward()


@pytest.mark.skipif(not ON_GPU, reason="threads of Triton interpreter kernels are not the GPU's concurrency")
def test_threads_computing_losses_at_once_get_the_serial_results():
    """Eight threads, each its own loss and gradients (as DataParallel replicas do): the same bits
    as one after the other, and the user's flags unchanged."""
    import threading

    before = tuple(getattr(torch.backends.cuda.matmul, f) for f in FLAGS)
    g = torch.Generator().manual_seed(1)
    inputs = [(torch.randn(256, 512, generator=g).bfloat16().to(DEVICE),
               (torch.randn(4000, 512, generator=g) * 0.05).bfloat16().to(DEVICE),
               torch.randint(0, 4000, (256,), generator=g).to(DEVICE)) for _ in range(8)]

    def step(h, w, t):
        h, w = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
        loss = fused_linear_cross_entropy(h, w, t, reduction="none")
        loss.sum().backward()
        return loss.detach(), h.grad, w.grad

    serial = [step(*x) for x in inputs]
    results = [None] * len(inputs)

    def worker(i):
        with torch.cuda.stream(torch.cuda.Stream()):
            results[i] = step(*inputs[i])
        torch.cuda.current_stream().synchronize()

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(inputs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    torch.cuda.synchronize()
    for got, want in zip(results, serial):
        for a, b in zip(got, want):
            assert torch.equal(a, b)
    assert tuple(getattr(torch.backends.cuda.matmul, f) for f in FLAGS) == before


def test_rows_product_rounds_once_with_or_without_a_factor():
    a, b = _operands(32, 2048, 40, torch.bfloat16)
    out = torch.empty(32, 40, dtype=torch.bfloat16, device=DEVICE)
    products.rows_product(a, b, out, None)
    assert _beyond_one_rounding(out, a, b) <= 2.0**-16
    third = torch.tensor([1.0 / 3.0], device=DEVICE)
    products.rows_product(a, b, out, third)
    assert _beyond_one_rounding(out, a, b, 1.0 / 3.0) <= 2.0**-16


class _MatmulSpy:
    """Wraps ``matmul_kernel`` and records each launch's TMA flags."""

    def __init__(self, kernel):
        self.kernel, self.flags = kernel, []

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            self.flags.append((kwargs["TMA"], kwargs["A_T"], kwargs["B_T"]))
            return self.kernel[grid](*args, **kwargs)

        return run


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("a_t", [False, True], ids=["a-rows", "a-transposed"])
@pytest.mark.parametrize("b_t", [False, True], ids=["b-rows", "b-transposed"])
def test_matmul_through_tma_descriptors_is_the_sum_rounded_once(dtype, a_t, b_t, monkeypatch):
    """The Triton matmul with a factor (the products that carry the mean's 1/count) loads both
    operands through TMA descriptors over their storage, row-major or transposed (grad_weight's da^T
    is da read by columns). Ragged M, K and P (blocks past the edges load as 0): the float64 product
    times the factor, rounded once. fp32 accumulation and the factor applied before the rounding."""
    if ON_GPU and not configs.tma_hardware(torch.device(DEVICE)):
        pytest.skip("this GPU has no TMA hardware (compute capability < 9.0)")
    spy = _MatmulSpy(gemm.matmul_kernel)
    monkeypatch.setattr(gemm, "matmul_kernel", spy)
    a, b = _operands(200, 328, 88, dtype, seed=3)
    if a_t:
        a = a.t().contiguous().t()
    if b_t:
        b = b.t().contiguous().t()
    out = torch.empty(200, 88, dtype=dtype, device=DEVICE)
    third = torch.tensor([1.0 / 3.0], device=DEVICE)
    gemm.matmul(a, b, out, False, third)
    assert spy.flags == [(True, a_t, b_t)]
    assert _beyond_one_rounding(out, a, b, 1.0 / 3.0) <= 2.0**-16
    # Accumulating into fp32 adds to what is there.
    acc = torch.ones(200, 88, dtype=torch.float32, device=DEVICE)
    gemm.matmul(a, b, acc, True)
    want = a.double() @ b.double() + 1.0
    assert ((acc.double() - want).abs() / (a.double().abs() @ b.double().abs() + 1.0)).max() < 2.0**-20


def test_matmul_takes_pointer_loads_where_tma_does_not_apply(monkeypatch):
    """A row stride of 70 bf16 elements (140 bytes, not a multiple of 16) in A, fp32 on the GPU, or a
    config without TMA: pointer loads, the sum rounded once all the same."""
    spy = _MatmulSpy(gemm.matmul_kernel)
    monkeypatch.setattr(gemm, "matmul_kernel", spy)
    a, b = _operands(48, 70, 40, torch.bfloat16, seed=4)  # a: contiguous 140-byte rows
    out = torch.empty(48, 40, dtype=torch.bfloat16, device=DEVICE)
    gemm.matmul(a, b, out, False)
    assert spy.flags[-1][0] is False
    assert _beyond_one_rounding(out, a, b) <= 2.0**-16
    aligned = torch.zeros(48, 72, dtype=torch.bfloat16, device=DEVICE)
    aligned[:, :70] = a  # a view with 144-byte rows: TMA
    gemm.matmul(aligned[:, :70], b, out, False)
    assert spy.flags[-1][0] is True and _beyond_one_rounding(out, a, b) <= 2.0**-16
    a32, b32 = _operands(48, 64, 40, torch.float32, seed=5)
    gemm.matmul(a32, b32, torch.empty(48, 40, device=DEVICE), False)
    assert spy.flags[-1][0] is (not ON_GPU)  # fp32 keeps pointer loads on the GPU (NOTES v12)
    again = torch.empty_like(out)
    with configs.override(each=lambda cfg: dataclasses.replace(cfg, tma=False)):
        gemm.matmul(aligned[:, :70], b, again, False)
    assert spy.flags[-1][0] is False and _beyond_one_rounding(again, a, b) <= 2.0**-16


def test_product_with_a_factor_rounds_once_with_or_without_tma(monkeypatch):
    """A bf16 product with a factor (the mean's 1/count) applies it in the matmul's epilogue, one
    rounding, whether the matmul loads through TMA (aligned rows) or through pointers."""
    if ON_GPU and not configs.tma_hardware(torch.device(DEVICE)):
        pytest.skip("this GPU has no TMA hardware (compute capability < 9.0)")
    spy = _MatmulSpy(gemm.matmul_kernel)
    monkeypatch.setattr(gemm, "matmul_kernel", spy)
    monkeypatch.setattr(gemm, "few_tiles", lambda a, b: False)  # one tile here: as if it filled the GPU
    third = torch.tensor([1.0 / 3.0], device=DEVICE)
    out = torch.empty(64, 40, dtype=torch.bfloat16, device=DEVICE)
    for k, tma in ((200, True), (198, False)):  # a: 400-byte rows, then 396-byte rows (no TMA layout)
        a, b = _operands(64, k, 40, torch.bfloat16, seed=6)
        products.product(a, b, out, False, third)
        assert spy.flags[-1] == (tma, False, False)
        assert _beyond_one_rounding(out, a, b, 1.0 / 3.0) <= 2.0**-16


def test_a_product_with_few_output_tiles_goes_to_cublas_with_an_fp32_result_and_rounds_once(monkeypatch):
    """Few output tiles (under half the SMs) with a long K: the Triton matmul would leave most of the
    GPU idle, so a 16-bit product runs on cuBLAS with an fp32 result and one ``scale``, with or
    without a factor. (On the CPU ``few_tiles`` is never true: patched here.)"""
    spy = _MatmulSpy(gemm.matmul_kernel)
    monkeypatch.setattr(gemm, "matmul_kernel", spy)
    monkeypatch.setattr(gemm, "few_tiles", lambda a, b: True)
    third = torch.tensor([1.0 / 3.0], device=DEVICE)
    a, b = _operands(64, 198, 40, torch.bfloat16, seed=7)  # no TMA layout either
    for factor in (1.0 / 3.0, None):
        out = torch.empty(64, 40, dtype=torch.bfloat16, device=DEVICE)
        products.product(a, b, out, False, third if factor else None)
        assert _beyond_one_rounding(out, a, b, factor or 1.0) <= 2.0**-16
    assert spy.flags == []


def test_few_tiles_counts_the_matmul_output_tiles_against_the_sms():
    """S2's chunked grad_hidden at 256 MiB (512 rows x H 2304: 36 tiles of 128 x 256) is few on an
    H200 (132 SMs); S1's (1024 x 4096: 128 tiles) is not; nothing is on the CPU."""
    if not ON_GPU:
        a, b = _operands(8, 16, 8, torch.bfloat16)
        assert not gemm.few_tiles(a, b)
        return
    one = torch.zeros((1, 1), dtype=torch.bfloat16, device=DEVICE)
    sms = configs.sm_count(one.device)
    cfg = configs.matmul_config(torch.bfloat16)
    for m, p in ((512, 2304), (1024, 4096), (128, 256)):
        tiles = -(-m // cfg.block_m) * -(-p // cfg.block_p)
        got = gemm.few_tiles(one.expand(m, 1000), one.expand(1000, p))
        assert got == (2 * tiles < sms)


@pytest.mark.parametrize("accumulate", [False, True], ids=["bf16-result", "fp32-sum"])
def test_a_plain_result_through_a_descriptor_is_the_pointer_result(accumulate, monkeypatch):
    """A config with ``c_tma`` (the shipped 16-bit one) reads and writes a contiguous plain result
    through a tensor descriptor (no 2-D tile of pointers in the epilogue): the same bits as the
    pointer epilogue, ragged M and P past the block edges, nothing written outside the result (a
    row slice of a larger buffer), and a non-contiguous result still through pointers."""
    if ON_GPU and not configs.tma_hardware(torch.device(DEVICE)):
        pytest.skip("this GPU has no TMA hardware (compute capability < 9.0)")
    spy = KernelSpy(gemm.matmul_kernel)
    monkeypatch.setattr(gemm, "matmul_kernel", spy)
    a, b = _operands(100, 200, 88, torch.bfloat16, seed=7)
    third = torch.tensor([1.0 / 3.0], device=DEVICE)
    dtype = torch.float32 if accumulate else torch.bfloat16

    def run(c_tma):
        buffer = torch.full((140, 88), 7.0, dtype=dtype, device=DEVICE)
        out = buffer[20:120]  # rows 20..119: contiguous, its neighbours must stay 7
        with configs.override(each=lambda cfg: dataclasses.replace(cfg, c_tma=c_tma)
                              if isinstance(cfg, configs.MatmulConfig) else cfg):
            gemm.matmul(a, b, out, accumulate, third)
        return buffer

    by_pointers, by_descriptor = run(False), run(True)
    assert [s["C_TMA"] for s in spy.launches] == [False, True]
    assert torch.equal(by_descriptor, by_pointers)
    assert (by_descriptor[:20] == 7).all() and (by_descriptor[120:] == 7).all()
    want = (a.double() @ b.double()) / 3.0 + (7.0 if accumulate else 0.0)
    assert ((by_descriptor[20:120].double() - want).abs() / (want.abs() + 1.0)).max() < 2.0**-7
    strided = torch.empty(88, 100, dtype=dtype, device=DEVICE).t()  # not contiguous: pointers
    gemm.matmul(a, b, strided, False, third)
    assert spy.launches[-1]["C_TMA"] is False



def test_a_product_split_in_two_k_halves_sums_in_fp32_and_rounds_once(monkeypatch):
    """Where twice the output tiles fill the GPU's waves better (``split_k``), a 16-bit product runs
    as two K halves added into an fp32 buffer of zeros, then one ``scale`` with the factor: the
    float64 product rounded once, the same bits on every run (two atomic adds onto 0 commute), and
    no cuBLAS. (On the CPU ``split_k`` is never 2: patched here.)"""
    spy = _MatmulSpy(gemm.matmul_kernel)
    monkeypatch.setattr(gemm, "matmul_kernel", spy)
    monkeypatch.setattr(gemm, "split_k", lambda a, b: 2)
    monkeypatch.setattr(gemm, "few_tiles", lambda a, b: False)  # one tile here: as if it filled the GPU
    monkeypatch.setattr(products, "accumulate", lambda *a, **k: pytest.fail("cuBLAS ran"))
    third = torch.tensor([1.0 / 3.0], device=DEVICE)
    a, b = _operands(100, 1100, 72, torch.bfloat16, seed=8)  # ragged tiles, K steps an odd count
    for factor in (1.0 / 3.0, None):
        out = torch.empty(100, 72, dtype=torch.bfloat16, device=DEVICE)
        products.product(a, b, out, False, third if factor else None, may_split=True)
        assert _beyond_one_rounding(out, a, b, factor or 1.0) <= 2.0**-16
        again = torch.empty_like(out)
        products.product(a, b, again, False, third if factor else None, may_split=True)
        assert torch.equal(again, out)
    assert len(spy.flags) == 4
    # Only where the caller allows it (the chunked path's grad_hidden): no fp32 buffer elsewhere.
    zeros = torch.zeros
    monkeypatch.setattr(torch, "zeros", lambda *a, **k: pytest.fail("an fp32 buffer for a split product"))
    products.product(a, b, out, False, third)
    monkeypatch.setattr(torch, "zeros", zeros)
    assert _beyond_one_rounding(out, a, b, 1.0 / 3.0) <= 2.0**-16
    # Each half alone is half of the sum: neither half's programs run the whole K loop.
    half = torch.zeros(100, 72, device=DEVICE)
    gemm.matmul(a[:, :550], b[:550], half, False)
    both = torch.zeros(100, 72, device=DEVICE)
    gemm.matmul(a, b, both, False, split=2)
    assert (both - half).abs().max() > 0 and _beyond_one_rounding(both.bfloat16(), a, b) <= 2.0**-16


def test_split_k_counts_how_full_the_waves_are():
    """S2's one-chunk grad_hidden (8192 x 2304, K = 256000: 576 tiles, 87% of 5 waves of 132 SMs)
    is split; S1's and S3's (1024 tiles, 97%) and a short K are not; nothing is on the CPU."""
    if not ON_GPU:
        a, b = _operands(8, 16, 8, torch.bfloat16)
        assert gemm.split_k(a, b) == 1
        return
    one = torch.zeros((1, 1), dtype=torch.bfloat16, device=DEVICE)
    sms = configs.sm_count(one.device)
    cfg = configs.matmul_config(torch.bfloat16)
    for m, k, p in ((8192, 256000, 2304), (8192, 128256, 4096), (16384, 151936, 2048), (8192, 4096, 2304)):
        tiles = -(-m // cfg.block_m) * -(-p // cfg.block_p)
        fill = lambda t: t / (-(-t // sms) * sms)  # noqa: E731
        want = 2 if k >= 2 * gemm.MIN_SPLIT_STEPS * cfg.block_k and fill(2 * tiles) >= fill(tiles) + 0.05 else 1
        assert gemm.split_k(one.expand(m, k), one.expand(k, p)) == want
    if sms == 132:  # the H200's: the cases named above
        assert gemm.split_k(one.expand(8192, 256000), one.expand(256000, 2304)) == 2
        assert gemm.split_k(one.expand(8192, 128256), one.expand(128256, 4096)) == 1


@pytest.mark.parametrize("h, v, allowed", [(16, 600, True), (32, 600, False)], ids=["small-h", "large-h"])
def test_the_chunked_grad_hidden_alone_may_split_where_its_buffer_is_small(h, v, allowed, monkeypatch):
    """The chunked path's grad_hidden ((R, V) @ (V, H)) may run in two K halves (an fp32 (R, H)
    buffer) only where that buffer is at most 1/16 of the chunk's (R, V) one: 32 H <= V. Its
    grad_weight product never, nor any other product."""
    calls = []
    real = products.product

    def spy(a, b, out, accumulate, unscale=None, may_split=False):
        calls.append((tuple(a.shape), may_split))
        return real(a, b, out, accumulate, unscale, may_split)

    monkeypatch.setattr(products, "product", spy)
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(40, h, generator=g).bfloat16().to(DEVICE).requires_grad_(True)
    weight = (torch.randn(v, h, generator=g) * 0.2).bfloat16().to(DEVICE).requires_grad_(True)
    targets = torch.randint(0, v, (40,), generator=g).to(DEVICE)
    fused_linear_cross_entropy(hidden, weight, targets, strategy="chunked").backward()
    assert ((40, v), allowed) in calls  # grad_hidden
    assert all(not split for shape, split in calls if shape != (40, v))
