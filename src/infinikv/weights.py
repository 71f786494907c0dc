"""Weight formats: how a loaded model stores its weights, and the kernels that read them.

``fp32`` keeps the model as loaded. ``bf16``, ``int8`` and ``int4`` replace every ``nn.Linear``
(the LM head included) by a :class:`PackedLinear` holding its weight in that format (a gated
MLP's gate and up stacked into one: :class:`GatedMLP`), and the
input embedding by a :class:`PackedEmbedding` (bf16 or int8 rows); the fp32 weights (and the
loaded file's memory map) are released once every module is packed. Activations, norms, biases
and so the K/V stay in the model's dtype: a policy sees the same kind of keys whatever the
weights (its exactness against ``full`` under packed weights: tests/test_weights.py).

The kernels are torch's own CPU weight-only ones (``aten._weight_int8pack_mm``,
``aten._weight_int4pack_mm_for_cpu``: the ops torchao's CPU int4 layout calls and inductor's
int8 weight-only pattern lowers to), called directly: torchao 0.18's eager int8 linear
dequantizes the whole weight on every call (slower than fp32), and its tensor-subclass dispatch
would add a Python hop to each of a step's ~200 small matmuls. Both kernels take bf16 inputs, so
each packed matmul casts its input to bf16 and its output back.
"""

from __future__ import annotations

import ctypes
import functools
import gc

import torch
from torch import nn

from .errors import InfinikvError
from .packed import INT4_GROUP, PackedEmbedding, PackedLinear, fuse_gated_mlps, pack_linear
from .sizes import model_device

FORMATS = ("fp32", "bf16", "int8", "int4")
UNPACKED = "fp32"  # the weights as loaded
AUTO = "auto"  # the fast path per model and device (``models.resolve_weights``): every command's default
_KERNELS = {"fp32": "fp32 matmul", "bf16": "bf16 matmul", "int8": "int8 weight-only", "int4": "int4 weight-only"}


def check_format(name: str, device: torch.device | str = "cpu") -> str:
    """``name`` if this machine can run it on ``device``, else the one-line error naming what can."""
    if name not in FORMATS:
        raise InfinikvError(f"unknown weight format {name!r}; choose one of {AUTO}, {', '.join(FORMATS)}")
    if not runs(name, device):
        raise InfinikvError(
            f"weights {name} cannot run on {torch.device(device).type} here (no {_KERNELS[name]} kernel for "
            f"it); this machine runs: {', '.join(f for f in FORMATS if runs(f, device))}"
        )
    return name


@functools.cache
def runs(name: str, device: torch.device | str = "cpu") -> bool:
    """Whether format ``name``'s kernel runs on ``device`` (tried once on a tiny matmul)."""
    if name == "fp32":
        return True
    device = torch.device(device)
    try:
        with torch.inference_mode():
            linear = nn.Linear(2 * INT4_GROUP, 64, bias=False, device=device)
            pack_linear(linear, name)(torch.ones(1, 2 * INT4_GROUP, device=device))
        return True
    except (RuntimeError, NotImplementedError):
        return False


def pack_weights(model: nn.Module, fmt: str) -> nn.Module:
    """Store ``model``'s weights as ``fmt`` in place (see the module docstring); returns it.

    The LM head is packed on its own even when it shares its weight with the embedding (two
    smaller copies in place of one fp32 table), and under ``int4`` it is kept in int8: it is the
    matrix the GGUFs keep at more bits (SmolLM2's Q4_1 file holds its decoder weights on a 16-level
    grid per 32 values, which int4 reproduces, but its tied embedding at ~29 levels: int4 moved
    that table by 9.7% of its mean magnitude). Every other ``nn.Linear`` is packed as ``fmt``,
    and then each gated MLP's gate and up projections are stacked into one (``fuse_gated_mlps``).
    """
    check_format(fmt, model_device(model))
    if fmt == UNPACKED:
        return model
    model.set_input_embeddings(PackedEmbedding(model.get_input_embeddings(), fmt))
    head = model.get_output_embeddings()
    if isinstance(head, nn.Linear):
        model.set_output_embeddings(pack_linear(head, "int8" if fmt == "int4" else fmt))
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                setattr(parent, name, pack_linear(child, fmt))
    fuse_gated_mlps(model)
    # a tied LM head shared the embedding's Parameter: both are replaced, so drop the tie
    model.config.tie_word_embeddings = False
    if hasattr(model.config, "get_text_config"):
        model.config.get_text_config().tie_word_embeddings = False
    _release_loaded_file(model)
    return model


def _release_loaded_file(model: nn.Module) -> None:
    """Give back the memory the fp32 weights held once they are packed.

    transformers loads safetensors as views of one memory map of the file: a norm's few bytes,
    left unpacked, kept all 513 MiB of SmolLM2's file mapped and resident (measured). Copying what
    is left unpacked drops the map; glibc keeps the freed quantization temporaries in its heap
    until asked to trim it (320 MiB here).
    """
    for module in model.modules():
        for tensor in [*module._parameters.values(), *module._buffers.values()]:
            if tensor is not None and not isinstance(module, (PackedLinear, PackedEmbedding)):
                tensor.data = tensor.data.clone()
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to trim
        pass


def dense_weight(linear: nn.Module) -> torch.Tensor:
    """A linear layer's weight ``[out, in]`` (fp32 when packed), whatever format stores it
    (what InfiniGen's partial query weights are cut from)."""
    return linear.dense() if isinstance(linear, PackedLinear) else linear.weight.detach()


def weights_format(model: nn.Module) -> str:
    """The format ``pack_weights`` stored ``model`` in (``fp32`` when never packed)."""
    return next((m.fmt for m in model.modules() if isinstance(m, PackedLinear)), UNPACKED)


def stored_bytes(model: nn.Module) -> int:
    """Bytes of the model's weights as stored: parameters and buffers, each shared tensor once."""
    tensors = {t.data_ptr(): t for t in [*model.parameters(), *model.buffers()] if t.numel()}
    return sum(t.numel() * t.element_size() for t in tensors.values())
