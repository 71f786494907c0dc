"""Loading a model by bundled name, local folder or ``.gguf`` file, with its weights packed as asked
and infinikv's attention attached."""

from __future__ import annotations

from pathlib import Path

import torch

from ..errors import InfinikvError
from .catalogue import BUNDLED, DEFAULT_MODEL, FETCH_HINT, bundled_folder, fetch_hint, is_hf_folder
from .defaults import set_default_policy


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
    from ..weights import AUTO

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
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from ..attention import attach
    from ..weights import check_format, pack_weights

    folder, gguf_file = resolve(model)  # a model not fetched says so before any kernel is built
    weights = check_format(resolve_weights(model, weights, device), device)
    hf_logging.disable_progress_bar()
    tokenizer = load_tokenizer(model)
    try:
        extra = {"gguf_file": gguf_file} if gguf_file else {}
        lm = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True, dtype=dtype, **extra)
    except Exception as exc:  # a truncated or corrupt folder fails in many ways
        raise cannot_load(model, folder, exc) from None
    pack_weights(lm.to(device).eval(), weights)
    attach(lm)
    if kv_capacity is not None or update_rule is not None:
        from ..policies.bct import BoundedCache

        if kv_capacity is None:
            raise InfinikvError("a bounded-cache model needs a capacity (kv_capacity=TOKENS)")
        set_default_policy(
            lm, BoundedCache(capacity=kv_capacity, **({"update_rule": update_rule} if update_rule else {}))
        )
    return lm, tokenizer


def load_tokenizer(model: str = DEFAULT_MODEL):
    """The tokenizer of ``model`` (as ``load_model`` names it), offline, padding on the left."""
    from transformers import AutoTokenizer

    folder, gguf_file = resolve(model)
    try:
        tokenizer = AutoTokenizer.from_pretrained(
            folder, local_files_only=True, **({"gguf_file": gguf_file} if gguf_file else {})
        )
    except Exception as exc:
        raise cannot_load(model, folder, exc) from None
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    return tokenizer


def cannot_load(model: str, folder: Path, exc: Exception) -> InfinikvError:
    """A truncated or corrupt folder fails in many ways: one line, and what to do."""
    hint = fetch_hint(model, force=True) if model in BUNDLED else "check the files or re-create them"
    return InfinikvError(f"cannot load model from {folder}: {str(exc).splitlines()[0][:200]}; {hint}")
