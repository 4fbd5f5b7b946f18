"""What the ``kvrag`` commands read from an index's manifest (``PERSIST/index.json``, written by ``kvrag ingest``):
the model, the store and the weight quantization its caches were computed with, and the note when they differ."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from kvrag.config import names_default_model
from kvrag.errors import ConfigError

if TYPE_CHECKING:
    from collections.abc import Mapping

    from kvrag.engine.engine import KVRAGEngine
    from kvrag.index import IndexManifest


def manifest(persist: str | None) -> IndexManifest:
    """The index's ``index.json`` at ``persist`` (empty when there is none or it does not parse as an object)."""
    if not persist:
        return {}
    p = Path(persist) / "index.json"
    try:
        data = json.loads(p.read_text())
    except (OSError, ValueError):
        return {}
    is_object = isinstance(data, dict)  # (its fields are checked where they are read)
    return data if is_object else {}


def store_url(args: argparse.Namespace) -> str:
    """--store, else the store recorded in PERSIST's manifest, else the file store PERSIST/kv.

    Raises:
        ConfigError: the manifest records a password-protected store (without its password: `kvrag ingest`
            never writes one to disk) and --store does not give the URL."""
    from kvrag.store.base import is_redacted

    if getattr(args, "store", None):
        return str(args.store)
    recorded = manifest(getattr(args, "persist", None)).get("store")
    if recorded and is_redacted(str(recorded)):
        msg = (f"the index {args.persist} uses the store {recorded}, recorded without its password; pass the whole "
               "URL with --store")
        raise ConfigError(msg)
    if recorded:
        return str(recorded)
    return own_store_url(args.persist)


def own_store_url(persist: str) -> str:
    """The index's own file store, ``PERSIST/kv`` (``kvrag ingest``'s default); ``PERSIST/kvcache`` in a LlamaIndex
    index written by llama-index-postprocessor-kvrag's ``build_index``."""
    d = Path(persist)
    if not (d / "kv").exists() and (d / "kvcache").is_dir():
        return "file://" + str((d / "kvcache").resolve())
    return "file://" + str((d / "kv").resolve())


def is_default_model(model: str | None) -> bool:
    """--model naming the embedded default model: omitted, 'default' (every command takes it) or its name."""
    return model == "" or names_default_model(model)


def model_arg(model: str | None) -> str | None:
    """--model as load_model takes it: None for the embedded default ('default' too, as `pull`, `store` and
    `calibrate` accept it), an existing path made absolute (it is recorded in the index manifest and must still
    name the same file when `ask` runs from another directory), else as given (a Hub id)."""
    if model is None or is_default_model(model):
        return None
    p = Path(model).expanduser()
    return str(p.resolve()) if p.exists() else model


def index_model(args: argparse.Namespace, man: Mapping[str, object]) -> str | None:
    """--model, else the model the index at --persist was built with (its manifest ``man``'s)."""
    if args.model:
        return model_arg(args.model)
    recorded = man.get("model")
    model = model_arg(str(recorded) if recorded else None)
    if model and not Path(model).is_absolute() and model.endswith(".gguf"):
        # an index written before paths were recorded absolute: relative to the directory ingest ran in
        msg = (f"the index {args.persist} was built with --model {model}, a relative path that does not exist from "
               "here; pass --model with the file's path")
        raise ConfigError(msg)
    return model


def index_quantize(args: argparse.Namespace, man: IndexManifest) -> str:
    """--quantize, else (left at 'default') the weight quantization the index was built with: its caches are keyed
    by it, so another one would compute every chunk again."""
    asked = str(getattr(args, "quantize", None) or "default")
    return str(man.get("quantize") or asked) if asked == "default" else asked


def note_other_model(persist: str, man: IndexManifest, eng: KVRAGEngine) -> None:
    """Say so when the loaded model is not the one the index's caches were computed by (they are not reused)."""
    from kvrag.kv.spec import dtype_name

    built_fp = man.get("model_fingerprint")
    if built_fp and built_fp != eng.loaded.fingerprint:
        loaded = f"{eng.loaded.name}, {dtype_name(eng.loaded.dtype)}, weights {eng.loaded.quantize or 'none'}"
        built = (f"{man.get('model', '?')}, {man.get('dtype', '?')}, weights {man.get('quantize', '?')}"
                 if man.get("dtype") else f"{man.get('model', '?')}, dtype unrecorded")
        print(f"note: the index {persist} was built with another model, dtype or weight quantization ({built}) "
              f"than the one loaded ({loaded}); its chunk caches are not reused and are computed again (match them "
              "with --model, KVRAG_DTYPE and --quantize)", file=sys.stderr)


__all__ = ["index_model", "index_quantize", "is_default_model", "manifest", "model_arg", "note_other_model",
           "own_store_url", "store_url"]
