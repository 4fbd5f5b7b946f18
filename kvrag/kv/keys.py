"""Content-addressed, position-independent chunk keys.

A key covers everything that changes a chunk's stored KV: the storage format version, the model fingerprint
(weights identity and compute dtype), the tokenizer fingerprint, the storage dtype/codec, the prefix the chunk was
conditioned on and the chunk's token ids. Two different models, tokenizers, templates (which change token ids or
the conditioning prefix) or dtypes therefore can never share an entry.
"""

from __future__ import annotations

import dataclasses
import hashlib
import re
from collections.abc import Sequence

import numpy as np

FORMAT_VERSION = 1
_KEY_RE = re.compile(r"^[0-9a-f]{64}$")


def hash_token_ids(token_ids: Sequence[int]) -> str:
    """sha256 hex digest of a token-id sequence (little-endian int64 bytes)."""
    arr = np.asarray(list(token_ids), dtype="<i8")
    return hashlib.sha256(arr.tobytes()).hexdigest()


@dataclasses.dataclass(frozen=True)
class ChunkKey:
    """Identity of one stored chunk cache."""

    model_fingerprint: str
    tokenizer_fingerprint: str
    codec: str
    prefix_id: str
    tokens_hash: str
    format_version: int = FORMAT_VERSION

    @classmethod
    def make(
        cls,
        token_ids: Sequence[int],
        *,
        model_fingerprint: str,
        tokenizer_fingerprint: str,
        codec: str,
        prefix_ids: Sequence[int] = (),
    ) -> ChunkKey:
        return cls(
            model_fingerprint=model_fingerprint,
            tokenizer_fingerprint=tokenizer_fingerprint,
            codec=codec,
            prefix_id=hash_token_ids(prefix_ids) if len(prefix_ids) else "none",
            tokens_hash=hash_token_ids(token_ids),
        )

    @property
    def digest(self) -> str:
        """64 hex chars; the storage key (safe as a file name and a Redis key)."""
        h = hashlib.sha256()
        for part in (
            f"kvrag-v{self.format_version}",
            self.model_fingerprint,
            self.tokenizer_fingerprint,
            self.codec,
            self.prefix_id,
            self.tokens_hash,
        ):
            h.update(part.encode())
            h.update(b"\x00")
        return h.hexdigest()

    def __str__(self) -> str:
        return self.digest


def is_valid_digest(key: str) -> bool:
    """True for a well-formed storage key (guards stores against path traversal through keys)."""
    return isinstance(key, str) and bool(_KEY_RE.fullmatch(key))
