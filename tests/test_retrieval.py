"""Retrieval under a budget: where the needle goes (``eval.trace``) and the question-aware rule."""

import torch

from infinikv.cache import Evictor, KVLayer
from infinikv.contract import Budget
from infinikv.eval.trace import found_share, needle_mask, oracle_positions
from infinikv.kv.slots import Slots
from infinikv.policies.rules import HeavyHitter, Question


def test_the_needle_share_counts_the_needle_tokens_each_head_attended():
    needle = needle_mask([[(2, 4)], [(0, 1), (5, 6)]], 8, torch.device("cpu"))
    positions = torch.tensor([[[2, 3, 7], [2, 6, 7]], [[0, 5, 1], [0, 5, 1]]])  # (b=2, h=2, K=3)
    counted = torch.tensor([[[True, True, True], [True, True, True]], [[True, True, True], [True, False, True]]])
    share = found_share(needle, positions, counted)
    assert share.tolist() == [[1.0, 0.5], [1.0, 0.5]]  # row 1, head 1: position 5 was not counted


def test_the_oracle_takes_each_heads_true_top_tokens():
    keys = torch.eye(4)[None, None]  # one KV head, four tokens: key i = e_i
    query = torch.tensor([0.0, 5.0, 0.0, 9.0]).view(1, 1, 1, 4)  # weighs token 3, then 1
    valid = torch.tensor([[[True, True, True, True]]])
    position = torch.tensor([[[10, 11, 12, 13]]])
    top, counted = oracle_positions(query, keys, valid, position, torch.tensor([[2]]), 1.0)
    assert sorted(top[counted].tolist()) == [11, 13]
    top, counted = oracle_positions(
        query, keys, valid & torch.tensor([True, True, True, False]), position, torch.tensor([[1]]), 1.0
    )
    assert top[counted].tolist() == [11]  # an invalid slot is never the oracle's


def prefill_then_evict(rule, n: int = 64, capacity: int = 8, planted: int = 5) -> list[int]:
    """One prefill chunk of ``n`` tokens on one head: every query but the last two attends evenly
    to every earlier token but ``planted``; the last two attend to ``planted`` alone. Returns the
    positions kept within ``capacity``."""
    keys = torch.zeros(1, 1, n, 2)
    keys[..., 0] = 1.0
    keys[0, 0, planted] = torch.tensor([0.0, 1.0])
    query = torch.zeros(1, 1, n, 2)
    query[..., 0] = 20.0
    query[0, 0, -2:] = torch.tensor([0.0, 20.0])
    layer = KVLayer(Slots(size=capacity + 1), Evictor(rule, Budget(tokens=capacity), fixed=True))
    layer.begin(n, torch.arange(n)[None], None, [n])
    key, value = layer.update(keys, keys.clone())
    layer.attend(query, key, value, 1.0)
    state = layer.slots.state
    return sorted(state["position"][0, 0][state["valid"][0, 0]].tolist())


def test_the_question_aware_rule_keeps_what_the_last_queries_ask_for_and_h2o_drops_it():
    heavy = prefill_then_evict(HeavyHitter(recent_ratio=0.5))
    question = prefill_then_evict(Question(observation_window=2, pooling=1))
    assert 5 not in heavy and len(heavy) == 8  # the early tokens everyone attended to win
    assert 5 in question and len(question) == 8
    assert {62, 63} <= set(question)  # the observation window itself is kept
