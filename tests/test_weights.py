"""Weight formats: the packed kernels against the weights they stand for, loading in int8 (tiny
and bundled), exactness of every policy against ``full`` under the same weights, the errors."""

import subprocess
import sys

import pytest
import torch
from torch import nn

from infinikv import Batch, load_model, make_policy, packed, weights
from infinikv.errors import InfinikvError
from infinikv.weights import PackedEmbedding, stored_bytes, weights_format


def stands_for(fmt: str, weight: torch.Tensor) -> torch.Tensor:
    """The weight a format rounds ``weight`` to."""
    if fmt == "int8":
        q, scale = packed.quantize_int8(weight)
        return q.float() * scale.float()[:, None]
    if fmt == "int4":
        return packed.dequantize_int4(*packed.quantize_int4(weight))
    return weight.to(torch.bfloat16).float()


@pytest.mark.parametrize("fmt", ["bf16", "int8", "int4"])
def test_torch_kernels_compute_with_the_weight_they_stand_for(fmt):
    """torch's weight-only kernels: x @ W'ᵀ + b, W' the weight the format rounded W to, on bf16 inputs."""
    torch.manual_seed(0)
    linear = nn.Linear(128, 96)
    x = torch.randn(2, 3, 128)
    out = packed.TorchPackedLinear(linear, fmt)(x)
    assert out.shape == (2, 3, 96) and out.dtype == torch.float32
    expected = x.to(torch.bfloat16).float() @ stands_for(fmt, linear.weight.detach()).T + linear.bias.detach()
    assert (out - expected).abs().max() < 0.02  # bf16 accumulation of 128 products of size ~0.1
    # and the rounding is the format's: int4 moves the weights far more than int8
    error = (stands_for(fmt, linear.weight.detach()) - linear.weight).abs().max() / linear.weight.abs().max()
    # (int8: half a step of 1/127 of the row's largest weight, plus the bf16 rounding of its scale)
    assert error < {"bf16": 0.005, "int8": 0.01, "int4": 0.07}[fmt]
    assert error > 0


# decode steps through the kernel; prefill chunks dequantized, a block of rows at a time, then whole
@pytest.mark.parametrize("rows", [1, 3, 40, 300])
@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_native_kernels_compute_with_the_weight_they_stand_for_in_float32(fmt, rows):
    """infinikv's kernels (what `pack_linear` picks on this CPU): x @ W'ᵀ + b in float32, no input
    rounding, W' the same grid as torch's layout (up to the bf16 rounding of its scales)."""
    torch.manual_seed(0)
    linear = nn.Linear(128, 96)
    layer = packed.pack_linear(linear, fmt)
    assert isinstance(layer, packed.NativeLinear)
    layer.BLOCK_FLOATS = 40 * 128  # blocks of 40 output rows: 40, 40 and 16
    x = torch.randn(rows, 128)
    exact = x @ layer.dense().T + linear.bias.detach()
    assert (layer(x) - exact).abs().max() < 1e-5
    assert (layer.dense() - stands_for(fmt, linear.weight.detach())).abs().max() < 0.01 * linear.weight.abs().max()


def test_int4_rounds_each_group_within_half_a_step():
    torch.manual_seed(0)
    weight = torch.randn(64, 96)
    q, scale_and_zero = packed.quantize_int4(weight)
    assert q.dtype == torch.int32 and int(q.min()) >= 0 and int(q.max()) <= 15
    assert scale_and_zero.shape == (96 // packed.INT4_GROUP, 64, 2)
    groups = weight.reshape(64, -1, packed.INT4_GROUP)
    half_step = ((groups.amax(-1) - groups.amin(-1)) / 15 / 2).repeat_interleave(packed.INT4_GROUP, dim=1)
    error = (packed.dequantize_int4(q, scale_and_zero) - weight).abs()
    assert bool((error <= half_step * 1.02 + 0.01).all())  # + the bf16 rounding of scale and zero


def test_packed_embedding_keeps_rows_and_a_gemma_scale():
    torch.manual_seed(0)
    table = nn.Embedding(50, 32)
    table.register_buffer("embed_scale", torch.tensor(4.0))
    ids = torch.tensor([[0, 7, 49]])
    expected = table(ids) * 4
    for fmt, bound in (("bf16", 0.004), ("int8", 0.01)):  # of the largest value: 2^-8 / 2, 1 / 127 / 2 + 2^-9
        rows = PackedEmbedding(table, fmt)(ids)
        assert rows.dtype == torch.float32
        assert (rows - expected).abs().max() < bound * expected.abs().max()


@torch.inference_mode()
def test_tiny_model_in_int8_decodes_with_a_quarter_of_the_bytes(tiny_folder):
    model, tokenizer = load_model(str(tiny_folder), weights="int8")
    reference, _ = load_model(str(tiny_folder), weights="fp32")
    assert weights_format(model) == "int8" and weights_format(reference) == "fp32"
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
    assert stored_bytes(model) < 0.3 * stored_bytes(reference)
    ids = torch.randint(0, len(tokenizer), (1, 40))
    ours, theirs = model(input_ids=ids).logits, reference(input_ids=ids).logits
    assert ours.dtype == torch.float32
    assert (ours - theirs).abs().max() < 0.05 * theirs.abs().max()


@pytest.mark.parametrize("fmt", ["bf16", "int8", "int4"])
@torch.inference_mode()
def test_gated_mlps_are_fused_and_compute_what_they_did(fmt, tiny_folder, monkeypatch):
    """Packing stacks each gated MLP's gate and up into one matrix; the logits are bit for bit those
    of the same format unfused (each output row is the same dot product)."""
    model, _ = load_model(str(tiny_folder), weights=fmt)
    assert sum(isinstance(m, packed.GatedMLP) for m in model.modules()) == model.config.num_hidden_layers
    monkeypatch.setattr(weights, "fuse_gated_mlps", lambda model: 0)
    unfused, _ = load_model(str(tiny_folder), weights=fmt)
    assert not any(isinstance(m, packed.GatedMLP) for m in unfused.modules())
    ids = torch.randint(0, 1000, (2, 24))
    assert torch.equal(model(input_ids=ids).logits, unfused(input_ids=ids).logits)


def test_an_mlp_that_combines_its_parts_otherwise_stays_unfused():
    class UpGated(nn.Module):  # act(up) * gate: the same parts, another function
        def __init__(self) -> None:
            super().__init__()
            self.gate_proj, self.up_proj, self.down_proj = nn.Linear(64, 96), nn.Linear(64, 96), nn.Linear(96, 64)
            self.act_fn = nn.SiLU()

        def forward(self, x):
            return self.down_proj(self.act_fn(self.up_proj(x)) * self.gate_proj(x))

    torch.manual_seed(0)
    model = nn.Sequential(UpGated())
    for name in ("gate_proj", "up_proj", "down_proj"):
        setattr(model[0], name, packed.pack_linear(getattr(model[0], name), "int8"))
    assert weights.fuse_gated_mlps(model) == 0 and isinstance(model[0], UpGated)


@pytest.fixture(scope="module")
def real_int8():
    return load_model("smollm2-135m", weights="int8")


@torch.inference_mode()
def test_bundled_model_in_int8_predicts_as_fp32_does(real, real_int8, emma_ids):
    (model, _), (int8, _) = real, real_int8
    assert stored_bytes(int8) < 0.35 * stored_bytes(model)
    ours, theirs = int8(input_ids=emma_ids).logits, model(input_ids=emma_ids).logits
    agree = (ours.argmax(-1) == theirs.argmax(-1)).float().mean()
    assert agree > 0.9, f"int8 picks fp32's top token at only {agree:.0%} of 200 positions"


@pytest.fixture(scope="module")
def full_logits_both(real, real_int8, emma_ids):
    """``full``'s ``emma_loop`` logits under fp32 and under int8 weights."""
    from test_policies import emma_loop

    with torch.inference_mode():
        return [emma_loop(m, emma_ids, make_policy("full").make_cache(m)) for m, _ in (real, real_int8)]


@pytest.mark.parametrize("name", ["bct", "sink", "h2o", "snapkv", "infinigen", "offload", "recall"])
@torch.inference_mode()
def test_policies_match_full_under_int8(real_int8, emma_ids, full_logits_both, name):
    """The matrix's exactness under int8 weights: room for every token (or a fetch of all) vs int8 `full`.

    Each packed matmul rounds its input to bf16, so a 1e-6 difference in an attention output
    (the policies that read attention scores compute it with their own kernel: h2o, snapkv, bct's
    rule, recall) could flip a rounding and grow through the layers. Measured over ``emma_loop``:
    those differ from `full` by 5e-6 mean / 5e-5 max logit (the same for the four) where int8 itself
    moves fp32's logits by 0.20 / 1.56; sink, attending as `full` does, is exact.
    The bar: a policy adds at most a third of what the format costs, and picks the same token.
    """
    from test_policies import emma_loop, whole

    model, tokenizer = real_int8
    fp32, reference = full_logits_both
    ours = emma_loop(model, emma_ids, whole(name, model, tokenizer).make_cache(model))
    gap, format_gap = (ours - reference).abs().mean(), (reference - fp32).abs().mean()
    assert gap < format_gap / 3, f"{name} moves int8 full's logits by {gap:.3f}, the format by {format_gap:.3f}"
    assert (ours.argmax(-1) == reference.argmax(-1)).float().mean() >= 0.98


@torch.inference_mode()
def test_bct_renumbers_positions_under_int8(real_int8, emma_ids):
    """Past its capacity `bct` keeps decoding what int8 `full` would, mostly (same bar as fp32's)."""
    from infinikv.eval.ppl import perplexity

    model, _ = real_int8
    full = perplexity(model, emma_ids[:, :193], make_policy("full"), context=32, progress=False)["perplexity"]
    bounded = perplexity(model, emma_ids[:, :193], make_policy("bct", capacity=48), context=32, progress=False)
    assert bounded["perplexity"] < 1.6 * full and bounded["attended_tokens"] <= 49


def test_unknown_format_is_one_line():
    with pytest.raises(InfinikvError, match="unknown weight format 'int3'; choose one of auto, fp32, bf16, int8, int4"):
        weights.check_format("int3")


def test_a_format_without_its_kernel_names_what_runs(monkeypatch, tiny_folder):
    """A machine whose torch lacks the int4 kernel: the CLI says so in one line, exit 2."""
    monkeypatch.setattr(weights, "runs", lambda name, device="cpu": name != "int4")
    with pytest.raises(
        InfinikvError, match="weights int4 cannot run on cpu here .* this machine runs: fp32, bf16, int8"
    ):
        load_model(str(tiny_folder), weights="int4")
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "infinikv.cli",
            "generate",
            "--model",
            str(tiny_folder),
            "--weights",
            "int3",
            "--prompt",
            "x",
        ],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 2 and "int3" in done.stderr and "Traceback" not in done.stderr


def test_batch_decodes_with_int4_weights(tiny_folder):
    model, _ = load_model(str(tiny_folder), weights="int4")
    batch = Batch(model, make_policy("bct", capacity=16))
    logits = batch.feed(torch.randint(0, 100, (1, 24)))
    assert torch.isfinite(logits).all()


def test_server_with_int8_weights_answers_as_the_engine_does(real_int8):
    """`serve --weights int8`: the HTTP answer is the int8 model's own greedy continuation."""
    import openai

    from infinikv import Sampling, generate
    from infinikv.bench.server import running_server

    model, tokenizer = real_int8
    prompt = "The capital of France is"
    expected = generate(model, tokenizer, prompt, make_policy("full"), Sampling(max_new_tokens=8)).texts[0]
    with running_server("smollm2-135m", ["--weights", "int8", "--threads", "1"]) as (base, _):
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=120)
        out = client.completions.create(model="smollm2-135m", prompt=prompt, max_tokens=8, temperature=0)
    assert out.choices[0].text == expected


def test_grid_rows_carry_their_weights_and_resume_by_them(tmp_path, tiny_folder):
    """A grid worker (local or a Ray actor) loads the cell's format; rows of two formats are two cells."""
    from infinikv.grid import Cell, LocalPool, Worker, finished, run_grid

    params = {"text": "austen:emma", "context": 64, "continuation": 8}
    cells = [Cell("P-ctx", str(tiny_folder), {"policy": "full"}, params, weights=w) for w in ("fp32", "int8")]
    out = tmp_path / "rows.jsonl"
    for cell in cells:
        worker = Worker(str(tiny_folder), weights=cell.weights)
        assert weights_format(worker.model) == cell.weights
        run_grid([cell], out, lambda worker=worker: LocalPool(worker), str, progress=False)
    rows = list(finished(out).values())
    assert sorted(r["weights"] for r in rows) == ["fp32", "int8"]
    assert rows[0]["perplexity"] != rows[1]["perplexity"]
    with pytest.raises(ValueError, match=r"\(fp32\) was given a cell of .* \(int8\)"):
        Worker(str(tiny_folder)).run(cells[1])
