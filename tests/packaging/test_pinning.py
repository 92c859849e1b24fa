"""Pinning a release, offline: `get_kernel(..., revision=<commit>)`, a `kernels.lock` through `load_kernel`
and `get_locked_kernel`, and what each kernels version does with a changed cached file; then the README's
"Pin it" section followed as written, in a fresh interpreter.

The Hub cache is laid out by the test (tests/hub_offline.py) under a made-up 40-hex commit, holding what
scripts/upload.py puts on the version branch (every build/<variant>); HF_HUB_OFFLINE=1, sockets refused,
torch reports one sm_90 GPU (kernels resolves and checks the torch-cuda variant as on an H100; nothing
launches). `kernels lock` and `kernels download` run as kernels' own CLI against a stand-in for the three
Hub calls they make (`list_repo_refs`, `list_repo_tree`, `get_organization_overview`); every file they
read comes from the cache. Runs under the declared minimum (kernels 0.17) and the newest release
(scripts/test_kernels_newest.sh, 0.19.1).
"""

from __future__ import annotations

import itertools
import json
import re
import subprocess
import sys
import tomllib
from datetime import datetime, timezone
from pathlib import Path
from types import SimpleNamespace
from typing import Callable

import pytest
from huggingface_hub import HfApi
from huggingface_hub.errors import RevisionNotFoundError
from huggingface_hub.hf_api import GitCommitInfo, GitRefInfo, GitRefs, RepoFolder
from hub_offline import (
    SIMULATED_CUDA, RecordingHubApi, build_hub_cache, guarded_env, load_script, offline_hub, simulate_cuda,
    version_branch_files,
)
from kernels import Metadata, get_kernel, get_locked_kernel, has_kernel, load_kernel
from kernels_api import VERSION as KERNELS_VERSION
from kernels_api import cli_main

REPO = Path(__file__).resolve().parents[2]
GENERAL = tomllib.loads((REPO / "build.toml").read_text(encoding="utf-8"))["general"]
REPO_ID, VERSION = GENERAL["hub"]["repo-id"], GENERAL["version"]
BRANCH = f"v{VERSION}"
VARIANT = "torch-cuda"  # the variant kernels picks on the simulated CUDA machine
PLACEHOLDER = "<commit>"  # how the README writes the commit a user copies from the card
UNKNOWN = "0123456789abcdef0123456789abcdef01234567"  # a commit the cache does not hold
# kernels verifies a cached variant against its metadata digest from 0.18.3 (read from its source;
# tested here under 0.19.1); 0.17 loads what is there.
VERIFIES = KERNELS_VERSION >= (0, 18, 3)
# 0.17 calls a cached commit incomplete when the branch listing names a file it lacks (no variant but
# its own is fetched by `kernels download`); 0.18.3 on takes the variant it finds.
PARTIAL_SNAPSHOT_LOADS = KERNELS_VERSION >= (0, 18, 3)
# The patched tiny model's loss against the plain one, both fp32 (tests/conftest.py's TOL for fp32).
FP32_LOSS_TOLERANCE = 1e-5
DIGEST_REFUSAL = (
    f"Kernel '{GENERAL['name']}' variant '{VARIANT}': the files do not match the digest in the metadata, "
    "so they may have been modified"
)

make_card = load_script("make_card")
sync_build = load_script("sync_build")


def not_cached(commit: str) -> str:
    return f"Cannot find a local snapshot for {REPO_ID} (revision: {commit})"


def variant_of(kernel) -> Path:
    return Path(kernel.__file__).parent


def lock_json(commit: str) -> str:
    """The hand-written kernels.lock the README points to (docs/publishing.md), for `commit` (kernels
    writes no final newline)."""
    return section_blocks("docs/publishing.md", "Pinning a release", "json")[0].replace(PLACEHOLDER, commit).rstrip("\n")


def section_blocks(doc: str, heading: str, language: str) -> list[str]:
    """The fenced `language` blocks of `doc`'s `## heading` section, in order."""
    _, sections = make_card.split_sections((REPO / doc).read_text(encoding="utf-8"))
    return re.findall(rf"^```{language}\n(.*?)^```$", dict(sections)[heading], flags=re.M | re.S)


def readme_blocks(language: str) -> list[str]:
    """The fenced `language` blocks of the README's "Pin it" section, in order."""
    return section_blocks("README.md", "Pin it", language)


@pytest.fixture
def hub_cache(tmp_path, monkeypatch) -> Path:
    simulate_cuda(monkeypatch)
    return offline_hub(monkeypatch, tmp_path / "hf_home")


_BUILDS = itertools.count()


def release_files(docstring_prefix: bytes = b"") -> dict[str, bytes]:
    """What scripts/upload.py puts on the version branch, with a build id of its own (kernels 0.19 hands
    back an already loaded module for a variant of the same id and digest, from whichever folder it is
    asked for: each test's release must be a build of its own to be told apart) and, optionally, the
    variant's docstring prefixed (a later release)."""
    files = version_branch_files(REPO)
    variant = {p.split("/", 2)[2]: data for p, data in files.items() if p.startswith(f"build/{VARIANT}/")}
    variant["__init__.py"] = variant["__init__.py"].replace(b'"""', b'"""' + docstring_prefix, 1)
    meta = json.loads(variant["metadata.json"])
    meta.update(id=f"{meta['id']}_{next(_BUILDS)}", digest=sync_build.variant_digest(variant))
    variant["metadata.json"] = json.dumps(meta, indent=2).encode()
    return files | {f"build/{VARIANT}/{p}": data for p, data in variant.items()}


def release(hub_cache: Path, *, downloaded: str = "all") -> tuple[str, Path]:
    """A release in the cache, as `hf download --revision <commit>` leaves it ("all") or as `kernels
    download` / an online get_kernel leave it ("variant": only build/torch-cuda/)."""
    files = release_files()
    fetched = None if downloaded == "all" else sorted(p for p in files if p.startswith(f"build/{VARIANT}/"))
    return build_hub_cache(hub_cache, REPO_ID, files, ref=None, downloaded=fetched)


def newer_release(hub_cache: Path) -> tuple[str, Path]:
    """A later upload to the version branch, as a download by branch name leaves it (refs/v1 moves to
    it); its docstring starts with "Next"."""
    return build_hub_cache(hub_cache, REPO_ID, release_files(b"Next: "), ref=BRANCH)


def change_one_byte(snapshot: Path) -> Path:
    """Changes one byte of the variant's __init__.py in the cache (its blob): the docstring's first
    letter, "f" to "F", so the module still imports and shows which file ran."""
    init = snapshot / "build" / VARIANT / "__init__.py"
    data = init.read_bytes()
    assert data.startswith(b'"""fused-linear-ce')
    init.write_bytes(data[:3] + b"F" + data[4:])
    return init


# --- where a user finds the commit: the publish step -----------------------------------------------


def test_the_publish_step_records_each_release_on_the_card():
    """upload.py's publish: the version branch's commit is what it returns (main() prints it), and the
    card it writes afterwards lists that commit first under "Releases", then the earlier upload commits
    of the branch (read back from their titles); a commit not made by an upload is no release."""
    upload = load_script("upload")
    earlier = [
        GitCommitInfo(commit_id="e" * 40, authors=[], created_at=datetime(2026, 12, 1, 23, 30, tzinfo=timezone.utc),
                      title=upload.release_title(REPO, "a" * 40), message="", formatted_title=None,
                      formatted_message=None),
        GitCommitInfo(commit_id="f" * 40, authors=[], created_at=datetime(2026, 11, 30, tzinfo=timezone.utc),
                      title="initial commit", message="", formatted_title=None, formatted_message=None),
    ]

    class Hub(RecordingHubApi):
        FILES = (".gitattributes", "README.md")
        HISTORY = {BRANCH: earlier}

    api = Hub()
    commit = upload.publish(api, REPO, repo_id=REPO_ID, repo_type="kernel", token="hf_test", build_dir=None)
    head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    assert api.history[BRANCH][0].commit_id == commit and re.fullmatch("[0-9a-f]{40}", commit)
    title = f"Upload {GENERAL['name']} {BRANCH} from {head}"
    assert api.history[BRANCH][0].title == upload.release_title(REPO, head) == title
    card_commit = [kw for name, kw in api.calls if name == "create_commit" and kw["revision"] == "main"]
    card = card_commit[0]["operations"][0].path_or_fileobj.decode()
    _, sections = make_card.split_sections(card)
    rows = [line for line in dict(sections)["Releases"].splitlines() if line.startswith("| 20")]
    today = api.history[BRANCH][0].created_at.date().isoformat()
    assert rows == [f"| {today} | `{commit}` | `{head}` |", f"| 2026-12-01 | `{'e' * 40}` | `{'a' * 40}` |"]
    _, without = make_card.split_sections(make_card.render_card(REPO))
    assert "Releases" not in dict(without)  # no releases known (a dry run): no section


# --- get_kernel(revision=...) -----------------------------------------------------------------------


def test_revision_loads_that_commit_while_the_branch_moves_on(hub_cache):
    """A pin is the commit, not the branch: after a newer release moves refs/v1, revision= still loads
    the pinned snapshot and version= the newer one."""
    pinned, snapshot = release(hub_cache)
    moved, newer_snapshot = newer_release(hub_cache)
    assert moved != pinned and re.fullmatch("[0-9a-f]{40}", pinned)
    variants = {p.name for p in (REPO / "build").iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert {p.name for p in (snapshot / "build").iterdir()} == variants  # torch-cuda, and any other
    kernel = get_kernel(REPO_ID, revision=pinned)
    assert variant_of(kernel) == snapshot / "build" / VARIANT
    assert kernel.__name__ == Metadata.read_from_file(snapshot / "build" / VARIANT / "metadata.json").id
    assert callable(kernel.fused_linear_cross_entropy) and callable(kernel.use_in_trl)
    newest = get_kernel(REPO_ID, version=VERSION)
    assert variant_of(newest) == newer_snapshot / "build" / VARIANT and newest.__doc__.startswith("Next")
    assert has_kernel(REPO_ID, revision=pinned)


def test_an_unknown_commit_fails_with_kernels_own_error(hub_cache):
    release(hub_cache)
    with pytest.raises(FileNotFoundError, match=re.escape(not_cached(UNKNOWN))):
        get_kernel(REPO_ID, revision=UNKNOWN)
    assert has_kernel(REPO_ID, revision=UNKNOWN) is False


# --- kernels lock / download, load_kernel / get_locked_kernel -------------------------------------------


@pytest.fixture
def hub_api(monkeypatch):
    """The Hub calls of `kernels lock` and `kernels download`, answered for one release, set by the
    returned `set_release(commit, trusted=...)`: v1 is at `commit`, its build/ holds every variant of
    the checkout, the publisher is trusted or not. Files are read from the cache (offline,
    hf_hub_download finds them by commit)."""
    state = SimpleNamespace(commit=None, trusted=False, variants=[])

    def list_repo_refs(self, repo_id, **kwargs):
        assert repo_id == REPO_ID and kwargs.get("repo_type") == "kernel"
        head = GitRefInfo(name=BRANCH, ref=f"refs/heads/{BRANCH}", target_commit=state.commit)
        return GitRefs(branches=[head], converts=[], tags=[])

    def list_repo_tree(self, repo_id, path_in_repo=None, *, revision=None, **kwargs):
        if revision != state.commit:
            response = SimpleNamespace(status_code=404, headers={}, request=None)  # what the error reads
            raise RevisionNotFoundError(f"404: {repo_id} has no revision {revision}", response=response)
        assert path_in_repo == "build"
        return [RepoFolder(path=f"build/{name}", oid=revision) for name in state.variants]

    def get_organization_overview(self, organization, **kwargs):
        assert organization == REPO_ID.split("/")[0]
        return SimpleNamespace(name=organization, trustedKernelPublisher=state.trusted)

    for call in (list_repo_refs, list_repo_tree, get_organization_overview):
        monkeypatch.setattr(HfApi, call.__name__, call)

    def set_release(commit: str, *, trusted: bool) -> None:
        state.commit, state.trusted = commit, trusted
        state.variants = sorted({p.split("/")[1] for p in version_branch_files(REPO) if p.startswith("build/")})

    return set_release


def kernels_cli(monkeypatch, *args: str) -> None:
    monkeypatch.setattr(sys, "argv", ["kernels", *args])
    cli_main()()


def new_project(folder: Path) -> Path:
    """A project declaring the kernel as the README's pyproject block does."""
    folder.mkdir(parents=True)
    (folder / "pyproject.toml").write_text('[project]\nname = "trainer"\nversion = "0"\n\n' + readme_blocks("toml")[0])
    return folder


@pytest.fixture
def project(tmp_path) -> Path:
    return new_project(tmp_path / "project")


def test_kernels_lock_writes_the_commit_as_the_readme_shows(hub_cache, hub_api, project, monkeypatch):
    """`kernels lock` refuses a publisher that is not trusted (trl-lib today) with its own message, and
    for a trusted one writes exactly the hand-written lock file docs/publishing.md shows."""
    commit, _ = release(hub_cache)
    hub_api(commit, trusted=False)
    with pytest.raises(ValueError, match=re.escape(f"Kernel repository '{REPO_ID}' is not from a trusted publisher")):
        kernels_cli(monkeypatch, "lock", str(project))
    assert not (project / "kernels.lock").exists()
    hub_api(commit, trusted=True)
    kernels_cli(monkeypatch, "lock", str(project))
    written = (project / "kernels.lock").read_text()
    assert written == lock_json(commit)
    assert json.loads(written)[0]["lock"]["commit"] == commit


def test_kernels_download_reads_the_locked_commit(hub_cache, hub_api, project, monkeypatch, capsys):
    commit, _ = release(hub_cache)
    hub_api(commit, trusted=False)  # download checks no publisher
    (project / "kernels.lock").write_text(lock_json(commit))
    kernels_cli(monkeypatch, "download", str(project))
    assert f"Downloading kernel: {REPO_ID} (revision: {commit})" in capsys.readouterr().err
    (project / "kernels.lock").write_text(lock_json(UNKNOWN))
    with pytest.raises(RevisionNotFoundError):
        kernels_cli(monkeypatch, "download", str(project))


@pytest.mark.parametrize("loader", ["load_kernel", "get_locked_kernel"])
def test_a_lock_file_loads_the_commit_it_names(hub_cache, project, loader):
    commit, snapshot = release(hub_cache)
    newer_release(hub_cache)
    lockfile = project / "kernels.lock"
    lockfile.write_text(lock_json(commit))
    load = {"load_kernel": load_kernel, "get_locked_kernel": get_locked_kernel}[loader]
    assert variant_of(load(REPO_ID, lockfile=lockfile)) == snapshot / "build" / VARIANT
    lockfile.write_text(lock_json(UNKNOWN))
    with pytest.raises(FileNotFoundError, match=re.escape(not_cached(UNKNOWN))):
        load(REPO_ID, lockfile=lockfile)


def test_what_kernels_download_fetches_loads_from_0_18_3_on(hub_cache, project):
    """`kernels download` (and an online get_kernel) fetch only this machine's variant, while the cache
    lists the whole commit (benchmarks/benchmark.py, .gitattributes): 0.17 refuses that snapshot offline,
    which is why the README has 0.17 users download the whole commit."""
    commit, snapshot = release(hub_cache, downloaded="variant")
    lockfile = project / "kernels.lock"
    lockfile.write_text(lock_json(commit))
    loads = [lambda: load_kernel(REPO_ID, lockfile=lockfile), lambda: get_kernel(REPO_ID, revision=commit)]
    for load in loads:
        if PARTIAL_SNAPSHOT_LOADS:
            assert variant_of(load()) == snapshot / "build" / VARIANT
        else:
            with pytest.raises(FileNotFoundError, match=re.escape(not_cached(commit))):
                load()


# --- a changed byte in the cache ----------------------------------------------------------------------


@pytest.mark.parametrize("loader", ["revision", "load_kernel", "get_locked_kernel"])
def test_a_changed_byte_is_refused_from_0_18_3_on_and_loads_under_0_17(hub_cache, project, loader):
    commit, snapshot = release(hub_cache)
    lockfile = project / "kernels.lock"
    lockfile.write_text(lock_json(commit))
    load = {
        "revision": lambda: get_kernel(REPO_ID, revision=commit),
        "load_kernel": lambda: load_kernel(REPO_ID, lockfile=lockfile),
        "get_locked_kernel": lambda: get_locked_kernel(REPO_ID, lockfile=lockfile),
    }[loader]
    change_one_byte(snapshot)
    if VERIFIES:
        with pytest.raises(RuntimeError, match=re.escape(DIGEST_REFUSAL)) as refused:
            load()
        assert "__init__.py" in str(refused.value)
    else:  # the documented fact: 0.17 runs the changed file
        kernel = load()
        assert variant_of(kernel) == snapshot / "build" / VARIANT and kernel.__doc__.startswith("Fused-linear-ce")


@pytest.mark.skipif(not VERIFIES, reason="kernels 0.17 verifies no digest")
def test_a_verified_commit_is_not_hashed_again(hub_cache):
    """0.19 hashes a cached commit once and keeps a receipt in the kernels cache: a file changed after
    that first load is not noticed by the next load (local folders are hashed on every load)."""
    commit, snapshot = release(hub_cache)
    assert variant_of(get_kernel(REPO_ID, revision=commit)) == snapshot / "build" / VARIANT
    change_one_byte(snapshot)
    assert variant_of(get_kernel(REPO_ID, revision=commit)) == snapshot / "build" / VARIANT


# --- the README, followed as written ---------------------------------------------------------------


_README_CHILD = '''
import ast, json, sys
from pathlib import Path
import transformers

commit = sys.argv[1]
config = transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                  num_attention_heads=2, num_key_value_heads=2)
model = transformers.AutoModelForCausalLM.from_config(config)
loaded, scope = [], {"model": model}
for block in json.loads(Path("blocks.json").read_text()):
    for statement in ast.parse(block.replace("<commit>", commit)).body:
        exec(compile(ast.Module([statement], []), "README.md", "exec"), scope)
        if isinstance(statement, ast.Assign) and ast.unparse(statement.targets[0]) == "flce":
            loaded.append(scope["flce"].__file__)
result = {"loaded": loaded, "patched": "forward" in vars(model)}
if result["patched"]:  # the pinned kernel computes the loss: on the CPU, in Triton's interpreter
    import torch
    torch.version.cuda, torch.cuda.is_available = None, lambda: False
    ids = torch.randint(0, config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(0))
    out = model(ids, labels=ids)
    plain = model.loss_function(model.lm_head(model.model(ids).last_hidden_state), ids, config.vocab_size)
    result.update(logits=out.logits, loss_error=abs(out.loss.item() - plain.item()))
print(json.dumps(result))
'''


def run_readme_blocks(tmp_path: Path, name: str, blocks: list[str]) -> tuple[str, Path, Callable]:
    """A fresh cache (`tmp_path/name`) holding the release, a project with the README's pyproject block and
    hand-written kernels.lock for it, and a fresh interpreter on a simulated CUDA machine, offline and with
    sockets refused, running `blocks` statement by statement (`model`: a tiny Llama on the CPU, so the
    kernels run in Triton's interpreter, GPU or not)."""
    home = tmp_path / name / "hf_home"
    commit, snapshot = release(home / "hub")
    project = new_project(tmp_path / name / "project")
    (project / "kernels.lock").write_text(lock_json(commit))
    (project / "blocks.json").write_text(json.dumps(blocks))
    (project / "child.py").write_text(SIMULATED_CUDA + _README_CHILD)
    env = guarded_env(tmp_path / name, home, TRITON_INTERPRET="1")
    return commit, snapshot, lambda: subprocess.run(
        [sys.executable, "child.py", commit], cwd=project, env=env, capture_output=True, text=True, timeout=300)


def test_the_readme_pin_section_as_a_new_user(tmp_path):
    """A fresh interpreter runs the section's Python blocks in order, in a project holding its pyproject
    block and (trl-lib not being a trusted publisher yet) its hand-written kernels.lock: each of the
    three loads is the pinned commit's variant, use_in_trl and patch_model take it, and the patched
    model's loss (no logits) is the plain one's."""
    python = readme_blocks("python")
    assert len(python) == 2 and f'revision="{PLACEHOLDER}"' in python[0] and "patch_model(model)" in python[0]
    _, snapshot, run = run_readme_blocks(tmp_path, "pinned", python)
    proc = run()
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["loaded"] == [str(snapshot / "build" / VARIANT / "__init__.py")] * 3 and result["patched"]
    assert result["logits"] is None and result["loss_error"] <= FP32_LOSS_TOLERANCE


def test_the_readme_locked_load_of_a_changed_cache(tmp_path):
    """The README's claim, as a user would try it: one byte of the cached commit changed before its
    first load; kernels 0.19 refuses the locked load with its own message, 0.17 loads it."""
    _, snapshot, run = run_readme_blocks(tmp_path, "changed", [readme_blocks("python")[1]])
    change_one_byte(snapshot)
    proc = run()
    if VERIFIES:
        assert proc.returncode != 0 and DIGEST_REFUSAL in proc.stderr, proc.stderr[-3000:]
    else:
        assert proc.returncode == 0, proc.stderr[-3000:]
        loaded = json.loads(proc.stdout.strip().splitlines()[-1])["loaded"]
        assert loaded == [str(snapshot / "build" / VARIANT / "__init__.py")] * 2
