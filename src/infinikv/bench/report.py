"""One Markdown report from the bench JSON: the speed table next to its floor, the quality
tables, and the plots redrawn from the same rows (so the report needs nothing but the JSON)."""

from __future__ import annotations

import statistics
import time
from pathlib import Path

from ..contract import REFERENCE
from ..results import PEER, label, leaderboard, row_label, run_label
from .plots import needle_heatmap, perplexity_plot, ruler_heatmap, speed_plot


def latest(folder: Path, kind: str) -> Path | None:
    """The newest ``<kind>-*.jsonl`` results file in ``folder``, or None."""
    files = sorted(folder.glob(f"{kind}-*.jsonl"), key=lambda f: f.stat().st_mtime)
    return files[-1] if files else None


def _mib(n: float) -> str:
    return f"{n / 2**20:.1f}"


def _cell(row: dict, key: str, spec: str, scale: float = 1.0) -> str:
    return format(row[key] / scale, spec) if row.get(key) is not None else "-"


def speed_section(rows: list[dict]) -> list[str]:
    """The speed table (ratios to full and to a peer, floor, efficiency) and how far each policy is
    from its floor. A peer's rows (``bench speed --peer``) carry only their speeds."""
    ours = [r for r in rows if r.get("policy") != PEER]
    first = ours[0]
    columns = [
        ("ms/step", "ms_per_step", ".1f", 1),
        ("tokens/s", "tokens_per_second", ".1f", 1),
        ("x full", "ratio_to_full", ".2f", 1),
        ("x peer", "ratio_to_peer", ".2f", 1),
        ("prompt tokens/s", "prompt_tokens_per_second", ".0f", 1),
        ("floor ms", "floor_ms_per_step", ".1f", 1),
        ("efficiency", "efficiency", ".2f", 1),
        ("KV held MiB", "kv_bytes", ".1f", 2**20),
        ("moved MiB/step", "bytes_moved_per_step", ".1f", 2**20),
        ("peak RSS MiB", "peak_rss_bytes", ".0f", 2**20),
    ]
    lines = [
        "## Speed",
        "",
        f"Median ms per decode step, policies interleaved in one process; {first['threads']} threads, STREAM-triad "
        f"bandwidth {first['bandwidth_bytes_per_second'] / 1e9:.1f} GB/s; weights {_mib(first['weights_bytes'])} MiB. "
        "The floor is the bytes a step must read (weights, the K/V it attends, and twice what it copies from a "
        "slow tier) over that bandwidth; efficiency = floor / measured. x full and x peer: their time over ours "
        "at the same context (above 1: ours is faster).",
        "",
        "| context | policy | " + " | ".join(c[0] for c in columns) + " |",
        "|---" * (len(columns) + 2) + "|",
    ]
    for r in rows:
        cells = [_cell(r, key, spec, scale) for _, key, spec, scale in columns]
        lines.append(f"| {r['context']:,} | {run_label(r)} | " + " | ".join(cells) + " |")
    lines += ["", "How far from the floor (median over contexts):", ""]
    for name in dict.fromkeys(run_label(r) for r in ours):
        eff = statistics.median(r["efficiency"] for r in ours if run_label(r) == name)
        lines.append(f"- {name}: {eff:.0%} of the floor's speed ({1 / eff:.1f}x the floor's time)")
    return [*lines, "", "![speed](speed.png)", ""]


def quality_section(rows: list[dict]) -> list[str]:
    """P-ctx perplexity by policy (rows) and budget (columns); the P-needle hits by depth."""
    ppl = [r for r in rows if r.get("protocol") == "P-ctx"]
    needle = [r for r in rows if r.get("protocol") == "P-needle"]
    lines = []
    if ppl:
        full = next((r["perplexity"] for r in ppl if r["policy"] == REFERENCE), None)
        budgets = sorted({r["budget"] for r in ppl if r.get("budget")})
        first = ppl[0]
        lines += [
            "## Quality: P-ctx",
            "",
            f"Perplexity of {first['continuation']} tokens of {first.get('text', '?')} after a "
            f"{first['context']:,}-token context, by budget (fraction of the tokens seen); policies without a "
            "budget in the last column" + (" (vs full in brackets)." if full else "."),
            "",
            "| policy | " + " | ".join(f"{b:g}" for b in budgets) + " | no budget |",
            "|---" * (len(budgets) + 2) + "|",
        ]

        def cell(r: dict | None) -> str:
            if r is None:
                return "-"
            return f"{r['perplexity']:.3f}" + (f" ({100 * (r['perplexity'] / full - 1):+.1f}%)" if full else "")

        for name in dict.fromkeys(label(r) for r in ppl):
            mine = [r for r in ppl if label(r) == name]
            by_budget = {r.get("budget"): r for r in mine}
            cells = [cell(by_budget.get(b)) for b in budgets] + [cell(by_budget.get(None))]
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
        lines += ["", "![P-ctx perplexity vs budget](quality-ppl.png)", ""]
    if needle:
        lines += [
            "## Quality: P-needle",
            "",
            f"Pass keys found in {needle[0]['context']:,} tokens of {needle[0].get('text', '?')}, by depth.",
            "",
            "| policy | accuracy | depths found |",
            "|---|---|---|",
        ]
        for r in needle:
            found = ", ".join(f"{c['depth']:.2f}" for c in r["cases"] if c["hit"]) or "none"
            lines.append(f"| {row_label(r)} | {sum(c['hit'] for c in r['cases'])}/{len(r['cases'])} | {found} |")
        lines += ["", "![P-needle by depth](quality-needle.png)", ""]
    return lines


def ruler_section(rows: list[dict]) -> list[str]:
    """RULER: the leaderboard table (accuracy x100 by policy and budget) and the heatmap."""

    header, lines = leaderboard(rows)
    samples = sorted({r["samples"] for r in rows})
    return [
        "## Quality: RULER",
        "",
        f"Accuracy x100 on {rows[0]['model']} (string match, {'/'.join(map(str, samples))} samples per task and "
        "length), averaged over tasks at each length, then per task averaged over lengths.",
        "",
        "| " + " | ".join(header) + " |",
        "|---" * len(header) + "|",
        *("| " + " | ".join(line) + " |" for line in lines),
        "",
        "![RULER accuracy by task and policy](ruler.png)",
        "",
    ]


def write_report(
    speed: list[dict], quality: list[dict], out_dir: Path, sources: list[Path], ruler: list[dict] | None = None
) -> Path:
    """Write ``report.md`` and its plots into ``out_dir``; returns the Markdown file."""
    out_dir.mkdir(parents=True, exist_ok=True)
    lines = [
        "# infinikv report",
        "",
        f"Generated {time.strftime('%Y-%m-%d %H:%M')} from " + ", ".join(f"`{s}`" for s in sources) + ".",
        "",
    ]
    if speed:
        speed_plot(speed, out_dir / "speed.png")
        lines += speed_section(speed)
    ppl = [r for r in quality if r.get("protocol") == "P-ctx"]
    needle = [r for r in quality if r.get("protocol") == "P-needle"]
    if ppl:
        perplexity_plot(ppl, out_dir / "quality-ppl.png")
    if needle:
        needle_heatmap(needle, out_dir / "quality-needle.png")
    lines += quality_section(quality)
    if ruler:
        ruler_heatmap(ruler, out_dir / "ruler.png")
        lines += ruler_section(ruler)
    report = out_dir / "report.md"
    report.write_text("\n".join(lines))
    return report
