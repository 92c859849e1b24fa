"""Opt-in autotuning: the fastest tiles of each logit kernel for the exact shape, timed once.

Off by default: the tuned table of ``configs.tiles`` (per shape bucket) serves every call, and no
call ever times anything. On (``FUSED_LINEAR_CE_AUTOTUNE=1`` in the environment, or
``enable(True)``), the first call at a new shape times every one of ``configs.candidates`` for each
kernel it runs (the forward's sweep, the chunked path, the recompute backward) on the call's own
inputs, a warm-up and ``REPS`` timed runs each, and keeps the fastest for that key (role, dtype, N,
H, V, memory budget, device, and the call's variant: bias, softcap, metrics, label smoothing, class
weights, which gradients, TMA-able layouts) for the rest of the process; later calls with that key
pay nothing. The key holds the exact N: a new sequence length tunes again.

What the tuning run costs and changes:
- Time, once per shape: each candidate's compile and ``REPS + 1`` runs of that kernel's whole
  stage (a forward, or a backward). It synchronises the device while it times.
- Memory: a candidate's run allocates what the stage itself allocates and frees it before the next,
  so the allocated peak stays about that of one call.
- Results: the candidates compute the same sums tile by tile, but a different tile shape can change
  the order in which partial statistics merge, so tuned and untuned results may differ in the last
  bits (both are checked against float64 in the tests). Leave it off where runs must be
  bit-reproducible across processes.

Never tunes during CUDA graph capture or for a vocabulary-parallel shard (the collectives would
run once per candidate); the table's tiles serve there.
"""

import os
import time

import torch

from . import configs, plan
from .configs import TileConfig

REPS = 3
_ENV = "FUSED_LINEAR_CE_AUTOTUNE"
_forced: bool | None = None
_chosen: dict[tuple, TileConfig] = {}
_timings: dict[tuple, list[tuple[TileConfig, float | None]]] = {}


def enable(flag: bool | None) -> None:
    """Turns autotuning on (True) or off (False) for this process; None defers to the environment
    variable FUSED_LINEAR_CE_AUTOTUNE ("1" is on)."""
    global _forced
    _forced = flag


def enabled() -> bool:
    if _forced is not None:
        return _forced
    return os.environ.get(_ENV, "0") == "1"


def chosen() -> dict[tuple, TileConfig]:
    """The choices made so far: {(role, dtype, N, H, V, budget, device): TileConfig}."""
    return dict(_chosen)


def timings() -> dict[tuple, list[tuple[TileConfig, float | None]]]:
    """Per key, each candidate with its median time in ms (None: it did not build or run here)."""
    return {k: list(v) for k, v in _timings.items()}


def reset() -> None:
    """Forgets every choice (the next call at each shape tunes again)."""
    _chosen.clear()
    _timings.clear()


def choose(role: str, hidden: torch.Tensor, v: int, run, budget=None, shard=None, *, variant=()) -> TileConfig:
    """The tiles for ``role`` at this call's shape: the table's (``configs.tiles``), or with
    autotuning on the fastest of ``configs.candidates``, each timed by ``run(cfg)`` (which runs the
    whole stage with those tiles and returns its outputs, dropped here). ``variant``: what else of
    the call changes the kernels it builds (part of the key)."""
    n, h = hidden.shape
    base = configs.tiles(role, hidden.dtype, h, where=hidden.device)
    if not enabled() or shard is not None or n == 0 or _capturing(hidden.device):
        return base
    candidates = configs.candidates(role, hidden.dtype, h, where=hidden.device)
    if len(candidates) == 1:
        return candidates[0]  # nothing to choose (fp32 on the GPU)
    key = (role, hidden.dtype, n, h, v, plan.chunk_budget(budget), str(hidden.device), tuple(variant))
    if key not in _chosen:
        measured, last_error = [], None
        for cfg in candidates:
            try:
                measured.append((cfg, _time(run, cfg, hidden.device)))
            except Exception as exc:  # a candidate that cannot run here is skipped; anything else is a bug
                if not _resource_error(exc):
                    raise
                measured.append((cfg, None))
                last_error = exc
        ran = [(ms, i) for i, (_cfg, ms) in enumerate(measured) if ms is not None]
        if not ran:
            raise RuntimeError(f"autotuning {role}: no candidate ran at N={n} H={h} V={v}") from last_error
        _timings[key] = measured
        _chosen[key] = measured[min(ran)[1]][0]
    return _chosen[key]


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def _time(run, cfg: TileConfig, device: torch.device) -> float:
    """Median ms of ``REPS`` runs of ``run(cfg)`` after one warm-up (the compile)."""
    run(cfg)
    times = []
    for _ in range(REPS):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            run(cfg)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            run(cfg)
            times.append((time.perf_counter() - t0) * 1e3)
    return sorted(times)[len(times) // 2]


def _resource_error(exc: Exception) -> bool:
    """Whether ``exc`` says the candidate does not fit this GPU (shared memory, registers), the one
    failure a candidate may have; anything else is a bug and propagates."""
    return type(exc).__name__ in ("OutOfResources", "OutOfResourcesError") or "out of resource" in str(exc).lower()
