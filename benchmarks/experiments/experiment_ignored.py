"""One GPU call: what skipping wholly ignored row blocks is worth, and what it costs where none are.

    git archive <base> torch-ext/fused_linear_ce | tar -x -C .ab/old --strip-components=1
    python3 benchmarks/experiments/experiment_ignored.py [--shapes S1 S3] [--variants old=.ab/old/fused_linear_ce ...]
        [--settings eval default 64M chunked-whole] [--profile] [--out DIR]

Per shape (bf16, tune.py's random data), three target layouts over sequences of 1024 tokens:
``full`` (every row counted), ``sft`` (each sequence's prompt, uniform in [256, 768) tokens, ignored:
an assistant-only loss, ~50% of rows, most of them in whole 128-row blocks) and ``scattered`` (the
same number of ignored rows per sequence at random places: no whole block, so nothing skipped).
Settings: the evaluation forward, the default budget, 64 MiB (recompute path) and the chunked path in
one chunk. The package as it is (``new``) and, with ``--variants``, copies of other versions loaded
as further packages (e.g. ``old``, before skipping: the same settings on ``full`` and ``sft`` show
what the change costs and saves). fwd+bwd medians of three interleaved rounds; ``new`` on ``sft``
checked against an fp32 reference; ``--profile``: per-kernel times of one step of each package on
``full``. Prints a table last; writes experiment_ignored.json.
"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "torch-ext"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: tune.py, bench.py
from experiment_common import (MiB, interleaved, kernel_times, make_step, median, parse_args,  # noqa: E402
                               reference, write_results)
from ab import load_copy  # noqa: E402  (benchmarks/ab.py: a copy of the package as a second package)
from tune import problem, rel  # noqa: E402

import fused_linear_ce  # noqa: E402

SHAPES = {"S1": (8192, 4096, 128256), "S3": (16384, 2048, 151936)}
SETTINGS = {"default": dict(), "64M": dict(strategy="recompute", chunk_bytes=64 * MiB),
            "chunked-whole": dict(strategy="chunked", chunk_bytes=1 << 50)}
SEQ = 1024


def layouts(targets):
    """{name: targets} for the three layouts (module docstring), one generator seed."""
    n = targets.shape[0]
    g = torch.Generator().manual_seed(1)
    sft, scattered = targets.clone(), targets.clone()
    for s0 in range(0, n, SEQ):
        length = min(SEQ, n - s0)
        prompt = int(torch.randint(SEQ // 4, 3 * SEQ // 4, (1,), generator=g)) * length // SEQ
        sft[s0 : s0 + prompt] = -100
        scattered[s0 + torch.randperm(length, generator=g)[:prompt].to(targets.device)] = -100
    return {"full": targets, "sft": sft, "scattered": scattered}


def dead_blocks(targets, block=128):
    """The share of ``block``-row blocks whose rows are all ignored."""
    n = targets.shape[0]
    blocks = (targets.new_full(((n + block - 1) // block * block,), -100))
    blocks[:n] = targets
    return (blocks.view(-1, block) == -100).all(1).float().mean().item()


def _options(ap):
    ap.add_argument("--variants", nargs="*", default=[], help="NAME=PATH of other copies of the package")
    ap.add_argument("--settings", nargs="+", default=["eval", *SETTINGS])
    ap.add_argument("--profile", action="store_true")


def main():
    args = parse_args(SHAPES, _options)
    packages = {"new": fused_linear_ce}
    for spec in args.variants:
        name, path = spec.split("=", 1)
        packages[name] = load_copy(name, path)
    rows = []
    for shape in args.shapes:
        hidden, weight, targets = problem(*SHAPES[shape])
        step = make_step(hidden, weight)
        runs, labels = {}, {}
        for layout, t in layouts(targets).items():
            if layout == "sft":
                ref = reference(hidden, weight, t)
                _, dx, dw = step(lambda hd, wd: fused_linear_ce.fused_linear_cross_entropy(hd, wd, t))
                print(f"{shape} sft new default: dx {rel(dx, ref[1]):.2e} dw {rel(dw, ref[2]):.2e}", flush=True)
                rows.append(dict(shape=shape, name="new sft default (check)", dx=rel(dx, ref[1]), dw=rel(dw, ref[2])))
                del ref, dx, dw
            for pkg_name, pkg in packages.items():
                if pkg_name != "new" and layout == "scattered":
                    continue
                fn = pkg.fused_linear_cross_entropy

                def evaluate(fn=fn, t=t):
                    with torch.no_grad():
                        return fn(hidden, weight, t, reduction="none")

                if "eval" in args.settings:
                    runs[f"{pkg_name} {layout} eval"] = evaluate
                    labels[f"{pkg_name} {layout} eval"] = dict(package=pkg_name, layout=layout, setting="eval",
                                                               dead=dead_blocks(t))
                for setting, kw in SETTINGS.items():
                    if setting not in args.settings:
                        continue
                    name = f"{pkg_name} {layout} {setting}"
                    runs[name] = lambda fn=fn, t=t, kw=kw: step(lambda hd, wd: fn(hd, wd, t, **kw))
                    labels[name] = dict(package=pkg_name, layout=layout, setting=setting, dead=dead_blocks(t))
        for fn in runs.values():  # compile and warm every variant before timing
            fn()
        torch.cuda.synchronize()
        if args.profile:
            for name, fn in runs.items():
                if " full " in name:
                    top = kernel_times(fn, top=6)
                    print(f"{shape} {name} kernels: " + "; ".join(f"{k} {v:.2f}" for k, v in top.items()), flush=True)
                    rows.append(dict(shape=shape, name=name + " (kernels)", kernels=top))
        times = interleaved(runs, rounds=3, rep=200)
        for name, ts in times.items():
            rows.append(dict(shape=shape, name=name, ms=median(ts), rounds=ts, **labels[name]))
            print(f"{shape} {name}: {median(ts):.2f} ms {['%.2f' % x for x in ts]}", flush=True)
    write_results(args.out, "experiment_ignored.json", rows)


if __name__ == "__main__":
    main()
