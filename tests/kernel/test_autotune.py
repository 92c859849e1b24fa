"""Opt-in autotuning (``autotune.py``): off by default, tunes once per shape, each stage with its own
candidates (``configs.candidates``: three on the interpreter, so the CPU run exercises the choice), the
tuned results as exact as the table's, a candidate that does not fit the GPU skipped, and no tuning
during CUDA graph capture or for a vocabulary shard."""

import pytest
import torch
from triton.runtime.errors import OutOfResources

from cases import Case, check_three_way, make_inputs
from conftest import DEVICE, ON_GPU
from fused_linear_ce import autotune, configs, fused_linear_cross_entropy


@pytest.fixture(autouse=True)
def fresh(monkeypatch):
    monkeypatch.delenv("FUSED_LINEAR_CE_AUTOTUNE", raising=False)
    autotune.reset()
    autotune.enable(None)
    yield
    autotune.reset()
    autotune.enable(None)


def _count_timings(monkeypatch):
    calls = []
    real = autotune._time

    def counted(run, cfg, device):
        calls.append(cfg)
        return real(run, cfg, device)

    monkeypatch.setattr(autotune, "_time", counted)
    return calls


def test_off_by_default_times_nothing(monkeypatch):
    calls = _count_timings(monkeypatch)
    assert not autotune.enabled()
    check_three_way(Case(24, 32, 300, torch.float32, "mean", extra=dict(strategy="recompute")))
    assert calls == [] and autotune.chosen() == {}


def test_the_environment_variable_turns_it_on(monkeypatch):
    monkeypatch.setenv("FUSED_LINEAR_CE_AUTOTUNE", "1")
    assert autotune.enabled()
    autotune.enable(False)  # the process-wide switch wins over the environment
    assert not autotune.enabled()


@pytest.mark.tier
@pytest.mark.parametrize("strategy, roles", [("recompute", {"sweep", "dlogits"}), ("chunked", {"chunked"})])
def test_tunes_each_stage_once_per_shape_and_stays_exact(strategy, roles, monkeypatch):
    """Every candidate of each stage the call runs is timed once, the fastest is kept per key, the
    gradients match float64 as the table's do, and a second call at that shape times nothing."""
    calls = _count_timings(monkeypatch)
    autotune.enable(True)
    case = Case(40, 48, 500, torch.bfloat16, "mean", ignored=0.2, extra=dict(strategy=strategy))
    check_three_way(case)
    chosen = autotune.chosen()
    assert {key[0] for key in chosen} == roles
    for key, cfg in chosen.items():
        role, dtype, n, h, v = key[:5]
        assert (dtype, n, h, v) == (torch.bfloat16, 40, 48, 500)
        timed = autotune.timings()[key]
        assert [c for c, _ms in timed] == list(configs.candidates(role, dtype, h))
        assert len(timed) >= 2 and all(ms is not None and ms > 0 for _c, ms in timed)
        assert cfg == min(timed, key=lambda t: t[1])[0]
    per_shape = sum(len(configs.candidates(role, torch.bfloat16, 48)) for role in roles)
    assert len(calls) == per_shape
    check_three_way(case)  # the same shape again: the choices are reused
    assert len(calls) == per_shape and autotune.chosen() == chosen
    check_three_way(Case(24, 48, 500, torch.bfloat16, "mean", extra=dict(strategy=strategy)))  # a new N
    assert len(calls) == 2 * per_shape


# Per role: the strategy that runs it, and the kernels (module, name) that must launch its tiles.
LAUNCHES = {
    "sweep": ("recompute", [("sweep_kernels", "lse_sweep_kernel")]),
    "dlogits": ("recompute", [("recompute", "dlogits_kernel")]),
    "chunked": ("chunked", [("sweep_kernels", "lse_sweep_kernel"), ("chunked", "softmax_gradient_kernel")]),
}


@pytest.mark.parametrize("role", configs.ROLES)  # every role: LAUNCHES must name its kernels
def test_a_forced_choice_is_the_one_that_runs(role, monkeypatch):
    """The kept tiles are what the call launches: a candidate whose block_v differs from the
    table's, forced to win, sets BLOCK_V in every kernel of its stage (the chunked path's sweep and
    gradient kernel must agree: the tile maxima are per block_v), and the gradients stay exact."""
    import importlib

    autotune.enable(True)
    base, *others = configs.candidates(role, torch.bfloat16, 48)
    wanted = next(c for c in others if c.block_v != base.block_v)
    monkeypatch.setattr(autotune, "_time", lambda run, cfg, device: 1.0 if cfg == wanted else 2.0)
    strategy, kernels = LAUNCHES[role]
    launched = {}
    for module_name, kernel in kernels:
        module = importlib.import_module(f"fused_linear_ce.{module_name}")
        real = getattr(module, kernel)

        class Spy:
            def __getitem__(self, grid, real=real, kernel=kernel):
                return lambda *a, **kw: launched.setdefault(kernel, set()).add(kw["BLOCK_V"]) or real[grid](*a, **kw)

        monkeypatch.setattr(module, kernel, Spy())
    check_three_way(Case(24, 48, 300, torch.bfloat16, "mean", extra=dict(strategy=strategy)))
    assert [cfg for key, cfg in autotune.chosen().items() if key[0] == role] == [wanted]
    assert launched == {kernel: {wanted.block_v} for _m, kernel in kernels}


def test_a_candidate_that_does_not_fit_is_skipped_and_other_errors_propagate():
    autotune.enable(True)
    hidden = torch.zeros(16, 48, device=DEVICE, dtype=torch.bfloat16)
    first = configs.candidates("sweep", torch.bfloat16, 48)[0]

    def run(cfg):
        if cfg == first:
            raise OutOfResources(300000, 232448, "shared memory")
        return cfg

    got = autotune.choose("sweep", hidden, 300, run)
    assert got != first and got in configs.candidates("sweep", torch.bfloat16, 48)[1:]
    (timed,) = autotune.timings().values()
    assert timed[0] == (first, None) and all(ms is not None for _c, ms in timed[1:])

    def broken(cfg):
        raise ValueError("a bug, not a resource limit")

    with pytest.raises(ValueError, match="a bug"):
        autotune.choose("sweep", torch.zeros(8, 48, device=DEVICE, dtype=torch.bfloat16), 300, broken)


def test_no_tuning_for_a_vocabulary_shard_or_an_empty_batch():
    autotune.enable(True)

    def run(cfg):
        raise AssertionError("must not be timed")

    base = configs.tiles("sweep", torch.float32, 48)
    assert autotune.choose("sweep", torch.zeros(16, 48, device=DEVICE), 300, run, shard=object()) == base
    assert autotune.choose("sweep", torch.zeros(0, 48, device=DEVICE), 300, run) == base
    assert autotune.chosen() == {}


@pytest.mark.skipif(not ON_GPU, reason="CUDA graph capture needs a GPU")
@pytest.mark.tier
def test_no_tuning_during_cuda_graph_capture():
    autotune.enable(True)

    def run(cfg):
        raise AssertionError("must not be timed during capture")

    hidden = torch.zeros(16, 48, device=DEVICE, dtype=torch.bfloat16)
    x = torch.zeros(4, device=DEVICE)
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream), torch.cuda.graph(graph):
        got = autotune.choose("sweep", hidden, 300, run)
        x.add_(1)
    assert got == configs.tiles("sweep", torch.bfloat16, 48) and autotune.chosen() == {}


def test_tuned_forward_without_grad_matches_the_table(monkeypatch):
    """Evaluation (no grad) tunes the sweep alone; with a choice of other tiles forced (taller, or
    narrower where none is taller) the per-row losses match the untuned call's to fp32 rounding (a
    different tile can merge partial sums in another order)."""
    hidden, weight, _bias, targets = make_inputs(Case(40, 48, 500, torch.float16, "none"))
    base, *others = configs.candidates("sweep", torch.float16, 48)
    wanted = next((c for c in others if c.block_n != base.block_n), others[0])
    monkeypatch.setattr(autotune, "_time", lambda run, cfg, device: 1.0 if cfg == wanted else 2.0)
    with torch.no_grad():
        untuned = fused_linear_cross_entropy(hidden, weight, targets, reduction="none")
        autotune.enable(True)
        tuned = fused_linear_cross_entropy(hidden, weight, targets, reduction="none")
    assert list(autotune.chosen().values()) == [wanted] and {key[0] for key in autotune.chosen()} == {"sweep"}
    torch.testing.assert_close(tuned, untuned, rtol=1e-6, atol=1e-6)


def test_one_candidate_is_not_timed(monkeypatch):
    autotune.enable(True)
    calls = _count_timings(monkeypatch)
    only = configs.tiles("sweep", torch.float32, 48)
    monkeypatch.setattr(configs, "candidates", lambda role, dtype, h=None, where=None: (only,))
    assert autotune.choose("sweep", torch.zeros(16, 48, device=DEVICE), 300, lambda cfg: cfg) == only
    assert calls == [] and autotune.chosen() == {}


def test_the_key_holds_the_call_variant_and_the_budget(monkeypatch):
    """A bias, another set of wanted gradients or another chunk_bytes at the same shape tunes again
    (they change the kernels built and the backward's plan)."""
    calls = _count_timings(monkeypatch)
    autotune.enable(True)
    base = Case(40, 48, 500, torch.bfloat16, "mean", extra=dict(strategy="recompute"))
    per_call = sum(len(configs.candidates(role, torch.bfloat16, 48)) for role in ("sweep", "dlogits"))
    check_three_way(base)
    assert len(calls) == per_call
    check_three_way(Case(40, 48, 500, torch.bfloat16, "mean", bias=True, extra=dict(strategy="recompute")))
    assert len(calls) == 2 * per_call
    check_three_way(Case(40, 48, 500, torch.bfloat16, "mean", grad=("hidden",), extra=dict(strategy="recompute")))
    assert len(calls) == 2 * per_call + len(configs.candidates("dlogits", torch.bfloat16, 48))
    check_three_way(Case(40, 48, 500, torch.bfloat16, "mean", chunk_bytes=16 * 256 * 2,
                         extra=dict(strategy="recompute")))
    assert len(calls) == 2 * per_call + 2 * len(configs.candidates("dlogits", torch.bfloat16, 48))


@pytest.mark.parametrize("options", [dict(bias=True, softcap=15.0, logit_scale=0.7),
                                     dict(label_smoothing=0.1, class_weight=True, ignored=0.25),
                                     dict(bias=True, chunk_bytes=16 * 256 * 2)],
                         ids=["bias-softcap-scale", "smoothing-class-weight", "bias-small-budget"])
@pytest.mark.parametrize("shape", ["narrow", "tall"])
@pytest.mark.parametrize("role", configs.ROLES)  # every role: LAUNCHES must name its kernels
def test_every_loss_variant_is_exact_with_other_tiles(role, shape, options, monkeypatch):
    """A tuned choice whose tiles differ from the table's (``narrow``: half the block_v, ragged
    tiles at V = 300; ``tall``: another block_n, which also sets the bias partial sums' row blocks
    and the backward plan's granularity) keeps the loss variants' gradients, the bias's included, as
    exact as the table's tiles; ``bias-small-budget`` makes the recompute backward cut its plane."""
    autotune.enable(True)
    base, *others = configs.candidates(role, torch.bfloat16, 48)
    field = "block_v" if shape == "narrow" else "block_n"
    wanted = next((c for c in others if getattr(c, field) != getattr(base, field)), None)
    if wanted is None:
        pytest.skip(f"no {role} candidate with another {field} on this device")
    monkeypatch.setattr(autotune, "_time", lambda run, cfg, device: 1.0 if cfg == wanted else 2.0)
    strategy = LAUNCHES[role][0]
    check_three_way(Case(72, 48, 300, torch.bfloat16, "mean", extra=dict(strategy=strategy), **options))
    assert [cfg for key, cfg in autotune.chosen().items() if key[0] == role] == [wanted]


def test_the_table_picks_the_chunked_sweep_tiles_by_hidden_size(monkeypatch):
    """The GPU table (read here without a GPU) of the running Triton: the chunked sweep's 128 x 128
    tiles with 4 warps up to H = 1024; above and for an unknown H, 128 x 256 with 8 warps under the
    Triton sm_90's tables were measured with (NOTES v32), 128 x 128 with 8 warps after it (the record's
    overlay); the other roles one bucket; fp32 its one config; and the autotuning candidates keep the
    other bucket's tiles among them."""
    from fused_linear_ce import archs, device

    monkeypatch.setattr(device, "interpreted", lambda: False)
    record = archs.get("sm90")
    (measured_with, _), = record.overlays
    sm90 = record.tables_for(configs.triton_version())
    (_, small), (_, wide) = sm90.chunked
    wide_shape = (256, 8) if configs.triton_version() <= measured_with else (128, 8)
    assert (small.block_v, small.num_warps, wide.block_v, wide.num_warps) == (128, 4, *wide_shape)
    for h, want in ((640, small), (896, small), (1024, small), (1025, wide), (2048, wide), (4096, wide),
                    (None, wide)):
        assert configs.tiles("chunked", torch.bfloat16, h) == want, h
        assert configs.sweep_config(torch.float16, chunked=True, h=h) == want, h
    for h in (640, 4096, None):
        assert configs.tiles("sweep", torch.bfloat16, h) == sm90.sweep[0][1]
        assert configs.tiles("dlogits", torch.bfloat16, h) == sm90.dlogits[0][1]
        assert configs.tiles("chunked", torch.float32, h) == sm90.sweep_fp32
    shapes = {(c.block_n, c.block_v, c.num_warps) for c in configs.candidates("chunked", torch.bfloat16, 4096)}
    assert {(128, 256, 8), (128, 128, 4)} <= shapes
    shapes = {(c.block_n, c.block_v, c.num_warps) for c in configs.candidates("chunked", torch.bfloat16, 896)}
    assert {(128, 256, 8), (128, 128, 4)} <= shapes
