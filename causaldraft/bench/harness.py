"""The bench runner: one loaded target, every method on the same questions, turn by turn.

Multi-turn questions are answered as Spec-Bench does: each method's own answer to turn i is fed
back (as the assistant message, through the chat template) before turn i + 1. After a warm-up,
the questions are run ``repeats`` times, methods interleaved per question so that load from other
processes spreads over all of them. A method that fails (cannot be built, or raises while running)
is recorded with its error and the others go on.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from tqdm import tqdm

from causaldraft.bench.methods import (
    Method,
    MethodFactory,
    MethodOutput,
    MethodSpec,
    RunSettings,
    parse_method,
)
from causaldraft.bench.prompts import Question, read_questions
from causaldraft.config import EngineConfig, SamplingConfig, validate_max_new_tokens
from causaldraft.errors import CausalDraftError, ContextOverflow
from causaldraft.models.loading import LoadedModel, load_model

WARMUP_TOKENS = 32
DEFAULT_BUDGETS = (4, 8, 16, 32, 48)


@dataclass(frozen=True)
class BenchConfig:
    prompts: str
    methods: tuple[str, ...]
    # the target and the engine settings every causaldraft method shares (compiled graphs by default)
    # each request from an empty cache (no kept prompt prefixes), as the llama.cpp baseline (llm.reset())
    engine: EngineConfig = field(default_factory=lambda: EngineConfig(prefix_cache_mb=0))
    temperature: float = 0.0
    max_new_tokens: int = 256
    limit: int | None = None
    categories: tuple[str, ...] = ()
    repeats: int = 1
    warmup: int = 1
    seed: int = 0
    profile: bool = False
    budgets: tuple[int, ...] = DEFAULT_BUDGETS

    def __post_init__(self) -> None:
        SamplingConfig(temperature=self.temperature)
        validate_max_new_tokens(self.max_new_tokens)
        if not self.methods:
            raise CausalDraftError("--methods needs at least one method")
        if self.repeats < 1:
            raise CausalDraftError(f"--repeats must be >= 1, got {self.repeats}")
        if self.warmup < 0:
            raise CausalDraftError(f"--warmup must be >= 0, got {self.warmup}")
        if any(budget < 2 or budget > 256 for budget in self.budgets) or not self.budgets:
            raise CausalDraftError(f"--budgets must be node counts in [2, 256], got {self.budgets}")


@dataclass(frozen=True)
class TurnRecord:
    method: str
    question_id: str
    category: str
    turn: int
    repeat: int
    output: MethodOutput


@dataclass
class BenchRun:
    config: BenchConfig
    questions: list[Question]
    records: list[TurnRecord] = field(default_factory=list)
    errors: dict[str, str] = field(default_factory=dict)
    profile: dict[str, dict[int, dict[str, float]]] = field(default_factory=dict)
    model_dir: str = ""
    fingerprint: str = ""
    # Ctrl-C during the runs: the records hold the (repeat, question)s every method finished
    interrupted: bool = False
    # questions left out for every method: a turn's prompt did not fit in the context (question id -> why)
    skipped: dict[str, str] = field(default_factory=dict)


def answer_turns(method: Method, encoder: object, tokenizer: object, question: Question,
                 settings: RunSettings) -> list[MethodOutput]:  # fmt: skip
    """Answer every turn, feeding the method's own previous answers back through the chat template."""
    messages: list[dict[str, str]] = []
    outputs = []
    for turn in question.turns:
        messages.append({"role": "user", "content": turn})
        prompt_ids = encoder.encode_chat(messages)  # type: ignore[attr-defined]
        output = method.generate(prompt_ids, settings)
        outputs.append(output)
        answer = tokenizer.decode(list(output.token_ids), skip_special_tokens=True)  # type: ignore[attr-defined]
        messages.append({"role": "assistant", "content": answer})
    return outputs


def turn_settings(config: BenchConfig, question_index: int, repeat: int) -> RunSettings:
    seed = config.seed + 100_003 * repeat + question_index
    return RunSettings(config.max_new_tokens, config.temperature, seed)


def build_methods(config: BenchConfig, factory: MethodFactory, errors: dict[str, str]) -> dict[str, Method]:
    methods: dict[str, Method] = {}
    for name in config.methods:
        try:
            methods[name] = factory.build(parse_method(name))
        except Exception as error:  # a method may fail in any way; the bench records it and goes on
            errors[name] = describe(error)
    return methods


def describe(error: Exception) -> str:
    if isinstance(error, CausalDraftError):
        return str(error)
    return f"{type(error).__name__}: {error}"


def warm_up(config: BenchConfig, methods: dict[str, Method], encoder: object, question: Question,
            errors: dict[str, str]) -> None:  # fmt: skip
    settings = RunSettings(min(WARMUP_TOKENS, config.max_new_tokens), config.temperature, config.seed)
    prompt_ids = encoder.encode_chat([{"role": "user", "content": question.turns[0]}])  # type: ignore[attr-defined]
    for name, method in list(methods.items()):
        for _ in range(config.warmup):
            try:
                method.generate(prompt_ids, settings)
            except Exception as error:  # a method may fail in any way; the bench records it and goes on
                errors[name] = describe(error)
                del methods[name]
                break


class Interrupted(Exception):
    """Ctrl-C during the runs; ``records`` holds the (repeat, question)s every method finished."""

    def __init__(self, records: list[TurnRecord]) -> None:
        super().__init__("interrupted")
        self.records = records


def run_questions(config: BenchConfig, methods: dict[str, Method], encoder: object, tokenizer: object,
                  questions: list[Question], repeats: int, errors: dict[str, str], progress: bool,
                  skipped: dict[str, str] | None = None) -> list[TurnRecord]:  # fmt: skip
    """Every question x method x repeat; a method that raises is dropped with its records, but a question
    whose prompt outgrows the context is left out for every method (in ``skipped``). On Ctrl-C,
    ``Interrupted`` carries the records of the questions every method finished."""
    skipped = {} if skipped is None else skipped
    records: list[TurnRecord] = []
    total = repeats * len(questions) * len(methods)
    with tqdm(total=total, desc="bench", unit="run", disable=not progress) as bar:
        for repeat in range(repeats):
            for index, question in enumerate(questions):
                settings = turn_settings(config, index, repeat)
                finished = len(records)
                for name, method in list(methods.items()):
                    if question.question_id in skipped:
                        bar.update(1)
                        continue
                    bar.set_postfix_str(f"{name} q{question.question_id}")
                    try:
                        outputs = answer_turns(method, encoder, tokenizer, question, settings)
                    except KeyboardInterrupt:
                        raise Interrupted(records[:finished]) from None
                    except ContextOverflow as error:  # the question, not the method: left out for all
                        skipped[question.question_id] = f"{name}: {error}"
                        records = records[:finished]
                        continue
                    except Exception as error:  # a method may fail in any way; the bench records it and goes on
                        errors[name] = describe(error)
                        del methods[name]
                        finished = len([record for record in records[:finished] if record.method != name])
                        records = [record for record in records if record.method != name]
                        continue
                    finally:
                        bar.update(1)
                    for turn, output in enumerate(outputs):
                        records.append(TurnRecord(name, question.question_id, question.category, turn, repeat, output))
    return records


def sweep_budgets(config: BenchConfig, factory: MethodFactory, encoder: object, tokenizer: object,
                  questions: list[Question], progress: bool) -> dict[str, dict[int, dict[str, float]]]:  # fmt: skip
    """Tokens/s and mean accepted of each tree method at every node budget (one pass, after warm-up)."""
    sweep: dict[str, dict[int, dict[str, float]]] = {}
    specs: list[MethodSpec] = []
    for name in config.methods:
        try:
            spec = parse_method(name)
        except CausalDraftError:
            continue
        if spec.speculative:
            specs.append(spec)
    for spec in specs:
        for budget in config.budgets:
            errors: dict[str, str] = {}
            try:
                methods = {spec.name: factory.build(spec, max_nodes=budget)}
            except Exception:  # already reported by the main run
                break
            warm_up(config, methods, encoder, questions[0], errors)
            records = run_questions(config, methods, encoder, tokenizer, questions, 1, errors, progress)
            if errors:
                break
            new_tokens = sum(len(record.output.token_ids) for record in records)
            wall_s = sum(record.output.wall_s for record in records)
            forwards = sum(record.output.target_forwards for record in records)
            sweep.setdefault(spec.name, {})[budget] = {
                "tokens_per_s": new_tokens / wall_s if wall_s else 0.0,
                "mean_accepted": new_tokens / forwards if forwards else 0.0,
            }
    return sweep


def run_bench(config: BenchConfig, progress: bool = True, loaded: LoadedModel | None = None) -> BenchRun:
    """Load the target once, build every method on it, warm up, run, and optionally sweep budgets."""
    from causaldraft.api import compile_backend, load

    questions = read_questions(config.prompts, config.limit, list(config.categories) or None)
    engine = config.engine
    target = loaded or load_model(engine.model, engine.backend, engine.dtype)
    if engine.compiled:
        compile_backend(target)
    config = replace(config, engine=replace(engine, dtype=target.dtype))  # ``auto`` resolved: the report names it
    run = BenchRun(config, questions, model_dir=str(target.model_dir), fingerprint=target.fingerprint)
    encoder = load(replace(config.engine.for_method("none", "chain"), calibrate=False), loaded=target)
    tokenizer = target.tokenizer
    factory = MethodFactory(target, config.engine, config.seed)
    methods = build_methods(config, factory, run.errors)
    warm_up(config, methods, encoder, questions[0], run.errors)
    try:
        run.records = run_questions(
            config, methods, encoder, tokenizer, questions, config.repeats, run.errors, progress, run.skipped
        )
    except Interrupted as stop:
        run.records, run.interrupted = stop.records, True
        return run
    if config.profile:
        run.profile = sweep_budgets(config, factory, encoder, tokenizer, questions, progress)
    return run
