"""The decode core: one loop for every caller, no host syncs in a steady decode step, compiled
decode steps equal to eager ones, incremental detokenization, several batches in one forward."""

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from infinikv import Batch, make_policy
from infinikv.core import Sampling, sample, step_together
from infinikv.eval.prompt_reads import Reads, prefill_shared
from infinikv.policies import REGISTRY
from infinikv.text import Detokenizer
from test_policies import ALL, prepared, whole


def run(batch: Batch, prompts, steps: list[int], chunk: int | None = None, tail: list[int] | None = None):
    """Prefill, decode ``steps`` (the same token in every row), then feed a chunk: every logit."""
    out = [batch.prefill(prompts, pad_id=0, chunk=chunk)]
    for token in steps:
        out.append(batch.step(torch.full((len(prompts),), token)))
    if tail:
        out.append(batch.feed(torch.tensor([tail] * len(prompts))))
    return torch.stack(out)


@pytest.mark.parametrize("name", ALL)
@torch.inference_mode()
def test_padded_chunked_batches_match_full(tiny, name):
    """Left padding, a prefill in chunks, decode steps, then a chunk after them: the same logits
    as ``full`` whenever the budget covers everything."""
    prompts = [list(range(1, 30)), list(range(40, 51))]
    steps, tail = [7, 8, 9, 10], [11, 12, 13]
    reference = run(Batch(tiny, make_policy("full")), prompts, steps, chunk=8, tail=tail)
    ours = run(Batch(tiny, whole(name, tiny)), prompts, steps, chunk=8, tail=tail)
    assert (ours - reference).abs().max() < (0.005 if name == "quant" else 1e-5)


SHARERS = {"full", "infinigen", "offload"}  # their caches hold a prompt's K/V as full's


@pytest.mark.parametrize("name", ALL)
@torch.inference_mode()
def test_a_prompt_read_once_serves_every_cache_that_reads_it_as_full(tiny, name):
    """Padded prompts read by ``full``: a cache that reads prompts as ``full`` does takes their K/V
    and decodes exactly as after reading them itself (every logit equal); any other reads its own."""
    prompts, steps = [list(range(1, 30)), list(range(40, 51))], [7, 8, 9, 10]
    reads = Reads()
    _, took = prefill_shared(Batch(tiny, make_policy("full")), prompts, 0, reads)
    assert not took and len(reads.full) == 1
    policy = prepared(make_policy(name, capacity=16) if REGISTRY[name].takes_budget else make_policy(name), tiny)
    own, shared = Batch(tiny, policy), Batch(tiny, policy)
    logits, took = prefill_shared(shared, prompts, 0, reads)
    assert took == (name in SHARERS) == shared.cache.reads_as_full
    for token in steps:
        logits = torch.cat([logits, shared.step(torch.full((2,), token))])
    assert torch.equal(run(own, prompts, steps), logits.view(len(steps) + 1, 2, -1))


def test_a_prompt_read_in_other_chunks_is_read_again(tiny):
    """K/V computed in other chunks differ in rounding: a cache reading in its own chunks reads."""
    prompts, reads = [list(range(1, 30))], Reads()
    prefill_shared(Batch(tiny, make_policy("full", prefill_chunk=8)), prompts, 0, reads)
    assert prefill_shared(Batch(tiny, make_policy("full")), prompts, 0, reads)[1] is False
    assert prefill_shared(Batch(tiny, make_policy("full")), prompts, 0, reads)[1] is True


@torch.inference_mode()
def test_caches_that_read_a_prompt_twice_share_both_readings(tiny):
    """``kvzip`` at a second budget takes the first one's readings of the same prompts (no forward
    runs) and decodes exactly as after reading them itself."""
    prompts, steps, reads = [list(range(1, 30)), list(range(40, 51))], [7, 8, 9, 10], Reads()
    assert prefill_shared(Batch(tiny, make_policy("kvzip", capacity=24)), prompts, 0, reads)[1] is False
    own, shared = (Batch(tiny, make_policy("kvzip", capacity=16)) for _ in range(2))
    forwards = []
    hook = tiny.model.register_forward_pre_hook(lambda module, args: forwards.append(1))
    try:
        logits, took = prefill_shared(shared, prompts, 0, reads)
    finally:
        hook.remove()
    assert took and not forwards
    for token in steps:
        logits = torch.cat([logits, shared.step(torch.full((2,), token))])
    assert torch.equal(run(own, prompts, steps), logits.view(len(steps) + 1, 2, -1))


STEADY = [("full", {}), ("sink", {"capacity": 48}), ("h2o", {"capacity": 48}), ("bct", {"capacity": 48})]
STEADY += [("bct", {"capacity": 48, "positions": "rank"}), ("quant", {}), ("sink", {"budget": 0.3})]


@pytest.mark.parametrize("name, options", STEADY)
@torch.inference_mode()
def test_a_steady_decode_step_never_reads_the_device(real, emma_ids, name, options):
    """Counts ``aten::item`` / ``aten::_local_scalar_dense`` (a device-to-host read) over real decode
    steps of the bundled model with a batch of two: none."""
    model, _ = real
    batch = Batch(model, make_policy(name, **options))
    ids = emma_ids[:, :70].expand(2, -1)
    batch.feed(ids[:, :64])  # past the bounded policies' 48 tokens: every step evicts
    for i in range(64, 66):
        batch.step(ids[:, i])
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for i in range(66, 68):
            batch.step(ids[:, i])
    counts = {e.key: e.count for e in prof.key_averages()}  # seconds of parsing: once
    assert [key for key in counts if key in ("aten::item", "aten::_local_scalar_dense")] == []
    assert counts.get("aten::mm", 0) + counts.get("aten::addmm", 0) > 0  # it did profile


@torch.inference_mode()
@pytest.mark.parametrize("name, options", [("infinigen", {}), ("infinigen", {"select": "mass"}), ("offload", {})])
def test_a_two_tier_decode_step_never_reads_the_device(real, emma_ids, name, options):
    """Selection and copy between tiers make no device-to-host read either: every copy's size is
    known on the host (the mass rule copies its cap's worth of rows and masks what it does not
    want), so no layer waits for the device to size it."""
    model, tokenizer = real
    batch = Batch(model, prepared(make_policy(name, **options), model, tokenizer))
    batch.feed(emma_ids[:, :100])
    batch.step(emma_ids[:, 100])
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for i in range(101, 104):
            batch.step(emma_ids[:, i])
    counts = {e.key: e.count for e in prof.key_averages()}  # seconds of parsing: once
    assert [key for key in counts if key in ("aten::item", "aten::_local_scalar_dense")] == []
    selected = counts.get("aten::index_select", 0)
    assert selected >= (3 * 30 * 2 if name == "infinigen" else 0)  # it profiled the fetch: K and V rows per layer


COMPILABLE = [("full", {}), ("sink", {"capacity": 12}), ("h2o", {"capacity": 12})]
COMPILABLE += [("bct", {"capacity": 12}), ("bct", {"capacity": 12, "positions": "rank"})]


@pytest.mark.slow
@pytest.mark.parametrize("name, options", COMPILABLE)
@torch.inference_mode()
def test_compiled_decode_steps_equal_eager_ones(tiny, name, options):
    """Every bounded policy (and full with a maximum length) compiled: logits within 1e-5 of eager
    over 40 steps that fill, evict and (rank) renumber; a second size of the same policy runs the
    same compiled step (the slots' dimension is traced as dynamic)."""
    from infinikv import compiled

    ids = torch.randint(0, 128, (1, 80))
    for size in (12, 20):
        sized = {**options, "capacity": size} if "capacity" in options else options
        eager = Batch(tiny, make_policy(name, **sized), max_length=80 + size)
        step = Batch(tiny, make_policy(name, **sized), compile=True, max_length=80 + size)
        for batch in (eager, step):
            batch.feed(ids[:, :8])
        for i in range(8, 48):
            assert (eager.step(ids[:, i]) - step.step(ids[:, i])).abs().max() < 1e-5
        assert step.compile_seconds > 0
        if size == 12:
            first = step.compiled
    assert step.compiled is first and any(first in found for found in compiled._LOADED.values())


@pytest.mark.slow
@torch.inference_mode()
def test_two_models_compiled_side_by_side_each_run_their_own_graph(tiny_folder):
    """Two models of one architecture, fp32 and int8 (two compiled steps: the weights' format is
    part of the key), decoded alternately: each equals its eager steps."""
    from infinikv import load_model

    ids = torch.randint(0, 1000, (1, 40))
    runs = []
    for fmt in ("fp32", "int8"):
        model, _ = load_model(str(tiny_folder), weights=fmt)
        pair = [Batch(model, make_policy("bct", capacity=16), compile=c, max_length=40) for c in (False, True)]
        for batch in pair:
            batch.feed(ids[:, :8])
        runs.append(pair)
    for i in range(8, 24):
        steps = [[batch.step(ids[:, i]) for batch in pair] for pair in runs]
        for eager, compiled in steps:
            assert (eager - compiled).abs().max() < 1e-4
        assert (steps[0][0] - steps[1][0]).abs().max() > 1e-3  # the two formats do differ
    assert runs[0][1].compiled is not runs[1][1].compiled


@torch.inference_mode()
def compiled_bct_steps(folder: str) -> float:
    """``bct``'s compiled decode steps on the int8 model of ``folder`` against its eager ones: the
    seconds the compiled step took to compile or load."""
    from infinikv import load_model

    model, _ = load_model(folder, weights="int8")
    ids = torch.randint(0, 1000, (1, 24))
    eager, step = (Batch(model, make_policy("bct", capacity=16), compile=c) for c in (False, True))
    for batch in (eager, step):
        batch.feed(ids[:, :8])
    for i in range(8, 20):
        assert (eager.step(ids[:, i]) - step.step(ids[:, i])).abs().max() < 1e-4
    return step.compile_seconds


@pytest.mark.slow
def test_a_second_process_loads_the_compiled_step_from_disk(tiny_folder):
    """This process compiles (or finds) the step; a new one loads it from disk without compiling."""
    import subprocess
    import sys
    from pathlib import Path

    compiled_bct_steps(str(tiny_folder))
    script = "import sys; from test_core import compiled_bct_steps; print(compiled_bct_steps(sys.argv[1]))"
    run = subprocess.run(
        [sys.executable, "-c", script, str(tiny_folder)], capture_output=True, text=True, cwd=Path(__file__).parent
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert "compiling the decode step" not in run.stderr
    assert float(run.stdout.split()[-1]) < 10


@pytest.mark.slow
@torch.inference_mode()
def test_a_corrupt_compiled_step_is_compiled_again_with_a_warning(tiny, tmp_path, monkeypatch):
    from infinikv import compiled

    monkeypatch.setattr(compiled, "compiled_dir", lambda: tmp_path)
    monkeypatch.setattr(compiled, "_LOADED", {})
    policy = make_policy("sink", capacity=10)
    key = compiled.step_key(tiny, policy, 1)
    corrupt = tmp_path / f"{key}-0.pt"
    corrupt.write_bytes(b"not a compiled step")
    ids = torch.randint(0, 128, (1, 30))
    eager, step = Batch(tiny, policy), Batch(tiny, make_policy("sink", capacity=10), compile=True)
    for batch in (eager, step):
        batch.feed(ids[:, :8])
    with pytest.warns(UserWarning, match="unusable .* compiling again"):
        step.step(ids[:, 8])
    eager.step(ids[:, 8])
    for i in range(9, 20):
        assert (eager.step(ids[:, i]) - step.step(ids[:, i])).abs().max() < 1e-5
    assert not corrupt.exists()  # removed, and the rebuilt step saved beside it
    assert [p.stat().st_size > 1000 for p in compiled.variants(key)] == [True]


def test_compiling_a_growing_cache_is_refused(tiny):
    from infinikv.errors import InfinikvError

    with pytest.raises(InfinikvError, match="--capacity"):
        Batch(tiny, make_policy("sink", budget=0.5), compile=True)
    with pytest.raises(InfinikvError, match="cannot be compiled"):
        Batch(tiny, make_policy("quant"), compile=True)
    with pytest.raises(InfinikvError, match="max-length"):
        Batch(tiny, make_policy("full"), compile=True)
    # callers ask before compiling: a fraction makes the storage grow, a capacity fixes it
    assert not make_policy("h2o", budget=0.2).compilable and make_policy("h2o", capacity=8).compilable
    assert make_policy("bct", kv_memory="1MiB").compilable and not make_policy("quant").compilable


@torch.inference_mode()
def test_a_budget_fraction_is_of_the_whole_prompt_however_it_is_chunked(tiny):
    batch = Batch(tiny, make_policy("bct", budget=0.5))
    batch.prefill([list(range(3, 43))], pad_id=0, chunk=8)
    assert all(layer.evictor.capacities == [20] and layer.slots.held == [20] for layer in batch.cache.layers)


@torch.inference_mode()
def test_several_batches_in_one_forward_equal_each_alone(tiny):
    """Different policies in one forward (the server's continuous batching) compute what each
    batch computes alone."""
    policies = [make_policy("full"), make_policy("sink", capacity=6), make_policy("h2o", capacity=6)]
    prompts = [[[1, 2, 3, 4, 5, 6, 7, 8]], [[9, 10, 11, 12, 13, 14, 15, 16, 17], [3, 4]], [[20, 21, 22]]]
    alone = [Batch(tiny, p) for p in policies]
    together = [Batch(tiny, p) for p in policies]
    firsts = [b.prefill(p, pad_id=0) for b, p in zip(alone, prompts, strict=True)]
    for b, p in zip(together, prompts, strict=True):
        b.prefill(p, pad_id=0)
    tokens = [f.argmax(-1) for f in firsts]
    for _ in range(10):
        expected = [b.step(t) for b, t in zip(alone, tokens, strict=True)]
        got = step_together(together, tokens)
        for e, g in zip(expected, got, strict=True):
            assert (e - g).abs().max() < 1e-5
        tokens = [e.argmax(-1) for e in expected]


@torch.inference_mode()
def test_rows_join_and_leave_a_batch(tiny):
    """A sequence prefilled alone and appended to a running batch decodes as it would alone."""
    ids = torch.randint(0, 128, (3, 40))
    alone = [Batch(tiny, make_policy("h2o", capacity=10)) for _ in range(3)]
    for b, row in zip(alone, ids, strict=True):
        b.feed(row[None, :20])
    group = Batch(tiny, make_policy("h2o", capacity=10))
    group.feed(ids[:1, :20])
    other = Batch(tiny, make_policy("h2o", capacity=10))
    other.feed(ids[1:, :20])
    group.append(other)
    for i in range(20, 30):
        expected = torch.cat([b.step(ids[r : r + 1, i]) for r, b in enumerate(alone)])
        assert (group.step(ids[:, i]) - expected).abs().max() < 1e-5
    group.keep([2, 0])
    for i in range(30, 35):
        expected = torch.cat([alone[2].step(ids[2:3, i]), alone[0].step(ids[0:1, i])])
        assert (group.step(ids[[2, 0], i]) - expected).abs().max() < 1e-5


def test_sample_stops_each_row_on_its_own(tiny):
    batch = Batch(tiny, make_policy("full"))
    logits = batch.prefill([[1, 2, 3], [4, 5]], pad_id=0)
    stop = int(logits[1].argmax())  # the second row stops at once
    tokens = sample(batch, logits, Sampling(max_new_tokens=6), stop_ids=[stop], pad_id=0)
    assert tokens[1] == [] and 0 < len(tokens[0]) <= 6 and stop not in tokens[0]


def test_detokenizer_pieces_add_up_and_cost_no_more_per_token(real):
    """The pieces equal the whole decode, and each push decodes a bounded window."""
    _, tokenizer = real
    text = "Ça coûte 5 €. Naïve café — 日本語のテキスト, and plain English. " * 40
    ids = tokenizer(text).input_ids
    calls = []
    original = tokenizer.decode

    def counting(tokens, **kwargs):
        calls.append(len(tokens))
        return original(tokens, **kwargs)

    tokenizer.decode = counting
    try:
        stream = Detokenizer(tokenizer)
        pieces = [stream.push(t) for t in ids] + [stream.flush()]
    finally:
        tokenizer.decode = original
    assert "".join(pieces) == tokenizer.decode(ids, skip_special_tokens=True)
    assert max(calls) <= 8  # a window of a few tokens, never the whole output


def test_the_core_needs_no_name(tiny):
    """Every registered policy runs through the same Batch calls."""
    for name, cls in REGISTRY.items():
        policy = whole(name, tiny)
        batch = Batch(tiny, policy)
        batch.prefill([[1, 2, 3]], pad_id=0)
        assert batch.step(torch.tensor([4])).shape == (1, 128), cls
