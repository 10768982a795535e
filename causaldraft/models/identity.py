"""Which model a checkpoint directory holds: the fingerprint trained drafters, n-gram stores and training
work folders are paired with.

A fingerprint covers what makes two checkpoints compute different things: the config's architecture keys
(sizes, norm epsilon, rope, sliding window, biases) and the weights of every tensor. Reading all weights
would cost seconds for a large model, so each tensor contributes its name, dtype, shape and four of its rows
(first, a third, two thirds, last), read from the files without loading the rest. A fine-tune changes
(almost) every row of every matrix, so it gets another fingerprint; so does another rope scaling with
the same weights. The files are read, not the loaded model, so the fingerprint is the same whatever dtype
the model is loaded in. A model converted from a GGUF file is identified by that file's SHA-256 instead of
its converted weights, which another transformers release could round differently. A checkpoint in PyTorch's
pickle format (``*.bin``, which only the hf backend reads) contributes each file's size and its first and last MiB.

Until stop 42 the fingerprint covered the sizes and the first 256 embedding rows only: a fine-tune
sharing its base's embeddings, or the same weights under another rope, passed for its base. Folders
recorded with that fingerprint are refused like any other model's (``OLD_FINGERPRINTS`` says why).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from causaldraft.errors import CausalDraftError
from causaldraft.models.native import checkpoint_files

# config.json keys that change what a checkpoint computes (missing keys count as null)
ARCHITECTURE_KEYS = (
    "model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "rms_norm_eps", "tie_word_embeddings", "rope_theta", "rope_scaling",
    "rope_parameters", "sliding_window", "use_sliding_window", "layer_types", "attention_bias", "mlp_bias",
    "hidden_act", "max_position_embeddings",
)  # fmt: skip
ROWS_READ = 4
PICKLE_BYTES = 1 << 20  # of a *.bin checkpoint file, read at its start and its end
OLD_FINGERPRINTS = "drafters and stores made before causaldraft's stop 43 carry an older fingerprint: make them again"


def checkpoint_fingerprint(model_dir: Path, gguf_sha256: str | None = None) -> str:
    """The fingerprint of the checkpoint in ``model_dir``; ``gguf_sha256``: the GGUF file it was converted
    from, which then stands for its weights."""
    try:
        config = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError) as error:
        raise CausalDraftError(f"{model_dir / 'config.json'} is unreadable or not JSON: {error}") from error
    digest = hashlib.sha256(b"causaldraft checkpoint fingerprint 2\n")
    digest.update(json.dumps({key: config.get(key) for key in ARCHITECTURE_KEYS}, sort_keys=True).encode())
    if gguf_sha256 is not None:
        digest.update(f"gguf {gguf_sha256}".encode())
        return digest.hexdigest()[:16]
    files = checkpoint_files(model_dir)
    if not files:  # a PyTorch-pickle checkpoint (the hf backend reads it): its files' sizes, heads and tails
        for other in sorted(model_dir.glob("*.bin")):
            digest.update(f"{other.name} {other.stat().st_size}".encode())
            with other.open("rb") as handle:
                digest.update(handle.read(PICKLE_BYTES))
                handle.seek(max(0, other.stat().st_size - PICKLE_BYTES))
                digest.update(handle.read(PICKLE_BYTES))
    for file in files:
        with opened(file) as handle:
            for name in sorted(handle.keys()):
                digest.update(name.encode())
                digest.update(sampled_bytes(handle, name))
    return digest.hexdigest()[:16]


@contextlib.contextmanager
def opened(file: Path) -> Iterator[Any]:
    """A checkpoint's safetensors file opened for reading names and slices; a corrupt one is a clear error."""
    try:
        with safe_open(str(file), framework="pt") as handle:
            yield handle
    except Exception as error:  # safetensors raises several types for corrupt files
        raise CausalDraftError(f"corrupt weights file {file}: {error}") from error


def sampled_bytes(handle: object, name: str) -> bytes:
    """A tensor's dtype, shape and the bytes of ``ROWS_READ`` rows spread over its first dimension (all of
    it when it has no more rows than that)."""
    part = handle.get_slice(name)  # type: ignore[attr-defined]
    shape = list(part.get_shape())
    header = f"{part.get_dtype()}{shape}".encode()
    if not shape:
        return header + tensor_bytes(handle.get_tensor(name))  # type: ignore[attr-defined]
    rows = sorted({index * (shape[0] - 1) // (ROWS_READ - 1) for index in range(ROWS_READ)})
    return header + b"".join(tensor_bytes(part[row : row + 1]) for row in rows)


def tensor_bytes(tensor: torch.Tensor) -> bytes:
    return tensor.contiguous().view(-1).view(torch.uint8).numpy().tobytes()  # type: ignore[no-any-return]


def load_fingerprint(checkpoint: str, dtype: str) -> str:
    """One load of a checkpoint: its fingerprint and the dtype it runs in (training work folders differ
    by dtype)."""
    return hashlib.sha256(f"{checkpoint} {dtype}".encode()).hexdigest()[:16]
