"""A ping-pong vocabulary sweep in Gluon (Triton 3.6's explicit-layout language), for issue 22's
target 4: does the softmax epilogue overlap the next tile's products when two consumer warpgroups
take turns on the tensor cores?

One program: BLOCK_N rows x a contiguous range of vocabulary tiles (as ``sweep_kernels.lse_sweep_kernel``).
Three partitions share the program's shared memory:

- a loader (1 warp) streams (hidden, weight) K-steps of every tile, in tile order, through a ring
  of STAGES buffers (TMA, ``ready`` / ``empty`` mbarriers);
- two consumers (4 warps each) take the tiles in turn, 0, 2, 4, ... and 1, 3, 5, ...: each runs its
  tile's products (asynchronous wgmma, one group in flight) then its online log-sum-exp epilogue in
  registers. A ``turn`` mbarrier pair orders the consumers' product loops, so one consumer's
  epilogue runs while the other's products use the tensor cores.

Each consumer writes its own per-row statistics (max, sum of exp(z - max), target logit) as one
split of ``stats`` (3, 2 x splits, N); the caller merges the splits.

Only the reduced sweep (no bias, no softcap; metrics as an option) of 16-bit inputs on sm_90: an
experiment, kept as measured in runs 1-4 (NOTES v23). Compiled with EVEN_V (V a multiple of BLOCK_V:
S1, S2 at 256-column tiles) its consumers spill 240 bytes of registers, which slowed those shapes;
the package's kernel (``torch-ext/fused_linear_ce/pingpong.py``) masks the last tile in a uniform
branch at every V instead and spills nothing.
"""

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
from triton.language.core import _aggregate as aggregate


@aggregate
class Shared:
    h_desc: tma.tensor_descriptor
    w_desc: tma.tensor_descriptor
    a_bufs: gl.shared_memory_descriptor
    b_bufs: gl.shared_memory_descriptor
    ready: gl.shared_memory_descriptor
    empty: gl.shared_memory_descriptor
    turn: gl.shared_memory_descriptor
    targets_ptr: gl.tensor
    stats_ptr: gl.tensor
    argmax_ptr: gl.tensor
    N: gl.tensor
    V: gl.tensor
    k_steps: gl.tensor
    row0: gl.tensor
    first: gl.tensor
    count: gl.tensor
    split: gl.tensor
    n_splits: gl.tensor
    scale: gl.tensor
    ORDERED: gl.constexpr
    EVEN_V: gl.constexpr
    EPILOGUE: gl.constexpr
    METRICS: gl.constexpr

    @gluon.constexpr_function
    def __init__(self, h_desc, w_desc, a_bufs, b_bufs, ready, empty, turn, targets_ptr, stats_ptr, argmax_ptr, N, V, k_steps, row0, first, count, split, n_splits, scale, ORDERED, EVEN_V, EPILOGUE, METRICS):
        self.h_desc = h_desc
        self.w_desc = w_desc
        self.a_bufs = a_bufs
        self.b_bufs = b_bufs
        self.ready = ready
        self.empty = empty
        self.turn = turn
        self.targets_ptr = targets_ptr
        self.stats_ptr = stats_ptr
        self.argmax_ptr = argmax_ptr
        self.N = N
        self.V = V
        self.k_steps = k_steps
        self.row0 = row0
        self.first = first
        self.count = count
        self.split = split
        self.n_splits = n_splits
        self.scale = scale
        self.ORDERED = gl.constexpr(ORDERED)
        self.EVEN_V = gl.constexpr(EVEN_V)
        self.EPILOGUE = gl.constexpr(EPILOGUE)
        self.METRICS = gl.constexpr(METRICS)


@gluon.jit
def _loader(p):
    BLOCK_K: gl.constexpr = p.h_desc.block_type.shape[1]
    BLOCK_V: gl.constexpr = p.w_desc.block_type.shape[0]
    STAGES: gl.constexpr = p.a_bufs.shape[0]
    nbytes: gl.constexpr = p.h_desc.block_type.nbytes + p.w_desc.block_type.nbytes
    for i in range(p.count):
        v0 = (p.first + i) * BLOCK_V
        for kk in range(p.k_steps):
            step = i * p.k_steps + kk
            s = step % STAGES
            phase = (step // STAGES) & 1
            mbarrier.wait(p.empty.index(s), phase ^ 1)
            mbarrier.expect(p.ready.index(s), nbytes)
            tma.async_copy_global_to_shared(p.h_desc, [p.row0, kk * BLOCK_K], p.ready.index(s), p.a_bufs.index(s))
            tma.async_copy_global_to_shared(p.w_desc, [v0, kk * BLOCK_K], p.ready.index(s), p.b_bufs.index(s))


@gluon.jit
def _consume(p, C: gl.constexpr):
    BLOCK_N: gl.constexpr = p.h_desc.block_type.shape[0]
    BLOCK_V: gl.constexpr = p.w_desc.block_type.shape[0]
    STAGES: gl.constexpr = p.a_bufs.shape[0]
    layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                     instr_shape=[16, BLOCK_V, 16])
    row_layout: gl.constexpr = gl.SliceLayout(1, layout)
    col_layout: gl.constexpr = gl.SliceLayout(0, layout)

    rows = p.row0 + gl.arange(0, BLOCK_N, layout=row_layout)
    mask_n = rows < p.N
    target = gl.load(p.targets_ptr + rows, mask=mask_n, other=-1).to(gl.int32)
    m = gl.full([BLOCK_N], float("-inf"), gl.float32, row_layout)
    s_sum = gl.zeros([BLOCK_N], gl.float32, row_layout)
    z_target = gl.zeros([BLOCK_N], gl.float32, row_layout)
    pz = gl.zeros([BLOCK_N], gl.float32, row_layout)
    best = gl.full([BLOCK_N], float("-inf"), gl.float32, row_layout)
    best_idx = gl.zeros([BLOCK_N], gl.int32, row_layout)
    lanes = gl.arange(0, BLOCK_V, layout=col_layout)

    for j in range((p.count - C + 1) // 2):
        i = 2 * j + C
        if p.ORDERED:  # my turn on the tensor cores: the other consumer's products are done
            mbarrier.wait(p.turn.index(C), (j & 1) ^ (1 - C))
        acc = gl.zeros([BLOCK_N, BLOCK_V], gl.float32, layout)
        prev = 0
        for kk in range(p.k_steps):
            step = i * p.k_steps + kk
            s = step % STAGES
            mbarrier.wait(p.ready.index(s), (step // STAGES) & 1)
            acc = warpgroup_mma(p.a_bufs.index(s), p.b_bufs.index(s).permute((1, 0)), acc, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
            mbarrier.arrive(p.empty.index(prev), pred=kk > 0)  # the previous step's buffers are read
            prev = s
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        mbarrier.arrive(p.empty.index(prev))
        if p.ORDERED:
            mbarrier.arrive(p.turn.index(1 - C))

        # The epilogue: online log-sum-exp over this tile, in registers.
        vt = p.first + i
        if p.EPILOGUE > 0:
            z = acc * p.scale
            if not p.EVEN_V:
                z = gl.where((vt * BLOCK_V + lanes)[None, :] < p.V, z, float("-inf"))
            tile_max = gl.max(z, axis=1)
            m_new = gl.maximum(m, tile_max)
            alpha = gl.exp(m - m_new)
            e = gl.exp(z - m_new[:, None])
            if p.METRICS:  # sum of exp(z - m) (z - m), moved to the new max; the first argmax
                ez = e * (z - m_new[:, None])
                if not p.EVEN_V:
                    ez = gl.where((vt * BLOCK_V + lanes)[None, :] < p.V, ez, 0.0)
                pz = alpha * (pz + gl.where(s_sum > 0.0, (m - m_new) * s_sum, 0.0)) + gl.sum(ez, axis=1)
                tile_arg = gl.min(gl.where(z == tile_max[:, None], lanes[None, :], BLOCK_V), axis=1)
                better = tile_max > best
                best = gl.where(better, tile_max, best)
                best_idx = gl.where(better, vt * BLOCK_V + tile_arg, best_idx)
            s_sum = s_sum * alpha + gl.sum(e, axis=1)
            if p.EPILOGUE > 1:
                hit = lanes[None, :] == (target - vt * BLOCK_V)[:, None]
                z_target += gl.sum(gl.where(hit, z, 0.0), axis=1)
            m = m_new
        else:  # a probe of the products' own rate: the row max only
            m = gl.maximum(m, gl.max(acc, axis=1))

    split = p.split * 2 + C
    plane = p.n_splits * 2 * p.N
    out = p.stats_ptr + split * p.N + rows
    gl.store(out, m, mask=mask_n)
    gl.store(out + plane, s_sum, mask=mask_n)
    gl.store(out + 2 * plane, z_target, mask=mask_n)
    if p.METRICS:
        gl.store(out + 3 * plane, pz, mask=mask_n)
        gl.store(out + 4 * plane, best, mask=mask_n)
        gl.store(p.argmax_ptr + split * p.N + rows, best_idx, mask=mask_n)


@gluon.jit
def _consumer0(p):
    _consume(p, 0)


@gluon.jit
def _consumer1(p):
    _consume(p, 1)


@gluon.jit
def pingpong_lse_kernel(h_desc, w_desc, targets_ptr, stats_ptr, argmax_ptr, N, V, H, tiles_per_split, n_splits, scale,
                        STAGES: gl.constexpr, ORDERED: gl.constexpr, EVEN_V: gl.constexpr, EPILOGUE: gl.constexpr,
                        METRICS: gl.constexpr,
                        CONSUMER_REGS: gl.constexpr, num_warps: gl.constexpr):
    BLOCK_N: gl.constexpr = h_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = h_desc.block_type.shape[1]
    BLOCK_V: gl.constexpr = w_desc.block_type.shape[0]
    # Splits vary fastest: the programs that run together share row blocks, so the hidden rows a
    # wave reads again for every tile stay in L2.
    pid_s = gl.program_id(0) % n_splits
    pid_n = gl.program_id(0) // n_splits
    n_tiles = gl.cdiv(V, BLOCK_V)
    first = pid_s * tiles_per_split
    count = gl.minimum(n_tiles - first, tiles_per_split)

    a_bufs = gl.allocate_shared_memory(h_desc.dtype, [STAGES, BLOCK_N, BLOCK_K], h_desc.layout)
    b_bufs = gl.allocate_shared_memory(w_desc.dtype, [STAGES, BLOCK_V, BLOCK_K], w_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=1)
    for c in gl.static_range(2):
        mbarrier.init(turn.index(c), count=1)

    # (integer arguments equal to 1 arrive as constexprs: the aggregate's fields are tensors)
    p = Shared(h_desc, w_desc, a_bufs, b_bufs, ready, empty, turn, targets_ptr, stats_ptr, argmax_ptr,
               gl.to_tensor(N), gl.to_tensor(V), gl.to_tensor(gl.cdiv(H, BLOCK_K)), gl.to_tensor(pid_n * BLOCK_N),
               gl.to_tensor(first), gl.to_tensor(count), gl.to_tensor(pid_s), gl.to_tensor(n_splits),
               gl.to_tensor(scale), ORDERED, EVEN_V, EPILOGUE, METRICS)
    gl.warp_specialize([
        (_consumer0, (p,)),
        (_consumer1, (p,)),
        (_loader, (p,)),
    ], [4, 1], [CONSUMER_REGS, 40])


def lse_stats(hidden, weight, targets, *, block_n=128, block_v=128, block_k=64, stages=4, ordered=True,
              splits=1, scale=1.0, consumer_regs=232, epilogue=2, metrics=False):
    """The kernel's per-split statistics, (3, 2 x splits, N) fp32: max, sum of exp(z - max), target logit."""
    n, h = hidden.shape
    v = weight.shape[0]
    gdt = gl.bfloat16 if hidden.dtype == torch.bfloat16 else gl.float16
    h_desc = TensorDescriptor.from_tensor(hidden, [block_n, block_k],
                                          gl.NVMMASharedLayout.get_default_for([block_n, block_k], gdt))
    w_desc = TensorDescriptor.from_tensor(weight, [block_v, block_k],
                                          gl.NVMMASharedLayout.get_default_for([block_v, block_k], gdt))
    n_tiles = triton.cdiv(v, block_v)
    per = triton.cdiv(n_tiles, splits)
    splits = triton.cdiv(n_tiles, per)
    stats = torch.empty(5 if metrics else 3, 2 * splits, n, device=hidden.device, dtype=torch.float32)
    argmax = torch.empty(2 * splits, n, device=hidden.device, dtype=torch.int32) if metrics else stats
    grid = (triton.cdiv(n, block_n) * splits,)
    pingpong_lse_kernel[grid](h_desc, w_desc, targets, stats, argmax, n, v, h, per, splits, scale,
                              STAGES=stages, ORDERED=ordered, EVEN_V=v % block_v == 0, EPILOGUE=epilogue, METRICS=metrics,
                              CONSUMER_REGS=consumer_regs, num_warps=4)
    return (stats, argmax) if metrics else stats


def merge(stats):
    """(lse, z_target) per row from the per-split statistics (splits with no tile hold m = -inf);
    with metrics (``(stats, argmax)``) also (entropy, argmax)."""
    stats, argmax = stats if isinstance(stats, tuple) else (stats, None)
    m, s, zt = stats[0], stats[1], stats[2]
    mx = m.max(dim=0).values
    w = torch.exp(m - mx)
    total = (s * w).sum(dim=0)
    lse = mx + torch.log(total)
    if argmax is None:
        return lse, zt.sum(dim=0)
    pz = (w * torch.where(s > 0, stats[3] + (m - mx) * s, 0.0)).sum(dim=0)
    entropy = torch.log(total) - pz / total
    best = stats[4].max(dim=0).values
    first = torch.where(stats[4] == best, torch.arange(argmax.shape[0], device=argmax.device)[:, None], argmax.shape[0])
    arg = argmax.gather(0, first.min(dim=0).values[None])[0]
    return lse, zt.sum(dim=0), entropy, arg
