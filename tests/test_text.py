"""Incremental detokenisation (``api.TextTracker``): the streamed pieces join into the tokenizer's own decode, and
stop strings end the output where decoding the whole text after every token would."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from causaldraft.api import TextTracker
from tests.tiny import byte_tokenizer


def whole_decode_reference(tokenizer, ids: list[int], stops: list[str]) -> tuple[int, str]:  # type: ignore[no-untyped-def]
    """Tokens kept and final text, by decoding the whole output after every token (the quadratic rule)."""
    for count in range(1, len(ids) + 1):
        text = tokenizer.decode(ids[:count], skip_special_tokens=True)
        found = [text.find(stop) for stop in stops if stop in text]
        if found:
            return count, text[: min(found)]
    return len(ids), tokenizer.decode(ids, skip_special_tokens=True)


def tracked(tokenizer, ids: list[int], stops: list[str], steps: list[int]) -> tuple[int, str, TextTracker]:  # type: ignore[no-untyped-def]
    """Feed ``ids`` in steps of the given sizes (as decode steps emit them); tokens kept, text shown, tracker."""
    tracker = TextTracker(tokenizer, stops)
    kept, shown, at = 0, "", 0
    for size in steps:
        step = ids[at : at + size]
        at += size
        count, piece = tracker.add(step)
        kept += count
        shown += piece
        if tracker.stopped or at >= len(ids):
            break
    return kept, shown + tracker.flush(), tracker


def random_steps(rng: random.Random, total: int) -> list[int]:
    steps = []
    while sum(steps) < total:
        steps.append(rng.randint(1, 6))
    return steps


def check_against_reference(tokenizer, texts: list[str], seed: int) -> None:  # type: ignore[no-untyped-def]
    rng = random.Random(seed)
    vocab = len(tokenizer)
    for round_ in range(60):
        if round_ % 3 == 0:  # random ids: specials, lone UTF-8 bytes, pieces out of context
            ids = [rng.randrange(vocab) for _ in range(rng.randint(1, 80))]
        else:
            ids = tokenizer.encode(rng.choice(texts), add_special_tokens=False)
        whole = tokenizer.decode(ids, skip_special_tokens=True)
        kept, shown, tracker = tracked(tokenizer, ids, [], random_steps(rng, len(ids)))
        assert (kept, shown) == (len(ids), whole)
        if whole:
            begin = rng.randrange(len(whole))
            stops = [whole[begin : begin + rng.randint(1, 4)], "never in this text \x00"]
            kept, shown, tracker = tracked(tokenizer, ids, stops, random_steps(rng, len(ids)))
            assert (kept, shown) == whole_decode_reference(tokenizer, ids, stops)
            assert tracker.stopped
        assert tracker.windowed  # the window always agreed: no whole decodes


TEXTS = [
    "Plain ASCII text, with punctuation: (a, b) -> c.\n\nA second paragraph.",
    "Multi-byte characters: café, naïve, Ωmega, 漢字かな, emoji 🎉🚀 and 👩‍👩‍👧.",
    "Code:\n```python\ndef f(x):\n    return x ** 2  # squared\n```\n",
    "  leading spaces, trailing spaces   \t tabs\t\tand \r\n line ends",
]


def test_streamed_text_and_stops_match_whole_decodes_on_a_byte_tokenizer() -> None:
    tokenizer = byte_tokenizer()  # one token per byte: characters split across tokens, invalid UTF-8 at random
    check_against_reference(tokenizer, TEXTS, seed=0)


def sentencepiece_like_tokenizer() -> PreTrainedTokenizerFast:
    """BPE over "▁"-marked words whose decoder drops the space of a decode's first word, as Llama 2's does."""
    inner = Tokenizer(models.BPE(unk_token="<unk>"))
    inner.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    inner.decoder = decoders.Metaspace(prepend_scheme="first")
    inner.train_from_iterator(TEXTS * 4, trainers.BpeTrainer(vocab_size=200, special_tokens=["<unk>", "<s>", "</s>"]))
    return PreTrainedTokenizerFast(tokenizer_object=inner, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def test_streamed_text_and_stops_match_whole_decodes_where_a_decode_drops_its_first_space() -> None:
    tokenizer = sentencepiece_like_tokenizer()
    ids = tokenizer.encode("A second paragraph.", add_special_tokens=False)
    whole = tokenizer.decode(ids)
    # the rule bites: some suffix decoded alone is not the whole text's end
    assert any(tokenizer.decode(ids[cut:]) != whole[len(tokenizer.decode(ids[:cut])) :] for cut in range(1, len(ids)))
    check_against_reference(tokenizer, TEXTS, seed=2)


def test_a_tokenizer_that_cleans_up_spaces_is_decoded_whole() -> None:
    tokenizer = byte_tokenizer()
    tokenizer.clean_up_tokenization_spaces = True
    assert not TextTracker(tokenizer, []).windowed
    ids = tokenizer.encode("Hello , world !", add_special_tokens=False)
    assert tracked(tokenizer, ids, [], [3] * len(ids))[:2] == (
        len(ids),
        tokenizer.decode(ids, skip_special_tokens=True),
    )


@pytest.mark.slow
def test_streamed_text_and_stops_match_whole_decodes_on_the_default_tokenizer() -> None:
    from causaldraft.models.loading import load_tokenizer, resolve_model_dir

    tokenizer = load_tokenizer(resolve_model_dir("default"))
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    texts = [*TEXTS, *(readme[at : at + 600] for at in range(0, 6000, 600))]
    check_against_reference(tokenizer, texts, seed=1)
