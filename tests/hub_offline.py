"""Helpers for tests of the Hub path that must never reach the network.

* `load_script(name)`: imports scripts/<name>.py.
* `refuse_network(monkeypatch)`: any connect or name lookup (bar localhost) in this process fails the test.
* `guarded_env(tmp_path, ...)`: an environment for subprocesses with the same guard (a sitecustomize.py
  put first on PYTHONPATH), HF_HUB_OFFLINE=1 and the Hugging Face cache in tmp_path.
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
from pathlib import Path

from huggingface_hub.file_download import repo_folder_name

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
