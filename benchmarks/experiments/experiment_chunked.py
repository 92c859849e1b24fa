"""One GPU call: the chunked path (gradients in the forward) against the recompute path.

    python3 benchmarks/experiments/experiment_chunked.py [--shape N H V] [--out DIR]

Checks every variant against an fp32 reference (TF32 off), times forward+backward and measures
the peak extra memory (above inputs and the gradients themselves), then profiles one step of each
path per kernel. Prints a table last; writes experiment_chunked.json under --out.
"""

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import triton.testing

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "torch-ext"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: tune.py, bench.py
from fused_linear_ce import configs, fused_linear_cross_entropy  # noqa: E402
from fused_linear_ce.reference import chunked_linear_cross_entropy  # noqa: E402

from experiment_common import kernel_times  # noqa: E402
from tune import problem, rel  # noqa: E402 - the same inputs and error measure as tune.py

MiB = 1 << 20


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", type=int, nargs=3, default=[8192, 4096, 128256])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    n, h, v = args.shape
    dev = "cuda"
    hidden, weight, targets = problem(n, h, v, dev)

    torch.backends.cuda.matmul.allow_tf32 = False
    ref_loss, count, ref_dx, ref_dw, _ = chunked_linear_cross_entropy(hidden, weight, targets, chunk=2048)
    ref_loss, ref_dx, ref_dw = ref_loss / count, ref_dx / count, ref_dw / count

    def step(**kw):
        hd = hidden.detach().requires_grad_(True)
        wd = weight.detach().requires_grad_(True)
        loss = fused_linear_cross_entropy(hd, wd, targets, **kw)
        loss.backward()
        return loss, hd.grad, wd.grad

    grads_bytes = hidden.numel() * 2 + weight.numel() * 2
    variants = {
        "recompute-256M": dict(strategy="recompute"),
        "chunked-whole": dict(strategy="chunked", chunk_bytes=1 << 40),
        "chunked-1G": dict(strategy="chunked", chunk_bytes=1024 * MiB),
        "chunked-512M": dict(strategy="chunked", chunk_bytes=512 * MiB),
    }
    flops = 2.0 * n * h * v
    mm = triton.testing.do_bench(lambda: hidden @ weight.T, warmup=50, rep=300)
    rows = []
    for name, kw in variants.items():
        loss, dx, dw = step(**kw)
        err = dict(loss=abs(loss.item() - ref_loss.item()) / abs(ref_loss.item()), dx=rel(dx, ref_dx), dw=rel(dw, ref_dw))
        del dx, dw, loss
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        step(**kw)
        extra = (torch.cuda.max_memory_allocated() - base - grads_bytes) / MiB
        ms = triton.testing.do_bench(lambda: step(**kw), warmup=5, rep=60)
        fwd = triton.testing.do_bench(lambda: fused_linear_cross_entropy(hidden, weight, targets), warmup=5, rep=60)
        rows.append(dict(name=name, ms=ms, fwd_nograd_ms=fwd, extra_mib=extra, tflops=3 * flops / ms / 1e9, **err))
        print(rows[-1], flush=True)

    # The chunked sweep's tiles and grouping (one tile a program), and the forward-only sweep's tiles.
    from dataclasses import replace

    base_chunked, base_sweep = configs._GPU_CHUNKED_SWEEP, configs._GPU_SWEEP
    sweeps = {
        "256x128-g16-tma": (base_chunked, base_sweep, True),
        "128x256-g16-tma": (replace(base_chunked, block_n=128, block_v=256), base_sweep, True),
        "256x128-g16-s4-tma": (replace(base_chunked, num_stages=4), base_sweep, True),
        "256x128-g16": (base_chunked, base_sweep),
        "256x128-g32": (replace(base_chunked, group_m=32), base_sweep),
    }
    for label, (cfg, sweep_cfg, *tma) in sweeps.items():
        configs._GPU_CHUNKED_SWEEP, configs._GPU_SWEEP = cfg, sweep_cfg
        configs._USE_TMA = bool(tma)
        try:
            loss, dx, dw = step(**variants["chunked-whole"])
            ok = rel(dx, ref_dx) < 3e-3 and rel(dw, ref_dw) < 3e-3
            del dx, dw
            ms = triton.testing.do_bench(lambda: step(**variants["chunked-whole"]), warmup=5, rep=60)
            rows.append(dict(name=f"chunked-whole-{label}", ms=ms, ok=ok))
        except Exception as exc:  # a config that does not compile (shared memory) is a result too
            rows.append(dict(name=f"chunked-whole-{label}", error=str(exc)[:200]))
        print(rows[-1], flush=True)
    for label, sweep_cfg in {"128x256": base_sweep, "128x256-tma": base_sweep,
                             "128x256-s4-tma": replace(base_sweep, num_stages=4),
                             "256x128-tma": replace(base_sweep, block_n=256, block_v=128)}.items():
        configs._GPU_SWEEP = sweep_cfg
        configs._USE_TMA = label.endswith("tma")
        try:
            ms = triton.testing.do_bench(lambda: fused_linear_cross_entropy(hidden, weight, targets), warmup=5, rep=60)
            rows.append(dict(name=f"forward-sweep-{label}", fwd_nograd_ms=ms))
        except Exception as exc:
            rows.append(dict(name=f"forward-sweep-{label}", error=str(exc)[:200]))
        print(rows[-1], flush=True)
    configs._GPU_CHUNKED_SWEEP, configs._GPU_SWEEP = base_chunked, base_sweep
    configs._USE_TMA = False

    # cuBLAS for the two backward products, as the unit the Triton products are held to
    da = torch.randn(n, v, device=dev).bfloat16()
    rows.append(dict(name="cublas-dx(da@W)", ms=triton.testing.do_bench(lambda: da @ weight, warmup=20, rep=100)))
    rows.append(dict(name="cublas-dw(da^T@X)", ms=triton.testing.do_bench(lambda: da.t() @ hidden, warmup=20, rep=100)))

    # Per kernel, one step of each path
    kernels = {}
    for name in ("recompute-256M", "chunked-whole"):
        kernels[name] = kernel_times(lambda: step(**variants[name]), top=8, width=40)
        print(name, kernels[name], flush=True)

    meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                shape=dict(N=n, H=h, V=v), matmul_ms=mm, matmul_tflops=flops / mm / 1e9)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "experiment_chunked.json").write_text(json.dumps(dict(meta=meta, rows=rows, kernels=kernels), indent=1))
    print(f"\nmatmul {mm:.2f} ms ({flops / mm / 1e9:.0f} TFLOP/s)  N={n} H={h} V={v} {meta['gpu']}")
    print(f"{'variant':28s} {'ms':>8s} {'fwd':>7s} {'MiB':>8s} {'TF/s':>6s} {'dx':>9s} {'dw':>9s}")
    for r in rows:
        print(f"{r['name']:28s} {r.get('ms', float('nan')):8.2f} {r.get('fwd_nograd_ms', float('nan')):7.2f} "
              f"{r.get('extra_mib', float('nan')):8.0f} {r.get('tflops', float('nan')):6.0f} "
              f"{r.get('dx', float('nan')):9.2e} {r.get('dw', float('nan')):9.2e}")


if __name__ == "__main__":
    main()
