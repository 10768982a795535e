"""Write a bench run to disk: results.json, steps.jsonl, report.md and PNG plots (Agg canvas)."""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import platform
import shlex
from importlib import metadata
from pathlib import Path

import torch

from causaldraft.bench.harness import BenchConfig, BenchRun
from causaldraft.bench.metrics import summarize
from causaldraft.bench.plots import plot_acceptance_by_depth, plot_accepted_lengths, plot_budgets, plot_speedups
from causaldraft.errors import CausalDraftError

LIBRARIES = ("causaldraft", "torch", "transformers", "tokenizers", "numpy", "matplotlib", "llama-cpp-python")
COLUMNS = ("tokens_per_s", "mean_accepted", "speedup_vs_hf", "speedup_vs_ar", "exact_match_vs_ar",
           "draft_ms_per_step", "verify_ms_per_step", "new_tokens", "turns")  # fmt: skip


EXACTNESS = (
    "Every lossless causaldraft method should show exact match 1.0 in every dtype but float32: the native "
    "backend's passes are row-invariant in bfloat16, int8 and int4 (each row of a verify pass is computed bit for "
    "bit as a one-row pass at its position, docs/exactness.md), so speculative output is plain decoding's token "
    "for token. Below 1.0 means a defect, except for `hf`, `hf-lookup` and `llamacpp` (other implementations, "
    "other rounding; in an int8 or int4 run the hf baselines run bfloat16 weights), "
    "the naive acceptance rule (lossy by design), `--backend hf` and float32 (whose matrix kernels round "
    "differently per row count: equal up to rounding, not bit for bit)."
)


def command_line(config: BenchConfig) -> str:
    """The causaldraft bench invocation that reproduces this configuration."""
    prompts = str(Path(config.prompts).resolve())
    parts = ["causaldraft", "bench", "--prompts", prompts, "--methods", ",".join(config.methods)]
    parts += config.engine.flags()
    parts += ["--temperature", f"{config.temperature:g}", "--max-new-tokens", str(config.max_new_tokens)]
    parts += ["--seed", str(config.seed), "--warmup", str(config.warmup)]
    if config.limit:
        parts += ["--limit", str(config.limit)]
    if config.categories:
        parts += ["--categories", ",".join(config.categories)]
    parts += ["--repeats", str(config.repeats)]
    if config.profile:
        parts += ["--profile", "--budgets", ",".join(map(str, config.budgets))]
    return shlex.join(parts)


def machine_info() -> dict[str, object]:
    cpu = platform.processor() or platform.machine()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        names = [line.split(":", 1)[1].strip() for line in cpuinfo.read_text().splitlines()
                 if line.startswith("model name")]  # fmt: skip
        cpu = names[0] if names else cpu
    memory_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30 if hasattr(os, "sysconf") else 0
    return {
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "memory_gib": round(memory_gib, 1),
        "platform": platform.platform(),
        "python": platform.python_version(),
    }


def library_versions() -> dict[str, str]:
    versions = {}
    for name in LIBRARIES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = "not installed"
    return versions


def config_record(run: BenchRun) -> dict[str, object]:
    config = dataclasses.asdict(run.config)
    for name in ("model", "backend", "dtype"):  # the target's settings, at the top as before
        config[name] = getattr(run.config.engine, name)
    config["compile"] = run.config.engine.compiled
    config["hf_dtype"] = run.config.engine.dtype if run.config.engine.dtype in ("float32", "bfloat16") else "bfloat16"
    config["interrupted"] = run.interrupted
    config["skipped_questions"] = run.skipped
    config["command"] = command_line(run.config)
    config["questions"] = len(run.questions)
    config["model_dir"] = run.model_dir
    config["fingerprint"] = run.fingerprint
    config["date"] = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    config["machine"] = machine_info()
    config["libraries"] = library_versions()
    return config


def write_steps(run: BenchRun, path: Path) -> None:
    with path.open("w", encoding="utf-8") as file:
        for record in run.records:
            for index, step in enumerate(record.output.steps):
                line = {"method": record.method, "question": record.question_id, "category": record.category,
                        "turn": record.turn, "repeat": record.repeat, "step": index, "accepted": step.accepted,
                        "nodes": step.nodes, "draft_s": round(step.draft_s, 6), "verify_s": round(step.verify_s, 6),
                        "speculated": step.speculated}  # fmt: skip
                file.write(json.dumps(line) + "\n")


def first_difference(tokens: tuple[int, ...], reference: tuple[int, ...]) -> int | None:
    """Index of the first token that differs from the reference (None when identical)."""
    for index, (token, other) in enumerate(zip(tokens, reference, strict=False)):
        if token != other:
            return index
    return None if len(tokens) == len(reference) else min(len(tokens), len(reference))


def write_outputs_jsonl(run: BenchRun, path: Path) -> None:
    """Each method's tokens per turn (first repeat), with where they first differ from ar's."""
    reference = {(r.question_id, r.turn): r.output.token_ids for r in run.records if r.method == "ar" and r.repeat == 0}
    with path.open("w", encoding="utf-8") as file:
        for record in run.records:
            if record.repeat != 0:
                continue
            expected = reference.get((record.question_id, record.turn))
            line = {"method": record.method, "question": record.question_id, "category": record.category,
                    "turn": record.turn, "token_ids": list(record.output.token_ids),
                    "first_difference_vs_ar": None if expected is None
                    else first_difference(record.output.token_ids, expected)}  # fmt: skip
            file.write(json.dumps(line) + "\n")


def cell(value: object) -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        return f"{value:.2f}" if abs(value) >= 10 else f"{value:.3f}"
    return str(value)


def table(rows: list[tuple[str, dict[str, object]]], first: str) -> list[str]:
    lines = [f"| {first} | " + " | ".join(COLUMNS) + " |", "|" + "---|" * (len(COLUMNS) + 1)]
    for label, values in rows:
        lines.append(f"| {label} | " + " | ".join(cell(values.get(column)) for column in COLUMNS) + " |")
    return lines


def render_report(results: dict[str, object], plots: list[str], sweep: dict[str, dict[int, dict[str, float]]]) -> str:
    config = results["config"]
    methods = results["methods"]
    assert isinstance(config, dict) and isinstance(methods, dict)
    ok = [(name, entry) for name, entry in methods.items() if "error" not in entry]
    lines = ["# causaldraft bench", "", f"`{config['command']}`", "",
             f"{config['questions']} questions, {config['repeats']} repeat(s) after {config['warmup']} warm-up, "
             f"temperature {config['temperature']}, {config['max_new_tokens']} new tokens max, dtype "
             f"{config['dtype']}, backend {config['backend']}. tokens/s = new tokens / wall time (prefill "
             "included); mean accepted = new tokens per target forward; exact match = share of turns whose "
             "tokens equal `ar`'s (greedy, or seeded Gumbel sampling: the same seed per turn for every method).",
             "", EXACTNESS, ""]  # fmt: skip
    if config["interrupted"]:
        lines += ["**Interrupted (Ctrl-C)**: only the questions every method had finished are reported.", ""]
    skipped = config["skipped_questions"]
    assert isinstance(skipped, dict)
    if skipped:
        lines += [f"**Left out for every method** ({len(skipped)} questions: a prompt outgrew the context):", ""]
        lines += [f"- question {question}: {why}" for question, why in skipped.items()] + [""]
    lines += ["## All categories", ""]
    lines += table(ok, "method")
    if any(len(entry["by_turn"]) > 1 for _, entry in ok):
        lines += ["", "## By turn", "", "Turn 2 and later answers have the conversation so far in their prompt "
                  "(the method's own earlier answers).", ""]  # fmt: skip
        lines += table([(f"{name}, turn {turn}", values) for name, entry in ok
                        for turn, values in entry["by_turn"].items()], "method, turn")  # fmt: skip
    failed = [(name, entry["error"]) for name, entry in methods.items() if "error" in entry]
    if failed:
        lines += ["", "## Failed or skipped methods", ""]
        lines += [f"- `{name}`: {error}" for name, error in failed]
    for name, entry in ok:
        lines += ["", f"## {name} by category", ""]
        lines += table(sorted(entry["by_category"].items()), "category")
    if sweep:
        budgets = sorted({budget for per_method in sweep.values() for budget in per_method})
        lines += ["", "## Tokens/s by tree budget (max_nodes)", "",
                  "| method | " + " | ".join(map(str, budgets)) + " |", "|" + "---|" * (len(budgets) + 1)]  # fmt: skip
        for name, per_budget in sweep.items():
            values = [cell(per_budget[b]["tokens_per_s"]) if b in per_budget else "–" for b in budgets]
            lines.append(f"| {name} | " + " | ".join(values) + " |")
    lines += ["", "## Plots", ""] + [f"![{Path(plot).stem}]({Path(plot).name})" for plot in plots]
    machine = config["machine"]
    libraries = config["libraries"]
    lines += ["", "## Machine", ""] + [f"- {key}: {value}" for key, value in machine.items()]
    lines += ["", "## Libraries", ""] + [f"- {key}: {value}" for key, value in libraries.items()]
    lines += ["", "Timings on a shared machine are noisy; compare methods within one run only.", ""]
    return "\n".join(lines)


def prepare_out(out_dir: str | Path) -> Path:
    """The output folder, made if missing; checked before the model loads so that no run is lost to it."""
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise CausalDraftError(f"--out {out} is a file; give a directory (made if missing)")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise CausalDraftError(f"cannot make the output directory {out}: {error}") from error
    return out


def write_outputs(run: BenchRun, out_dir: str | Path) -> dict[str, object]:
    """Write every artefact of a run into ``out_dir``; returns the results.json payload."""
    out = prepare_out(out_dir)
    # greedy and Gumbel-sampled outputs are functions of the model (and the seed) alone: comparable to ar's
    comparable = run.config.temperature == 0 or run.config.engine.sampler == "gumbel"
    summary = summarize(list(run.config.methods), run.records, run.errors, comparable)
    results: dict[str, object] = {"config": config_record(run), "methods": summary}
    if run.profile:
        results["profile"] = {name: {str(b): values for b, values in per.items()} for name, per in run.profile.items()}
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    write_steps(run, out / "steps.jsonl")
    write_outputs_jsonl(run, out / "outputs.jsonl")
    plots = [
        plot_speedups(summary, out / "speedup_by_category.png"),
        plot_accepted_lengths(run.records, out / "accepted_lengths.png"),
        plot_acceptance_by_depth(summary, out / "acceptance_by_depth.png"),
    ]
    budgets = out / "tokens_per_s_by_budget.png"
    if run.profile:
        plots.append(plot_budgets(run.profile, summary, budgets))
    else:
        budgets.unlink(missing_ok=True)  # an earlier --profile run's plot in a reused folder is not this run's
    (out / "report.md").write_text(render_report(results, [str(p) for p in plots], run.profile), encoding="utf-8")
    return results
