"""PNG plots of a bench run, drawn on matplotlib's Agg canvas (no pyplot, no global backend switch)."""

from __future__ import annotations

from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from causaldraft.bench.harness import TurnRecord
from causaldraft.bench.metrics import accepted_histogram


def new_figure(width: float = 8.0, height: float = 4.5) -> Figure:
    figure = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(figure)
    return figure


def save(figure: Figure, path: Path) -> Path:
    figure.savefig(str(path), dpi=110)
    return path


def no_data(figure: Figure, message: str) -> None:
    axes = figure.add_subplot()
    axes.text(0.5, 0.5, message, ha="center", va="center")
    axes.set_axis_off()


def plot_speedups(summary: dict[str, dict[str, object]], path: Path) -> Path:
    """Speedup of each method per category, against hf when it ran, else against ar."""
    figure = new_figure(10.0, 4.5)
    ok = {name: entry for name, entry in summary.items() if "error" not in entry}
    baseline = "hf" if "hf" in ok else "ar"
    key = f"speedup_vs_{baseline}"
    if baseline not in ok:
        no_data(figure, "speedups need an hf or ar method in the run")
        return save(figure, path)
    categories = sorted({c for entry in ok.values() for c in entry["by_category"]})  # type: ignore[attr-defined]
    groups = ["all", *categories]
    axes = figure.add_subplot()
    bar_width = 0.8 / max(1, len(ok))
    for offset, (name, entry) in enumerate(ok.items()):
        by_category = entry["by_category"]
        values = [entry[key]] + [by_category.get(c, {}).get(key) for c in categories]  # type: ignore[attr-defined]
        xs = [index + offset * bar_width for index in range(len(groups))]
        axes.bar(xs, [v if isinstance(v, (int, float)) else 0.0 for v in values], bar_width, label=name)
    axes.axhline(1.0, color="black", linewidth=0.8)
    axes.set_xticks([index + 0.4 - bar_width / 2 for index in range(len(groups))], groups, rotation=30, ha="right")
    axes.set_ylabel(f"speedup vs {baseline} (tokens/s ratio)")
    axes.set_title("Speedup per category")
    axes.legend(fontsize="small", ncols=2)
    return save(figure, path)


def plot_accepted_lengths(records: list[TurnRecord], path: Path) -> Path:
    """Share of steps that verified a draft, by accepted draft tokens; one bar group per method."""
    figure = new_figure()
    names = list(dict.fromkeys(record.method for record in records))
    histograms = {name: accepted_histogram([r for r in records if r.method == name]) for name in names}
    histograms = {name: counts for name, counts in histograms.items() if counts}
    if not histograms:
        no_data(figure, "no drafts verified")
        return save(figure, path)
    longest = max(max(counts) for counts in histograms.values())
    axes = figure.add_subplot()
    bar_width = 0.8 / len(histograms)
    for offset, (name, counts) in enumerate(histograms.items()):
        steps = sum(counts.values())
        xs = [size + offset * bar_width for size in range(longest + 1)]
        axes.bar(xs, [counts.get(size, 0) / steps for size in range(longest + 1)], bar_width, label=name)
    axes.set_xticks([size + 0.4 - bar_width / 2 for size in range(longest + 1)], [str(s) for s in range(longest + 1)])
    axes.set_xlabel("accepted draft tokens per step")
    axes.set_ylabel("share of steps with a draft")
    axes.set_title("Accepted lengths")
    axes.legend(fontsize="small")
    return save(figure, path)


def plot_acceptance_by_depth(summary: dict[str, dict[str, object]], path: Path) -> Path:
    """Share of steps drafting at least d deep that accepted at least d tokens."""
    figure = new_figure()
    curves: dict[str, list[float]] = {}
    for name, entry in summary.items():
        rates = entry.get("acceptance_by_depth")
        if isinstance(rates, list) and rates:
            curves[name] = rates
    if not curves:
        no_data(figure, "no draft trees recorded")
        return save(figure, path)
    axes = figure.add_subplot()
    for name, rates in curves.items():
        axes.plot(range(1, len(rates) + 1), rates, marker="o", label=name)
    axes.set_xlabel("draft depth")
    axes.set_ylabel("acceptance rate")
    axes.set_ylim(0, 1.05)
    axes.set_title("Acceptance by draft depth")
    axes.legend(fontsize="small")
    return save(figure, path)


def plot_budgets(sweep: dict[str, dict[int, dict[str, float]]], summary: dict[str, dict[str, object]],
                 path: Path) -> Path:  # fmt: skip
    """Tokens/s of each tree method against its node budget; ar and hf as horizontal references."""
    figure = new_figure()
    axes = figure.add_subplot()
    for name, per_budget in sweep.items():
        budgets = sorted(per_budget)
        axes.plot(budgets, [per_budget[b]["tokens_per_s"] for b in budgets], marker="o", label=name)
    for reference, style in (("ar", "--"), ("hf", ":")):
        entry = summary.get(reference, {})
        if isinstance(entry.get("tokens_per_s"), float):
            axes.axhline(float(entry["tokens_per_s"]), linestyle=style, color="gray", label=reference)  # type: ignore[arg-type]
    axes.set_xlabel("tree budget (max_nodes)")
    axes.set_ylabel("tokens/s")
    axes.set_title("Tokens/s vs tree budget")
    axes.legend(fontsize="small")
    return save(figure, path)
