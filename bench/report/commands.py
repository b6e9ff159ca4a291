"""CLI commands of bench.report (registered on the `bench` app in bench/cli.py)."""
import click

COMMANDS: list[click.Command] = []
