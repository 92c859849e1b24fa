"""Every GPU architecture family the package builds for, one record each (``ARCHS``): its GPUs, how one
is recognised, what a block may use, what the hardware has, and the tiles of every kernel there (per
role, with overlays for Triton releases after the one the tiles were chosen under).

The package reads the records through ``device.py`` (which family a GPU is, what it has) and
``configs.py`` (the tiles a launch takes); ``scripts/registers.py`` compiles every configuration of a
record for its targets (the matrix, tests/kernel/test_arch_matrix.py); ``scripts/sync_build.py`` writes
metadata.json's archs from ``declared``; the README's and docs/gpus.md's GPU tables say what the records
say (tests/kernel/test_arch_docs.py). Adding an architecture is a record here and the matrix run
(docs/gpus.md).

Standard library only: scripts load this file by path, without torch or Triton.
"""

from dataclasses import dataclass, fields, replace

KB = 1024


@dataclass(frozen=True)
class TileConfig:
    """A logit kernel's tiles (the sweeps, the chunked path's gradient kernel, dlogits)."""

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
    """The Triton matmul's tiles (``gemm.matmul``: products with a factor in the epilogue)."""

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


# The divergence's row kernel (``divergence_kernel.py``): one row a program, its vocabulary in blocks
# of BLOCK_V classes with num_warps warps, by the programs each SM gets: (most programs an SM, BLOCK_V,
# warps), the first that takes them. H200, bf16, the row kernel with da at D1 / D2 in chunks of 256,
# 432 / 512 and 8192 rows (``benchmarks/experiments/experiment_distill_rows.py``): few rows a chunk
# leave each SM one or two long programs, and larger blocks keep more bytes in flight (D1 beta = 1, ms
# for all N rows: 256 rows 14.0 with 1024 / 4 against 7.0 with 4096 / 16; 432 rows 9.4 against 7.1
# with 2048 / 8; all rows 5.6 with 1024 / 4 against 5.4 / 6.2, and at beta = 0.5 8.9 against 9.4 / 11.1).
DIVERGENCE_ROW_LAUNCHES = ((2, 4096, 16), (8, 2048, 8), (None, 1024, 4))
# fp32 inputs, one configuration of each kernel: 3 stages of 16 KB; two per SM assumed (not measured:
# fp32 is not a tuned case). Pointer loads: with TMA descriptors the fp32 sweep was slower (H200,
# 2048 x 1024 x 32000, TF32 off: evaluation forward 12.7 ms against 9.9).
FP32_SWEEP = TileConfig(block_n=64, block_v=64, block_h=32, group_m=8, num_warps=4, num_stages=3, resident=2,
                        tma=False)
FP32_MATMUL = MatmulConfig(block_m=64, block_p=64, block_k=32, group_m=8, num_warps=4, num_stages=3, tma=False)

ROLES = ("sweep", "chunked", "dlogits")  # the logit kernels' roles, each a field of ``Tables``
MATMUL_ROLES = ("product", "paired_rows", "compensated")


@dataclass(frozen=True)
class Tables:
    """The tiles of every kernel on one family, for 16-bit inputs unless named fp32.

    The logit kernels' roles (``ROLES``: "sweep" the forward's vocabulary sweep, "chunked" the
    chunked path's sweep and its in-place gradient kernel, "dlogits" the recompute backward's) are
    buckets of the hidden size in ascending H: (largest H of the bucket, or None for the rest, its
    tiles). H is the length of each tile's product loop, against which the softmax epilogue is a
    fixed cost. The matmul's roles (``MATMUL_ROLES``): "product" every product, "paired_rows" the
    recompute path's paired plan's grad_hidden product (all N rows by one vocabulary block into the
    bf16 + int8 pair), "compensated" any other sum into a compensated pair."""

    sweep: tuple
    chunked: tuple
    dlogits: tuple
    product: MatmulConfig
    paired_rows: MatmulConfig
    compensated: MatmulConfig
    sweep_fp32: TileConfig = FP32_SWEEP  # every logit kernel's on fp32 inputs
    matmul_fp32: MatmulConfig = FP32_MATMUL
    divergence_rows: tuple = DIVERGENCE_ROW_LAUNCHES
    pingpong: PingpongConfig | None = None  # the Gluon ping-pong sweep's, where the family runs it
    # The chunked sweep's class-major buffer (hosted in grad_weight) stored through a TMA descriptor
    # (else through pointers), where the family has TMA.
    transposed_store_tma: bool = True

    def each(self, change) -> "Tables":
        """These tables with ``change(cfg)`` for every TileConfig and MatmulConfig in them."""
        def one(value):
            if isinstance(value, (TileConfig, MatmulConfig)):
                return change(value)
            if isinstance(value, tuple) and all(isinstance(b, tuple) and len(b) == 2 for b in value):
                return tuple((h, one(cfg)) for h, cfg in value)  # a role's buckets
            return value

        return replace(self, **{f.name: one(getattr(self, f.name)) for f in fields(self)})


@dataclass(frozen=True)
class Arch:
    """One architecture family: the GPUs that take the same tiles."""

    name: str
    gpus: str  # for the docs' tables
    backend: str  # "cuda" or "rocm": the build variant (build/torch-<backend>) that serves it
    # How a GPU is recognised: CUDA compute capabilities (major, minor), or ROCm gfx names (the
    # device's gcnArchName up to its first ':').
    recognises: tuple
    # What metadata.json's backend.archs declares for it (``kernels`` refuses a GPU it does not name):
    # CUDA capabilities as "major.minor", ROCm gfx names.
    declares: tuple
    shared: int  # bytes of shared memory (LDS on AMD) a block may use, the least of its GPUs'
    wave: int  # threads a warp (a wavefront on AMD); Triton's num_warps counts these
    tma: bool  # TMA tensor descriptors in hardware (else the same kernels with pointer loads)
    mma: str  # the matrix instructions Triton emits for tl.dot: mma.sync, wgmma, tcgen05, mfma, wmma
    tf32: bool  # tl.dot takes input_precision="tf32" (fp32 inputs where torch allows TF32)
    tables: Tables
    # Tables for Triton releases after the one ``tables`` were chosen under: ((major, minor), tables)
    # in ascending version, each taking every release after its version.
    overlays: tuple = ()
    max_warps: int = 32  # warps a block may have (1024 threads)
    # The memory ordering of the fp32 atomic adds (the split-K matmul's partial sums, ``gemm.py``):
    # relaxed on ROCm, where the default acquire-release adds fences around each; the sums need no
    # ordering (the host reads them after the kernel), and CUDA keeps the default its figures have.
    atomic_sem: str = "acq_rel"
    # The declared targets the matrix (tests/kernel/test_arch_matrix.py) compiles, where not all of
    # them: one a family whose parts share one instruction set and register file.
    matrix_only: tuple = ()

    @property
    def matrix(self) -> tuple:
        """The targets the matrix compiles for this family."""
        return self.matrix_only or self.declares

    @property
    def pingpong(self) -> bool:
        """Whether the family runs the Gluon ping-pong sweep (its tables name its tiles)."""
        return self.tables.pingpong is not None

    def tables_for(self, triton: tuple) -> Tables:
        """The tables under Triton ``triton`` (major, minor): the last overlay below it, else ``tables``."""
        chosen = self.tables
        for after, tables in self.overlays:
            if triton > after:
                chosen = tables
        return chosen


def _one(cfg) -> tuple:
    """One bucket for every hidden size."""
    return ((None, cfg),)


# ---- CUDA --------------------------------------------------------------------------------------------
# sm90, the tables measured (H200, Triton 3.6; the measurements are under ``benchmarks/``).
# Sweep: 128 x 256 logit tiles over 64-wide H steps (15.2 ms vs 19.9 ms for 128 x 128 at S1); 3 stages
# of 48 KB of operands: one program per SM. Operands through TMA descriptors (bf16, S1 evaluation
# forward 13.0-13.5 ms against 14.1-14.2 with pointer loads). One bucket: H = 640 to 4096 gave no
# second one that held up side by side.
_SM90_SWEEP = TileConfig(block_n=128, block_v=256, block_h=64, group_m=8, num_warps=8, num_stages=3, resident=1)
# The chunked path's sweep, one tile a program in a 1-D grid grouped by group_m row blocks (a wave
# shares fewer rows and weight tiles): 128 x 256 tiles with two warpgroups, 3 stages (208 KB of
# shared memory with the descriptor store's 64 KB buffer: one program per SM), groups of 16. Its
# gradient kernel keeps 128-column programs (``chunked.gradient_cols``). bf16, the chunked path in one
# chunk, 3 interleaved rounds against torch.compile (benchmarks/results/flat/run2.json, random /
# peaked): S1 0.988x / 1.004x against 1.036x / 1.036x for 128 x 128 tiles with one warpgroup, S2
# 0.993x / 0.993x against 1.031x / 1.007x, S3 1.007x / 0.995x against 1.035x / 1.015x; the sweep
# alone 13.66 / 16.20 / 17.52 ms against 14.55 / 16.91 / 17.83. (With the gradient kernel on the
# sweep's tiles, 128 x 128 tiles measured faster than 256 x 128 ones.)
_SM90_CHUNKED = TileConfig(block_n=128, block_v=256, block_h=64, group_m=16, num_warps=8, num_stages=3)
# Up to H = 1024 the 128 x 128 tiles with one warpgroup (3 stages, 128 KB: one program per SM): at
# H = 896 and 640 (autotuning the whole chunked forward) the 128 x 256 tiles took 14% longer,
# measured with the gradient kernel on the sweep's tiles rather than on its own 128-column programs.
_SM90_CHUNKED_SMALL_H = TileConfig(block_n=128, block_v=128, block_h=64, group_m=16, num_warps=4, num_stages=3)
_SMALL_H = 1024  # the chunked sweep's small-H bucket's largest H
# The recompute backward's dlogits kernel (one tile a program; its tiles also cut the backward plan):
# the sweep's. 128 x 128 tiles with 4 warps (two programs per SM), 4 stages, 128-wide H steps were all
# slower (S1-S3 at 64 MiB: +0.5 to +3.7 ms fwd+bwd).
# The Triton matmul: TMA loads reach cuBLAS's rate where pointer loads took 1.23x (S1 grad_weight
# blocks, M=4096 K=8192 P=4096: 0.38 ms against 0.47, cuBLAS 0.38). The contiguous plain result
# through a descriptor (c_tma): S4's 3840-row chunk, a master weight's fp32 dW sum 7.22 -> 6.79 ms,
# the bf16 dX and S1's dW unchanged (6.06 / 6.04, 12.49 / 12.48 ms); no spills where the pointer
# epilogue spilled 88 bytes (1696 for the fp32 sum). The same tiles with two programs an SM (128 x
# 128, 4 warps) were 1-24% slower on all but the paired plan's dX (2.28 against 2.37 ms;
# benchmarks/results/matmul/). The pair's epilogue on column halves (split_pair): no spills with an
# int8 remainder (104 bytes whole); S4 chunk's grad_weight into the pair 7.37 ms against 7.44 (cuBLAS
# into bf16 6.01).
_SM90_MATMUL = MatmulConfig(block_m=128, block_p=256, block_k=64, group_m=8, num_warps=8, num_stages=3, c_tma=True,
                            split_pair=True)
# The paired plan's grad_hidden product (N x block columns x H into the bf16 + int8 pair: a K loop of
# only the block's columns, then 3 + 3 bytes an element of epilogue): 128 x 128 tiles, two programs
# an SM, so that one's epilogue runs beside the other's products; 8 warps once the epilogue is split.
# S4's 2048-column block: 2.16 ms, against 2.22 with 4 warps unsplit and 2.40 for the shared config
# (cuBLAS into bf16 1.64; benchmarks/results/matmul/run3.json).
_SM90_PAIRED_ROWS = MatmulConfig(block_m=128, block_p=128, block_k=64, group_m=8, num_warps=8, num_stages=3,
                                 c_tma=True, split_pair=True)
# The per-token sweep of log-probs alone as a ping-pong kernel (``pingpong.py``), for H up to max_h.
# bf16, that forward side by side with the Triton sweep (``benchmarks/results/gluon/``): 16384 x 1024
# x 151936 -12%, S3 (H = 2048) -16%, S2 (H = 2304) -4.5% (one round of two within the other's spread),
# S1 (H = 4096) +6%: with a long K loop the Triton sweep's epilogue is a small share and the 64 x 256
# consumer tiles' products are slower than its 128 x 256 ones. 128 x 128 consumer tiles, 3-8 stages,
# 128-deep K steps and 2-4 vocabulary splits were slower at S1-S3.
_SM90_PINGPONG = PingpongConfig(max_h=2048)
_SM90 = Tables(sweep=_one(_SM90_SWEEP), chunked=((_SMALL_H, _SM90_CHUNKED_SMALL_H), (None, _SM90_CHUNKED)),
               dlogits=_one(_SM90_SWEEP), product=_SM90_MATMUL, paired_rows=_SM90_PAIRED_ROWS,
               compensated=_SM90_MATMUL, pingpong=_SM90_PINGPONG)
# Triton after 3.6 compiles some of them with more spills (offline, Triton 3.9.0 for sm_90: the
# chunked sweep 424 bytes, 960 with a softcap and a bias; the per-token sweep 464): there sm_90 takes
# 128 x 128 tiles with 8 warps for both sweeps (0 and 8 bytes under 3.9), not timed.
_SQUARE = TileConfig(block_n=128, block_v=128, block_h=64, group_m=8, num_warps=8, num_stages=3)
_SM90_NEWER_TRITON = replace(_SM90, sweep=_one(_SQUARE),
                             chunked=((_SMALL_H, _SM90_CHUNKED_SMALL_H), (None, replace(_SQUARE, group_m=16))))

# The other CUDA families' tables, chosen offline by compiling every configuration the package
# launches for that target under Triton 3.6 and 3.9 (``scripts/registers.py --arch``, held by
# tests/kernel/test_arch_matrix.py): each fits the family's per-block shared memory and spills at
# most 256 bytes a thread. Not timed on those GPUs (none was at hand): ``autotune`` tunes for the
# exact shape there, and benchmarks/NOTES.md has the compile figures.
# Below sm_90 there is no TMA: pointer loads, mma.sync, and an epilogue whose 2-D tiles of pointers
# cost registers the descriptors did not. sm80 (A100: 163 KB a block) and sm86 (99 KB): 128 x 128
# logit tiles with 8 warps, 3 stages (128 x 256 spill 0.9 KB with pointer loads; 4 stages 264 bytes
# under Triton 3.9 with every per-token field); the chunked sweep 128 x 64 with 8 warps (128 x 128
# spilled 320 bytes with the metrics, 64 x 256 360, 128 x 64 with 4 warps 416 on sm_86 under 3.9);
# every product 128 x 128 with 8 warps (the pair's pointer epilogue at 128 x 256 spilled 3.3 KB, 48
# bytes here).
_SM80_MATMUL = MatmulConfig(block_m=128, block_p=128, block_k=64, group_m=8, num_warps=8, num_stages=3)
_SM80 = Tables(sweep=_one(_SQUARE), chunked=_one(replace(_SQUARE, block_v=64, group_m=16)), dlogits=_one(_SQUARE),
               product=_SM80_MATMUL, paired_rows=_SM80_MATMUL, compensated=_SM80_MATMUL)
# sm80 after Triton 3.6: the sweep with every per-token field spills 272 bytes at 128 x 128 under 3.8
# (256 under 3.9), 128 x 64 with 8 warps none under 3.6, 3.8 and 3.9 (the sweep's other uses none
# either); not timed. sm86 keeps its tables (176 bytes under 3.8).
_SM80_NEWER_TRITON = replace(_SM80, sweep=_one(replace(_SQUARE, block_v=64)))
# sm100 (227 KB, TMA, tcgen05): sm90's tables but for both sweeps, 128 x 128 with 8 warps (sm90's
# 128 x 256 spill 1.1 KB in the chunked sweep with a softcap and a bias; under Triton 3.9 0.6-2 KB in
# the sweep with the metrics), and the sums into a pair, 128 x 128 (0.5-0.6 KB at 128 x 256). Its
# class-major buffer (hosted in grad_weight) is stored through pointers: the transposed tile through a
# descriptor fails to compile there at every tile tried (Triton 3.6's TMEM layout pass,
# ``PassManager::run failed``); by pointers 0 bytes of stack.
_SM100 = replace(_SM90, sweep=_one(_SQUARE), chunked=_one(replace(_SQUARE, group_m=16)), compensated=_SM90_PAIRED_ROWS,
                 pingpong=None, transposed_store_tma=False)
# sm100 after Triton 3.6: the dlogits kernel with the bias gradient spills 304 bytes at sm90's 128 x 256
# under 3.7.1; 128 x 128 with 8 warps none under 3.7.1 and 3.8, 0-8 bytes under 3.9; not timed.
_SM100_NEWER_TRITON = replace(_SM100, dlogits=_one(_SQUARE))
# sm120 (99 KB a block, TMA, mma.sync): 128 x 128 tiles with 8 warps everywhere (sm90's chunked sweep
# needs 160 KB, its fp32 sums 128 KB).
_SM120_MATMUL = replace(_SM80_MATMUL, c_tma=True, split_pair=True)
_SM120 = Tables(sweep=_one(_SQUARE), chunked=_one(replace(_SQUARE, group_m=16)), dlogits=_one(_SQUARE),
                product=_SM120_MATMUL, paired_rows=_SM120_MATMUL, compensated=_SM120_MATMUL)

# ---- ROCm --------------------------------------------------------------------------------------------
# No TMA (tensor descriptors lower to pointer loads there) and no Gluon ping-pong: the kernels with
# pointer loads, as below sm_90. Chosen offline with Triton's AMD backend (``scripts/registers.py
# --arch gfx942``; docs/gpus.md has the figures): under Triton 3.6 and 3.9 every configuration
# compiles, fits the workgroup's LDS and spills nothing to scratch. Not run on AMD hardware: ``autotune`` tunes
# for the exact shape.
# 2 stages, the AMD backend's usual software pipelining for one product with an epilogue (3 stages
# take the sweep's whole 64 KB of LDS with 128 x 128 tiles).
_AMD_STAGES = 2
# CDNA (a wave of 64, MFMA, 512 VGPRs and AGPRs a lane): sm86's tiles, none spills on gfx90a, gfx942 or
# gfx950 (the sweep with every per-token field 215 VGPRs on gfx942).
_CDNA_SQUARE = replace(_SQUARE, num_stages=_AMD_STAGES, tma=False)
_CDNA_MATMUL = replace(_SM80_MATMUL, num_stages=_AMD_STAGES, tma=False)
_CDNA = Tables(sweep=_one(_CDNA_SQUARE), chunked=_one(replace(_CDNA_SQUARE, block_v=64, group_m=16)),
               dlogits=_one(_CDNA_SQUARE), product=_CDNA_MATMUL, paired_rows=_CDNA_MATMUL, compensated=_CDNA_MATMUL,
               sweep_fp32=replace(FP32_SWEEP, num_stages=_AMD_STAGES),
               matmul_fp32=replace(FP32_MATMUL, num_stages=_AMD_STAGES))
# RDNA (a wave of 32, WMMA, 256 VGPRs a lane, no AGPRs): sm86's 128 x 128 logit tiles with 8 waves
# spill up to 416 bytes a lane (the sweep with every per-token field, gfx1100; 384 on gfx1201), with
# 16 waves 8 bytes (the sweep's metrics). 64 x 128 tiles with 8 waves spill none (the sweep and
# dlogits, up to 256 VGPRs); the chunked sweep 128 x 64 with 16 waves (197 VGPRs); the products
# 128 x 128 with 16 waves (with 8 the sums into a pair spilled 20-40 bytes). The fp32 sweeps (FMA
# dots) 32 x 64 tiles with 16 waves (64 x 64 with 4 waves spilled 340-444 bytes; 32 x 64 with 4 none
# under Triton 3.6, 132-176 bytes under 3.9), the fp32 products 32 x 64 with 4 waves.
_RDNA_SWEEP = TileConfig(block_n=64, block_v=128, block_h=64, group_m=8, num_warps=8, num_stages=_AMD_STAGES, tma=False)
_RDNA_MATMUL = replace(_CDNA_MATMUL, num_warps=16)
_RDNA = Tables(sweep=_one(_RDNA_SWEEP), chunked=_one(replace(_CDNA_SQUARE, block_v=64, group_m=16, num_warps=16)),
               dlogits=_one(_RDNA_SWEEP), product=_RDNA_MATMUL, paired_rows=_RDNA_MATMUL, compensated=_RDNA_MATMUL,
               sweep_fp32=replace(FP32_SWEEP, block_n=32, num_warps=16, num_stages=_AMD_STAGES),
               matmul_fp32=replace(FP32_MATMUL, block_m=32, num_stages=_AMD_STAGES))

_CUDA_FACTS = dict(backend="cuda", wave=32, tf32=True)
_CDNA_FACTS = dict(backend="rocm", wave=64, tma=False, mma="mfma", max_warps=16, atomic_sem="relaxed")
_RDNA_FACTS = dict(backend="rocm", wave=32, tma=False, mma="wmma", tf32=False, shared=64 * KB, atomic_sem="relaxed")

ARCHS = (
    Arch("sm80", "A100, A800", recognises=((8, 0), (8, 7)), declares=("8.0",), shared=163 * KB,
         tma=False, mma="mma.sync", tables=_SM80, overlays=(((3, 6), _SM80_NEWER_TRITON),), **_CUDA_FACTS),
    Arch("sm86", "A10G, A40, RTX 3090, L4, L40S, RTX 4090", recognises=((8, 6), (8, 9)), declares=("8.6", "8.9"),
         shared=99 * KB, tma=False, mma="mma.sync", tables=_SM80, **_CUDA_FACTS),
    Arch("sm90", "H100, H200", recognises=((9, 0),), declares=("9.0",), shared=227 * KB, tma=True, mma="wgmma",
         tables=_SM90, overlays=(((3, 6), _SM90_NEWER_TRITON),), **_CUDA_FACTS),
    Arch("sm100", "B200, GB200, B300", recognises=((10, 0), (10, 3), (11, 0)),
         declares=("10.0", "10.3"), shared=227 * KB, tma=True, mma="tcgen05", tables=_SM100,
         overlays=(((3, 6), _SM100_NEWER_TRITON),), **_CUDA_FACTS),
    Arch("sm120", "RTX 5090, RTX PRO 6000", recognises=((12, 0), (12, 1)), declares=("12.0",), shared=99 * KB,
         tma=True, mma="mma.sync", tables=_SM120, **_CUDA_FACTS),
    Arch("cdna2", "MI210, MI250, MI250X", recognises=("gfx90a",), declares=("gfx90a",), shared=64 * KB, tf32=False,
         tables=_CDNA, **_CDNA_FACTS),
    Arch("cdna3", "MI300X, MI300A, MI325X", recognises=("gfx942",), declares=("gfx942",), shared=64 * KB, tf32=True,
         tables=_CDNA, **_CDNA_FACTS),
    Arch("cdna4", "MI350X, MI355X", recognises=("gfx950",), declares=("gfx950",), shared=160 * KB, tf32=False,
         tables=_CDNA, **_CDNA_FACTS),
    Arch("rdna3", "RX 7900 XTX / XT, Radeon PRO W7900 / W7800", recognises=("gfx1100", "gfx1101"),
         declares=("gfx1100", "gfx1101"), matrix_only=("gfx1100",), tables=_RDNA, **_RDNA_FACTS),
    Arch("rdna4", "RX 9070 (XT), Radeon AI PRO R9700", recognises=("gfx1200", "gfx1201"),
         declares=("gfx1200", "gfx1201"), matrix_only=("gfx1201",), tables=_RDNA, **_RDNA_FACTS),
)
BY_NAME = {arch.name: arch for arch in ARCHS}
BACKENDS = ("cuda", "rocm")


def get(name: str) -> Arch:
    """The record of family ``name``; a ValueError naming the known ones otherwise."""
    if name not in BY_NAME:
        raise ValueError(f"unknown architecture family {name!r}; known: {sorted(BY_NAME)}")
    return BY_NAME[name]


def of_backend(backend: str) -> tuple:
    """The records of ``backend`` ("cuda" or "rocm"), in ``ARCHS``'s order."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; known: {BACKENDS}")
    return tuple(arch for arch in ARCHS if arch.backend == backend)


def declared(backend: str) -> list:
    """metadata.json's backend.archs for ``backend``'s build: every record's ``declares`` in ``ARCHS``'s
    order (CUDA "8.0" ... "12.0"; ROCm "gfx90a" ... "gfx1201")."""
    return [target for arch in of_backend(backend) for target in arch.declares]


def declaring(target: str) -> Arch:
    """The record that declares ``target`` (a CUDA "major.minor" or a gfx name)."""
    for arch in ARCHS:
        if target in arch.declares:
            return arch
    raise ValueError(f"no architecture family declares {target!r}; declared: {declared('cuda') + declared('rocm')}")
