"""Where a distillation step's time goes: ``fused_linear_divergence`` at D1 / D2 (bf16, peaked data),
each piece alone and whole steps, in interleaved rounds beside the four plain products.

Pieces (one chunk of all N rows unless named): the teacher's and the student's fp32-output logits
(cuBLAS, ``products.accumulate``), the four products in bf16 (the floor), the row kernel for each
beta with and without da (and its bytes / ms), dX and dW from da, the default chunk's dW into the
bf16 + int8 pair times the chunk count. Steps: "mean" at chunk budgets of 512 MiB (the
default) to 2 GiB and in one chunk, "none" (recompute) at the same budgets, for beta in {1, 0.5, 0},
each with its extra memory (peak during the step less what was allocated before and the gradients). Every step's dX / dW is checked
against ``distill_cases.reference`` first. Prints the table last; JSON under --out.
"""

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import experiment_common as C  # noqa: E402

from fused_linear_ce import divergence, pairs, plan, products  # noqa: E402
from fused_linear_ce.divergence import Spec  # noqa: E402
from fused_linear_ce.validate import Options  # noqa: E402

BETAS = (1.0, 0.5, 0.0)
BUDGETS = (512 << 20, 1 << 30, 1536 << 20, 2 << 30)  # chunk_bytes: the default, then larger
GB = 1e9


def pieces(data):
    """{name: callable} of the step's pieces at all N rows (one chunk) and the default chunk's dW pair."""
    x_s, w_s, x_t, w_t = data.x_s, data.w_s, data.x_t, data.w_t
    n, v, h = x_s.shape[0], w_s.shape[0], x_s.shape[1]
    zs = torch.empty((n, v), dtype=torch.float32, device=x_s.device)
    zt = torch.empty_like(zs)
    products.accumulate(x_s, w_s.t(), zs, True)
    products.accumulate(x_t, w_t.t(), zt, True)
    da_full = torch.empty((n, v), dtype=torch.bfloat16, device=x_s.device)
    counted = torch.ones(n, dtype=torch.int8, device=x_s.device)
    coef = torch.zeros((2, n), dtype=torch.float32, device=x_s.device)
    coef[0] = 1.0
    stats = torch.empty((3, n), dtype=torch.float32, device=x_s.device)
    out = torch.empty_like(stats)
    dx = torch.empty_like(x_s)
    dw = torch.empty_like(w_s)
    one = torch.ones(1, dtype=torch.float32, device=x_s.device)
    g16 = (x_s @ w_s.T)
    run = {
        "logits_t fp32": lambda: products.accumulate(x_t, w_t.t(), zt, True),
        "logits_s fp32": lambda: products.accumulate(x_s, w_s.t(), zs, True),
        "logits_t bf16": lambda: x_t @ w_t.T,
        "logits_s bf16": lambda: x_s @ w_s.T,
        "dx": lambda: products.product(g16, w_s, dx, False, one),
        "dw one": lambda: products.product(g16.t(), x_s, dw, False, one),
    }
    lo = pairs.compensation_buffer(dw, torch.int8)
    for budget in BUDGETS:
        rows = plan.divergence_chunk_rows(n, v, budget)
        run[f"dw pair x{-(-n // rows)} (R={rows})"] = lambda rows=rows: [
            products.compensated(g16[i:i + rows].t(), x_s[i:i + rows], dw, lo, i > 0, one) for i in range(0, n, rows)]
    opts = Options(logit_scale=1.0, softcap=None, temperature=1.0)
    for beta in BETAS:
        spec = Spec(beta=beta, student=opts, teacher=opts, reduction="mean", strategy="chunked", chunk_bytes=None)
        for write in (False, True):
            def row(spec=spec, write=write):
                divergence._launch(zs, zt, da_full if write else None, (None, None), None, counted, coef, stats, out,
                                   0, n, spec, values=True, write_da=write, stats_known=False, dtype=torch.bfloat16)
            run[f"row b={beta:g}{' +da' if write else ''}"] = row
    return run


def steps(data):
    variants = [(f"mean {b >> 20}M", dict(chunk_bytes=b)) for b in BUDGETS] + [("mean 1chunk", dict(chunk_bytes=1 << 40))]
    variants += [(f"none {b >> 20}M", dict(reduction="none", chunk_bytes=b)) for b in BUDGETS]
    return {f"step {label} b={beta:g}": C.divergence_step(data, beta, **kwargs)
            for beta in BETAS for label, kwargs in variants}


def main():
    args = C.parse_args(("D1", "D2"), lambda ap: ap.add_argument("--rounds", type=int, default=3))
    rows = []
    t0 = time.perf_counter()
    for shape in args.shapes:
        data, refs = C.distill_problem(shape, BETAS)
        runs = {"two logits bf16": lambda: [data.x_t @ data.w_t.T, data.x_s @ data.w_s.T]}
        runs.update(steps(data))
        checks = C.check_divergence_steps(shape, {k: f for k, f in runs.items() if k.startswith("step")}, refs,
                                          data, t0)
        rows += [dict(shape=shape, name=name, **c) for name, c in checks.items()]
        del refs
        torch.cuda.empty_cache()
        runs.update(pieces(data))
        times = C.interleaved(runs, rounds=args.rounds, rep=40)
        floor = times["two logits bf16"]
        n, v = data.n, data.w_s.shape[0]
        for name, ts in times.items():
            ms = C.median(ts)
            row = dict(shape=shape, name=name, ms=ms, rounds=ts)
            if name.startswith("row"):
                row["planes_read_gb"] = 8 * n * v / GB
                row["gb_per_s_per_plane_pass"] = 8 * n * v / GB / (ms / 1e3)
            rows.append(row)
            print(f"[{time.perf_counter() - t0:5.0f}s] {shape} {name:28s} {ms:8.2f} ms  "
                  f"({' '.join(f'{t:.2f}' for t in ts)})", flush=True)
        two = C.median(floor)
        mm = C.median(times["logits_t bf16"]) + C.median(times["logits_s bf16"]) + C.median(times["dx"]) + \
            C.median(times["dw one"])
        print(f"{shape}: two logits (bf16) together {two:.2f} ms; the four products summed from pieces {mm:.2f} ms")
        del data, runs
        torch.cuda.empty_cache()
    checks = {(r["shape"], r["name"]): r for r in rows if "ms" not in r}
    for r in rows:
        if "ms" in r and (r["shape"], r["name"]) in checks:
            r.update(extra_mib=checks[r["shape"], r["name"]]["extra_mib"], dx=checks[r["shape"], r["name"]]["dx"],
                     dw=checks[r["shape"], r["name"]]["dw"])
    C.write_results(args.out, "distill_profile.json", [dict(r, plan="") for r in rows if "ms" in r],
                    checks=list(checks.values()))


if __name__ == "__main__":
    main()
