import pytest
import torch

from infinikv import Sampling, generate, make_policy
from infinikv.core import left_pad, next_tokens
from infinikv.errors import InfinikvError


def test_left_pad():
    ids, real = left_pad([[1, 2, 3], [4]], pad_id=0)
    assert ids.tolist() == [[1, 2, 3], [0, 0, 4]] and real.tolist() == [[True] * 3, [False, False, True]]


def test_top_p_keeps_only_the_nucleus():
    logits = torch.log(torch.tensor([[0.6, 0.3, 0.05, 0.05]]))
    g = torch.Generator().manual_seed(0)
    picks = {int(next_tokens(logits, Sampling(temperature=1.0, top_p=0.8), g)) for _ in range(200)}
    assert picks == {0, 1}
    assert int(next_tokens(logits, Sampling(), None)) == 0  # greedy


@pytest.mark.parametrize(
    "kwargs, message",
    [(dict(max_new_tokens=0), "max-new-tokens"), (dict(temperature=-1), "temperature"), (dict(top_p=0), "top-p")],
)
def test_bad_sampling(kwargs, message):
    with pytest.raises(InfinikvError, match=message):
        Sampling(**kwargs)


def test_sampling_is_reproducible_with_a_seed(real):
    model, tokenizer = real
    sampling = Sampling(max_new_tokens=12, temperature=0.8, top_p=0.9, seed=3)
    first = generate(model, tokenizer, "Tell me about the sea.", "sink", sampling, chat=True, budget=0.5)
    second = generate(model, tokenizer, "Tell me about the sea.", "sink", sampling, chat=True, budget=0.5)
    assert first.token_ids == second.token_ids and first.new_tokens == 12


def test_streaming_pieces_add_up_to_the_text(real):
    model, tokenizer = real
    pieces = []
    result = generate(
        model,
        tokenizer,
        "The capital of France is",
        make_policy("full"),
        Sampling(max_new_tokens=10),
        on_text=lambda i, p: pieces.append(p),
    )
    assert "".join(pieces) == result.texts[0] and result.texts[0].startswith(" Paris")
    assert result.kv_bytes > 0 and 0 < result.attended_fraction <= 1


def test_empty_prompt(real):
    model, tokenizer = real
    with pytest.raises(InfinikvError, match="empty"):
        generate(model, tokenizer, "   ", "full")


def test_budget_shrinks_what_is_attended(real, emma_ids):
    model, tokenizer = real
    text = tokenizer.decode(emma_ids[0])
    full = generate(model, tokenizer, text, "full", Sampling(max_new_tokens=8))
    sink = generate(model, tokenizer, text, "sink", Sampling(max_new_tokens=8), budget=0.25)
    per_token = 30 * 2 * 3 * 64 * 4
    # the peak of each: the prompt is held whole until the prefill evicts; full then keeps the 7 tokens fed
    assert (
        sink.kv_bytes == sink.prompt_tokens[0] * per_token and full.kv_bytes == (full.prompt_tokens[0] + 7) * per_token
    )
    assert sink.attended_fraction < 0.3 < full.attended_fraction
