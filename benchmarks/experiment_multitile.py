"""One GPU call: the chunked path's sweep with several vocabulary tiles a program (v8, NOTES.md).

Ran at commit 59a8ef8, whose ``configs.CHUNKED_MULTI_TILE`` switched the two; the multi-tile sweep
was removed in the next commit, so at later commits its rows time the one-tile sweep.

    python3 benchmarks/experiment_multitile.py [--shapes S1 S2 S3] [--out DIR]

Per shape (bf16, random data as tune.py): chunked-whole forward+backward with the sweep's programs one
tile each (1-D grouped grid) against several tiles each (splits from ``configs.vocab_splits``), in
256 x 128 and 128 x 256 tiles; the recompute path at 64 MiB and its default; the evaluation forward;
torch.compile and Liger side by side when available. Each checked against an fp32 reference (TF32
off). Prints a table last; writes experiment_multitile.json under --out.
"""

import argparse
import os
import sys
from dataclasses import replace
from pathlib import Path

import torch
import triton.testing

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "torch-ext"))
from fused_linear_ce import configs, fused_linear_cross_entropy  # noqa: E402

from experiment_common import MiB, measure, reference, write_results  # noqa: E402
from tune import problem  # noqa: E402

SHAPES = {"S1": (8192, 4096, 128256), "S2": (8192, 2304, 256000), "S3": (16384, 2048, 151936)}
BASE = configs._GPU_CHUNKED_SWEEP


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES))
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    peers = {}
    try:
        from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy as liger

        peers["liger"] = lambda h, w, t: (lambda o: o[0] if isinstance(o, (tuple, list)) else o)(liger(h, w, t))
    except Exception:
        pass

    def torch_loss(h, w, t):
        return torch.nn.functional.cross_entropy((h @ w.T).float(), t)

    peers["torch.compile"] = torch.compile(torch_loss)
    rows = []
    for shape in args.shapes:
        n, h, v = SHAPES[shape]
        hidden, weight, targets = problem(n, h, v)
        ref = reference(hidden, weight, targets)
        grads_bytes = hidden.numel() * 2 + weight.numel() * 2
        mm = triton.testing.do_bench(lambda: hidden @ weight.T, warmup=20, rep=100)

        def step(fn):
            hd = hidden.detach().requires_grad_(True)
            wd = weight.detach().requires_grad_(True)
            loss = fn(hd, wd, targets)
            loss.backward()
            return loss, hd.grad, wd.grad

        def ours(**kw):
            return lambda hd, wd, t: fused_linear_cross_entropy(hd, wd, t, **kw)

        whole = dict(strategy="chunked", chunk_bytes=1 << 40)
        variants = {
            "chunked-whole one-tile 256x128": (ours(**whole), False, BASE),
            "chunked-whole multi 256x128": (ours(**whole), True, BASE),
            "chunked-whole multi 128x256": (ours(**whole), True, replace(BASE, block_n=128, block_v=256, group_m=8)),
            "recompute-64M": (ours(strategy="recompute", chunk_bytes=64 * MiB), True, BASE),
            "recompute-256M": (ours(strategy="recompute"), True, BASE),
        }
        for name, fn in peers.items():
            variants[name] = (fn, True, BASE)
        for name, (fn, multi, cfg) in variants.items():
            configs.CHUNKED_MULTI_TILE, configs._GPU_CHUNKED_SWEEP = multi, cfg
            try:
                rows.append(dict(shape=shape, name=name, matmul_ms=mm, **measure(step, fn, ref, grads_bytes)))
            except Exception as exc:
                rows.append(dict(shape=shape, name=name, error=f"{type(exc).__name__}: {str(exc)[:200]}"))
            print(rows[-1], flush=True)
        configs.CHUNKED_MULTI_TILE, configs._GPU_CHUNKED_SWEEP = True, BASE
        with torch.no_grad():
            fwd = triton.testing.do_bench(lambda: fused_linear_cross_entropy(hidden, weight, targets), warmup=5, rep=50)
        rows.append(dict(shape=shape, name="evaluation forward", ms=fwd, matmul_ms=mm))
        print(rows[-1], flush=True)
        torch.cuda.empty_cache()

    write_results(args.out, "experiment_multitile.json", rows)

if __name__ == "__main__":
    main()
