"""One GPU call: a flattened tile loop for the sweep, and TMA loads for the Triton matmul (v12 in NOTES.md).

    python3 benchmarks/experiments/experiment_flat.py [--shapes S1 S3] [--out DIR]

Part 1, the evaluation forward's sweep (reduced: log-sum-exp and target logit only, as in
``experiment_sweep.py``; the package's split scheme and TMA loads, 128 x 256 x 64 tiles):
- ``tma``: the package's loop nest: a loop over the split's vocabulary tiles around the K loop, so
  the software pipeline drains and refills at every tile;
- ``mflat``: one loop over (tile, k) pairs, written by hand (``tl.range(flatten=True)`` does not
  compile here, v11): the accumulator is reset and the softmax epilogue runs under ``k == last``,
  so the next tile's first loads are in flight during this tile's epilogue; ``mflat-s4`` with 4
  stages; ``mflat-ws`` the same loop with Triton's warp specialisation (probed in a child process).

Part 2, the recompute path's grad_weight product with the common factor, ``(da^T @ hidden) * g``
rounded once to bf16 (S1 at 64 MiB: 32 blocks of 4096 classes, each M=4096, K=8192, P=4096; at the
default 256 MiB: M=8192):
- ``ptr``: the package's Triton matmul (pointer loads, factor in the epilogue);
- ``tma`` / ``tma-s4``: the same kernel with both operands through TMA descriptors (da read as
  stored, (K, M) blocks transposed in shared memory; hidden (K, P) blocks);
- ``cublas``: torch.mm with a bf16 result and no factor (the speed v10 had; two roundings once a
  factor is applied after it);
- ``cublas-fp32``: torch.mm with an fp32 result, then the factor and one rounding (the staging
  buffer is extra memory: M x P x 4 bytes).
Each product is checked against a float64 product. Rounds are interleaved; prints a table last and
writes experiment_flat.json under --out.
"""

import contextlib
import sys
import traceback
from pathlib import Path

import torch
import triton
import triton.language as tl
import triton.testing
from triton.tools.tensor_descriptor import TensorDescriptor

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "torch-ext"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: tune.py, bench.py
from fused_linear_ce import configs, gemm, products  # noqa: E402
from fused_linear_ce.logits import grouped_tile  # noqa: E402

from experiment_common import (answer_probe, checked_variants, interleaved, median, package_eval,  # noqa: E402
                               parse_args, write_results)
from tune import problem  # noqa: E402

SHAPES = {"S1": (8192, 4096, 128256), "S2": (8192, 2304, 256000), "S3": (16384, 2048, 151936)}
BLOCK_N, BLOCK_V, BLOCK_H = 128, 256, 64
SWEEPS = {
    "tma": dict(flat=False),
    "mflat": dict(flat=True),
    "mflat-s4": dict(flat=True, num_stages=4),
    "mflat-ws": dict(flat=True, ws=True),
}


@triton.jit

@contextlib.contextmanager
def _full_precision_reductions():
    """cuBLAS without reduced-precision split-K reductions into bf16, as this experiment measured it
    (the package itself no longer changes torch's process-wide flag: its products never ask cuBLAS
    for a 16-bit result)."""
    flags = torch.backends.cuda.matmul
    saved = flags.allow_bf16_reduced_precision_reduction
    flags.allow_bf16_reduced_precision_reduction = False
    try:
        yield
    finally:
        flags.allow_bf16_reduced_precision_reduction = saved

def merge_tile(acc, vt, m, s, zt, target, V, BLOCK_V: tl.constexpr):
    """One logit tile (vocabulary tile ``vt``) into the rows' running max, sum and target logit."""
    offs_v = vt * BLOCK_V + tl.arange(0, BLOCK_V)
    z = tl.where((offs_v < V)[None, :], acc, float("-inf"))
    m_new = tl.maximum(m, tl.max(z, axis=1))
    s = s * tl.exp(m - m_new) + tl.sum(tl.exp(z - m_new[:, None]), axis=1)
    zt += tl.sum(tl.where(offs_v[None, :] == target[:, None], z, 0.0), axis=1)
    return m_new, s, zt


@triton.jit
def sweep_kernel(h_desc, w_desc, t_ptr, stats_ptr, N, V, H, n_tiles, tiles_per_prog, slots,
                 BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr,
                 FLAT: tl.constexpr, WS: tl.constexpr):
    """stats (3, slots, N): max, sum exp(z - max), target logit of program (row block, split)."""
    pid = tl.program_id(0)
    pid_n = pid // slots
    pid_s = pid % slots
    t0 = pid_s * tiles_per_prog
    t1 = tl.minimum(t0 + tiles_per_prog, n_tiles)
    row0 = pid_n * BLOCK_N
    offs_n = row0 + tl.arange(0, BLOCK_N)
    target = tl.load(t_ptr + tl.minimum(offs_n, N - 1))
    m = tl.full((BLOCK_N,), float("-inf"), tl.float32)
    s = tl.zeros((BLOCK_N,), tl.float32)
    zt = tl.zeros((BLOCK_N,), tl.float32)
    k_tiles = tl.cdiv(H, BLOCK_H)
    if FLAT:
        acc = tl.zeros((BLOCK_N, BLOCK_V), tl.float32)
        for it in tl.range(0, (t1 - t0) * k_tiles, warp_specialize=WS):
            vt = t0 + it // k_tiles
            k = it % k_tiles
            x = h_desc.load([row0, k * BLOCK_H])
            w = w_desc.load([vt * BLOCK_V, k * BLOCK_H])
            acc = tl.dot(x, w.T, acc)
            if k == k_tiles - 1:
                m, s, zt = merge_tile(acc, vt, m, s, zt, target, V, BLOCK_V)
                acc = tl.zeros((BLOCK_N, BLOCK_V), tl.float32)
    else:
        for vt in range(t0, t1):
            acc = tl.zeros((BLOCK_N, BLOCK_V), tl.float32)
            for k in range(0, k_tiles):
                x = h_desc.load([row0, k * BLOCK_H])
                w = w_desc.load([vt * BLOCK_V, k * BLOCK_H])
                acc = tl.dot(x, w.T, acc)
            m, s, zt = merge_tile(acc, vt, m, s, zt, target, V, BLOCK_V)
    base = stats_ptr + pid_s * N + offs_n
    mask = offs_n < N
    tl.store(base, m, mask=mask)
    tl.store(base + slots * N, s, mask=mask)
    tl.store(base + 2 * slots * N, zt, mask=mask)


def sweep_runner(hidden, weight, targets, *, flat, ws=False, num_stages=3):
    n, h = hidden.shape
    v = weight.shape[0]
    n_blocks, n_tiles = triton.cdiv(n, BLOCK_N), triton.cdiv(v, BLOCK_V)
    slots = configs.vocab_splits(n_blocks, n_tiles, hidden.device)
    per = triton.cdiv(n_tiles, slots)
    slots = triton.cdiv(n_tiles, per)
    h_desc = TensorDescriptor.from_tensor(hidden, [BLOCK_N, BLOCK_H])
    w_desc = TensorDescriptor.from_tensor(weight, [BLOCK_V, BLOCK_H])
    stats = torch.empty((3, slots, n), device=hidden.device, dtype=torch.float32)

    def run():
        sweep_kernel[(n_blocks * slots,)](h_desc, w_desc, targets, stats, n, v, h, n_tiles, per, slots,
                                          BLOCK_N=BLOCK_N, BLOCK_V=BLOCK_V, BLOCK_H=BLOCK_H, FLAT=flat, WS=ws,
                                          num_warps=8, num_stages=num_stages)
        mx = stats[0].amax(0)
        lse = mx + torch.log((stats[1] * torch.exp(stats[0] - mx)).sum(0))
        return lse - stats[2].sum(0)

    return run, dict(programs=n_blocks * slots, per=per, slots=slots)


@triton.jit
def tma_matmul_kernel(a_desc, b_desc, c_ptr, scale_ptr, M, P, K, stride_cm,
                      A_KM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_P: tl.constexpr,
                      BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    """C = (A @ B) * scale, bf16 out; A_KM: A's descriptor is over A^T as stored, (K, M)."""
    pid_m, pid_p = grouped_tile(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(P, BLOCK_P), GROUP_M)
    acc = tl.zeros((BLOCK_M, BLOCK_P), tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        if A_KM:
            a = a_desc.load([k * BLOCK_K, pid_m * BLOCK_M]).T
        else:
            a = a_desc.load([pid_m * BLOCK_M, k * BLOCK_K])
        b = b_desc.load([k * BLOCK_K, pid_p * BLOCK_P])
        acc = tl.dot(a, b, acc)
    acc = acc * tl.load(scale_ptr)
    offs_m = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_p = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)
    mask = (offs_m < M)[:, None] & (offs_p < P)[None, :]
    tl.store(c_ptr + offs_m[:, None] * stride_cm + offs_p[None, :], acc.to(c_ptr.dtype.element_ty), mask=mask)


def product_runners(da, hidden, g, out):
    """Variants of out = (da^T @ hidden) * g."""
    m, p, k = da.shape[1], hidden.shape[1], da.shape[0]
    cfg = configs.matmul_config(da.dtype)

    def tma(stages):
        a_desc = TensorDescriptor.from_tensor(da, [cfg.block_k, cfg.block_m])
        b_desc = TensorDescriptor.from_tensor(hidden, [cfg.block_k, cfg.block_p])
        grid = (triton.cdiv(m, cfg.block_m) * triton.cdiv(p, cfg.block_p),)

        def run():
            tma_matmul_kernel[grid](a_desc, b_desc, out, g, m, p, k, out.stride(0), A_KM=True,
                                    BLOCK_M=cfg.block_m, BLOCK_P=cfg.block_p, BLOCK_K=cfg.block_k,
                                    GROUP_M=cfg.group_m, num_warps=cfg.num_warps, num_stages=stages)
            return out
        return run

    staging = torch.empty((m, p), device=da.device, dtype=torch.float32)

    def cublas_fp32():
        with _full_precision_reductions():
            torch.mm(da.t(), hidden, out_dtype=torch.float32, out=staging)
        return products.scale(staging, g, out=out)

    def cublas():
        with _full_precision_reductions():
            return torch.mm(da.t(), hidden, out=out)

    return {
        "ptr": lambda: (gemm.matmul(da.t(), hidden, out, False, g), out)[1],
        "tma": tma(3),
        "tma-s4": tma(4),
        "cublas": cublas,
        "cublas-fp32": cublas_fp32,
    }


def main():
    if answer_probe(SHAPES, SWEEPS, sweep_runner):
        return
    args = parse_args(["S1", "S3"])
    rows_out = []
    for name in args.shapes:
        n, h, v = SHAPES[name]
        hidden, weight, targets = problem(n, h, v)

        package = package_eval(hidden, weight, targets)
        ref = package()
        variants = {"package": (package, {}), "matmul": (lambda: hidden @ weight.T, {})}
        checked, errors = checked_variants(__file__, name, SWEEPS, sweep_runner, hidden, weight, targets, ref,
                                           lambda vname, spec: spec.get("ws", False))
        variants.update(checked)
        times = interleaved({k: fn for k, (fn, _info) in variants.items()})
        mm = median(times["matmul"])
        for k, (_fn, info) in variants.items():
            rows_out.append(dict(shape=name, name=f"sweep/{k}", ms=median(times[k]), matmul_ms=mm, rounds=times[k],
                                 **info))
        rows_out += [dict(shape=name, name=f"sweep/{k}", error=e) for k, e in errors.items()]
        variants.clear()
        torch.cuda.empty_cache()

        if name != "S1":
            continue
        # Part 2: grad_weight products at S1, the 64 MiB and 256 MiB plans' block widths.
        g = torch.full((1,), 1.0 / 8191, device="cuda")
        for cols in (4096, 8192):
            torch.manual_seed(1)
            da = (torch.randn(n, cols, device="cuda") * 1e-3).bfloat16()
            exact = (da.double().t() @ hidden.double()) * g.double()
            out = torch.empty((cols, h), device="cuda", dtype=torch.bfloat16)
            runners = product_runners(da, hidden, g, out)
            ok = {}
            for k, fn in runners.items():
                try:
                    res = fn().double()
                    if k == "cublas":
                        res = res * g.double()
                    err = ((res - exact).norm() / exact.norm()).item()
                    ok[k] = (fn, err)
                    print(f"  product {cols} {k}: err {err:.2e}", flush=True)
                except Exception as e:
                    rows_out.append(dict(shape=name, name=f"dw{cols}/{k}", error=f"{type(e).__name__}: {str(e)[:300]}"))
                    traceback.print_exc(limit=2)
            del exact
            times = interleaved({k: fn for k, (fn, _err) in ok.items()})
            ref_ms = median(times["cublas"]) if "cublas" in times else float("nan")
            for k, (_fn, err) in ok.items():
                rows_out.append(dict(shape=name, name=f"dw{cols}/{k}", ms=median(times[k]), matmul_ms=ref_ms,
                                     rounds=times[k], dw=err, blocks=triton.cdiv(v, cols)))
            del da, out, runners, ok
            torch.cuda.empty_cache()
    write_results(args.out, "experiment_flat.json", rows_out)


if __name__ == "__main__":
    main()
