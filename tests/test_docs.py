"""The documentation site builds, strictly: every page in the nav, every link and anchor resolves,
every API page's object imports (mkdocstrings); the measured tables are generated from their rows."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from infinikv.bench import pages
from infinikv.cli import main
from infinikv.errors import InfinikvError

ROOT = Path(__file__).resolve().parent.parent


def test_the_site_builds_strictly(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "site" / "policies" / "bct" / "index.html").is_file()
    assert "infinikv.core.Batch" in (tmp_path / "site" / "reference" / "index.html").read_text()


def test_the_readme_links_only_to_pages_that_exist():
    readme = (ROOT / "README.md").read_text()
    targets = re.findall(r"\]\((docs/[^)#]+)", readme)
    assert targets and all((ROOT / t).is_file() for t in targets), [t for t in targets if not (ROOT / t).is_file()]
    assert len(readme.splitlines()) <= 200


def test_every_measured_table_is_generated_from_its_rows():
    stale = [
        str(p) for p in pages.pages(ROOT) if pages.render(p.read_text(), ROOT / "docs" / "results", p) != p.read_text()
    ]
    assert stale == [], "run: infinikv report --docs"
    marked = [p for p in pages.pages(ROOT) if "<!-- results:" in p.read_text()]
    assert len(marked) >= 2  # the README and the speed page at least


def test_a_marked_table_is_rewritten_from_its_rows(tmp_path):
    (tmp_path / "docs" / "results").mkdir(parents=True)
    rows = [
        {"policy": "full", "context": 1024, "ms_per_step": 11.54, "weights": "int4"},
        {"policy": "peer", "label": "llama.cpp", "context": 1024, "ms_per_step": 12.46},
    ]
    pages.keep(rows, tmp_path / "docs" / "results" / "s.json", "infinikv bench speed")
    page = tmp_path / "docs" / "speed.md"
    page.write_text("# Speed\n<!-- results: s.json decode -->\nold\n<!-- /results -->\nafter\n")
    (tmp_path / "README.md").write_text("no tables\n")
    assert pages.refresh(tmp_path) == [page]
    text = page.read_text()
    assert "old" not in text and "| 1,024 | 11.5 | 12.5 |" in text and "full [int4]" in text and "after" in text
    assert "infinikv bench speed" in text and "(results/s.json)" in text
    assert pages.refresh(tmp_path) == []  # up to date: nothing rewritten
    page.write_text("<!-- results: s.json nosuch -->\n<!-- /results -->\n")
    with pytest.raises(InfinikvError, match="unknown results table"):
        pages.refresh(tmp_path)
    assert json.loads((tmp_path / "docs" / "results" / "s.json").read_text())["rows"] == rows


def shell_commands(text: str) -> list[str]:
    """The ``infinikv`` commands in a page's sh/bash/shell code blocks (continuations joined; each
    part of a pipe, an ``&&`` chain or a background ``&`` on its own; environment assignments
    before it dropped)."""
    found = []
    for block in re.findall(r"```(?:sh|bash|shell)\n(.*?)```", text, re.DOTALL):
        for line in block.replace("\\\n", " ").splitlines():
            for part in re.split(r"&&?|\|\|?|;", line.split(" #")[0]):
                words = part.split()
                while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):
                    words.pop(0)
                if words[:1] == ["infinikv"]:
                    found.append(" ".join(words))
    return found


def test_every_command_in_the_docs_parses():
    """Each ``infinikv`` command shown in the README or the docs names a command and flags that
    exist, with values they accept: the command line parser runs on it (a dry run of the flags)."""
    import shlex

    from infinikv.cli import build_parser

    failures, count = [], 0
    for page in pages.pages(ROOT):
        for command in shell_commands(page.read_text()):
            count += 1
            argv = [w for w in shlex.split(command.split(">")[0])[1:] if not w.startswith("$(")]
            try:
                build_parser().parse_args(argv)
            except (SystemExit, InfinikvError) as exc:
                failures.append(f"{page.relative_to(ROOT)}: {command} ({exc})")
    assert count >= 30 and failures == [], "\n".join(failures)


def test_any_rows_lay_out_by_pivot_or_columns(tmp_path):
    (tmp_path / "docs" / "results").mkdir(parents=True)
    rows = [
        {"policy": "full", "task": "multikey_1", "length": 2048, "accuracy": 0.8, "attended": 1.0},
        {"policy": "infinigen", "task": "multikey_1", "length": 2048, "accuracy": 0.4, "attended": 0.1},
        {"policy": "full", "task": "single_1", "length": 2048, "accuracy": 1.0, "attended": 1.0},
        {"policy": "full", "task": "single_1", "length": 4096, "accuracy": 0.9, "attended": 1.0},
    ]
    pages.keep(rows, tmp_path / "docs" / "results" / "r.json", "infinikv eval ruler")
    page = tmp_path / "docs" / "r.md"
    page.write_text(
        "<!-- results: r.json pivot down=run across=task value=accuracy format=.0% where=length:2048|1024 -->\n"
        "<!-- /results -->\n<!-- results: r.json columns fields=run;length:,;attended:.1% -->\n<!-- /results -->\n"
    )
    (tmp_path / "README.md").write_text("")
    pages.refresh(tmp_path)
    text = page.read_text()
    assert "| policy | multikey_1 | single_1 |" in text
    assert "| full | 80% | 100% |" in text and "| infinigen | 40% | - |" in text  # no single_1 row: a dash
    assert "| infinigen | 2,048 | 10.0% |" in text and "| full | 4,096 | 100.0% |" in text
    page.write_text("<!-- results: r.json pivot down=run -->\n<!-- /results -->\n")
    with pytest.raises(InfinikvError, match="pivot"):  # a missing argument is named, not a traceback
        pages.refresh(tmp_path)


def test_the_board_puts_each_protocol_of_a_policy_on_one_line(tmp_path, capsys):
    """RULER, follow-up and P-ctx rows of one policy and budget meet on one line per model; a
    table may draw on several row files; ``report --board`` prints the same board."""
    results = tmp_path / "docs" / "results"
    ruler = [
        {
            "protocol": "RULER",
            "model": "m",
            "policy": "full",
            "task": "niah_multikey_1",
            "length": 2048,
            "accuracy": 0.8,
        },
        {
            "protocol": "RULER",
            "model": "m",
            "policy": "recall",
            "budget": 0.1,
            "task": "niah_multikey_1",
            "length": 2048,
            "accuracy": 0.5,
        },
        {
            "protocol": "RULER",
            "model": "other",
            "policy": "full",
            "task": "niah_single_1",
            "length": 16384,
            "accuracy": 1.0,
        },
    ]
    ppl = [
        {
            "protocol": "P-ctx",
            "model": "m",
            "policy": "recall",
            "budget": 0.1,
            "context": 4096,
            "perplexity": 23.7131,
            "kv_bytes": 3 * 2**20,
            "attended_fraction": 0.19,
        },
        {
            "protocol": "P-ctx",
            "model": "m",
            "policy": "recall",
            "budget": 0.05,
            "context": 4096,
            "perplexity": 24.5,
            "kv_bytes": 2**20,
            "attended_fraction": 0.1,
        },
    ]
    pages.keep(ruler, results / "r.json", "infinikv eval ruler")
    pages.keep(ppl, results / "p.json", "infinikv eval ppl")
    page = tmp_path / "docs" / "board.md"
    page.write_text("<!-- results: r.json+p.json board model=m -->\n<!-- /results -->\n")
    (tmp_path / "README.md").write_text("")
    pages.refresh(tmp_path)
    text = page.read_text()
    assert (
        "infinikv eval ruler\ninfinikv eval ppl\n" in text and "(results/r.json)" in text and "(results/p.json)" in text
    )
    assert "| policy | niah_multikey_1 2k | P-ctx 4k | peak K/V (MiB) | attended (%) |" in text
    assert "| full | 80 | - | - | - |" in text  # not measured: a dash
    lines = [line for line in text.splitlines() if line.startswith("| recall")]
    assert lines == ["| recall 0.05 | - | 24.500 | 1 | 10 |", "| recall 0.1 | 50 | 23.713 | 3 | 19 |"]
    assert "niah_single_1 16k" not in text  # another model's rows: its own table
    assert main(["report", "--board", str(results / "r.json"), str(results / "p.json")]) == 0
    printed = capsys.readouterr().out
    assert "## m\n" in printed and "## other\n" in printed and "| full | 100 |" in printed
    assert main(["report", "--board", str(results / "r.json"), "--json"]) == 0
    board = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert {"model": "m", "policy": "recall 0.1", "niah_multikey_1 2k": 50.0} in board
    assert main(["report", "--board", str(page)]) == 2  # not rows: one line, exit 2


@pytest.mark.parametrize("script", sorted((ROOT / "examples").glob("*.py")), ids=lambda p: p.name)
def test_every_example_imports(script):
    """The docs run the examples by hand; a module moved without them fails here, not in a reader's
    shell (examples/past_context.py imported ``infinikv.serve.bench`` for two days after it moved)."""
    done = subprocess.run(
        [sys.executable, "-c", f"import runpy; runpy.run_path({str(script)!r}, run_name='example')"],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr[-2000:]
