"""docs/development.md is a map: it names every file of the package, of scripts/, of benchmarks/ and
examples/ and the shared files of tests/; every ``module.name`` it cites in the package exists; and
every duration it quotes is one testing.md states."""

import importlib
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
GUIDE = (REPO / "docs" / "development.md").read_text(encoding="utf-8")
PACKAGE = REPO / "torch-ext" / "fused_linear_ce"
CODE = re.findall(r"`([^`\n]+)`", GUIDE)  # the guide's inline code spans
NAMED = set(CODE) | {Path(span).name for span in CODE}


def _files(folder: str, *patterns: str) -> list[str]:
    return sorted(p.name for pattern in patterns for p in (REPO / folder).glob(pattern) if p.is_file())


@pytest.mark.parametrize("folder, patterns", [
    ("torch-ext/fused_linear_ce", ("*.py",)),
    ("scripts", ("*",)),
    ("benchmarks", ("*.py", "*.sh")),
    ("examples", ("*.py",)),
    ("tests", ("*.py", "*.json")),
])
def test_every_file_is_named(folder, patterns):
    files = _files(folder, *patterns)
    assert files, folder
    # "demo.sh / demo.py" style cells name two files in one span
    named = NAMED | {part.strip(" `") for span in CODE for part in span.split("/")}
    assert [f for f in files if f not in named] == [], f"docs/development.md does not name these files of {folder}/"


def test_the_test_folders_are_named():
    folders = sorted(p.name for p in (REPO / "tests").iterdir() if p.is_dir() and any(p.glob("test_*.py")))
    assert folders and [f for f in folders if f"tests/{f}/" not in GUIDE] == []


def _citations() -> list[tuple[str, str]]:
    """``module.name`` in the guide's code spans, where module is a file of the package."""
    modules = {p.stem for p in PACKAGE.glob("*.py")}
    found = {m for span in CODE for m in re.findall(r"(?<![\w.])([a-z_]+)\.([A-Za-z_]\w*)", span)}
    return sorted((module, name) for module, name in found if module in modules and name != "py")


def test_every_cited_name_exists():
    cited = _citations()
    assert len(cited) >= 20, cited  # the recipes cite ~35: fewer means the pattern no longer finds them
    missing = [f"{m}.{n}" for m, n in cited if not hasattr(importlib.import_module(f"fused_linear_ce.{m}"), n)]
    assert missing == [], "docs/development.md cites names the package does not have"


DURATION = r"~?\d+(?:\.\d+)? (?:min|s)\b"  # "~6 min", "45 s"


def test_every_timing_is_testing_mds():
    """The guide quotes only durations that testing.md (where the suite's timings are kept) states."""
    testing = (REPO / "docs" / "testing.md").read_text(encoding="utf-8")
    ours = set(re.findall(DURATION, GUIDE))
    assert ours, "the guide gives no timing of the test command"
    assert sorted(ours - set(re.findall(DURATION, testing))) == []
