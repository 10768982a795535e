"""Bit-exact passes: every row of a verify pass computes exactly what a one-row pass at its
position computes, layer by layer, in bf16, int8 and int4, eager and compiled; so greedy
speculative output is the same engine's plain decoding token for token in those dtypes, for every
drafter and tree kind (docs/exactness.md)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from causaldraft.api import load
from causaldraft.cache import KVCache
from causaldraft.models import attention_kernel, bf16_choice, int4_kernel
from causaldraft.models.blocked import KEY_BLOCK, blocked_keys, pass_room
from causaldraft.models.compiled import GraphKey, GraphStore, compile_model, kernel_products, use_chosen_bf16_products
from causaldraft.models.loading import LoadedModel, load_model
from causaldraft.models.native import NativeLlama, default_aux_layers
from causaldraft.models.products import (
    at_least_rows,
    fp32_products_row_invariant,
    native_bf16_products,
    product_dtype,
    product_rows,
)
from tests.test_eagle3 import AUX, layer_dir
from tests.test_heads import random_heads_dir
from tests.tiny import save_tiny_llama

LOW_PRECISION = ["bfloat16", "int8", "int4"]
# prefix lengths: no head block, a pass that ends right at a block's end, one and two head blocks
PREFIXES = [30, KEY_BLOCK - 4, KEY_BLOCK + 5, 2 * KEY_BLOCK + 2]
PROMPTS = ["hello hello hello world", "the cat sat on the mat and the cat", "abcabcabc"]


def backend_of(loaded: LoadedModel) -> NativeLlama:
    assert isinstance(loaded.backend, NativeLlama)
    return loaded.backend


def prefilled(backend: NativeLlama, prompt: list[int]) -> KVCache:
    cache = backend.new_cache(256)
    n = len(prompt)
    backend.forward(torch.tensor(prompt), torch.arange(n), torch.ones(n, n, dtype=torch.bool).tril(), cache)
    return cache


def decoy_tree(chain: list[int], length: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The chain's tokens as nodes 0, 2, 4, ... of a tree whose odd nodes are decoy siblings, so
    every chain row sees its ancestors with gaps between them: tokens, positions, mask."""
    tokens, positions, parents = [], [], []
    for depth, token in enumerate(chain):
        parent = 2 * (depth - 1) if depth else -1
        tokens += [token, (token + 7) % 250 + 3]
        positions += [length + depth, length + depth]
        parents += [parent, parent]
    n = len(tokens)
    mask = torch.zeros(n, length + n, dtype=torch.bool)
    mask[:, :length] = True
    for node in range(n):
        ancestor = node
        while ancestor >= 0:
            mask[node, length + ancestor] = True
            ancestor = parents[ancestor]
    return torch.tensor(tokens), torch.tensor(positions), mask


def assert_rows_match_one_row_passes(backend: NativeLlama, prefix: int, layers: tuple[int, ...]) -> None:
    """Plain decoding of a chain one row at a time against one tree pass holding that chain among
    decoys: every chain row's inputs of ``layers``, final hidden state and logits, bit for bit."""
    generator = torch.Generator().manual_seed(prefix)
    prompt = torch.randint(3, 259, (prefix,), generator=generator).tolist()
    depth = min(6, pass_room(prefix))
    chain = torch.randint(3, 259, (depth,), generator=generator).tolist()
    cache = prefilled(backend, prompt)
    plain = []
    for index, token in enumerate(chain):
        mask = torch.ones(1, cache.length + 1, dtype=torch.bool)
        plain.append(backend.forward(torch.tensor([token]), torch.tensor([prefix + index]), mask, cache,
                                     aux_layers=layers))  # fmt: skip
    tokens, positions, mask = decoy_tree(chain, prefix)
    tree = backend.forward(tokens, positions, mask, prefilled(backend, prompt), aux_layers=layers)
    assert tree.aux is not None
    hidden = backend.llama_shape.hidden_size
    for index, one_row in enumerate(plain):
        row = 2 * index
        assert one_row.aux is not None
        for position, layer in enumerate(layers):
            columns = slice(position * hidden, (position + 1) * hidden)
            assert torch.equal(tree.aux[row, columns], one_row.aux[0, columns]), (prefix, index, layer)
        assert torch.equal(tree.hidden[row], one_row.hidden[0]), (prefix, index)
        assert torch.equal(tree.logits[row], one_row.logits[0]), (prefix, index)


@pytest.mark.parametrize("dtype", LOW_PRECISION)
@pytest.mark.parametrize("prefix", PREFIXES)
def test_eager_tree_rows_equal_one_row_passes_layer_by_layer(
    models: dict[str, LoadedModel], dtype: str, prefix: int
) -> None:
    backend = backend_of(models[dtype])
    layers = tuple(range(backend.llama_shape.num_layers + 1))  # every layer's input, and the last output
    assert_rows_match_one_row_passes(backend, prefix, layers)


@pytest.fixture(scope="module")
def wide_heads(tmp_path_factory: pytest.TempPathFactory) -> dict[str, LoadedModel]:
    """The tiny Llama with heads of 64 (3 query heads per kv head, as the default model): the head size whose
    bf16 caches the AMX build of the attention kernel takes through tiles (docs/exactness.md)."""
    directory = save_tiny_llama(tmp_path_factory.mktemp("tiny-llama-64"), hidden_size=192, num_attention_heads=3,
                                num_key_value_heads=1)  # fmt: skip
    return {dtype: load_model(str(directory), "native", dtype) for dtype in ("bfloat16", "int4")}


@pytest.mark.parametrize("dtype", ["bfloat16", "int4"])
@pytest.mark.parametrize("prefix", [*PREFIXES, KEY_BLOCK + 31, 2 * KEY_BLOCK + 33])
def test_tree_rows_equal_one_row_passes_with_heads_of_64(
    wide_heads: dict[str, LoadedModel], dtype: str, prefix: int
) -> None:
    backend = backend_of(wide_heads[dtype])
    assert backend.llama_shape.head_dim == 64
    layers = tuple(range(backend.llama_shape.num_layers + 1))
    assert_rows_match_one_row_passes(backend, prefix, layers)


@pytest.mark.parametrize("drafter", ["lookup", "eagle3"])
def test_greedy_speculative_output_is_plain_decoding_with_heads_of_64(
    wide_heads: dict[str, LoadedModel], tmp_path: Path, drafter: str
) -> None:
    assert_speculation_is_plain_decoding(wide_heads["bfloat16"], tmp_path, drafter, "dynamic", max_new_tokens=80)


@pytest.fixture(scope="module")
def qwen3(tiny_qwen3_dir: Path) -> dict[str, LoadedModel]:
    """The tiny Qwen3 (query and key norms per head, heads of 32 over a hidden size of 64)."""
    return {dtype: load_model(str(tiny_qwen3_dir), "native", dtype) for dtype in ("bfloat16", "int4")}


@pytest.mark.parametrize("dtype", ["bfloat16", "int4"])
def test_tree_rows_equal_one_row_passes_with_query_and_key_norms(qwen3: dict[str, LoadedModel], dtype: str) -> None:
    backend = backend_of(qwen3[dtype])
    assert backend.llama_shape.qk_norm
    layers = tuple(range(backend.llama_shape.num_layers + 1))
    for prefix in PREFIXES[:2]:
        assert_rows_match_one_row_passes(backend, prefix, layers)


@pytest.mark.parametrize(("dtype", "drafter"), [("bfloat16", "eagle3"), ("int4", "lookup")])
def test_greedy_speculative_output_is_plain_decoding_with_query_and_key_norms(
    qwen3: dict[str, LoadedModel], tmp_path: Path, dtype: str, drafter: str
) -> None:
    if dtype == "int4" and torch.backends.mkldnn.is_available():  # prompts read by the twin, with the same norms
        assert qwen3[dtype].prefill is not None
    assert_speculation_is_plain_decoding(qwen3[dtype], tmp_path, drafter, "dynamic", max_new_tokens=80)


@pytest.mark.parametrize("dtype", LOW_PRECISION)
def test_eager_tree_rows_equal_one_row_passes_in_torch_ops(
    models: dict[str, LoadedModel], dtype: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where the attention kernel is not built, the blocked layout's torch ops keep rows invariant too
    (the kernel serves every cache where it is built, so this path is not reached otherwise)."""
    monkeypatch.setattr(attention_kernel, "available", lambda: False)
    backend = backend_of(models[dtype])
    layers = tuple(range(backend.llama_shape.num_layers + 1))
    for prefix in PREFIXES:
        assert_rows_match_one_row_passes(backend, prefix, layers)


@pytest.mark.parametrize("dtype", [*LOW_PRECISION, "bfloat16-onednn", "bfloat16-chosen"])
def test_compiled_tree_rows_equal_one_row_passes(
    tiny_llama_dir: Path, graph_root: Path, dtype: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The one-row pass and the tree pass run different compiled graphs (buckets). bf16 layers run through
    causaldraft's bf16 kernel where it is built (a one-row graph), else through oneDNN with their weights
    frozen into the graphs (no one-row graph): "bfloat16-onednn" turns the kernels off to cover that, and
    "bfloat16-chosen" has the kernel but chooses oneDNN (its linears swapped for plain ones, models/bf16_choice.py)."""
    if dtype == "bfloat16-onednn":
        monkeypatch.setenv(int4_kernel.SWITCH, "torch")
    if dtype == "bfloat16-chosen":
        if not (native_bf16_products() and int4_kernel.bf16_available()):
            pytest.skip("needs oneDNN's bf16 products and causaldraft's bf16 kernel")
        monkeypatch.setenv(bf16_choice.SWITCH, bf16_choice.ONEDNN)
    loaded = load_model(str(tiny_llama_dir), "native", dtype.partition("-")[0])
    backend = backend_of(loaded)
    layers = default_aux_layers(backend.llama_shape.num_layers)
    use_chosen_bf16_products(backend)
    buckets = (1, 16) if kernel_products(backend) else (2, 16)
    compile_model(backend, buckets=buckets, store=GraphStore(GraphKey.of(backend, layers), graph_root), progress=False)
    for prefix in PREFIXES:
        assert_rows_match_one_row_passes(backend, prefix, layers)


def test_the_old_attention_was_not_row_invariant(
    models: dict[str, LoadedModel], monkeypatch: pytest.MonkeyPatch
) -> None:
    """What the blocked layout fixes: attending over the slots with the tree's gaps in between
    (the layout every pass used before) gives chain rows other bits than one-row passes (here, than
    the blocked layout in torch's ops, which equal them; the attention kernel is tested apart)."""
    monkeypatch.setattr(attention_kernel, "available", lambda: False)
    backend = backend_of(models["bfloat16"])
    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, 259, (2 * KEY_BLOCK + 2,), generator=generator).tolist()
    chain = torch.randint(3, 259, (6,), generator=generator).tolist()
    tokens, positions, mask = decoy_tree(chain, len(prompt))
    with torch.no_grad():
        cache = prefilled(backend, prompt)
        slots = torch.arange(cache.length, cache.length + tokens.shape[0])[None]
        keys, values = [k[None] for k in cache.keys], [v[None] for v in cache.values]
        over_mask, _ = backend.body(tokens[None], positions[None], mask, slots, keys, values)
        layout = blocked_keys(mask, positions, cache.length, tokens.shape[0])
        assert layout is not None
        blocked, _ = backend.body(tokens[None], positions[None], layout, slots, keys, values)
    assert not torch.equal(over_mask[0::2], blocked[0::2])


def test_a_product_is_computed_with_at_least_its_dtype_s_fewest_rows() -> None:
    x = torch.arange(6.0).view(3, 2)
    assert at_least_rows(x, 2) is x
    assert torch.equal(at_least_rows(x, 4), torch.cat((x, x)))
    assert torch.equal(at_least_rows(x[:1], product_rows(torch.float32)), x[:1].repeat(4, 1))
    assert at_least_rows(x[:1], product_rows(torch.bfloat16)).shape == (2, 2)


def test_bf16_attention_products_run_in_fp32_only_where_bf16_is_not_native() -> None:
    """Where torch's bf16 products are a generic kernel (AVX2), attention multiplies in fp32 if this
    CPU's fp32 products round each row alike whatever the others (checked once); the bf16 layer
    tests above then run that path."""
    assert product_dtype(torch.float32) == torch.float32
    in_fp32 = not native_bf16_products() and fp32_products_row_invariant()
    assert product_dtype(torch.bfloat16) == (torch.float32 if in_fp32 else torch.bfloat16)


def test_a_pass_past_the_key_block_has_no_blocked_layout() -> None:
    length = KEY_BLOCK - 2  # room for 2 positions
    assert pass_room(length) == 2
    chain = torch.ones(3, length + 3, dtype=torch.bool).tril(length)
    assert blocked_keys(chain[:2, : length + 2], torch.arange(length, length + 2), length, 2) is not None
    assert blocked_keys(chain, torch.arange(length, length + 3), length, 3) is None


@pytest.mark.parametrize("dtype", LOW_PRECISION)
@pytest.mark.parametrize("drafter", ["lookup", "draft", "markov", "medusa", "eagle3"])
@pytest.mark.parametrize("tree", ["chain", "static", "dynamic"])
def test_greedy_speculative_output_is_plain_decoding_in_low_precision(
    models: dict[str, LoadedModel], tmp_path: Path, dtype: str, drafter: str, tree: str
) -> None:
    assert_speculation_is_plain_decoding(models[dtype], tmp_path, drafter, tree, max_new_tokens=80)


def assert_speculation_is_plain_decoding(
    loaded: LoadedModel, tmp_path: Path, drafter: str, tree: str, max_new_tokens: int
) -> None:
    """Greedy output of ``drafter`` with ``tree`` (random heads or layer where it needs one) equals plain
    decoding's on PROMPTS, token for token, and it really speculated."""
    plain = load(loaded=loaded, drafter="none", calibrate=False, compile=False)
    options: dict[str, object] = {"draft_layers": 2}
    if drafter in ("markov", "medusa"):
        options["heads"] = str(random_heads_dir(loaded, drafter, tmp_path / drafter))
    if drafter == "eagle3":  # a compiled target's graphs return its default feature layers (check_graph_features)
        backend = backend_of(loaded)
        aux_layers = backend.graph_aux_layers if backend.compiled else AUX
        options["heads"] = str(layer_dir(loaded, tmp_path / drafter, aux_layers=aux_layers))
    spec = load(loaded=loaded, drafter=drafter, tree=tree, calibrate=False, fallback=False, compile=False, **options)  # type: ignore[arg-type]
    drafted = 0
    for prompt in PROMPTS:
        expected = plain.generate(prompt, max_new_tokens=max_new_tokens).token_ids
        result = spec.generate(prompt, max_new_tokens=max_new_tokens)
        assert result.token_ids == expected, (prompt, drafter, tree)
        drafted += sum(step.nodes - 1 for step in result.stats.steps)
    assert drafted > 0  # it really speculated


def test_no_draft_tree_reaches_past_the_key_block(models: dict[str, LoadedModel]) -> None:
    """The decode loop keeps every tree within ``pass_room``: over 200 tokens the passes cross
    block ends several times, and none is longer than the room left in its block."""
    loaded = models["bfloat16"]
    spec = load(loaded=loaded, drafter="lookup", tree="chain", depth=8, calibrate=False, fallback=False, compile=False)
    result = spec.generate(PROMPTS[2] * 4, max_new_tokens=200)
    plain = load(loaded=loaded, drafter="none", calibrate=False, compile=False)
    assert result.token_ids == plain.generate(PROMPTS[2] * 4, max_new_tokens=200).token_ids
    assert max(step.nodes for step in result.stats.steps) > 2


@pytest.mark.slow
@pytest.mark.parametrize("dtype", LOW_PRECISION)
def test_default_model_tree_rows_equal_one_row_passes_layer_by_layer(dtype: str) -> None:
    backend = backend_of(load_model("default", "native", dtype))
    layers = tuple(range(backend.llama_shape.num_layers + 1))
    for prefix in PREFIXES:
        assert_rows_match_one_row_passes(backend, prefix, layers)


@pytest.fixture(scope="module")
def default_int4_compiled() -> LoadedModel:
    """The default model as a new user gets it: int4 through the compiled graphs `make setup` built."""
    from causaldraft.api import compile_backend

    loaded = load_model("default", "native", "int4")
    assert compile_backend(loaded, progress=False)
    return loaded


@pytest.mark.slow
def test_default_model_compiled_tree_rows_equal_one_row_passes(default_int4_compiled: LoadedModel) -> None:
    backend = backend_of(default_int4_compiled)
    for prefix in PREFIXES:
        assert_rows_match_one_row_passes(backend, prefix, backend.graph_aux_layers)


@pytest.mark.slow
@pytest.mark.parametrize("products", ["kernel", "onednn"])
def test_default_model_bf16_graphs_are_row_invariant(
    graph_root: Path, products: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first four layers of the default model (its real shapes: in_features 576 and 1536) in bf16
    graphs: through causaldraft's bf16 kernel (buckets of 1 and 16 rows), and through oneDNN with the
    weights frozen into the graphs, reordered (models/compiled.py; buckets of 2 and 16 rows): where the
    kernel is built, its linears swapped for plain ones, as where oneDNN is measured faster."""
    if products == "onednn":
        monkeypatch.setenv(bf16_choice.SWITCH, bf16_choice.ONEDNN)
        if not native_bf16_products():
            pytest.skip("oneDNN takes no bf16 weights here")
    full = backend_of(load_model("default", "native", "bfloat16"))
    backend = full.truncated(4)
    layers = default_aux_layers(backend.llama_shape.num_layers)
    use_chosen_bf16_products(backend)
    key = GraphKey.of(backend, layers)
    assert bool(key.weights) == (products == "onednn") and kernel_products(backend) == (products == "kernel")
    buckets = (1, 16) if products == "kernel" else (2, 16)
    compile_model(backend, buckets=buckets, store=GraphStore(key, graph_root), progress=False)
    for prefix in PREFIXES:
        assert_rows_match_one_row_passes(backend, prefix, layers)


@pytest.mark.slow
@pytest.mark.parametrize("drafter", ["lookup", "markov", "eagle3"])
def test_default_model_speculative_output_is_plain_decoding_in_int4_compiled(
    default_int4_compiled: LoadedModel, drafter: str
) -> None:
    """The README's first command's setting (int4, compiled, measured cost model): token-identical."""
    plain = load(loaded=default_int4_compiled, drafter="none", compile=False)
    spec = load(loaded=default_int4_compiled, drafter=drafter, tree="dynamic", compile=False)
    prompts = ["Write a limerick about a cat who learns to code.", "List three uses of a paperclip, briefly.",
               "Explain why the sky is blue in two sentences."]  # fmt: skip
    for prompt in prompts:
        expected = plain.generate(prompt, chat=True, max_new_tokens=96).token_ids
        assert spec.generate(prompt, chat=True, max_new_tokens=96).token_ids == expected, (drafter, prompt)


PENALIZED = {"frequency_penalty": 0.4, "presence_penalty": 0.2, "repetition_penalty": 1.1, "logit_bias": {28: -5.0}}


@pytest.mark.slow
@pytest.mark.parametrize("drafter", ["lookup", "eagle3"])
@pytest.mark.parametrize("options", [{}, PENALIZED], ids=["raw", "penalized"])
def test_default_model_logprobs_and_penalties_keep_plain_decoding_in_int4_compiled(
    default_int4_compiled: LoadedModel, drafter: str, options: dict[str, object]
) -> None:
    """Each new token's log-probabilities, read from verify passes (logprobs.py), are the bits plain decoding
    reports; penalties and a bias judged node by node along each path (penalties.py) keep its tokens. The prompt's
    log-probabilities (read from its passes, through the int4 model's prompt twin) are the same whatever drafts."""
    plain = load(loaded=default_int4_compiled, drafter="none", compile=False)
    # no fallback to plain decoding: with the penalties the drafts are often rejected, and the test needs steps that
    # accept some (the clock would otherwise decide whether any are drafted)
    spec = load(loaded=default_int4_compiled, drafter=drafter, tree="dynamic", compile=False, fallback=False)
    accepted = 0
    for prompt in ("Name three planets and one fact about each.", "List the days of the week, one per line."):
        expected = plain.generate(prompt, chat=True, max_new_tokens=64, logprobs=5, prompt_logprobs=1, **options)
        result = spec.generate(prompt, chat=True, max_new_tokens=64, logprobs=5, prompt_logprobs=1, **options)
        assert result.token_ids == expected.token_ids and result.logprobs == expected.logprobs, (drafter, prompt)
        assert result.prompt_logprobs == expected.prompt_logprobs and expected.prompt_logprobs is not None
        assert [entry.token_id for entry in expected.prompt_logprobs] == plain.encode(prompt, chat=True)[1:]
        accepted += sum(step.accepted for step in result.stats.steps)
    assert accepted > 0


@pytest.mark.slow
@pytest.mark.parametrize("drafter", ["lookup", "eagle3"])
def test_default_model_decodes_a_kept_prefix_as_a_whole_read_in_int4_compiled(
    default_int4_compiled: LoadedModel, drafter: str
) -> None:
    """The README's first command's setting: a chat whose second turn starts with the first turn's prompt
    copies its whole chunks (prefix.py) and decodes what an engine reading every prompt whole decodes."""
    from causaldraft.decode import PROMPT_CHUNK

    reading = load(loaded=default_int4_compiled, drafter=drafter, compile=False, prefix_cache_mb=0)
    keeping = load(loaded=default_int4_compiled, drafter=drafter, compile=False)
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()[:2400]
    first = [{"role": "user", "content": f"Summarise this in one line:\n{readme}"}]
    answer = reading.generate(first, max_new_tokens=24)
    second = [*first, {"role": "assistant", "content": answer.text}, {"role": "user", "content": "Now in French."}]
    assert len(keeping.encode(first)) > 2 * PROMPT_CHUNK
    for messages in (first, second):
        expected = reading.generate(messages, max_new_tokens=64)
        result = keeping.generate(messages, max_new_tokens=64)
        assert result.token_ids == expected.token_ids
    assert result.stats.cached_prompt_tokens >= 2 * PROMPT_CHUNK


@pytest.fixture(scope="module")
def bf16_onednn_compiled(tiny_llama_dir: Path, graph_root: Path) -> LoadedModel:
    """The tiny Llama in bf16 loaded with its kernel linears, compiled where oneDNN was chosen: plain linears."""
    if not (native_bf16_products() and int4_kernel.bf16_available()):
        pytest.skip("needs oneDNN's bf16 products and causaldraft's bf16 kernel")
    loaded = load_model(str(tiny_llama_dir), "native", "bfloat16")
    backend = backend_of(loaded)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(bf16_choice.SWITCH, bf16_choice.ONEDNN)
        use_chosen_bf16_products(backend)
        store = GraphStore(GraphKey.of(backend, default_aux_layers(backend.llama_shape.num_layers)), graph_root)
        compile_model(backend, buckets=(2, 4, 16), store=store, progress=False)
    assert store.key.weights and backend.buckets == (2, 4, 16)
    return loaded


@pytest.mark.parametrize("drafter", ["lookup", "draft", "markov", "medusa", "eagle3"])
@pytest.mark.parametrize("tree", ["chain", "static", "dynamic"])
def test_greedy_speculative_output_is_plain_decoding_through_onednn_graphs(
    bf16_onednn_compiled: LoadedModel, tmp_path: Path, drafter: str, tree: str
) -> None:
    """bf16 loaded with causaldraft's kernel and compiled where oneDNN was chosen (its linears swapped for plain
    ones, graphs and eager passes alike through oneDNN): speculative output is still plain decoding's."""
    assert_speculation_is_plain_decoding(bf16_onednn_compiled, tmp_path, drafter, tree, max_new_tokens=60)


def test_within_depth_keeps_a_tree_of_the_shallow_nodes() -> None:
    from causaldraft.drafters.base import Draft
    from causaldraft.tree import Tree

    probs = torch.eye(4)
    draft = Draft(Tree((-1, 0, 1, 0), (10, 11, 12, 13)), (1.0, 0.5, 0.25, 0.4), "sampled", probs)
    cut = draft.within_depth(1)
    assert cut.tree == Tree((-1, 0, 0), (10, 11, 13))
    assert cut.scores == (1.0, 0.5, 0.4)
    assert cut.draft_probs is not None and torch.equal(cut.draft_probs, probs[[0, 1, 3]])
    assert draft.within_depth(2) is draft


def test_trees_stay_within_the_largest_compiled_bucket(tiny_llama_dir: Path, graph_root: Path) -> None:
    """A pass larger than the largest bucket runs eagerly, and eager code may round a row differently from
    a graph (int4 trees of 17-32 nodes did, on the default model: stop 34). So compiled, the decode loop
    keeps trees within ``pass_rows``; lookup paths of 16 on a repeating text would otherwise exceed it."""
    loaded = load_model(str(tiny_llama_dir), "native", "int4")
    backend = backend_of(loaded)
    compile_model(backend, buckets=(1, 4), store=GraphStore(GraphKey.of(backend, ()), graph_root), progress=False)
    assert backend.pass_rows() == 4
    spec = load(
        loaded=loaded, drafter="lookup", tree="dynamic", calibrate=False, fallback=False, lookup_depth=16, compile=False
    )
    plain = load(loaded=loaded, drafter="none", calibrate=False, compile=False)
    prompt = PROMPTS[2] * 4
    result = spec.generate(prompt, max_new_tokens=64)
    assert result.token_ids == plain.generate(prompt, max_new_tokens=64).token_ids
    assert max(step.nodes for step in result.stats.steps) == 4
