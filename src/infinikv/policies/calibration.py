"""InfiniGen's offline calibration (``infinikv prepare``): rank each KV head's rotary pairs by how
much of q.k they carry, and measure each layer's coverage curve for the mass rule, on token ids
someone else read (``preparation.ensure_prepared`` reads texts); saved next to the model with the
options the curves were measured with (``Fit``), and loaded back only for the same options.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from ..errors import InfinikvError
from ..kv.speculation import (
    RankedByMass,
    column_scores,
    mass_ranking,
    pair_scores,
    pairs_to_columns,
    partial_query,
    speculative_scores,
)
from ..modules import attention_modules, is_rotary, partial_weights, project
from ..sizes import model_device, sliding_window

PREP_FILE = "infinikv-infinigen.json"
PREP_VERSION = 2  # 2: the coverage curves of the mass rule
# the speculated masses whose true coverage calibration measures, per layer
MASS_GRID = (0.5, 0.6, 0.7, 0.8, 0.85, 0.9, 0.93, 0.95, 0.97, 0.98, 0.99, 1.0)
CURVE_QUERIES = 128  # decode positions per layer the curves average over


@dataclass(frozen=True)
class Fit:
    """The policy options a calibration's coverage curves depend on (the defaults are the policy's)."""

    # half the dims: with distractors (RULER niah_multikey_1, 2k) 0.3 picked a wrong key's value
    # (infinigen 40 against full's 80), 0.5 scores 90 for 2 ms more a step at 4k
    partial_ratio: float = 0.5
    max_fetch: float = 0.1
    keep_first: int = 4
    keep_recent: int = 32

    def file_name(self) -> str:
        """The defaults' calibration is ``PREP_FILE``; other options get a file of their own."""
        if self == Fit():
            return PREP_FILE
        options = f"r{self.partial_ratio:g}-f{self.max_fetch:g}-{self.keep_first}-{self.keep_recent}"
        return f"infinikv-infinigen-{options}.json"


def prep_path(model: torch.nn.Module, fit: Fit) -> Path:
    """Where ``model``'s calibration for ``fit`` is saved: next to its weights."""
    folder = Path(model.name_or_path or "")
    if not model.name_or_path or not folder.is_dir():
        raise InfinikvError(f"infinigen's preparation is saved next to the model, but {folder} is not a folder")
    return folder / fit.file_name()


def load(model: torch.nn.Module, fit: Fit) -> dict[str, Any] | None:
    """The saved calibration of ``model`` for ``fit``, or None (none, an older version, other options)."""
    path = prep_path(model, fit)
    if not path.is_file():
        return None
    prep = json.loads(path.read_text())
    if prep.get("version") != PREP_VERSION or prep.get("fit") != asdict(fit):
        return None
    return prep


def fit_and_save(model: torch.nn.Module, ids: torch.Tensor, text: str, fit: Fit, progress: bool = False) -> Path:
    """Calibrate on ``ids`` (1, n), the first tokens of ``text``, and save it next to the model."""
    prep = calibrate(model, ids.to(model_device(model)), fit, progress)
    prep["calibration"], prep["version"] = text, PREP_VERSION
    path = prep_path(model, fit)
    temporary = path.with_name(f"{path.name}.{os.getpid()}.tmp")  # another process may be reading it
    temporary.write_text(json.dumps(prep))
    os.replace(temporary, path)
    return path


@torch.inference_mode()
def attention_inputs(
    model: torch.nn.Module, ids: torch.Tensor, progress: bool = False
) -> dict[int, tuple[torch.Tensor, Any]]:
    """Each layer's attention input x (1, n, D) and RoPE ``(cos, sin)`` (or None) for ``ids`` (1, n)."""
    captured: dict[int, tuple[torch.Tensor, Any]] = {}
    modules = attention_modules(model)
    bar = tqdm(total=len(modules), desc="calibrating", unit="layer", disable=not progress, leave=False)

    def capture(module, args, kwargs):
        captured[module.layer_idx] = (kwargs["hidden_states"], kwargs.get("position_embeddings"))
        bar.update(1)

    hooks = [m.register_forward_pre_hook(capture, with_kwargs=True) for m in modules.values()]
    try:
        model(input_ids=ids, use_cache=False, logits_to_keep=1)
    finally:
        for hook in hooks:
            hook.remove()
        bar.close()
    return captured


@torch.inference_mode()
def calibrate(model: torch.nn.Module, ids: torch.Tensor, fit: Fit = Fit(), progress: bool = False) -> dict[str, Any]:
    """Rank each KV head's rotary pairs (and single columns) by how much of q.k they carry, and
    measure each layer's coverage curve for the mass rule (``coverage_curve``) under ``fit``.

    Runs ``ids`` (1, n) through the model once and uses every layer's post-RoPE queries and
    keys. Returns ``{"pair_ranking": [layer][kv head][pairs, best first], "column_ranking": ...,
    "coverage"/"fetched": [layer][one per MASS_GRID]}`` (layer 0, with no layer before it,
    speculates from its own input), and for a QK-norm model ``"query_square"``: [layer][query
    head][column], the mean square of its queries before the norm. A sliding-window layer, which
    never speculates, gets None in each list.
    """
    prep: dict[str, Any] = {"pair_ranking": [], "column_ranking": [], "coverage": [], "fetched": []}
    modules = attention_modules(model)
    rotary, previous = is_rotary(model), None
    normed = any(getattr(m, "q_norm", None) is not None for m in modules.values())
    if normed:
        prep["query_square"] = []
    for index, (x, rope) in sorted(attention_inputs(model, ids, progress).items()):
        module, before, previous = modules[index], previous, x
        if sliding_window(model.config, index) is not None:
            for name in prep:
                prep[name].append(None)
            continue
        q, k, square = project(module, x, rope)
        q, k, square = q[0].transpose(0, 1), k[0].transpose(0, 1), square[0]  # (n, H, d), (n, h, d), (H, d)
        prep["pair_ranking"].append(pair_scores(q, k).argsort(-1, descending=True).tolist())
        prep["column_ranking"].append(column_scores(q, k).argsort(-1, descending=True).tolist())
        if normed:
            prep["query_square"].append(square.tolist())
        columns = kept_columns(prep, index, rotary, fit.partial_ratio, module.head_dim)
        norm = query_norm(module, prep, index, columns)
        coverage, fetched = coverage_curve(module, x if before is None else before, rope, q, k, columns, fit, norm)
        prep["coverage"].append(coverage)
        prep["fetched"].append(fetched)
    return {**prep, "mass_grid": list(MASS_GRID), "fit": asdict(fit), "tokens": int(ids.shape[1])}


def coverage_curve(
    module: torch.nn.Module,
    x: torch.Tensor,
    rope: Any,
    q: torch.Tensor,
    k: torch.Tensor,
    columns: torch.Tensor,
    fit: Fit,
    norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,
) -> tuple[list[float], list[float]]:
    """How much true attention mass the mass rule covers, and what share it fetches, at each
    speculated mass of ``MASS_GRID``, as a decode step would see it: speculation from the
    previous layer's attention input x (1, n, D) with this layer's partial weights, against the
    true attention of this layer's queries q (n, H, d) over its keys k (n, h, d), post-RoPE, at
    ``CURVE_QUERIES`` positions of the second half, with ``fit``'s cap and resident tokens. The
    current token (always attended) counts.
    ``norm``: the QK-norm estimate of a partial query (``query_norm``), or None.
    """
    n, h = k.shape[0], k.shape[1]
    at = torch.linspace(n // 2, n - 1, min(CURVE_QUERIES, n - n // 2), device=q.device).long().unique()  # (T,)
    positions = torch.arange(n, device=q.device)
    stored = positions[None, :] < at[:, None]  # (T, n): the tokens a step at ``at`` may fetch
    logits = torch.einsum("thgd,nhd->thgn", q[at].view(len(at), h, -1, q.shape[-1]), k) * module.scaling
    truth = logits.masked_fill(positions > at[:, None, None, None], -math.inf).softmax(-1).mean(2)  # (T, h, n)
    current = truth.gather(-1, at[:, None, None].expand(-1, h, 1))[..., 0]  # (T, h)
    weight, bias = partial_weights(module, columns)
    cos = sin = None
    if rope is not None:
        cos, sin = (r[0, at][:, columns][:, None] for r in rope)  # (T, 1, h, c)
    pq = partial_query(x[0, at][:, None], weight, bias, cos, sin, norm)  # (T, h, g, 1, c)
    partial = k.gather(-1, columns[None].expand(n, -1, -1)).transpose(0, 1)  # (h, n, c)
    scores = speculative_scores(pq, partial[None], module.scaling)[:, :, :, 0]  # (T, h, g, n)
    scores = scores.masked_fill(~stored[:, None, None], -math.inf)
    cap = (at * fit.max_fetch).ceil().long().clamp(min=1).tolist()
    resident = stored & ((positions < fit.keep_first) | (positions >= at[:, None] - fit.keep_recent))
    ranked = RankedByMass(*mass_ranking(scores, resident[:, None].expand(-1, h, -1)), cap)  # as select_by_mass ranks
    truth = truth.gather(-1, ranked.indices)  # (T, h, k)
    coverage, fetched = [], []
    for mass in MASS_GRID:
        fetch = ranked.take(mass)
        coverage.append(round(float(((truth * fetch).sum(-1) + current).mean()), 4))
        fetched.append(round(float((fetch.sum(-1) / at[:, None]).mean()), 4))
    return coverage, fetched


def query_norm(
    module: torch.nn.Module, prep: dict[str, Any], layer: int, columns: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, float] | None:
    """For a QK-norm layer, what ``normalize_partial`` needs at the kept ``columns`` (h, c): the
    norm's gain (h, c), the full-to-kept mean-square ratio (h, g) and its epsilon; else None."""
    norm = getattr(module, "q_norm", None)
    if norm is None:
        return None
    eps = float(getattr(norm, "eps", getattr(norm, "variance_epsilon", 1e-6)))
    ones = torch.ones(module.head_dim, dtype=norm.weight.dtype, device=columns.device)
    gain = (norm(ones) * math.sqrt(1 + eps))[columns]  # an RMS norm of ones is its gain
    square = torch.tensor(prep["query_square"][layer], device=columns.device)  # (H, d)
    square = square.view(columns.shape[0], -1, square.shape[-1])  # (h, g, d)
    kept = square.gather(2, columns[:, None, :].expand(-1, square.shape[1], -1)).mean(-1)
    return gain, (square.mean(-1) / kept.clamp(min=1e-12)).to(gain.dtype), eps


def kept_columns(prep: dict[str, Any], layer: int, rotary: bool, ratio: float, head_dim: int) -> torch.Tensor:
    """The columns each KV head keeps (h, c): its best rotary pairs (RoPE) or best columns."""
    if rotary:
        pairs = max(1, round(ratio * head_dim / 2))
        return pairs_to_columns(torch.tensor(prep["pair_ranking"][layer])[:, :pairs], head_dim)
    return torch.tensor(prep["column_ranking"][layer])[:, : max(1, round(ratio * head_dim))]


def chosen_mass(prep: dict[str, Any], layer: int, target: float) -> float:
    """The smallest speculated mass whose calibrated coverage reaches ``target`` (1: the cap)."""
    curve = prep["coverage"][layer]
    return next((m for m, c in zip(prep["mass_grid"], curve, strict=True) if c >= target), 1.0)


def calibration_table(prep: dict[str, Any], target: float, dense: int) -> str:
    """Per sparse layer: the mass chosen for ``target`` and what it covered and fetched in calibration."""
    lines = [f"{'layer':>5} {'mass':>6} {'coverage':>9} {'fetched':>8}"]
    for layer in range(dense, len(prep["coverage"])):
        if prep["coverage"][layer] is None:  # a sliding-window layer
            continue
        mass = chosen_mass(prep, layer, target)
        at = prep["mass_grid"].index(mass)
        coverage, fetched = prep["coverage"][layer][at], prep["fetched"][layer][at]
        lines.append(f"{layer:>5} {mass:>6.2f} {coverage:>9.3f} {fetched:>7.1%}")
    return "\n".join(lines)
