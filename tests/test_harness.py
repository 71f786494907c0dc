"""infinikv as an lm-eval model: found by the real ``lm_eval`` command (registered by the package),
exact against the model's own forward under ``full``, and acting through the policy's cache."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from lm_eval.api.instance import Instance

from infinikv.errors import InfinikvError
from infinikv.harness import InfinikvLM

ROOT = Path(__file__).resolve().parents[1]
TASKS = ROOT / "examples" / "lm_eval"
sys.path.insert(0, str(TASKS))
import utils as local_tasks  # noqa: E402  (the example tasks' own generators)


def requests(kind: str, arguments: list[tuple]) -> list[Instance]:
    return [Instance(kind, {}, args, i) for i, args in enumerate(arguments)]


def own_logprobs(lm: InfinikvLM, ids: list[int]) -> torch.Tensor:
    """log p(ids[i + 1] | ids[: i + 1]) from one forward of the model without any cache (n - 1,)."""
    with torch.inference_mode():
        logits = lm.model(input_ids=torch.tensor([ids]), use_cache=False).logits[0, :-1].float()
    return logits.log_softmax(-1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]


@pytest.fixture(scope="module")
def tiny_lm(tiny_folder):
    return InfinikvLM(pretrained=str(tiny_folder), policy="full", chunk=7)


def test_loglikelihood_under_full_is_the_models_own(tiny_lm):
    torch.manual_seed(0)
    context, continuation = torch.randint(5, 1000, (40,)).tolist(), torch.randint(5, 1000, (6,)).tolist()
    ((total, greedy),) = tiny_lm._loglikelihood_tokens([(("", ""), context, continuation)], disable_tqdm=True)
    expected = own_logprobs(tiny_lm, context + continuation)[-len(continuation) :]
    assert total == pytest.approx(float(expected.sum()), abs=1e-4)
    assert greedy is False  # a random continuation is not what a random model would pick


def test_greedy_flag_is_true_for_the_models_own_continuation(tiny_lm):
    prompt = torch.randint(5, 1000, (30,)).tolist()
    out = tiny_lm.generate_until(requests("generate_until", [(tiny_lm.tokenizer.decode(prompt), {"max_gen_toks": 5})]))
    context = tiny_lm.tok_encode(tiny_lm.tokenizer.decode(prompt))
    continuation = tiny_lm.tok_encode(out[0])[:3]
    ((_, greedy),) = tiny_lm._loglikelihood_tokens([(("", ""), context, continuation)], disable_tqdm=True)
    assert continuation and greedy is True


def test_rolling_loglikelihood_in_chunks_is_the_models_own(tiny_lm):
    text = "It is a truth universally acknowledged, that a single man in possession of a good fortune."
    (total,) = tiny_lm.loglikelihood_rolling(requests("loglikelihood_rolling", [(text,)]), disable_tqdm=True)
    ids = [tiny_lm.prefix_token_id, *tiny_lm.tok_encode(text, add_special_tokens=False)]
    assert len(ids) > 2 * tiny_lm.chunk  # several chunks
    assert total == pytest.approx(float(own_logprobs(tiny_lm, ids).sum()), abs=1e-3)


def test_a_policy_that_evicts_changes_the_answer(tiny_folder, tiny_lm):
    sink = InfinikvLM(pretrained=str(tiny_folder), policy="sink", capacity=8)
    torch.manual_seed(1)
    context, continuation = torch.randint(5, 1000, (64,)).tolist(), torch.randint(5, 1000, (4,)).tolist()
    ((full, _),) = tiny_lm._loglikelihood_tokens([(("", ""), context, continuation)], disable_tqdm=True)
    ((kept, _),) = sink._loglikelihood_tokens([(("", ""), context, continuation)], disable_tqdm=True)
    assert abs(full - kept) > 1e-2


def test_generate_until_batches_like_alone_and_cuts_at_until(tiny_folder, tiny_lm):
    prompts = ["Once upon a time", "The sky is blue and the grass", "A"]
    kwargs = {"until": ["\n"], "max_gen_toks": 8}
    alone = tiny_lm.generate_until(requests("generate_until", [(p, kwargs) for p in prompts]), disable_tqdm=True)
    batched = InfinikvLM(pretrained=str(tiny_folder), policy="full", batch_size=3)
    together = batched.generate_until(requests("generate_until", [(p, kwargs) for p in prompts]), disable_tqdm=True)
    assert together == alone
    uncut = tiny_lm.generate_until(requests("generate_until", [(prompts[0], {"max_gen_toks": 8})]), disable_tqdm=True)
    assert uncut[0] and (cut := uncut[0][2:5]) and cut not in uncut[0][:2]
    again = tiny_lm.generate_until(
        requests("generate_until", [(prompts[0], {"max_gen_toks": 8, "until": [cut]})]), disable_tqdm=True
    )
    assert again == [uncut[0][: uncut[0].index(cut)]]


def test_a_bad_policy_fails_before_the_model_loads():
    with pytest.raises(InfinikvError, match="no parameter"):
        InfinikvLM(pretrained="/nonexistent", policy="full", bits=4)
    with pytest.raises(InfinikvError, match="unknown policy"):
        InfinikvLM(pretrained="/nonexistent", policy="nope")


def test_passkeys_are_lost_when_the_cache_keeps_too_little(real):
    """The example task on the real model, in process: the full cache finds every pass key, a
    16-token sink cache (4 first tokens + the newest) finds fewer."""
    docs = local_tasks.passkey()["test"].select(range(4))
    asked = requests("generate_until", [(d["prompt"], {"until": ["\n"], "max_gen_toks": 12}) for d in docs])
    found = {}
    for policy, extra in (("full", {}), ("sink", {"capacity": 16})):
        lm = InfinikvLM(pretrained="smollm2-135m", policy=policy, batch_size=4, **extra)
        found[policy] = sum(d["key"] in out for d, out in zip(docs, lm.generate_until(asked, True), strict=True))
    assert found["full"] == 4 and found["sink"] < found["full"]


def test_the_lm_eval_command_runs_the_local_tasks_through_infinikv(tmp_path, tiny_folder):
    """``lm_eval --model infinikv`` works from the shell (the package registers the model) on the
    three example tasks, offline (a tiny random model: this checks the plumbing, not the scores)."""
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    lm_eval = Path(sys.executable).with_name("lm_eval")
    done = subprocess.run(
        [
            str(lm_eval),
            "--model",
            "infinikv",
            "--model_args",
            f"pretrained={tiny_folder},policy=h2o,budget=0.5",
            "--tasks",
            "infinikv_passkey,infinikv_recall,infinikv_paragraphs",
            "--include_path",
            str(TASKS),
            "--limit",
            "3",
            "--output_path",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    (results,) = tmp_path.glob("*/results_*.json")
    scores = json.loads(results.read_text())["results"]
    assert scores["infinikv_passkey"]["sample_len"] == 3
    assert 0 <= scores["infinikv_passkey"]["acc,none"] <= 1 and 0 <= scores["infinikv_recall"]["acc,none"] <= 1
    assert 0 < scores["infinikv_paragraphs"]["bits_per_byte,none"] < 20  # finite: every token was scored
    assert json.loads(results.read_text())["config"]["model"] == "infinikv"


def test_the_registration_costs_other_programs_nothing():
    """The ``.pth`` hook is installed in every interpreter of the environment: it must import
    neither infinikv nor torch (nor lm-eval) until lm-eval loads its models."""
    probe = "import sys; print(sorted(m for m in ('infinikv', 'torch', 'lm_eval') if m in sys.modules))"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"
    hooked = "import sys; print(any(type(f).__name__ == '_Watch' for f in sys.meta_path))"  # from the .pth
    done = subprocess.run([sys.executable, "-c", hooked], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "True"
