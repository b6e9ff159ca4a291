"""`python -m bench.results`: print the column table from the declaration; `--write` puts it into
README.md and docs/architecture.md (tests/test_results.py checks that both hold it)."""
import sys
from pathlib import Path

from bench.results.schema import markdown_table

ROOT = Path(__file__).resolve().parents[2]
BEGIN, END = "<!-- schema:begin -->", "<!-- schema:end -->"


def write_tables() -> None:
    table = markdown_table()
    readme = ROOT / "README.md"
    text = readme.read_text()
    start = text.index("| column | unit | kind |")
    readme.write_text(text[:start] + table + text[text.index("\n\n", start):])
    doc = ROOT / "docs" / "architecture.md"
    text = doc.read_text()
    doc.write_text(text[:text.index(BEGIN) + len(BEGIN)] + "\n" + table + "\n" + text[text.index(END):])


if "--write" in sys.argv[1:]:
    write_tables()
else:
    print(markdown_table())
