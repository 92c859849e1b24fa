"""Every experiment script in benchmarks/experiments/ prints its command line (``--help``) on a CPU, and
the folder's README indexes it. The experiments measure on a GPU; ``--help`` imports everything a run
imports (the package's modules, the harness, the peers' optional imports), so a script that no longer
matches the package fails here first."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
EXPERIMENTS = REPO / "benchmarks" / "experiments"
SHARED = "experiment_common.py"  # the scripts' shared pieces, no command line of its own
SCRIPTS = sorted(p.name for p in EXPERIMENTS.glob("experiment_*.py") if p.name != SHARED)
LIMIT_S = 600  # every script's --help in one interpreter: ~10 s on two CPU cores

# One interpreter for all scripts (torch imports once); each script starts from the sys.path that
# `python3 script` gives it and without the repository's modules a previous script imported, so none
# relies on another's imports.
RUNNER = r"""
import contextlib, io, json, os, runpy, sys
repo, scripts = sys.argv[1], sys.argv[2:]
path0, results = list(sys.path[1:]), {}
for script in scripts:
    sys.path[:] = [os.path.dirname(script), *path0]  # as `python3 script`: its folder first
    for name in [n for n, m in sys.modules.items() if (getattr(m, "__file__", None) or "").startswith(repo)]:
        del sys.modules[name]
    sys.argv, out, code = [script, "--help"], io.StringIO(), None
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            runpy.run_path(script, run_name="__main__")
    except SystemExit as exc:
        code = exc.code
    except BaseException as exc:
        code = f"{type(exc).__name__}: {exc}"
    results[script] = [code, out.getvalue()]
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def helps() -> dict:
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", TRITON_INTERPRET="1")  # a CPU, even on a GPU machine
    paths = [str(EXPERIMENTS / s) for s in SCRIPTS]
    done = subprocess.run([sys.executable, "-c", RUNNER, str(REPO), *paths], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=LIMIT_S)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return {Path(k).name: v for k, v in json.loads(done.stdout.splitlines()[-1]).items()}


def test_there_are_experiments():
    """The glob finds the scripts (18 of them; fewer than 10 means the folder moved)."""
    assert len(SCRIPTS) >= 10, SCRIPTS


@pytest.mark.parametrize("script", SCRIPTS)
def test_help_runs_on_a_cpu(helps, script):
    code, output = helps[script]
    assert code in (0, None) and "usage:" in output, f"{script} --help: exit {code!r}\n{output[-3000:]}"


def test_the_readme_indexes_every_experiment():
    readme = (EXPERIMENTS / "README.md").read_text(encoding="utf-8")
    assert [s for s in SCRIPTS if f"`{s}`" not in readme] == []
