"""The README and docs/ hold together: every relative link resolves to a file of the repository, every `#anchor` into a
markdown file to one of its headings (GitHub's slugs), every document under docs/ they mention by path exists, and the README stays
a page a user reads (at most 200 lines) whose set-up commands are the ones CI runs."""

from __future__ import annotations

import re
import unicodedata
import uuid
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
README_MAX_LINES = 200

_FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})")
_CODE_SPAN = re.compile(r"(`+)(?:.+?)\1")
_INLINE_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_REFERENCE_DEF = re.compile(r"^ {0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s|$)")
_HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)(?:\s+#+)?\s*$")
_DOC_MENTION = re.compile(r"(?<![\w/.-])docs/([\w.-]+\.md)\b")
_EXTERNAL = re.compile(r"^[a-z][a-z0-9+.-]*:", re.IGNORECASE)   # https:, mailto:, ...


def markdown_files() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def prose_lines(text: str, blank_code: bool = True) -> list[tuple[int, str]]:
    """(line number, line) of the lines outside fenced code blocks, with inline code spans blanked out unless
    `blank_code` is False: a link or heading inside code is text."""
    out, fence = [], None
    for number, line in enumerate(text.splitlines(), 1):
        opened = _FENCE.match(line)
        if fence is None and opened:
            fence = opened.group(1)
        elif fence is not None:
            if opened and opened.group(1)[0] == fence[0] and len(opened.group(1)) >= len(fence):
                fence = None
        else:
            out.append((number, _CODE_SPAN.sub(lambda m: " " * len(m.group(0)), line) if blank_code else line))
    return out


def github_slug(heading: str) -> str:
    """The anchor GitHub gives a heading: its rendered text lowercased, every character but letters, digits,
    `-`, `_` and spaces dropped, spaces turned into `-`."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)     # a link's text
    text = re.sub(r"<[^>]+>", "", text).replace("`", "")          # HTML tags, code spans' backticks
    text = re.sub(r"(\*{1,3}|(?<!\w)_{1,3}|_{1,3}(?!\w))", "", text)  # emphasis markers
    text = text.strip().lower()
    kept = "".join(c for c in text if c in "-_ " or unicodedata.category(c)[0] in "LN")
    return kept.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every anchor a markdown file's headings get, duplicates numbered as GitHub numbers them (`x`, `x-1`, ...)."""
    seen: dict[str, int] = {}
    out = set()
    for _, line in prose_lines(path.read_text(), blank_code=False):
        match = _HEADING.match(line)
        if not match:
            continue
        slug = github_slug(match.group(2))
        count = seen.get(slug, 0)
        out.add(slug if count == 0 else f"{slug}-{count}")
        seen[slug] = count + 1
    return out


def links(path: Path) -> list[tuple[int, str]]:
    """(line, target) of every inline link, image and reference definition outside code."""
    found = []
    for number, line in prose_lines(path.read_text()):
        found += [(number, m.group(1)) for m in _INLINE_LINK.finditer(line)]
        found += [(number, m.group(1)) for m in _REFERENCE_DEF.finditer(line)]
    return found


def broken_links(path: Path) -> list[str]:
    """One line per link of `path` that does not resolve: `file:line: target: why`."""
    problems = []
    for number, target in links(path):
        if _EXTERNAL.match(target):
            continue
        where = f"{path.relative_to(REPO)}:{number}: {target}"
        file_part, _, anchor = target.partition("#")
        resolved = (path.parent / file_part).resolve() if file_part else path
        if REPO not in resolved.parents and resolved != REPO:
            problems.append(f"{where}: points outside the repository")
        elif not resolved.exists():
            problems.append(f"{where}: no such file")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            problems.append(f"{where}: no heading with that anchor in {resolved.relative_to(REPO)}")
    return problems


@pytest.mark.parametrize("path", markdown_files(), ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_resolves(path):
    assert broken_links(path) == []


@pytest.mark.parametrize("path", markdown_files(), ids=lambda p: str(p.relative_to(REPO)))
def test_every_mentioned_doc_exists(path):
    """Plain mentions (`see docs/vllm.md section 10`) are how the docs cite each other; a renamed doc breaks them."""
    missing = [f"{path.relative_to(REPO)}:{number}: docs/{name}"
               for number, line in enumerate(path.read_text().splitlines(), 1)
               for name in _DOC_MENTION.findall(line) if not (REPO / "docs" / name).is_file()]
    assert missing == []


def test_the_link_check_finds_a_broken_file_and_a_broken_anchor(tmp_path, monkeypatch):
    """The check itself, on a page of known links: a missing file, a missing heading, and links that resolve."""
    monkeypatch.setitem(globals(), "REPO", tmp_path)
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "guide.md").write_text("# Guide\n\n## 2. The store, and `gc`\n\n## Notes *(double)*\n\n"
                                                "## Notes *(double)*\n\n```sh\n# not a heading\n```\n")
    # Names no file of the fixture has: a random one per link, so none can exist by chance.
    gone, in_code, web, ref = (f"{uuid.uuid4().hex}.md" for _ in range(4))
    page = tmp_path / "README.md"
    page.write_text("[ok](docs/guide.md#2-the-store-and-gc) [ok](docs/guide.md#notes-double-1) [up](#top)\n"
                    f"[gone](docs/{gone}) [bad](docs/guide.md#not-a-heading) <https://example.com> "
                    f"[web](https://example.com/{web})\n`[in code](docs/{in_code})`\n\n# Top\n[ref]: docs/{ref}\n")
    assert broken_links(page) == [f"README.md:2: docs/{gone}: no such file",
                                  "README.md:2: docs/guide.md#not-a-heading: no heading with that anchor in "
                                  "docs/guide.md",
                                  f"README.md:6: docs/{ref}: no such file"]


def test_github_slugs():
    assert github_slug("5.1 What a neuron recipe with chunked prefill compiles") == \
        "51-what-a-neuron-recipe-with-chunked-prefill-compiles"
    assert github_slug("`qbuild plan --format tree|json|dot|mermaid`") == "qbuild-plan---format-treejsondotmermaid"
    assert github_slug("8. NeuronConfig and InferenceConfig: arguments *(double)*") == \
        "8-neuronconfig-and-inferenceconfig-arguments-double"
    assert github_slug("CI: `.github/workflows/publish.yml`") == "ci-githubworkflowspublishyml"
    assert github_slug("snake_case stays") == "snake_case-stays"


def test_the_readme_is_at_most_200_lines():
    lines = (REPO / "README.md").read_text().count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; move detail into docs/ (at most {README_MAX_LINES})"


def test_ci_runs_the_readme_set_up_commands():
    """The README opens with the two commands that do everything on a fresh machine; CI runs the test one."""
    readme = (REPO / "README.md").read_text()
    first_block = readme.split("```", 2)[1]
    assert re.search(r"^make demo\b", first_block, re.M) and re.search(r"^make test\b", first_block, re.M), first_block
    targets = re.findall(r"^([\w-]+):", (REPO / "Makefile").read_text(), re.M)
    assert {"demo", "test"} <= set(targets)
    assert re.search(r"^make test$", (REPO / ".ci" / "run").read_text(), re.M)
