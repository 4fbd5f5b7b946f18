"""Bad input: every item gets a clear error (or documented behaviour). Security checks on keys and serialization.

Covered elsewhere (not repeated here):
  * unknown fusion method lists the valid ones -- tests/unit/test_engine.py::test_context_overflow_and_bad_method_raise
    (also unknown method parameters) and the LlamaIndex LLM tests;
  * repairer checkpoint trained for another model -- tests/unit/test_cacherepair.py::test_checkpoint_for_other_model_raises;
  * model without RoPE / unsupported RoPE -- tests/unit/test_models.py::test_gpt2_like_model_raises and neighbours;
  * corrupt / truncated store entries -- tests/unit/test_store.py; foreign spec in every backend -- KVStoreTests;
  * empty prompt -- tests/unit/test_planner.py::test_empty_prompt_refused;
  * Redis password never in messages -- tests/unit/test_store.py::test_redis_unreachable_names_url_without_password.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import Any

import pytest

from kvrag import adapters, cli, cli_index
from kvrag.config import EngineConfig, GenerationConfig
from kvrag.engine.engine import KVRAGEngine
from kvrag.errors import ConfigError, ContextLengthError
from kvrag.fusion import get_method
from kvrag.index import make_chunks, read_documents
from kvrag.prompting import RagTemplate, render_passage
from kvrag.store import DiskStore, MemoryStore, serde
from kvrag.store.maintenance import gc_store
from kvrag_testing.store_suite import chunk_key, make_spec, random_chunk, with_format_version
from kvrag_testing.tiny import tiny_model

ROOT = Path(__file__).resolve().parents[2]
PASSAGES = [
    render_passage("Paris is the capital of France. The city has many museums.", "Paris"),
    render_passage("Berlin is the capital of Germany. It is a large city.", "Berlin"),
]
GEN = GenerationConfig(max_new_tokens=6)


@pytest.fixture(scope="module")
def lm() -> Any:
    return tiny_model("llama")


@pytest.fixture
def eng(lm: Any) -> KVRAGEngine:
    return KVRAGEngine(lm, MemoryStore(), EngineConfig())


def ask(eng: KVRAGEngine, passages: list[str], question: str = "Capital?") -> Any:
    return eng.answer(RagTemplate().render(eng.tokenizer, passages, question), passages, "stale", GEN)


# ---- empty and whitespace-only documents and chunks ----------------------------------------------------------------
@pytest.mark.parametrize("text", ["", " ", "\n\n\t  \n"])
def test_empty_chunk_skipped_by_ensure_and_ingest(
    eng: KVRAGEngine, text: str, caplog: pytest.LogCaptureFixture
) -> None:
    assert eng.ensure([text]) == [(None, False)] and eng.identify([text]) == [None]  # never cached
    assert eng.store.stats()["entries"] == 0
    with caplog.at_level(logging.WARNING, logger="kvrag.engine"):
        keys = eng.ingest([text, PASSAGES[0], text])
    assert len(keys) == 1 and eng.store.stats()["entries"] == 1
    assert sum("whitespace-only chunk" in r.getMessage() for r in caplog.records) == 2
    assert adapters.ensure_chunks(eng, [text]) == [(None, False)]  # the framework path skips them too


def test_whitespace_chunk_registered_with_a_request_is_ignored(eng: KVRAGEngine) -> None:
    r = eng.answer(RagTemplate().render(eng.tokenizer, PASSAGES, "Capital?"), [*PASSAGES, "  ", ""], "stale", GEN)
    assert r.stats["chunks_registered"] == 2 and r.stats["chunks_found"] == 2


def test_empty_and_whitespace_documents(tmp_path: Path, eng: KVRAGEngine, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "a.md").write_text("")
    (tmp_path / "b.txt").write_text("  \n\n\t\n")
    docs = read_documents(tmp_path)
    assert [d for d, _ in docs] == ["a.md", "b.txt"]
    assert make_chunks(docs, lambda t: len(eng.tokenize(t)), 64) == []
    # the CLI says so before it loads any model
    assert cli.main(["ingest", str(tmp_path), "--persist", str(tmp_path / "idx")]) == 2
    assert "empty or whitespace-only" in capsys.readouterr().err
    (tmp_path / "c.md").write_text("Some text.\n\n   \n\nMore text.")
    chunks = make_chunks(read_documents(tmp_path), lambda t: len(eng.tokenize(t)), 64)
    assert [c.source for c in chunks] == ["c.md"] and all(c.text.strip() for c in chunks)
    with pytest.raises(ConfigError, match="does not exist"):
        read_documents(tmp_path / "missing")


def _saved_model_and_docs(tmp_path: Path) -> Path:
    """A tiny model saved as a checkpoint folder (what ``--model`` takes) and one document in ``tmp_path/docs``."""
    pytest.importorskip("faiss")
    pytest.importorskip("sentence_transformers")
    model = tmp_path / "model"
    lm = tiny_model("llama")
    lm.model.save_pretrained(model)
    lm.tokenizer.save_pretrained(model)
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text("The ferry leaves the harbour at dawn and returns at dusk.")
    return model


def test_a_store_password_is_never_written_to_the_index(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    """`kvrag ingest --store redis://:PASSWORD@...` wrote the URL, password and all, into PERSIST/index.json (a
    file indexes are copied and shared with). The index records the URL without it; a later command that would
    read it from there is told to pass --store."""
    pytest.importorskip("faiss")
    pytest.importorskip("sentence_transformers")
    from kvrag.store import factory

    opened: list[str] = []

    def secret_store(url: str, opts: dict[str, Any]) -> DiskStore:  # stands in for a password-protected Redis
        opened.append(url)
        return DiskStore(tmp_path / "kv")

    monkeypatch.setitem(factory._REGISTRY, "pwtest", secret_store)
    model = _saved_model_and_docs(tmp_path)
    url, persist = "pwtest://:s3cret@127.0.0.1:6379/0?password=s3cret", str(tmp_path / "idx")
    assert cli.main(["ingest", str(tmp_path / "docs"), "--persist", persist, "--store", url, "--model", str(model),
                     "--chunk-tokens", "32"]) == 0
    manifest = (tmp_path / "idx" / "index.json").read_text()
    assert "s3cret" not in manifest and "pwtest://:***@127.0.0.1:6379/0?password=***" in manifest
    capsys.readouterr()
    ask = ["ask", "When does the ferry leave?", "--persist", persist, "--max-new-tokens", "2", "--json"]
    assert cli.main(ask) == 2
    assert "recorded without its password; pass the whole URL with --store" in capsys.readouterr().err
    assert cli.main([*ask, "--store", url]) == 0 and opened[-1] == url
    assert '"hit_rate": 1.0' in capsys.readouterr().out


def test_ask_loads_the_quantization_the_index_was_built_with(tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    """An index ingested with --quantize int8 was asked with the default quantization: another model fingerprint,
    so every cache was computed again (hit rate 0). The manifest records the dtype and quantization; ask and
    serve load the index's quantization unless --quantize says otherwise, and say so when the model differs."""
    pytest.importorskip("faiss")
    pytest.importorskip("sentence_transformers")
    model = _saved_model_and_docs(tmp_path)
    persist = str(tmp_path / "idx")
    assert cli.main(["ingest", str(tmp_path / "docs"), "--persist", persist, "--model", str(model),
                     "--chunk-tokens", "32", "--quantize", "int8"]) == 0
    man = json.loads((tmp_path / "idx" / "index.json").read_text())
    assert man["quantize"] == "int8" and man["dtype"] in ("float32", "bfloat16")
    capsys.readouterr()
    ask = ["ask", "When does the ferry leave?", "--persist", persist, "--max-new-tokens", "2", "--json"]
    assert cli.main(ask) == 0
    out = capsys.readouterr()
    assert '"hit_rate": 1.0' in out.out and "note:" not in out.err
    assert cli.main([*ask, "--quantize", "none"]) == 0  # asked for: loaded, and the note says why nothing is reused
    out = capsys.readouterr()
    assert '"hit_rate": 0.0' in out.out and "weights int8" in out.err and "weights none" in out.err
    assert out.err.count(str(model)) == 2  # both sides name their model


def test_cli_errors_name_the_option_to_change(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Window errors named no option (`ask`: "fewer or shorter chunks or turns"; `ingest --chunk-tokens` too big:
    "split it into smaller chunks"), an empty question was answered, and a second ingest replaced an index without
    a word."""
    model = _saved_model_and_docs(tmp_path)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 512}))
    (tmp_path / "docs" / "b.md").write_text(" ".join(f"word{i}" for i in range(600)))  # past that window
    persist = str(tmp_path / "idx")
    ingest = ["ingest", str(tmp_path / "docs"), "--persist", persist, "--model", str(model)]
    assert cli.main([*ingest, "--chunk-tokens", "100000"]) == 2
    assert "kvrag ingest --chunk-tokens " in capsys.readouterr().err
    assert cli.main([*ingest, "--chunk-tokens", "120"]) == 0
    assert "note: replacing" not in capsys.readouterr().err
    ask = ["ask", "When does the ferry leave?", "--persist", persist, "--max-new-tokens", "2"]
    assert cli.main([*ask, "--top-k", "8"]) == 2  # 8 chunks of ~120 tokens: past the window
    assert "--top-k 4" in capsys.readouterr().err
    assert cli.main(["ask", "  ", "--persist", persist]) == 2
    assert "the question is empty" in capsys.readouterr().err
    assert cli.main([*ingest, "--chunk-tokens", "64"]) == 0
    assert f"note: replacing the index at {persist}" in capsys.readouterr().err


def test_ingest_with_a_model_that_does_not_load_leaves_no_store_folder(tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """The store is opened before the model loads (a bad store URL fails first); a model that then fails to load
    left an empty PERSIST/kv behind, which looked like an ingested index's store."""
    pytest.importorskip("faiss")
    pytest.importorskip("sentence_transformers")
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text("Some text to ingest.")
    missing = str(tmp_path / "missing.gguf")
    assert cli.main(["ingest", str(tmp_path / "docs"), "--persist", str(tmp_path / "idx"), "--model", missing]) == 2
    assert "no GGUF file" in capsys.readouterr().err
    assert not (tmp_path / "idx").exists()
    (tmp_path / "kept").mkdir()  # a folder that was there stays, with whatever it holds
    (tmp_path / "kept" / "notes.txt").write_text("mine")
    assert cli.main(["ingest", str(tmp_path / "docs"), "--persist", str(tmp_path / "kept"), "--model", missing]) == 2
    assert sorted(p.name for p in (tmp_path / "kept").iterdir()) == ["notes.txt"]


# ---- lengths ---------------------------------------------------------------------------------------------------------
def test_chunk_longer_than_the_context_window(lm: Any) -> None:
    eng = KVRAGEngine(lm, MemoryStore(), EngineConfig(max_context=32, chunk_prefix="none"))
    long = "The quick brown fox jumps over the lazy dog. " * 10
    n = len(eng.tokenize(long))
    for call in (lambda: eng.ingest(["short", long]), lambda: eng.ensure([long]),
                 lambda: adapters.ensure_chunks(eng, [long])):
        with pytest.raises(ContextLengthError) as ei:
            call()
        msg = str(ei.value)
        assert f"{n} tokens" in msg and "context window is 32" in msg and "smaller chunks" in msg


def test_prompt_longer_than_the_context_window_names_the_lengths(lm: Any) -> None:
    eng = KVRAGEngine(lm, MemoryStore(), EngineConfig(max_context=40))
    prompt = RagTemplate().render(eng.tokenizer, PASSAGES, "Capital?")
    plan = eng.plan(prompt, PASSAGES)
    with pytest.raises(ContextLengthError) as ei:
        eng.prepare(plan, "stale")
    msg = str(ei.value)
    assert (f"{plan.total_len} tokens" in msg and f"{plan.context_len} context" in msg
            and "context window is 40" in msg and "fewer or shorter chunks" in msg)


# ---- text encoding ---------------------------------------------------------------------------------------------------
def test_non_utf8_document_bytes_are_replaced_with_a_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / "latin1.txt").write_bytes("Caf\xe9 au lait, 3\xa0\u20ac".encode("latin-1", errors="replace"))
    (tmp_path / "ctrl.md").write_bytes(b"bell\x07 nul\x00 esc\x1b[31m red\r\nline")
    with caplog.at_level(logging.WARNING, logger="kvrag.index"):
        docs = dict(read_documents(tmp_path))
    assert "\ufffd" in docs["latin1.txt"] and any("not valid UTF-8" in r.getMessage() for r in caplog.records)
    assert docs["ctrl.md"] == "bell nul esc[31m red\r\nline"  # control characters are dropped, newlines kept


def test_control_characters_in_chunks_are_ordinary_text(eng: KVRAGEngine) -> None:
    weird = [render_passage("Tab\there, bell\x07, nul\x00, esc\x1b[0m, form\x0cfeed.", "Ctrl"), PASSAGES[0]]
    first, second = ask(eng, weird), ask(eng, weird)
    assert second.stats["chunk_hits"] == 2 and second.stats["chunks_found"] == 2 and first.text == second.text


def test_invalid_unicode_and_non_str_text_raise_config_error(eng: KVRAGEngine) -> None:
    bad = "abc" + "\udcff" + "def"  # what bytes.decode(errors="surrogateescape") makes of an invalid byte
    with pytest.raises(ConfigError, match=r"index 3, a lone surrogate"):
        eng.ingest([bad])
    with pytest.raises(ConfigError, match="not valid Unicode"):
        ask(eng, [render_passage(bad)])
    with pytest.raises(ConfigError, match="got bytes; decode"):
        eng.tokenize(b"bytes are not text")  # type: ignore[arg-type]


# ---- methods and parameters ------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("spec", "match"),
    [
        ("relaxkv:r=1.5", r"r must be in \(0, 1\].*got 1.5"),
        ("relaxkv:r=0", r"r must be in \(0, 1\]"),
        ("cacheblend:r=-0.1", r"r must be in \(0, 1\]"),
        ("relaxkv:agg=median", r"agg must be one of \['mean', 'max'\], got 'median'"),
        ("epic:k=-1", "k .* must be >= 0"),
        ("relaxkv:r=lots", "not a valid float"),
        ("relaxkv:r", "expected name:key=value"),
    ],
)
def test_method_parameter_out_of_range_lists_valid_values(spec: str, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        get_method(spec)


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: EngineConfig(on_store_error="ignore"), r"on_store_error must be one of \['recompute', 'raise'\]"),
        (lambda: EngineConfig(chunk_prefix="system"), "chunk_prefix must be one of"),
        (lambda: EngineConfig(store_dtype="int4"), "store_dtype must be float32, float16, bfloat16 or None"),
        (lambda: EngineConfig(max_context=1), "max_context must be >= 2"),
        (lambda: GenerationConfig(max_new_tokens=0), "max_new_tokens must be >= 1"),
        (lambda: GenerationConfig(top_p=1.5), r"top_p must be in \(0, 1\]"),
        (lambda: GenerationConfig(temperature=0), "use do_sample=False for greedy"),
        (lambda: GenerationConfig(max_new_tokens=1.5), "max_new_tokens must be a whole number of tokens, got 1.5"),
        (lambda: GenerationConfig(max_new_tokens=True), "max_new_tokens must be a whole number of tokens, got True"),
        (lambda: GenerationConfig(stop=["ok", 3]), r"stop must be a string or a list of strings"),
        (lambda: GenerationConfig(stop=5), r"stop must be a string or a list of strings, got 5"),  # was a TypeError
        (lambda: GenerationConfig(do_sample="no"), "do_sample must be True or False, got 'no'"),  # sampled
        (lambda: GenerationConfig(do_sample=True, seed="abc"), "seed must be a whole number or None"),
        (lambda: GenerationConfig(do_sample=True, top_k=1.5), "top_k must be a whole number, got 1.5"),
        (lambda: GenerationConfig(do_sample=True, temperature=float("nan")), "temperature must be a finite number"),
        (lambda: GenerationConfig(do_sample=True, top_p="0.5"), "top_p must be a finite number, got '0.5'"),
        (lambda: EngineConfig(speculative_tokens=True), "speculative_tokens must be an integer >= 0"),
        (lambda: GenerationConfig(do_sample=2), "do_sample must be True or False, got 2"),
        (lambda: adapters.generation_config(max_new_tokens=True), "max_new_tokens must be a number, got True"),
        (lambda: adapters.generation_config(max_new_tokens=4, temperature=float("nan")), "temperature must be >= 0"),
        (lambda: adapters.generation_config(max_new_tokens=4, temperature="warm"), "temperature must be a number"),
        (lambda: adapters.generation_config(max_new_tokens=4, top_k=2.5), "top_k must be a whole number, got 2.5"),
    ],
)
def test_config_out_of_range_says_what_is_valid(make: Any, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        make()


def test_engine_with_unknown_default_method_lists_valid(lm: Any) -> None:
    with pytest.raises(ConfigError, match="valid methods: .*stale"):
        KVRAGEngine(lm, MemoryStore(), EngineConfig(method="fastest"))


def test_engine_given_a_store_url_instead_of_a_store_names_how_to_open_it(lm: Any, tmp_path: Path) -> None:
    for store in (str(tmp_path / "kv"), "memory://", tmp_path):
        with pytest.raises(ConfigError, match=r"expected a KVStore, got .*KVRAGEngine\.from_pretrained"):
            KVRAGEngine(lm, store, EngineConfig())  # type: ignore[arg-type]  # the mistake under test
    eng = KVRAGEngine.from_pretrained(lm, store=str(tmp_path / "kv"))  # what the message names
    assert ask(eng, PASSAGES).stats["chunk_misses"] == 2


def test_a_chat_template_changed_after_the_engine_was_built_is_refused(tmp_path: Path) -> None:
    lm = tiny_model("llama")
    store = DiskStore(tmp_path)
    old = KVRAGEngine(lm, store, EngineConfig())
    assert old.chunk_prefix_ids  # chunks are computed after the template's header
    ask(old, PASSAGES)
    lm.tokenizer.chat_template = lm.tokenizer.chat_template.replace("<|im_start|>", "<|im_start|> ")
    with pytest.raises(ConfigError, match="chat template changed after this engine was built"):
        ask(old, PASSAGES)  # its caches follow the old header: spliced after the new one they would be wrong
    new = KVRAGEngine(lm, store, EngineConfig())  # built after the change: its own prefix, its own keys
    assert new.chunk_prefix_ids != old.chunk_prefix_ids
    assert ask(new, PASSAGES).stats["chunk_hits"] == 0


def test_a_lossy_codec_s_entries_are_keyed_apart_from_exact_ones(lm: Any, tmp_path: Path) -> None:
    from kvrag.kv.keys import ChunkKey
    from kvrag.store import TieredStore

    rounded = KVRAGEngine(lm, DiskStore(tmp_path, codec="int8"), EngineConfig())
    rounded.ingest(PASSAGES)
    exact = KVRAGEngine(lm, DiskStore(tmp_path), EngineConfig())  # the same directory, native entries
    r = ask(exact, PASSAGES)
    assert r.stats["chunk_hits"] == 0 and r.stats["chunk_misses"] == 2  # never served int8-rounded caches
    assert ask(rounded, PASSAGES).stats["chunk_hits"] == 2 and ask(exact, PASSAGES).stats["chunk_hits"] == 2
    ids = exact.tokenize(PASSAGES[0])  # native keys are what they were: stores written before stay valid
    assert exact.chunk_key(ids) == ChunkKey.make(ids, model_fingerprint=lm.fingerprint, codec=exact.spec.dtype,
                                                 tokenizer_fingerprint=lm.tokenizer_fingerprint,
                                                 prefix_ids=exact.chunk_prefix_ids).digest
    tiered = KVRAGEngine(lm, TieredStore(MemoryStore(), DiskStore(tmp_path / "t", codec="int8")), EngineConfig())
    assert tiered.key_codec == rounded.key_codec == f"{exact.spec.dtype}+int8" and exact.key_codec == exact.spec.dtype
    assert ask(tiered, PASSAGES).stats["chunk_misses"] == 2 and ask(tiered, PASSAGES).stats["chunk_hits"] == 2
    # an int8 entry under an exact key (written when keys did not name the codec, or copied there) is not served
    key = exact.chunk_key(ids)
    exact.store.put_bytes(key, serde.encode(exact.store.get(key), "int8"))  # type: ignore[arg-type]
    r = ask(exact, PASSAGES)
    assert r.stats["chunk_misses"] == 1 and exact.counters["entries_mismatched"] == 1
    assert exact.store.get(key).codec == exact.spec.dtype  # type: ignore[union-attr]  # written over, exact again


# ---- a store written by another model or format version ----------------------------------------------------------------
def test_store_from_another_model_is_never_served_and_gc_removes_it(tmp_path: Path, lm: Any) -> None:
    store = DiskStore(tmp_path)
    a = KVRAGEngine(lm, store, EngineConfig())
    a_keys = a.ingest(PASSAGES)
    b = KVRAGEngine(tiny_model("llama", seed=1), store, EngineConfig())  # same architecture, other weights
    assert b.spec.model_fingerprint != a.spec.model_fingerprint
    r = ask(b, PASSAGES)
    assert r.stats["chunk_hits"] == 0 and r.stats["chunk_misses"] == 2  # content-addressed keys never collide
    assert ask(b, PASSAGES).stats["chunk_hits"] == 2
    g = gc_store(store, [b.spec.model_fingerprint])
    assert g.removed["other_model"] == len(a_keys) and not any(store.contains(k) for k in a_keys)
    assert ask(b, PASSAGES).stats["chunk_hits"] == 2


def test_an_entry_under_another_chunk_s_key_is_not_served_and_is_written_over(
        tmp_path: Path, eng: KVRAGEngine, caplog: pytest.LogCaptureFixture) -> None:
    store = DiskStore(tmp_path)
    e = KVRAGEngine(eng.loaded, store, EngineConfig())
    ref = ask(e, PASSAGES)
    ka, kb = (e.chunk_key(e.tokenize(p)) for p in PASSAGES)
    store.put_bytes(ka, store.get_bytes(kb) or b"")  # a valid entry, copied onto another chunk's key
    with caplog.at_level(logging.WARNING, logger="kvrag.engine"):
        r = ask(e, PASSAGES)
    assert r.text == ref.text and r.stats["chunk_misses"] == 1 and r.stats["chunk_hits"] == 1
    assert any("holds other tokens than its key names" in m.getMessage() for m in caplog.records)
    assert e.counters["entries_mismatched"] == 1
    fixed = store.get(ka)
    assert fixed is not None and fixed.token_ids.tolist() == e.tokenize(PASSAGES[0])  # computed again, written over
    assert ask(e, PASSAGES).stats["chunk_hits"] == 2


def test_entry_of_another_format_version_is_not_served(tmp_path: Path, eng: KVRAGEngine,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    store = DiskStore(tmp_path)
    e = KVRAGEngine(eng.loaded, store, EngineConfig())
    ref = ask(e, PASSAGES)
    key = e.chunk_key(e.tokenize(PASSAGES[0]))
    store.put_bytes(key, with_format_version(store.get_bytes(key) or b"", 0))
    with caplog.at_level(logging.WARNING, logger="kvrag.store"):
        r = ask(e, PASSAGES)
    assert r.text == ref.text and r.stats["chunk_misses"] == 1 and r.stats["chunk_hits"] == 1
    assert any("format_version 0" in m.getMessage() for m in caplog.records)
    assert store.stats()["foreign_skipped"] == 1
    assert ask(e, PASSAGES).stats["chunk_hits"] == 2  # recomputed and rewritten in the current format


def test_store_bound_to_a_spec_skips_entries_of_another_spec(tmp_path: Path) -> None:
    c = random_chunk(make_spec(fingerprint="other"), T=4, seed=1)
    DiskStore(tmp_path).put(chunk_key(c), c)
    bound = DiskStore(tmp_path, expected_spec=make_spec(fingerprint="mine"))
    assert bound.get(chunk_key(c)) is None and bound.contains(chunk_key(c))


# ---- security --------------------------------------------------------------------------------------------------------
TRAVERSAL = ["../" * 3 + "etc/passwd", "/etc/passwd", "..", "a" * 62 + "/.", "..%2f" + "a" * 59,
             "a" * 63 + "\x00", "ab/../../" + "c" * 55, "C:\\" + "a" * 61]


@pytest.mark.parametrize("key", TRAVERSAL, ids=repr)
def test_disk_store_rejects_path_traversal_keys(tmp_path: Path, key: str) -> None:
    root = tmp_path / "store"
    store = DiskStore(root)
    chunk = random_chunk(make_spec(), T=2, seed=1)
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    for call in (lambda: store.put(key, chunk), lambda: store.get(key), lambda: store.delete(key),
                 lambda: store.contains(key), lambda: store.put_bytes(key, serde.encode(chunk)),
                 lambda: store.get_bytes(key), lambda: store.write_bytes(key, serde.encode(chunk))):
        with pytest.raises(ConfigError, match="64-char lowercase hex"):
            call()
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before
    good = chunk_key(chunk)
    assert store.path_for(good).resolve().is_relative_to(root.resolve())


def test_disk_store_ignores_foreign_files_and_names(tmp_path: Path) -> None:
    store = DiskStore(tmp_path)
    (tmp_path / "ab").mkdir()
    (tmp_path / "ab" / "not-a-key.kv").write_bytes(b"x")
    (tmp_path / "zz").mkdir()
    (tmp_path / "zz" / ("0" * 62 + ".kv")).write_bytes(b"x")
    (tmp_path / "README").write_text("hi")
    assert list(store.iter_keys()) == []


_PICKLE = re.compile(r"^\s*(import|from)\s+(pickle|cPickle|dill|cloudpickle|joblib)\b|pickle\.loads?\(|\.load_pickle\(",
                     re.M)
_TORCH_LOAD = re.compile(r"torch\.load\(([^)]*)\)")


def test_no_pickle_anywhere() -> None:
    offenders = []
    for base in (ROOT / "kvrag", ROOT / "integrations"):
        for p in base.rglob("*.py"):
            src = p.read_text(encoding="utf-8")
            if _PICKLE.search(src):
                offenders.append(f"{p.relative_to(ROOT)}: pickle")
            for m in _TORCH_LOAD.finditer(src):
                if "weights_only=True" not in m.group(1):
                    offenders.append(f"{p.relative_to(ROOT)}: torch.load without weights_only=True")
    assert offenders == []


# ---- arguments a call would otherwise take silently in another sense ----------------------------------------------
def test_one_str_where_a_list_of_texts_is_expected_is_refused(eng: KVRAGEngine) -> None:
    """A str is a sequence of its characters: taken as chunks it made every character a chunk."""
    prompt = RagTemplate().render(eng.tokenizer, PASSAGES[:1], "Capital?")
    for call in (lambda: eng.answer(prompt, PASSAGES[0], "stale", GEN), lambda: eng.ingest(PASSAGES[0]),
                 lambda: eng.ensure(PASSAGES[0]), lambda: eng.plan(prompt, PASSAGES[0])):
        with pytest.raises(ConfigError, match=r"got one str .*wrap it in a list"):
            call()
    assert eng.store.stats()["entries"] == 0  # nothing was ingested
    with pytest.raises(ConfigError, match="prompt must be a str"):
        eng.answer(None, PASSAGES, "stale", GEN)  # type: ignore[arg-type]


def test_settings_in_the_forms_configs_and_frameworks_write_them() -> None:
    """JSON / YAML configs and frameworks write numbers as strings or floats and flags as 0 / 1 or numpy bools: the
    values that mean a setting are taken (a greedy call's seed=42.0 was refused for a moment), others refused."""
    import numpy as np

    g = adapters.generation_config(max_new_tokens="6", temperature="0", top_p=1, seed=42.0, stop="\n")
    assert (g.max_new_tokens, g.do_sample, g.top_p, g.seed, g.stop) == (6, False, 1.0, 42, ("\n",))
    g = GenerationConfig(do_sample=np.True_, seed=np.int64(3), temperature=np.float32(0.5), stop=np.array(["a"]))
    assert (g.do_sample, type(g.seed), g.seed, type(g.temperature), g.stop) == (True, int, 3, float, ("a",))
    assert GenerationConfig(do_sample=1).do_sample is True


def test_one_stop_string_is_one_stop(eng: KVRAGEngine) -> None:
    """``stop="Isle"`` is the stop string "Isle" (as in OpenAI's API and kvrag's adapters), not four one-letter stops."""
    assert GenerationConfig(stop="Isle").stop == ("Isle",)
    ps = [render_passage("The last ferry leaves Tamsin Isle at 23:40 on weekdays.")]
    prompt = RagTemplate().render(eng.tokenizer, ps, "Quote the passage.")
    whole = eng.answer(prompt, chunks=ps, method="full", max_new_tokens=12).text
    cut = eng.answer(prompt, chunks=ps, method="full", max_new_tokens=12, stop="Isle").text
    assert cut == whole.split("Isle")[0]


def test_plan_parts_refuses_one_str_for_the_chunks(eng: KVRAGEngine) -> None:
    """``plan_parts("Context:", "abc def", "Q?")`` planned every character as a chunk; ``plan`` refused it already."""
    with pytest.raises(ConfigError, match=r"chunks must be a list of texts, got one str .*wrap it in a list"):
        eng.plan_parts("Context:", "abc def", "Q?")  # type: ignore[arg-type]


def test_chunks_as_any_iterable(eng: KVRAGEngine) -> None:
    """Chunks given as a generator failed inside the planner (zip() of the consumed generator)."""
    prompt = RagTemplate().render(eng.tokenizer, PASSAGES[:2], "Capital?")
    listed = eng.answer(prompt, list(PASSAGES[:2]), "stale", GEN)
    gen = eng.answer(prompt, (p for p in PASSAGES[:2]), "stale", GEN)  # type: ignore[arg-type]
    assert gen.token_ids == listed.token_ids and gen.stats.chunks_found == 2 == listed.stats.chunks_found


def test_generation_keywords_that_would_be_ignored_are_refused(eng: KVRAGEngine) -> None:
    prompt = RagTemplate().render(eng.tokenizer, PASSAGES, "Capital?")
    with pytest.raises(ConfigError, match=r"temperature takes effect only when sampling: pass do_sample=True"):
        eng.answer(prompt, PASSAGES, "stale", temperature=0.8, max_new_tokens=4)
    with pytest.raises(ConfigError, match=r"top_k, top_p take effect only when sampling"):
        eng.answer(prompt, PASSAGES, "stale", top_p=0.5, top_k=3, max_new_tokens=4)
    greedy = eng.answer(prompt, PASSAGES, "stale", max_new_tokens=4).token_ids  # temperature 0 is how configs say it
    assert eng.answer(prompt, PASSAGES, "stale", temperature=0, do_sample=False, max_new_tokens=4).token_ids == greedy
    with pytest.raises(ConfigError, match=r"either gen= or generation keywords, not both .*'max_new_tokens'"):
        eng.answer(prompt, PASSAGES, "stale", GEN, max_new_tokens=10)
    sampled = eng.answer(prompt, PASSAGES, "stale", do_sample=True, temperature=0.8, seed=3, max_new_tokens=4)
    assert sampled.token_ids == eng.answer(prompt, PASSAGES, "stale", do_sample=True, temperature=0.8, seed=3,
                                           max_new_tokens=4).token_ids
    assert len(eng.answer(prompt, PASSAGES, "stale", max_new_tokens=3, seed=1).token_ids) <= 3  # a seed alone: greedy


def test_a_word_longer_than_a_chunk_is_cut_to_the_chunk_size(tmp_path: Path, eng: KVRAGEngine) -> None:
    """A run of text without spaces (base64, a long URL) was one chunk of any size: the ingest failed on the context
    window with advice the user could not act on (kvrag's own splitter had made the chunk)."""
    import base64
    import random

    blob = base64.b64encode(random.Random(0).randbytes(6000)).decode()
    (tmp_path / "d.md").write_text(f"Intro text.\n\n{blob}\n\nOutro text.")
    count = lambda t: len(eng.tokenize(t))  # noqa: E731
    chunks = make_chunks(read_documents(tmp_path), count, 64)
    assert len(chunks) > 10 and all(count(c.text.rstrip()) <= 64 for c in chunks)  # (+ the blank line after each)
    assert blob in "".join(c.text for c in chunks).replace("\n", "")  # every character kept, in order


def test_the_model_an_index_was_built_with(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """--model default is the embedded model everywhere; an existing model path is recorded absolute, so `ask` from
    another directory finds it; an index that recorded a relative path says what to pass."""
    import argparse

    monkeypatch.chdir(tmp_path)
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    assert cli_index.model_arg("default") is None and cli_index.model_arg(None) is None
    assert cli_index.model_arg("m.gguf") == str(tmp_path / "m.gguf") and cli_index.model_arg("org/name") == "org/name"
    args = argparse.Namespace(model=None, persist="idx")
    assert cli_index.index_model(args, {"model": str(tmp_path / "m.gguf")}) == str(tmp_path / "m.gguf")
    assert cli_index.index_model(args, {"model": "smollm2-135m-instruct"}) is None
    with pytest.raises(ConfigError, match="relative path that does not exist from here; pass --model"):
        cli_index.index_model(args, {"model": "models/elsewhere.gguf"})


def test_ask_checks_its_arguments_before_loading_a_model_and_ctrl_c_is_one_line(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("faiss")
    import kvrag.models

    def no_model(*a: Any, **k: Any) -> Any:
        raise AssertionError("the model was loaded before the arguments were checked")

    monkeypatch.setattr(kvrag.models, "load_model", no_model)
    missing = str(tmp_path / "no-index")
    assert cli.main(["ask", "q", "--persist", missing, "--method", "stael"]) == 2
    assert "valid methods" in capsys.readouterr().err
    for flag in ("--top-k", "--max-new-tokens"):
        assert cli.main(["ask", "q", "--persist", missing, flag, "0"]) == 2
        assert f"{flag} must be >= 1, got 0" in capsys.readouterr().err

    def interrupted(args: Any) -> int:
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "cmd_ask", interrupted)  # Ctrl-C anywhere in a command, e.g. inside a kernel
    assert cli.main(["ask", "q", "--persist", missing]) == 130
    assert capsys.readouterr().err.strip() == "interrupted"


def test_an_engine_refuses_pickling_at_once_naming_what_to_do() -> None:
    """Frameworks try to pickle what they hold (LlamaIndex's __getstate__, multiprocessing); an engine failed only
    after pickling part of its weights, with "cannot pickle 'mmap.mmap' object"."""
    import pickle

    from kvrag_testing.tiny import tiny_engine

    with pytest.raises(TypeError, match="open one in each process"):
        pickle.dumps(tiny_engine("qwen2"))


def test_a_method_that_is_not_a_string_or_repeats_a_parameter_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"a method is named by a string .* got 123"):
        get_method(123)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"method parameter 'r' given twice in 'relaxkv:r=0.15,r=0.2'"):
        get_method("relaxkv:r=0.15,r=0.2")  # the last one used to win, silently


@pytest.mark.parametrize(
    ("line", "match"),
    [
        ('["a", "b"]', r"c\.jsonl:2 is a JSON list, not an object"),
        ('{"passages": "not a list"}', r"c\.jsonl:2: 'passages' must be a list of strings, got str"),
        ('{"titles": ["a"], "passages": ["one", "two"]}', r"'titles' must be a list with one title per passage \(2\)"),
    ],
)
def test_a_malformed_corpus_line_is_named(tmp_path: Path, line: str, match: str) -> None:
    """``kvrag train-repairer``'s corpus: a bad line is an error naming it (a list crashed with AttributeError, a
    string of passages trained on its characters, a title list of another length passed)."""
    from kvrag.repair.dataset import CorpusIndex

    corpus = tmp_path / "c.jsonl"
    corpus.write_text('{"titles": ["x", "y"], "passages": ["first passage", "second passage"]}\n' + line + "\n")
    with pytest.raises(ConfigError, match=match):
        CorpusIndex(corpus, "all")
