"""``causaldraft show-tree``: one decoding step's draft tree and its attention mask, for debugging
causality (each row may see only the prefix, itself and its ancestors)."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

import torch

from causaldraft.adapt import BudgetPolicy
from causaldraft.decode import draft_step, prefill
from causaldraft.errors import CausalDraftError
from causaldraft.tree import Tree, compile_tree


def render_tree(tree: Tree, scores: tuple[float, ...], decode: Callable[[list[int]], str]) -> str:
    """Indented tree: one node per line with index, token, text and draft score."""
    lines: list[str] = []

    def visit(node: int, depth: int) -> None:
        lines.append(f"{'  ' * depth}[{node}] {tree.tokens[node]:>6} {decode([tree.tokens[node]])!r} "
                     f"score={scores[node]:.3f}")  # fmt: skip
        for child in tree.children(node):
            visit(child, depth + 1)

    visit(0, 0)
    return "\n".join(lines)


def render_mask(mask: torch.Tensor) -> str:
    """The tree part of the mask [n, n] as rows of '#' (may attend) and '.'."""
    header = "     " + "".join(str(col % 10) for col in range(mask.shape[1]))
    rows = [f"{row:>4} " + "".join("#" if allowed else "." for allowed in mask[row].tolist())
            for row in range(mask.shape[0])]  # fmt: skip
    return "\n".join([header, *rows])


def save_mask_png(mask: torch.Tensor, tokens: list[str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    size = max(4.0, 0.35 * mask.shape[0])
    figure, axes = plt.subplots(figsize=(size, size))
    axes.imshow(mask.int().numpy(), cmap="Greys", vmin=0, vmax=1)
    axes.set_xticks(range(len(tokens)), tokens, rotation=90, fontsize=7)
    axes.set_yticks(range(len(tokens)), tokens, fontsize=7)
    axes.set_title("draft tree attention mask (black = may attend; prefix columns omitted)")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def show_tree(args: argparse.Namespace) -> None:
    from causaldraft.api import load
    from causaldraft.config import SamplingConfig
    from causaldraft.flags import engine_config

    png = Path(args.png) if args.png else None
    if png is not None and not png.parent.is_dir():  # checked before the model loads
        raise CausalDraftError(f"--png {png}: the folder {png.parent} does not exist")
    engine = load(engine_config(args))
    prompt_ids = engine.encode(args.prompt, chat=args.chat)
    state = prefill(engine.decoder, prompt_ids, 1, None)
    policy = BudgetPolicy(engine.decoder.tree, engine.decoder.decode, engine.decoder.cost, engine.adapt)
    draft = draft_step(engine.decoder, state, policy, SamplingConfig())
    compiled = compile_tree(draft.tree)
    decode = engine.tokenizer.decode
    prefix = state.cache.length
    print(f"prefix length P = {prefix}; {draft.tree.size} nodes; positions = P + depth = "
          f"{(compiled.depths + prefix).tolist()}")  # fmt: skip
    print(render_tree(draft.tree, draft.scores, decode))
    print("\nattention mask over the tree (every row also sees all P prefix columns):")
    print(render_mask(compiled.mask))
    print("\nroot-to-leaf paths:", [list(path) for path in compiled.paths])
    if png is not None:
        labels = [ascii(decode([token]))[1:-1] for token in draft.tree.tokens]
        save_mask_png(compiled.mask, labels, png)
        print(f"saved {args.png}")
