"""``recall``: a bounded fast tier whose evictions move to InfiniGen's pool."""

import pytest
import torch

from infinikv.core import Batch
from infinikv.policies import make_policy
from test_policies import prepared


def recall(real, **params):
    return prepared(make_policy("recall", **params), *real)


@torch.inference_mode()
def test_recall_equals_full_when_its_pool_fetches_everything(real, emma_ids):
    model, _ = real
    ids = emma_ids[:, :120]
    full = Batch(model, make_policy("full"))
    ours = Batch(model, recall(real, budget=0.2, select="oracle", max_fetch=1.0))
    for batch in (full, ours):
        batch.feed(ids[:, :100])
    for i in range(100, 120):
        assert (full.step(ids[:, i]) - ours.step(ids[:, i])).abs().max() < 1e-4
    layer = ours.cache.layers[3]
    assert layer.slots.held == [20] and layer.pool.held == [100]  # 20% of the prompt, the rest pooled
    _, fractions = ours.cache.attended()
    assert fractions[3] == pytest.approx(1.0)


@torch.inference_mode()
def test_a_prompt_is_read_as_full_reads_it_however_small_the_fast_tier(real, emma_ids):
    """The prompt runs in chunks of the fast tier's capacity and each chunk attends to the pool
    beside it: every position's logits are full's, not a window's; a step that fetches every
    pooled token is full's too."""
    model, _ = real
    ids = emma_ids[:, :140]
    full = Batch(model, make_policy("full"))
    ours = Batch(model, recall(real, capacity=16, select="oracle", max_fetch=1.0))
    expected, got = (batch.extend(ids[:, :120], keep_all=True) for batch in (full, ours))
    assert got.shape == expected.shape and (expected - got).abs().max() < 1e-4
    layer = ours.cache.layers[3]
    assert layer.slots.held == [16] and layer.pool.held == [104]  # read in chunks of 16, the rest pooled
    for i in range(120, 140):
        assert (full.step(ids[:, i]) - ours.step(ids[:, i])).abs().max() < 1e-4
    _, fractions = ours.cache.attended()
    assert fractions[3] == pytest.approx(1.0)  # the steps' share: the prompt's reading is not counted


@torch.inference_mode()
def test_the_fast_tier_never_grows_and_nothing_is_lost(real, emma_ids):
    model, _ = real
    batch = Batch(model, recall(real, capacity=32, update_rule="heavy-hitter"))
    batch.feed(emma_ids[:, :64])
    layers = batch.cache.layers
    allocated = [layer.slots.allocated for layer in layers]
    sizes = []
    for i in range(64, 120):
        batch.step(emma_ids[:, i])
        sizes.append([layer.tier_bytes()["fast"] for layer in layers])
    assert all(s == sizes[0] for s in sizes)
    assert [layer.slots.allocated for layer in layers] == allocated == [33] * len(layers)
    for layer in layers:
        assert layer.slots.held == [32] and layer.pool.held == [120 - 32]
        held = layer.slots.state["position"][0, :, :33].masked_fill(~layer.slots.state["valid"][0, :, :33], -1)
        pooled = layer.pool.state["position"][0, :, : layer.pool.n]
        for head in range(held.shape[0]):  # every position is in exactly one tier
            every = torch.cat([held[head][held[head] >= 0], pooled[head]]).sort().values
            assert torch.equal(every, torch.arange(120))
    tiers = layers[0].tier_bytes()
    assert tiers["pool"] == 88 * layers[0].pool.bytes_per_token() and 0 < tiers["partial"] < tiers["pool"]
    summed = batch.cache.tier_bytes()  # what eval stream and bench generation report per window
    assert summed["fast"] == sum(sizes[-1]) and summed["fast"] + summed["pool"] == batch.cache.held_bytes()


@torch.inference_mode()
def test_rows_join_and_keep_carry_the_pool(tiny):
    from infinikv.cache import join, keep

    policy = prepared(make_policy("recall", budget=0.5), tiny)
    one, two = Batch(tiny, policy), Batch(tiny, policy)
    one.feed(torch.randint(0, 128, (1, 20)))
    two.feed(torch.randint(0, 128, (1, 12)))
    join(one.cache, two.cache)
    layer = one.cache.layers[1]
    assert layer.slots.held == [10, 6] and layer.pool.held == [10, 6]
    assert layer.pool.keys.shape[0] == layer.pool.state["partial"].shape[0] == 2
    keep(one.cache, [1])
    assert layer.pool.held == [6] and layer.pool.keys.shape[0] == layer.pool.state["partial"].shape[0] == 1
