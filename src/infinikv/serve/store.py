"""Idle conversations on disk (``serve --store DIR``): a conversation that leaves RAM is written,
and the next turn restores its cache instead of prefilling the whole history again, also after
a restart.

An entry is the cache as it is (slots, positions, the policy's own state), whatever the policy:
the object graph is pickled with its tensors set aside into one safetensors file (the model's
parameters by name, every other storage once; with ``kv="int8"`` the K/V slots quantized per
head vector, a quarter of their fp32 bytes). An SQLite index (stdlib) holds each entry's
conversation key, tokens, size, last use and checksum. Writes are atomic (a temporary file, then
a rename, then the index row); an entry that is missing, truncated, corrupt or made by another
model is a warning and a fresh prefill, never a failed request. ``max_bytes`` bounds the disk,
least recently used out first. Loading unpickles only classes of infinikv, torch, transformers
and a few builtins: the store is the server's own directory, not a place for foreign files.
"""

from __future__ import annotations

import base64
import hashlib
import io
import json
import logging
import os
import pickle
import sqlite3
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors

from ..cache.cache import KVCache
from ..core import Batch
from ..policies import Policy
from .conversations import Conversation, Entry

log = logging.getLogger("infinikv.serve")

KV_FORMATS = ("int8", "fp32")
SAFE_MODULES = ("infinikv.", "torch", "transformers.", "collections", "copyreg", "_codecs", "functools")
SAFE_BUILTINS = {"set", "frozenset", "slice", "range", "complex", "bytearray", "object", "getattr"}


def fingerprint(model: torch.nn.Module) -> str:
    """What a stored cache needs of the model that reads it again: its config and every weight's
    name, shape and dtype (another model, or the same one stored in another format, differs)."""
    parts = [model.config.to_json_string(use_diff=False)]
    parts += [f"{name}:{tuple(t.shape)}:{t.dtype}" for name, t in model.state_dict(keep_vars=True).items()]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` (..., d) as int8 (..., d) and an fp16 scale (..., 1) per vector of its last dimension."""
    scale = (x.abs().amax(dim=-1, keepdim=True).float() / 127).clamp(min=1e-12).half()
    return torch.round(x.float() / scale.float()).clamp(-127, 127).to(torch.int8), scale


def shared_objects(model: torch.nn.Module) -> dict[str, Any]:
    """The objects a cache refers to but does not own: the model and its parameters and buffers."""
    named = {f"parameter:{n}": p for n, p in model.named_parameters()}
    return {"model": model, **named, **{f"buffer:{n}": b for n, b in model.named_buffers()}}


class Packer(pickle.Pickler):
    """Pickles an object graph with its tensors set aside in ``tensors`` (a flat dict of
    contiguous tensors, what safetensors stores): objects in ``shared`` by name, tensors in
    ``quantized`` (K/V ``(b, h, S, d)`` with the slots in use, ``n``) as int8 with scales, the
    unused slots left out, every other tensor as a view of its storage, which is saved once (so
    views of one storage still share it when loaded)."""

    def __init__(self, file: io.BytesIO, shared: dict[str, Any], quantized: list[tuple[torch.Tensor, int]]) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.shared = {id(obj): name for name, obj in shared.items()}
        self.quantized = {id(t): n for t, n in quantized}
        self.tensors: dict[str, torch.Tensor] = {}
        self.storages: dict[tuple[int, int], str] = {}

    def persistent_id(self, obj: Any) -> tuple | None:
        if id(obj) in self.shared:
            return ("shared", self.shared[id(obj)])
        if not isinstance(obj, torch.Tensor):
            return None
        device = str(obj.device)
        if id(obj) in self.quantized:
            name = f"kv{len(self.tensors)}"
            used = obj[:, :, : self.quantized[id(obj)]].cpu()
            self.tensors[name], self.tensors[f"{name}.scale"] = quantize(used)
            return ("int8", name, str(obj.dtype).removeprefix("torch."), tuple(obj.shape), device)
        storage = obj.untyped_storage()
        where = (storage.data_ptr(), storage.nbytes())
        name = self.storages.get(where)
        if name is None:
            name = self.storages[where] = f"storage{len(self.storages)}"
            whole = torch.empty(0, dtype=torch.uint8, device=obj.device).set_(storage)
            self.tensors[name] = whole.cpu().clone()
        dtype = str(obj.dtype).removeprefix("torch.")
        return ("view", name, dtype, tuple(obj.shape), obj.stride(), obj.storage_offset(), device)


class Unpacker(pickle.Unpickler):
    """The reverse of ``Packer``, refusing any class outside ``SAFE_MODULES``."""

    def __init__(self, file: io.BytesIO, shared: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
        super().__init__(file)
        self.shared, self.tensors = shared, tensors
        self.storages: dict[tuple[str, str], torch.UntypedStorage] = {}

    def find_class(self, module: str, name: str) -> Any:
        if module.startswith(SAFE_MODULES) or (module == "builtins" and name in SAFE_BUILTINS):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"refusing {module}.{name}")

    def persistent_load(self, pid: tuple) -> Any:
        kind, name, *rest = pid
        if kind == "shared":
            return self.shared[name]
        if kind == "int8":
            dtype, shape, device = getattr(torch, rest[0]), rest[1], rest[2]
            values = self.tensors[name].float() * self.tensors[f"{name}.scale"].float()
            whole = torch.zeros(shape, dtype=dtype, device=device)
            whole[:, :, : values.shape[2]] = values.to(dtype)
            return whole
        dtype, shape, stride, offset, device = getattr(torch, rest[0]), *rest[1:]
        storage = self.storages.get((name, device))
        if storage is None:
            storage = self.storages[(name, device)] = self.tensors[name].to(device).untyped_storage()
        return torch.empty(0, dtype=dtype, device=device).set_(storage, offset, shape, stride)


class ConversationStore:
    """Idle conversations in ``directory``, at most ``max_bytes`` of it, with what it did."""

    def __init__(self, directory: Path, max_bytes: int, kv: str, model: torch.nn.Module) -> None:
        self.directory, self.max_bytes, self.kv = Path(directory), max_bytes, kv
        self.model, self.shared, self.fingerprint = model, shared_objects(model), fingerprint(model)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.lock = threading.Lock()
        self.db = sqlite3.connect(self.directory / "index.sqlite", check_same_thread=False, isolation_level=None)
        self.db.execute(
            "CREATE TABLE IF NOT EXISTS entries (id TEXT PRIMARY KEY, model TEXT, key TEXT, n INTEGER, "
            "tokens TEXT, bytes INTEGER, used REAL, checksum TEXT)"
        )
        self.inherited = {row[0] for row in self.db.execute("SELECT id FROM entries")}  # from before this process
        self.writes = self.restores = self.failures = self.evicted = self.resumed = 0
        self.bytes_written = self.bytes_restored = 0

    # -- what /metrics shows -----------------------------------------------------------------
    def size(self) -> tuple[int, int]:
        """Entries and bytes on disk now."""
        with self.lock:
            n, total = self.db.execute("SELECT COUNT(*), COALESCE(SUM(bytes), 0) FROM entries").fetchone()
        return n, total

    # -- writing -----------------------------------------------------------------------------
    def put(self, conversation: Conversation) -> None:
        """Write ``conversation`` (a warning, not an error, if its cache cannot be stored)."""
        batch = conversation.batch
        try:
            with torch.inference_mode():
                data = self.pack(batch)
        except (pickle.PicklingError, TypeError, AttributeError, RuntimeError) as exc:
            log.warning("infinikv: conversation not stored (%s: %s)", type(exc).__name__, exc)
            self.failures += 1
            return
        entry = uuid.uuid4().hex
        path = self.directory / f"{entry}.safetensors"
        temporary = path.with_suffix(".tmp")
        try:
            with open(temporary, "wb") as file:
                file.write(data)
                file.flush()
                os.fsync(file.fileno())
            os.replace(temporary, path)
        except OSError as exc:  # a full or read-only disk: the conversation is dropped, as without a store
            log.warning("infinikv: conversation not stored (%s)", exc)
            temporary.unlink(missing_ok=True)
            self.failures += 1
            return
        row = (entry, self.fingerprint, conversation.key, len(conversation.tokens), json.dumps(conversation.tokens))
        with self.lock:
            self.db.execute(
                "INSERT INTO entries VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (*row, len(data), time.time(), hashlib.sha256(data).hexdigest()),
            )
        self.writes += 1
        self.bytes_written += len(data)
        self._bound()

    def pack(self, batch: Batch) -> bytes:
        """``batch``'s cache, next positions and compile flag as one safetensors file's bytes."""
        kv = batch.cache.kv_tensors() if self.kv == "int8" else []
        quantized = [(t, n) for t, n in kv if t.is_floating_point()]  # a policy's own codes stay as they are
        skeleton = io.BytesIO()
        packer = Packer(skeleton, self.shared, quantized)
        packer.dump({"cache": batch.cache, "next_position": batch.next_position, "compile": batch.compile})
        metadata = {"skeleton": base64.b64encode(skeleton.getvalue()).decode(), "kv": self.kv}
        return save_tensors(packer.tensors, metadata=metadata)

    def _bound(self) -> None:
        """Delete the least recently used entries while the store holds more than ``max_bytes``."""
        with self.lock:
            rows = self.db.execute("SELECT id, bytes FROM entries ORDER BY used DESC").fetchall()
        total = 0
        for entry, size in rows:
            total += size
            if total > self.max_bytes:
                self._delete(entry)
                self.evicted += 1

    # -- reading -----------------------------------------------------------------------------
    def match(self, key: str, prompt: list[int]) -> Entry | None:
        """The stored conversation with ``key`` whose tokens are the longest proper prefix of ``prompt``."""
        with self.lock:
            rows = self.db.execute(
                "SELECT id, n, tokens FROM entries WHERE model = ? AND key = ? AND n < ? ORDER BY n DESC",
                (self.fingerprint, key, len(prompt)),
            ).fetchall()
        for entry, n, tokens in rows:
            if prompt[:n] == json.loads(tokens):
                return Entry(entry, n)
        return None

    def restore(self, entry: Entry, policy: Policy) -> Batch | None:
        """The cache of ``entry`` as a batch of ``policy`` (the entry leaves the store: the
        conversation goes on in RAM), or None, with a warning, if it cannot be read."""
        path = self.directory / f"{entry.id}.safetensors"
        with self.lock:
            found = self.db.execute("SELECT checksum FROM entries WHERE id = ?", (entry.id,)).fetchone()
        try:
            data = path.read_bytes()
            if found is None or hashlib.sha256(data).hexdigest() != found[0]:
                raise ValueError("its checksum does not match (truncated or corrupt)")
            with torch.inference_mode():
                batch = self.unpack(data, policy)
        except (OSError, ValueError, KeyError, SafetensorError, pickle.UnpicklingError, RuntimeError) as exc:
            log.warning("infinikv: stored conversation %s not restored, prefilling it (%s)", entry.id, exc)
            self.failures += 1
            self._delete(entry.id)
            return None
        self.restores += 1
        self.resumed += entry.id in self.inherited
        self.bytes_restored += len(data)
        self._delete(entry.id)
        return batch

    def unpack(self, data: bytes, policy: Policy) -> Batch:
        header = json.loads(data[8 : 8 + int.from_bytes(data[:8], "little")])["__metadata__"]
        state = Unpacker(io.BytesIO(base64.b64decode(header["skeleton"])), self.shared, load_tensors(data)).load()
        cache: KVCache = state["cache"]
        batch = Batch(self.model, policy, state["compile"], cache=cache)
        batch.next_position = state["next_position"]
        return batch

    def _delete(self, entry: str) -> None:
        with self.lock:
            self.db.execute("DELETE FROM entries WHERE id = ?", (entry,))
        (self.directory / f"{entry}.safetensors").unlink(missing_ok=True)
