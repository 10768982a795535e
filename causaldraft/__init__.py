"""causaldraft: lossless speculative decoding with causal draft trees."""

from causaldraft.api import Engine, Generation, load
from causaldraft.errors import CausalDraftError

__all__ = ["CausalDraftError", "Engine", "Generation", "load"]
__version__ = "0.1.0"
