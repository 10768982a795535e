"""vLLM's stop_token_ids, ignore_eos and min_tokens: the tokens that end the output, judged node by node so that
speculative output ends where plain decoding's does."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

import causaldraft
from causaldraft.api import Engine
from causaldraft.errors import CausalDraftError
from causaldraft.models.loading import LoadedModel
from causaldraft.penalties import without_early_stops
from causaldraft.tree import Tree
from tests.test_exact import PROMPTS
from tests.test_penalties import speculative

PROMPT = "abcabcabc hello"


def test_min_tokens_masks_the_stops_in_the_rows_that_choose_early_tokens() -> None:
    """3 tokens emitted, min_tokens 5: the root (depth 0) and its children choose tokens 4 and 5 and lose the stop
    tokens; the grandchild chooses token 6 and keeps them."""
    tree = Tree(parents=(-1, 0, 0, 1), tokens=(9, 3, 4, 5))
    logits = torch.zeros(4, 8)
    scores = without_early_stops(logits, tree, 3, 5, frozenset({2, 6}))
    assert scores[:3, [2, 6]].eq(float("-inf")).all() and scores[3].eq(0).all()
    assert scores[:, [0, 1, 3, 4, 5, 7]].eq(0).all() and logits.eq(0).all()  # a copy; nothing else touched
    assert without_early_stops(logits, tree, 5, 5, frozenset({2})) is logits  # nothing early: unchanged


def plain_and_stop(models: dict[str, LoadedModel], dtype: str) -> tuple[Engine, int]:
    plain = causaldraft.load(loaded=models[dtype], drafter="none", calibrate=False, compile=False)
    output = plain.generate(PROMPT, max_new_tokens=30).token_ids
    return plain, output[len(output) // 3]  # a token the plain output holds, not first


def test_stop_token_ids_end_the_output_and_min_tokens_delays_them(models: dict[str, LoadedModel]) -> None:
    plain, stop = plain_and_stop(models, "int4")
    whole = plain.generate(PROMPT, max_new_tokens=30)
    cut = plain.generate(PROMPT, max_new_tokens=30, stop_token_ids=[stop])
    first = whole.token_ids.index(stop)
    assert cut.token_ids == whole.token_ids[: first + 1] and cut.finish_reason == "stop"  # kept in it, as EOS is
    later = plain.generate(PROMPT, max_new_tokens=30, stop_token_ids=[stop], min_tokens=first + 4)
    assert stop not in later.token_ids[: first + 3] and len(later.token_ids) >= first + 4
    assert later.token_ids[:first] == whole.token_ids[:first] and later.token_ids[first] != stop


def test_ignore_eos_runs_to_max_new_tokens(models: dict[str, LoadedModel]) -> None:
    plain, stop = plain_and_stop(models, "int4")
    plain.decoder = dataclasses.replace(plain.decoder, eos_token_ids=frozenset({stop}))  # the model's EOS, here
    ended = plain.generate(PROMPT, max_new_tokens=30)
    assert ended.finish_reason == "stop" and ended.token_ids[-1] == stop and len(ended.token_ids) < 30
    ignored = plain.generate(PROMPT, max_new_tokens=30, ignore_eos=True)
    assert ignored.finish_reason == "length" and len(ignored.token_ids) == 30
    assert ignored.token_ids[: len(ended.token_ids)] == ended.token_ids
    delayed = plain.generate(PROMPT, max_new_tokens=30, min_tokens=len(ended.token_ids) + 2)
    assert stop not in delayed.token_ids[: len(ended.token_ids) + 1]  # EOS masked until min_tokens


@pytest.mark.parametrize("dtype", ["bfloat16", "int4"])
@pytest.mark.parametrize("drafter", ["draft", "lookup", "eagle3"])
def test_speculative_output_ends_where_plain_decoding_s_does(
    models: dict[str, LoadedModel], tiny_llama_dir: Path, tmp_path: Path, dtype: str, drafter: str
) -> None:
    plain, stop = plain_and_stop(models, dtype)
    spec = speculative(models[dtype], tiny_llama_dir, tmp_path, drafter)
    accepted = 0
    for prompt in (PROMPT, *PROMPTS):
        for options in ({"stop_token_ids": [stop]}, {"stop_token_ids": [stop], "min_tokens": 12},
                        {"stop_token_ids": [stop], "min_tokens": 9, "temperature": 0.8, "seed": 3}):  # fmt: skip
            expected = plain.generate(prompt, max_new_tokens=30, **options)
            result = spec.generate(prompt, max_new_tokens=30, **options)
            assert result.token_ids == expected.token_ids and result.finish_reason == expected.finish_reason
            accepted += sum(step.accepted for step in result.stats.steps)
    assert accepted > 0
    batched = plain.generate_batch([PROMPT, *PROMPTS], size=4, max_new_tokens=30, stop_token_ids=[stop], min_tokens=12)
    alone = [plain.generate(prompt, max_new_tokens=30, stop_token_ids=[stop], min_tokens=12) for prompt in
             (PROMPT, *PROMPTS)]  # fmt: skip
    assert [result.token_ids for result in batched] == [result.token_ids for result in alone]


@pytest.mark.parametrize(
    ("options", "says"),
    [({"min_tokens": -1}, "min_tokens"), ({"min_tokens": True}, "min_tokens"),
     ({"min_tokens": 40, "max_new_tokens": 30}, "min_tokens"), ({"ignore_eos": "yes"}, "ignore_eos"),
     ({"stop_token_ids": 5}, "stop_token_ids"), ({"stop_token_ids": ["a"]}, "token ids")],
)  # fmt: skip
def test_bad_stop_options_are_refused_at_the_call(
    models: dict[str, LoadedModel], options: dict[str, object], says: str
) -> None:
    plain = causaldraft.load(loaded=models["int4"], drafter="none", calibrate=False, compile=False)
    with pytest.raises(CausalDraftError, match=says):
        plain.events(PROMPT, **options)
    with pytest.raises(CausalDraftError, match="stop_token_ids"):
        plain.generate(PROMPT, max_new_tokens=3, stop_token_ids=[plain.model.backend.shape.vocab_size])
    assert plain.generate(PROMPT, max_new_tokens=3).token_ids
