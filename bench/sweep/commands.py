"""CLI commands of bench.sweep (registered on the `bench` app in bench/cli.py)."""
import click

COMMANDS: list[click.Command] = []
