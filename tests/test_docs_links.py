"""The README and the pages under docs/: links that lead somewhere, a README read in five minutes.

Every relative link in the README, in docs/*.md and in the READMEs of notebooks/
and benchmarks/ must name a file that exists, and its `#anchor` a heading of
that file under GitHub's rules for heading ids. The README stays under 200 lines,
its prose lines (tables, code blocks and link definitions aside) and those of
the docs pages no longer than a screen. Every page under docs/ is linked from
the README, and every test that docs/reliability.md names exists.
"""

import pathlib
import re
import unicodedata
import urllib.parse

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [README, *DOCS, ROOT / "notebooks" / "README.md", ROOT / "benchmarks" / "README.md"]

README_MAX_LINES = 200
# A line of prose on a laptop screen beside a notebook; table rows cannot wrap,
# a code block keeps the lines it runs, and a link definition holds one URL.
PROSE_MAX_CHARACTERS = 100

FENCE = re.compile(r"^ {0,3}(```|~~~)")
HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)(?:\s+#+)?\s*$")
LINK_DEFINITION = re.compile(r"^ {0,3}\[[^\]]+\]:\s*<?([^\s>]+)>?")
INLINE_LINK = re.compile(r"\]\(\s*<?([^\s)>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HTML_ANCHOR = re.compile(r"<a\s+(?:id|name)=\"([^\"]+)\"")
CODE_SPAN = re.compile(r"`+[^`\n]*`+")
SCHEME = re.compile(r"^(?:[a-zA-Z][a-zA-Z0-9+.-]*:|//)")


def outside_code_blocks(text):
    """The page's lines, numbered from 1, with fenced code blocks left out."""
    fenced = False
    for number, line in enumerate(text.splitlines(), start=1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            yield number, line


def prose_lines(text):
    """Lines a reader reads as prose: no code block, table row or link definition."""
    for number, line in outside_code_blocks(text):
        if not line.lstrip().startswith("|") and not LINK_DEFINITION.match(line):
            yield number, line


def github_slug(heading):
    """The id GitHub gives a heading: its text in lower case, punctuation and
    symbols dropped (`-` and `_` kept), each space a hyphen."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link reads as its text
    text = re.sub(r"<[^>]+>", "", text).lower()
    kept = "".join(ch for ch in text if ch in " -_" or unicodedata.category(ch)[0] in "LNM")
    return kept.replace(" ", "-")


def anchors(text):
    """Every `#anchor` a page offers: its headings' ids (a repeated one numbered
    `-1`, `-2`, ... as GitHub numbers it) and explicit HTML anchors."""
    found, seen = set(HTML_ANCHOR.findall(text)), {}
    for _, line in outside_code_blocks(text):
        heading = HEADING.match(line)
        if heading:
            slug = github_slug(heading.group(2))
            found.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
            seen[slug] = seen.get(slug, 0) + 1
    return found


def links(text):
    """(line number, target) of every inline link, image and link definition."""
    for number, line in outside_code_blocks(text):
        line = CODE_SPAN.sub("", line)
        definition = LINK_DEFINITION.match(line)
        if definition:
            yield number, definition.group(1)
        for target in INLINE_LINK.findall(line):
            yield number, target


def broken_links(page, root=ROOT):
    """What is wrong with each relative link of a page, one line each."""
    problems = []
    text = page.read_text(encoding="utf-8")
    for number, target in links(text):
        if SCHEME.match(target):
            continue  # the web is not checked: no network at test time
        path, _, anchor = target.partition("#")
        where = f"{page.relative_to(root)}:{number}: {target}"
        linked = (page.parent / urllib.parse.unquote(path)).resolve() if path else page
        if not linked.exists():
            problems.append(f"{where}: no file {linked.relative_to(root) if linked.is_relative_to(root) else linked}")
        elif anchor and linked.suffix == ".md":
            offered = anchors(linked.read_text(encoding="utf-8"))
            if urllib.parse.unquote(anchor) not in offered:
                problems.append(f"{where}: no heading with the id {anchor!r} in "
                                f"{linked.relative_to(root)} (its ids: {', '.join(sorted(offered))})")
    return problems


@pytest.mark.parametrize("page", PAGES, ids=lambda page: str(page.relative_to(ROOT)))
def test_every_relative_link_leads_to_a_file_and_its_anchor_to_a_heading(page):
    problems = broken_links(page)
    assert not problems, "\n".join(problems)


def test_the_link_check_finds_a_missing_file_and_a_missing_heading(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "page.md").write_text(
        "# The page\n\n## How each backend gets a step's values out\n\n"
        "## On JAX (`overhead_jax.py`)\n\n## Repeated\n\n## Repeated\n", encoding="utf-8")
    readme = tmp_path / "README.md"
    readme.write_text(
        "# Top\n\n"
        "[fine](docs/page.md#how-each-backend-gets-a-steps-values-out), "
        "[fine too](docs/page.md#on-jax-overhead_jaxpy) and [this page](#top)\n"
        "[second of two](docs/page.md#repeated-1) [on the web](https://example.org/none)\n"
        "[no file](docs/gone.md) and [no heading](docs/page.md#on-jax)\n"
        "[definition]: docs/missing.png\n"
        "```\n[inside code](docs/none.md)\n```\n"
        "`[in a code span](docs/none.md)`\n", encoding="utf-8")
    problems = broken_links(readme, root=tmp_path)
    assert [problem.split(": ", 2)[1] for problem in problems] == [
        "docs/gone.md", "docs/page.md#on-jax", "docs/missing.png"]
    assert "README.md:5:" in problems[0] and "no file docs/gone.md" in problems[0]
    assert "no heading with the id 'on-jax' in docs/page.md" in problems[1]


def test_the_readme_reads_in_five_minutes():
    text = README.read_text(encoding="utf-8")
    assert len(text.splitlines()) < README_MAX_LINES, (
        f"README.md has {len(text.splitlines())} lines: move detail into a page under docs/ "
        f"and link it")
    long_lines = [f"README.md:{number} ({len(line)})" for number, line in prose_lines(text)
                  if len(line) > PROSE_MAX_CHARACTERS]
    assert long_lines == [], f"wrap these prose lines at {PROSE_MAX_CHARACTERS} characters"


@pytest.mark.parametrize("page", DOCS, ids=lambda page: page.name)
def test_the_prose_of_a_docs_page_fits_a_screen(page):
    long_lines = [f"{page.name}:{number} ({len(line)})"
                  for number, line in prose_lines(page.read_text(encoding="utf-8"))
                  if len(line) > PROSE_MAX_CHARACTERS]
    assert long_lines == [], f"wrap these prose lines at {PROSE_MAX_CHARACTERS} characters"


def test_the_readme_links_every_docs_page():
    linked = {(README.parent / target.partition("#")[0]).resolve()
              for _, target in links(README.read_text(encoding="utf-8"))}
    unlinked = [page.name for page in DOCS if page.resolve() not in linked]
    assert not unlinked, f"link these pages from README.md's Documentation: {unlinked}"


def test_every_reliability_promise_names_a_test_that_exists():
    text = (ROOT / "docs" / "reliability.md").read_text(encoding="utf-8")
    rows = [line for line in text.splitlines() if line.startswith("| ") and "`" in line.split("|")[2]]
    assert len(rows) >= 10
    for row in rows:
        for file, test in re.findall(r"`((?:tests/widgets/)?[\w/]+\.py)(?:::(\w+))?`", row.split("|")[2]):
            path = ROOT / (file if file.startswith("tests/") else pathlib.Path("tests", "lab", file))
            assert path.is_file(), row
            assert not test or f"def {test}(" in path.read_text(encoding="utf-8"), (file, test)
