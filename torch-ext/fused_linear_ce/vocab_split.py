"""The forward sweep's vocabulary split: how many programs share one row block's sweep, from the
GPU's size and the tiles alone (a launch grid; what memory each stage takes is ``plan.py``)."""

import functools

import torch
import triton

from . import device as _device

# The forward's vocabulary split: the fewest splits whose programs fill the GPU's waves to at least
# this share (``vocab_splits``).
_WAVE_EFFICIENCY = 0.95
# Splits on the interpreter: more than one, so every run exercises the merge of partial statistics.
_CPU_SPLITS = 3


def vocab_splits(n_row_blocks: int, n_vocab_tiles: int, device: torch.device, *, resident: int = 1) -> int:
    """How many programs share one row block's vocabulary sweep (each a contiguous range of tiles).

    The sweep takes about (waves) x (tiles per program), where a wave is the SMs x ``resident``
    programs that run at once; the work is row blocks x tiles. This takes the fewest splits whose
    waves are at least ``_WAVE_EFFICIENCY`` full, else the fullest (fewer splits: fewer partial
    statistics, and the programs that run together share more of the weight in L2). H200, bf16,
    evaluation forward (``benchmarks/results/borrowed/experiment_splits.json``): S1 2 splits 13.9 ms
    against 15.8 for the 5 that a fixed 2 programs per SM gives, S3 1 split 18.7 against 23.1."""
    if _device.interpreted() or device.type != "cuda":
        return max(1, min(_CPU_SPLITS, n_vocab_tiles))
    sms = _device.sm_count(device)
    return _fewest_full_splits(max(1, n_row_blocks), max(1, n_vocab_tiles), sms * resident)


def tile_ranges(n_row_blocks: int, n_vocab_tiles: int, device: torch.device, *, resident: int = 1) -> tuple[int, int]:
    """(splits, tiles per split) of a vocabulary sweep: ``vocab_splits``' count, with the tiles cut
    into equal contiguous ranges and no split left without tiles."""
    per = triton.cdiv(n_vocab_tiles, vocab_splits(n_row_blocks, n_vocab_tiles, device, resident=resident))
    return triton.cdiv(n_vocab_tiles, per), per


@functools.lru_cache(maxsize=256)
def _fewest_full_splits(row_blocks: int, tiles: int, slots: int) -> int:
    best, best_eff = 1, 0.0
    for splits in range(1, tiles + 1):
        per = triton.cdiv(tiles, splits)
        if splits > 1 and triton.cdiv(tiles, splits - 1) == per:
            continue  # the same ranges as fewer splits
        waves = triton.cdiv(row_blocks * triton.cdiv(tiles, per), slots)
        eff = row_blocks * tiles / (waves * per * slots)
        if eff >= _WAVE_EFFICIENCY:
            return splits
        if eff > best_eff:
            best, best_eff = splits, eff
    return best
