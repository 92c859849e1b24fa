#!/usr/bin/env python3
"""Generates the Hub card (the `README.md` of the Hub repo's `main` branch) from this repo's README.md.

The card is the README's title and introduction plus its user-facing `## ` sections, copied verbatim,
under a YAML front matter (license from metadata.json, `library_name: kernels`, tags). Nothing is
written by hand twice, so the card and the README cannot disagree; `scripts/upload.py` uploads the
output of `render_card()`, and tests/packaging/test_publish_card.py checks it against the current README.

Sections named in `REPO_ONLY_SECTIONS` (how to develop and publish this repo) are left out; every other
`## ` section goes in, in README order, and `REQUIRED_SECTIONS` must exist (usage, benchmark table,
clean-room statement). Files the kept sections show or link with a relative path (images,
`docs/*.md`) are returned by `card_assets()`: the upload puts them next to the card on `main`, where
the relative links resolve.

One rewrite is made: a `git clone` of the Hub repo without a branch gets `-b v<version>`. The build
lives on the version branch (`kernel-builder upload` and scripts/upload.py put only the card on `main`),
so a plain clone has no `build/` and nothing to load (`pin_clone_branch`).

One section is added: "Releases" (`releases_section`), the commits of the version branch that
scripts/upload.py made, newest first, each with the source commit it was built from. That is where a
user copies the 40-hex commit to pin (`get_kernel(..., revision=...)`, `kernels.lock`). upload.py reads
the list from the branch's history on the Hub after each upload; without releases (a dry run, the CLI
below) the section is left out.

Nothing is written into the repo (kernel-builder treats a top-level CARD.md as a template of its own,
and anything extra under build/ is stale for scripts/sync_build.py).

Usage:
    python3 scripts/make_card.py                 # print the card
    python3 scripts/make_card.py --output FILE   # write it to FILE
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tomllib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

REPO_ONLY_SECTIONS = ("Development", "Maintainers")
REQUIRED_SECTIONS = ("Install and use", "Memory and speed", "Clean room")
TAGS = (
    "kernels",
    "kernel",
    "triton",
    "cuda",
    "rocm",
    "cross-entropy",
    "fused-linear-cross-entropy",
    "loss",
    "llm-training",
)
# The newest releases listed on the card; the version branch's commit history on the Hub lists them all.
CARD_RELEASES = 10
_IMAGE = re.compile(r"!\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
# Any link or image target: documents the card links to (docs/design.md, ...) go beside it too.
_LINK = re.compile(r"\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def split_sections(text: str) -> tuple[str, list[tuple[str, str]]]:
    """`(preamble, [(heading, section text)])`: the text before the first `## ` line, then each `## `
    section verbatim (heading line included, trailing blank lines stripped). Fenced code is skipped."""
    preamble: list[str] = []
    sections: list[tuple[str, list[str]]] = []
    in_fence = False
    for line in text.splitlines():
        if line.lstrip().startswith(("```", "~~~")):
            in_fence = not in_fence
        if not in_fence and line.startswith("## "):
            sections.append((line[3:].strip(), [line]))
        elif sections:
            sections[-1][1].append(line)
        else:
            preamble.append(line)
    return "\n".join(preamble).rstrip(), [(h, "\n".join(lines).rstrip()) for h, lines in sections]


def card_sections(repo: Path = REPO) -> tuple[str, list[tuple[str, str]]]:
    """The README's preamble and the sections that go on the card; raises if a required one is missing."""
    readme = repo / "README.md"
    if not readme.is_file():
        raise FileNotFoundError(f"{readme} is missing: the card is generated from it")
    preamble, sections = split_sections(readme.read_text(encoding="utf-8"))
    headings = [h for h, _ in sections]
    missing = [h for h in REQUIRED_SECTIONS if h not in headings]
    if missing:
        raise ValueError(f"README.md lacks the section(s) the card needs: {missing} (has {headings})")
    return preamble, [(h, body) for h, body in sections if h not in REPO_ONLY_SECTIONS]


def _general(repo: Path) -> dict:
    return tomllib.loads((repo / "build.toml").read_text(encoding="utf-8"))["general"]


def front_matter(repo: Path = REPO) -> str:
    license_id = json.loads((repo / "metadata.json").read_text(encoding="utf-8"))["license"]
    lines = ["---", "library_name: kernels", f"license: {license_id}", "tags:"]
    lines += [f"- {tag}" for tag in TAGS]
    return "\n".join(lines + ["---"])


def pin_clone_branch(text: str, repo_id: str, version: int) -> str:
    """`git clone [opts] https://huggingface.co/[kernels/]<repo_id>[.git] [dir]` without `-b`/`--branch`
    becomes `git clone -b v<version> ...`: the version branch is where `build/` is."""
    url = r"https?://(?:www\.)?(?:huggingface\.co|hf\.co)/(?:kernels/)?" + re.escape(repo_id) + r"(?:\.git)?/?"
    clone = re.compile(r"(?m)^(?P<lead>[^\n]*?\bgit clone)(?P<rest>(?:[ \t]+[^\n]*)?[ \t]+" + url + r"(?=\s|$)[^\n]*)$")

    def pin(m: re.Match) -> str:
        if re.search(r"(?:^|\s)(?:-b|--branch)(?:\s|=)", m.group("rest")):
            return m.group(0)
        return f"{m.group('lead')} -b v{version}{m.group('rest')}"

    return clone.sub(pin, text)


@dataclass(frozen=True)
class Release:
    """One upload to the version branch: `commit` is the Hub commit users pin (40 hex), `source` the
    commit of this repo it was built from, `date` the day of the upload (UTC, YYYY-MM-DD)."""

    commit: str
    source: str
    date: str


def releases_section(releases: Sequence[Release], repo_id: str, version: int) -> str:
    """The card's "Releases" section: the newest `CARD_RELEASES` of `releases` (newest first)."""
    lines = [
        "## Releases",
        "",
        f"The commits of branch `v{version}`, newest first: `version={version}` follows the branch, a commit "
        f'is one exact release. Pin one as "Pin it" above shows: `get_kernel("{repo_id}", '
        'revision="<commit>", ...)`, a `kernels.lock`, or `git checkout <commit>` in a clone.',
        "",
        "| date (UTC) | commit (`revision=`) | built from source commit |",
        "|---|---|---|",
    ]
    lines += [f"| {r.date} | `{r.commit}` | `{r.source}` |" for r in releases[:CARD_RELEASES]]
    if len(releases) > CARD_RELEASES:
        lines += ["", f"Older releases: the commit history of branch `v{version}`."]
    return "\n".join(lines)


def render_card(repo: Path = REPO, releases: Sequence[Release] = ()) -> str:
    """The whole card: front matter, README title + introduction, the kept sections, the releases
    (newest first; none: no section), a footer."""
    preamble, sections = card_sections(repo)
    general = _general(repo)
    pin = lambda text: pin_clone_branch(text, general["hub"]["repo-id"], general["version"])  # noqa: E731
    preamble, sections = pin(preamble), [(h, pin(body)) for h, body in sections]
    if releases:
        sections.append(("Releases", releases_section(releases, general["hub"]["repo-id"], general["version"])))
    footer = (
        f"<sub>This card is generated from the project README by `scripts/make_card.py`. Version "
        f"{general['version']} of `{general['hub']['repo-id']}` is the Hub branch `v{general['version']}` "
        f"(`get_kernel(..., version={general['version']})`).</sub>"
    )
    parts = [front_matter(repo), preamble] + [body for _, body in sections] + [footer]
    return "\n\n".join(parts) + "\n"


def card_assets(repo: Path = REPO) -> list[str]:
    """Repo-relative paths of the files the card shows or links to with relative links (the images,
    and the documents under docs/ and benchmarks/ it points readers to): uploaded beside it on
    `main`, where those links resolve. In-page anchors (`#...`) are not files."""
    preamble, sections = card_sections(repo)
    found: list[str] = []
    for body in [preamble] + [body for _, body in sections]:
        for target in _LINK.findall(body):
            if target.startswith("#"):
                continue  # an anchor in the card itself
            if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.IGNORECASE) or target.startswith("/"):
                continue  # absolute URL
            rel = target.split("#", 1)[0]
            if not (repo / rel).is_file():
                raise FileNotFoundError(f"README.md links {target!r}, which is not a file in the repo")
            if rel not in found:
                found.append(rel)
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repo", type=Path, default=REPO, help="repository root (default: this script's repo)")
    parser.add_argument("--output", type=Path, help="write the card here instead of stdout")
    args = parser.parse_args(argv)
    try:
        card = render_card(args.repo.resolve())
    except (OSError, ValueError, KeyError) as e:
        print(f"make_card.py: {e}", file=sys.stderr)
        return 1
    if args.output:
        args.output.write_text(card, encoding="utf-8")
    else:
        sys.stdout.write(card)
    return 0


if __name__ == "__main__":
    sys.exit(main())
