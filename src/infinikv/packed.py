"""Packed weights: a Linear's weight stored as bf16, int8 or int4 and multiplied by torch's CPU
weight-only kernels or infinikv's own (``native``); a gated MLP's gate and up as one product; an
embedding's rows in bf16 or int8. ``weights`` decides which module gets which."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from . import native
from .errors import InfinikvError

INT4_GROUP = 32  # values per scale and zero: the block of the Q4 GGUFs the bundled models come from


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row int8: ``weight [N, K]`` -> ``(q int8 [N, K], scale bf16 [N])``, ``weight ~ q * scale``."""
    scale = (weight.abs().amax(dim=1).float() / 127).clamp(min=1e-12)
    q = (weight.float() / scale[:, None]).round().clamp(-127, 127).to(torch.int8)
    return q, scale.to(torch.bfloat16)


def quantize_int4(weight: torch.Tensor, group: int = INT4_GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """``native.int4_grid`` in the layout of torch's CPU int4 kernel.

    ``weight [N, K]`` -> ``(q int32 [N, K] in 0..15, scale_and_zero bf16 [K / group, N, 2])`` with
    ``weight ~ (q - 8) * scale + zero`` (the zero is the value at the middle code 8).
    """
    q, scale, low = native.int4_grid(weight)
    zero = low + scale * 8
    scale_and_zero = torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous().to(torch.bfloat16)
    return q.reshape(weight.shape).to(torch.int32), scale_and_zero


def dequantize_int4(q: torch.Tensor, scale_and_zero: torch.Tensor, group: int = INT4_GROUP) -> torch.Tensor:
    """The fp32 weight ``[N, K]`` that ``quantize_int4``'s ``(q, scale_and_zero)`` stand for."""
    rows, width = q.shape
    scale, zero = scale_and_zero.float().transpose(0, 1).unbind(-1)  # [N, K / group] each
    codes = q.float().reshape(rows, width // group, group) - 8
    return (codes * scale[..., None] + zero[..., None]).reshape(rows, width)


class PackedLinear(nn.Module):
    """``nn.Linear`` with its weight stored in a packed format (the fp32 weight is not kept);
    ``pack_linear`` picks the kernel. ``forward(x [..., in_features]) -> [..., out_features]`` in
    ``x``'s dtype; the bias, if any, stays in the dtype it was loaded in.

    ``rows`` names each buffer and the dim its output rows lie on (``stacked`` joins them).
    """

    def __init__(self, linear: nn.Linear, fmt: str) -> None:
        super().__init__()
        self.rows: dict[str, int] = {}
        self.in_features, self.out_features, self.fmt = linear.in_features, linear.out_features, fmt
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.matmul(x.reshape(-1, self.in_features)).reshape(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias

    def matmul(self, flat: torch.Tensor) -> torch.Tensor:
        """``flat [M, in_features]`` times the stored weight, transposed: ``[M, out_features]`` in flat's dtype."""
        raise NotImplementedError

    def dense(self) -> torch.Tensor:
        """The fp32 weight ``[out_features, in_features]`` this module multiplies by."""
        raise NotImplementedError

    @classmethod
    def stacked(cls, parts: list[PackedLinear]) -> PackedLinear:
        """One packed linear whose output is ``parts``' outputs side by side (their rows stacked, in
        their own format: nothing is re-quantized)."""
        first = parts[0]
        out = cls.__new__(cls)
        nn.Module.__init__(out)
        out.in_features, out.fmt, out.rows = first.in_features, first.fmt, first.rows
        out.out_features = sum(p.out_features for p in parts)
        for name, rows_dim in first.rows.items():
            out.register_buffer(name, torch.cat([getattr(p, name) for p in parts], rows_dim))
        biases = [p.bias for p in parts]
        out.bias = None if biases[0] is None else nn.Parameter(torch.cat(biases), requires_grad=False)
        return out

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, weights={self.fmt}"


class TorchPackedLinear(PackedLinear):
    """bf16, int8 or int4 through torch's own kernels (``aten._weight_int8pack_mm``,
    ``aten._weight_int4pack_mm_for_cpu``): they take bf16 inputs, so each call rounds its input
    to bf16 and casts its output back. Used where infinikv's native kernels do not run."""

    def __init__(self, linear: nn.Linear, fmt: str) -> None:
        super().__init__(linear, fmt)
        weight = linear.weight.detach()
        if fmt == "bf16":
            self.register_buffer("weight", weight.to(torch.bfloat16))
            self.rows = {"weight": 0}
        elif fmt == "int8":
            q, scale = quantize_int8(weight)
            self.register_buffer("weight", q)
            self.register_buffer("scale", scale)
            self.rows = {"weight": 0, "scale": 0}
        elif fmt == "int4":
            if self.in_features % INT4_GROUP:
                raise InfinikvError(f"int4 weights need in_features divisible by {INT4_GROUP}, got {self.in_features}")
            q, scale_and_zero = quantize_int4(weight)
            self.register_buffer("weight", torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1))
            self.register_buffer("scale_and_zero", scale_and_zero)
            self.rows = {"weight": 0, "scale_and_zero": 1}
        else:
            raise ValueError(f"no packed linear for {fmt!r}")

    def matmul(self, flat: torch.Tensor) -> torch.Tensor:
        x = flat.to(torch.bfloat16)
        if self.fmt == "int8":
            y = torch._weight_int8pack_mm(x, self.weight, self.scale)
        elif self.fmt == "int4":
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.weight, INT4_GROUP, self.scale_and_zero)
        else:
            y = F.linear(x, self.weight)
        return y.to(flat.dtype)

    def dense(self) -> torch.Tensor:
        """(int4's packed layout has no unpacking op: the kernel applied to the identity gives it,
        bf16-rounded)"""
        if self.fmt == "int8":
            return self.weight.float() * self.scale.float()[:, None]
        if self.fmt == "bf16":
            return self.weight.float()
        identity = torch.eye(self.in_features, dtype=torch.bfloat16, device=self.weight.device)
        return self.matmul(identity).float().T.contiguous()


class NativeLinear(PackedLinear):
    """int8 or int4 through infinikv's CPU kernels (``infinikv.native``): float32 activations, no
    rounding of the input, scales kept in float32. A decode step's few rows go through the
    kernel; a prefill chunk's many rows through a float32 GEMM of the dequantized weight, which
    is faster there (measured: 576x3072 at 512 rows, 16.2 ms by the kernel, 13.9 dequantized).
    Below ``WHOLE_ROWS`` rows the weight is dequantized a block of 4 MiB at a time: a block stays in
    the cache and in malloc's heap, where a large weight came from fresh pages every call, a cost
    that many rows amortize and few do not (2 threads, Qwen2.5's 9728x896 gate and up: at 128 rows
    56 ms whole, 37 ms in blocks; at 2,048 rows 411 ms whole, 653 ms in blocks, which copy their
    outputs into place)."""

    GEMV_ROWS = 16  # above this many rows, dequantize and multiply
    WHOLE_ROWS = 256  # from this many rows, dequantize the whole weight at once
    BLOCK_FLOATS = 1 << 20  # below it, a block of the dequantized weight

    def __init__(self, linear: nn.Linear, fmt: str) -> None:
        super().__init__(linear, fmt)
        weight = linear.weight.detach()
        if fmt == "int8":
            q, scale = quantize_int8(weight)
            self.register_buffer("weight", q)
            self.register_buffer("scale", scale.float())
            self.rows = {"weight": 0, "scale": 0}
        elif fmt == "int4":
            if self.in_features % INT4_GROUP:
                raise InfinikvError(f"int4 weights need in_features divisible by {INT4_GROUP}, got {self.in_features}")
            packed, scale, minimum = native.pack_int4(weight)
            self.register_buffer("weight", packed)
            self.register_buffer("scale", scale)
            self.register_buffer("minimum", minimum)
            self.rows = {"weight": 0, "scale": 0, "minimum": 0}
        else:
            raise ValueError(f"no native linear for {fmt!r}")

    def matmul(self, flat: torch.Tensor) -> torch.Tensor:
        if flat.shape[0] <= self.GEMV_ROWS:
            if self.fmt == "int8":
                return torch.ops.infinikv.int8_linear(flat, self.weight, self.scale)
            return torch.ops.infinikv.int4_linear(flat, self.weight, self.scale, self.minimum)
        block = max(1, self.BLOCK_FLOATS // self.in_features)
        if flat.shape[0] >= self.WHOLE_ROWS or block >= self.out_features:
            return F.linear(flat, self.dense())
        out = flat.new_empty(flat.shape[0], self.out_features)
        for start in range(0, self.out_features, block):
            rows = slice(start, start + block)
            out[:, rows] = F.linear(flat, self.dense_rows(rows))
        return out

    def dense(self) -> torch.Tensor:
        return self.dense_rows(slice(None))

    def dense_rows(self, rows: slice) -> torch.Tensor:
        """The fp32 weight's ``rows`` ``[len(rows), in_features]``."""
        if self.fmt == "int8":
            return self.weight[rows] * self.scale[rows, None]  # float32 in one pass (int8 widens exactly)
        return torch.ops.infinikv.int4_dequantize(self.weight[rows], self.scale[rows], self.minimum[rows])


def pack_linear(linear: nn.Linear, fmt: str) -> PackedLinear:
    """``linear`` stored as ``fmt``, multiplied by infinikv's native kernels where they run (int8 and
    int4 on a CPU with float32 activations), else by torch's."""
    native_kernels = linear.weight.device.type == "cpu" and linear.weight.dtype == torch.float32
    if fmt in ("int8", "int4") and native_kernels and native.available():
        return NativeLinear(linear, fmt)
    return TorchPackedLinear(linear, fmt)


class GatedMLP(nn.Module):
    """A gated MLP, ``down(act(gate(x)) * up(x))`` (Llama, Qwen2, Gemma3...), with its gate and up
    projections packed as one matrix: one matmul and one cast of its input where there were two.
    ``forward(x [..., D]) -> [..., D]``."""

    def __init__(self, gate: PackedLinear, up: PackedLinear, down: PackedLinear, act_fn: nn.Module) -> None:
        super().__init__()
        self.gate_up, self.down_proj, self.act_fn = type(gate).stacked([gate, up]), down, act_fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down_proj(self.act_fn(gate) * up)


def fuse_gated_mlps(model: nn.Module) -> int:
    """Replace each packed gated MLP of ``model`` by a :class:`GatedMLP`; returns how many.

    An MLP qualifies by its parts (packed ``gate_proj``, ``up_proj``, ``down_proj`` and an
    ``act_fn``, nothing else) and by its output: the fused module must give the original's on a
    random input, so an MLP that combines the same parts another way stays as it is.
    """
    fused = 0
    for parent in list(model.modules()):
        for name, mlp in list(parent.named_children()):
            parts = dict(mlp.named_children())
            if set(parts) != {"gate_proj", "up_proj", "down_proj", "act_fn"}:
                continue
            if not all(isinstance(parts[p], PackedLinear) for p in ("gate_proj", "up_proj", "down_proj")):
                continue
            candidate = GatedMLP(mlp.gate_proj, mlp.up_proj, mlp.down_proj, mlp.act_fn)
            device = mlp.gate_proj.weight.device  # a generator of its own: loading draws nothing from the global one
            generator = torch.Generator(device).manual_seed(0)
            probe = torch.randn(2, mlp.gate_proj.in_features, device=device, generator=generator)
            with torch.inference_mode():
                same = torch.allclose(candidate(probe), mlp(probe), rtol=1e-3, atol=1e-4)
            if same:
                setattr(parent, name, candidate)
                fused += 1
    return fused


class PackedEmbedding(nn.Module):
    """An input embedding whose rows are stored in bf16, or int8 with one scale per row (for
    ``int8`` and ``int4``: a lookup reads a few rows, so the table's format costs no speed).
    Keeps a Gemma-style ``embed_scale`` (a multiplier the original module applied)."""

    def __init__(self, embedding: nn.Embedding, fmt: str) -> None:
        super().__init__()
        table, self.padding_idx = embedding.weight.detach(), embedding.padding_idx
        self.num_embeddings, self.embedding_dim = table.shape
        self.dtype = table.dtype
        if fmt == "bf16":
            self.register_buffer("weight", table.to(torch.bfloat16))
            self.scale = None
        else:
            q, scale = quantize_int8(table)
            self.register_buffer("weight", q)
            self.register_buffer("scale", scale)
        embed_scale = getattr(embedding, "embed_scale", None)
        self.register_buffer("embed_scale", None if embed_scale is None else embed_scale.detach().clone())

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = F.embedding(ids, self.weight).to(self.dtype)
        if self.scale is not None:
            rows = rows * self.scale[ids].to(self.dtype)[..., None]
        return rows if self.embed_scale is None else rows * self.embed_scale.to(self.dtype)
