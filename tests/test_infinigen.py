"""InfiniGen: selection semantics, exact skewing, the two tiers and their ledger, overlap."""

import math

import pytest
import torch
from transformers import OPTConfig, OPTForCausalLM

from infinikv import Batch, attach, make_policy
from infinikv.errors import InfinikvError
from infinikv.policies.infinigen import calibrate, skew
from infinikv.speculation import pair_scores, pairs_to_columns, partial_query, select_tokens


def test_threshold_keeps_tokens_within_alpha_of_the_max():
    scores = torch.tensor([10.0, 9.0, 6.5, 5.9, 0.0, -3.0]).view(1, 1, 1, 6)
    rows, fetch = select_tokens(scores, alpha=4.0, max_fetch=6)
    assert rows[fetch].tolist() == [0, 1, 2]  # 10, 9 and 6.5 are above 10 - 4
    rows, fetch = select_tokens(scores, alpha=math.inf, max_fetch=6)
    assert rows[fetch].tolist() == list(range(6))


def test_the_cap_limits_the_fetch():
    scores = torch.zeros(1, 1, 1, 10)  # every token ties: all are wanted
    rows, fetch = select_tokens(scores, alpha=4.0, max_fetch=3)
    assert int(fetch.sum()) == 3


def test_count_is_averaged_over_heads_and_groups_take_their_best():
    # one KV head, two query heads: head 0 wants tokens {0}, head 1 wants {3, 4, 5}: mean count 2
    scores = torch.tensor([[9.0, 0, 0, 0, 0, 0], [0, 0, 0, 9.0, 8.5, 8.0]]).view(1, 1, 2, 6)
    rows, fetch = select_tokens(scores, alpha=4.0, max_fetch=6)
    assert rows[fetch].tolist() == [0, 3]  # the top 2 by the best logit any head of the group gives


def test_each_sequence_keeps_its_own_count():
    scores = torch.stack([torch.tensor([9.0, 0, 0, 0]), torch.tensor([9.0, 8.0, 7.0, 0])]).view(2, 1, 1, 4)
    rows, fetch = select_tokens(scores, alpha=4.0, max_fetch=4)
    assert fetch.sum(-1).flatten().tolist() == [1, 3]


def test_unfetchable_tokens_are_never_fetched():
    scores = torch.tensor([5.0, -math.inf, 4.0]).view(1, 1, 1, 3)
    rows, fetch = select_tokens(scores, alpha=math.inf, max_fetch=3)
    assert 1 not in rows[fetch].tolist()


def test_rotary_pairs_give_exact_partial_dot_products():
    """A partial query over whole rotary pairs equals the rotated full query restricted to them."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    torch.manual_seed(0)
    d, D = 8, 16
    weight = torch.randn(2 * d, D)  # two query heads sharing one KV head
    x = torch.randn(1, 1, D)
    angle = torch.randn(1, 1, d // 2)
    cos, sin = torch.cat([angle.cos()] * 2, -1), torch.cat([angle.sin()] * 2, -1)
    full = apply_rotary_pos_emb((x @ weight.T).view(1, 1, 2, d).transpose(1, 2), torch.zeros(1, 1, 1, d), cos, sin)[
        0
    ]  # (1, 2, 1, d)
    columns = pairs_to_columns(torch.tensor([[3, 1]]), d)  # (1, 4)
    partial = partial_query(x, weight.view(1, 2, d, D)[:, :, columns[0]], None, cos[:, :, columns], sin[:, :, columns])
    assert torch.allclose(partial[0, 0, :, 0], full[0, :, 0][:, columns[0]], atol=1e-6)
    assert pair_scores(torch.randn(5, 2, d), torch.randn(5, 1, d)).shape == (1, d // 2)


@pytest.fixture(scope="module")
def opt():
    torch.manual_seed(0)
    config = OPTConfig(
        vocab_size=100,
        hidden_size=64,
        num_hidden_layers=3,
        ffn_dim=128,
        num_attention_heads=4,
        max_position_embeddings=256,
        word_embed_proj_dim=64,
    )
    return attach(OPTForCausalLM(config).eval())


@torch.inference_mode()
def test_skew_folding_leaves_opt_logits_unchanged(opt):
    ids = torch.randint(0, 100, (1, 64))
    before = opt(input_ids=ids).logits
    layer = opt.model.decoder.layers[1].self_attn
    x = torch.randn(1, 64, 64)
    energy_before = layer.q_proj(x).view(64, 4, 16)[:, 0].pow(2).mean(0)
    skew(opt, ids)
    assert (opt(input_ids=ids).logits - before).abs().max() < 1e-4
    energy_after = layer.q_proj(x).view(64, 4, 16)[:, 0].pow(2).mean(0)
    top = lambda e: float(e.sort(descending=True).values[:4].sum() / e.sum())  # noqa: E731
    assert top(energy_after) > top(energy_before)  # skewing concentrates the query in few columns


def test_skewing_refuses_rope_models(tiny):
    with pytest.raises(InfinikvError, match="RoPE"):
        skew(tiny, torch.randint(0, 128, (1, 8)))


def infinigen(real, **params):
    model, tokenizer = real
    policy = make_policy("infinigen", **params)
    policy.prepare(model, tokenizer)
    return policy


@torch.inference_mode()
def test_a_row_that_joins_late_counts_only_its_own_fetches(real, emma_ids):
    model, _ = real
    policy = infinigen(real, alpha=4.0)
    early, late = Batch(model, policy), Batch(model, policy)
    early.feed(emma_ids[:, :100])
    for i in range(100, 106):
        early.step(emma_ids[:, i])
    late.feed(emma_ids[:, :100])
    early.append(late)
    for i in range(106, 108):
        early.step(emma_ids[:, [i, i - 6]].view(2))
    stats = early.cache.layers[2].stats
    assert stats.fetch_steps == [8, 2]
    solo = Batch(model, policy)
    solo.feed(emma_ids[:, :100])
    for i in range(100, 102):
        solo.step(emma_ids[:, i])
    joined, alone = early.cache.transfer_summary([1]), solo.cache.transfer_summary()
    # its own 2 steps, not diluted by the other row's 8 (batched speculation may pick a token more or less)
    assert joined["fetched_fraction"] == pytest.approx(alone["fetched_fraction"], rel=0.2)


@torch.inference_mode()
def test_ledger_bytes_are_tokens_times_bytes_per_token(real, emma_ids):
    model, _ = real
    batch = Batch(model, infinigen(real, alpha=4.0))
    batch.feed(emma_ids[:, :150])
    counts = []
    for layer in batch.cache.layers[2:]:
        layer.observer = lambda positions, mask: counts.append(int(mask.sum(-1).max()))
    for i in range(150, 160):
        batch.step(emma_ids[:, i])
    per_token = 2 * 3 * 64 * 4
    cache = batch.cache
    for layer in cache.layers[2:]:
        stats = layer.stats
        assert stats.fetch_steps == [10]
        fetched = float(stats.fetched[0]) / 10  # tokens per KV head and step
        assert 1 <= fetched <= math.ceil(0.2 * 160)
    assert all(1 < c <= math.ceil(0.2 * 160) + 1 for c in counts)  # fetched rows + the current token
    assert cache.layers[0].stats.fetch_steps == [0]  # dense layers fetch nothing
    summary = cache.transfer_summary()
    assert 0 < summary["fetched_fraction"] <= 0.2
    tokens = sum(float(layer.stats.fetched[0]) / 10 for layer in cache.layers[2:])
    assert summary["tokens_fetched_per_step"] == pytest.approx(tokens)
    assert summary["bytes_moved_per_step"] == pytest.approx(tokens * per_token)
    counts_per_layer, _ = cache.attended()
    assert counts_per_layer[5] == pytest.approx(float(cache.layers[5].stats.fetched[0]) / 10 + 1)


@torch.inference_mode()
def test_offload_fetches_everything_and_is_exact(real, emma_ids):
    model, _ = real
    ids = emma_ids[:, :110]
    full, offload = Batch(model, make_policy("full")), Batch(model, make_policy("offload"))
    for batch in (full, offload):
        batch.feed(ids[:, :100])
    for i in range(100, 110):
        assert (full.step(ids[:, i]) - offload.step(ids[:, i])).abs().max() < 1e-4
    summary = offload.cache.transfer_summary()
    assert summary["fetched_fraction"] == 1.0
    assert summary["bytes_moved_per_step"] == pytest.approx(30 * 104.5 * 2 * 3 * 64 * 4)


@pytest.mark.parametrize("name", ["infinigen", "offload"])
@torch.inference_mode()
def test_overlap_on_and_off_give_identical_outputs(real, emma_ids, name):
    model, _ = real
    ids = emma_ids[:, :140]
    outputs = []
    for no_overlap in (False, True):
        policy = infinigen(real, no_overlap=no_overlap) if name == "infinigen" else make_policy(name, no_overlap=True)
        batch = Batch(model, policy)
        logits = [batch.feed(ids[:, :100])]
        for i in range(100, 140):
            logits.append(batch.step(ids[:, i]))
        outputs.append(torch.stack(logits))
    assert torch.equal(outputs[0], outputs[1])


def test_infinigen_is_prepared_explicitly(tiny):
    with pytest.raises(InfinikvError, match="infinikv prepare"):
        make_policy("infinigen").make_cache(tiny)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(alpha=-1), "alpha"),
        (dict(partial_ratio=0), "partial-ratio"),
        (dict(partial_ratio=1.5), "partial-ratio"),
        (dict(max_fetch=0), "max-fetch"),
        (dict(max_fetch=2), "max-fetch"),
        (dict(dense_layers=-1), "dense-layers"),
    ],
)
def test_bad_infinigen_parameters(kwargs, message):
    with pytest.raises(InfinikvError, match=message):
        make_policy("infinigen", **kwargs)


def test_calibration_ranks_pairs_per_kv_head(tiny):
    prep = calibrate(tiny, torch.randint(0, 128, (1, 32)), progress=False)
    assert len(prep["pair_ranking"]) == 2
    assert [sorted(head) for head in prep["pair_ranking"][0]] == [list(range(8))] * 2  # 2 KV heads, d/2 = 8 pairs


@pytest.mark.parametrize("eviction", ["counter", "lru", "fifo"])
@torch.inference_mode()
def test_bounded_pool(real, emma_ids, eviction):
    """The pool never exceeds its capacity, evicts by its rule and keeps partial keys in step."""
    model, _ = real
    batch = Batch(model, infinigen(real, pool_capacity=64, eviction=eviction))
    layer = batch.cache.layers[5]
    decisions = []
    scores = layer.rule.scores

    def spy(slots, at):
        out = scores(slots, at)
        decisions.append((out.clone(), slots.state["valid"][:, :, : at.length].clone()))
        return out

    layer.rule.scores = spy
    dropped = []
    drop = layer.slots.drop
    layer.slots.drop = lambda victims, take=None: (dropped.append(victims.clone()), drop(victims, take))
    batch.feed(emma_ids[:, :60])
    for i in range(60, 100):
        batch.step(emma_ids[:, i])
        for sparse in batch.cache.layers[2:]:
            assert int(sparse.slots.state["valid"].sum(-1).max()) <= 64 and sparse.slots.held == [min(i + 1, 64)]
            if i >= 64:
                assert sparse.slots.held == [64]
    assert len(decisions) == len(dropped) == 100 - 64
    state = layer.slots.state
    for (score, valid), victims in zip(decisions, dropped, strict=True):
        for head in range(3):  # each KV head drops one entry: one it ranks lowest
            victim = int(victims[0, head, 0])
            assert valid[0, head, victim] and float(score[0, head, victim]) == float(
                score[0, head][valid[0, head]].min()
            )
    columns = layer.fetcher.columns
    stored, held = layer.slots.keys, state["valid"]
    expected = stored.gather(-1, columns[None, :, None, :].expand(1, -1, stored.shape[2], -1))
    assert torch.equal(state["partial"][held], expected[held])


def test_eviction_needs_a_pool():
    with pytest.raises(InfinikvError, match="needs --pool-capacity"):
        make_policy("infinigen", eviction="lru")
    with pytest.raises(InfinikvError, match="eviction"):
        make_policy("infinigen", pool_capacity=0.8, eviction="random")
