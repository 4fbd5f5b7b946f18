"""``kvrag bench chat``: a multi-turn chat over dev passages, with the answered turns' KV reused
(:mod:`kvrag.engine.conversation`) beside the same prompts with the whole history recomputed.

A conversation of ``--turns`` dev questions (rows ``--offset`` ...) is asked one turn after another, each answer
appended to the history, the prompt rendered with the model's chat template: a system message holding the
passages, then the history, then the new question. Scenarios:

* ``fixed``: the system message holds the first row's ``--passages`` passages on every turn (the chunks do not
  change; the history sits behind the same prefix).
* ``changing``: turn ``k``'s system message holds row ``offset + k``'s passages (what a chat engine that retrieves
  again every turn sends; the history no longer sits behind the same prefix): the reusing engine moves the kept
  history behind the new passages (:mod:`kvrag.engine.relocate`); with ``--kl``, each turn's next-token KL against
  ``full`` of the method with the history prefilled and with it moved.
* ``changing-history``: as ``changing``, the reusing engine also given the earlier user / assistant messages as
  reusable segments (:func:`kvrag.adapters.history_segments`: cached like chunks, placed at their new position,
  repaired by the method). With ``--kl``, each turn's next-token KL against ``full`` of the method with the
  history prefilled and with the history as segments.

Each turn's prompt is answered by two engines on one model and one chunk store, taking turns (their order
alternates per turn, so a busy machine slows them alike): ``reuse`` (kvrag's defaults: the conversation cache on)
and ``recompute`` (``conversation_cache_bytes=0``: the history prefilled again). Recorded per turn: TTFT of each,
tokens reused from the conversation, tokens prefilled, and whether both answers are the same tokens. Chunk caches
are ingested before the turns (cache-ready TTFT). ``--frameworks`` also runs the same fixed-chunk conversation
through LlamaIndex's stock ``context`` chat engine (``KVCachedLLM``) and a LangChain ``RunnableWithMessageHistory``
chain (``ChatKVCached``), reporting their TTFT per turn (``llamaindex-changing`` / ``langchain-changing``: the
``changing`` passages, LlamaIndex through its ``condense_plus_context`` engine; :mod:`kvrag_bench.chat_frameworks`), and ``serve``
(``serve-changing``: the ``changing`` passages): ``kvrag serve`` driven by the ``openai`` SDK
over HTTP, with llama.cpp's server on the same GGUF file beside it (``--peer``; :mod:`kvrag_bench.chat_serve`).

``--kv-check`` measures where decode-written K/V differs from prefill-written K/V: after a ``full`` answer, the kept
KV of (prompt + answer) against one prefill of the same ids, per part (prompt positions, answer positions).

Writes ``chat.json`` and ``chat.md`` to ``--out``.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

from kvrag_bench.report import writing_main

SYSTEM = "Answer the user's questions from these passages. Be brief."
SCENARIOS = ("fixed", "changing", "changing-history")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--data", required=True, help="QA JSONL (id, question, answers, contexts[{title, text}])")
    p.add_argument("--offset", type=int, default=0, help="the conversation's first row")
    p.add_argument("--turns", type=int, default=10, help="questions asked, one per turn")
    p.add_argument("--passages", type=int, default=10, help="passages in the system message")
    p.add_argument("--method", default=None, help="fusion method spec of every answer (default: the engine's)")
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--scenarios", default="fixed,changing,changing-history",
                   help="comma-separated: fixed, changing, changing-history")
    p.add_argument("--repeats", type=int, default=3,
                   help="timed prepares per turn and engine before the answers; the fastest is reported (0: none)")
    p.add_argument("--kl", action="store_true",
                   help="with changing chunks: next-token KL vs full with the history prefilled / as segments")
    p.add_argument("--frameworks", default="none",
                   help="comma-separated: llamaindex, langchain, llamaindex-changing, langchain-changing, serve, "
                        "serve-changing (or none)")
    p.add_argument("--peer", default="auto", choices=("auto", "llama.cpp", "none"),
                   help="with --frameworks serve: llama.cpp's server (llama-cpp-python) on the same GGUF beside "
                        "kvrag serve (auto: when it is installed and the model is a GGUF file)")
    p.add_argument("--kv-check", action="store_true", help="measure decode-written vs prefill-written K/V (full)")
    p.add_argument("--no-full-reference", dest="full_reference", action="store_false",
                   help="skip each turn's `full` answer with the history recomputed (the answer both engines' "
                        "methods aim at; compared with both)")
    p.add_argument("--out", default="runs/chat")


def _messages(system: str, history: list[dict[str, str]], question: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": system}, *history, {"role": "user", "content": question}]


def _prepare_s(eng: Any, prompt: str, chunks: list[str], method: str) -> float:
    """Seconds of one prepare (fetch, assemble or copy the kept KV, repair, prefill: the TTFT less the first
    token's choice), not streamed, so nothing is kept."""
    t = time.perf_counter()
    prep = eng.prepare(eng.plan(prompt, chunks), method, reserve=1)
    dt = time.perf_counter() - t
    del prep  # gives its KV back
    return dt


def _fastest(best: dict[str, float], order: list[tuple[str, Any, list[str]]], prompt: str, method: str,
             repeats: int) -> None:
    for _ in range(repeats):
        for name, eng, c in order:
            best[name] = min(best[name], _prepare_s(eng, prompt, c, method))


def _history_logits(logits: dict[str, Any], reuse: Any, recompute: Any, prompt: str, chunks: list[str],
                    segments: list[str], method: str, reused: str) -> None:
    """The last logits of ``full``, of ``method`` with the history prefilled (both on the recomputing engine) and of
    ``method`` with the reusing engine's history (``reused``: ``segments`` on the recomputing engine, ``moved`` on
    the reusing one, which moves the kept turn before's history) into ``logits``."""
    for name, eng, m, c in (("full", recompute, "full", chunks), ("prefilled", recompute, method, chunks),
                            (reused, recompute if reused == "segments" else reuse, method, segments)):
        prep = eng.prepare(eng.plan(prompt, c), m, reserve=1)
        logits[name] = prep.last_logits
        del prep  # gives its KV back


def converse(reuse: Any, recompute: Any, chunks_of: Callable[[int], list[str]], questions: list[str], method: str,
             gen: Any, *, history_segments: bool = False, kl: bool = False, repeats: int = 0,
             full_reference: bool = False) -> list[dict[str, Any]]:
    """One conversation; both engines answer every turn's prompt (the history is the reusing engine's answers).

    ``history_segments``: the reusing engine also gets the earlier messages as reusable segments
    (:func:`kvrag.adapters.history_segments`). ``kl``: the next-token KL against ``full`` of the method with the
    history prefilled and with it as segments (on the recomputing engine, no conversation kept). ``repeats``: before
    the answers, that many prepares of the turn's prompt per engine, taking turns; the fastest is recorded (a
    shared machine's stalls only ever add time). ``full_reference``: also the turn's ``full`` answer on the
    recomputing engine, and whether each engine's answer is the same tokens."""
    from kvrag.adapters import chunk_texts, with_history
    from kvrag.prompting import render_chat
    from kvrag_bench.metrics import kl_divergence

    history: list[dict[str, str]] = []
    rows = []
    for k, q in enumerate(questions):
        chunks = chunks_of(k)
        reuse.ingest(chunks, progress=False)
        messages = _messages(SYSTEM + "\n" + "".join(chunks), history, q)
        prompt = render_chat(reuse.tokenizer, messages)
        segments = chunk_texts(with_history(chunks, messages)) if history_segments else chunks
        order = [("reuse", reuse, segments), ("recompute", recompute, chunks)]
        best = {"reuse": float("inf"), "recompute": float("inf")}
        if not history_segments:  # before the answer, which replaces the kept turn with this one
            _fastest(best, order, prompt, method, repeats)
        reused = "segments" if history_segments else "moved"  # the reusing engine's history
        logits: dict[str, Any] = {}
        if kl and not history_segments:  # before the answer too: the reusing engine moves the turn before's kept
            _history_logits(logits, reuse, recompute, prompt, chunks, segments, method, reused)  # history
        got = {name: eng.answer(prompt, c, method, gen) for name, eng, c in (order if k % 2 == 0 else order[::-1])}
        if history_segments:  # after it: the answer's TTFT includes computing the newest turn's segments
            _fastest(best, order, prompt, method, repeats)
            if kl:
                _history_logits(logits, reuse, recompute, prompt, chunks, segments, method, reused)
        r, f = got["reuse"], got["recompute"]
        total = r.stats.context_tokens + r.stats.suffix_tokens
        row = {"turn": k + 1, "prompt_tokens": total, "reused_conversation": r.stats.conversation_tokens,
               "prefilled": total - r.stats.reused_tokens, "recompute_prefilled": total - f.stats.reused_tokens,
               "ttft_reuse_s": r.timings.ttft_s, "ttft_recompute_s": f.timings.ttft_s,
               "same_answer": r.token_ids == f.token_ids, "answer": r.text,
               "recompute_answer": f.text if r.token_ids != f.token_ids else None,
               "reuse_timings": r.timings.to_dict(), "recompute_timings": f.timings.to_dict()}
        if full_reference and method != "full":
            ref = recompute.answer(prompt, chunks, "full", gen).token_ids
            row.update(same_as_full_reuse=r.token_ids == ref, same_as_full_recompute=f.token_ids == ref)
        row["level_reuse"] = r.stats.method_stats.auto_choice
        row["level_recompute"] = f.stats.method_stats.auto_choice
        if repeats:
            row.update(prepare_min_reuse_s=best["reuse"], prepare_min_recompute_s=best["recompute"])
        if kl:
            row["kl_history_prefilled"] = float(kl_divergence(logits["full"], logits["prefilled"]))
            row[f"kl_history_{reused}"] = float(kl_divergence(logits["full"], logits[reused]))
        rows.append(row)
        history += [{"role": "user", "content": q}, {"role": "assistant", "content": r.text}]
        fastest = f"; fastest prepare {best['reuse']:.3f} s (recompute {best['recompute']:.3f} s)" if repeats else ""
        print(f"  turn {k + 1}: {total} prompt tokens, {r.stats.conversation_tokens} reused from the conversation, "
              f"{row['prefilled']} prefilled; TTFT {r.timings.ttft_s:.3f} s (recompute {f.timings.ttft_s:.3f} s)"
              f"{fastest}; same answer: {r.token_ids == f.token_ids}"
              + (f"; same as full: reuse {row['same_as_full_reuse']}, recompute {row['same_as_full_recompute']}"
                 if "same_as_full_reuse" in row else ""), flush=True)
    return rows


def compare_with_full(rows: list[dict[str, Any]], eng: Any, chunks_of: Callable[[int], list[str]],
                      questions: list[str], gen: Any) -> None:
    """Each turn of a conversation over HTTP (``kvrag_bench.chat_serve`` rows, the reusing server's answers as the
    history) against the in-process ``full`` answer to the same messages (turn ``k``'s passages ``chunks_of(k)``):
    ``same_as_full_reuse`` / ``same_as_full_recompute`` per row (the same text)."""
    from kvrag.prompting import render_chat

    history: list[dict[str, str]] = []
    for k, (row, q) in enumerate(zip(rows, questions, strict=True)):
        chunks = chunks_of(k)
        prompt = render_chat(eng.tokenizer, _messages(SYSTEM + "\n" + "".join(chunks), history, q))
        ref = eng.answer(prompt, chunks, "full", gen).text
        row["same_as_full_reuse"] = row["answer"] == ref
        row["same_as_full_recompute"] = (row["recompute_answer"] or row["answer"]) == ref
        row.setdefault("level_reuse", None)
        row.setdefault("level_recompute", None)
        history += [{"role": "user", "content": q}, {"role": "assistant", "content": row["answer"]}]


def same_as_full_counts(rows: list[dict[str, Any]]) -> dict[str, int]:
    """The summary's counts of turns whose answer was ``full``'s, per engine."""
    return {f"same_as_full_{k}": sum(r[f"same_as_full_{k}"] for r in rows) for k in ("reuse", "recompute")}


def kv_check(eng: Any, chunks: list[str], questions: list[str], gen: Any) -> dict[str, Any]:
    """Decode-written vs prefill-written K/V: a ``full`` answer's kept KV against one prefill of the same ids."""
    import torch

    from kvrag.kv import hf_cache
    from kvrag.prompting import render_chat

    out: dict[str, Any] = {}
    prompt = render_chat(eng.tokenizer, _messages(SYSTEM + "\n" + "".join(chunks), [], questions[0]))
    eng.answer(prompt, chunks, "full", gen)
    ids = tuple(eng.tokenize(prompt))
    entry = next(e for e in eng.conversations._entries.values() if e.method == repr(eng.method("full"))
                 and e.ids[: len(ids)] == ids)
    with torch.inference_mode(), hf_cache.model_lock(eng.model):
        k, v = hf_cache.prefill_kv(eng.model, torch.tensor(entry.ids))
    n = entry.prompt_len
    for part, sl in (("prompt", slice(0, n)), ("answer", slice(n, len(entry.ids)))):
        for name, kept, ref in (("keys", entry.keys, k), ("values", entry.values, v)):
            a, b = kept[:, :, sl].float(), ref[:, :, sl].float()
            d = (a - b).abs()
            out[f"{part}_{name}"] = {"positions": int(a.shape[2]), "max_abs_diff": float(d.max()),
                                     "mean_abs_diff": float(d.mean()), "max_abs": float(b.abs().max()),
                                     "bit_identical_fraction": float((a == b).float().mean()),
                                     "layer0_max_abs_diff": float(d[0].max())}
    return out


def _summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    first = rows[0]
    last = rows[-1]
    return {"turns": len(rows),
            "ttft_ratio_last_first_reuse": last["ttft_reuse_s"] / first["ttft_reuse_s"],
            "ttft_ratio_last_first_recompute": last["ttft_recompute_s"] / first["ttft_recompute_s"],
            "same_answers": sum(r["same_answer"] for r in rows),
            "same_answers_after_first": sum(r["same_answer"] for r in rows[1:]),
            "reused_tokens": sum(r["reused_conversation"] for r in rows),
            **(same_as_full_counts(rows) if "same_as_full_reuse" in first else {}),
            **({"prepare_ratio_last_first_reuse": last["prepare_min_reuse_s"] / first["prepare_min_reuse_s"],
                "prepare_ratio_last_first_recompute": last["prepare_min_recompute_s"] / first["prepare_min_recompute_s"]}
               if "prepare_min_reuse_s" in first else {}),
            **{f"mean_{k}": sum(r[k] for r in rows) / len(rows)
               for k in ("kl_history_prefilled", "kl_history_segments", "kl_history_moved") if k in first}}


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from kvrag.config import EngineConfig, GenerationConfig
    from kvrag.engine.engine import KVRAGEngine
    from kvrag.kv.quant import quantization_of
    from kvrag.models import load_model
    from kvrag.store import MemoryStore
    from kvrag_bench.data import load_requests
    from kvrag_bench.provenance import machine_info, run_git_sha

    if args.threads:
        torch.set_num_threads(args.threads)
    loaded = load_model(args.model, dtype=args.dtype, device=args.device, quantize=args.quantize)
    store = MemoryStore()
    cfg = {} if args.method is None else {"method": args.method}
    reuse = KVRAGEngine(loaded, store, EngineConfig(**cfg))
    recompute = KVRAGEngine(loaded, store, EngineConfig(**cfg, conversation_cache_bytes=0))
    method = reuse.config.method
    requests = load_requests(args.data, limit=args.turns + 1, offset=args.offset)
    if len(requests) < args.turns + 1:
        raise SystemExit(f"--turns {args.turns} needs {args.turns + 1} rows of {args.data} from --offset {args.offset}")
    questions = [r.question for r in requests[1 : args.turns + 1]]
    fixed = requests[0].passages()[: args.passages]
    gen = GenerationConfig(max_new_tokens=args.max_new_tokens)
    warm = requests[0].question  # untimed: the first request of a process pays one-time setup
    for eng in (reuse, recompute):
        converse(eng, eng, lambda k: fixed, [warm], method, gen)
    reuse.conversations.clear()
    result: dict[str, Any] = {"scenarios": {}}
    for scenario in [s.strip() for s in args.scenarios.split(",") if s.strip()]:
        if scenario not in SCENARIOS:
            raise SystemExit(f"unknown scenario {scenario!r}; choose from {', '.join(SCENARIOS)}")
        print(f"{scenario}:", flush=True)
        chunks_of = ((lambda k: fixed) if scenario == "fixed"
                     else (lambda k: requests[1 + k].passages()[: args.passages]))
        rows = converse(reuse, recompute, chunks_of, questions, method, gen,
                        history_segments=scenario == "changing-history", kl=scenario != "fixed" and args.kl,
                        repeats=args.repeats, full_reference=args.full_reference)
        result["scenarios"][scenario] = {"rows": rows, "summary": _summary(rows)}
        reuse.conversations.clear()
    for fw in [s.strip() for s in args.frameworks.split(",") if s.strip() and s.strip() != "none"]:
        from kvrag_bench.chat_frameworks import run as run_framework

        if fw in ("serve", "serve-changing"):
            from kvrag.prompting import render_chat
            from kvrag_bench import chat_serve

            if args.quantize not in (None, "default") or args.dtype is not None:
                print("  note: kvrag serve loads the model with its defaults (dtype, quantization), not --dtype / "
                      "--quantize", flush=True)
            changing = fw == "serve-changing"
            turn_chunks = ((lambda k: requests[1 + k].passages()[: args.passages]) if changing
                           else (lambda k: fixed))
            print(f"kvrag serve over HTTP (openai SDK), {'passages that change every turn' if changing else 'fixed chunks'}:",
                  flush=True)
            served = chat_serve.run(turn_chunks, questions, warm, args.max_new_tokens, method=method,
                                    model=args.model, threads=args.threads, peer=args.peer,
                                    count_tokens=lambda m: len(reuse.tokenize(render_chat(reuse.tokenizer, m))),
                                    n_ctx=8192 if changing else 4096, warm_chunks=fixed)
            if args.full_reference and method != "full":
                print("  `full` with the history recomputed, in process, for each turn's messages:", flush=True)
                compare_with_full(served["rows"], recompute, turn_chunks, questions, gen)
                served["summary"].update(same_as_full_counts(served["rows"]))
            result["scenarios"][fw] = served
            continue
        changing = fw.endswith("-changing")
        print(f"{fw} stock chat engine, {'passages that change every turn' if changing else 'fixed chunks'}:",
              flush=True)
        result["scenarios"][fw] = run_framework(
            fw, reuse, recompute,
            (lambda k: requests[1 + k].passages()[: args.passages]) if changing else (lambda k: fixed),
            questions, gen)
        reuse.conversations.clear()
    if args.kv_check:
        result["kv_check"] = kv_check(reuse, fixed, questions, gen)
    dtype = next(loaded.model.parameters()).dtype
    result.update({"model": loaded.name, "dtype": str(dtype).replace("torch.", ""), "quantize": args.quantize,
                   "quantization": quantization_of(loaded.model) or "none", "method": method,
                   "max_new_tokens": args.max_new_tokens, "turns": args.turns, "passages": args.passages,
                   "data": str(args.data), "offset": args.offset, "torch_threads": torch.get_num_threads(),
                   "machine": machine_info(loaded.device, dtype), "commit": run_git_sha(),
                   "conversation_cache": reuse.conversations.stats()})
    return result


def _num(x: float | int | None, spec: str = "") -> str:
    return "-" if x is None else format(x, spec)


def _per(x: float | None, first: float | None) -> str:
    return "-" if x is None or first is None or first <= 0 else f"{x / first:.2f}"


def _ratio_text(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}x"


def _scenario_lines(name: str, sc: dict[str, Any]) -> list[str]:
    rows, s = sc["rows"], sc["summary"]
    fast = "prepare_min_reuse_s" in rows[0]
    usage = "cached_tokens" in rows[0]  # over HTTP: the usage's cached tokens
    peer = "llamacpp_ttft_s" in rows[0]
    ref = "same_as_full_reuse" in rows[0]
    head = ("| turn | prompt tokens | reused from the conversation |" + (" cached (usage) |" if usage else "")
            + " prefilled | TTFT reuse (s) | TTFT / turn 1 | TTFT recompute (s) | TTFT / turn 1 |"
            + (" fastest prepare reuse (s) | / turn 1 | recompute (s) | / turn 1 |" if fast else "")
            + (" llama.cpp prompt tokens | llama.cpp TTFT (s) | / turn 1 |" if peer else "") + " same answer |"
            + (" level reuse / recompute | same as full reuse / recompute |" if ref else ""))
    lines = [f"### {name}", "", head, "|" + "---:|" * (head.count("|") - 2 - 2 * ref) + ":---:|" + "---|:---:|" * ref]
    f = rows[0]
    for r in rows:
        cells = (f"| {r['turn']} | {_num(r['prompt_tokens'])} | {_num(r['reused_conversation'])} |"
                 + (f" {_num(r['cached_tokens'])} |" if usage else "")
                 + f" {_num(r['prefilled'])} | {_num(r['ttft_reuse_s'], '.3f')} | "
                 f"{_per(r['ttft_reuse_s'], f['ttft_reuse_s'])} | {_num(r['ttft_recompute_s'], '.3f')} | "
                 f"{_per(r['ttft_recompute_s'], f['ttft_recompute_s'])} |")
        if fast:
            cells += (f" {r['prepare_min_reuse_s']:.3f} | {_per(r['prepare_min_reuse_s'], f['prepare_min_reuse_s'])} | "
                      f"{r['prepare_min_recompute_s']:.3f} | "
                      f"{_per(r['prepare_min_recompute_s'], f['prepare_min_recompute_s'])} |")
        if peer:
            cells += (f" {_num(r['llamacpp_prompt_tokens'])} | {_num(r['llamacpp_ttft_s'], '.3f')} | "
                      f"{_per(r['llamacpp_ttft_s'], f['llamacpp_ttft_s'])} |")
        cells += f" {'yes' if r['same_answer'] else 'no'} |"
        if ref:
            cells += (f" {r['level_reuse'] or '-'} / {r['level_recompute'] or '-'} | "
                      f"{'yes' if r['same_as_full_reuse'] else 'no'} / {'yes' if r['same_as_full_recompute'] else 'no'} |")
        lines.append(cells)
    if "kl_history_prefilled" in rows[0]:
        reused = "segments" if "kl_history_segments" in rows[0] else "moved"
        kp = [r["kl_history_prefilled"] for r in rows]
        ks = [r[f"kl_history_{reused}"] for r in rows]
        what = "as segments" if reused == "segments" else "moved from the kept conversation"
        lines += ["", f"Next-token KL vs `full` per turn, method with the history prefilled / {what}: "
                  + ", ".join(f"{a:.3g} / {b:.3g}" for a, b in zip(kp, ks, strict=True))
                  + f" (mean {sum(kp) / len(kp):.3g} / {sum(ks) / len(ks):.3g})."]
    fastest = (f" (fastest prepares: reuse {s['prepare_ratio_last_first_reuse']:.2f}x, recompute "
               f"{s['prepare_ratio_last_first_recompute']:.2f}x)" if "prepare_ratio_last_first_reuse" in s else "")
    llama = (f", llama.cpp server {_ratio_text(s.get('ttft_ratio_last_first_llamacpp'))}"
             if "llamacpp_turns" in s else "")
    lines += ["", f"Last turn / turn 1 TTFT: reuse {_ratio_text(s['ttft_ratio_last_first_reuse'])}, recompute "
                  f"{_ratio_text(s['ttft_ratio_last_first_recompute'])}{llama}{fastest}; same answers "
                  f"{s['same_answers']}/{s['turns']} ({s['same_answers_after_first']}/{s['turns'] - 1} of the turns "
                  "after the first)"
                  + (f"; the same answer as `full` with the history recomputed: reuse {s['same_as_full_reuse']}/"
                     f"{s['turns']}, recompute {s['same_as_full_recompute']}/{s['turns']}." if ref else ".")]
    if "llamacpp" in sc:
        lc = sc["llamacpp"]
        counted = (" Its stream carries no usage: its prompt tokens are its messages rendered with the same chat "
                   "template and counted with kvrag's tokenizer." if rows[0].get("llamacpp_prompt_tokens_counted")
                   else "")
        lines += ["", f"llama.cpp: llama-cpp-python {lc['llama_cpp_python']} server, n_ctx {lc['n_ctx']}, "
                      f"{lc['threads']} thread(s), the same GGUF file, its own answers as its history.{counted}"]
    for note in sc.get("notes", []):
        lines += ["", "Note: " + note.replace("\n", " ").strip()[:1500]]
    return [*lines, ""]


def markdown(result: dict[str, Any]) -> str:
    lines = [f"{result['model']}, {result['machine']['kind']}, {result['dtype']}, weights {result['quantization']}, "
             f"method {result['method']}, {result['turns']} turns of {result['data']} from row {result['offset']}, "
             f"{result['passages']} passages, {result['max_new_tokens']} new tokens, {result['torch_threads']} "
             f"thread(s), commit {result['commit'][:10]}", ""]
    for name, sc in result["scenarios"].items():
        lines += _scenario_lines(name, sc)
    if "kv_check" in result:
        lines += ["### decode-written vs prefill-written K/V (`full`, one turn)", "",
                  "| part | tensor | positions | bit-identical | max abs diff | mean abs diff | max abs value |",
                  "|---|---|---:|---:|---:|---:|---:|"]
        for key, c in result["kv_check"].items():
            part, name = key.split("_", 1)
            lines.append(f"| {part} | {name} | {c['positions']} | {c['bit_identical_fraction']:.1%} | "
                         f"{c['max_abs_diff']:.3g} | {c['mean_abs_diff']:.3g} | {c['max_abs']:.3g} |")
    return "\n".join(lines)


main = writing_main("chat", run, markdown)


__all__ = ["add_arguments", "compare_with_full", "converse", "kv_check", "main", "markdown", "run",
           "same_as_full_counts"]
