"""Repetition, frequency and presence penalties, applied to every node of a verify pass along its own path, and the
logit bias, the same for every node.

A penalty makes the next token's distribution depend on the tokens before it, so in a tree each node is penalized
for its own context: the prompt and the output so far, then the draft tokens from the root's child down to the node
itself (its logits choose the token after it). Verification then judges every node against its penalized logits,
so speculative output is the penalized plain decoding's, token for token when greedy or Gumbel-sampled, in law when
rejection-sampled.

As vLLM applies them (``SamplingParams``): the repetition penalty divides a positive logit by r and multiplies a
negative one by r, for every token seen in the prompt or the output (CTRL's rule, also transformers'); the
frequency and presence penalties subtract f x count and p x (count > 0) for the tokens in the output only (OpenAI's
definition). The logit bias is added first, then the repetition penalty, then the others (vLLM's order). Each
node's row is computed from integer counts by element-wise operations alone, so it is the bits plain decoding
computes at that position.

Worked example: output so far (a, b, a), tree root r (the last output token, node 0) with children x (node 1) and
y (node 2), and z under x (node 3). Counts per node: node 0 {a: 2, b: 1}, node 1 {a: 2, b: 1, x: 1}, node 2
{a: 2, b: 1, y: 1}, node 3 {a: 2, b: 1, x: 1, z: 1}.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from causaldraft.config import SamplingConfig
from causaldraft.tree import Tree


def penalized_logits(
    logits: torch.Tensor,  # [n, vocab]: row i predicts the token after node i
    tree: Tree,
    tokens: Sequence[int],  # the prompt and the output so far; the last one is the tree's root
    prompt_length: int,
    sampling: SamplingConfig,
) -> torch.Tensor:
    """``logits`` with the bias and each node's penalties applied, float32 [n, vocab]. Only the columns of tokens
    in some node's context can change, so the penalties are computed over those alone (a few hundred, not the
    vocabulary: ~0.1 ms a pass instead of ~1-7)."""
    scores = logits.float().clone()  # [n, vocab]
    if sampling.logit_bias:
        ids, biases = zip(*sampling.logit_bias, strict=True)
        scores[:, list(ids)] += torch.tensor(biases)  # [n, len(ids)] + [len(ids)]
    if not (sampling.presence_penalty or sampling.frequency_penalty or sampling.repetition_penalty != 1.0):
        return scores
    context = torch.tensor(tokens, dtype=torch.long)  # [T]
    drafted = torch.tensor(tree.tokens[1:], dtype=torch.long)  # [n - 1]: node i's token at i - 1
    columns = torch.unique(torch.cat([context, drafted]))  # [m] sorted: every token some node has seen
    width = columns.numel()
    output = torch.searchsorted(columns, context[prompt_length:])
    counts = torch.bincount(output, minlength=width).float().expand(tree.size, width).clone()  # [n, m]
    seen = torch.zeros(width, dtype=torch.bool)
    seen[torch.searchsorted(columns, context)] = True
    seen = seen.expand(tree.size, width).clone()  # [n, m]
    drafted_columns = torch.searchsorted(columns, drafted).tolist()
    rows, cols = [], []
    for node in range(1, tree.size):
        ancestor = node
        while ancestor > 0:  # the draft tokens on the node's path, itself included (the root is in ``tokens``)
            rows.append(node)
            cols.append(drafted_columns[ancestor - 1])
            ancestor = tree.parents[ancestor]
    if rows:
        where = (torch.tensor(rows), torch.tensor(cols))
        counts.index_put_(where, torch.ones(len(rows)), accumulate=True)
        seen[where] = True
    values = scores[:, columns]  # [n, m]
    if sampling.repetition_penalty != 1.0:
        penalty = sampling.repetition_penalty
        values = torch.where(seen, torch.where(values > 0, values / penalty, values * penalty), values)
    if sampling.frequency_penalty:
        values = values - sampling.frequency_penalty * counts
    if sampling.presence_penalty:
        values = values - sampling.presence_penalty * (counts > 0).float()
    scores[:, columns] = values
    return scores


def without_early_stops(
    logits: torch.Tensor,  # [n, vocab]: row i chooses new token number ``emitted + depth(i)``
    tree: Tree,
    emitted: int,  # new tokens so far
    min_tokens: int,
    stop_token_ids: frozenset[int],
) -> torch.Tensor:
    """``logits`` with the stop tokens made impossible (-inf) in the rows that choose a new token before the
    ``min_tokens``-th, as plain decoding does at those positions (vLLM's ``min_tokens``). Example: 3 tokens emitted,
    min_tokens 5: the root (depth 0) and its children (depth 1) choose tokens 4 and 5, so their rows lose the stop
    tokens; grandchildren choose token 6 and keep them."""
    early = [node for node, depth in enumerate(tree.depths) if emitted + depth < min_tokens]
    if not early or not stop_token_ids:
        return logits
    scores = logits.clone()
    scores[torch.tensor(early)[:, None], torch.tensor(sorted(stop_token_ids))[None, :]] = float("-inf")
    return scores
