"""infinikv report: the latest bench JSON of each kind into one Markdown file with its plots."""

import json
import os
import time

from infinikv.cli import main


def speed_row(context, policy, ms, **extra):
    return {
        "policy": policy,
        "budget": extra.pop("budget", None),
        "capacity": None,
        "context": context,
        "ms_per_step": ms,
        "tokens_per_second": 1000 / ms,
        "ratio_to_full": round(100.0 / ms, 3),
        "kv_bytes": 2**20 * context // 1024,
        "bytes_moved_per_step": 0,
        "weights_bytes": 500 * 2**20,
        "bandwidth_bytes_per_second": 25 * 10**9,
        "threads": 2,
        "floor_ms_per_step": 25.0,
        "efficiency": round(25.0 / ms, 3),
        "rss_bytes": 2**30,
        "peak_rss_bytes": 2**30,
        **extra,
    }


def quality_rows():
    rows = [{"protocol": "P-ctx", "policy": "full", "budget": None, "perplexity": 20.0}]
    rows += [{"protocol": "P-ctx", "policy": "sink", "budget": b, "perplexity": 20 + 1 / b} for b in (0.1, 0.5)]
    rows += [{"protocol": "P-ctx", "policy": "quant", "budget": None, "bits": 4, "perplexity": 21.0}]
    for r in rows:
        r.update(context=4096, continuation=512, text="austen:emma", capacity=None)
    cases = [{"depth": d, "hit": d > 0.3} for d in (0.1, 0.5, 0.9)]
    rows += [{"protocol": "P-needle", "policy": "full", "budget": None, "context": 4096, "cases": cases}]
    return rows


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_report_from_the_latest_results(capsys, tmp_path, monkeypatch):
    results = tmp_path / "home" / "results"
    results.mkdir(parents=True)
    monkeypatch.setenv("INFINIKV_HOME", str(tmp_path / "home"))
    old, new = results / "speed-1.jsonl", results / "speed-2.jsonl"
    write_jsonl(old, [speed_row(1024, "full", 999.0)])
    peer = {
        "policy": "peer",
        "label": "llama.cpp (peer)",
        "context": 4096,
        "ms_per_step": 50.0,
        "tokens_per_second": 20.0,
    }
    ours = [
        speed_row(c, p, ms, ratio_to_peer=50.0 / ms)
        for c in (1024, 4096)
        for p, ms in (("full", 100.0), ("offload", 200.0))
    ]
    write_jsonl(new, [peer, *ours])
    os.utime(old, (time.time() - 60, time.time() - 60))
    write_jsonl(results / "quality-1.jsonl", quality_rows())
    code = main(["report", "--out-dir", str(tmp_path / "reports")])
    report = tmp_path / "reports" / next(os.walk(tmp_path / "reports"))[1][0] / "report.md"
    assert code == 0 and capsys.readouterr().out.strip() == str(report)
    text = report.read_text()
    assert "speed-2.jsonl" in text and "999" not in text  # the newest speed file only
    assert "| 4,096 | offload | 200.0 | 5.0 | 0.50 | 0.25 | - | 25.0 | 0.12 |" in text
    assert "| 4,096 | llama.cpp (peer) | 50.0 | 20.0 | - | - | - | - | - |" in text  # a peer's rows: speed only
    assert "- offload: 12% of the floor's speed (8.0x the floor's time)" in text
    assert "| sink | 30.000 (+50.0%) | 22.000 (+10.0%) | - |" in text
    assert "| quant bits=4 | - | - | 21.000 (+5.0%) |" in text
    assert "| full | 2/3 | 0.50, 0.90 |" in text
    for png in ("speed.png", "quality-ppl.png", "quality-needle.png"):
        assert f"]({png})" in text and (report.parent / png).stat().st_size > 10_000


def test_report_without_results_says_what_to_run(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("INFINIKV_HOME", str(tmp_path))
    code = main(["report", "--out-dir", str(tmp_path / "reports")])
    err = capsys.readouterr().err
    assert code == 2 and "run infinikv bench speed" in err and err.count("\n") == 1
