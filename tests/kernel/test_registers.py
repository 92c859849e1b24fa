"""Register pressure of the hot kernels, read from an offline sm_90 compile (``scripts/registers.py``;
no GPU needed: Triton compiles for any target, and its wheel carries ptxas and cuobjdump).

NOTES v12: the evaluation sweep spilled 96 bytes of registers to the stack, the dlogits kernel 304
and the chunked sweep 1616, from their epilogues (an int64 target comparison over the whole tile, a
2-D tile of store pointers). Slimmed, they spill nothing (the chunked sweep 8 bytes). That measured
no speed change on the H200, so what this guards is the register budget itself: overlapping a tile's
softmax epilogue with the next tile's products (warp specialisation, NOTES v11) needs registers a
spilling epilogue does not have. Known spills, reported and not held: the sweep with metrics on a
ragged last tile (~200 bytes). The Triton matmul's plain epilogue spilled 1168 bytes while its tile
of result pointers was formed before the factor's multiplication; formed after it (NOTES v19), 88,
held there for a strided result ("matmul, pointers"). A contiguous result goes through a tensor
descriptor (the shipped config's ``c_tma``, NOTES v20): 0, also for an fp32 sum (1696 by pointers). Held above zero: the sweep on a ragged last tile at 40 bytes since it skips wholly
ignored row blocks (NOTES v15: the evaluation forward at S3, whose V is ragged, measured 1.4% slower;
at S1 within the spread), and the dlogits kernel with the bias gradient at 96 (1168 before v15,
whose reshaped epilogue took it down to 80; 96 since the temperature's two float arguments, softcap_out
and grad_scale, NOTES v17; not timed). The per-token cases are held at 0: the sweep with every field,
and the dlogits kernel with the entropy gradient (~400 while its epilogue kept the tiles of z and p
both live; written in log p, 0, NOTES v21). The compensated matmul (a grad_weight
summed into a pair of 16-bit buffers, ``products.compensated``) reads and writes the pair through
tensor descriptors: held at 0, where its pointer epilogue (two 2-D tiles of 16-bit loads and stores)
spills ~3100 bytes, reported. With an int8 remainder (the recompute path's long-context
grad_hidden, ``BackwardPlan.paired``; the chunked path's weight gradient): 104 bytes while the
epilogue held the whole tile's old pair beside the accumulator ("matmul, compensated int8, unsplit",
reported); on the tile's two column halves in turn (the configs' ``split_pair``, NOTES v21), 0, held.
With a 4-bit remainder two a byte (the chunked path's weight gradient at long context, NOTES v28):
0, held (216 registers against the int8 pair's 202). The chunked buffer hosted class-major in
grad_weight (NOTES v29): its sweep stores a transposed tile through a descriptor (8 bytes, as the
row-major one) and the gradient kernel spilled 704 bytes while its offsets came from clamped rows
(which also cost its coalescing); from the unclamped rows 0, held.

Since v22 every pointer and integer argument is compiled as divisible by 16, as a launch at the
package's shapes specialises them (without the hints, ``--unaligned``, the figures are those of
unaligned buffers). With them the ragged sweep's 40 bytes and the dlogits bias gradient's 96 are 0,
held; the strided pointer epilogue ("matmul, pointers") takes 184 where it took 88, held there; and the
chunked path's in-place gradient kernel (pointer loads, not reported before: 4.5-6 KB of stack
without the hints) spills nothing in its shipped programs, with and without the entropy and bias
gradients, held at 0.

Since v23 the Hopper ping-pong sweep (``pingpong.py``, Gluon) is compiled here too, with and without
skipping ignored blocks: held at 0. Specialised to a V that is a multiple of its 256-column tiles it
spilled 240 bytes in its consumers; its last tile's mask in a uniform branch at every V took that to 0.

Since v32 the chunked sweep runs 128 x 256 tiles with 8 warps (faster in whole steps at S1-S3 with
these spills, NOTES v32): 72 bytes (8 at 128 x 128, the tiles kept up to H = 1024: held there),
class-major 40, with the metrics 0, held there;
with a softcap and a bias 824 (1088 at 128 x 128, not reported before), held there. The registers
case also lists E_T now: unlisted, it compiled as a runtime argument, both store branches in one
kernel.

Since the architecture families (``scripts/registers.py --arch``, the other targets held by
test_arch_matrix.py) the unit strides of contiguous operands are specialised as a launch does
(``registers.unit_strides``: hidden's, weight's, bias's and targets' element strides, the matmul's
contiguous dimensions), which the pointer loads below sm_90 need to vectorise. On sm_90 the tables'
figures move where the bias or a pointer epilogue is involved: the dlogits kernel with the bias
gradient 48 bytes (0 without the hint), the chunked sweep with a softcap and a bias 0 (its own 128 x 128 tiles,
``configs.chunked_epilogue``: 808 at the table's 128 x 256, 824 without the hint), the
strided pointer epilogue 0 (184), the pair's pointer epilogue 1032 (3280, reported)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import triton

REPO = Path(__file__).resolve().parents[2]
TOOLS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
HELD = {"sweep": 0, "sweep, ragged V": 0, "sweep, metrics": 0, "dlogits": 0, "chunked sweep": 72,
        "chunked sweep, class-major": 40, "chunked sweep, metrics": 0, "chunked sweep, softcap and bias": 0,
        "chunked sweep, H <= 1024": 8, "chunked gradient, class-major": 0,
        "chunked gradient, class-major, bias gradient": 0,
        "dlogits, bias gradient": 48, "matmul, da^T, compensated": 0, "matmul, compensated int8": 0, "matmul, da^T, compensated int8": 0,
        "matmul, da^T, compensated 4-bit": 0,
        "matmul": 0, "matmul, da^T": 0, "matmul, da^T, fp32 sum": 0, "matmul, pointers": 0,
        "matmul, paired rows": 0, "sweep, every per-token field": 0, "dlogits, entropy gradient": 0,
        "chunked gradient": 0, "chunked gradient, bias gradient": 0, "chunked gradient, entropy gradient": 0,
        "chunked gradient, entropy and bias gradients": 0, "pingpong sweep": 0,
        "pingpong sweep, metrics": 16, "pingpong sweep, every block": 0, "matmul, split K": 0}


@pytest.fixture(scope="module")
def usage():
    if not (TOOLS / "cuobjdump").exists() or not (TOOLS / "ptxas").exists():
        pytest.skip(f"this Triton install has no ptxas / cuobjdump under {TOOLS}")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, str(REPO / "scripts" / "registers.py"), "--json"], env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    return {row["name"]: row for row in json.loads(out.stdout)}


def test_every_hot_kernel_compiles_for_sm90_within_the_register_file(usage):
    assert set(HELD) <= set(usage)
    for name, row in usage.items():
        assert 0 < row["registers"] <= 255, name
        assert 0 <= row["shared"] <= 227 * 1024, name  # an H100/H200 block's shared memory (none without reductions)


@pytest.mark.parametrize("name", list(HELD))
def test_the_slimmed_epilogues_do_not_spill(usage, name):
    assert usage[name]["stack"] <= HELD[name], f"{name}: {usage[name]['stack']} bytes of stack (spilled registers)"
