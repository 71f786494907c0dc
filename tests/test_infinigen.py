"""InfiniGen: selection semantics, calibration, the two tiers and their ledger, overlap."""

import math
from itertools import pairwise

import pytest
import torch
from transformers import OPTConfig, OPTForCausalLM

from infinikv import Batch, attach, make_policy
from infinikv.contract import Preparing
from infinikv.errors import InfinikvError
from infinikv.eval.recall import attention_recall
from infinikv.kv.speculation import pair_scores, pairs_to_columns, partial_query, select_by_mass, select_tokens
from infinikv.policies.calibration import MASS_GRID, calibrate, chosen_mass
from infinikv.preparation import ensure_prepared


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


def logits(*probs: float) -> torch.Tensor:
    return torch.tensor(probs).log()


def test_mass_rule_takes_the_fewest_tokens_reaching_the_mass():
    scores = logits(0.5, 0.3, 0.15, 0.05).view(1, 1, 1, 4)
    cap = [4]
    for mass, expected in ((0.5, [0]), (0.7, [0, 1]), (0.85, [0, 1, 2]), (1.0, [0, 1, 2, 3])):
        rows, fetch = select_by_mass(scores, mass, cap)
        assert sorted(rows[fetch].tolist()) == expected
    rows, fetch = select_by_mass(scores, 0.85, [2])  # the cap wins
    assert rows[fetch].tolist() == [0, 1]


def test_residents_come_first_and_their_mass_counts():
    scores = logits(0.5, 0.3, 0.15, 0.05).view(1, 1, 1, 4)
    resident = torch.tensor([False, False, False, True]).view(1, 1, 4)
    rows, fetch = select_by_mass(scores, 0.54, [4], resident)
    assert rows[fetch].tolist() == [0, 3]  # 0.05 (resident) + 0.5 reaches 0.54
    rows, fetch = select_by_mass(scores, 0.56, [4], resident)
    assert rows[fetch].tolist() == [0, 1, 3]


def test_mass_rule_counts_per_kv_head_over_its_group_mean():
    # KV head 0: both query heads peak on token 0; KV head 1: its two heads disagree (1 and 2)
    head0 = torch.stack([logits(0.97, 0.01, 0.01, 0.01)] * 2)
    head1 = torch.stack([logits(0.01, 0.97, 0.01, 0.01), logits(0.01, 0.01, 0.97, 0.01)])
    rows, fetch = select_by_mass(torch.stack([head0, head1])[None], 0.9, [4])
    assert rows[0, 0][fetch[0, 0]].tolist() == [0] and rows[0, 1][fetch[0, 1]].tolist() == [1, 2]


def test_mass_rule_never_fetches_unfetchable_tokens():
    scores = torch.tensor([5.0, -math.inf, 4.0]).view(1, 1, 1, 3)
    rows, fetch = select_by_mass(scores, 1.0, [3])
    assert 1 not in rows[fetch].tolist() and int(fetch.sum()) == 2


@pytest.mark.parametrize("resident", ["none", "mask", "first_and_last"])
def test_taking_the_cap_picks_the_sorted_top_k_set(resident):
    """The unranked top-k of the cap rule (``mass`` 1) against a full sort of the same weights, on
    logits with no ties (a tie at the k-th weight could go either way): the same set of rows, and
    only unfetchable tokens left out; residents given as a mask or as the first and last slots."""
    torch.manual_seed(0)
    scores = torch.randn(2, 3, 2, 500) * 4
    scores[:, :, :, 7] = -math.inf  # never fetched
    mask = (torch.arange(500) < 4) | (torch.arange(500) >= 490)
    given = {"none": None, "mask": mask, "first_and_last": (4, 10)}[resident]
    rows, fetch = select_by_mass(scores, 1.0, [60, 60], given)
    probs = scores.softmax(-1).mean(2)
    rank = probs if given is None else probs + 2 * mask
    expected = rank.argsort(-1, descending=True)[..., :60].sort(-1).values
    assert torch.equal(rows.sort(-1).values, expected) and bool(fetch.all())
    few = scores.clone()
    few[..., 50:] = -math.inf  # 49 fetchable tokens (0-49 but 7), a cap of 60: the rest are masked out
    rows, fetch = select_by_mass(few, 1.0, [60, 60])
    assert rows.shape[-1] == 60 and (fetch.sum(-1) == 49).all()
    assert bool((rows[fetch] < 50).all()) and not bool((rows[fetch] == 7).any())


def test_residents_as_first_and_last_slots_count_once_when_they_overlap():
    """Fewer tokens than ``first + recent``: every token is resident once, as with the mask (a
    token counted twice would outrank the others)."""
    torch.manual_seed(0)
    scores = torch.randn(1, 3, 3, 17)
    slot = torch.arange(17)
    for first, recent in ((4, 32), (4, 5), (0, 3), (3, 0)):
        rows, _ = select_by_mass(scores, 1.0, [2], (first, recent), masked=False)
        expected, _ = select_by_mass(scores, 1.0, [2], (slot < first) | (slot >= 17 - recent))
        assert torch.equal(rows.sort(-1).values, expected.sort(-1).values), (first, recent)


def test_with_nothing_masked_every_row_counts_even_a_weight_that_rounds_to_zero():
    scores = torch.tensor([0.0, -200.0, -1.0, -2.0]).view(1, 1, 1, 4)  # token 1's weight underflows to 0
    rows, fetch = select_by_mass(scores, 1.0, [4], masked=False)
    assert sorted(rows[0, 0].tolist()) == [0, 1, 2, 3] and fetch is None
    rows, fetch = select_by_mass(scores, 1.0, [4])  # masked: fetchable tokens count, whatever their weight
    assert bool(fetch.all())
    rows, fetch = select_by_mass(scores, 1.0, [3], masked=False)  # the cap: token 1 is the one left out
    assert sorted(rows[0, 0].tolist()) == [0, 2, 3]


def test_the_mass_rule_copies_its_cap_and_masks_what_it_does_not_want():
    scores = logits(0.5, 0.3, 0.15, 0.05).view(1, 1, 1, 4)
    rows, fetch = select_by_mass(scores, 0.7, [3])
    assert rows.shape[-1] == 3 and rows[fetch].tolist() == [0, 1]


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


def infinigen(real, **params):
    model, tokenizer = real
    policy = make_policy("infinigen", **params)
    ensure_prepared(policy, model, tokenizer)
    return policy


@torch.inference_mode()
def test_a_row_that_joins_late_counts_only_its_own_fetches(real, emma_ids):
    model, _ = real
    policy = infinigen(real, select="alpha", alpha=4.0)
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
    batch = Batch(model, infinigen(real, select="alpha", alpha=4.0, dense_layers=2))
    batch.feed(emma_ids[:, :150])
    counts = []
    for layer in batch.cache.layers[2:]:
        layer.observer = lambda query, scaling, positions, mask: counts.append(int(mask.sum(-1).max()))
    for i in range(150, 160):
        batch.step(emma_ids[:, i])
    per_token = 2 * 3 * 64 * 4
    cache = batch.cache
    for layer in cache.layers[2:]:
        stats = layer.stats
        assert stats.fetch_steps == [10]
        fetched = stats.totals()["fetched"][0] / 10  # tokens per KV head and step
        assert 1 <= fetched <= math.ceil(0.2 * 160)
    assert all(1 < c <= math.ceil(0.2 * 160) + 1 for c in counts)  # fetched rows + the current token
    assert cache.layers[0].stats.fetch_steps == [0]  # dense layers fetch nothing
    summary = cache.transfer_summary()
    assert 0 < summary["fetched_fraction"] <= 0.2
    tokens = sum(layer.stats.totals()["fetched"][0] / 10 for layer in cache.layers[2:])
    assert summary["tokens_fetched_per_step"] == pytest.approx(tokens)
    assert summary["bytes_moved_per_step"] == pytest.approx(tokens * per_token)
    counts_per_layer, _ = cache.attended()
    assert counts_per_layer[5] == pytest.approx(cache.layers[5].stats.totals()["fetched"][0] / 10 + 1)


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
        (dict(select="best"), "select"),
        (dict(coverage=1.0), "coverage"),
        (dict(mass=1.5), "mass"),
        (dict(keep_recent=-1), "keep-recent"),
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


def test_calibration_ranks_pairs_per_kv_head_and_measures_coverage(tiny):
    prep = calibrate(tiny, torch.randint(0, 128, (1, 32)), progress=False)
    assert len(prep["pair_ranking"]) == 2
    assert [sorted(head) for head in prep["pair_ranking"][0]] == [list(range(8))] * 2  # 2 KV heads, d/2 = 8 pairs
    coverage, fetched = prep["coverage"][1], prep["fetched"][1]
    assert len(coverage) == len(fetched) == len(MASS_GRID)
    # a larger speculated mass fetches more and covers more (up to the 4-digit rounding)
    assert all(a <= b + 1e-4 for a, b in pairwise(coverage)) and 0 < coverage[0] <= coverage[-1] <= 1.0001
    at = torch.arange(16, 32).float()  # the decode positions the curve averages over, 16 tokens fetchable or more
    cap = float(((at * 0.2).ceil() / at).mean())
    assert all(a <= b + 1e-4 for a, b in pairwise(fetched)) and 0 < fetched[-1] <= cap + 1e-4
    target = (coverage[0] + coverage[-1]) / 2
    smallest = next(m for m, c in zip(MASS_GRID, coverage, strict=True) if c >= target)
    assert chosen_mass(prep, 1, target) == smallest
    assert chosen_mass(prep, 1, 2.0) == 1.0  # out of reach: the cap


@torch.inference_mode()
def test_the_oracle_attends_to_the_true_top_tokens(real, emma_ids):
    """At the first decode step layer 0's input is the full model's, so the oracle's choice there
    covers exactly as much as the recall's oracle of the same count, and the speculation (from
    the same input, layer 0 having no layer before it) at most that. Later layers see inputs
    that already differ from the full model's."""
    model, _ = real
    oracle = infinigen(real, select="oracle", max_fetch=0.1)
    speculated = infinigen(real, select="mass", coverage=0.9)
    first, guessed = (attention_recall(model, emma_ids[:, :191], p, 190, progress=False) for p in (oracle, speculated))
    assert first["recall_per_layer"][0] == pytest.approx(first["oracle_recall_per_layer"][0], abs=1e-4)
    assert guessed["recall_per_layer"][0] <= guessed["oracle_recall_per_layer"][0] + 1e-4
    assert 0.1 < first["attended_fraction"] < 0.11  # ceil(0.1 x 190) fetched and the current token, of 191


@pytest.mark.parametrize("eviction", ["counter", "lru", "fifo"])
@torch.inference_mode()
def test_bounded_pool(real, emma_ids, eviction):
    """The pool never exceeds its capacity, evicts by its rule and keeps partial keys in step."""
    model, _ = real
    batch = Batch(model, infinigen(real, pool_capacity=64, eviction=eviction))
    layer = batch.cache.layers[5]
    decisions = []
    scores = layer.evictor.rule.scores

    def spy(slots, at):
        out = scores(slots, at)
        decisions.append((out.clone(), slots.state["valid"][:, :, : at.length].clone()))
        return out

    layer.evictor.rule.scores = spy
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
    columns = layer.tiers.selection.columns
    stored, held = layer.slots.keys, state["valid"]
    expected = stored.gather(-1, columns[None, :, None, :].expand(1, -1, stored.shape[2], -1))
    assert torch.equal(state["partial"][held], expected[held])


def test_options_of_another_selection_rule_are_refused():
    with pytest.raises(InfinikvError, match="--alpha applies to --select alpha"):
        make_policy("infinigen", alpha=8)
    with pytest.raises(InfinikvError, match="--coverage applies to --select mass"):
        make_policy("infinigen", select="alpha", coverage=0.9)
    with pytest.raises(InfinikvError, match="not both"):
        make_policy("infinigen", select="mass", coverage=0.9, mass=0.9)
    assert make_policy("infinigen", select="alpha", alpha=8).params["alpha"] == 8


def test_eviction_needs_a_pool():
    with pytest.raises(InfinikvError, match="needs --pool-capacity"):
        make_policy("infinigen", eviction="lru")
    with pytest.raises(InfinikvError, match="eviction"):
        make_policy("infinigen", pool_capacity=0.8, eviction="random")


def test_a_calibration_records_its_options_and_is_redone_for_others(tiny_folder, tmp_path):
    """The coverage curves depend on the partial ratio, the cap and the residents: a calibration
    records them, a policy with other values gets its own, and one whose record differs is redone."""
    import json
    import shutil

    from infinikv import load_model

    folder = shutil.copytree(tiny_folder, tmp_path / "model")
    for saved in folder.glob("infinikv-infinigen*.json"):  # what other tests of the session calibrated
        saved.unlink()
    model, tokenizer = load_model(str(folder))
    default = make_policy("infinigen")
    assert "calibrated" in ensure_prepared(default, model, tokenizer, Preparing(tokens=64))
    path = folder / "infinikv-infinigen.json"
    fit = {"partial_ratio": 0.5, "max_fetch": 0.1, "keep_first": 4, "keep_recent": 32}
    assert json.loads(path.read_text())["fit"] == fit
    assert ensure_prepared(make_policy("infinigen"), model, tokenizer) is None  # the same options: loaded
    other = make_policy("infinigen", select="mass", partial_ratio=0.3)
    assert "calibrated" in ensure_prepared(other, model, tokenizer, Preparing(tokens=64))
    assert other.prep["fit"] == {**fit, "partial_ratio": 0.3}
    assert json.loads((folder / "infinikv-infinigen-r0.3-f0.1-4-32.json").read_text())["fit"] == other.prep["fit"]
    assert json.loads(path.read_text())["fit"] == fit  # the default's is untouched
    # a rule that reads no curves takes any calibration: the default's
    assert ensure_prepared(make_policy("infinigen", partial_ratio=0.3), model, tokenizer) is None
    edited = json.loads(path.read_text())
    edited["fit"]["max_fetch"] = 0.5  # a record that does not match the options asked for
    path.write_text(json.dumps(edited))
    assert "calibrated" in ensure_prepared(make_policy("infinigen"), model, tokenizer, Preparing(tokens=64))
    assert json.loads(path.read_text())["fit"] == fit
