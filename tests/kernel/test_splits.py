"""The forward's vocabulary split (vocab_split.vocab_splits on a GPU): the fewest splits whose programs
fill the waves; measured on the H200 in benchmarks/results/borrowed/experiment_splits.json."""

import pytest
import triton

from fused_linear_ce import configs, vocab_split

SLOTS = 132  # H200 SMs x one resident program of the bf16 sweep tiles


def _efficiency(row_blocks, tiles, splits, slots=SLOTS):
    per = triton.cdiv(tiles, splits)
    waves = triton.cdiv(row_blocks * triton.cdiv(tiles, per), slots)
    return row_blocks * tiles / (waves * per * slots)


@pytest.mark.parametrize("shape,row_blocks,tiles,want", [
    ("S1", 64, 501, 2),  # 128 programs in one wave; the old rule's 5 made 320 (2.4 waves)
    ("S2", 64, 1000, 2),
    ("S3", 128, 594, 1),
    ("S4", 512, 501, 1),
])
def test_real_shapes_take_the_fewest_splits_that_fill_the_waves(shape, row_blocks, tiles, want):
    got = vocab_split._fewest_full_splits(row_blocks, tiles, SLOTS)
    assert got == want
    assert _efficiency(row_blocks, tiles, got) >= vocab_split._WAVE_EFFICIENCY
    assert all(_efficiency(row_blocks, tiles, s) < vocab_split._WAVE_EFFICIENCY for s in range(1, got))


@pytest.mark.parametrize("row_blocks,tiles", [(1, 10), (8, 40), (2, 3), (3, 1000), (1, 1)])
def test_small_problems_take_the_fullest_waves(row_blocks, tiles):
    got = vocab_split._fewest_full_splits(row_blocks, tiles, SLOTS)
    assert 1 <= got <= tiles
    best = max(_efficiency(row_blocks, tiles, s) for s in range(1, tiles + 1))
    if best >= vocab_split._WAVE_EFFICIENCY:
        assert _efficiency(row_blocks, tiles, got) >= vocab_split._WAVE_EFFICIENCY
    else:
        assert _efficiency(row_blocks, tiles, got) == pytest.approx(best)
