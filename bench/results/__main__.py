"""`python -m bench.results`: print the column table from the declaration; `--write` puts it into
docs/row-schema.md, its one copy (tests/test_results.py checks that the page holds it)."""
import sys
from pathlib import Path

from bench.results.schema import markdown_table

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "row-schema.md"
BEGIN, END = "<!-- schema:begin -->", "<!-- schema:end -->"


def write_table() -> None:
    text = PAGE.read_text()
    PAGE.write_text(text[:text.index(BEGIN) + len(BEGIN)] + "\n" + markdown_table() + "\n" + text[text.index(END):])


if "--write" in sys.argv[1:]:
    write_table()
else:
    print(markdown_table())
