"""``kvrag bench chat --frameworks serve``: the fixed-chunk conversation over HTTP with the official ``openai`` SDK,
against ``kvrag serve`` and, beside it, llama.cpp's server on the same GGUF file.

Servers, each a subprocess on a free port of 127.0.0.1, waited for with a deadline and terminated (SIGTERM, then
killed) at the end:

* ``reuse``: ``kvrag serve`` with the run's model, method and ``--threads`` (the conversation cache on, its default);
  the passages registered with ``POST /v1/kvrag/chunks`` (cached before the turns).
* ``recompute``: the same with ``--conversation-cache-bytes 0`` (the history prefilled again every turn).
* ``llama.cpp`` (``--peer``): ``python -m llama_cpp.server`` (llama-cpp-python's server) on the same GGUF file,
  ``--n_ctx 4096``, the same thread count. It keeps its context's tokens between requests and evaluates only the
  part of a prompt after the longest common prefix with them (what llama.cpp's own server does per slot with
  ``cache_prompt``). Greedy (``temperature`` 0, ``repeat_penalty`` 1), its chat template the GGUF's.

Every turn sends the whole ``messages`` list (a system message holding the passages, the history, the new question)
with ``client.chat.completions.create(..., stream=True, stream_options={"include_usage": True})``; the servers take
turns per question, the order rotating, so that a busy machine slows them alike. ``reuse`` and ``recompute`` get the
same messages (the history is ``reuse``'s answers), so each turn's answers are comparable; llama.cpp keeps its own
answers as its history, as a deployed chat would (its cache then holds what it generated). Recorded per turn:
client-side TTFT (request sent -> first non-empty content delta), time to the first streamed chunk, the total time,
``usage.prompt_tokens`` and ``usage.prompt_tokens_details.cached_tokens``, kvrag's own summary (``kvrag`` in the last
chunk: server-side TTFT, conversation tokens reused, chunks found) and the answers.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, Any

SYSTEM = "Answer the user's questions from these passages. Be brief."
MODEL_ID = "kvrag-chat"
LLAMACPP_SERVER_DEPS = ("llama_cpp", "fastapi", "uvicorn", "sse_starlette", "starlette_context", "pydantic_settings")
_LLAMACPP_INSTALL = "pip install 'llama-cpp-python[server]'"


class ServerFailed(RuntimeError):
    """A server subprocess exited, or did not answer in time; the message ends with its output's tail."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    """A server subprocess listening on 127.0.0.1: started, waited for, terminated.

    Args:
        name: what messages call it.
        argv: the command, without the port: ``port_args(port)`` is appended.
        port_args: the arguments that make it listen on a port.
        ready_path: a path that answers 200 once it serves.
        start_timeout_s: how long to wait for ``ready_path`` (the process must stay alive meanwhile).
        env: its environment (default: this process's).
    """

    def __init__(self, name: str, argv: Sequence[str], port_args: Callable[[int], list[str]], ready_path: str, *,
                 start_timeout_s: float = 600.0, env: dict[str, str] | None = None) -> None:
        self.name = name
        self.port = free_port()
        self.argv = [*argv, *port_args(self.port)]
        self.ready_path = ready_path
        self.start_timeout_s = start_timeout_s
        self.env = env
        self.proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def tail(self, chars: int = 2000) -> str:
        """The last ``chars`` characters of its output (stdout and stderr)."""
        if self._log is None:
            return ""
        self._log.flush()
        self._log.seek(0)
        return self._log.read().decode(errors="replace")[-chars:]

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self) -> Server:
        import httpx

        self._log = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(self.argv, env=self.env, stdout=self._log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + self.start_timeout_s
        while True:
            rc = self.proc.poll()
            if rc is not None:
                raise ServerFailed(f"{self.name} exited with status {rc} before it answered {self.ready_path}; "
                                   f"its output ends:\n{self.tail()}")
            try:
                if httpx.get(self.url + self.ready_path, timeout=2).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise ServerFailed(f"{self.name} did not answer {self.ready_path} within {self.start_timeout_s:g} s; "
                                   f"its output ends:\n{self.tail()}")
            time.sleep(0.25)

    def stop(self, timeout_s: float = 30.0) -> int | None:
        """SIGTERM, then SIGKILL after ``timeout_s``: its exit status (None: it was never started)."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout_s)
        return self.proc.returncode

    def __enter__(self) -> Server:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
        if self._log is not None:
            self._log.close()
            self._log = None


def kvrag_server(method: str, model: str | None, threads: int | None, *, conversation_cache: bool = True,
                 start_timeout_s: float = 600.0) -> Server:
    """``kvrag serve`` of this kvrag (its package directory first on ``PYTHONPATH``)."""
    import kvrag

    root = str(Path(kvrag.__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    argv = [sys.executable, "-m", "kvrag.cli", "serve", "--host", "127.0.0.1", "--model-id", MODEL_ID,
            "--method", method, "--max-queue", "4"]
    argv += ["--model", model] if model else []
    argv += ["--threads", str(threads)] if threads else []
    argv += [] if conversation_cache else ["--conversation-cache-bytes", "0"]
    name = "kvrag serve" + ("" if conversation_cache else " (conversation cache off)")
    return Server(name, argv, lambda p: ["--port", str(p)], "/health", start_timeout_s=start_timeout_s, env=env)


def llamacpp_missing() -> str | None:
    """None when llama-cpp-python's server can start here, else what is missing and the install command."""
    missing = [m for m in LLAMACPP_SERVER_DEPS if importlib.util.find_spec(m) is None]
    if missing:
        return f"llama-cpp-python's server needs {', '.join(missing)}: {_LLAMACPP_INSTALL}"
    return None


def llamacpp_server(gguf: str, threads: int, n_ctx: int = 4096, *, start_timeout_s: float = 600.0) -> Server:
    """llama-cpp-python's OpenAI-compatible server on ``gguf`` (one model, one context kept between requests)."""
    argv = [sys.executable, "-m", "llama_cpp.server", "--model", gguf, "--model_alias", MODEL_ID,
            "--host", "127.0.0.1", "--n_ctx", str(n_ctx), "--n_threads", str(threads),
            "--n_threads_batch", str(threads)]
    return Server("llama.cpp server", argv, lambda p: ["--port", str(p)], "/v1/models", start_timeout_s=start_timeout_s)


def stream_turn(client: Any, messages: list[dict[str, str]], max_tokens: int,
                extra_body: dict[str, Any] | None = None) -> dict[str, Any]:
    """One streamed chat completion with the ``openai`` SDK, timed client-side.

    Returns ``text``, ``ttft_s`` (request sent -> first non-empty content delta; None when nothing was generated),
    ``first_chunk_s``, ``total_s``, ``prompt_tokens`` / ``completion_tokens`` / ``cached_tokens`` (from the usage
    chunk; None where the server sends none) and ``kvrag`` (kvrag serve's summary in the last chunk, else None)."""
    t0 = time.perf_counter()
    stream = client.chat.completions.create(model=MODEL_ID, messages=messages, max_tokens=max_tokens, temperature=0,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body=extra_body)
    first_chunk: float | None = None
    ttft: float | None = None
    parts: list[str] = []
    usage = None
    summary = None
    for ch in stream:
        now = time.perf_counter() - t0
        first_chunk = now if first_chunk is None else first_chunk
        for c in ch.choices or []:
            if c.delta is not None and c.delta.content:
                ttft = now if ttft is None else ttft
                parts.append(c.delta.content)
        usage = ch.usage if ch.usage is not None else usage
        summary = (ch.model_extra or {}).get("kvrag", summary)
    total = time.perf_counter() - t0
    details = getattr(usage, "prompt_tokens_details", None)
    cached = getattr(details, "cached_tokens", None)
    return {"text": "".join(parts), "ttft_s": ttft, "first_chunk_s": first_chunk, "total_s": total,
            "prompt_tokens": getattr(usage, "prompt_tokens", None),
            "completion_tokens": getattr(usage, "completion_tokens", None),
            "cached_tokens": None if cached is None else int(cached), "kvrag": summary}


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b <= 0 else a / b


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The scenario summary of :func:`converse`'s rows (the keys ``chat_bench.markdown`` reads)."""
    first, last = rows[0], rows[-1]
    out: dict[str, Any] = {
        "turns": len(rows), "ttft_ratio_last_first_reuse": _ratio(last["ttft_reuse_s"], first["ttft_reuse_s"]),
        "ttft_ratio_last_first_recompute": _ratio(last["ttft_recompute_s"], first["ttft_recompute_s"]),
        "same_answers": sum(r["same_answer"] for r in rows),
        "same_answers_after_first": sum(r["same_answer"] for r in rows[1:]),
        "reused_tokens": sum(r["reused_conversation"] or 0 for r in rows)}
    if "llamacpp_ttft_s" in first:
        done = [r for r in rows if r.get("llamacpp_ttft_s") is not None]
        out["llamacpp_turns"] = len(done)
        if done and done[-1] is last:
            out["ttft_ratio_last_first_llamacpp"] = _ratio(last["llamacpp_ttft_s"], first["llamacpp_ttft_s"])
    return out


def converse(servers: dict[str, Any], chunks: list[str] | Callable[[int], list[str]], questions: list[str],
             max_tokens: int, on_turn: Callable[[dict[str, Any]], None] | None = None,
             count_tokens: Callable[[list[dict[str, str]]], int] | None = None) -> dict[str, Any]:
    """The conversation against ``servers`` (name -> an ``openai.OpenAI`` client; ``reuse`` and ``recompute``
    required, ``llama.cpp`` optional): one row per turn. ``chunks``: the passages of every turn, or turn ``k``'s
    as ``chunks(k)``. A llama.cpp request that fails (its server crashed) ends llama.cpp's part; the error is kept
    in ``llamacpp_error``. ``count_tokens``: the prompt tokens of a ``messages`` list, for a server whose stream
    carries no usage (llama-cpp-python's)."""
    chunks_of = chunks if callable(chunks) else (lambda k: chunks)
    peer = "llama.cpp" in servers
    history: list[dict[str, str]] = []
    peer_history: list[dict[str, str]] = []
    rows: list[dict[str, Any]] = []
    error: str | None = None
    extra = {"llama.cpp": {"repeat_penalty": 1.0}}
    for k, q in enumerate(questions):
        system = SYSTEM + "\n" + "".join(chunks_of(k))
        msgs = {"reuse": [{"role": "system", "content": system}, *history, {"role": "user", "content": q}]}
        msgs["recompute"] = msgs["reuse"]
        if peer and error is None:
            msgs["llama.cpp"] = [{"role": "system", "content": system}, *peer_history, {"role": "user", "content": q}]
        names = list(msgs)
        shift = k % len(names)
        got: dict[str, dict[str, Any]] = {}
        for name in names[shift:] + names[:shift]:
            try:
                got[name] = stream_turn(servers[name], msgs[name], max_tokens, extra.get(name))
            except Exception as e:
                if name != "llama.cpp":
                    raise
                error = f"turn {k + 1}: {type(e).__name__}: {e}"
        r, f = got["reuse"], got["recompute"]
        info = r["kvrag"] or {}
        prompt = r["prompt_tokens"]
        row: dict[str, Any] = {
            "turn": k + 1, "prompt_tokens": prompt, "reused_conversation": info.get("conversation_tokens"),
            "cached_tokens": r["cached_tokens"], "chunks_found": info.get("chunks_found"),
            "prefilled": None if prompt is None or r["cached_tokens"] is None else prompt - r["cached_tokens"],
            "recompute_prefilled": (None if f["prompt_tokens"] is None or f["cached_tokens"] is None
                                    else f["prompt_tokens"] - f["cached_tokens"]),
            "ttft_reuse_s": r["ttft_s"], "ttft_recompute_s": f["ttft_s"],
            "server_ttft_reuse_s": info.get("ttft_s"), "server_ttft_recompute_s": (f["kvrag"] or {}).get("ttft_s"),
            "total_reuse_s": r["total_s"], "total_recompute_s": f["total_s"],
            "same_answer": r["text"] == f["text"], "answer": r["text"],
            "recompute_answer": f["text"] if r["text"] != f["text"] else None}
        if peer:
            p = got.get("llama.cpp", {})
            row.update({f"llamacpp_{key}": p.get(key) for key in ("ttft_s", "prompt_tokens", "cached_tokens",
                                                                  "total_s")}, llamacpp_answer=p.get("text"))
            if p and p["prompt_tokens"] is None and count_tokens is not None:
                row["llamacpp_prompt_tokens"] = count_tokens(msgs["llama.cpp"])
                row["llamacpp_prompt_tokens_counted"] = True
            if p:
                peer_history += [{"role": "user", "content": q}, {"role": "assistant", "content": p["text"]}]
        rows.append(row)
        history += [{"role": "user", "content": q}, {"role": "assistant", "content": r["text"]}]
        if on_turn is not None:
            on_turn(row)
    out: dict[str, Any] = {"rows": rows, "summary": summarize(rows)}
    if error is not None:
        out["llamacpp_error"] = error
    return out


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def _print_turn(row: dict[str, Any]) -> None:
    peer = ""
    if row.get("llamacpp_ttft_s") is not None:
        peer = f"; llama.cpp {row['llamacpp_prompt_tokens']} prompt tokens, TTFT {row['llamacpp_ttft_s']:.3f} s"
    print(f"  turn {row['turn']}: {row['prompt_tokens']} prompt tokens, {row['cached_tokens']} cached "
          f"({row['reused_conversation']} from the conversation); TTFT {_fmt(row['ttft_reuse_s'])} s "
          f"(recompute {_fmt(row['ttft_recompute_s'])} s){peer}; same answer: {row['same_answer']}", flush=True)


def run(chunks: list[str] | Callable[[int], list[str]], questions: list[str], warm_question: str,
        max_new_tokens: int, *, method: str, model: str | None, threads: int | None, peer: str = "auto",
        count_tokens: Callable[[list[dict[str, str]]], int] | None = None, n_ctx: int = 4096,
        warm_chunks: list[str] | None = None) -> dict[str, Any]:
    """Start the servers, register the chunks (every turn's), warm each server with one untimed request, run the
    conversation, stop the servers. ``chunks``: as :func:`converse`'s. ``peer``: ``auto`` (llama.cpp when its
    server can start here and the model is a GGUF file), ``llama.cpp`` (asked for: a missing server or model is
    reported in the result) or ``none``; ``n_ctx``: its context window. ``count_tokens``: see :func:`converse`.
    ``warm_chunks``: the warm-up request's passages (default: turn 1's; other passages leave llama.cpp's server no
    cached prefix for turn 1 when the passages change every turn)."""
    chunks_of = chunks if callable(chunks) else (lambda k: chunks)
    every = list(dict.fromkeys([*(c for k in range(len(questions)) for c in chunks_of(k)), *(warm_chunks or [])]))
    try:
        import openai
    except ImportError as e:
        raise SystemExit("--frameworks serve needs the openai SDK: pip install 'kvrag-bench[serve]'") from e
    import httpx

    from kvrag_bench.decode_bench import _gguf_of

    notes: list[str] = []
    gguf = None
    if peer != "none":
        gguf = _gguf_of(model)
        why = llamacpp_missing() if gguf is not None else "the model is not a GGUF file"
        if why is not None:
            gguf = None
            notes.append(f"no llama.cpp column: {why}")
            print(f"  {notes[-1]}", flush=True)
    with contextlib.ExitStack() as stack:
        servers: dict[str, Any] = {}
        started = [("reuse", kvrag_server(method, model, threads)),
                   ("recompute", kvrag_server(method, model, threads, conversation_cache=False))]
        if gguf is not None:
            started.append(("llama.cpp", llamacpp_server(gguf, threads or 1, n_ctx)))
        procs: dict[str, Server] = {}
        for name, srv in started:
            try:
                procs[name] = stack.enter_context(srv)
            except ServerFailed as e:
                if name != "llama.cpp":
                    raise
                notes.append(f"no llama.cpp column: {e}")
                print(f"  {notes[-1]}", flush=True)
                continue
            servers[name] = openai.OpenAI(base_url=srv.url + "/v1", api_key="not-needed", max_retries=0, timeout=600)
        for name in ("reuse", "recompute"):
            r = httpx.post(procs[name].url + "/v1/kvrag/chunks", json={"texts": every}, timeout=1200)
            if r.status_code != 200:
                raise ServerFailed(f"{procs[name].name}: registering the passages answered {r.status_code}: {r.text}")
        system = SYSTEM + "\n" + "".join(chunks_of(0) if warm_chunks is None else warm_chunks)
        warm = [{"role": "system", "content": system}, {"role": "user", "content": warm_question}]
        for name in list(servers):  # untimed: the first request of a server pays one-time setup
            try:
                stream_turn(servers[name], warm, max_new_tokens, {"repeat_penalty": 1.0} if name == "llama.cpp"
                            else None)
            except Exception as e:
                if name != "llama.cpp":
                    raise
                notes.append(f"no llama.cpp column: its first request failed ({type(e).__name__}: {e}); its output "
                             f"ends:\n{procs[name].tail()}")
                print(f"  {notes[-1]}", flush=True)
                del servers[name]
        result = converse(servers, chunks, questions, max_new_tokens, on_turn=_print_turn, count_tokens=count_tokens)
        if "llamacpp_error" in result:
            log = procs["llama.cpp"].tail() if "llama.cpp" in procs else ""
            alive = "llama.cpp" in procs and procs["llama.cpp"].alive()
            notes.append(f"llama.cpp stopped answering at {result.pop('llamacpp_error')} (server "
                         f"{'still running' if alive else 'exited'}); its output ends:\n{log}")
            print(f"  {notes[-1]}", flush=True)
        if "llama.cpp" in servers:
            import llama_cpp

            result["llamacpp"] = {"llama_cpp_python": getattr(llama_cpp, "__version__", "?"), "gguf": gguf,
                                  "n_ctx": n_ctx, "threads": threads or 1}
    result["server"] = {"method": method, "threads": threads, "model": model or "default"}
    if notes:
        result["notes"] = notes
    return result


__all__ = ["LLAMACPP_SERVER_DEPS", "MODEL_ID", "Server", "ServerFailed", "converse", "free_port", "kvrag_server",
           "llamacpp_missing", "llamacpp_server", "run", "stream_turn", "summarize"]
