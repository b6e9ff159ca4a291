"""How many of Megatron-LM's functional-test configs parabench expresses exactly, and what blocks the rest.

Reads every tests/functional_tests/test_cases/**/model_config.yaml of a Megatron-LM checkout with
`bench import`'s reader (bench/ecosystem/megatron.py), each block at its own world size (GPUS_PER_NODE, else the
tests' 1 node × 8 GPUs). A file counts as expressible when every block is; a file's blockers are counted once
each. Only GPT-family test cases (gpt, moe, mixtral) can be: the others (bert, t5, hybrid, multimodal, …) are
counted under "not a GPT model".

    .venv/bin/python benchmarks/ecosystem_coverage.py /path/to/Megatron-LM            # the figure and the top blockers
    .venv/bin/python benchmarks/ecosystem_coverage.py /path/to/Megatron-LM --json
"""
from __future__ import annotations

import argparse
import collections
import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.ecosystem import read_source  # noqa: E402
from bench.ecosystem.table import SourceError  # noqa: E402

GPT_FAMILIES = ("gpt", "moe", "mixtral")
CASES = "tests/functional_tests/test_cases"


def blocker_name(problem: str) -> str:
    """A problem line as its kind: '--qk-layernorm: not expressible: qk-layernorm (issue 26)' → 'qk-layernorm'."""
    key, _, detail = problem.partition(": ")
    if key == "this suite cannot run it":
        return "this suite refuses: " + re.sub(r"\d+", "N", detail.split(";")[0])
    return re.sub(r"\d+", "N", detail.removeprefix("not expressible: ").split(" (")[0].split(":")[0])


def file_blockers(path: Path, family: str) -> set[str]:
    if family not in GPT_FAMILIES:
        return {f"not a GPT model ({family})"}
    try:
        imports = read_source(str(path))
    except SourceError as e:
        return {"unreadable: " + re.sub(r"\d+", "N", str(e).split(": ", 1)[1])}
    return {blocker_name(p) for imp in imports for p in imp.problems}


def coverage(checkout: Path) -> dict:
    files = sorted((checkout / CASES).glob("**/model_config.yaml"))
    counts: collections.Counter = collections.Counter()
    expressible = 0
    for path in files:
        blockers = file_blockers(path, path.relative_to(checkout / CASES).parts[0])
        expressible += not blockers
        counts.update(blockers)
    return {"files": len(files), "expressible": expressible, "blockers": counts.most_common()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkout", type=Path, help="a Megatron-LM checkout (its tests/functional_tests)")
    parser.add_argument("--top", type=int, default=15, help="blockers to print")
    parser.add_argument("--json", action="store_true", help="the counts as JSON")
    args = parser.parse_args()
    if not (args.checkout / CASES).is_dir():
        sys.exit(f"error: {args.checkout}: no {CASES} folder (give a Megatron-LM checkout)")
    result = coverage(args.checkout)
    if args.json:
        print(json.dumps(result))
        return
    share = result["expressible"] / max(result["files"], 1)
    print(f"{result['expressible']} of {result['files']} functional-test configs ({share:.0%}) are exactly expressible")
    print("top blockers (files each blocks; a file may have several):")
    for name, count in result["blockers"][:args.top]:
        print(f"  {count:>4}  {name}")


if __name__ == "__main__":
    main()
