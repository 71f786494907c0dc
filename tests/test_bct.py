"""The Bounded-Cache Transformer: fixed storage, update rules, a built model that keeps them."""

import json

import pytest
import torch

from infinikv import load_model, make_policy
from infinikv.errors import InfinikvError
from infinikv.models import default_policy_spec
from infinikv.policies.base import Budget
from infinikv.policies.bct import RULES, TovaLayer, parse_bytes
from infinikv.rope import RotaryTable, evicted_before, rotate

RULE_NAMES = list(RULES)


@pytest.mark.parametrize("rule", RULE_NAMES)
@torch.inference_mode()
def test_storage_is_allocated_once_for_2000_steps(tiny, rule):
    capacity = 48
    cache = make_policy("bct", capacity=capacity, update_rule=rule).make_cache(tiny)
    ids = torch.randint(0, 128, (2, 2000 + 100))
    tiny(input_ids=ids[:, :100], cache=cache, use_cache=True)  # a prefill larger than the capacity
    pointers = [(layer.keys.data_ptr(), layer.values.data_ptr()) for layer in cache.layers]
    held, allocated = cache.held_bytes(), cache.allocated_bytes()
    per_token = 2 * 2 * 2 * 16 * 4  # batch x (K and V) x KV heads x head_dim x fp32
    for step in range(100, 2100):
        tiny(input_ids=ids[:, step : step + 1], cache=cache, use_cache=True)
        if step in (100 + capacity, 2099):  # memory after N steps == memory after `capacity` steps
            assert [(layer.keys.data_ptr(), layer.values.data_ptr()) for layer in cache.layers] == pointers
            assert cache.held_bytes() == held == 2 * capacity * per_token
            assert cache.allocated_bytes() == allocated == 2 * (capacity + 1) * per_token
    for layer in cache.layers:
        assert layer.keys.shape[2] == capacity + 1 and layer.get_seq_length() == 2100
        assert int(layer.meta["valid"][:, :, : layer.used].sum(-1).max()) == capacity


@pytest.mark.slow
@torch.inference_mode()
def test_real_model_held_bytes_are_exact_every_step(real, emma_ids):
    model, _ = real
    capacity = 64
    cache = make_policy("bct", capacity=capacity).make_cache(model)
    model(input_ids=emma_ids[:, :100], cache=cache, use_cache=True)
    pointer = cache.layers[0].keys.data_ptr()
    for i in range(100, 200):
        model(input_ids=emma_ids[:, i : i + 1], cache=cache, use_cache=True)
        assert cache.held_bytes() == capacity * 30 * 2 * 3 * 64 * 4
    assert cache.layers[0].keys.data_ptr() == pointer


@torch.inference_mode()
def test_merge_conserves_the_total_weight(real, emma_ids):
    model, _ = real
    cache = make_policy("bct", capacity=40, update_rule="merge").make_cache(model)
    model(input_ids=emma_ids[:, :90], cache=cache, use_cache=True)
    for i in range(90, 130):
        model(input_ids=emma_ids[:, i : i + 1], cache=cache, use_cache=True)
        for layer in cache.layers[::7]:
            valid = layer.meta["valid"][:, :, : layer.used]
            totals = (layer.meta["weight"][:, :, : layer.used] * valid).sum(-1)
            assert torch.allclose(totals, torch.full_like(totals, i + 1))
            assert layer.meta["weight"][:, :, : layer.used][valid].min() >= 1


def test_merge_folds_into_the_most_similar_slot():
    layer = RULES["merge"](Budget(tokens=3), recent_ratio=0.0, fixed=True)
    keys = torch.tensor([[1.0, 0], [0, 1.0], [0.9, 0.1], [-1.0, 0]]).view(1, 1, 4, 2)
    layer.update(keys, keys * 10, kwargs={"position_ids": torch.arange(4)[None]})
    layer.admit(None)
    layer.observe(torch.tensor([[[5.0, 4.0, 0.1, 3.0]]]), torch.zeros(1, 1, 4))
    layer.commit(attended=4.0)
    valid = layer.meta["valid"][0, 0, :3]
    positions = layer.meta["position"][0, 0, :3][valid].tolist()
    assert sorted(positions) == [0, 1, 3]  # the least attended (position 2) was evicted...
    slot = positions.index(0)
    assert layer.meta["weight"][0, 0, slot] == 2  # ...into the slot with the most similar key
    assert torch.allclose(layer.keys[0, 0, slot], torch.tensor([0.95, 0.05]))
    assert torch.allclose(layer.values[0, 0, slot], torch.tensor([9.5, 0.5]))


def test_tova_evicts_the_argmin_of_the_current_attention():
    layer = TovaLayer(Budget(tokens=4), fixed=True)
    k = torch.randn(1, 2, 5, 8)
    layer.update(k, k.clone(), kwargs={"position_ids": torch.arange(5)[None]})
    layer.admit(None)
    last = torch.tensor([[[0.3, 0.05, 0.2, 0.25, 0.2], [0.1, 0.4, 0.3, 0.01, 0.19]]])
    layer.observe(last * 3, last)
    layer.commit(attended=5.0)
    for head, evicted in enumerate(last[0].argmin(-1).tolist()):
        kept = layer.meta["position"][0, head, :4].tolist()
        assert evicted not in kept and len(set(kept)) == 4


@torch.inference_mode()
def test_tova_on_the_real_model_drops_what_the_last_query_ignores(real, emma_ids):
    model, _ = real
    cache = make_policy("bct", capacity=30, update_rule="tova").make_cache(model)
    model(input_ids=emma_ids[:, :30], cache=cache, use_cache=True)
    layer = cache.layers[10]
    before = layer.meta["position"][:, :, :30].clone()
    seen = []
    observe = layer.observe
    layer.observe = lambda mass, last: (seen.append(last.clone()), observe(mass, last))
    model(input_ids=emma_ids[:, 30:31], cache=cache, use_cache=True)
    for head in range(3):
        candidates = torch.cat([before[0, head], torch.tensor([30])])  # slot order: 30 stored + the new token
        dropped = set(candidates.tolist()) - set(layer.meta["position"][0, head, :30].tolist())
        assert dropped == {int(candidates[seen[0][0, head].argmin()])}


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(capacity=0), "capacity"),
        (dict(capacity=-5), "capacity"),
        (dict(capacity=10, update_rule="lru"), "update-rule"),
        (dict(kv_memory="lots"), "is not a size"),
        (dict(kv_memory="-3MiB"), "is not a size"),
        (dict(kv_memory="64MiB", budget=0.2), "not both"),
    ],
)
def test_bad_bct_input(kwargs, message):
    with pytest.raises(InfinikvError, match=message):
        make_policy("bct", **kwargs)


def test_capacity_beyond_the_memory_budget(tiny):
    with pytest.raises(InfinikvError, match="more than --kv-memory"):
        make_policy("bct", capacity=100_000, kv_memory="1MiB").make_cache(tiny)
    with pytest.raises(InfinikvError, match="holds no token"):
        make_policy("bct", kv_memory="16B").make_cache(tiny)


def test_kv_memory_sets_the_capacity(real):
    model, _ = real
    policy = make_policy("bct", kv_memory="64MiB")
    cache = policy.make_cache(model)
    per_token = 30 * 2 * 3 * 64 * 4
    assert policy.describe()["capacity"] == 64 * 2**20 // per_token - 1
    assert parse_bytes("1.5 KiB") == 1536 and parse_bytes("2GB") == 2 * 10**9
    assert cache.layers[0].budget.tokens == policy.describe()["capacity"]


@pytest.mark.slow
def test_built_model_round_trip(real, tmp_path):
    from infinikv.cli import main

    assert (
        main(
            [
                "models",
                "build",
                "smollm2-135m",
                "--capacity",
                "48",
                "--update-rule",
                "merge",
                "--out",
                str(tmp_path / "m"),
            ]
        )
        == 0
    )
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    assert config["infinikv_policy"] == {"policy": "bct", "capacity": 48, "update_rule": "merge"}
    model, tokenizer = load_model(str(tmp_path / "m"))
    assert default_policy_spec(model) == {"policy": "bct", "capacity": 48, "update_rule": "merge"}
    ids = tokenizer("It is a truth universally acknowledged, that a single man", return_tensors="pt").input_ids
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=60, do_sample=False, return_dict_in_generate=True
    )
    layer = out.cache.layers[0]
    assert type(layer).__name__ == "MergeLayer" and layer.fixed_capacity == 48 and layer.used == 48
    assert layer.get_seq_length() == ids.shape[1] + 59
    # the built model is the same network: with nothing evicted it matches the plain one exactly
    plain, _ = real
    short = ids[:, :8]
    with torch.inference_mode():
        assert torch.equal(
            model.generate(short, attention_mask=torch.ones_like(short), max_new_tokens=20, do_sample=False),
            plain.generate(short, attention_mask=torch.ones_like(short), max_new_tokens=20, do_sample=False),
        )


def test_load_model_with_a_capacity():
    built, _ = load_model("smollm2-135m", kv_capacity=32, update_rule="tova")
    assert default_policy_spec(built) == {"policy": "bct", "capacity": 32, "update_rule": "tova"}
    with pytest.raises(InfinikvError, match="capacity"):
        load_model("smollm2-135m", kv_capacity=0)


def test_rotations_compose_and_evictions_are_counted_per_row():
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 16, 2).float() / 16))
    table = RotaryTable(inv_freq)
    offsets = torch.tensor([0, 7, 1023, 1024, 30000, 30007])
    cos, sin = table(offsets)
    angles = offsets[:, None].double() * inv_freq.double()
    assert torch.allclose(cos.double(), angles.cos(), atol=1e-6) and torch.allclose(
        sin.double(), angles.sin(), atol=1e-6
    )
    x = torch.randn(5, 16)
    forth = rotate(x, cos[4], sin[4])
    assert torch.allclose(rotate(forth, cos[4], -sin[4]), x, atol=1e-5)  # R(-a) R(a) = 1
    assert torch.allclose(rotate(rotate(x, cos[1], sin[1]), cos[4], sin[4]), rotate(x, cos[5], sin[5]), atol=1e-4)
    position = torch.tensor([[[0, 5, 2, 9, 4]]])
    evicted = torch.tensor([[[False, True, False, False, True]]])
    assert evicted_before(position, evicted).tolist() == [[[0, 1, 0, 2, 0]]]


@pytest.mark.parametrize("rule", RULE_NAMES)
@torch.inference_mode()
def test_rank_positions_renumber_the_kept_keys(tiny, rule):
    """Every kept key of every row sits at its rank among the kept tokens of that row."""
    cache = make_policy("bct", capacity=24, update_rule=rule, positions="rank").make_cache(tiny)
    ids = torch.randint(0, 128, (2, 140))
    tiny(input_ids=ids[:, :60], cache=cache, use_cache=True)
    for step in range(60, 140):
        tiny(input_ids=ids[:, step : step + 1], cache=cache, use_cache=True)
    for layer in cache.layers:
        valid = layer.meta["valid"][:, :, : layer.used]
        rank = layer.meta["position"][:, :, : layer.used] - layer.meta["shift"][:, :, : layer.used]
        for row, kept in zip(rank.flatten(0, 1), valid.flatten(0, 1), strict=True):
            assert sorted(row[kept].tolist()) == list(range(24))


@torch.inference_mode()
def test_rank_positions_attend_as_if_the_kept_tokens_were_the_whole_text(tiny):
    """Layer 0 sees token embeddings only, so after evictions its attention output for a new token
    must equal a fresh run over just the kept tokens at positions 0..n (the query right after)."""
    cache = make_policy("bct", capacity=16, update_rule="sink-recent", positions="rank").make_cache(tiny)
    ids = torch.randint(0, 128, (1, 61))
    for step in range(60):
        tiny(input_ids=ids[:, step : step + 1], cache=cache, use_cache=True)
    layer = cache.layers[0]
    kept = layer.meta["position"][0, 0, : layer.used][layer.meta["valid"][0, 0, : layer.used]].sort().values
    assert kept[-1] == 59 and layer.meta["shift"].max() > 0  # evictions happened
    outputs = []
    hook = tiny.model.layers[0].self_attn.register_forward_hook(lambda m, a, out: outputs.append(out[0][:, -1]))
    try:
        tiny(input_ids=ids[:, 60:61], cache=cache, use_cache=True)
        tiny(input_ids=torch.cat([ids[:, kept], ids[:, 60:61]], dim=1))  # plain positions 0..16
        original = make_policy("bct", capacity=16, update_rule="sink-recent", positions="original").make_cache(tiny)
        for step in range(61):
            tiny(input_ids=ids[:, step : step + 1], cache=original, use_cache=True)
    finally:
        hook.remove()
    repositioned, reference, kept_positions = outputs[0], outputs[1], outputs[-1]
    scale = reference.abs().max()
    assert (repositioned - reference).abs().max() < 1e-4 * scale
    assert (kept_positions - reference).abs().max() > 2e-3 * scale  # the test can tell them apart


@torch.inference_mode()
def test_auto_positions_are_original_within_the_trained_context_then_ranks(tiny):
    """auto = original positions up to max_position_embeddings (512 here), bit for bit; ranks after."""
    caches = {p: make_policy("bct", capacity=32, positions=p).make_cache(tiny) for p in ("auto", "original")}
    ids = torch.randint(0, 128, (1, 540))
    logits = {p: [tiny(input_ids=ids[:, :40], cache=c, use_cache=True).logits[:, -1]] for p, c in caches.items()}
    for step in range(40, 540):
        for p, c in caches.items():
            logits[p].append(tiny(input_ids=ids[:, step : step + 1], cache=c, use_cache=True).logits[:, -1])
    seen_before = 40 + torch.arange(501)  # tokens seen when each logit row was produced
    same = torch.tensor([torch.equal(a, o) for a, o in zip(logits["auto"], logits["original"], strict=True)])
    assert same[seen_before <= 512].all() and not same[seen_before > 512].any()
