"""The continuous-batching table: causaldraft's server at concurrency 1 and N, and llama.cpp's
``llama-server`` (``-np N``) on the same GGUF, driven by the same load script in one run.

Each row is one ``bench/load_server.py`` run (32 greedy chat requests of 128 tokens by default); the
causaldraft rows check every answer against the same request sent alone (``--check-outputs``) and mix
malformed requests into the concurrent loads (``--bad-every``). Writes ``OUT/<row>.json`` and
``OUT/table.md``. Build llama-server first (``bench/build_llama_server.py``); without it that row is skipped.

    .venv/bin/python bench/continuous_batching.py --out runs/batching
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def rows(args: argparse.Namespace) -> list[tuple[str, list[str]]]:
    """(name, command) of every run, in order."""
    common = ["--requests", str(args.requests), "--max-tokens", str(args.max_tokens)]
    ours = [sys.executable, str(HERE / "load_server.py"), "--model", args.model, *common, "--check-outputs"]
    load = [f"--concurrency={args.concurrency}", f"--max-batch={args.concurrency}", "--bad-every=4"]
    planned = [
        (f"{args.dtype}-{args.drafter}-c1", [*ours, "--dtype", args.dtype, "--drafter", args.drafter,
                                             "--concurrency=1", f"--max-batch={args.concurrency}"]),
        (f"{args.dtype}-{args.drafter}-c{args.concurrency}", [*ours, "--dtype", args.dtype, "--drafter",
                                                               args.drafter, *load]),
    ]  # fmt: skip
    for drafter in args.int4_drafters:
        planned.append((f"int4-{drafter}-c{args.concurrency}", [*ours, "--dtype", "int4", "--drafter", drafter, *load]))
    anchor = [sys.executable, str(HERE / "llama_server_load.py"), f"--parallel={args.concurrency}", *common]
    planned.append((f"llama-server-c{args.concurrency}", [*anchor, f"--concurrency={args.concurrency}"]))
    return planned


def table(results: dict[str, dict[str, object]]) -> str:
    lines = ["| run | completed | errors | tokens/s | p50 s | p99 s | batch/step | answers = alone | bad -> 4xx |",
             "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for name, report in results.items():
        checked = f"{int(report['outputs_checked']) - int(report['outputs_differing'])}/{report['outputs_checked']}"
        lines.append(
            f"| {name} | {report['completed']} | {report['errors'] or 0} | {report['tokens_per_s']} | "
            f"{report['latency_p50_s']} | {report['latency_p99_s']} | {report.get('server_batch_size_mean') or ''} | "
            f"{checked} | {report['bad_answered_4xx']}/{report['bad_sent']} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--model", default="default")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--drafter", default="markov")
    parser.add_argument("--int4-drafters", nargs="*", default=["lookup", "markov"])
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--only", nargs="*", default=None, help="run only these rows (names as in the table)")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    results: dict[str, dict[str, object]] = {}
    for name, command in rows(args):
        if args.only is not None and name not in args.only:
            continue
        report_path = args.out / f"{name}.json"
        print(f"continuous_batching: {name}: {' '.join(command)}", file=sys.stderr, flush=True)
        done = subprocess.run([*command, "--json", str(report_path)], cwd=HERE.parent)
        if report_path.is_file():
            results[name] = json.loads(report_path.read_text())
        else:
            print(f"continuous_batching: {name} wrote no report (exit {done.returncode})", file=sys.stderr)
    text = table(results)
    (args.out / "table.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
