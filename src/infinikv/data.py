"""Texts, offline: Jane Austen's six novels and the Jargon File from Debian packages, Python
source code from the running interpreter's standard library, or any local ``.txt`` file.

``fetch`` downloads the Debian packages with ``apt-get download`` (no installation, so R is not
pulled in), unpacks them with ``dpkg-deb -x``, reads the novels out of R's lazy-load format with
:mod:`infinikv.rdata`, and writes plain UTF-8 files under ``$INFINIKV_HOME/data``.

``code:python`` needs no fetch: it is built on demand from the ``.py`` files that sit directly
in the interpreter's stdlib directory (see :func:`python_source`).
"""

from __future__ import annotations

import gzip
import json
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

from .errors import InfinikvError
from .paths import data_dir
from .rdata import read_lazyload

# Publication order; names as the R package spells them.
AUSTEN = ["sensesensibility", "prideprejudice", "mansfieldpark", "emma", "northangerabbey", "persuasion"]
AUSTEN_PACKAGE, JARGON_PACKAGE = "r-cran-janeaustenr", "jargon-text"
FETCH_HINT = "run `infinikv data fetch`, or give a local .txt file path"
CHAPTER_ONE = re.compile(r"^(CHAPTER|Chapter) (I|1)\.?\s*$", re.MULTILINE)
CODE_PYTHON = "code:python"


def text_names() -> list[str]:
    return [f"austen:{n}" for n in AUSTEN] + ["austen:all", "jargon", CODE_PYTHON]


def stdlib_dir() -> Path:
    """The running interpreter's standard-library directory (the base install's, even in a venv)."""
    return Path(sysconfig.get_paths()["stdlib"])


def python_files(root: Path | None = None) -> list[Path]:
    """The files ``code:python`` is made of: every ``*.py`` file directly in the stdlib directory
    (no packages, so no test suites, site-packages, idlelib or tkinter), sorted by file name
    (code-point order, independent of locale and file system)."""
    root = stdlib_dir() if root is None else root
    return sorted((p for p in root.glob("*.py") if p.is_file()), key=lambda p: p.name)


def python_source(root: Path | None = None) -> str:
    """``code:python``: the stdlib's top-level ``.py`` files, each after a one-line header
    ``# ==== <name>.py ====`` and ending with a newline, joined by a blank line.

    Deterministic for a given Python installation (about 4.7 M characters from 168 files on
    CPython 3.11); undecodable bytes, if any, are replaced, and line endings normalised to ``\\n``.
    """
    files = python_files(root)
    if not files:
        raise InfinikvError(f"no .py files in {root or stdlib_dir()}: this Python has no stdlib sources")
    chunks = []
    for path in files:
        source = path.read_bytes().decode("utf-8", errors="replace").replace("\r\n", "\n")
        if not source.endswith("\n"):
            source += "\n"
        chunks.append(f"# ==== {path.name} ====\n{source}")
    return "\n".join(chunks)


def _file(name: str) -> Path:
    if name == CODE_PYTHON:
        return stdlib_dir()
    if name == "jargon":
        return data_dir() / "jargon.txt"
    return data_dir() / "austen" / f"{name.split(':', 1)[1]}.txt"


def paragraphs(lines: list[str]) -> str:
    """Re-join hard-wrapped lines into paragraphs separated by blank lines."""
    out, current = [], []
    for line in lines:
        if line.strip():
            current.append(line.strip())
        elif current:
            out.append(" ".join(current))
            current = []
    if current:
        out.append(" ".join(current))
    return "\n\n".join(out) + "\n"


def _apt_download(packages: list[str], into: Path) -> None:
    if shutil.which("apt-get") is None or shutil.which("dpkg-deb") is None:
        raise InfinikvError(
            "apt-get/dpkg-deb are not available here, so the bundled texts cannot be fetched; "
            "give a local .txt file path instead"
        )
    command = ["apt-get", "download", *packages]
    done = subprocess.run(command, cwd=into, capture_output=True, text=True)
    if done.returncode != 0:  # stale or missing package lists: refresh once and retry
        subprocess.run(["apt-get", "update", "-qq"], capture_output=True, text=True)
        done = subprocess.run(command, cwd=into, capture_output=True, text=True)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise InfinikvError(
            f"apt-get download {' '.join(packages)} failed ({last}); give a local .txt file path instead"
        )
    for deb in into.glob("*.deb"):
        subprocess.run(["dpkg-deb", "-x", str(deb), str(into / "root")], check=True)


def fetch(force: bool = False) -> Path:
    """Get the Austen novels and the Jargon File into ``$INFINIKV_HOME/data`` (once)."""
    if not force and all(_file(n).is_file() for n in text_names()):
        return data_dir()
    print(f"fetching {AUSTEN_PACKAGE} and {JARGON_PACKAGE} with apt-get download ...", file=sys.stderr)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        _apt_download([AUSTEN_PACKAGE, JARGON_PACKAGE], work)
        rdata = work / "root/usr/lib/R/site-library/janeaustenr/data"
        novels = read_lazyload(rdata / "Rdata.rdx", rdata / "Rdata.rdb")
        (data_dir() / "austen").mkdir(parents=True, exist_ok=True)
        for name in AUSTEN:
            _file(f"austen:{name}").write_text(paragraphs(novels[name]), encoding="utf-8")
        _file("austen:all").write_text(
            "\n".join(_file(f"austen:{n}").read_text(encoding="utf-8") for n in AUSTEN), encoding="utf-8"
        )
        jargon = gzip.decompress((work / "root/usr/share/doc/jargon-text/jargon.txt.gz").read_bytes())
        _file("jargon").write_text(jargon.decode("utf-8", errors="replace"), encoding="utf-8")
    (data_dir() / "token_counts.json").unlink(missing_ok=True)
    return data_dir()


def load_text(name: str, from_chapter_one: bool = False) -> str:
    """A text by name (``austen:emma``, ``austen:all``, ``jargon``, ``code:python``) or by ``.txt`` path.

    ``from_chapter_one`` skips an Austen novel's front matter (title, volume headings), as the
    measurement protocols ask; other texts (``jargon``, ``code:python``, local files) have no
    chapters and always start at their beginning.
    """
    if name == CODE_PYTHON:
        return python_source()
    if name in text_names():
        path = _file(name)
        if not path.is_file():
            raise InfinikvError(f"text {name!r} is not fetched yet: {FETCH_HINT}")
    elif name.startswith(("austen:", "code:")):
        raise InfinikvError(f"unknown text {name!r}; choose from {', '.join(text_names())} or a .txt path")
    else:
        path = Path(name).expanduser()
        if not path.is_file():
            raise InfinikvError(f"no text {name!r}: give one of {', '.join(text_names())} or an existing .txt file")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise InfinikvError(f"{path} is not UTF-8 text") from None
    if not text.strip():
        raise InfinikvError(f"text {name!r} is empty")
    if from_chapter_one and name.startswith("austen:"):
        match = CHAPTER_ONE.search(text)
        text = text[match.start() :] if match else text
    return text


def list_texts(tokenizer=None) -> list[dict]:
    """Each named text with its size: characters always, tokens when a tokenizer is given."""
    cache_file = data_dir() / "token_counts.json"
    counts = json.loads(cache_file.read_text()) if cache_file.is_file() else {}
    key = getattr(tokenizer, "name_or_path", None)
    rows = []
    for name in text_names():
        path = _file(name)
        code = name == CODE_PYTHON
        present = path.is_dir() if code else path.is_file()
        row = {"name": name, "path": str(path), "fetched": present, "chars": None, "tokens": None}
        if present:
            text = python_source() if code else path.read_text(encoding="utf-8")
            row["chars"] = len(text)
            if tokenizer is not None:
                # code:python depends on the interpreter: count it per Python version
                entry = f"{name}@{sys.version.split()[0]}:{len(text)}" if code else name
                cached = counts.get(str(key), {}).get(entry)
                row["tokens"] = cached if cached is not None else len(tokenizer(text).input_ids)
                counts.setdefault(str(key), {})[entry] = row["tokens"]
        rows.append(row)
    if tokenizer is not None and data_dir().is_dir():
        cache_file.write_text(json.dumps(counts))
    return rows
