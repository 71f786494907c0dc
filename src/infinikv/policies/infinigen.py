"""``infinigen``: InfiniGen (Lee et al., "InfiniGen: Efficient Generative Inference of Large
Language Models with Dynamic KV Cache Management", OSDI 2024). Every token's K/V stays in the
slow tier; a cheap rehearsal with a partial query weight and a partial key cache guesses which
few tokens each KV head will attend to, and only those are fetched. The paper rehearses one
layer ahead, with the previous layer's attention input, so the fetch overlaps that layer: the
default on CUDA. On a CPU both tiers share one memory and there is nothing to overlap, so each
layer rehearses with its own input (``--ahead 0``), which finds what one layer ahead misses
(RULER's needles: see the README's "Retrieval under a budget"). Nothing is ever dropped, so a
token ignored now can be fetched again later. The first ``dense_layers`` layers and the prefill
attend to everything; a layer the model bounds to a sliding window keeps its window
(``window``) and neither speculates nor fetches.

For RoPE models the partial columns are whole rotary pairs, chosen per KV head offline
(``infinikv prepare``, see ``calibration``), so the partial dot product is exact for the kept
pairs. A model with QK-norm (Gemma 3) normalizes each query head by the RMS of all its columns:
speculation estimates it from the kept ones (``normalize_partial``, calibrated per column).
"""

from __future__ import annotations

from typing import Any

import torch

from ..cache import Evictor, KVCache, KVLayer, TwoTier
from ..contract import Budget, Cost, Option, Preparing
from ..errors import InfinikvError
from ..kv.rope import rotary_inv_freq
from ..kv.slots import Slots
from ..kv.tiers import slow_tier
from ..modules import attention_modules, is_rotary, partial_weights
from ..sizes import model_shape
from .base import Policy, Reader
from .calibration import Fit, calibration_table, chosen_mass, fit_and_save, kept_columns, load, query_norm
from .pool import POOL_RULES
from .speculation import Speculation

DEFAULT_CALIBRATION = "austen:persuasion"
CALIBRATION_TOKENS = 4096
COVERAGE = 0.92
DEFAULT_FIT = Fit()  # the option defaults the calibration is measured with


RULE_OPTIONS = {  # by --select
    "top": ("keep_first", "keep_recent"),
    "mass": ("coverage", "mass", "keep_first", "keep_recent"),
    "alpha": ("alpha",),
}


class InfiniGen(Policy):
    """Speculative fetching of the few tokens each layer needs, from a slow tier holding them all.

    Needs a preparation per model (``prepare``: rank each KV head's rotary pairs on a calibration
    text, saved next to the model), run explicitly before caches are built.
    """

    name = "infinigen"
    takes_budget = False
    needs_preparation = True
    cost = Cost(
        "infinigen",
        stores=lambda fetch, dense: 1.0,
        reads=lambda fetch, dense: dense + (1 - dense) * fetch,  # dense layers fetch everything
        share=("fetch", 0.1),  # the paper: "< 10% on average"
        partial=True,
    )
    options = (
        Option(
            "select",
            str,
            "top",
            "how speculation picks tokens: top (default: the --max-fetch share each KV head weighs most), "
            "mass (the fewest reaching a calibrated mass), alpha (the paper's threshold) or oracle (the true "
            "top --max-fetch share of each layer, an upper bound for comparison)",
            lambda s: s in ("top", "mass", "alpha", "oracle"),
        ),
        Option(
            "coverage",
            float,
            COVERAGE,
            "with --select mass: the share of true attention mass each layer should cover; the mass "
            "per layer that reaches it is read off the calibration, in (0, 1)",
            lambda c: 0 < c < 1,
        ),
        Option(
            "mass",
            float,
            0.0,
            "with --select mass: one speculated mass for every layer instead, in (0, 1] (1: the cap)",
            lambda m: 0 <= m <= 1,
        ),
        Option(
            "alpha", float, 4.0, "with --select alpha: fetch tokens with logit > max - alpha, >= 0", lambda a: a >= 0
        ),
        Option(
            "keep_first",
            int,
            DEFAULT_FIT.keep_first,
            "with --select top or mass: first tokens always fetched (attention sinks), >= 0",
            lambda n: n >= 0,
        ),
        Option(
            "keep_recent",
            int,
            DEFAULT_FIT.keep_recent,
            "with --select top or mass: newest tokens always fetched, >= 0",
            lambda n: n >= 0,
        ),
        Option(
            "partial_ratio",
            float,
            DEFAULT_FIT.partial_ratio,
            "share of each head's dims in the partial weights, in (0, 1]",
            lambda r: 0 < r <= 1,
        ),
        Option(
            "max_fetch",
            float,
            DEFAULT_FIT.max_fetch,
            "with --select top or oracle: the share of tokens seen each KV head fetches; else the cap on it, in (0, 1]",
            lambda r: 0 < r <= 1,
        ),
        Option(
            "dense_layers",
            int,
            0,
            "first layers that always use their full cache, >= 0 (at 0, layer 0 speculates from its own input)",
            lambda n: n >= 0,
        ),
        Option(
            "ahead",
            str,
            "auto",
            "1: speculate one layer ahead, from the previous layer's input (the paper: the copy overlaps "
            "that layer on a GPU); 0: at the layer itself, from its own input (nothing to overlap on a CPU, "
            "and its own query finds needles one layer ahead misses); auto: 1 on CUDA, else 0",
            lambda a: a in ("auto", "0", "1"),
        ),
        Option("no_overlap", bool, False, "fetch synchronously instead of overlapping the previous layer"),
        Option(
            "pool_capacity",
            float,
            0.0,
            "bound the slow tier: a fraction of tokens seen (<= 1) or tokens; 0 = unbounded",
            lambda c: c >= 0,
        ),
        Option(
            "eviction",
            str,
            "",
            "with --pool-capacity: counter (default), lru or fifo",
            lambda e: e in ("", *POOL_RULES),
        ),
    )

    def __init__(self, budget: float | None = None, capacity: int | None = None, **params: Any) -> None:
        super().__init__(budget, capacity, **params)
        select = self.params["select"]
        own = RULE_OPTIONS.get(select, ())
        for rule, names in RULE_OPTIONS.items():
            stray = [name for name in names if name in self.given and name not in own]
            if stray:
                raise InfinikvError(f"--{stray[0].replace('_', '-')} applies to --select {rule}, not {select}")
        if "coverage" in self.given and "mass" in self.given:
            raise InfinikvError("give --coverage (a mass per layer from the calibration) or --mass, not both")
        if self.params["eviction"] and not self.params["pool_capacity"]:
            raise InfinikvError("--eviction needs --pool-capacity (the pool is unbounded otherwise)")
        pool = self.params["pool_capacity"]
        self.pool = None if not pool else Budget(fraction=pool) if pool <= 1 else Budget(tokens=int(pool))
        self.prep: dict[str, Any] | None = None  # the calibration (``prepare``, or set by hand)
        self.prepared_for: str | None = None

    def fit(self) -> Fit:
        """The options this policy's coverage curves must have been measured with: its own when it
        reads the curves (``--select mass`` with ``--coverage``), else any (the defaults')."""
        params = self.params
        if params["select"] != "mass" or params["mass"]:
            return Fit()
        return Fit(params["partial_ratio"], params["max_fetch"], params["keep_first"], params["keep_recent"])

    def prepare(self, model: torch.nn.Module, read: Reader, how: Preparing) -> str | None:
        """Load the model's saved calibration for this policy's options (``fit``), or calibrate
        (default: ``DEFAULT_CALIBRATION``, ``CALIBRATION_TOKENS`` tokens) and save it next to the
        model; one saved by an older version or with other options is redone."""
        fit = self.fit()
        if self.prep is not None and self.prepared_for == (model.name_or_path, fit) and not how.force:
            return None
        prep, did = None if how.force else load(model, fit), None
        if prep is None:
            text = how.calibration or DEFAULT_CALIBRATION
            path = fit_and_save(model, read(text, how.tokens or CALIBRATION_TOKENS), text, fit, how.progress)
            prep, did = load(model, fit), f"infinigen: calibrated {model.name_or_path} on {text}, saved to {path}"
        self.prep, self.prepared_for = prep, (model.name_or_path, fit)
        if did and self.params["select"] == "mass" and not self.params["mass"]:
            target = self.params["coverage"]
            dense = self.params["dense_layers"]
            did += f"\nper layer, the mass for {target:.0%} coverage on the calibration text:\n"
            did += calibration_table(self.prep, target, dense)
        return did

    def prepared_on(self) -> str | None:
        return None if self.prep is None else self.prep.get("calibration")

    def rule(self, index: int) -> dict[str, float]:
        """How layer ``index`` picks its tokens (see ``Speculation``)."""
        params, rule = self.params, {"max_fetch": self.params["max_fetch"]}
        if params["select"] == "alpha":
            return rule | {"alpha": params["alpha"]}
        if params["select"] == "oracle":
            return rule | {"mass": 1.0}
        mass = 1.0 if params["select"] == "top" else params["mass"] or chosen_mass(self.prep, index, params["coverage"])
        return rule | {
            "mass": mass,
            "keep_first": params["keep_first"],
            "keep_recent": params["keep_recent"],
        }

    def describe(self) -> dict[str, Any]:
        out = super().describe()
        if self.prep is not None and self.params["select"] == "mass" and not self.params["mass"]:
            first = self.params["dense_layers"]
            curves = self.prep["coverage"]  # None for a sliding-window layer, which does not speculate
            masses = [None if curves[i] is None else self.rule(i)["mass"] for i in range(first, len(curves))]
            out["mass_per_layer"] = masses
        return out

    def make_cache(self, model: torch.nn.Module, max_length: int | None = None, static: bool = False) -> KVCache:
        self.setup(model)
        return super().make_cache(model, max_length, static)

    def setup(self, model: torch.nn.Module) -> None:
        """What building the layers for ``model`` needs: its calibration (an error without one)."""
        if self.prep is None:
            raise InfinikvError(
                "infinigen needs its calibration for this model: run `infinikv prepare --model MODEL` "
                "(or policy.prepare(model, tokenizer)) first"
            )
        self.modules = attention_modules(model)
        self.rotary = is_rotary(model)

    def layer(self, index: int, model: torch.nn.Module, static: int | None) -> KVLayer:
        if index < self.params["dense_layers"]:
            return KVLayer(Slots())
        pooled = self.pool is not None
        evictor = Evictor(POOL_RULES[self.params["eviction"] or "counter"](), self.pool) if pooled else None
        return KVLayer(Slots(home=slow_tier(model)), evictor, TwoTier(self.speculation(index, model)))

    def one_ahead(self, device: torch.device) -> bool:
        """Whether layers speculate one layer ahead on ``device`` (``--ahead``)."""
        return self.params["ahead"] == "1" or (self.params["ahead"] == "auto" and device.type == "cuda")

    def speculation(self, index: int, model: torch.nn.Module, in_order: bool = True) -> Speculation:
        """Layer ``index``'s speculation (after ``setup``); ``in_order``: see ``Speculation``."""
        _, _, head_dim = model_shape(model.config)
        module = self.modules[index]
        oracle = self.params["select"] == "oracle"  # every column of the layer's own query and keys
        ahead = not oracle and index > 0 and self.one_ahead(module.q_proj.weight.device)  # layer 0: none before
        ratio = 1.0 if oracle else self.params["partial_ratio"]
        columns = kept_columns(self.prep, index, self.rotary, ratio, head_dim).to(module.q_proj.weight.device)
        weight, bias = partial_weights(module, columns)
        frequencies = None
        if self.rotary and ahead:  # speculating from a layer with another RoPE: this layer's own angles
            own, theirs = rotary_inv_freq(model, index), rotary_inv_freq(model, index - 1)
            if own is not None and (theirs is None or not torch.equal(own, theirs)):
                frequencies = own.to(columns.device)[columns % (head_dim // 2)]
        return Speculation(
            columns,
            weight,
            bias,
            self.rotary,
            self.rule(index),
            module.scaling,
            not self.params["no_overlap"],
            self.pool is not None,
            ahead,
            frequencies,
            query_norm(module, self.prep, index, columns),
            in_order,
        )

    def worst_case_tokens(self, config: Any, prompt_tokens: int, max_new_tokens: int, chunk: int | None = None) -> int:
        total = prompt_tokens + max_new_tokens
        return total if self.pool is None else self.pool.worst_case(prompt_tokens, total, chunk=chunk)
