"""Spec-Bench / MT-bench prompt files: one JSON object per line with question_id, category, turns."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from causaldraft.errors import CausalDraftError


@dataclass(frozen=True)
class Question:
    question_id: str
    category: str
    turns: tuple[str, ...]


def parse_question(line: str, where: str) -> Question:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as error:
        raise CausalDraftError(f"{where}: not valid JSON ({error.msg})") from error
    if not isinstance(record, dict):
        raise CausalDraftError(f"{where}: expected a JSON object")
    turns = record.get("turns")
    if not isinstance(turns, list) or not turns or not all(isinstance(turn, str) and turn for turn in turns):
        raise CausalDraftError(f"{where}: 'turns' must be a non-empty list of non-empty strings")
    if "question_id" not in record:
        raise CausalDraftError(f"{where}: missing 'question_id'")
    category = record.get("category") or "uncategorized"
    return Question(str(record["question_id"]), str(category), tuple(turns))


def read_questions(path: str | Path, limit: int | None = None, categories: list[str] | None = None) -> list[Question]:
    """Read a prompt file, keep the given categories (all if None), then the first ``limit`` questions."""
    file = Path(path)
    if file.is_dir():
        raise CausalDraftError(f"prompt file {file} is a directory")
    if not file.is_file():
        raise CausalDraftError(f"prompt file {file} does not exist")
    if limit is not None and limit < 1:
        raise CausalDraftError(f"--limit must be >= 1, got {limit}")
    try:
        text = file.read_text(encoding="utf-8-sig")  # a byte-order mark some editors write is skipped
    except UnicodeDecodeError as error:
        raise CausalDraftError(
            f"prompt file {file} is not UTF-8 text ({error.reason} at byte {error.start})"
        ) from error
    questions = []
    lines: dict[str, int] = {}
    for number, line in enumerate(text.splitlines(), start=1):
        if line.strip():
            question = parse_question(line, f"{file}:{number}")
            if question.question_id in lines:
                raise CausalDraftError(
                    f"{file}:{number}: question_id {question.question_id!r} is also on line "
                    f"{lines[question.question_id]} (answers are compared across methods by question_id)"
                )
            lines[question.question_id] = number
            questions.append(question)
    if categories:
        known = {question.category for question in questions}
        unknown = [name for name in categories if name not in known]
        if unknown:
            raise CausalDraftError(f"unknown categories {', '.join(unknown)}; the file has {', '.join(sorted(known))}")
        questions = [question for question in questions if question.category in categories]
    if not questions:
        raise CausalDraftError(f"no questions in {file}")
    return questions[:limit] if limit else questions
