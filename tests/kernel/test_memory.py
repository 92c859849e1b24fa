"""No leaks, bounded memory, on the GPU: 1000 forward+backward calls at a realistic size
(N=4096 tokens, H=2048, V=32000, bf16) leave ``torch.cuda.memory_allocated()`` exactly where it
started, and the peak over them stays within the documented bound for the chosen ``chunk_bytes``.

The bound, from the code (``sweep.py``, ``recompute.py``, ``chunked.py``, ``ops.py``, ``losses.py``), above the inputs themselves:
- the gradients being returned: N x H + V x H in the input dtype;
- the largest ``extra_bytes`` of ``plan.plan_passes(...)``: the da block (rows x cols, input
  dtype) plus the fp32 accumulator of whichever gradient is summed over blocks (N x H or V x H; none
  when the plane fits, in two passes, or when the N x H one lives in grad_weight's memory), at most
  ``chunk_bytes``;
- O(N): the forward's partial statistics (NUM_STATS x SPLIT x N fp32, SPLIT from
  ``vocab_split.vocab_splits``), and per-row fp32 / int64 / bool vectors (lse, target logit, loss terms,
  target weights, the backward's (3, N) coefficients and their temporaries), fewer than 32 of them;
- a product whose output has fewer tiles than half the SMs (a ragged last block) runs on cuBLAS
  with an fp32 result: at most (SMs / 2) tiles of 128 x 256 fp32 (``gemm.few_tiles``);
- slack for the caching allocator: each live block may be up to 1 MiB larger than asked for.
No bias here (its (N / block_n) x V fp32 partial sums would add to the O(N) part).

The chunked path (``chunked.py``) holds, above the inputs: the gradients computed in the forward
(N x H + V x H, input dtype), while the forward runs the chunk buffer (rows x V, input dtype), the
per-tile statistics (2 x T x rows fp32, T = V / block_v; none where they fit in the chunk's rows of
grad_hidden, 2 x T x 4 <= H x 2 bytes, as here) and with more than one chunk grad_weight's
int8 V x H remainder (``products.compensated``); in the backward, before v18, two more
gradient-sized sets at its peak (the scaled copies and materialised zero gradients of the op's
gradient outputs; an H200 probe at this shape read 403 MiB at the forward's peak and 424 MiB at the
backward's, 3 x 141 MiB). Since v18 bf16 gradients are scaled in place and no zeros are
materialised: the bound's 2 x gradients is a ceiling. Its products run in cuBLAS, whose workspaces come from the caching
allocator: a 1000-call run on the H200 (2026-11-30) peaked at 544 MiB, 120 MiB above the probe,
which is not attributed; CUBLAS_SLACK covers it.

Expected on an H200: ~5 ms a call, ~15 s in all; peak above the inputs ~410 MiB at the default
setting (the whole 250 MiB plane in one block); at 16 MiB the N x H accumulator (32 MiB) lives in
grad_weight's memory (V >= 2N), so the extra is the 16 MiB blocks and the O(N) part.
"""

import pytest
import torch
import triton

from conftest import ON_GPU
from fused_linear_ce import configs, fused_linear_cross_entropy, plan, vocab_split
from fused_linear_ce.sweep import NUM_STATS

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU (memory statistics)")]

N, H, V = 4096, 2048, 32000
DTYPE = torch.bfloat16
CALLS = 1000
MiB = 1 << 20
ALLOCATOR_SLACK = 16 * MiB
CUBLAS_SLACK = 128 * MiB  # the chunked path only (module docstring)


def _inputs(n=N, h=H, v=V):
    g = torch.Generator(device="cuda").manual_seed(0)
    hidden = torch.randn(n, h, device="cuda", generator=g).to(DTYPE).requires_grad_(True)
    weight = (torch.randn(v, h, device="cuda", generator=g) * (4.0 / h) ** 0.5).to(DTYPE).requires_grad_(True)
    targets = torch.randint(0, v, (n,), device="cuda", generator=g)
    targets[::7] = -100
    return hidden, weight, targets


def _settled_allocated(timeout_s: float = 2.0) -> int:
    """``torch.cuda.memory_allocated()`` once the GPU is idle and the count has held still for a few
    reads. torch.autograd.grad returns when the engine marks the graph task complete; its worker
    thread drops its own references to that call's gradients a moment later, and under CPU
    contention (pytest -n 12) a read right after the call saw them still allocated: exactly one
    call's gradients (147,849,216 bytes here), at the baseline or at the end, never more. A real
    leak grows with the calls and does not go away with waiting."""
    import time

    torch.cuda.synchronize()
    last, same, deadline = torch.cuda.memory_allocated(), 0, time.monotonic() + timeout_s
    while same < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
        now = torch.cuda.memory_allocated()
        same = same + 1 if now == last else 0
        last = now
    return last


def _bound(chunk_bytes, strategy) -> int:
    """The documented peak above the inputs (module docstring), in bytes."""
    itemsize = DTYPE.itemsize
    gradients = (N * H + V * H) * itemsize
    if strategy == "chunked":
        cfg = configs.sweep_config(DTYPE, chunked=True)
        rows = plan.chunk_rows(N, V, DTYPE, chunk_bytes, cfg.block_n)
        tile_stats = 2 * triton.cdiv(V, cfg.block_v) * 4  # bytes a row, in grad_hidden's row where they fit
        forward = rows * V * itemsize + (tile_stats * rows if tile_stats > H * itemsize else 0)
        if rows < N:
            forward += V * H  # grad_weight's int8 remainder (a compensated pair across chunks)
        return gradients + max(forward, 2 * gradients) + 32 * 8 * N + ALLOCATOR_SLACK + CUBLAS_SLACK
    cfg, tiles = configs.sweep_config(DTYPE), configs.dlogits_config(DTYPE)
    passes = plan.plan_passes(N, V, H, DTYPE, chunk_bytes, tiles.block_n, tiles.block_v, True, True)
    splits = vocab_split.vocab_splits(triton.cdiv(N, cfg.block_n), triton.cdiv(V, cfg.block_v), torch.device("cuda"))
    per_row = 4 * N * NUM_STATS * splits + 32 * 8 * N
    mm = configs.matmul_config(DTYPE)
    few_tile_result = configs.sm_count(torch.device("cuda")) // 2 * mm.block_m * mm.block_p * 4
    return (gradients + max(p.extra_bytes(N, V, H, itemsize) for p in passes) + per_row + few_tile_result
            + ALLOCATOR_SLACK)


@pytest.mark.tier_if(lambda chunk_bytes, strategy: (chunk_bytes, strategy) in ((None, "recompute"), (16 * MiB, "chunked")))
@pytest.mark.parametrize("strategy", ["recompute", "chunked"])
@pytest.mark.parametrize("chunk_bytes", [None, 16 * MiB], ids=["default", "16MiB"])
def test_thousand_calls_do_not_leak_and_peak_within_the_documented_bound(chunk_bytes, strategy):
    torch.cuda.empty_cache()
    hidden, weight, targets = _inputs()

    def step():
        loss = fused_linear_cross_entropy(hidden, weight, targets, chunk_bytes=chunk_bytes, strategy=strategy)
        return torch.autograd.grad(loss, (hidden, weight))  # the gradients, without .grad's bookkeeping

    for _ in range(3):  # compile, and let any lazily created state appear before the baseline
        step()
    base = _settled_allocated()
    torch.cuda.reset_peak_memory_stats()
    for _ in range(CALLS):
        grads = step()
        assert grads[0].shape == (N, H) and grads[1].shape == (V, H)
        del grads
    leaked = _settled_allocated() - base
    peak = torch.cuda.max_memory_allocated() - base
    bound = _bound(chunk_bytes, strategy)
    assert leaked == 0, f"{leaked} bytes still allocated after {CALLS} calls"
    assert peak <= bound, f"peak {peak / MiB:.1f} MiB above the inputs > bound {bound / MiB:.1f} MiB"
    # The bound is not vacuous: the gradients and the da block alone are most of it.
    assert peak >= (N * H + V * H) * DTYPE.itemsize


def test_backward_into_grad_leaves_nothing_behind():
    """The training-loop form: loss.backward() into .grad, then the gradients dropped."""
    torch.cuda.empty_cache()
    hidden, weight, targets = _inputs()

    def step():
        fused_linear_cross_entropy(hidden, weight, targets, chunk_bytes=16 * MiB).backward()
        hidden.grad = weight.grad = None

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    for _ in range(100):
        step()
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == base


def _extra_mib(n, h, v, **kwargs):
    """Peak allocated during one forward+backward above the inputs and the gradients, in MiB."""
    hidden, weight, targets = _inputs(n, h, v)
    for _ in range(2):
        grads = torch.autograd.grad(fused_linear_cross_entropy(hidden, weight, targets, **kwargs), (hidden, weight))
        del grads
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    grads = torch.autograd.grad(fused_linear_cross_entropy(hidden, weight, targets, **kwargs), (hidden, weight))
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base - sum(t.nbytes for t in grads)
    del grads, hidden, weight
    torch.cuda.empty_cache()
    return extra / MiB


def test_default_setting_is_flat_in_n():
    """Flat memory: at the default the extra memory is bounded at any N. The chunked path's 256 MiB
    while the whole plane fits in one chunk (N = 4096: its 250 MiB plane); DEFAULT_PAIRED_BYTES
    (512 MiB) for long context, where the chunked path sums grad_weight as a bf16 + 4-bit pair
    (``plan.LONG_CONTEXT``: a 31 MiB remainder and 7808-row chunks in the rest), the same
    at 8x those tokens (N = 262144)."""
    h, v = 2048, 32000
    small = _extra_mib(4096, h, v)
    large = _extra_mib(32768, h, v)
    huge = _extra_mib(262144, h, v)
    per_row = 32 * 8 * 262144 / MiB
    paired = plan.DEFAULT_PAIRED_BYTES / MiB
    assert small >= 200, "the small case should hold its whole 250 MiB plane"
    assert small <= plan.DEFAULT_CHUNKED_BYTES / MiB + per_row
    assert 400 <= large <= paired + per_row, f"{large:.0f} MiB at N=32768"
    assert 400 <= huge <= paired + per_row, f"{huge:.0f} MiB at N=262144"
