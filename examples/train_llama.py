"""A real training run: a small Llama-style causal LM with the Llama-3 vocabulary (128256), trained
twice from the same seed on the same synthetic text, once with transformers' own loss (logits in
bf16 under autocast, upcast to fp32 for the cross-entropy) and once with fused-linear-ce on the final
hidden states and the lm-head weight. Writes the log (JSON) and a PNG of the two loss curves with
the peak memory of each.

    python3 examples/train_llama.py --out examples/results          # H200: ~2 x 300 steps
    python3 examples/train_llama.py --tiny --steps 3 --out /tmp/x   # CPU smoke test (interpreter)

Synthetic text: sequences from a fixed random bigram model over 4096 tokens spread across the whole
vocabulary (each has 8 likely successors with Zipf weights), so the loss falls from log(128256) ~
11.8 towards the bigram entropy as the model learns which tokens occur and then the transitions.

A third run, "torch-fp32-head", is transformers' loss with the lm-head product in fp32 (no autocast
there): it differs from "torch" only by rounding, so the spread between the two is the bf16 noise the
fused curve is compared with.
"""

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "torch-ext"))
from fused_linear_ce import fused_linear_cross_entropy  # noqa: E402


def bigram_batches(vocab, batch, seq, steps, seed, device):
    """Yields (input_ids, labels) drawn from a fixed random bigram model; the same stream for any
    run with the same seed."""
    g = torch.Generator().manual_seed(seed)
    active = torch.randperm(vocab, generator=g)[: min(vocab, 4096)]
    successors = torch.full((vocab, 8), 0, dtype=torch.int64)
    successors[active] = active[torch.randint(0, len(active), (len(active), 8), generator=g)]
    probs = 1.0 / torch.arange(1, 9, dtype=torch.float64)
    probs = probs / probs.sum()
    for _ in range(steps):
        tokens = torch.empty(batch, seq, dtype=torch.int64)
        tokens[:, 0] = active[torch.randint(0, len(active), (batch,), generator=g)]
        choice = torch.multinomial(probs.expand(batch * seq, 8), 1, replacement=True, generator=g).view(batch, seq)
        for t in range(1, seq):
            tokens[:, t] = successors[tokens[:, t - 1], choice[:, t]]
        tokens = tokens.to(device)
        yield tokens, tokens.clone()


def bigram_entropy():
    p = 1.0 / torch.arange(1, 9, dtype=torch.float64)
    p = p / p.sum()
    return float(-(p * p.log()).sum())


def build_model(args, device):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.hidden * 8 // 3 // 64 * 64 or 64,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.heads // 4 or 1,
        max_position_embeddings=args.seq, tie_word_embeddings=False,
    )
    torch.manual_seed(args.seed)
    return LlamaForCausalLM(cfg).to(device)


def train(loss_kind, args, device):
    model = build_model(args, device)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / args.warmup))
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")
    losses, times = [], []
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    for step, (ids, labels) in enumerate(bigram_batches(args.vocab, args.batch, args.seq, args.steps, args.seed, device)):
        t0 = time.perf_counter()
        with autocast:
            if loss_kind == "torch":
                loss = model(input_ids=ids, labels=labels).loss
            elif loss_kind == "torch-fp32-head":
                hidden = model.model(input_ids=ids).last_hidden_state
                with torch.autocast(device.type, enabled=False):
                    logits = hidden.float() @ model.lm_head.weight.T
                loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())
            else:
                hidden = model.model(input_ids=ids).last_hidden_state
                loss = fused_linear_cross_entropy(hidden, model.lm_head.weight, labels, shift=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        times.append(time.perf_counter() - t0)
        if step % 25 == 0 or step == args.steps - 1:
            print(f"{loss_kind:6s} step {step:4d} loss {losses[-1]:.4f} {times[-1] * 1e3:.0f} ms", flush=True)
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else float("nan")
    del model, opt
    return dict(loss=losses, step_s=times, peak_gib=peak,
                median_step_ms=1e3 * sorted(times[len(times) // 5:])[len(times[len(times) // 5:]) // 2])


def check_gradients(args, device):
    """One batch, three losses on the same model: transformers' own under autocast, ours under
    autocast, and transformers' own in fp32 without autocast (the reference). Prints each
    parameter group's gradient error against the reference and the losses."""
    model = build_model(args, device)
    ids, labels = next(bigram_batches(args.vocab, args.batch, args.seq, 1, args.seed, device))
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")

    def grads(kind, use_autocast):
        model.zero_grad(set_to_none=True)
        with autocast if use_autocast else torch.autocast(device.type, enabled=False):
            if kind == "torch":
                loss = model(input_ids=ids, labels=labels).loss
            else:
                hidden = model.model(input_ids=ids).last_hidden_state
                loss = fused_linear_cross_entropy(hidden, model.lm_head.weight, labels, shift=True)
        loss.backward()
        return loss.item(), {n: p.grad.detach().double().clone() for n, p in model.named_parameters()}

    ref_loss, ref = grads("torch", False)
    out = {}
    for kind in ("torch", "fused"):
        loss, g = grads(kind, True)
        groups = {}
        for name, t in g.items():
            key = "lm_head" if "lm_head" in name else ("embed" if "embed" in name else "layers")
            num, den = groups.get(key, (0.0, 0.0))
            groups[key] = (num + (t - ref[name]).square().sum().item(), den + ref[name].square().sum().item())
        out[kind] = dict(loss=loss, **{k: (n / d) ** 0.5 for k, (n, d) in groups.items()})
        print(f"{kind:6s} (autocast bf16) loss {loss:.5f} (fp32 {ref_loss:.5f}); gradient error vs fp32: "
              + ", ".join(f"{k} {v:.2e}" for k, v in out[kind].items() if k != "loss"), flush=True)
    return out


def plot(log, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for kind, style in (("torch", "-"), ("torch-fp32-head", ":"), ("fused", "--")):
        r = log["runs"][kind]
        ax.plot(r["loss"], style, lw=1.2,
                label=f"{kind}: peak {r['peak_gib']:.1f} GiB, {r['median_step_ms']:.0f} ms/step")
    ax.axhline(log["bigram_entropy"], color="gray", lw=0.8, ls=":", label="bigram entropy (floor)")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    m = log["meta"]
    ax.set_title(f"Llama {m['layers']}L h{m['hidden']} V={m['vocab']}, {m['batch']}x{m['seq']} tokens/step, "
                 f"{m['gpu']}", fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="examples/results")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tiny", action="store_true", help="CPU smoke size")
    ap.add_argument("--check-gradients", action="store_true", help="compare one batch's gradients and stop")
    args = ap.parse_args()
    if args.tiny:
        args.vocab, args.hidden, args.layers, args.heads, args.batch, args.seq = 512, 64, 1, 4, 2, 16
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    import transformers

    if args.check_gradients:
        check_gradients(args, device)
        return
    runs = {kind: train(kind, args, device) for kind in ("torch", "torch-fp32-head", "fused")}
    a, b = torch.tensor(runs["torch"]["loss"]), torch.tensor(runs["fused"]["loss"])
    gap = (a - b).abs()
    noise = (a - torch.tensor(runs["torch-fp32-head"]["loss"])).abs()
    log = dict(
        meta=dict(vars(args), gpu=torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                  torch=torch.__version__, transformers=transformers.__version__,
                  date=time.strftime("%Y-%m-%d")),
        bigram_entropy=bigram_entropy(), log_vocab=math.log(args.vocab),
        max_abs_gap=gap.max().item(), mean_abs_gap_last50=gap[-50:].mean().item(),
        noise_max_abs_gap=noise.max().item(), noise_mean_abs_gap_last50=noise[-50:].mean().item(), runs=runs,
    )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "train_llama.json").write_text(json.dumps(log, indent=1))
    plot(log, out / "train_llama.png")
    print(f"torch vs fused: max |loss gap| {log['max_abs_gap']:.4f}, mean over the last 50 steps "
          f"{log['mean_abs_gap_last50']:.4f}; torch vs torch-fp32-head (the noise): {log['noise_max_abs_gap']:.4f}, "
          f"{log['noise_mean_abs_gap_last50']:.4f}; peak torch {runs['torch']['peak_gib']:.2f} GiB, fused "
          f"{runs['fused']['peak_gib']:.2f} GiB")


if __name__ == "__main__":
    main()
