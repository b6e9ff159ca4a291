"""`bench`: thin commands over the library. Commands parse, call, print; known errors print one
line and exit 2 (no traceback)."""
from __future__ import annotations

import sys

import click

from bench.cli.ecosystem import config_from_source, from_options
from bench.cli.options import config_from_options, config_options, echo_json
from bench.config import ConfigError


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
def app():
    """parabench: benchmark and explain tensor × pipeline × data-parallel training."""


@app.command()
@config_options()
@click.option("--launcher", type=click.Choice(["local", "debug"]), default="local", show_default=True,
              help="local: world-size processes on this machine; debug: in this process (world 1)")
@click.option("--json", "as_json", is_flag=True, help="print the result row as one JSON object")
@click.option("--trace-dir", default="traces", show_default=True, type=click.Path(file_okay=False),
              help="with --profile: the traces go to TRACE_DIR/<run_id>/")
@click.option("--no-calibrate", is_flag=True,
              help="do not measure this machine first: predict on a profile measured here before, else the built-in")
@click.option("--hardware", default=None, help="predict the row on this profile (name or YAML file); nothing is calibrated")
@from_options
def run(launcher, as_json, trace_dir, no_calibrate, hardware, source, model_config, approximate, blocks, **options):
    """Run one benchmark configuration and print its result row."""
    cfg = config_from_source(source, options, model_config, approximate, blocks) if source else config_from_options(options)
    from bench.sweep.local import DebugLauncher, run_debug, run_local
    from bench.sweep.runner import calibrate_here, local_size_reason
    reason = local_size_reason(cfg.world, cfg.device) if launcher == "local" else DebugLauncher().unsupported(cfg)
    if reason:  # before anything starts
        raise ConfigError(reason)
    if cfg.profile:
        from bench.metrics.profile import check_writable
        check_writable(trace_dir)  # refused in one line before any rank starts
    from bench.analysis.hardware import get_hardware
    from bench.layout import named_dims
    hw = get_hardware(hardware) if hardware else None  # a bad name or file: one line, before anything starts
    note = None if no_calibrate or hw else calibrate_here([cfg], launcher)
    if note:
        click.echo(note, err=True)
    layout = " ".join(f"{d}={getattr(cfg, d)}" for d in named_dims(cfg.cp, cfg.ep))
    click.echo(f"running {cfg.backend} {layout} ({cfg.world} ranks) run_id={cfg.run_id}", err=True)
    row = (run_debug if launcher == "debug" else run_local)(cfg, trace_dir if cfg.profile else None, hw)
    if as_json:
        echo_json(row)
    else:
        _print_row(row)
    if row.get("trace_dir"):
        click.echo(f"trace: {row['trace_dir']}/trace_rank*.json (Perfetto / chrome://tracing), ops_rank*.md", err=True)
    sys.exit(0 if row["status"] == "ok" else 1)


def _print_row(row: dict) -> None:
    from bench.layout import named_dims
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
    for dim in named_dims(row["cp"], row.get("ep") or 1):
        click.echo(f"comm {dim}: {row.get(comm_column('bytes', dim), 0) / 2**20:.3f} MiB/step payload, "
                   f"{row.get(comm_column('wire_bytes', dim), 0) / 2**20:.3f} MiB wire, "
                   f"{row.get(comm_column('ops', dim), 0):.0f} ops")


def _register_groups() -> None:
    """One module per command group; each lists its click commands in COMMANDS (imports stay light)."""
    from bench.cli.analysis import COMMANDS as analysis
    from bench.cli.ecosystem import COMMANDS as ecosystem
    from bench.cli.report import COMMANDS as report
    from bench.cli.sweep import COMMANDS as sweep
    for command in (*sweep, *report, *analysis, *ecosystem):
        app.add_command(command)


_register_groups()


def main(argv: list[str] | None = None) -> None:
    """The one error handler: a known mistake prints `error: …` (one line, naming the key, value or
    file) and exits 2; Ctrl-C exits 130; anything else is a bug of ours: one line, the traceback saved to
    a file (never printed), exit 3. `bench run` exits 1 for a failed run, `compare` 1 for a regression."""
    try:
        app(args=argv, prog_name="bench", standalone_mode=False)
    except click.exceptions.Exit as e:
        sys.exit(e.exit_code)
    except getattr(click.exceptions, "NoArgsIsHelpError", ()) as e:  # `bench`, `bench history`: the help
        click.echo(e.ctx.get_help(), err=True)
        sys.exit(2)
    except click.ClickException as e:  # click's own mistakes (an option's type, a missing argument) as one line
        ctx = getattr(e, "ctx", None)
        hint = f" (see `{ctx.command_path} --help`)" if ctx is not None else ""
        click.echo(f"error: {e.format_message()}{hint}", err=True)
        sys.exit(2)
    except (click.exceptions.Abort, KeyboardInterrupt):
        sys.exit(130)
    except BrokenPipeError:  # `bench … | head`
        sys.exit(0)
    except (ConfigError, ValueError, OSError) as e:
        click.echo(f"error: {_one_line(e)}", err=True)
        sys.exit(2)
    except Exception as e:  # noqa: BLE001 - the last resort: no raw traceback for a user
        click.echo(f"internal error: {type(e).__name__}: {_one_line(e)} (traceback saved to {_save_traceback()}; "
                   "please report it)", err=True)
        sys.exit(3)


def _one_line(error: BaseException) -> str:
    """The message of a known error as one line: an OSError as `path: reason`."""
    if isinstance(error, OSError) and error.filename is not None:
        return f"{error.filename}: {error.strerror or error}"
    lines = [ln.strip() for ln in str(error).splitlines() if ln.strip()]
    return " · ".join(lines[:3])[:2000] or type(error).__name__


def _save_traceback() -> str:
    """The current exception's traceback in ~/.cache/parabench/tracebacks/ (or the temp folder)."""
    import os
    import tempfile
    import time
    import traceback

    from bench.environment import cache_dir
    text = traceback.format_exc()
    for folder in (str(cache_dir() / "tracebacks"), tempfile.gettempdir()):
        try:
            os.makedirs(folder, exist_ok=True)
            path = os.path.join(folder, f"bench-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.txt")
            with open(path, "w") as f:
                f.write(text)
            return path
        except OSError:
            continue
    return "nowhere: no writable folder"

