"""``kvzip``: a prompt scored by a second reading of it, before any question, then cut to the budget.
Its scores are checked against transformers' own attention weights of the prompt read twice."""

import copy

import pytest
import torch
from transformers import LlamaForCausalLM

from infinikv import Batch, make_policy
from infinikv.errors import InfinikvError
from infinikv.kv.attend import peak_attention


def test_peak_attention_is_the_most_any_later_query_pays_each_key():
    b, heads, kv_heads, length, d, queries = 2, 4, 2, 50, 8, 20
    keys, every_query = torch.randn(b, kv_heads, length, d), torch.randn(b, heads, length, d)
    logits = every_query @ keys.repeat_interleave(heads // kv_heads, 1).transpose(-1, -2) * 0.3
    probs = logits.masked_fill(torch.ones(length, length, dtype=torch.bool).triu(1), float("-inf")).softmax(-1)
    expected = probs[:, :, -queries:, :40].view(b, kv_heads, 2, queries, 40).amax((2, 3))
    got = peak_attention(every_query[:, :, -queries:], keys, 0.3, upto=40)
    assert torch.allclose(got, expected, atol=1e-6)


@torch.inference_mode()
def test_a_prompt_is_scored_by_its_second_reading(tiny):
    """Each prompt token's score is the most attention transformers' eager attention pays it from
    the queries of the same prompt fed again right after it (max over those queries and a KV
    head's query heads); a batch of two prompts of different lengths scores each as alone."""
    prompts = [torch.randint(0, 128, (30,)).tolist(), torch.randint(0, 128, (22,)).tolist()]
    batch = Batch(tiny, make_policy("kvzip", capacity=64))  # holds every token: nothing evicted
    batch.prefill(prompts, pad_id=0)
    plain = LlamaForCausalLM(copy.deepcopy(tiny.config)).eval()
    plain.load_state_dict(tiny.state_dict(), strict=False)
    plain.set_attn_implementation("eager")
    for row, prompt in enumerate(prompts):
        n = len(prompt)
        attentions = plain(input_ids=torch.tensor([prompt * 2]), output_attentions=True).attentions
        for index, layer in enumerate(batch.cache.layers):
            weights = attentions[index][0, :, n:, :n]  # (H, n, n): the second reading over the first
            expected = weights.reshape(2, 2, n, n).amax((1, 2))  # 2 KV heads of 2 query heads each
            slots = layer.slots
            position, valid = slots.state["position"][row], slots.state["valid"][row]
            score = slots.state["score"][row][valid].view(2, n)
            assert torch.equal(position[valid].view(2, n), torch.arange(n).expand(2, n))
            assert torch.allclose(score, expected, atol=1e-5)


@torch.inference_mode()
def test_the_budget_keeps_the_best_read_tokens_and_later_ones_go_first(tiny):
    prompt = torch.randint(0, 128, (40,)).tolist()
    whole = Batch(tiny, make_policy("kvzip", capacity=64))
    whole.prefill([prompt], 0)
    batch = Batch(tiny, make_policy("kvzip", capacity=16, recent_tokens=4))
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


def test_a_prompt_fed_without_its_reading_is_refused(tiny):
    batch = Batch(tiny, make_policy("kvzip", capacity=8))
    with pytest.raises(InfinikvError, match="reading it twice"):
        batch.feed(torch.randint(0, 128, (1, 20)))
