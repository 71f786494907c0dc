"""The offload planner's arithmetic, checked against hand-computed cases, and its errors."""

import json

import pytest

from infinikv.bench.plan import (
    GPU_PRESETS,
    MODEL_PRESETS,
    Gpu,
    ModelShape,
    fractions_from_bench,
    plan,
    shape_from_config,
)
from infinikv.cli import main
from infinikv.errors import InfinikvError


def test_opt_13b_on_an_a6000_by_hand():
    """The paper's setting: OPT-13B, batch 20, 2,048 tokens, A6000 (48 GB, PCIe 3.0 x16), 96 GB host."""
    model = MODEL_PRESETS["opt-13b"]
    # per layer 4 x 5120^2 (attention) + 2 x 5120 x 20480 (MLP) = 314,572,800; x 40 layers, plus the
    # tied embedding 50272 x 5120 = 257,392,640
    assert model.params() == 40 * 314_572_800 + 257_392_640 == 12_840_304_640
    assert model.kv_bytes_per_token() == 2 * 40 * 5120 * 2 == 819_200
    rows = {r["policy"]: r for r in plan(model, GPU_PRESETS["a6000"], 96, batch=20, context=2048)}
    kv = 20 * 2048 * 819_200  # 33.55 GB: with 25.68 GB of weights, more than 90% of 48 GB
    pcie, hbm = 0.8 * 15.75e9, 0.8 * 768e9
    offload = rows["offload"]
    assert not offload["kv_on_gpu"] and offload["link_bytes_per_step"] == kv and offload["bound"] == "PCIe"
    assert offload["tokens_per_second"] == pytest.approx(20 / (kv / pcie))  # 7.51
    assert offload["tokens_per_second"] == pytest.approx(7.51, abs=0.005)
    # infinigen: layers 0-1 fetch everything, the other 38 a tenth: 2/40 + 38/40 x 0.1 = 0.145 of the K/V
    infinigen = rows["infinigen"]
    assert infinigen["link_bytes_per_step"] == round(0.145 * kv)
    assert infinigen["tokens_per_second"] == pytest.approx(20 / (0.145 * kv / pcie))  # 51.79
    # quant-4: 4/16 + 2 fp16 per 64 values = 0.28125 of the K/V: 9.44 GB fits on the GPU next to the weights
    quant = rows["quant-4"]
    assert quant["kv_on_gpu"] and quant["link_bytes_per_step"] == 0 and quant["bound"] == "GPU memory"
    assert quant["tokens_per_second"] == pytest.approx(20 / ((2 * 12_840_304_640 + 0.28125 * kv) / hbm))
    # with every K/V on the host, as in the paper, quant-4 and h2o (a fifth) cross PCIe too
    host = {r["policy"]: r for r in plan(model, GPU_PRESETS["a6000"], 96, 20, 2048, kv_on_host=True)}
    assert host["quant-4"]["tokens_per_second"] == pytest.approx(20 / (0.28125 * kv / pcie))  # 26.70
    assert host["h2o"]["tokens_per_second"] == pytest.approx(20 / (0.2 * kv / pcie))  # 37.55


def test_weights_that_do_not_fit_stream_over_the_link():
    """A toy case in round numbers: 0.8 GB of weights, a 0.5 GB GPU (0.45 GB usable), a 10 GB/s link."""
    model = ModelShape(
        "toy", 1, hidden=10_000, heads=100, kv_heads=100, ffn=0, vocab=0, gated_mlp=False, tied_embeddings=True
    )
    assert model.params() * 2 == 4 * 10_000**2 * 2 == 800_000_000
    toy = Gpu("toy", memory_gb=0.5, hbm_gbps=100, link_gbps=10, tflops=1000)
    rows = {r["policy"]: r for r in plan(model, toy, host_gb=100, batch=1, context=1000)}
    # K/V: 1000 tokens x 2 x 10,000 x 2 bytes = 40 MB; GPU room 0.45 GB holds 0.45 of the 0.8 GB of weights
    offload = rows["offload"]
    assert offload["weights_on_gpu_bytes"] == 450_000_000 and not offload["kv_on_gpu"]
    assert offload["link_bytes_per_step"] == 350_000_000 + 40_000_000
    assert offload["seconds_per_step"] == pytest.approx(390e6 / 8e9)  # 80% of 10 GB/s
    assert offload["host_bytes"] == 390_000_000


def test_config_json_of_the_bundled_model(real):
    from infinikv.models import DEFAULT_MODEL, bundled_folder

    shape = shape_from_config(bundled_folder(DEFAULT_MODEL))
    model, _ = real
    assert (shape.layers, shape.heads, shape.kv_heads, shape.head_dim) == (30, 9, 3, 64)
    # our count leaves out the norms: within 0.1% of the real parameter count
    assert shape.params() == pytest.approx(sum(p.numel() for p in model.parameters()), rel=1e-3)
    assert shape.kv_bytes_per_token() == 30 * 2 * 3 * 64 * 2  # fp16: half the 46 KB of fp32


def test_fractions_come_from_the_nearest_bench_context():
    rows = [
        {"context": 1024, "policy": "full", "kv_bytes": 1000},
        {"context": 1024, "policy": "infinigen", "kv_bytes": 1000, "fetched_fraction": 0.3, "alpha": 4.0},
        {"context": 4096, "policy": "full", "kv_bytes": 4000},
        {"context": 4096, "policy": "h2o", "kv_bytes": 800, "budget": 0.2},
        {"context": 4096, "policy": "infinigen", "kv_bytes": 4000, "fetched_fraction": 0.05, "alpha": 4.0},
    ]
    found = fractions_from_bench(rows, 3000)
    assert found["infinigen"][0] == 0.05 and found["h2o"][0] == 0.2 and "4096" in found["infinigen"][1]


def test_plan_from_bench_json_on_the_command_line(capsys, tmp_path):
    bench = tmp_path / "speed.json"
    bench.write_text(
        json.dumps(
            [
                {"context": 2048, "policy": "full", "kv_bytes": 100},
                {"context": 2048, "policy": "infinigen", "kv_bytes": 100, "fetched_fraction": 0.02, "alpha": 4.0},
            ]
        )
    )
    code = main(["plan", "--batch", "20", "--context", "2048", "--from", str(bench), "--json"])
    result = json.loads(capsys.readouterr().out)
    assert code == 0 and result["projection"] is True
    assert result["fractions"]["infinigen"]["fraction"] == 0.02 and result["fractions"]["h2o"]["source"] == "default"
    rows = {r["policy"]: r for r in result["policies"]}
    kv = 20 * 2048 * 819_200
    assert rows["infinigen"]["link_bytes_per_step"] == round((2 / 40 + 38 / 40 * 0.02) * kv)
    code = main(["plan", "--batch", "20"])
    out = capsys.readouterr().out
    assert code == 0 and out.startswith("PROJECTION") and "7.51" in out and "51.79" in out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["plan", "--gpu", "v100"], "unknown GPU preset 'v100'; choose from a6000, h100, h200"),
        (["plan", "--model-preset", "opt-175b"], "unknown model preset 'opt-175b'"),
        (["plan", "--model", "/no/such/config.json"], "cannot read a model config"),
        (["plan", "--fetch-fraction", "2"], "--fetch-fraction must be in (0, 1]"),
        (["plan", "--from", "/no/such.json"], "cannot read /no/such.json"),
        (["plan", "--batch", "0"], "at least 1"),
        # 64 x 100,000 tokens x 819,200 B = 5,242.9 GB of K/V, more than 0.9 x (48 + 96) GB
        (["plan", "--batch", "64", "--context", "100000"], "needs 5242.9 GB of fp16 K/V plus 25.7 GB of weights"),
    ],
)
def test_bad_plan_input(capsys, argv, message):
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2 and message in err and err.count("\n") == 1


def test_too_long_context_says_what_it_would_need():
    with pytest.raises(InfinikvError, match=r"5268.6 GB in all, more than the 129.6 GB usable"):
        plan(MODEL_PRESETS["opt-13b"], GPU_PRESETS["a6000"], 96, batch=64, context=100_000)
