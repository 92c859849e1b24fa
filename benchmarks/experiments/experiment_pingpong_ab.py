"""The package's forward sweep as the Hopper ping-pong kernel (``pingpong.py``) against the Triton
sweep, side by side in one process (``FUSED_LINEAR_CE_PINGPONG=0`` switches it off per call), at
every H: where does the bucket end? One GPU call.

Prediction (``experiment_gluon_sweep.py``, at commit 3502f5a; NOTES v23): at S3 (H = 2048) the plain
forward drops from 1.20x to ~1.04x one matmul and the default loss step by the same ~2.5 ms; with
metrics (the per-token SFT fields) it is ~3% slower. S1 / S2 measured slower there, but that kernel
spilled 240 bytes of registers whenever V was a multiple of its 256-column tiles (S1, S2; not S3), which
the shipped kernel does not: measured again here with the bucket opened to every H.

    python3 benchmarks/experiments/experiment_pingpong_ab.py --out $OUT/pingpong_ab
"""

import argparse
import contextlib
import json
import os
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "torch-ext"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench import SHAPES, versions  # noqa: E402 - before triton: sets TRITON_INTERPRET=1 without a GPU
from experiment_common import interleaved, median  # noqa: E402

import torch  # noqa: E402

from fused_linear_ce import configs, fused_linear_cross_entropy, fused_linear_logprobs  # noqa: E402

EXTRA = {"S3h1024": (16384, 1024, 151936)}  # a small model's lm-head (Qwen2.5-0.5B-like H, Qwen vocabulary)


def switched(on: bool, fn):
    """``fn`` run with the ping-pong sweep on or off."""
    def run():
        os.environ["FUSED_LINEAR_CE_PINGPONG"] = "1" if on else "0"
        try:
            return fn()
        finally:
            os.environ.pop("FUSED_LINEAR_CE_PINGPONG", None)
    return run


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="S3,S3h1024,S1,S2")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--workloads", default="log_probs,sft fields,loss,sft,grpo",
                    help="comma-separated among: log_probs, sft fields, loss, sft, grpo")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    from tune import problem

    every_h = contextlib.ExitStack()  # held to the end of the run: the ping-pong sweep at every H,
    everywhere = replace(configs.pingpong(1), max_h=1 << 30)  # to find its bucket's end
    every_h.enter_context(configs.override("sm90", pingpong=everywhere))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for shape in args.shapes.split(","):
        n, h, v = SHAPES.get(shape) or EXTRA[shape]
        hidden, weight, targets = problem(n, h, v)
        mm = median(interleaved({"mm": lambda: hidden @ weight.T}, rounds=1)["mm"])
        rows_ref = torch.arange(256, device="cuda")
        z = hidden[rows_ref].double() @ weight.double().T
        lp_ref = z.gather(1, targets[rows_ref, None])[:, 0] - torch.logsumexp(z, dim=1)

        def logprobs(outputs):
            def run():
                with torch.no_grad():
                    return fused_linear_logprobs(hidden, weight, targets, outputs=outputs)
            return run

        def loss_step():
            hd, wd = hidden.detach().requires_grad_(True), weight.detach().requires_grad_(True)
            fused_linear_cross_entropy(hd, wd, targets).backward()

        adv = torch.randn(n, device="cuda")

        def per_token_step(grpo, chunk_bytes=None, trl=None):
            outputs = ("log_probs", "entropy") if grpo else ("log_probs", "entropy", "is_top1")

            def run():
                hd, wd = hidden.detach().requires_grad_(True), weight.detach().requires_grad_(True)
                if trl is not None:  # TRL's head, a black box: (log_probs, entropy, ...) in its order
                    lp, ent = trl.apply(hd, wd, None, targets, 1.0, 32768, None, 1.0, outputs[1:])[:2]
                else:
                    out = fused_linear_logprobs(hd, wd, targets, outputs=outputs, chunk_bytes=chunk_bytes)
                    lp, ent = out["log_probs"], out["entropy"]
                loss = -(lp * adv).mean() - 0.01 * ent.mean() if grpo else -lp.mean()
                loss.backward()
            return run

        work = {"log_probs fwd": logprobs(("log_probs",)),
                "sft fields fwd": logprobs(("log_probs", "entropy", "is_top1")),
                "loss fwd+bwd (default)": loss_step,
                "sft fwd+bwd (default)": per_token_step(False),
                "grpo fwd+bwd (default)": per_token_step(True),
                "sft fwd+bwd (192 MiB)": per_token_step(False, 192 << 20),
                "grpo fwd+bwd (192 MiB)": per_token_step(True, 192 << 20)}
        work = {k: w for k, w in work.items() if k.split(" (")[0].split(" fwd")[0] in args.workloads.split(",")}
        try:
            from trl.kernels import ChunkedLogProbFunction as trl_head
        except Exception:
            trl_head = None
        for name, fn in work.items():
            runs = {"triton": switched(False, fn), "pingpong": switched(True, fn)}
            if trl_head is not None and "fwd+bwd" in name and not name.startswith("loss"):
                runs["trl"] = per_token_step(name.startswith("grpo"), trl=trl_head)
            times = interleaved(runs, rounds=args.rounds, rep=60 if "bwd" not in name else 400)
            row = dict(shape=shape, n=n, h=h, v=v, workload=name, matmul_ms=mm,
                       **{k: median(t) for k, t in times.items()}, rounds=times)
            if "bwd" not in name:
                a, b = runs["triton"](), runs["pingpong"]()
                row["lp_err_triton"] = float((a["log_probs"][rows_ref].double() - lp_ref).abs().max())
                row["lp_err_pingpong"] = float((b["log_probs"][rows_ref].double() - lp_ref).abs().max())
                row["lp_max_diff"] = float((a["log_probs"] - b["log_probs"]).abs().max())
                if "entropy" in a:
                    row["entropy_max_diff"] = float((a["entropy"] - b["entropy"]).abs().max())
                    row["top1_differs"] = int((a["is_top1"] != b["is_top1"]).sum())
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "rounds"}), flush=True)
        del hidden, weight, targets
        torch.cuda.empty_cache()
    (out / "experiment_pingpong_ab.json").write_text(json.dumps(dict(meta=versions(), rows=rows), indent=1))
    print(f"{'shape':8} {'workload':24} {'mm':>6} {'triton':>7} {'pingpong':>8} {'change':>7}  notes")
    for r in rows:
        note = " ".join(f"{k}={r[k]:.1e}" for k in ("lp_err_triton", "lp_err_pingpong", "lp_max_diff") if k in r)
        note += f" trl={r['trl']:.2f}" if "trl" in r else ""
        print(f"{r['shape']:8} {r['workload']:24} {r['matmul_ms']:6.2f} {r['triton']:7.2f} {r['pingpong']:8.2f} "
              f"{(r['pingpong'] / r['triton'] - 1) * 100:+6.1f}%  {note}")


if __name__ == "__main__":
    main()
