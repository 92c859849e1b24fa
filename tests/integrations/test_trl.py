"""The TRL recipe (examples/trl_sft.py): same loss and metrics as SFTTrainer's own, and it trains."""

import importlib.util
import sys

import pytest
import torch

from conftest import DEVICE, REPO

trl = pytest.importorskip("trl")
transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")
datasets = pytest.importorskip("datasets")

import fused_linear_ce  # noqa: E402

VOCAB = 64


def _recipe():
    spec = importlib.util.spec_from_file_location("trl_sft_recipe", REPO / "examples" / "trl_sft.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["trl_sft_recipe"] = module
    spec.loader.exec_module(module)
    return module.FusedLossSFTTrainer


def _tokenizer():
    vocab = {f"t{i}": i for i in range(VOCAB - 2)} | {"<pad>": VOCAB - 2, "<eos>": VOCAB - 1}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")


def _model():
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                                      tie_word_embeddings=False, pad_token_id=VOCAB - 2, eos_token_id=VOCAB - 1)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).float()


def _dataset():
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(5, 15, (16,), generator=g).tolist()
    ids = [torch.randint(0, VOCAB - 2, (n,), generator=g).tolist() for n in lengths]
    return datasets.Dataset.from_dict({"input_ids": ids})


def _trainer(cls, tmp_path, **extra):
    args = trl.SFTConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=3, learning_rate=1e-2,
                         logging_steps=1, report_to=[], use_cpu=DEVICE.type == "cpu", save_strategy="no",
                         seed=0, data_seed=0, dataloader_drop_last=True)
    return cls(model=_model(), args=args, train_dataset=_dataset(), processing_class=_tokenizer(), **extra)


def test_recipe_matches_sfttrainer_loss_and_metrics_and_trains(tmp_path):
    fused = _trainer(_recipe(), tmp_path / "fused", fused_kernel=fused_linear_ce)
    plain = _trainer(trl.SFTTrainer, tmp_path / "plain")
    fused.train()
    plain.train()
    fused_logs = [e for e in fused.state.log_history if "loss" in e]
    plain_logs = [e for e in plain.state.log_history if "loss" in e]
    assert len(fused_logs) == len(plain_logs) == 3
    for ours, theirs in zip(fused_logs, plain_logs):
        for key in ("loss", "mean_token_accuracy", "entropy"):
            assert ours[key] == pytest.approx(theirs[key], rel=2e-3, abs=1e-4), (key, ours, theirs)
    assert fused_logs[-1]["loss"] < fused_logs[0]["loss"]
