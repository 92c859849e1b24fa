"""The divergence row kernel's launch (``configs.DIVERGENCE_ROW_LAUNCHES``) at the chunk sizes
of the default plans, and whole "mean" steps with each launch, da in place and in its own buffer.
D1 / D2, bf16, peaked data, interleaved rounds.

Pieces: the row kernel with da (beta 1 and 0.5) over R rows of real logits (R = 256, 432 / 512 and
all 8192), per launch and scaled to all N rows (ms x N / R), for each (BLOCK_V, warps). Steps: the
512 MiB default with da in its own buffer (R = 256) and in place, for each launch. Every step's dX /
dW is checked against ``distill_cases.reference`` first, and every launch's da against the shipped
launch's. Table last; JSON under --out.
"""

import contextlib
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import experiment_common as C  # noqa: E402

from fused_linear_ce import configs, divergence, plan, products  # noqa: E402
from fused_linear_ce.divergence import Spec  # noqa: E402
from fused_linear_ce.validate import Options  # noqa: E402

BETAS = (1.0, 0.5)
MIB = 1 << 20
LAUNCHES = [(1024, 4), (1024, 8), (2048, 8), (2048, 16), (4096, 16), (512, 4)]
IN_PLACE = 1 << 30


def rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


_LAUNCH = contextlib.ExitStack()  # the override ``use`` holds


def use(launch):
    """This launch at every row count (``configs.override``), until the next ``use``."""
    _LAUNCH.close()
    _LAUNCH.enter_context(configs.override(divergence_rows=((None, *launch),)))


def row_pieces(data, checks):
    n, v = data.n, data.w_s.shape[0]
    zs = torch.empty((n, v), dtype=torch.float32, device="cuda")
    zt = torch.empty_like(zs)
    products.accumulate(data.x_s, data.w_s.t(), zs, True)
    products.accumulate(data.x_t, data.w_t.t(), zt, True)
    da = torch.empty((n, v), dtype=torch.bfloat16, device="cuda")
    counted = torch.ones(n, dtype=torch.int8, device="cuda")
    coef = torch.zeros((2, n), dtype=torch.float32, device="cuda")
    coef[0] = 1.0
    stats = torch.empty((3, n), dtype=torch.float32, device="cuda")
    out = torch.empty_like(stats)
    opts = Options(logit_scale=1.0, softcap=None, temperature=1.0)
    run = {}
    for beta in BETAS:
        spec = Spec(beta=beta, student=opts, teacher=opts, reduction="mean", strategy="chunked", chunk_bytes=None)
        for r in (256, 512 if v < 140000 else 432, n):
            def call(launch, r=r, spec=spec):
                use(launch)
                divergence._launch(zs[:r], zt[:r], da[:r], (None, None), None, counted, coef, stats, out, 0, n, spec,
                                   values=True, write_da=True, stats_known=False, dtype=torch.bfloat16)
            call(LAUNCHES[0])
            want = da[:r].clone()
            for launch in LAUNCHES:
                call(launch)
                name = f"row b={beta:g} R={r} V{launch[0]} w{launch[1]}"
                checks[name] = dict(da_vs_shipped=rel(da[:r], want), scale=n / r)
                run[name] = lambda launch=launch, call=call: call(launch)
            del want
    return run, (zs, zt, da)


def steps(data):
    def setting(ring, launch):
        plan.DIVERGENCE_GROUP_CHUNK_ROWS = ring
        use(launch)
    return {f"step {plan} V{launch[0]} w{launch[1]} b={beta:g}":
            C.divergence_step(data, beta, lambda ring=ring, launch=launch: setting(ring, launch))
            for beta in BETAS for plan, ring in (("own R=256", 256), ("in place", IN_PLACE)) for launch in LAUNCHES[:5]}


def main():
    args = C.parse_args(("D1", "D2"), lambda ap: ap.add_argument("--rounds", type=int, default=3))
    rows = []
    t0 = time.perf_counter()
    for shape in args.shapes:
        data, refs = C.distill_problem(shape, BETAS)
        runs = steps(data)
        checks = C.check_divergence_steps(shape, runs, refs, data, t0)
        del refs
        torch.cuda.empty_cache()
        times = C.interleaved(runs, rounds=args.rounds, rep=200)
        pieces, bufs = row_pieces(data, checks)
        times.update(C.interleaved(pieces, rounds=args.rounds, rep=100))
        del bufs, pieces
        torch.cuda.empty_cache()
        for name, ts in times.items():
            ms = C.median(ts)
            check = checks.get(name, {})
            row = dict(shape=shape, name=name, ms=ms, rounds=ts, **check)
            if "scale" in check:
                row["ms_all_rows"] = ms * check["scale"]
            rows.append(row)
            extra = f" all N {row['ms_all_rows']:.2f} ms, da vs shipped {check['da_vs_shipped']:.1e}" if "scale" in check else ""
            print(f"[{time.perf_counter() - t0:5.0f}s] {shape} {name:36s} {ms:8.3f} ms{extra}  "
                  f"({' '.join(f'{t:.2f}' for t in ts)})", flush=True)
        del data, runs
        torch.cuda.empty_cache()
    use(LAUNCHES[0])
    C.write_results(args.out, "distill_rows.json", rows)


if __name__ == "__main__":
    main()
