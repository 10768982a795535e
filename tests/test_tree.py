import torch

from causaldraft.tree import Tree, TreeDraft, build_tree, compile_tree, full_mask, gate_scores, merge_paths, prune


def test_worked_example_mask_positions_and_paths() -> None:
    # DESIGN.md: 0:"the"(-1), 1:"cat"(0), 2:"dog"(0), 3:"sat"(1)
    tree = Tree(parents=(-1, 0, 0, 1), tokens=(10, 11, 12, 13))
    compiled = compile_tree(tree)
    assert compiled.mask.int().tolist() == [
        [1, 0, 0, 0],
        [1, 1, 0, 0],
        [1, 0, 1, 0],
        [1, 1, 0, 1],
    ]
    assert compiled.depths.tolist() == [0, 1, 1, 2]
    assert (compiled.depths + 7).tolist() == [7, 8, 8, 9]
    assert compiled.paths == ((0, 2), (0, 1, 3))  # leaves in index order
    mask = full_mask(compiled, prefix_length=2)
    assert mask.shape == (4, 6)
    assert mask[:, :2].all() and mask[3, 2:].int().tolist() == [1, 1, 0, 1]


def test_chain_is_a_causal_tree() -> None:
    compiled = compile_tree(Tree.chain([5, 6, 7]))
    assert torch.equal(compiled.mask, torch.ones(3, 3, dtype=torch.bool).tril())
    assert compiled.paths == ((0, 1, 2),)


def test_tree_rejects_parents_after_children() -> None:
    try:
        Tree(parents=(-1, 2, 0), tokens=(1, 2, 3))
    except ValueError:
        return
    raise AssertionError("a child before its parent must be rejected")


def fixed_expander(tree: Tree, nodes: list[int]) -> list[list[tuple[int, float]]]:
    # Each node proposes tokens (10 * depth + rank) with probabilities 0.6, 0.3, 0.1.
    result = []
    for node in nodes:
        depth, walk = 0, node
        while tree.parents[walk] >= 0:
            walk, depth = tree.parents[walk], depth + 1
        result.append([(10 * (depth + 1) + rank, prob) for rank, prob in enumerate((0.6, 0.3, 0.1))])
    return result


def test_build_chain_static_and_dynamic() -> None:
    chain = build_tree("chain", 1, fixed_expander, depth=3, width=3, max_nodes=32)
    assert chain.tokens == [1, 10, 20, 30] and chain.parents == [-1, 0, 1, 2]
    static = build_tree("static", 1, fixed_expander, depth=3, width=3, max_nodes=32)
    assert static.parents.count(0) == 3  # width 3 at depth 1, then 2 children each, then 1
    assert len(static.tokens) == 1 + 3 + 6 + 6
    dynamic = build_tree("dynamic", 1, fixed_expander, depth=3, width=2, max_nodes=5)
    # scores: depth 1 0.6, 0.3; depth 2 0.36, 0.18 | 0.18, 0.09; depth 3 0.216, ... -> best 4 kept
    assert dynamic.tokens == [1, 10, 11, 20, 30]
    assert dynamic.parents == [-1, 0, 0, 1, 3]
    assert [round(s, 3) for s in dynamic.scores] == [1.0, 0.6, 0.3, 0.36, 0.216]


def test_prune_keeps_ancestors_of_kept_nodes() -> None:
    draft = TreeDraft(parents=[-1, 0, 1, 0], tokens=[0, 1, 2, 3], scores=[1.0, 0.2, 0.9, 0.5])
    pruned = prune(draft, 3)
    assert pruned.tokens == [0, 1, 2]  # node 2 (0.9) needs its parent 1 (0.2)
    assert pruned.parents == [-1, 0, 1]


def test_merge_paths_shares_prefixes() -> None:
    draft = TreeDraft(parents=[-1, 0], tokens=[0, 5], scores=[1.0, 0.5])
    merge_paths(draft, [(5, 6), (7,)], score=0.8, max_nodes=10)
    assert draft.tokens == [0, 5, 6, 7]
    assert draft.parents == [-1, 0, 1, 0]
    assert draft.scores[1] == 0.8


def test_tree_depths_are_computed_once_with_the_tree() -> None:
    tree = Tree((-1, 0, 0, 1, 3), (5, 6, 7, 8, 9))
    assert tree.depths == (0, 1, 1, 2, 3)
    assert compile_tree(tree).depths.tolist() == list(tree.depths)


def test_a_gate_ends_the_tree_before_a_level_and_sees_merged_scores() -> None:
    calls: list[tuple[list[float], list[float], int]] = []

    def two_levels(scores: list[float], frontier: list[float], level: int) -> bool:
        calls.append((scores, frontier, level))
        return level < 2

    draft = build_tree("dynamic", 1, fixed_expander, depth=4, width=2, max_nodes=32, gate=two_levels,
                       merged={(999,): 0.7})  # fmt: skip
    assert max(Tree(tuple(draft.parents), tuple(draft.tokens)).depths) == 2
    assert [level for _, _, level in calls] == [0, 1, 2]
    assert calls[0] == ([0.7], [1.0], 0)  # before level 0: only the merged candidates, the root's score
    assert calls[2][0][0] == 0.7 and len(calls[2][0]) == len(draft.tokens)  # merged + every drafted node


def test_the_gate_counts_a_merged_candidate_the_tree_holds_once() -> None:
    draft = TreeDraft(parents=[-1], tokens=[1], scores=[1.0])
    draft.add(draft.add(0, 7, 0.6), 8, 0.5)  # root -> 7 (0.6) -> 8 (0.3)
    assert gate_scores(draft, {(7,): 0.5, (9,): 0.4}) == [0.6, 0.4, 0.3]
    assert gate_scores(draft, {(7,): 0.9, (7, 8): 0.2}) == [0.9, 0.3]
    assert gate_scores(draft, {}) == [0.6, 0.3]
