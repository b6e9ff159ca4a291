"""CLI commands over bench.ecosystem (registered on the `bench` app in bench/cli/__init__.py): import, export;
and `--from FILE`, the option layout, estimate, run and sweep take to read a framework's config directly.

Exit status of `bench import`: 0 when every config of the source is exactly expressible, 1 when one is not
(the table says which keys block it), 2 for a source nothing sensible can be read from."""
from __future__ import annotations

import sys

import click

from bench.cli.options import echo_json, positive_int, write_text_atomically

COMMANDS: list[click.Command] = []
STATUS_ORDER = ("mapped", "defaulted", "conflict", "dropped")


BLOCK = click.option("--block", "blocks", multiple=True, help="only this block of a functional test's model_config.yaml "
                     "(MODEL_ARGS, MODEL_ARGS_2, …; repeatable)")


def pick(imports, blocks: tuple[str, ...], source: str):
    """The configs of the blocks asked for (all when none is named)."""
    from bench.config import ConfigError
    if not blocks:
        return imports
    unknown = sorted(set(blocks) - {i.label for i in imports})
    if unknown:
        raise ConfigError(f"{source}: --block {unknown[0]}: no such block (the file holds "
                          f"{', '.join(i.label or 'one config' for i in imports)})")
    return [i for i in imports if i.label in blocks]


def from_options(func):
    """`--from FILE` (+ `--block`, `--model-config`, `--approximate`): the config read from a framework's file."""
    func = BLOCK(func)
    func = click.option("--approximate", is_flag=True,
                        help="with --from: use the closest config even when the source is not exactly expressible")(func)
    func = click.option("--model-config", type=click.Path(dir_okay=False), default=None,
                        help="with --from: an HF config.json for the model's shape")(func)
    return click.option("--from", "source", type=click.Path(dir_okay=False), default=None,
                        help="read the config from a Megatron-LM script or model_config.yaml, a DeepSpeed JSON, a "
                             "torchtitan TOML or an HF config.json (bench import explains it); flags given beside "
                             "it override its values")(func)


def config_from_source(source: str, options: dict, model_config: str | None, approximate: bool, blocks=()):
    """The one config of `source`, with the config options given beside --from applied over it."""
    from bench.cli.options import given_options
    from bench.config import ConfigError
    from bench.ecosystem import read_source
    given = given_options(options)
    imports = pick(read_source(source, given.pop("world_size", None), model_config, given.pop("model", None)), blocks, source)
    if len(imports) > 1:
        raise ConfigError(f"{source} holds {len(imports)} configs ({', '.join(i.label for i in imports)}): pick one "
                          f"with --block, or `bench sweep --from {source}` for all")
    imp = imports[0]
    if imp.problems and not approximate:
        raise ConfigError(f"{source} is not exactly expressible: {imp.problems[0]}"
                          + (f" (and {len(imp.problems) - 1} more: bench import {source})" if len(imp.problems) > 1 else "")
                          + "; add --approximate to use the closest config")
    cfg = imp.config()
    return cfg.replace(**given) if given else cfg


def spec_from_source(source: str, world_size, model_config, approximate: bool, blocks=()):
    """`bench sweep --from FILE`: the sweep an import would write, parsed as a sweep file."""
    from pathlib import Path

    from bench.config import ConfigError
    from bench.ecosystem import read_source, sweep_data
    from bench.sweep.spec import parse_sweep
    imports = pick(read_source(source, world_size, model_config), blocks, source)
    blocked = [f"{i.label or source}: {i.problems[0]}" for i in imports if i.problems]
    if blocked and not approximate:
        raise ConfigError(f"{source} is not exactly expressible ({blocked[0]}); add --approximate to use the closest configs")
    name = source_name(source)
    return parse_sweep(sweep_data(imports, name), source, name)


def source_name(source: str) -> str:
    """A sweep's name for a source: the file's stem, or its folder's for a functional test's model_config.yaml."""
    from pathlib import Path
    path = Path(source)
    return "megatron" if source == "megatron" else path.parent.name if path.stem == "model_config" else path.stem


@click.command("import")
@click.argument("source", metavar="FILE|megatron")
@click.argument("args", nargs=-1, type=click.UNPROCESSED, metavar="[-- ARGS…]")
@click.option("--world-size", type=positive_int(), default=None,
              help="GPUs of the run (Megatron arguments and DeepSpeed JSON do not hold it)")
@click.option("--model-config", type=click.Path(dir_okay=False), default=None,
              help="an HF config.json: the model's shape where the source leaves it out")
@click.option("--model", default=None, help="a preset as the model's shape (a DeepSpeed JSON holds none)")
@click.option("-o", "--out", type=click.Path(dir_okay=False, writable=True), default=None,
              help="write the sweep file (one run per config) for `bench sweep`")
@click.option("--approximate", is_flag=True, help="write the sweep even when a config is not exactly expressible")
@click.option("--json", "as_json", is_flag=True, help="the configs and every source key's fate as JSON")
@BLOCK
def import_(source, args, world_size, model_config, model, out, approximate, as_json, blocks):
    """Read a framework's config: Megatron-LM (a launch script, a functional test's model_config.yaml, or
    `bench import megatron -- ARGS…`), a DeepSpeed JSON (the launch arguments after --), a torchtitan TOML
    or print_config JSON, an HF config.json. Prints what became of every key; exits 1 when a config is not
    exactly expressible."""
    from bench.ecosystem import read_megatron, read_source, sweep_text
    if source == "megatron":
        imports = read_megatron(list(args), world_size, model_config, model)
    else:
        imports = pick(read_source(source, world_size, model_config, model, tuple(args)), blocks, source)
    exact = all(imp.exact for imp in imports)
    if as_json:
        echo_json({"exact": exact, "configs": [{**imp.to_dict(), "config": _config_dict(imp)} for imp in imports]})
    else:
        for imp in imports:
            _print_import(imp)
    if out and (exact or approximate):
        write_text_atomically(out, sweep_text(imports, source_name(source), "bench import " + " ".join(sys.argv[2:])))
        click.echo(f"wrote {out} ({len(imports)} run(s)): bench sweep {out}", err=True)
    elif out:
        click.echo(f"{out} not written: not exactly expressible (add --approximate to write the closest configs)", err=True)
    sys.exit(0 if exact else 1)


def _config_dict(imp):
    try:
        return imp.config().to_dict()
    except (ValueError, TypeError):
        return None


def _print_import(imp) -> None:
    title = f"{imp.source}" + (f" [{imp.label}]" if imp.label else "") + f" ({imp.framework}): {len(imp.entries)} keys"
    click.echo(title)
    width = min(max((len(e.key) for e in imp.entries), default=10), 48)
    for status in STATUS_ORDER:
        for e in sorted((e for e in imp.entries if e.status == status), key=lambda e: not e.blocks):
            value = "" if e.value is None else str(e.value)
            value = value if len(value) <= 28 else value[:25] + "…"
            mark = "BLOCKS " if e.blocks else ""
            click.echo(f"  {status:<9} {e.key:<{width}} {value:<28} {mark}{e.detail}")
    problems = imp.problems
    if problems:
        click.echo(f"NOT exactly expressible ({len(problems)}): " + "; ".join(problems))
        return
    cfg = imp.config()
    click.echo(f"exactly expressible: run_id {cfg.run_id}: {cfg.backend} tp {cfg.tp} × cp {cfg.cp} × pp {cfg.pp} × "
               f"dp {cfg.dp} = {cfg.world} (order {cfg.order}), micro_batch {cfg.micro_batch} × micro_batches "
               f"{cfg.micro_batches}, model {cfg.model}" + (f" + {', '.join(cfg.model_overrides)}" if cfg.model_overrides else ""))


@click.command("export")
@click.option("--config", "sweep", type=click.Path(dir_okay=False), default=None, help="a sweep file (one run, or --run-id)")
@click.option("--row", "results", type=click.Path(), default=None, help="a results folder or parquet (with --run-id)")
@click.option("--run-id", default=None, help="which run of the sweep file or results")
@click.option("--to", "to", type=click.Choice(["megatron", "deepspeed", "torchtitan"]), required=True)
@click.option("-o", "--out", type=click.Path(dir_okay=False, writable=True), default=None, help="write it here (default: stdout)")
def export(sweep, results, run_id, to, out):
    """Write one config as Megatron-LM launch arguments, a DeepSpeed JSON (and its launch line) or a torchtitan TOML."""
    if bool(sweep) == bool(results):
        raise click.UsageError("give one of --config SWEEP.yaml or --row RESULTS --run-id ID")
    cfg = _config_of_sweep(sweep, run_id) if sweep else _config_of_row(results, run_id)
    emit(cfg, to, out)


def emit(cfg, to: str, out: str | None) -> None:
    """`cfg` in framework `to`'s terms, to `out` or stdout (DeepSpeed: the launch line on stderr)."""
    from bench.ecosystem import deepspeed_launch, export as render
    text = render(cfg, to)
    if out:
        write_text_atomically(out, text)
        click.echo(f"wrote {out} ({to}, run_id {cfg.run_id})", err=True)
    else:
        click.echo(text, nl=False)
    if to == "deepspeed":
        click.echo(f"launch: {deepspeed_launch(cfg, out or 'ds_config.json')}", err=True)


def _config_of_sweep(path: str, run_id: str | None):
    from bench.config import ConfigError
    from bench.sweep.spec import expand, load_sweep
    every = expand(load_sweep(path)).runs
    runs = [r for r in every if r.run_id == run_id] if run_id else every
    if len(runs) != 1:
        ids = ", ".join(r.run_id for r in every[:8])
        raise ConfigError(f"{path}: {'no run ' + run_id if run_id else f'{len(runs)} runs'}; pick one with --run-id ({ids})")
    return runs[0]


def _config_of_row(path: str, run_id: str | None):
    import json

    from bench.cli.options import _base
    from bench.config import FIELDS, LIST_FIELDS, ConfigError, RunConfig, annotation
    from bench.results.store import load_results
    if not run_id:
        raise click.UsageError("--row needs --run-id ID")
    df = load_results(path)
    rows = df[df["run_id"] == run_id].to_dict("records")
    if not rows:
        raise ConfigError(f"{path}: no row with run_id {run_id}")
    row = {k: (v.item() if hasattr(v, "item") else v) for k, v in rows[0].items() if k in FIELDS}
    row = {k: v for k, v in row.items() if v is not None and v == v}  # NaN: a column this row leaves empty
    for name in LIST_FIELDS:
        if isinstance(row.get(name), str):
            row[name] = tuple(json.loads(row[name]))
    for name, value in row.items():  # an integer column stored as float beside empty cells
        if isinstance(value, float) and value.is_integer() and _base(annotation(name)) is int:
            row[name] = int(value)
    return RunConfig(**row)


COMMANDS += [import_, export]
