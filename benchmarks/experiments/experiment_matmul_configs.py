"""The Triton matmul's tile configuration per product (issue 22, targets 2 and 4), one GPU call.

The package runs every product into a 16-bit gradient, and the compensated pairs, on one matmul config
(128 x 256 x 64, 8 warps, 3 stages: one program per SM). At S4 with 960 MiB chunks the dW products into
the bf16 + int8 pair took 134 ms against 93 ms for the same FLOPs as dX (``experiment_chunked_s4.py``,
at commit 3502f5a): a K loop of 60 steps, then an epilogue that reads and writes 6 bytes an element and
overlaps nothing, since no second program shares the SM. Prediction: a config whose programs fit two to
an SM (128 x 128 tiles, 3 stages: 96 KB of operands) lets one program's epilogue run under the other's
products, and closes most of the 41 ms; on the plain products it costs a little of the mainloop's rate.
The result through a descriptor (``c_tma``) removes the epilogue's spills (below); it should matter most
for the fp32 sum (an fp32 master weight's dW on the chunked path: 1696 bytes of stack in the shipped
config).

Each case is one product of the package's own shapes, run through ``products`` with
``configs.matmul_config`` patched to each candidate; cuBLAS (``torch.mm``, bf16 out) times the same
FLOPs. Every candidate's output is checked against the shipped config's on the same inputs before
it is timed (a config that computes something else is a row with ``error``).

    python3 benchmarks/experiments/experiment_matmul_configs.py --out $OUT/matmul
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

from fused_linear_ce import configs, gemm, pairs, products  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")



# (block_m, block_p, block_k, group_m, num_warps, num_stages, {switches}); the first is the shipped
# one, against which every other is checked. Run 1 (NOTES v20, ``results/matmul/run1.json``, whose
# meta lists that run's 11 candidates) measured the tile shapes and ``c_tma``: the shipped 128 x 256
# tiles were the fastest or within 1% everywhere, two programs an SM (128 x 128) lost everywhere
# but the paired plan's dX, and c_tma took the fp32 sum from 7.22 to 6.79 ms, the rest unchanged:
# c_tma ships. Run 2 (``results/matmul/run2.json``) added a persistent grid (one program an SM
# walking the tiles; flattened or warp-specialised tile loops) from ``persistent_grid.patch`` (on
# commit a238e65; the patch is at commit 3502f5a): the pair and the fp32 sum do not fit 3 stages
# with it (240-400 KB of shared memory), 2 stages lose more than the overlap gains; not kept.
SHIPPED = (128, 256, 64, 8, 8, 3)
CANDIDATES = [
    (*SHIPPED, dict(c_tma=True)),
    (*SHIPPED, dict(c_tma=True, split_pair=True)),
    (128, 128, 64, 8, 4, 3, dict(c_tma=True, split_pair=True)),
    (128, 128, 64, 8, 8, 3, dict(c_tma=True, split_pair=True)),
    (*SHIPPED, dict(c_tma=False)),
    (128, 256, 64, 8, 8, 4, dict(c_tma=True)),
    (128, 128, 64, 8, 4, 3, dict(c_tma=True)),
    (128, 128, 64, 8, 4, 3, dict(c_tma=False)),
    (128, 128, 64, 8, 8, 3, dict(c_tma=True)),
    (128, 128, 64, 8, 4, 4, dict(c_tma=True)),
    (256, 128, 64, 8, 8, 3, dict(c_tma=True)),
]


def config_name(spec):
    flags = [k if v is True else f"no-{k}" if v is False else f"{k}={v}" for k, v in spec[6].items()]
    return "x".join(map(str, spec[:6])) + "".join(" " + f for f in flags)


def cases(scale):
    """name -> (setup() -> (run, output tensors, flops)). ``scale`` shrinks every size (a smoke run)."""
    n4, n1, h, v = 65536 // scale, 8192 // scale, 4096 // scale, 128256 // scale
    rows = 3840 // scale  # the chunk of rows 960 MiB holds at S4
    cols = 2048 // scale  # the paired plan's vocabulary block at S4
    dev = DEVICE
    bf = dict(device=dev, dtype=torch.bfloat16)
    unscale = torch.full((1,), 1.0 / n4, device=dev)

    def randn(*shape, s=1.0):
        return (s * torch.randn(*shape, device=dev)).to(torch.bfloat16)

    def chunk_dw_pair():
        da, x = randn(rows, v, s=1e-2), randn(rows, h)
        hi = torch.zeros(v, h, **bf)
        lo = pairs.compensation_buffer(hi, torch.int8)
        return (lambda: products.compensated(da.t(), x, hi, lo, True, unscale)), (hi, lo), 2 * v * h * rows, (da.t(), x)

    def chunk_dw_master():
        da, x = randn(rows, v, s=1e-2), randn(rows, h)
        out = torch.zeros(v, h, device=dev)
        return (lambda: products.product(da.t(), x, out, True, unscale)), (out,), 2 * v * h * rows, (da.t(), x)

    def chunk_dx():
        da, w = randn(rows, v, s=1e-2), randn(v, h)
        out = torch.empty(rows, h, **bf)
        return (lambda: gemm.matmul(da, w, out, False, unscale)), (out,), 2 * rows * h * v, (da, w)

    def paired_dx():
        da, w = randn(n4, cols, s=1e-2), randn(cols, h)
        hi = torch.zeros(n4, h, **bf)
        lo = pairs.compensation_buffer(hi, torch.int8)
        return (lambda: products.compensated(da, w, hi, lo, True, unscale)), (hi, lo), 2 * n4 * h * cols, (da, w)

    def s1_dw():
        da, x = randn(n1, v, s=1e-2), randn(n1, h)
        out = torch.empty(v, h, **bf)
        return (lambda: gemm.matmul(da.t(), x, out, False, unscale)), (out,), 2 * v * h * n1, (da.t(), x)

    return {"s4-chunk-dW-pair": chunk_dw_pair, "s4-chunk-dW-master": chunk_dw_master, "s4-chunk-dX": chunk_dx,
            "s4-paired-dX": paired_dx, "s1-chunked-dW": s1_dw}


def with_config(cfg, fn):
    """``fn()`` with every product's config ``cfg`` (``configs.override``)."""
    with configs.override(product=cfg, paired_rows=cfg, compensated=cfg):
        return fn()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=".")
    ap.add_argument("--scale", type=int, default=1, help="divide every size by this (a quick check)")
    ap.add_argument("--cases", nargs="*", help="only these cases (default all)")
    ap.add_argument("--candidates", nargs="*", type=int,
                    help="only these indices into CANDIDATES (default all; 0, the shipped one, always)")
    args = ap.parse_args()
    chosen = [c for i, c in enumerate(CANDIDATES) if i == 0 or not args.candidates or i in args.candidates]
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    meta = dict(gpu=torch.cuda.get_device_name() if DEVICE.type == "cuda" else "cpu", **versions(),
                date=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                candidates=chosen, scale=args.scale)
    rows, t0 = [], time.perf_counter()
    for name, setup in cases(args.scale).items():
        if args.cases and name not in args.cases:
            continue
        run, outs, flops, (a, b) = setup()
        ms = timed(lambda: torch.mm(a, b))
        rows.append(dict(case=name, config="cublas", ms=ms, tflops=flops / ms / 1e9))
        expected = None
        for spec in chosen:
            cfg = configs.MatmulConfig(*spec[:6], **spec[6])
            row = dict(case=name, config=config_name(spec))
            try:
                for t in outs:
                    t.zero_()
                with_config(cfg, run)  # one product from zero: the check, on the result (a pair's hi)
                got = outs[0].float().clone()
                if expected is None:
                    expected = got
                else:
                    row["max_diff"] = (got - expected).abs().max().item()
                    if not row["max_diff"] <= 1e-2 * expected.abs().max().item():
                        raise RuntimeError(f"differs from the shipped config by {row['max_diff']:.3g}")
                row["ms"] = with_config(cfg, lambda: timed(run))
                row["tflops"] = flops / row["ms"] / 1e9
            except Exception as exc:  # a row, not a crash
                row["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
            rows.append(row)
            print(f"[{time.perf_counter() - t0:5.0f}s] " + " ".join(
                f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()), flush=True)
            (out_dir / "experiment_matmul_configs.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
        del run, outs, a, b
        torch.cuda.empty_cache()

    print(f"\n{'case':20} {'config':56} {'ms':>8} {'TFLOP/s':>8}")
    for r in rows:
        tail = r["error"][:60] if "error" in r else f"{r['ms']:8.3f} {r['tflops']:8.1f}"
        print(f"{r['case']:20} {r['config']:56} {tail}")


if __name__ == "__main__":
    main()
