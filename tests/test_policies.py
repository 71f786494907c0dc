"""The shared matrix: every registered policy through exactness, invariants and generate."""

import itertools
import math

import pytest
import torch
import torch.nn.functional as F
from transformers import DynamicCache

from infinikv import Batch, load_model, make_policy, policy_names
from infinikv.contract import Budget
from infinikv.core import step_together
from infinikv.engine import encode_prompts
from infinikv.errors import InfinikvError
from infinikv.kv.slots import Slots
from infinikv.policies import REGISTRY
from infinikv.policies.calibration import calibrate
from infinikv.preparation import ensure_prepared

ALL = policy_names()
# Policies that hold at most their budget (recall's budget bounds its fast tier, its pool keeps the
# rest: test_recall.py)
BOUNDED = [name for name in ALL if REGISTRY[name].takes_budget and name != "recall"]


EXACT = {"infinigen": dict(max_fetch=1.0)}  # speculation that fetches everything
# Lossy by design: quant at 8 bits keeps every token but rounds it. Max logit error measured:
# 0.27 over the real model's `emma_loop` (logits ~20), 0.0009 on the tiny one (logits ~0.7);
# its own bounds are in test_quant.py.
LOSSY = {"quant": dict(bits=8)}
TOLERANCE = {"quant": 0.5}
TINY_TOLERANCE = {"quant": 0.005}


def whole(name: str, model, tokenizer=None):
    """The policy keeping (or fetching) every token of these tests: it must match ``full``."""
    params = {**EXACT, **LOSSY}.get(name, {})
    policy = make_policy(name, capacity=4096) if REGISTRY[name].takes_budget else make_policy(name, **params)
    return prepared(policy, model, tokenizer)


def prepared(policy, model, tokenizer=None):
    """``policy`` with its preparation run (a tiny model has no folder: calibrate it in memory)."""
    if policy.needs_preparation:
        if tokenizer is None:
            policy.prep = calibrate(model, torch.randint(0, model.config.vocab_size, (1, 64)), progress=False)
        else:
            ensure_prepared(policy, model, tokenizer)
    return policy


def forward_loop(model, ids, cache, prefill: int, chunk: int = 0):
    """Prefill, then single-token decode steps, then an optional chunk; logits of every call."""
    logits = [model(input_ids=ids[:, :prefill], cache=cache, use_cache=True).logits]
    end = ids.shape[1] - chunk
    for i in range(prefill, end):
        logits.append(model(input_ids=ids[:, i : i + 1], cache=cache, use_cache=True).logits)
    if chunk:
        logits.append(model(input_ids=ids[:, end:], cache=cache, use_cache=True).logits)
    return torch.cat(logits, dim=1)


def emma_loop(model, emma_ids: torch.Tensor, cache) -> torch.Tensor:
    """``forward_loop`` over Emma's first 104 tokens: 80 prefilled, 8 decode steps, a chunk of 16."""
    return forward_loop(model, emma_ids[:, :104], cache, 80, chunk=16)


@torch.inference_mode()
def test_full_matches_transformers_dynamic_cache(real, emma_ids):
    model, _ = real
    reference = emma_loop(model, emma_ids, DynamicCache(config=model.config))
    ours = emma_loop(model, emma_ids, make_policy("full").make_cache(model))
    assert (ours - reference).abs().max() < 1e-4


@pytest.fixture(scope="module")
def full_logits(real, emma_ids):
    """``full``'s ``emma_loop`` logits (computed once)."""
    with torch.inference_mode():
        return emma_loop(real[0], emma_ids, make_policy("full").make_cache(real[0]))


@pytest.mark.parametrize("name", ALL)
@torch.inference_mode()
def test_exact_when_the_budget_covers_everything(real, emma_ids, full_logits, name):
    model, tokenizer = real
    ours = emma_loop(model, emma_ids, whole(name, model, tokenizer).make_cache(model))
    assert (ours - full_logits).abs().max() < TOLERANCE.get(name, 1e-4)
    if REGISTRY[name].takes_budget and name not in ("bct", "recall"):  # a growing budget: 1 keeps everything too
        again = emma_loop(model, emma_ids, make_policy(name, budget=1.0).make_cache(model))
        assert (again - full_logits).abs().max() < 1e-4


def prefill_then_steps(batch: Batch, ids: torch.Tensor, chunk: int) -> torch.Tensor:
    """A batch's logits over ``ids`` (1, 96): its first 80 tokens read in chunks of ``chunk``, then a
    decode step for each of the rest."""
    logits = [batch.prefill([ids[0, :80].tolist()], 0, chunk=chunk, keep_all=True)]
    return torch.cat(logits + [batch.step(ids[:, i])[:, None] for i in range(80, ids.shape[1])], dim=1)


@pytest.fixture(scope="module")
def full_in_one_chunk(real, emma_ids):
    with torch.inference_mode():
        return prefill_then_steps(Batch(real[0], make_policy("full")), emma_ids[:, :96], chunk=80)


@pytest.mark.parametrize("name", ALL)
@torch.inference_mode()
def test_chunked_prefill_is_exact_when_the_budget_covers_everything(real, emma_ids, full_in_one_chunk, name):
    """The decode core's default: a prompt read in chunks (of 24 here, as a 512-token chunk reads a
    long prompt), then decode steps: each position's logits equal one-chunk ``full``'s."""
    model, tokenizer = real
    got = prefill_then_steps(Batch(model, whole(name, model, tokenizer)), emma_ids[:, :96], chunk=24)
    assert (got - full_in_one_chunk).abs().max() < TOLERANCE.get(name, 1e-4)


@pytest.mark.parametrize("name", BOUNDED)
@torch.inference_mode()
def test_a_bounded_prefill_holds_at_most_capacity_plus_its_chunk(real, emma_ids, name):
    """A 200-token prompt under a 48-token budget, read in the policy's own chunks: the cache's
    peak K/V (``peak_bytes``, what results report) stays within (capacity + chunk) tokens, and the
    chunk is no larger than the capacity (snapkv and kvzip read their prompt whole: snapkv's question
    scores it, kvzip compresses a context read whole)."""
    model, _ = real
    capacity, prompt = 48, emma_ids[0, :200].tolist()
    policy = make_policy(name, capacity=capacity)
    chunk = policy.prefill_chunk(model, len(prompt))
    assert chunk == (len(prompt) if name in ("snapkv", "kvzip") else capacity)
    batch = Batch(model, policy)
    batch.prefill([prompt], 0)
    per_token = batch.cache.layers[0].slots.bytes_per_token()
    assert batch.cache.peak_bytes() <= (capacity + chunk) * per_token * len(batch.cache.layers)
    again = Batch(model, make_policy(name, capacity=capacity, prefill_chunk=16))
    again.prefill([prompt], 0)
    assert again.cache.peak_bytes() <= (capacity + 16) * per_token * len(again.cache.layers)


GENERATE = dict(max_new_tokens=12, do_sample=False)


@pytest.fixture(scope="module")
def plain_generation(real, emma_ids):
    """transformers' own ``generate`` (its DynamicCache) from Emma's first 60 tokens."""
    ids = emma_ids[:, :60]
    return real[0].generate(ids, attention_mask=torch.ones_like(ids), **GENERATE)


@pytest.mark.parametrize("name", ALL)
def test_generate_with_model_generate(real, emma_ids, plain_generation, name):
    model, tokenizer = real
    ids = emma_ids[:, :60]
    cache = whole(name, model, tokenizer).make_cache(model)
    ours = model.generate(ids, attention_mask=torch.ones_like(ids), cache=cache, **GENERATE)
    assert torch.equal(ours, plain_generation)


@pytest.mark.parametrize("name", BOUNDED)
@torch.inference_mode()
def test_capacity_is_never_exceeded(real, emma_ids, name):
    model, _ = real
    capacity = 32
    batch = Batch(model, make_policy(name, capacity=capacity))
    batch.prefill([emma_ids[0, :100].tolist()], 0, chunk=100)  # one forward, as a prompt (kvzip reads it twice first)
    layers = batch.cache.layers
    parts = [(getattr(layer.evictor, "parts", None) or [1.0])[0] for layer in layers]  # kvzip spreads them
    capacities = [Budget(tokens=capacity).capacity(100, part) for part in parts]
    assert sum(capacities) <= capacity * 30 and (name == "kvzip") == (len(set(capacities)) > 1)
    for i in range(100, 130):
        batch.step(emma_ids[:, i])
        for layer, kept in zip(layers, capacities, strict=True):
            assert layer.slots.tokens() == [kept]
            assert int(layer.slots.state["valid"].sum(-1).max()) == layer.slots.held[0]  # host count = device count
            assert layer.get_seq_length() == i + 1  # tokens seen keep counting
    assert batch.cache.held_bytes() == sum(capacities) * 3 * 64 * 2 * 4


@torch.inference_mode()
def test_sink_tokens_are_always_kept(real, emma_ids):
    model, _ = real
    batch = Batch(model, make_policy("sink", capacity=24, sinks=4))
    batch.feed(emma_ids[:, :50])
    for i in range(50, 90):
        batch.step(emma_ids[:, i])
        for layer in batch.cache.layers:
            state = layer.slots.state
            kept = set(state["position"][0, 0][state["valid"][0, 0]].tolist())
            assert {0, 1, 2, 3} <= kept
            assert set(range(i + 1 - 20, i + 1)) <= kept  # and the 20 most recent


def one_layer(policy, q: int, keys: torch.Tensor):
    """A policy's layer 0 after one forward of ``keys`` (b, h, q, d) at positions 0..q-1, attended."""
    layer = policy.layer(0, None, None)
    b = keys.shape[0]
    layer.begin(q, torch.arange(q).expand(b, q), None, [q] * b)
    layer.update(keys, keys.clone())
    return layer


def evict(layer):
    """The eviction stage of ``layer``'s current forward, run on its own (without attention)."""
    plan = layer.plan
    layer.evictor.evict(layer.slots, layer.positions[:, -1], plan.eviction, plan.write.length)


def test_h2o_keeps_the_heaviest_hitters_and_the_recent_tokens():
    """On the real layer object with known attention: the kept set is exactly top-score + recent."""
    layer = one_layer(make_policy("h2o", capacity=6, recent_ratio=0.5), 10, torch.randn(1, 2, 10, 4))
    scores = torch.tensor([[5.0, 0.1, 4.0, 0.2, 3.0, 0.3, 0.4, 9.0, 0.5, 0.6], [0.0] * 9 + [1.0]])
    layer.evictor.rule.observe(layer.slots, scores[None], scores[None], 1)
    evict(layer)
    assert layer.slots.held == [6]
    state = layer.slots.state
    kept = [sorted(state["position"][0, h][state["valid"][0, h]].tolist()) for h in range(2)]
    assert kept[0] == [0, 2, 4, 7, 8, 9]  # top-3 scores among the old tokens + 3 most recent
    assert kept[1][-3:] == [7, 8, 9] and len(set(kept[1])) == 6


@torch.inference_mode()
def test_eviction_frees_a_slot_in_place_and_the_next_token_takes_it(tiny):
    """No compaction: an evicted slot is marked empty and the next token is written into it."""
    batch = Batch(tiny, make_policy("sink", capacity=8, sinks=2))
    ids = torch.randint(0, 128, (2, 30))
    batch.feed(ids[:, :8])
    slots = batch.cache.layers[0].slots
    pointer = slots.keys.data_ptr()
    for i in range(8, 30):
        before = slots.state["position"].clone()
        batch.step(ids[:, i])
        moved = (slots.state["position"] != before).sum(-1)  # slots whose token changed
        assert bool((moved == 1).all())  # exactly one per row and head: the victim's, now the new token's
        assert int(slots.state["position"].max()) == i and slots.n == 9  # capacity + the spare slot
    assert slots.keys.data_ptr() == pointer


def test_slots_fill_holes_before_growing():
    slots = Slots()
    k = torch.randn(2, 1, 4, 2)
    write = slots.plan(4, [4, 4])
    assert write.contiguous and write.length == 4
    slots.write(write, k, k, torch.arange(4).expand(2, 4), None)
    slots.drop(torch.tensor([[[1]], [[3]]]))
    slots.forget([1, 1])
    write = slots.plan(1, [1, 1])
    assert not write.contiguous and write.length == 4  # one hole per row: no growth
    where = slots.write(write, k[:, :, :1], k[:, :, :1], torch.full((2, 1), 9), None)
    assert where.flatten().tolist() == [1, 3] and slots.held == [4, 4]
    assert bool(slots.state["valid"][:, :, :4].all())


@pytest.fixture(scope="module")
def packed():
    """(model, tokenizer) of the bundled model as a user runs it (int4, infinikv's kernels), where a
    test compares policies' behaviour rather than their bits: the linears of the positions test
    take 10 s of its time instead of fp32's 20 (py-spy, one thread)."""
    return load_model("smollm2-135m")


def bounded_and_full(model, capacity: int) -> dict[str, Batch]:
    """A batch of each bounded policy at ``capacity``, and one of ``full``: the bar they are held to."""
    policies = {"full": make_policy("full")} | {name: make_policy(name, capacity=capacity) for name in BOUNDED}
    return {name: Batch(model, policy) for name, policy in policies.items()}


def greedy_together(batches: dict[str, Batch], prompt: list[int], new: int) -> dict[str, list[int]]:
    """Each batch's ``new`` greedy tokens after ``prompt``, every batch decoding in one forward a
    step (``step_together``, the server's mixed-policy batching)."""
    tokens = [batch.prefill([prompt], 0).argmax(-1) for batch in batches.values()]
    steps = [tokens]
    for _ in range(new - 1):
        tokens = [logits.argmax(-1) for logits in step_together(list(batches.values()), tokens)]
        steps.append(tokens)
    return {name: [int(step[i]) for step in steps] for i, name in enumerate(batches)}


STORY = "Write a long story about a girl who travels across the sea to find her lost brother."
NEW, CAPACITY = 120, 64  # greedy tokens, cache capacity: the prompt (~40 tokens) + 120 is well past 64


@pytest.mark.slow
@torch.inference_mode()
def test_greedy_past_capacity_does_not_collapse(packed):
    """120 greedy tokens at capacity 64, every bounded policy and `full` decoding together (one
    forward a step, as the server batches them): no run of one repeated token, as varied as `full`.

    (This 135M model loops on phrases even with the full cache, so the bar is `full` itself.)
    """
    model, tokenizer = packed
    prompt = encode_prompts(tokenizer, [STORY], chat=True)[0]
    assert len(prompt) + NEW > CAPACITY + 80  # well past capacity
    stories = greedy_together(bounded_and_full(model, CAPACITY), prompt, NEW)
    for name, story in stories.items():
        assert max(len(list(run)) for _, run in itertools.groupby(story)) < 8, name
        assert len(set(story)) >= 0.8 * len(set(stories["full"])), name


PAST = 145  # tokens of Emma teacher-forced: 97 past a capacity of 48


@pytest.mark.slow
@torch.inference_mode()
def test_positions_advance_past_eviction(packed, emma_ids):
    """Teacher-forced perplexity on real text stays near `full` long after the cache is full: every
    bounded policy at capacity 48 and `full` read Emma's tokens 33..145 after the first 32, together.

    With positions stuck at the stored length, this perplexity is several times `full`'s.
    """
    batches = bounded_and_full(packed[0], 48)
    for batch in batches.values():
        batch.extend(emma_ids[:, :32])
    nll = torch.zeros(len(batches), dtype=torch.float64)
    for i in range(32, PAST - 1):
        logits = step_together(list(batches.values()), [emma_ids[:, i]] * len(batches))
        nll += torch.stack([F.cross_entropy(row[0].double(), emma_ids[0, i + 1]) for row in logits])
    perplexity = dict(zip(batches, torch.exp(nll / (PAST - 33)).tolist(), strict=True))
    for name, batch in batches.items():
        assert perplexity[name] < 1.6 * perplexity["full"], (name, perplexity)
        counts, _ = batch.cache.attended()
        assert name == "full" or sum(counts) / len(counts) <= 49, (name, counts)


@pytest.mark.parametrize("name", ALL)
def test_batched_greedy_equals_each_prompt_alone(real, name):
    from infinikv import Sampling, generate

    model, tokenizer = real
    prompts = ["The capital of France is", "Once upon a time, in a small village by the sea, there lived an old"]
    policy = make_policy(name, budget=0.5) if REGISTRY[name].takes_budget else make_policy(name)
    sampling = Sampling(max_new_tokens=12)  # infinigen at its defaults: each sequence speculates for itself
    batched = generate(model, tokenizer, prompts, policy, sampling)
    alone = [generate(model, tokenizer, p, policy, sampling).token_ids[0] for p in prompts]
    assert batched.token_ids == alone


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(name="nope", budget=0.1), "unknown policy"),
        (dict(name="sink", budget=0.0), "budget"),
        (dict(name="sink", budget=1.5), "budget"),
        (dict(name="h2o", capacity=0), "capacity"),
        (dict(name="sink"), "needs --budget"),
        (dict(name="sink", budget=0.2, capacity=10), "exactly one"),
        (dict(name="h2o", budget=0.2, recent_ratio=2), "recent-ratio"),
        (dict(name="sink", budget=0.2, sinks=-1), "sinks"),
        (dict(name="sink", budget=0.2, bogus=1), "no parameter"),
    ],
)
def test_bad_policy_parameters(kwargs, message):
    with pytest.raises(InfinikvError, match=message):
        make_policy(**kwargs)


def test_cache_without_attach_is_refused(tiny):
    import copy

    from transformers import LlamaForCausalLM

    plain = LlamaForCausalLM(copy.deepcopy(tiny.config)).eval()
    plain.set_attn_implementation("sdpa")
    cache = make_policy("sink", capacity=4).make_cache(plain)
    with pytest.raises(InfinikvError, match="attach"):
        plain(input_ids=torch.randint(0, 128, (1, 8)), cache=cache, use_cache=True)


@pytest.mark.parametrize("name", ALL)
@torch.inference_mode()
def test_tiny_model_prefill_then_chunks(tiny, name):
    """Mixed chunk sizes on a GQA model: same logits as full when nothing is evicted."""
    ids = torch.randint(0, 128, (2, 40))
    reference = forward_loop(tiny, ids, make_policy("full").make_cache(tiny), 20, chunk=7)
    ours = forward_loop(tiny, ids, whole(name, tiny).make_cache(tiny), 20, chunk=7)
    assert (ours - reference).abs().max() < TINY_TOLERANCE.get(name, 1e-5)
    assert math.isfinite(float(ours.abs().max()))


@pytest.mark.parametrize("name", ALL)
@torch.inference_mode()
def test_a_cache_is_freed_when_its_last_reference_goes(tiny, name):
    """No reference cycles in a cache: its K/V go back at once when nothing refers to it, not at
    the garbage collector's next full pass (a server drops a conversation's cache and admits the
    next request into that memory)."""
    import gc
    import weakref

    policy = make_policy(name, capacity=16) if REGISTRY[name].takes_budget else make_policy(name)
    batch = Batch(tiny, prepared(policy, tiny))
    ids = torch.randint(0, tiny.config.vocab_size, (1, 40))
    batch.prefill([ids[0].tolist()], 0)
    for i in range(5):
        batch.step(ids[:, i])
    parts = [weakref.ref(part) for layer in batch.cache.layers for part in (layer, layer.slots, *layer.pools)]
    gc.collect()
    gc.disable()
    try:
        del batch
        assert [part() for part in parts] == [None] * len(parts)
    finally:
        gc.enable()
