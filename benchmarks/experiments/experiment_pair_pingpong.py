"""The product into a compensated pair on Hopper: Gluon ping-pong kernels (``gluon_pair.py``: the old pair
read when the tile's products end, quarter by quarter; ``gluon_pair_prefetch.py``: the old pair
prefetched by the loader warp) against ``matmul_kernel``'s pair epilogue and cuBLAS's plain product of
the same shape, at the pair's two uses at long context (H200, S4 = 65536 x 4096 x 128256, bf16):

- ``chunk-dW``: a chunk's grad_weight summed into the bf16 + int8 pair (a = da^T of R x V, b = the
  chunk's hidden rows), R = 4096 (1 GiB chunks) and 3840 (960 MiB);
- ``paired-dX``: the paired plan's grad_hidden block (a = da of N x 2048, b = the weight's 2048 rows).

Each variant first checks its pair against the Triton kernel's (bits equal, else the share and the
largest ulp distance of hi), then its time is the median of interleaved rounds. ``--tiles`` the
ping-pong's column tiles a program (``PairPingpongConfig.tiles_per_program``); ``--b-t-tiles`` also b
through its transpose's storage (K-major for wgmma) and the products alone (no epilogue) at those
tiles. Prints a table last; writes pair_pingpong.json under --out.

    python3 benchmarks/experiments/experiment_pair_pingpong.py --cases chunk-dW-4096 paired-dX --tiles 4 8 16
"""

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from experiment_common import interleaved, median, pair_case  # noqa: E402  (puts torch-ext on the path)

import gluon_pair  # noqa: E402
import gluon_pair_prefetch  # noqa: E402
from fused_linear_ce import gemm  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", nargs="+", default=["chunk-dW-4096", "chunk-dW-3840", "paired-dX"])
    ap.add_argument("--tiles", nargs="+", type=int, default=[4, 8, 16])
    ap.add_argument("--b-t-tiles", nargs="*", type=int, default=[8],
                    help="also b through its transpose's storage, and the products alone, at these tiles")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    unscale = torch.tensor([0.5], device="cuda")
    rows = []
    for name in args.cases:
        a, b, shape, _ = pair_case(name)
        hi0 = (1e-3 * torch.randn(shape, device="cuda")).bfloat16()
        lo0 = torch.zeros(shape, dtype=torch.int8, device="cuda")
        hi, lo = hi0.clone(), lo0.clone()
        role = "paired_rows" if name == "paired-dX" else "product"

        def triton_pair():
            gemm.matmul(a, b, hi, True, unscale, lo=lo, role=role)

        b_t = b.t().contiguous().t()  # b's values over its transpose's storage (K-major for wgmma)

        def gluon_run(tiles, transposed=False, mainloop_only=False):
            def run():
                gluon_pair.launch(a, b_t if transposed else b, hi, lo, True, unscale, b_transposed=transposed,
                                  mainloop_only=mainloop_only, cfg=cfg)
            cfg = dataclasses.replace(gluon_pair.CONFIG, tiles_per_program=tiles)
            return run

        out16 = torch.empty(shape, dtype=torch.bfloat16, device="cuda")
        out32 = torch.zeros(shape, dtype=torch.float32, device="cuda")
        runs = {"triton pair": triton_pair, "cuBLAS bf16": lambda: torch.mm(a, b, out=out16),
                "cuBLAS fp32 sum": lambda: torch.addmm(out32, a, b, out=out32, out_dtype=torch.float32)}
        checks = {}
        variants = {f"gluon pair {t} tiles": (t, False) for t in args.tiles}
        variants.update({f"gluon pair {t} tiles b^T": (t, True) for t in args.b_t_tiles})
        for t in args.b_t_tiles:
            runs[f"gluon mainloop {t} tiles"] = gluon_run(t, mainloop_only=True)
            runs[f"gluon mainloop {t} tiles b^T"] = gluon_run(t, transposed=True, mainloop_only=True)
        runs["gluon pair prefetched"] = lambda: gluon_pair_prefetch.launch(a, b, hi, lo, True, unscale)
        variants["gluon pair prefetched"] = None
        for label, spec in variants.items():
            run = runs["gluon pair prefetched"] if spec is None else gluon_run(*spec)
            runs[label] = run
            hi.copy_(hi0), lo.copy_(lo0)
            triton_pair()
            want = (hi.clone(), lo.clone())
            hi.copy_(hi0), lo.copy_(lo0)
            run()
            torch.cuda.synchronize()
            same = torch.equal(hi, want[0]) and torch.equal(lo, want[1])
            diff = (hi.view(torch.int16).int() - want[0].view(torch.int16).int()).abs()
            checks[label] = dict(bits_equal=same, hi_differ_share=(diff > 0).float().mean().item(),
                             hi_max_ulps=diff.max().item(), lo_differ_share=(lo != want[1]).float().mean().item())
            print(name, label, checks[label], flush=True)
        times = interleaved(runs, rounds=args.rounds, rep=40)
        for variant, rounds in times.items():
            rows.append(dict(case=name, variant=variant, ms=median(rounds), rounds=rounds, check=checks.get(variant)))
        del a, b, hi, lo, hi0, lo0, out16, out32
        torch.cuda.empty_cache()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=__import__("triton").__version__)
    (Path(args.out) / "pair_pingpong.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    print(f"\n{'case':16} {'variant':28} {'ms':>8}  check")
    for r in rows:
        c = r["check"]
        check = "" if c is None else ("bits equal" if c["bits_equal"] else
                                      f"hi differs {c['hi_differ_share']:.2e} max {c['hi_max_ulps']} ulps")
        print(f"{r['case']:16} {r['variant']:28} {r['ms']:8.3f}  {check}")


if __name__ == "__main__":
    main()
