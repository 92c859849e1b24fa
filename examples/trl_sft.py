"""Recipe: TRL's trainers (SFT, GRPO, RLOO, DPO, KTO) with fused-linear-ce as their fused LM head.

TRL 1.16 computes every trainer's per-token log-probs, entropy and top-1 through its own chunked head
(``trl.trainer.utils.add_fused_lm_head``). Two lines make that head run this kernel (fp32 logits,
no (N, V) tensor, both gradients), before the trainer is built:

    from kernels import get_kernel
    get_kernel("trl-lib/fused-linear-ce", version=1).use_in_trl()

    trainer = SFTTrainer(model=model, args=SFTConfig(...), train_dataset=ds)
    trainer.train()

``train`` below is that, runnable: ``python3 examples/trl_sft.py`` trains a tiny model for a few
steps on the CPU (the Triton interpreter) or a GPU. Tested in ``tests/integrations/test_trl.py``
against TRL's own head: same losses, metrics and gradients.
"""

import os
import sys
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def train(kernel, model, dataset, tokenizer, output_dir, **config):
    """SFTTrainer with ``kernel`` as its fused LM head; returns the trainer after ``train()``."""
    from trl import SFTConfig, SFTTrainer

    kernel.use_in_trl()
    args = SFTConfig(output_dir=str(output_dir), report_to=[], save_strategy="no",
                     use_cpu=not torch.cuda.is_available(), **config)
    trainer = SFTTrainer(model=model, args=args, train_dataset=dataset, processing_class=tokenizer)
    trainer.train()
    return trainer


if __name__ == "__main__":
    import tempfile

    import datasets
    import tokenizers
    import transformers

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "torch-ext"))
    import fused_linear_ce

    vocab = {f"t{i}": i for i in range(62)} | {"<pad>": 62, "<eos>": 63}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1, pad_token_id=62, eos_token_id=63)
    g = torch.Generator().manual_seed(0)
    rows = [torch.randint(0, 62, (int(n),), generator=g).tolist() for n in torch.randint(5, 15, (16,), generator=g)]
    with tempfile.TemporaryDirectory() as out:
        trainer = train(fused_linear_ce, transformers.LlamaForCausalLM(config), datasets.Dataset.from_dict(
            {"input_ids": rows}), tokenizer, out, per_device_train_batch_size=4, max_steps=3, logging_steps=1)
    for entry in trainer.state.log_history:
        if "loss" in entry:
            print({k: entry[k] for k in ("loss", "mean_token_accuracy", "entropy")})
