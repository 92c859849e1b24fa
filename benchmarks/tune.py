"""One GPU call: check the kernels against an fp32 reference at a real size, then time config variants.

    python3 benchmarks/tune.py [--shape N H V] [--out DIR]

Prints a table last; writes tune.json under --out. Configs are swapped by patching ``configs``.
"""

import argparse
import json
import os
import sys
from dataclasses import replace
from pathlib import Path

import torch
import triton.testing

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "torch-ext"))
from fused_linear_ce import configs, fused_linear_cross_entropy  # noqa: E402
from fused_linear_ce.reference import chunked_linear_cross_entropy  # noqa: E402


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def problem(n, h, v, dev="cuda"):
    """bf16 hidden, weight and targets with logits of std ~2, seed 0 (shared with
    ``experiments/experiment_ignored.py``)."""
    torch.manual_seed(0)
    hidden = (torch.randn(n, h, device=dev) * 0.5).bfloat16()
    weight = (torch.randn(v, h, device=dev) * (4.0 / h) ** 0.5).bfloat16()
    targets = torch.randint(0, v, (n,), device=dev)
    return hidden, weight, targets


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", type=int, nargs=3, default=[8192, 4096, 128256])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    n, h, v = args.shape
    hidden, weight, targets = problem(n, h, v)

    # Reference: fp32 logits from the bf16 inputs, chunked.
    ref_loss, count, ref_dx, ref_dw, _ = chunked_linear_cross_entropy(hidden, weight, targets, chunk=2048)
    ref_loss = ref_loss / count
    ref_dx, ref_dw = ref_dx / count, ref_dw / count

    def run(chunk_size=None):
        hd = hidden.detach().requires_grad_(True)
        wd = weight.detach().requires_grad_(True)
        loss = fused_linear_cross_entropy(hd, wd, targets, chunk_bytes=chunk_size)
        loss.backward()
        return loss, hd.grad, wd.grad

    flops = 2.0 * n * h * v
    mm_ms = triton.testing.do_bench(lambda: hidden @ weight.T, warmup=50, rep=300)
    rows = [dict(name="matmul", ms=mm_ms, tflops=flops / mm_ms / 1e9)]

    # Each variant through ``configs.override`` (every family's table: the one of this GPU is what runs).
    base_sweep = configs.tiles("sweep", hidden.dtype, h, where=hidden.device)
    sweep_variants = {
        "base": base_sweep,
        "bv256": replace(base_sweep, block_v=256),
        "s4": replace(base_sweep, num_stages=4),
        "bn64": replace(base_sweep, block_n=64, num_warps=4),
        "bh128": replace(base_sweep, block_h=128, num_stages=3),
    }
    for name, cfg in sweep_variants.items():
        try:
            with torch.no_grad(), configs.override(sweep=cfg):
                ms = triton.testing.do_bench(lambda: fused_linear_cross_entropy(hidden, weight, targets), warmup=50, rep=300)
                loss = fused_linear_cross_entropy(hidden, weight, targets)
            rows.append(dict(name=f"fwd/{name}", ms=ms, tflops=flops / ms / 1e9, loss_rel=abs(loss.item() - ref_loss.item()) / ref_loss.item()))
        except Exception as e:  # a config that does not compile is a row, not a crash
            rows.append(dict(name=f"fwd/{name}", error=repr(e)[:200]))

    base_mm = configs.matmul_config(hidden.dtype, where=hidden.device)
    mm_variants = {
        "base": base_mm,
        "bp256": replace(base_mm, block_p=256),
        "s4": replace(base_mm, num_stages=4),
    }
    for name, cfg in mm_variants.items():
        for chunk in (None, 64 << 20, 1 << 30):
            try:
                with configs.override(product=cfg):
                    loss, dx, dw = run(chunk)
                    ms = triton.testing.do_bench(lambda: run(chunk), warmup=20, rep=200)
                    torch.cuda.reset_peak_memory_stats()
                    base = torch.cuda.memory_allocated()
                    run(chunk)
                    extra = (torch.cuda.max_memory_allocated() - base) / 2**20
                rows.append(dict(name=f"fwdbwd/{name}/chunk={chunk}", ms=ms, tflops=3 * flops / ms / 1e9,
                                 loss_rel=abs(loss.item() - ref_loss.item()) / ref_loss.item(),
                                 dx_rel=rel(dx, ref_dx), dw_rel=rel(dw, ref_dw), peak_mib=extra))
            except Exception as e:
                rows.append(dict(name=f"fwdbwd/{name}/chunk={chunk}", error=repr(e)[:300]))

    # Where the time goes: CUDA kernel totals of one forward+backward at the default settings.
    from torch.profiler import ProfilerActivity, profile

    run()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    for e in sorted(prof.key_averages(), key=lambda e: -e.device_time_total)[:8]:
        rows.append(dict(name=f"kernel/{e.key[:24]}x{e.count}", ms=e.device_time_total / 1e3, tflops=0.0))

    def torch_eager():
        hd = hidden.detach().requires_grad_(True)
        wd = weight.detach().requires_grad_(True)
        loss = torch.nn.functional.cross_entropy((hd @ wd.T).float(), targets)
        loss.backward()
        return loss, hd.grad, wd.grad

    loss, dx, dw = torch_eager()
    ms = triton.testing.do_bench(torch_eager, warmup=20, rep=200)
    rows.append(dict(name="torch-eager", ms=ms, tflops=3 * flops / ms / 1e9, dx_rel=rel(dx, ref_dx), dw_rel=rel(dw, ref_dw)))

    meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__, shape=[n, h, v])
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "tune.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    print(meta)
    for r in rows:
        if "error" in r:
            print(f"{r['name']:32s} ERROR {r['error']}")
        else:
            extra = " ".join(f"{k}={r[k]:.2e}" for k in ("loss_rel", "dx_rel", "dw_rel") if k in r)
            mem = f" peak+{r['peak_mib']:.0f}MiB" if "peak_mib" in r else ""
            print(f"{r['name']:32s} {r['ms']:8.2f} ms {r['tflops']:6.0f} TF/s {extra}{mem}")


if __name__ == "__main__":
    main()
