"""The row every speed table is read against: transformers' own cache, run through the same calls."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..forward import forward
from ..policies.base import KEEP_ALL_PREFILL_CHUNK
from ..sizes import model_device


class DynamicBaseline:
    """transformers' own ``DynamicCache`` (and stock SDPA attention) on one sequence: the
    reference row of ``bench speed``, decoded through the same two calls as a ``Batch``."""

    def __init__(self, model: torch.nn.Module, offloading: bool = False) -> None:
        from transformers import DynamicCache

        self.model, self.device = model, model_device(model)
        self.cache = DynamicCache(config=model.config, offloading=offloading)
        self.position = 0

    @torch.inference_mode()
    def prefill(self, prompts: Sequence[Sequence[int]], pad_id: int, chunk: int | None = None) -> torch.Tensor:
        (prompt,) = prompts
        ids = torch.tensor([list(prompt)], device=self.device)
        chunk = chunk or KEEP_ALL_PREFILL_CHUNK
        for start in range(0, ids.shape[1], chunk):
            logits = self._forward(ids[:, start : start + chunk])
        return logits

    @torch.inference_mode()
    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        return self._forward(tokens[:, None])

    def _forward(self, ids: torch.Tensor) -> torch.Tensor:
        q = ids.shape[1]
        positions = torch.arange(self.position, self.position + q, device=self.device)[None]
        self.position += q
        return forward(self.model, self.cache, ids, positions)
