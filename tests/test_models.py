import pytest
import torch

from infinikv import models
from infinikv.errors import InfinikvError


def test_bundled_model_is_smollm2(real):
    model, tokenizer = real
    assert model.config.num_hidden_layers == 30 and model.config.num_key_value_heads == 3
    ids = tokenizer("The capital of France is", return_tensors="pt").input_ids
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=2, do_sample=False)
    assert tokenizer.decode(out[0, ids.shape[1] :]).startswith(" Paris")


def test_missing_bundled_model_names_the_fix(tmp_path, monkeypatch):
    monkeypatch.setenv("INFINIKV_HOME", str(tmp_path))
    with pytest.raises(InfinikvError, match="infinikv models fetch"):
        models.load_model("smollm2-135m")


def test_unknown_model_path():
    with pytest.raises(InfinikvError, match="no model"):
        models.resolve("/no/such/model")


def test_corrupt_model_folder(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "llama"')
    (tmp_path / "model.safetensors").write_bytes(b"\0" * 16)
    with pytest.raises(InfinikvError, match="cannot load model"):
        models.load_model(str(tmp_path))


def test_folder_without_weights(tmp_path):
    with pytest.raises(InfinikvError, match="not a model folder"):
        models.resolve(str(tmp_path))


def test_list_shows_the_bundled_model():
    rows = models.list_models()
    assert rows[0]["name"] == "smollm2-135m" and rows[0]["fetched"]
