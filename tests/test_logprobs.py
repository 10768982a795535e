"""Log-probabilities of the emitted tokens (``logprobs=``): the model's own log_softmax at each position, the same
bits from speculative and plain decoding where passes are row-invariant, cut with the tokens at stop strings, EOS
and max_new_tokens, per request in a batch; bad values refused."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from causaldraft.api import Engine, StreamPiece, load
from causaldraft.errors import CausalDraftError
from causaldraft.logprobs import TokenLogprob, token_logprobs
from causaldraft.models.loading import LoadedModel
from causaldraft.serve.logprob_bodies import TokenTexts
from tests.test_eagle3 import AUX, layer_dir
from tests.test_exact import LOW_PRECISION, PROMPTS
from tests.tiny import byte_tokenizer

TOP = 3


def speculative(loaded: LoadedModel, tmp_path: Path, drafter: str, tree: str = "dynamic") -> Engine:
    options: dict[str, object] = {}
    if drafter == "eagle3":
        options["heads"] = str(layer_dir(loaded, tmp_path / drafter, aux_layers=AUX))
    return load(loaded=loaded, drafter=drafter, tree=tree, calibrate=False, fallback=False, compile=False, **options)  # type: ignore[arg-type]


@pytest.mark.parametrize("dtype", LOW_PRECISION)
@pytest.mark.parametrize(("drafter", "tree"), [("lookup", "dynamic"), ("lookup", "chain"), ("eagle3", "dynamic")])
def test_speculative_logprobs_are_plain_decoding_s_bit_for_bit(
    models: dict[str, LoadedModel], tmp_path: Path, dtype: str, drafter: str, tree: str
) -> None:
    loaded = models[dtype]
    plain = load(loaded=loaded, drafter="none", calibrate=False, compile=False)
    spec = speculative(loaded, tmp_path, drafter, tree)
    accepted = 0
    for prompt in PROMPTS:
        expected = plain.generate(prompt, max_new_tokens=60, logprobs=TOP)
        result = spec.generate(prompt, max_new_tokens=60, logprobs=TOP)
        assert result.token_ids == expected.token_ids
        assert expected.logprobs is not None and len(expected.logprobs) == len(expected.token_ids)
        assert result.logprobs == expected.logprobs, (prompt, drafter, tree)  # floats equal bit for bit
        assert [entry.token_id for entry in result.logprobs] == result.token_ids
        accepted += sum(step.accepted for step in result.stats.steps)
    assert accepted > 0  # rows past the root were reported from verify passes


def reference_logprobs(engine: Engine, prompt_ids: list[int], output: list[int]) -> list[torch.Tensor]:
    """log_softmax of the model's logits before each output token, from one whole causal pass per token."""
    backend = engine.model.backend
    rows = []
    for index in range(len(output)):
        tokens = prompt_ids + output[:index]
        cache = backend.new_cache(len(tokens) + 1)
        causal = torch.ones(len(tokens), len(tokens), dtype=torch.bool).tril()
        logits = backend.forward(torch.tensor(tokens), torch.arange(len(tokens)), causal, cache).logits
        rows.append(torch.log_softmax(logits[-1].float(), dim=-1))
    return rows


@pytest.mark.parametrize("sampling", [{}, {"temperature": 0.7, "top_k": 20, "seed": 3}])
def test_logprobs_are_the_model_s_raw_log_softmax_at_each_position(
    tiny_llama_dir: Path, sampling: dict[str, object]
) -> None:
    """In fp32, against whole causal passes: each entry is the model's log-probability of its token and the
    ``TOP`` most likely tokens there, before temperature and top-k (which only choose the token)."""
    engine = load(model=str(tiny_llama_dir), dtype="float32", drafter="lookup", calibrate=False, compile=False)
    prompt = PROMPTS[1]
    result = engine.generate(prompt, max_new_tokens=24, logprobs=TOP, **sampling)
    assert result.logprobs is not None and len(result.logprobs) == len(result.token_ids) > 0
    reference = reference_logprobs(engine, engine.encode(prompt), result.token_ids)
    scaled_apart = 0.0
    for entry, row in zip(result.logprobs, reference, strict=True):
        assert entry.logprob == pytest.approx(float(row[entry.token_id]), abs=1e-4)
        values, ids = torch.topk(row, TOP)
        assert [token for token, _ in entry.top] == ids.tolist()
        assert [value for _, value in entry.top] == pytest.approx(values.tolist(), abs=1e-4)
        if not sampling:
            assert entry.token_id == entry.top[0][0]  # greedy emits the most likely token
        scaled = torch.log_softmax(row / 0.7, dim=-1)[entry.token_id]
        scaled_apart = max(scaled_apart, abs(float(scaled) - entry.logprob))
    if sampling:
        assert scaled_apart > 1e-2  # the temperature's distribution would have given other values


def test_logprobs_are_kept_with_their_tokens_at_stops_and_in_streams(models: dict[str, LoadedModel]) -> None:
    engine = load(loaded=models["int4"], drafter="lookup", calibrate=False, fallback=False, compile=False)
    prompt = PROMPTS[0]
    whole = engine.generate(prompt, max_new_tokens=40, logprobs=1)
    assert whole.logprobs is not None and len(whole.logprobs) == len(whole.token_ids) == 40
    stop = whole.text[10:13]
    assert stop
    cut = engine.generate(prompt, max_new_tokens=40, logprobs=1, stop=stop)
    assert cut.finish_reason == "stop" and len(cut.token_ids) < 40
    assert cut.logprobs == whole.logprobs[: len(cut.token_ids)]
    pieces = [item for item in engine.events(prompt, max_new_tokens=40, logprobs=1) if isinstance(item, StreamPiece)]
    assert [entry for piece in pieces for entry in piece.logprobs] == whole.logprobs
    assert all(len(piece.logprobs) == len(piece.token_ids) for piece in pieces)
    assert engine.generate(prompt, max_new_tokens=5).logprobs is None  # not asked for


def test_batched_logprobs_are_each_request_s_alone(models: dict[str, LoadedModel]) -> None:
    engine = load(loaded=models["int4"], drafter="lookup", calibrate=False, compile=False)
    alone = [engine.generate(prompt, max_new_tokens=30, logprobs=2) for prompt in PROMPTS]
    batched = engine.generate_batch(PROMPTS, size=3, max_new_tokens=30, logprobs=2)
    for one, many in zip(alone, batched, strict=True):
        assert many.token_ids == one.token_ids and many.logprobs == one.logprobs


@pytest.mark.parametrize("value", [-1, 21, True, 1.5, "2"])
def test_bad_logprobs_are_refused_before_anything_runs(models: dict[str, LoadedModel], value: object) -> None:
    engine = load(loaded=models["int4"], drafter="none", calibrate=False, compile=False)
    with pytest.raises(CausalDraftError, match="logprobs"):
        engine.generate("hi", max_new_tokens=2, logprobs=value)
    with pytest.raises(CausalDraftError, match="logprobs"):
        engine.events("hi", logprobs=value)  # refused at the call, before the first step


def test_token_logprobs_reads_each_token_at_its_row() -> None:
    """Literal logits: the entry of token t at row r is log_softmax(row r)[t], with its rank (1 + the tokens more
    likely there) and row r's most likely tokens."""
    logits = torch.tensor([[0.0, 1.0, 2.0], [3.0, 0.0, 0.0], [0.0, -1.0, 5.0]])  # [3 nodes, vocab 3]
    entries = token_logprobs(logits, (0, 2), (1, 2), top=2)
    expected = torch.log_softmax(logits, dim=-1)
    assert entries == [
        TokenLogprob(1, float(expected[0, 1]), 2, ((2, float(expected[0, 2])), (1, float(expected[0, 1])))),
        TokenLogprob(2, float(expected[2, 2]), 1, ((2, float(expected[2, 2])), (0, float(expected[2, 0])))),
    ]


def test_token_texts_spell_each_token_s_own_bytes() -> None:
    """A byte-level tokenizer's tokens give back the text's UTF-8 bytes, also where a token holds part of a
    character (its text alone is U+FFFD); another tokenizer's give their text's UTF-8."""
    tokenizer = byte_tokenizer()
    texts = TokenTexts(tokenizer)
    text = "naïve 🙂 a"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert bytes(byte for token in ids for byte in texts.bytes(token)) == text.encode("utf-8")
    assert texts.text(ids[2]) == "\ufffd" and len(texts.bytes(ids[2])) == 1  # the first byte of "ï"
    assert texts.text(ids[0]) == "n" and texts.bytes(ids[0]) == [ord("n")]
    words = Tokenizer(models.WordLevel({"héllo": 0, "[UNK]": 1}, unk_token="[UNK]"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    word_texts = TokenTexts(PreTrainedTokenizerFast(tokenizer_object=words, unk_token="[UNK]"))
    assert word_texts.text(0) == "héllo" and word_texts.bytes(0) == list("héllo".encode())
