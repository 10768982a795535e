from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from causaldraft.models import bf16_choice
from causaldraft.models.loading import LoadedModel, load_model
from tests.tiny import save_tiny_gpt2, save_tiny_llama, save_tiny_qwen3


def pytest_configure(config: pytest.Config) -> None:
    # Tiny models gain nothing from intra-op threads, and spinning threads fight over 2 cores.
    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def tiny_qwen_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Llama-shaped model with qkv bias (the Qwen2 layout), saved as model_type qwen2."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from tests.tiny import byte_tokenizer

    directory = tmp_path_factory.mktemp("tiny-qwen")
    torch.manual_seed(1)
    config = Qwen2Config(vocab_size=259, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=True, eos_token_id=2)  # fmt: skip
    Qwen2ForCausalLM(config).save_pretrained(str(directory))
    byte_tokenizer().save_pretrained(str(directory))
    return directory


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_qwen3(tmp_path_factory.mktemp("tiny-qwen3"))


@pytest.fixture(scope="session")
def tiny_gpt2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_gpt2(tmp_path_factory.mktemp("tiny-gpt2"))


@pytest.fixture(scope="module")
def models(tiny_llama_dir: Path) -> dict[str, LoadedModel]:
    """The tiny Llama in every dtype whose passes are bit-exact (docs/exactness.md)."""
    return {dtype: load_model(str(tiny_llama_dir), "native", dtype) for dtype in ("bfloat16", "int8", "int4")}


@pytest.fixture(autouse=True)
def seeded_torch() -> None:
    """Every test starts from the same global torch RNG state, whichever tests ran before it in its worker
    (the suite runs in parallel workers that take tests in no fixed order: make test)."""
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def threads_restored() -> Iterator[None]:
    """Nothing a test runs leaves torch's thread count changed: a worker left on two threads spins against the
    other worker's for the rest of the suite (stop 56: tests of 4-8 s took 50-97 s after a training recipe
    had set two threads for good)."""
    count = torch.get_num_threads()
    yield
    assert torch.get_num_threads() == count, f"torch's thread count left at {torch.get_num_threads()}, was {count}"


@pytest.fixture(autouse=True)
def isolated_home(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """Keep converted/quantized caches of tests out of the user's home, except the default model."""
    monkeypatch.setenv("CAUSALDRAFT_TEST", "1")
    # compiled bf16 models trace their kernel linears unless a test asks for oneDNN's frozen products: the
    # same graphs on every CPU (the timed choice between the two has its own tests, tests/test_bf16_choice.py)
    monkeypatch.setenv(bf16_choice.SWITCH, bf16_choice.KERNEL)


@pytest.fixture(scope="session")
def graph_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Compiled graph packages of the tiny models, shared by this session's tests (never the user's)."""
    return tmp_path_factory.mktemp("compiled")
