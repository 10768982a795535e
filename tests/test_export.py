"""Export of an eagle3 drafter in the speculators layout, checked by speculators' own model class.

The check runs in the interpreter named by ``CAUSALDRAFT_SPECULATORS_PYTHON`` (a venv with
speculators: ``make .venv-speculators/bin/python``; ``make test`` sets it). Without it the check is skipped
locally, and fails in CI (``CI`` set), so the proof cannot silently go missing there."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from causaldraft.drafters.eagle3_model import load_layer, save_layer
from causaldraft.export import export_eagle3, write_reference
from causaldraft.models.loading import LoadedModel, load_model
from tests.test_eagle3 import random_layer

CHECK = Path(__file__).resolve().parent.parent / "bench" / "eagle3_export_check.py"


@pytest.fixture(scope="module")
def tiny_bf16(tiny_llama_dir: Path) -> LoadedModel:
    return load_model(str(tiny_llama_dir), "native", "bfloat16")


def exported(tiny: LoadedModel, tmp_path: Path) -> tuple[Path, Path]:
    directory = tmp_path / "eagle3"
    save_layer(random_layer(tiny), directory)
    return directory, export_eagle3(directory, tiny, tmp_path / "export")


def test_export_layout_and_vocabulary_maps(tiny_bf16: LoadedModel, tmp_path: Path) -> None:
    directory, out = exported(tiny_bf16, tmp_path)
    config = json.loads((out / "config.json").read_text())
    assert config["speculators_model_type"] == "eagle3"
    assert config["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]
    assert config["transformer_layer_config"]["num_hidden_layers"] == 1
    assert config["speculators_config"]["verifier"]["name_or_path"] == str(tiny_bf16.model_dir.resolve())
    weights = load_file(str(out / "model.safetensors"))
    layer = load_layer(directory, tiny_bf16.base_fingerprint, 259, 64)
    assert torch.equal(torch.arange(200) + weights["d2t"], layer.vocab_ids)
    assert int(weights["t2d"].sum()) == 200 and bool(weights["t2d"][layer.vocab_ids].all())
    q, k, v = (weights[f"layers.0.self_attn.{name}_proj.weight"] for name in "qkv")
    assert torch.equal(torch.cat([q, k, v]).float(), layer.qkv_proj.weight.to(torch.bfloat16).float())
    assert q.shape == (64, 128) and k.shape == (32, 128)  # 2 x hidden inputs: [embedding, hidden]


def test_export_heads_cli_names_the_verifier_absolutely_and_refuses_what_it_cannot_export(
    tiny_bf16: LoadedModel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A relative --model becomes an absolute verifier path (vLLM may start elsewhere); markov heads are
    refused as what they are; a layer of another model without --model is told to pass --model."""
    from causaldraft.cli import main
    from tests.test_heads import random_heads_dir

    directory, _ = exported(tiny_bf16, tmp_path)
    monkeypatch.chdir(tiny_bf16.model_dir.parent)
    relative = tiny_bf16.model_dir.name
    assert main(["export-heads", str(directory), "--format", "eagle3", "--out", str(tmp_path / "cli"),
                 "--model", relative]) == 0  # fmt: skip
    config = json.loads((tmp_path / "cli" / "config.json").read_text())
    assert config["speculators_config"]["verifier"]["name_or_path"] == str(tiny_bf16.model_dir.resolve())
    heads = random_heads_dir(tiny_bf16, "markov", tmp_path / "markov")
    assert main(["export-heads", str(heads), "--format", "eagle3", "--out", str(tmp_path / "x")]) == 2
    assert "holds markov/medusa heads: export-heads writes eagle3 layers" in capsys.readouterr().err
    assert main(["export-heads", str(directory), "--format", "eagle3", "--out", str(tmp_path / "x")]) == 2
    assert "not trained for the default model: pass the target it was trained for with --model" in (
        capsys.readouterr().err
    )
    assert not (tmp_path / "x").exists()


SCALED_ROPES = {
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16},
}  # fmt: skip


@pytest.mark.parametrize("rope", ["default", "llama3", "yarn"])
def test_speculators_model_class_gives_the_same_draft_logits(tiny_bf16: LoadedModel, tmp_path: Path, rope: str) -> None:
    """speculators' EAGLE-3 model, loaded from the exported folder, computes the layer's logits: for a target
    with the default rope and for targets that scale theirs (llama3 as Llama 3.1/3.2, yarn with its cos/sin
    scaling), whose rope the layer and the export carry."""
    python = os.environ.get("CAUSALDRAFT_SPECULATORS_PYTHON")
    if not python:
        if os.environ.get("CI"):
            pytest.fail("CAUSALDRAFT_SPECULATORS_PYTHON is not set in CI (make test sets it)")
        pytest.skip("no speculators interpreter (make .venv-speculators/bin/python; make test sets it)")
    target = tiny_bf16
    if rope != "default":
        from tests.tiny import save_tiny_llama

        model = save_tiny_llama(tmp_path / f"{rope}-rope", rope_scaling=SCALED_ROPES[rope], rope_theta=500000.0)
        target = load_model(str(model), "native", "bfloat16")
    directory, out = exported(target, tmp_path)
    layer_config = json.loads((out / "config.json").read_text())["transformer_layer_config"]
    assert layer_config["rope_parameters"]["rope_type"] == rope
    reference = write_reference(directory, target, tmp_path / "reference.pt")
    run = subprocess.run([python, str(CHECK), str(out), str(reference)], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    report = json.loads(run.stdout.strip().splitlines()[-1])
    print(json.dumps(report))  # the check's report, for the record (pytest -rP shows it)
    assert report["ok"] and report["same_top1"] and report["draft_to_target_map_equal"]
