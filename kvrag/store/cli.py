"""``kvrag store``: stats, verify, gc and migrate on a KV store (the command line of :mod:`kvrag.store.maintenance`;
the parser and the index / model look-ups are :mod:`kvrag.cli`'s)."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

from kvrag.store import maintenance
from kvrag.store.base import redact_url
from kvrag.store.factory import local_directory, store_from_url
from kvrag.store.sizing import collection_size, human

_REASON = {maintenance.CORRUPT: "corrupt", maintenance.FORMAT_VERSION: "format version",
           maintenance.OTHER_MODEL: "other model, dtype or quantization"}
"""How a report names each reason an entry is unusable (a model's caches in another dtype are another model's)."""


def _mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB"


def run(args: argparse.Namespace, url: str, index_tokens: list[int] | None,
        keep_fingerprints: Callable[[], list[str] | None]) -> int:
    """``kvrag store ACTION`` on the store at ``url``: ``args.action`` is stats, verify, gc or migrate (with
    ``args.json``, ``args.dry_run``, ``args.to``, ``args.overwrite``); ``index_tokens``: the token counts of the
    index at ``--persist`` (stats projects its size); ``keep_fingerprints()``: the models whose entries to keep
    (verify, gc, migrate; None: every model's). Returns the exit status."""
    local = local_directory(url)
    if local is not None and not Path(local).expanduser().is_dir():
        # opening a file store creates its folder: a mistyped path would report an empty store (and leave a folder)
        print(f"error: no KV store at {local} (no such directory); check --store / --persist", file=sys.stderr)
        return 2
    store = store_from_url(url)
    progress = not args.json
    if args.action == "stats":
        size = collection_size(store, index_tokens)
        if args.json:
            print(json.dumps({**store.stats(), "size": size}, default=str))
            return 0
        print(json.dumps(store.stats(), indent=2, default=str))
        bpt = size.get("bytes_per_token")
        print(f"size: {size['entries']} entries, {human(size['bytes'])}"
              + (f" ({human(size['bytes_per_entry'])} per entry)" if size["bytes_per_entry"] else "")
              + (f"; codec {size['codec']}, {bpt:.0f} bytes per token" if bpt else ""))
        if index_tokens:
            print(f"index: {size['chunks']} chunks, {size['tokens']} tokens"
                  + (f"; 100K such chunks would take {human(size['projected_100k_chunks_bytes'])} in this store"
                     if size.get("projected_100k_chunks_bytes") else ""))
        return 0
    keep = keep_fingerprints()
    if args.action == "verify":
        # reads every entry; decoding checks magic, header, checksums and shapes. Nothing is modified.
        v = maintenance.verify_store(store, keep, progress=progress)
        if args.json:
            print(json.dumps(v.to_dict()))
        else:
            for reason, keys in v.bad.items():
                for k in keys:
                    print(f"BAD {k} ({_REASON.get(reason, reason)})")
            bad = v.scanned - v.ok
            print(f"{v.ok}/{v.scanned} entries ok" + (f"; {bad} unusable (remove them with `kvrag store gc`)" if bad else ""))
        return 0 if v.clean else 1
    if args.action == "gc":
        g = maintenance.gc_store(store, keep, dry_run=args.dry_run, progress=progress)
        if args.json:
            print(json.dumps(g.to_dict()))
            return 0
        verb = "would remove" if g.dry_run else "removed"
        why = ", ".join(f"{n} {_REASON.get(r, r)}" for r, n in g.removed.items())
        print(f"gc{' (dry run)' if g.dry_run else ''}: scanned {g.scanned} entries, kept {g.kept}, {verb} "
              f"{g.total_removed} ({why}), {_mb(g.bytes_freed)}" +
              (f"; removed {g.temp_files_removed} abandoned temp files" if g.temp_files_removed else ""))
        if keep is None:
            print("note: entries of every model were kept (a shared store holds other indexes', models' and dtypes' "
                  "caches); pass --model or --keep-fingerprint to also remove entries of other models",
                  file=sys.stderr)
        return 0
    # migrate
    dst = store_from_url(args.to)
    if store.keyed_codecs() != dst.keyed_codecs():  # entries keep their keys; engines key by codec
        print(f"note: {redact_url(url)} and {redact_url(args.to)} use different codecs "
              f"({'/'.join(sorted(store.codecs()))} and {'/'.join(sorted(dst.codecs()))}): chunk keys name the codec, "
              "so engines on the destination URL will not find the copied entries; give the destination the "
              "source's ?codec= option", file=sys.stderr)
    m = maintenance.migrate_store(store, dst, keep_fingerprints=keep, overwrite=args.overwrite,
                                  dry_run=args.dry_run, progress=progress)
    if args.json:
        print(json.dumps(m.to_dict()))
    else:
        skipped = ", ".join(f"{n} {_REASON.get(r, r)}" for r, n in m.skipped.items())
        print(f"migrate{' (dry run)' if m.dry_run else ''} {redact_url(url)} -> {redact_url(args.to)}: scanned "
              f"{m.scanned}, {'would copy' if m.dry_run else 'copied and verified'} {m.copied} "
              f"({_mb(m.bytes_copied)}), already there {m.skipped_existing}, not copied: {skipped}")
        for k in m.failed_keys:
            print(f"FAILED {k} (the copy did not read back intact and was removed)")
    dst.close()
    return 0 if m.ok else 1


__all__ = ["run"]
