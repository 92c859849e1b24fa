"""Records the planner's decisions of the code at HEAD (before the one-plan refactor) on a grid of
shapes, dtypes, options, gradients and budgets: tests/kernel/plan_grid.json."""

import itertools
import json
import os
import random
import sys
from dataclasses import asdict

os.environ["TRITON_INTERPRET"] = "1"
REPO = sys.argv[1]
sys.path.insert(0, os.path.join(REPO, "torch-ext"))

import torch  # noqa: E402

from fused_linear_ce import chunked, configs, device, plan, tokens  # noqa: E402
from fused_linear_ce.validate import Options, chunked_unsupported  # noqa: E402

DT = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
SHAPES = [  # n, v, h
    (0, 500, 96), (1, 500, 96), (77, 500, 96), (300, 300, 64), (1024, 50000, 768), (2048, 128256, 4096),
    (4096, 32000, 1024), (4096, 128256, 4096), (8192, 128256, 4096), (8192, 256000, 2304),
    (16384, 151936, 2048), (32768, 128256, 4096), (65536, 128256, 4096), (131072, 128256, 4096),
    (65536, 32000, 2048), (8192, 2000, 8192),
]
BUDGETS = [None, 1 << 20, 12 << 20, 64 << 20, 384 << 20, 1 << 30, 4 << 30]
LOSS_OPTIONS = [  # reduction, return_lse, softcap, label_smoothing
    ("mean", False, None, 0.0), ("sum", False, None, 0.0), ("none", False, None, 0.0), ("mean", True, None, 0.0),
    ("mean", False, 30.0, 0.0), ("mean", False, 30.0, 0.1), ("mean", False, None, 0.1),
]
NEEDS = [(True, True, False), (True, True, True), (True, False, False), (False, True, False), (False, False, True),
         (False, False, False)]
WEIGHTS = [(False, False), (True, False), (False, True)]  # master, sharded


def tiles(dtype, h, gpu):
    device.interpreted = (lambda: False) if gpu else REAL_INTERPRETED
    c = configs.tiles("chunked", dtype, h)
    d = configs.dlogits_config(dtype, h=h)
    return c, d


REAL_INTERPRETED = device.interpreted


def passes_of(n, v, h, dtype, chunk_bytes, d, need_rows, need_dw, may_pair, master):
    ps = plan.plan_passes(n, v, h, dtype, chunk_bytes, d.block_n, d.block_v, need_rows, need_dw, may_pair=may_pair,
                          fp32_weight_grad=master)
    return [list(asdict(p).values()) for p in ps]


def loss_record(gpu, shape, dt, strategy, budget, option, needs, weights):
    n, v, h = shape
    dtype = DT[dt]
    master, sharded = weights
    if master and dtype == torch.float32:
        return None
    reduction, return_lse, softcap, smoothing = option
    opts = Options(reduction=reduction, return_lse=return_lse, softcap=softcap, label_smoothing=smoothing,
                   chunk_bytes=budget, strategy=strategy)
    if strategy == "chunked" and chunked_unsupported(opts) is not None:
        return None  # refused by validation
    bias = needs[2]
    c, d = tiles(dtype, h, gpu)
    record = {"kind": "loss", "gpu": gpu, "n": n, "v": v, "h": h, "dtype": dt, "strategy": strategy,
              "chunk_bytes": budget, "reduction": reduction, "return_lse": return_lse, "softcap": softcap,
              "label_smoothing": smoothing, "needs": list(needs), "bias": bias, "master": master,
              "sharded": sharded, "tiles": [c.block_n, c.block_v, d.block_n, d.block_v]}
    use = chunked.use(opts, n, v, h, dtype, needs, master, sharded)
    out = {"chunked": use}
    if use and n == 0:
        pass
    elif use:
        lean = chunked.long_context_budget(opts, n, v, h, dtype, needs, master, sharded)
        slab = None if lean is not None else chunked.hosted_slab_rows(opts, n, v, h, dtype, needs[1], master)
        fwd_budget = opts.chunk_bytes if lean is None else lean
        if fwd_budget is None and master and slab is None:
            fwd_budget = plan.DEFAULT_MASTER_BYTES
        cfg = configs.chunked_epilogue(c, softcap is not None, bias)
        rows = n if slab is not None else plan.chunk_rows(n, v, dtype, fwd_budget, cfg.block_n)
        dw_dtype = torch.float32 if master else dtype
        dw_type = chunked.weight_grad_dtype(dtype, dw_dtype)
        head = (plan.hosted_head(n, v, h, dtype, dw_type, rows, cfg.block_n)
                if slab is None and needs[1] and rows < n else None)
        out.update(lean=lean, slab=slab, budget=fwd_budget, rows=rows, head=list(head) if head else None)
    elif any(needs):
        out["passes"] = passes_of(n, v, h, dtype, budget, d, needs[0] or needs[2], needs[1],
                                  not sharded and not needs[2], master)
    record["out"] = out
    return record


def token_record(gpu, shape, dt, strategy, budget, softcap, entropy, needs, weights):
    n, v, h = shape
    dtype = DT[dt]
    master, sharded = weights
    if master and dtype == torch.float32:
        return None
    outputs = ("log_probs", "entropy") if entropy else ("log_probs",)
    opts = Options(reduction="none", softcap=softcap, chunk_bytes=budget, strategy=strategy, outputs=outputs)
    if strategy == "chunked" and tokens.chunked_unsupported(opts, n, v, dtype) is not None:
        return None
    c, d = tiles(dtype, h, gpu)
    record = {"kind": "tokens", "gpu": gpu, "n": n, "v": v, "h": h, "dtype": dt, "strategy": strategy,
              "chunk_bytes": budget, "softcap": softcap, "entropy": entropy, "needs": list(needs),
              "bias": needs[2], "master": master, "sharded": sharded,
              "tiles": [c.block_n, c.block_v, d.block_n, d.block_v]}
    keeps = tokens.keeps_exponentials(opts, n, v, dtype, needs)
    out = {"chunked": keeps}
    if any(needs):
        out["passes"] = passes_of(n, v, h, dtype, budget, d, needs[0] or needs[2], needs[1],
                                  not sharded and not needs[2], master)
    record["out"] = out
    return record


def divergence_record(gpu, shape, dt, strategy, budget, reduction, needs):
    n, v, h = shape
    if n == 0:
        return None
    if strategy == "chunked" and reduction == "none":
        return None
    dtype = DT[dt]
    device.interpreted = (lambda: False) if gpu else REAL_INTERPRETED
    record = {"kind": "divergence", "gpu": gpu, "n": n, "v": v, "h": h, "dtype": dt, "strategy": strategy,
              "chunk_bytes": budget, "reduction": reduction, "needs": list(needs)}
    resolved = strategy if strategy != "auto" else ("recompute" if reduction == "none" else "chunked")
    use = resolved == "chunked" and any(needs)
    write = use  # the forward forms da only on the chunked strategy with a gradient
    f = plan.plan_divergence_chunks(n, v, budget, dtype.itemsize if write else None)
    b = plan.plan_divergence_chunks(n, v, budget, dtype.itemsize)
    record["out"] = {"strategy": resolved, "chunked": use, "forward": [f.rows, f.group],
                     "backward": [b.rows, b.group] if any(needs) else None}
    return record


def main():
    rng = random.Random(0)
    records = []
    loss_grid = list(itertools.product([False, True], SHAPES, DT, ["auto", "recompute", "chunked"], BUDGETS,
                                       LOSS_OPTIONS, NEEDS, WEIGHTS))
    # every named shape at the defaults, then a seeded sample of the rest
    chosen = [g for g in loss_grid if g[4] is None and g[5] == LOSS_OPTIONS[0] and g[3] == "auto"]
    long = [(65536, 128256, 4096), (131072, 128256, 4096), (32768, 128256, 4096), (65536, 32000, 2048)]
    chosen += [g for g in loss_grid if g[1] in long and g[3] == "auto" and g[5] in LOSS_OPTIONS[:2]
               and g[4] in (None, 1 << 30, 384 << 20) and g[6] in NEEDS[:3]]
    chosen += rng.sample(loss_grid, 1300)
    for args in chosen:
        r = loss_record(*args)
        if r is not None:
            records.append(r)
    token_grid = list(itertools.product([False, True], SHAPES, DT, ["auto", "recompute", "chunked"], BUDGETS,
                                        [None, 30.0], [False, True], NEEDS, WEIGHTS))
    for args in rng.sample(token_grid, 600):
        r = token_record(*args)
        if r is not None:
            records.append(r)
    div_grid = list(itertools.product([False, True], SHAPES, DT, ["auto", "recompute", "chunked"],
                                      BUDGETS + [8 << 30], ["mean", "sum", "none"],
                                      [(True, True, False), (True, False, True), (False, False, False)]))
    for args in rng.sample(div_grid, 400):
        r = divergence_record(*args)
        if r is not None:
            records.append(r)
    device.interpreted = REAL_INTERPRETED
    seen, unique = set(), []
    for r in records:
        key = json.dumps({k: v for k, v in r.items() if k != "out"}, sort_keys=True)
        if key not in seen:
            seen.add(key)
            unique.append(r)
    fields = {}
    rows = []
    for r in unique:
        names = [k for k in r if k not in ("kind", "out")]
        fields.setdefault(r["kind"], names)
        assert fields[r["kind"]] == names
        rows.append(json.dumps([r["kind"], [r[k] for k in names], r["out"]], separators=(",", ":")))
    with open(os.path.join(REPO, "tests/kernel/plan_grid.json"), "w") as f:
        f.write('{"fields": ' + json.dumps(fields) + ',\n"cases": [\n' + ",\n".join(rows) + "\n]}\n")
    print(len(unique))


if __name__ == "__main__":
    main()
