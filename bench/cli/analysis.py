"""CLI commands over bench.analysis (registered on the `bench` app in bench/cli/__init__.py): layout, estimate,
plan. They parse, call the pure functions of bench.analysis, and print."""
from __future__ import annotations

import click

from bench.cli.ecosystem import config_from_source, emit, from_options
from bench.cli.options import (ENGINE_FIELDS, FRACTION, LAYOUT_FIELDS, MODEL_FIELDS, config_from_options, config_options,
                               echo_json, given_options, number, positive_int, refuse_unused, write_text_atomically)

COMMANDS: list[click.Command] = []

_MIXED = click.option("--mixed-state", type=click.Choice(["zero", "autocast", "megatron"]), default=None,
                      help="mixed-precision model state: zero = 2+2+12 bytes/param (ZeRO paper, Megatron); "
                           "autocast = 4+4+8 (fp32 weights, as this suite's torch engines); "
                           "megatron = 2+4+12 (fp32 main gradients) [default: the backend's own, as its row's pred_*]")
_ACTS = click.option("--activations", type=click.Choice(["table2", "suite"]), default=None,
                     help="table2 = Korthikanti et al. 2022 (dropout, attention scores saved); "
                          "suite = this suite's GPT (no dropout, fused attention) "
                          "[default: suite, as the rows' pred_*]")
_ATTENTION = click.option("--attention", type=click.Choice(["flash", "unfused"]), default=None,
                          help="attention kernel: flash = fused flash/SDPA (what every engine here runs); "
                               "unfused = the scores materialised and saved (Korthikanti et al.'s Megatron-LM) "
                               "[default: flash, for every backend]")


def _given(options: dict, name: str, default):
    """An option's value, or `default` when it was not given (never for a given 0: the types refuse it)."""
    return default if options.get(name) is None else options[name]


def _gib(n: float) -> str:
    return f"{n / 2**30:,.2f} GiB" if n >= 2**28 else f"{n / 2**20:,.2f} MiB"


@click.command("layout")
@config_options(MODEL_FIELDS, LAYOUT_FIELDS, ENGINE_FIELDS)
@click.option("--gpus-per-node", type=positive_int(), default=8, show_default=True, help="GPUs per node")
@click.option("--rack-size", type=positive_int(), default=None,
              help="nodes per rack: warn about pipeline sends across racks")
@click.option("--any-engine", is_flag=True,
              help="with --model: check only the layout and model (what Megatron-LM could run), not this suite's backends")
@click.option("--json", "as_json", is_flag=True, help="ranks, groups, links and warnings as JSON")
@from_options
def layout(gpus_per_node, rack_size, any_engine, as_json, source, model_config, approximate, blocks, **options):
    """Explain a tp × cp × pp × dp layout (and ep inside dp × cp): which GPU computes which stage and holds
    which sequence chunks and experts, who talks to whom, over which link.

    With --model, each group also shows the ops and bytes per step it moves (other flags as `bench run`);
    with --seq (or --model) and --cp, the tokens each cp rank holds."""
    from bench.analysis.explain import explain, format_text
    from bench.config import ConfigError
    from bench.layout import Layout, layout_product, seq_split_reason
    if source:  # the layout, model and step of a framework's config
        cfg = config_from_source(source, options, model_config, approximate, blocks)
        info = explain(Layout(tp=cfg.tp, pp=cfg.pp, dp=cfg.dp, order=cfg.order, cp=cfg.cp, gpus_per_node=gpus_per_node,
                              ep=cfg.ep),
                       rack_size, cfg, seq=cfg.seq)
        echo_json(info) if as_json else click.echo(format_text(info))
        return
    lay = Layout(tp=_given(options, "tp", 1), pp=_given(options, "pp", 1), dp=_given(options, "dp", 1),
                 order=_given(options, "order", "tp-pp-dp"), cp=_given(options, "cp", 1), gpus_per_node=gpus_per_node,
                 ep=_given(options, "ep", 1))
    if not options["model"]:
        refuse_unused(options, (*LAYOUT_FIELDS, *(("seq",) if lay.cp > 1 else ())),
                      "without --model (the layout alone is explained; --seq places the chunks of --cp > 1); "
                      "add --model")
    world = options.get("world_size")
    if world is not None and world != lay.world_size:  # a typo in the layout, not a layout to explain
        raise ConfigError(f"{layout_product(lay)} = {lay.world_size}, but --world-size is {world}")
    cfg, seq = None, options.get("seq")
    if options["model"]:
        cfg = _shape_from_options(options) if any_engine else config_from_options(options)
    elif seq is not None and seq_split_reason(seq, lay.cp):
        raise ConfigError(f"--seq: {seq_split_reason(seq, lay.cp)}")
    info = explain(lay, rack_size, cfg, seq=seq)
    if as_json:
        echo_json(info)
    else:
        click.echo(format_text(info))


@click.command("estimate")
@config_options(MODEL_FIELDS, LAYOUT_FIELDS, ENGINE_FIELDS)
@click.option("--params", "n_params", type=number("params", gt=0, le=1e16), default=None,
              help="a bare parameter count (e.g. 7.5e9): model-state memory only, from --dp --zero --dtype")
@click.option("--hardware", default=None, help="profile name (a100-80gb, h100-sxm, h100-hbm2e-500w, h200, cpu) or a "
                                                "YAML file: adds the predicted step time, tokens/s and MFU")
@click.option("--gpus-per-node", type=positive_int(), default=None, help="GPUs per node (default: the hardware's)")
@_MIXED
@_ACTS
@_ATTENTION
@click.option("--any-engine", is_flag=True,
              help="check only the layout and model (what Megatron-LM could run), not this suite's backends")
@click.option("--json", "as_json", is_flag=True, help="print every predicted figure as one JSON object")
@from_options
def estimate(n_params, hardware, gpus_per_node, mixed_state, activations, attention, any_engine, as_json, source,
             model_config, approximate, blocks, **options):
    """Predict per-rank memory, communication per step, bubble, FLOPs (and time) of one config.

    Takes the same flags as `bench run`; impossible configs are refused with RunConfig's reason."""
    from bench.analysis.estimate import estimate as predict
    from bench.analysis.estimate import estimate_params
    if n_params is not None:
        refuse_unused(options, ("dp", "zero", "dtype"), "with --params (model-state memory from --dp --zero --dtype)")
        est = estimate_params(n_params, _given(options, "dp", 1), int(_given(options, "zero", 0)),
                              _given(options, "dtype", "bf16-mixed"), mixed_state)
    else:
        from models.config import count_params
        if source:
            cfg = config_from_source(source, options, model_config, approximate, blocks)
        else:
            cfg = _shape_from_options(options) if any_engine else config_from_options(options)
        est = {"params": count_params(cfg.model_config), "cp": cfg.cp, "ep": cfg.ep,
               **predict(cfg, hardware, gpus_per_node, mixed_state, activations, attention)}
    if as_json:
        echo_json(est)
        return
    _print_estimate(est)




def _shape_from_options(options: dict):
    """The run's fields with RunConfig's defaults, checked by RunConfig's layout and model rules only."""
    from bench.config import ConfigError, RunConfig, structural_reason
    from models.config import get_preset
    from bench.analysis.estimate import CANDIDATE_FIELDS  # what --any-engine reads: what the cost model reads
    refuse_unused(options, CANDIDATE_FIELDS, "with --any-engine (layout and model checks only); drop it or them")
    given = given_options(options)
    get_preset(given.get("model", "tiny"))  # unknown preset: the error lists the known ones
    cfg = RunConfig.unchecked(**given)
    reason = structural_reason(cfg)
    if reason:
        raise ConfigError(reason)
    return cfg


def _print_estimate(est: dict) -> None:
    from bench.layout import named_dims
    from bench.results.schema import comm_column
    if "world_size" not in est:  # --params
        click.echo(f"{est['params']:.4g} params, dp={est['dp']}, ZeRO-{est['zero']}, {est['dtype']}, per device:")
    else:
        click.echo(f"{est['params']:,} parameters; per rank (stage {est['worst_stage']}, the largest), "
                   f"{est['mixed_state']} state convention, "
                   f"{est['activations']} activations, {est['attention']} attention:")
    for key in ("params_bytes", "grads_bytes", "optimizer_bytes", "activation_bytes", "transient_bytes",
                "total_bytes", "peak_mem_bytes"):  # transient: less the state freed before the step's peak
        if key in est:
            click.echo(f"  {key.removesuffix('_bytes'):<12} {_gib(est[key]):>14}")
    if "world_size" not in est:
        return
    click.echo(f"  activations per layer and micro-batch: {_gib(est['activation_bytes_per_layer'])}")
    click.echo("communication per step and rank (payload / ring wire):")
    for dim in [*named_dims(est["cp"]), *(["ep"] if est["ep"] > 1 else [])]:
        payload, wire = est[comm_column("bytes", dim)], est[comm_column("wire_bytes", dim)]
        click.echo(f"  {dim}: {_gib(payload):>14} / {_gib(wire):>14}")
    click.echo(f"bubble fraction {est['bubble_fraction']:.3f}   model FLOPs per step {est['flops_per_step']:.4g}")
    if "step_time_s" in est:
        dims = [d for d in ("tp", "cp", "ep", "pp", "dp") if d in est["links"]]  # cp, ep: named only where > 1
        click.echo(f"on {est['profile']} (links " + ", ".join(f"{d} {est['links'][d]}" for d in dims) + "): step "
                   f"{est['step_time_s']:.4g} s = compute {est['compute_s']:.4g} + overhead {est['overhead_s']:.4g} "
                   "+ exposed comm " + " ".join(f"{d} {est[f'comm_exposed_{d}_s']:.4g}" for d in dims) +
                   f" + bubble {est['bubble_s']:.4g} + optimizer {est['optimizer_s']:.4g}")
        click.echo(f"  {est['tokens_per_s']:,.0f} tokens/s   MFU {est['mfu']:.1%}   "
                   f"{'fits' if est['fits'] else 'DOES NOT FIT'} in {_gib(est['memory_limit_bytes'])}")


@click.command("plan")
@click.option("--model", required=True, help="model preset (models.PRESETS)")
@click.option("--gpus", type=positive_int(), required=True, help="GPUs in the cluster")
@click.option("--gpus-per-node", type=positive_int(), default=8, show_default=True)
@click.option("--hardware", required=True, help="profile name or YAML file (see bench/analysis/hardware.py)")
@click.option("--global-batch", type=positive_int(1 << 30), required=True, help="sequences per optimizer step")
@click.option("--seq", type=positive_int(1 << 24), default=None, help="sequence length (default: the model's seq_len)")
@click.option("--dtype", type=click.Choice(["bf16-mixed", "fp16-mixed", "fp32"]), default="bf16-mixed",
              show_default=True)
@click.option("--top", type=positive_int(10**6), default=5, show_default=True, help="configs to print")
@click.option("--memory-fraction", type=FRACTION, default=0.9, show_default=True,
              help="share of device memory a config may use")
@click.option("--engines", type=click.Choice(["suite", "any"]), default="suite", show_default=True,
              help="suite: configs this suite's backends run (RunConfig's validator); any: every config a "
                   "complete engine could run (layout and model checks only)")
@_MIXED
@_ACTS
@_ATTENTION
@click.option("--json", "as_json", is_flag=True, help="a list of configs, best first (RunConfig fields + predictions)")
@click.option("--emit-sweep", "emit", type=click.Path(dir_okay=False, writable=True), default=None,
              help="also write the top configs as a sweep file (runs: one entry each) for "
                   "`bench sweep FILE --launcher slurm`")
@click.option("--emit", "framework", type=click.Choice(["megatron", "deepspeed", "torchtitan"]), default=None,
              help="also print the best config that framework can run, in its terms: Megatron-LM arguments (backend "
                   "native), DeepSpeed JSON (deepspeed), torchtitan TOML (fsdp)")
def plan(model, gpus, gpus_per_node, hardware, global_batch, seq, dtype, top, memory_fraction, engines, mixed_state,
         activations, attention, as_json, emit, framework):
    """Rank every valid (tp, pp, dp, sharding, schedule, micro-batch, order) config by predicted throughput."""
    from bench.analysis.planner import describe
    from bench.analysis.planner import plan as make_plan
    if framework and as_json:
        raise click.UsageError("--emit prints the framework's text; drop --json")
    result = make_plan(model, gpus, gpus_per_node, hardware, global_batch, seq, 10**6 if framework else top, dtype,
                       mixed_state, activations, memory_fraction, engines, attention)
    ranked, result.configs = result.configs, result.configs[:top]
    if emit and result.configs:
        _emit_sweep(emit, result, model, gpus, gpus_per_node, hardware, global_batch)
    if as_json:
        echo_json(result.configs)
        return
    click.echo(f"{result.considered:,} configs considered, {result.valid:,} valid and distinct, "
               f"{result.fitting:,} fit in memory; dropped:")
    for reason, count in result.dropped.most_common():
        click.echo(f"  {count:>7,}  {reason}")
    if not result.configs:
        click.echo("no config fits: add GPUs, lower the global batch or the sequence length")
        return
    click.echo(f"top {len(result.configs)} by predicted tokens/s:")
    for i, row in enumerate(result.configs, 1):
        click.echo(f"{i}. {describe(row)}")
        click.echo(f"   {row['tokens_per_s']:,.0f} tokens/s  MFU {row['mfu']:.1%}  step {row['step_time_s']:.2f} s "
                   f"(compute {row['compute_s']:.2f}, comm tp {row['comm_tp_s']:.2f} "
                   + (f"cp {row['comm_cp_s']:.2f} " if row["cp"] > 1 else "")
                   + (f"ep {row['comm_exposed_ep_s']:.2f} " if row["ep"] > 1 else "") + f"pp {row['comm_pp_s']:.2f} "
                   f"dp {row['comm_dp_exposed_s']:.2f}, bubble {row['bubble_s']:.2f})  "
                   f"memory {_gib(row['total_bytes'])} (act {_gib(row['activation_bytes'])})")
    if framework:
        _emit_framework(framework, ranked, model, gpus, hardware)


FRAMEWORK_BACKENDS = {"megatron": "native", "deepspeed": "deepspeed", "torchtitan": "fsdp"}


def _emit_framework(framework: str, ranked: list[dict], model: str, gpus: int, hardware: str) -> None:
    """The best fitting config of the framework's backend that the framework can express, in its terms."""
    from bench.analysis.planner import SWEEP_FIELDS, plan_device
    from bench.config import ConfigError, RunConfig
    from bench.ecosystem import SourceError, export
    backend = FRAMEWORK_BACKENDS[framework]
    for i, row in enumerate(ranked, 1):
        if row["backend"] != backend:
            continue
        cfg = RunConfig(model=model, device=plan_device(hardware), world_size=gpus,
                        **{k: row[k] for k in SWEEP_FIELDS if row.get(k) is not None})
        try:
            export(cfg, framework)
        except SourceError:
            continue  # a layout the framework cannot write (gpipe for Megatron-LM, …): the next best
        click.echo(f"\n{framework} for plan {i} ({describe_short(cfg)}, predicted {row['tokens_per_s']:,.0f} tokens/s):")
        emit(cfg, framework, None)
        return
    raise ConfigError(f"--emit {framework}: no fitting config of backend {backend} that {framework} can express")


def describe_short(cfg) -> str:
    return f"{cfg.backend} tp {cfg.tp} pp {cfg.pp} dp {cfg.dp}" + (f" cp {cfg.cp}" if cfg.cp > 1 else "")


def _emit_sweep(path: str, result, model: str, gpus: int, gpus_per_node: int, hardware: str,
                global_batch: int) -> None:
    """Write the plan's top configs as a sweep file."""
    import time

    from bench.analysis.planner import sweep_text
    text = sweep_text(result, model, gpus, gpus_per_node, hardware, global_batch, _command_line(),
                      time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))
    write_text_atomically(path, text)
    click.echo(f"wrote {path} ({len(result.configs)} run(s)): bench sweep {path} --launcher slurm", err=True)


def _command_line() -> str:
    """The running command as it was given: the options set on the command line, in declaration order."""
    import shlex

    from click.core import ParameterSource
    ctx = click.get_current_context()
    parts = [f"bench {ctx.info_name}"]
    for param in ctx.command.params:
        if ctx.get_parameter_source(param.name) != ParameterSource.COMMANDLINE:
            continue
        value = ctx.params[param.name]
        parts.append(param.opts[0] if param.is_flag else f"{param.opts[0]} {shlex.quote(str(value))}")
    return " ".join(parts)


@click.command("validate")
@click.option("--published", "path", default=None, help="published-results YAML (default: bench/analysis/published.yaml)")
@click.option("--figure", "figure", default="validate.png", show_default=True,
              help="where to write the predicted-vs-published figure ('' for none)")
@click.option("--json", "as_json", is_flag=True, help="every entry and the error summary as JSON")
def validate(path, figure, as_json):
    """Hold the analytic model against published runs: predicted vs published per entry (error on the time or
    the bytes: + is too slow or too much), mean and max |error| per kind, per source and per engine family."""
    from bench.analysis.validate import PUBLISHED
    from bench.analysis.validate import validate as run
    result = run(path or PUBLISHED)
    if figure:
        from bench.report.figures import validation_figure
        validation_figure(result).savefig(figure, bbox_inches="tight")
        result["figure"] = figure
    if as_json:
        echo_json(result)
        return
    _print_validation(result)
    if figure:
        click.echo(f"figure: {figure}")


def _print_validation(result: dict) -> None:
    source = None
    for e in result["entries"]:
        if e["source"] != source:
            source = e["source"]
            click.echo(f"\n{source}" + (f"\n  note: {e['note']}" if e["note"] else "") +
                       f"\n  {'entry':<38} {'family':<12} {'published':>17} {'predicted':>17} {'error':>8}   where")
        pub = f"{e['published']:,.2f} {e['unit']}"
        if e["refused"]:
            click.echo(f"  {e['name']:<38} {e['family']:<12} {pub:>17}   refused: {e['refused']}   {e['where']}")
            continue
        plot = " (read off a plot)" if e["read_off_plot"] else ""
        click.echo(f"  {e['name']:<38} {e['family']:<12} {pub:>17} {e['predicted']:>13,.2f} {e['unit']:<3} "
                   f"{e['error']:>+7.1%}   {e['where']}{plot}")
    click.echo("")
    for title, table in (("per kind", {k: {"": s} for k, s in result["summary"].items()}),
                         ("per source", result["by_source"]), ("per family", result["by_family"]),
                         ("of the figures read off a plot (in none of the above)", result["read_off_plot"])):
        if not table:
            continue
        click.echo(f"mean / max |error| {title}:")
        for name, parts in table.items():
            for what, s in parts.items():
                click.echo(f"  {name}{' · ' + what if what else ''}: {s['entries']} entries, "
                           f"mean {s['mean_abs_error']:.2%}, max {s['max_abs_error']:.2%}")
    if result["refused"]:
        click.echo(f"{len(result['refused'])} entries refused by the model (their reasons above)")


@click.command("calibrate")
@click.option("--world", type=positive_int(64), default=2, show_default=True,
              help="ranks to measure collectives and shared cores with")
@click.option("--out", "out", default=None, help="profile file to write (default: NAME.yaml in the profiles folder, "
                                                 "$PARABENCH_PROFILES or $XDG_CACHE_HOME/parabench/profiles, where "
                                                 "--hardware NAME finds it)")
@click.option("--name", default=None, help="profile name (default: cpu, or the GPU's profile name)")
@click.option("--quick", is_flag=True, help="fewer shapes and sizes, shorter windows (< 30 s on a laptop)")
def calibrate(world, out, name, quick):
    """Measure this machine (matmul curve, memory bandwidth, per-op overhead, optimizer, collectives, shared
    cores) into a hardware profile the time model reads."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from bench.analysis.hardware import format_bytes
    from bench.calibrate import calibrate as measure
    from bench.calibrate import progress_steps, write_profile
    with Progress(TextColumn("{task.description:<40}"), BarColumn(), TimeElapsedColumn()) as bar:
        task = bar.add_task("starting ranks", total=progress_steps(world))

        def tick(what: str) -> None:
            bar.update(task, advance=1, description=what)
        hw = measure(world, quick, name, tick)
    path = write_profile(hw, out)
    cal = hw.calibration
    click.echo(f"wrote {path} (profile {hw.name!r}; use --hardware {hw.name if not out else path})")
    click.echo(f"  matmul fp32 up to {hw.peak_flops['fp32'] / 1e9:,.1f} GFLOP/s, bf16 up to "
               f"{hw.peak_flops.get('bf16', 0) / 1e9:,.1f}; memory {cal.memory_bw / 1e9:.2f} GB/s; "
               f"op {cal.op_overhead_s * 1e6:.1f} µs; AdamW {cal.optimizer_s_per_param * 1e9:.2f} ns/param; "
               f"a model's kernels together ×{cal.composition:.2f} their time alone")
    for op, table in cal.collectives.items():
        for n, by_ranks in sorted(table.items()):
            for ranks, points in sorted(by_ranks.items()):
                click.echo(f"  {op:<15}n={n} of {ranks} running: " +
                           ", ".join(f"{format_bytes(b)} {t * 1e3:.2f} ms" for b, t in points))
    click.echo("  ranks sharing the machine slow compute ×" +
               ", ".join(f"{f:.2f} ({k})" for k, f in sorted(cal.oversubscription.items())) +
               "; memory-bound work ×" + ", ".join(f"{f:.2f} ({k})" for k, f in sorted(cal.memory_contention.items())))


COMMANDS += [layout, estimate, plan, validate, calibrate]
