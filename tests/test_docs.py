"""The docs as a front door and one page per topic: the README stays short and starts with the two
commands CI runs, every docs page is reachable from it, every relative link and anchor resolves, every
file the README sends a reader to exists, and the knobs page names every RunConfig field. Pure: reads
files only. (The row schema's one copy: tests/test_results.py; the presets table: tests/test_model.py.)"""
import re
from dataclasses import fields
from pathlib import Path

from bench.config import RunConfig

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = sorted((ROOT / "docs").glob("*.md"))
README_BUDGET = 10_000  # bytes: torchtitan's README is 11.6 KB, picotron's 3.2 KB
LINK = re.compile(r"\]\(([^)\s]+)\)")


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces → hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)  # a '#' in a code block is no heading
    return {slug(m[1]) for m in re.finditer(r"^#{1,6} (.+)$", text, re.M)}


def test_readme_is_short_and_starts_with_the_two_commands_ci_runs():
    text = README.read_text()
    assert len(text.encode()) <= README_BUDGET, f"README.md is {len(text.encode())} bytes; move detail to docs/"
    first_block = re.search(r"```bash\n(.*?)```", text, re.S)[1].splitlines()
    assert len(first_block) == 2 and first_block[0].endswith("bench sweep sweeps/quickstart.yaml")
    assert first_block[1] in (ROOT / ".ci" / "run").read_text().splitlines()  # the test command, as CI runs it


def test_every_docs_page_is_linked_from_the_readme():
    linked = {(README.parent / m).resolve() for m in (t.split("#")[0] for t in LINK.findall(README.read_text())) if m}
    assert PAGES and [str(p.relative_to(ROOT)) for p in PAGES if p.resolve() not in linked] == []


def test_every_relative_link_and_anchor_resolves():
    broken = []
    for doc in (README, *PAGES):
        for target in LINK.findall(doc.read_text()):
            if re.match(r"[a-z]+:", target):
                continue  # https:, mailto:
            file, _, anchor = target.partition("#")
            path = (doc.parent / file).resolve() if file else doc
            if not path.exists() or (anchor and path.suffix == ".md" and anchor not in anchors(path)):
                broken.append(f"{doc.relative_to(ROOT)}: {target}")
    assert broken == []


def test_the_files_the_readme_sends_a_reader_to_exist():
    dive = README.read_text().split("## Dive into the code")[1].split("\n## ")[0]
    files = re.findall(r"^\d+\. `([\w/.]+\.py)`", dive, re.M)
    assert len(files) == 8 and [f for f in files if not (ROOT / f).is_file()] == []


def test_the_knobs_page_names_every_runconfig_field():
    page = (ROOT / "docs" / "knobs.md").read_text()
    missing = [f.name for f in fields(RunConfig) if f"`--{f.name.replace('_', '-')}" not in page]
    assert missing == [], f"docs/knobs.md does not describe {missing}"
