"""`python -m bench.cli`: the console script `bench` without installing it."""
from bench.cli import main

main()
