"""The n-gram store of the model's own answers (drafters/store.py): its index against a plain
reference, its files and refusals, prompt lookup with it, greedy equivalence and the sampling law
of every drafter that walks it, and ``causaldraft build-store``."""

from __future__ import annotations

import dataclasses
import json
import random
import shutil
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import pytest
from safetensors.numpy import load_file as load_arrays
from safetensors.numpy import save_file as save_arrays
from safetensors.torch import load_file

from causaldraft.api import load
from causaldraft.cli import main
from causaldraft.config import SamplingConfig
from causaldraft.drafters.base import DraftContext, StepResult
from causaldraft.drafters.lookup import Continuation, LookupDrafter, Match, prior_first_rate
from causaldraft.drafters.store import (
    CONFIG_FILE,
    MIN_COUNT,
    REPEAT_PREFIX,
    STORE_FILE,
    NgramStore,
    StoreConfig,
    StoreGuess,
    add_answers,
    build_index,
    corpus_arrays,
    corpus_sequences,
    index_path,
    load_store,
    save_store,
)
from causaldraft.errors import CausalDraftError
from causaldraft.models.loading import LoadedModel, load_model
from causaldraft.paths import causaldraft_home
from causaldraft.verify import Acceptance
from tests.test_decode import SAMPLES, law_test
from tests.test_eagle3 import layer_dir
from tests.test_heads import random_heads_dir

PROMPTS = ["hello world hello world", "the cat sat on the mat. the cat", "abcabcabc"]
CORPUS_PROMPTS = [*PROMPTS, "one two three", "the mat", "a b c d", "zzz top"]
MIN_SCORE = 0.02  # the untimed policy's threshold in the law test: about half of the nodes pass


def store_of(sequences: Sequence[Sequence[int]], vocab_size: int = 100) -> NgramStore:
    tokens, starts = corpus_arrays(sequences)
    return NgramStore(StoreConfig("test", vocab_size, len(tokens), len(sequences)), tokens, starts)


def reference_guess(sequences: Sequence[Sequence[int]], context: Sequence[int]) -> StoreGuess | None:
    """The longest 2..6-gram ending ``context`` seen MIN_COUNT times inside one sequence, followed by
    its commonest token (the smaller id on a tie), counted by brute force."""
    for size in range(min(6, len(context)), 1, -1):
        gram = tuple(context[-size:])
        followers = Counter(
            sequence[end]
            for sequence in sequences
            for end in range(size, len(sequence))
            if tuple(sequence[end - size : end]) == gram
        )
        total = sum(followers.values())
        if total >= MIN_COUNT:
            token, count = min(followers.items(), key=lambda item: (-item[1], item[0]))
            return StoreGuess(token, size, count / total)
    return None


def test_the_documented_example() -> None:
    a, b, c, d, e, x = 1, 2, 3, 4, 5, 6
    store = store_of([(a, b, c, d), (a, b, c, e), (a, b, c, d)])
    guess = store.guess((x, a, b, c))
    assert guess is not None and (guess.token, guess.size) == (d, 3) and guess.share == pytest.approx(2 / 3)
    walked = store.continuation((x, a, b, c), 4)
    assert walked is not None and walked[0] == (d,)
    assert store.guess((x, d)) is None  # never seen


def test_guesses_equal_a_brute_force_count() -> None:
    generator = random.Random(0)
    sequences = [[generator.randrange(6) for _ in range(generator.randrange(1, 40))] for _ in range(30)]
    store = store_of(sequences)
    checked = 0
    for _ in range(400):
        context = [generator.randrange(6) for _ in range(generator.randrange(1, 9))]
        expected = reference_guess(sequences, context)
        guess = store.guess(context)
        assert (guess is None) == (expected is None), context
        if guess is not None and expected is not None:
            assert (guess.token, guess.size) == (expected.token, expected.size), context
            assert guess.share == pytest.approx(expected.share)
            checked += 1
    assert checked > 100


def test_n_grams_do_not_cross_sequences() -> None:
    store = store_of([(5, 6), (7, 8), (5, 6), (7, 8)])
    assert store.guess((6, 7)) is None and store.guess((5, 6)) is None  # 6 7 only across a boundary
    assert len(store) == 0
    assert store_of([(5, 6, 7), (5, 6, 7)]).guess((5, 6)) == StoreGuess(7, 2, 1.0)


def test_a_corpus_shorter_than_the_longest_n_gram_builds() -> None:
    assert store_of([(1, 2, 3)]).guess((1, 2)) is None  # seen once: below MIN_COUNT
    assert store_of([(1, 2, 3), (1, 2, 3)]).guess((1, 2)) == StoreGuess(3, 2, 1.0)
    assert len(store_of([])) == 0 and store_of([]).guess((1, 2)) is None


def test_a_continuation_stops_when_it_gets_unsure() -> None:
    store = store_of([(1, 2, 3, 4, 5)] * 2 + [(1, 2, 9, 9, 9)] * 2 + [(7, 2, 3, 4, 6)] * 3)
    walked = store.continuation((0, 1, 2), 5)
    assert walked is not None
    tokens, first = walked
    # "1 2" -> 3 or 9 (1/2), then "1 2 3" -> 4 (1), then "1 2 3 4" -> 5 (1); "2 3 4 5" unseen
    assert tokens == (3, 4, 5) and first == StoreGuess(3, 2, 0.5)
    assert store.continuation((0, 1, 2), 2) == ((3, 4), first)
    unsure = store_of([(1, 2, 3), (1, 2, 4), (1, 2, 5), (1, 2, 6)])
    assert unsure.continuation((1, 2), 3) is None  # share 1/4 < MIN_SHARE


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir: Path) -> LoadedModel:
    return load_model(str(tiny_llama_dir), "native", "float32")


@pytest.fixture(scope="module")
def answers(tiny: LoadedModel) -> list[list[int]]:
    engine = load(loaded=tiny, drafter="none", calibrate=False, compile=False)
    return [engine.generate(prompt, max_new_tokens=40).token_ids for prompt in CORPUS_PROMPTS]


@pytest.fixture(scope="module")
def store_dir(tiny: LoadedModel, answers: list[list[int]], tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("store")
    config = StoreConfig(tiny.base_fingerprint, tiny.backend.shape.vocab_size, 0, len(answers))
    save_store(directory, answers, config)
    return directory


def test_files_round_trip_and_bad_stores_are_refused(tiny: LoadedModel, store_dir: Path, tmp_path: Path) -> None:
    fingerprint, vocab = tiny.base_fingerprint, tiny.backend.shape.vocab_size
    store = load_store(store_dir, fingerprint, vocab)
    assert len(store) > 0 and store.config.sequences == len(CORPUS_PROMPTS)
    with pytest.raises(CausalDraftError, match="another model's answers"):
        load_store(store_dir, "0123456789abcdef", vocab)
    with pytest.raises(CausalDraftError, match="is missing"):
        load_store(tmp_path, fingerprint, vocab)
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / CONFIG_FILE).write_text((store_dir / CONFIG_FILE).read_text())
    (broken / STORE_FILE).write_bytes(b"not a safetensors file")
    with pytest.raises(CausalDraftError, match="cannot read"):
        load_store(broken, fingerprint, vocab)
    (broken / CONFIG_FILE).write_text("{not json")
    with pytest.raises(CausalDraftError, match="not an n-gram store config"):
        load_store(broken, fingerprint, vocab)
    foreign = tmp_path / "foreign"
    save_store(foreign, [[1, 2, vocab + 5]], StoreConfig(fingerprint, vocab, 3, 1))
    with pytest.raises(CausalDraftError, match="outside the vocabulary"):
        load_store(foreign, fingerprint, vocab)
    with pytest.raises(CausalDraftError, match="does not exist"):
        load(loaded=tiny, drafter="lookup", store=str(tmp_path / "nowhere"), calibrate=False, compile=False)


def test_a_loaded_store_keeps_its_index_in_the_cache(
    tiny: LoadedModel, store_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first load writes the built index under the home; later loads read that file (an edited file
    shows through), a corrupt one is rebuilt and rewritten, and an unwritable home only costs the build."""
    fingerprint, vocab = tiny.base_fingerprint, tiny.backend.shape.vocab_size
    monkeypatch.setenv("CAUSALDRAFT_HOME", str(tmp_path / "home"))
    first = load_store(store_dir, fingerprint, vocab)
    tokens, starts = corpus_arrays(first_answers := corpus_of(store_dir))
    path = index_path(tokens, starts, first.config.min_ngram, first.config.max_ngram)
    assert path.parent == causaldraft_home() / "store-index" and path.is_file()
    built = build_index(tokens, starts, first.config.min_ngram, first.config.max_ngram)
    for kept, fresh in zip((first.keys, first.followers, first.shares), built, strict=True):
        assert kept.dtype == fresh.dtype and (kept == fresh).all()
    edited = {"keys": built[0], "followers": built[1] + 1, "shares": built[2]}
    save_arrays(edited, str(path))
    assert (load_store(store_dir, fingerprint, vocab).followers == built[1] + 1).all()
    path.write_bytes(b"not an index")
    assert (load_store(store_dir, fingerprint, vocab).followers == built[1]).all()
    assert (load_arrays(str(path))["followers"] == built[1]).all()  # rewritten
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no partial file left
    assert index_path(*corpus_arrays([*first_answers, [1, 2]]), 2, 6) != path  # another corpus, another file
    assert index_path(tokens, starts, 2, 5) != path  # other n-gram sizes too
    blocked = tmp_path / "blocked"
    blocked.write_text("a file where the home's folder would be")
    monkeypatch.setenv("CAUSALDRAFT_HOME", str(blocked))
    assert (load_store(store_dir, fingerprint, vocab).keys == built[0]).all()


def corpus_of(directory: Path) -> list[list[int]]:
    tensors = load_file(str(directory / STORE_FILE))
    return corpus_sequences(tensors["tokens"].numpy(), tensors["starts"].numpy())


def context(tokens: tuple[int, ...], width: int = 1) -> DraftContext:
    return DraftContext(tokens, None, "chain" if width == 1 else "dynamic", 4, width, 16, SamplingConfig(), None)


def test_lookup_proposes_the_store_s_continuation_and_learns_its_rate() -> None:
    store = store_of([(1, 2, 3, 4, 5)] * 3)
    drafter = LookupDrafter(store=store)
    tokens = (9, 8, 1, 2)  # no earlier occurrence in the text: the store alone proposes
    draft = drafter.propose(context(tokens))
    stored = Match(2, True, stored=True)
    assert draft.tree.tokens == (2, 3, 4, 5)
    assert draft.scores[1] == pytest.approx(prior_first_rate(stored))
    assert drafter.recorded == [Continuation((3, 4, 5), stored)]
    accepted = Acceptance((0, 1, 2, 3), (3, 4, 5, 7), True)
    drafter.observe(StepResult(draft, accepted, (*tokens, 3, 4, 5, 7)))
    assert drafter.rates.first[stored] > prior_first_rate(stored) and drafter.recorded == []
    # a repeated 3-gram in the text outscores the store: it keeps the one place of a chain, while
    # the store's continuation is still scored against what the target emits
    text = (1, 2, 6, 0, 1, 2, 6, 0, 1, 2)
    drafter = LookupDrafter(store=store)
    found = drafter.continuations(text, 4, 1)
    assert found == [Continuation((6, 0, 1, 2), Match(3, False))]
    assert [path.match.stored for path in drafter.recorded] == [False, True]
    assert LookupDrafter(store=store).continuations(text, 4, 2)[1].match.stored  # a free place: added


def test_the_store_makes_lookup_accept_more(tiny: LoadedModel, store_dir: Path) -> None:
    plain = load(loaded=tiny, drafter="lookup", tree="chain", calibrate=False, fallback=False, compile=False)
    stored = load(
        loaded=tiny,
        drafter="lookup",
        tree="chain",
        store=str(store_dir),
        calibrate=False,
        fallback=False,
        compile=False,
    )
    passes = {name: 0 for name in ("plain", "stored")}
    for prompt in CORPUS_PROMPTS:
        passes["plain"] += plain.generate(prompt, max_new_tokens=40).stats.target_forwards
        passes["stored"] += stored.generate(prompt, max_new_tokens=40).stats.target_forwards
    assert passes["stored"] < passes["plain"]


@pytest.mark.parametrize("drafter", ["lookup", "markov", "medusa", "eagle3"])
@pytest.mark.parametrize("tree", ["chain", "static", "dynamic"])
def test_greedy_output_with_the_store_is_token_identical_to_plain(
    tiny: LoadedModel, answers: list[list[int]], store_dir: Path, tmp_path: Path, drafter: str, tree: str
) -> None:
    heads = None
    if drafter == "eagle3":
        heads = str(layer_dir(tiny, tmp_path / "eagle3"))
    elif drafter != "lookup":
        heads = str(random_heads_dir(tiny, drafter, tmp_path / drafter))
    engine = load(loaded=tiny, drafter=drafter, tree=tree, heads=heads, store=str(store_dir), calibrate=False,
                  fallback=False, compile=False)  # fmt: skip
    for prompt, expected in zip(CORPUS_PROMPTS, answers, strict=True):
        result = engine.generate(prompt, max_new_tokens=40)
        assert result.token_ids == expected, (drafter, tree, prompt)
        assert max(step.nodes for step in result.stats.steps) > 2  # it really drafted


@pytest.mark.parametrize(("sampler", "adapt"), [("gumbel", False), ("rejection", False), ("rejection", True)])
def test_sampled_output_with_the_store_follows_the_exact_target_law(
    tiny_llama_dir: Path, tiny: LoadedModel, store_dir: Path, sampler: str, adapt: bool
) -> None:
    """Also under seeded rejection sampling with adaptation on, where trees are cut by their scores
    (``DecodeConfig.untimed_min_score``, lowered so that some nodes of this untrained model pass)."""
    engine = load(loaded=tiny, drafter="lookup", tree="dynamic", depth=2, store=str(store_dir), calibrate=False,
                  fallback=False, adapt=adapt, sampler=sampler, compile=False)  # fmt: skip
    decode = dataclasses.replace(engine.decoder.decode, untimed_min_score=MIN_SCORE)
    engine.decoder = dataclasses.replace(engine.decoder, decode=decode)
    pvalue, drafted = law_test(engine, tiny_llama_dir, {})
    assert drafted > SAMPLES and pvalue > 1e-4
    assert drafted < 2 * SAMPLES if adapt else drafted == 2 * SAMPLES  # the scores cut some trees


def test_build_store_command(tiny_llama_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(CORPUS_PROMPTS))
    out = tmp_path / "store"
    work = tmp_path / "work"
    args = ["build-store", "--model", str(tiny_llama_dir), "--prompts", str(prompts), "--tokens", "50",
            "--max-new-tokens", "16", "--threads", "1", "--work", str(work), "--out", str(out)]  # fmt: skip
    assert main(args) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    config = json.loads((out / CONFIG_FILE).read_text())
    assert summary["tokens"] == config["tokens"] >= 50 and summary["ngrams"] > 0
    assert config["record"]["data"] == str(work / "store-data-seed0") and config["sequences"] > 1
    tiny32 = load_model(str(tiny_llama_dir), "native", "float32")  # the store fits every dtype of the model
    assert len(load_store(out, tiny32.base_fingerprint, tiny32.backend.shape.vocab_size)) > 0
    again = tmp_path / "again"
    assert main(["build-store", "--model", str(tiny_llama_dir), "--from", str(tmp_path / "work" / "store-data-seed0"),
                 "--out", str(again)]) == 0  # fmt: skip
    assert (again / STORE_FILE).read_bytes() == (out / STORE_FILE).read_bytes()
    assert main(["build-store", "--model", str(tiny_llama_dir), "--out", str(again)]) == 2  # neither source
    assert "either --prompts" in capsys.readouterr().err
    missing = tmp_path / "missing.txt"  # refused before a model loads (this one does not exist either)
    assert main(["build-store", "--model", str(tmp_path / "no-model"), "--prompts", str(missing), "--out",
                 str(again)]) == 2  # fmt: skip
    assert f"prompt file {missing} does not exist" in capsys.readouterr().err
    for change, message in (({"fingerprint": "0123456789abcdef"}, "another model's answers"),
                            ({"temperature": 0.8}, "sampled answers")):  # fmt: skip
        data = tmp_path / f"data-{message.split()[0]}"
        shutil.copytree(work / "store-data-seed0", data)
        meta = json.loads((data / "meta.json").read_text())
        (data / "meta.json").write_text(json.dumps({**meta, **change}))
        assert main(["build-store", "--model", str(tiny_llama_dir), "--from", str(data), "--out", str(again)]) == 2
        assert message in capsys.readouterr().err
    # --extend: the store's answers first; the same answers again are all left out as repeats
    extended = tmp_path / "extended"
    from_data = ["build-store", "--model", str(tiny_llama_dir), "--from", str(work / "store-data-seed0")]
    assert main([*from_data, "--extend", str(out), "--out", str(extended)]) == 0
    grown = json.loads((extended / CONFIG_FILE).read_text())
    assert (grown["tokens"], grown["sequences"]) == (config["tokens"], config["sequences"])
    assert grown["record"]["extends"]["repeated_answers_left_out"] == config["sequences"]
    assert grown["record"]["extends"]["record"] == config["record"]
    assert main([*from_data, "--extend", str(tmp_path / "none"), "--out", str(extended)]) == 2
    assert "store to extend" in capsys.readouterr().err
    other = tmp_path / "other-store"
    shutil.copytree(out, other)
    (other / CONFIG_FILE).write_text(json.dumps({**config, "fingerprint": "0123456789abcdef"}))
    assert main([*from_data, "--extend", str(other), "--out", str(extended)]) == 2
    assert "another model's answers" in capsys.readouterr().err
    fresh_work = tmp_path / "work-refused"  # refused before any answer is generated
    assert main([*args[:-4], "--work", str(fresh_work), "--extend", str(other), "--out", str(extended)]) == 2
    assert "another model's answers" in capsys.readouterr().err and not fresh_work.exists()


def test_added_answers_leave_out_repeats_of_earlier_ones() -> None:
    corpus = [[1, 2, 3]]
    assert add_answers(corpus, [[1, 2, 4], [5], [5]], prefix=2) == ([[1, 2, 3], [5]], 2)
    assert add_answers(corpus, [[1, 2, 4], [5, 6], [5]], prefix=3) == ([[1, 2, 3], [1, 2, 4], [5, 6]], 1)
    # found by an audit: answers cut shorter (a smaller --max-new-tokens) are the start of the longer ones
    assert add_answers(corpus, [[1, 2, 4], [5], [5], [1], [5, 6]], prefix=2) == ([[1, 2, 3], [5], [5, 6]], 3)
    assert add_answers([[4, 5, 6, 7]], [[4, 5], [4]]) == ([[4, 5, 6, 7]], 2)
    long = list(range(REPEAT_PREFIX + 5))
    changed_late = [*long[:REPEAT_PREFIX], 999]  # the same first REPEAT_PREFIX tokens: one answer twice
    assert add_answers([long], [changed_late, long[:-1]]) == ([long], 2)
    assert add_answers([], [[7], [7, 8]]) == ([[7], [7, 8]], 0)
