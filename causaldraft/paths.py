"""Where causaldraft keeps what it writes: one root, ``$CAUSALDRAFT_HOME`` (default
``~/.cache/causaldraft``), with ``models/`` (converted checkpoints), ``quant/`` (packed weights of
read-only checkpoints), ``compiled/`` (graph packages and their verify-cost calibration),
``kernels/`` (the kernels built for this machine, and which int4 build it runs: ``kernel_choice``),
``store-index/`` (the n-gram stores' built indexes: ``drafters/store.cached_index``) and ``train/`` (work
caches of training runs)."""

from __future__ import annotations

import os
from pathlib import Path

from causaldraft.errors import CausalDraftError


def causaldraft_home() -> Path:
    return Path(os.environ.get("CAUSALDRAFT_HOME", Path.home() / ".cache" / "causaldraft"))


def trained_directory(path: str | Path, what: str) -> Path:
    """``path`` as the directory of trained weights it must be (``what`` names them in the error): a file
    inside it is named as such, with the directory to pass instead."""
    directory = Path(path).expanduser()
    if directory.is_file():
        raise CausalDraftError(f"{what} {directory} is a file: pass the directory that holds it ({directory.parent})")
    if not directory.is_dir():
        raise CausalDraftError(f"{what} {directory} does not exist")
    return directory
