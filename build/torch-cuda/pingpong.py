"""The per-token forward sweep on Hopper as a ping-pong kernel (Gluon): the softmax epilogue of one
tile runs while the other consumer's products use the tensor cores.

``sweep_kernels.lse_sweep_kernel`` runs each tile's products and then its epilogue in one instruction stream;
with a short K loop (H <= 2048: 32 steps of 64) the epilogue and the refill of the operand pipeline
between tiles leave the tensor cores idle for ~20% of the sweep (S3, 16384 x 2048 x 151936: 1.20x
one cuBLAS matmul). Here one program (BLOCK_N rows x a range of vocabulary tiles, as there) has three
partitions sharing its shared memory:

- a loader warp streams the (hidden, weight) K-steps of every tile, in tile order, through a ring of
  STAGES buffers (TMA loads; ``ready`` / ``empty`` mbarriers);
- two consumer warpgroups take the tiles in turn (0, 2, 4, ... and 1, 3, 5, ...). Each runs its
  tile's products (asynchronous wgmma, one group in flight) and then the online row max, sum of
  exp(z - max) and target logit, in registers. A ``turn`` mbarrier pair orders their product loops,
  so that one consumer's epilogue runs under the other's products.

Which calls (``sweep.sweep`` and ``rule``): the per-token function's sweeps (a reference model's
log-probs; SFT's and GRPO's log-probs, entropy and top-1), 16-bit, no bias or softcap, H <= 2048,
compute capability 9.0; label smoothing's and the squares' sums (mean_logits, log_sum_sq_probs) stay
on the Triton sweep. Measured (H200, bf16, ``benchmarks/NOTES.md``, ``benchmarks/results/gluon/``):
the log-probs forward at S3 14.6-14.9 ms against 17.3-17.7 for the Triton sweep (cuBLAS 14.7), at
16384 x 1024 x 151936 7.9-8.1 against 8.9-9.1; at H = 4096 (S1) it is 6% slower, hence the bucket
(``configs.pingpong``). The metrics' sums (the entropy's sum of exp(z - m) (z - m), the first argmax)
run on the tile's two column halves in turn: on the whole tile, z, its exponentials and their
products spill the consumers' registers; the argmax only on tiles where some row of the block finds
a new largest logit. Without the metrics the sums take the same halves, so that asking for them
leaves the log-sum-exp bit for bit the same. Not the loss: its step did not move beyond its spread
(S3 65.2 / 68.9 ms against 64.8 / 65.2), and with and without ``return_metrics`` it stays on one
sweep, the Triton one, whose log-probs this kernel's match to ~2e-6 (S1-S3), not bit for bit.

Each consumer writes its statistics as a split of its own (split 2 s + consumer), in the planes
``sweep_kernels.combine_kernel`` merges. No interpreter: the CPU tests check the rule and compile the kernel
for sm_90 (``tests/kernel/test_registers.py``: no spill; 16 bytes of stack with the metrics);
``tests/kernel/test_pingpong.py`` runs it on an sm_90 GPU against float64 and the Triton sweep.
"""

import os

import torch
import triton

from . import configs, device, vocab_split

# Gluon is experimental: its API has changed between Triton releases (``warp_specialize``'s
# arguments, the aggregates), so the kernel is used only with the releases it was tested on; with
# any other Triton every call takes the Triton sweep.
TESTED_TRITON = ((3, 6),)


def triton_tested(version: str = triton.__version__) -> bool:
    """Whether ``version`` (Triton's) is one this kernel was tested with (major.minor)."""
    try:
        return tuple(int(x) for x in version.split(".")[:2]) in TESTED_TRITON
    except ValueError:
        return False


try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonDescriptor
    from triton.language.core import _aggregate as aggregate

    HAVE_GLUON = triton_tested()
except Exception:  # pragma: no cover - a Triton without Gluon, or without these parts of it
    HAVE_GLUON = False

# FUSED_LINEAR_CE_PINGPONG=0 sends every call to the Triton sweep (A/B runs, or a way out of a
# Gluon problem on some driver); any other value, or none, leaves ``eligible`` to decide.
_ENV = "FUSED_LINEAR_CE_PINGPONG"


def eligible(hidden, weight, plain: bool) -> bool:
    """Whether the sweep of this call runs here (``rule``, on this call's facts). ``plain``: the
    caller's part of the rule (``sweep.sweep``: a per-token call whose sweep carries nothing but the
    log-sum-exp and the target logit)."""
    if not HAVE_GLUON or os.environ.get(_ENV) == "0" or device.interpreted():
        return False
    if hidden.device.type != "cuda" or torch.version.hip is not None:
        return False
    return rule(device.capability(hidden.device), hidden.dtype, hidden.shape[1], plain=plain,
                tma=device.tma_layout(hidden) and device.tma_layout(weight))


def rule(capability: tuple[int, int], dtype: torch.dtype, h: int, *, plain: bool, tma: bool) -> bool:
    """A CUDA GPU of ``capability`` whose family runs the ping-pong sweep (``archs.Arch.pingpong``:
    Hopper, wgmma; Blackwell has none), 16-bit operands whose layouts take TMA descriptors, a
    ``plain`` call (see ``eligible``), and a hidden size inside the family's ``configs.pingpong``
    bucket."""
    family = device.family_of(capability)
    return (family is not None and dtype in (torch.bfloat16, torch.float16) and plain and tma
            and configs.pingpong(h, where=family) is not None)


def launch(hidden, weight, targets, tile_scale, metrics: bool, offset: int, ignore_index: int, skip_ignored: bool):
    """Runs the ping-pong sweep; returns (stats (3 or 5, 2 S, N) fp32, argmax (2 S, N) int32 or
    ``stats``, 2 S): the per-split planes of ``sweep_kernels.combine_kernel`` (row max, sum of exp(z - max),
    target logit; with ``metrics`` also the sum of exp(z - max) (z - max), the largest logit and its
    class), S the vocabulary splits (``vocab_split.tile_ranges``, one program per SM)."""
    n, h = hidden.shape
    v = weight.shape[0]
    cfg = configs.pingpong(h)
    gdt = gl.bfloat16 if hidden.dtype == torch.bfloat16 else gl.float16
    h_desc = GluonDescriptor.from_tensor(hidden, [cfg.block_n, cfg.block_k],
                                         gl.NVMMASharedLayout.get_default_for([cfg.block_n, cfg.block_k], gdt))
    w_desc = GluonDescriptor.from_tensor(weight, [cfg.block_v, cfg.block_k],
                                         gl.NVMMASharedLayout.get_default_for([cfg.block_v, cfg.block_k], gdt))
    n_blocks, n_tiles = triton.cdiv(n, cfg.block_n), triton.cdiv(v, cfg.block_v)
    splits, per = vocab_split.tile_ranges(n_blocks, n_tiles, hidden.device)
    stats = device.new((5 if metrics else 3, 2 * splits, n), torch.float32, hidden.device)
    argmax = device.new((2 * splits, n), torch.int32, hidden.device) if metrics else stats
    pingpong_sweep_kernel[(n_blocks * splits,)](
        h_desc, w_desc, targets, stats, argmax, n, v, h, per, splits, targets.stride(0), tile_scale, offset,
        ignore_index, STAGES=cfg.stages, METRICS=metrics, SKIP_IGNORED=skip_ignored,
        CONSUMER_REGS=cfg.consumer_regs, LOADER_REGS=cfg.loader_regs, num_warps=4,
    )
    return stats, argmax, 2 * splits


if HAVE_GLUON:

    @aggregate
    class _Program:
        """What the three partitions of one program share."""

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
        stride_t: gl.tensor
        scale: gl.tensor
        offset: gl.tensor
        live: gl.tensor
        METRICS: gl.constexpr
        SKIP_IGNORED: gl.constexpr

        @gluon.constexpr_function
        def __init__(self, h_desc, w_desc, a_bufs, b_bufs, ready, empty, turn, targets_ptr, stats_ptr, argmax_ptr,
                     N, V, k_steps, row0, first, count, split, n_splits, stride_t, scale, offset, live, METRICS,
                     SKIP_IGNORED):
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
            self.stride_t = stride_t
            self.scale = scale
            self.offset = offset
            self.live = live
            self.METRICS = gl.constexpr(METRICS)
            self.SKIP_IGNORED = gl.constexpr(SKIP_IGNORED)

    @gluon.jit
    def _loader(p):
        """Every K-step of every tile of the program, in order, into the ring (1 warp)."""
        BLOCK_K: gl.constexpr = p.h_desc.block_type.shape[1]
        BLOCK_V: gl.constexpr = p.w_desc.block_type.shape[0]
        STAGES: gl.constexpr = p.a_bufs.shape[0]
        nbytes: gl.constexpr = p.h_desc.block_type.nbytes + p.w_desc.block_type.nbytes
        for i in range(p.count):
            v0 = (p.first + i) * BLOCK_V
            for kk in range(p.k_steps):
                step = i * p.k_steps + kk
                s = step % STAGES
                mbarrier.wait(p.empty.index(s), ((step // STAGES) & 1) ^ 1)  # fresh barriers pass phase 1
                mbarrier.expect(p.ready.index(s), nbytes)
                tma.async_copy_global_to_shared(p.h_desc, [p.row0, kk * BLOCK_K], p.ready.index(s),
                                                p.a_bufs.index(s))
                tma.async_copy_global_to_shared(p.w_desc, [v0, kk * BLOCK_K], p.ready.index(s), p.b_bufs.index(s))

    @gluon.jit
    def _consume(p, C: gl.constexpr):
        """Consumer C's tiles (C, C + 2, ...): products, then the online statistics (4 warps)."""
        BLOCK_N: gl.constexpr = p.h_desc.block_type.shape[0]
        BLOCK_V: gl.constexpr = p.w_desc.block_type.shape[0]
        STAGES: gl.constexpr = p.a_bufs.shape[0]
        layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, BLOCK_V, 16])
        row_layout: gl.constexpr = gl.SliceLayout(1, layout)
        lanes = gl.arange(0, BLOCK_V, layout=gl.SliceLayout(0, layout))

        rows = p.row0 + gl.arange(0, BLOCK_N, layout=row_layout)
        mask_n = rows < p.N
        target = gl.load(p.targets_ptr + rows.to(gl.int64) * p.stride_t, mask=mask_n, other=-1).to(gl.int64)
        # The target's class in this weight's rows (int32), -1 when another shard's or out of range.
        in_shard = (target >= p.offset) & (target < p.offset + p.V)
        target_col = gl.where(in_shard, target - p.offset, -1).to(gl.int32)
        m = gl.full([BLOCK_N], float("-inf"), gl.float32, row_layout)
        s_sum = gl.zeros([BLOCK_N], gl.float32, row_layout)
        z_target = gl.zeros([BLOCK_N], gl.float32, row_layout)
        pz = gl.zeros([BLOCK_N], gl.float32, row_layout)
        best = gl.full([BLOCK_N], float("-inf"), gl.float32, row_layout)
        best_idx = gl.zeros([BLOCK_N], gl.int32, row_layout)
        last = gl.cdiv(p.V, BLOCK_V) - 1

        for j in range((p.count - C + 1) // 2):
            i = 2 * j + C
            # My turn on the tensor cores: the other consumer's products of the tile before are issued
            # and done (consumer 0's first wait passes on the fresh barrier's phase 1).
            mbarrier.wait(p.turn.index(C), (j & 1) ^ (1 - C))
            acc = gl.zeros([BLOCK_N, BLOCK_V], gl.float32, layout)
            prev = 0
            for kk in range(p.k_steps):
                step = i * p.k_steps + kk
                s = step % STAGES
                mbarrier.wait(p.ready.index(s), (step // STAGES) & 1)
                acc = warpgroup_mma(p.a_bufs.index(s), p.b_bufs.index(s).permute((1, 0)), acc, is_async=True)
                acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
                mbarrier.arrive(p.empty.index(prev), pred=kk > 0)  # the step before is read
                prev = s
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            mbarrier.arrive(p.empty.index(prev))
            mbarrier.arrive(p.turn.index(1 - C))

            # The epilogue, as sweep_kernels.lse_sweep_kernel's (same statistics, same rounding of z).
            vt = p.first + i
            z = acc * p.scale
            # Only the last tile can have columns past the end: a uniform branch, at every V (the
            # kernel specialised to a V that is a multiple of BLOCK_V, without it, spills 240 bytes
            # of registers in the consumers, this way none; scripts/registers.py).
            if vt == last:
                z = gl.where((vt * BLOCK_V + lanes)[None, :] < p.V, z, float("-inf"))
            tile_max = gl.max(z, axis=1)
            m_new = gl.maximum(m, tile_max)
            alpha = gl.exp(m - m_new)
            hit = lanes[None, :] == (target_col - vt * BLOCK_V)[:, None]
            z_target += gl.sum(gl.where(hit, z, 0.0), axis=1)
            if p.METRICS:
                # The first argmax, only on tiles where some row of the block finds a new largest
                # logit (a uniform branch: after the first tiles most find none).
                better = tile_max > best
                if gl.max(better.to(gl.int32), axis=0) > 0:
                    tile_arg = gl.min(gl.where(z == tile_max[:, None], lanes[None, :], BLOCK_V), axis=1)
                    best_idx = gl.where(better, vt * BLOCK_V + tile_arg, best_idx)
                    best = gl.where(better, tile_max, best)
            # The sums of exp(z - m) (and exp(z - m) (z - m)) on the tile's two column halves in turn:
            # with the metrics, d, e and e d of the whole tile beside z would not fit the consumer's
            # registers (536-824 bytes of stack). Without them the same halves, so that the metrics'
            # sums leave the log-sum-exp bit for bit the same.
            halves = z.reshape([BLOCK_N, 2, BLOCK_V // 2]).permute((0, 2, 1)).split()
            half_layout: gl.constexpr = halves[0].type.layout
            m_h = gl.convert_layout(m_new, gl.SliceLayout(1, half_layout))
            cols = gl.arange(0, BLOCK_V // 2, layout=gl.SliceLayout(0, half_layout))
            e_sum = gl.zeros([BLOCK_N], gl.float32, gl.SliceLayout(1, half_layout))
            ed_sum = gl.zeros([BLOCK_N], gl.float32, gl.SliceLayout(1, half_layout))
            for k in gl.static_range(2):
                d = halves[k] - m_h[:, None]
                e = gl.exp(d)
                e_sum += gl.sum(e, axis=1)
                if p.METRICS:  # sum of exp(z - m) (z - m), moved to the new max (as the Triton sweep's)
                    ed = e * d
                    if vt == last:  # not 0 * -inf
                        ed = gl.where((vt * BLOCK_V + k * (BLOCK_V // 2) + cols)[None, :] < p.V, ed, 0.0)
                    ed_sum += gl.sum(ed, axis=1)
            if p.METRICS:
                pz = alpha * (pz + gl.where(s_sum > 0.0, (m - m_new) * s_sum, 0.0)) + gl.convert_layout(ed_sum, row_layout)
            s_sum = s_sum * alpha + gl.convert_layout(e_sum, row_layout)
            m = m_new

        split = p.split * 2 + C
        if p.SKIP_IGNORED:  # neutral statistics for a block of ignored rows (see lse_sweep_kernel)
            m = gl.where(p.live, m, 0.0)
            s_sum = gl.where(p.live, s_sum, gl.where(split == 0, 1.0, 0.0))
        plane = p.n_splits.to(gl.int64) * 2 * p.N
        base = p.stats_ptr + split.to(gl.int64) * p.N + rows
        gl.store(base, m, mask=mask_n)
        gl.store(base + plane, s_sum, mask=mask_n)
        gl.store(base + 2 * plane, z_target, mask=mask_n)
        if p.METRICS:
            gl.store(base + 3 * plane, pz, mask=mask_n)
            gl.store(base + 4 * plane, best, mask=mask_n)
            gl.store(p.argmax_ptr + split.to(gl.int64) * p.N + rows, best_idx, mask=mask_n)

    @gluon.jit
    def _consumer0(p):
        _consume(p, 0)

    @gluon.jit
    def _consumer1(p):
        _consume(p, 1)

    @gluon.jit
    def pingpong_sweep_kernel(h_desc, w_desc, targets_ptr, stats_ptr, argmax_ptr, N, V, H, tiles_per_split, n_splits,
                              stride_t, scale, vocab_offset, ignore_index, STAGES: gl.constexpr,
                              METRICS: gl.constexpr, SKIP_IGNORED: gl.constexpr,
                              CONSUMER_REGS: gl.constexpr, LOADER_REGS: gl.constexpr, num_warps: gl.constexpr):
        """One program: BLOCK_N rows x ``tiles_per_split`` vocabulary tiles; a 1-D grid with the splits
        fastest (the programs that run together share row blocks). Writes splits 2 s and 2 s + 1."""
        BLOCK_N: gl.constexpr = h_desc.block_type.shape[0]
        BLOCK_K: gl.constexpr = h_desc.block_type.shape[1]
        BLOCK_V: gl.constexpr = w_desc.block_type.shape[0]
        pid_s = gl.program_id(0) % n_splits
        pid_n = gl.program_id(0) // n_splits
        first = pid_s * tiles_per_split
        count = gl.minimum(gl.cdiv(V, BLOCK_V) - first, tiles_per_split)
        live = True
        if SKIP_IGNORED:  # a block whose rows are all ignored runs no tile
            layout: gl.constexpr = gl.BlockedLayout([1], [32], [num_warps], [0])
            rows = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=layout)
            t = gl.load(targets_ptr + rows.to(gl.int64) * stride_t, mask=rows < N, other=ignore_index)
            live = gl.max((t != ignore_index).to(gl.int32), axis=0) > 0
            count = gl.where(live, count, 0)

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

        # (integer arguments equal to 1 arrive as constexprs; the aggregate's fields are tensors)
        p = _Program(h_desc, w_desc, a_bufs, b_bufs, ready, empty, turn, targets_ptr, stats_ptr, argmax_ptr,
                     gl.to_tensor(N), gl.to_tensor(V), gl.to_tensor(gl.cdiv(H, BLOCK_K)),
                     gl.to_tensor(pid_n * BLOCK_N), gl.to_tensor(first), gl.to_tensor(count), gl.to_tensor(pid_s),
                     gl.to_tensor(n_splits), gl.to_tensor(stride_t), gl.to_tensor(scale), gl.to_tensor(vocab_offset),
                     gl.to_tensor(live), METRICS, SKIP_IGNORED)
        gl.warp_specialize([
            (_consumer0, (p,)),
            (_consumer1, (p,)),
            (_loader, (p,)),
        ], [4, 1], [CONSUMER_REGS, LOADER_REGS])
