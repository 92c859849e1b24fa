"""fp32 master weights under ``torch.autocast``: an fp32 lm-head weight with 16-bit activations (a
``Trainer`` with ``bf16=True`` on an fp32 model) is cast inside the op, and its gradient is summed in
fp32 straight into the fp32 result: no 16-bit weight gradient, no V x H accumulator beside it, and
"auto" takes the three-product chunked path at any N.

Checked against float64 of the same rounded operands: the loss and the hidden gradient are those of
casting the weight first (bit for bit: the same products in the same order); the weight gradient is
strictly more exact than the cast path's on both paths (one rounding of da, none of the sum). The
per-token function (``fused_linear_logprobs``) and TRL's drop-in take the same master weight. bf16
on CPU runs through the kernels' BF16_EMULATION switch (operands upcast to fp32 before ``tl.dot``,
exact; fp32 -> bf16 rounding to nearest even on the bits): see ``tests/kernel/test_bf16_emulation.py``
for why that cover is faithful. fp16 needs none.
"""

import pytest
import torch
import torch.nn.functional as F
import triton

from conftest import DEVICE, ON_GPU, rel_err
from fused_linear_ce import ChunkedLogProbFunction, chunked, configs, fused_linear_cross_entropy, fused_linear_logprobs
from fused_linear_ce import products
from fused_linear_ce import plan as plan_module
from fused_linear_ce.validate import Options

MiB = 1 << 20
N, H, V = 200, 48, 320


def _problem(seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, H, generator=g).to(DEVICE)
    weight = (0.3 * torch.randn(V, H, generator=g)).to(DEVICE)
    targets = torch.randint(0, V, (N,), generator=g).to(DEVICE)
    targets[::7] = -100
    return hidden, weight, targets


def _reference(hidden, weight, targets, dtype, upstream):
    """float64 loss and gradients of the operands rounded to ``dtype`` (what the products see)."""
    h = hidden.to(dtype).double().requires_grad_(True)
    w = weight.to(dtype).double().requires_grad_(True)
    loss = F.cross_entropy(h @ w.T, targets)
    (loss * upstream).backward()
    return loss.detach(), h.grad, w.grad


def _run(hidden, weight, targets, dtype, upstream, cast_first, **kwargs):
    h = hidden.clone().requires_grad_(True)
    w = weight.clone().requires_grad_(True)
    with torch.autocast(DEVICE.type, dtype=dtype):
        loss = fused_linear_cross_entropy(h, w.to(dtype) if cast_first else w, targets, **kwargs)
    (loss * upstream).backward()
    return loss.detach(), h.grad, w.grad


# chunk_bytes of 64 rows: several chunks on the chunked path, several blocks on the recompute path.
SETTINGS = {"one": None, "chunks": 64 * V * 2}


@pytest.mark.parametrize("setting", SETTINGS)
@pytest.mark.parametrize("strategy", ["auto", "chunked", "recompute"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_fp32_weight_gradient_is_fp32_and_at_least_as_exact_as_casting_first(dtype, strategy, setting):
    hidden, weight, targets = _problem()
    upstream = 3.0  # not a power of two: the backward's scaling is a real multiplication
    kwargs = dict(strategy=strategy, chunk_bytes=SETTINGS[setting])
    loss, dx, dw = _run(hidden, weight, targets, dtype, upstream, cast_first=False, **kwargs)
    loss_c, dx_c, dw_c = _run(hidden, weight, targets, dtype, upstream, cast_first=True, **kwargs)
    ref_loss, ref_dx, ref_dw = _reference(hidden, weight, targets, dtype, upstream)

    assert dw.dtype == torch.float32 and dx.dtype == torch.float32
    assert torch.equal(loss, loss_c)
    if not (strategy == "auto" and setting == "chunks"):  # there the cast-first call takes the recompute path
        assert torch.equal(dx, dx_c)
    assert abs(loss.double() - ref_loss).item() < 1e-5
    err, err_cast = rel_err(dw, ref_dw), rel_err(dw_c, ref_dw)
    # Both paths: da rounded once, the products summed in fp32 and never rounded to 16 bits.
    assert err < 0.85 * err_cast, f"master {err:.2e} against cast-first {err_cast:.2e}"
    assert rel_err(dx, ref_dx) < (4e-3 if dtype == torch.bfloat16 else 1e-3)


# (the first chunk's targets' class weight, the others', other options): the largest B in the first
# chunk only, by 4x and by 10^6; "sum" with label smoothing, whose B is (1 - eps) w[t] and whose factor
# is the upstream gradient itself.
FACTOR_CASES = {"mean": (2.0, 0.5, {}), "wide": (1e3, 1e-3, {}),
                "sum-smoothed": (2.0, 0.5, dict(reduction="sum", label_smoothing=0.1))}


@pytest.mark.parametrize("case", FACTOR_CASES)
@pytest.mark.parametrize("strategy", ["chunked", "recompute"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_weight_gradient_summed_over_token_blocks_gets_its_factor_once(monkeypatch, dtype, strategy, case):
    """With bf16 products, a master weight's dW summed over token chunks (chunked path) or token
    blocks (recompute path) goes through ``products.accumulate`` unscaled (cuBLAS with an fp32 result
    on the GPU), the first product writing, the rest adding, and is scaled once at the end; so every
    chunk must share one factor. Class weights whose largest value differs between the chunks (each
    chunk's own ``losses.normalize`` divisor would differ) check that it does: dW stays strictly
    closer to float64 than casting first, as with fp16, whose chunked products keep applying each
    chunk's factor (its lift out of the subnormals is per chunk)."""
    first, rest, options = FACTOR_CASES[case]
    hidden, weight, targets = _problem()
    class_weight = torch.full((V,), rest)
    class_weight[targets[:64].clamp(min=0)] = first  # the first chunk's rows weigh more than the rest's
    class_weight = class_weight.to(DEVICE)
    calls = []
    original = products.accumulate

    def spy(a, b, acc, first):
        calls.append((tuple(acc.shape), acc.dtype, first))
        return original(a, b, acc, first)

    monkeypatch.setattr(products, "accumulate", spy)
    budget = 64 * V * 2  # several 64-row chunks; on the recompute path a token plan (fp16, a master weight)
    kwargs = dict(strategy=strategy, chunk_bytes=budget, class_weight=class_weight, **options)
    if strategy == "recompute" and dtype == torch.bfloat16:
        kwargs["chunk_bytes"] = 64 * V * 2 + 4 * N * H  # no room for the pair: the master weight's token plan
    _, dx, dw = _run(hidden, weight, targets, dtype, 3.0, cast_first=False, **kwargs)
    weight_sums = [c for c in calls if c[0] == (V, H)]
    monkeypatch.setattr(products, "accumulate", original)
    _, _, dw_c = _run(hidden, weight, targets, dtype, 3.0, cast_first=True, **kwargs)

    h = hidden.to(dtype).double().requires_grad_(True)
    w = weight.to(dtype).double().requires_grad_(True)
    (3.0 * F.cross_entropy(h @ w.T, targets, weight=class_weight.double(), **options)).backward()
    assert dw.dtype == torch.float32
    err, err_cast = rel_err(dw, w.grad), rel_err(dw_c, w.grad)
    assert err < 0.85 * err_cast, f"master {err:.2e} against cast-first {err_cast:.2e}"
    assert rel_err(dx, h.grad) < (4e-3 if dtype == torch.bfloat16 else 1e-3)
    if dtype == torch.bfloat16 or strategy == "recompute":
        assert len(weight_sums) > 1, calls  # one a token chunk or block
        assert [first for *_, first in weight_sums] == [True] + [False] * (len(weight_sums) - 1)
        assert all(dt == torch.float32 for _, dt, _ in weight_sums)
    else:
        assert weight_sums == []  # fp16 chunks: each product applies its own chunk's factor


def test_auto_takes_the_chunked_path_for_a_master_weight_at_any_n(monkeypatch):
    """With a 64-row chunk the whole (N, V) gradient does not fit, so a 16-bit weight goes to the
    recompute path; an fp32 master weight costs the chunked path no V x H accumulator and goes there."""
    hidden, weight, targets = _problem()
    budget = SETTINGS["chunks"]
    calls = []
    original = chunked.forward

    def spy(*args, **kwargs):
        calls.append(kwargs.get("dw_dtype"))
        return original(*args, **kwargs)

    monkeypatch.setattr(chunked, "forward", spy)
    cfg = configs.sweep_config(torch.bfloat16, chunked=True)
    assert plan_module.chunk_rows(N, V, torch.bfloat16, budget, cfg.block_n) < N  # several chunks
    _run(hidden, weight, targets, torch.bfloat16, 1.0, cast_first=True, chunk_bytes=budget)
    assert calls == []
    _run(hidden, weight, targets, torch.bfloat16, 1.0, cast_first=False, chunk_bytes=budget)
    assert calls == [torch.float32]


def test_master_gradient_accumulates_into_grad_and_refuses_a_second_backward():
    """Two micro-batches accumulate into ``.grad`` (the first gradient is stolen, the second added);
    the fp32 gradient was scaled in place, so a second backward through the same graph raises
    (naming strategy="recompute") instead of scaling it twice."""
    hidden, weight, targets = _problem()
    batches = [_problem(seed)[0] for seed in (1, 2)]
    alone = [_run(h, weight, targets, torch.bfloat16, 1.0, cast_first=False)[2] for h in batches]
    w = weight.clone().requires_grad_(True)
    for h in batches:
        with torch.autocast(DEVICE.type, dtype=torch.bfloat16):
            fused_linear_cross_entropy(h, w, targets).backward()
        if h is batches[0]:
            first = w.grad
            assert torch.equal(first, alone[0])
    assert w.grad is first  # accumulated into, not replaced
    assert torch.equal(w.grad, alone[0] + alone[1])
    w2 = weight.clone().requires_grad_(True)
    with torch.autocast(DEVICE.type, dtype=torch.bfloat16):
        loss = fused_linear_cross_entropy(hidden, w2, targets)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match=r'second backward through the same graph.*strategy="recompute"'):
        loss.backward()


@pytest.mark.parametrize("per_token", [False, True], ids=["loss", "per-token"])
def test_compiles_without_a_graph_break_under_autocast(per_token):
    hidden, weight, targets = _problem()

    def step(h, w):
        with torch.autocast(DEVICE.type, dtype=torch.bfloat16):
            if per_token:  # the recompute path in blocks (its exponentials do not fit the budget)
                out = fused_linear_logprobs(h, w, targets, outputs=("log_probs", "entropy"),
                                            chunk_bytes=SETTINGS["chunks"])
                return -(3 * out["log_probs"]).sum() + out["entropy"].sum()
            return fused_linear_cross_entropy(h, w, targets, chunk_bytes=SETTINGS["chunks"])

    compiled = torch.compile(step, fullgraph=True)
    got, want = [], []
    for fn, out in ((compiled, got), (step, want)):
        h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        loss = fn(h, w)
        loss.backward()
        out.extend([loss.detach(), h.grad, w.grad])
    assert got[2].dtype == torch.float32
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


@pytest.mark.skipif(not ON_GPU, reason="GPU memory")
@pytest.mark.tier
def test_extra_memory_is_the_weight_copy_and_the_chunk():
    """N = 8192, H = 2048, V = 32000, fp32 weight under bf16 autocast, several 32 MiB chunks: the peak
    above the inputs and the fp32 gradients is the bf16 copy of the weight the products read (what
    autocast keeps too), the chunk's buffer and N-sized tensors, while the fp32 weight gradient is
    summed during the forward. (Casting first peaks about as high: on the H200 162 MiB here against
    125, its bf16 gradient and int8 remainder in the forward and the fp32 copy in the backward;
    what the master weight saves is the recompute path's extra products at long N and the 16-bit
    rounding of the weight gradient, tests above.)"""
    n, h, v = 8192, 2048, 32000
    g = torch.Generator(device="cuda").manual_seed(0)
    hidden = torch.randn(n, h, device="cuda", generator=g)
    weight = 0.02 * torch.randn(v, h, device="cuda", generator=g)
    targets = torch.randint(0, v, (n,), device="cuda", generator=g)
    budget = 32 * MiB

    def extra(cast_first):  # peak above the inputs and the fp32 gradients, MiB
        hh, ww = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        for _ in range(2):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = fused_linear_cross_entropy(hh, ww.to(torch.bfloat16) if cast_first else ww, targets,
                                                  chunk_bytes=budget, strategy="chunked")
            loss.backward()
            hh.grad = ww.grad = None
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = fused_linear_cross_entropy(hh, ww.to(torch.bfloat16) if cast_first else ww, targets,
                                              chunk_bytes=budget, strategy="chunked")
        loss.backward()
        torch.cuda.synchronize()
        return (torch.cuda.max_memory_allocated() - base - hh.grad.nbytes - ww.grad.nbytes) / MiB

    master = extra(False)
    copy = v * h * 2 / MiB
    # The chunk (32 MiB), its per-tile statistics, the bf16 hidden copy (32 MiB) and its bf16
    # gradient (32 MiB), O(N) vectors, allocator rounding. Measured 37 MiB beyond the copy.
    assert master <= copy + 160, f"{master - copy:.0f} MiB beyond the weight copy"
    # Not vacuous: a 16-bit weight gradient (125 MiB) or an fp32 V x H accumulator (250) would not fit.
    assert master < copy + v * h * 2 / MiB


def _logprob_reference(hidden, weight, targets, dtype, bias=None):
    """float64 per-token log-probs and entropy of the operands rounded to ``dtype``, and the
    gradients of ``-sum(3 * log_probs) + sum(entropy)`` (per-row upstream gradients, not a mean)."""
    h = hidden.to(dtype).double().requires_grad_(True)
    w = weight.to(dtype).double().requires_grad_(True)
    z = h @ w.T + (bias.to(dtype).double() if bias is not None else 0.0)
    lp = torch.log_softmax(z, -1)
    counted = targets != -100
    log_probs = torch.where(counted, lp.gather(1, targets.clamp(min=0)[:, None])[:, 0], 0.0)
    entropy = torch.where(counted, -(lp.exp() * lp).sum(-1), 0.0)
    (-(3 * log_probs).sum() + entropy.sum()).backward()
    return log_probs.detach(), entropy.detach(), h.grad, w.grad


def _run_logprobs(fn, hidden, weight, targets, dtype, cast_first, bias=None, **kwargs):
    h = hidden.clone().requires_grad_(True)
    w = weight.clone().requires_grad_(True)
    b = bias.clone().requires_grad_(True) if bias is not None else None
    with torch.autocast(DEVICE.type, dtype=dtype):
        out = fn(h, w.to(dtype) if cast_first else w, targets, b, **kwargs)
    (-(3 * out["log_probs"]).sum() + out["entropy"].sum()).backward()
    return out, h.grad, w.grad


def _per_token(h, w, t, b, **kwargs):
    return fused_linear_logprobs(h, w, t, b, outputs=("log_probs", "entropy"), **kwargs)


def _trl(h, w, t, b, **kwargs):  # TRL's call contract (``trl_head``); chunk_size is TRL's and unused
    lp, ent, *_ = ChunkedLogProbFunction.apply(h, w, b, t.clamp(min=0), 1.0, 32768, outputs=("entropy",))
    counted = t != -100
    return {"log_probs": torch.where(counted, lp, 0.0), "entropy": torch.where(counted, ent, 0.0)}


# Per-token settings: the chunked path (exponentials kept, one chunk), the recompute path whole, and
# the recompute path in blocks: bf16 pairs grad_hidden (vocabulary blocks, each grad_weight block
# complete in one product); fp16, or bf16 with a bias gradient, takes the master weight's one pass
# of token blocks, grad_weight summed over them in place in fp32 (``plan.plan_passes``).
PER_TOKEN = {"chunked": dict(strategy="chunked"), "recompute": dict(strategy="recompute"),
             "blocks": dict(strategy="recompute", chunk_bytes=64 * V * 2)}


@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("setting", PER_TOKEN)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_per_token_master_weight_gradient_is_fp32_and_more_exact(dtype, setting, bias):
    """fused_linear_logprobs under autocast with an fp32 weight: the fields and the hidden gradient
    are those of casting first (the same products); the weight gradient is fp32, summed without a
    16-bit rounding, so strictly closer to float64."""
    hidden, weight, targets = _problem()
    b = 0.1 * torch.randn(V, generator=torch.Generator().manual_seed(5)).to(DEVICE) if bias else None
    kwargs = PER_TOKEN[setting]
    out, dx, dw = _run_logprobs(_per_token, hidden, weight, targets, dtype, False, b, **kwargs)
    out_c, dx_c, dw_c = _run_logprobs(_per_token, hidden, weight, targets, dtype, True, b, **kwargs)
    ref_lp, ref_ent, ref_dx, ref_dw = _logprob_reference(hidden, weight, targets, dtype, b)

    assert dw.dtype == torch.float32
    for name in ("log_probs", "entropy"):
        assert torch.equal(out[name], out_c[name]), name
    assert torch.equal(dx, dx_c)
    assert rel_err(out["log_probs"], ref_lp) < 1e-5 and rel_err(out["entropy"], ref_ent) < 1e-5
    err, err_cast = rel_err(dw, ref_dw), rel_err(dw_c, ref_dw)
    assert err < 0.85 * err_cast, f"master {err:.2e} against cast-first {err_cast:.2e}"
    assert rel_err(dx, ref_dx) < (8e-3 if dtype == torch.bfloat16 else 1.5e-3)


def test_master_token_plan_sums_grad_weight_over_token_blocks_in_place(monkeypatch):
    """The fp16 "blocks" setting above runs the master weight's plan: one pass of several token
    blocks of whole vocabulary rows, no other V x H buffer (spied on the planner's answer)."""
    plans = []
    original = plan_module.plan_passes

    def spy(*args, **kwargs):
        plans.append((kwargs.get("fp32_weight_grad"), original(*args, **kwargs)))
        return plans[-1][1]

    monkeypatch.setattr(plan_module, "plan_passes", spy)
    hidden, weight, targets = _problem()
    _run_logprobs(_per_token, hidden, weight, targets, torch.float16, False, **PER_TOKEN["blocks"])
    ((fp32_grad, passes),) = plans
    assert fp32_grad
    (p,) = passes
    assert p.cols == V and p.rows < N and not p.dw_accumulator and p.weight_grad and p.rows_grads


def test_trl_drop_in_takes_the_master_weight():
    """TRL's contract under autocast with an fp32 lm-head weight (a Trainer with bf16=True on an fp32
    model): the same fields as casting first, an fp32 weight gradient closer to float64."""
    hidden, weight, targets = _problem()
    out, dx, dw = _run_logprobs(_trl, hidden, weight, targets, torch.bfloat16, False)
    out_c, dx_c, dw_c = _run_logprobs(_trl, hidden, weight, targets, torch.bfloat16, True)
    _, _, _, ref_dw = _logprob_reference(hidden, weight, targets, torch.bfloat16)
    assert torch.equal(out["log_probs"], out_c["log_probs"]) and torch.equal(dx, dx_c)
    assert dw.dtype == torch.float32
    assert rel_err(dw, ref_dw) < 0.85 * rel_err(dw_c, ref_dw)


@pytest.mark.parametrize("api", ["loss-recompute", "per-token"])
def test_no_16bit_weight_copy_is_held_from_the_forward_to_the_backward(api):
    """What autograd keeps for the backward (``saved_tensors_hooks``): with a master weight the fp32
    weight itself (no new memory), never a V x H 16-bit copy, which casting first keeps (autocast's
    cast of an fp32 model's head: V x H x 2 bytes, 1 GiB at 128256 x 4096)."""
    hidden, weight, targets = _problem()

    def saved_weight_copies(cast_first):
        h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        seen = []

        def pack(t):
            seen.append((t.shape, t.dtype))
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            with torch.autocast(DEVICE.type, dtype=torch.bfloat16):
                ww = w.to(torch.bfloat16) if cast_first else w
                if api == "per-token":
                    out = fused_linear_logprobs(h, ww, targets, outputs=("log_probs", "entropy"), strategy="recompute")
                    loss = out["entropy"].sum() - out["log_probs"].sum()
                else:
                    loss = fused_linear_cross_entropy(h, ww, targets, strategy="recompute")
        loss.backward()
        assert w.grad.dtype == torch.float32
        return [d for shape, d in seen if shape == (V, H)]

    assert saved_weight_copies(cast_first=False) == [torch.float32]
    assert torch.bfloat16 in saved_weight_copies(cast_first=True)  # not vacuous: the cast copy is kept


def test_several_chunks_take_the_master_default_budget_and_one_chunk_is_hosted(monkeypatch):
    """"auto" with no ``chunk_bytes``: a master weight whose bf16 plane does not fit in its fp32
    gradient (N > 2H) runs chunks of ``plan.DEFAULT_MASTER_BYTES`` (on the GPU 504 MiB; here 64 rows,
    the GPU's whole 128-row blocks there), each summed into the gradient (``products.accumulate``,
    first writing; on the GPU the chunks' small grad_hidden products take it too, into an fp32
    (rows, H) buffer, hence the filter); where it fits (N <= 2H, S1's 8192 x 4096) one chunk lives in
    the gradient itself (``tests/kernel/test_hosted_chunk.py``)."""
    hidden, weight, targets = _problem()  # N = 200 > 2H = 96
    calls = []
    original = products.accumulate

    def spy(a, b, acc, first):
        if tuple(acc.shape) == (V, H):
            calls.append((tuple(acc.shape), first))
        return original(a, b, acc, first)

    monkeypatch.setattr(products, "accumulate", spy)
    monkeypatch.setattr(plan_module, "DEFAULT_MASTER_BYTES", 64 * V * 2)
    _run(hidden, weight, targets, torch.bfloat16, 1.0, cast_first=False)
    rows = plan_module.chunk_rows(N, V, torch.bfloat16, 64 * V * 2, configs.sweep_config(torch.bfloat16, chunked=True).block_n)
    assert rows < N
    assert calls == [((V, H), i == 0) for i in range(triton.cdiv(N, rows))]  # 4 chunks here, 2 on the GPU
    calls.clear()
    monkeypatch.setattr(plan_module, "DEFAULT_MASTER_BYTES", N * V * 2)  # the whole plane: one chunk
    _run(hidden, weight, targets, torch.bfloat16, 1.0, cast_first=False)
    assert calls == []
    assert plan_module.hosted_chunk(Options(), 8192, 128256, 4096, torch.bfloat16, True, True) is not None
