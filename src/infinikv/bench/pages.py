"""The measured tables of the README and the docs, generated from committed result rows.

A page marks where a table goes with ``<!-- results: FILE TABLE [KEY=VALUE ...] -->`` and
``<!-- /results -->``; ``docs/results/FILE`` (or several, ``A.json+B.json``) holds the rows and
how they were measured (``command``, ``commit``, ``machine``, ``date``), ``TABLE`` names one of
``TABLES`` and the ``KEY=VALUE`` words are its arguments (``pivot`` and ``columns`` lay out any
rows, so a new result needs no new code). ``infinikv report --docs`` rewrites every marked block
from its rows, so no measured number is typed by hand and a re-measurement is new rows, not an
edited sentence; a test checks the pages are up to date.
"""

from __future__ import annotations

import json
import os
import platform
import re
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from ..errors import InfinikvError
from ..results import run_label
from .board import board_table

MARKED = re.compile(r"(<!-- results: (\S+\.json) (\w+)((?: \S+=\S+)*) -->\n).*?(<!-- /results -->)", re.DOTALL)
RUN = "run"  # a field name standing for ``run_label``: the policy, its budget, weights and compilation
MIB = "MiB"  # a format: bytes shown in MiB


def field(row: dict, name: str) -> object:
    """``row[name]``, or the run's label for ``run``."""
    return run_label(row) if name == RUN else row.get(name)


def selected(rows: list[dict], where: str | None) -> list[dict]:
    """The rows matching ``where`` (``FIELD:VALUE[|VALUE...][,FIELD:...]``, compared as text), or all."""
    for condition in where.split(",") if where else []:
        name, _, values = condition.partition(":")
        rows = [r for r in rows if str(field(r, name)) in values.split("|")]
    return rows


def cell(value: object, spec: str) -> str:
    """A value as a table shows it: ``-`` when missing, numbers with ``spec`` (Python's, or ``MiB``)."""
    if value is None:
        return "-"
    if isinstance(value, bool) or not isinstance(value, int | float):
        return str(value)
    if spec == MIB:
        return f"{value / 2**20:,.1f}"
    return format(value, spec)


def heading(name: str) -> str:
    """A field's column heading: ``run`` is the policy as it ran."""
    return "policy" if name == RUN else name.replace("_", " ")


def pivot_table(
    rows: list[dict], down: str, across: str, value: str, format: str = ",.1f", where: str | None = None
) -> list[str]:
    """``value`` of each (``down``, ``across``) pair: one line per ``down``, one column per ``across``,
    both in the rows' order (a pair measured twice shows its last row)."""
    rows = selected(rows, where)
    columns = list(dict.fromkeys(cell(field(r, across), ",") for r in rows))
    lines_of = list(dict.fromkeys(field(r, down) for r in rows))
    cells = {(field(r, down), cell(field(r, across), ",")): cell(field(r, value), format) for r in rows}
    header = ["| " + heading(down) + " | " + " | ".join(columns) + " |", "|---" * (len(columns) + 1) + "|"]
    return header + [
        f"| {cell(d, ',')} | " + " | ".join(cells.get((d, c), "-") for c in columns) + " |" for d in lines_of
    ]


def columns_table(rows: list[dict], fields: str, where: str | None = None) -> list[str]:
    """One line per row, one column per field of ``fields`` (``NAME[:FORMAT];...``; Python's format
    spec, ``,.1f`` if not given: ``,`` for a count, ``.1%`` for a share)."""
    specs = [(name, spec or ",.1f") for name, _, spec in (f.partition(":") for f in fields.split(";"))]
    lines = ["| " + " | ".join(heading(name) for name, _ in specs) + " |", "|---" * len(specs) + "|"]
    for r in selected(rows, where):
        lines.append("| " + " | ".join(cell(field(r, name), spec) for name, spec in specs) + " |")
    return lines


def pivot(rows: list[dict], key: str, spec: str) -> list[str]:
    """One line per context, one column per run (``run_label``): ``key`` formatted with ``spec``."""
    runs = list(dict.fromkeys(run_label(r) for r in rows))
    cells = {(r["context"], run_label(r)): format(r[key], spec) for r in rows if r.get(key) is not None}
    lines = ["| context | " + " | ".join(runs) + " |", "|---" * (len(runs) + 1) + "|"]
    for context in sorted({r["context"] for r in rows}):
        lines.append(f"| {context:,} | " + " | ".join(cells.get((context, run), "-") for run in runs) + " |")
    return lines


def decode_table(rows: list[dict]) -> list[str]:
    """ms per decode step (median), contexts down, runs across (``bench speed`` rows)."""
    return pivot(rows, "ms_per_step", ".1f")


def prompt_table(rows: list[dict]) -> list[str]:
    """Prefill speed in prompt tokens/s, contexts down, runs across (``bench speed`` rows)."""
    return pivot(rows, "prompt_tokens_per_second", ".0f")


def prefill_table(rows: list[dict]) -> list[str]:
    """Prefill of a long prompt in the policy's chunks and in one (``scripts/prefill_memory.py`` rows)."""
    lines = [
        "| policy | prompt tokens | prefill | seconds | RSS above the loaded model (MiB) | cache's peak K/V (MiB) |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        chunks = f"chunks of {r['prefill_chunk']:,}" if r["prefill_chunk"] else "the policy's chunks"
        lines.append(
            f"| {run_label(r)} | {r['prompt_tokens']:,} | {chunks} | {r['prefill_seconds']:.1f} | "
            f"{r['peak_rss_above_loaded_bytes'] / 2**20:,.0f} | {r['kv_bytes'] / 2**20:,.1f} |"
        )
    return lines


TABLES: dict[str, Callable[..., list[str]]] = {
    "decode": decode_table,
    "prompt": prompt_table,
    "prefill": prefill_table,
    "pivot": pivot_table,
    "columns": columns_table,
    "board": board_table,
}
TABLE_ARGUMENTS = re.compile(r"(\w+)=(\S+)")


def machine() -> str:
    """The CPU's model name and how many cores this process may use."""
    name = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{name}, {len(os.sched_getaffinity(0))} cores"


def commit() -> str:
    """The checkout's commit (``-dirty`` when ``src/`` has uncommitted changes, the code that ran
    not being that commit's), or ``unknown`` outside git."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True)
        clean = subprocess.run(["git", "diff", "--quiet", "HEAD", "--", "src"], check=False).returncode == 0
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head.stdout.strip() + ("" if clean else "-dirty")


def keep(rows: list[dict], path: Path, command: str, measured_at: str | None = None) -> None:
    """Save ``rows`` for the pages, with how they were measured (the command, commit, machine, date),
    without each sample's output. ``measured_at``: the commit that ran (default: the checkout's)."""
    record = {
        "command": command,
        "commit": measured_at or commit(),
        "machine": machine(),
        "date": time.strftime("%Y-%m-%d"),
    }
    rows = [{k: v for k, v in r.items() if k != "outputs"} for r in rows]  # each sample's text stays in the run's file
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({**record, "rows": rows}, indent=1) + "\n")


def render(text: str, results: Path, page: Path) -> str:
    """``text`` (of ``page``) with every marked block rewritten from its rows in ``results``."""

    def block(match: re.Match) -> str:
        opening, names, table, arguments, closing = match.groups()
        if table not in TABLES:
            raise InfinikvError(f"unknown results table {table!r} (known: {', '.join(TABLES)})")
        sources, commands, rows = [], ["", "```sh"], []
        for name in names.split("+"):  # a table may draw on several files: the board does
            try:
                measured = json.loads((results / name).read_text())
            except (OSError, json.JSONDecodeError) as exc:
                raise InfinikvError(f"cannot read the results {results / name}: {exc}") from None
            sources.append(
                f"{measured['date']} on {measured['machine']}, commit `{measured['commit']}` "
                f"([rows]({os.path.relpath(results / name, page.parent)}))"
            )
            commands.append(measured["command"])
            rows += measured["rows"]
        try:
            lines = TABLES[table](rows, **dict(TABLE_ARGUMENTS.findall(arguments)))
        except (TypeError, KeyError) as exc:
            raise InfinikvError(f"{page}: results table {table} {arguments.strip()}: {exc}") from None
        return "\n".join([opening + "Measured " + "; ".join(sources) + ":", *commands, "```", "", *lines, "", closing])

    return MARKED.sub(block, text)


def pages(root: Path) -> list[Path]:
    """The pages that may hold measured tables: the README and every page of the docs."""
    return [root / "README.md", *sorted((root / "docs").rglob("*.md"))]


def refresh(root: Path) -> list[Path]:
    """Rewrite the marked tables of every page under ``root`` from ``root/docs/results``; the pages changed."""
    changed = []
    for page in pages(root):
        text = page.read_text()
        new = render(text, root / "docs" / "results", page)
        if new != text:
            page.write_text(new)
            changed.append(page)
    return changed
