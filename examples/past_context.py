"""One request past the model's trained context, through the ``openai`` client, under ``bct``.

Starts ``infinikv serve`` on a free loopback port, sends one streamed completion whose prompt
(``--prompt`` tokens of Austen's Emma) plus ``max_tokens`` (``--max-tokens``, generated to the end:
``ignore_eos``) run past the model's trained context, and prints the time to first token, the
rate of the first and the last ``--window`` generated tokens, their ratio and the K/V the request
held. A bounded cache that renumbers its keys keeps both the rate and the memory flat::

    python examples/past_context.py --prompt 6000 --max-tokens 6000 --capacity 1024

Tokens are timed by the ``usage`` each chunk carries (``stream_options`` ``continuous_usage_stats``,
vLLM's extension): a token that adds no text (a character split over tokens, a skipped special
token) is counted with the chunk that follows it.
"""

import argparse
import time

from openai import OpenAI
from transformers import AutoConfig, AutoTokenizer

from infinikv.bench.server import running_server
from infinikv.data import load_text
from infinikv.models import resolve


def rate(arrivals: list[tuple[float, int]], start: int, end: int | None) -> float:
    """Tokens per second from the chunk that brought token ``start`` to the one that brought
    ``end`` (None: the last)."""
    begin = next(i for i, (_, n) in enumerate(arrivals) if n >= start)
    stop = len(arrivals) - 1 if end is None else next(i for i, (_, n) in enumerate(arrivals) if n >= end)
    return (arrivals[stop][1] - arrivals[begin][1]) / (arrivals[stop][0] - arrivals[begin][0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--prompt", type=int, default=6000, help="prompt tokens")
    parser.add_argument("--max-tokens", type=int, default=6000)
    parser.add_argument("--capacity", type=int, default=1024, help="bct's tokens kept per layer")
    parser.add_argument("--window", type=int, default=1000, help="tokens whose rate is compared")
    args = parser.parse_args()

    folder = resolve(args.model)[0]
    tokenizer, config = AutoTokenizer.from_pretrained(folder), AutoConfig.from_pretrained(folder)
    ids = tokenizer(load_text("austen:emma", from_chapter_one=True)).input_ids[: args.prompt]
    prompt = tokenizer.decode(ids)
    serve = ["--policy", "bct", "--capacity", str(args.capacity), "--kv-memory", "1GiB"]
    with running_server(args.model, serve) as (base, _):
        client = OpenAI(base_url=f"{base}/v1", api_key="unused")
        started, arrivals, usage, kv = time.perf_counter(), [], None, None  # arrivals: (seconds, tokens so far)
        for chunk in client.completions.create(
            model=args.model,
            prompt=prompt,
            max_tokens=args.max_tokens,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True, "continuous_usage_stats": True},
            extra_body={"ignore_eos": True},
        ):
            if chunk.choices and chunk.usage:
                arrivals.append((time.perf_counter(), chunk.usage.completion_tokens))
            elif chunk.usage:
                usage, kv = chunk.usage, chunk.model_extra.get("kv")
    trained = getattr(config.get_text_config(), "max_position_embeddings", None)
    first, last = rate(arrivals, 1, args.window), rate(arrivals, usage.completion_tokens - args.window, None)
    print(f"prompt {usage.prompt_tokens} tokens + {usage.completion_tokens} generated (trained context: {trained})")
    print(f"time to first token {arrivals[0][0] - started:.1f} s; total {arrivals[-1][0] - started:.1f} s")
    window = args.window
    print(f"first {window} tokens {first:.2f} tokens/s, last {window} {last:.2f} tokens/s: {last / first:.2f}x")
    print(f"K/V held (peak) {kv['kv_bytes'] / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()
