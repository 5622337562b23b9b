"""The documentation stays documentation: every relative link of README.md, docs/, reports/ and scripts/README.md
resolves (file and, into a Markdown page, heading anchor); no tracker number ("issue" and a number) in code, docs
or scripts; no run log in docs/ or README.md (load figures, a figure measured at a commit, a date): measurements
live in reports/ (runtime/tools/reports.py), and a page links to them."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# the pages whose relative links must resolve
LINKED_PAGES = ("README.md", "docs/*.md", "reports/*.md", "reports/*/*.md", "scripts/README.md")
# where no tracker number may appear: the code, its configs and its docs
NO_TRACKER = ("runtime", "sweep", "tests", "scripts", "docs", "infra", "search_spaces", "mlflow")
NO_TRACKER_FILES = ("README.md", "Makefile")
TEXT_SUFFIXES = {".py", ".md", ".sh", ".yaml", ".yml", ".toml", ".cpp", ".txt", ".cfg", ".ini", ""}
# a frozen corpus (a former version of the kernel source, the tests' evaluated text): editing it changes every
# fixture built on it, so it keeps its words
FROZEN = {Path("tests/data/kernel_source.txt")}
# pages that must not log runs
NO_RUN_LOG = ("README.md", "docs/*.md")

TRACKER = re.compile(r"[Ii]ssues? ?#?[0-9]")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
RUN_LOG = {
    "a load figure": re.compile(r"\bload (average|~?[0-9])", re.IGNORECASE),
    "a figure measured at a commit": re.compile(
        r"\b(at|before) (?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}\b"),
    "a date": re.compile(r"\b20[0-9]{2}-[01][0-9]-[0-3][0-9]\b"),
}


def pages(patterns: tuple[str, ...]) -> list[Path]:
    """The files matching the glob patterns under the checkout, sorted."""
    return sorted({p for pattern in patterns for p in ROOT.glob(pattern) if p.is_file()})


def slug(heading: str) -> str:
    """GitHub's anchor of a Markdown heading: lower case, punctuation but `-` and `_` removed, spaces to `-`."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """The heading anchors of a Markdown page (fenced code blocks skipped)."""
    found, fenced = set(), False
    for line in page.read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and line.startswith("#"):
            found.add(slug(line.lstrip("#")))
    return found


def broken_links(page: Path) -> list[str]:
    """Each relative link of `page` whose file, or heading anchor in a Markdown file, does not exist."""
    text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.DOTALL)
    text = re.sub(r"`[^`\n]*`", "", text)  # code spans are not links
    broken = []
    for target in LINK.findall(text):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto: ...
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target} (no heading #{anchor})")
    return broken


def tracker_numbers(text: str) -> list[str]:
    """The lines of `text` that name a tracker number."""
    return [line.strip() for line in text.splitlines() if TRACKER.search(line)]


def run_log(text: str) -> list[str]:
    """'what: line' for each line of `text` that logs a run."""
    return [f"{what}: {line.strip()}" for line in text.splitlines()
            for what, pattern in RUN_LOG.items() if pattern.search(line)]


def code_and_docs() -> list[Path]:
    """Every text file of the code, its configs, scripts, tests and docs, the frozen corpus aside."""
    files = [ROOT / name for name in NO_TRACKER_FILES]
    for top in NO_TRACKER:
        files += [p for p in (ROOT / top).rglob("*") if p.is_file() and p.suffix in TEXT_SUFFIXES
                  and "__pycache__" not in p.parts and p.relative_to(ROOT) not in FROZEN]
    return sorted(files)


@pytest.mark.parametrize("page", pages(LINKED_PAGES), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page: Path) -> None:
    assert broken_links(page) == []


def test_no_tracker_numbers_in_code_or_docs() -> None:
    found = {str(p.relative_to(ROOT)): hits for p in code_and_docs()
             if (hits := tracker_numbers(p.read_text(encoding="utf-8", errors="replace")))}
    assert found == {}


@pytest.mark.parametrize("page", pages(NO_RUN_LOG), ids=lambda p: str(p.relative_to(ROOT)))
def test_docs_log_no_runs(page: Path) -> None:
    assert run_log(page.read_text(encoding="utf-8")) == []


def test_the_checks_see_what_they_look_for(tmp_path: Path) -> None:
    """Each check finds its marker in a text built to hold it, and passes the same text without it."""
    number = 4 * 10 + 3
    assert tracker_numbers(f"a bounded pool (issue {number})\nfine") == [f"a bounded pool (issue {number})"]
    assert tracker_numbers(f"Issues #{number} and 40") and not tracker_numbers("the copy's issue time")
    for line in ("ran at load 10-15", "load average 1.0-1.7", "Measured at 1bd694e on this machine",
                 "| at 6a2b3c4 | 25 min |", "taken on 2026-12-05"):
        assert run_log(line), line
    assert run_log("loads a layer at 25% residency; slots 0..P_l-1") == []
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.md").write_text("# The answer\n\n## Hosts (`profile`)\n")
    page = tmp_path / "a.md"
    page.write_text("[ok](sub/b.md) [ok](sub/b.md#the-answer) [ok](sub/b.md#hosts-profile) [web](https://x.org/y)"
                    " `[code](nowhere.md)`\n[gone](sub/c.md) [bad anchor](sub/b.md#nothing)\n")
    assert broken_links(page) == ["sub/c.md (no such file)", "sub/b.md#nothing (no heading #nothing)"]
