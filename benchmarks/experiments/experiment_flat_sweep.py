"""Issue 22 target 4 at S1: the chunked path's sweep as a persistent kernel with one hand-flattened
loop over (tile, K step), so that Triton's pipeliner issues the next tile's first operand loads
while this tile's softmax epilogue runs. One GPU call per run.

Run 1 (``--run 1``, ``results/flat/run1.*``): a standalone kernel (``flat_sweep_kernel`` below: the
plain loss only, row-major exponentials through a descriptor, what the fast path runs at S1-S3).
- The kernels alone on each shape's chunk (one chunk of all rows): the shipped sweep, the flat
  sweep at 3 / 4 stages and with ``warp_specialize`` (in a child process: a compiler abort is a
  row, not the end of the run), both at 128 x 128 and 128 x 256, cuBLAS's bf16 logits (no
  epilogue) and the package's Triton matmul writing bf16 logits. The flat sweep's exponentials,
  tile statistics and target logits are compared bit for bit with the shipped sweep's first.
- Whole fast-path steps side by side (interleaved rounds): ours, ours with the flat sweep patched
  into ``sweep._triton_sweep`` at the shipped 128 x 128 tiles, torch.compile.

Run 2 (default, ``results/flat/run2.*``) under each chunked-sweep config (``_configs``: the 128 x 128
one-tile grid and the same grid at 128 x 256 with 8 warps): errors against the fp32 reference, the
sweep alone, whole steps interleaved with torch.compile, and at the first shape a batch whose every
other 512 rows are ignored. The recorded run 2 also timed a persistent flattened sweep in the package
with and without its compaction of ignored row blocks (NOTES v32, refuted): that kernel's patch,
``flat_sweep.patch``, and this script's branches for it are at commit 3502f5a.

    python3 benchmarks/experiments/experiment_flat_sweep.py --out $OUT/flat [--run 1]

On the CPU (``TRITON_INTERPRET=1``) ``--check`` runs only run 1's bit-for-bit comparison at a small shape.
"""

import collections
import contextlib
import json
import subprocess
import sys
from dataclasses import replace
from functools import partial
from pathlib import Path

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "torch-ext"))
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import fused_linear_ce  # noqa: E402
from fused_linear_ce import configs, device, gemm, sweep  # noqa: E402
from fused_linear_ce.logits import grouped_tile, round_to  # noqa: E402
from fused_linear_ce.validate import Options  # noqa: E402

SHAPES = {"S1": (8192, 4096, 128256), "S2": (8192, 2304, 256000), "S3": (16384, 2048, 151936)}
# The chunked sweep's tiles when run 1 ran (v13's; 128 x 256 with 8 warps since v32)
RUN1_TILES = configs.TileConfig(block_n=128, block_v=128, block_h=64, group_m=16, num_warps=4, num_stages=3)


@triton.jit
def flat_sweep_kernel(
    hidden_desc, weight_desc, e_desc,  # (N, H), (V, H), (N, V) descriptors
    stats_ptr,  # (2, T, N) fp32 out: each tile's row max and sum of exp(z - max)
    z_target_ptr,  # (N,) fp32 out: the target logit, by the tile that holds it
    targets_ptr, N, V, H, stride_t, logit_scale, tiles_per_program, num_programs,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr, GROUP_M: tl.constexpr,
    EVEN_V: tl.constexpr, STAGES: tl.constexpr, WARP_SPECIALIZE: tl.constexpr,
    BF16_EMULATION: tl.constexpr, INPUT_PRECISION: tl.constexpr,
):
    pid = tl.program_id(0)
    n_blocks = tl.cdiv(N, BLOCK_N)
    n_tiles = tl.cdiv(V, BLOCK_V)
    total = n_blocks * n_tiles
    k_steps = tl.cdiv(H, BLOCK_H)
    acc = tl.zeros((BLOCK_N, BLOCK_V), tl.float32)
    for it in tl.range(0, tiles_per_program * k_steps, num_stages=STAGES, warp_specialize=WARP_SPECIALIZE):
        j = it // k_steps
        k = it - j * k_steps
        # the last programs' surplus turns redo the last tile: the same bits stored again
        t = tl.minimum(pid + j * num_programs, total - 1)
        pid_n, vt = grouped_tile(t, n_blocks, n_tiles, GROUP_M)
        x = hidden_desc.load([pid_n * BLOCK_N, k * BLOCK_H])
        w = weight_desc.load([vt * BLOCK_V, k * BLOCK_H])
        if BF16_EMULATION:
            x = x.to(tl.float32)
            w = w.to(tl.float32)
        acc = tl.dot(x, w.T, acc, input_precision=INPUT_PRECISION)
        if k == k_steps - 1:
            z = acc * logit_scale
            offs_v = vt * BLOCK_V + tl.arange(0, BLOCK_V)
            if not EVEN_V:
                z = tl.where((offs_v < V)[None, :], z, float("-inf"))
            m = tl.max(z, axis=1)
            e = tl.exp(z - m[:, None])
            s = tl.sum(e, axis=1)
            e_desc.store([pid_n * BLOCK_N, vt * BLOCK_V], round_to(e, e_desc.dtype, BF16_EMULATION))
            offs_n = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
            mask_n = offs_n < N
            target = tl.load(targets_ptr + tl.where(mask_n, offs_n, 0) * stride_t)
            col = (target - vt * BLOCK_V).to(tl.int32)
            holds = mask_n & (col >= 0) & (col < BLOCK_V)
            z_t = tl.sum(tl.where(tl.arange(0, BLOCK_V)[None, :] == col[:, None], z, 0.0), axis=1)
            base = stats_ptr + vt.to(tl.int64) * N + offs_n
            plane = n_tiles.to(tl.int64) * N
            tl.store(base, m, mask=mask_n)
            tl.store(base + plane, s, mask=mask_n)
            tl.store(z_target_ptr + offs_n, 0.0 + z_t, mask=holds)
            acc = tl.zeros((BLOCK_N, BLOCK_V), tl.float32)


def flat_sweep(hidden, weight, targets, e_out, z_target, stats, cfg, stages, ws=False, scale=1.0):
    n, h = hidden.shape
    v = weight.shape[0]
    hidden_desc = TensorDescriptor.from_tensor(hidden, [cfg.block_n, cfg.block_h])
    weight_desc = TensorDescriptor.from_tensor(weight, [cfg.block_v, cfg.block_h])
    e_desc = TensorDescriptor.from_tensor(e_out, [cfg.block_n, cfg.block_v])
    total = triton.cdiv(n, cfg.block_n) * triton.cdiv(v, cfg.block_v)
    programs = min(total, device.sm_count(hidden.device) * cfg.resident) if hidden.is_cuda else min(total, 3)
    flags = device.logit_flags(hidden.dtype)
    flat_sweep_kernel[(programs,)](
        hidden_desc, weight_desc, e_desc, stats, z_target, targets, n, v, h, targets.stride(0), scale,
        triton.cdiv(total, programs), programs,
        BLOCK_N=cfg.block_n, BLOCK_V=cfg.block_v, BLOCK_H=cfg.block_h, GROUP_M=cfg.group_m,
        EVEN_V=v % cfg.block_v == 0, STAGES=stages, WARP_SPECIALIZE=ws, num_warps=cfg.num_warps,
        num_stages=stages, **flags,
    )


FLAT = dict(stages=3, ws=False)


def _patched_triton_sweep(real):
    """``sweep._triton_sweep`` with the flat kernel where the call is the plain loss's chunked sweep
    through descriptors into a row-major buffer, the real one elsewhere."""

    def patched(hidden, weight, targets, bias, class_weight, opts, offset, e_out, cfg, z_target, scratch=None):
        metrics, smoothing, squares = sweep.sums(opts)
        plain = (e_out is not None and e_out.stride(1) == 1 and bias is None and class_weight is None
                 and opts.softcap is None and not (metrics or smoothing or squares) and offset == 0
                 and device.tma_hardware(hidden.device) and device.tma_layout(hidden)
                 and device.tma_layout(weight) and device.tma_layout(e_out))
        if not plain:
            return real(hidden, weight, targets, bias, class_weight, opts, offset, e_out, cfg, z_target, scratch)
        n = hidden.shape[0]
        t = triton.cdiv(weight.shape[0], cfg.block_v)
        stats = device.fp32_fit(scratch, (2, t, n)) if scratch is not None else None
        if stats is None:
            stats = device.new((2, t, n), torch.float32, hidden.device)
        flat_sweep(hidden, weight, targets, e_out, z_target, stats, cfg, FLAT["stages"], FLAT["ws"],
                   opts.kernel_scales()[0])
        return stats, stats, t

    return patched


def shipped(hidden, weight, targets, e_out, z_target, cfg, scratch=None):
    opts = Options()
    return sweep._triton_sweep(hidden, weight, targets, None, None, opts, 0, e_out, cfg, z_target, scratch)


def compare(hidden, weight, targets, cfg, stages_list, ws_list=(False,)):
    """Bit-for-bit: the flat sweep's outputs against the shipped sweep's. Returns {variant: bool}."""
    n, v = hidden.shape[0], weight.shape[0]
    e0 = torch.full((n, v), float("nan"), dtype=hidden.dtype, device=hidden.device)
    z0 = torch.full((n,), float("nan"), device=hidden.device)
    stats0, _, t = shipped(hidden, weight, targets, e0, z0, cfg)
    out = {}
    for stages in stages_list:
        for ws in ws_list:
            e1 = torch.full_like(e0, float("nan"))
            z1 = torch.full_like(z0, float("nan"))
            s1 = torch.full((2, t, n), float("nan"), device=hidden.device)
            flat_sweep(hidden, weight, targets, e1, z1, s1, cfg, stages, ws)
            same = (torch.equal(e0.view(torch.int16), e1.view(torch.int16))
                    and torch.equal(stats0[:2].view(torch.int32), s1.view(torch.int32))
                    and torch.equal(z0.view(torch.int32), z1.view(torch.int32)))
            out[f"s{stages}{'-ws' if ws else ''}"] = same
    return out


def cpu_check():
    torch.manual_seed(0)
    n, h, v = 40, 96, 600  # ragged rows, classes and K steps
    cfg = configs.tiles("chunked", torch.bfloat16)
    for dtype in (torch.float16, torch.bfloat16):
        hidden = torch.randn(n, h).to(dtype)
        weight = torch.randn(v, h).to(dtype)
        targets = torch.randint(0, v, (n,))
        res = compare(hidden, weight, targets, cfg, (1, 2))
        print(dtype, res)
        assert all(res.values()), res


def kernels_alone(name, hidden, weight, targets, rep, timed):
    """Run 1: the standalone kernel against the shipped sweep, cuBLAS and the Triton matmul."""
    n, h = hidden.shape
    v = weight.shape[0]
    cfg = RUN1_TILES  # the chunked sweep's tiles at run 1
    e = torch.empty(n, v, dtype=hidden.dtype, device="cuda")
    z = torch.empty(n, device="cuda")
    t = triton.cdiv(v, cfg.block_v)
    stats = torch.empty(2, t, n, device="cuda")
    rows = {}
    rows["shipped 128x128 s3"] = timed(lambda: shipped(hidden, weight, targets, e, z, cfg), rep)
    for stages in (3, 4):
        rows[f"flat 128x128 s{stages}"] = timed(lambda: flat_sweep(hidden, weight, targets, e, z, stats, cfg, stages), rep)
    wide = configs.TileConfig(block_n=128, block_v=256, block_h=64, group_m=16, num_warps=8, num_stages=3)
    stats_w = torch.empty(2, triton.cdiv(v, 256), n, device="cuda")
    rows["shipped 128x256 w8 s3"] = timed(lambda: shipped(hidden, weight, targets, e, z, wide), rep)
    rows["flat 128x256 w8 s3"] = timed(lambda: flat_sweep(hidden, weight, targets, e, z, stats_w, wide, 3), rep)
    rows["cuBLAS logits bf16"] = timed(lambda: torch.mm(hidden, weight.t(), out=e), rep)
    one = torch.ones(1, device="cuda")
    rows["Triton matmul logits bf16"] = timed(lambda: gemm.matmul(hidden, weight.t(), e, False, one), rep)
    return rows


def probe_ws(name):
    """Run 1: the flat sweep with warp_specialize, in a child: (bit-equal, ms) or the failure."""
    r = subprocess.run([sys.executable, __file__, "--ws-child", name], capture_output=True, text=True, timeout=300)
    tail = (r.stdout + r.stderr).strip().splitlines()[-3:]
    if r.returncode != 0:
        return dict(error=f"rc {r.returncode}: " + " | ".join(tail)[:300])
    return json.loads(r.stdout.strip().splitlines()[-1])


def ws_child(name):
    from bench import make_data
    from experiment_common import timed
    n, h, v = SHAPES[name]
    hidden, weight, targets = make_data(n, h, v, "random", torch.device("cuda"), seed=0)
    cfg = RUN1_TILES  # the chunked sweep's tiles at run 1
    same = compare(hidden, weight, targets, cfg, (3,), (True,))
    e = torch.empty(n, v, dtype=hidden.dtype, device="cuda")
    z = torch.empty(n, device="cuda")
    stats = torch.empty(2, triton.cdiv(v, cfg.block_v), n, device="cuda")
    ms = timed(lambda: flat_sweep(hidden, weight, targets, e, z, stats, cfg, 3, True), 200)
    print(json.dumps(dict(same=same["s3-ws"], ms=ms)))


def _rounds(rounds, entries, rep, timed):
    """Interleaved rounds: per round, each entry (label -> (step, patch or None; a patch returns its
    undo)) timed in turn. Returns label -> ms per round."""
    times = collections.defaultdict(list)
    for _ in range(rounds):
        for label, (step, patch) in entries.items():
            undo = patch() if patch is not None else (lambda: None)
            try:
                times[label].append(timed(step, rep))
            finally:
                undo()
    return dict(times)


def _flat_patch(real, stages):
    """Run 1: the standalone kernel at ``stages`` in place of ``sweep._triton_sweep``; returns the undo."""
    FLAT.update(stages=stages)
    sweep._triton_sweep = _patched_triton_sweep(real)
    return lambda: setattr(sweep, "_triton_sweep", real)


def run1(args):
    """Run 1: the standalone kernel (``flat_sweep_kernel`` above) in the kernels-alone table and
    patched into whole steps at the shipped 128 x 128 tiles."""
    from bench import WHOLE, make_data
    from experiment_common import against_compile, timed
    from experiment_fastpath import stepper, torch_ce
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__, shapes={})
    table = []
    ours = partial(fused_linear_ce.fused_linear_cross_entropy, strategy="chunked", chunk_bytes=WHOLE)
    real = sweep._triton_sweep
    for name in args.shapes:
        n, h, v = SHAPES[name]
        rec = result["shapes"][name] = {}
        torch._dynamo.reset()
        compiled = torch.compile(torch_ce, dynamic=False)
        for dist in args.dists:
            hidden, weight, targets = make_data(n, h, v, dist, torch.device("cuda"), seed=0)
            if dist == args.dists[0]:
                cfg = RUN1_TILES  # the chunked sweep's tiles at run 1
                rec["bits"] = compare(hidden, weight, targets, cfg, (3, 4))
                print(f"{name} bit-equal to the shipped sweep: {rec['bits']}", flush=True)
                rec["kernels"] = kernels_alone(name, hidden, weight, targets, args.rep, timed)
                if not args.no_ws:
                    rec["kernels"]["flat 128x128 s3 warp_specialize"] = probe_ws(name)
                for key, ms in rec["kernels"].items():
                    print(f"{name} {key:34s} {ms if isinstance(ms, dict) else f'{ms:8.3f} ms'}", flush=True)
                    table.append(f"{name} kernel {key:34s} {ms if isinstance(ms, dict) else f'{ms:8.3f}'}")
            steps = {"ours": stepper(ours, hidden, weight, targets), "compile": stepper(compiled, hidden, weight, targets)}
            entries = {label: (step, None) for label, step in steps.items()}
            entries.update({f"flat-s{st}": (steps["ours"], partial(_flat_patch, real, st)) for st in (3, 4)})
            times = _rounds(args.rounds, entries, args.rep, timed)
            rec.setdefault("steps", {})[dist] = times
            table += against_compile(f"{name} {dist:7s}", times, 10)
            del hidden, weight, targets
            torch.cuda.empty_cache()
        (out / "experiment_flat_sweep.json").write_text(json.dumps(result, indent=1))
    print("\n" + "\n".join(table))


# Run 2: the package's chunked sweep under each tile config (``configs.override(chunked=...)``):
# the 128 x 128 one-tile grid (v13) and the same grid at 128 x 256 w8 (shipped since).
def _configs():
    wide = configs.TileConfig(block_n=128, block_v=256, block_h=64, group_m=16, num_warps=8, num_stages=3)
    return {"t128": replace(wide, block_v=128, num_warps=4), "wide": wide}


def _use(label, cfgs):
    """Makes the package run ``label`` (``configs.override``); returns the undo."""
    held = contextlib.ExitStack()
    held.enter_context(configs.override(chunked=cfgs[label]))
    return held.close


def _ignored_half(targets, run=512):
    """Every other run of 512 rows ignored (prompt tokens under an assistant-only loss)."""
    t = targets.clone()
    idx = torch.arange(t.shape[0], device=t.device)
    t[(idx // run) % 2 == 0] = -100
    return t


def run2(args):
    from bench import WHOLE, make_data
    from experiment_common import against_compile, reference, timed
    from experiment_fastpath import stepper, torch_ce
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cfgs = _configs()
    labels = list(cfgs)
    result = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                  configs={k: str(v) for k, v in cfgs.items()}, shapes={})
    table = []
    ours = partial(fused_linear_ce.fused_linear_cross_entropy, strategy="chunked", chunk_bytes=WHOLE)
    for name in args.shapes:
        n, h, v = SHAPES[name]
        rec = result["shapes"][name] = dict(errors={}, sweep={}, steps={})
        torch._dynamo.reset()
        compiled = torch.compile(torch_ce, dynamic=False)
        dists = list(args.dists) + (["random-ignored-half"] if name == args.shapes[0] else [])
        for dist in dists:
            hidden, weight, targets = make_data(n, h, v, dist.split("-")[0], torch.device("cuda"), seed=0)
            if dist.endswith("ignored-half"):
                targets = _ignored_half(targets)
            if dist == dists[0]:
                ref_loss, ref_dx, ref_dw = reference(hidden, weight, targets)
                for label in labels:
                    undo = _use(label, cfgs)
                    try:
                        x = hidden.detach().requires_grad_(True)
                        w = weight.detach().requires_grad_(True)
                        loss = ours(x, w, targets)
                        loss.backward()
                        rel = lambda a, b: ((a.float() - b).norm() / b.norm()).item()
                        rec["errors"][label] = dict(loss=abs(loss.item() - ref_loss.item()), dx=rel(x.grad, ref_dx),
                                                    dw=rel(w.grad, ref_dw))
                        e = torch.empty(n, v, dtype=hidden.dtype, device="cuda")
                        cfg = RUN1_TILES  # the chunked sweep's tiles at run 1
                        rec["sweep"][label] = timed(
                            lambda: sweep.sweep(hidden, weight, targets, None, None, Options(), None, e, cfg), args.rep)
                        del e, x, w, loss
                    finally:
                        undo()
                    row = (f"{name} {label:15s} sweep {rec['sweep'][label]:7.3f} ms  dX {rec['errors'][label]['dx']:.2e}"
                           f"  dW {rec['errors'][label]['dw']:.2e}")
                    print(row, flush=True)
                    table.append(row)
                del ref_dx, ref_dw
            step = stepper(ours, hidden, weight, targets)
            entries = {"compile": (stepper(compiled, hidden, weight, targets), None)}
            entries.update({label: (step, partial(_use, label, cfgs)) for label in labels})
            times = _rounds(args.rounds, entries, args.rep, timed)
            rec["steps"][dist] = times
            table += against_compile(f"{name} {dist:20s}", times, 15)
            del hidden, weight, targets
            torch.cuda.empty_cache()
        (out / "experiment_flat_sweep.json").write_text(json.dumps(result, indent=1))
    print("\n" + "\n".join(table))


def main():
    if "--check" in sys.argv:
        return cpu_check()
    if "--ws-child" in sys.argv:
        return ws_child(sys.argv[sys.argv.index("--ws-child") + 1])
    from experiment_common import parse_args
    args = parse_args(SHAPES, lambda ap: (ap.add_argument("--dists", nargs="+", default=["random", "peaked"]),
                                          ap.add_argument("--rounds", type=int, default=3),
                                          ap.add_argument("--rep", type=int, default=200),
                                          ap.add_argument("--no-ws", action="store_true"),
                                          ap.add_argument("--run", type=int, default=2)))
    return run1(args) if args.run == 1 else run2(args)


if __name__ == "__main__":
    main()
