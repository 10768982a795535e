"""A draft model with the target's vocabulary: a separate small model, or the self-draft built
from the target's own first layers (early exit, sharing the target's weights).

The drafter owns its KV cache. Each proposal first catches up on the tokens the draft cache lacks
(the context through the root), then grows the tree: every expansion runs one draft forward over
the frontier nodes with their tree mask, so each guess is conditioned on its own path.
Afterwards the draft cache is rolled back to the context.
"""

from __future__ import annotations

import torch

from causaldraft.config import SamplingConfig
from causaldraft.drafters.base import Draft, DraftContext, StepResult
from causaldraft.drafters.ranking import noise_scores
from causaldraft.errors import CausalDraftError
from causaldraft.models.base import Backend, Cache
from causaldraft.sampling import gumbel_noise, warp_probs
from causaldraft.tree import Candidates, Tree, build_tree


class DraftModelDrafter:
    feature_layers: tuple[int, ...] = ()

    def __init__(self, model: Backend, name: str = "draft", max_len: int = 8192, vocab_size: int | None = None) -> None:
        """``vocab_size``: the target's, where the draft model's output rows differ in number (same
        tokenizer, embeddings padded to another size): its logits are cut or padded to it."""
        self.model = model
        self.name = name
        self.max_len = max_len
        self.vocab_size = vocab_size
        self.cache: Cache = model.new_cache(max_len)
        self.context: tuple[int, ...] = ()  # tokens whose entries are in the draft cache

    def fork(self) -> DraftModelDrafter:
        return DraftModelDrafter(self.model, self.name, self.max_len, self.vocab_size)

    def start(self, prompt: tuple[int, ...], features: torch.Tensor | None = None) -> None:
        self.cache.rollback(0)
        self.context = ()

    def catch_up(self, tokens: tuple[int, ...]) -> torch.Tensor:
        """Feed the tokens the draft cache lacks; return the root's next-token logits [vocab]."""
        common = 0
        limit = min(len(self.context), len(tokens) - 1)
        while common < limit and self.context[common] == tokens[common]:
            common += 1
        self.cache.rollback(common)
        new = torch.tensor(tokens[common:], dtype=torch.long)
        n = new.shape[0]
        mask = torch.ones(n, common + n, dtype=torch.bool).tril(common)
        positions = torch.arange(common, common + n)
        out = self.model.forward(new, positions, mask, self.cache, torch.tensor([n - 1]))
        self.context = tokens
        return fit_vocabulary(out.logits, self.vocab_size)[0]

    def propose(self, context: DraftContext) -> Draft:
        tokens = context.tokens
        root_logits = self.catch_up(tokens)
        # Gumbel sampling ranks children by the target's own noise (deterministic children);
        # rejection sampling draws them from the draft distribution
        sampled = not context.sampling.greedy and context.noise_seed is None
        base = len(tokens)  # draft cache slot of tree node j (j >= 1) is base + slot_of[j]
        probs_of: dict[int, torch.Tensor] = {0: draft_distribution(root_logits, context.sampling)}
        slot_of: dict[int, int] = {0: base - 1}
        depth_of: dict[int, int] = {0: 0}

        def expand(tree: Tree, nodes: list[int]) -> list[Candidates]:
            pending = [node for node in nodes if node not in probs_of]
            if pending:
                self.feed(tree, pending, slot_of, probs_of, base, context.sampling)
            for node in nodes:
                if node not in depth_of:
                    depth_of[node] = depth_of[tree.parents[node]] + 1
            return [self.candidates(probs_of[node], context, sampled, base + depth_of[node]) for node in nodes]

        draft = build_tree(context.tree_kind, tokens[-1], expand, context.depth, context.width, context.max_nodes,
                           context.gate)  # fmt: skip
        self.cache.rollback(base)
        if not sampled:
            return Draft.from_tree_draft(draft)
        vocab = probs_of[0].shape[0]
        rows = [probs_of.get(node, torch.zeros(vocab)) for node in range(len(draft.tokens))]
        return Draft(draft.freeze(), tuple(draft.scores), "sampled", torch.stack(rows))

    def feed(
        self,
        tree: Tree,
        nodes: list[int],
        slot_of: dict[int, int],
        probs_of: dict[int, torch.Tensor],
        base: int,
        sampling: SamplingConfig,
    ) -> None:
        """One draft forward over tree nodes; each attends to the context and its ancestors."""
        start = self.cache.length
        total = start + len(nodes)
        mask = torch.zeros(len(nodes), total, dtype=torch.bool)  # [m, total]
        mask[:, :base] = True
        depths = []
        for row, node in enumerate(nodes):
            slot_of[node] = start + row
            ancestor, depth = node, 0
            while ancestor > 0:
                mask[row, slot_of[ancestor]] = True
                ancestor = tree.parents[ancestor]
                depth += 1
            depths.append(depth)
        tokens = torch.tensor([tree.tokens[node] for node in nodes], dtype=torch.long)
        positions = torch.tensor(depths, dtype=torch.long) + (base - 1)
        out = self.model.forward(tokens, positions, mask, self.cache)
        probs = draft_distribution(fit_vocabulary(out.logits, self.vocab_size), sampling)  # [m, vocab]
        for row, node in enumerate(nodes):
            probs_of[node] = probs[row]

    @staticmethod
    def candidates(probs: torch.Tensor, context: DraftContext, sampled: bool, position: int) -> Candidates:
        """A node's children; ``position``: theirs (absolute), for the Gumbel noise."""
        count = 1 if context.tree_kind == "chain" else context.width
        if sampled:
            drawn = torch.multinomial(probs, count, replacement=True, generator=context.generator)
            return [(int(token), float(probs[token])) for token in drawn]
        if context.noise_seed is not None:
            perturbed = torch.log(probs) + gumbel_noise(context.noise_seed, position, probs.shape[0])
            chosen = torch.topk(perturbed, count).indices
            scores = noise_scores(perturbed)
            return [(int(token), float(scores[token])) for token in chosen]
        top = torch.topk(probs, count)
        return [(int(token), float(prob)) for prob, token in zip(top.values, top.indices, strict=True)]

    def observe(self, result: StepResult) -> None:
        return None


def fit_vocabulary(logits: torch.Tensor, size: int | None) -> torch.Tensor:
    """[m, V_draft] -> [m, size]: rows past the tokenizer's ids cut, missing ones at -inf (never drafted)."""
    if size is None or logits.shape[-1] == size:
        return logits
    if logits.shape[-1] > size:
        return logits[:, :size]
    return torch.nn.functional.pad(logits, (0, size - logits.shape[-1]), value=float("-inf"))


def draft_distribution(logits: torch.Tensor, sampling: SamplingConfig) -> torch.Tensor:
    """The distribution drafts are ranked or drawn from: warped like the target's when sampling;
    the plain softmax when greedy (the one-hot argmax would leave nothing to rank siblings by)."""
    if sampling.greedy:
        return torch.softmax(logits.float(), dim=-1)
    return warp_probs(logits, sampling)


def check_same_vocabulary(target_vocab: dict[str, int], draft_vocab: dict[str, int]) -> None:
    """The draft must tokenize exactly like the target; otherwise its guesses mean nothing."""
    if target_vocab != draft_vocab:
        only_target = len(set(target_vocab.items()) - set(draft_vocab.items()))
        raise CausalDraftError(
            f"draft model vocabulary differs from the target's ({len(draft_vocab)} vs "
            f"{len(target_vocab)} tokens, {only_target} target entries differ): "
            "a draft model must share the target's tokenizer"
        )
