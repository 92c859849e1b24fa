"""One GPU call: the evaluation forward's vocabulary sweep against one cuBLAS matmul (v11 in NOTES.md).

    python3 benchmarks/experiments/experiment_sweep.py [--shapes S1 S2 S3 S4] [--out DIR]

The package's sweep (``lse_sweep_kernel``) runs each program over a contiguous range of vocabulary
tiles of one row block; S1 gets 64 row blocks x 2 splits = 128 programs on 132 SMs, and each tile's
softmax epilogue runs between two K loops that do not overlap it. This script times, on the same
bf16 inputs (tune.py's random problem), a reduced copy of that sweep (log-sum-exp and target logit
only) in variants:
- ``split``: the package's scheme (programs = row blocks x splits), pointer loads;
- ``flat``: the same, the tile loop flattened with the K loop (``tl.range(flatten=True)``) so the
  next tile's loads are issued during this tile's epilogue;
- ``tma``: TMA tensor descriptors for both operands; ``tma-flat``; ``tma-ws`` (warp specialisation
  of the tile loop, Triton's Hopper autoWS);
- ``even``: one program per SM, each a contiguous run of the row-block-major tile sequence (runs
  cross row blocks; a row block's partial statistics go to slot ``program - first program``);
  ``even-flat``, ``even-tma``, ``even-tma-flat``;
- ``cublas-fp32``: the exact alternative: cuBLAS with an fp32 result in blocks of rows, then
  torch.logsumexp (the cost of writing and reading fp32 logits).
Each variant's lse is checked against the package's (itself checked against float64 on 256 rows).
The package's evaluation forward and one bf16 cuBLAS matmul are timed alongside, in rounds
interleaved across variants (the H200 runs at its power cap; see NOTES). Prints a table last;
writes experiment_sweep.json under --out.
"""

import sys
from pathlib import Path

import torch
import triton
import triton.language as tl
import triton.testing

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "torch-ext"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: tune.py, bench.py

from experiment_common import (answer_probe, checked_variants, interleaved, median, package_eval,  # noqa: E402
                               parse_args, write_results)
from tune import problem  # noqa: E402

SHAPES = {"S1": (8192, 4096, 128256), "S2": (8192, 2304, 256000), "S3": (16384, 2048, 151936),
          "S4": (65536, 4096, 128256)}
BLOCK_N, BLOCK_V, BLOCK_H = 128, 256, 64
SPECS = {
    "split": dict(tma=False, even=False, flatten=False),
    "flat": dict(tma=False, even=False, flatten=True),
    "tma": dict(tma=True, even=False, flatten=False),
    "tma-flat": dict(tma=True, even=False, flatten=True),
    "tma-ws": dict(tma=True, even=False, flatten=False, ws=True),
    "tma-ws-k": dict(tma=True, even=False, flatten=False, ws_k=True),
    "even": dict(tma=False, even=True, flatten=False),
    "even-flat": dict(tma=False, even=True, flatten=True),
    "even-tma": dict(tma=True, even=True, flatten=False),
    "even-tma-flat": dict(tma=True, even=True, flatten=True),
    "even-s4": dict(tma=False, even=True, flatten=False, num_stages=4),
    "even-tma-s4": dict(tma=True, even=True, flatten=False, num_stages=4),
}


@triton.jit
def _tile(h_ptr, w_ptr, h_desc, w_desc, row0, col0, H, offs_n, offs_v,
          BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr, TMA: tl.constexpr,
          WS_K: tl.constexpr):
    acc = tl.zeros((BLOCK_N, BLOCK_V), tl.float32)
    offs_h = tl.arange(0, BLOCK_H)
    for k in tl.range(0, H // BLOCK_H, warp_specialize=WS_K):
        if TMA:
            x = h_desc.load([row0, k * BLOCK_H])
            w = w_desc.load([col0, k * BLOCK_H])
            acc = tl.dot(x, w.T, acc)
        else:
            x = tl.load(h_ptr + offs_n[:, None] * H + (k * BLOCK_H + offs_h)[None, :])
            w = tl.load(w_ptr + offs_v[None, :] * H + (k * BLOCK_H + offs_h)[:, None])
            acc = tl.dot(x, w, acc)
    return acc


@triton.jit
def sweep_kernel(h_ptr, w_ptr, h_desc, w_desc, t_ptr, stats_ptr, N, V, H, n_tiles, tiles_per_prog,
                 total, slots,
                 BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr,
                 TMA: tl.constexpr, EVEN: tl.constexpr, FLATTEN: tl.constexpr, WS: tl.constexpr,
                 WS_K: tl.constexpr):
    """stats (3, slots, N): max, sum exp(z - max), target logit per (slot, row). ``split``: program
    (row block, split) covers tiles [split * tiles_per_prog, ...). ``EVEN``: program p covers the
    global tiles [p * tiles_per_prog, ...) of the row-block-major order, flushing at each row
    block's end into slot p - (first program of that row block)."""
    pid = tl.program_id(0)
    if EVEN:
        g0 = pid * tiles_per_prog
        g1 = tl.minimum(g0 + tiles_per_prog, total)
    else:
        pid_n = pid // slots
        pid_s = pid % slots
        g0 = pid_n * n_tiles + pid_s * tiles_per_prog
        g1 = pid_n * n_tiles + tl.minimum((pid_s + 1) * tiles_per_prog, n_tiles)
    m = tl.full((BLOCK_N,), float("-inf"), tl.float32)
    s = tl.zeros((BLOCK_N,), tl.float32)
    zt = tl.zeros((BLOCK_N,), tl.float32)
    for g in tl.range(g0, g1, flatten=FLATTEN, warp_specialize=WS):
        r = g // n_tiles
        vt = g - r * n_tiles
        offs_n = r * BLOCK_N + tl.arange(0, BLOCK_N)
        rows = tl.minimum(offs_n, N - 1)
        offs_v = vt * BLOCK_V + tl.arange(0, BLOCK_V)
        cols = tl.minimum(offs_v, V - 1)
        z = _tile(h_ptr, w_ptr, h_desc, w_desc, r * BLOCK_N, vt * BLOCK_V, H, rows, cols,
                  BLOCK_N, BLOCK_V, BLOCK_H, TMA, WS_K)
        z = tl.where((offs_v < V)[None, :], z, float("-inf"))
        target = tl.load(t_ptr + rows)
        m_new = tl.maximum(m, tl.max(z, axis=1))
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(z - m_new[:, None]), axis=1)
        zt += tl.sum(tl.where(offs_v[None, :] == target[:, None], z, 0.0), axis=1)
        m = m_new
        if (vt == n_tiles - 1) | (g == g1 - 1):
            if EVEN:
                slot = pid - (r * n_tiles) // tiles_per_prog
            else:
                slot = pid_s
            base = stats_ptr + slot * N + offs_n
            mask = offs_n < N
            tl.store(base, m, mask=mask)
            tl.store(base + slots * N, s, mask=mask)
            tl.store(base + 2 * slots * N, zt, mask=mask)
            m = tl.full((BLOCK_N,), float("-inf"), tl.float32)
            s = tl.zeros((BLOCK_N,), tl.float32)
            zt = tl.zeros((BLOCK_N,), tl.float32)


def sweep_runner(hidden, weight, targets, *, tma, even, flatten, ws=False, ws_k=False, num_warps=8,
                 num_stages=3):
    n, h = hidden.shape
    v = weight.shape[0]
    n_blocks, n_tiles = triton.cdiv(n, BLOCK_N), triton.cdiv(v, BLOCK_V)
    total = n_blocks * n_tiles
    sms = torch.cuda.get_device_properties(hidden.device).multi_processor_count
    if even:
        per = triton.cdiv(total, sms)
        programs = triton.cdiv(total, per)
        slots = triton.cdiv(n_tiles, per) + 1
    else:  # the package's rule at S1 gives 2 splits; take the same count of splits per row block
        from fused_linear_ce import configs
        slots = configs.vocab_splits(n_blocks, n_tiles, hidden.device)
        per = triton.cdiv(n_tiles, slots)
        slots = triton.cdiv(n_tiles, per)
        programs = n_blocks * slots
    if tma:
        from triton.tools.tensor_descriptor import TensorDescriptor
        h_desc = TensorDescriptor.from_tensor(hidden, [BLOCK_N, BLOCK_H])
        w_desc = TensorDescriptor.from_tensor(weight, [BLOCK_V, BLOCK_H])
    else:
        h_desc = w_desc = hidden  # unused
    stats = torch.empty((3, slots, n), device=hidden.device, dtype=torch.float32)

    def run():
        stats[0].fill_(float("-inf"))
        stats[1].zero_()
        stats[2].zero_()
        sweep_kernel[(programs,)](hidden, weight, h_desc, w_desc, targets, stats, n, v, h, n_tiles, per,
                                  total, slots, BLOCK_N=BLOCK_N, BLOCK_V=BLOCK_V, BLOCK_H=BLOCK_H,
                                  TMA=tma, EVEN=even, FLATTEN=flatten, WS=ws, WS_K=ws_k,
                                  num_warps=num_warps, num_stages=num_stages)
        mx = stats[0].amax(0)
        lse = mx + torch.log((stats[1] * torch.exp(stats[0] - mx)).sum(0))
        return lse - stats[2].sum(0)  # per-row loss

    return run, dict(programs=programs, per=per, slots=slots)


def cublas_runner(hidden, weight, targets, rows=1024):
    n = hidden.shape[0]
    out = torch.empty((rows, weight.shape[0]), device=hidden.device, dtype=torch.float32)
    loss = torch.empty(n, device=hidden.device, dtype=torch.float32)

    def run():
        for r0 in range(0, n, rows):
            r = min(rows, n - r0)
            z = torch.mm(hidden[r0:r0 + r], weight.T, out_dtype=torch.float32, out=out[:r])
            loss[r0:r0 + r] = torch.logsumexp(z, 1) - z.gather(1, targets[r0:r0 + r, None])[:, 0]
        return loss

    return run, dict(rows=rows)


def main():
    if answer_probe(SHAPES, SPECS, sweep_runner):
        return
    args = parse_args(["S1", "S3"])
    rows_out = []
    for name in args.shapes:
        n, h, v = SHAPES[name]
        hidden, weight, targets = problem(n, h, v)

        package = package_eval(hidden, weight, targets)
        ref = package()
        sub = torch.arange(0, n, max(1, n // 256), device=hidden.device)
        z64 = hidden[sub].double() @ weight.double().T
        ref64 = torch.logsumexp(z64, 1) - z64.gather(1, targets[sub, None])[:, 0]
        pkg_err = ((ref[sub].double() - ref64).abs() / ref64.abs()).max().item()
        print(f"{name}: package vs float64 on {len(sub)} rows: max rel {pkg_err:.1e}", flush=True)
        del z64

        variants = {"package": (package, {}), "matmul": (lambda: hidden @ weight.T, {})}
        checked, errors = checked_variants(__file__, name, SPECS, sweep_runner, hidden, weight, targets, ref,
                                           lambda vname, spec: "ws" in vname)  # a compiler abort must not end the run
        variants.update(checked)
        results = {k: info for k, (_run, info) in checked.items()}
        results.update({k: dict(error=e) for k, e in errors.items()})
        run, info = cublas_runner(hidden, weight, targets)
        out = run()
        err = ((out - ref).abs().max() / ref.abs().max()).item()
        variants["cublas-fp32"] = (run, info)
        results["cublas-fp32"] = dict(err=err, **info)

        times = interleaved({k: fn for k, (fn, _info) in variants.items()})
        mm = median(times["matmul"])
        for k in variants:
            ms = median(times[k])
            row = dict(shape=name, name=k, ms=ms, matmul_ms=mm, rounds=times[k], **results.get(k, {}))
            rows_out.append(row)
        for k, r in results.items():
            if "error" in r:
                rows_out.append(dict(shape=name, name=k, error=r["error"]))
        variants.clear()  # the closures hold this shape's tensors
        torch.cuda.empty_cache()
    write_results(args.out, "experiment_sweep.json", rows_out)


if __name__ == "__main__":
    main()
