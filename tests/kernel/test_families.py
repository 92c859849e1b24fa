"""The architecture families (``archs.ARCHS``, read by ``device`` and ``configs``): a GPU's capability
and shared memory, or its ROCm gfx name, pick its family; the family picks every kernel's tiles, the
dot precision and the planner's granularity; bf16 below sm_80 is refused before any kernel; and each
family's tiles give the loss, the per-token fields and the divergence of float64 when the kernels run
with them in the interpreter.

The GPU is mocked (``device``'s cached CUDA probes; for ROCm ``torch.version.hip`` and the device
properties' ``gcnArchName``); what each family's tiles compile to on its targets is
``test_arch_matrix.py``. bf16 here: the interpreter upcasts bf16 tiles before ``tl.dot`` and rounds on
the bits (``device.bf16_emulation``, tests/kernel/test_bf16_emulation.py), so the bf16 cases check
the GPU's arithmetic with these tiles."""

import dataclasses
import types

import pytest
import torch

import test_divergence
import test_logprobs
from cases import Case, check_three_way
from conftest import ON_GPU
from fused_linear_ce import archs, configs, device, pingpong, plan
from fused_linear_ce.validate import Options
from simulated_gpu import fresh_device_probes

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
# (gcnArchName as torch reports it, compute units, family): a GPU of each AMD family.
AMD_GPUS = {
    "MI250X": ("gfx90a:sramecc+:xnack-", 110, "cdna2"),
    "MI300X": ("gfx942:sramecc+:xnack-", 304, "cdna3"),
    "MI355X": ("gfx950:sramecc+:xnack-", 256, "cdna4"),
    "RX 7900 XTX": ("gfx1100", 96, "rdna3"),
    "Radeon PRO W7800": ("gfx1101", 70, "rdna3"),
    "RX 9070": ("gfx1200", 56, "rdna4"),
    "Radeon AI PRO R9700": ("gfx1201", 64, "rdna4"),
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


def mock_rocm(monkeypatch, gcn_arch, cus=304):
    """A ROCm torch whose device 0 reports ``gcn_arch``: ``torch.version.hip`` set, the device
    properties' ``gcnArchName`` and CU count, ``device``'s cached probes fresh; compiled kernels."""
    monkeypatch.setattr(torch.version, "hip", "6.4.43482")
    monkeypatch.setattr(torch.version, "cuda", None)
    props = types.SimpleNamespace(gcnArchName=gcn_arch, multi_processor_count=cus, name="AMD Instinct")
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index=None: props)
    fresh_device_probes(monkeypatch.setattr, device)
    monkeypatch.setattr(device, "_capability", lambda i: pytest.fail("a ROCm GPU's capability was read"))
    monkeypatch.setattr(device, "_index", lambda d: 0)
    monkeypatch.setattr(device, "interpreted", lambda: False)


@pytest.mark.parametrize("name", list(GPUS))
def test_each_gpu_gets_its_family(monkeypatch, name):
    mock_gpu(monkeypatch, name)
    assert device.family(CUDA) == GPUS[name][3]
    assert device.atomic_sem(CUDA) == "acq_rel"  # Triton's default, what the CUDA figures were taken with
    assert configs.tables(CUDA) == archs.get(GPUS[name][3]).tables_for(configs.triton_version())


@pytest.mark.parametrize("name", list(AMD_GPUS))
def test_each_amd_gpu_gets_its_family_and_no_cuda_feature(monkeypatch, name):
    """The gfx name up to its first ':' picks the family (as ``kernels`` checks metadata.json's archs);
    no TMA descriptors, no ping-pong; "tf32" dots on CDNA3 alone (Triton's AMD backend refuses them
    elsewhere), bf16 allowed."""
    gcn, cus, fam = AMD_GPUS[name]
    mock_rocm(monkeypatch, gcn, cus)
    assert device.family(CUDA) == fam and device.hardware(CUDA) is archs.get(fam)
    assert configs.tables(CUDA) == archs.get(fam).tables_for(configs.triton_version())
    assert not device.tma_hardware(CUDA)
    on_gpu = types.SimpleNamespace(device=CUDA, dtype=torch.bfloat16, shape=(4096, 1024))  # a call's hidden
    assert not pingpong.eligible(on_gpu, on_gpu, plain=True)
    want = "tf32" if fam == "cdna3" else "ieee"
    assert device.input_precision(torch.bfloat16, device=CUDA) == want
    # a stand-in for cuBLAS's switches (pytest >= 9.0.3 undoes a setattr on torch's own with delattr, which it refuses)
    monkeypatch.setattr(torch.backends.cuda, "matmul", types.SimpleNamespace(allow_tf32=True))
    assert device.input_precision(torch.float32, device=CUDA) == want
    monkeypatch.setattr(torch.backends.cuda, "matmul", types.SimpleNamespace(allow_tf32=False))  # torch's default
    assert device.input_precision(torch.float32, device=CUDA) == "ieee"
    device.check_dtype(torch.bfloat16, CUDA)
    assert configs.divergence_row_config(cus, 128256, CUDA) == (1, 4096, 16)
    assert device.atomic_sem(CUDA) == "relaxed"  # the split-K sums without acquire-release fences


def test_an_undeclared_gfx_takes_the_tables_of_its_wave():
    """A part no record names (an MI100, a Radeon 890M) takes the family of its wave size whose tables
    need the least LDS."""
    assert device.rocm_family("gfx908") == "cdna2"
    assert device.rocm_family("gfx1150") == "rdna3"


def test_family_of_by_capability_and_shared_memory():
    assert device.family_of((7, 5)) is None and device.family_of((7, 0)) is None
    assert device.family_of((8, 7)) == "sm80"  # Orin: the A100's SM
    assert device.family_of((12, 1)) == "sm120"
    assert device.family_of((13, 0)) == "sm120"  # a newer capability: its nearest named one below
    # less shared memory than the family's tables need: the largest family that fits
    assert device.family_of((8, 0), 99 * 1024) == "sm86"
    assert device.family_of((8, 0), 163 * 1024) == "sm80"
    assert device.family_of((9, 0), 150 * 1024) == "sm86" and device.family_of((9, 0), 200 * 1024) == "sm80"
    assert device.family_of((12, 0), 64 * 1024) == "sm120" and device.family_of((9, 0), 64 * 1024) == "sm86"
    # no device, the interpreter's CPU tensors: sm_90's tables
    assert device.family(None) == "sm90" and device.family(torch.device("cpu")) == "sm90"


@pytest.mark.parametrize("name", list(GPUS))
def test_each_family_picks_its_tables(monkeypatch, name):
    """Every role's tiles come from the GPU's family record; sm_90's are the measured ones, unchanged."""
    mock_gpu(monkeypatch, name)
    fam = GPUS[name][3]
    table = archs.get(fam).tables_for(configs.triton_version())
    for role in configs.ROLES:
        for h in (896, 4096, None):
            want = configs.tiles(role, torch.bfloat16, h, where=fam)
            assert configs.tiles(role, torch.bfloat16, h, where=CUDA) == want
            assert configs.tiles(role, torch.float32, h, where=CUDA) == table.sweep_fp32
    for role in configs.MATMUL_ROLES:
        assert configs.matmul_config(torch.bfloat16, role=role, where=CUDA) == getattr(table, role)
    # without a device, sm_90's (the published API's default)
    assert configs.tiles("sweep", torch.bfloat16, 4096) == configs.tiles("sweep", torch.bfloat16, 4096, where="sm90")


def test_the_measured_sm90_tables():
    """sm_90's tables as measured (H200, Triton 3.6): 128 x 256 sweeps, the chunked sweep's 128 x 128
    bucket up to H = 1024, 128 x 256 products, the ping-pong sweep up to H = 2048."""
    sm90 = archs.get("sm90").tables_for((3, 6))
    shapes = {role: [(h, c.block_n, c.block_v, c.num_warps) for h, c in getattr(sm90, role)] for role in configs.ROLES}
    assert shapes == {"sweep": [(None, 128, 256, 8)], "dlogits": [(None, 128, 256, 8)],
                      "chunked": [(1024, 128, 128, 4), (None, 128, 256, 8)]}
    assert (sm90.product.block_p, sm90.paired_rows.block_p, sm90.compensated) == (256, 128, sm90.product)
    assert sm90.pingpong.max_h == 2048 and archs.get("sm90").pingpong
    assert [a.name for a in archs.ARCHS if a.pingpong] == ["sm90"]


def test_a_newer_triton_takes_the_tables_that_hold_under_it(monkeypatch):
    """sm_90's measured tables under Triton 3.6; after it (3.9 spills 424-960 bytes in the chunked
    sweep with them) the 128 x 128 sweeps; sm_80's sweep 128 x 64 after it, sm_100's dlogits 128 x 128;
    the other families one table for all."""
    mock_gpu(monkeypatch, "H100")
    bf16 = torch.bfloat16
    measured = archs.get("sm90").tables
    monkeypatch.setattr(configs, "triton_version", lambda: (3, 6))
    assert configs.tables(CUDA) == measured
    monkeypatch.setattr(configs, "triton_version", lambda: (3, 9))
    assert configs.tiles("chunked", bf16, 4096, where=CUDA).block_v == 128
    assert configs.tiles("sweep", bf16, 4096, where=CUDA).block_v == 128
    assert configs.tiles("chunked", bf16, 1024, where=CUDA) == measured.chunked[0][1]
    assert configs.tiles("dlogits", bf16, 4096, where=CUDA) == measured.dlogits[0][1]
    assert configs.matmul_config(bf16, where=CUDA) == measured.product
    assert [a.name for a in archs.ARCHS if a.overlays] == ["sm80", "sm90", "sm100"]
    # sm80's per-token sweep (272 bytes of spills at 128 x 128 under 3.8): 128 x 64 after 3.6
    assert configs.tiles("sweep", bf16, where="sm80").block_v == 64
    # sm100's dlogits with the bias gradient (304 bytes at 128 x 256 under 3.7.1): 128 x 128 after 3.6
    assert configs.tiles("dlogits", bf16, where="sm100").block_v == 128
    monkeypatch.setattr(configs, "triton_version", lambda: (3, 6))
    assert configs.tables("sm80") == configs.tables("sm86")
    assert configs.tiles("dlogits", bf16, where="sm100") == archs.get("sm90").tables.dlogits[0][1]


def test_the_families_differ_where_the_offline_compile_says():
    """The tables that do not hold elsewhere are replaced there: the chunked sweep's 128 x 256 tiles
    (160 KB of shared memory on sm_120; a compile failure class-major and 1.1 KB of spills on sm_100;
    5 KB of spills through pointers on sm_80), the products' 128 x 256 tiles below sm_90 and on sm_120;
    on AMD at most 16 waves a workgroup (CDNA: 1024 lanes) and RDNA's narrower logit tiles."""
    bf16 = torch.bfloat16
    for fam in ("sm80", "sm86", "sm100", "sm120", "cdna3", "rdna3"):
        assert configs.tiles("chunked", bf16, 4096, where=fam).block_v <= 128, fam
    for fam in ("sm80", "sm86", "sm120", "cdna2", "rdna4"):
        assert configs.matmul_config(bf16, role="product", where=fam).block_p == 128, fam
        # sm80's overlay after Triton 3.6: 64 wide
        assert configs.tiles("sweep", bf16, 4096, where=fam).block_v <= 128, fam
    assert configs.matmul_config(bf16, role="product", where="sm100") == archs.get("sm90").tables.product
    assert configs.matmul_config(bf16, role="compensated", where="sm100").block_p == 128
    assert not configs.transposed_store_tma("sm100") and configs.transposed_store_tma("sm90")
    assert configs.tiles("sweep", bf16, 4096, where="rdna3").block_n == 64
    for arch in archs.of_backend("rocm"):
        table = arch.tables
        configs_of = [c for role in configs.ROLES for _, c in getattr(table, role)]
        configs_of += [getattr(table, role) for role in configs.MATMUL_ROLES] + [table.sweep_fp32, table.matmul_fp32]
        assert all(c.num_warps <= arch.max_warps and not c.tma for c in configs_of), arch.name
        assert all(warps <= arch.max_warps for _, _, warps in table.divergence_rows), arch.name
    with pytest.raises(ValueError, match="unknown architecture family"):
        configs.tables("sm75")


def test_the_planner_cuts_by_the_family_tiles(monkeypatch):
    """The long-context plan's granularity is the family's dlogits tiles: the decision is taken with
    the device's family, the same one the backward then runs with."""
    opts = Options(strategy="auto")
    needs = (True, True, False)
    for name in ("H100", "A100", "RTX 5090"):
        mock_gpu(monkeypatch, name)
        cfg = configs.dlogits_config(torch.bfloat16, h=4096, where=CUDA)
        assert cfg == configs.tiles("dlogits", torch.bfloat16, 4096, where=GPUS[name][3])
        p = plan.plan_loss(opts, 65536, 128256, 4096, torch.bfloat16, needs, where=CUDA)
        assert p.mode == plan.LONG_CONTEXT, name  # the 4-bit pair's long-context plan on every family


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


def run_with(family: str):
    """``configs.override`` that makes the tables the kernels run with here (the interpreter's, or on a
    GPU its family's) those of ``family``, as a GPU of it gets them: for a ROCm family through a mocked
    ROCm GPU reporting its first gfx name. Block sizes count (warps and stages mean nothing to the
    interpreter)."""
    arch = archs.get(family)
    with pytest.MonkeyPatch.context() as mp:
        if arch.backend == "rocm":
            mock_rocm(mp, arch.recognises[0])
            table = configs.tables(CUDA)
        else:
            table = configs.tables(family)
    here = configs.INTERPRETER if not ON_GPU else device.family(torch.device("cuda"))
    return configs.override(here, **{f.name: getattr(table, f.name) for f in dataclasses.fields(table)})


def _distinct_tables(backend):
    """One family of each distinct table of ``backend``'s, named by the families that share it."""
    seen = {}
    for arch in archs.of_backend(backend):
        seen.setdefault(arch.tables, []).append(arch.name)
    return [pytest.param(names[0], id="+".join(names)) for names in seen.values()]


@pytest.mark.parametrize("family", ["sm80", "sm100", "sm120"] + _distinct_tables("rocm"))
@pytest.mark.parametrize("strategy", ["recompute", "chunked"])
def test_each_family_tiles_compute_the_loss_in_the_interpreter(family, strategy):
    """The kernels with a family's tables: loss and gradients against float64 and plain torch, bf16
    with a ragged V and N over several of the tiles."""
    with run_with(family):
        check_three_way(Case(130, 64, 300, torch.bfloat16, "mean", extra=dict(strategy=strategy)))


@pytest.mark.parametrize("family", _distinct_tables("rocm"))
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_each_amd_family_tiles_compute_the_per_token_fields(family, dtype):
    """The per-token fields (log-probs, entropy, top-1) and their gradients against float64 with each
    AMD family's tables, both strategies (``test_logprobs``'s check); fp32 on the family's fp32 tiles."""
    with run_with(family):
        for strategy in ("recompute", "chunked"):
            test_logprobs.test_fields_and_gradients_match_float64(dtype, strategy, "plain")


@pytest.mark.parametrize("family", _distinct_tables("rocm"))
def test_each_amd_family_tiles_compute_the_divergence(family):
    """The divergence (JSD, and forward KL on the chunked strategy) and its gradients against float64
    with each AMD family's tables (``test_divergence``'s checks)."""
    with run_with(family):
        test_divergence.test_matches_reference_16bit(0.5, "sum", torch.bfloat16)
        test_divergence.test_several_chunks(0.0, "chunked", "mean")


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
    the package's emulation, as in the module docstring). sm_90's measured tables: those of the Triton
    before its record's overlay (a newer Triton's are 128 wide already)."""
    (measured_with, _), = archs.get("sm90").overlays
    monkeypatch.setattr(configs, "triton_version", lambda: measured_with)
    wide = configs.tiles("chunked", torch.bfloat16, None, where="sm90")
    assert wide.block_v == 256
    assert configs.chunked_epilogue(wide, True, True) == dataclasses.replace(wide, block_v=128)
    for softcap, bias in ((True, False), (False, True), (False, False)):
        assert configs.chunked_epilogue(wide, softcap, bias) is wide
    narrow = configs.tiles("chunked", torch.bfloat16, None, where="sm100")
    assert configs.chunked_epilogue(narrow, True, True) is narrow

    launched = []
    real = configs.chunked_epilogue
    monkeypatch.setattr(configs, "chunked_epilogue", lambda *a: launched.append(real(*a)) or launched[-1])
    with configs.override(configs.INTERPRETER, chunked=wide):
        check_three_way(Case(130, 64, 300, torch.bfloat16, "mean", bias=True, softcap=5.0,
                             extra=dict(strategy="chunked")))
    assert launched and all(cfg.block_v == 128 for cfg in launched)


def test_override_is_the_one_way_to_other_tiles():
    """``configs.override`` changes the named family's tables (or every family's) inside its block
    only, nests, applies ``each`` to every config, and refuses unknown families and fields."""
    bf16 = torch.bfloat16
    before = configs.tables("sm80")
    small = configs.TileConfig(block_n=64, block_v=64, block_h=32, group_m=4, num_warps=4, num_stages=2)
    with configs.override("sm80", sweep=small):
        assert configs.tiles("sweep", bf16, 4096, where="sm80") == small
        assert configs.tables("sm86") == archs.get("sm86").tables_for(configs.triton_version())
        with configs.override(each=lambda cfg: dataclasses.replace(cfg, tma=False)):
            assert not configs.tiles("sweep", bf16, where="sm80").tma
            assert not configs.matmul_config(bf16, where="sm90").tma
        assert configs.matmul_config(bf16, where="sm90").tma
    assert configs.tables("sm80") == before
    with pytest.raises(ValueError, match="unknown architecture family"):
        with configs.override("sm70"):
            pass
    with pytest.raises(ValueError, match="not fields of archs.Tables"):
        with configs.override(sweeps=small):
            pass
