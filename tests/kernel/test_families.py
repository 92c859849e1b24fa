"""The architecture families (``device.family_of``, ``configs.FAMILY_TABLES``): a GPU's capability and
shared memory pick its family, the family picks every kernel's tiles and the planner's granularity,
bf16 below sm_80 is refused before any kernel, and each family's tiles give the loss and gradients of
plain torch when the kernels run with them in the interpreter.

The GPU is mocked (``device``'s cached CUDA probes); what each family's tiles compile to on its
targets is ``test_arch_matrix.py``. bf16 here: the interpreter upcasts bf16 tiles before ``tl.dot``
and rounds on the bits (``device.bf16_emulation``, tests/kernel/test_bf16_emulation.py), so the bf16
cases check the GPU's arithmetic with these tiles."""

import pytest
import torch

from cases import Case, check_three_way
from fused_linear_ce import chunked, configs, device
from fused_linear_ce.validate import Options

# (capability, the shared memory a block may opt into, SMs): a GPU of each family, and its family.
GPUS = {
    "A100": ((8, 0), 163 * 1024, 108, "sm80"),
    "A10G": ((8, 6), 99 * 1024, 80, "sm86"),
    "L4": ((8, 9), 99 * 1024, 58, "sm86"),
    "H100": ((9, 0), 227 * 1024, 132, "sm90"),
    "B200": ((10, 0), 227 * 1024, 148, "sm100"),
    "B300": ((10, 3), 227 * 1024, 148, "sm100"),
    "RTX 5090": ((12, 0), 99 * 1024, 170, "sm120"),
}
CUDA = torch.device("cuda", 0)


def mock_gpu(monkeypatch, name, capability=None, shared=None, sms=None):
    """Makes ``device``'s probes answer for GPU ``name`` (``GPUS``) and the kernels count as compiled
    (not interpreted) for the configuration functions."""
    cap, opt, count, _ = GPUS.get(name, ((7, 5), 64 * 1024, 40, None))
    monkeypatch.setattr(device, "_capability", lambda i: capability or cap)
    monkeypatch.setattr(device, "_shared_optin", lambda i: shared or opt)
    monkeypatch.setattr(device, "_sm_count", lambda i: sms or count)
    monkeypatch.setattr(device, "_index", lambda d: 0)
    monkeypatch.setattr(device, "gpu_name", lambda d: f"NVIDIA {name}")
    monkeypatch.setattr(device, "interpreted", lambda: False)


@pytest.mark.parametrize("name", list(GPUS))
def test_each_gpu_gets_its_family(monkeypatch, name):
    mock_gpu(monkeypatch, name)
    assert device.family(CUDA) == GPUS[name][3]
    assert configs.family(CUDA) == GPUS[name][3]


def test_family_of_by_capability_and_shared_memory():
    assert device.family_of((7, 5)) is None and device.family_of((7, 0)) is None
    assert device.family_of((8, 7)) == "sm80"  # Orin: the A100's SM
    assert device.family_of((12, 1)) == "sm120"
    assert device.family_of((13, 0)) == "sm120"  # a newer capability: its nearest named one below
    # less shared memory than the family's tables need: the largest family that fits
    assert device.family_of((8, 0), 99 * 1024) == "sm86"
    assert device.family_of((8, 0), 163 * 1024) == "sm80"
    # no device, the interpreter's CPU tensors: sm_90's tables
    assert device.family(None) == "sm90" and device.family(torch.device("cpu")) == "sm90"


@pytest.mark.parametrize("name", list(GPUS))
def test_each_family_picks_its_tables(monkeypatch, name):
    """Every role's tiles come from the GPU's family table; sm_90's are the measured ones, unchanged."""
    mock_gpu(monkeypatch, name)
    fam = GPUS[name][3]
    for role in configs.ROLES:
        for h in (896, 4096, None):
            assert configs.tiles(role, torch.bfloat16, h, where=CUDA) == configs.family_tiles(role, torch.bfloat16, h, fam)
            assert configs.tiles(role, torch.float32, h, where=CUDA) == configs._GPU_SWEEP_FP32
    for role in configs.MATMUL_ROLES:
        assert configs.matmul_config(torch.bfloat16, role=role, where=CUDA) == configs.family_matmul(
            torch.bfloat16, role, fam)
    if fam == "sm90" and configs.triton_version() <= configs.MEASURED_TRITON:
        assert configs.tiles("chunked", torch.bfloat16, 4096, where=CUDA) == configs._GPU_CHUNKED_SWEEP
        assert configs.tiles("sweep", torch.bfloat16, 4096, where=CUDA) == configs._GPU_SWEEP
        assert configs.matmul_config(torch.bfloat16, where=CUDA) == configs._GPU_MATMUL
        assert configs.matmul_config(torch.bfloat16, role="compensated", where=CUDA) == configs._GPU_MATMUL
    # without a device, sm_90's (the published API's default)
    assert configs.tiles("sweep", torch.bfloat16, 4096) == configs.family_tiles("sweep", torch.bfloat16, 4096, "sm90")


def test_a_newer_triton_takes_the_tables_that_hold_under_it(monkeypatch):
    """sm_90's measured tables under Triton 3.6; after it (3.9 spills 424-960 bytes in the chunked
    sweep with them) the 128 x 128 sweeps; the other families one table for both."""
    mock_gpu(monkeypatch, "H100")
    bf16 = torch.bfloat16
    monkeypatch.setattr(configs, "triton_version", lambda: (3, 6))
    assert configs.tiles("chunked", bf16, 4096, where=CUDA) == configs._GPU_CHUNKED_SWEEP
    assert configs.tiles("sweep", bf16, 4096, where=CUDA) == configs._GPU_SWEEP
    monkeypatch.setattr(configs, "triton_version", lambda: (3, 9))
    assert configs.tiles("chunked", bf16, 4096, where=CUDA) == configs._SM90_NEWER_TRITON_CHUNKED
    assert configs.tiles("sweep", bf16, 4096, where=CUDA) == configs._SM90_NEWER_TRITON
    assert configs.tiles("chunked", bf16, 1024, where=CUDA) == configs._GPU_CHUNKED_SWEEP_SMALL_H
    assert configs.tiles("dlogits", bf16, 4096, where=CUDA) == configs._GPU_DLOGITS
    assert configs.matmul_config(bf16, where=CUDA) == configs._GPU_MATMUL
    assert set(configs.NEWER_TRITON_TABLES) == {"sm90"}


def test_the_families_differ_where_the_offline_compile_says():
    """The tables that do not hold elsewhere are replaced there: the chunked sweep's 128 x 256 tiles
    (160 KB of shared memory on sm_120; a compile failure class-major and 1.1 KB of spills on sm_100;
    5 KB of spills through pointers on sm_80), the products' 128 x 256 tiles below sm_90 and on sm_120."""
    bf16 = torch.bfloat16
    for fam in ("sm80", "sm86", "sm100", "sm120"):
        assert configs.family_tiles("chunked", bf16, 4096, fam).block_v <= 128, fam
    for fam in ("sm80", "sm86", "sm120"):
        assert configs.family_matmul(bf16, "product", fam).block_p == 128, fam
        assert configs.family_tiles("sweep", bf16, 4096, fam).block_v == 128, fam
    assert configs.family_matmul(bf16, "product", "sm100") == configs._GPU_MATMUL
    assert configs.family_matmul(bf16, "compensated", "sm100").block_p == 128
    assert not configs.transposed_store_tma("sm100") and configs.transposed_store_tma("sm90")
    with pytest.raises(ValueError, match="unknown configuration family"):
        configs.family("sm75")


def test_the_planner_cuts_by_the_family_tiles(monkeypatch):
    """The long-context plan's granularity is the family's dlogits tiles: the decision is taken with
    the device's family, the same one the backward then runs with."""
    opts = Options(strategy="auto")
    needs = (True, True, False)
    for name in ("H100", "A100", "RTX 5090"):
        mock_gpu(monkeypatch, name)
        cfg = configs.dlogits_config(torch.bfloat16, h=4096, where=CUDA)
        assert cfg == configs.family_tiles("dlogits", torch.bfloat16, 4096, GPUS[name][3])
        budget = chunked.long_context_budget(opts, 65536, 128256, 4096, torch.bfloat16, needs, False, False, CUDA)
        assert budget is not None, name  # the 4-bit pair's long-context plan on every family


def test_divergence_rows_take_the_family_launches(monkeypatch):
    for name in ("H100", "A100", "RTX 5090"):
        mock_gpu(monkeypatch, name)
        sms = GPUS[name][2]
        assert configs.divergence_row_config(sms, 128256, CUDA) == (1, 4096, 16)
        assert configs.divergence_row_config(100 * sms, 128256, CUDA) == (1, 1024, 4)


def test_bf16_below_sm80_is_refused_before_any_kernel(monkeypatch):
    """A T4 (7.5): bf16 raises a ValueError naming the GPU and what runs there; fp16 and fp32 pass."""
    mock_gpu(monkeypatch, "T4")
    with pytest.raises(ValueError, match=r"NVIDIA T4 is 7\.5: use fp16 .* or fp32"):
        device.check_dtype(torch.bfloat16, CUDA)
    device.check_dtype(torch.float16, CUDA)
    device.check_dtype(torch.float32, CUDA)
    mock_gpu(monkeypatch, "A100")
    device.check_dtype(torch.bfloat16, CUDA)


def test_the_public_functions_check_the_dtype_first(monkeypatch):
    """The loss's, the log-probs' and the distillation's checks call ``check_dtype`` (through
    ``validate.check_device``) before any kernel (here made to refuse everything, on CPU tensors)."""
    import fused_linear_ce
    from fused_linear_ce import validate

    def refuse(dtype, where):
        raise ValueError("refused by check_dtype")

    monkeypatch.setattr(validate, "check_dtype", refuse)
    h, w, t = torch.randn(4, 16), torch.randn(32, 16), torch.randint(0, 32, (4,))
    with pytest.raises(ValueError, match="refused by check_dtype"):
        fused_linear_ce.fused_linear_cross_entropy(h, w, t)
    with pytest.raises(ValueError, match="refused by check_dtype"):
        fused_linear_ce.fused_linear_logprobs(h, w, t)
    with pytest.raises(ValueError, match="refused by check_dtype"):
        fused_linear_ce.fused_linear_divergence(h, w, h.clone(), w.clone(), beta=0.5)


@pytest.mark.parametrize("fam", ["sm80", "sm100", "sm120"])
@pytest.mark.parametrize("strategy", ["recompute", "chunked"])
def test_each_family_tiles_compute_the_loss_in_the_interpreter(monkeypatch, fam, strategy):
    """The kernels with a family's tiles (block sizes; warps and stages mean nothing to the
    interpreter) as the interpreter's configuration: loss and gradients against float64 and plain
    torch, bf16 with a ragged V and N over several of the tiles."""
    bf16 = torch.bfloat16
    sweep_cfg = configs.family_tiles("chunked" if strategy == "chunked" else "sweep", bf16, None, fam)
    monkeypatch.setattr(configs, "_CPU_SWEEP", sweep_cfg)
    monkeypatch.setattr(configs, "_CPU_MATMUL", configs.family_matmul(bf16, "product", fam))
    check_three_way(Case(130, 64, 300, bf16, "mean", extra=dict(strategy=strategy)))


def test_the_cublas_route_follows_the_family_tiles(monkeypatch):
    """``products.product`` sends a 16-bit product to cuBLAS where ``gemm.matmul``'s output has fewer
    tiles than half the SMs (``gemm.few_tiles``): counted in the family's tiles, so the same chunk's
    grad_hidden (256 rows by H = 4096) takes cuBLAS on an H100 (32 tiles of 128 x 256 for 132 SMs) and
    the Triton matmul on an A100 (64 tiles of 128 x 128 for 108 SMs)."""
    from fused_linear_ce import gemm

    def few(name, m, p):
        mock_gpu(monkeypatch, name)
        return 2 * gemm.output_tiles(m, p, torch.bfloat16, CUDA) < device.sm_count(CUDA)

    assert few("H100", 256, 4096) and not few("A100", 256, 4096)
    assert few("RTX 5090", 256, 4096)  # 64 tiles of 128 x 128 for 170 SMs
    assert not few("H100", 8192, 4096)


def test_softcap_with_bias_takes_narrower_chunked_tiles(monkeypatch):
    """The chunked sweep with both a softcap and a bias takes 128-wide class tiles where the table's
    are wider (``configs.chunked_epilogue``: sm_90's 128 x 256 spill 808 B there, test_arch_matrix.py);
    with either alone, or narrower tables, the tiles stay. In the interpreter with sm_90's tiles: the
    narrowed tiles are the ones launched, and the loss and gradients hold against float64 (bf16 through
    the package's emulation, as in the module docstring). sm_90's measured tables (those of
    ``configs.MEASURED_TRITON``; a newer Triton's are 128 wide already)."""
    monkeypatch.setattr(configs, "triton_version", lambda: configs.MEASURED_TRITON)
    wide = configs.family_tiles("chunked", torch.bfloat16, None, "sm90")
    assert wide.block_v == 256
    assert configs.chunked_epilogue(wide, True, True) == configs.TileConfig(**{**vars(wide), "block_v": 128})
    for softcap, bias in ((True, False), (False, True), (False, False)):
        assert configs.chunked_epilogue(wide, softcap, bias) is wide
    narrow = configs.family_tiles("chunked", torch.bfloat16, None, "sm100")
    assert configs.chunked_epilogue(narrow, True, True) is narrow

    monkeypatch.setattr(configs, "_CPU_SWEEP", wide)
    launched = []
    real = configs.chunked_epilogue
    monkeypatch.setattr(configs, "chunked_epilogue", lambda *a: launched.append(real(*a)) or launched[-1])
    check_three_way(Case(130, 64, 300, torch.bfloat16, "mean", bias=True, softcap=5.0,
                         extra=dict(strategy="chunked")))
    assert launched and all(cfg.block_v == 128 for cfg in launched)
