import pytest
import torch

from causaldraft.cache import KVCache
from causaldraft.errors import CausalDraftError


def filled_cache() -> KVCache:
    cache = KVCache(num_layers=2, kv_heads=1, head_dim=1, max_len=8, dtype=torch.float32)
    for layer in range(2):
        values = torch.arange(6, dtype=torch.float32).view(1, 6, 1) + 10 * layer
        cache.write_layer(layer, values, -values)
    cache.append(6)
    return cache


def test_write_returns_views_over_prefix_and_new_entries() -> None:
    cache = KVCache(1, 1, 1, 8, torch.float32)
    keys, values = cache.write_layer(0, torch.ones(1, 3, 1), torch.ones(1, 3, 1))
    assert keys.shape == (1, 3, 1) and cache.length == 0
    cache.append(3)
    keys, _ = cache.write_layer(0, torch.full((1, 2, 1), 7.0), torch.zeros(1, 2, 1))
    assert keys[0, :, 0].tolist() == [1, 1, 1, 7, 7]


def test_commit_gathers_accepted_tree_slots_into_contiguous_positions() -> None:
    # Prefix of length 2, tree nodes in slots 2..5; accepted path = nodes 0, 2, 3 -> slots 2, 4, 5.
    cache = filled_cache()
    cache.commit([2, 4, 5], start=2)
    assert cache.length == 5
    assert cache.keys[0][0, :5, 0].tolist() == [0, 1, 2, 4, 5]
    assert cache.keys[1][0, :5, 0].tolist() == [10, 11, 12, 14, 15]
    assert cache.values[1][0, :5, 0].tolist() == [-10, -11, -12, -14, -15]


def test_commit_of_contiguous_prefix_keeps_values() -> None:
    cache = filled_cache()
    cache.commit([2, 3], start=2)
    assert cache.length == 4
    assert cache.keys[0][0, :4, 0].tolist() == [0, 1, 2, 3]


def test_rollback_sets_length_and_next_append_overwrites() -> None:
    cache = filled_cache()
    cache.rollback(3)
    assert cache.length == 3
    keys, _ = cache.write_layer(0, torch.full((1, 1, 1), 99.0), torch.zeros(1, 1, 1))
    assert keys[0, :, 0].tolist() == [0, 1, 2, 99]
    with pytest.raises(ValueError):
        cache.rollback(5)


def test_commit_rejects_slots_outside_the_written_range() -> None:
    cache = filled_cache()
    with pytest.raises(ValueError):
        cache.commit([7], start=2)
    with pytest.raises(ValueError):
        cache.commit([1], start=2)


def test_overflow_is_a_clear_error() -> None:
    cache = filled_cache()
    with pytest.raises(CausalDraftError, match="context overflow"):
        cache.append(3)
