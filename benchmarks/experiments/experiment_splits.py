"""One GPU call: how many programs share a row block's vocabulary sweep (``configs.vocab_splits``).

    python3 benchmarks/experiments/experiment_splits.py [--out DIR]

The forward sweep runs (row blocks x splits) programs, each over a contiguous range of vocabulary
tiles, one resident program per SM for the bf16 tiles (144 KB of shared memory). Predicted time is
proportional to waves x tiles per program. This times the evaluation forward (no grad) at S1-S4 with
fixed split counts, against one cuBLAS matmul, and prints the model's prediction next to each.
"""

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import triton
import triton.testing

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "torch-ext"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: tune.py, bench.py
from fused_linear_ce import configs, fused_linear_cross_entropy, plan  # noqa: E402

from tune import problem  # noqa: E402

SHAPES = {"S1": (8192, 4096, 128256), "S2": (8192, 2304, 256000), "S3": (16384, 2048, 151936),
          "S4": (65536, 4096, 128256)}
REAL = plan.vocab_splits


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    cfg = configs.sweep_config(torch.bfloat16)
    rows = []
    for shape, (n, h, v) in SHAPES.items():
        hidden, weight, targets = problem(n, h, v)
        blocks, tiles = triton.cdiv(n, cfg.block_n), triton.cdiv(v, cfg.block_v)
        mm = triton.testing.do_bench(lambda: hidden @ weight.T, warmup=20, rep=100)
        current = REAL(blocks, tiles, hidden.device)
        choices = sorted({current, 1, 2, 3, 4, 6, 8, 16, 33, 66})
        for s in choices:
            plan.vocab_splits = lambda b, t, d, s=s: min(s, t)
            ms = triton.testing.do_bench(lambda: fused_linear_cross_entropy(hidden, weight, targets),
                                         warmup=5, rep=50)
            per = triton.cdiv(tiles, s)
            waves = triton.cdiv(blocks * triton.cdiv(tiles, per), sms)
            rows.append(dict(shape=shape, splits=s, current=s == current, fwd_ms=ms, matmul_ms=mm,
                             model=waves * per, ideal=blocks * tiles / sms))
            print(rows[-1], flush=True)
        plan.vocab_splits = REAL
        torch.cuda.empty_cache()
    meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__, sms=sms)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "experiment_splits.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    print(f"\n{meta}\n{'shape':5s} {'splits':>6s} {'fwd ms':>7s} {'x mm':>6s} {'model':>6s} {'ideal':>7s}")
    for r in rows:
        print(f"{r['shape']:5s} {r['splits']:6d}{'*' if r['current'] else ' '} {r['fwd_ms']:7.2f} "
              f"{r['fwd_ms'] / r['matmul_ms']:6.3f} {r['model']:6d} {r['ideal']:7.1f}")


if __name__ == "__main__":
    main()
