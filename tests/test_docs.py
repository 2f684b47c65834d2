"""The pages a user reads: every relative link in README.md and docs/ resolves (the file, and the
heading an anchor names, by GitHub's rule for heading anchors), and every `dsa-train` command
line in README's code blocks parses with the real command-line parser (options, arguments and
their types; nothing runs)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import typer

from dsa_train.cli.app import app

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)|!\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def anchors(page: Path) -> set[str]:
    """GitHub's anchors of a page's headings: lower case, punctuation but - and _ dropped,
    spaces to -, a repeated one numbered -1, -2, ..."""
    seen: dict[str, int] = {}
    found = set()
    for line in FENCE.sub("", page.read_text(encoding="utf-8")).splitlines():
        heading = re.match(r"#{1,6}\s+(.*)", line)
        if not heading:
            continue
        text = re.sub(r"`|\*\*|\[([^\]]*)\]\([^)]*\)", r"\1", heading.group(1).strip())
        slug = re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        found.add(slug if count == 0 else f"{slug}-{count}")
    return found


def links(page: Path) -> list[str]:
    text = FENCE.sub("", page.read_text(encoding="utf-8"))
    return [a or b for a, b in LINK.findall(text)]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_relative_link_resolves(page):
    broken = []
    for target in links(page):
        if re.match(r"[a-z]+:", target):  # https:, mailto: ...: not ours to check offline
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(f"{target} (no file {file.relative_to(ROOT) if file.is_relative_to(ROOT) else file})")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file):
            broken.append(f"{target} (no heading #{anchor} in {file.name})")
    assert not broken, f"{page.name}: " + "; ".join(broken)


def readme_commands() -> list[str]:
    lines = []
    for block in FENCE.findall((ROOT / "README.md").read_text(encoding="utf-8")):
        for line in block.splitlines()[1:-1]:
            line = line.strip()
            if line.startswith("dsa-train "):
                lines.append(line)
    return lines


def test_readme_has_command_lines():
    assert len(readme_commands()) >= 10  # the parse test below has something to check


@pytest.mark.parametrize("line", readme_commands(), ids=lambda line: line.split("#")[0].strip())
def test_every_readme_command_line_parses(line):
    name, *args = shlex.split(line, comments=True)[1:]
    group = typer.main.get_command(app)
    parent = group.context_class(group, info_name="dsa-train")
    command = group.get_command(parent, name)
    assert command is not None, f"no command {name!r}"
    try:
        command.make_context(name, args, parent=parent)
    except Exception as e:  # click's (or typer's vendored) BadParameter: a path that must exist, in an example
        if type(e).__name__ != "BadParameter" or "does not exist" not in str(e):
            raise
