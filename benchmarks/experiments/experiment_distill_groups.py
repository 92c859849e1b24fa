"""da in a buffer of its own (``plan.plan_divergence_chunks``): fewer, larger groups of gradient products
against da over the teacher's logit buffer, at the same chunk budget. ``fused_linear_divergence`` at
D1 / D2 (bf16, peaked data), in interleaved rounds.

Steps ("mean" by default, "none" where named; beta 1, 0.5 and 0): da in place (``DIVERGENCE_GROUP_CHUNK_ROWS``
set past the in-place rows) and in its own buffer with chunks of R = 256 rows, at 512 MiB (the
default), 768 MiB and 1 GiB, and in one chunk (run 1, before the row kernel's launches by chunk
size and grad_hidden on cuBLAS for few tiles, also took R = 192 / 320 / 384 at 512 MiB). Pieces: both models' fp32-output logits
over all N rows in chunks of R rows, and grad_weight into the bf16 + int8 pair over all N rows in
groups of M rows. Every step's dX / dW and extra memory (peak during the step less what was allocated
before and the gradients) is checked against ``distill_cases.reference`` first. Table last; JSON
under --out.
"""

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import experiment_common as C  # noqa: E402

from fused_linear_ce import pairs, products  # noqa: E402
from fused_linear_ce import plan as planning  # noqa: E402

BETAS = (1.0, 0.5, 0.0)
MIB = 1 << 20
IN_PLACE = 1 << 30  # DIVERGENCE_GROUP_CHUNK_ROWS past any in-place row count: da over the teacher's buffer
STEPS = [(f"{plan} {mib}M", rows, mib, "mean") for mib in (512, 768, 1024)
         for plan, rows in (("in place", IN_PLACE), ("own R=256", 256))] + [
    ("one chunk", 256, 1 << 20, "mean"),
    ("none in place 512M", IN_PLACE, 512, "none"), ("none own R=256 512M", 256, 512, "none")]


def steps(data):
    runs, plans = {}, {}
    n, v = data.n, data.w_s.shape[0]
    for beta in BETAS:
        for label, ring, mib, reduction in STEPS:
            name = f"step {label} b={beta:g}"
            runs[name] = C.divergence_step(data, beta, lambda ring=ring: setattr(planning, "DIVERGENCE_GROUP_CHUNK_ROWS", ring),
                                           reduction=reduction, chunk_bytes=mib * MIB)
            planning.DIVERGENCE_GROUP_CHUNK_ROWS = ring
            p = planning.plan_divergence_chunks(n, v, mib * MIB, 2)
            plans[name] = f"R={p.rows} M={p.group} x{-(-n // p.group)}"
    return runs, plans


def pieces(data):
    """Both logits over all N rows in chunks of R rows; grad_weight into the pair in groups of M rows."""
    x_s, w_s, x_t, w_t = data.x_s, data.w_s, data.x_t, data.w_t
    n, v = x_s.shape[0], w_s.shape[0]
    zs = torch.empty((432, v), dtype=torch.float32, device=x_s.device)
    zt = torch.empty_like(zs)
    run = {}
    for r in (192, 256, 320, 384, 432):
        def logits(r=r):
            for i in range(0, n, r):
                k = min(r, n - i)
                products.accumulate(x_s[i:i + k], w_s.t(), zs[:k], True)
                products.accumulate(x_t[i:i + k], w_t.t(), zt[:k], True)
        run[f"logits R={r}"] = logits
    g16 = x_s @ w_s.T
    dw = torch.empty_like(w_s)
    lo = pairs.compensation_buffer(dw, torch.int8)
    one = torch.ones(1, dtype=torch.float32, device=x_s.device)
    for m in (432, 736, 1056, 2496):
        run[f"dw pair M={m} x{-(-n // m)}"] = lambda m=m: [
            products.compensated(g16[i:i + m].t(), x_s[i:i + m], dw, lo, i > 0, one) for i in range(0, n, m)]
    run["dw one"] = lambda: products.product(g16.t(), x_s, dw, False, one)
    return run


def main():
    args = C.parse_args(("D1", "D2"), lambda ap: ap.add_argument("--rounds", type=int, default=3))
    rows = []
    t0 = time.perf_counter()
    for shape in args.shapes:
        data, refs = C.distill_problem(shape, BETAS)
        runs = {"four products bf16": lambda: [data.x_t @ data.w_t.T, data.x_s @ data.w_s.T]}
        step_runs, plans = steps(data)
        runs.update(step_runs)
        checks = C.check_divergence_steps(shape, step_runs, refs, data, t0, plans)
        del refs
        torch.cuda.empty_cache()
        runs.update(pieces(data))
        times = C.interleaved(runs, rounds=args.rounds, rep=200)
        g16 = data.x_s @ data.w_s.T
        mm = C.median(times["four products bf16"]) + C.median(times["dw one"]) + triton_ms(
            lambda: g16 @ data.w_s)
        del g16
        for name, ts in times.items():
            ms = C.median(ts)
            row = dict(shape=shape, name=name, ms=ms, rounds=ts, matmul_ms=mm, **checks.get(name, {}))
            rows.append(row)
            print(f"[{time.perf_counter() - t0:5.0f}s] {shape} {name:32s} {ms:8.2f} ms  "
                  f"({' '.join(f'{t:.2f}' for t in ts)})", flush=True)
        del data, runs, step_runs
        torch.cuda.empty_cache()
    C.write_results(args.out, "distill_groups.json", rows)


def triton_ms(fn):
    import triton
    return triton.testing.do_bench(fn, warmup=5, rep=100)


if __name__ == "__main__":
    main()
