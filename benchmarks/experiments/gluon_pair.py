"""Experiment (not shipped): the compensated pair's product on Hopper as a ping-pong kernel (Gluon),
so that one tile's read, add and write of the pair runs while the other consumer's products use the
tensor cores. NOTES v25 and ``experiment_pair_pingpong.py`` (which runs it) say what it measured: its
pair holds ``gemm.matmul_kernel``'s bits, its product loop alone beats cuBLAS, and with the pair's
epilogue it is slower than ``matmul_kernel`` at both of the pair's uses at long context.

``products.compensated`` sums a product into a pair, hi (16-bit) and lo (an int8 or bf16 remainder):
s = (a @ b) [* unscale] (+ hi + lo), then hi = s rounded and lo = the rest. One program here (BLOCK_M
rows of the output x a range of its column tiles) has, as the per-token sweep of ``pingpong.py``,
three partitions sharing its shared memory: a loader warp streaming the (a, b) K-steps of every tile
through a ring of STAGES buffers (TMA), and two consumer warpgroups taking the tiles in turn (a
``turn`` mbarrier pair orders their product loops), each running its tile's products (asynchronous
wgmma) and then the pair's epilogue on the tile's four 64-column quarters in turn: the old pair in
through TMA into the consumer's shared buffers, the arithmetic of ``pairs.pair_value`` /
``pair_of`` element for element, the new pair out through TMA. ``a`` is read through a descriptor
over its own storage or over its transpose's (da^T: da's (K, M) blocks, transposed in shared memory);
``b`` row-major, or through its transpose's storage with ``b_transposed``. ``mainloop_only`` skips the
epilogue (the products alone, for the experiment's measure).
"""

from dataclasses import dataclass

import torch
import triton

from fused_linear_ce import device, pingpong

HAVE_GLUON = pingpong.HAVE_GLUON
if HAVE_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                                    warpgroup_mma_wait)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonDescriptor
    from triton.language.core import _aggregate as aggregate


def _a_transposed(a: torch.Tensor):
    """False when ``a``'s storage takes a TMA descriptor, True when its transpose's does, else None."""
    if device.tma_layout(a):
        return False
    return True if device.tma_layout(a.t()) else None


@dataclass(frozen=True)
class PairPingpongConfig:
    """Each consumer warpgroup's tile is block_m x block_p of the output, block_k the K-step of the
    ring's ``stages`` buffers; a program takes ``tiles_per_program`` column tiles of one row block."""

    block_m: int = 64
    block_p: int = 256
    block_k: int = 64
    stages: int = 4
    tiles_per_program: int = 8
    consumer_regs: int = 232
    loader_regs: int = 40


CONFIG = PairPingpongConfig()


def launch(a: torch.Tensor, b: torch.Tensor, hi: torch.Tensor, lo: torch.Tensor, accumulate: bool, unscale=None,
           b_transposed: bool = False, mainloop_only: bool = False, cfg: PairPingpongConfig = CONFIG) -> None:
    """(hi, lo) = the pair of (a @ b) [* unscale] (+ hi + lo when ``accumulate``), as
    ``products.compensated``: 16-bit a and b whose layouts (or a's transpose's) take TMA descriptors,
    a contiguous pair whose rows do too, compute capability 9.0."""
    m, k = a.shape
    p = b.shape[1]
    if m == 0 or p == 0:
        return
    gdt = gl.bfloat16 if a.dtype == torch.bfloat16 else gl.float16
    a_t = _a_transposed(a)
    a_block = [cfg.block_k, cfg.block_m] if a_t else [cfg.block_m, cfg.block_k]
    a_desc = GluonDescriptor.from_tensor(a.t() if a_t else a, a_block,
                                         gl.NVMMASharedLayout.get_default_for(a_block, gdt))
    b_t = b_transposed
    b_block = [cfg.block_p, cfg.block_k] if b_t else [cfg.block_k, cfg.block_p]
    b_desc = GluonDescriptor.from_tensor(b.t() if b_t else b, b_block, gl.NVMMASharedLayout.get_default_for(b_block, gdt))
    pair_block = [cfg.block_m, cfg.block_p // 4]
    hdt = gl.bfloat16 if hi.dtype == torch.bfloat16 else gl.float16
    ldt = gl.int8 if lo.dtype == torch.int8 else gl.bfloat16
    hi_desc = GluonDescriptor.from_tensor(hi, pair_block, gl.NVMMASharedLayout.get_default_for(pair_block, hdt))
    lo_desc = GluonDescriptor.from_tensor(lo, pair_block, gl.NVMMASharedLayout.get_default_for(pair_block, ldt))
    n_blocks, n_tiles = triton.cdiv(m, cfg.block_m), triton.cdiv(p, cfg.block_p)
    per = min(n_tiles, cfg.tiles_per_program)
    splits = triton.cdiv(n_tiles, per)
    pair_pingpong_kernel[(n_blocks * splits,)](
        a_desc, b_desc, hi_desc, lo_desc, unscale if unscale is not None else hi, m, p, k, per, splits,
        ACCUMULATE=accumulate, HAS_SCALE=unscale is not None, A_T=a_t, B_T=b_t, MAINLOOP_ONLY=mainloop_only,
        STAGES=cfg.stages,
        CONSUMER_REGS=cfg.consumer_regs, LOADER_REGS=cfg.loader_regs, num_warps=4,
    )


if HAVE_GLUON:

    @aggregate
    class _Program:
        """What the three partitions of one program share."""

        a_desc: tma.tensor_descriptor
        b_desc: tma.tensor_descriptor
        a_bufs: gl.shared_memory_descriptor
        b_bufs: gl.shared_memory_descriptor
        ready: gl.shared_memory_descriptor
        empty: gl.shared_memory_descriptor
        turn: gl.shared_memory_descriptor
        hi_desc: tma.tensor_descriptor
        lo_desc: tma.tensor_descriptor
        hi_bufs: gl.shared_memory_descriptor
        lo_bufs: gl.shared_memory_descriptor
        pair_bar: gl.shared_memory_descriptor
        scale_ptr: gl.tensor
        M: gl.tensor
        P: gl.tensor
        k_steps: gl.tensor
        row0: gl.tensor
        first: gl.tensor
        count: gl.tensor
        ACCUMULATE: gl.constexpr
        HAS_SCALE: gl.constexpr
        A_T: gl.constexpr
        B_T: gl.constexpr
        MAINLOOP_ONLY: gl.constexpr

        @gluon.constexpr_function
        def __init__(self, a_desc, b_desc, a_bufs, b_bufs, ready, empty, turn, hi_desc, lo_desc, hi_bufs, lo_bufs,
                     pair_bar, scale_ptr, M, P, k_steps, row0, first, count, ACCUMULATE, HAS_SCALE, A_T, B_T,
                     MAINLOOP_ONLY):
            self.a_desc = a_desc
            self.b_desc = b_desc
            self.a_bufs = a_bufs
            self.b_bufs = b_bufs
            self.ready = ready
            self.empty = empty
            self.turn = turn
            self.hi_desc = hi_desc
            self.lo_desc = lo_desc
            self.hi_bufs = hi_bufs
            self.lo_bufs = lo_bufs
            self.pair_bar = pair_bar
            self.scale_ptr = scale_ptr
            self.M = M
            self.P = P
            self.k_steps = k_steps
            self.row0 = row0
            self.first = first
            self.count = count
            self.ACCUMULATE = gl.constexpr(ACCUMULATE)
            self.HAS_SCALE = gl.constexpr(HAS_SCALE)
            self.A_T = gl.constexpr(A_T)
            self.B_T = gl.constexpr(B_T)
            self.MAINLOOP_ONLY = gl.constexpr(MAINLOOP_ONLY)

    @gluon.jit
    def _loader(p):
        """Every K-step of every tile of the program, in order, into the ring (1 warp)."""
        BLOCK_K: gl.constexpr = p.b_desc.block_type.shape[1] if p.B_T else p.b_desc.block_type.shape[0]
        BLOCK_P: gl.constexpr = p.b_desc.block_type.shape[0] if p.B_T else p.b_desc.block_type.shape[1]
        STAGES: gl.constexpr = p.a_bufs.shape[0]
        nbytes: gl.constexpr = p.a_desc.block_type.nbytes + p.b_desc.block_type.nbytes
        for i in range(p.count):
            col0 = (p.first + i) * BLOCK_P
            for kk in range(p.k_steps):
                step = i * p.k_steps + kk
                s = step % STAGES
                mbarrier.wait(p.empty.index(s), ((step // STAGES) & 1) ^ 1)  # fresh barriers pass phase 1
                mbarrier.expect(p.ready.index(s), nbytes)
                if p.A_T:  # a^T's (K, M) block
                    tma.async_copy_global_to_shared(p.a_desc, [kk * BLOCK_K, p.row0], p.ready.index(s),
                                                    p.a_bufs.index(s))
                else:
                    tma.async_copy_global_to_shared(p.a_desc, [p.row0, kk * BLOCK_K], p.ready.index(s),
                                                    p.a_bufs.index(s))
                if p.B_T:  # b^T's (P, K) block
                    tma.async_copy_global_to_shared(p.b_desc, [col0, kk * BLOCK_K], p.ready.index(s),
                                                    p.b_bufs.index(s))
                else:
                    tma.async_copy_global_to_shared(p.b_desc, [kk * BLOCK_K, col0], p.ready.index(s),
                                                    p.b_bufs.index(s))

    @gluon.jit
    def _pair_step(hi):
        """v25's ``products.pair_step`` (replaced by v26's bit-pattern remainder, NOTES v26; this
        experiment keeps v25's encoding): the unit of an int8 remainder of a bf16 hi, 2^(e - 15)."""
        bits = hi.to(gl.float32).to(gl.int32, bitcast=True)
        exponent = gl.maximum((bits >> 23) & 0xFF, 16)
        return ((exponent - 15) << 23).to(gl.float32, bitcast=True)

    @gluon.jit
    def _pair_part(p, acc, C: gl.constexpr, phase, row0, col0):
        """The pair's epilogue on one (BLOCK_M, BLOCK_P // 4) part at (row0, col0), through consumer C's
        shared buffers and TMA (the old pair in, the new one out; nothing past the edges written): the
        arithmetic of ``pairs.pair_value`` and ``pair_of``, element for element."""
        layout: gl.constexpr = acc.type.layout
        hi_buf = p.hi_bufs.index(C)
        lo_buf = p.lo_bufs.index(C)
        bar = p.pair_bar.index(C)
        hi_dtype: gl.constexpr = p.hi_desc.dtype
        lo_dtype: gl.constexpr = p.lo_desc.dtype
        s = acc
        if p.ACCUMULATE:  # the old pair's value first (exact in fp32 but under 2^-24 of hi), then the product
            mbarrier.expect(bar, p.hi_desc.block_type.nbytes + p.lo_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(p.hi_desc, [row0, col0], bar, hi_buf)
            tma.async_copy_global_to_shared(p.lo_desc, [row0, col0], bar, lo_buf)
            mbarrier.wait(bar, phase)
            old_hi = hi_buf.load(layout)
            old_lo = lo_buf.load(layout)
            if lo_dtype == gl.int8:
                old = old_hi.to(gl.float32) + old_lo.to(gl.float32) * _pair_step(old_hi)
            else:
                old = old_hi.to(gl.float32) + old_lo.to(gl.float32)
            s = old + acc
        hi = s.to(hi_dtype)
        rest = s - hi.to(gl.float32)
        rest = gl.where(gl.abs(rest) <= 3.4028234663852886e38, rest, 0.0)  # hi overflowed, or s inf / NaN
        if lo_dtype == gl.int8:
            lo = gl.minimum(gl.maximum(gl.floor(rest / _pair_step(hi) + 0.5), -127.0), 127.0).to(gl.int8)
        else:
            lo = rest.to(lo_dtype)
        hi_buf.store(hi)
        lo_buf.store(lo)
        fence_async_shared()
        tma.async_copy_shared_to_global(p.hi_desc, [row0, col0], hi_buf)
        tma.async_copy_shared_to_global(p.lo_desc, [row0, col0], lo_buf)
        tma.store_wait(0)  # the buffers are read out before the next part's old pair lands in them

    @gluon.jit
    def _consume(p, C: gl.constexpr):
        """Consumer C's tiles (C, C + 2, ...): products, then the pair's epilogue (4 warps)."""
        BLOCK_M: gl.constexpr = p.a_bufs.shape[2] if p.A_T else p.a_bufs.shape[1]
        BLOCK_P: gl.constexpr = p.b_bufs.shape[1] if p.B_T else p.b_bufs.shape[2]
        STAGES: gl.constexpr = p.a_bufs.shape[0]
        layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, BLOCK_P, 16])
        for j in range((p.count - C + 1) // 2):
            i = 2 * j + C
            # My turn on the tensor cores: the other consumer's products of the tile before are issued
            # and done (consumer 0's first wait passes on the fresh barrier's phase 1).
            mbarrier.wait(p.turn.index(C), (j & 1) ^ (1 - C))
            acc = gl.zeros([BLOCK_M, BLOCK_P], gl.float32, layout)
            prev = 0
            for kk in range(p.k_steps):
                step = i * p.k_steps + kk
                s = step % STAGES
                mbarrier.wait(p.ready.index(s), (step // STAGES) & 1)
                if p.A_T:
                    a = p.a_bufs.index(s).permute((1, 0))
                else:
                    a = p.a_bufs.index(s)
                if p.B_T:
                    b = p.b_bufs.index(s).permute((1, 0))
                else:
                    b = p.b_bufs.index(s)
                acc = warpgroup_mma(a, b, acc, is_async=True)
                acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
                mbarrier.arrive(p.empty.index(prev), pred=kk > 0)  # the step before is read
                prev = s
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            mbarrier.arrive(p.empty.index(prev))
            mbarrier.arrive(p.turn.index(1 - C))

            if not p.MAINLOOP_ONLY:  # (an experiment's measure of the products alone)
                QUARTER: gl.constexpr = BLOCK_P // 4
                if p.HAS_SCALE:
                    acc = acc * gl.load(p.scale_ptr)
                col0 = (p.first + i) * BLOCK_P
                # Four column quarters in turn, each the TMA block of the pair's descriptors (64 columns:
                # 128 bytes of bf16, the widest swizzled block).
                halves = acc.reshape([BLOCK_M, 2, BLOCK_P // 2]).permute((0, 2, 1)).split()
                for h in gl.static_range(2):
                    quarters = halves[h].reshape([BLOCK_M, 2, BLOCK_P // 4]).permute((0, 2, 1)).split()
                    for q in gl.static_range(2):
                        _pair_part(p, quarters[q], C, (j * 4 + 2 * h + q) & 1, p.row0, col0 + (2 * h + q) * QUARTER)

    @gluon.jit
    def _consumer0(p):
        _consume(p, 0)

    @gluon.jit
    def _consumer1(p):
        _consume(p, 1)

    @gluon.jit
    def pair_pingpong_kernel(a_desc, b_desc, hi_desc, lo_desc, scale_ptr, M, P, K, tiles_per_program, n_splits, ACCUMULATE: gl.constexpr, HAS_SCALE: gl.constexpr, A_T: gl.constexpr,
                             B_T: gl.constexpr, MAINLOOP_ONLY: gl.constexpr,
                             STAGES: gl.constexpr, CONSUMER_REGS: gl.constexpr, LOADER_REGS: gl.constexpr,
                             num_warps: gl.constexpr):
        """One program: BLOCK_M rows x ``tiles_per_program`` column tiles of the output; a 1-D grid with
        the column ranges fastest (the programs that run together share row blocks of ``a``)."""
        BLOCK_K: gl.constexpr = b_desc.block_type.shape[1] if B_T else b_desc.block_type.shape[0]
        BLOCK_P: gl.constexpr = b_desc.block_type.shape[0] if B_T else b_desc.block_type.shape[1]
        BLOCK_M: gl.constexpr = a_desc.block_type.shape[1] if A_T else a_desc.block_type.shape[0]
        pid_s = gl.program_id(0) % n_splits
        pid_m = gl.program_id(0) // n_splits
        first = pid_s * tiles_per_program
        count = gl.minimum(gl.cdiv(P, BLOCK_P) - first, tiles_per_program)

        a_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES] + a_desc.block_type.shape, a_desc.layout)
        b_bufs = gl.allocate_shared_memory(b_desc.dtype, [STAGES] + b_desc.block_type.shape, b_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        hi_bufs = gl.allocate_shared_memory(hi_desc.dtype, [2] + hi_desc.block_type.shape, hi_desc.layout)
        lo_bufs = gl.allocate_shared_memory(lo_desc.dtype, [2] + lo_desc.block_type.shape, lo_desc.layout)
        pair_bar = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        for s in gl.static_range(STAGES):
            mbarrier.init(ready.index(s), count=1)
            mbarrier.init(empty.index(s), count=1)
        for c in gl.static_range(2):
            mbarrier.init(turn.index(c), count=1)
            mbarrier.init(pair_bar.index(c), count=1)

        # (integer arguments equal to 1 arrive as constexprs; the aggregate's fields are tensors)
        p = _Program(a_desc, b_desc, a_bufs, b_bufs, ready, empty, turn, hi_desc, lo_desc, hi_bufs, lo_bufs, pair_bar,
                     scale_ptr,
                     gl.to_tensor(M), gl.to_tensor(P), gl.to_tensor(gl.cdiv(K, BLOCK_K)),
                     gl.to_tensor(pid_m * BLOCK_M), gl.to_tensor(first), gl.to_tensor(count),
                     ACCUMULATE, HAS_SCALE, A_T, B_T, MAINLOOP_ONLY)
        gl.warp_specialize([
            (_consumer0, (p,)),
            (_consumer1, (p,)),
            (_loader, (p,)),
        ], [4, 1], [CONSUMER_REGS, LOADER_REGS])
