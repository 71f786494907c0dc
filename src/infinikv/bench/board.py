"""The leaderboard of the small models: one table per model, a line per policy and budget, what it
gets right (RULER tasks, follow-up questions, P-ctx) beside what it holds and reads, from the rows
the evaluations write. Rows of the same policy and budget from different protocols meet on one
line, so one run of each evaluation makes the board; a cell nobody measured stays empty."""

from __future__ import annotations

from ..results import label, row_label

PERPLEXITY = "P-ctx"
HELD = "peak K/V (MiB)"
ATTENDED = "attended (%)"


def kilo(tokens: int) -> str:
    """A length as a header shows it: ``2k`` for 2,048 tokens."""
    return f"{tokens // 1024}k" if tokens % 1024 == 0 else f"{tokens:,}"


def cells(row: dict) -> dict[str, float]:
    """What one evaluation row puts on the board: accuracy in %, perplexity, memory, reading."""
    protocol = row.get("protocol")
    if protocol == "RULER":
        return {f"{row['task']} {kilo(row['length'])}": 100 * row["accuracy"]}
    if protocol == "followup":
        return {f"follow-up {row['question']} {kilo(row['length'])}": 100 * row["accuracy"]}
    if protocol == PERPLEXITY:
        return {
            f"{PERPLEXITY} {kilo(row['context'])}": row["perplexity"],
            HELD: row["kv_bytes"] / 2**20,
            ATTENDED: 100 * row["attended_fraction"],
        }
    return {}


def board_rows(rows: list[dict]) -> list[dict]:
    """One row per model and policy run (``row_label``): ``model``, ``policy`` and a field per
    column of the board (``PERPLEXITY``'s row gives the memory and reading columns), a policy's
    budgets together, smallest first, policies in the order the rows first show them (later rows
    of a cell win)."""
    board: dict[tuple[str, str], dict] = {}
    order: dict[str, tuple[int, float]] = {}
    policies: dict[str, int] = {}
    for row in rows:
        found = cells(row)
        if found:
            key = (row.get("model", "?"), row_label(row))
            board.setdefault(key, {"model": key[0], "policy": key[1]}).update(found)
            first = policies.setdefault(label(row), len(policies))
            order[key[1]] = (first, row.get("budget") or row.get("capacity") or 0)
    return sorted(board.values(), key=lambda r: order[r["policy"]])


def board_table(rows: list[dict], model: str) -> list[str]:
    """``model``'s board as Markdown lines: accuracies as integers, P-ctx to 3 decimals."""
    lines_of = [r for r in board_rows(rows) if r["model"] == model]
    columns = list(dict.fromkeys(k for r in lines_of for k in r if k not in ("model", "policy")))

    def shown(name: str, value: float | None) -> str:
        if value is None:
            return "-"
        return f"{value:.3f}" if name.startswith(PERPLEXITY) else f"{value:,.0f}"

    header = ["| policy | " + " | ".join(columns) + " |", "|---" * (len(columns) + 1) + "|"]
    return header + [f"| {r['policy']} | " + " | ".join(shown(c, r.get(c)) for c in columns) + " |" for r in lines_of]
