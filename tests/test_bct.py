"""The Bounded-Cache Transformer: fixed storage, update rules, a built model that keeps them."""

import json

import pytest
import torch

from infinikv import Batch, load_model, make_policy
from infinikv.cache import Evictor, KVLayer
from infinikv.contract import Budget
from infinikv.errors import InfinikvError
from infinikv.kv.rope import Renumbering, RotaryTable, rotate
from infinikv.kv.slots import Slots
from infinikv.models import default_policy_spec
from infinikv.policies import RULES
from infinikv.sizes import parse_bytes
from test_policies import evict

RULE_NAMES = list(RULES)


@pytest.mark.parametrize("rule", RULE_NAMES)
@torch.inference_mode()
def test_storage_is_allocated_once_for_600_steps(tiny, rule):
    """600 steps past a 100-token prompt, over 12 times the capacity: the same storage throughout."""
    capacity = 48
    batch = Batch(tiny, make_policy("bct", capacity=capacity, update_rule=rule))
    cache = batch.cache
    ids = torch.randint(0, 128, (2, 600 + 100))
    batch.extend(ids[:, :100])  # a prompt larger than the capacity
    pointers = [(layer.slots.keys.data_ptr(), layer.slots.values.data_ptr()) for layer in cache.layers]
    held, allocated = cache.held_bytes(), cache.allocated_bytes()
    per_token = 2 * 2 * 2 * 16 * 4  # batch x (K and V) x KV heads x head_dim x fp32
    for step in range(100, 700):
        batch.step(ids[:, step])
        if step in (100 + capacity, 699):  # memory after N steps == memory after `capacity` steps
            assert [(layer.slots.keys.data_ptr(), layer.slots.values.data_ptr()) for layer in cache.layers] == pointers
            assert cache.held_bytes() == held == 2 * capacity * per_token
            assert cache.allocated_bytes() == allocated == 2 * (capacity + 1) * per_token
    for layer in cache.layers:
        assert layer.slots.keys.shape[2] == capacity + 1 and layer.get_seq_length() == 700
        assert int(layer.slots.state["valid"].sum(-1).max()) == capacity


@pytest.mark.slow
@torch.inference_mode()
def test_real_model_held_bytes_are_exact_every_step(real, emma_ids):
    model, _ = real
    capacity = 64
    batch = Batch(model, make_policy("bct", capacity=capacity))
    batch.feed(emma_ids[:, :100])
    pointer = batch.cache.layers[0].slots.keys.data_ptr()
    for i in range(100, 200):
        batch.step(emma_ids[:, i])
        assert batch.cache.held_bytes() == capacity * 30 * 2 * 3 * 64 * 4
    assert batch.cache.layers[0].slots.keys.data_ptr() == pointer


@torch.inference_mode()
def test_merge_conserves_the_total_weight(real, emma_ids):
    model, _ = real
    batch = Batch(model, make_policy("bct", capacity=40, update_rule="merge"))
    batch.feed(emma_ids[:, :90])
    for i in range(90, 130):
        batch.step(emma_ids[:, i])
        for layer in batch.cache.layers[::7]:
            state = layer.slots.state
            valid = state["valid"]
            totals = (state["weight"] * valid).sum(-1)
            assert torch.allclose(totals, torch.full_like(totals, i + 1))
            assert state["weight"][valid].min() >= 1


def rule_layer(rule: str, capacity: int, keys: torch.Tensor, **params) -> KVLayer:
    """A bct layer of ``rule`` after one forward of ``keys`` (1, h, q, d), values = 10 x keys."""
    q = keys.shape[2]
    layer = KVLayer(Slots(), Evictor(RULES[rule](**params), Budget(tokens=capacity), fixed=True))
    layer.begin(q, torch.arange(q)[None], None, [q])
    layer.update(keys, keys * 10)
    return layer


def kept_positions(layer: KVLayer, head: int = 0) -> list[int]:
    state = layer.slots.state
    return sorted(state["position"][0, head][state["valid"][0, head]].tolist())


def test_merge_folds_into_the_most_similar_slot():
    keys = torch.tensor([[1.0, 0], [0, 1.0], [0.9, 0.1], [-1.0, 0]]).view(1, 1, 4, 2)
    layer = rule_layer("merge", 3, keys, recent_ratio=0.0)
    layer.evictor.rule.observe(layer.slots, torch.tensor([[[5.0, 4.0, 0.1, 3.0]]]), torch.zeros(1, 1, 4), 1)
    evict(layer)
    assert kept_positions(layer) == [0, 1, 3]  # the least attended (position 2) was evicted...
    slot = 0  # ...into the slot with the most similar key (position 0's)
    state = layer.slots.state
    assert state["weight"][0, 0, slot] == 2
    assert torch.allclose(layer.slots.keys[0, 0, slot], torch.tensor([0.95, 0.05]))
    assert torch.allclose(layer.slots.values[0, 0, slot], torch.tensor([9.5, 0.5]))


def test_tova_evicts_the_argmin_of_the_current_attention():
    layer = rule_layer("tova", 4, torch.randn(1, 2, 5, 8))
    last = torch.tensor([[[0.3, 0.05, 0.2, 0.25, 0.2], [0.1, 0.4, 0.3, 0.01, 0.19]]])
    layer.evictor.rule.observe(layer.slots, last * 3, last, 1)
    evict(layer)
    for head, evicted in enumerate(last[0].argmin(-1).tolist()):
        kept = kept_positions(layer, head)
        assert evicted not in kept and len(kept) == 4


@torch.inference_mode()
def test_tova_on_the_real_model_drops_what_the_last_query_ignores(real, emma_ids):
    model, _ = real
    batch = Batch(model, make_policy("bct", capacity=30, update_rule="tova"))
    batch.feed(emma_ids[:, :30])
    layer = batch.cache.layers[10]
    before = {h: set(kept_positions(layer, h)) | {30} for h in range(3)}  # the kept tokens and the new one
    seen = []
    observe = layer.evictor.rule.observe
    layer.evictor.rule.observe = lambda slots, mass, last, queries: (
        seen.append((last.clone(), slots.state["position"].clone())),
        observe(slots, mass, last, queries),
    )
    batch.step(emma_ids[:, 30])
    last, position = seen[0]
    for head in range(3):
        dropped = before[head] - set(kept_positions(layer, head))
        assert dropped == {int(position[0, head, last[0, head].argmin()])}


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
    assert cache.layers[0].evictor.budget.tokens == policy.describe()["capacity"]


@pytest.mark.slow
def test_built_model_round_trip(real, tmp_path):
    from infinikv.cli import main

    argv = ["models", "build", "smollm2-135m", "--policy", "bct", "--capacity", "48", "--update-rule", "merge"]
    assert main([*argv, "--out", str(tmp_path / "m")]) == 0
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    assert config["infinikv_policy"] == {"policy": "bct", "capacity": 48, "update_rule": "merge"}
    model, tokenizer = load_model(str(tmp_path / "m"), weights="fp32")
    assert default_policy_spec(model) == {"policy": "bct", "capacity": 48, "update_rule": "merge"}
    ids = tokenizer("It is a truth universally acknowledged, that a single man", return_tensors="pt").input_ids
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=60, do_sample=False, return_dict_in_generate=True
    )
    layer = out.cache.layers[0]
    assert layer.evictor.rule.name == "merge" and layer.evictor.capacities == [48] and layer.slots.held == [48]
    assert layer.get_seq_length() == ids.shape[1] + 59
    # the built model is the same network: with nothing evicted it matches the plain one exactly
    plain, _ = real
    short = ids[:, :8]
    with torch.inference_mode():
        assert torch.equal(
            model.generate(short, attention_mask=torch.ones_like(short), max_new_tokens=20, do_sample=False),
            plain.generate(short, attention_mask=torch.ones_like(short), max_new_tokens=20, do_sample=False),
        )


def test_load_model_with_a_capacity(emma_ids):
    built, tokenizer = load_model("smollm2-135m", kv_capacity=32, update_rule="tova")
    assert default_policy_spec(built) == {"policy": "bct", "capacity": 32, "update_rule": "tova"}
    with pytest.raises(InfinikvError, match="capacity"):
        load_model("smollm2-135m", kv_capacity=0)
    # transformers' own generate() prefills a long prompt in the policy's chunks (no more than its
    # capacity), so the cache never holds more than capacity + chunk, and decodes as infinikv's core does
    assert built.generation_config.prefill_chunk_size == 32
    ids = emma_ids[:, :150]
    with torch.inference_mode():
        out = built.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False, return_dict_in_generate=True
        )
        per_token = 2 * 3 * 64 * 4  # K and V, 3 KV heads of 64 fp32 values
        assert out.cache.peak_bytes() <= (32 + 32) * per_token * len(out.cache.layers)
        batch = Batch(built, make_policy("bct", capacity=32, update_rule="tova"))
        tokens = [batch.prefill([ids[0].tolist()], tokenizer.pad_token_id).argmax(-1)]
        for _ in range(7):
            tokens.append(batch.step(tokens[-1]).argmax(-1))
    assert out.sequences[0, 150:].tolist() == torch.cat(tokens).tolist()


def test_rotations_compose_and_evictions_move_only_older_keys():
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
    # one victim at position 5: only the kept keys older than it move one step forward
    renumbering = Renumbering(inv_freq, threshold=0)
    position = torch.tensor([[[0, 5, 2, 9, 4]]])
    valid = torch.ones(1, 1, 5, dtype=torch.bool)
    keys, after = torch.randn(1, 1, 5, 16), torch.zeros(1, 1, 5, dtype=torch.int32)
    before = keys.clone()
    renumbering.evict(keys, after, position, valid, torch.tensor([[[1]]]), None, True)
    assert after.tolist() == [[[1, 0, 1, 0, 1]]]
    one = table(torch.tensor([1]))
    for slot in range(5):
        expected = rotate(before[0, 0, slot], one[0][0], one[1][0]) if after[0, 0, slot] else before[0, 0, slot]
        assert torch.allclose(keys[0, 0, slot], expected, atol=1e-6)


@pytest.mark.parametrize("rule", RULE_NAMES)
@torch.inference_mode()
def test_rank_positions_keep_the_kept_keys_at_their_ranks(tiny, rule):
    """Every kept key of every row is rotated to its rank among the kept tokens of that row (up to
    one shift per row, which RoPE cannot see): position + after - rank is the same for all."""
    batch = Batch(tiny, make_policy("bct", capacity=24, update_rule=rule, positions="rank"))
    ids = torch.randint(0, 128, (2, 140))
    batch.extend(ids[:, :60])
    for step in range(60, 140):
        batch.step(ids[:, step])
    for layer in batch.cache.layers:
        state = layer.slots.state
        for row in range(2):
            for head in range(2):
                kept = state["valid"][row, head]
                position = state["position"][row, head][kept]
                rank = position.argsort().argsort()
                offset = position + state["after"][row, head][kept] - rank
                assert kept.sum() == 24 and len(set(offset.tolist())) == 1


@torch.inference_mode()
def test_rank_positions_attend_as_if_the_kept_tokens_were_the_whole_text(tiny):
    """Layer 0 sees token embeddings only, so after evictions its attention output for a new token
    must equal a fresh run over just the kept tokens at positions 0..n (the query right after)."""
    cache = make_policy("bct", capacity=16, update_rule="sink-recent", positions="rank").make_cache(tiny)
    ids = torch.randint(0, 128, (1, 61))
    for step in range(60):
        tiny(input_ids=ids[:, step : step + 1], cache=cache, use_cache=True)
    layer = cache.layers[0]
    kept = torch.tensor(kept_positions(layer))
    assert kept[-1] == 59 and layer.slots.state["after"].max() > 0  # evictions happened
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
    repositioned, reference, unmoved = outputs[0], outputs[1], outputs[-1]
    scale = reference.abs().max()
    assert (repositioned - reference).abs().max() < 1e-4 * scale
    assert (unmoved - reference).abs().max() > 2e-3 * scale  # the test can tell them apart


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
