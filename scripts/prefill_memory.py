"""What a long prompt costs through ``infinikv generate``: prefill seconds, the process's RSS peak
above the loaded model (``generate --json`` reads it), and the cache's own peak K/V, in the
policy's chunks and in one chunk. One process per run, one run at a time.

    .venv/bin/python scripts/prefill_memory.py --policies "bct[capacity=1024],full" \
        --tokens 8000 --one-chunk 8000 --out docs/results/prefill.json
    .venv/bin/python scripts/prefill_memory.py --policies "bct[capacity=1024]" --tokens 32000 --one-chunk 0 \
        --out docs/results/prefill.json --append
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from transformers import AutoTokenizer

from infinikv.bench.pages import keep
from infinikv.cli.common import split_policies
from infinikv.data import load_text
from infinikv.models import resolve, resolve_weights


def run(model: str, policy: str, options: dict, prompt: Path, chunk: int) -> dict:
    """``infinikv generate`` once, for one new token; its JSON result."""
    given = [f"--{k.replace('_', '-')}={v}" for k, v in options.items()]
    given += [f"--prefill-chunk={chunk}"] if chunk else []
    command = [sys.executable, "-m", "infinikv.cli", "generate", "--model", model, "--json", "--max-new-tokens", "1"]
    command += ["--compile", "off", "--policy", policy, *given, "--prompt-file", str(prompt)]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"failed: {' '.join(command)}\n{done.stderr}")
    return json.loads(done.stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--policies", default="bct[capacity=1024],full,h2o[capacity=1024],infinigen")
    parser.add_argument("--tokens", default="8000", help="prompt lengths, comma-separated")
    parser.add_argument("--one-chunk", type=int, default=8000, help="also prefill prompts of this length in one chunk")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--append", action="store_true", help="add to the rows already in --out")
    args = parser.parse_args()
    tokenizer = AutoTokenizer.from_pretrained(resolve(args.model)[0])
    ids = tokenizer(load_text("austen:emma"))["input_ids"]
    weights = resolve_weights(args.model, "auto")
    before = json.loads(args.out.read_text()) if args.append else {"rows": []}
    rows = before["rows"]
    this = "python scripts/prefill_memory.py " + " ".join(sys.argv[1:])
    command = "\n".join(filter(None, [before.get("command"), this]))
    with tempfile.TemporaryDirectory() as tmp:
        for policy, options in split_policies(args.policies):
            for tokens in map(int, args.tokens.split(",")):
                prompt = Path(tmp) / f"{tokens}.txt"
                prompt.write_text(tokenizer.decode(ids[2000 : 2000 + tokens]))
                for chunk in [0] + ([tokens] if tokens == args.one_chunk else []):
                    result = run(args.model, policy, options, prompt, chunk)
                    row = {"model": args.model, "weights": weights, "policy": policy}
                    row |= {k: result.get(k) for k in ("capacity", "budget")}
                    row |= {"prompt_tokens": result["prompt_tokens"][0], "prefill_chunk": chunk}
                    row |= {"prefill_seconds": result["prefill_seconds"], "kv_bytes": result["kv_bytes"]}
                    row |= {k: result[k] for k in ("loaded_rss_bytes", "peak_rss_above_loaded_bytes")}
                    rows.append(row)
                    print(json.dumps(row), flush=True)
                    keep(rows, args.out, command)


if __name__ == "__main__":
    main()
