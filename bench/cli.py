"""`bench`: thin commands over the library. Commands parse, call, print; known errors print one
line and exit 2 (no traceback)."""
from __future__ import annotations

import sys

import click

from bench.cli_options import config_from_options, config_options, echo_json
from bench.config import ConfigError


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
def app():
    """parabench: benchmark and explain tensor × pipeline × data-parallel training."""


@app.command()
@config_options
@click.option("--launcher", type=click.Choice(["local", "debug"]), default="local", show_default=True,
              help="local: world-size processes on this machine; debug: in this process (world 1)")
@click.option("--json", "as_json", is_flag=True, help="print the result row as one JSON object")
@click.option("--trace-dir", default="traces", show_default=True, type=click.Path(file_okay=False),
              help="with --profile: the traces go to TRACE_DIR/<run_id>/")
def run(launcher, as_json, trace_dir, **options):
    """Run one benchmark configuration and print its result row."""
    cfg = config_from_options(options)
    from bench.sweep.local import run_debug, run_local
    if cfg.profile:
        from bench.metrics.profile import check_writable
        check_writable(trace_dir)  # refused in one line before any rank starts
    click.echo(f"running {cfg.backend} tp={cfg.tp} pp={cfg.pp} dp={cfg.dp} ({cfg.world} ranks) "
               f"run_id={cfg.run_id}", err=True)
    row = (run_debug if launcher == "debug" else run_local)(cfg, trace_dir if cfg.profile else None)
    if as_json:
        echo_json(row)
    else:
        _print_row(row)
    if row.get("trace_dir"):
        click.echo(f"trace: {row['trace_dir']}/trace_rank*.json (Perfetto / chrome://tracing), ops_rank*.md", err=True)
    sys.exit(0 if row["status"] == "ok" else 1)


def _print_row(row: dict) -> None:
    from bench.layout import DIMS
    from bench.results import comm_column
    if row["status"] != "ok":
        click.echo(f"status: {row['status']}\n{row['error']}")
        return
    click.echo(f"status: ok   loss {row['loss_first']:.4f} → {row['loss_last']:.4f}")
    click.echo(f"step {row['step_time_s'] * 1e3:.1f} ms (p10 {row['step_time_p10_s'] * 1e3:.1f}, "
               f"p90 {row['step_time_p90_s'] * 1e3:.1f})   {row['tokens_per_s']:.0f} tokens/s   "
               f"MFU {row['mfu']:.2%}")
    click.echo(f"peak step memory {row['peak_mem_bytes'] / 2**20:.1f} MiB/rank   "
               f"persistent {row['persistent_bytes'] / 2**20:.1f} MiB/rank")
    for dim in DIMS:
        click.echo(f"comm {dim}: {row.get(comm_column('bytes', dim), 0) / 2**20:.3f} MiB/step payload, "
                   f"{row.get(comm_column('wire_bytes', dim), 0) / 2**20:.3f} MiB wire, "
                   f"{row.get(comm_column('ops', dim), 0):.0f} ops")


def _register_groups() -> None:
    """One module per command group; each lists its click commands in COMMANDS (imports stay light)."""
    from bench.analysis.commands import COMMANDS as analysis
    from bench.report.commands import COMMANDS as report
    from bench.sweep.commands import COMMANDS as sweep
    for command in (*sweep, *report, *analysis):
        app.add_command(command)


_register_groups()


def main() -> None:
    try:
        app(standalone_mode=False)
    except click.exceptions.Exit as e:
        sys.exit(e.exit_code)
    except click.ClickException as e:
        e.show()
        sys.exit(2)
    except click.exceptions.Abort:
        sys.exit(130)
    except (ConfigError, ValueError, FileNotFoundError) as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(2)


if __name__ == "__main__":
    main()
