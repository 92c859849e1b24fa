"""Who sums a chunk's weight gradient across token chunks fastest (issue 22, targets 2 and 3), one GPU call.

The chunked path adds every chunk's dW = da^T @ x ((V, R) @ (R, H)) to a running sum across chunks:
an fp32 master weight's gradient (target 3) through the Triton matmul's fp32 epilogue, which also
applies the chunk's factor; a bf16 weight's through the bf16 + int8 pair (target 2). Both epilogues
read and write the V x H sum once a chunk (8 and 6 bytes an element) with one program per SM, so
nothing overlaps them. cuBLAS with an fp32 result and beta = 1 (``products.accumulate``) reads and
writes the same bytes, but its Hopper kernels run two consumer warpgroups in turn, one's epilogue
under the other's products. Prediction: at S4's chunk shapes it sums into fp32 within ~5% of its
own bf16-out product, where the Triton fp32 sum is ~12% and the pair ~23% above it (run 3).

Per chunk of R rows (the chunk_bytes that hold them at V = 128256: 256 MiB -> 1024, 448 MiB ->
1792, 960 MiB -> 3840, 1 GiB -> 4096), ms of one product and of S4's 65536 rows in such chunks:
cuBLAS into bf16 (the floor), cuBLAS into fp32 (beta = 1), the same on the two halves of the
vocabulary (two outputs: the fp32 sum split between the gradient's own memory and a buffer), the
Triton fp32 sum, the Triton pair. Each result is checked against a float64 product first.

    python3 benchmarks/experiments/experiment_fp32_sum.py --out $OUT/fp32_sum
"""

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "torch-ext"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench import versions  # noqa: E402 - before triton: sets TRITON_INTERPRET=1 without a GPU
from experiment_common import timed  # noqa: E402

import torch  # noqa: E402
import triton  # noqa: E402

from fused_linear_ce import pairs, products  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")




def methods(da, x, unscale):
    v, h = da.shape[1], x.shape[1]
    half = v // 2
    out16 = torch.empty(v, h, dtype=torch.bfloat16, device=DEVICE)
    acc = torch.zeros(v, h, device=DEVICE)
    lo_part, hi_part = acc[:half], torch.zeros(v - half, h, device=DEVICE)
    pair_hi = torch.zeros(v, h, dtype=torch.bfloat16, device=DEVICE)
    pair_lo = pairs.compensation_buffer(pair_hi, torch.int8)
    a = da.t()
    return {
        "cublas-bf16": (lambda: torch.mm(a, x, out=out16), out16, 1.0),
        "cublas-fp32-sum": (lambda: products.accumulate(a, x, acc, False), acc, 1.0),
        "cublas-fp32-halves": (lambda: (products.accumulate(a[:half], x, lo_part, False),
                                        products.accumulate(a[half:], x, hi_part, False)), None, 1.0),
        "triton-fp32-sum": (lambda: products.product(a, x, acc, True, unscale), acc, unscale.item()),
        "triton-pair": (lambda: products.compensated(a, x, pair_hi, pair_lo, True, unscale), pair_hi, unscale.item()),
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=".")
    ap.add_argument("--rows", nargs="+", type=int, default=[1024, 1792, 3840, 4096])
    ap.add_argument("--scale", type=int, default=1, help="divide V and H by this (a quick check)")
    args = ap.parse_args()
    n_total, h, v = 65536, 4096 // args.scale, 128256 // args.scale
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    meta = dict(gpu=torch.cuda.get_device_name() if DEVICE.type == "cuda" else "cpu", **versions(),
                date=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), args=vars(args))
    rows, t0 = [], time.perf_counter()
    unscale = torch.full((1,), 0.5, device=DEVICE)
    for r in args.rows:
        g = torch.Generator(DEVICE).manual_seed(r)
        da = (1e-2 * torch.randn(r, v, device=DEVICE, generator=g)).to(torch.bfloat16)
        x = torch.randn(r, h, device=DEVICE, generator=g).to(torch.bfloat16)
        exact = (da.double().t() @ x.double())
        chunks = triton.cdiv(n_total, r)
        for name, (run, out, factor) in methods(da, x, unscale).items():
            row = dict(rows=r, method=name)
            if out is not None:  # one product from zero, against float64
                out.zero_()
                run()
                got = out.double() / factor
                row["rel_err"] = ((got - exact).norm() / exact.norm()).item()
            row["ms"] = timed(run)
            row["s4_ms"] = row["ms"] * chunks
            row["tflops"] = 2 * v * h * r / row["ms"] / 1e9
            rows.append(row)
            print(f"[{time.perf_counter() - t0:5.0f}s] " + " ".join(
                f"{k}={val:.4g}" if isinstance(val, float) else f"{k}={val}" for k, val in row.items()), flush=True)
            (out_dir / "experiment_fp32_sum.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
        del da, x, exact
        torch.cuda.empty_cache() if DEVICE.type == "cuda" else None

    print(f"\n{'rows':>5} {'method':20} {'ms':>8} {'S4 ms':>8} {'TFLOP/s':>8} {'rel err':>9}")
    for r in rows:
        print(f"{r['rows']:5} {r['method']:20} {r['ms']:8.3f} {r['s4_ms']:8.1f} {r['tflops']:8.1f} "
              f"{r.get('rel_err', float('nan')):9.2e}")


if __name__ == "__main__":
    main()
