"""The attention functions against the textbook formula: softmax(QK^T * s + mask) V, the mass
each key receives and the newest queries' weights, over several query blocks."""

import pytest
import torch

from infinikv.kv import attend


def textbook(query, key, value, visible, scaling, watched=1):
    """Repeat K/V per query head, materialise every weight at once (b, H, q, L)."""
    g = query.shape[1] // key.shape[1]
    k, v = key.repeat_interleave(g, 1), value.repeat_interleave(g, 1)
    weights = (query @ k.transpose(-1, -2) * scaling).masked_fill(~visible, float("-inf")).softmax(-1)
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
