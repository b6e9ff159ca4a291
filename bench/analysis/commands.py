"""CLI commands of bench.analysis (registered on the `bench` app in bench/cli.py)."""
import click

COMMANDS: list[click.Command] = []
