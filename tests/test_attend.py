"""The attention functions against the textbook formula: softmax(QK^T * s + mask) V, the mass
each key receives and the newest queries' weights, over several query blocks."""

import pytest
import torch

from infinikv.kv import attend


def textbook(query, key, value, visible, scaling, watched=1, bias=None):
    """Repeat K/V (and a bias (b, h, L)) per query head, materialise every weight at once (b, H, q, L)."""
    g = query.shape[1] // key.shape[1]
    k, v = key.repeat_interleave(g, 1), value.repeat_interleave(g, 1)
    logits = query @ k.transpose(-1, -2) * scaling
    if bias is not None:
        logits = logits + bias.repeat_interleave(g, 1)[:, :, None]
    weights = logits.masked_fill(~visible, float("-inf")).softmax(-1)
    b, heads = query.shape[:2]
    per_kv = weights.view(b, key.shape[1], g, *weights.shape[2:])
    return weights @ v, per_kv.sum((2, 3)), per_kv[:, :, :, -watched:].sum((2, 3))


@pytest.mark.parametrize("watched", [1, 7])  # 7: the newest queries span two blocks
@pytest.mark.parametrize("causal", [False, True])
def test_weighted_attention_is_the_textbook_formula_over_several_blocks(causal, watched):
    torch.manual_seed(0)
    b, heads, kv_heads, q, d = 2, 4, 2, 2 * attend.QUERY_CHUNK + 5, 8
    query, key, value = torch.randn(b, heads, q, d), torch.randn(b, kv_heads, q, d), torch.randn(b, kv_heads, q, d)
    lower = torch.ones(q, q, dtype=torch.bool).tril()
    visible = lower.expand(b, kv_heads, q, q)
    out, mass, last = attend.weighted(query, key, value, None if causal else visible, None, 0.3, causal, watched)
    want_out, want_mass, want_last = textbook(query, key, value, lower, 0.3, watched)
    torch.testing.assert_close(out, want_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(mass, want_mass, atol=1e-3, rtol=1e-5)
    torch.testing.assert_close(last, want_last, atol=1e-5, rtol=1e-5)
    assert mass.sum().item() == pytest.approx(b * heads * q, rel=1e-5)  # every query's weights sum to 1


@pytest.mark.parametrize("pooled_heads", [None, 1, 2])  # every pooled row visible; one mask for both heads; one each
def test_attention_beside_a_pool_is_the_textbook_formula_over_pool_and_own_slots(pooled_heads):
    """``weighted_beside``: a prefill chunk's queries (two blocks) over 300 pooled rows (some hidden,
    all of them for one row's head) and 100 own slots (causal, with a bias): the output over both,
    the mass of the own slots (of the newest 30 queries: both blocks), as the textbook computes
    them over the concatenation."""
    torch.manual_seed(0)
    b, heads, kv_heads, q, d, pooled, own = 2, 4, 2, attend.QUERY_CHUNK + 24, 16, 300, 100
    query = torch.randn(b, heads, q, d)
    key, value = torch.randn(b, kv_heads, pooled + own, d), torch.randn(b, kv_heads, pooled + own, d)
    pooled_visible = None if pooled_heads is None else torch.rand(b, pooled_heads, pooled) > 0.3
    if pooled_heads == 2:
        pooled_visible[1, 0] = False  # this row's first head sees no pooled key: its weights are all its own
    visible = torch.ones(own, own, dtype=torch.bool).tril(own - q)[-q:].expand(b, 1, q, own)
    bias = torch.randn(b, kv_heads, own)
    out, mass, last = attend.weighted_beside(query, key, value, pooled, pooled_visible, visible, bias, 0.3, 30)
    every = torch.ones(b, kv_heads, q, pooled, dtype=torch.bool)
    if pooled_visible is not None:
        every &= pooled_visible[:, :, None]
    every = torch.cat([every, visible.expand(b, kv_heads, q, own)], -1)
    full_bias = torch.nn.functional.pad(bias, (pooled, 0))
    g = heads // kv_heads
    want_out, want_mass, want_last = textbook(query, key, value, every.repeat_interleave(g, 1), 0.3, 30, full_bias)
    torch.testing.assert_close(out, want_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(mass, want_mass[..., pooled:], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(last, want_last[..., pooled:], atol=1e-5, rtol=1e-5)
    if pooled_heads == 2:
        assert mass[1, 0].sum().item() == pytest.approx(g * q, rel=1e-5)  # nothing pooled to share it with
