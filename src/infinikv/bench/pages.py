"""The measured tables of the README and the docs, generated from committed result rows.

A page marks where a table goes with ``<!-- results: FILE TABLE -->`` and ``<!-- /results -->``;
``docs/results/FILE`` holds the rows and how they were measured (``command``, ``commit``,
``machine``, ``date``), and ``TABLE`` names one of ``TABLES``. ``infinikv report --docs``
rewrites every marked block from its rows, so no measured number is typed by hand and a
re-measurement is new rows, not an edited sentence; a test checks the pages are up to date.
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

MARKED = re.compile(r"(<!-- results: (\S+\.json) (\w+) -->\n).*?(<!-- /results -->)", re.DOTALL)


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


TABLES: dict[str, Callable[[list[dict]], list[str]]] = {
    "decode": decode_table,
    "prompt": prompt_table,
    "prefill": prefill_table,
}


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


def keep(rows: list[dict], path: Path, command: str) -> None:
    """Save ``rows`` for the pages, with how they were measured (the command, commit, machine, date)."""
    record = {"command": command, "commit": commit(), "machine": machine(), "date": time.strftime("%Y-%m-%d")}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({**record, "rows": rows}, indent=1) + "\n")


def render(text: str, results: Path, page: Path) -> str:
    """``text`` (of ``page``) with every marked block rewritten from its rows in ``results``."""

    def block(match: re.Match) -> str:
        opening, name, table, closing = match.groups()
        if table not in TABLES:
            raise InfinikvError(f"unknown results table {table!r} (known: {', '.join(TABLES)})")
        try:
            measured = json.loads((results / name).read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise InfinikvError(f"cannot read the results {results / name}: {exc}") from None
        source = (
            f"Measured {measured['date']} on {measured['machine']}, commit `{measured['commit']}` "
            f"([rows]({os.path.relpath(results / name, page.parent)})):"
        )
        command = ["", "```sh", measured["command"], "```"]
        return "\n".join([opening + source, *command, "", *TABLES[table](measured["rows"]), "", closing])

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
