"""Read the ecosystem's configs into RunConfigs, and write RunConfigs back in their terms (docs/ecosystem.md).

    imports = read_source("model_config.yaml", world_size=8)     # → [Imported], one per config of the file
    imports[0].entries                                             # every source key: mapped, defaulted, dropped, conflict
    imports[0].exact, imports[0].config()                          # expressible exactly?  the RunConfig
    export(cfg, "megatron")                                        # the launch arguments (deepspeed: JSON, torchtitan: TOML)

One module per framework (megatron, deepspeed, torchtitan, hf), each a table of source key → RunConfig or
model field with the framework's default (bench/ecosystem/table.py), so a new field is one line. Readers
never approximate silently: a key that changes the math and has no field here is listed as a blocker, and
the config is then not exactly expressible.
"""
from __future__ import annotations

import json
from pathlib import Path

from bench.ecosystem.table import Imported, SourceError

FORMATS = {
    "megatron": "Megatron-LM arguments: a launch script (.sh), a functional test's model_config.yaml (MODEL_ARGS), "
                "or `bench import megatron -- ARGS…`",
    "deepspeed": "a DeepSpeed JSON (the layout from the launch arguments after --, or --world-size)",
    "torchtitan": "a torchtitan train-config TOML or the JSON its --debug.print_config writes",
    "hf": "an HF config.json (the model's shape)",
}
EXPORTS = ("megatron", "deepspeed", "torchtitan")


def known_formats() -> str:
    return "; ".join(FORMATS.values())


def read_source(path: str, world_size: int | None = None, model_config: str | None = None, model: str | None = None,
                launch_args: tuple[str, ...] = ()) -> list[Imported]:
    """Every config of the file at `path` (a functional-test YAML may hold several blocks)."""
    source = str(path)
    kind, data = detect(source)
    hint = model_hint(model_config, model)
    if kind == "megatron-yaml":
        from bench.ecosystem import megatron
        return [megatron.read(pairs, source, world_size, world_hint=gpus or megatron.FUNCTIONAL_TEST_WORLD,
                              world_why="the block's GPUS_PER_NODE" if gpus else
                              "the functional tests' 1 node × 8 GPUs (tests/test_utils/recipes)", label=label, model=hint)
                for label, pairs, gpus in megatron.yaml_blocks(data, source)]
    if kind == "megatron-script":
        from bench.ecosystem import megatron
        from bench.ecosystem.shell import expand_script
        argv, world = expand_script(data, source)
        return [megatron.read(megatron.parse_argv(argv), source, world_size, world_hint=world,
                              world_why="the script's launcher", model=hint)]
    if kind == "deepspeed":
        return [_deepspeed(data, source, world_size, hint, launch_args)]
    if kind == "torchtitan":
        from bench.ecosystem import torchtitan
        return [torchtitan.read(data, source, world_size)]
    from bench.ecosystem import hf
    return [hf.read(data, source, world_size)]


def read_megatron(argv: list[str], world_size: int | None = None, model_config: str | None = None,
                  model: str | None = None) -> list[Imported]:
    """`bench import megatron -- ARGS…`: an argument list as a shell would pass it."""
    from bench.ecosystem import megatron
    hint = model_hint(model_config, model)
    return [megatron.read(megatron.parse_argv(list(argv)), "megatron arguments", world_size, model=hint)]


def _deepspeed(data: dict, source: str, world_size, hint, launch_args) -> Imported:
    from bench.ecosystem import deepspeed, megatron
    if launch_args:
        base = megatron.read(megatron.parse_argv(list(launch_args)), source, world_size, model=hint,
                             framework="deepspeed", backend="deepspeed")
    elif hint:
        base = Imported("deepspeed", source, model=dict(hint))
        base.values.update(tp=1, pp=1, cp=1, micro_batch=None, micro_batches=None)
    else:
        raise SourceError(source, "model", "a DeepSpeed JSON holds no model: give --model PRESET, --model-config "
                          "config.json, or the Megatron-DeepSpeed launch arguments after --")
    return deepspeed.read(data, source, base, world_size)


def model_hint(model_config: str | None, model: str | None) -> dict | None:
    """The model's shape from an HF config.json or a preset name (None: the source must hold it)."""
    if model_config:
        from bench.ecosystem import hf
        kind, data = detect(model_config)
        if kind != "hf":
            raise SourceError(model_config, "", "--model-config takes an HF config.json (with model_type)")
        return hf.read(data, model_config).model
    if model:
        from bench.ecosystem.model import shape
        from models.config import get_preset
        return shape(get_preset(model))
    return None


def detect(source: str) -> tuple[str, object]:
    """(format, parsed content) of the file; a file of no known format is a SourceError saying which are known."""
    path = Path(source)
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise SourceError(source, "", f"not a text file; known formats: {known_formats()}") from None
    suffix = path.suffix.lower()
    if suffix == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            why = "it ends early (truncated?)" if not text[e.pos:].strip() else e.msg
            raise SourceError(source, f"line {e.lineno} column {e.colno}", f"not valid JSON: {why}") from None
        if not isinstance(data, dict):
            raise SourceError(source, "", f"a JSON object was expected; known formats: {known_formats()}")
        if "model_type" in data:
            return "hf", data
        if {"job", "parallelism", "training", "model"} & set(data) and not {"train_batch_size", "zero_optimization"} & set(data):
            return "torchtitan", data
        if {"train_batch_size", "train_micro_batch_size_per_gpu", "zero_optimization", "gradient_accumulation_steps",
            "fp16", "bf16"} & set(data):
            return "deepspeed", data
    elif suffix == ".toml":
        import tomllib
        try:
            return "torchtitan", tomllib.loads(text)
        except tomllib.TOMLDecodeError as e:
            raise SourceError(source, "", f"not valid TOML: {e}") from None
    elif suffix in (".yaml", ".yml"):
        import yaml
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            raise SourceError(source, f"line {mark.line + 1}" if mark else "", "malformed YAML") from None
        if isinstance(data, dict) and any(str(k).startswith("MODEL_ARGS") for k in data):
            return "megatron-yaml", data
    elif suffix in (".sh", ".bash", ".slurm") or text.startswith("#!"):
        return "megatron-script", text
    raise SourceError(source, "", f"unknown format; known: {known_formats()}")


def export(cfg, to: str) -> str:
    """`cfg` in framework `to`'s terms: Megatron-LM launch arguments, DeepSpeed JSON (+ the layout's arguments
    in a comment line on stderr's side: see `deepspeed_launch`), torchtitan TOML."""
    if to == "megatron":
        from bench.ecosystem.megatron import export_text
        return export_text(cfg)
    if to == "deepspeed":
        from bench.ecosystem.deepspeed import export_json
        return json.dumps(export_json(cfg), indent=2) + "\n"
    if to == "torchtitan":
        from bench.ecosystem.torchtitan import export_toml
        return export_toml(cfg)
    raise SourceError("export", "--to", f"{to!r}; choose one of {', '.join(EXPORTS)}")


def deepspeed_launch(cfg, json_path: str = "ds_config.json") -> str:
    """The Megatron-DeepSpeed command that carries the layout and the model beside the JSON."""
    import shlex

    from bench.ecosystem.deepspeed import launch_args
    return (f"deepspeed --num_gpus {cfg.world} pretrain_gpt.py " + " ".join(map(shlex.quote, launch_args(cfg)))
            + f" --deepspeed --deepspeed_config {json_path}")


def sweep_data(imports: list[Imported], name: str) -> dict:
    """A sweep file's content: one run per config (all sharing the model: a sweep has one)."""
    configs = [imp.config() for imp in imports]
    models = {(c.model, c.model_overrides) for c in configs}
    if len(models) > 1:  # a sweep has one model (Megatron-LM's padded vocab differs with tp, for one)
        by_model = {}
        for imp, c in zip(imports, configs):
            by_model.setdefault((c.model, c.model_overrides), []).append(imp.label)
        groups = "; ".join(", ".join(labels) for labels in by_model.values())
        raise SourceError(imports[0].source, "model", f"the blocks hold {len(models)} different models ({groups}): "
                          "a sweep has one; pick blocks of one model with --block")
    from bench.ecosystem.model import SHAPE_FIELDS
    preset, overrides = models.pop()
    model = {"preset": preset, **{k: _scalar(v) for k, v in (o.split("=", 1) for o in overrides) if k in SHAPE_FIELDS}}
    runs = [{k: v for k, v in c.canonical().items() if k not in ("model", "model_overrides")} for c in configs]
    return {"name": name, "model": model if overrides else preset, "runs": runs}


def _scalar(text: str):
    import yaml
    return yaml.safe_load(text)


def sweep_text(imports: list[Imported], name: str, command: str) -> str:
    import yaml
    data = sweep_data(imports, name)
    header = [f"# written by `{command}`: {len(data['runs'])} run(s) read from {imports[0].source} "
              f"({imports[0].framework}); `bench sweep THIS_FILE --dry-run` predicts each"]
    body = yaml.safe_dump({k: data[k] for k in ("name", "model")}, sort_keys=False, default_flow_style=None, width=10**6)
    runs = "runs:\n" + "".join(f"  - {yaml.safe_dump(r, default_flow_style=True, sort_keys=False, width=10**6).strip()}\n"
                               for r in data["runs"])
    return "\n".join(header) + "\n" + body + runs
