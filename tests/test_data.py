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
