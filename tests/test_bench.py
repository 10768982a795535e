"""The bench harness end to end on the tiny model, plus its parsers and multi-turn feeding."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from causaldraft.bench.harness import BenchConfig, BenchRun, answer_turns, run_bench
from causaldraft.bench.methods import MethodOutput, RunSettings, cut_at_eos, parse_method, parse_methods
from causaldraft.bench.prompts import Question, read_questions
from causaldraft.bench.report import first_difference, write_outputs
from causaldraft.cli import main
from causaldraft.config import EngineConfig
from causaldraft.errors import CausalDraftError

METHODS = ("ar", "lookup", "lookup:chain", "draft:static", "hf", "markov", "no-such-method")
LOSSLESS = ("ar", "lookup", "lookup:chain", "draft:static")
METRIC_KEYS = {"tokens_per_s", "mean_accepted", "speedup_vs_hf", "speedup_vs_ar", "exact_match_vs_ar"}
STEP_KEYS = {"method", "question", "turn", "accepted", "nodes", "draft_s", "verify_s"}


def write_prompts(path: Path) -> Path:
    questions = [
        {"question_id": 81, "category": "writing",
         "turns": ["Write a poem about the sea, the sea and the sea.", "Now make it shorter."]},
        {"question_id": 111, "category": "math", "turns": ["What is 2+2? Then 2+2 is 4 and 2+2 is"]},
    ]  # fmt: skip
    path.write_text("".join(json.dumps(question) + "\n" for question in questions))
    return path


@pytest.fixture(scope="module")
def bench(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict, BenchRun]:
    directory = tmp_path_factory.mktemp("bench")
    prompts = write_prompts(directory / "questions.jsonl")
    # fixed trees, no fallback: every step of a drafter method verifies a real draft
    engine = EngineConfig(
        model=str(tiny_llama_dir), dtype="float32", draft_layers=2, adapt=False, fallback=False, compile=False
    )
    config = BenchConfig(prompts=str(prompts), methods=METHODS, max_new_tokens=20, engine=engine)
    run = run_bench(config, progress=False)
    out = directory / "out"
    results = write_outputs(run, out)
    return out, results, run


def test_results_schema(bench: tuple[Path, dict, BenchRun]) -> None:
    out, results, _ = bench
    on_disk = json.loads((out / "results.json").read_text())
    assert on_disk == json.loads(json.dumps(results))
    assert on_disk["config"]["dtype"] == "float32" and on_disk["config"]["questions"] == 2
    assert "causaldraft bench --prompts" in on_disk["config"]["command"]
    assert list(on_disk["methods"]) == list(METHODS)
    for name in ("ar", "lookup", "lookup:chain", "draft:static", "hf"):
        entry = on_disk["methods"][name]
        assert METRIC_KEYS <= set(entry), name
        assert set(entry["by_category"]) == {"writing", "math"}
        for per_category in entry["by_category"].values():
            assert METRIC_KEYS <= set(per_category)
        assert entry["turns"] == 3  # two turns of question 81, one of 111
        assert {turn: values["turns"] for turn, values in entry["by_turn"].items()} == {"1": 2, "2": 1}
        assert sum(values["new_tokens"] for values in entry["by_turn"].values()) == entry["new_tokens"]
        for turn, per_turn in entry["by_turn"].items():
            assert METRIC_KEYS <= set(per_turn)
            ar_turn = on_disk["methods"]["ar"]["by_turn"][turn]
            assert per_turn["speedup_vs_ar"] == pytest.approx(
                per_turn["tokens_per_s"] / ar_turn["tokens_per_s"], rel=1e-3
            )
        assert entry["tokens_per_s"] == pytest.approx(entry["new_tokens"] / entry["wall_s"], rel=1e-3)
        assert entry["speedup_vs_ar"] == pytest.approx(
            entry["tokens_per_s"] / on_disk["methods"]["ar"]["tokens_per_s"], rel=1e-3
        )


def test_lossless_methods_match_ar_exactly(bench: tuple[Path, dict, BenchRun]) -> None:
    _, results, run = bench
    for name in LOSSLESS:
        assert results["methods"][name]["exact_match_vs_ar"] == 1.0, name
        for per_group in (
            *results["methods"][name]["by_category"].values(),
            *results["methods"][name]["by_turn"].values(),
        ):
            assert per_group["exact_match_vs_ar"] == 1.0
    # the transformers baseline runs the same fp32 weights on the same prompt ids
    assert results["methods"]["hf"]["exact_match_vs_ar"] == 1.0
    assert results["methods"]["ar"]["mean_accepted"] == 1.0
    assert results["methods"]["hf"]["mean_accepted"] == 1.0
    for name in ("lookup", "lookup:chain", "draft:static"):  # drafts were verified, so the match means something
        assert sum(results["methods"][name]["accepted_histogram"].values()) > 0, name
        assert len(results["methods"][name]["acceptance_by_depth"]) >= 2, name
    assert results["methods"]["lookup"]["mean_accepted"] > 1.0
    outputs = {(r.method, r.question_id, r.turn): r.output.token_ids for r in run.records}
    assert outputs[("ar", "81", 1)] == outputs[("lookup", "81", 1)]
    assert len(outputs[("ar", "81", 0)]) > 0


def test_failures_are_reported_without_losing_others(bench: tuple[Path, dict, BenchRun]) -> None:
    out, results, _ = bench
    assert set(results["methods"]["markov"]) == {"error"}  # no trained heads for the tiny model
    assert "unknown method 'no-such-method'" in results["methods"]["no-such-method"]["error"]
    assert all("error" not in results["methods"][name] for name in (*LOSSLESS, "hf"))
    report = (out / "report.md").read_text()
    assert "Failed or skipped methods" in report and "`markov`" in report
    assert "## By turn" in report and "| lookup, turn 2 |" in report


def test_steps_jsonl(bench: tuple[Path, dict, BenchRun]) -> None:
    out, results, _ = bench
    lines = [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines()]
    assert all(STEP_KEYS <= set(line) for line in lines)
    for name in LOSSLESS:
        steps = [line for line in lines if line["method"] == name]
        assert len(steps) == results["methods"][name]["target_forwards"]
        assert sum(line["accepted"] + 1 for line in steps) >= results["methods"][name]["new_tokens"]
    assert {line["question"] for line in lines} == {"81", "111"}
    assert not [line for line in lines if line["method"] == "hf"]
    assert not [line for line in lines if line["method"] == "ar" and line["speculated"]]  # plain steps: never
    assert all(line["speculated"] == (line["nodes"] > 1) for line in lines if line["method"] == "lookup:chain")
    outputs = [json.loads(line) for line in (out / "outputs.jsonl").read_text().splitlines()]
    assert len(outputs) == 3 * 5  # three turns for each method that ran
    assert all(line["first_difference_vs_ar"] is None for line in outputs if line["method"] in LOSSLESS)


def test_report_and_plots_exist(bench: tuple[Path, dict, BenchRun]) -> None:
    out, _, _ = bench
    report = (out / "report.md").read_text()
    for name in (*LOSSLESS, "hf"):
        assert f"| {name} |" in report
    assert "## lookup by category" in report and "| writing |" in report
    assert "torch" in report and "cpu_count" in report
    for plot in ("speedup_by_category.png", "accepted_lengths.png", "acceptance_by_depth.png"):
        assert (out / plot).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", plot
        assert f"]({plot})" in report


def test_cli_sampling_and_profile(tiny_llama_dir: Path, tmp_path: Path) -> None:
    prompts = write_prompts(tmp_path / "questions.jsonl")
    out = tmp_path / "out"
    code = main(["bench", "--no-compile", "--prompts", str(prompts), "--methods", "ar,lookup,hf-lookup", "--model",
                 str(tiny_llama_dir), "--dtype", "float32", "--temperature", "0.8", "--max-new-tokens", "8",
                 "--categories", "math", "--profile", "--budgets", "4,8", "--no-progress",
                 "--out", str(out)])  # fmt: skip
    assert code == 0
    results = json.loads((out / "results.json").read_text())
    assert results["config"]["categories"] == ["math"] and results["config"]["questions"] == 1
    for entry in results["methods"].values():
        assert entry["exact_match_vs_ar"] is not None  # seeded Gumbel sampling: the same seed per turn for all
        assert set(entry["by_category"]) == {"math"}
    assert results["methods"]["lookup"]["exact_match_vs_ar"] == 1.0  # a function of the seed and the model
    assert set(results["profile"]) == {"lookup"}
    assert set(results["profile"]["lookup"]) == {"4", "8"}
    assert (out / "tokens_per_s_by_budget.png").is_file()
    assert "Tokens/s by tree budget" in (out / "report.md").read_text()
    code = main(
        [
            "bench",
            "--no-compile",
            "--prompts",
            str(prompts),
            "--methods",
            "ar",
            "--model",
            str(tiny_llama_dir),
            "--dtype",
            "float32",
            "--max-new-tokens",
            "4",
            "--limit",
            "1",
            "--no-progress",
            "--out",
            str(out),
        ]
    )
    assert code == 0 and not (out / "tokens_per_s_by_budget.png").exists()  # the same folder, no --profile: gone


def test_cli_user_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--no-compile", "--prompts", str(tmp_path / "missing.jsonl"), "--methods", "ar"]) == 2
    assert "does not exist" in capsys.readouterr().err
    prompts = write_prompts(tmp_path / "questions.jsonl")
    assert main(["bench", "--no-compile", "--prompts", str(prompts), "--methods", "ar", "--repeats", "0"]) == 2
    assert main(["bench", "--no-compile", "--prompts", str(prompts), "--methods", "ar", "--threads", "0"]) == 2
    assert "--threads must be >= 1" in capsys.readouterr().err


def test_multi_turn_feeds_the_methods_own_answer(tiny_llama_dir: Path) -> None:
    from causaldraft.api import load

    encoder = load(str(tiny_llama_dir), "float32", drafter="none", calibrate=False, compile=False)
    prompts: list[list[int]] = []

    class Recorder:
        name = "recorder"

        def generate(self, prompt_ids: list[int], settings: RunSettings) -> MethodOutput:
            prompts.append(prompt_ids)
            answer = encoder.tokenizer.encode(f"answer {len(prompts)}", add_special_tokens=False)
            return MethodOutput(tuple(answer), 0.1, len(answer))

    question = Question("1", "writing", ("first question", "second question"))
    outputs = answer_turns(Recorder(), encoder, encoder.tokenizer, question, RunSettings(8, 0.0, 0))
    assert len(outputs) == 2
    expected = encoder.encode_chat([{"role": "user", "content": "first question"},
                                    {"role": "assistant", "content": "answer 1"},
                                    {"role": "user", "content": "second question"}])  # fmt: skip
    assert prompts[0] == encoder.encode_chat([{"role": "user", "content": "first question"}])
    assert prompts[1] == expected


def test_parse_method() -> None:
    assert parse_method("ar").drafter == "none" and not parse_method("ar").speculative
    spec = parse_method("draft:chain")
    assert (spec.name, spec.kind, spec.drafter, spec.tree) == ("draft:chain", "causaldraft", "draft", "chain")
    assert parse_method("markov:dynamic").tree == "dynamic" and parse_method("lookup").tree == "dynamic"
    assert parse_method("hf-lookup").kind == "hf-lookup"
    for bad in ("hf:chain", "lookup:wide", "none", "nope"):
        with pytest.raises(CausalDraftError):
            parse_method(bad)
    assert parse_methods("ar, lookup,,ar") == ["ar", "lookup"]
    assert parse_methods("lookup,lookup:dynamic,ar,auto:chain") == ["lookup", "ar", "auto:chain"]  # same method once
    with pytest.raises(CausalDraftError, match="unknown method 'foo'"):
        parse_methods("ar,foo")
    assert cut_at_eos([5, 2, 7], frozenset({2})) == (5, 2) and cut_at_eos([5, 7], frozenset({2})) == (5, 7)
    assert cut_at_eos([5, 9, 2, 7], frozenset({2, 9})) == (5, 9)


def test_first_difference() -> None:
    assert first_difference((1, 2, 3), (1, 2, 3)) is None
    assert first_difference((1, 5, 3), (1, 2, 3)) == 1
    assert first_difference((1, 2), (1, 2, 3)) == 2


def test_read_questions(tmp_path: Path) -> None:
    prompts = write_prompts(tmp_path / "questions.jsonl")
    assert [q.question_id for q in read_questions(prompts)] == ["81", "111"]
    assert [q.question_id for q in read_questions(prompts, limit=1)] == ["81"]
    assert [q.category for q in read_questions(prompts, categories=["math"])] == ["math"]
    assert read_questions(prompts)[0].turns[1] == "Now make it shorter."
    with pytest.raises(CausalDraftError, match="unknown categories"):
        read_questions(prompts, categories=["poetry"])
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question_id": 1, "turns": []}\n')
    with pytest.raises(CausalDraftError, match="bad.jsonl:1"):
        read_questions(bad)
    twice = tmp_path / "twice.jsonl"
    twice.write_text('{"question_id": 7, "turns": ["a"]}\n{"question_id": 7, "turns": ["b"]}\n')
    with pytest.raises(CausalDraftError, match="twice.jsonl:2: question_id '7' is also on line 1"):
        read_questions(twice)  # answers are matched across methods by question_id: it once gave ar 0.5 vs itself
    latin = tmp_path / "latin.jsonl"
    latin.write_bytes(b'{"question_id": 1, "turns": ["caf\xe9"]}\n')
    with pytest.raises(CausalDraftError, match="is not UTF-8"):
        read_questions(latin)
    marked = tmp_path / "bom.jsonl"
    marked.write_bytes(b"\xef\xbb\xbf" + prompts.read_bytes())
    assert [q.question_id for q in read_questions(marked)] == ["81", "111"]
    with pytest.raises(CausalDraftError, match="is a directory"):
        read_questions(tmp_path)


def test_a_question_outgrowing_the_context_is_left_out_for_every_method_and_the_rest_kept(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    """The tiny model's context is 512 tokens: a 600-byte question cannot be answered by any method. It
    is left out for all of them, and the other question's results stay (they were all dropped before)."""
    prompts = tmp_path / "long.jsonl"
    questions = [{"question_id": 1, "category": "a", "turns": ["abc abc abc"]},
                 {"question_id": 2, "category": "b", "turns": ["x" * 600]}]  # fmt: skip
    prompts.write_text("".join(json.dumps(question) + "\n" for question in questions))
    engine = EngineConfig(model=str(tiny_llama_dir), dtype="float32", compile=False)
    run = run_bench(BenchConfig(prompts=str(prompts), methods=("ar", "lookup"), max_new_tokens=8, engine=engine,
                                warmup=0), progress=False)  # fmt: skip
    assert not run.errors and list(run.skipped) == ["2"] and "context of 512 tokens" in run.skipped["2"]
    assert {(record.method, record.question_id) for record in run.records} == {("ar", "1"), ("lookup", "1")}
    results = write_outputs(run, tmp_path / "out")
    assert results["methods"]["lookup"]["exact_match_vs_ar"] == 1.0
    assert "Left out for every method" in (tmp_path / "out" / "report.md").read_text()


def test_ctrl_c_keeps_the_questions_every_method_finished(
    tiny_llama_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Ctrl-C in the second question: the first question's results are written, the report says so, and
    the command exits 130 with a line saying what was kept (it once wrote nothing at all)."""
    from causaldraft.bench import harness

    answered = harness.answer_turns
    calls = []

    def interrupted_in_the_second_question(*args: object) -> object:
        calls.append(1)
        if len(calls) == 3:  # ar and lookup finished question 1; ar is answering question 2
            raise KeyboardInterrupt
        return answered(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(harness, "answer_turns", interrupted_in_the_second_question)
    out = tmp_path / "out"
    code = main(["bench", "--model", str(tiny_llama_dir), "--dtype", "float32", "--no-compile", "--prompts",
                 str(write_prompts(tmp_path / "q.jsonl")), "--methods", "ar,lookup", "--max-new-tokens", "8",
                 "--warmup", "0", "--no-progress", "--out", str(out)])  # fmt: skip
    assert code == 130 and "interrupted" in capsys.readouterr().err
    results = json.loads((out / "results.json").read_text())
    assert results["config"]["interrupted"] and results["methods"]["lookup"]["exact_match_vs_ar"] == 1.0
    assert {json.loads(line)["question"] for line in (out / "outputs.jsonl").read_text().splitlines()} == {"81"}
    assert "Interrupted (Ctrl-C)" in (out / "report.md").read_text()
    command = results["config"]["command"]
    assert "--seed 0" in command and "--warmup 0" in command and str((tmp_path / "q.jsonl").resolve()) in command


def test_an_out_that_is_a_file_or_a_bad_method_is_refused_before_the_model_loads(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    prompts = write_prompts(tmp_path / "questions.jsonl")
    afile = tmp_path / "afile"
    afile.write_text("hi")
    missing_model = str(tmp_path / "no-model")  # a load would fail otherwise: these checks come first
    assert main(["bench", "--model", missing_model, "--prompts", str(prompts), "--methods", "ar",
                 "--out", str(afile)]) == 2  # fmt: skip
    assert f"--out {afile} is a file" in capsys.readouterr().err
    assert main(["bench", "--model", missing_model, "--prompts", str(prompts), "--methods", "ar,lookup:bogus",
                 "--out", str(tmp_path / "out")]) == 2  # fmt: skip
    assert "method 'lookup:bogus': tree kind" in capsys.readouterr().err


def crashing_llamacpp(connection: object, gguf: str, seed: int) -> None:
    """A llama.cpp child that loads, then dies natively in its first generate (as an AMX build did)."""
    import os

    connection.send(("ok", 2))  # type: ignore[attr-defined]
    connection.recv()  # type: ignore[attr-defined]
    os.abort()


def test_a_crashing_llamacpp_child_is_this_methods_error_not_the_bench(tmp_path: Path) -> None:
    from causaldraft.bench.methods import LlamaCppMethod, RunSettings

    method = LlamaCppMethod("llamacpp", tmp_path / "model.gguf", 0, worker=crashing_llamacpp)
    with pytest.raises(CausalDraftError, match="crashed"):
        method.generate([1, 2, 3], RunSettings(max_new_tokens=4, temperature=0.0, seed=0))
    with pytest.raises(CausalDraftError, match="crashed earlier"):
        method.generate([1, 2, 3], RunSettings(max_new_tokens=4, temperature=0.0, seed=0))
