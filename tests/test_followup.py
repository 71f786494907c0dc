"""``infinikv eval followup``: documents with several needles, questions asked in turn through one
cache. The conversation path is checked against the whole history read in one prefill."""

import json

import pytest
import torch

from infinikv.cli import main
from infinikv.core import Batch, Sampling, sample
from infinikv.data import load_text
from infinikv.eval.followup import ANSWER_TOKENS, conversations, question_rows, run_followup
from infinikv.models import load_model
from infinikv.policies import parse_spec


@pytest.fixture(scope="module")
def tiny_chat(tiny_folder):
    model, tokenizer = load_model(str(tiny_folder))
    return model, tokenizer, conversations(tokenizer, load_text("austen:emma"), 400, 3, 3)


def test_a_document_hides_one_needle_per_question(tiny_chat):
    _, tokenizer, chats = tiny_chat
    for chat in chats:
        assert len(chat.turns[0]) == 400 and len(chat.turns) == 3 and len(set(chat.answers)) == 3
        needles = {tokenizer.decode(chat.turns[0][a:b]) for a, b in chat.spans}  # in prompt order
        holding = [next(n for n in needles if answer in n) for answer in chat.answers]
        assert len(set(holding)) == 3  # each answer in a needle of its own
        key = holding[1].split(" for ")[1].split(" is")[0]  # question 2 asks for answer 2's key
        assert key in tokenizer.decode(chat.turns[1]) and key not in tokenizer.decode(chat.turns[2])


def test_each_turn_answers_as_the_whole_history_read_at_once(tiny_chat):
    """Feeding answer 1 and question 2 into the cache gives the tokens a fresh prefill of the whole
    conversation gives; and a batch of conversations (padded turns) answers as each alone."""
    model, tokenizer, chats = tiny_chat
    full = parse_spec({"policy": "full"})
    together = run_followup(model, tokenizer, chats, full, [], batch_size=3)
    alone = run_followup(model, tokenizer, chats, full, [], batch_size=1)
    assert [o["outputs"] for o in together["outputs"]] == [o["outputs"] for o in alone["outputs"]]

    chat = chats[0]
    greedy = Sampling(max_new_tokens=ANSWER_TOKENS)
    first = Batch(model, full)
    answer = sample(first, first.prefill([chat.turns[0]], 0), greedy, [], 0)[0]
    history = chat.turns[0] + answer + chat.turns[1]
    whole = Batch(model, full)
    second = sample(whole, whole.prefill([history], 0), greedy, [], 0)[0]
    assert tokenizer.decode(second, skip_special_tokens=True) == alone["outputs"][0]["outputs"][1]
    assert len(together["accuracy"]) == 3 and all(0 <= a <= 1 for a in together["accuracy"])
    assert together["attended_fraction"] == [1.0, 1.0, 1.0]
    assert together["held_bytes"][0] < together["held_bytes"][1] < together["held_bytes"][2]  # the chat grows


@pytest.mark.parametrize("name", ["bct", "kvzip"])
def test_a_bounded_cache_holds_its_budget_through_every_turn(tiny_chat, name):
    model, tokenizer, chats = tiny_chat
    row = run_followup(model, tokenizer, chats, parse_spec({"policy": name, "capacity": 64}), [], batch_size=3)
    full = run_followup(model, tokenizer, chats, parse_spec({"policy": "full"}), [], batch_size=3)
    assert row["held_bytes"][0] == row["held_bytes"][2] < full["held_bytes"][0] / 4  # constant: the capacity
    assert all(a < 0.5 for a in row["attended_fraction"])
    rows = question_rows(row)
    assert [r["question"] for r in rows] == [1, 2, 3] and rows[2]["held_bytes"] == row["held_bytes"][2]
    assert "outputs" not in rows[0] and rows[0]["policy"] == name


def test_the_command_writes_a_row_per_question(capsys, tmp_path, tiny_folder):
    out = tmp_path / "followup.jsonl"
    argv = ["eval", "followup", "--model", str(tiny_folder), "--lengths", "300", "--questions", "2"]
    argv += ["--samples", "2", "--policies", "full,snapkv", "--budgets", "0.2", "--out", str(out), "--quiet"]
    assert main([*argv, "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["policy"], r["question"]) for r in rows] == [("full", 1), ("full", 2), ("snapkv", 1), ("snapkv", 2)]
    assert all({"budget", "length", "model", "accuracy"} <= set(r) and r["length"] == 300 for r in rows)
    assert len(out.read_text().splitlines()) == 2  # one resumable cell per policy
    assert main(argv) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0].split()[:5] == ["length", "policy", "budget", "q1", "q2"] and len(table) == 3


def test_a_bad_question_count_is_a_one_line_error(capsys, tiny_folder):
    code = main(["eval", "followup", "--model", str(tiny_folder), "--questions", "0"])
    err = capsys.readouterr().err
    assert code == 2 and "--questions" in err and "Traceback" not in err


@pytest.mark.parametrize("length", [60])
def test_a_document_too_short_for_its_needles_says_so(capsys, tiny_folder, length):
    code = main(["eval", "followup", "--model", str(tiny_folder), "--lengths", str(length), "--questions", "4"])
    err = capsys.readouterr().err
    assert code == 2 and "use a longer length" in err
    torch.manual_seed(0)
