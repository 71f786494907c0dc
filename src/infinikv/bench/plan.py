"""An offload planner in the spirit of FlexGen's cost model: a PROJECTION, not a measurement.

Given a model's shape, a GPU, host memory, a batch and a context, it decides where the fp16
weights and each policy's K/V live (GPU first, the rest in host memory behind PCIe) and projects
decode tokens/s from bytes alone: a step reads every weight and the K/V a policy touches from
GPU memory, and copies what lives on the host over PCIe, the two overlapped (FlexGen's
pipeline), so the slower one sets the pace. Compute only counts when it is slower still. The
policies and what the planner models of each are the policies' own declared ``cost``
(``contract.Cost``); the fractions that make them differ (InfiniGen's fetched share, H2O's kept
share) come from our own bench JSON when given, else from the defaults the policies declare.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..contract import REFERENCE, Cost
from ..errors import InfinikvError
from ..policies import REGISTRY

GB = 1e9
DTYPE_BYTES = 2  # fp16 weights and K/V, as in the paper's runs
ACHIEVED = 0.8  # share of a peak bandwidth (HBM or PCIe) that decode kernels and pinned copies reach
USABLE = 0.9  # share of GPU and host memory left after the CUDA context, activations and fragmentation
PARTIAL_RATIO = 0.3  # InfiniGen's partial weights and partial keys: 30% of each head's dims
DENSE_LAYERS = 2  # InfiniGen's first layers attend (and fetch) densely
MODELLED: tuple[Cost, ...] = tuple(cls.cost for cls in REGISTRY.values() if cls.cost is not None)
FRACTIONS = {cost.name: cost.share for cost in MODELLED if cost.share}  # name: (what the share is, default)


@dataclass(frozen=True)
class ModelShape:
    """A decoder-only transformer's sizes (enough to count its bytes)."""

    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    gated_mlp: bool  # Llama's gate/up/down (3 matrices) vs OPT's fc1/fc2 (2)
    tied_embeddings: bool

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def params(self) -> int:
        """Weights in matrices and embeddings (biases and norms, < 0.1%, are left out)."""
        attention = 2 * self.hidden * self.hidden + 2 * self.hidden * self.kv_heads * self.head_dim
        mlp = (3 if self.gated_mlp else 2) * self.hidden * self.ffn
        return self.layers * (attention + mlp) + self.vocab * self.hidden * (1 if self.tied_embeddings else 2)

    def kv_bytes_per_token(self) -> int:
        """K and V of one token over all layers, fp16."""
        return 2 * self.layers * self.kv_heads * self.head_dim * DTYPE_BYTES


@dataclass(frozen=True)
class Gpu:
    """A GPU and its host link: memory (GB), HBM and link peak bandwidths (GB/s), fp16 TFLOPS."""

    name: str
    memory_gb: float
    hbm_gbps: float
    link_gbps: float
    tflops: float


MODEL_PRESETS = {
    "opt-6.7b": ModelShape("opt-6.7b", 32, 4096, 32, 32, 16384, 50272, False, True),
    "opt-13b": ModelShape("opt-13b", 40, 5120, 40, 40, 20480, 50272, False, True),
    "opt-30b": ModelShape("opt-30b", 48, 7168, 56, 56, 28672, 50272, False, True),
    "llama-2-7b": ModelShape("llama-2-7b", 32, 4096, 32, 32, 11008, 32000, True, False),
    "llama-2-13b": ModelShape("llama-2-13b", 40, 5120, 40, 40, 13824, 32000, True, False),
}
GPU_PRESETS = {  # vendor peak figures; PCIe x16: 3.0 = 15.75 GB/s, 5.0 = 63 GB/s per direction
    "a6000": Gpu("RTX A6000 48 GB, PCIe 3.0 x16", 48, 768, 15.75, 154.8),
    "h100": Gpu("H100 SXM 80 GB, PCIe 5.0 x16", 80, 3350, 63, 989),
    "h200": Gpu("H200 141 GB, PCIe 5.0 x16", 141, 4800, 63, 989),
}


def preset(table: dict, name: str, kind: str):
    """``table[name]``, or a one-line error listing the choices."""
    if name not in table:
        raise InfinikvError(f"unknown {kind} preset {name!r}; choose from {', '.join(table)}")
    return table[name]


def shape_from_config(path: Path) -> ModelShape:
    """A ``ModelShape`` from a Hugging Face ``config.json`` (or the folder holding it)."""
    path = Path(path)
    file = path / "config.json" if path.is_dir() else path
    try:
        config = json.loads(file.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise InfinikvError(f"cannot read a model config from {file}: {exc}") from None
    opt = config.get("model_type") == "opt"
    try:
        heads = config["num_attention_heads"]
        return ModelShape(
            name=config.get("_name_or_path") or file.parent.name,
            layers=config["num_hidden_layers"],
            hidden=config["hidden_size"],
            heads=heads,
            kv_heads=config.get("num_key_value_heads") or heads,
            ffn=config["ffn_dim"] if opt else config["intermediate_size"],
            vocab=config["vocab_size"],
            gated_mlp=not opt,
            tied_embeddings=config.get("tie_word_embeddings", opt),
        )
    except KeyError as exc:
        raise InfinikvError(f"{file} has no {exc.args[0]!r}: not a decoder config the planner knows") from None


def fractions_from_bench(rows: list[dict], context: int) -> dict[str, tuple[float, str]]:
    """InfiniGen's fetched share and H2O's kept share measured by ``bench speed``, from the cells
    at the context nearest ``context``: ``{policy: (fraction, where it came from)}``."""
    found: dict[str, tuple[float, str]] = {}
    if not rows:
        return found
    nearest = min({r["context"] for r in rows}, key=lambda c: abs(math.log(c / context)))
    cells = [r for r in rows if r["context"] == nearest]
    full = next((r for r in cells if r["policy"] == REFERENCE), None)
    for r in cells:
        name = r["policy"]
        if name not in FRACTIONS or name in found:
            continue
        if FRACTIONS[name][0] == "fetch" and "fetched_fraction" in r:
            found[name] = (r["fetched_fraction"], f"bench, context {nearest}, {r.get('label', name)}")
        if FRACTIONS[name][0] == "keep" and full:
            found[name] = (r["kv_bytes"] / full["kv_bytes"], f"bench, context {nearest}, budget {r.get('budget')}")
    return found


def read_rows(path: Path) -> list[dict]:
    """Result rows from a JSON list (``--json``), a JSON-lines results file, or the docs' kept rows
    (``docs/results/*.json``: the rows with how they were measured)."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise InfinikvError(f"cannot read {path}: {exc.strerror}") from None
    try:
        if text.lstrip().startswith(("[", "{\n")):
            whole = json.loads(text)
            return whole["rows"] if isinstance(whole, dict) and "rows" in whole else whole
        return [json.loads(x) for x in text.splitlines() if x]
    except json.JSONDecodeError as exc:
        raise InfinikvError(f"{path} is not bench JSON ({exc.msg})") from None


def plan(
    model: ModelShape,
    gpu: Gpu,
    host_gb: float,
    batch: int,
    context: int,
    fractions: dict[str, float] | None = None,
    kv_on_host: bool = False,
) -> list[dict[str, Any]]:
    """Project decode tokens/s for each modelled policy; one dict per policy (bytes in B, times in
    s). ``fractions``: each policy's modelled share by name (default: what it declares).

    Raises when even the full fp16 K/V of ``batch x context`` tokens does not fit in GPU plus
    host memory next to the weights (``offload`` and ``infinigen`` keep all of it).
    """
    if batch < 1 or context < 1:
        raise InfinikvError("--batch and --context must be at least 1")
    weights = model.params() * DTYPE_BYTES
    kv = batch * context * model.kv_bytes_per_token()
    gpu_room, host_room = USABLE * gpu.memory_gb * GB, USABLE * host_gb * GB
    if weights + kv > gpu_room + host_room:
        raise InfinikvError(
            f"context {context} x batch {batch} needs {kv / GB:.1f} GB of fp16 K/V plus {weights / GB:.1f} GB of "
            f"weights, {(weights + kv) / GB:.1f} GB in all, more than the {(gpu_room + host_room) / GB:.1f} GB usable "
            f"on the GPU and host ({USABLE:.0%} of {gpu.memory_gb:g} + {host_gb:g} GB): use a shorter --context, "
            "a smaller --batch or more --host-memory"
        )
    dense = min(DENSE_LAYERS, model.layers) / model.layers
    partial = PARTIAL_RATIO / 2 * kv + PARTIAL_RATIO * model.layers * model.hidden**2 * DTYPE_BYTES
    shares = {name: default for name, (_, default) in FRACTIONS.items()} | (fractions or {})
    rows = []
    for cost in MODELLED:
        name, share = cost.name, shares.get(cost.name, 1.0)
        # K/V stored, K/V read per step, kept on the GPU besides (partial keys and query weights)
        stored, read = cost.stores(share, dense) * kv, cost.reads(share, dense) * kv
        resident = partial if cost.partial else 0
        attended = 1 if cost.share is None else read / kv  # the share of the tokens attended
        on_gpu = min(weights, max(gpu_room - resident, 0))  # weights first, after what must be resident
        kv_gpu = not kv_on_host and on_gpu == weights and weights + resident + stored <= gpu_room
        host = (weights - on_gpu) + (0 if kv_gpu else stored)
        link_bytes = (weights - on_gpu) + (0 if kv_gpu else read)
        hbm_bytes = weights + read + resident  # every weight, the K/V attended, speculation's partial data
        flops = 2 * model.params() * batch + 4 * batch * model.layers * model.hidden * context * attended
        times = {
            "GPU memory": hbm_bytes / (ACHIEVED * gpu.hbm_gbps * GB),
            "PCIe": link_bytes / (ACHIEVED * gpu.link_gbps * GB),
            "compute": flops / (gpu.tflops * 1e12),
        }
        bound = max(times, key=times.get)
        fits = host <= host_room and resident < gpu_room
        step = times[bound]
        rows.append(
            {
                "policy": name,
                "fits": fits,
                "weights_on_gpu_bytes": round(on_gpu),
                "kv_on_gpu": kv_gpu,
                "kv_stored_bytes": round(stored),
                "gpu_bytes": round(on_gpu + resident + (stored if kv_gpu else 0)),
                "host_bytes": round(host),
                "link_bytes_per_step": round(link_bytes),
                "gpu_memory_bytes_per_step": round(hbm_bytes),
                "seconds_per_step": step,
                "bound": bound,
                "tokens_per_second": batch / step if fits else None,
            }
        )
    return rows
