"""Helpers for tests of the Hub path that must never reach the network.

* `load_script(name)`: imports scripts/<name>.py.
* `refuse_network(monkeypatch)`: any connect or name lookup (bar localhost) in this process fails the test.
* `guarded_env(tmp_path, ...)`: an environment for subprocesses with the same guard (a sitecustomize.py
  put first on PYTHONPATH), HF_HUB_OFFLINE=1 and the Hugging Face cache in tmp_path.
* `offline_hub(monkeypatch, home)`: offline mode with an empty cache under `home`, in the environment and
  in the constants the libraries read at import time, sockets refused, LOCAL_KERNELS unset.
* `version_branch_files(repo)`: what scripts/upload.py puts on the version branch (every build/<variant>,
  benchmarks/benchmark*.py) plus the `.gitattributes` a new Hub repo starts with.
* `simulate_cuda(monkeypatch, capability)` and `SIMULATED_CUDA` (the same, as code for a child process):
  torch reports a CUDA build with one GPU of that capability, so kernels' variant resolution and checks
  run as on that GPU; nothing launches.
* `RecordingHubApi`: stands in for `huggingface_hub.HfApi` in upload tests.
* `build_hub_cache(...)`: a Hugging Face cache laid out the way huggingface_hub 2.4 writes it for a
  `kernel`-type repo (checked against its sources, see docs/MAINTAINERS.md):

      <HF_HUB_CACHE>/kernels--<org>--<name>/          repo_folder_name(repo_id, repo_type="kernel")
          blobs/<git blob sha1>                       file contents (the etag of a non-LFS file)
          snapshots/<commit>/<path>                   relative symlinks to ../../blobs/<sha1>
          refs/<branch>                               the commit, no newline (written only when a
                                                      download asked for a branch name, e.g. "v1")
          trees/<commit>.json                         the branch's full file listing (2.4's tree cache)
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import socket
import sys
from datetime import datetime, timezone
from pathlib import Path

from huggingface_hub import constants
from huggingface_hub.file_download import repo_folder_name
from huggingface_hub.hf_api import CommitInfo, GitCommitInfo
from kernels_api import resolver

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def load_script(name: str):
    """Imports scripts/<name>.py as module `name` (registered, so dataclasses and re-imports work)."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


_GUARD = '''\
import socket

_connect = socket.socket.connect


def _refuse(self, address, *args, **kwargs):
    if self.family == getattr(socket, "AF_UNIX", None):
        return _connect(self, address, *args, **kwargs)
    raise OSError(f"network access refused in tests: {address!r}")


_getaddrinfo = socket.getaddrinfo


def _resolve(host, *args, **kwargs):
    if host in (None, "localhost", "127.0.0.1", "::1"):
        return _getaddrinfo(host, *args, **kwargs)
    raise OSError(f"network access refused in tests: name lookup of {host!r}")


socket.socket.connect = _refuse
socket.socket.connect_ex = _refuse
socket.getaddrinfo = _resolve
'''


def refuse_network(monkeypatch) -> None:
    connect = socket.socket.connect

    def refuse(self, address, *args, **kwargs):
        if self.family == getattr(socket, "AF_UNIX", None):
            return connect(self, address, *args, **kwargs)
        raise AssertionError(f"network access attempted in a test: {address!r}")

    getaddrinfo = socket.getaddrinfo

    def resolve(host, *args, **kwargs):
        if host in (None, "localhost", "127.0.0.1", "::1"):
            return getaddrinfo(host, *args, **kwargs)
        raise AssertionError(f"network access attempted in a test: name lookup of {host!r}")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket.socket, "connect_ex", refuse)
    monkeypatch.setattr(socket, "getaddrinfo", resolve)


def hf_env(hf_home: Path) -> dict[str, str]:
    """Offline mode with the cache under `hf_home` (what the libraries read at import time)."""
    return {"HF_HOME": str(hf_home), "HF_HUB_CACHE": str(hf_home / "hub"), "HF_HUB_OFFLINE": "1"}


def offline_hub(monkeypatch, home: Path) -> Path:
    """Offline mode with an empty cache under `home`, set both in the environment and in the constants
    the libraries read at import time; LOCAL_KERNELS unset so that the cache is what resolves; sockets
    refused. Returns the Hub cache folder."""
    for key, value in hf_env(home).items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("LOCAL_KERNELS", raising=False)
    monkeypatch.delenv("KERNELS_CACHE", raising=False)
    monkeypatch.setattr(constants, "HF_HOME", str(home))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(home / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    if hasattr(resolver, "CACHE_DIR"):  # 0.17 reads KERNELS_CACHE at import time, 0.19 on each call
        monkeypatch.setattr(resolver, "CACHE_DIR", None)  # KERNELS_CACHE unset: the HF hub cache
    refuse_network(monkeypatch)
    return home / "hub"


def simulate_cuda(monkeypatch, capability: tuple[int, int] = (9, 0)) -> None:
    """torch reports a CUDA build with one GPU of `capability` (default sm_90, the H100/H200)."""
    from simulated_gpu import SimulatedGpu

    SimulatedGpu(monkeypatch.setattr).cuda(capability)


# `simulate_cuda` at sm_90 for a child process (whose sys.path has tests/), before kernels loads anything.
SIMULATED_CUDA = f"""\
import sys
sys.path.insert(0, {str(Path(__file__).resolve().parent)!r})
from simulated_gpu import SimulatedGpu
SimulatedGpu.plain().cuda((9, 0))
"""


def version_branch_files(repo: Path) -> dict[str, bytes]:
    """What the version branch holds after scripts/upload.py (every build/<variant> folder, the
    benchmarks/benchmark*.py files), plus the .gitattributes a new Hub repo starts with."""
    upload = load_script("upload")
    branch = upload.version_branch(repo)
    ops = upload.plan_operations(repo, None)
    files = {op.path: op.source.read_bytes() for op in ops if op.action == "upload" and op.branch == branch}
    assert any(p.startswith("build/torch-cuda/") for p in files)
    files[".gitattributes"] = b"*.safetensors filter=lfs diff=lfs merge=lfs -text\n"
    return files


class RecordingHubApi:
    """Stands in for `huggingface_hub.HfApi`: records each call as `(name, {"args": positional, **keywords})`
    in `calls`. The branches `BRANCHES` exist, each holding the files `FILES` and the commits `HISTORY`
    ({branch: [GitCommitInfo], newest first}); `create_commit` puts a commit on top of its branch and
    answers a CommitInfo with its sha; `list_repo_commits` answers the branch's commits. Other methods
    answer None. The last instance is `RecordingHubApi.last` (upload.py makes its own)."""

    BRANCHES = ("main", "v1")
    FILES: tuple[str, ...] = ()
    HISTORY: dict[str, list[GitCommitInfo]] = {}
    last: "RecordingHubApi | None" = None

    def __init__(self, *args, **kwargs):
        self.calls: list[tuple[str, dict]] = []
        self.history = {branch: list(commits) for branch, commits in self.HISTORY.items()}
        RecordingHubApi.last = self

    def _record(self, name, args, kwargs):
        self.calls.append((name, {"args": args, **kwargs}))

    def list_repo_refs(self, *args, **kwargs):
        self._record("list_repo_refs", args, kwargs)
        branches = [type("Ref", (), {"name": name}) for name in self.BRANCHES]
        return type("Refs", (), {"branches": branches})

    def list_repo_files(self, *args, **kwargs):
        self._record("list_repo_files", args, kwargs)
        return list(self.FILES)

    def create_commit(self, repo_id, *, operations, commit_message, revision, **kwargs):
        self._record("create_commit", (repo_id,), dict(kwargs, operations=operations,
                                                       commit_message=commit_message, revision=revision))
        commits = self.history.setdefault(revision, [])
        sha = hashlib.sha1(f"{revision}\0{len(commits)}\0{commit_message}".encode()).hexdigest()
        commits.insert(0, GitCommitInfo(commit_id=sha, authors=[], created_at=datetime.now(timezone.utc),
                                        title=commit_message, message="", formatted_title=None,
                                        formatted_message=None))
        url = f"https://huggingface.co/{repo_id}/commit/{sha}"
        return CommitInfo(commit_url=url, commit_message=commit_message, commit_description="", oid=sha)

    def list_repo_commits(self, *args, revision=None, **kwargs):
        self._record("list_repo_commits", args, dict(kwargs, revision=revision))
        return list(self.history.get(revision, []))

    def __getattr__(self, name):
        return lambda *args, **kwargs: self._record(name, args, kwargs)


def guarded_env(tmp_path: Path, hf_home: Path, **extra: str) -> dict[str, str]:
    guard = tmp_path / "network_guard"
    guard.mkdir(exist_ok=True)
    (guard / "sitecustomize.py").write_text(_GUARD, encoding="utf-8")
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_KERNELS", "KERNELS_CACHE")}
    env.update(hf_env(hf_home))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(guard), env.get("PYTHONPATH")]))
    env.update(extra)
    return env


def git_blob_id(data: bytes) -> str:
    """The Hub's blob id (and cache etag) of a regular, non-LFS file: git's blob sha1."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def fake_commit(files: dict[str, bytes]) -> str:
    """A stable 40-hex commit id for a branch content (the cache only needs it to look like one)."""
    listing = "".join(f"{path}\0{git_blob_id(data)}\n" for path, data in sorted(files.items()))
    return hashlib.sha1(listing.encode("utf-8")).hexdigest()


def build_hub_cache(
    hub_cache: Path,
    repo_id: str,
    branch_files: dict[str, bytes],
    *,
    ref: str | None,
    downloaded: list[str] | None = None,
    repo_type: str = "kernel",
) -> tuple[str, Path]:
    """Writes the cache a download of `branch_files` (the whole content of one branch) leaves behind.

    `ref`: the branch name the download asked for (writes refs/<ref>), or None when it asked for the
    commit hash, as an online `get_kernel` does. `downloaded`: the paths actually fetched (default all;
    `get_kernel` fetches `build/<variant>/*` only). Returns `(commit, snapshot folder)`.
    """
    storage = hub_cache / repo_folder_name(repo_id=repo_id, repo_type=repo_type)
    commit = fake_commit(branch_files)
    snapshot = storage / "snapshots" / commit
    for path in sorted(branch_files if downloaded is None else downloaded):
        data = branch_files[path]
        blob = storage / "blobs" / git_blob_id(data)
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = snapshot / path
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    snapshot.mkdir(parents=True, exist_ok=True)
    if ref is not None:
        (storage / "refs").mkdir(parents=True, exist_ok=True)
        (storage / "refs" / ref).write_text(commit, encoding="utf-8")
    tree = {
        "format_version": 1,
        "files": {p: {"size": len(d), "blob_id": git_blob_id(d)} for p, d in sorted(branch_files.items())},
    }
    (storage / "trees").mkdir(parents=True, exist_ok=True)
    (storage / "trees" / f"{commit}.json").write_text(json.dumps(tree, indent=1), encoding="utf-8")
    return commit, snapshot
