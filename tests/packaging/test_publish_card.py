"""scripts/make_card.py: the Hub card is the README under front matter (its sections in order, the
repo-only ones left out, clones pinned to the version branch), its assets go to `main` beside it, and
the CLI prints it. Sockets are refused throughout. The upload itself: test_publish.py."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
import yaml
from conftest import REPO
from hub_offline import load_script, refuse_network

upload = load_script("upload")
make_card = load_script("make_card")


@pytest.fixture(autouse=True)
def _no_network(monkeypatch):
    refuse_network(monkeypatch)


def test_card_is_the_readme_under_front_matter():
    card = make_card.render_card(REPO)
    _, front, body = card.split("---\n", 2)
    meta = yaml.safe_load(front)
    assert meta["license"] == json.loads((REPO / "metadata.json").read_text())["license"] == "apache-2.0"
    assert meta["library_name"] == "kernels"
    assert {"kernel", "triton", "cross-entropy"} <= set(meta["tags"])
    general = upload._general(REPO)
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    # Verbatim but for the one rewrite: clones of the Hub repo pinned to the version branch.
    readme = make_card.pin_clone_branch(readme, general["hub"]["repo-id"], general["version"])
    preamble, sections = make_card.split_sections(readme)
    assert body.lstrip().startswith(preamble)
    kept = [h for h, _ in sections if h not in make_card.REPO_ONLY_SECTIONS]
    assert set(make_card.REQUIRED_SECTIONS) <= set(kept)
    for heading, text in sections:
        assert (text in body) is (heading in kept), heading
    positions = [body.index(text) for heading, text in sections if heading in kept]
    assert positions == sorted(positions), "sections keep the README's order"
    assert "get_kernel(" in body and "|---" in dict(sections)["Memory and speed"]


def test_card_assets_are_uploaded_next_to_the_card():
    """Every relative link of the card (images, docs/*.md) goes to `main` beside it: none is broken
    on the Hub."""
    assets = make_card.card_assets(REPO)
    card = make_card.render_card(REPO)
    for rel in assets:
        assert (REPO / rel).is_file() and f"]({rel}" in card
    relative = {t.split("#", 1)[0] for t in re.findall(r"\]\(([^)\s]+)", card)
                if not re.match(r"^([a-z][a-z0-9+.-]*:|/|#)", t, re.IGNORECASE)}
    assert relative == set(assets)
    assert any(a.startswith("docs/") for a in assets)
    ops = upload.plan_operations(REPO, [])
    assert [op.path for op in ops if op.branch == "main"] == ["README.md", *assets]


def test_card_cli_prints_render_card():
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "make_card.py")], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == make_card.render_card(REPO)


def test_sections_ignore_headings_in_code_and_require_the_card_sections(tmp_path):
    text = "# t\nintro\n## A\n```bash\n## not a heading\n```\n## Clean room\nx\n"
    preamble, sections = make_card.split_sections(text)
    assert preamble == "# t\nintro"
    assert [h for h, _ in sections] == ["A", "Clean room"]
    assert "## not a heading" in sections[0][1]
    (tmp_path / "README.md").write_text(text)
    with pytest.raises(ValueError, match="lacks the section"):
        make_card.card_sections(tmp_path)


def test_card_clones_the_version_branch():
    """A plain clone of the Hub repo checks out `main`, which holds only the card: every clone command
    on the card names the version branch, where build/ is (the upload plan puts build/ there only)."""
    card = make_card.render_card(REPO)
    general = upload._general(REPO)
    clones = [line for line in card.splitlines() if "git clone" in line and general["hub"]["repo-id"] in line]
    for line in clones:
        assert f"git clone -b v{general['version']} " in line, line
    ops = upload.plan_operations(REPO, [])
    assert not [op.path for op in ops if op.branch == "main" and op.path.startswith("build/")]
    assert any(op.path == "build/torch-cuda/__init__.py" and op.branch == f"v{general['version']}" for op in ops)


@pytest.mark.parametrize(
    ("line", "pinned"),
    [
        ("git clone https://huggingface.co/org/k", "git clone -b v3 https://huggingface.co/org/k"),
        ("git clone --depth 1 https://huggingface.co/kernels/org/k.git d", "git clone -b v3 --depth 1 https://huggingface.co/kernels/org/k.git d"),
        ("git clone -b v2 https://huggingface.co/org/k", "git clone -b v2 https://huggingface.co/org/k"),
        ("git clone --branch=main https://hf.co/org/k", "git clone --branch=main https://hf.co/org/k"),
        ("git clone https://github.com/org/k", "git clone https://github.com/org/k"),
        ("git clone https://huggingface.co/org/k-other", "git clone https://huggingface.co/org/k-other"),
    ],
)


def test_pin_clone_branch(line, pinned):
    assert make_card.pin_clone_branch(line, "org/k", 3) == pinned
