"""The one decoding loop: draft -> verify -> commit -> accept -> observe, as a generator.

Plain decoding is the same loop with a root-only draft. State lives in ``DecodeState``; stats in
``GenerationStats``. Stop rules are applied token by token to the emitted block, so EOS, stop
strings and max_new_tokens end the output at exactly the same token as plain decoding would.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from causaldraft.adapt import BudgetPolicy, VerifyCost
from causaldraft.cache import KVCache
from causaldraft.config import DecodeConfig, SamplingConfig, TreeConfig
from causaldraft.drafters.base import Draft, DraftContext, Drafter, StepResult
from causaldraft.errors import CausalDraftError, ContextOverflow
from causaldraft.logprobs import TokenLogprob, token_logprobs
from causaldraft.models.base import Backend, Cache, ForwardOutput
from causaldraft.penalties import penalized_logits, without_early_stops
from causaldraft.prefix import PrefixStore, copy_chunks
from causaldraft.sampling import gumbel_noise_rows, gumbel_scores, warp_probs
from causaldraft.threads import ThreadPolicy, step_on
from causaldraft.tree import compile_tree, full_mask
from causaldraft.verify import Acceptance, row_argmax, verify_greedy, verify_naive, verify_sampled


@dataclass(frozen=True)
class StepStats:
    nodes: int
    accepted: int  # draft tokens accepted (tokens emitted - 1)
    draft_s: float
    verify_s: float
    speculated: bool


@dataclass
class GenerationStats:
    new_tokens: int = 0
    target_forwards: int = 0
    prefill_s: float = 0.0
    cached_prompt_tokens: int = 0  # prompt rows copied from a kept prefix instead of read (prefix.py)
    wall_s: float = 0.0
    steps: list[StepStats] = field(default_factory=list)
    depth_attempts: list[int] = field(default_factory=list)  # steps that drafted >= d tokens deep
    depth_accepts: list[int] = field(default_factory=list)  # steps that accepted >= d tokens

    @property
    def mean_accepted(self) -> float:
        return self.new_tokens / self.target_forwards if self.target_forwards else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.wall_s if self.wall_s > 0 else 0.0

    def acceptance_by_depth(self) -> list[float]:
        return [acc / att if att else 0.0 for acc, att in zip(self.depth_accepts, self.depth_attempts, strict=True)]

    def record(self, step: StepStats, tree_depth: int) -> None:
        self.steps.append(step)
        self.target_forwards += 1
        while len(self.depth_attempts) < tree_depth:
            self.depth_attempts.append(0)
            self.depth_accepts.append(0)
        for depth in range(tree_depth):
            self.depth_attempts[depth] += 1
            self.depth_accepts[depth] += int(depth < step.accepted)

    def summary(self) -> dict[str, float | int]:
        steps = max(1, len(self.steps))
        return {
            "new_tokens": self.new_tokens,
            "target_forwards": self.target_forwards,
            "mean_accepted": round(self.mean_accepted, 4),
            "wall_s": round(self.wall_s, 4),
            "tokens_per_s": round(self.tokens_per_s, 3),
            "draft_ms_per_step": round(1000 * sum(step.draft_s for step in self.steps) / steps, 3),
            "verify_ms_per_step": round(1000 * sum(step.verify_s for step in self.steps) / steps, 3),
            "cached_prompt_tokens": self.cached_prompt_tokens,
        }


@dataclass
class DecodeState:
    tokens: list[int]  # prompt + emitted; the last one is the root, not yet in the cache
    prompt_length: int
    cache: Cache
    hidden: torch.Tensor | None  # [hidden] target state that predicted the root
    generator: torch.Generator | None
    stats: GenerationStats
    finished: bool = False
    finish_reason: str = ""
    noise_seed: int | None = None  # Gumbel sampling: the seed the noise of every position is keyed by
    logprobs: list[TokenLogprob] | None = None  # each emitted token's (``logprobs.py``); None: not asked for
    top_logprobs: int = 0  # alternatives kept per token with ``logprobs``
    stop_token_ids: frozenset[int] = frozenset()  # tokens that end the output (PromptRead: the decoder's EOS ids)
    min_tokens: int = 0  # no stop token may be chosen before this many new tokens (``penalties.without_early_stops``)


@dataclass(frozen=True)
class Decoder:
    """Everything fixed for one engine: models, drafter, policies and the measured costs."""

    target: Backend
    drafter: Drafter
    tree: TreeConfig
    decode: DecodeConfig
    cost: VerifyCost
    eos_token_ids: frozenset[int]
    prefill_target: Backend | None = None  # reads the prompt instead of ``target`` (same cache kind)


PROMPT_CHUNK = 256  # prompt rows per prefill pass


class PromptRead:
    """A prompt being cached in passes of at most ``PROMPT_CHUNK`` rows, so a long one can be read a
    chunk at a time between other requests' steps (``batch.Batch``) and never holds attention scores
    over the whole prompt at once. The chunks' bounds depend on the prompt alone, so plain and
    speculative decoding, alone or batched, start from the same cache. ``state`` is ready for
    decoding steps once ``done``.

    With ``prefixes`` (the engine's ``prefix.PrefixStore``), each pass first copies the kept chunks
    that continue the cached prefix instead of reading them (the same bits: ``prefix``), and each whole
    chunk it reads is kept.

    With ``prompt_logprobs`` (alternatives per token, 0-20), each pass scores every row it reads: row i
    predicts prompt token i + 1, so ``scored`` ends with one ``TokenLogprob`` per prompt token but the first
    (which nothing predicts). Kept chunks are then read again, not copied (a copy has no logits).

    Checks the request first (CausalDraftError): an empty prompt, or one that with max_new_tokens
    overruns the context; ``cache``, when given, must be empty (a batch's pool slot)."""

    def __init__(
        self, decoder: Decoder, prompt: list[int], max_new_tokens: int, generator: torch.Generator | None,
        cache: Cache | None = None, prefixes: PrefixStore | None = None, prompt_logprobs: int | None = None,
    ) -> None:  # fmt: skip
        if not prompt:
            raise CausalDraftError("the prompt is empty")
        limit = decoder.target.shape.max_positions
        if len(prompt) + max_new_tokens > limit:
            raise ContextOverflow(
                f"prompt of {len(prompt)} tokens + max_new_tokens {max_new_tokens} exceeds the model's "
                f"context of {limit} tokens"
            )
        needed = len(prompt) + max_new_tokens + decoder.tree.max_nodes + 1
        if cache is None:
            cache = decoder.target.new_cache(needed)
        elif cache.length or cache.max_len < needed:
            raise CausalDraftError(
                f"prompt of {len(prompt)} tokens + max_new_tokens {max_new_tokens} exceeds the batch's "
                f"context of {cache.max_len} tokens per sequence"
            )
        self.decoder = decoder
        self.state = DecodeState(list(prompt), len(prompt), cache, None, generator, GenerationStats(),
                                 stop_token_ids=decoder.eos_token_ids)  # fmt: skip
        self.features: list[torch.Tensor] = []  # the drafter's features of the rows read so far
        if prefixes is not None and prefixes.chunk != PROMPT_CHUNK:
            raise ValueError(f"a prefix store for prompts keeps chunks of {PROMPT_CHUNK} rows, not {prefixes.chunk}")
        self.prefixes = prefixes if isinstance(cache, KVCache) else None  # rows copied as they are: native caches
        self.top_scored = prompt_logprobs or 0
        self.scored: list[TokenLogprob] | None = None if prompt_logprobs is None else []  # prompt tokens 1..
        self.done = False

    @property
    def rows_left(self) -> int:
        """Prompt tokens still to be cached (all but the last, which is the first step's root)."""
        return self.state.prompt_length - 1 - self.state.cache.length

    def advance(self) -> int:
        """Cache the next chunk (the drafter starts after the last one); returns the rows read."""
        if self.done:
            return 0
        started = time.perf_counter()
        state, decoder = self.state, self.decoder
        # what the rows' bits depend on besides the tokens (the prompt is read on this many threads)
        conditions = (torch.get_num_threads(), *decoder.drafter.feature_layers)
        self.copy_kept_chunks(conditions)
        length, count = state.cache.length, min(PROMPT_CHUNK, self.rows_left)
        if count:
            tokens = torch.tensor(state.tokens[length : length + count], dtype=torch.long)
            mask = torch.ones(count, length + count, dtype=torch.bool)
            mask[:, length:] = mask[:, length:].tril()
            reader = decoder.prefill_target or decoder.target
            scored_rows = None if self.scored is not None else torch.tensor([count - 1])  # None: every row
            out = reader.forward(
                tokens, torch.arange(length, length + count), mask, state.cache, scored_rows,
                decoder.drafter.feature_layers,
            )  # fmt: skip
            state.hidden = out.hidden[-1]
            if self.scored is not None:
                predicted = state.tokens[length + 1 : length + count + 1]
                self.scored.extend(token_logprobs(out.logits, range(count), predicted, self.top_scored))
            if out.aux is not None:
                self.features.append(out.aux)
            whole_chunk = count == PROMPT_CHUNK and not length % PROMPT_CHUNK
            if self.prefixes is not None and isinstance(state.cache, KVCache) and whole_chunk:
                prompt = state.tokens[: state.prompt_length]
                self.prefixes.keep(prompt, length // PROMPT_CHUNK, state.cache, out.aux, conditions)
        if not self.rows_left:
            features = torch.cat(self.features) if self.features else None
            decoder.drafter.start(tuple(state.tokens), features)
            self.features, self.done = [], True
        state.stats.prefill_s += time.perf_counter() - started
        return count

    def copy_kept_chunks(self, conditions: tuple[int, ...]) -> None:
        """Copy the kept chunks that continue the cached prefix (and their features) into the cache."""
        state = self.state
        if self.prefixes is None or not isinstance(state.cache, KVCache) or state.cache.length % PROMPT_CHUNK:
            return
        if self.scored is not None:  # every row's logits are asked for: read them
            return
        found = self.prefixes.find(state.tokens[: state.prompt_length], state.cache.length // PROMPT_CHUNK, conditions)
        if self.decoder.drafter.feature_layers:  # conditions name the feature layers: kept chunks carry them
            found = list(itertools.takewhile(lambda kept: kept.features is not None, found))
            self.features.extend(kept.features for kept in found if kept.features is not None)
        copy_chunks(found, state.cache)
        state.stats.cached_prompt_tokens += sum(kept.rows for kept in found)


def prefill(
    decoder: Decoder, prompt: list[int], max_new_tokens: int, generator: torch.Generator | None,
    cache: Cache | None = None,
) -> DecodeState:  # fmt: skip
    """Cache every prompt token but the last, which becomes the first step's root (in ``cache``,
    empty, when given: a batch's pool slot; else a new one sized for the request)."""
    read = PromptRead(decoder, prompt, max_new_tokens, generator, cache)
    while not read.done:
        read.advance()
    return read.state


def draft_step(decoder: Decoder, state: DecodeState, policy: BudgetPolicy, sampling: SamplingConfig) -> Draft:
    """The drafter's tree, sized by the policy and kept within the positions and rows the target's next
    pass may hold and stay row-invariant (``Backend.pass_room``, ``Backend.pass_rows``: the root is one
    of them)."""
    limits = policy.limits()
    max_depth = decoder.target.pass_room(state.cache.length) - 1
    if limits is None or max_depth < 1:
        return Draft.root_only(state.tokens[-1])
    max_nodes = min(limits.max_nodes, decoder.target.pass_rows())
    context = DraftContext(
        tokens=tuple(state.tokens),
        hidden=state.hidden,
        tree_kind=decoder.tree.kind,
        depth=min(limits.depth, max_depth),
        width=limits.width,
        max_nodes=max_nodes,
        sampling=sampling,
        generator=state.generator,
        noise_seed=state.noise_seed,
        gate=limits.gate,
        lookup_depth=min(limits.lookup_depth, max_depth),
    )
    draft = policy.prune(decoder.drafter.propose(context)).within_depth(max_depth)
    if draft.tree.size <= max_nodes:
        return draft
    if draft.child_mode == "deterministic":
        return draft.pruned(max_nodes)
    raise CausalDraftError(f"the drafter sampled {draft.tree.size} nodes; the step allows {max_nodes}")


@dataclass(frozen=True)
class TreePass:
    """The target pass over a draft tree: new tokens [n], positions [n], mask [n, length + n]."""

    tokens: torch.Tensor
    positions: torch.Tensor
    mask: torch.Tensor


def tree_pass(draft: Draft, length: int) -> TreePass:
    compiled = compile_tree(draft.tree)
    tokens = torch.tensor(draft.tree.tokens, dtype=torch.long)
    return TreePass(tokens, compiled.depths + length, full_mask(compiled, length))


def verify_step(
    decoder: Decoder, state: DecodeState, draft: Draft, sampling: SamplingConfig
) -> tuple[Acceptance, ForwardOutput]:
    """One target pass over the tree; returns the acceptance and the pass's output (hidden
    states [n, hidden], and the drafter's features [n, F] when it reads them)."""
    inputs = tree_pass(draft, state.cache.length)
    out = decoder.target.forward(
        inputs.tokens, inputs.positions, inputs.mask, state.cache, aux_layers=decoder.drafter.feature_layers
    )
    return accept_pass(decoder, state, draft, inputs, out, sampling), out


def accept_pass(
    decoder: Decoder, state: DecodeState, draft: Draft, inputs: TreePass, out: ForwardOutput,
    sampling: SamplingConfig,
) -> Acceptance:  # fmt: skip
    """The accepted path of a verified tree, by the engine's acceptance rule (each node penalized along its own
    path first, when the request has penalties, and kept from stopping before ``min_tokens``)."""
    early_stops = state.min_tokens > state.stats.new_tokens
    noise = None  # Gumbel-seeded sampling: the noise of each node's next token, keyed by where that token goes
    if not sampling.greedy and state.noise_seed is not None and decoder.decode.acceptance == "lossless":
        positions = (inputs.positions + 1).tolist()
        noise = gumbel_noise_rows(state.noise_seed, positions, decoder.target.shape.vocab_size)  # [n, vocab]
    if not sampling.penalized and not early_stops and state.logprobs is None:  # the logits may go unread
        if sampling.greedy:
            return verify_greedy(draft.tree, out.scores.first_maxima())
        if noise is not None:
            return verify_greedy(draft.tree, out.scores.gumbel_maxima(noise, sampling))
    logits = out.logits  # [n, vocab]
    if sampling.penalized:
        logits = penalized_logits(logits, draft.tree, state.tokens, state.prompt_length, sampling)
    if early_stops:
        logits = without_early_stops(logits, draft.tree, state.stats.new_tokens, state.min_tokens, state.stop_token_ids)
    if sampling.greedy:
        return verify_greedy(draft.tree, row_argmax(logits))
    if noise is not None:
        return verify_greedy(draft.tree, row_argmax(gumbel_scores(logits, noise, sampling)))
    target_probs = warp_probs(logits, sampling)
    if decoder.decode.acceptance == "naive":
        return verify_naive(draft.tree, target_probs, state.generator)
    return verify_sampled(draft.tree, target_probs, draft.draft_probs, draft.child_mode, state.generator)


def commit_step(
    state: DecodeState, prefix_length: int, acceptance: Acceptance, out: ForwardOutput
) -> torch.Tensor | None:
    """Keep the KV entries of the accepted path (root included); the final token is the next root.

    out.hidden: [n, hidden] from the verify pass; the accepted path's last node predicted that
    token. Returns the accepted path's features [len(path), F] (None without features).
    """
    state.cache.commit([prefix_length + node for node in acceptance.path], prefix_length)
    state.hidden = out.hidden[acceptance.path[-1]]
    return None if out.aux is None else out.aux[list(acceptance.path)]


def decode_steps(
    decoder: Decoder,
    state: DecodeState,
    policy: BudgetPolicy,
    sampling: SamplingConfig,
    max_new_tokens: int,
    threads: ThreadPolicy | None = None,
) -> Iterator[list[int]]:
    """Yield each step's emitted tokens, cut at EOS and max_new_tokens (EOS itself is emitted):
    draft -> verify -> commit -> accept -> observe. ``threads``: picks each step's thread count
    from its verify time (None: torch's count is left alone)."""
    while not state.finished:
        with step_on(threads):
            started = time.perf_counter()
            draft = draft_step(decoder, state, policy, sampling)
            drafted_at = time.perf_counter()
            prefix_length = state.cache.length
            acceptance, out = verify_step(decoder, state, draft, sampling)
            timing = StepTiming(drafted_at - started, time.perf_counter() - drafted_at)
            emitted = finish_step(decoder, state, policy, draft, prefix_length, acceptance, out, max_new_tokens,
                                  timing)  # fmt: skip
        if threads is not None:
            threads.observe_pass(draft.tree.size, timing.verify_s)
        if emitted:
            yield emitted


@dataclass(frozen=True)
class StepTiming:
    draft_s: float
    verify_s: float  # this sequence's share of the verify pass


def finish_step(
    decoder: Decoder, state: DecodeState, policy: BudgetPolicy, draft: Draft, prefix_length: int,
    acceptance: Acceptance, out: ForwardOutput, max_new_tokens: int, timing: StepTiming,
) -> list[int]:  # fmt: skip
    """After the verify pass: commit -> accept -> observe. Returns the emitted tokens."""
    features = commit_step(state, prefix_length, acceptance, out)
    emitted = accept_tokens(decoder, state, list(acceptance.tokens), max_new_tokens)
    if state.logprobs is not None:  # emitted token i was chosen at row path[i] (logprobs.py)
        state.logprobs.extend(token_logprobs(out.logits, acceptance.path[: len(emitted)], emitted, state.top_logprobs))
    decoder.drafter.observe(StepResult(draft, acceptance, tuple(state.tokens), features))
    accepted = len(acceptance.path) - 1
    # a step is speculative when it verified a draft beyond the root (plain decoding's steps never are)
    step = StepStats(draft.tree.size, accepted, timing.draft_s, timing.verify_s,
                     policy.state.speculating and draft.tree.size > 1)  # fmt: skip
    state.stats.record(step, max(draft.tree.depths))
    policy.observe(draft, accepted, step.draft_s, step.verify_s)
    return emitted


def accept_tokens(decoder: Decoder, state: DecodeState, tokens: list[int], max_new_tokens: int) -> list[int]:
    emitted = []
    for token in tokens:
        state.tokens.append(token)
        emitted.append(token)
        state.stats.new_tokens += 1
        if token in state.stop_token_ids:
            state.finished, state.finish_reason = True, "stop"
            break
        if state.stats.new_tokens >= max_new_tokens:
            state.finished, state.finish_reason = True, "length"
            break
    return emitted
