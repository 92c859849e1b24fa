"""Tile tables: block sizes, warps and stages of every kernel, and the candidates autotuning times.

Fixed tuned defaults per shape bucket (``tiles``); autotuning for the exact shape is opt-in
(``autotune.py``), so tests never pay for tuning and importing never touches the GPU. The GPU values
were measured on an H200 (the measurements are under ``benchmarks/``); the interpreter values only
keep CPU tests quick.

How the work is cut (the vocabulary split, the backward plan, the memory knob) is ``plan.py``; what
the device can do is ``device.py``. Their public names are re-exported here, where the published API
(tests/public_api.json) has them.
"""

from dataclasses import dataclass, replace

import torch
import triton

from . import device
from .device import fp_fusion, input_precision, interpreted, sm_count, tma_hardware, tma_layout  # re-exported

__all__ = [  # the public names (scripts/public_api.py), the re-exported ones included
    "DIVERGENCE_ROW_LAUNCHES", "ROLES", "MatmulConfig", "PingpongConfig", "TileConfig",
    "FAMILY_TABLES", "MATMUL_ROLES", "MEASURED_TRITON", "NEWER_TRITON_TABLES",
    "candidates", "chunked_epilogue", "family", "family_matmul", "family_tiles",
    "divergence_launches", "divergence_row_config", "table", "transposed_store_tma", "triton_version",
    "dlogits_config", "fp_fusion", "input_precision", "interpreted", "matmul_config", "pingpong",
    "sm_count", "sweep_config", "tiles", "tma_hardware", "tma_layout",
]


@dataclass(frozen=True)
class TileConfig:
    block_n: int
    block_v: int
    block_h: int
    group_m: int
    num_warps: int
    num_stages: int
    resident: int = 1  # programs of these tiles one SM holds at once (shared memory, registers)
    tma: bool = True  # operands through TMA tensor descriptors where the layout allows (``tma_layout``)


@dataclass(frozen=True)
class PingpongConfig:
    """The Hopper ping-pong sweep's tiles (``pingpong.py``): each consumer warpgroup's tile is
    block_n x block_v (its fp32 accumulator 128 registers a thread at 64 x 256), block_k the K-step
    of the ring's ``stages`` buffers; ``consumer_regs`` the registers a consumer thread may hold."""

    max_h: int  # the bucket: hidden sizes up to this one
    block_n: int = 64
    block_v: int = 256
    block_k: int = 64
    stages: int = 4
    consumer_regs: int = 232
    loader_regs: int = 40  # the loader warp's (its warpgroup's) registers; the rest go to the consumers


@dataclass(frozen=True)
class MatmulConfig:
    block_m: int
    block_p: int
    block_k: int
    group_m: int
    num_warps: int
    num_stages: int
    tma: bool = True  # operands through TMA tensor descriptors where the layout allows (``tma_layout``)
    # A plain (not compensated) result read and written through a descriptor too, where it is
    # contiguous: no 2-D tile of pointers in the epilogue (``matmul_kernel``'s C_TMA).
    c_tma: bool = False
    # A compensated pair's epilogue (through descriptors) on the tile's two column halves in turn:
    # fewer registers live at once (``matmul_kernel``'s SPLIT_PAIR).
    split_pair: bool = False


# Interpreter: every program runs in numpy, so fewer, larger tiles are faster; tl.dot needs >= 16.
_CPU_SWEEP = TileConfig(block_n=16, block_v=256, block_h=64, group_m=4, num_warps=1, num_stages=1)
_CPU_MATMUL = MatmulConfig(block_m=64, block_p=64, block_k=256, group_m=4, num_warps=1, num_stages=1)

# GPU: 128 x 256 logit tiles over 64-wide H steps (H200: 15.2 ms vs 19.9 ms for 128 x 128 at S1);
# 3 stages of 48 KB of operands: one program per SM. Operands through TMA descriptors (H200, bf16,
# S1 evaluation forward 13.0-13.5 ms against 14.1-14.2 with pointer loads).
_GPU_SWEEP = TileConfig(block_n=128, block_v=256, block_h=64, group_m=8, num_warps=8, num_stages=3, resident=1)
# fp32: 3 stages of 16 KB; two per SM assumed (not measured: fp32 is not a tuned case). Pointer
# loads: with TMA descriptors the fp32 sweep was slower (H200, 2048 x 1024 x 32000, TF32 off:
# evaluation forward 12.7 ms against 9.9).
_GPU_SWEEP_FP32 = TileConfig(block_n=64, block_v=64, block_h=32, group_m=8, num_warps=4, num_stages=3, resident=2,
                             tma=False)
# The chunked path's sweep, one tile a program in a 1-D grid grouped by group_m row blocks (a wave
# shares fewer rows and weight tiles): 128 x 256 tiles with two warpgroups, 3 stages (208 KB of
# shared memory with the descriptor store's 64 KB buffer: one program per SM), groups of 16. Its
# gradient kernel keeps 128-column programs (``chunked.gradient_cols``). H200, bf16, the chunked path
# in one chunk, 3 interleaved rounds against torch.compile (benchmarks/results/flat/run2.json,
# random / peaked): S1 0.988x / 1.004x against 1.036x / 1.036x for 128 x 128 tiles with one
# warpgroup, S2 0.993x / 0.993x against 1.031x / 1.007x, S3 1.007x / 0.995x against 1.035x /
# 1.015x; the sweep alone 13.66 / 16.20 / 17.52 ms against 14.55 / 16.91 / 17.83. (With the gradient
# kernel on the sweep's tiles, 128 x 128 tiles measured faster than 256 x 128 ones.)
_GPU_CHUNKED_SWEEP = TileConfig(block_n=128, block_v=256, block_h=64, group_m=16, num_warps=8, num_stages=3)
# Up to H = 1024 the 128 x 128 tiles with one warpgroup (3 stages, 128 KB: one program per SM): at
# H = 896 and 640 (autotuning the whole chunked forward, H200) the 128 x 256 tiles took 14% longer,
# measured with the gradient kernel on the sweep's tiles rather than on its own 128-column programs.
_GPU_CHUNKED_SWEEP_SMALL_H = TileConfig(block_n=128, block_v=128, block_h=64, group_m=16, num_warps=4, num_stages=3)
# The recompute backward's dlogits kernel (one tile a program; its tiles also cut the backward plan):
# the sweep's. 128 x 128 tiles with 4 warps (two programs per SM), 4 stages, 128-wide H steps were all
# slower (H200, S1-S3 at 64 MiB: +0.5 to +3.7 ms fwd+bwd).
_GPU_DLOGITS = _GPU_SWEEP
# The Triton matmul (products with a factor in the epilogue): TMA loads reach cuBLAS's rate where
# pointer loads took 1.23x (H200, S1 grad_weight blocks, M=4096 K=8192 P=4096: 0.38 ms against 0.47,
# cuBLAS 0.38). fp32 keeps pointer loads, as the fp32 sweep.
# The contiguous plain result through a descriptor (c_tma): H200, S4's 3840-row chunk, a master
# weight's fp32 dW sum 7.22 -> 6.79 ms, the bf16 dX and S1's dW unchanged (6.06 / 6.04, 12.49 / 12.48
# ms); no spills where the pointer epilogue spilled 88 bytes (1696 for the fp32 sum). The same tiles
# with two programs an SM (128 x 128, 4 warps) were 1-24% slower on all but the paired plan's dX
# (2.28 against 2.37 ms; benchmarks/results/matmul/).
_GPU_MATMUL = MatmulConfig(block_m=128, block_p=256, block_k=64, group_m=8, num_warps=8, num_stages=3, c_tma=True,
                           split_pair=True)
# The pair's epilogue on column halves (split_pair): no spills with an int8 remainder (104 bytes
# whole); H200, S4 chunk's grad_weight into the pair 7.37 ms against 7.44 (cuBLAS into bf16 6.01).
# The paired plan's grad_hidden product (N x block columns x H into the bf16 + int8 pair: a K loop of
# only the block's columns, then 3 + 3 bytes an element of epilogue): 128 x 128 tiles, two programs
# an SM, so that one's epilogue runs beside the other's products; 8 warps once the epilogue is split.
# H200, S4's 2048-column block: 2.16 ms, against 2.22 with 4 warps unsplit and 2.40 for the shared
# config (cuBLAS into bf16 1.64; benchmarks/results/matmul/run3.json).
_GPU_MATMUL_PAIRED_ROWS = MatmulConfig(block_m=128, block_p=128, block_k=64, group_m=8, num_warps=8, num_stages=3,
                                       c_tma=True, split_pair=True)
_GPU_MATMUL_FP32 = MatmulConfig(block_m=64, block_p=64, block_k=32, group_m=8, num_warps=4, num_stages=3,
                                tma=False)

# The tuned tiles of the three logit kernels per shape bucket, for 16-bit inputs on the GPU: per role,
# (largest H of the bucket or None for the rest, the name of the config in this module) in ascending
# H. The bucket is the hidden size: H is the length of each tile's product loop, against which the
# tile's softmax epilogue is a fixed cost. Names, not objects, so that experiments patch the
# module's configs. The sweep's and the dlogits kernel's one bucket: the H200 at H = 640 to 4096
# gave no second one that held up side by side. The chunked sweep's two: 128 x 256 tiles measured
# best at H = 2048, 2304 and 4096 (benchmarks/results/flat/), 128 x 128 up to H = 1024
# (``_GPU_CHUNKED_SWEEP_SMALL_H``). ``autotune`` tunes for the exact shape where that matters.
_TUNED = {
    "sweep": ((None, "_GPU_SWEEP"),),
    "chunked": ((1024, "_GPU_CHUNKED_SWEEP_SMALL_H"), (None, "_GPU_CHUNKED_SWEEP")),
    "dlogits": ((None, "_GPU_DLOGITS"),),
}

# The other families' tables (``device.FAMILIES``), chosen offline by compiling every configuration
# the package launches for that target under Triton 3.6 and 3.9 (``scripts/registers.py --arch``,
# held by tests/kernel/test_arch_matrix.py): each fits the family's per-block shared memory and
# spills at most 256 bytes a thread. Not timed on those GPUs (none was at hand): ``autotune`` tunes
# for the exact shape there, and benchmarks/NOTES.md has the compile figures.
# Below sm_90 there is no TMA (``device.tma_hardware``): pointer loads, mma.sync, and an epilogue
# whose 2-D tiles of pointers cost registers the descriptors did not.
# sm80 (A100: 163 KB a block, no TMA) and sm86 (A10G, L4, RTX 3090 / 4090, L40S: 99 KB): 128 x 128
# logit tiles with 8 warps, 3 stages (128 x 256 spill 0.9 KB with pointer loads; 4 stages 264 bytes
# under Triton 3.9 with every per-token field); the chunked sweep 128 x 64 with 8 warps (128 x 128
# spilled 320 bytes with the metrics, 64 x 256 360, 128 x 64 with 4 warps 416 on sm_86 under 3.9);
# every product 128 x 128 with 8 warps (the pair's pointer epilogue at 128 x 256 spilled 3.3 KB, 48
# bytes here).
_SM80_SWEEP = TileConfig(block_n=128, block_v=128, block_h=64, group_m=8, num_warps=8, num_stages=3)
_SM80_CHUNKED = TileConfig(block_n=128, block_v=64, block_h=64, group_m=16, num_warps=8, num_stages=3)
_SM80_MATMUL = MatmulConfig(block_m=128, block_p=128, block_k=64, group_m=8, num_warps=8, num_stages=3)
# sm100 (B200, B300: 227 KB, TMA, tcgen05): sm90's tables but for both sweeps, 128 x 128 with 8 warps
# (sm90's 128 x 256 spill 1.1 KB in the chunked sweep with a softcap and a bias; under Triton 3.9
# 0.6-2 KB in the sweep with the metrics), and the sums into a pair, 128 x 128 (0.5-0.6 KB at
# 128 x 256). Its class-major buffer (hosted in grad_weight) is stored through pointers
# (``transposed_store_tma``): the transposed tile through a descriptor fails to compile there at every
# tile tried (Triton 3.6's TMEM layout pass, ``PassManager::run failed``); by pointers
# 0 bytes of stack.
_SM100_SWEEP = TileConfig(block_n=128, block_v=128, block_h=64, group_m=8, num_warps=8, num_stages=3)
_SM100_CHUNKED = replace(_SM100_SWEEP, group_m=16)
_SM100_PAIR = replace(_GPU_MATMUL_PAIRED_ROWS)
# sm120 (RTX 5090, RTX PRO 6000: 99 KB a block, TMA, mma.sync): 128 x 128 tiles with 8 warps
# everywhere (sm90's chunked sweep needs 160 KB, its fp32 sums 128 KB).
_SM120_TILES = TileConfig(block_n=128, block_v=128, block_h=64, group_m=8, num_warps=8, num_stages=3)
_SM120_CHUNKED = replace(_SM120_TILES, group_m=16)
_SM120_MATMUL = MatmulConfig(block_m=128, block_p=128, block_k=64, group_m=8, num_warps=8, num_stages=3, c_tma=True,
                             split_pair=True)
FAMILY_TABLES = {
    "sm80": dict(tuned={"sweep": ((None, "_SM80_SWEEP"),), "chunked": ((None, "_SM80_CHUNKED"),),
                        "dlogits": ((None, "_SM80_SWEEP"),)},
                 matmul="_SM80_MATMUL", paired_rows="_SM80_MATMUL"),
    "sm86": dict(tuned={"sweep": ((None, "_SM80_SWEEP"),), "chunked": ((None, "_SM80_CHUNKED"),),
                        "dlogits": ((None, "_SM80_SWEEP"),)},
                 matmul="_SM80_MATMUL", paired_rows="_SM80_MATMUL"),
    "sm90": dict(tuned=_TUNED, matmul="_GPU_MATMUL", paired_rows="_GPU_MATMUL_PAIRED_ROWS"),
    "sm100": dict(tuned=dict(_TUNED, sweep=((None, "_SM100_SWEEP"),), chunked=((None, "_SM100_CHUNKED"),)),
                  matmul="_GPU_MATMUL",
                  paired_rows="_GPU_MATMUL_PAIRED_ROWS", compensated="_SM100_PAIR", transposed_store_tma=False),
    "sm120": dict(tuned={"sweep": ((None, "_SM120_TILES"),), "chunked": ((None, "_SM120_CHUNKED"),),
                         "dlogits": ((None, "_SM120_TILES"),)},
                  matmul="_SM120_MATMUL", paired_rows="_SM120_MATMUL"),
}
ROLES = tuple(_TUNED)

# The per-token sweep of log-probs alone as a ping-pong kernel on Hopper (``pingpong.py``), for H up
# to max_h. H200, bf16, that forward side by side with the Triton sweep (``benchmarks/results/gluon/``):
# 16384 x 1024 x 151936 -12%, S3 (H = 2048) -16%, S2 (H = 2304) -4.5% (one round of two
# within the other's spread), S1 (H = 4096) +6%: with a long K loop the Triton sweep's epilogue is a
# small share and the 64 x 256 consumer tiles' products are slower than its 128 x 256 ones. 128 x 128
# consumer tiles, 3-8 stages, 128-deep K steps and 2-4 vocabulary splits were slower at S1-S3.
_GPU_PINGPONG = PingpongConfig(max_h=2048)


def pingpong(h: int) -> PingpongConfig | None:
    """The ping-pong sweep's tiles at hidden size ``h``, or None outside its bucket."""
    return _GPU_PINGPONG if h <= _GPU_PINGPONG.max_h else None


# Triton after 3.6 (the one sm_90's tables were measured with) compiles some of them with more spills
# (offline, Triton 3.9.0 for sm_90: the chunked sweep 424 bytes, 960 with a softcap and a bias; the
# per-token sweep 464): there sm_90 takes 128 x 128 tiles with 8 warps for both sweeps (0 and 8 bytes
# under 3.9), not timed. Every other family's tables hold under both (tests/kernel/test_arch_matrix.py,
# scripts/registers_matrix.sh).
MEASURED_TRITON = (3, 6)
_SM90_NEWER_TRITON = TileConfig(block_n=128, block_v=128, block_h=64, group_m=8, num_warps=8, num_stages=3)
_SM90_NEWER_TRITON_CHUNKED = replace(_SM90_NEWER_TRITON, group_m=16)
NEWER_TRITON_TABLES = {
    "sm90": dict(FAMILY_TABLES["sm90"], tuned=dict(
        _TUNED, sweep=((None, "_SM90_NEWER_TRITON"),),
        chunked=((1024, "_GPU_CHUNKED_SWEEP_SMALL_H"), (None, "_SM90_NEWER_TRITON_CHUNKED")))),
}


def triton_version() -> tuple[int, int]:
    """The installed Triton's (major, minor)."""
    major, minor = (int("".join(c for c in part if c.isdigit()) or 0) for part in triton.__version__.split(".")[:2])
    return major, minor


def table(name: str) -> dict:
    """Family ``name``'s tables for the installed Triton (``NEWER_TRITON_TABLES`` after
    ``MEASURED_TRITON``)."""
    if triton_version() > MEASURED_TRITON and name in NEWER_TRITON_TABLES:
        return NEWER_TRITON_TABLES[name]
    return FAMILY_TABLES[name]


def family(where) -> str:
    """The configuration family of ``where``: a ``torch.device`` (``device.family``), a family name
    (``device.FAMILIES``) or None (sm_90's tables, the measured ones)."""
    if isinstance(where, str):
        if where not in FAMILY_TABLES:
            raise ValueError(f"unknown configuration family {where!r}; known: {sorted(FAMILY_TABLES)}")
        return where
    return device.family(where)


def family_tiles(role: str, dtype: torch.dtype, h: int | None, name: str) -> TileConfig:
    """The GPU tiles of ``role`` in family ``name``'s table (``tiles`` without the interpreter's)."""
    if dtype == torch.float32:
        return _GPU_SWEEP_FP32
    for h_max, attr in table(name)["tuned"][role]:
        if h_max is None or (h is not None and h <= h_max):
            return globals()[attr]
    raise AssertionError(f"no bucket of {role!r} takes h={h}")  # the last bucket is open-ended


def tiles(role: str, dtype: torch.dtype, h: int | None = None, *, where=None) -> TileConfig:
    """The tuned tiles of one logit kernel (``role``: "sweep" the forward's vocabulary sweep,
    "chunked" the chunked path's sweep and its in-place gradient kernel, "dlogits" the recompute
    backward's) for hidden size ``h`` (None: the largest bucket) on ``where``'s family (``family``;
    None: sm_90). The interpreter and fp32 have one configuration each."""
    if device.interpreted():
        return _CPU_SWEEP
    return family_tiles(role, dtype, h, family(where))


def candidates(role: str, dtype: torch.dtype, h: int | None = None, *, where=None) -> tuple[TileConfig, ...]:
    """What opt-in autotuning (``autotune``) times for ``role``: the tuned tiles first, then their
    neighbours (variants measured on the H200; a candidate that does not fit a GPU's shared
    memory is skipped there). fp32 keeps its one configuration; the interpreter gets three (narrower
    and taller tiles), so that CPU tests exercise the choice."""
    base = tiles(role, dtype, h, where=where)
    if device.interpreted():
        return (base, replace(base, block_v=base.block_v // 2), replace(base, block_n=2 * base.block_n))
    if dtype == torch.float32:
        return (base,)
    square = dict(block_n=128, block_v=128, num_warps=4, num_stages=3, resident=1)
    wide = dict(block_n=128, block_v=256, num_warps=8, num_stages=3, resident=1)
    variants = {
        "sweep": (dict(num_stages=4), dict(block_n=256, block_v=128), dict(square, resident=2),
                  dict(block_n=64, num_warps=4)),
        "chunked": (dict(square), dict(wide), dict(square, num_stages=4), dict(block_n=256, block_v=128, num_warps=8),
                    dict(group_m=32)),
        "dlogits": (dict(num_stages=4), dict(square), dict(block_v=128)),
    }[role]
    out = [base]
    for change in variants:
        cfg = replace(base, **change)
        if cfg not in out:
            out.append(cfg)
    return tuple(out)


def chunked_epilogue(cfg: TileConfig, softcap: bool, bias: bool) -> TileConfig:
    """The chunked sweep's tiles for a call with both a softcap and a bias: its epilogue keeps the bias
    tile and the softcap's tanh derivative live beside the logits, so 128 x 256 tiles with two
    warpgroups spill 808 B a thread (sm_90, Triton 3.6, ``scripts/registers.py``); 128 x 128 with the
    same warps spill none. Other calls keep ``cfg``. Not timed: the pairing is rare (Gemma-2's softcap
    comes without a bias)."""
    if softcap and bias and cfg.block_v > 128:
        return replace(cfg, block_v=128)
    return cfg


def sweep_config(dtype: torch.dtype, *, chunked: bool = False, h: int | None = None, where=None) -> TileConfig:
    """The sweep's tiles; ``chunked``: the chunked path's (its in-place gradient kernel uses the
    same tiles, one tile max per row of each). ``h``: the hidden size (``tiles``)."""
    return tiles("chunked" if chunked else "sweep", dtype, h, where=where)


def dlogits_config(dtype: torch.dtype, *, h: int | None = None, where=None) -> TileConfig:
    """The recompute backward's tiles: its dlogits kernel's, and the granularity of its plan's blocks
    (``plan_passes``) and bias partial sums."""
    return tiles("dlogits", dtype, h, where=where)


MATMUL_ROLES = ("product", "paired_rows", "compensated")


def family_matmul(dtype: torch.dtype, role: str, name: str) -> MatmulConfig:
    """The GPU matmul config of ``role`` in family ``name``'s table (``matmul_config`` without the
    interpreter's)."""
    if role not in MATMUL_ROLES:
        raise ValueError(f"unknown matmul role {role!r}; known: {MATMUL_ROLES}")
    if dtype == torch.float32:
        return _GPU_MATMUL_FP32
    tables = table(name)
    return globals()[tables.get(role, tables["matmul"])]


def matmul_config(dtype: torch.dtype, *, role: str = "product", where=None) -> MatmulConfig:
    """The Triton matmul's config for ``dtype`` on ``where``'s family (``family``; None: sm_90).
    ``role="paired_rows"``: the recompute path's paired plan's grad_hidden product
    (``BackwardPlan.paired``: all N rows by one vocabulary block into the bf16 + int8 pair), which has
    its own 16-bit config; ``role="compensated"``: any other sum into a compensated pair (the
    ``product`` config unless the family's table names its own)."""
    if device.interpreted():
        return _CPU_MATMUL
    return family_matmul(dtype, role, family(where))


# The divergence's row kernel on a GPU (``divergence_kernel.py``): one row a program, its vocabulary
# in blocks of BLOCK_V classes with num_warps warps, by the programs each SM gets
# (``divergence_row_config``): (most programs an SM, BLOCK_V, warps), the first that takes them.
# H200, bf16, the row kernel with da at D1 / D2 in chunks of 256, 432 / 512 and 8192 rows
# (``benchmarks/experiments/experiment_distill_rows.py``): few rows a chunk leave each SM one or two
# long programs, and larger blocks keep more bytes in flight (D1 beta = 1, ms for all N rows: 256
# rows 14.0 with 1024 / 4 against 7.0 with 4096 / 16; 432 rows 9.4 against 7.1 with 2048 / 8; all
# rows 5.6 with 1024 / 4 against 5.4 / 6.2, and at beta = 0.5 8.9 against 9.4 / 11.1).
DIVERGENCE_ROW_LAUNCHES = ((2, 4096, 16), (8, 2048, 8), (None, 1024, 4))


def transposed_store_tma(where) -> bool:
    """Whether the chunked sweep stores a class-major buffer's transposed tiles through a TMA
    descriptor on ``where``'s family (``family``), else through pointers."""
    return table(family(where)).get("transposed_store_tma", True)


def divergence_launches(name: str) -> tuple:
    """Family ``name``'s row-kernel launches (``DIVERGENCE_ROW_LAUNCHES`` unless its table names its own)."""
    return globals()[table(name).get("divergence_rows", "DIVERGENCE_ROW_LAUNCHES")]


def divergence_row_config(r: int, v: int, where: torch.device) -> tuple[int, int, int]:
    """The divergence row kernel's (BLOCK_N, BLOCK_V, num_warps) for a chunk of ``r`` rows: on a GPU
    one row a program (``DIVERGENCE_ROW_LAUNCHES``); on the interpreter, whose cost is per operation,
    up to 32 rows of 256 classes (still several blocks a row, and of rows, at the tests' sizes), one
    warp."""
    if device.interpreted():
        return min(32, triton.next_power_of_2(r)), min(256, triton.next_power_of_2(v)), 1
    per_sm = r / device.sm_count(where)
    for most, block_v, warps in divergence_launches(family(where)):
        if most is None or per_sm <= most:
            return 1, min(block_v, triton.next_power_of_2(v)), warps
    raise AssertionError("DIVERGENCE_ROW_LAUNCHES ends open")
