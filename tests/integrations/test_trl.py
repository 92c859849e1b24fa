"""The TRL drop-in (``trl_head``, ``examples/trl_sft.py``): TRL 1.16's own fused LM head, imported as
a black box, against ours swapped into it: same per-token fields and gradients inside
``add_fused_lm_head`` on tiny real models, and the same SFTTrainer run."""

import importlib.util
import inspect
import sys

import pytest
import torch

from conftest import DEVICE, REPO, rel_err

trl = pytest.importorskip("trl")
transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")
datasets = pytest.importorskip("datasets")

import trl.trainer.utils as trl_utils  # noqa: E402

import fused_linear_ce  # noqa: E402

VOCAB = 64
ALL = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1")


@pytest.fixture
def ours(monkeypatch):
    """Installs our head for the test (restored after it) and counts its calls."""
    calls = []
    real = fused_linear_ce.trl_head.chunked_log_probs

    def counted(*args, **kwargs):
        calls.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(fused_linear_ce.ChunkedLogProbFunction, "apply", staticmethod(counted))
    _restore_trl(monkeypatch)
    return calls


def _restore_trl(monkeypatch):
    """Everything ``use_in_trl`` replaces is put back after the test (the distillation drop-ins too)."""
    import trl.trainer.distillation_trainer as trl_distillation

    monkeypatch.setattr(trl_utils, "_ChunkedLogProbFunction", trl_utils._ChunkedLogProbFunction)
    for name in fused_linear_ce.trl_distill.TRL_DISTILL_NAMES:
        monkeypatch.setattr(trl_distillation, name, getattr(trl_distillation, name))


def test_contract_is_trls():
    """Our apply takes TRL's forward arguments (after ctx) by the same names, order and defaults."""
    theirs = list(inspect.signature(trl.kernels.ChunkedLogProbFunction.forward).parameters.values())[1:]
    mine = list(inspect.signature(fused_linear_ce.trl_head.chunked_log_probs).parameters.values())
    assert [p.name for p in mine] == [p.name for p in theirs]
    assert [p.default for p in mine] == [p.default for p in theirs]


def _model(kind):
    torch.manual_seed(0)
    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                  num_key_value_heads=1, max_position_embeddings=64, pad_token_id=VOCAB - 2, eos_token_id=VOCAB - 1)
    if kind == "gemma2":
        config = transformers.Gemma2Config(head_dim=16, final_logit_softcapping=3.0, **common)
        return transformers.Gemma2ForCausalLM(config).float().to(DEVICE)
    config = transformers.LlamaConfig(tie_word_embeddings=False, **common)
    return transformers.LlamaForCausalLM(config).float().to(DEVICE)


def _step(model, ids, labels):
    model.zero_grad()
    out = model(input_ids=ids, labels=labels, fused_lm_head=True)
    (out.loss - 0.1 * out.entropy.sum()).backward()
    return out, {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("kind", ["llama", "gemma2"])
def test_drop_in_gives_trls_fields_and_gradients_inside_add_fused_lm_head(kind, ours):
    model = _model(kind)
    trl_utils.add_fused_lm_head(model, temperature=0.8, outputs=ALL)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB - 2, (2, 12), generator=g).to(DEVICE)
    labels = ids.clone()
    labels[0, :4] = -100
    theirs, their_grads = _step(model, ids, labels)
    assert not ours
    fused_linear_ce.use_in_trl()  # after add_fused_lm_head: the patched model picks it up
    mine, my_grads = _step(model, ids, labels)
    assert ours, "our head was not called"
    assert rel_err(mine.loss, theirs.loss) < 1e-5
    for name in ALL[:-1]:
        assert rel_err(getattr(mine, name), getattr(theirs, name)) < 1e-5, name
    assert torch.equal(mine.is_top1, theirs.is_top1)
    assert my_grads.keys() == their_grads.keys()
    for name in their_grads:
        assert rel_err(my_grads[name], their_grads[name]) < 1e-4, name


def test_product_dtype_follows_autocast_else_hidden():
    g = torch.Generator().manual_seed(2)
    hidden = torch.randn(9, 32, generator=g).to(DEVICE)
    weight = torch.randn(VOCAB, 32, generator=g).to(DEVICE).requires_grad_()
    targets = torch.randint(0, VOCAB, (9,), generator=g).to(DEVICE)
    apply = fused_linear_ce.ChunkedLogProbFunction.apply
    in_bf16 = fused_linear_ce.fused_linear_logprobs(hidden.bfloat16(), weight.bfloat16(), targets)["log_probs"]
    lp = apply(hidden.bfloat16(), weight, None, targets, 1.0, 32768)[0]  # fp32 weight, bf16 hidden
    assert torch.equal(lp, in_bf16)
    lp.sum().backward()
    assert weight.grad.dtype == torch.float32
    with torch.autocast(DEVICE.type, dtype=torch.bfloat16):
        assert torch.equal(apply(hidden, weight, None, targets, 1.0, 32768)[0], in_bf16)
    out = apply(hidden, weight, None, targets, 1.0, 32768, outputs=("is_top1",))
    assert out[1] is None and out[2] is None and out[3] is None and out[4].dtype == torch.bool
    with pytest.raises(ValueError, match="chunk_size"):
        apply(hidden, weight, None, targets, 1.0, 0)


def _tokenizer():
    vocab = {f"t{i}": i for i in range(VOCAB - 2)} | {"<pad>": VOCAB - 2, "<eos>": VOCAB - 1}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")


def _dataset():
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(5, 15, (16,), generator=g).tolist()
    return datasets.Dataset.from_dict({"input_ids": [torch.randint(0, VOCAB - 2, (n,), generator=g).tolist()
                                                     for n in lengths]})


def _recipe():
    spec = importlib.util.spec_from_file_location("trl_sft_recipe", REPO / "examples" / "trl_sft.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["trl_sft_recipe"] = module
    spec.loader.exec_module(module)
    return module


def test_sfttrainer_with_the_switch_matches_trls_own_head(tmp_path, ours):
    config = dict(per_device_train_batch_size=4, max_steps=3, learning_rate=1e-2, logging_steps=1, seed=0,
                  data_seed=0, dataloader_drop_last=True)
    args = trl.SFTConfig(output_dir=str(tmp_path / "plain"), report_to=[], save_strategy="no",
                         use_cpu=DEVICE.type == "cpu", **config)
    plain = trl.SFTTrainer(model=_model("llama"), args=args, train_dataset=_dataset(), processing_class=_tokenizer())
    plain.train()
    assert not ours
    fused = _recipe().train(fused_linear_ce, _model("llama"), _dataset(), _tokenizer(), tmp_path / "fused", **config)
    assert ours, "SFTTrainer did not call our head"
    fused_logs = [e for e in fused.state.log_history if "loss" in e]
    plain_logs = [e for e in plain.state.log_history if "loss" in e]
    assert len(fused_logs) == len(plain_logs) == 3
    for mine, theirs in zip(fused_logs, plain_logs):
        for key in ("loss", "mean_token_accuracy", "entropy"):
            assert mine[key] == pytest.approx(theirs[key], rel=1e-4, abs=1e-5), (key, mine, theirs)
    assert fused_logs[-1]["loss"] < fused_logs[0]["loss"]


def test_the_drop_in_budget_is_the_default_until_long_context_then_at_most_2_gib():
    """``trl_head.trl_chunk_bytes``: None (the package's defaults: 192 MiB recompute, 256 MiB chunks)
    while 6 N H bytes (the hosted fp32 (N, H) accumulator's extra half in a third of the budget) is
    within 256 MiB, as up to N H = 32 Mi; beyond, 6 N H bytes, at most 2 GiB; any leading dims."""
    budget = fused_linear_ce.trl_head.trl_chunk_bytes
    mib = 1 << 20

    def rows(*shape):
        return torch.empty(*shape, device="meta")

    assert budget(rows(8192, 4096)) is budget(rows(16384, 2048)) is budget(rows(8192, 2304)) is None
    assert budget(rows(12, 32)) is None and budget(rows(10240, 4096)) is None  # 240 MiB: within 256
    assert budget(rows(12288, 4096)) == 288 * mib
    assert budget(rows(32768, 4096)) == budget(rows(4, 8192, 4096)) == 768 * mib
    assert budget(rows(65536, 4096)) == 1536 * mib
    assert budget(rows(131072, 4096)) == budget(rows(262144, 4096)) == 2048 * mib
    assert budget("not a tensor") is None


def test_the_drop_in_runs_within_its_budget_and_use_in_trl_sets_another(monkeypatch):
    """``chunked_log_probs`` hands ``fused_linear_logprobs`` the budget ``trl_chunk_bytes`` gives, and the
    head that ``use_in_trl(chunk_bytes=)`` installs (TRL's contract, its call signature) hands it that
    one; a bad budget is refused before anything is installed; the fields do not depend on it."""
    seen = []
    real = fused_linear_ce.trl_head.fused_linear_logprobs

    def spy(*args, **kwargs):
        seen.append(kwargs["chunk_bytes"])
        return real(*args, **kwargs)

    monkeypatch.setattr(fused_linear_ce.trl_head, "fused_linear_logprobs", spy)
    _restore_trl(monkeypatch)
    g = torch.Generator().manual_seed(4)
    hidden = torch.randn(40, 32, generator=g).to(DEVICE)
    weight = torch.randn(VOCAB, 32, generator=g).to(DEVICE)
    targets = torch.randint(0, VOCAB, (40,), generator=g).to(DEVICE)
    by_default = fused_linear_ce.ChunkedLogProbFunction.apply(hidden, weight, None, targets, 0.9, 32768)
    with pytest.raises(ValueError, match="chunk_bytes"):
        fused_linear_ce.use_in_trl(chunk_bytes=0)
    assert trl_utils._ChunkedLogProbFunction is not fused_linear_ce.ChunkedLogProbFunction
    small = 40 * 16 * 4  # blocks of 16 vocabulary columns
    previous = fused_linear_ce.use_in_trl(chunk_bytes=small)["trl.trainer.utils._ChunkedLogProbFunction"]
    head = trl_utils._ChunkedLogProbFunction
    assert previous is not head and head.chunk_bytes == small
    theirs = list(inspect.signature(trl.kernels.ChunkedLogProbFunction.forward).parameters.values())[1:]
    assert [p.name for p in inspect.signature(head.apply).parameters.values()] == [p.name for p in theirs]
    in_blocks = head.apply(hidden, weight, None, targets, 0.9, 32768)
    assert seen == [fused_linear_ce.trl_head.trl_chunk_bytes(hidden), small]
    assert seen[0] is None  # the package's defaults
    for mine, want in zip(in_blocks, by_default):
        assert torch.equal(mine, want)
    fused_linear_ce.use_in_trl()
    assert trl_utils._ChunkedLogProbFunction is fused_linear_ce.ChunkedLogProbFunction
