"""API keys: who a request speaks for. Each key has an owner; a conversation or cached prefix
belongs to its owner (``conversations.conversation_key``), so one user's requests never continue,
nor time, another's cache."""

from __future__ import annotations

import secrets
from pathlib import Path

from ..errors import InfinikvError


def read_keys(path: Path) -> dict[str, str]:
    """A keys file as key -> owner: one key per line, optionally followed by a name (else the
    owner is ``key N``, N the line); blank lines and ``#`` comments skipped."""
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        raise InfinikvError(f"--api-keys {path}: {exc.strerror}") from None
    keys: dict[str, str] = {}
    for number, line in enumerate(lines, 1):
        words = line.split()
        if not words or words[0].startswith("#"):
            continue
        key, name = words[0], " ".join(words[1:]) or f"key {number}"
        if key in keys or name in keys.values():
            raise InfinikvError(f"--api-keys {path}, line {number}: a key or name given twice")
        keys[key] = name
    if not keys:
        raise InfinikvError(f"--api-keys {path} holds no key")
    return keys


def key_owner(api_keys: dict[str, str], authorization: str) -> str | None:
    """Who an ``Authorization`` header speaks for: the owner of its key, or None. Every key is
    compared, in constant time, so the time taken tells nothing of which key came close."""
    owner = None
    for key, name in api_keys.items():
        if secrets.compare_digest(authorization.encode(), f"Bearer {key}".encode()):
            owner = name
    return owner
