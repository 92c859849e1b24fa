"""The benchmark harness: ours at several memory settings against the peers, one process, one run.

    python3 benchmarks/bench.py --out benchmarks/results          # S1-S4, random + peaked, all methods
    python3 benchmarks/bench.py --shapes S1 --dists peaked --methods 'flce*,liger*'
    python3 benchmarks/bench.py --tiny --quick --out /tmp/b       # CPU smoke test (Triton interpreter)

Per (shape, dist, method) one row: forward-only time under no_grad (``fwd_ms``), forward+backward time
(``fwdbwd_ms``), both medians; ``extra_mib`` = peak allocated during one forward+backward minus what was
allocated before it (the inputs) minus the bytes of the gradients dX and dW themselves; loss / dX / dW
relative (Frobenius) errors against an fp32-logit reference (``reference.chunked_linear_cross_entropy``);
``tflops`` = 6*N*V*H over the forward+backward time, and its share of the measured one-matmul rate
(``pct_matmul``, i.e. 3 matmuls / fwdbwd) and of 989 TFLOP/s (``pct_peak``). The ``matmul`` row is one
cuBLAS ``hidden @ weight.T`` (fwd_ms) and the three matmuls of a forward+backward (fwdbwd_ms): the floor.

With ``--rounds R`` (R > 1) every method of a (shape, dist) is timed again R - 1 times after the
first pass, the methods interleaved in each round, and its times are the medians over the rounds
(each round's value kept in ``fwd_ms_rounds`` / ``fwdbwd_ms_rounds``): on the H200 back-to-back steps
run at the power cap, and one pass's median of a setting moved by 3-6 ms between runs (NOTES v12).

Peers are optional imports used as black boxes through their public APIs: a missing one is a printed
note, a failing or out-of-memory one a row with ``error``. Writes ``<gpu>.json`` (e.g. h200.json) under
--out after every (shape, dist), so a timeout still leaves results; ``plot.py`` turns it into PNGs and a
markdown table.
"""

import argparse
import datetime
import fnmatch
import gc
import importlib.metadata
import inspect
import json
import os
import platform
import re
import statistics
import sys
import time
from functools import partial
from pathlib import Path

import torch

if not torch.cuda.is_available():  # before Triton decorates the kernels
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402
import triton.testing  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "torch-ext"))
from fused_linear_ce import configs, fused_linear_cross_entropy, reference  # noqa: E402

SHAPES = {  # name: (N, H, V)
    "S1": (8192, 4096, 128256),  # Llama-3 8B
    "S2": (8192, 2304, 256000),  # Gemma-2 2B
    "S3": (16384, 2048, 151936),  # Qwen-class
    "S4": (65536, 4096, 128256),  # long context, S1's H and V
    "tiny": (128, 64, 1000),  # CPU smoke test
}
PEAK_TFLOPS = 989.0  # H200 dense bf16 datasheet
PEAK_MARGIN = 14.0  # peaked data: target logit this far above a std-1 background
SLOW_MS = 100.0  # a call slower than this is timed by hand (few reps), not by do_bench
SLOW_BUDGET_MS = 1200.0  # ... with about this much time per figure, 1 to 3 reps
SKIP = {("S4", "cce-exact"): "slow at S4 (~4x CCE default)"}
MiB = 2**20


def size_label(nbytes):
    for unit, shift in (("G", 30), ("M", 20), ("K", 10)):
        if nbytes >= 1 << shift and nbytes % (1 << shift) == 0:
            return f"{nbytes >> shift}{unit}"
    return str(nbytes)


def parse_size(text):
    m = re.fullmatch(r"(\d+)([KMG]?)i?B?", text.strip(), re.IGNORECASE)
    if not m:
        raise argparse.ArgumentTypeError(f"bad size {text!r}; use e.g. 64M, 1G, 4096")
    return int(m[1]) << {"": 0, "K": 10, "M": 20, "G": 30}[m[2].upper()]


def _loss(out):
    """A peer's return value -> its loss tensor (some return tuples or output objects)."""
    if isinstance(out, (tuple, list)):
        out = out[0]
    return getattr(out, "loss", out)


def torch_ce(h, w, t):
    return F.cross_entropy((h @ w.T).float(), t)


WHOLE = 1 << 50  # "chunked:whole": a chunk_bytes no plane reaches, so one chunk of all N rows


def parse_setting(text):
    """'64M' (the recompute path with that chunk_bytes), 'chunked:1G' / 'chunked:whole' (the
    chunked path) or 'auto:1280M' ("auto" with that chunk_bytes: at S4 the long-context chunked
    path) -> (name suffix, keyword arguments)."""
    strategy, _, size = text.strip().rpartition(":")
    if strategy not in ("", "chunked", "recompute", "auto"):
        raise argparse.ArgumentTypeError(f"bad setting {text!r}; use e.g. 64M, chunked:1G, chunked:whole, auto:1280M")
    nbytes = WHOLE if size == "whole" else parse_size(size)
    label = "whole" if nbytes == WHOLE else size_label(nbytes)
    if strategy == "chunked":
        return f"chunked-{label}", dict(strategy="chunked", chunk_bytes=nbytes)
    if strategy == "auto":
        return f"auto-{label}", dict(chunk_bytes=nbytes)
    return label, dict(strategy="recompute", chunk_bytes=nbytes)


def build_methods(settings, notes):
    """name -> loss(hidden, weight, targets) -> 0-d loss, in run order. Peers only if importable.
    ``settings``: parse_setting results, ours besides the default (``flce``)."""
    methods = {"matmul": None, "flce": fused_linear_cross_entropy}
    for suffix, kwargs in settings:
        methods[f"flce-{suffix}"] = partial(fused_linear_cross_entropy, **kwargs)
    methods["torch"] = torch_ce
    methods["torch-compile"] = torch.compile(torch_ce, dynamic=False)
    try:
        from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy as liger

        methods["liger"] = lambda h, w, t: _loss(liger(h, w, t))
        if "accum_dtype" in inspect.signature(liger).parameters:
            methods["liger-fp32"] = lambda h, w, t: _loss(liger(h, w, t, accum_dtype=torch.float32))
        else:
            notes.append("liger: no accum_dtype option in this version; liger-fp32 skipped")
    except Exception as e:  # noqa: BLE001 - any import failure means "not available"
        notes.append(f"liger-kernel not available ({type(e).__name__}: {e}); its rows skipped")
    try:
        from cut_cross_entropy import linear_cross_entropy as cce

        methods["cce"] = lambda h, w, t: _loss(cce(h, w, t))
        if "filter_eps" in inspect.signature(cce).parameters:
            methods["cce-exact"] = lambda h, w, t: _loss(cce(h, w, t, filter_eps=None))
        else:
            notes.append("cut-cross-entropy: no filter_eps option; cce-exact skipped")
    except Exception as e:  # noqa: BLE001
        notes.append(f"cut-cross-entropy not available ({type(e).__name__}: {e}); its rows skipped")
    return methods


def make_data(n, h, v, dist, device, seed):
    """bf16 (hidden, weight, targets). random: logits ~ N(0, 2^2), uniform targets. peaked: hidden =
    0.5 * noise (a std-1 logit background) + a lean onto its target's weight row worth PEAK_MARGIN."""
    g = torch.Generator(device=device).manual_seed(seed)
    weight = (torch.randn(v, h, generator=g, device=device) * (4.0 / h) ** 0.5).bfloat16()  # |w_v|^2 ~ 4
    targets = torch.randint(0, v, (n,), generator=g, device=device)
    hidden = torch.randn(n, h, generator=g, device=device)
    if dist == "peaked":
        w_t = weight[targets].float()
        hidden = 0.5 * hidden + (PEAK_MARGIN / w_t.pow(2).sum(-1, keepdim=True)) * w_t
        del w_t
    elif dist != "random":
        raise ValueError(f"unknown dist {dist!r}")
    return hidden.bfloat16(), weight, targets


class matmul_precision:
    """fp32 matmuls of the reference: tf32 reads bf16 inputs exactly (only dlogits is rounded, ~2^-11);
    ieee is exact but ~8x slower (several minutes a shape on an H200)."""

    def __init__(self, mode, device):
        self.mode = "highest" if (mode == "ieee" or device.type != "cuda") else "high"

    def __enter__(self):
        self.prev = torch.get_float32_matmul_precision()
        torch.set_float32_matmul_precision(self.mode)

    def __exit__(self, *exc):
        torch.set_float32_matmul_precision(self.prev)


def reference_and_stats(hidden, weight, targets, precision):
    """The fp32-logit reference (mean loss, dX, dW) and what the data look like."""
    n, v = hidden.shape[0], weight.shape[0]
    chunk = max(1, min(n, (2 << 30) // (4 * v)))  # ~2 GiB of fp32 logits a chunk
    with matmul_precision(precision, hidden.device):
        loss_sum, count, dx, dw, _ = reference.chunked_linear_cross_entropy(hidden, weight, targets, chunk=chunk)
        c = count.item()
        rows = min(n, 4096)
        p_t, std, margin = [], [], []
        for r in range(0, rows, chunk):
            z = reference.logits(hidden[r : r + chunk], weight, compute_dtype=torch.float32)
            z_t = z.gather(1, targets[r : r + chunk, None])[:, 0]
            p_t.append((z_t - torch.logsumexp(z, -1)).exp())
            std.append(z.std(-1))
            margin.append(z_t - z.mean(-1))
            del z
    stats = dict(
        mean_p_target=torch.cat(p_t).mean().item(),
        logit_std=torch.cat(std).mean().item(),
        target_margin=torch.cat(margin).mean().item(),
        ref_loss=loss_sum.item() / c,
    )
    return loss_sum.item() / c, dx.div_(c), dw.div_(c), stats


def rel(a, b):
    return ((a.float() - b).norm() / b.norm()).item()


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def bench(fn, est_ms, device, quick, grad_to_none=()):
    """Median ms of fn(): do_bench after warm-up, by hand (1-3 reps) for slow calls, wall clock on CPU."""

    def by_hand(reps, clock):
        times = []
        for _ in range(reps):
            for x in grad_to_none:
                x.grad = None
            times.append(clock(fn))
        return statistics.median(times)

    if device.type != "cuda":
        return by_hand(1 if quick else 3, _wall_ms)
    if est_ms > SLOW_MS:
        return by_hand(max(1, min(1 if quick else 3, int(SLOW_BUDGET_MS // est_ms))), _event_ms)
    warmup, rep = (5, 40) if quick else (25, 200)
    return triton.testing.do_bench(fn, warmup=warmup, rep=rep, grad_to_none=list(grad_to_none), return_mode="median")


def _wall_ms(fn):
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def _event_ms(fn):
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end)


def measure_matmul(hidden, weight, quick):
    """One matmul (fwd_ms) and the three of a forward+backward (fwdbwd_ms), cuBLAS, bf16; and the
    timers (``retime``)."""
    dev = hidden.device
    clock = _event_ms if dev.type == "cuda" else _wall_ms
    one = lambda: hidden @ weight.T  # noqa: E731
    one()
    fwd = bench(one, clock(one), dev, quick)
    g = hidden @ weight.T  # stands in for dlogits

    def three():
        hidden @ weight.T
        g @ weight
        g.T @ hidden

    three()
    est = clock(three)
    timers = dict(fwd_ms=(one, clock(one), ()), fwdbwd_ms=(three, est, ()))
    return dict(fwd_ms=fwd, fwdbwd_ms=bench(three, est, dev, quick)), timers


def measure(fn, hidden, weight, targets, ref, quick):
    """One method's row: memory and errors from one forward+backward after a warm-up, then times; and
    the timers (``retime``)."""
    dev = hidden.device
    cuda = dev.type == "cuda"
    clock = _event_ms if cuda else _wall_ms
    h = hidden.detach().requires_grad_(True)
    w = weight.detach().requires_grad_(True)
    fn(h, w, targets).backward()  # warm-up: compile, autotune
    h.grad = w.grad = None
    sync(dev)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    holder = {}

    def fwdbwd():
        loss = fn(h, w, targets)
        loss.backward()
        holder["loss"] = loss.detach()

    est = clock(fwdbwd)
    out = {}
    if cuda:
        peak = torch.cuda.max_memory_allocated()
        out["extra_mib"] = (peak - base - h.grad.nbytes - w.grad.nbytes) / MiB
    ref_loss, ref_dx, ref_dw = ref
    out["loss_rel"] = abs(holder.pop("loss").item() - ref_loss) / abs(ref_loss)
    out["dx_rel"], out["dw_rel"] = rel(h.grad, ref_dx), rel(w.grad, ref_dw)
    h.grad = w.grad = None
    def fwd():
        with torch.no_grad():
            return fn(hidden, weight, targets)

    fwd()  # warm-up of the no-grad path (a second graph for torch.compile)
    fwd_est = clock(fwd)
    out["fwd_ms"] = bench(fwd, fwd_est, dev, quick)
    out["fwdbwd_ms"] = bench(fwdbwd, est, dev, quick, grad_to_none=(h, w))
    h.grad = w.grad = None
    return out, dict(fwd_ms=(fwd, fwd_est, ()), fwdbwd_ms=(fwdbwd, est, (h, w)))


def retime(row, timers, device, quick):
    """One more round of ``row``'s times: appends to ``<key>_rounds`` for fwd_ms and fwdbwd_ms."""
    for key, (fn, est, leaves) in timers.items():
        rounds = row.setdefault(f"{key}_rounds", [row[key]])
        rounds.append(bench(fn, est, device, quick, grad_to_none=leaves))
        for x in leaves:
            x.grad = None


def derive(row, rows, flop, stats):
    """``row``'s TFLOP/s and its shares of the peak and of the matmul row's rate (the matmul row of
    the same shape and dist, measured first)."""
    if not row["fwdbwd_ms"]:
        return
    row["tflops"] = flop / row["fwdbwd_ms"] / 1e9
    row["pct_peak"] = row["tflops"] / PEAK_TFLOPS
    mm = next((r for r in rows if r["method"] == "matmul" and r["shape"] == row["shape"] and r["dist"] == row["dist"]
               and r["fwd_ms"]), None)
    if mm is not None:
        stats["matmul_tflops"] = flop / 3 / mm["fwd_ms"] / 1e9
        row["pct_matmul"] = row["tflops"] / stats["matmul_tflops"]


def free_memory(device):
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def versions():
    v = dict(torch=torch.__version__, triton=triton.__version__, python=platform.python_version())
    for dist in ("liger-kernel", "cut-cross-entropy"):
        try:
            v[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            v[dist] = None
    return v


def gpu_name(device):
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def file_stem(name):
    stem = re.sub(r"[^a-z0-9]+", "-", name.lower().replace("nvidia", "")).strip("-")
    return stem or "gpu"


def fmt(x, spec):
    return "-" if x is None else format(x, spec)


def progress(t0, tag, row):
    if row.get("error"):
        msg = f"ERROR {row['error']}"
    else:
        msg = (
            f"fwd {fmt(row.get('fwd_ms'), '8.2f')} ms  fwd+bwd {fmt(row.get('fwdbwd_ms'), '8.2f')} ms  "
            f"extra {fmt(row.get('extra_mib'), '9.1f')} MiB  loss {fmt(row.get('loss_rel'), '.1e')} "
            f"dx {fmt(row.get('dx_rel'), '.1e')} dw {fmt(row.get('dw_rel'), '.1e')}  "
            f"{fmt(row.get('tflops'), '5.0f')} TF/s ({fmt(row.get('pct_matmul'), '.0%')} of mm)"
        )
    print(f"[{time.perf_counter() - t0:6.0f}s] {tag} {row['method']:14s} {msg}", flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="benchmarks/results", help="folder for <gpu>.json (default %(default)s)")
    ap.add_argument("--shapes", default="S1,S2,S3,S4", help="from " + ",".join(SHAPES) + " (default %(default)s)")
    ap.add_argument("--dists", default="random,peaked", help="random and/or peaked (default %(default)s)")
    ap.add_argument("--methods", default="*", help="comma-separated names or globs, e.g. 'flce*,torch' (default all)")
    ap.add_argument("--settings", default=None, help="extra settings of ours: chunk_bytes of the recompute path "
                    "(64M), of the chunked path (chunked:1G, chunked:whole) or of \"auto\" (auto:1280M); default "
                    "64M,128M,1G,chunked:256M,chunked:1G,chunked:whole,auto:1280M")
    ap.add_argument("--ref-precision", choices=("tf32", "ieee"), default="tf32", help="fp32 reference matmuls (default %(default)s)")
    ap.add_argument("--tiny", action="store_true", help="one tiny shape; runs on CPU under TRITON_INTERPRET=1")
    ap.add_argument("--quick", action="store_true", help="fewer timing reps")
    ap.add_argument("--no-skip", action="store_true", help="also run the slow combinations skipped by default")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rounds", type=int, default=1, help="timing rounds, methods interleaved; times are "
                    "the medians over them (default %(default)s)")
    args = ap.parse_args(argv)

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    shapes = ["tiny"] if args.tiny else [s.strip() for s in args.shapes.split(",") if s.strip()]
    for s in shapes:
        if s not in SHAPES:
            ap.error(f"unknown shape {s!r}; known: {', '.join(SHAPES)}")
    if device.type == "cpu" and shapes != ["tiny"]:
        ap.error("no CUDA GPU: only --tiny runs on the CPU")
    dists = [d.strip() for d in args.dists.split(",") if d.strip()]
    settings_text = args.settings or ("4K,chunked:4K,chunked:whole" if args.tiny
                                      else "64M,128M,1G,chunked:256M,chunked:1G,chunked:whole,auto:1280M")
    settings = [parse_setting(s) for s in settings_text.split(",") if s.strip()]

    notes = []
    methods = build_methods(settings, notes)
    patterns = [p.strip() for p in args.methods.split(",") if p.strip()]
    if device.type == "cpu" and args.methods == "*":  # peers are GPU kernels; inductor's C++ build is slow
        patterns = ["flce*", "torch", "matmul"]
        notes.append("CPU: default methods are flce*, torch, matmul (ask for others with --methods)")
    methods = {k: f for k, f in methods.items() if any(fnmatch.fnmatchcase(k, p) for p in patterns)}
    for n in notes:
        print(f"note: {n}", flush=True)

    name = gpu_name(device)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    out_path = out_dir / f"{file_stem(name)}.json"
    meta = dict(
        gpu=name,
        **versions(),
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        args=vars(args),
        default_chunk_bytes=configs.DEFAULT_CHUNK_BYTES,
        reference=f"reference.chunked_linear_cross_entropy, fp32 logits, {args.ref_precision} matmuls",
        peak_tflops=PEAK_TFLOPS,
        notes=notes,
        skipped=[],
        data={},
    )
    rows = []
    t0 = time.perf_counter()

    def write():
        tmp = out_path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
        tmp.replace(out_path)

    for shape in shapes:
        n, h, v = SHAPES[shape]
        flop = 6.0 * n * v * h
        torch._dynamo.reset()  # fresh torch.compile graphs for this shape, no recompile limit
        for dist in dists:
            tag = f"{shape} {dist}"
            hidden, weight, targets = make_data(n, h, v, dist, device, args.seed)
            ref_loss, ref_dx, ref_dw, stats = reference_and_stats(hidden, weight, targets, args.ref_precision)
            meta["data"][f"{shape}/{dist}"] = stats
            print(f"[{time.perf_counter() - t0:6.0f}s] {tag} N={n} H={h} V={v} " + " ".join(f"{k}={x:.3g}" for k, x in stats.items()), flush=True)
            timed = []  # (row, timers) of this (shape, dist), for the extra rounds
            for method, fn in methods.items():
                if (shape, method) in SKIP and not args.no_skip:
                    meta["skipped"].append(f"{shape}/{dist}/{method}: {SKIP[(shape, method)]}")
                    print(f"note: skipped {tag} {method}: {SKIP[(shape, method)]}", flush=True)
                    continue
                row = dict(shape=shape, dist=dist, N=n, H=h, V=v, method=method, fwd_ms=None, fwdbwd_ms=None,
                           extra_mib=None, loss_rel=None, dx_rel=None, dw_rel=None, tflops=None, error=None)
                if method.startswith("flce"):
                    kw = fn.keywords if isinstance(fn, partial) else {}
                    row["chunk_bytes"] = kw.get("chunk_bytes", configs.DEFAULT_CHUNK_BYTES)
                    row["strategy"] = kw.get("strategy", "auto")
                try:
                    if method == "torch" and device.type == "cuda" and 12 * n * v > torch.cuda.mem_get_info()[0]:
                        raise torch.OutOfMemoryError(f"skipped: its logits need ~{12 * n * v / 2**30:.0f} GiB")
                    if fn is None:
                        figures, timers = measure_matmul(hidden, weight, args.quick)
                    else:
                        figures, timers = measure(fn, hidden, weight, targets, (ref_loss, ref_dx, ref_dw), args.quick)
                    row.update(figures)
                    if args.rounds > 1:
                        timed.append((row, timers))
                except Exception as e:  # noqa: BLE001 - an OOM or a failing peer is a row, not a crash
                    row["error"] = f"{type(e).__name__}: {str(e).strip()[:300]}"
                free_memory(device)
                rows.append(row)
                if args.rounds == 1:
                    derive(row, rows, flop, stats)
                    progress(t0, tag, row)
            for r in range(1, args.rounds):
                for row, timers in timed:
                    try:
                        retime(row, timers, device, args.quick)
                    except Exception as e:  # noqa: BLE001
                        row["error"] = f"round {r}: {type(e).__name__}: {str(e).strip()[:300]}"
                print(f"[{time.perf_counter() - t0:6.0f}s] {tag} round {r + 1} of {args.rounds}", flush=True)
            if args.rounds > 1:
                for row in (rw for rw in rows if rw["shape"] == shape and rw["dist"] == dist):
                    for key in ("fwd_ms", "fwdbwd_ms"):
                        if row.get(f"{key}_rounds"):
                            row[key] = statistics.median(row[f"{key}_rounds"])
                    derive(row, rows, flop, stats)
                    progress(t0, tag, row)
            del timed
            del hidden, weight, targets, ref_dx, ref_dw
            free_memory(device)
            write()
    print(f"[{time.perf_counter() - t0:6.0f}s] wrote {out_path}", flush=True)


if __name__ == "__main__":
    main()
