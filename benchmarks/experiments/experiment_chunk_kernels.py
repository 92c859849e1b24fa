"""Two of the chunked path's per-chunk costs, one GPU call (issue 22 targets 2-3; issue 21's chunked GRPO).

1. **The chunk's grad_hidden** (``products.product(da, weight, ...)``: (R, V) @ (V, H), K = V long).
   The Triton matmul runs one program per 128 x 256 output tile with the whole K loop in it, so its
   time goes by whole waves: at H = 4096 and R = 1792 rows (448 MiB chunks at V = 128256) its 224
   tiles take two waves of 132 SMs, the second 70% full. Prediction: cuBLAS with an fp32 result
   (then one ``scale`` into the 16-bit gradient, an R x H fp32 buffer) picks tiles or a split that
   fill the waves, and is faster wherever the Triton tiles' last wave is partly empty.
2. **``softmax_gradient_kernel`` with the entropy gradient** (per-token GRPO on the chunked path)
   compiles to ~224 registers at 8 warps on 128 x 128 tiles: one program per SM in a memory-bound
   kernel (114 registers without it). Prediction: 16 warps (half the elements a thread) give the SM
   twice the warps in flight and bring it near the SFT kernel's time.

    python3 benchmarks/experiments/experiment_chunk_kernels.py --out $OUT/chunk_kernels
"""

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "torch-ext"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench import versions  # noqa: E402 - before triton: sets TRITON_INTERPRET=1 without a GPU
from experiment_common import timed  # noqa: E402

import torch  # noqa: E402
import triton  # noqa: E402

from fused_linear_ce import chunked, configs, device, gemm, products  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")




def dx_rows(args, h, v, record):
    unscale = torch.full((1,), 0.5, device=DEVICE)
    weight = torch.randn(v, h, device=DEVICE).to(torch.bfloat16)
    cfg = configs.matmul_config(torch.bfloat16)
    sms = device.sm_count(DEVICE) if DEVICE.type == "cuda" else 132
    for r in args.rows:
        da = (1e-2 * torch.randn(r, v, device=DEVICE)).to(torch.bfloat16)
        out = torch.empty(r, h, dtype=torch.bfloat16, device=DEVICE)
        exact = (da.double() @ weight.double()) * 0.5
        tiles = triton.cdiv(r, cfg.block_m) * triton.cdiv(h, cfg.block_p)
        waves = triton.cdiv(tiles, sms)
        for name, run in {
            "cublas-bf16": lambda: torch.mm(da, weight, out=out),
            "triton": lambda: gemm.matmul(da, weight, out, False, unscale),
            "cublas-fp32-scale": lambda: products._fp32_then_scale(da, weight, out, unscale),
        }.items():
            run()
            got = out.double() * (0.5 if name == "cublas-bf16" else 1.0)
            record(dict(part="dx", rows=r, method=name, tiles=tiles, wave_fill=tiles / (waves * sms),
                        rel_err=((got - exact).norm() / exact.norm()).item(), ms=timed(run, rep=200)))
        del da, out, exact


def gradient_warps(args, record):
    """The gradient kernel alone on S1's (8192, 128256) chunk, from exponentials in (0, 1]."""
    r, v = 8192 // args.scale, 128256 // args.scale
    cfg = configs.sweep_config(torch.bfloat16, chunked=True)
    g = torch.Generator(DEVICE).manual_seed(0)
    e0 = torch.rand(r, v, device=DEVICE, generator=g).to(torch.bfloat16)
    tiles = triton.cdiv(v, cfg.block_v)
    tile_max = torch.randn(tiles, r, device=DEVICE, generator=g)
    lse2 = torch.stack([tile_max.amax(0), torch.full((r,), 10.0, device=DEVICE)])
    targets = torch.randint(0, v, (r,), device=DEVICE, generator=g)
    z_target = torch.randn(r, device=DEVICE, generator=g)
    stats = chunked.RowStats(lse2, z_target, None, None, None, None)
    coef5 = torch.randn(5, r, device=DEVICE, generator=g)
    from fused_linear_ce.validate import Options
    opts = Options(reduction="mean")
    original = chunked.gradient_warps
    reference = {}
    for fields, coef in (("sft", coef5[:3].contiguous()), ("grpo", coef5)):
        for warps, block_n in [(w, b) for b in args.block_n for w in args.warps]:
            chunked.gradient_warps = lambda entropy_grad, w=warps: w
            e = e0.clone()
            rows_cfg = replace(cfg, block_n=block_n)  # the sweep's vocabulary tiles, fewer rows a program
            try:
                chunked.gradient_in_place(e, tile_max, stats, coef, targets, None, None, opts, None, rows_cfg)
                row = dict(part="gradient", fields=fields, warps=warps, block_n=block_n)
                if fields not in reference:
                    reference[fields] = e.clone()
                else:
                    row["same_bits"] = bool(torch.equal(e, reference[fields]))
                buf = e0.clone()

                def run():
                    buf.copy_(e0)  # the kernel works in place: each call from the same exponentials
                    chunked.gradient_in_place(buf, tile_max, stats, coef, targets, None, None, opts, None, rows_cfg)

                row["ms"] = timed(run, rep=200)
                row["copy_ms"] = timed(lambda: buf.copy_(e0), rep=200)
            except Exception as exc:
                row = dict(part="gradient", fields=fields, warps=warps, block_n=block_n, error=f"{type(exc).__name__}: {str(exc)[:200]}")
            finally:
                chunked.gradient_warps = original
            record(row)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=".")
    ap.add_argument("--rows", nargs="+", type=int, default=[1024, 1792, 2048, 3840, 4096])
    ap.add_argument("--warps", nargs="+", type=int, default=[8, 16, 4])
    ap.add_argument("--block-n", nargs="+", type=int, default=[128], help="rows a gradient program (the sweep's 128)")
    ap.add_argument("--parts", nargs="+", default=["dx", "gradient"])
    ap.add_argument("--scale", type=int, default=1, help="divide the sizes by this (a quick check)")
    args = ap.parse_args()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    meta = dict(gpu=torch.cuda.get_device_name() if DEVICE.type == "cuda" else "cpu", **versions(),
                date=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), args=vars(args))
    rows, t0 = [], time.perf_counter()

    def record(row):
        rows.append(row)
        print(f"[{time.perf_counter() - t0:5.0f}s] " + " ".join(
            f"{k}={val:.4g}" if isinstance(val, float) else f"{k}={val}" for k, val in row.items()), flush=True)
        (out_dir / "experiment_chunk_kernels.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))

    if "dx" in args.parts:
        dx_rows(args, 4096 // args.scale, 128256 // args.scale, record)
    if "gradient" in args.parts:
        gradient_warps(args, record)
    print()
    for r in rows:
        if "error" in r:
            print(r)
        elif r["part"] == "dx":
            print(f"dX R={r['rows']:5} {r['method']:18} {r['ms']:8.3f} ms  tiles {r['tiles']:4} fill {r['wave_fill']:.2f}"
                  f"  err {r['rel_err']:.2e}")
        else:
            print(f"gradient {r['fields']:5} warps {r['warps']:2} rows {r['block_n']:3} {r['ms']:8.3f} ms (copy {r['copy_ms']:.3f})"
                  f" same bits {r.get('same_bits', '-')}")


if __name__ == "__main__":
    main()
