"""The benchmark harness: ours at several memory settings against the peers, side by side.

    python3 benchmarks/bench.py --shapes S1,S2,S3 --merge             # GPU, ~5 min; updates <gpu>.json by shape
    python3 benchmarks/bench.py --shapes S4 --merge                   # GPU, ~4 min
    python3 benchmarks/bench.py --shapes S1 --dists peaked --methods 'flce*,liger*'
    python3 benchmarks/bench.py --tiny --quick --out /tmp/b           # CPU smoke test (Triton interpreter)

Per (shape, dist) every method is first set up once: a warm-up forward+backward (compile, autotune),
then one forward+backward that gives ``extra_mib`` (peak allocated during it minus what was allocated
before it, the inputs, minus the bytes of the gradients dX and dW themselves) and the loss / dX / dW
relative (Frobenius) errors against an fp32-logit reference (``reference.chunked_linear_cross_entropy``).
Then ``--rounds`` rounds (default 3), interleaved: round r times method 1, 2, ..., k (forward-only under
no_grad, then forward+backward), then round r + 1. On the H200 back-to-back steps run at the power cap
and one pass of a method moves by 3-6 ms at S1 between runs; interleaving puts that drift on every
method alike. Reported: ``fwd_ms`` / ``fwdbwd_ms`` = the median over the rounds, each round's value in
``<key>_rounds`` and their range in ``<key>_min`` / ``<key>_max``; ``tflops`` = 6*N*V*H over the median
forward+backward time, and its share of the measured one-matmul rate (``pct_matmul``, i.e. 3 matmuls /
fwdbwd) and of 989 TFLOP/s (``pct_peak``). The ``matmul`` row is one cuBLAS ``hidden @ weight.T``
(fwd_ms) and the three matmuls of a forward+backward (fwdbwd_ms): the floor. Each round's figure is a
do_bench median (``--rep-ms`` of repetitions), or for a call slower than 100 ms the median of up to
``--reps`` calls timed by hand.

Peers are optional imports used as black boxes through their public APIs: torch, torch.compile, Liger,
Cut Cross-Entropy, and TRL's head (``trl.kernels.ChunkedLogProbFunction.apply(hidden, weight, None,
targets, 1.0, 32768)``: per-token log-probs, loss = -(their sum over counted rows) / count). A missing
one is a printed note, a failing or out-of-memory one a row with ``error``. Writes ``<gpu>.json``
(e.g. h200.json) under --out after every (shape, dist), so a timeout still leaves results; with
``--merge`` the rows and meta of the shapes run replace those in an existing ``<gpu>.json`` and the
other shapes stay (S1-S3 in one call, S4 in another, one JSON). The meta records the date, the commit
of the package measured and whether the tree was dirty (``git``; else the environment's
``BENCH_COMMIT``). ``plot.py`` turns the JSON into PNGs and a markdown table, ``render.py`` into the
README's and docs' tables.
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
from fused_linear_ce import fused_linear_cross_entropy, plan, reference  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import results_json  # noqa: E402 - benchmarks/results_json.py

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
SLOW_BUDGET_MS = 1200.0  # ... with about this much time per figure, 1 to --reps reps
SKIP = {("S4", "cce-exact"): "slow at S4 (~4x CCE default)"}
MiB = 2**20
TRL_CHUNK = 32768  # the chunk_size argument of TRL's head
# ours besides the default: the settings the docs cite (the others through --settings)
DEFAULT_SETTINGS = "64M,chunked:1G,chunked:whole,auto:1280M"
TINY_SETTINGS = "4K,chunked:whole"  # the interpreter is slow: one recompute, one chunked setting
# Seconds per (dist, method) on the H200, from benchmarks/results/run.log (one pass of the harness
# of 2026-12-03, S1-S4 in 266 s): the set-up (warm-ups, memory, errors) and one round of timing at
# the default --rep-ms / --reps (two do_bench windows of ~0.3 s; at S4 by hand, ~1.2 s a figure).
# At S4 a round's figure is one untimed call then up to 3 timed ones (~2.1 s a method and round).
ESTIMATE_S = {"S1": (1.5, 0.6), "S2": (1.3, 0.6), "S3": (1.3, 0.6), "S4": (1.1, 2.1), "tiny": (1.0, 0.5)}
ESTIMATE_DATA_S = {"S1": 1.0, "S2": 1.5, "S3": 1.5, "S4": 2.5, "tiny": 0.5}  # data and reference, per dist
ESTIMATE_START_S = 30.0  # imports, torch.compile's first use


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
    try:
        from trl.kernels import ChunkedLogProbFunction

        methods["trl"] = partial(trl_loss, ChunkedLogProbFunction)
    except Exception as e:  # noqa: BLE001
        notes.append(f"trl.kernels.ChunkedLogProbFunction not available ({type(e).__name__}: {e}); trl rows skipped")
    return methods


def trl_loss(head, h, w, t, ignore_index=-100):
    """TRL's head as a mean cross-entropy: its per-token log-probs (first output) of the counted rows,
    summed, negated, over their count."""
    log_probs = head.apply(h, w, None, t, 1.0, TRL_CHUNK)[0]
    counted = t != ignore_index
    return -(log_probs.float() * counted).sum() / counted.sum()


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


def reference_gradients(hidden, weight, targets, precision, bias=None, **options):
    """The fp32-logit reference of the mean loss with ``options`` (softcap, ...): (loss, dX, dW, dB or None),
    ``reference_rows`` rows at a time."""
    with matmul_precision(precision, hidden.device):
        loss_sum, count, dx, dw, db = reference.chunked_linear_cross_entropy(
            hidden, weight, targets, bias, chunk=reference_rows(hidden, weight), **options)
    c = count.item()
    return loss_sum.item() / c, dx.div_(c), dw.div_(c), (db.div_(c) if db is not None else None)


def reference_rows(hidden, weight):
    """The rows of a reference chunk: ~2 GiB of fp32 logits."""
    return max(1, min(hidden.shape[0], (2 << 30) // (4 * weight.shape[0])))


def reference_and_stats(hidden, weight, targets, precision):
    """The fp32-logit reference (mean loss, dX, dW) and what the data look like."""
    loss, dx, dw, _ = reference_gradients(hidden, weight, targets, precision)
    chunk = reference_rows(hidden, weight)
    with matmul_precision(precision, hidden.device):
        p_t, std, margin = [], [], []
        for r in range(0, min(hidden.shape[0], 4096), chunk):
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
        ref_loss=loss,
    )
    return loss, dx, dw, stats


def rel(a, b):
    return ((a.float() - b).norm() / b.norm()).item()


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def bench(fn, est_ms, device, quick, grad_to_none=(), rep_ms=None, reps=None):
    """Median ms of fn(): do_bench after warm-up (``rep_ms`` of repetitions: 200, 40 if quick), by hand
    for slow calls (1 to ``reps`` calls: 3, 1 if quick, within SLOW_BUDGET_MS), wall clock on CPU."""
    reps = reps or (1 if quick else 3)

    def by_hand(n, clock):
        times = []
        for _ in range(n):
            for x in grad_to_none:
                x.grad = None
            times.append(clock(fn))
        return statistics.median(times)

    if device.type != "cuda":
        return by_hand(reps, _wall_ms)
    if est_ms > SLOW_MS:
        by_hand(1, _event_ms)  # untimed: the allocator's blocks for this call (freed between methods) first
        return by_hand(max(1, min(reps, int(SLOW_BUDGET_MS // est_ms))), _event_ms)
    rep = rep_ms or (40 if quick else 200)
    warmup = max(5, rep // 8)
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


def matmul_timers(hidden, weight):
    """The timers (``time_round``) of one matmul (fwd_ms) and of the three of a forward+backward
    (fwdbwd_ms), cuBLAS, bf16."""
    clock = _event_ms if hidden.device.type == "cuda" else _wall_ms
    one = lambda: hidden @ weight.T  # noqa: E731
    one()

    def three():
        g = hidden @ weight.T  # stands in for dlogits: nothing of N x V kept between calls
        g @ weight
        g.T @ hidden

    three()
    return dict(fwd_ms=(one, clock(one), ()), fwdbwd_ms=(three, clock(three), ()))


def measure_matmul(hidden, weight, quick):
    """The matmul row's times, one round; and its timers."""
    timers = matmul_timers(hidden, weight)
    return time_round(timers, hidden.device, quick), timers


def setup(fn, hidden, weight, targets, ref):
    """One method, measured once: memory and errors from one forward+backward after a warm-up; and
    the timers (``time_round``) of its forward under no_grad and of its forward+backward."""
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
    return out, dict(fwd_ms=(fwd, clock(fwd), ()), fwdbwd_ms=(fwdbwd, est, (h, w)))


def measure(fn, hidden, weight, targets, ref, quick):
    """One method's row from ``setup`` and one round of times (for one-off experiments); and its timers."""
    out, timers = setup(fn, hidden, weight, targets, ref)
    out.update(time_round(timers, hidden.device, quick))
    return out, timers


def time_round(timers, device, quick, rep_ms=None, reps=None):
    """One round of a method's times: {"fwd_ms": ms, "fwdbwd_ms": ms}."""
    got = {}
    for key, (fn, est, leaves) in timers.items():
        got[key] = bench(fn, est, device, quick, grad_to_none=leaves, rep_ms=rep_ms, reps=reps)
        for x in leaves:
            x.grad = None
    return got


def summarize(row, rounds):
    """``row``'s reported times from its rounds ({key: [ms, ...]}): the median, each round's value and
    their range."""
    for key, values in rounds.items():
        if values:
            row[key] = statistics.median(values)
            row[f"{key}_rounds"] = list(values)
            row[f"{key}_min"], row[f"{key}_max"] = min(values), max(values)


def estimate_s(shapes, n_dists, n_methods, rounds, quick=False, rep_ms=None, reps=None):
    """Seconds a run should take on an H200, from ESTIMATE_S (run.log): {shape: s} and the total."""
    per = {}
    for shape in shapes:
        setup_s, round_s = ESTIMATE_S.get(shape, ESTIMATE_S["S4"])
        if shape == "S4":
            scale = (1 + (reps or (1 if quick else 3))) / 4
        else:
            scale = ((rep_ms or (40 if quick else 200)) + 100) / 300  # ~0.1 s a round is not the window
        per[shape] = n_dists * (ESTIMATE_DATA_S.get(shape, 2.5) + n_methods * (setup_s + rounds * round_s * scale))
    return per, ESTIMATE_START_S + sum(per.values())


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
    for dist in ("liger-kernel", "cut-cross-entropy", "trl"):
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


def spread(row, key):
    lo, hi = row.get(f"{key}_min"), row.get(f"{key}_max")
    return "" if lo is None else f" [{lo:.2f}-{hi:.2f}]"


def progress(t0, tag, row):
    if row.get("error"):
        msg = f"ERROR {row['error']}"
    else:
        msg = (
            f"fwd {fmt(row.get('fwd_ms'), '8.2f')}{spread(row, 'fwd_ms')} ms  "
            f"fwd+bwd {fmt(row.get('fwdbwd_ms'), '8.2f')}{spread(row, 'fwdbwd_ms')} ms  "
            f"extra {fmt(row.get('extra_mib'), '9.1f')} MiB  loss {fmt(row.get('loss_rel'), '.1e')} "
            f"dx {fmt(row.get('dx_rel'), '.1e')} dw {fmt(row.get('dw_rel'), '.1e')}  "
            f"{fmt(row.get('tflops'), '5.0f')} TF/s ({fmt(row.get('pct_matmul'), '.0%')} of mm)"
        )
    print(f"[{time.perf_counter() - t0:6.0f}s] {tag} {row['method']:14s} {msg}", flush=True)


def error_text(e):
    return f"{type(e).__name__}: {str(e).strip()[:300]}"


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="benchmarks/results", help="folder for <gpu>.json (default %(default)s)")
    ap.add_argument("--shapes", default="S1,S2,S3,S4", help="from " + ",".join(SHAPES) + " (default %(default)s)")
    ap.add_argument("--dists", default="random,peaked", help="random and/or peaked (default %(default)s)")
    ap.add_argument("--methods", default="*", help="comma-separated names or globs, e.g. 'flce*,torch' (default all)")
    ap.add_argument("--settings", default=None, help="settings of ours besides the default: chunk_bytes of the "
                    "recompute path (64M), of the chunked path (chunked:1G, chunked:whole) or of \"auto\" "
                    f"(auto:1280M); default {DEFAULT_SETTINGS} (--tiny: {TINY_SETTINGS})")
    ap.add_argument("--ref-precision", choices=("tf32", "ieee"), default="tf32", help="fp32 reference matmuls (default %(default)s)")
    ap.add_argument("--tiny", action="store_true", help="one tiny shape; runs on CPU under TRITON_INTERPRET=1")
    ap.add_argument("--quick", action="store_true", help="fewer timing reps: --rep-ms 40 --reps 1 unless given")
    ap.add_argument("--rounds", type=int, default=3, help="timing rounds, methods interleaved in each; times are "
                    "the medians over them (default %(default)s)")
    ap.add_argument("--rep-ms", type=int, default=None, help="do_bench's repetition window per figure and round, "
                    "ms (default 200, --quick 40)")
    ap.add_argument("--reps", type=int, default=None, help="calls per figure and round for a call slower than "
                    f"{SLOW_MS:.0f} ms, timed by hand within {SLOW_BUDGET_MS:.0f} ms (default 3, --quick 1)")
    ap.add_argument("--merge", action="store_true", help="update an existing <gpu>.json under --out: the shapes "
                    "run replace theirs, the others stay")
    ap.add_argument("--estimate", action="store_true", help="print the time estimate and exit")
    ap.add_argument("--no-skip", action="store_true", help="also run the slow combinations skipped by default")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.rounds < 1:
        ap.error("--rounds must be at least 1")
    args.shape_list = ["tiny"] if args.tiny else [s.strip() for s in args.shapes.split(",") if s.strip()]
    for s in args.shape_list:
        if s not in SHAPES:
            ap.error(f"unknown shape {s!r}; known: {', '.join(SHAPES)}")
    if not torch.cuda.is_available() and args.shape_list != ["tiny"] and not args.estimate:
        ap.error("no CUDA GPU: only --tiny runs on the CPU")
    return args


def select_methods(args, device, notes):
    settings_text = args.settings or (TINY_SETTINGS if args.tiny else DEFAULT_SETTINGS)
    methods = build_methods([parse_setting(s) for s in settings_text.split(",") if s.strip()], notes)
    patterns = [p.strip() for p in args.methods.split(",") if p.strip()]
    if device.type == "cpu" and args.methods == "*":  # peers are GPU kernels; inductor's C++ build is slow
        patterns = ["flce*", "torch", "matmul"]
        notes.append("CPU: default methods are flce*, torch, matmul (ask for others with --methods)")
    return {k: f for k, f in methods.items() if any(fnmatch.fnmatchcase(k, p) for p in patterns)}


def print_estimate(args, methods, n_dists):
    """Prints (and returns) the run's expected seconds on an H200; on a CPU it counts the methods a GPU
    run would have only where they were importable here."""
    counts = {s: sum((s, m) not in SKIP or args.no_skip for m in methods) for s in args.shape_list}
    per = {s: estimate_s([s], n_dists, n, args.rounds, args.quick, args.rep_ms, args.reps)[0][s] for s, n in counts.items()}
    total = ESTIMATE_START_S + sum(per.values())
    print(f"estimate (H200, from run.log): ~{total:.0f} s for {args.rounds} round(s): "
          + ", ".join(f"{s} ~{t:.0f} s ({counts[s]} methods x {n_dists} dists)" for s, t in per.items()), flush=True)
    return total


def run_dist(shape, dist, methods, args, device, meta, rows, t0):
    """One (shape, dist): set up every method once, then the interleaved rounds; appends its rows."""
    n, h, v = SHAPES[shape]
    tag = f"{shape} {dist}"
    hidden, weight, targets = make_data(n, h, v, dist, device, args.seed)
    ref_loss, ref_dx, ref_dw, stats = reference_and_stats(hidden, weight, targets, args.ref_precision)
    meta["data"][f"{shape}/{dist}"] = stats
    print(f"[{time.perf_counter() - t0:6.0f}s] {tag} N={n} H={h} V={v} " + " ".join(f"{k}={x:.3g}" for k, x in stats.items()), flush=True)
    here, timed = [], []  # this (shape, dist)'s rows; (row, timers, {key: [ms per round]})
    for method, fn in methods.items():
        if (shape, method) in SKIP and not args.no_skip:
            meta["skipped"].append(f"{shape}/{dist}/{method}: {SKIP[(shape, method)]}")
            print(f"note: skipped {tag} {method}: {SKIP[(shape, method)]}", flush=True)
            continue
        row = dict(shape=shape, dist=dist, N=n, H=h, V=v, method=method, fwd_ms=None, fwdbwd_ms=None,
                   extra_mib=None, loss_rel=None, dx_rel=None, dw_rel=None, tflops=None, error=None)
        if method.startswith("flce"):
            kw = fn.keywords if isinstance(fn, partial) else {}
            row["chunk_bytes"] = kw.get("chunk_bytes", plan.DEFAULT_CHUNK_BYTES)
            row["strategy"] = kw.get("strategy", "auto")
        try:
            if method == "torch" and device.type == "cuda" and 12 * n * v > torch.cuda.mem_get_info()[0]:
                raise torch.OutOfMemoryError(f"skipped: its logits need ~{12 * n * v / 2**30:.0f} GiB")
            if fn is None:
                timers = matmul_timers(hidden, weight)
            else:
                figures, timers = setup(fn, hidden, weight, targets, (ref_loss, ref_dx, ref_dw))
                row.update(figures)
            timed.append((row, timers, {k: [] for k in timers}))
        except Exception as e:  # noqa: BLE001 - an OOM or a failing peer is a row, not a crash
            row["error"] = error_text(e)
        free_memory(device)
        here.append(row)
    del ref_dx, ref_dw
    free_memory(device)
    print(f"[{time.perf_counter() - t0:6.0f}s] {tag} set up {len(timed)} methods", flush=True)
    for r in range(args.rounds):
        for row, timers, got in timed:
            if row["error"]:
                continue
            try:
                for key, ms in time_round(timers, device, args.quick, args.rep_ms, args.reps).items():
                    got[key].append(ms)
            except Exception as e:  # noqa: BLE001
                row["error"] = f"round {r + 1}: {error_text(e)}"
            if device.type == "cuda":
                torch.cuda.empty_cache()  # one method's cached blocks do not crowd the next
        print(f"[{time.perf_counter() - t0:6.0f}s] {tag} round {r + 1} of {args.rounds}", flush=True)
    for row, _, got in timed:
        if not row["error"]:
            summarize(row, got)
    rows.extend(here)
    for row in here:
        derive(row, rows, 6.0 * n * v * h, stats)
        progress(t0, tag, row)
    del timed, hidden, weight, targets
    free_memory(device)


def main(argv=None):
    args = parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dists = [d.strip() for d in args.dists.split(",") if d.strip()]
    notes = []
    methods = select_methods(args, device, notes)
    for n in notes:
        print(f"note: {n}", flush=True)
    print_estimate(args, methods, len(dists))
    if args.estimate:
        return

    name = gpu_name(device)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    out_path = out_dir / f"{file_stem(name)}.json"
    old = json.loads(out_path.read_text()) if args.merge and out_path.exists() else None
    date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    meta = dict(gpu=name, **versions(), date=date, **results_json.provenance(),
                args={k: x for k, x in vars(args).items() if k != "shape_list"},
                default_chunk_bytes=plan.DEFAULT_CHUNK_BYTES,
                reference=f"reference.chunked_linear_cross_entropy, fp32 logits, {args.ref_precision} matmuls",
                peak_tflops=PEAK_TFLOPS, notes=notes, skipped=[], data={})
    run = {k: meta.get(k) for k in results_json.RUN_KEYS}
    run["rounds"] = args.rounds
    meta["shape_runs"] = {}  # a shape's entry from its start: --merge then drops the old rows of that shape only
    rows = []
    t0 = time.perf_counter()

    def write():
        data = dict(meta=meta, rows=rows)
        if old is not None:
            data = results_json.merge(old, data)
        tmp = out_path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(data, indent=1))
        tmp.replace(out_path)

    for shape in args.shape_list:
        meta["shape_runs"][shape] = run
        torch._dynamo.reset()  # fresh torch.compile graphs for this shape, no recompile limit
        for dist in dists:
            run_dist(shape, dist, methods, args, device, meta, rows, t0)
            write()
    print(f"[{time.perf_counter() - t0:6.0f}s] wrote {out_path}" + (" (merged)" if old is not None else ""), flush=True)


if __name__ == "__main__":
    main()
