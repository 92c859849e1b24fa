"""The configurations ``scripts/registers.py`` compiles: every kernel the package launches, as a launch
on one target builds it (its family's tiles from ``configs``, its TMA and dot precision from the
family's record in ``archs.py``), each a ``Case``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(frozen=True)
class Case:
    name: str
    kernel: str  # attribute of fused_linear_ce.<module>
    module: str
    constexprs: dict
    descriptors: dict  # argument name -> block shape
    num_warps: int
    num_stages: int
    c_dtype: str = "*bf16"  # matmul_kernel's c_ptr
    lo_dtype: str = "bf16"  # matmul_kernel's lo_ptr / lo_desc element, used when COMPENSATED
    # Every pointer and integer argument marked divisible by 16, as a launch at the package's shapes
    # specialises them (16-byte aligned buffers; N, H, V, strides and offsets multiples of 16). Without
    # the hints a pointer kernel compiles for unaligned accesses: the chunked gradient kernel with 32
    # registers and 4.5-6 KB of stack, where a real launch gets no spill.
    divisible: bool = True
    # Integer arguments that are 1 at the launch (Triton specialises a 1 into a constant): the chunked
    # buffer's class stride, or its row stride where the buffer is class-major (hosted in grad_weight).
    unit_strides: tuple = ("stride_ev",)
    dtype: str = "bf16"  # the element of every other pointer (the input dtype)


def arch_of(target: str):
    """The family record (``archs.ARCHS``) that declares a matrix target: a CUDA architecture as its
    sm number ("90") or a ROCm gfx name ("gfx942")."""
    from fused_linear_ce import archs

    if not target.startswith("gfx"):
        sm = int(target)
        if sm < 80:
            raise SystemExit(f"sm_{sm}: no configuration family below sm_80 (bf16 unsupported there)")
        target = f"{sm // 10}.{sm % 10}"
    try:
        return archs.declaring(target)
    except ValueError as exc:
        raise SystemExit(str(exc)) from None


def precision(target: str) -> str:
    """tl.dot's input precision a launch on ``target`` passes (``device.input_precision``)."""
    return "tf32" if arch_of(target).tf32 else "ieee"


class _Builder:
    """The cases of one target with one family's tiles: each method builds one kind of launch, as the
    package's launcher builds it there."""

    def __init__(self, target: str, fam: str):
        import torch

        from fused_linear_ce import configs

        self.fam, self.tma, bf16 = fam, arch_of(target).tma, torch.bfloat16
        self.atomic_sem = arch_of(target).atomic_sem
        self.sweep, self.chunked, self.dlogits = (configs.tiles(role, bf16, None, where=fam)
                                                  for role in ("sweep", "chunked", "dlogits"))
        self.small = configs.tiles("chunked", bf16, 1024, where=fam)
        self.mm, self.pr, self.comp = (configs.matmul_config(bf16, role=role, where=fam)
                                       for role in ("product", "paired_rows", "compensated"))
        self.store_tma = configs.transposed_store_tma(fam)
        sweep, dlogits, mm = self.sweep, self.dlogits, self.mm
        logit = dict(HAS_BIAS=False, HAS_SOFTCAP=False, BLOCK_H=sweep.block_h, EVEN_H=True, BF16_EMULATION=False,
                     INPUT_PRECISION=precision(target), TMA=self.tma)
        self.forward = dict(logit, METRICS=False, SUM_Z=False, SQUARES=False, HAS_CLASS_WEIGHT=False,
                            BLOCK_N=sweep.block_n, BLOCK_V=sweep.block_v, EVEN_V=True, STORE_E=False, E_TMA=False,
                            E_T=False, GROUP_M=0, SKIP_IGNORED=True)
        self.backward = dict(logit, SMOOTHING=False, ENTROPY_GRAD=False, HAS_CLASS_WEIGHT=False,
                             BLOCK_N=dlogits.block_n, BLOCK_V=dlogits.block_v, BLOCK_H=dlogits.block_h,
                             GROUP_M=dlogits.group_m)
        self.matmul = dict(ACCUMULATE=False, HAS_SCALE=True, BLOCK_M=mm.block_m, BLOCK_P=mm.block_p, BLOCK_K=mm.block_k,
                           GROUP_M=mm.group_m, EVEN_M=True, EVEN_P=True, EVEN_K=True, BF16_EMULATION=False,
                           INPUT_PRECISION=precision(target), TMA=self.tma, B_T=False, COMPENSATED=False,
                           C_TMA=mm.c_tma and self.tma, SPLIT_PAIR=False, SPLIT_K=1)

    def d(self, **blocks):
        """Descriptor arguments where the target has TMA; pointers (no descriptors) elsewhere."""
        return blocks if self.tma else {}

    def mm_case(self, name, cfg, extra, descs, c_dtype="*bf16", lo_dtype="bf16"):
        return Case(name, "matmul_kernel", "gemm",
                    dict(self.matmul, BLOCK_M=cfg.block_m, BLOCK_P=cfg.block_p, BLOCK_K=cfg.block_k,
                         GROUP_M=cfg.group_m, **extra), descs, cfg.num_warps, cfg.num_stages, c_dtype=c_dtype,
                    lo_dtype=lo_dtype)

    def pair(self, name, cfg, A_T, lo_dtype="bf16"):
        """A product summed into a compensated pair (through descriptors where the target has TMA) at
        ``cfg``, its epilogue on column halves where ``cfg.split_pair`` says, as ``gemm.matmul``
        launches it."""
        c_block = (cfg.block_m, cfg.block_p // 2 if cfg.split_pair else cfg.block_p)
        lo_block = (c_block[0], c_block[1] // 2) if lo_dtype == "u8" else c_block  # 4-bit: two a byte
        a_desc = (cfg.block_k, cfg.block_m) if A_T else (cfg.block_m, cfg.block_k)
        return self.mm_case(name, cfg, dict(A_T=A_T, ACCUMULATE=True, COMPENSATED=True, C_TMA=self.tma,
                                            SPLIT_PAIR=cfg.split_pair and self.tma),
                            self.d(a_desc=a_desc, b_desc=(cfg.block_k, cfg.block_p), c_desc=c_block, lo_desc=lo_block),
                            lo_dtype=lo_dtype)

    def gradient(self, name, entropy_grad, bias_grad, rows=None, warps=None, class_major=False, cfg=None):
        """The chunked path's in-place gradient kernel (pointer loads) as ``chunked.gradient_in_place``
        launches it: the sweep's vocabulary tiles, ``gradient_rows`` / ``gradient_warps`` unless given."""
        from fused_linear_ce import chunked as chunked_module

        cfg = cfg or self.chunked
        rows = rows or chunked_module.gradient_rows(cfg, entropy_grad)
        warps = warps or chunked_module.gradient_warps(cfg, entropy_grad)  # never interpreted here
        return Case(name, "softmax_gradient_kernel", "chunked",
                    dict(HAS_SOFTCAP=False, SMOOTHING=False, ENTROPY_GRAD=entropy_grad, HAS_CLASS_WEIGHT=False,
                         BIAS_GRAD=bias_grad, BLOCK_N=rows, BLOCK_V=chunked_module.gradient_cols(cfg),
                         STATS_V=cfg.block_v, BF16_EMULATION=False),
                    {}, warps, 1, unit_strides=("stride_e",) if class_major else ("stride_ev",))

    def chunked_sweep(self, name, cfg=None, **extra):
        """The chunked path's sweep (STORE_E, its exponentials through a descriptor where the target
        has TMA, over the buffer's transpose with E_T) at ``cfg``'s tiles on a ragged V, as
        ``sweep._triton_sweep`` launches it."""
        cfg = cfg or self.chunked
        e_t = extra.get("E_T", False)
        e_block = (cfg.block_v, cfg.block_n) if e_t else (cfg.block_n, cfg.block_v)
        return Case(name, "lse_sweep_kernel", "sweep_kernels",
                    dict(self.forward, BLOCK_N=cfg.block_n, BLOCK_V=cfg.block_v, BLOCK_H=cfg.block_h, EVEN_V=False,
                         STORE_E=True, GROUP_M=cfg.group_m, **extra, E_TMA=self.tma and (not e_t or self.store_tma)),
                    self.d(hidden_desc=(cfg.block_n, cfg.block_h), weight_desc=(cfg.block_v, cfg.block_h),
                           **({} if e_t and not self.store_tma else dict(e_desc=e_block))),
                    cfg.num_warps, cfg.num_stages, unit_strides=("stride_e",) if e_t else ("stride_ev",))

    def sweep_case(self, name, **extra):
        sweep = self.sweep
        return Case(name, "lse_sweep_kernel", "sweep_kernels", dict(self.forward, **extra),
                    self.d(hidden_desc=(sweep.block_n, sweep.block_h), weight_desc=(sweep.block_v, sweep.block_h)),
                    sweep.num_warps, sweep.num_stages)

    def dlogits_case(self, name, **extra):
        cfg = self.dlogits
        return Case(name, "dlogits_kernel", "recompute", dict(self.backward, **extra),
                    self.d(hidden_desc=(cfg.block_n, cfg.block_h), weight_desc=(cfg.block_v, cfg.block_h)),
                    cfg.num_warps, cfg.num_stages)


def _logit_cases(b: _Builder) -> list[Case]:
    """The sweeps (forward, chunked, per-token) and the recompute backward's dlogits kernel."""
    from fused_linear_ce import configs

    return [
        b.sweep_case("sweep"),
        b.sweep_case("sweep, ragged V", EVEN_V=False),
        b.sweep_case("sweep, metrics", METRICS=True),
        b.sweep_case("sweep, metrics, ragged V", METRICS=True, EVEN_V=False),
        b.chunked_sweep("chunked sweep"),
        b.chunked_sweep("chunked sweep, class-major", E_T=True),
        b.chunked_sweep("chunked sweep, H <= 1024", cfg=b.small),
        b.chunked_sweep("chunked sweep, metrics", METRICS=True),
        b.chunked_sweep("chunked sweep, softcap and bias", configs.chunked_epilogue(b.chunked, True, True),
                        HAS_SOFTCAP=True, HAS_BIAS=True),
        b.sweep_case("sweep, every per-token field", METRICS=True, SUM_Z=True, SQUARES=True, EVEN_V=False),
        b.dlogits_case("dlogits", HAS_BIAS=False, BIAS_GRAD=False),
        b.dlogits_case("dlogits, bias gradient", HAS_BIAS=True, BIAS_GRAD=True),
        b.dlogits_case("dlogits, entropy gradient", ENTROPY_GRAD=True, HAS_BIAS=False, BIAS_GRAD=False),
    ]


def _product_cases(b: _Builder) -> list[Case]:
    """Every use of the Triton matmul: plain, through da's transpose, summed in fp32, split K, and
    summed into a compensated pair."""
    mm, d = b.mm, b.d
    # A plain contiguous result through a descriptor where the shipped config says (``c_tma``); a
    # strided one always through pointers ("matmul, pointers").
    c_desc = d(c_desc=(mm.block_m, mm.block_p), lo_desc=(mm.block_m, mm.block_p)) if mm.c_tma else {}
    a_t_descs = d(a_desc=(mm.block_k, mm.block_m), b_desc=(mm.block_k, mm.block_p))
    a_descs = d(a_desc=(mm.block_m, mm.block_k), b_desc=(mm.block_k, mm.block_p))
    return [
        b.mm_case("matmul, da^T", mm, dict(A_T=True), dict(a_t_descs, **c_desc)),
        b.mm_case("matmul", mm, dict(A_T=False), dict(a_descs, **c_desc)),
        b.mm_case("matmul, da^T, fp32 sum", mm, dict(A_T=True, ACCUMULATE=True), dict(a_t_descs, **c_desc),
                  c_dtype="*fp32"),
        b.mm_case("matmul, pointers", mm, dict(A_T=False, C_TMA=False), a_descs),
        # grad_hidden's K reduction in two halves added into fp32 by atomics (``gemm.split_k``)
        b.mm_case("matmul, split K", mm,
                  dict(A_T=False, C_TMA=b.tma, HAS_SCALE=False, SPLIT_K=2, ATOMIC_SEM=b.atomic_sem),
                  dict(a_descs, **d(c_desc=(mm.block_m, mm.block_p // 2))), c_dtype="*fp32"),
        b.pair("matmul, da^T, compensated", b.comp, A_T=True),
        b.pair("matmul, da^T, compensated int8", b.comp, A_T=True, lo_dtype="i8"),
        b.pair("matmul, da^T, compensated 4-bit", b.comp, A_T=True, lo_dtype="u8"),
        b.pair("matmul, compensated int8", b.comp, A_T=False, lo_dtype="i8"),
        b.pair("matmul, paired rows", b.pr, A_T=False, lo_dtype="i8"),
    ]


def _gradient_cases(b: _Builder) -> list[Case]:
    """The chunked path's in-place gradient kernel in each of its variants."""
    return [
        b.gradient("chunked gradient", entropy_grad=False, bias_grad=False),
        b.gradient("chunked gradient, class-major", entropy_grad=False, bias_grad=False, class_major=True),
        b.gradient("chunked gradient, class-major, bias gradient", entropy_grad=False, bias_grad=True,
                   class_major=True),
        b.gradient("chunked gradient, bias gradient", entropy_grad=False, bias_grad=True),
        b.gradient("chunked gradient, entropy gradient", entropy_grad=True, bias_grad=False),
        b.gradient("chunked gradient, entropy and bias gradients", entropy_grad=True, bias_grad=True),
        b.gradient("chunked gradient, H <= 1024", entropy_grad=False, bias_grad=False, cfg=b.small),
    ]


def _fallback_cases(b: _Builder) -> list[Case]:
    """On TMA targets, the pointer fallbacks of layouts TMA cannot take (reported, not held); without
    TMA the cases above are those already."""
    if not b.tma:
        return []
    comp = b.comp
    return [
        b.pair("matmul, compensated int8, unsplit", dataclasses.replace(comp, split_pair=False), A_T=False,
               lo_dtype="i8"),
        b.gradient("chunked gradient, entropy gradient, the sweep's rows", entropy_grad=True, bias_grad=False,
                   rows=b.chunked.block_n, warps=8),
        b.mm_case("matmul, da^T, compensated, pointers", comp,
                  dict(A_T=True, ACCUMULATE=True, COMPENSATED=True, C_TMA=False),
                  b.d(a_desc=(comp.block_k, comp.block_m), b_desc=(comp.block_k, comp.block_p))),
    ]


def cases(target: str = "90", tables: str | None = None) -> list[Case]:
    """Every configuration the package launches on ``target`` (``arch_of``): its family's tiles
    (``tables``: another family's, to compare), TMA where the family has it."""
    fam = tables or arch_of(target).name
    b = _Builder(target, fam)
    return (_logit_cases(b) + _product_cases(b) + _gradient_cases(b) + _fallback_cases(b)
            + fp32_cases(target, fam) + divergence_cases(fam))


def fp32_cases(target: str = "90", fam: str = "sm90") -> list[Case]:
    """fp32 inputs: one configuration of each kernel (family ``fam``'s), pointer loads (``configs``)."""
    import torch

    from fused_linear_ce import configs

    sw = configs.tiles("sweep", torch.float32, where=fam)
    mm = configs.matmul_config(torch.float32, where=fam)
    logit = dict(HAS_BIAS=False, HAS_SOFTCAP=False, BLOCK_N=sw.block_n, BLOCK_V=sw.block_v, BLOCK_H=sw.block_h,
                 EVEN_H=True, BF16_EMULATION=False, INPUT_PRECISION=precision(target), TMA=False, GROUP_M=sw.group_m)
    forward = dict(logit, METRICS=True, SUM_Z=False, SQUARES=False, HAS_CLASS_WEIGHT=False, EVEN_V=False,
                   STORE_E=False, E_TMA=False, E_T=False, SKIP_IGNORED=True)
    backward = dict(logit, SMOOTHING=False, ENTROPY_GRAD=False, HAS_CLASS_WEIGHT=False, HAS_BIAS=True,
                    BIAS_GRAD=True)
    matmul = dict(ACCUMULATE=True, HAS_SCALE=True, BLOCK_M=mm.block_m, BLOCK_P=mm.block_p, BLOCK_K=mm.block_k,
                  GROUP_M=mm.group_m, EVEN_M=False, EVEN_P=False, EVEN_K=False, BF16_EMULATION=False,
                  INPUT_PRECISION=precision(target), TMA=False, A_T=True, B_T=False, COMPENSATED=False, C_TMA=False,
                  SPLIT_PAIR=False, SPLIT_K=1)
    return [
        Case("fp32 sweep, metrics", "lse_sweep_kernel", "sweep_kernels", forward, {}, sw.num_warps, sw.num_stages,
             dtype="fp32"),
        Case("fp32 chunked sweep", "lse_sweep_kernel", "sweep_kernels", dict(forward, STORE_E=True), {},
             sw.num_warps, sw.num_stages, dtype="fp32"),
        Case("fp32 dlogits, bias gradient", "dlogits_kernel", "recompute", backward, {}, sw.num_warps,
             sw.num_stages, dtype="fp32"),
        Case("fp32 matmul, da^T, sum", "matmul_kernel", "gemm", matmul, {}, mm.num_warps, mm.num_stages,
             c_dtype="*fp32", dtype="fp32"),
    ]


def divergence_cases(fam: str) -> list[Case]:
    """The divergence's row kernel at each of its launches (``configs.divergence_launches``), in
    its largest programs (the JSD with both biases, softcaps, targets, values and da) and the
    forward KL's da pass alone."""
    from fused_linear_ce import configs
    from fused_linear_ce.divergence_kernel import FORWARD_KL, JSD

    base = dict(HAS_BIAS_S=True, HAS_BIAS_T=True, SOFTCAP_S=True, SOFTCAP_T=True, HAS_TARGETS=True,
                STATS_KNOWN=False, VALUES=True, WRITE_DA=True, DIV_GRAD=True, BLOCK_N=1, BF16_EMULATION=False)
    out = []
    for _most, block_v, warps in configs.divergence_launches(fam):
        out.append(Case(f"divergence rows {block_v} / {warps} warps, JSD", "divergence_row_kernel",
                        "divergence_kernel", dict(base, MODE=JSD.value, BLOCK_V=block_v), {}, warps, 1))
        out.append(Case(f"divergence rows {block_v} / {warps} warps, forward KL da", "divergence_row_kernel",
                        "divergence_kernel", dict(base, MODE=FORWARD_KL.value, BLOCK_V=block_v, HAS_BIAS_S=False,
                                                  HAS_BIAS_T=False, SOFTCAP_S=False, SOFTCAP_T=False,
                                                  STATS_KNOWN=True, VALUES=False), {}, warps, 1))
    return out


# The matmul's uses, for ``--matmul``: (constexprs, A read through its transpose, c's and lo's dtypes).
_MATMUL_USES = {
    "plain": (dict(A_T=False), False, "*bf16", "bf16"),
    "da^T": (dict(A_T=True), True, "*bf16", "bf16"),
    "da^T, fp32 sum": (dict(A_T=True, ACCUMULATE=True), True, "*fp32", "bf16"),
    "plain, C_TMA": (dict(A_T=False, C_TMA=True), False, "*bf16", "bf16"),
    "da^T, C_TMA": (dict(A_T=True, C_TMA=True), True, "*bf16", "bf16"),
    "da^T, fp32 sum, C_TMA": (dict(A_T=True, ACCUMULATE=True, C_TMA=True), True, "*fp32", "bf16"),
    "da^T, compensated int8": (dict(A_T=True, ACCUMULATE=True, COMPENSATED=True, C_TMA=True), True, "*bf16", "i8"),
    "compensated int8": (dict(A_T=False, ACCUMULATE=True, COMPENSATED=True, C_TMA=True), False, "*bf16", "i8"),
    "da^T, compensated int8, split": (dict(A_T=True, ACCUMULATE=True, COMPENSATED=True, C_TMA=True, SPLIT_PAIR=True),
                                      True, "*bf16", "i8"),
    "compensated int8, split": (dict(A_T=False, ACCUMULATE=True, COMPENSATED=True, C_TMA=True, SPLIT_PAIR=True),
                                False, "*bf16", "i8"),
}


def matmul_cases(spec: str, target: str = "90") -> list[Case]:
    """The matmul's uses (``_MATMUL_USES``) at a candidate config
    ``block_m,block_p,block_k,group_m,num_warps,num_stages`` (``experiment_matmul_configs.py``)."""
    bm, bp, bk, gm, warps, stages = (int(x) for x in spec.split(","))
    tma = arch_of(target).tma
    base = dict(ACCUMULATE=False, HAS_SCALE=True, BLOCK_M=bm, BLOCK_P=bp, BLOCK_K=bk, GROUP_M=gm, EVEN_M=True,
                EVEN_P=True, EVEN_K=True, BF16_EMULATION=False, INPUT_PRECISION=precision(target), TMA=tma, B_T=False,
                COMPENSATED=False, C_TMA=False, SPLIT_PAIR=False, SPLIT_K=1)
    out = []
    for use, (extra, a_t, c_dtype, lo_dtype) in _MATMUL_USES.items():
        if not tma:  # every operand and result through pointers
            if extra.get("C_TMA"):
                extra = dict(extra, C_TMA=False, SPLIT_PAIR=False)
            out.append(Case(f"matmul {bm}x{bp}x{bk} w{warps} s{stages}, {use}", "matmul_kernel", "gemm",
                            dict(base, **extra), {}, warps, stages, c_dtype=c_dtype, lo_dtype=lo_dtype))
            continue
        descs = dict(a_desc=(bk, bm) if a_t else (bm, bk), b_desc=(bk, bp))
        c_block = (bm, bp // 2 if extra.get("SPLIT_PAIR") else bp)
        if extra.get("C_TMA"):
            descs.update(c_desc=c_block)
        if extra.get("COMPENSATED"):
            descs.update(lo_desc=c_block)
        out.append(Case(f"matmul {bm}x{bp}x{bk} w{warps} s{stages}, {use}", "matmul_kernel", "gemm",
                        dict(base, **extra), descs, warps, stages, c_dtype=c_dtype, lo_dtype=lo_dtype))
    return out


def pingpong_cases() -> list[Case]:
    """The Hopper ping-pong sweep (``pingpong.py``, Gluon) at its shipped config, where this Triton
    has Gluon: skipping wholly ignored row blocks (the per-token default) and not (a returned lse)."""
    from fused_linear_ce import configs, pingpong

    if not pingpong.HAVE_GLUON:
        return []
    cfg = configs.pingpong(2048)
    descs = {"h_desc": [cfg.block_n, cfg.block_k], "w_desc": [cfg.block_v, cfg.block_k]}
    base = dict(STAGES=cfg.stages, SKIP_IGNORED=True, CONSUMER_REGS=cfg.consumer_regs,
                LOADER_REGS=cfg.loader_regs, num_warps=4)
    base = dict(base, METRICS=False)
    return [Case("pingpong sweep", "pingpong_sweep_kernel", "pingpong", base, descs, 4, 1),
            Case("pingpong sweep, metrics", "pingpong_sweep_kernel", "pingpong", dict(base, METRICS=True), descs, 4, 1),
            Case("pingpong sweep, every block", "pingpong_sweep_kernel", "pingpong", dict(base, SKIP_IGNORED=False),
                 descs, 4, 1)]
