"""`python -m bench.results`: print the README's column table from the declaration."""
from bench.results.schema import markdown_table

print(markdown_table())
