"""Result rows (one JSON object per cell of an evaluation or benchmark) as people read them: labels,
the reference row, and the RULER leaderboard table. Evaluations, benchmarks, plots and reports all
read rows through here, so none of them imports another to name a row."""

from __future__ import annotations

import statistics

from .contract import REFERENCE

PEER = "peer"  # the policy field of a peer's rows (another engine, measured by its own script)
LABEL_PARAMS = ("update_rule", "bits", "alpha")  # the parameters that tell two cells of a policy apart


def label(row: dict) -> str:
    """A policy's name with the parameters that distinguish it, e.g. ``quant bits=4`` (the row's own
    label when it has one: the options given by hand)."""
    if row.get("label"):
        return row["label"]
    extra = " ".join(
        f"{k}={row[k]:g}" if isinstance(row[k], float) else f"{k}={row[k]}" for k in LABEL_PARAMS if k in row
    )
    return f"{row['policy']} {extra}".strip()


def row_label(row: dict) -> str:
    """``label`` with the budget (a fraction) or capacity (tokens) when the policy has one."""
    if row.get("budget"):
        return f"{label(row)} {row['budget']:g}"
    return f"{label(row)} {row['capacity']}t" if row.get("capacity") else label(row)


def run_label(row: dict) -> str:
    """``row_label`` with how the row ran: its weights format (unless fp32, or the default ``auto``
    of rows that did not resolve it) and ``(compiled)``."""
    weights = f" [{row['weights']}]" if row.get("weights", "fp32") not in ("fp32", "auto") else ""
    return row_label(row) + weights + (" (compiled)" if row.get("compiled") else "")


def budget_text(row: dict) -> str:
    """The budget alone: a fraction, a capacity in tokens (``512t``), or ``-``."""
    if row.get("budget"):
        return f"{row['budget']:g}"
    return f"{row['capacity']}t" if row.get("capacity") else "-"


def reference(rows: list[dict], key: str) -> float | None:
    """The ``full`` row's value: every quality table is relative to the full cache."""
    return next((r[key] for r in rows if r["policy"] == REFERENCE), None)


def leaderboard(rows: list[dict]) -> tuple[list[str], list[list[str]]]:
    """The leaderboard's shape: a header and one line per policy and budget, its accuracy (x100)
    averaged over tasks at each length and over both, then per task (averaged over lengths)."""
    lengths = sorted({r["length"] for r in rows})
    tasks = list(dict.fromkeys(r["task"] for r in rows))
    cells = {(row_label(r), r["task"], r["length"]): 100 * r["accuracy"] for r in rows}

    def mean(values: list[float]) -> str:
        return f"{statistics.fmean(values):.1f}" if values else "-"

    lines = []
    for name in dict.fromkeys(row_label(r) for r in rows):
        by_length = [[cells[name, t, n] for t in tasks if (name, t, n) in cells] for n in lengths]
        per_task = [[cells[name, t, n] for n in lengths if (name, t, n) in cells] for t in tasks]
        every = [v for values in by_length for v in values]
        lines.append([name, *map(mean, by_length), mean(every), *map(mean, per_task)])
    return ["policy", *(f"{n:,}" for n in lengths), "mean", *tasks], lines


def summary(rows: list[dict]) -> str:
    """``leaderboard`` as a text table."""
    header, lines = leaderboard(rows)
    widths = [max(len(line[i]) for line in [header, *lines]) for i in range(len(header))]
    return "\n".join(
        " ".join(f"{v:<{w}}" if i == 0 else f"{v:>{w}}" for i, (v, w) in enumerate(zip(line, widths, strict=True)))
        for line in [header, *lines]
    )


def needle_found(rows: list[dict]) -> str:
    """Where the needle went (``eval.trace``): per policy, the share of the needle's tokens its
    layers attended at answer steps, and the oracle's of the same count, averaged over cells."""
    by_label: dict[str, list[dict]] = {}
    for row in rows:
        if "needle_attended" in row:
            by_label.setdefault(row_label(row), []).append(row)
    if not by_label:
        return ""
    width = max(len(name) for name in [*by_label, "needle attended (%)"])
    lines = [f"{'needle attended (%)':<{width}} {'policy':>8} {'oracle':>8}"]
    for name, cells in by_label.items():
        oracle = [r["oracle_needle_attended"] for r in cells if "oracle_needle_attended" in r]
        shown = f"{statistics.fmean(oracle):>8.1f}" if oracle else f"{'-':>8}"
        lines.append(f"{name:<{width}} {statistics.fmean(r['needle_attended'] for r in cells):>8.1f} {shown}")
    return "\n".join(lines)
