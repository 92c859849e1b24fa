#!/usr/bin/env python3
"""Publishes the kernel to the Hugging Face Hub, the way `kernel-builder upload` lays a kernel repo out.

* Branch `v<version>` (version from metadata.json) of a `kernel`-type repo gets exactly
  `build/<variant>/**` for every variant folder under build/ (`torch-cuda` and `torch-rocm`, one per
  build.toml backend; no `__pycache__/`, no `*.pyc`) and
  `benchmarks/benchmark*.py` if any; files under `build/` (and stale `benchmarks/benchmark*.py`) that
  the branch has but this checkout does not are deleted in the same commit. The repo and the branch
  are created when missing (a new branch starts from `main`'s head, as kernel-builder's does).
* Branch `main` gets the card as README.md (`scripts/make_card.py`, generated from README.md) and the
  images it shows. The card is written after the version branch's commit: its "Releases" section lists
  that branch's upload commits (`release_history`, from the Hub's commit history), the new one first.
* It prints the commit the version branch is at after the upload: the 40-hex sha users pin
  (`get_kernel(..., revision=...)`, `kernels.lock`). Each upload commit's title names the source
  commit it was built from (`release_title`).

It refuses (exit 2, nothing uploaded) when the metadata is invalid (kernels' own parser, as the loader
reads it), when build/ is out of sync with torch-ext/ (`scripts/sync_build.py --check`) or when the git
working tree is dirty (`git status --porcelain`). `--dry-run` runs the same checks and prints the
operations, one per line, without any network access; `--remote-files FILE` (paths on the version
branch, one per line) stands in for the Hub's listing so the deletions can be seen too. Without it a
dry run assumes the branch does not exist yet.

`--build-dir result` uploads the variants of a kernel-builder (Nix) build instead of the committed
`build/` (kernels' documented CI flow: nix build, copy into build/, upload); it is refused unless
`scripts/compare_nix_build.py` finds no drift between the two.

Usage:
    python3 scripts/upload.py --dry-run [--remote-files FILE] [--build-dir result]
    HF_TOKEN=... python3 scripts/upload.py [--repo-id ORG/NAME] [--repo-type kernel|model]

A 403 from the Hub (exit 3, a message naming the cause, `hub_refusal_message`) means the token may
not write to the namespace, or creating `kernel`-type repos is still gated for it (as for `trl-lib`
today): then publish the same layout with `--repo-type model` (docs/publishing.md).

Why this script is hand-written: it follows `kernel-builder upload` (same branch layout, same stale-file
deletion, card to `main`), but kernel-builder is a Nix-built Rust tool that is not installable from
PyPI on a CI runner without Nix, cannot fall back to a `model`-type repo while kernel repos are gated,
and does not refuse a stale or dirty checkout. The `kernels` package (0.17) has no upload command.
Everything it can take from the tools it does: the metadata is parsed by `kernels._rust.Metadata`, the
variant digest is checked with `kernels._rust.Digest`, and the Hub calls are `huggingface_hub.HfApi`.

As a module: `plan_operations(repo_root, remote_files)` (pure: reads the checkout only; its tail is
`card_operations(repo_root, releases)`), `preflight(repo_root)` (the refusals), `execute(operations,
api, ...)` (returns the commit of each branch), `release_history(...)`, `hub_refusal_message(...)`.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import os
import re
import subprocess
import sys
import tomllib
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import compare_nix_build  # noqa: E402
import make_card  # noqa: E402
import sync_build  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
MAIN = "main"
REPO_TYPE = "kernel"  # huggingface_hub.constants.REPO_TYPE_KERNEL
URL_PREFIX = {"kernel": "kernels/", "model": ""}  # huggingface_hub.constants.REPO_TYPES_URL_PREFIXES
BENCHMARK_GLOB = "benchmark*.py"
# The title of an upload commit on the version branch; `release_history` reads releases back from it.
RELEASE_TITLE = "Upload {name} {branch} from {source}"


@dataclass(frozen=True)
class Operation:
    """One step. `action`: create-repo | create-branch | upload | delete. `path`: the repo id, the branch
    or the path in the repo. `branch`: where an upload/delete goes. `source`/`data`: what is uploaded."""

    action: str
    path: str
    branch: str | None = None
    source: Path | None = None
    data: bytes | None = None

    def __str__(self) -> str:
        line = f"{self.action} {self.path}"
        return f"{line} -> {self.branch}" if self.branch == MAIN else line


def _general(repo: Path) -> dict:
    return tomllib.loads((repo / "build.toml").read_text(encoding="utf-8"))["general"]


def default_repo_id(repo: Path = REPO) -> str:
    return _general(repo)["hub"]["repo-id"]


def version_branch(repo: Path = REPO) -> str:
    return f"v{json.loads((repo / 'metadata.json').read_text(encoding='utf-8'))['version']}"


def _ignored(rel: Path) -> bool:
    return "__pycache__" in rel.parts or rel.suffix == ".pyc"


def _variant_folders(build: Path, *, nix: bool) -> list[Path]:
    """Variant folders of a build tree: every folder of build/; in a Nix result, those that hold a
    metadata.json (the result also has benchmarks/ and maybe CARD.md)."""
    if not build.is_dir():
        return []
    folders = (p for p in build.iterdir() if p.is_dir() and p.name != "__pycache__")
    return sorted(p for p in folders if not nix or (p / "metadata.json").is_file())


def local_branch_files(repo: Path = REPO, build_dir: Path | None = None) -> dict[str, Path]:
    """`{path in repo: local file}` of what the version branch must hold: build/<variant>/** of every
    variant folder (of `build_dir`, a Nix result, when given), and benchmarks/benchmark*.py."""
    files: dict[str, Path] = {}
    build = Path(build_dir) if build_dir is not None else repo / "build"
    variants = _variant_folders(build, nix=build_dir is not None)
    if not variants:
        raise FileNotFoundError(f"no build variant under {build}")
    for variant in variants:
        for path in sorted(variant.rglob("*")):
            rel = path.relative_to(variant)
            if path.is_file() and not _ignored(rel):
                files[f"build/{variant.name}/{rel.as_posix()}"] = path
    for path in sorted((repo / "benchmarks").glob(BENCHMARK_GLOB)):
        if path.is_file():
            files[path.relative_to(repo).as_posix()] = path
    return dict(sorted(files.items()))


def _stale(remote_path: str, local: dict[str, Path]) -> bool:
    """A branch file this upload removes: under build/, or a benchmarks/benchmark*.py, and not local."""
    if remote_path in local:
        return False
    if remote_path.startswith("build/"):
        return True
    head, _, name = remote_path.rpartition("/")
    return head == "benchmarks" and fnmatch.fnmatch(name, BENCHMARK_GLOB)


def plan_operations(
    repo_root: Path,
    remote_files: list[str] | None,
    *,
    repo_id: str | None = None,
    repo_type: str = REPO_TYPE,
    new_branch: bool | None = None,
    build_dir: Path | None = None,
) -> list[Operation]:
    """Everything an upload does, in order. Reads the checkout only; no network.

    `remote_files`: the files on the version branch, or None when it does not exist and starts empty.
    `new_branch=True` with a list: the branch does not exist and will start with those files (a new
    branch is a copy of `main`). Default: new exactly when `remote_files` is None."""
    repo = Path(repo_root)
    repo_id = repo_id or default_repo_id(repo)
    branch = version_branch(repo)
    local = local_branch_files(repo, build_dir)
    ops = [Operation("create-repo", f"{URL_PREFIX[repo_type]}{repo_id}")]
    if remote_files is None if new_branch is None else new_branch:
        ops.append(Operation("create-branch", branch))
    ops += [Operation("delete", p, branch) for p in sorted(set(remote_files or ())) if _stale(p, local)]
    ops += [Operation("upload", p, branch, source=src) for p, src in local.items()]
    return ops + card_operations(repo)


def card_operations(repo_root: Path, releases: Sequence[make_card.Release] = ()) -> list[Operation]:
    """The uploads to `main`: the card (with `releases`, newest first, in its "Releases" section) and
    the files it shows or links to."""
    repo = Path(repo_root)
    card = make_card.render_card(repo, releases).encode("utf-8")
    return [Operation("upload", "README.md", MAIN, data=card)] + [
        Operation("upload", p, MAIN, source=repo / p) for p in make_card.card_assets(repo)
    ]


def preflight(repo_root: Path, build_dir: Path | None = None) -> list[str]:
    """Reasons not to publish this checkout (and the Nix build in `build_dir`, if given); empty when
    it may be published."""
    from kernels._rust import Metadata  # the loader's own parser

    repo = Path(repo_root)
    problems: list[str] = []
    general = _general(repo)
    metadata_files = [repo / "metadata.json"] + sorted((repo / "build").glob("*/metadata.json"))
    for path in metadata_files:
        rel = path.relative_to(repo)
        try:
            meta = Metadata.read_from_file(path)
        except (OSError, ValueError) as e:
            problems.append(f"invalid metadata: {rel}: {e}")
            continue
        if str(meta.name) != general["name"] or meta.version != general["version"]:
            problems.append(
                f"invalid metadata: {rel}: name/version {meta.name}/{meta.version} do not match build.toml "
                f"{general['name']}/{general['version']}"
            )
        elif path.parent.parent == repo / "build":
            problems += _digest_problems(path.parent, meta)
    if not problems:
        try:
            stale = sync_build.check(repo)
        except (OSError, ValueError) as e:
            stale = [f"cannot compute the expected build: {e}"]
        if stale:
            problems.append(
                "build/ is out of sync with torch-ext/ (run `python3 scripts/sync_build.py` and commit): "
                + "; ".join(stale)
            )
    if build_dir is not None and not problems:
        build_dir = Path(build_dir)
        if not _variant_folders(build_dir, nix=True):
            problems.append(f"no build variant (folder with a metadata.json) under {build_dir}")
        else:
            drift = compare_nix_build.compare(build_dir, repo)
            if drift:
                problems.append("the Nix build differs from the committed build/: " + "; ".join(drift))
            for variant in _variant_folders(build_dir, nix=True):
                try:
                    meta = Metadata.read_from_file(variant / "metadata.json")
                except (OSError, ValueError) as e:
                    problems.append(f"invalid metadata: {variant}/metadata.json: {e}")
                    continue
                problems += _digest_problems(variant, meta)
    status = subprocess.run(
        ["git", "-C", str(repo), "status", "--porcelain"], capture_output=True, text=True, check=False
    )
    if status.returncode != 0:
        problems.append(f"not a git working tree: {status.stderr.strip()}")
    elif status.stdout.strip():
        changed = "\n".join(f"      {line}" for line in status.stdout.rstrip().splitlines())
        problems.append(f"git working tree is dirty (commit or stash first):\n{changed}")
    return problems


def _digest_problems(variant: Path, meta) -> list[str]:
    """What `kernels.verify.verify_variant` would find wrong with the variant's files: the same
    re-hash (`Digest.hash_variant` with the metadata's algorithm) and `digest.validate`."""
    from kernels._rust import Digest, DigestValidationError

    rel = f"{variant.parent.name}/{variant.name}"
    if meta.digest is None:
        return [f"invalid metadata: {rel}/metadata.json: no digest (run `python3 scripts/sync_build.py`)"]
    try:
        meta.digest.validate(Digest.hash_variant(meta.digest.algorithm, variant))
    except DigestValidationError as e:
        return [f"stale digest: {rel}: " + "; ".join(str(v) for v in e.violations)]
    return []


def hub_refusal_message(error: Exception, *, repo_id: str, repo_type: str) -> str | None:
    """A clear explanation of a 401/403 from the Hub; None for any other error."""
    response = getattr(error, "response", None)
    status = getattr(response, "status_code", None)
    server = getattr(error, "server_message", None) or ""
    namespace = repo_id.split("/", 1)[0]
    where = f"{URL_PREFIX.get(repo_type, '')}{repo_id} ({repo_type} repo)"
    if status == 401:
        return (
            f"upload.py: the Hub rejected the token (HTTP 401) for {where}: it is missing, expired or "
            f"revoked. Create a write token at https://huggingface.co/settings/tokens and pass it as "
            f"HF_TOKEN or --token.{' Hub says: ' + server if server else ''}"
        )
    if status != 403:
        return None
    lines = [
        f"upload.py: the Hub refused (HTTP 403 Forbidden) a write to {where}.{' Hub says: ' + server if server else ''}",
        "Two causes are known:",
        f"  1. the token may not write to the `{namespace}` namespace: use a token of a member with write",
        f"     access to `{namespace}` (a classic write token, or a fine-grained token granting",
        f"     'write access to contents/settings of all repos' under `{namespace}`);",
    ]
    if repo_type == "kernel":
        lines += [
            f"  2. creating `kernel`-type repos is gated for `{namespace}` (kernel repos are enabled per",
            "     namespace by Hugging Face; ask for it). Until then publish the same layout to a model",
            f"     repo: `python3 scripts/upload.py --repo-type model --repo-id {repo_id}` (users then",
            "     `git clone -b v<version>` it and load it with get_local_kernel; docs/publishing.md).",
        ]
    else:
        lines += ["  2. the repo exists and belongs to someone else, or the organisation restricts writes."]
    return "\n".join(lines)


def _git_head(repo: Path) -> str:
    out = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True)
    return out.stdout.strip() or "unknown"


def remote_branch_files(api, repo_id: str, repo_type: str, branch: str, token: str) -> tuple[list[str], bool]:
    """`(files, exists)`: the files on `branch`, or when it does not exist yet the files it will start
    with (those of `main`, which a new branch copies; none for a new repo)."""
    from huggingface_hub.errors import RepositoryNotFoundError

    try:
        refs = api.list_repo_refs(repo_id, repo_type=repo_type, token=token)
    except RepositoryNotFoundError:
        return [], False
    branches = {ref.name for ref in refs.branches}
    source = branch if branch in branches else MAIN if MAIN in branches else None
    if source is None:
        return [], False
    return list(api.list_repo_files(repo_id, revision=source, repo_type=repo_type, token=token)), source == branch


def release_title(repo: Path, source: str) -> str:
    return RELEASE_TITLE.format(name=_general(repo)["name"], branch=version_branch(repo), source=source)


def release_history(api, repo: Path, repo_id: str, repo_type: str, token: str) -> list[make_card.Release]:
    """The upload commits of the version branch on the Hub, newest first (the Hub's order), read from
    their titles (`RELEASE_TITLE`); other commits (the branch's start from `main`) are not releases."""
    name, branch = re.escape(_general(repo)["name"]), re.escape(version_branch(repo))
    title = re.compile(RELEASE_TITLE.format(name=name, branch=branch, source="(?P<source>[0-9a-f]{40})") + "$")
    commits = api.list_repo_commits(repo_id, repo_type=repo_type, revision=version_branch(repo), token=token)
    releases = []
    for commit in commits:
        match = title.match(commit.title.strip())
        if match:
            date = commit.created_at.astimezone(timezone.utc).date().isoformat()
            releases.append(make_card.Release(commit=commit.commit_id, source=match["source"], date=date))
    return releases


def execute(
    operations: list[Operation], api, *, repo_id: str, repo_type: str, token: str, message: str
) -> dict[str, str]:
    """Runs a plan: repo and branch creation first, then one commit per branch, in plan order. Returns
    `{branch: the commit it is at}` for each branch committed to (a commit that changes nothing leaves
    the branch where it was: the Hub then answers with its current commit)."""
    from huggingface_hub import CommitOperationAdd, CommitOperationDelete

    commits: dict[str, list] = {}
    for op in operations:
        if op.action == "create-repo":
            api.create_repo(repo_id, repo_type=repo_type, exist_ok=True, token=token)
        elif op.action == "create-branch":
            api.create_branch(repo_id, branch=op.path, repo_type=repo_type, exist_ok=True, token=token)
        elif op.action == "delete":
            commits.setdefault(op.branch, []).append(CommitOperationDelete(path_in_repo=op.path))
        elif op.action == "upload":
            content = op.data if op.data is not None else str(op.source)
            commits.setdefault(op.branch, []).append(CommitOperationAdd(path_in_repo=op.path, path_or_fileobj=content))
        else:
            raise ValueError(f"unknown operation {op}")
    heads = {}
    for branch, ops in commits.items():
        info = api.create_commit(
            repo_id, operations=ops, commit_message=message, repo_type=repo_type, revision=branch, token=token
        )
        heads[branch] = info.oid
    return heads


def publish(api, repo: Path, *, repo_id: str, repo_type: str, token: str, build_dir: Path | None) -> str:
    """Uploads the version branch (printing each operation), then the card with the branch's releases,
    the new one first. Returns the commit the version branch is at: the sha users pin."""
    branch = version_branch(repo)
    remote, exists = remote_branch_files(api, repo_id, repo_type, branch, token)
    operations = plan_operations(
        repo, remote, repo_id=repo_id, repo_type=repo_type, new_branch=not exists, build_dir=build_dir
    )
    for op in operations:
        print(op)
    hub = {"repo_id": repo_id, "repo_type": repo_type, "token": token}
    message = release_title(repo, _git_head(repo))
    heads = execute([op for op in operations if op.branch != MAIN], api, message=message, **hub)
    releases = release_history(api, repo, **hub)
    execute(card_operations(repo, releases), api, message=f"Card: {message}", **hub)
    return heads[branch]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repo-id", help="Hub repo (default: [general.hub] repo-id of build.toml)")
    parser.add_argument("--repo-type", choices=sorted(URL_PREFIX), default=REPO_TYPE)
    parser.add_argument("--dry-run", action="store_true", help="check and print the operations; no network")
    parser.add_argument("--remote-files", type=Path, help="dry run: files on the version branch, one per line")
    parser.add_argument("--token", help="Hub token (default: environment variable HF_TOKEN)")
    parser.add_argument("--repo", type=Path, default=REPO, help="repository root (default: this script's repo)")
    parser.add_argument("--build-dir", type=Path, help="upload the variants of this Nix build (e.g. ./result)")
    args = parser.parse_args(argv)
    repo = args.repo.resolve()
    build_dir = args.build_dir.resolve() if args.build_dir else None
    if args.remote_files and not args.dry_run:
        parser.error("--remote-files is for --dry-run only")

    problems = preflight(repo, build_dir)
    if problems:
        print("upload.py: refusing to publish:", file=sys.stderr)
        for problem in problems:
            print(f"  - {problem}", file=sys.stderr)
        return 2
    repo_id = args.repo_id or default_repo_id(repo)
    branch = version_branch(repo)

    if args.dry_run:
        remote = None
        if args.remote_files:
            lines = args.remote_files.read_text(encoding="utf-8").splitlines()
            remote = [s.strip() for s in lines if s.strip() and not s.lstrip().startswith("#")]
        else:
            print(f"upload.py: dry run, assuming branch {branch} does not exist yet", file=sys.stderr)
        for op in plan_operations(repo, remote, repo_id=repo_id, repo_type=args.repo_type, build_dir=build_dir):
            print(op)
        return 0

    token = args.token or os.environ.get("HF_TOKEN")
    if not token:
        print("upload.py: no token: pass --token or set HF_TOKEN", file=sys.stderr)
        return 2
    from huggingface_hub import HfApi
    from huggingface_hub.errors import HfHubHTTPError

    try:
        commit = publish(HfApi(), repo, repo_id=repo_id, repo_type=args.repo_type, token=token, build_dir=build_dir)
    except HfHubHTTPError as e:
        message = hub_refusal_message(e, repo_id=repo_id, repo_type=args.repo_type)
        if message is None:
            raise
        print(message, file=sys.stderr)
        return 3
    print(f"upload.py: published {repo_id} ({args.repo_type}) branch {branch} and the card on {MAIN}")
    print(f'upload.py: branch {branch} is at commit {commit}: pin this release with revision="{commit}"')
    return 0


if __name__ == "__main__":
    sys.exit(main())
