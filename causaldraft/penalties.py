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
    """``logits`` with each node's penalties applied, float32 [n, vocab]."""
    vocab = logits.shape[-1]
    counts = torch.zeros(tree.size, vocab)  # [n, vocab]: each node's output counts
    seen = torch.zeros(tree.size, vocab, dtype=torch.bool)  # [n, vocab]: tokens of each node's whole context
    output = torch.tensor(tokens[prompt_length:], dtype=torch.long)
    counts[:] = torch.bincount(output, minlength=vocab)[:vocab].float()
    seen[:, torch.tensor(tokens, dtype=torch.long)] = True
    for node in range(1, tree.size):
        ancestor = node
        while ancestor > 0:  # the draft tokens on the node's path, itself included (the root is in ``tokens``)
            counts[node, tree.tokens[ancestor]] += 1
            seen[node, tree.tokens[ancestor]] = True
            ancestor = tree.parents[ancestor]
    scores = logits.float()
    if sampling.logit_bias:
        ids, biases = zip(*sampling.logit_bias, strict=True)
        scores = scores.clone()
        scores[:, list(ids)] += torch.tensor(biases)  # [n, len(ids)] + [len(ids)]
    if sampling.repetition_penalty != 1.0:
        penalty = sampling.repetition_penalty
        scores = torch.where(seen, torch.where(scores > 0, scores / penalty, scores * penalty), scores)
    if sampling.frequency_penalty:
        scores = scores - sampling.frequency_penalty * counts
    if sampling.presence_penalty:
        scores = scores - sampling.presence_penalty * (counts > 0).float()
    return scores
