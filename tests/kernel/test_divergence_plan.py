"""How a fused_linear_divergence call runs: its chunks and gradient groups (``plan.plan_divergence_chunks``),
da over the teacher's buffer or in one of its own, bf16's weight gradient as a compensated pair, which
products run (none forming da without gradients; the teacher's once with a log-prob gradient), the
chunked strategy's second backward, torch.compile over the custom ops, the row kernel compiled for
sm_90, and on a GPU its memory within the budget. Each against the float64 reference where it computes
(``divergence_cases.check``); the values and gradients under every option: test_divergence.py."""

import pytest
import torch

from conftest import DEVICE, ON_GPU, rel_err
from fused_linear_ce import configs, divergence, fused_linear_divergence, products
from fused_linear_ce import plan as plan_module

pytest.register_assert_rewrite("divergence_cases")
from divergence_cases import (  # noqa: E402
    DTYPES, GRAD_TOL, H_T, LOGITS, N, SMALL_CHUNKS, V, check, divergence_inputs, student_leaves,
)

# With ``small_groups``: fp32 da in its own buffer, groups of 32 rows in chunks of 8 (8 x 8 + 32 x 4
# bytes a class).
OWN_DA_FP32 = LOGITS * V * 8 + 4 * V * 32
# 16-bit da over the teacher's buffer in chunks of 6 rows: da's own buffer would hold none.
IN_PLACE_16 = LOGITS * V * 6


@pytest.fixture
def small_groups(monkeypatch):
    """Chunks of 8 rows where da takes a buffer of its own, on the GPU as on the interpreter."""
    monkeypatch.setattr(plan_module, "DIVERGENCE_GROUP_CHUNK_ROWS", 8)
    monkeypatch.setattr(plan_module, "INTERPRETED_DIVERGENCE_GROUP_CHUNK_ROWS", 8)


def _count_groups(monkeypatch):
    """A list that gets one entry (the group's rows) per call of the gradient products."""
    calls = []
    real = divergence._gradient_products
    monkeypatch.setattr(divergence, "_gradient_products",
                        lambda da, *a, **k: (calls.append(da.shape[0]), real(da, *a, **k))[1])
    return calls


@pytest.mark.parametrize("strategy,reduction,chunk_bytes,groups",
                         [("chunked", "mean", None, 1), ("chunked", "mean", IN_PLACE_16, -(-N // 6)),
                          ("chunked", "mean", SMALL_CHUNKS, 2), ("recompute", "none", SMALL_CHUNKS, 2)],
                         ids=["one_chunk", "pair_in_place", "pair_own_da", "recompute_pair_own_da"])


def test_bf16_weight_gradient(strategy, reduction, chunk_bytes, groups, small_groups, monkeypatch):
    """bf16's weight gradient: rounded once from one chunk, or summed over several groups as a bf16 +
    4-bit compensated pair (``products.compensated``), da over the teacher's buffer or in its own
    (groups of 32 rows in chunks of 8), on the chunked strategy then scaled in place. On the CPU
    through the kernels' BF16_EMULATION (tl.dot on upcast tiles, round-to-nearest-even casts: what
    the GPU computes; tests/kernel/test_bf16_emulation.py)."""
    calls = _count_groups(monkeypatch)
    check(divergence_inputs(torch.bfloat16, bias=True), torch.bfloat16, beta=0.5, chunk_bytes=chunk_bytes,
          student_softcap=5.0, strategy=strategy, reduction=reduction)
    assert len(calls) == groups


@pytest.mark.parametrize("strategy,reduction", [("chunked", "mean"), ("recompute", "none")])
def test_own_da_buffer(strategy, reduction, small_groups, monkeypatch):
    """da in a buffer of its own (``plan.plan_divergence``): four chunks of 8 rows fill a group of
    32, whose gradient products run once; the ragged last group takes the rest."""
    assert plan_module.plan_divergence_chunks(N, V, OWN_DA_FP32, 4) == plan_module.DivergenceChunks(8, 32, True)
    calls = _count_groups(monkeypatch)
    check(divergence_inputs(torch.float32, bias=True), torch.float32, beta=0.3, strategy=strategy,
          reduction=reduction, chunk_bytes=OWN_DA_FP32, student_softcap=5.0, lp_grad=reduction == "none")
    assert calls == [32, N - 32]


def test_own_da_buffer_of_all_rows(small_groups, monkeypatch):
    """A budget whose da buffer holds all N rows: one group (its products once, grad_weight rounded
    once), and what the budget has left widens the chunks past 8 rows (fp16: 2-byte da)."""
    budget = LOGITS * V * 12 + 2 * V * N
    plan = plan_module.plan_divergence_chunks(N, V, budget, 2)
    assert plan.group == N and 8 < plan.rows < N and LOGITS * V * plan.rows + 2 * V * N <= budget
    calls = _count_groups(monkeypatch)
    check(divergence_inputs(torch.float16, bias=True), torch.float16, beta=0.7, chunk_bytes=budget, lp_grad=True)
    assert calls == [N, N]  # the forward's group, then the log-prob gradient's recompute


def test_plan_chunks(monkeypatch):
    """The plan at D1-like sizes on the GPU: a 16-bit da takes its own buffer where that buys fewer
    groups than da over the teacher's buffer; everything within the budget."""
    monkeypatch.setattr(divergence.device, "interpreted", lambda: False)
    plan, v, mib = plan_module.plan_divergence_chunks, 151936, 1 << 20
    assert plan(8192, v, None, 2) == plan_module.DivergenceChunks(256, 1184, True)  # 7 groups against 16 in place
    assert plan(8192, v, 512 * mib, 2) == plan_module.DivergenceChunks(256, 736, True)  # 12 against 19
    assert plan(8192, v, 512 * mib, 4) == plan_module.DivergenceChunks(432, 432)  # fp32 da: 371 rows alone, fewer
    assert plan(8192, v, None, None) == plan_module.DivergenceChunks(544, 544)  # values only
    assert plan(300, v, None, 2) == plan_module.DivergenceChunks(300, 300)  # one chunk
    assert plan(8192, v, 4096 * mib, 2) == plan_module.DivergenceChunks(1472, 8192, True)  # all rows' da; wider chunks
    for n in (1000, 8192, 65536):
        for budget in (64 * mib, 512 * mib, 1024 * mib, 4096 * mib):
            for da in (None, 2, 4):
                p = plan(n, v, budget, da)
                assert 1 <= p.rows <= p.group <= n and (p.group == n or p.group % plan_module.DIVERGENCE_ROW_ALIGN == 0)
                assert p.rows * v * LOGITS + (p.group * v * da if p.own_da else 0) <= budget or p.rows == 1


def test_no_grad_forward_values_only(monkeypatch):
    """Without gradients nothing forms da: the chunked strategy runs its values-only sweep."""
    inputs = divergence_inputs(torch.float32)
    calls = []
    monkeypatch.setattr(divergence, "_gradient_products", lambda *a, **k: calls.append(1))
    with torch.no_grad():
        div = fused_linear_divergence(**inputs, beta=0.5)
    assert not calls and torch.isfinite(div)


def test_log_prob_gradient_on_the_chunked_strategy_skips_the_teacher(monkeypatch):
    """The chunked strategy's gradients come from the forward; a log-prob gradient adds a recompute
    of that term alone, with the student's logits only: one teacher product in all."""
    inputs = divergence_inputs(torch.float32)
    teacher_products = []
    real = products.accumulate

    def spy(a, b, *args, **kwargs):
        if b.shape[1] == V:  # a logit product h @ W.T (on the GPU grad_hidden may come through here too)
            teacher_products.append(a.shape[1] == H_T)
        return real(a, b, *args, **kwargs)

    monkeypatch.setattr(products, "accumulate", spy)
    div, fields = fused_linear_divergence(**inputs, beta=0.5, outputs=("log_probs",))
    (div + fields["log_probs"].sum()).backward()
    # the logit products: the forward's student and teacher, the log-prob recompute's student alone
    assert sum(teacher_products) == 1 and len(teacher_products) == 3


@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
def test_chunked_second_backward_raises_the_losss_error(dtype):
    """The chunked strategy scales its forward's gradients in place in the first backward (fp32 / bf16
    ones, already in the leaves' dtype): a second backward through the same graph raises the loss's
    clear error (``custom_ops.check_spent``) naming fused_linear_divergence, before anything is written;
    fp16's fp32 unit gradients are scaled into new tensors, so its second backward is the first's
    again. strategy="recompute", which the message names, backwards the graph any number of times."""
    inputs = divergence_inputs(dtype, bias=True)
    leaves = [inputs[k] for k in ("student_hidden", "student_weight", "student_bias")]
    div = fused_linear_divergence(**inputs, beta=0.3, strategy="chunked")
    first = [g.clone() for g in torch.autograd.grad(div, leaves, retain_graph=True)]
    if dtype == torch.float16:
        again = torch.autograd.grad(div, leaves, retain_graph=True)
        assert all(torch.equal(a, b) for a, b in zip(again, first))
        return
    with pytest.raises(RuntimeError, match=r'fused_linear_divergence: a second backward through the same graph '
                                           r'\(retain_graph=True\) on the chunked path.*strategy="recompute"'):
        torch.autograd.grad(div, leaves, retain_graph=True)
    div = fused_linear_divergence(**inputs, beta=0.3, strategy="recompute")
    for _ in range(2):
        again = torch.autograd.grad(div, leaves, retain_graph=True)
        assert all(rel_err(a, b) <= GRAD_TOL[dtype] for a, b in zip(again, first))


@pytest.mark.parametrize("strategy,reduction", [("chunked", "mean")] + [("recompute", "none")] * ON_GPU)
def test_compiles_without_a_graph_break_and_equals_eager(strategy, reduction):
    """torch.compile(fullgraph=True) over the custom ops, the temperature a traced float (no recompile
    per value): the same divergence, log-probs and gradients as eager. The chunked case with a
    log-prob gradient runs all three ops (forward, scale_gradients, the recompute backward); the
    "none" case only on the GPU (CPU time)."""
    inputs = divergence_inputs(torch.float32, bias=True)
    g = torch.Generator().manual_seed(5)
    up, up_lp = torch.randn(N, generator=g).to(DEVICE), torch.randn(N, generator=g).to(DEVICE)
    fixed = {k: v for k, v in inputs.items() if not k.startswith("student")}

    def step(hs, ws, bs, temperature):
        div, fields = fused_linear_divergence(hs, ws, student_bias=bs, beta=0.3, temperature=temperature,
                                              strategy=strategy, reduction=reduction, outputs=("log_probs",),
                                              **fixed)
        return (div * (up if reduction == "none" else 1.0)).sum() + (fields["log_probs"] * up_lp).sum()

    compiled = torch.compile(step, backend="aot_eager" if not ON_GPU else "inductor", fullgraph=True)
    for temperature in (1.0, 0.7):
        leaves = [[t.detach().clone().requires_grad_() for t in student_leaves(inputs)] for _ in range(2)]
        expected = step(*leaves[0], temperature)
        got = compiled(*leaves[1], temperature)
        expected.backward()
        got.backward()
        # inductor fuses the test's own sums over tokens into one kernel, which adds in another order
        # than eager's two reductions: the totals may differ by a few fp32 ulps per token.
        assert torch.allclose(got, expected, rtol=1e-5 if ON_GPU else 1e-6, atol=1e-6)
        for a, b in zip(leaves[1], leaves[0]):
            assert rel_err(a.grad, b.grad) < 1e-6


# Compiles the row kernel for sm_90 offline (scripts/registers.py's compile_case) in a subprocess
# without the interpreter: the GPU compiler refuses what the interpreter lets pass (a loop-carried
# name with two shapes did). Each case: MODE, VALUES, WRITE_DA, STATS_KNOWN, DIV_GRAD.
SM90_SCRIPT = """
import json, sys, tempfile
from pathlib import Path
sys.path.insert(0, sys.argv[1] + "/scripts"); sys.path.insert(0, sys.argv[1] + "/torch-ext")
import registers as R
R._FP32_PTRS |= {"zs_ptr", "zt_ptr", "coef_ptr", "stats_ptr", "out_ptr"}
R._INT_PTRS["counted_ptr"] = "*i8"
R._FLOATS |= {"scale_s", "cap_s", "cap_out_s", "chain_s", "scale_t", "cap_t", "cap_out_t", "beta", "alpha", "log_a", "log_b"}
rows = []
with tempfile.TemporaryDirectory() as tmp:
    for mode, values, write, known, div_grad, block_v, warps in json.loads(sys.argv[2]):
        flags = dict(MODE=mode, VALUES=values, WRITE_DA=write, STATS_KNOWN=known, DIV_GRAD=div_grad)
        case = R.Case(name=f"{flags} BLOCK_V={block_v} warps={warps}", kernel="divergence_row_kernel", module="divergence_kernel",
                      constexprs=dict(flags, HAS_BIAS_S=True, HAS_BIAS_T=True, SOFTCAP_S=True, SOFTCAP_T=True,
                                      HAS_TARGETS=True, BLOCK_N=1, BLOCK_V=block_v, BF16_EMULATION=False),
                      descriptors={}, num_warps=warps, num_stages=1, unit_strides=())
        rows.append(R.compile_case(case, Path(tmp)))
print(json.dumps(rows))
"""


def test_row_kernel_compiles_for_sm90_without_spills():
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    import triton

    tools = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    if not (tools / "cuobjdump").exists() or not (tools / "ptxas").exists():
        pytest.skip(f"this Triton install has no ptxas / cuobjdump under {tools}")
    flags = [(0, True, True, False, True), (1, True, True, False, True), (2, True, False, False, True),
             (2, False, True, True, True), (0, False, True, True, False)]
    cases = [(*f, block_v, warps) for f in flags for _, block_v, warps in configs.DIVERGENCE_ROW_LAUNCHES]  # every launch
    repo = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", SM90_SCRIPT, str(repo), json.dumps(cases)], env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    for row in json.loads(out.stdout):
        assert 0 < row["registers"] <= 255 and row["stack"] == 0, row


@pytest.mark.skipif(not ON_GPU, reason="CUDA memory statistics")
def test_gpu_memory_within_the_budget_and_flat_in_n():
    """The default "mean" step's extra memory (the peak during forward and backward beyond what was
    allocated before and the two gradients): within ``chunk_bytes`` (logit buffers and da's own
    buffer, ``plan.plan_divergence_chunks``: chunks of 256 rows in groups of 1024 here), grad_weight's
    4-bit remainder, a group's fp32 grad_hidden product and 1 MiB of O(N) statistics, and the same
    at 4x the rows (2 and 8 groups)."""
    v, h_s, h_t, budget = 32768, 512, 768, 128 << 20
    assert plan_module.plan_divergence_chunks(8192, v, budget, 2) == plan_module.DivergenceChunks(256, 1024, True)
    g = torch.Generator(device="cuda").manual_seed(0)
    ws = (torch.randn(v, h_s, device="cuda", generator=g) / h_s**0.5).bfloat16().requires_grad_()
    wt = (torch.randn(v, h_t, device="cuda", generator=g) / h_t**0.5).bfloat16()
    extra = {}
    for n in (2048, 8192, 2048):  # the first call also allocates cuBLAS's workspace: the last one counts
        hs = torch.randn(n, h_s, device="cuda", generator=g).bfloat16().requires_grad_()
        ht = torch.randn(n, h_t, device="cuda", generator=g).bfloat16()
        ws.grad = None
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        fused_linear_divergence(hs, ws, ht, wt, beta=0.5, chunk_bytes=budget).backward()
        torch.cuda.synchronize()
        extra[n] = torch.cuda.max_memory_allocated() - base - hs.grad.nbytes - ws.grad.nbytes
    bound = budget + v * h_s // 2 + 1024 * h_s * 4 + (1 << 20)
    assert extra[8192] <= bound and extra[2048] <= bound, (extra, bound)
    assert abs(extra[8192] - extra[2048]) <= 1 << 20, extra
