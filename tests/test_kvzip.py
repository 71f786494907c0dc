"""``kvzip``: a prompt scored by a second reading of it, before any question, then cut to the budget.
Its scores are checked against transformers' own attention weights of the prompt read twice."""

import copy

import pytest
import torch
from transformers import LlamaForCausalLM

from infinikv import Batch, make_policy
from infinikv.errors import InfinikvError
from infinikv.eval.trace import NeedleTrace
from infinikv.kv import attend
from infinikv.policies.rules import layer_parts


@pytest.mark.parametrize("block_bytes", [attend.PEAK_BLOCK_BYTES, 0])  # 0: blocks of 16 queries, then 4
def test_peak_attention_is_the_most_any_later_query_pays_each_key(block_bytes):
    b, heads, kv_heads, length, d, queries = 2, 4, 2, 50, 8, 20
    keys, every_query = torch.randn(b, kv_heads, length, d), torch.randn(b, heads, length, d)
    logits = every_query @ keys.repeat_interleave(heads // kv_heads, 1).transpose(-1, -2) * 0.3
    probs = logits.masked_fill(torch.ones(length, length, dtype=torch.bool).triu(1), float("-inf")).softmax(-1)
    expected = probs[:, :, -queries:, :40].view(b, kv_heads, 2, queries, 40).amax((2, 3))
    got = attend.peak_attention(every_query[:, :, -queries:], keys, 0.3, 40, block_bytes)
    assert torch.allclose(got, expected, atol=1e-6)


@pytest.mark.parametrize("chunk", [2048, 8])
@torch.inference_mode()
def test_a_prompt_is_scored_by_its_second_reading(tiny, chunk):
    """Each prompt token's score is the most attention transformers' eager attention pays it from
    the queries of the same prompt fed again right after it (max over those queries and a KV
    head's query heads); fed again in chunks of 8 tokens, each chunk right after the prompt alone,
    the most over the chunks; a batch of two prompts of different lengths scores each as alone."""
    prompts = [torch.randint(0, 128, (30,)).tolist(), torch.randint(0, 128, (22,)).tolist()]
    batch = Batch(tiny, make_policy("kvzip", capacity=64, reread_chunk=chunk))  # holds every token: nothing evicted
    batch.prefill(prompts, pad_id=0)
    plain = LlamaForCausalLM(copy.deepcopy(tiny.config)).eval()
    plain.load_state_dict(tiny.state_dict(), strict=False)
    plain.set_attn_implementation("eager")
    for row, prompt in enumerate(prompts):
        n = len(prompt)
        readings = [
            plain(input_ids=torch.tensor([prompt + prompt[start : start + chunk]]), output_attentions=True).attentions
            for start in range(0, n, chunk)
        ]
        for index, layer in enumerate(batch.cache.layers):
            weights = [attentions[index][0, :, n:, :n] for attentions in readings]  # (H, c, n): a copy over the prompt
            expected = torch.stack([w.reshape(2, 2, -1, n).amax((1, 2)) for w in weights]).amax(0)  # 2 KV heads of 2
            slots = layer.slots
            position, valid = slots.state["position"][row], slots.state["valid"][row]
            score = slots.state["score"][row][valid].view(2, n)
            assert torch.equal(position[valid].view(2, n), torch.arange(n).expand(2, n))
            assert torch.allclose(score, expected, atol=1e-5)


@torch.inference_mode()
def test_a_prompt_is_read_once_then_copied_once(tiny):
    """The model runs over a prompt once for its first reading (whose K/V the cache stores, exactly
    those of ``full``) and once per chunk of its copy: 1 + 4 forwards for 30 tokens in chunks of 8."""
    prompt = torch.randint(0, 128, (30,)).tolist()
    forwards = []
    hook = tiny.model.register_forward_pre_hook(lambda module, args: forwards.append(1))
    try:
        batch = Batch(tiny, make_policy("kvzip", capacity=64, reread_chunk=8))
        batch.prefill([prompt], pad_id=0)
    finally:
        hook.remove()
    assert len(forwards) == 1 + 4
    full = Batch(tiny, make_policy("full"))
    full.prefill([prompt], pad_id=0)
    for layer, reference in zip(batch.cache.layers, full.cache.layers, strict=True):
        kept = layer.slots.view(layer.slots.n)[0].view(1, 2, 30, -1)  # a pool: head-major, one slot per token
        assert torch.equal(kept, reference.slots.view(30)[0])


@torch.inference_mode()
def test_each_layer_keeps_its_best_read_tokens_and_later_ones_go_first(tiny):
    prompt = torch.randint(0, 128, (40,)).tolist()
    whole = Batch(tiny, make_policy("kvzip", capacity=64, heads="even"))
    whole.prefill([prompt], 0)
    batch = Batch(tiny, make_policy("kvzip", capacity=16, recent_tokens=4, spread="layer", heads="even"))
    batch.prefill([prompt], 0)
    for layer, reference in zip(batch.cache.layers, whole.cache.layers, strict=True):
        score = reference.slots.state["score"][0, :, :40]
        best = score.topk(16, dim=-1).indices.sort(-1).values
        kept = layer.slots.state["position"][0][layer.slots.state["valid"][0]].view(2, 16).sort(-1).values
        assert torch.equal(kept, best)
    for token in torch.randint(0, 128, (12,)):  # decode: the 4 newest stay, older later tokens go first
        batch.step(token.view(1))
    for layer in batch.cache.layers:
        position = layer.slots.state["position"][0][layer.slots.state["valid"][0]].view(2, 16)
        assert int((position >= 40).sum(-1).max()) == 4 and int(position.max()) == 51


@torch.inference_mode()
def test_each_kv_head_keeps_as_many_tokens_as_its_scores_earn(tiny):
    """``heads=own`` (the default): a layer's K/V of both KV heads share one pool, so the layer
    keeps its best (token, head) pairs, the capacity's worth of each head, and the heads hold
    different counts; decoding, each head keeps the 4 newest later tokens, older ones going first.
    Its held bytes are exactly the capacity's (as ``heads=even``, which holds the same count per head)."""
    prompt = torch.randint(0, 128, (40,)).tolist()
    whole = Batch(tiny, make_policy("kvzip", capacity=64, heads="even"))
    whole.prefill([prompt], 0)
    batch = Batch(tiny, make_policy("kvzip", capacity=16, recent_tokens=4, spread="layer"))
    batch.prefill([prompt], 0)
    counts = []
    for layer, reference in zip(batch.cache.layers, whole.cache.layers, strict=True):
        score = reference.slots.state["score"][0, :, :40]  # (2, 40)
        best = torch.zeros(2 * 40, dtype=torch.bool).scatter(0, score.flatten().topk(32).indices, True).view(2, 40)
        kept = torch.zeros(2, 40, dtype=torch.bool)
        valid = layer.slots.state["valid"][0, 0]
        heads, position = layer.slots.state["head"][0, 0][valid], layer.slots.state["position"][0, 0][valid]
        kept[heads, position] = True
        assert torch.equal(kept, best) and layer.slots.tokens() == [16]
        counts.append(best.sum(-1).tolist())
    assert any(a != b for a, b in counts)  # some layer's heads keep different counts
    even = Batch(tiny, make_policy("kvzip", capacity=16, spread="layer", heads="even"))
    even.prefill([prompt], 0)
    assert batch.cache.held_bytes() == even.cache.held_bytes()
    for token in torch.randint(0, 128, (12,)):
        batch.step(token.view(1))
    for layer in batch.cache.layers:
        valid = layer.slots.state["valid"][0, 0]
        heads, position = layer.slots.state["head"][0, 0][valid], layer.slots.state["position"][0, 0][valid]
        later = [sorted(position[(heads == h) & (position >= 40)].tolist()) for h in range(2)]
        assert later == [[48, 49, 50, 51]] * 2 and layer.slots.tokens() == [16]


def test_only_a_model_of_several_kv_heads_pools_them(tiny):
    one_head = copy.deepcopy(tiny.config)
    one_head.num_key_value_heads = 1
    kinds = {
        (heads, n): type(make_policy("kvzip", budget=0.2, heads=heads).make_cache(model).layers[0]).__name__
        for heads in ("own", "even")
        for n, model in ((2, tiny), (1, LlamaForCausalLM(one_head)))
    }
    assert kinds == {("own", 2): "PooledLayer", ("own", 1): "KVLayer", ("even", 2): "KVLayer", ("even", 1): "KVLayer"}


@torch.inference_mode()
def test_a_needle_trace_counts_each_heads_own_slots_of_a_pool(tiny):
    """The needle trace of a pooled layer: a decode step's share of the needle per KV head is what
    that head held of it as the step attended (before it evicted), computed here from the pool."""
    prompt = torch.randint(0, 128, (40,)).tolist()
    batch = Batch(tiny, make_policy("kvzip", capacity=16, spread="layer"))
    batch.prefill([prompt], 0)
    shares = []
    for layer in batch.cache.layers:
        valid = layer.slots.state["valid"][0, 0]
        position, head = layer.slots.state["position"][0, 0][valid], layer.slots.state["head"][0, 0][valid]
        inside = (position >= 10) & (position < 30)
        shares.append([round(100 * int((inside & (head == h)).sum()) / 20, 1) for h in range(2)])
    trace = NeedleTrace()
    trace.watch(batch.cache, [[(10, 30)]], 41, torch.device("cpu"))
    batch.step(torch.tensor([1]))
    assert trace.result()["needle_attended_per_head"] == shares and shares[0] != shares[0][::-1]


def test_a_prompt_fed_without_its_reading_is_refused(tiny):
    batch = Batch(tiny, make_policy("kvzip", capacity=8))
    with pytest.raises(InfinikvError, match="reading it twice"):
        batch.feed(torch.randint(0, 128, (1, 20)))


@torch.inference_mode()
def test_the_budget_is_spread_over_the_layers_by_one_threshold(tiny):
    """KVzip's spread: the budget's share of all the scores (every layer and KV head) sets one
    threshold; each layer keeps its best tokens, as many as its heads hold above it, at least a
    tenth of an even share, and the layers together no more than even shares."""
    prompt = torch.randint(0, 128, (40,), generator=torch.Generator().manual_seed(2)).tolist()  # parts differ
    whole = Batch(tiny, make_policy("kvzip", capacity=64, heads="even"))
    whole.prefill([prompt], 0)
    scores = torch.stack([layer.slots.state["score"][0, :, :40] for layer in whole.cache.layers])  # (L, h, 40)
    threshold = scores.flatten().sort(descending=True).values[16 * 2 * 2 - 1]  # 16 of 40 per layer and head
    above = (scores >= threshold).sum(-1).float().mean(-1)
    parts = above / above.mean()
    parts = torch.where(parts < 0.1, 0.1, parts * (2 - 0.1 * (parts < 0.1).sum()) / parts[parts >= 0.1].sum())
    capacities = (16 * parts).floor().long().tolist()
    assert len(set(capacities)) > 1 and sum(capacities) <= 2 * 16
    batch = Batch(tiny, make_policy("kvzip", capacity=16, heads="even"))
    batch.prefill([prompt], 0)
    for layer, score, capacity in zip(batch.cache.layers, scores, capacities, strict=True):
        best = score.topk(capacity, dim=-1).indices.sort(-1).values
        kept = layer.slots.state["position"][0][layer.slots.state["valid"][0]].view(2, capacity).sort(-1).values
        assert torch.equal(kept, best)


def test_layer_parts_follow_where_the_high_scores_are_and_ignore_padding():
    """A layer whose heads score few tokens high keeps less than one whose heads score many; the
    parts average 1; a row padded past its length gets the parts it gets alone."""
    torch.manual_seed(0)
    peaked = torch.rand(1, 2, 30) * 0.1
    peaked[..., :3] = 1.0
    flat = 0.5 + torch.rand(1, 2, 30) * 0.1
    alone = layer_parts([peaked, flat], torch.tensor([30]).view(1, 1, 1), torch.tensor([0.2]), 0.1)
    assert alone[0, 0] < 1 < alone[1, 0] and torch.allclose(alone.mean(0), torch.ones(1, dtype=torch.float64))
    padded = [torch.cat([torch.rand(1, 2, 36), torch.nn.functional.pad(t, (0, 6))]) for t in (peaked, flat)]
    both = layer_parts(padded, torch.tensor([36, 30]).view(2, 1, 1), torch.tensor([0.3, 0.2]), 0.1)
    assert torch.equal(both[:, 1:], alone)
    every = layer_parts([peaked, flat], torch.tensor([30]).view(1, 1, 1), torch.tensor([1.0]), 0.1)
    assert torch.equal(every, torch.ones(2, 1, dtype=torch.float64))  # a budget that keeps the whole prompt: even parts


@torch.inference_mode()
def test_rows_carry_their_parts_when_they_join_and_leave_a_batch(tiny):
    """A conversation prefilled alone and appended to a running batch decodes as it would alone,
    each row keeping its own layers' parts of the budget."""
    ids = torch.randint(0, 128, (3, 50))
    alone = [Batch(tiny, make_policy("kvzip", budget=0.3)) for _ in range(3)]
    for b, length, row in zip(alone, (40, 30, 36), ids, strict=True):
        b.prefill([row[:length].tolist()], 0)
    group = Batch(tiny, make_policy("kvzip", budget=0.3))
    group.prefill([ids[0, :40].tolist()], 0)
    other = Batch(tiny, make_policy("kvzip", budget=0.3))
    other.prefill([ids[1, :30].tolist(), ids[2, :36].tolist()], 0)
    assert group.cache.layers[0].evictor.parts != other.cache.layers[0].evictor.parts[:1]
    group.append(other)
    for i in range(40, 46):
        expected = torch.cat([b.step(ids[r : r + 1, i]) for r, b in enumerate(alone)])
        assert (group.step(ids[:, i]) - expected).abs().max() < 1e-5
    group.keep([2, 0])
    for i in range(46, 50):
        expected = torch.cat([alone[2].step(ids[2:3, i]), alone[0].step(ids[0:1, i])])
        assert (group.step(ids[[2, 0], i]) - expected).abs().max() < 1e-5
    for layer, single in zip(group.cache.layers, alone[2].cache.layers, strict=True):
        assert layer.slots.held[0] == single.slots.held[0]


@torch.inference_mode()
def test_a_compiled_steps_storage_keeps_even_shares(tiny):
    """A static cache (a compiled step's) allocates every layer's slots before the prompt is read,
    so each layer keeps the capacity, however the scores would spread it."""
    prompt = torch.randint(0, 128, (40,), generator=torch.Generator().manual_seed(2)).tolist()  # parts differ
    policy = make_policy("kvzip", capacity=16)
    batch = Batch(tiny, policy, cache=policy.make_cache(tiny, static=True))
    batch.prefill([prompt], 0)
    assert [layer.slots.held for layer in batch.cache.layers] == [[16], [16]]
    assert all(layer.evictor.parts is None for layer in batch.cache.layers)
