"""The conversation store: every policy's cache written and read back continues as the cache
itself does (exactly when stored lossless), and a bad entry is a fresh prefill, never an error."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from infinikv import Batch, attach, make_policy, policy_names
from infinikv.policies import REGISTRY
from infinikv.policies.calibration import calibrate
from infinikv.serve.conversations import Conversation
from infinikv.serve.store import ConversationStore


def policy_of(name: str, model):
    policy = make_policy(name, capacity=24) if REGISTRY[name].takes_budget else make_policy(name)
    if policy.needs_preparation:
        policy.prep = calibrate(model, torch.randint(0, model.config.vocab_size, (1, 64)), progress=False)
    return policy


def conversation(model, policy, tokens: list[int]) -> Conversation:
    batch = Batch(model, policy)
    batch.prefill([tokens[:40]], 0)
    for token in tokens[40:]:
        batch.step(torch.tensor([token]))
    return Conversation("key", tokens, batch, batch.cache.held_bytes())


def continued(batch: Batch, tokens: list[int]) -> torch.Tensor:
    """The logits of decoding ``tokens`` from ``batch`` on."""
    return torch.stack([batch.step(torch.tensor([t]))[0] for t in tokens])


@pytest.mark.parametrize("name", policy_names())
@torch.inference_mode()
def test_every_policy_is_restored_as_it_was(tiny, tmp_path, name):
    torch.manual_seed(0)
    tokens = torch.randint(0, 128, (60,)).tolist()
    after = torch.randint(0, 128, (12,)).tolist()
    policy = policy_of(name, tiny)
    store = ConversationStore(tmp_path / "lossless", 2**30, "fp32", tiny)
    stored = conversation(tiny, policy, tokens)
    store.put(stored)
    entry = store.match("key", tokens + after)
    assert entry is not None and entry.tokens == len(tokens) and store.writes == 1
    restored = store.restore(entry, policy)
    assert restored is not None and store.restores == 1 and store.size() == (0, 0)
    expected = continued(stored.batch, after)
    assert torch.equal(continued(restored, after), expected)

    lossy = ConversationStore(tmp_path / "int8", 2**30, "int8", tiny)
    again = conversation(tiny, policy, tokens)
    lossy.put(again)
    near = continued(lossy.restore(lossy.match("key", tokens + after), policy), after)
    assert (near - expected).abs().max() < 0.05 * expected.abs().max()


@torch.inference_mode()
def test_int8_holds_about_a_quarter_of_the_kv_bytes(tmp_path):
    """With heads of 64 dims, as the bundled models have (a scale per 64 values)."""
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=128,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    model = attach(LlamaForCausalLM(config).eval())
    stored = conversation(model, make_policy("full"), torch.randint(0, 128, (300,)).tolist())
    sizes = {}
    for kv in ("fp32", "int8"):
        store = ConversationStore(tmp_path / kv, 2**30, kv, model)
        store.put(stored)
        sizes[kv] = store.size()[1]
    assert sizes["fp32"] > stored.batch.cache.allocated_bytes() and sizes["int8"] < 0.3 * sizes["fp32"]


@torch.inference_mode()
def test_a_match_needs_the_key_the_prefix_and_the_model(tiny, tmp_path):
    tokens = list(range(50))
    store = ConversationStore(tmp_path, 2**30, "int8", tiny)
    store.put(conversation(tiny, make_policy("full"), tokens))
    assert store.match("key", tokens + [1]) is not None
    assert store.match("other", tokens + [1]) is None  # another owner, policy or sampling
    assert store.match("key", tokens) is None  # nothing new to feed
    assert store.match("key", [7] + tokens) is None
    reopened = ConversationStore(tmp_path, 2**30, "int8", tiny)  # a restart: the index is on disk
    assert reopened.match("key", tokens + [1]) is not None
    other_model = tiny.config.to_dict() | {"rms_norm_eps": 1e-3}
    tiny.config.rms_norm_eps, saved = other_model["rms_norm_eps"], tiny.config.rms_norm_eps
    try:
        assert ConversationStore(tmp_path, 2**30, "int8", tiny).match("key", tokens + [1]) is None
    finally:
        tiny.config.rms_norm_eps = saved


@pytest.mark.parametrize("damage", ["truncate", "flip", "delete"])
@torch.inference_mode()
def test_a_damaged_entry_is_a_warning_and_a_fresh_prefill(tiny, tmp_path, caplog, damage):
    tokens = list(range(50))
    store = ConversationStore(tmp_path, 2**30, "int8", tiny)
    store.put(conversation(tiny, make_policy("full"), tokens))
    entry = store.match("key", tokens + [1])
    path = tmp_path / f"{entry.id}.safetensors"
    data = path.read_bytes()
    if damage == "truncate":
        path.write_bytes(data[: len(data) // 2])
    elif damage == "flip":
        path.write_bytes(data[:-10] + bytes(10))
    else:
        path.unlink()
    assert store.restore(entry, make_policy("full")) is None
    assert store.failures == 1 and "not restored" in caplog.text
    assert store.match("key", tokens + [1]) is None  # the bad entry is gone


@torch.inference_mode()
def test_the_disk_is_bounded_least_recently_used_out_first(tiny, tmp_path):
    store = ConversationStore(tmp_path, 2**30, "int8", tiny)
    first = conversation(tiny, make_policy("full"), list(range(50)))
    store.put(first)
    one = store.size()[1]
    store.max_bytes = int(2.5 * one)
    for start in (30, 60):
        store.put(conversation(tiny, make_policy("full"), list(range(start, start + 50))))
    assert store.size() == (2, 2 * one) and store.evicted == 1
    assert store.match("key", list(range(51))) is None  # the oldest went
    assert store.match("key", list(range(60, 111))) is not None
    assert len(list(tmp_path.glob("*.safetensors"))) == 2
