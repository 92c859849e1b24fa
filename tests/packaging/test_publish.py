"""scripts/upload.py, without the Hub.

The dry run is checked line for line on a clean clone of this repo (HEAD), with a listing of the
remote branch that has stale files; the refusals (dirty tree, stale build/, invalid metadata, stale
digest, a Nix build that drifted) are checked on clones changed accordingly; the real upload path runs
against a recording stand-in for `HfApi`. Sockets are refused throughout. The card the upload puts on
`main`: test_publish_card.py; the variant's digest and compatibility package: test_publish_variant.py.
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import huggingface_hub
import pytest
from huggingface_hub import CommitOperationAdd, CommitOperationDelete
from huggingface_hub.errors import HfHubHTTPError
from hub_offline import RecordingHubApi, guarded_env, load_script, refuse_network

REPO = Path(__file__).resolve().parents[2]
UPLOAD = REPO / "scripts" / "upload.py"
upload = load_script("upload")
make_card = load_script("make_card")
sync_build = load_script("sync_build")
GIT_ID = ["-c", "user.name=publish-test", "-c", "user.email=publish-test@example.invalid"]
REMOTE = [
    ".gitattributes",
    "README.md",
    "benchmarks/benchmark_old.py",
    "benchmarks/results.json",
    "build/torch-cuda/__init__.py",
    "build/torch-cuda/old_module.py",
    "build/torch-universal/fused_linear_ce/__init__.py",
]


@pytest.fixture(autouse=True)
def _no_network(monkeypatch):
    refuse_network(monkeypatch)


@pytest.fixture
def env(tmp_path) -> dict:
    """For subprocesses: sockets refused, Hub offline, no token."""
    env = guarded_env(tmp_path, tmp_path / "hf_home")
    env.pop("HF_TOKEN", None)
    return env


def test_the_network_guard_is_on(env):
    with pytest.raises(AssertionError, match="network access attempted"):
        socket.create_connection(("huggingface.co", 443), timeout=1)
    code = "import socket; socket.create_connection(('huggingface.co', 443), timeout=1)"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert proc.returncode != 0 and "network access refused" in proc.stderr


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *GIT_ID, *args], capture_output=True, text=True, check=True).stdout


@pytest.fixture
def clone(tmp_path) -> Path:
    """A clean clone of HEAD (the committed state: what CI publishes)."""
    subprocess.run(["git", "clone", "--quiet", str(REPO), str(tmp_path / "clone")], check=True)
    return tmp_path / "clone"


def commit_all(repo: Path, message: str) -> None:
    git(repo, "add", "-A")
    git(repo, "commit", "--quiet", "-m", message)


def run_upload(repo: Path, *args: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(UPLOAD), "--repo", str(repo), *args], capture_output=True, text=True, env=env, timeout=300
    )


def branch_lines(repo: Path) -> list[str]:
    """The uploads to the version branch, derived independently: what sync_build says build/ must
    hold, and the benchmarks/benchmark*.py files (what kernel-builder uploads too)."""
    build = [p for p in sync_build.expected_files(repo) if p.startswith("build/")]
    bench = [p.relative_to(repo).as_posix() for p in (repo / "benchmarks").glob("benchmark*.py")]
    return [f"upload {p}" for p in sorted(build + bench)]


def card_lines(repo: Path) -> list[str]:
    return ["upload README.md -> main"] + [f"upload {p} -> main" for p in make_card.card_assets(repo)]


# --- the plan ------------------------------------------------------------------------------------------


def test_dry_run_lists_exact_operations_with_stale_files(clone, tmp_path, env):
    bench = clone / "benchmarks" / "benchmark_flce.py"
    bench.write_text("# a kernels.Benchmark subclass would go here\n")
    commit_all(clone, "add a benchmark")
    pycache = clone / "build" / "torch-cuda" / "__pycache__"
    pycache.mkdir()
    (pycache / "api.cpython-311.pyc").write_bytes(b"\0")  # git-ignored: the tree stays clean
    remote = tmp_path / "remote.txt"
    remote.write_text("# files on branch v1\n" + "\n".join(REMOTE) + "\n")

    proc = run_upload(clone, "--dry-run", "--remote-files", str(remote), env=env)

    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == [
        "create-repo kernels/trl-lib/fused-linear-ce",
        "delete benchmarks/benchmark_old.py",
        "delete build/torch-cuda/old_module.py",
        "delete build/torch-universal/fused_linear_ce/__init__.py",
        *branch_lines(clone),
        *card_lines(clone),
    ]
    assert "upload benchmarks/benchmark_flce.py" in proc.stdout
    assert "upload build/torch-cuda/metadata.json" in proc.stdout
    assert "upload build/torch-cuda/__init__.py" in proc.stdout
    assert "upload README.md -> main" in proc.stdout


def test_dry_run_without_listing_creates_the_branch(clone, env):
    proc = run_upload(clone, "--dry-run", env=env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == [
        "create-repo kernels/trl-lib/fused-linear-ce",
        "create-branch v1",
        *branch_lines(clone),
        *card_lines(clone),
    ]
    assert "assuming branch v1 does not exist" in proc.stderr


def test_plan_operations_is_pure_and_carries_the_content(clone):
    ops = upload.plan_operations(clone, REMOTE, repo_id="someone/other", repo_type="model")
    assert str(ops[0]) == "create-repo someone/other"
    uploads = {op.path: op for op in ops if op.action == "upload" and op.branch == "v1"}
    for path, op in uploads.items():
        assert op.source == clone / path and op.data is None
    readme = next(op for op in ops if op.path == "README.md")
    assert readme.branch == "main" and readme.data == make_card.render_card(clone).encode("utf-8")
    assert upload.plan_operations(clone, REMOTE) == upload.plan_operations(clone, REMOTE)


class RecordingApi(RecordingHubApi):
    """The Hub stand-in with both branches holding `REMOTE`."""

    FILES = tuple(REMOTE)


def test_upload_calls_the_hub_api_as_planned(clone, monkeypatch, capsys):
    monkeypatch.setattr(huggingface_hub, "HfApi", RecordingApi)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    assert upload.main(["--repo", str(clone), "--token", "hf_test"]) == 0
    calls = RecordingApi.last.calls
    assert [name for name, _ in calls] == [
        "list_repo_refs", "list_repo_files", "create_repo", "create_commit", "list_repo_commits", "create_commit",
    ]
    assert all(kw.get("repo_type") == "kernel" and kw.get("token") == "hf_test" for _, kw in calls)
    assert calls[2][1]["exist_ok"] is True and calls[1][1]["revision"] == "v1"
    (_, branch_commit), (_, main_commit) = calls[3], calls[5]
    assert branch_commit["revision"] == "v1" and main_commit["revision"] == "main"
    deleted = [op.path_in_repo for op in branch_commit["operations"] if isinstance(op, CommitOperationDelete)]
    added = [op.path_in_repo for op in branch_commit["operations"] if isinstance(op, CommitOperationAdd)]
    assert deleted == [
        "benchmarks/benchmark_old.py",
        "build/torch-cuda/old_module.py",
        "build/torch-universal/fused_linear_ce/__init__.py",
    ]
    assert added == [line.split(" ", 1)[1] for line in branch_lines(clone)]
    card = main_commit["operations"][0]
    releases = upload.release_history(RecordingApi.last, clone, "trl-lib/fused-linear-ce", "kernel", "hf_test")
    assert card.path_in_repo == "README.md" and card.path_or_fileobj == make_card.render_card(clone, releases).encode()
    assert branch_commit["commit_message"].startswith("Upload fused-linear-ce v1 from " + git(clone, "rev-parse", "HEAD").strip())
    pinned = RecordingApi.last.history["v1"][0].commit_id
    assert f'branch v1 is at commit {pinned}: pin this release with revision="{pinned}"' in capsys.readouterr().out


def test_a_new_branch_drops_the_build_files_it_inherits_from_main(clone, monkeypatch, capsys):
    """A new branch starts as a copy of main: stale build/ files there are deleted, as kernel-builder does."""
    monkeypatch.setattr(RecordingApi, "BRANCHES", ["main"])
    monkeypatch.setattr(huggingface_hub, "HfApi", RecordingApi)
    assert upload.main(["--repo", str(clone), "--token", "hf_test"]) == 0
    calls = RecordingApi.last.calls
    assert [name for name, _ in calls] == [
        "list_repo_refs", "list_repo_files", "create_repo", "create_branch", "create_commit", "list_repo_commits",
        "create_commit",
    ]
    assert calls[1][1]["revision"] == "main" and calls[3][1]["branch"] == "v1"
    lines = capsys.readouterr().out.splitlines()
    assert lines[:3] == ["create-repo kernels/trl-lib/fused-linear-ce", "create-branch v1", "delete benchmarks/benchmark_old.py"]
    assert "delete build/torch-cuda/old_module.py" in lines


# --- refusals ---------------------------------------------------------------------------------------


def test_refuses_a_dirty_tree(clone, env):
    with open(clone / "README.md", "a", encoding="utf-8") as f:
        f.write("\nlocal edit\n")
    (clone / "notes.txt").write_text("untracked\n")
    proc = run_upload(clone, "--dry-run", env=env)
    assert proc.returncode == 2 and proc.stdout == ""
    assert "refusing to publish" in proc.stderr and "git working tree is dirty" in proc.stderr
    assert " M README.md" in proc.stderr and "?? notes.txt" in proc.stderr


def test_refuses_a_build_out_of_sync_with_the_sources(clone, env):
    with open(clone / "torch-ext" / "fused_linear_ce" / "api.py", "a", encoding="utf-8") as f:
        f.write("# changed without scripts/sync_build.py\n")
    commit_all(clone, "source change without sync")
    proc = run_upload(clone, "--dry-run", env=env)
    assert proc.returncode == 2 and proc.stdout == ""
    assert "build/ is out of sync with torch-ext/" in proc.stderr
    assert "differs: build/torch-cuda/api.py" in proc.stderr
    assert "dirty" not in proc.stderr


@pytest.mark.parametrize("breakage", ["missing-license", "version-not-int", "version-mismatch"])
def test_refuses_invalid_metadata(clone, breakage, env):
    for path in (clone / "metadata.json", clone / "build" / "torch-cuda" / "metadata.json"):
        meta = json.loads(path.read_text())
        if breakage == "missing-license":
            del meta["license"]
        elif breakage == "version-not-int":
            meta["version"] = "one"
        else:
            meta["version"] = 2  # build.toml still says 1
        path.write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
    commit_all(clone, f"break metadata: {breakage}")
    proc = run_upload(clone, "--dry-run", env=env)
    assert proc.returncode == 2 and proc.stdout == ""
    assert "invalid metadata: metadata.json:" in proc.stderr
    assert "invalid metadata: build/torch-cuda/metadata.json:" in proc.stderr
    expected = {
        "missing-license": "missing field `license`",
        "version-not-int": 'invalid type: string "one"',
        "version-mismatch": "do not match build.toml fused-linear-ce/1",
    }[breakage]
    assert expected in proc.stderr


def test_refuses_to_upload_without_a_token(clone, env):
    proc = run_upload(clone, env=env)
    assert proc.returncode == 2 and "no token" in proc.stderr


def test_refuses_a_stale_digest(clone, env):
    """A variant file changed after its metadata.json was written (build/ edited by hand, sync skipped
    for the metadata): the loader's re-hash disagrees, so the upload refuses."""
    variant = clone / "build" / "torch-cuda"
    with open(variant / "api.py", "a", encoding="utf-8") as f:
        f.write("# edited in build/\n")
    commit_all(clone, "edit build/ by hand")
    proc = run_upload(clone, "--dry-run", env=env)
    assert proc.returncode == 2 and proc.stdout == ""
    assert "stale digest: build/torch-cuda:" in proc.stderr and "api.py" in proc.stderr


def _http_error(status: int, server_message: str | None = None) -> HfHubHTTPError:
    """What huggingface_hub raises for a failed request (its transport's Response, faked: the error
    reads only `headers`, `request` and, in upload.py, `status_code`)."""
    response = SimpleNamespace(status_code=status, headers={}, request=None)
    return HfHubHTTPError(f"{status} Client Error: {server_message}", response=response, server_message=server_message)


@pytest.mark.parametrize("repo_type", ["kernel", "model"])
def test_a_403_says_what_to_do(clone, monkeypatch, capsys, repo_type):
    """The Hub refusing create_repo (namespace gate for kernel repos, or a token without write access)
    ends with exit 3 and an explanation, not a traceback; nothing is committed."""

    class ForbiddenApi(RecordingApi):
        def create_repo(self, *args, **kwargs):
            self._record("create_repo", args, kwargs)
            raise _http_error(403, "You don't have the rights to create a kernel")

    monkeypatch.setattr(huggingface_hub, "HfApi", ForbiddenApi)
    code = upload.main(["--repo", str(clone), "--token", "hf_test", "--repo-type", repo_type])
    assert code == 3
    calls = [name for name, _ in ForbiddenApi.last.calls]
    assert calls[-1] == "create_repo" and "create_commit" not in calls
    err = capsys.readouterr().err
    assert "HTTP 403" in err and "You don't have the rights to create a kernel" in err
    assert "may not write to the `trl-lib` namespace" in err
    if repo_type == "kernel":
        assert "gated for `trl-lib`" in err and "--repo-type model" in err
    else:
        assert "gated" not in err


def test_hub_refusal_message_leaves_other_errors_alone():
    assert upload.hub_refusal_message(_http_error(500), repo_id="a/b", repo_type="kernel") is None
    assert upload.hub_refusal_message(ValueError("x"), repo_id="a/b", repo_type="kernel") is None
    assert "HTTP 401" in upload.hub_refusal_message(_http_error(401), repo_id="a/b", repo_type="kernel")


# --- uploading a kernel-builder (Nix) build -----------------------------------------------------------


def fake_nix_build(tmp_path: Path) -> Path:
    """What `nix build .#bundle` leaves: each variant with kernel-builder's own _ops.py, compat module,
    id and a digest of its own files; benchmarks/ and a CARD.md beside them."""
    result = tmp_path / "result"
    for committed in sorted(p for p in (REPO / "build").iterdir() if p.is_dir()):
        variant = result / committed.name
        backend_id = f"_fused_linear_ce_{committed.name.removeprefix('torch-')}_0123abc"
        shutil.copytree(committed, variant, ignore=shutil.ignore_patterns("__pycache__"))
        (variant / "_ops.py").write_text(f"import torch\nops = torch.ops.{backend_id}\n")
        (variant / "fused_linear_ce" / "__init__.py").write_text("# kernel-builder's compat module\nfrom .. import *\n")
        meta = json.loads((variant / "metadata.json").read_text())
        meta.update(id=backend_id, digest=sync_build.hash_variant(variant))
        (variant / "metadata.json").write_text(json.dumps(meta, indent=2))
    shutil.copytree(REPO / "benchmarks", result / "benchmarks", ignore=shutil.ignore_patterns("__pycache__", "results"))
    (result / "CARD.md").write_text("card\n")
    return result


def test_dry_run_uploads_the_nix_build(clone, tmp_path, env):
    result = fake_nix_build(tmp_path)
    proc = run_upload(clone, "--dry-run", "--build-dir", str(result), env=env)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert not [line for line in lines if "CARD.md" in line or "build/benchmarks" in line]
    ops = upload.plan_operations(clone, [], build_dir=result)
    for variant in ("torch-cuda", "torch-rocm"):
        assert f"upload build/{variant}/_ops.py" in lines and f"upload build/{variant}/metadata.json" in lines
        meta = next(op for op in ops if op.path == f"build/{variant}/metadata.json")
        assert meta.source == result / variant / "metadata.json"


def test_refuses_a_nix_build_that_drifted_or_has_a_stale_digest(clone, tmp_path, env):
    result = fake_nix_build(tmp_path)
    with open(result / "torch-cuda" / "api.py", "a", encoding="utf-8") as f:
        f.write("# built from other sources\n")
    proc = run_upload(clone, "--dry-run", "--build-dir", str(result), env=env)
    assert proc.returncode == 2 and proc.stdout == ""
    assert "the Nix build differs from the committed build/: differs: torch-cuda/api.py" in proc.stderr
    assert "stale digest: result/torch-cuda:" in proc.stderr
