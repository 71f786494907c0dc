"""Evaluation grids: cells, the worker that runs them, and resuming from a results file.

A cell is one (protocol, model, policy spec, parameters): a P-ctx perplexity, a P-needle run or
one RULER task at one length. A ``Worker`` loads its model once and runs any cell on it, either
in the driver's process (``LocalPool``) or as one Ray actor per worker (``cluster.RayPool``);
either way the driver appends each row to the results file as soon as it lands (``run_grid``),
and a run given the same file skips the cells it already holds, so an interrupted grid resumes.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from tqdm import tqdm

# What makes two rows the same cell, besides model and policy spec. Options (``Cell.options``:
# batch size, compiled steps) change how a cell runs, not what it measures.
PROTOCOLS: dict[str, tuple[str, ...]] = {
    "P-ctx": ("text", "context", "continuation"),
    "P-needle": ("text", "context", "needles", "seed"),
    "RULER": ("task", "length", "samples", "seed", "text"),
    "P-stream": ("text", "tokens", "chunk", "window"),
    "recall": ("text", "context", "steps"),
    "followup": ("length", "questions", "samples", "seed", "text"),
}
METRICS = {
    "P-ctx": "perplexity",
    "P-needle": "accuracy",
    "RULER": "accuracy",
    "P-stream": "perplexity",
    "recall": "recall",
    "followup": "accuracy",  # one per question
}


@dataclass(frozen=True)
class Cell:
    protocol: str
    model: str
    spec: dict[str, Any]
    params: dict[str, Any]
    options: dict[str, Any] = field(default_factory=dict)
    weights: str = "fp32"  # the format the model's weights are stored in (``infinikv.weights``)

    @property
    def key(self) -> str:
        packed = [self.weights] if self.weights != "fp32" else []  # fp32 keys as before formats existed
        return json.dumps([self.protocol, self.model, self.spec, self.params, *packed], sort_keys=True)

    def identity(self) -> dict[str, Any]:
        """What a result row carries so that ``row_key`` finds its cell again."""
        return {
            "protocol": self.protocol,
            "model": self.model,
            "weights": self.weights,
            "spec": self.spec,
            **self.params,
        }


def row_key(row: Any) -> str | None:
    """The key of the cell a result row came from; None for a row of no known cell."""
    keys = PROTOCOLS.get(row.get("protocol")) if isinstance(row, dict) else None
    if keys is None or any(k not in row for k in ("model", "spec", *keys)):
        return None
    params = {k: row[k] for k in keys}
    return Cell(row["protocol"], row["model"], row["spec"], params, weights=row.get("weights", "fp32")).key


def finished(out: Path) -> dict[str, dict]:
    """The rows already in ``out`` by cell key; a line cut short by an interrupted write is
    ignored (its cell runs again)."""
    done: dict[str, dict] = {}
    if not out.exists():
        return done
    for line in out.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if (key := row_key(row)) is not None:
            done[key] = row
    return done


def append_row(out: Path, row: dict) -> None:
    """Append ``row`` as one JSON line, on a line of its own even after a write cut short."""
    with out.open("ab+") as f:
        cut = f.tell() > 0 and f.seek(-1, 2) >= 0 and f.read(1) != b"\n"
        f.write((("\n" if cut else "") + json.dumps(row) + "\n").encode())


class Worker:
    """One model, loaded once, and the inputs of the cells it ran (a RULER task's samples are
    generated once for every policy that runs it)."""

    def __init__(
        self,
        model: str,
        device: str = "cpu",
        threads: int | None = None,
        progress: bool = False,
        loaded=None,
        weights: str = "fp32",
    ):
        import torch

        from . import models

        if threads:
            torch.set_num_threads(threads)
        self.name, self.weights, self.progress = model, weights, progress
        self.model, self.tokenizer = loaded or models.load_model(model, device=device, weights=weights)
        self.inputs: dict[tuple, Any] = {}
        self._reads: tuple[tuple, Any] = ((), None)  # one set of inputs and its prompts' readings

    def run(self, cell: Cell) -> dict:
        from .policies import parse_spec
        from .preparation import ensure_prepared

        if (cell.model, cell.weights) != (self.name, self.weights):
            raise ValueError(
                f"a worker of {self.name} ({self.weights}) was given a cell of {cell.model} ({cell.weights})"
            )
        policy = parse_spec(cell.spec)
        ensure_prepared(policy, self.model, self.tokenizer)  # loads the calibration the driver saved
        return {**RUNNERS[cell.protocol](self, policy, **cell.params, **cell.options), **cell.identity()}

    def cached(self, key: tuple, make: Callable[[], Any]) -> Any:
        if key not in self.inputs:
            self.inputs[key] = make()
        return self.inputs[key]

    def reads(self, key: tuple):
        """The prompt readings the cells of inputs ``key`` share (``eval.prompt_reads.Reads``). Cells
        run input by input (every policy of a task in turn), so one set is kept, as much K/V as
        ``full`` holds for all its prompts; a cell of other inputs drops it."""
        from .eval.prompt_reads import Reads

        if self._reads[0] != key:
            self._reads = (key, Reads())
        return self._reads[1]

    def text(self, name: str, from_chapter_one: bool = True) -> str:
        from . import data

        return self.cached(("text", name, from_chapter_one), lambda: data.load_text(name, from_chapter_one))


def _context(worker: Worker, policy, text: str, context: int, continuation: int, compile: bool | str = "off") -> dict:
    from .compiled import resolve
    from .eval.ppl import context_tokens, perplexity

    key = ("P-ctx", text, context, continuation)
    ids = worker.cached(key, lambda: context_tokens(worker.tokenizer, worker.text(text), context, continuation))
    compile = resolve(compile, worker.model, policy, 1, ids.shape[1]) and policy.compilable
    return perplexity(worker.model, ids, policy, context, worker.progress, compile=compile)


def _needle(worker: Worker, policy, text: str, context: int, needles: int, seed: int) -> dict:
    from .eval.needle import needle_accuracy, needle_cases

    key = ("P-needle", text, context, needles, seed)
    cases = worker.cached(key, lambda: needle_cases(worker.tokenizer, worker.text(text), context, needles, seed))
    return needle_accuracy(worker.model, worker.tokenizer, cases, policy, worker.progress)


def _ruler(worker: Worker, policy, task: str, length: int, samples: int, seed: int, text: str, batch_size: int) -> dict:
    from .engine import end_of_sequence_ids
    from .eval import ruler
    from .eval.ruler_run import run_cell

    def generate() -> list:
        haystack = worker.text(text) if ruler.TASKS[task].haystack == "text" else None
        trained = getattr(worker.model.config, "max_position_embeddings", None)
        return ruler.generate(task, worker.tokenizer, haystack, length, samples, seed, max_context=trained)

    key = ("RULER", task, length, samples, seed, text)
    prompts = worker.cached(key, generate)
    stop_ids = sorted(end_of_sequence_ids(worker.model, worker.tokenizer))
    with tqdm(
        total=samples, desc=f"{task} {policy.label()}", unit="sample", disable=not worker.progress, leave=False
    ) as bar:
        return run_cell(worker.model, worker.tokenizer, prompts, policy, stop_ids, batch_size, bar, worker.reads(key))


def _followup(
    worker: Worker, policy, length: int, questions: int, samples: int, seed: int, text: str, batch_size: int
) -> dict:
    from .engine import end_of_sequence_ids
    from .eval.followup import conversations, run_followup

    key = ("followup", length, questions, samples, seed, text)
    chats = worker.cached(
        key, lambda: conversations(worker.tokenizer, worker.text(text), length, questions, samples, seed)
    )
    stop_ids = sorted(end_of_sequence_ids(worker.model, worker.tokenizer))
    with tqdm(
        total=samples, desc=f"follow-up {policy.label()}", unit="chat", disable=not worker.progress, leave=False
    ) as bar:
        return run_followup(worker.model, worker.tokenizer, chats, policy, stop_ids, batch_size, bar, worker.reads(key))


def _stream(worker: Worker, policy, text: str, tokens: int, chunk: int, window: int) -> dict:
    from .eval.stream import stream, stream_tokens

    ids = worker.cached(
        ("P-stream", text, tokens), lambda: stream_tokens(worker.tokenizer, worker.text(text, False), tokens)
    )
    return stream(worker.model, ids, policy, chunk, window, worker.progress)


def _recall(worker: Worker, policy, text: str, context: int, steps: int) -> dict:
    from .eval.ppl import context_tokens
    from .eval.recall import attention_recall

    key = ("recall", text, context, steps)
    ids = worker.cached(key, lambda: context_tokens(worker.tokenizer, worker.text(text), context, steps))
    return attention_recall(worker.model, ids[:, : context + steps], policy, context, worker.progress)


RUNNERS: dict[str, Callable[..., dict]] = {
    "P-ctx": _context,
    "P-needle": _needle,
    "RULER": _ruler,
    "P-stream": _stream,
    "recall": _recall,
    "followup": _followup,
}


class Pool(Protocol):
    def run(self, cells: list[Cell]) -> Iterator[tuple[Cell, dict]]:
        """Each cell's row, in the order they finish."""
        ...


class LocalPool:
    """The cells one after another in this process."""

    def __init__(self, worker: Worker) -> None:
        self.worker = worker

    def run(self, cells: list[Cell]) -> Iterator[tuple[Cell, dict]]:
        for cell in cells:
            yield cell, self.worker.run(cell)


def run_grid(
    cells: Iterable[Cell],
    out: Path,
    pool: Callable[[], Pool],
    describe: Callable[[dict], str],
    progress: bool = True,
    minutes: float | None = None,
) -> list[dict]:
    """Every cell's row in the cells' order: those ``out`` already holds, then the others run by
    ``pool()`` (only made when there is work), each appended to ``out`` the moment it lands. After
    ``minutes`` no new cell starts: the rows so far are returned and a second run resumes."""
    cells = list(cells)
    done = finished(out)
    todo = [c for c in cells if c.key not in done]
    print(
        f"{len(cells) - len(todo)} of {len(cells)} cells already in {out}; give --out {out} again to resume",
        file=sys.stderr,
    )
    rows: dict[str, dict] = {}
    deadline = None if minutes is None else time.monotonic() + 60 * minutes
    if todo:
        with tqdm(total=len(todo), unit="cell", desc="cells", disable=not progress, position=0) as bar:
            for cell, row in pool().run(todo):
                append_row(out, row)
                rows[cell.key] = row
                bar.write(f"  done: {describe(row)}", file=sys.stderr)
                bar.update()
                if deadline is not None and time.monotonic() > deadline and len(rows) < len(todo):
                    left = len(todo) - len(rows)
                    bar.write(
                        f"--limit-minutes {minutes:g} spent: {left} cells not run; give --out {out} again for them",
                        file=sys.stderr,
                    )
                    break
    return [row for c in cells if (row := rows.get(c.key) or done.get(c.key))]
