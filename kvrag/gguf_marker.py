"""The marker a prepared GGUF folder holds (written last): which file it was prepared from, and how a later load
finds that folder again without hashing the file (:func:`kvrag.default_model.prepare_gguf`)."""

from __future__ import annotations

import hashlib
import json
import os
import uuid
from pathlib import Path
from typing import TypedDict

MARKER = ".kvrag-converted.json"
CONVERSION_FORMAT = 6
"""Bumped when a prepared folder's content changes (3: the probe digest, prefill attention aligned; 4: the
tokenizer's class, :mod:`kvrag.prepared_tokenizer`; 5: a ``rope_freqs.weight`` tensor's RoPE scaling in the
config, :mod:`kvrag.gguf_rope`; 6: the head size and Gemma 2 / 3 27B's query scaling from the header,
:mod:`kvrag.gguf_attention`)."""


def sha256_file(path: Path, bufsize: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(bufsize):
            h.update(block)
    return h.hexdigest()


class ConversionMarker(TypedDict, total=False):
    """A prepared folder's marker (written last): the GGUF it was prepared from and the probe's logits digest."""

    format: int
    model: str
    gguf_file: str
    gguf_path: str
    gguf_architecture: str
    gguf_quantizations: list[str]
    gguf_sha256: str
    gguf_size: int
    gguf_mtime_ns: int
    probe_text: str
    probe_logits_sha256: str


def read_marker(target: Path) -> ConversionMarker | None:
    try:
        data = json.loads((target / MARKER).read_text())
    except (OSError, ValueError):
        return None
    is_object = isinstance(data, dict)  # (its fields are checked where they are read)
    return data if is_object else None


def marker_matches(target: Path, gguf: Path, *, sha256: str | None = None, same_path: bool = False) -> bool:
    """True when ``target`` holds a finished conversion of exactly this GGUF file.

    The GGUF's sha256 is recorded in the marker; to keep warm loads fast it is only recomputed when the file's size
    or mtime differ from the recorded ones (e.g. after reinstalling the wheel). ``sha256``: the file's digest,
    already computed (compared directly). ``same_path``: a size/mtime match counts only for the file the marker
    records by path, and no digest is computed (the fast look-up of :func:`kvrag.default_model.prepare_gguf`).
    """
    marker = read_marker(target)
    if marker is None or marker.get("format") != CONVERSION_FORMAT:
        return False
    if sha256 is not None:
        return bool(marker.get("gguf_sha256") == sha256)
    st = gguf.stat()
    if marker.get("gguf_size") == st.st_size and marker.get("gguf_mtime_ns") == st.st_mtime_ns:
        return not same_path or marker.get("gguf_path") == str(gguf)
    return not same_path and bool(marker.get("gguf_sha256") == sha256_file(gguf))


def remember_location(target: Path, gguf: Path) -> None:
    """Record ``gguf``'s path, size and mtime in ``target``'s marker (atomically; best effort), so that the next
    load of the file at this path skips hashing it (a multi-GB file takes seconds to hash on every load)."""
    marker = read_marker(target)
    if marker is None:
        return
    st = gguf.stat()
    marker["gguf_path"], marker["gguf_size"], marker["gguf_mtime_ns"] = str(gguf), st.st_size, st.st_mtime_ns
    tmp = target / f"{MARKER}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        tmp.write_text(json.dumps(marker, indent=2, sort_keys=True))
        os.replace(tmp, target / MARKER)
    except OSError:  # a read-only models folder: the next load hashes the file again, nothing worse
        tmp.unlink(missing_ok=True)


__all__ = ["CONVERSION_FORMAT", "MARKER", "ConversionMarker", "marker_matches", "read_marker", "remember_location",
           "sha256_file"]
