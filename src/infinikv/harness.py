"""infinikv as an lm-evaluation-harness model: ``lm_eval --model infinikv --model_args
pretrained=smollm2-135m,policy=h2o,budget=0.2 --tasks ...``.

Every request runs through a policy's cache the way infinikv serves it: the context is
prefilled (and compressed, evicted or offloaded as the policy does), and what follows it is
decoded one token at a time against that cache, so a task measures what the policy keeps.
``loglikelihood`` teacher-forces the continuation; ``generate_until`` samples greedily (or at
the task's temperature) in left-padded batches of ``batch_size``; ``loglikelihood_rolling``
feeds the text in chunks of ``chunk`` tokens, the policy acting between chunks (P-stream's
protocol). Registered by the package (see ``_infinikv_lm_eval``); nothing is downloaded: the
model is a bundled name or a local folder, and tasks must be local.
"""

from __future__ import annotations

import json
from typing import Any

import torch
from lm_eval.api.model import TemplateLM
from tqdm import tqdm

from .contract import REFERENCE
from .core import Batch, Sampling, sample
from .engine import end_of_sequence_ids
from .models import DEFAULT_MODEL, load_model
from .policies import parse_spec
from .preparation import ensure_prepared


class InfinikvLM(TemplateLM):
    """lm-eval's ``LM`` over an infinikv policy; ``model_args`` name the model, the policy and
    its options (any option a policy declares, e.g. ``bits=4`` for ``quant``) and ``weights``
    (fp32, bf16, int8, int4). lm-eval's own
    ``--device`` and ``--batch_size`` arrive here too (``max_batch_size`` is accepted and unused:
    the batch size is fixed)."""

    def __init__(
        self,
        pretrained: str = DEFAULT_MODEL,
        policy: str = REFERENCE,
        budget: float | None = None,
        capacity: int | None = None,
        batch_size: int | str = 1,
        max_gen_toks: int = 256,
        chunk: int = 512,
        device: str | None = None,
        max_batch_size: int | None = None,
        weights: str = "fp32",
        **options: Any,
    ) -> None:
        super().__init__()
        spec: dict[str, Any] = {"policy": policy, **options}
        if budget is not None:
            spec["budget"] = budget
        if capacity is not None:
            spec["capacity"] = capacity
        self.policy = parse_spec(spec)  # a bad policy fails before the model loads
        if device is None or (device.startswith("cuda") and not torch.cuda.is_available()):
            device = "cpu"  # lm-eval asks for cuda by default; as its own hf model does, fall back
        self.model, self.tokenizer = load_model(pretrained, device=device, weights=weights)
        ensure_prepared(self.policy, self.model, self.tokenizer)
        self.batch_size = int(batch_size) if str(batch_size).isdigit() else 1  # "auto" is not supported: 1
        self.max_gen_toks, self.chunk = int(max_gen_toks), int(chunk)
        self.max_length = getattr(self.model.config, "max_position_embeddings", None) or 2048
        self.stop_ids = sorted(end_of_sequence_ids(self.model, self.tokenizer))
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.eot_token_id

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        """What an empty context (and a rolling text) starts from: the BOS token where the tokenizer
        starts every text with one (Gemma), else the end-of-text token."""
        bos = self.tokenizer.bos_token_id
        return bos if bos is not None and self.tok_encode("a")[:1] == [bos] else self.eot_token_id

    @property
    def tokenizer_name(self) -> str:
        return self.tokenizer.name_or_path.replace("/", "__")

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs: Any) -> list[int]:
        """None: as the tokenizer does by default (a BOS where the model expects one)."""
        special = True if add_special_tokens is None else add_special_tokens
        return self.tokenizer(string, add_special_tokens=special).input_ids

    @torch.inference_mode()
    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs: Any) -> list[tuple[float, bool]]:
        """Each ``(_, context ids, continuation ids)``: the continuation's log-probability after the
        context (prefilled under the policy), and whether greedy decoding would have produced it."""
        out = []
        for strings, context, continuation in tqdm(requests, desc="loglikelihood", disable=disable_tqdm):
            context, continuation = self._fit(context, len(continuation)), list(continuation)
            batch = Batch(self.model, self.policy, max_length=len(context) + len(continuation))
            logits = batch.prefill([context], self.pad_id)
            total, greedy = 0.0, True
            for i, token in enumerate(continuation):
                scores = logits[0].float().log_softmax(-1)
                total += float(scores[token])
                greedy = greedy and int(scores.argmax()) == token
                if i + 1 < len(continuation):
                    logits = batch.step(torch.tensor([token], device=batch.device))
            out.append((total, greedy))
            self._cache(("loglikelihood", strings), out[-1])
        return out

    @torch.inference_mode()
    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Each text's log-likelihood, every token predicted once, fed ``chunk`` tokens per forward
        after ``prefix_token_id`` (the policy compresses between chunks)."""
        out = []
        for request in tqdm(requests, desc="loglikelihood_rolling", disable=disable_tqdm):
            ids = torch.tensor([[self.prefix_token_id, *self.tok_encode(request.args[0], add_special_tokens=False)]])
            batch = Batch(self.model, self.policy, max_length=ids.shape[1])
            total = 0.0
            for begin in range(0, ids.shape[1] - 1, self.chunk):
                end = min(begin + self.chunk, ids.shape[1] - 1)
                logits = batch.feed(ids[:, begin:end].to(batch.device), keep_all=True)[0]
                scores = logits.float().log_softmax(-1)
                total += float(scores.gather(-1, ids[0, begin + 1 : end + 1, None].to(scores.device)).sum())
            out.append(total)
            self._cache(("loglikelihood_rolling", request.args), total)
        return out

    @torch.inference_mode()
    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Each ``(context, gen_kwargs)``: the continuation up to the first ``until`` string (or
        ``max_gen_toks`` tokens), decoded in batches of requests that share their ``gen_kwargs``."""
        results: list[str | None] = [None] * len(requests)
        groups: dict[str, list[int]] = {}
        for i, request in enumerate(requests):
            groups.setdefault(json.dumps(request.args[1], sort_keys=True, default=str), []).append(i)
        bar = tqdm(total=len(requests), desc="generate_until", disable=disable_tqdm)
        for indices in groups.values():
            kwargs = dict(requests[indices[0]].args[1])
            until = kwargs.pop("until", None) or []
            until = [until] if isinstance(until, str) else list(until)
            new_tokens = int(kwargs.pop("max_gen_toks", self.max_gen_toks))
            temperature = float(kwargs.pop("temperature", 0.0)) if kwargs.pop("do_sample", False) else 0.0
            sampling = Sampling(max_new_tokens=new_tokens, temperature=temperature, seed=0 if temperature else None)
            for first in range(0, len(indices), self.batch_size):
                rows = indices[first : first + self.batch_size]
                prompts = [self._fit(self.tok_encode(requests[i].args[0]), new_tokens) for i in rows]
                batch = Batch(self.model, self.policy, max_length=max(map(len, prompts)) + new_tokens)
                logits = batch.prefill(prompts, self.pad_id)
                for i, tokens in zip(rows, sample(batch, logits, sampling, self.stop_ids, self.pad_id), strict=True):
                    text = self.tokenizer.decode(tokens, skip_special_tokens=True)
                    cut = min((text.index(s) for s in until if s and s in text), default=len(text))
                    results[i] = text[:cut]
                    self._cache(("generate_until", requests[i].args), results[i])
                bar.update(len(rows))
        bar.close()
        return [r or "" for r in results]

    def _fit(self, context: list[int], room: int) -> list[int]:
        """The context's last tokens that leave ``room`` for what follows within the trained context."""
        keep = max(self.max_length - room, 1)
        return list(context[-keep:]) if len(context) > keep else list(context)

    def _cache(self, key: tuple, value: Any) -> None:
        if getattr(self, "cache_hook", None) is not None:
            self.cache_hook.add_partial(key[0], key[1], value)
