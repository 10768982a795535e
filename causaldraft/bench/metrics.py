"""Aggregate turn records into the per-method, per-category numbers of results.json."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from causaldraft.bench.harness import TurnRecord


@dataclass(frozen=True)
class Totals:
    new_tokens: int
    wall_s: float
    target_forwards: int
    turns: int

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def mean_accepted(self) -> float:
        return self.new_tokens / self.target_forwards if self.target_forwards else 0.0


def totals(records: list[TurnRecord]) -> Totals:
    return Totals(
        new_tokens=sum(len(record.output.token_ids) for record in records),
        wall_s=sum(record.output.wall_s for record in records),
        target_forwards=sum(record.output.target_forwards for record in records),
        turns=len(records),
    )


def exact_match(records: list[TurnRecord], reference: list[TurnRecord]) -> float | None:
    """Share of turns (first repeat) whose tokens equal the reference method's for the same turn."""
    expected = {(r.question_id, r.turn): r.output.token_ids for r in reference if r.repeat == 0}
    pairs = [(r.output.token_ids, expected.get((r.question_id, r.turn))) for r in records if r.repeat == 0]
    if not pairs:
        return None
    return sum(tokens == other for tokens, other in pairs) / len(pairs)


def acceptance_by_depth(records: list[TurnRecord]) -> list[float]:
    """Over all steps: share of steps drafting >= d tokens deep that accepted >= d tokens."""
    attempts: list[int] = []
    accepts: list[int] = []
    for record in records:
        for depth, (tried, taken) in enumerate(zip(record.output.depth_attempts, record.output.depth_accepts,
                                                   strict=True)):  # fmt: skip
            if depth >= len(attempts):
                attempts.append(0)
                accepts.append(0)
            attempts[depth] += tried
            accepts[depth] += taken
    return [round(taken / tried, 4) if tried else 0.0 for taken, tried in zip(accepts, attempts, strict=True)]


def accepted_histogram(records: list[TurnRecord]) -> dict[int, int]:
    """Accepted draft tokens per step -> number of steps, over steps that verified a draft (nodes > 1)."""
    counts = Counter(step.accepted for record in records for step in record.output.steps if step.nodes > 1)
    return dict(sorted(counts.items()))


def ratio(value: float, baseline: float | None) -> float | None:
    return round(value / baseline, 4) if baseline else None


def metrics(records: list[TurnRecord], hf: Totals | None, ar: Totals | None, ar_records: list[TurnRecord] | None,
            comparable: bool) -> dict[str, object]:  # fmt: skip
    total = totals(records)
    steps = [step for record in records for step in record.output.steps]
    per_step = 1000 / max(1, len(steps))
    return {
        "tokens_per_s": round(total.tokens_per_s, 3),
        "draft_ms_per_step": round(per_step * sum(step.draft_s for step in steps), 3),
        "verify_ms_per_step": round(per_step * sum(step.verify_s for step in steps), 3),
        "mean_accepted": round(total.mean_accepted, 4),
        "speedup_vs_hf": ratio(total.tokens_per_s, hf.tokens_per_s if hf else None),
        "speedup_vs_ar": ratio(total.tokens_per_s, ar.tokens_per_s if ar else None),
        "exact_match_vs_ar": exact_match(records, ar_records) if comparable and ar_records is not None else None,
        "new_tokens": total.new_tokens,
        "wall_s": round(total.wall_s, 6),
        "target_forwards": total.target_forwards,
        "turns": total.turns,
    }


def turn_label(record: TurnRecord) -> str:
    """A record's turn, counted from 1 ("1": first answers; "2": answers with an earlier exchange in the prompt)."""
    return str(record.turn + 1)


def category_label(record: TurnRecord) -> str:
    return record.category


def summarize(methods: list[str], records: list[TurnRecord], errors: dict[str, str],
              comparable: bool) -> dict[str, dict[str, object]]:  # fmt: skip
    """results.json "methods": keyed by method string in the given order; failed ones carry "error".
    Each entry's ``by_category`` and ``by_turn`` hold the same metrics over its records of one category
    or one turn, against the reference methods' records of that group."""
    by_method = {name: [r for r in records if r.method == name] for name in methods if name not in errors}

    def group_metrics(own: list[TurnRecord], label: Callable[[TurnRecord], str], group: str) -> dict[str, object]:
        def reference(name: str) -> list[TurnRecord] | None:
            chosen = [r for r in by_method.get(name, []) if label(r) == group]
            return chosen or None

        hf, ar = reference("hf"), reference("ar")
        mine = [r for r in own if label(r) == group]
        return metrics(mine, totals(hf) if hf else None, totals(ar) if ar else None, ar, comparable)

    def breakdown(own: list[TurnRecord], label: Callable[[TurnRecord], str]) -> dict[str, dict[str, object]]:
        return {group: group_metrics(own, label, group) for group in sorted({label(r) for r in records})}

    summary: dict[str, dict[str, object]] = {}
    for name in methods:
        if name in errors:
            summary[name] = {"error": errors[name]}
            continue
        own = by_method[name]
        hf, ar = by_method.get("hf"), by_method.get("ar")
        entry = metrics(own, totals(hf) if hf else None, totals(ar) if ar else None, ar, comparable)
        entry["by_category"] = breakdown(own, category_label)
        entry["by_turn"] = breakdown(own, turn_label)
        entry["acceptance_by_depth"] = acceptance_by_depth(own)
        entry["accepted_histogram"] = {str(size): count for size, count in accepted_histogram(own).items()}
        summary[name] = entry
    return summary
