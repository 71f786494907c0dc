"""``infinikv eval ruler``: result rows, resuming, the leaderboard table, the heatmap, bad input;
and on the real model, that the suite separates a full cache from a small sink cache."""

import json

import pytest

from infinikv.cli import main
from infinikv.engine import end_of_sequence_ids
from infinikv.eval import ruler
from infinikv.eval.ruler_run import run_cell
from infinikv.grid import finished
from infinikv.policies import parse_spec
from infinikv.results import leaderboard, summary

KEYS = {"model", "policy", "budget", "task", "length", "accuracy", "samples"}


def ruler_cli(capsys, *argv):
    code = main(["eval", "ruler", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def rows_of(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_grid_appends_one_row_per_cell_and_resumes(capsys, tmp_path, tiny_folder):
    out, png = tmp_path / "ruler.jsonl", tmp_path / "ruler.png"
    argv = ["--model", str(tiny_folder), "--lengths", "600,400", "--samples", "3", "--batch-size", "2"]
    argv += ["--policies", "full,sink", "--budgets", "0.5", "--out", str(out), "--quiet"]
    code, table, err = ruler_cli(capsys, *argv, "--tasks", "niah_single_1,vt", "--heatmap", str(png))
    assert code == 0, err
    rows = rows_of(out)
    assert [(r["length"], r["task"], r["label"]) for r in rows] == [
        (n, t, p) for n in (400, 600) for t in ("niah_single_1", "vt") for p in ("full", "sink")
    ]
    assert all(KEYS <= set(r) and r["samples"] == 3 and len(r["outputs"]) == 3 for r in rows)
    assert all(r["accuracy"] == pytest.approx(sum(o["score"] for o in r["outputs"]) / 3) for r in rows)
    assert [r["budget"] for r in rows[:2]] == [None, 0.5]
    board, found = table.split("\n\n")  # the leaderboard, then where the needles went
    assert board.splitlines()[0].split() == ["policy", "400", "600", "mean", "niah_single_1", "vt"]
    assert [line.split()[0] for line in board.splitlines()[1:]] == ["full", "sink"]
    assert board.splitlines()[2].split()[1] == "0.5"  # the budget beside the policy
    assert found.splitlines()[1].split() == ["full", "100.0", "-"]
    assert png.stat().st_size > 10_000
    assert "0 of 8 cells already" in err

    # the same command again: nothing runs, nothing is appended, the same table
    before = out.read_text()
    code, again, err = ruler_cli(capsys, *argv, "--tasks", "niah_single_1,vt")
    assert code == 0 and out.read_text() == before and again == table and "8 of 8 cells already" in err

    # an interrupted write (a cut last line) and one more task: only those cells run
    lines = before.splitlines()
    out.write_text("\n".join(lines[:-1]) + "\n" + lines[-1][:40])
    code, _, err = ruler_cli(capsys, *argv, "--tasks", "niah_single_1,vt,fwe")
    assert code == 0 and "7 of 12 cells already" in err
    cells = {(r["length"], r["task"], r["label"]) for r in rows_of_valid(out)}
    assert len(cells) == 12


def test_the_policies_that_read_a_prompt_as_full_does_read_it_once(capsys, tmp_path, tiny_folder):
    """``offload`` takes the K/V ``full`` read for each batch of the same prompts, and answers as
    ``full``; ``sink`` (it evicts while reading) reads its own."""
    out = tmp_path / "ruler.jsonl"
    argv = ["--model", str(tiny_folder), "--lengths", "400", "--samples", "3", "--batch-size", "2"]
    argv += ["--tasks", "niah_single_1", "--policies", "full,offload,sink", "--budgets", "0.5", "--out", str(out)]
    code, _, err = ruler_cli(capsys, *argv, "--quiet")
    assert code == 0, err
    rows = rows_of(out)
    assert {r["label"]: r["prompts_taken"] for r in rows} == {"full": 0, "offload": 2, "sink": 0}
    assert [o["output"] for o in rows[1]["outputs"]] == [o["output"] for o in rows[0]["outputs"]]


def test_limit_minutes_keeps_the_rows_so_far_and_resumes(capsys, tmp_path, tiny_folder):
    """Once the limit is spent no new cell starts: the rows that landed are kept and printed, and
    the same command without the limit runs only the rest."""
    out = tmp_path / "ruler.jsonl"
    argv = ["--model", str(tiny_folder), "--lengths", "400", "--samples", "2", "--tasks", "niah_single_1"]
    argv += ["--policies", "full,sink", "--budgets", "0.5,0.25", "--out", str(out), "--quiet"]
    code, table, err = ruler_cli(capsys, *argv, "--limit-minutes", "0.00001")  # spent by the first cell
    assert code == 0 and len(rows_of(out)) == 1 and "2 cells not run" in err
    assert [line.split()[0] for line in table.split("\n\n")[0].splitlines()[1:]] == ["full"]
    code, _, err = ruler_cli(capsys, *argv)
    assert code == 0 and "1 of 3 cells already" in err and len(rows_of(out)) == 3
    assert ruler_cli(capsys, *argv, "--limit-minutes", "0")[0] == 2


def rows_of_valid(path):
    return list(finished(path).values())


def test_leaderboard_averages_over_tasks_and_lengths():
    def row(label, budget, task, length, accuracy):
        return {"label": label, "budget": budget, "capacity": None, "task": task, "length": length} | {
            "accuracy": accuracy
        }

    rows = [row("full", None, t, n, a) for t, n, a in [("a", 1, 1.0), ("b", 1, 0.5), ("a", 2, 0.5), ("b", 2, 0.0)]]
    rows += [row("sink", 0.1, "a", 1, 0.25)]
    header, lines = leaderboard(rows)
    assert header == ["policy", "1", "2", "mean", "a", "b"]
    assert lines == [["full", "75.0", "25.0", "50.0", "75.0", "25.0"], ["sink 0.1", "25.0", "-", "25.0", "25.0", "-"]]
    assert summary(rows).splitlines()[2].split() == ["sink", "0.1", "25.0", "-", "25.0", "25.0", "-"]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--lengths", "0"], "--lengths expects positive token counts"),
        (["--lengths", "2k"], "--lengths expects comma-separated whole numbers"),
        (["--tasks", "nope"], "unknown RULER task 'nope'"),
        (["--samples", "0"], "--samples and --batch-size must be at least 1"),
        (["--lengths", "8192"], "past the model's trained context of 4096 tokens"),
        (["--lengths", "100", "--tasks", "vt"], "vt does not fit in 100 tokens"),
    ],
)
def test_bad_input_is_a_one_line_error(capsys, tmp_path, tiny_folder, argv, message):
    code, _, err = ruler_cli(capsys, "--model", str(tiny_folder), "--out", str(tmp_path / "r.jsonl"), *argv)
    assert code == 2 and message in err and err.count("\n") == 1
    assert not (tmp_path / "r.jsonl").exists()


@pytest.mark.slow
def test_the_suite_separates_a_full_cache_from_a_small_sink_cache(real):
    """The sanity bar on the bundled model: multi-key needles at 1,024 tokens, full finds more
    than sink keeping 10% of the tokens (its recent window only reaches the last needles)."""
    model, tokenizer = real
    samples = ruler.generate("niah_multikey_1", tokenizer, ruler_text(), 1024, 4)
    stops = sorted(end_of_sequence_ids(model, tokenizer))
    full = run_cell(model, tokenizer, samples, parse_spec({"policy": "full"}), stops, batch_size=4)
    sink = run_cell(model, tokenizer, samples, parse_spec({"policy": "sink", "budget": 0.1}), stops, batch_size=4)
    assert full["accuracy"] > sink["accuracy"]  # measured: 2/4 and 1/4 (sink keeps the last needle only)
    assert sink["attended_fraction"] < 0.2 and full["attended_fraction"] == 1.0


def ruler_text() -> str:
    from infinikv.data import load_text

    return load_text("austen:emma", from_chapter_one=True)


def test_a_batch_of_prompts_decodes_like_each_alone(tiny_folder):
    """Batching a cell must not change its answers (same-length prompts, no padding)."""
    from infinikv.models import load_model

    model, tokenizer = load_model(str(tiny_folder))
    samples = ruler.generate("niah_single_1", tokenizer, None, 300, 3)
    policy = parse_spec({"policy": "h2o", "budget": 0.5})
    together = run_cell(model, tokenizer, samples, policy, [], batch_size=3)
    alone = run_cell(model, tokenizer, samples, policy, [], batch_size=1)
    assert [o["output"] for o in together["outputs"]] == [o["output"] for o in alone["outputs"]]
    assert 0 < together["needle_attended"] < 100 and "oracle_needle_attended" not in together  # it evicts
    assert together["needle_attended"] == pytest.approx(alone["needle_attended"], abs=0.05)
    whole = run_cell(model, tokenizer, samples, parse_spec({"policy": "full"}), [], batch_size=3)
    assert whole["needle_attended"] == 100 and len(whole["needle_attended_per_layer"]) == 2
