"""The server, end to end: a real ``infinikv serve`` on a free loopback port, the real ``openai`` client."""

import json
import re
import shutil
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import torch

from infinikv import Sampling, generate, make_policy
from infinikv.bench.server import free_port, running_server
from infinikv.bench.serving import bench_serve
from infinikv.cli import main
from infinikv.serve.metrics import snapshot
from infinikv.serve.sequence import safe_end as _safe_end

MODEL = "smollm2-135m"
KEY = "test-key"
KV_MEMORY = 64 * 2**20  # 1,456 tokens of smollm2-135m's fp32 K/V (46,080 bytes a token, all layers)
PER_TOKEN = 46080


@pytest.fixture(scope="module")
def server():
    """Base URL of a server with a 64 MiB K/V budget, a queue of one, an API key and InfiniGen
    prepared at start."""
    flags = ["--kv-memory", "64MiB", "--max-queue", "1", "--api-key", KEY, "--threads", "1", "--prepare", "infinigen"]
    with running_server(MODEL, flags) as (base, _):
        yield base


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key=KEY, max_retries=0, timeout=120)


def metrics(server) -> dict[str, float]:
    text = httpx.get(f"{server}/metrics", headers={"Authorization": f"Bearer {KEY}"}, timeout=60).text
    return {name: float(value) for name, value in re.findall(r"^(infinikv_\S+) (\S+)$", text, re.M)}


def wait_for(server, condition, timeout: float = 30) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(server)
        if condition(m) or time.monotonic() > deadline:
            return m
        time.sleep(0.1)


def test_completion_and_chat(client):
    out = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=8, temperature=0)
    assert out.choices[0].text.startswith(" Paris") and out.choices[0].finish_reason == "length"
    assert out.usage.completion_tokens == 8 and out.usage.prompt_tokens == 5 and out.usage.total_tokens == 13
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=12,
        temperature=0,
    )
    assert "Paris" in chat.choices[0].message.content and chat.choices[0].message.role == "assistant"
    assert chat.usage.prompt_tokens > 10
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_policies_lists_what_a_request_may_name(server):
    listing = httpx.get(f"{server}/v1/policies", headers={"Authorization": f"Bearer {KEY}"}, timeout=60).json()
    rows = {row["name"]: row for row in listing["data"]}
    assert listing["default"] == {"policy": "full"} and rows["full"]["spec"] == listing["default"]
    assert rows["infinigen"]["ready"] and rows["infinigen"]["spec"]["policy"] == "infinigen"  # --prepare infinigen
    assert not rows["recall"]["ready"] and rows["recall"]["takes_budget"] and not rows["full"]["takes_budget"]
    assert httpx.get(f"{server}/v1/policies", timeout=60).status_code == 401
    assert httpx.get(f"{server}/", timeout=60).status_code == 200  # the chat page asks for the key itself


def test_streaming_and_stop(client, server):
    whole = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=8, temperature=0)
    stream = client.completions.create(
        model=MODEL,
        prompt="Once upon a time",
        max_tokens=8,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert chunks[-2].choices[0].finish_reason == "length" and chunks[-1].usage.completion_tokens == 8
    counted = client.completions.create(  # vLLM's continuous_usage_stats: each text chunk counts its tokens
        model=MODEL,
        prompt="Once upon a time",
        max_tokens=8,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True},
    )
    counts = [c.usage.completion_tokens for c in counted if c.choices and c.choices[0].text]
    assert counts == sorted(counts) and counts[0] >= 1 and counts[-1] == 8 and len(counts) >= 4
    stopped = client.completions.create(
        model=MODEL, prompt="The capital of France is", max_tokens=8, temperature=0, stop=["."]
    )
    assert stopped.choices[0].text == " Paris" and stopped.choices[0].finish_reason == "stop"
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "stream": True}
    with httpx.stream(
        "POST", f"{server}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=60
    ) as r:
        lines = [line for line in r.iter_lines() if line]
    assert r.headers["content-type"].startswith("text/event-stream") and lines[-1] == "data: [DONE]"


def test_kv_policy_per_request(client):
    prompt = "It was a truth universally acknowledged, that a single man in possession of a good fortune, " * 3
    full = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0)
    sink = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=4, temperature=0, extra_body={"kv": {"policy": "sink", "capacity": 8}}
    )
    assert full.kv["policy"] == "full" and sink.kv["policy"] == "sink" and sink.kv["capacity"] == 8
    # peak K/V: sink's prompt is prefilled in chunks of its capacity (8 held + 8 fed); full keeps it all
    assert sink.usage.prompt_tokens > 16 and sink.kv["kv_bytes"] == (8 + 8) * PER_TOKEN
    assert full.kv["kv_bytes"] == (full.usage.prompt_tokens + 3) * PER_TOKEN
    with pytest.raises(openai.BadRequestError, match="unknown policy"):
        client.completions.create(model=MODEL, prompt="Hi", extra_body={"kv": {"policy": "nope"}})


def test_metrics(client, server):
    before = metrics(server)
    client.completions.create(model=MODEL, prompt="Hello", max_tokens=3, temperature=0)
    after = metrics(server)
    assert (
        after['infinikv_requests_total{outcome="completed"}']
        == before['infinikv_requests_total{outcome="completed"}'] + 1
    )
    assert after["infinikv_tokens_generated_total"] == before["infinikv_tokens_generated_total"] + 3
    assert after["infinikv_kv_bytes_budget"] == KV_MEMORY and after["infinikv_kv_bytes_in_use"] == 0
    assert after["infinikv_tokens_per_second"] > 0 and after["infinikv_queue_length"] == 0
    assert 300 * 2**20 < after["infinikv_resident_bytes"] <= after["infinikv_resident_bytes_peak"]  # the model alone
    sparse = client.completions.create(
        model=MODEL,
        prompt="Hello there, " * 20,
        max_tokens=3,
        temperature=0,
        extra_body={"kv": {"policy": "infinigen"}},
    )
    fraction = metrics(server)['infinikv_fetch_fraction{policy="infinigen"}']
    assert 0 < fraction < 1 and fraction == pytest.approx(sparse.kv["fetched_fraction"], rel=1e-4)


PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village,",
    "def fibonacci(n):",
    "My favourite food is",
    "The three primary colours are",
    "In 1492, Columbus",
    "Water boils at",
    "The best way to learn a language is",
]
POLICIES = [
    {"policy": "full"},
    {"policy": "sink", "capacity": 6},
    {"policy": "h2o", "budget": 0.5},
    {"policy": "bct", "capacity": 6},
]


def test_concurrent_batched_equals_alone(client, server, real):
    """8 streams under 4 policies share decode steps; each equals its prompt run alone."""
    model, tokenizer = real

    def ask(i: int) -> str:
        stream = client.completions.create(
            model=MODEL, prompt=PROMPTS[i], max_tokens=8, temperature=0, stream=True, extra_body={"kv": POLICIES[i % 4]}
        )
        return "".join(c.choices[0].text for c in stream)

    alone = [ask(i) for i in range(8)]
    with ThreadPoolExecutor(8) as pool:
        together = list(pool.map(ask, range(8)))
    assert together == alone and len(set(alone)) == 8
    assert metrics(server)["infinikv_batch_size_max"] >= 4
    spec = dict(POLICIES[2])  # the server's path equals the library's (h2o: attention-scored eviction)
    library = generate(model, tokenizer, PROMPTS[2], make_policy(spec.pop("policy"), **spec), Sampling(8))
    assert library.texts[0] == alone[2]


def test_budget_queue_and_cancel(client, server, real):
    prompt_tokens = len(real[1]("Once upon a time").input_ids)
    big = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 1000, "temperature": 0}
    with pytest.raises(openai.BadRequestError, match="more than the server's K/V budget") as never:
        client.completions.create(**{**big, "max_tokens": 1500})
    assert never.value.code == "kv_budget_exceeded"
    cancelled = metrics(server)['infinikv_requests_total{outcome="cancelled"}']
    first = client.completions.create(**big, stream=True)
    next(iter(first))  # running, holding 1000+ tokens' worth of reservation
    m = metrics(server)
    assert m["infinikv_kv_bytes_reserved"] == (prompt_tokens + 1000) * PER_TOKEN and m["infinikv_kv_bytes_in_use"] > 0
    second = client.completions.create(**big, stream=True)  # waits: both do not fit in 64 MiB
    assert wait_for(server, lambda m: m["infinikv_queue_length"] == 1)["infinikv_queue_length"] == 1
    with pytest.raises(openai.RateLimitError, match="queue is full") as full:
        client.completions.create(**big)
    assert full.value.response.headers["retry-after"] == "1"
    first.close()  # the client goes away: its sequence stops and the waiting one is admitted
    assert next(iter(second)).choices[0].text
    second.close()
    m = wait_for(server, lambda m: m["infinikv_active_sequences"] == 0)
    assert m["infinikv_kv_bytes_in_use"] == 0 and m["infinikv_kv_bytes_reserved"] == 0
    assert m['infinikv_requests_total{outcome="cancelled"}'] == cancelled + 2


def test_api_key(server):
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server}/v1", api_key="wrong", max_retries=0).models.list()
    r = httpx.get(f"{server}/v1/models")
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{server}/v1/models", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
    assert httpx.get(f"{server}/health").status_code == 200


GOOD = {"model": MODEL, "prompt": "Hello", "max_tokens": 2}


@pytest.mark.parametrize(
    "path, body, status, says",
    [
        ("completions", "{not json", 400, "not valid JSON"),
        ("completions", [1, 2], 400, "body"),
        ("completions", {**GOOD, "max_tokens": "ten"}, 400, "max_tokens"),
        ("completions", {**GOOD, "max_tokens": -1}, 400, "max_tokens"),
        ("completions", {**GOOD, "max_tokens": 10**6}, 400, "trained context of 8192 tokens under full; a policy"),
        ("completions", {**GOOD, "kv": {"policy": "infinigen", "max_fetch": 0.2}}, 400, "--prepare 'infinigen[max_"),
        ("completions", {**GOOD, "temperature": "hot"}, 400, "temperature"),
        ("completions", {**GOOD, "prompt": "   "}, 400, "empty"),
        ("completions", {**GOOD, "prompt": ["a", "b"]}, 400, "one prompt"),
        ("completions", {**GOOD, "kv": {"policy": "sink"}}, 400, "needs --budget"),
        ("completions", {**GOOD, "kv": {"budget": 0.2}}, 400, "policy"),
        ("completions", {**GOOD, "kv": {"policy": "sink", "budget": 3}}, 400, "budget"),
        ("completions", {**GOOD, "kv": {"policy": "bct", "kv_memory": "1KB"}}, 400, "holds no token"),
        ("completions", {**GOOD, "model": "gpt-4"}, 404, "not served"),
        ("completions", {**GOOD, "n": 2}, 400, "n=1"),
        ("completions", {**GOOD, "logprobs": 3}, 400, "logprobs"),
        ("completions", {"model": MODEL}, 400, "prompt"),
        ("chat/completions", {"model": MODEL, "messages": []}, 400, "messages"),
        ("chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": ""}]}, 400, "empty"),
        ("chat/completions", {"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}, 400, "role"),
        ("nowhere", GOOD, 404, "Not Found"),
    ],
)
def test_bad_input(server, path, body, status, says):
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    kwargs = {"content": body} if isinstance(body, str) else {"json": body}
    r = httpx.post(f"{server}/v1/{path}", headers=headers, timeout=60, **kwargs)
    assert r.status_code == status
    error = r.json()["error"]
    assert says in error["message"] and error["type"]


def test_bounded_policies_run_past_the_trained_context(tiny_folder, tmp_path):
    """A model trained on 64 positions: ``full`` cannot go past them and says which policy can;
    ``bct`` (renumbered keys) generates 120 tokens after a 20-token prompt through the openai client."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(tiny_folder)
    config.max_position_embeddings = 64
    folder = tmp_path / "short"
    shutil.copytree(tiny_folder, folder)
    config.save_pretrained(folder)
    with running_server(str(folder), ["--kv-memory", "16MiB"]) as (base, _):
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=120)
        ask = {"model": str(folder), "prompt": "one two three four " * 5, "max_tokens": 120, "temperature": 0}
        with pytest.raises(openai.BadRequestError, match="trained context of 64 tokens under full.*: bct"):
            client.completions.create(**ask)
        past = client.completions.create(**ask, extra_body={"kv": {"policy": "bct", "capacity": 16}})
        assert past.usage.completion_tokens == 120 and past.usage.prompt_tokens + 120 > 64
        with pytest.raises(openai.BadRequestError, match="trained context of 64 tokens under bct"):
            client.completions.create(
                **ask, extra_body={"kv": {"policy": "bct", "capacity": 16, "positions": "original"}}
            )


def test_a_budget_that_holds_no_request_is_refused_at_start(capsys):
    assert main(["serve", "--kv-memory", "1KiB", "--port", str(free_port())]) == 2
    err = capsys.readouterr().err
    assert "--kv-memory of 0.00 MiB cannot hold one request of the default kv full" in err and err.count("\n") == 1


def test_a_process_budget_that_holds_no_request_is_refused_at_start(capsys):
    assert main(["serve", "--memory", "10MiB", "--port", str(free_port())]) == 2
    err = capsys.readouterr().err
    assert "--memory of 10.00 MiB (" in err and "resident with the model loaded) cannot hold one request" in err


def test_a_process_budget_admits_what_fits_beside_what_it_measured(real):
    """``serve --memory``: the scheduler measures what forwards take beyond the K/V; admission keeps
    the model, that rest and the reserved K/V under the budget, and admits a request alone whatever
    the rest (it has nobody to wait for)."""
    from infinikv import memory
    from infinikv.serve.budget import ProcessBudget
    from infinikv.serve.scheduler import Scheduler
    from infinikv.serve.sequence import Sequence

    model, tokenizer = real
    prompt = tokenizer("The quick brown fox jumps over the lazy dog.").input_ids
    full = make_policy("full")
    one = (len(prompt) + 8) * PER_TOKEN  # what a request of 8 new tokens reserves
    budget = ProcessBudget(memory.rss() + 2**30)
    scheduler = Scheduler(model, tokenizer, kv_memory=2**30, max_queue=4, keep_conversations=0, budget=budget)
    try:
        converse(scheduler, Sequence(prompt, full, Sampling(8), [], None))
        assert budget.rest > 0  # a forward's temporaries, at least
        assert snapshot(scheduler)["memory_bytes_rest"] == budget.rest
        budget.total = budget.base + budget.rest + 2 * one + one // 2  # room for two requests, not three
        admission = scheduler.admission
        seqs = [Sequence(prompt, full, Sampling(8), [], None) for _ in range(3)]
        for seq in seqs:
            admission.price(seq)
        with scheduler.cond:  # nothing is running: nothing is admitted behind the test's back
            assert [admission.offer(seq) for seq in seqs] == [True, True, False]
            admission.release(seqs[0])
            assert list(admission.admit_waiting()) == [seqs[2]]
            admission.release(seqs[1])
            admission.release(seqs[2])
            budget.rest = budget.total  # a rest that fills the budget: a request alone still runs
            assert [admission.offer(seq) for seq in seqs[:2]] == [True, False]
            admission.release(seqs[0])
            admission.waiting.clear()
    finally:
        scheduler.close()


@pytest.mark.parametrize("name, options", [("full", {}), ("bct", {"capacity": 32})])
def test_a_decode_step_reads_the_device_once_however_many_rows(real, name, options):
    """The tokens of every running row are picked on the device and read back in one go: a step of
    three rows, as one of one, reads the host once (``tolist``, ``item``, ``bool``, ``int``)."""
    import threading

    from infinikv.serve.scheduler import Scheduler
    from infinikv.serve.sequence import Sequence

    model, tokenizer = real
    reads, steps = [], []
    originals = {method: getattr(torch.Tensor, method) for method in ("tolist", "item", "__bool__", "__int__")}

    def counted(method):
        def read(tensor, *args):
            if threading.current_thread().name == "infinikv-scheduler":
                reads.append(method)
            return originals[method](tensor, *args)

        return read

    scheduler = Scheduler(model, tokenizer, kv_memory=2**30, max_queue=4, keep_conversations=0, compile=False)
    step = scheduler._step

    def observed() -> None:
        rows, before = sum(len(g.seqs) for g in scheduler.groups.values()), len(reads)
        step()
        steps.append((rows, reads[before:]))

    scheduler._step = observed
    prompts = [tokenizer(text).input_ids for text in ("The sea", "A quiet morning in the hills", "Tea")]
    try:
        for method in originals:
            setattr(torch.Tensor, method, counted(method))
        seqs = [Sequence(p, make_policy(name, **options), Sampling(12), [], None, ignore_eos=True) for p in prompts]
        finished = [threading.Event() for _ in seqs]
        for seq, event in zip(seqs, finished, strict=True):
            seq.emit = lambda e, event=event: e[0] in ("done", "error") and event.set()
            scheduler.submit(seq)
        assert all(event.wait(120) for event in finished)
    finally:
        for method, original in originals.items():
            setattr(torch.Tensor, method, original)
        scheduler.close()
    assert max(rows for rows, _ in steps) == 3
    assert all(len(read) == 1 for _, read in steps), steps


def test_worst_case_bytes(real):
    config = real[0].config
    assert make_policy("full").worst_case_bytes(config, 100, 50) == 150 * PER_TOKEN
    assert make_policy("bct", capacity=64).worst_case_bytes(config, 100, 500) == 100 * PER_TOKEN  # the prefill
    assert make_policy("bct", capacity=64).worst_case_bytes(config, 10, 500) == 65 * PER_TOKEN
    assert make_policy("bct", capacity=64).worst_case_bytes(config, 10, 5) == 65 * PER_TOKEN  # allocated once
    assert make_policy("recall", capacity=64).worst_case_bytes(config, 10, 5) == 65 * PER_TOKEN  # its fast tier
    assert make_policy("sink", budget=0.5).worst_case_bytes(config, 10, 90) == 51 * PER_TOKEN
    bct = make_policy("bct", capacity=64)  # a prompt prefilled in chunks holds at most capacity + a chunk
    assert bct.worst_case_bytes(config, 1000, 5, chunk=64) == 128 * PER_TOKEN
    assert bct.worst_case_bytes(config, 100, 5, chunk=64) == 100 * PER_TOKEN
    assert make_policy("full").worst_case_bytes(config, 1000, 5, chunk=64) == 1005 * PER_TOKEN


def test_a_long_prompt_under_a_bounded_policy_reserves_its_capacity_and_a_chunk(real, emma_ids):
    """The server prefills in the policy's chunks and reserves what that holds at most, not the
    whole prompt: the cache's real peak stays within it."""
    from infinikv.serve.scheduler import Scheduler
    from infinikv.serve.sequence import Sequence

    model, tokenizer = real
    seq = Sequence(emma_ids[0].tolist(), make_policy("bct", capacity=64), Sampling(4), [], None, ignore_eos=True)
    scheduler = Scheduler(model, tokenizer, kv_memory=2**30, max_queue=1, keep_conversations=0)
    try:
        converse(scheduler, seq)
    finally:
        scheduler.close()
    assert seq.chunk == 64 and seq.reserved == (64 + 64) * PER_TOKEN
    assert 65 * PER_TOKEN <= seq.kv_bytes <= seq.reserved


def test_stop_strings_are_held_back():
    assert _safe_end("Paris. The", ["The end"]) == len("Paris. ")
    assert _safe_end("Paris", ["."]) == 5 and _safe_end("caf\ufffd", []) == 3


@pytest.mark.parametrize(
    "argv, says",
    [
        (["serve", "--kv-memory", "lots"], "--kv-memory"),
        (["serve", "--policy", "nope"], "unknown policy"),
        (["serve", "--capacity", "8"], "needs --policy"),
        (["serve", "--store", "/proc/no/store"], "--store /proc/no/store"),
        (["serve", "--store-size", "big"], "--store-size"),
        (["bench", "serve", "--clients", "0"], "--clients"),
        (["bench", "serve", "--json", "/proc/no/rows.json"], "--json /proc/no/rows.json: cannot write"),
        (["bench", "serve", "--policy", "full", "--policies", "full,sink"], "not both"),
        (["bench", "serve", "--kill-after", "3"], "give --turns"),
    ],
)
def test_cli_usage_errors(argv, says, capsys):
    assert main(argv) == 2
    assert says in capsys.readouterr().err


def test_bench_serve():
    result = bench_serve(
        MODEL, ["--kv-memory", "256MiB"], 256 * 2**20, clients=2, requests=3, max_tokens=4, duration=120
    )
    assert result["completed"] == 3 and result["errors"] == 0 and result["unfinished"] == 0
    assert 0 < result["ttft_p50_ms"] <= result["ttft_p99_ms"] and result["itl_p50_ms"] > 0
    assert result["aggregate_tokens_per_second"] == pytest.approx(3 * 4 / result["seconds"], rel=0.01)
    assert result["peak_rss_bytes"] > result["model_bytes"] > 0 and result["requests_per_second"] > 0
    assert 1 <= result["most_decoding_at_once"] <= 2


def test_bench_serve_measures_each_policy_on_its_own_server(tmp_path, capsys):
    out = tmp_path / "rows.json"
    argv = ["bench", "serve", "--policies", "full,sink[capacity=64]", "--prompt-tokens", "120", "--clients", "2"]
    code = main([*argv, "--requests", "2", "--max-tokens", "3", "--kv-memory", "256MiB", "--json", str(out)])
    rows = json.loads(out.read_text())
    assert [r["policy"] for r in rows] == ["full", "sink[capacity=64]"]
    for row in rows:  # every request a document of 120 tokens, answered with exactly 3 tokens
        assert row["completed"] == 2 and row["errors"] == 0 and row["prompt_tokens_mean"] == pytest.approx(120, abs=2)
        assert row["aggregate_tokens_per_second"] == pytest.approx(2 * 3 / row["seconds"], rel=0.01)
    assert code == (0 if all(r["rss_within_budget"] for r in rows) else 1)
    assert "sink[capacity=64]" in capsys.readouterr().out


def test_bench_serve_turns_continued_and_fresh():
    from infinikv.bench.turns import ChatLoad, bench_turns, turns_table

    result = bench_turns(MODEL, ["--kv-memory", "256MiB", "--threads", "1"], 256 * 2**20, ChatLoad(2, 2, 20, 4))
    assert result["errors"] == 0
    for run, peak in result["peak_rss_bytes"].items():  # the weights are read in by the first forward
        assert peak > result["model_bytes"] and peak >= result["idle_rss_bytes"][run] > 0
    first, second = result["turns_table"]
    assert first["continued_cached_tokens"] == first["fresh_cached_tokens"] == second["fresh_cached_tokens"] == 0
    assert 0 < second["continued_cached_tokens"] < second["prompt_tokens"]  # every client continued its cache
    assert second["continued_kv_bytes"] == second["fresh_kv_bytes"]  # full: the same tokens either way
    assert "cached" in turns_table(result).splitlines()[1]


def test_a_long_prefill_is_chunked_between_decode_steps(real):
    """While a stream decodes, a long prompt is prefilled a chunk at a time with decode steps in
    between (the stream keeps getting tokens), and both finish with the right texts."""
    import threading

    from infinikv.core import Sampling
    from infinikv.serve.scheduler import Scheduler
    from infinikv.serve.sequence import Sequence

    model, tokenizer = real
    scheduler = Scheduler(model, tokenizer, kv_memory=2**30, max_queue=4, prefill_chunk=128)
    events: dict[str, list] = {"stream": [], "long": []}
    done = threading.Event()

    def emit(name):
        def put(event):
            events[name].append((event, scheduler.steps))
            if name == "long" and event[0] in ("done", "error"):
                done.set()

        return put

    try:
        stream = Sequence(
            tokenizer("Once upon a time").input_ids, make_policy("full"), Sampling(60), [], emit("stream")
        )
        scheduler.submit(stream)
        while scheduler.steps < 3:  # the stream is decoding
            time.sleep(0.01)
        long_ids = tokenizer("It was a bright cold day in April. " * 120).input_ids[:1000]
        prompt = Sequence(long_ids, make_policy("full"), Sampling(1), [], emit("long"))
        scheduler.submit(prompt)
        assert done.wait(120)
    finally:
        scheduler.close()
    finished_at = events["long"][-1][1]
    assert events["long"][-1][0] == ("done", "length")
    assert finished_at - 3 >= 1000 // 128  # at least one decode step per chunk before the prefill ended
    assert len([e for e in events["stream"] if 3 <= e[1] <= finished_at and e[0][0] == "text"]) >= 1000 // 128


def converse(scheduler, *turns):
    """Run ``turns`` (each a Sequence) one after another on ``scheduler``; each must complete."""
    import threading

    for seq in turns:
        finished = threading.Event()
        seq.emit = lambda event, finished=finished: event[0] in ("done", "error") and finished.set()
        scheduler.submit(seq)
        assert finished.wait(120) and seq.finish_reason in ("stop", "length")
    return turns


@torch.inference_mode()
def test_a_conversation_continues_its_cache(real):
    """With ``full`` the next turn, continued, gives the tokens of the whole conversation sent
    fresh; with ``bct`` the continued cache equals one Batch fed the same tokens in the same order."""
    from infinikv.core import Batch
    from infinikv.serve.scheduler import Scheduler
    from infinikv.serve.sequence import Sequence

    model, tokenizer = real
    first = tokenizer("Alice lives in Paris and keeps three cats. Bob lives in Rome.").input_ids
    more = tokenizer(" Question: where does Alice live? Answer:").input_ids
    for spec in ({"policy": "full"}, {"policy": "bct", "capacity": 24}):
        policy = make_policy(spec.pop("policy"), **spec)
        scheduler = Scheduler(model, tokenizer, kv_memory=2**30, max_queue=4, keep_conversations=4)
        try:
            one = Sequence(first, policy, Sampling(6), [], None)
            converse(scheduler, one)
            second = first + one.tokens + more
            two = Sequence(second, policy, Sampling(6), [], None)
            converse(scheduler, two)
            kept = list(scheduler.admission.conversations.idle.values())
        finally:
            scheduler.close()
        assert two.reused == len(first) + one.fed == len(first) + len(one.tokens) - 1  # the last pick is unfed
        assert scheduler.admission.conversations.hits == 1 and snapshot(scheduler)["reuse_tokens_saved"] == two.reused
        if policy.name == "full":
            fresh = Scheduler(model, tokenizer, kv_memory=2**30, max_queue=4, keep_conversations=0)
            try:
                alone = Sequence(second, policy, Sampling(6), [], None)
                converse(fresh, alone)
            finally:
                fresh.close()
            assert alone.tokens == two.tokens and alone.reused == 0 and not fresh.admission.conversations.idle
            continue
        reference = Batch(model, policy)
        reference.cache.expect([len(first)])
        reference.feed(torch.tensor([first]))
        for token in one.tokens[: one.fed]:
            reference.step(torch.tensor([token]))
        reference.feed(torch.tensor([second[two.reused :]]))
        for token in two.tokens[: two.fed]:
            reference.step(torch.tensor([token]))
        assert kept[-1].tokens == second + two.tokens[: two.fed]
        for ours, theirs in zip(kept[-1].batch.cache.layers, reference.cache.layers, strict=True):
            assert ours.slots.held == theirs.slots.held == [24]
            n = theirs.slots.n
            for name in ("position", "valid"):
                assert torch.equal(ours.slots.state[name][..., :n], theirs.slots.state[name][..., :n])
            assert torch.allclose(ours.slots.keys[:, :, :n], theirs.slots.keys[:, :, :n], atol=1e-5)


def test_ignore_eos_generates_max_tokens(real):
    """vLLM's ``ignore_eos``: an end-of-sequence pick is generated like any token."""
    from infinikv.serve.scheduler import Scheduler
    from infinikv.serve.sequence import Sequence

    model, tokenizer = real
    prompt, full = tokenizer("The capital of France is").input_ids, make_policy("full")
    scheduler = Scheduler(model, tokenizer, kv_memory=2**30, max_queue=4, keep_conversations=0)
    try:
        (probe,) = converse(scheduler, Sequence(prompt, full, Sampling(1), [], None))
        scheduler.eos = {probe.tokens[0]}  # the model's first pick now ends a sequence
        stops, goes_on = converse(
            scheduler,
            Sequence(prompt, full, Sampling(5), [], None),
            Sequence(prompt, full, Sampling(5), [], None, ignore_eos=True),
        )
    finally:
        scheduler.close()
    assert stops.finish_reason == "stop" and stops.tokens == []
    assert goes_on.finish_reason == "length" and len(goes_on.tokens) == 5 and goes_on.tokens[0] == probe.tokens[0]


@torch.inference_mode()
def test_a_finished_row_is_copied_out_of_its_batch_alone(real):
    """``detach`` copies one row of a running batch: the copy decodes as that sequence alone
    would, and the batch it came from keeps its rows and K/V untouched."""
    from infinikv.core import Batch
    from infinikv.serve.conversations import detach

    model, tokenizer = real
    prompts = [tokenizer(t).input_ids for t in ("Alice lives in Paris and keeps three cats.", "Bob lives in Rome.")]
    for spec in ({"policy": "full"}, {"policy": "bct", "capacity": 8}):
        policy = make_policy(spec.pop("policy"), **spec)
        group, reference = Batch(model, policy), Batch(model, policy)
        group.feed(torch.tensor([prompts[0]]))
        second = Batch(model, policy)
        for batch in (second, reference):
            batch.feed(torch.tensor([prompts[1]]))
        group.append(second)
        before = [layer.slots.keys.clone() for layer in group.cache.layers]
        alone = detach(group, 1)
        assert alone.cache.rows == 1 and group.cache.rows == 2
        assert all(torch.equal(layer.slots.keys, k) for layer, k in zip(group.cache.layers, before, strict=True))
        assert alone.cache.held_bytes() == reference.cache.held_bytes()
        token = torch.tensor([42])
        assert torch.allclose(alone.step(token), reference.step(token), atol=1e-4)


def test_idle_conversations_make_room_least_recently_used_first(real):
    from infinikv.serve.scheduler import Scheduler
    from infinikv.serve.sequence import Sequence

    model, tokenizer = real
    prompt = tokenizer("The quick brown fox jumps over the lazy dog.").input_ids
    full = make_policy("full")
    budget = (len(prompt) + 40) * PER_TOKEN  # one request of 40 new tokens, nothing beside it
    scheduler = Scheduler(model, tokenizer, kv_memory=budget, max_queue=4, keep_conversations=2)
    try:
        a, b = converse(
            scheduler, Sequence(prompt, full, Sampling(4), [], None), Sequence(prompt, full, Sampling(5), [], None)
        )
        kept = snapshot(scheduler)
        assert kept["conversations_kept"] == 2 and kept["kv_bytes_kept"] == (2 * len(prompt) + 3 + 4) * PER_TOKEN
        converse(scheduler, Sequence(prompt, full, Sampling(6), [], None))  # the third: the oldest goes
        assert scheduler.admission.conversations.dropped == 1
        assert [len(c.tokens) for c in scheduler.admission.conversations.idle.values()] == [
            len(prompt) + 4,
            len(prompt) + 5,
        ]
        converse(scheduler, Sequence(prompt, full, Sampling(40), [], None))  # needs the whole budget
        after = snapshot(scheduler)
        assert (
            after["conversations_dropped"] == 3
            and after["conversations_kept"] == 1
            and after["kv_bytes_kept"] <= budget
        )
    finally:
        scheduler.close()


def test_a_chat_continues_its_cache_over_http(client, server):
    before = metrics(server)
    messages = [{"role": "user", "content": "Name a colour."}]
    first = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0)
    messages += [
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "And another one?"},
    ]
    second = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0)
    assert second.usage.prompt_tokens_details.cached_tokens > first.usage.prompt_tokens
    after = metrics(server)
    assert after["infinikv_reuse_hits_total"] == before["infinikv_reuse_hits_total"] + 1
    assert after["infinikv_reuse_tokens_saved_total"] - before["infinikv_reuse_tokens_saved_total"] == (
        second.usage.prompt_tokens_details.cached_tokens
    )


def test_each_api_key_continues_only_its_own_conversations(tiny_folder, tmp_path):
    """Two keys from --api-keys: a prompt that extends one key's finished request continues its
    cache for that key (cached_tokens) and for the other key is prefilled fresh, so neither the
    usage nor the time to first token tells one user what another sent."""
    keys = tmp_path / "keys"
    keys.write_text("# key name\nalice-key alice\nbob-key\n")
    with running_server(str(tiny_folder), ["--kv-memory", "16MiB", "--api-keys", str(keys)]) as (base, _):
        alice, bob = (
            openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0, timeout=120)
            for key in ("alice-key", "bob-key")
        )
        ask = {"model": str(tiny_folder), "max_tokens": 6, "temperature": 0}
        first = alice.completions.create(prompt="one two three four five six seven", **ask)
        following = "one two three four five six seven" + first.choices[0].text + " eight nine"
        assert bob.completions.create(prompt=following, **ask).usage.prompt_tokens_details.cached_tokens == 0
        continued = alice.completions.create(prompt=following, **ask)
        assert continued.usage.prompt_tokens_details.cached_tokens > 0  # alice's own cache, still there
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{base}/v1", api_key="alice", max_retries=0).models.list()


@pytest.mark.parametrize(
    "text, says",
    [("", "holds no key"), ("k1 same\nk2 same\n", "line 2: a key or name given twice"), ("k\nk\n", "line 2")],
)
def test_a_bad_api_keys_file_is_a_one_line_error(tmp_path, capsys, text, says):
    keys = tmp_path / "keys"
    keys.write_text(text)
    assert main(["serve", "--model", "smollm2-135m", "--api-keys", str(keys)]) == 2
    err = capsys.readouterr().err
    assert says in err and "Traceback" not in err


def test_conversations_survive_a_kill_under_load(tiny_folder):
    """Six conversations opening with a document, room for two at once: every turn is answered
    whole (429s waited out), and after a SIGKILL the new server restores from the store what the
    old one wrote, none of it failing to load."""
    from infinikv.bench.faults import bench_faults
    from infinikv.bench.turns import ChatLoad

    flags = ["--kv-memory", "300KiB", "--policy", "bct[capacity=64]", "--max-queue", "2", "--threads", "1"]
    load = ChatLoad(clients=6, turns=3, turn_tokens=10, max_tokens=4, document_tokens=100)
    result = bench_faults(str(tiny_folder), flags, 300 * 2**10, load, kill_after=6)
    assert result["errors"] == 0 and result["turns_answered"] == result["turns_asked"] == 18, result
    assert 1 <= result["most_decoding_at_once"] <= 2  # 64 + a chunk of 64 slots of 1 KiB reserved each: two fit
    assert result["stored_at_kill"] >= 1 and result["resumed_from_before_kill"] >= 1
    assert result["store_failures_after_kill"] == 0 and result["answered_at_kill"] >= 6
    assert result["cached_tokens"] > 0


def test_conversations_outlive_the_server_in_its_store(tiny_folder, tmp_path):
    """With --store, a conversation that leaves RAM (here at once: --keep-conversations 0) is
    written to disk and its next turn restores it (cached_tokens), after a SIGKILL and after a
    clean stop, with the answer the conversation gets continued in RAM; a damaged entry is prefilled."""
    store = ["--store", str(tmp_path / "store"), "--store-kv", "fp32", "--kv-memory", "16MiB"]
    ask = {"model": str(tiny_folder), "max_tokens": 6, "temperature": 0}
    prompts = ["one two three four five six seven", "alpha beta gamma delta epsilon"]

    def turn(base: str, text: str):
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=120)
        return client.completions.create(prompt=text, **ask)

    def entries() -> set:
        return set((tmp_path / "store").glob("*.safetensors"))

    with running_server(str(tiny_folder), ["--kv-memory", "16MiB"]) as (base, _):  # in RAM, no store
        following = [prompt + turn(base, prompt).choices[0].text + " eight nine" for prompt in prompts]
        in_ram = [turn(base, text) for text in following]
        assert all(answer.usage.prompt_tokens_details.cached_tokens > 0 for answer in in_ram)

    with running_server(str(tiny_folder), [*store, "--keep-conversations", "0"]) as (base, server):
        turn(base, prompts[0])
        m = wait_for(base, lambda m: m["infinikv_store_writes_total"] == 1)
        assert m["infinikv_store_conversations"] == 1 and m["infinikv_conversations_kept"] == 0
        first_entry = entries()
        turn(base, prompts[1])
        wait_for(base, lambda m: m["infinikv_store_writes_total"] == 2)
        server.kill()  # no clean stop: what was written before survives
        server.wait()
    (damaged,) = entries() - first_entry
    damaged.write_bytes(damaged.read_bytes()[:100])
    with running_server(str(tiny_folder), [*store, "--keep-conversations", "4"]) as (base, _):
        restored = turn(base, following[0])
        assert restored.usage.prompt_tokens_details.cached_tokens == in_ram[0].usage.prompt_tokens_details.cached_tokens
        assert restored.choices[0].text == in_ram[0].choices[0].text
        fresh = turn(base, following[1])  # its entry damaged: prefilled, answered as in RAM
        assert fresh.usage.prompt_tokens_details.cached_tokens == 0
        assert fresh.choices[0].text == in_ram[1].choices[0].text
        m = metrics(base)
        assert m["infinikv_store_restores_total"] == 1 and m["infinikv_store_failures_total"] == 1
        assert m["infinikv_store_conversations"] == 0  # both entries left the store: one restored, one dropped
        assert m["infinikv_store_inherited"] == 2 and m["infinikv_store_resumed_total"] == 1  # written before the kill
        assert m["infinikv_conversations_kept"] == 2  # back in RAM, until the server stops
    third = following[0] + restored.choices[0].text + " ten"
    with running_server(str(tiny_folder), store) as (base, _):  # the clean stop above wrote it
        answer = turn(base, third)
        assert answer.usage.prompt_tokens_details.cached_tokens > restored.usage.prompt_tokens_details.cached_tokens
        assert metrics(base)["infinikv_store_restores_total"] == 1
