"""Tensors cached in a safetensors file whose metadata names a format and a key (e.g. a digest of the
sources they were made from): written atomically, read back only when both still match."""

from __future__ import annotations

import os
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file


def write(path: Path, tensors: dict[str, torch.Tensor], format_name: str, key: str) -> None:
    """Write ``tensors`` to ``path`` through a temporary file renamed into place (no reader sees half a file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    save_file({name: tensor.contiguous() for name, tensor in tensors.items()}, str(partial),
              metadata={"format": format_name, "key": key})  # fmt: skip
    partial.replace(path)


def read(path: Path, format_name: str, key: str) -> dict[str, torch.Tensor] | None:
    """The tensors of ``path``, or None when it is absent, of another format or key, or unreadable."""
    if not path.is_file():
        return None
    try:
        with safe_open(str(path), framework="pt") as handle:
            metadata = handle.metadata() or {}
            if metadata.get("format") != format_name or metadata.get("key") != key:
                return None
            return {name: handle.get_tensor(name) for name in handle.keys()}
    except Exception:  # safetensors raises several types for corrupt files; the caller rebuilds
        return None
