"""Experiment (not shipped): the second form of ``gluon_pair.py``'s ping-pong product into a compensated
pair, with the old pair prefetched. NOTES v25 says what it measured: the whole S4 steps 5-6% slower
than with ``gemm.matmul_kernel``'s pair, and with a bf16 remainder its buffers do not fit Hopper's
shared memory (254 KB of 227); with an int8 remainder its pair held the Triton kernel's bits in the
GPU tests that ran (``results/gluon_pair/run4_prefetch.log``).

One program (BLOCK_M rows of the output x a range of its column tiles) has three partitions sharing
its shared memory:

- a loader warp: for each tile, first the old pair of the tile into its consumer's pair buffers (one
  TMA block per 64-column quarter, hi and lo; once that consumer has stored the pair of its tile
  before), then the tile's (a, b) K-steps through a ring of STAGES (3) buffers;
- two consumer warpgroups taking the tiles in turn (a ``turn`` mbarrier pair orders their product
  loops): each runs its tile's products (asynchronous wgmma), then the epilogue on the four quarters
  in turn, reading the old pair from its buffers (there since the tile's products began), writing the
  new pair back into them (the arithmetic of ``pairs.pair_value`` / ``pair_of``, element for
  element) and out through TMA.
"""

import dataclasses

import torch
import triton

from gluon_pair import HAVE_GLUON, PairPingpongConfig, _a_transposed

if HAVE_GLUON:
    from gluon_pair import _pair_step
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                                    warpgroup_mma_wait)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonDescriptor
    from triton.language.core import _aggregate as aggregate

# gluon_pair's tiles with 3 ring stages: each consumer's whole tile of the pair (48 KB with an int8
# remainder) sits beside them.
CONFIG = dataclasses.replace(PairPingpongConfig(), stages=3)


def launch(a: torch.Tensor, b: torch.Tensor, hi: torch.Tensor, lo: torch.Tensor, accumulate: bool, unscale=None,
           cfg: PairPingpongConfig = CONFIG) -> None:
    """(hi, lo) = the pair of (a @ b) [* unscale] (+ hi + lo when ``accumulate``), as
    ``products.compensated``: 16-bit a and b whose layouts (or a's transpose's) take TMA descriptors,
    a contiguous pair whose rows do too (an int8 lo: a bf16 one does not fit), compute capability 9.0."""
    m, k = a.shape
    p = b.shape[1]
    if m == 0 or p == 0:
        return
    gdt = gl.bfloat16 if a.dtype == torch.bfloat16 else gl.float16
    a_t = _a_transposed(a)
    a_block = [cfg.block_k, cfg.block_m] if a_t else [cfg.block_m, cfg.block_k]
    a_desc = GluonDescriptor.from_tensor(a.t() if a_t else a, a_block,
                                         gl.NVMMASharedLayout.get_default_for(a_block, gdt))
    b_block = [cfg.block_k, cfg.block_p]
    b_desc = GluonDescriptor.from_tensor(b, b_block, gl.NVMMASharedLayout.get_default_for(b_block, gdt))
    pair_block = [cfg.block_m, cfg.block_p // 4]  # 64 columns: 128 bytes of bf16, the widest swizzled block
    hdt = gl.bfloat16 if hi.dtype == torch.bfloat16 else gl.float16
    ldt = gl.int8 if lo.dtype == torch.int8 else gl.bfloat16
    hi_desc = GluonDescriptor.from_tensor(hi, pair_block, gl.NVMMASharedLayout.get_default_for(pair_block, hdt))
    lo_desc = GluonDescriptor.from_tensor(lo, pair_block, gl.NVMMASharedLayout.get_default_for(pair_block, ldt))
    n_blocks, n_tiles = triton.cdiv(m, cfg.block_m), triton.cdiv(p, cfg.block_p)
    per = min(n_tiles, cfg.tiles_per_program)
    splits = triton.cdiv(n_tiles, per)
    pair_pingpong_kernel[(n_blocks * splits,)](
        a_desc, b_desc, hi_desc, lo_desc, unscale if unscale is not None else hi, m, p, k, per, splits,
        ACCUMULATE=accumulate, HAS_SCALE=unscale is not None, A_T=a_t, STAGES=cfg.stages,
        CONSUMER_REGS=cfg.consumer_regs, LOADER_REGS=cfg.loader_regs, num_warps=4,
    )


if HAVE_GLUON:

    @aggregate
    class _Program:
        """What the three partitions of one program share."""

        a_desc: tma.tensor_descriptor
        b_desc: tma.tensor_descriptor
        hi_desc: tma.tensor_descriptor
        lo_desc: tma.tensor_descriptor
        a_bufs: gl.shared_memory_descriptor
        b_bufs: gl.shared_memory_descriptor
        hi_bufs: gl.shared_memory_descriptor  # (2 consumers x 4 quarters, BLOCK_M, BLOCK_P // 4)
        lo_bufs: gl.shared_memory_descriptor
        ready: gl.shared_memory_descriptor
        empty: gl.shared_memory_descriptor
        turn: gl.shared_memory_descriptor
        pair_ready: gl.shared_memory_descriptor  # per consumer: its tile's old pair has landed
        pair_free: gl.shared_memory_descriptor  # per consumer: its pair buffers are stored out
        scale_ptr: gl.tensor
        k_steps: gl.tensor
        row0: gl.tensor
        first: gl.tensor
        count: gl.tensor
        ACCUMULATE: gl.constexpr
        HAS_SCALE: gl.constexpr
        A_T: gl.constexpr

        @gluon.constexpr_function
        def __init__(self, a_desc, b_desc, hi_desc, lo_desc, a_bufs, b_bufs, hi_bufs, lo_bufs, ready, empty, turn,
                     pair_ready, pair_free, scale_ptr, k_steps, row0, first, count, ACCUMULATE, HAS_SCALE, A_T):
            self.a_desc = a_desc
            self.b_desc = b_desc
            self.hi_desc = hi_desc
            self.lo_desc = lo_desc
            self.a_bufs = a_bufs
            self.b_bufs = b_bufs
            self.hi_bufs = hi_bufs
            self.lo_bufs = lo_bufs
            self.ready = ready
            self.empty = empty
            self.turn = turn
            self.pair_ready = pair_ready
            self.pair_free = pair_free
            self.scale_ptr = scale_ptr
            self.k_steps = k_steps
            self.row0 = row0
            self.first = first
            self.count = count
            self.ACCUMULATE = gl.constexpr(ACCUMULATE)
            self.HAS_SCALE = gl.constexpr(HAS_SCALE)
            self.A_T = gl.constexpr(A_T)

    @gluon.jit
    def _loader(p):
        """Per tile, in order: the old pair into its consumer's buffers, then every K-step (1 warp)."""
        BLOCK_K: gl.constexpr = p.b_desc.block_type.shape[0]
        BLOCK_P: gl.constexpr = p.b_desc.block_type.shape[1]
        QUARTER: gl.constexpr = p.hi_desc.block_type.shape[1]
        STAGES: gl.constexpr = p.a_bufs.shape[0]
        nbytes: gl.constexpr = p.a_desc.block_type.nbytes + p.b_desc.block_type.nbytes
        pair_bytes: gl.constexpr = 4 * (p.hi_desc.block_type.nbytes + p.lo_desc.block_type.nbytes)
        for i in range(p.count):
            col0 = (p.first + i) * BLOCK_P
            if p.ACCUMULATE:
                c = i % 2
                # The consumer's pair of its tile before is stored out (fresh barriers pass phase 1).
                mbarrier.wait(p.pair_free.index(c), ((i // 2) & 1) ^ 1)
                mbarrier.expect(p.pair_ready.index(c), pair_bytes)
                for q in gl.static_range(4):
                    tma.async_copy_global_to_shared(p.hi_desc, [p.row0, col0 + q * QUARTER], p.pair_ready.index(c),
                                                    p.hi_bufs.index(4 * c + q))
                    tma.async_copy_global_to_shared(p.lo_desc, [p.row0, col0 + q * QUARTER], p.pair_ready.index(c),
                                                    p.lo_bufs.index(4 * c + q))
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
                tma.async_copy_global_to_shared(p.b_desc, [kk * BLOCK_K, col0], p.ready.index(s), p.b_bufs.index(s))

    @gluon.jit
    def _pair_quarter(p, acc, hi_buf, lo_buf):
        """The new pair of one (BLOCK_M, BLOCK_P // 4) quarter into its buffers, from the old pair there:
        the arithmetic of ``pairs.pair_value`` and ``pair_of``, element for element."""
        layout: gl.constexpr = acc.type.layout
        s = acc
        if p.ACCUMULATE:  # the old pair's value first (exact in fp32 but under 2^-24 of hi), then the product
            old_hi = hi_buf.load(layout)
            old_lo = lo_buf.load(layout)
            if p.lo_desc.dtype == gl.int8:
                old = old_hi.to(gl.float32) + old_lo.to(gl.float32) * _pair_step(old_hi)
            else:
                old = old_hi.to(gl.float32) + old_lo.to(gl.float32)
            s = old + acc
        hi = s.to(p.hi_desc.dtype)
        rest = s - hi.to(gl.float32)
        rest = gl.where(gl.abs(rest) <= 3.4028234663852886e38, rest, 0.0)  # hi overflowed, or s inf / NaN
        if p.lo_desc.dtype == gl.int8:
            lo = gl.minimum(gl.maximum(gl.floor(rest / _pair_step(hi) + 0.5), -127.0), 127.0).to(gl.int8)
        else:
            lo = rest.to(p.lo_desc.dtype)
        hi_buf.store(hi)
        lo_buf.store(lo)

    @gluon.jit
    def _consume(p, C: gl.constexpr):
        """Consumer C's tiles (C, C + 2, ...): products, then the pair's epilogue (4 warps)."""
        BLOCK_M: gl.constexpr = p.a_bufs.shape[2] if p.A_T else p.a_bufs.shape[1]
        BLOCK_P: gl.constexpr = p.b_bufs.shape[2]
        QUARTER: gl.constexpr = BLOCK_P // 4
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
                acc = warpgroup_mma(a, p.b_bufs.index(s), acc, is_async=True)
                acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
                mbarrier.arrive(p.empty.index(prev), pred=kk > 0)  # the step before is read
                prev = s
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            mbarrier.arrive(p.empty.index(prev))
            mbarrier.arrive(p.turn.index(1 - C))

            if p.HAS_SCALE:
                acc = acc * gl.load(p.scale_ptr)
            if p.ACCUMULATE:
                mbarrier.wait(p.pair_ready.index(C), j & 1)
            # The four 64-column quarters in turn (the pair's TMA blocks; fewer registers live).
            col0 = (p.first + i) * BLOCK_P
            halves = acc.reshape([BLOCK_M, 2, BLOCK_P // 2]).permute((0, 2, 1)).split()
            for h in gl.static_range(2):
                quarters = halves[h].reshape([BLOCK_M, 2, QUARTER]).permute((0, 2, 1)).split()
                for q in gl.static_range(2):
                    _pair_quarter(p, quarters[q], p.hi_bufs.index(4 * C + 2 * h + q), p.lo_bufs.index(4 * C + 2 * h + q))
            fence_async_shared()
            for q in gl.static_range(4):
                tma.async_copy_shared_to_global(p.hi_desc, [p.row0, col0 + q * QUARTER], p.hi_bufs.index(4 * C + q))
                tma.async_copy_shared_to_global(p.lo_desc, [p.row0, col0 + q * QUARTER], p.lo_bufs.index(4 * C + q))
            tma.store_wait(0)  # the buffers are read out: the loader may bring the next tile's old pair
            if p.ACCUMULATE:
                mbarrier.arrive(p.pair_free.index(C))

    @gluon.jit
    def _consumer0(p):
        _consume(p, 0)

    @gluon.jit
    def _consumer1(p):
        _consume(p, 1)

    @gluon.jit
    def pair_pingpong_kernel(a_desc, b_desc, hi_desc, lo_desc, scale_ptr, M, P, K, tiles_per_program, n_splits,
                             ACCUMULATE: gl.constexpr, HAS_SCALE: gl.constexpr, A_T: gl.constexpr,
                             STAGES: gl.constexpr, CONSUMER_REGS: gl.constexpr, LOADER_REGS: gl.constexpr,
                             num_warps: gl.constexpr):
        """One program: BLOCK_M rows x ``tiles_per_program`` column tiles of the output; a 1-D grid with
        the column ranges fastest (the programs that run together share row blocks of ``a``). TMA
        reads past the edges as 0 and writes nothing there."""
        BLOCK_K: gl.constexpr = b_desc.block_type.shape[0]
        BLOCK_P: gl.constexpr = b_desc.block_type.shape[1]
        BLOCK_M: gl.constexpr = a_desc.block_type.shape[1] if A_T else a_desc.block_type.shape[0]
        pid_s = gl.program_id(0) % n_splits
        pid_m = gl.program_id(0) // n_splits
        first = pid_s * tiles_per_program
        count = gl.minimum(gl.cdiv(P, BLOCK_P) - first, tiles_per_program)

        a_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES] + a_desc.block_type.shape, a_desc.layout)
        b_bufs = gl.allocate_shared_memory(b_desc.dtype, [STAGES, BLOCK_K, BLOCK_P], b_desc.layout)
        hi_bufs = gl.allocate_shared_memory(hi_desc.dtype, [8] + hi_desc.block_type.shape, hi_desc.layout)
        lo_bufs = gl.allocate_shared_memory(lo_desc.dtype, [8] + lo_desc.block_type.shape, lo_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        pair_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        pair_free = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        for s in gl.static_range(STAGES):
            mbarrier.init(ready.index(s), count=1)
            mbarrier.init(empty.index(s), count=1)
        for c in gl.static_range(2):
            mbarrier.init(turn.index(c), count=1)
            mbarrier.init(pair_ready.index(c), count=1)
            mbarrier.init(pair_free.index(c), count=1)

        # (integer arguments equal to 1 arrive as constexprs; the aggregate's fields are tensors)
        p = _Program(a_desc, b_desc, hi_desc, lo_desc, a_bufs, b_bufs, hi_bufs, lo_bufs, ready, empty, turn,
                     pair_ready, pair_free, scale_ptr, gl.to_tensor(gl.cdiv(K, BLOCK_K)),
                     gl.to_tensor(pid_m * BLOCK_M), gl.to_tensor(first), gl.to_tensor(count),
                     ACCUMULATE, HAS_SCALE, A_T)
        gl.warp_specialize([
            (_consumer0, (p,)),
            (_consumer1, (p,)),
            (_loader, (p,)),
        ], [4, 1], [CONSUMER_REGS, LOADER_REGS])
