"""Drafter registry: names to constructors. Each takes the loaded target and drafter options."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from causaldraft.drafters.base import Drafter, NoDrafter
from causaldraft.drafters.draft_model import DraftModelDrafter, check_same_vocabulary
from causaldraft.drafters.lookup import LookupDrafter
from causaldraft.drafters.store import CONFIG_FILE as STORE_CONFIG
from causaldraft.drafters.store import NgramStore, default_store_dir, load_store, read_store_config
from causaldraft.errors import CausalDraftError
from causaldraft.models.loading import LoadedModel, load_model
from causaldraft.models.native import NativeLlama
from causaldraft.paths import trained_directory


@dataclass(frozen=True)
class DrafterOptions:
    draft_model: str | None = None  # local path of a separate draft model (same vocabulary)
    draft_layers: int = 4  # self-draft: how many of the target's first layers
    heads: str | None = None  # trained heads directory (markov / medusa / eagle3); None = shipped default
    lookup_merge: bool = True  # merge prompt-lookup candidates into head trees
    draft_dtype: str | None = None  # dtype of a separate draft model; None = the target's
    store: str | None = None  # n-gram store directory for prompt lookup; None = the shipped one if it fits
    use_store: bool = True  # False: prompt lookup in the text so far only

    def __post_init__(self) -> None:
        if self.draft_layers < 1:
            raise CausalDraftError(f"draft_layers must be >= 1, got {self.draft_layers}")


def build_none(target: LoadedModel, options: DrafterOptions, dtype: str) -> Drafter:
    return NoDrafter()


def lookup_store(target: LoadedModel, options: DrafterOptions) -> NgramStore | None:
    """The n-gram store prompt lookup walks besides the text so far (drafters/store.py): the one
    in ``options.store`` (refused if it does not fit the target), else the store shipped for the
    default model when the target is that model, else none."""
    if not options.use_store:
        return None
    fingerprint, vocab_size = target.base_fingerprint, target.backend.shape.vocab_size
    if options.store is not None:
        directory = trained_directory(options.store, "n-gram store directory")
        return load_store(directory, fingerprint, vocab_size)
    shipped = default_store_dir()
    if (shipped / STORE_CONFIG).is_file() and read_store_config(shipped).fingerprint == fingerprint:
        return load_store(shipped, fingerprint, vocab_size)
    return None


def build_lookup(target: LoadedModel, options: DrafterOptions, dtype: str) -> Drafter:
    return LookupDrafter(store=lookup_store(target, options))


def build_draft(target: LoadedModel, options: DrafterOptions, dtype: str) -> Drafter:
    if options.draft_model is None:
        if not isinstance(target.backend, NativeLlama):
            raise CausalDraftError("the self-draft needs the native backend (or pass --draft-model PATH)")
        layers = target.backend.llama_shape.num_layers
        if not 1 <= options.draft_layers < layers:
            raise CausalDraftError(
                f"the self-draft runs the target's first --draft-layers layers: must be in [1, {layers - 1}] for "
                f"this {layers}-layer model, got {options.draft_layers} (or pass --draft-model PATH)"
            )
        return DraftModelDrafter(target.backend.truncated(options.draft_layers), name="draft")
    if not Path(options.draft_model).exists():
        raise CausalDraftError(f"draft model path {options.draft_model} does not exist")
    try:
        draft = load_model(options.draft_model, "native", options.draft_dtype or dtype)
    except CausalDraftError as error:
        raise CausalDraftError(f"draft model {options.draft_model} (draft models run on the native backend, "
                               f"whatever the target's): {error}") from None  # fmt: skip
    check_same_vocabulary(target.tokenizer.get_vocab(), draft.tokenizer.get_vocab())
    rows, needed = draft.backend.shape.vocab_size, target.backend.shape.vocab_size
    if rows < needed:  # the target may emit any of its ids, and the draft must read each one it is given
        raise CausalDraftError(f"the draft model {options.draft_model} embeds {rows} token ids, fewer than the "
                               f"target's {needed}: it could not read every token the target writes")  # fmt: skip
    return DraftModelDrafter(draft.backend, name="draft", vocab_size=target.backend.shape.vocab_size)


def build_heads(kind: str) -> Callable[[LoadedModel, DrafterOptions, str], Drafter]:
    def build(target: LoadedModel, options: DrafterOptions, dtype: str) -> Drafter:
        from causaldraft.drafters.heads import load_heads_drafter

        store = lookup_store(target, options) if options.lookup_merge else None
        return load_heads_drafter(kind, target, options, store)

    return build


def build_eagle3(target: LoadedModel, options: DrafterOptions, dtype: str) -> Drafter:
    from causaldraft.drafters.eagle3 import load_eagle3_drafter

    store = lookup_store(target, options) if options.lookup_merge else None
    return load_eagle3_drafter(target, options, store)


def auto_choice(target: LoadedModel, options: DrafterOptions) -> str:
    """What ``auto`` (the default drafter) runs: the kind of the trained drafter in ``--heads DIR``; else, on a
    bf16 or fp32 target that a shipped eagle3 layer fits (the default model), that layer, merged with prompt
    lookup (ahead of lookup alone in every bf16 bench of stops 38-44, by 1-12 %); else prompt lookup, which needs
    no training, costs ~0.1 ms a step and leads with int4 and int8 targets, whose passes grow faster with the
    tree (docs/results/history.md). The shipped Markov, Medusa and eagle3 drafters of the default model also
    load by name."""
    from causaldraft.drafters.eagle3 import shipped_eagle3_fits
    from causaldraft.drafters.eagle3_model import CONFIG_FILE as EAGLE3_CONFIG
    from causaldraft.drafters.heads import CONFIG_FILE, read_config

    if options.heads is None:
        unquantized = isinstance(target.backend, NativeLlama) and not target.backend.quantized
        return "eagle3" if unquantized and shipped_eagle3_fits(target) else "lookup"
    directory = trained_directory(options.heads, "heads directory")
    if (directory / EAGLE3_CONFIG).is_file():
        return "eagle3"
    if (directory / CONFIG_FILE).is_file():
        return read_config(directory)[0].kind
    raise CausalDraftError(f"no trained drafter in {directory}: neither {CONFIG_FILE} nor {EAGLE3_CONFIG}")


def build_auto(target: LoadedModel, options: DrafterOptions, dtype: str) -> Drafter:
    return DRAFTERS[auto_choice(target, options)](target, options, dtype)


DRAFTERS: dict[str, Callable[[LoadedModel, DrafterOptions, str], Drafter]] = {
    "auto": build_auto,
    "none": build_none,
    "lookup": build_lookup,
    "draft": build_draft,
    "medusa": build_heads("medusa"),
    "markov": build_heads("markov"),
    "eagle3": build_eagle3,
}


def build_drafter(name: str, target: LoadedModel, options: DrafterOptions, dtype: str) -> Drafter:
    if name not in DRAFTERS:
        raise CausalDraftError(f"unknown drafter {name!r}; choose one of {', '.join(DRAFTERS)}")
    return DRAFTERS[name](target, options, dtype)
