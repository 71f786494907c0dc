"""infinikv's native CPU kernels (``kernels.cpp``), built once per machine, and their references.

The kernels are what a decode step spends its time in: int4 and int8 weight products for one
or a few rows (torch's weight-only kernels take bf16 activations, so each call pays two casts,
and their fixed cost is most of a small matrix's time), and one query's attention over the
slots, which also returns the probability each slot received (what the eviction rules keep).

They are compiled from source with the system C++ compiler and ``-march=native`` through
torch's extension API, into ``$INFINIKV_HOME/kernels/<key>``, where the key covers the source,
torch's version and the CPU's instruction sets: a machine that moves from AVX-512 to AVX2 gets
its own build, never the other's. ``make`` builds them at set-up (``python -m infinikv.native``);
any later first use builds them if needed (~20 s, said on stderr). Where no build is possible
(no compiler, not x86, ``INFINIKV_NATIVE=0``) ``available()`` is False and callers use the
references below, which are also what the tests compare each kernel with.
"""

from __future__ import annotations

import functools
import hashlib
import os
import platform
import sys
import warnings
from pathlib import Path

import torch

from ..paths import home

SOURCE = Path(__file__).with_name("kernels.cpp")
FLAGS = ["-O3", "-march=native", "-fopenmp"]
INT4_GROUP = 32


def cpu_features() -> str:
    """The CPU's instruction-set flags (what ``-march=native`` compiles for)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return " ".join(sorted(line.split(":", 1)[1].split()))
    except OSError:
        pass
    return platform.processor() or platform.machine()


def build_key() -> str:
    """What a build depends on: the source, the flags, torch and the CPU."""
    digest = hashlib.sha256()
    for part in (SOURCE.read_bytes(), " ".join(FLAGS).encode(), torch.__version__.encode(), cpu_features().encode()):
        digest.update(part)
    return digest.hexdigest()[:16]


def build_dir() -> Path:
    return home() / "kernels" / build_key()


ready = False  # the kernels are loaded (read by code that torch.compile traces: a plain flag)


@functools.cache
def available() -> bool:
    """Build (once per machine) and load the kernels; False, with one warning, where they cannot."""
    global ready
    if os.environ.get("INFINIKV_NATIVE", "1") == "0" or platform.machine() not in ("x86_64", "AMD64"):
        return False
    from torch.utils import cpp_extension

    where = build_dir()
    where.mkdir(parents=True, exist_ok=True)
    built = any(where.glob("*.so"))
    if not built:
        print(f"infinikv: building the native CPU kernels into {where} (once per machine, ~20 s) ...", file=sys.stderr)
    try:
        cpp_extension.load(
            name=f"infinikv_kernels_{build_key()}",
            sources=[str(SOURCE)],
            build_directory=str(where),
            extra_cflags=FLAGS,
            extra_ldflags=["-fopenmp"],
            is_python_module=False,
            verbose=False,
        )
    except Exception as exc:  # no compiler, a broken toolchain: the references still run
        warnings.warn(
            f"infinikv: native CPU kernels unavailable ({str(exc).splitlines()[0][:200]}); using torch's kernels",
            stacklevel=2,
        )
        return False
    _register_fakes()
    ready = True
    return True


def _register_fakes() -> None:
    """Shapes for torch.compile, which traces the ops without running them."""
    lib = "infinikv::"

    @torch.library.register_fake(lib + "int4_linear")
    def _(x, packed, scale, minimum):
        return x.new_empty(x.shape[0], packed.shape[0])

    @torch.library.register_fake(lib + "int4_dequantize")
    def _(packed, scale, minimum):
        return scale.new_empty(packed.shape[0], packed.shape[1] * 2)

    @torch.library.register_fake(lib + "int8_linear")
    def _(x, q, scale):
        return x.new_empty(x.shape[0], q.shape[0])

    @torch.library.register_fake(lib + "decode_attention")
    def _(query, keys, values, visible, bias, scale, want_mass):
        b, n_kv, length = keys.shape[:3]
        mass = query.new_empty(b, n_kv, length) if want_mass else query.new_empty(0)
        return query.new_empty(query.shape), mass

    @torch.library.register_fake(lib + "lowest_slot")
    def _(scores, valid, position):
        shape = (*scores.shape[:2], 1)
        return position.new_empty(shape), position.new_empty(shape)

    @torch.library.register_fake(lib + "rms_norm")
    def _(x, weight, eps, offset):
        return torch.empty_like(x)


# -- the int4 layout and the references -----------------------------------------------------------
def int4_grid(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric int4 per 32 values of a row (the block of the Q4 GGUFs): ``weight [N, K]`` ->
    ``(q [N, K/32, 32] uint8 in 0..15, scale, minimum [N, K/32] float32)``, ``weight ~ q * scale + minimum``."""
    rows, width = weight.shape
    groups = weight.float().reshape(rows, width // INT4_GROUP, INT4_GROUP)
    low, high = groups.amin(dim=2), groups.amax(dim=2)
    scale = ((high - low) / 15).clamp(min=1e-6)
    q = ((groups - low[..., None]) / scale[..., None]).round().clamp(0, 15).to(torch.uint8)
    return q, scale, low


def pack_int4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``int4_grid`` in the kernel's layout: ``packed [N, K/2] uint8`` (in each group's 16 bytes, byte i
    holds value i in its low nibble and value i + 16 in its high one), ``scale``, ``minimum`` ``[N, K/32]``."""
    q, scale, low = int4_grid(weight)
    half = INT4_GROUP // 2
    packed = (q[..., :half] | (q[..., half:] << 4)).reshape(weight.shape[0], -1)
    return packed.contiguous(), scale.contiguous(), low.contiguous()


def unpack_int4(packed: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor) -> torch.Tensor:
    """The float32 weight ``[N, K]`` that ``pack_int4``'s output stands for."""
    rows = packed.shape[0]
    bytes_ = packed.view(rows, -1, INT4_GROUP // 2)
    q = torch.cat([bytes_ & 15, bytes_ >> 4], dim=-1).float()
    return (q * scale[..., None] + minimum[..., None]).reshape(rows, -1)


def int4_linear_reference(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor):
    """``x [M, K]`` times the int4 weight, transposed: ``[M, N]``."""
    return x @ unpack_int4(packed, scale, minimum).T


def int8_linear_reference(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return x @ (q.float() * scale.float()[:, None]).T


def decode_attention_reference(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    visible: torch.Tensor | None,
    bias: torch.Tensor | None,
    scale: float,
    want_mass: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One query per head: query (b, H, d), keys/values (b, h, L, d), visible (b, 1 or h, L) bool,
    bias (b, h, L) -> out (b, H, d) and the probability per slot summed over each KV head's
    query heads (b, h, L) (empty without ``want_mass``)."""
    b, n_heads, d = query.shape
    n_kv = keys.shape[1]
    grouped = query.view(b, n_kv, n_heads // n_kv, d)
    logits = torch.matmul(grouped, keys.transpose(-1, -2)) * scale  # (b, h, g, L)
    if bias is not None:
        logits = logits + bias[:, :, None, :]
    if visible is not None:
        logits = logits.masked_fill(~visible[:, :, None, :], float("-inf"))
    probs = logits.softmax(-1)
    out = torch.matmul(probs, values).reshape(b, n_heads, d)
    return out, probs.sum(2) if want_mass else query.new_empty(0)


def lowest_slot_reference(
    scores: torch.Tensor, valid: torch.Tensor, position: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The valid slot with the lowest score (above float's max: its max), the newest among equal
    scores, and the valid slots' count, per row and KV head: (b, h, L) -> (b, h, 1) each."""
    scores = scores.clamp(max=torch.finfo(torch.float32).max).masked_fill(~valid, float("inf"))
    lowest = scores == scores.amin(-1, keepdim=True)
    victims = position.masked_fill(~lowest, torch.iinfo(torch.long).min).argmax(-1, keepdim=True)
    return victims, valid.sum(-1, keepdim=True)


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (weight + offset)
