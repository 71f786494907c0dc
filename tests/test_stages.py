"""The cache's stages, each on its own (statistics, eviction, two tiers, rows), the adapter's
accounting, and a fetch policy a newcomer composes from them (``examples/topk_fetch.py``)."""

import sys
from pathlib import Path

import pytest
import torch

from infinikv import Batch, make_policy
from infinikv.cache import Evictor, KVLayer, Selection, TwoTier, join, keep
from infinikv.cache.stats import Clock, Stats
from infinikv.contract import Budget
from infinikv.kv.layout import is_slot_last, put
from infinikv.kv.slots import Slots, StateSpec
from infinikv.kv.tiers import FastTier
from infinikv.policies.rules import HeavyHitter, SinkRecent

sys.path.insert(0, str(Path(__file__).parents[1] / "examples"))
from topk_fetch import TopKFetch  # noqa: E402


def filled(rows: int, tokens: int, heads: int = 2, d: int = 4, size: int | None = None, static: bool = False) -> Slots:
    """Slots holding ``tokens`` tokens per row at positions 0.., keys = values = random."""
    slots = Slots(size=size, static=static)
    slots.add_state("score", HeavyHitter.state["score"])
    write = slots.plan(tokens, [tokens] * rows)
    keys = torch.randn(rows, heads, tokens, d)
    slots.write(write, keys, keys.clone(), torch.arange(tokens).expand(rows, tokens), None)
    return slots


def test_stats_count_per_row_and_follow_rows():
    stats = Stats()
    stats.rows(2)
    stats.hold([5, 3])
    stats.hold([4, 6])
    assert stats.peak == [5, 6]
    stats.attend([4, 6], [8, 12])
    stats.attend([4, 6], [8, 12])
    assert stats.steps == [2, 2] and stats.keys == [8, 12] and stats.fraction == [1.0, 1.0]
    stats.fetch(torch.tensor([2.0, 3.0]), [4, 6], [8, 12])  # counted on the device
    stats.fetch([1.0, 1.0], [4, 6], [8, 12], beside=[2, 3])  # known on the host
    totals = stats.totals()
    assert stats.fetch_steps == [2, 2] and totals["fetched"] == [3.0, 4.0]
    assert totals["fetched_fraction"] == pytest.approx([0.5 + 1 / 4, 0.5 + 1 / 6])
    assert totals["attended"] == pytest.approx([3.0 + 3.0, 4.0 + 4.0])
    assert totals["attended_fraction"] == pytest.approx([3 / 8 + 3 / 8, 4 / 12 + 4 / 12])
    other = Stats()
    other.rows(1)
    other.hold([9])
    stats.extend(other)
    assert stats.peak == [5, 6, 9] and stats.totals()["fetched"] == [3.0, 4.0, 0.0]
    stats.select([2, 0])
    assert stats.peak == [9, 5] and stats.totals()["fetched"] == [0.0, 3.0]


def test_evictor_plans_each_rows_excess_on_the_host():
    slots = filled(2, 10)
    slots.held = [10, 7]  # row 1 holds fewer (it had padding)
    evictor = Evictor(SinkRecent(sinks=1), Budget(tokens=6))
    eviction = evictor.plan(slots, [10, 7], [0, 0], torch.device("cpu"))
    assert eviction.count == 4 and not eviction.on_device and not eviction.uniform
    assert slots.held == [6, 6]  # counted as gone before the device drops them
    assert evictor.take.tolist() == [[[True] * 4], [[True, False, False, False]]]
    evictor.evict(slots, torch.tensor([9, 9]), eviction, 10)
    valid, position = slots.state["valid"], slots.state["position"]
    assert position[0, 0][valid[0, 0]].tolist() == [0, 5, 6, 7, 8, 9]  # the sink and the newest five
    assert int(valid[1, 0].sum()) == 9  # one victim only in the row over by one


def test_a_fixed_evictor_settles_its_capacity_once_and_a_static_one_decides_on_the_device():
    slots = Slots()
    evictor = Evictor(SinkRecent(), Budget(fraction=0.5), fixed=True)
    evictor.expect([40, 20], slots)
    assert evictor.capacities == [20, 10] and slots.size == 21
    evictor.expect([100, 100], slots)
    assert evictor.capacities == [20, 10]  # settled once, by the prompt
    static = filled(1, 5, size=5, static=True)
    eviction = Evictor(SinkRecent(), Budget(tokens=4)).plan(static, [5], [4], torch.device("cpu"))
    assert eviction.count == 1 and eviction.on_device  # one victim, dropped where the device finds the row over


def test_a_slot_last_state_keeps_its_layout_and_its_values():
    """A state stored slot-last (partial keys, read by one product over every slot) stays so when
    the storage grows, when rows join or are kept, and holds what was written."""

    def with_partial() -> Slots:
        slots = Slots()
        slots.add_state("partial", StateSpec(torch.float32, (3,), slot_last=True))
        return slots

    def write(slots: Slots, q: int) -> torch.Tensor:
        kv, position = torch.randn(1, 2, q, 4), torch.zeros(1, q, dtype=torch.long)
        new = torch.randn(1, 2, q, 3)
        where = slots.write(slots.plan(q, [q]), kv, kv, position, None)
        put(slots.state["partial"], where, new)
        return new

    slots = with_partial()
    written = [write(slots, q) for q in (5, 20, 1)]  # the second write grows the storage
    partial = slots.state["partial"]
    assert is_slot_last(partial) and partial.stride(2) == 1 and slots.allocated >= 26
    assert torch.equal(partial[:, :, :26], torch.cat(written, 2))
    other = with_partial()
    write(other, 3)
    for change, rows in ((lambda: slots.append_rows(other), slice(0, 1)), (lambda: slots.keep_rows([0]), slice(None))):
        change()
        partial = slots.state["partial"]
        assert is_slot_last(partial) and torch.equal(partial[rows, :, :26], torch.cat(written, 2))


def test_the_fast_tier_takes_the_chosen_rows_then_the_new_tokens():
    slots = filled(2, 10, heads=3)
    rows = torch.randint(0, 10, (2, 3, 4))
    fast = FastTier()
    fast.fetch(slots, rows, 4, False, torch.device("cpu"), room=1)
    new = torch.randn(2, 3, 1, 4)
    keys, values = fast.with_new(4, new, new)
    expected = slots.keys.gather(2, rows[..., None].expand(-1, -1, -1, 4))
    assert torch.equal(keys, torch.cat([expected, new], 2)) and torch.equal(values, keys)


class Every(Selection):
    """Chooses slots 0 and 2 of every row and head; slot 2 counts only in row 0."""

    def choose(self, slots, x, rope, positions, stored, held):
        rows = torch.tensor([0, 2]).expand(2, 2, 2)
        return rows, torch.tensor([[True, True], [True, False]])[:, None, :].expand(2, 2, 2)


def test_two_tiers_copy_the_chosen_rows_and_mask_the_rest():
    slots = filled(2, 4)
    tiers = TwoTier(Every())
    per_row = tiers.speculate(slots, torch.zeros(2, 1, 8), None, torch.tensor([[4], [4]]), 4, [4, 4], Clock())
    assert per_row.tolist() == [2.0, 1.0]
    keys, _ = tiers.with_new(torch.ones(2, 2, 1, 4), torch.ones(2, 2, 1, 4))
    assert torch.equal(keys[:, :, :2], slots.keys[:, :, [0, 2]]) and torch.equal(keys[:, :, 2], torch.ones(2, 2, 4))
    assert tiers.visibility()[:, 0, 0].tolist() == [[True, True, True], [True, False, True]]  # + the new token
    tiers.done()
    assert not tiers.started
    every = TwoTier(Selection()).start(slots, None, None, [4, 3], 4, overlap=False)  # fetch all: row 1 has a hole
    assert every == [4.0, 3.0]


@torch.inference_mode()
def test_peak_counts_the_prompt_before_eviction_and_the_decode_token(tiny):
    """A bounded cache holds the whole prompt until the prefill evicts, then its capacity plus the
    decode step's new token: that is its peak, and what admission reserves (worst_case_bytes)."""
    policy = make_policy("bct", capacity=8)
    batch = Batch(tiny, policy)
    batch.feed(torch.randint(0, 128, (1, 30)))
    layer = batch.cache.layers[0]
    assert layer.stats.peak == [30] and layer.slots.held == [8]
    batch.step(torch.tensor([3]))
    assert layer.stats.peak == [30]
    fresh = Batch(tiny, policy)
    fresh.feed(torch.randint(0, 128, (1, 8)))
    fresh.step(torch.tensor([3]))
    assert fresh.cache.layers[0].stats.peak == [9]  # capacity + the step's token, before its eviction
    assert fresh.cache.peak_bytes() == policy.worst_case_bytes(tiny.config, 8, 1)
    assert batch.cache.peak_bytes() == policy.worst_case_bytes(tiny.config, 30, 1)


@torch.inference_mode()
def test_rows_join_and_keep_carry_every_stage(tiny):
    policy = make_policy("h2o", budget=0.5)
    one, two = Batch(tiny, policy), Batch(tiny, policy)
    one.feed(torch.randint(0, 128, (1, 20)))
    two.feed(torch.randint(0, 128, (1, 12)))
    join(one.cache, two.cache)
    layer = one.cache.layers[1]
    assert layer.seen == [20, 12] and layer.slots.held == [10, 6] and layer.stats.peak == [20, 12]
    keep(one.cache, [1])
    assert layer.seen == [12] and layer.slots.held == [6] and layer.stats.peak == [12]
    assert layer.slots.keys.shape[0] == 1 and isinstance(layer.evictor, Evictor)


@torch.inference_mode()
def test_a_newcomers_fetch_policy_composes_from_the_parts(tiny):
    """``examples/topk_fetch.py`` (55 lines, no edit to the adapter): fetching every token it is
    exactly ``full``; with a small ``k`` it attends to the pinned tokens plus k per KV head."""
    ids = torch.randint(0, 128, (1, 60))
    policies = (make_policy("full"), TopKFetch(k=100), TopKFetch(resident=2, k=5))
    full, everything, few = (Batch(tiny, p) for p in policies)
    chosen = []
    for layer in few.cache.layers:
        assert isinstance(layer, KVLayer) and layer.tiers is not None
        layer.observer = lambda query, scaling, positions, visible: chosen.append(int(visible.sum(-1).max()))
    for batch in (full, everything, few):
        batch.feed(ids[:, :40])
    chosen.clear()  # the prompt attended to itself whole
    for i in range(40, 60):
        expected = full.step(ids[:, i])
        assert torch.allclose(everything.step(ids[:, i]), expected, atol=1e-5)
        few.step(ids[:, i])
    assert chosen and max(chosen) == 2 * 2 + 5 + 1  # pinned, top-k and the current token
    with pytest.raises(Exception, match="k"):
        TopKFetch(k=0)


def test_admission_and_kv_memory_count_the_models_dtype(tiny):
    """What a request reserves and what ``--kv-memory`` buys are in the dtype the model runs in."""
    import copy

    half = copy.deepcopy(tiny.config)
    half.dtype = torch.bfloat16
    for name, params in (("full", {}), ("h2o", {"capacity": 16}), ("quant", {"bits": 4})):
        policy = make_policy(name, **params)
        fp32, bf16 = policy.worst_case_bytes(tiny.config, 100, 10), policy.worst_case_bytes(half, 100, 10)
        assert bf16 < fp32 and (name == "quant" or 2 * bf16 == fp32)
    bounded = make_policy("bct", kv_memory="1MiB")
    assert bounded.resolve(half).tokens >= 2 * bounded.resolve(tiny.config).tokens
