"""PNG plots drawn from result rows alone (the bench JSON), so a report can redraw them later."""

from __future__ import annotations

from pathlib import Path

from ..results import label, row_label, run_label


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, out: Path) -> Path:
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    _pyplot().close(fig)
    return out


def speed_plot(rows: list[dict], out: Path) -> Path:
    """ms per decode step by context, each policy with its floor (dashed), and the ratio to full."""
    plt = _pyplot()
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 8), sharex=True)
    for i, name in enumerate(dict.fromkeys(run_label(r) for r in rows)):
        cells = sorted((r for r in rows if run_label(r) == name), key=lambda r: r["context"])
        x = [r["context"] for r in cells]
        color = f"C{i % 10}"
        top.plot(x, [r["ms_per_step"] for r in cells], marker="o", color=color, label=name)
        if all("floor_ms_per_step" in r for r in cells):  # the peer's rows carry no floor
            top.plot(x, [r["floor_ms_per_step"] for r in cells], linestyle="--", color=color, linewidth=1)
        if all(r.get("ratio_to_full") for r in cells):
            bottom.plot(x, [r["ratio_to_full"] for r in cells], marker="o", color=color, label=name)
    top.set_ylabel("ms per decode step (dashed: memory-bandwidth floor)")
    top.set_yscale("log")
    bottom.set_ylabel("speed vs full (same run)")
    bottom.axhline(1.0, color="grey", linewidth=1)
    bottom.set_xlabel("context (tokens)")
    bottom.set_xscale("log", base=2)
    for axis in (top, bottom):
        axis.grid(alpha=0.3)
    top.legend(fontsize=8)
    return _save(fig, out)


def perplexity_plot(rows: list[dict], out: Path) -> Path:
    """P-ctx perplexity vs budget: a curve per bounded policy, a dashed line per unbounded one."""
    plt = _pyplot()
    fig, axis = plt.subplots(figsize=(9, 5.5))
    names = list(dict.fromkeys(label(r) for r in rows))
    for i, name in enumerate(names):
        cells = [r for r in rows if label(r) == name]
        color = f"C{i % 10}"
        budgets = sorted((r for r in cells if r.get("budget")), key=lambda r: r["budget"])
        if budgets:
            axis.plot([r["budget"] for r in budgets], [r["perplexity"] for r in budgets], "o-", color=color, label=name)
        for r in cells:
            if not r.get("budget") and not r.get("capacity"):
                axis.axhline(r["perplexity"], color=color, linestyle="--", linewidth=1, label=f"{name} (no budget)")
    axis.set_xscale("log")
    ticks = sorted({r["budget"] for r in rows if r.get("budget")})
    axis.set_xticks(ticks, [f"{b:g}" for b in ticks])
    axis.minorticks_off()
    axis.set_xlabel("budget (fraction of the tokens seen)")
    axis.set_ylabel(f"P-ctx perplexity ({rows[0]['context']} + {rows[0]['continuation']} tokens)")
    axis.grid(alpha=0.3)
    axis.legend(fontsize=8)
    return _save(fig, out)


def needle_heatmap(rows: list[dict], out: Path) -> Path:
    """P-needle: pass key found (1) or not (0) by depth (columns) and policy/budget (rows)."""
    plt = _pyplot()
    names = [row_label(r) for r in rows]
    depths = [c["depth"] for c in rows[0]["cases"]]
    hits = [[float(c["hit"]) for c in r["cases"]] for r in rows]
    fig, axis = plt.subplots(figsize=(max(6, 2.5 + 0.5 * len(depths)), 1.5 + 0.35 * len(rows)))
    axis.imshow(hits, cmap="RdYlGn", vmin=0, vmax=1, aspect="auto")
    axis.set_xticks(range(len(depths)), [f"{d:.2f}" for d in depths], rotation=90)
    axis.set_yticks(range(len(names)), names)
    axis.set_xlabel("depth of the pass key")
    axis.set_title(f"P-needle, {rows[0]['context']} tokens: pass key found (green) or not (red)", fontsize=10)
    return _save(fig, out)


def ruler_heatmap(rows: list[dict], out: Path) -> Path:
    """Accuracy (x100) by task (columns) and policy/budget (rows), one panel per length, as a PNG."""
    plt = _pyplot()
    lengths = sorted({r["length"] for r in rows})
    tasks = list(dict.fromkeys(r["task"] for r in rows))
    names = list(dict.fromkeys(row_label(r) for r in rows))
    cells = {(row_label(r), r["task"], r["length"]): 100 * r["accuracy"] for r in rows}
    fig, axes = plt.subplots(
        1, len(lengths), figsize=(1.5 + 0.75 * len(tasks) * len(lengths), 1.8 + 0.4 * len(names)), squeeze=False
    )
    for axis, length in zip(axes[0], lengths, strict=True):
        grid = [[cells.get((name, task, length), float("nan")) for task in tasks] for name in names]
        axis.imshow(grid, cmap="RdYlGn", vmin=0, vmax=100, aspect="auto")
        for i, values in enumerate(grid):
            for j, value in enumerate(values):
                if value == value:  # not NaN: a cell that ran
                    axis.text(j, i, f"{value:.0f}", ha="center", va="center", fontsize=7)
        axis.set_xticks(range(len(tasks)), tasks, rotation=90, fontsize=8)
        axis.set_yticks(range(len(names)), names if axis is axes[0][0] else [""] * len(names), fontsize=8)
        axis.set_title(f"{length:,} tokens", fontsize=10)
    fig.suptitle(f"RULER accuracy (x100), {rows[0]['model']}", fontsize=10)
    return _save(fig, out)
