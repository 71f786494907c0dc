import re

import pytest

from infinikv import data
from infinikv.errors import InfinikvError


def test_paragraphs_rejoin_wrapped_lines():
    assert data.paragraphs(["It is a truth", "universally acknowledged.", "", "", "Next."]) == (
        "It is a truth universally acknowledged.\n\nNext.\n"
    )


def test_named_and_local_texts(tmp_path):
    assert "Jargon" in data.load_text("jargon")[:2000]
    local = tmp_path / "t.txt"
    local.write_text("hello world\n")
    assert data.load_text(str(local)) == "hello world\n"


@pytest.mark.parametrize("name, message", [("austen:nope", "unknown text"), ("/no/such.txt", "no text")])
def test_missing_text_is_a_clear_error(name, message):
    with pytest.raises(InfinikvError, match=message):
        data.load_text(name)


def test_unfetched_text_names_the_fix(tmp_path, monkeypatch):
    monkeypatch.setenv("INFINIKV_HOME", str(tmp_path))
    with pytest.raises(InfinikvError, match="infinikv data fetch"):
        data.load_text("austen:emma")


def test_fetch_without_apt_says_so(tmp_path, monkeypatch):
    monkeypatch.setenv("INFINIKV_HOME", str(tmp_path))
    monkeypatch.setattr(data.shutil, "which", lambda _: None)
    with pytest.raises(InfinikvError, match="apt-get.*local .txt"):
        data.fetch()


def test_list_counts_tokens(real):
    _, tokenizer = real
    rows = {r["name"]: r for r in data.list_texts(tokenizer)}
    assert rows["austen:emma"]["tokens"] > 150_000
    assert set(rows) == set(data.text_names())


def test_code_python_is_the_stdlib_source_in_a_fixed_order():
    text = data.load_text("code:python")
    assert text == data.load_text("code:python", from_chapter_one=True)  # no chapters: starts at the top
    assert text == data.python_source()  # deterministic
    files = data.python_files()
    names = [p.name for p in files]
    assert names == sorted(names) and "os.py" in names and "typing.py" in names
    assert all(p.parent == data.stdlib_dir() for p in files)  # top level only: no test suites, no site-packages
    assert text.startswith(f"# ==== {names[0]} ====\n")
    assert re.findall(r"^# ==== (\S+) ====$", text, re.MULTILINE) == names
    assert len(text) > 1_000_000


def test_code_python_format(tmp_path):
    (tmp_path / "b.py").write_text("x = 1\r\n")
    (tmp_path / "a.py").write_text("def f():\n    return 2")  # no final newline
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "c.py").write_text("skipped = True\n")
    (tmp_path / "notes.txt").write_text("skipped\n")
    assert data.python_source(tmp_path) == "# ==== a.py ====\ndef f():\n    return 2\n\n# ==== b.py ====\nx = 1\n"
    with pytest.raises(InfinikvError, match="no .py files"):
        data.python_source(tmp_path / "pkg" / "empty")


def test_code_python_needs_no_fetch(tmp_path, monkeypatch):
    monkeypatch.setenv("INFINIKV_HOME", str(tmp_path))
    rows = {r["name"]: r for r in data.list_texts()}
    assert rows["code:python"]["fetched"] and rows["code:python"]["chars"] > 1_000_000
    assert rows["code:python"]["path"] == str(data.stdlib_dir())
    assert not rows["austen:emma"]["fetched"]
    with pytest.raises(InfinikvError, match="unknown text"):
        data.load_text("code:rust")
