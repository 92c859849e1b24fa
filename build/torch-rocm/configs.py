"""Tile tables: block sizes, warps and stages of every kernel, and the candidates autotuning times.

Fixed tuned defaults per shape bucket (``tiles``), one table per architecture family (``archs.py``,
the one record of each family; ``tables``); autotuning for the exact shape is opt-in
(``autotune.py``), so tests never pay for tuning and importing never touches the GPU. The interpreter
has tables of its own that only keep CPU tests quick. ``override`` is the one way to try other tiles.

How the work is cut (the memory knob, the modes) is ``plan.py`` (with ``backward_passes.py`` and
``vocab_split.py``); what the device can do is ``device.py``, whose public names are re-exported
here, where the published API (tests/public_api.json) has them.
"""

import contextlib
from dataclasses import fields, replace

import torch
import triton

from . import archs, device
from .archs import DIVERGENCE_ROW_LAUNCHES, MATMUL_ROLES, ROLES, MatmulConfig, PingpongConfig, Tables, TileConfig
from .device import fp_fusion, input_precision, interpreted, sm_count, tma_hardware, tma_layout  # re-exported

__all__ = [  # the public names (scripts/public_api.py), the re-exported ones included
    "DIVERGENCE_ROW_LAUNCHES", "ROLES", "MatmulConfig", "PingpongConfig", "TileConfig",
    "MATMUL_ROLES", "Tables", "INTERPRETER",
    "candidates", "chunked_epilogue", "override", "tables",
    "divergence_launches", "divergence_row_config", "transposed_store_tma", "triton_version",
    "dlogits_config", "fp_fusion", "input_precision", "interpreted", "matmul_config", "pingpong",
    "sm_count", "sweep_config", "tiles", "tma_hardware", "tma_layout",
]

# The interpreter's tables: every program runs in numpy, so fewer, larger tiles are faster; tl.dot
# needs >= 16. One configuration for every logit kernel and one for every product, any dtype.
INTERPRETER = "interpreter"
_CPU_SWEEP = TileConfig(block_n=16, block_v=256, block_h=64, group_m=4, num_warps=1, num_stages=1)
_CPU_MATMUL = MatmulConfig(block_m=64, block_p=64, block_k=256, group_m=4, num_warps=1, num_stages=1)
_INTERPRETER_TABLES = Tables(sweep=((None, _CPU_SWEEP),), chunked=((None, _CPU_SWEEP),), dlogits=((None, _CPU_SWEEP),),
                             product=_CPU_MATMUL, paired_rows=_CPU_MATMUL, compensated=_CPU_MATMUL,
                             sweep_fp32=_CPU_SWEEP, matmul_fp32=_CPU_MATMUL)
# The overrides in force (``override``), innermost last: (family or None for all, change of every
# config or None, {field: value}).
_overrides: list = []


def triton_version() -> tuple[int, int]:
    """The installed Triton's (major, minor)."""
    major, minor = (int("".join(c for c in part if c.isdigit()) or 0) for part in triton.__version__.split(".")[:2])
    return major, minor


@contextlib.contextmanager
def override(family: str | None = None, *, each=None, **changes):
    """Within the ``with`` block, the tables of ``family`` (an ``archs.ARCHS`` name or ``INTERPRETER``;
    None: every family's and the interpreter's) with ``changes`` (fields of ``archs.Tables``: a
    TileConfig for a role is one bucket for every H) and ``each(cfg)`` applied to every config in
    them. The one way to launch other tiles than the tables' (experiments, tests); blocks nest."""
    if family not in (None, INTERPRETER):
        archs.get(family)
    unknown = set(changes) - {f.name for f in fields(Tables)}
    if unknown:
        raise ValueError(f"override: {sorted(unknown)} are not fields of archs.Tables")
    entry = (family, each, {k: ((None, v),) if k in ROLES and isinstance(v, TileConfig) else v
                            for k, v in changes.items()})
    _overrides.append(entry)
    try:
        yield
    finally:
        _overrides.remove(entry)


def _family(where) -> str:
    """The family whose tables ``where`` takes: a name as given; a device (or None) its family
    (``device.family``), or ``INTERPRETER`` where the kernels run in the interpreter."""
    if isinstance(where, str):
        return where
    return INTERPRETER if device.interpreted() else device.family(where)


def tables(where=None) -> Tables:
    """The tables ``where`` takes (a ``torch.device``, None for sm_90's, or a family name): its
    family's record's for the installed Triton (``archs.Arch.tables_for``), the interpreter's where
    the kernels are interpreted, with any ``override`` in force."""
    name = _family(where)
    chosen = _INTERPRETER_TABLES if name == INTERPRETER else archs.get(name).tables_for(triton_version())
    for family, each, changes in _overrides:
        if family in (None, name):
            chosen = replace(chosen.each(each) if each else chosen, **changes)
    return chosen


def tiles(role: str, dtype: torch.dtype, h: int | None = None, *, where=None) -> TileConfig:
    """The tuned tiles of one logit kernel (``role``, ``archs.ROLES``: "sweep" the forward's vocabulary
    sweep, "chunked" the chunked path's sweep and its in-place gradient kernel, "dlogits" the
    recompute backward's) for hidden size ``h`` (None: the largest bucket) in ``where``'s tables
    (``tables``). fp32 has one configuration."""
    if role not in ROLES:
        raise ValueError(f"unknown role {role!r}; known: {ROLES}")
    table = tables(where)
    if dtype == torch.float32:
        return table.sweep_fp32
    for h_max, cfg in getattr(table, role):
        if h_max is None or (h is not None and h <= h_max):
            return cfg
    raise AssertionError(f"no bucket of {role!r} takes h={h}")  # the last bucket is open-ended


def candidates(role: str, dtype: torch.dtype, h: int | None = None, *, where=None) -> tuple[TileConfig, ...]:
    """What opt-in autotuning (``autotune``) times for ``role``: the tuned tiles first, then their
    neighbours (variants measured on the H200; a candidate that does not fit a GPU's shared
    memory is skipped there). fp32 keeps its one configuration; the interpreter gets three (narrower
    and taller tiles), so that CPU tests exercise the choice."""
    base = tiles(role, dtype, h, where=where)
    if _family(where) == INTERPRETER:
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
    same warps spill none and run faster on sm_90. Other calls keep ``cfg``."""
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


def matmul_config(dtype: torch.dtype, *, role: str = "product", where=None) -> MatmulConfig:
    """The Triton matmul's config for ``dtype`` in ``where``'s tables (``tables``; None: sm_90's).
    ``role`` (``archs.MATMUL_ROLES``): "product" every product; "paired_rows" the recompute path's
    paired plan's grad_hidden product (``BackwardPlan.paired``: all N rows by one vocabulary block into
    the bf16 + int8 pair), which has its own 16-bit config; "compensated" any other sum into a
    compensated pair. fp32 has one config."""
    if role not in MATMUL_ROLES:
        raise ValueError(f"unknown matmul role {role!r}; known: {MATMUL_ROLES}")
    table = tables(where)
    return table.matmul_fp32 if dtype == torch.float32 else getattr(table, role)


def pingpong(h: int, *, where="sm90") -> PingpongConfig | None:
    """The ping-pong sweep's tiles at hidden size ``h`` in ``where``'s tables (``tables``; a family
    name, sm_90's by default), or None where the family has none or ``h`` is outside its bucket."""
    cfg = tables(where).pingpong
    return cfg if cfg is not None and h <= cfg.max_h else None


def transposed_store_tma(where) -> bool:
    """Whether the chunked sweep stores a class-major buffer's transposed tiles through a TMA
    descriptor in ``where``'s tables (``tables``), else through pointers."""
    return tables(where).transposed_store_tma


def divergence_launches(where) -> tuple:
    """The row kernel's launches in ``where``'s tables (``tables``): (most programs an SM, BLOCK_V,
    warps), the first that takes a chunk's rows."""
    return tables(where).divergence_rows


def divergence_row_config(r: int, v: int, where: torch.device) -> tuple[int, int, int]:
    """The divergence row kernel's (BLOCK_N, BLOCK_V, num_warps) for a chunk of ``r`` rows: on a GPU
    one row a program (``DIVERGENCE_ROW_LAUNCHES``); on the interpreter, whose cost is per operation,
    up to 32 rows of 256 classes (still several blocks a row, and of rows, at the tests' sizes), one
    warp."""
    if device.interpreted():
        return min(32, triton.next_power_of_2(r)), min(256, triton.next_power_of_2(v)), 1
    per_sm = r / device.sm_count(where)
    for most, block_v, warps in divergence_launches(where):
        if most is None or per_sm <= most:
            return 1, min(block_v, triton.next_power_of_2(v)), warps
    raise AssertionError("DIVERGENCE_ROW_LAUNCHES ends open")
