"""The command line, in process (fast) and once as a real subprocess (exit code, no traceback)."""

import json
import subprocess
import sys

import pytest

from infinikv.cli import main


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_generate_streams_and_summarises(capsys):
    code, out, err = run(capsys, "generate", "--prompt", "The capital of France is", "--max-new-tokens", "4")
    assert code == 0 and out.startswith(" Paris")
    assert "tokens in" in err and "KV held" in err


def test_generate_json_batch_from_prompts_file(capsys, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps("The capital of France is") + "\n" + json.dumps("One, two, three,") + "\n")
    code, out, _ = run(
        capsys,
        "generate",
        "--prompts-file",
        str(prompts),
        "--max-new-tokens",
        "3",
        "--policy",
        "h2o",
        "--budget",
        "0.5",
        "--json",
    )
    result = json.loads(out)
    assert code == 0 and len(result["texts"]) == 2 and result["policy"] == "h2o" and result["budget"] == 0.5
    assert result["texts"][0].startswith(" Paris")


def test_generate_takes_a_policy_with_its_options_as_bench_does(capsys):
    code, out, _ = run(
        capsys,
        "generate",
        "--prompt",
        "One, two, three,",
        "--max-new-tokens",
        "2",
        "--policy",
        "sink[capacity=8]",
        "--json",
    )
    result = json.loads(out)
    assert code == 0 and result["policy"] == "sink" and result["capacity"] == 8


def test_generate_prompt_file_keeps_newlines(capsys, tmp_path):
    prompt = tmp_path / "p.txt"
    prompt.write_text("Line one.\nLine two.\n")
    code, out, _ = run(capsys, "generate", "--prompt-file", str(prompt), "--max-new-tokens", "2", "--json")
    assert code == 0 and json.loads(out)["prompt_tokens"][0] >= 6


def test_generate_chat_with_sampling(capsys):
    code, out, _ = run(
        capsys,
        "generate",
        "--prompt",
        "Say hello.",
        "--chat",
        "--max-new-tokens",
        "6",
        "--temperature",
        "0.7",
        "--top-p",
        "0.9",
        "--seed",
        "1",
        "--json",
    )
    assert code == 0 and json.loads(out)["new_tokens"] >= 1


def test_eval_ppl_grid_json_and_partial_results(capsys, tmp_path):
    out_file = tmp_path / "grid.jsonl"
    code, out, _ = run(
        capsys,
        "eval",
        "ppl",
        "--context",
        "64",
        "--continuation",
        "16",
        "--policies",
        "full,sink,h2o",
        "--budgets",
        "0.25,0.5",
        "--json",
        "--out",
        str(out_file),
        "--quiet",
    )
    rows = json.loads(out)
    assert code == 0 and [(r["policy"], r["budget"]) for r in rows] == [
        ("full", None),
        ("sink", 0.25),
        ("sink", 0.5),
        ("h2o", 0.25),
        ("h2o", 0.5),
    ]
    for row in rows:
        assert {"policy", "budget", "perplexity", "attended_fraction", "kv_bytes", "seconds"} <= set(row)
        assert len(row["attended_tokens_per_layer"]) == 30
    assert rows[0]["attended_fraction"] == 1.0 and rows[1]["attended_fraction"] < 0.3
    assert len(out_file.read_text().splitlines()) == 5


def test_eval_ppl_table(capsys):
    code, out, _ = run(
        capsys,
        "eval",
        "ppl",
        "--context",
        "48",
        "--continuation",
        "8",
        "--policies",
        "full,sink",
        "--budget",
        "0.5",
        "--quiet",
    )
    assert code == 0 and "vs full" in out and "sink" in out


def test_models_and_data_listings(capsys):
    code, out, _ = run(capsys, "models", "list", "--json")
    assert code == 0 and json.loads(out)[0]["fetched"]
    code, out, _ = run(capsys, "data", "list")
    assert code == 0 and "austen:emma" in out and "tokens" in out
    code, out, _ = run(capsys, "models", "fetch")  # already there: a fast no-op
    assert code == 0 and "smollm2-135m" in out


def test_every_commands_help_prints():
    """argparse formats a help string only when asked: a stray % in one fails only then."""
    from argparse import _SubParsersAction

    from infinikv.cli import build_parser

    def parsers(parser):
        yield parser
        for action in parser._actions:
            if isinstance(action, _SubParsersAction):
                for child in action.choices.values():
                    yield from parsers(child)

    helps = [parser.format_help() for parser in parsers(build_parser())]
    assert len(helps) > 10 and all(text.startswith("usage:") for text in helps)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["generate", "--policy", "nope", "--budget", "0.5"], "unknown policy"),
        (["generate", "--policy", "sink", "--budget", "0"], "budget"),
        (["generate", "--policy", "sink", "--budget", "1.5"], "budget"),
        (["generate", "--policy", "sink", "--capacity", "0"], "capacity"),
        (["generate", "--policy", "sink"], "needs --budget"),
        (["generate", "--policy", "sink,h2o", "--budget", "0.5"], "takes one policy"),
        (["generate", "--policy", "sink[capacity]"], "not option=value"),
        (["generate", "--prompt", "  "], "empty"),
        (["generate", "--model", "/no/such/model", "--prompt", "hi"], "no model"),
        (["generate", "--max-new-tokens", "x"], "invalid int"),
        (["generate", "--sinks", "2", "--prompt", "hi"], "needs --policy"),
        (["generate", "--policy", "h2o", "--budget", "0.5", "--sinks", "2"], "does not apply"),
        (["eval", "ppl", "--text", "/no/such.txt"], "no text"),
        (["eval", "ppl", "--text", "austen:nope"], "unknown text"),
        (["eval", "ppl", "--context", "300000", "--text", "austen:persuasion"], "fewer than"),
        (["eval", "ppl", "--budgets", "a,b", "--policies", "sink"], "comma-separated"),
        (["frobnicate"], "invalid choice"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(capsys, argv, message):
    code, _, err = run(capsys, *argv)
    assert code == 2
    assert message in err and err.count("\n") == 1 and err.startswith("infinikv: error:")


def test_real_process_exit_code_without_traceback(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "infinikv.cli", "generate", "--model", str(tmp_path), "--prompt", "x"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2 and "Traceback" not in done.stderr and "not a model folder" in done.stderr


def test_missing_bundled_model_from_the_cli(tmp_path):
    env = {"INFINIKV_HOME": str(tmp_path), "PATH": "/usr/bin:/bin"}
    done = subprocess.run(
        [sys.executable, "-m", "infinikv.cli", "generate", "--prompt", "x"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert done.returncode == 2 and "infinikv models fetch" in done.stderr and "Traceback" not in done.stderr


def test_eval_needle(capsys):
    code, out, _ = run(
        capsys,
        "eval",
        "needle",
        "--context",
        "400",
        "--needles",
        "2",
        "--policies",
        "full,bct",
        "--budget",
        "0.5",
        "--json",
        "--quiet",
        "--out",
        "/dev/null",
    )
    rows = json.loads(out)
    assert code == 0 and [r["policy"] for r in rows] == ["full", "bct"]
    assert rows[0]["accuracy"] == 1.0 and all(len(r["cases"]) == 2 for r in rows)
    assert {"policy", "budget", "accuracy"} <= set(rows[1])


def test_eval_stream_with_plot(capsys, tmp_path):
    plot = tmp_path / "stream.png"
    code, out, _ = run(
        capsys,
        "eval",
        "stream",
        "--tokens",
        "300",
        "--chunk",
        "32",
        "--window",
        "100",
        "--policies",
        "bct,full",
        "--capacity",
        "64",
        "--plot",
        str(plot),
        "--quiet",
        "--out",
        str(tmp_path / "s.jsonl"),
    )
    assert code == 0 and plot.stat().st_size > 10_000
    assert "bct:heavy-hitter" in out and "peak RSS" in out
    rows = [json.loads(line) for line in (tmp_path / "s.jsonl").read_text().splitlines()]
    assert [len(r["windows"]) for r in rows] == [3, 3]
    assert rows[0]["windows"][-1]["kv_bytes"] == 64 * 30 * 2 * 3 * 64 * 4  # bct holds exactly its capacity
    assert rows[0]["windows"][-1]["kv_tiers"] == {"held": 64 * 30 * 2 * 3 * 64 * 4}
    # the peak counts the chunk being read beside the capacity, and stays there (flat)
    assert {w["peak_kv_bytes"] for w in rows[0]["windows"]} == {(64 + 32) * 30 * 2 * 3 * 64 * 4}


SPEED_FIELDS = {
    "context": int,
    "policy": str,
    "ms_per_step": float,
    "tokens_per_second": float,
    "peak_rss_bytes": int,
    "kv_bytes": int,
    "bytes_moved_per_step": (int, float),
    "floor_ms_per_step": float,
    "efficiency": float,
    "weights_bytes": int,
    "bandwidth_bytes_per_second": int,
    "profile_ms": dict,
}


def test_bench_speed_end_to_end_on_a_tiny_model(capsys, tmp_path, tiny_folder):
    out_file, plot, peer = tmp_path / "speed.json", tmp_path / "speed.png", tmp_path / "peer.jsonl"
    peer.write_text(
        "".join(
            json.dumps({"peer": "llama.cpp", "context": c, "ms_per_step": 2.0, "prefill_s": 0.5}) + "\n"
            for c in (128, 256)
        )
    )
    code, out, _ = run(
        capsys,
        "bench",
        "speed",
        "--model",
        str(tiny_folder),
        "--contexts",
        "128,256",
        "--steps",
        "3",
        "--prefill-chunk",
        "100",
        "--policies",
        "full,quant,h2o,offload,infinigen",
        "--budget",
        "0.25",
        "--json",
        str(out_file),
        "--out",
        str(tmp_path / "speed.jsonl"),
        "--plot",
        str(plot),
        "--peer",
        str(peer),
        "--quiet",
    )
    rows = json.loads(out_file.read_text())
    peers, rows = rows[:2], rows[2:]  # the peer's rows lead the JSON, table and plot
    assert [(r["label"], r["context"], r["prompt_tokens_per_second"]) for r in peers] == [
        ("llama.cpp (peer)", 128, 256.0),
        ("llama.cpp (peer)", 256, 512.0),
    ]
    assert all(r["ratio_to_peer"] == pytest.approx(2.0 / r["ms_per_step"], rel=1e-2) for r in rows)
    policies = ("hf-dynamic", "full", "quant", "h2o", "offload", "infinigen")
    assert code == 0 and [(r["context"], r["policy"]) for r in rows] == [(c, p) for c in (128, 256) for p in policies]
    assert [json.loads(line) for line in (tmp_path / "speed.jsonl").read_text().splitlines()] == rows
    for row in rows:
        for field, kind in SPEED_FIELDS.items():
            assert isinstance(row[field], kind), field
        # the JSON rounds each field on its own, so recomputing from rounded fields is off by ~1e-3
        assert row["ms_per_step"] > 0 and 0 < row["efficiency"]
        assert row["efficiency"] == pytest.approx(row["floor_ms_per_step"] / row["ms_per_step"], abs=2e-3)
        read = row["weights_bytes"] + row["kv_bytes_attended_per_step"] + 2 * row["bytes_moved_per_step"]  # CPU
        assert row["kv_bytes_attended_per_step"] > 0
        assert row["floor_ms_per_step"] == pytest.approx(read / row["bandwidth_bytes_per_second"] * 1000, abs=1e-3)
        assert row["peak_rss_bytes"] >= row["rss_bytes"] > 0
    full = {r["context"]: r for r in rows if r["policy"] == "full"}
    for row in rows:
        assert row["ratio_to_full"] == pytest.approx(full[row["context"]]["ms_per_step"] / row["ms_per_step"], abs=2e-3)
        reference = full[row["context"]]["kv_bytes"]
        # quant: head_dim 32 is one group; 4 bits pack its 128 fp32 bytes into 16, plus scale and min (8)
        expected = {"full": 1, "quant": (16 + 8) / 128, "h2o": 0.25, "offload": 1, "infinigen": 1}
        expected["hf-dynamic"] = (row["context"] + 3 + 3 / 2) / (row["context"] + 3 + 3)  # mean over the steps
        expected = expected[row["policy"]]
        assert row["kv_bytes"] == pytest.approx(expected * reference, rel=0.03)
    offload = [r for r in rows if r["policy"] == "offload"]
    assert all(r["bytes_moved_per_step"] > 0 and r["fetched_fraction"] == 1 for r in offload)
    # the floor counts the bytes a step touches: less K/V for h2o than full, more traffic for offload
    by = {(r["context"], r["policy"]): r["floor_ms_per_step"] for r in rows}
    assert by[256, "h2o"] < by[256, "full"] < by[256, "offload"]
    assert plot.stat().st_size > 10_000 and "floor ms" in out and "speculate" in out and "llama.cpp (peer)" in out


def test_bench_generation_reports_flat_windows_on_a_tiny_model(capsys, tmp_path, tiny_folder):
    out_file = tmp_path / "generation.jsonl"
    argv = ["bench", "generation", "--model", str(tiny_folder), "--policy", "bct", "--capacity", "16"]
    code, out, _ = run(capsys, *argv, "--tokens", "60", "--window", "20", "--out", str(out_file), "--quiet")
    row = json.loads(out_file.read_text())
    assert code == 0 and row["tokens"] == 60 and [w["end"] for w in row["windows"]] == [20, 40, 60]
    assert {w["kv_bytes"] for w in row["windows"]} == {16 * 2 * 2 * 32 * 2 * 4}  # full capacity, never more
    assert {w["peak_kv_bytes"] for w in row["windows"]} == {(16 + 1) * 2 * 2 * 32 * 2 * 4}  # + the token being read
    assert row["last_over_first_rate"] == pytest.approx(
        row["windows"][-1]["tokens_per_second"] / row["windows"][0]["tokens_per_second"], abs=2e-3
    )
    assert "last window" in out
    code, _, err = run(capsys, *argv, "--tokens", "10", "--window", "20")
    assert code == 2 and "--tokens at least --window" in err


def test_generate_uses_a_built_models_policy(capsys, tmp_path):
    from infinikv.models import load_model, save_model

    model, tokenizer = load_model("smollm2-135m", kv_capacity=16, update_rule="heavy-hitter", weights="fp32")
    save_model(model, tokenizer, tmp_path / "m")
    code, out, _ = run(
        capsys,
        "generate",
        "--model",
        str(tmp_path / "m"),
        "--prompt",
        "Once upon a time there was a",
        "--max-new-tokens",
        "20",
        "--json",
    )
    result = json.loads(out)
    assert code == 0 and result["policy"] == "bct" and result["capacity"] == 16
    # the peak: its storage, allocated once, of capacity + 1 slots (a step's token lands before its victim goes)
    assert result["update_rule"] == "heavy-hitter" and result["kv_bytes"] == (16 + 1) * 30 * 2 * 3 * 64 * 4


@pytest.mark.parametrize(
    "argv, message",
    [
        (["generate", "--policy", "bct", "--capacity", "8", "--update-rule", "lru"], "update-rule"),
        (["generate", "--policy", "bct", "--kv-memory", "12 parsecs"], "is not a size"),
        (["generate", "--policy", "bct", "--capacity", "100000", "--kv-memory", "1MiB", "--prompt", "hi"], "more than"),
        (["eval", "stream", "--tokens", "1", "--policies", "full"], "--tokens"),
        (["models", "build", "smollm2-135m", "--policy", "bct", "--capacity", "0", "--out", "/tmp/x"], "capacity"),
        (["models", "build", "smollm2-135m", "--out", "/tmp/x"], "needs --policy"),
    ],
)
def test_bad_bct_input_from_the_cli(capsys, argv, message):
    code, _, err = run(capsys, *argv)
    assert code == 2 and message in err and err.count("\n") == 1


def test_eval_recall_and_prepare(capsys, tmp_path):
    argv = ["eval", "recall", "--context", "64", "--steps", "2", "--policies", "infinigen,h2o", "--budget", "0.2"]
    options = ("--select", "alpha", "--alpha", "8", "--dense-layers", "2")
    code, out, _ = run(capsys, *argv, *options, "--json", "--quiet", "--out", str(tmp_path / "r.jsonl"))
    rows = json.loads(out)
    assert code == 0 and [r["policy"] for r in rows] == ["infinigen", "h2o"]
    for row in rows:
        assert 0 < row["recall"] <= row["oracle_recall"] + 1e-6 <= 1.0001 and 0 < row["attended_fraction"] < 1
        assert len(row["recall_per_layer"]) == 30
    infinigen, h2o = rows
    assert infinigen["recall_per_layer"][0] == pytest.approx(1.0)  # its dense layers attend to everything


def test_prepare_warns_about_the_calibration_text(capsys, tmp_path):
    from infinikv.models import load_model, save_model

    model, tokenizer = load_model("smollm2-135m", weights="fp32")
    save_model(model, tokenizer, tmp_path / "m")
    code, out, _ = run(
        capsys, "prepare", "--model", str(tmp_path / "m"), "--calibration", "jargon", "--tokens", "64", "--quiet"
    )
    assert code == 0 and (tmp_path / "m" / "infinikv-infinigen.json").is_file()
    code, _, err = run(
        capsys,
        "eval",
        "ppl",
        "--model",
        str(tmp_path / "m"),
        "--text",
        "jargon",
        "--context",
        "32",
        "--continuation",
        "4",
        "--policies",
        "infinigen",
        "--quiet",
        "--out",
        str(tmp_path / "r.jsonl"),
    )
    assert code == 0 and "calibrated on jargon" in err


def test_bench_quality_end_to_end_on_a_tiny_model(capsys, tmp_path, tiny_folder):
    out_file = tmp_path / "quality.json"
    code, out, _ = run(
        capsys,
        "bench",
        "quality",
        "--model",
        str(tiny_folder),
        "--context",
        "64",
        "--continuation",
        "8",
        "--needle-context",
        "120",
        "--needles",
        "3",
        "--policies",
        "full,sink,quant,bct",
        "--budgets",
        "0.1,0.5",
        "--json",
        str(out_file),
        "--out",
        str(tmp_path / "quality.jsonl"),
        "--plot-dir",
        str(tmp_path / "plots"),
        "--quiet",
    )
    rows = json.loads(out_file.read_text())
    cells = [("full", None), ("sink", 0.1), ("sink", 0.5), ("quant", None), ("bct", 0.1), ("bct", 0.5)]
    assert code == 0 and [(r["protocol"], r["policy"], r["budget"]) for r in rows] == [
        (protocol, p, b) for protocol in ("P-ctx", "P-needle") for p, b in cells
    ]
    assert len((tmp_path / "quality.jsonl").read_text().splitlines()) == 12
    for row in rows[:6]:
        assert row["perplexity"] > 1 and 0 < row["attended_fraction"] <= 1 and row["context"] == 64
    for row in rows[6:]:
        assert 0 <= row["accuracy"] <= 1 and [c["depth"] for c in row["cases"]] == [0.1, 0.5, 0.9]
    assert rows[1]["attended_fraction"] < rows[2]["attended_fraction"] < rows[0]["attended_fraction"] == 1
    for name in ("quality-ppl.png", "quality-needle.png"):
        assert (tmp_path / "plots" / name).stat().st_size > 10_000
    assert "vs full" in out and "depths hit" in out
