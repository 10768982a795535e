"""Where causaldraft keeps what it writes: one root, ``$CAUSALDRAFT_HOME`` (default
``~/.cache/causaldraft``), with ``models/`` (converted checkpoints), ``quant/`` (packed weights of
read-only checkpoints), ``compiled/`` (graph packages and their verify-cost calibration),
``kernels/`` (the kernels built for this machine, and which int4 build it runs: ``kernel_choice``),
``store-index/`` (the n-gram stores' built indexes: ``drafters/store.cached_index``) and ``train/`` (work
caches of training runs)."""

from __future__ import annotations

import os
from pathlib import Path


def causaldraft_home() -> Path:
    return Path(os.environ.get("CAUSALDRAFT_HOME", Path.home() / ".cache" / "causaldraft"))
