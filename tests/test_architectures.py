"""The policy x architecture matrix on tiny random models of each family infinikv supports:
Llama (GQA), Qwen2 (GQA with q/k/v biases), Gemma 3 (sliding-window and global layers, two RoPE
bases, QK-norm, one KV head) and OPT (learned positions, no RoPE). Every policy at a budget that
covers everything must give the logits of transformers' own cache for the model, batch rows
exactly as alone, and work inside ``model.generate``."""

import pytest
import torch
from transformers import (
    DynamicCache,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    OPTConfig,
    OPTForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from infinikv import Batch, attach, make_policy, policy_names
from infinikv.modules import project
from infinikv.policies import REGISTRY
from infinikv.policies.calibration import calibrate, calibration_table
from infinikv.sizes import windows

VOCAB, WINDOW = 128, 8
SMALL = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_attention_heads=4)


def build(family: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if family == "llama":
        return LlamaForCausalLM(LlamaConfig(**SMALL, num_hidden_layers=3, num_key_value_heads=2))
    if family == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**SMALL, num_hidden_layers=3, num_key_value_heads=2))
        for name, tensor in model.named_parameters():  # random biases, so that they matter
            if name.endswith("bias"):
                tensor.data.normal_(0, 0.5)
        return model
    if family == "gemma3":
        kinds = ["sliding_attention", "full_attention"] * 2
        config = Gemma3TextConfig(
            **SMALL, num_hidden_layers=4, num_key_value_heads=1, head_dim=32, sliding_window=WINDOW,
            layer_types=kinds, query_pre_attn_scalar=32, max_position_embeddings=512,
        )  # fmt: skip
        model = Gemma3ForCausalLM(config)
        for name, tensor in model.named_parameters():  # random norm gains (Gemma's start at 0)
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                tensor.data.normal_(0, 0.5)
        return model
    config = OPTConfig(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=3, ffn_dim=128, num_attention_heads=4,
        max_position_embeddings=512, word_embed_proj_dim=64,
    )  # fmt: skip
    return OPTForCausalLM(config)


FAMILIES = ["llama", "qwen2", "gemma3", "opt"]


@pytest.fixture(scope="module", params=FAMILIES)
def family(request):
    return request.param, attach(build(request.param).eval())


def keeping_everything(name: str, model) -> object:
    """``name`` at a setting that keeps (or fetches) every token the model attends to."""
    if REGISTRY[name].needs_preparation:  # infinigen fetching everything; recall's fast tier holding it
        policy = make_policy(name, capacity=4096) if REGISTRY[name].takes_budget else make_policy(name, max_fetch=1.0)
        policy.prep = calibrate(model, torch.randint(0, VOCAB, (1, 64)))
        return policy
    if name == "quant":
        return make_policy(name, bits=8)
    return make_policy(name, capacity=4096) if REGISTRY[name].takes_budget else make_policy(name)


TOLERANCE = {"quant": 0.01}  # 8-bit rounding


def forward_loop(model, ids, cache, prefill: int = 20, chunk: int = 7) -> torch.Tensor:
    """A prefill longer than the window, decode steps, a chunk: the logits of every call."""
    logits = [model(input_ids=ids[:, :prefill], cache=cache, use_cache=True).logits]
    end = ids.shape[1] - chunk
    for i in range(prefill, end):
        logits.append(model(input_ids=ids[:, i : i + 1], cache=cache, use_cache=True).logits)
    logits.append(model(input_ids=ids[:, end:], cache=cache, use_cache=True).logits)
    return torch.cat(logits, dim=1)


@pytest.mark.parametrize("name", policy_names())
@torch.inference_mode()
def test_every_policy_matches_the_models_own_cache(family, name):
    kind, model = family
    ids = torch.randint(0, VOCAB, (2, 40))
    reference = forward_loop(model, ids, DynamicCache(config=model.config))
    cache = keeping_everything(name, model).make_cache(model)
    ours = forward_loop(model, ids, cache)
    assert (ours - reference).abs().max() < TOLERANCE.get(name, 1e-5)
    for layer, window in zip(cache.layers, windows(model.config), strict=True):  # a window holds window - 1
        assert layer.slots.tokens() == [40 if window is None else window - 1] * 2
        assert layer.is_sliding == (window is not None)
    assert (kind == "gemma3") == any(windows(model.config))


@pytest.mark.parametrize("name", policy_names())
@torch.inference_mode()
def test_batched_rows_equal_each_alone(family, name):
    """Left-padded prompts of different lengths, 12 greedy steps, a budget that evicts on the
    model's own layers: each row's tokens are those it gets alone."""
    _, model = family
    policy = make_policy(name, capacity=12) if REGISTRY[name].takes_budget else keeping_everything(name, model)
    if policy.needs_preparation and policy.prep is None:  # recall: speculation over what its fast tier evicts
        policy.prep = calibrate(model, torch.randint(0, VOCAB, (1, 64)))
    prompts = [torch.randint(0, VOCAB, (n,)).tolist() for n in (23, 9)]

    def greedy(rows: list[list[int]]) -> list[list[int]]:
        batch = Batch(model, policy)
        logits, out = batch.prefill(rows, pad_id=0, chunk=16), []
        for _ in range(12):
            token = logits.argmax(-1)
            out.append(token.tolist())
            logits = batch.step(token)
        return [list(t) for t in zip(*out, strict=True)]

    assert greedy(prompts) == [greedy([p])[0] for p in prompts]


@pytest.mark.parametrize("name", policy_names())
def test_model_generate_equals_the_models_own_cache(family, name):
    _, model = family
    ids = torch.randint(0, VOCAB, (1, 30))
    kwargs = dict(attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False)
    reference = model.generate(ids, **kwargs)
    ours = model.generate(ids, cache=keeping_everything(name, model).make_cache(model), **kwargs)
    assert torch.equal(ours, reference)


@torch.inference_mode()
def test_gemma3_speculation_with_every_column_is_the_layers_query():
    """Gemma 3's global layer 1 speculates from sliding layer 0 (another RoPE base) through its
    QK-norm: with every column kept, the partial query is the query the layer computes."""
    model = attach(build("gemma3").eval())
    policy = make_policy("infinigen", partial_ratio=1.0, select="mass", ahead="1")
    policy.prep = calibrate(model, torch.randint(0, VOCAB, (1, 64)))
    cache = policy.make_cache(model)
    assert [layer.tiers is not None for layer in cache.layers] == [False, True, False, True]
    assert policy.describe()["mass_per_layer"][::2] == [None, None]  # sliding layers do not speculate
    assert [int(row.split()[0]) for row in calibration_table(policy.prep, 0.9, 0).splitlines()[1:]] == [1, 3]
    speculation = cache.layers[1].tiers.selection
    assert speculation.frequencies is not None and speculation.norm is not None
    x, positions = torch.randn(1, 5, 64), torch.arange(30, 35)[None]
    rope = model.model.rotary_emb(x, positions, "full_attention")
    module = model.model.layers[1].self_attn
    q = project(module, x, rope)[0][0].transpose(0, 1)  # (5, H, d)
    pq = speculation.query(x, None, positions)[0]  # (h, g, q, c), c = d in the calibrated column order
    expected = q.transpose(0, 1)[:, :, speculation.columns[0]]  # (H, q, c)
    assert torch.allclose(pq.flatten(0, 1), expected, atol=1e-4)


@torch.inference_mode()
def test_memory_accounting_counts_the_windows():
    """On a model with sliding-window layers, what admission reserves bounds what the cache
    really holds, and bct's --kv-memory covers the windows' storage as well as its own."""
    model = attach(build("gemma3").eval())
    config, prompt = model.config, torch.randint(0, VOCAB, (60,)).tolist()
    for policy in (make_policy("sink", capacity=16), make_policy("full"), make_policy("bct", kv_memory="40KiB")):
        batch = Batch(model, policy)
        logits = batch.prefill([prompt], pad_id=0)
        for _ in range(20):
            logits = batch.step(logits.argmax(-1))
        assert batch.cache.peak_bytes() <= policy.worst_case_bytes(config, 60, 20)
        if policy.name == "bct":
            assert batch.cache.allocated_bytes() <= 40 * 1024 < batch.cache.allocated_bytes() + 2 * 4 * 32 * 2
    assert make_policy("sink", capacity=16).worst_case_bytes(config, 60, 20) < make_policy("full").worst_case_bytes(
        config, 60, 20
    )


@torch.inference_mode()
def test_bct_repositions_gemma3_keys_with_the_global_rope():
    """A Gemma 3 whose layer 0 is global (RoPE base 1e6; the sliding layers use 1e4): after bct
    evicts with rank positions, layer 0 (which sees embeddings only) attends as a fresh run over
    just the kept tokens would, so its keys were rotated with the global layer's own frequencies."""
    torch.manual_seed(0)
    config = Gemma3TextConfig(
        **SMALL, num_hidden_layers=2, num_key_value_heads=1, head_dim=32, sliding_window=WINDOW,
        layer_types=["full_attention", "sliding_attention"], query_pre_attn_scalar=32, max_position_embeddings=512,
    )  # fmt: skip
    model = attach(Gemma3ForCausalLM(config).eval())
    policy = make_policy("bct", capacity=16, update_rule="sink-recent", positions="rank")
    cache = policy.make_cache(model)
    ids = torch.randint(0, VOCAB, (1, 61))
    for step in range(60):
        model(input_ids=ids[:, step : step + 1], cache=cache, use_cache=True)
    slots = cache.layers[0].slots
    valid = slots.state["valid"][0, 0]
    kept = slots.state["position"][0, 0][valid].sort().values
    assert kept[-1] == 59 and slots.state["after"].max() > 0  # evictions happened
    outputs = []
    hook = model.model.layers[0].self_attn.register_forward_hook(lambda m, a, out: outputs.append(out[0][:, -1]))
    try:
        model(input_ids=ids[:, 60:61], cache=cache, use_cache=True)
        model(input_ids=torch.cat([ids[:, kept], ids[:, 60:61]], dim=1))  # plain positions 0..16
    finally:
        hook.remove()
    repositioned, reference = outputs
    assert (repositioned - reference).abs().max() < 1e-4 * reference.abs().max()
