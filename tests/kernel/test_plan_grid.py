"""The planner's decisions on a grid of calls, held against plan_grid.json: loss, per-token and
divergence calls over shapes (tiny to 131072 x 4096 x 128256), dtypes, strategies, budgets,
options, wanted gradients, master weights and vocabulary shards, each with the interpreter's tiles
and with sm_90's; each plan also survives its encoding as the ops' arguments (``opargs``). The
fixture was recorded from the code before the plan was decided once per call (commit 8374131, by
the script in that commit), so a change of any decision fails here."""

import json
from dataclasses import asdict
from pathlib import Path

import pytest
import torch

from fused_linear_ce import device, opargs, plan
from fused_linear_ce.validate import Options

GRID = json.loads((Path(__file__).with_name("plan_grid.json")).read_text())
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _passes(p: plan.Plan) -> list:
    return [list(asdict(x).values()) for x in p.passes]


def _loss(c: dict) -> dict:
    opts = Options(reduction=c["reduction"], return_lse=c["return_lse"], softcap=c["softcap"],
                   label_smoothing=c["label_smoothing"], chunk_bytes=c["chunk_bytes"], strategy=c["strategy"])
    p = plan.plan_loss(opts, c["n"], c["v"], c["h"], DTYPES[c["dtype"]], tuple(c["needs"]), master=c["master"],
                       sharded=c["sharded"], bias=c["bias"])
    assert opargs.decode(p.mode, opargs.encode(p)) == p  # as the ops get it
    out = {"chunked": p.mode in plan.GRADIENTS_IN_FORWARD}
    if out["chunked"] and c["n"] > 0:
        out.update(lean=p.budget if p.mode == plan.LONG_CONTEXT else None,
                   slab=p.slab_rows if p.mode == plan.HOSTED else None, budget=p.budget, rows=p.rows,
                   head=[p.head_rows, p.slab_rows] if p.head_rows else None)
    elif not out["chunked"] and any(c["needs"]):
        out["passes"] = _passes(p)
    return out


def _tokens(c: dict) -> dict:
    outputs = ("log_probs", "entropy") if c["entropy"] else ("log_probs",)
    opts = Options(reduction="none", softcap=c["softcap"], chunk_bytes=c["chunk_bytes"], strategy=c["strategy"],
                   outputs=outputs)
    p = plan.plan_tokens(opts, c["n"], c["v"], c["h"], DTYPES[c["dtype"]], tuple(c["needs"]), master=c["master"],
                         sharded=c["sharded"])
    assert opargs.decode(p.mode, opargs.encode(p)) == p
    out = {"chunked": p.mode == plan.EXPONENTIALS}
    if any(c["needs"]):
        out["passes"] = _passes(p)
    return out


def _divergence(c: dict) -> dict:
    p = plan.plan_divergence(c["strategy"], c["reduction"], c["n"], c["v"], DTYPES[c["dtype"]], c["chunk_bytes"],
                             tuple(c["needs"]))
    assert opargs.decode_divergence(p.mode, opargs.encode_divergence(p)) == p
    back = p.backward
    return {"chunked": p.mode == plan.CHUNKED, "forward": [p.forward.rows, p.forward.group],
            "backward": [back.rows, back.group] if back is not None else None}


DECIDE = {"loss": _loss, "tokens": _tokens, "divergence": _divergence}


@pytest.mark.parametrize("kind", sorted(DECIDE))
def test_the_planner_decides_as_recorded(kind, monkeypatch):
    interpreted = device.interpreted
    names = GRID["fields"][kind]
    wrong, seen = [], 0
    for case_kind, values, want in GRID["cases"]:
        if case_kind != kind:
            continue
        case = dict(zip(names, values))
        seen += 1
        # sm_90's tables where the grid says "gpu" (no device: the family of None), else the interpreter's
        monkeypatch.setattr(device, "interpreted", (lambda: False) if case["gpu"] else interpreted)
        got = json.loads(json.dumps(DECIDE[kind](case)))
        if kind == "divergence":  # the resolved strategy acts only where a gradient is wanted: as the mode
            recorded = want.pop("strategy")
            assert not any(case["needs"]) or (recorded == "chunked") == got["chunked"], case
        if got != want:
            wrong.append((case, got, want))
    assert seen > 300
    assert not wrong, f"{len(wrong)} of {seen} decisions differ, the first: {wrong[0]}"
