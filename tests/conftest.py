"""Shared fixtures: the real bundled model (fetched by `make test`), real text, a tiny random Llama."""

import os

# Under pytest-xdist (`make test` runs 2 workers) each worker, and every process a test starts,
# gets its share of the cores: two torch processes with a thread per core each would fight
# over them (a busy core slows an OpenMP matmul many times over). Set before torch is imported.
if workers := os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // int(workers)))

import pytest  # noqa: E402
import torch  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM

from infinikv import attach, load_model  # noqa: E402
from infinikv.data import load_text  # noqa: E402

if workers:  # in case a plugin imported torch first
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


# `make test` hands whole files to two workers (`--dist loadfile --no-loadscope-reorder`) in this
# order, the longest first (seconds per file, measured on a whole run), so the last file a worker
# runs while the other is idle is a short one; files not named follow in their own order.
LONGEST_FIRST = (
    "test_policies.py",  # ~300 s
    "test_serve.py",  # ~290
    "test_core.py",  # ~220
    "test_ray.py",  # ~200
    "test_models_real.py",  # ~200
    "test_cli.py",  # ~150
    "test_weights.py",  # ~100
    "test_ruler_run.py",  # ~80
    "test_bct.py",  # ~70
    "test_harness.py",  # ~65
    "test_infinigen.py",  # ~55
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: a file keeps its own order


@pytest.fixture(autouse=True)
def seeded():
    """Every test draws the same random numbers whichever tests ran before it in its process (two
    xdist workers split the tests differently from run to run): a lossy policy's greedy tokens on
    a random prompt, equal by luck for one draw, failed for another."""
    torch.manual_seed(0)


@pytest.fixture(scope="session")
def real():
    """(model, tokenizer) of the bundled SmolLM2-135M-Instruct in fp32: the exactness tests' format."""
    torch.manual_seed(0)
    return load_model("smollm2-135m", weights="fp32")


@pytest.fixture(scope="session")
def emma_ids(real):
    """The first 200 tokens of Emma, chapter 1 (1, 200)."""
    _, tokenizer = real
    return tokenizer(load_text("austen:emma", from_chapter_one=True)[:4000], return_tensors="pt").input_ids[:, :200]


@pytest.fixture(scope="session")
def tiny():
    """A 2-layer random Llama with grouped-query attention, for fast unit tests."""
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
    )
    return attach(LlamaForCausalLM(config).eval())


@pytest.fixture(scope="session")
def tiny_folder(tmp_path_factory):
    """A saved 2-layer random Llama with the bundled tokenizer: a real ``--model`` folder that
    runs a whole benchmark in seconds."""
    from transformers import AutoTokenizer

    from infinikv.models import DEFAULT_MODEL, bundled_folder

    tokenizer = AutoTokenizer.from_pretrained(bundled_folder(DEFAULT_MODEL))
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
    )
    folder = tmp_path_factory.mktemp("tiny-llama")
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder
