"""Experiment (GPU): the logits' product by cuBLAS with an fp32 result, then a memory-bound sweep.

    python3 benchmarks/experiment_product.py --out $OUT

A. cuBLAS ``hidden @ weight.T`` with a bf16 result against an fp32 one (``torch.mm(out_dtype=)``),
   in pieces of rows, as ms for all N rows.
B. Per shape: torch.compile, ours chunked (one chunk) with the product by cuBLAS (``product``) and
   inside the sweep (``in-kernel``), ours by default, and the matmul row; ``bench.measure``'s
   figures (times, extra memory, errors against the fp32-logit reference). The sweep's tile for
   the stored product in three variants at S1.
C. A kernel-time breakdown (torch profiler) of one chunked step at S1, product on.
Writes ``experiment_product.json`` and ``profile.txt`` under --out; prints a table last.
"""

import argparse
import json
import os
import sys
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench  # noqa: E402
from bench import SHAPES, WHOLE, fused_linear_cross_entropy, make_data, measure, reference_and_stats  # noqa: E402
from fused_linear_ce import configs  # noqa: E402


def product_times(n, h, v, piece_rows):
    x, w, _ = make_data(n, h, v, "random", torch.device("cuda"), 0)
    out = {}
    for rows in piece_rows:
        buf = torch.empty((rows, v), dtype=torch.float32, device="cuda")
        pieces = n // rows
        f32 = lambda: [torch.mm(x[i * rows:(i + 1) * rows], w.t(), out_dtype=torch.float32, out=buf)  # noqa: E731
                       for i in range(pieces)]
        b16 = lambda: [x[i * rows:(i + 1) * rows] @ w.t() for i in range(pieces)]  # noqa: E731
        out[rows] = dict(fp32_out=bench.bench(f32, 20, x.device, False), bf16_out=bench.bench(b16, 20, x.device, False))
        del buf
    return out


def with_product(flag, fn):
    def run(*a, **k):
        old = configs.PRODUCT_SWEEP
        configs.PRODUCT_SWEEP = flag
        try:
            return fn(*a, **k)
        finally:
            configs.PRODUCT_SWEEP = old
    return run


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--shapes", default="S1,S1-peaked,S2,S3")
    ap.add_argument("--no-products", action="store_true", help="skip part A")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    dev = torch.device("cuda")
    result = {"products": {}, "rows": [], "meta": dict(bench.versions(), gpu=torch.cuda.get_device_name())}

    if not args.no_products:
        n, h, v = SHAPES["S1"]
        result["products"]["S1"] = product_times(n, h, v, [512, 1024, 2048, 8192])
        for name, rows in (("S2", 1152), ("S3", 1024)):
            result["products"][name] = product_times(*SHAPES[name], [rows])
        print(json.dumps(result["products"], indent=1), flush=True)

    chunked = partial(fused_linear_cross_entropy, strategy="chunked", chunk_bytes=WHOLE)
    methods = {
        "torch-compile": torch.compile(bench.torch_ce, dynamic=False),
        "chunked-product": with_product(True, chunked),
        "chunked-in-kernel": with_product(False, chunked),
        "flce-default": fused_linear_cross_entropy,
        "flce-default-1G-eval": partial(fused_linear_cross_entropy, chunk_bytes=1 << 30),
        "flce-default-in-kernel": with_product(False, fused_linear_cross_entropy),
    }
    tiles = {"64x256w8": (64, 256, 8), "128x128w8": (128, 128, 8), "32x512w8": (32, 512, 8), "64x128w4": (64, 128, 4)}
    for shape in args.shapes.split(","):
        base, _, dist = shape.partition("-")
        n, h, v = SHAPES[base]
        hidden, weight, targets = make_data(n, h, v, dist or "random", dev, 0)
        ref = reference_and_stats(hidden, weight, targets, "tf32")[:3]
        row = dict(shape=shape, method="matmul", **bench.measure_matmul(hidden, weight, False))
        result["rows"].append(row)
        print(row, flush=True)
        todo = dict(methods)
        if shape == "S1":
            for tname, (bn, bv, nw) in tiles.items():
                cfg = configs.TileConfig(block_n=bn, block_v=bv, block_h=64, group_m=16, num_warps=nw, num_stages=1)

                def tiled(*a, _cfg=cfg, **k):
                    old = configs._GPU_PRODUCT_SWEEP
                    configs._GPU_PRODUCT_SWEEP = _cfg
                    try:
                        return chunked(*a, **k)
                    finally:
                        configs._GPU_PRODUCT_SWEEP = old
                todo[f"chunked-product-{tname}"] = tiled
        for name, fn in todo.items():
            try:
                row = dict(shape=shape, method=name, **measure(fn, hidden, weight, targets, ref, False))
            except Exception as e:  # noqa: BLE001
                row = dict(shape=shape, method=name, error=f"{type(e).__name__}: {e}"[:300])
            result["rows"].append(row)
            print(row, flush=True)
            bench.free_memory(dev)
        (out / "experiment_product.json").write_text(json.dumps(result, indent=1))
        del hidden, weight, targets, ref
        bench.free_memory(dev)

    # C. profile one chunked step at S1, product on and off
    n, h, v = SHAPES["S1"]
    hidden, weight, targets = make_data(n, h, v, "random", dev, 0)
    hx = hidden.detach().requires_grad_(True)
    wx = weight.detach().requires_grad_(True)
    from torch.profiler import ProfilerActivity, profile

    for flag in (True, False):
        step = with_product(flag, chunked)
        for _ in range(2):
            step(hx, wx, targets).backward()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            hx.grad = wx.grad = None
            step(hx, wx, targets).backward()
            torch.cuda.synchronize()
        table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=60)
        (out / f"profile_product_{flag}.txt").write_text(table)
        print(f"product={flag}\n{table}")

    print("\nshape       method                        fwd_ms  fwdbwd_ms  extra_MiB  dx_rel    dw_rel")
    for r in result["rows"]:
        if "error" in r:
            print(f"{r['shape']:<11} {r['method']:<29} ERROR {r['error'][:80]}")
            continue
        print(f"{r['shape']:<11} {r['method']:<29} {r['fwd_ms']:7.2f} {r['fwdbwd_ms']:9.2f} "
              f"{r.get('extra_mib', float('nan')):10.0f}  {r.get('dx_rel', float('nan')):.2e}  {r.get('dw_rel', float('nan')):.2e}")
    for shape, d in result["products"].items():
        for rows, t in d.items():
            print(f"product {shape} rows {rows}: fp32-out {t['fp32_out']:.2f} ms, bf16-out {t['bf16_out']:.2f} ms (all N rows)")


if __name__ == "__main__":
    main()
