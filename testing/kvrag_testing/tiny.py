"""Tiny random-weight models of each supported family, built in-process (no download), for unit tests.

Every model has the same shape (vocab 256, hidden 64, 4 attention heads, 2 KV heads (GQA), head_dim 16,
intermediate 128, 4096 positions, SDPA attention) and comes with a tiny byte-level BPE tokenizer trained
deterministically in-process on a built-in corpus, with ChatML-style special tokens and chat template::

    from kvrag_testing.tiny import tiny_model
    lm = tiny_model("qwen3", rope={"rope_type": "linear", "factor": 2.0})
    ids = lm.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True)
    logits = lm.model(input_ids=torch.tensor([ids])).logits      # [1, T, 256]
    engine = tiny_engine("qwen2")                                  # a KVRAGEngine over one, memory store
"""

from __future__ import annotations

import collections
import functools
from typing import TYPE_CHECKING, Any

import torch

from kvrag.errors import ConfigError
from kvrag.models import LoadedModel, wrap_model

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedTokenizerFast

FAMILIES = ("llama", "qwen2", "qwen3", "mistral")
"""The core families every standard suite runs on."""

MORE_FAMILIES = ("gemma", "gemma2", "gemma3", "olmo2", "granite", "cohere", "smollm3", "phi", "gpt_neox", "stablelm",
                 "phi3", "gpt_oss", "exaone4")
"""Further families, each with what sets it apart from Llama: Gemma (scaled embeddings, (1 + w) RMSNorm), Gemma 2
(alternating sliding / global layers, attention and final logit soft-capping, query pre-attention scale, extra
norms; eager attention, which transformers requires for it), Gemma 3 (5 local : 1 global layers with different RoPE
bases, q/k norms), OLMo 2 (norms after attention and MLP, q/k norm), Granite (embedding, residual, attention and
logit multipliers), Cohere (LayerNorm, parallel attention + MLP, interleaved RoPE, logit scale), SmolLM3 (every
4th layer without RoPE), Phi (partial rotary 0.5, parallel block, LayerNorm with bias), GPT-NeoX (partial rotary
0.25, parallel residual, no GQA), StableLM (partial rotary 0.25), Phi-3 (fused projections; LongRoPE through ``rope=``), GPT-OSS (mixture of experts, attention sinks, alternating
sliding / global layers; eager attention), EXAONE 4 (3 local layers with RoPE : 1 global layer without). :mod:`tests.unit.test_families` runs them through
the equivalence oracle; ``docs/models.md`` is generated from it."""

ALL_FAMILIES = FAMILIES + MORE_FAMILIES

VOCAB_SIZE = 256
HIDDEN_SIZE = 64
NUM_HEADS = 4
NUM_KV_HEADS = 2
HEAD_DIM = 16
INTERMEDIATE_SIZE = 128
MAX_POSITIONS = 4096
ROPE_THETA = 10000.0
INIT_STD = 0.02
"""Default weight-init std (transformers' own default). At 0.02 attention is nearly uniform: moving half of a
24-token prompt by 300 positions changes the next-token distributions by KL ~1e-6, so a test that must tell a
repaired cache from a stale one should pass ``init_std=0.1`` (KL ~0.2 for the same shift). Larger weights also
amplify fp32 rounding (values after layer 0 at positions ~700 then differ by ~5e-6 instead of <1e-6), so exact
equivalence tests keep the default."""

UNK, PAD, BOS = "<unk>", "<pad>", "<|endoftext|>"
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = (UNK, PAD, BOS, IM_START, IM_END)  # ids 0..4

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# Training text for the BPE merges; plain ASCII so every byte-level symbol used is in the base alphabet.
_CORPUS = """\
The quick brown fox jumps over the lazy dog. Paris is the capital of France, and Berlin is the capital of Germany.
A retrieval augmented generation system retrieves documents, splits them into chunks and answers questions.
Each chunk of text is encoded once; its key and value cache is stored and reused when the chunk is retrieved again.
Question: What is the capital of France? Answer: Paris.
Question: Who wrote the report? Answer: The committee wrote the report in the year 2021.
The model reads the context, then the question, and then it generates the answer token by token.
Rotary position embeddings rotate the queries and keys by an angle that grows with the position of the token.
Numbers such as 0 1 2 3 4 5 6 7 8 9 10 100 and 1000 appear in tables, dates and lists.
system user assistant: You are a helpful assistant. Use the context to answer the question in one sentence.
"""

# Base alphabet: the byte-level symbols of tab, newline, carriage return and printable ASCII. Other bytes map to
# <unk>; the tokenizer is meant for the ASCII text of unit tests.
_BASE_BYTES = (9, 10, 13, *range(32, 127))


@functools.lru_cache(maxsize=1)
def _bytes_to_unicode() -> dict[int, str]:
    from tokenizers import pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    # GPT-2's byte -> printable-char table: printable latin-1 bytes map to themselves, the rest to 256 + n.
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {b: chr(b) for b in keep}
    n = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + n)
            n += 1
    assert set(table.values()) == set(alphabet), "unexpected ByteLevel alphabet"
    return table


@functools.lru_cache(maxsize=4)
def _train_bpe(vocab_size: int) -> tuple[tuple[tuple[str, int], ...], tuple[tuple[str, str], ...]]:
    """Deterministic byte-level BPE training (most frequent pair, ties broken lexicographically)."""
    from tokenizers import pre_tokenizers

    b2u = _bytes_to_unicode()
    pre = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    words = collections.Counter(w for w, _ in pre.pre_tokenize_str(_CORPUS))
    vocab: dict[str, int] = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for b in _BASE_BYTES:
        vocab[b2u[b]] = len(vocab)
    splits = {w: list(w) for w in sorted(words)}
    merges: list[tuple[str, str]] = []
    while len(vocab) < vocab_size:
        pairs: collections.Counter[tuple[str, str]] = collections.Counter()
        for w, syms in splits.items():
            for a, b in zip(syms, syms[1:], strict=False):
                pairs[(a, b)] += words[w]
        if not pairs:
            break
        best = min(pairs, key=lambda p: (-pairs[p], p))
        merges.append(best)
        if best[0] + best[1] not in vocab:  # two different splits can merge into the same string
            vocab[best[0] + best[1]] = len(vocab)
        for w, syms in splits.items():
            out: list[str] = []
            i = 0
            while i < len(syms):
                if i + 1 < len(syms) and (syms[i], syms[i + 1]) == best:
                    out.append(syms[i] + syms[i + 1])
                    i += 2
                else:
                    out.append(syms[i])
                    i += 1
            splits[w] = out
    return tuple(vocab.items()), tuple(merges)


def tiny_tokenizer(
    *, vocab_size: int = VOCAB_SIZE, chat_template: str | None = CHAT_TEMPLATE
) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer of exactly ``vocab_size`` tokens, built in-process, no download.

    Special tokens: ``<unk>`` (0), ``<pad>`` (1), ``<|endoftext|>`` (2, bos), ``<|im_start|>`` (3),
    ``<|im_end|>`` (4, eos). No special tokens are added on encode (like Qwen / SmolLM2); the chat template adds them.

    Args:
        vocab_size: total vocabulary including specials and the 98-symbol ASCII base alphabet.
        chat_template: Jinja chat template (ChatML-like by default; None for no template).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    if vocab_size < len(SPECIAL_TOKENS) + len(_BASE_BYTES):
        msg = f"vocab_size must be >= {len(SPECIAL_TOKENS) + len(_BASE_BYTES)}, got {vocab_size}"
        raise ConfigError(msg)
    vocab, merges = _train_bpe(vocab_size)
    backend = Tokenizer(models.BPE(vocab=dict(vocab), merges=list(merges), unk_token=UNK))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(list(SPECIAL_TOKENS))
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        unk_token=UNK,
        pad_token=PAD,
        bos_token=BOS,
        eos_token=IM_END,
        chat_template=chat_template,
        model_max_length=MAX_POSITIONS,
    )
    return tok


def tiny_config(
    family: str,
    *,
    rope: dict[str, Any] | None = None,
    num_layers: int = 2,
    vocab_size: int = VOCAB_SIZE,
    init_std: float = INIT_STD,
    sliding_window: int | None = None,
) -> PretrainedConfig:
    """The config of a tiny model of ``family`` (see module docstring for the shape).

    Args:
        family: one of :data:`ALL_FAMILIES`.
        rope: overrides of ``rope_parameters`` (default ``{"rope_type": "default", "rope_theta": 10000.0}``),
            e.g. ``{"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 2048}``.
        num_layers: decoder layers.
        vocab_size: vocabulary size.
        init_std: ``initializer_range`` (std of the random weights), see :data:`INIT_STD`.
        sliding_window: a sliding attention window of this many tokens (None: full attention everywhere). Mistral
            uses it at every layer; Qwen2/Qwen3 (``use_sliding_window``) at the upper half of the layers
            (``max_window_layers = num_layers // 2``), as their configs lay out mixed layer types. Llama has none.
    """
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    if family in MORE_FAMILIES:
        return _more_config(family, rope=rope, num_layers=num_layers, vocab_size=vocab_size, init_std=init_std,
                            sliding_window=sliding_window)
    rope_parameters: dict[str, Any] = {"rope_type": "default", "rope_theta": ROPE_THETA}
    rope_parameters.update(rope or {})
    common: dict[str, Any] = {
        "vocab_size": vocab_size,
        "hidden_size": HIDDEN_SIZE,
        "num_attention_heads": NUM_HEADS,
        "num_key_value_heads": NUM_KV_HEADS,
        "head_dim": HEAD_DIM,
        "intermediate_size": INTERMEDIATE_SIZE,
        "num_hidden_layers": num_layers,
        "max_position_embeddings": MAX_POSITIONS,
        "rope_parameters": rope_parameters,
        "tie_word_embeddings": False,
        "initializer_range": init_std,
        "pad_token_id": SPECIAL_TOKENS.index(PAD),
        "bos_token_id": SPECIAL_TOKENS.index(BOS),
        "eos_token_id": SPECIAL_TOKENS.index(IM_END),
    }
    window: dict[str, Any] = {"use_sliding_window": False}
    if sliding_window is not None:
        window = {"use_sliding_window": True, "sliding_window": sliding_window, "max_window_layers": num_layers // 2}
    if family == "llama":
        if sliding_window is not None:
            msg = f"Llama has no sliding-window attention (got sliding_window={sliding_window}); use mistral or qwen2"
            raise ConfigError(msg)
        return LlamaConfig(**common)
    if family == "qwen2":
        return Qwen2Config(**common, **window)
    if family == "qwen3":  # q/k RMSNorm per head is part of the Qwen3 architecture
        return Qwen3Config(**common, **window)
    if family == "mistral":
        return MistralConfig(**common, sliding_window=sliding_window)
    msg = f"unknown tiny model family {family!r}; expected one of {list(ALL_FAMILIES)}"
    raise ConfigError(msg)


def _more_config(family: str, *, rope: dict[str, Any] | None, num_layers: int, vocab_size: int, init_std: float,
                 sliding_window: int | None) -> PretrainedConfig:
    """The configs of :data:`MORE_FAMILIES` (same shape as the core families; see :func:`tiny_config`)."""
    import transformers

    base: dict[str, Any] = {"rope_type": "default", "rope_theta": ROPE_THETA}
    common: dict[str, Any] = {
        "vocab_size": vocab_size, "hidden_size": HIDDEN_SIZE, "num_attention_heads": NUM_HEADS,
        "num_key_value_heads": NUM_KV_HEADS, "head_dim": HEAD_DIM, "intermediate_size": INTERMEDIATE_SIZE,
        "num_hidden_layers": num_layers, "max_position_embeddings": MAX_POSITIONS, "tie_word_embeddings": False,
        "initializer_range": init_std, "pad_token_id": SPECIAL_TOKENS.index(PAD),
        "bos_token_id": SPECIAL_TOKENS.index(BOS), "eos_token_id": SPECIAL_TOKENS.index(IM_END),
    }
    window = sliding_window if sliding_window is not None else MAX_POSITIONS
    extra: dict[str, Any] = {}
    if family == "gemma3":  # 5 local : 1 global layers (fewer layers: the last one global), local base 10K, global 1M
        pattern = min(6, num_layers)
        extra["layer_types"] = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
                                for i in range(num_layers)]
        extra["sliding_window"] = window
        extra["query_pre_attn_scalar"] = HEAD_DIM
        extra["rope_parameters"] = {"sliding_attention": {"rope_type": "default", "rope_theta": ROPE_THETA},
                                    "full_attention": {"rope_type": "default", "rope_theta": 1e6, **(rope or {})}}
        return transformers.Gemma3TextConfig(**common, **extra)
    params = {**base, **(rope or {})}
    if family == "gemma":
        return transformers.GemmaConfig(**common, rope_parameters=params)
    if family == "gemma2":  # alternating sliding / global layers, soft-capping, query pre-attention scale
        return transformers.Gemma2Config(**common, rope_parameters=params, sliding_window=window,
                                         attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
                                         query_pre_attn_scalar=HEAD_DIM)
    if family == "olmo2":
        return transformers.Olmo2Config(**common, rope_parameters=params)
    if family == "granite":
        return transformers.GraniteConfig(**common, rope_parameters=params, embedding_multiplier=2.0,
                                          residual_multiplier=0.5, attention_multiplier=0.5,
                                          logits_scaling=0.5)
    if family == "cohere":
        return transformers.CohereConfig(**common, rope_parameters=params, logit_scale=0.0625)
    if family == "smollm3":  # every 4th layer without RoPE
        return transformers.SmolLM3Config(**common, rope_parameters=params, no_rope_layer_interval=4)
    if family == "phi":
        return transformers.PhiConfig(**common, rope_parameters={"partial_rotary_factor": 0.5, **params})
    if family == "gpt_neox":  # no GQA, parallel attention + MLP, a quarter of each head rotated
        neox = {k: v for k, v in common.items() if k not in ("num_key_value_heads", "head_dim")}
        return transformers.GPTNeoXConfig(**neox, rope_parameters={"partial_rotary_factor": 0.25, **params},
                                          use_parallel_residual=True)
    if family == "gpt_oss":  # mixture of experts, attention sinks, alternating sliding / global layers
        return transformers.GptOssConfig(**common, rope_parameters=params, sliding_window=window,
                                         num_local_experts=4, num_experts_per_tok=2)
    if family == "exaone4":  # 3 local layers with RoPE : 1 global layer without RoPE, q/k norms
        return transformers.Exaone4Config(**common, rope_parameters=params, sliding_window=window,
                                          sliding_window_pattern=4)
    if family == "stablelm":
        return transformers.StableLmConfig(**common, rope_parameters={"partial_rotary_factor": 0.25, **params})
    assert family == "phi3"  # LongRoPE reads original_max_position_embeddings from the config itself
    orig = params.get("original_max_position_embeddings")
    return transformers.Phi3Config(**common, rope_parameters=params,
                                   **({"original_max_position_embeddings": orig} if orig else {}))


def attn_implementation(family: str) -> str:
    """The attention implementation a tiny model of ``family`` loads with: 'eager' where transformers refuses SDPA
    (Gemma 2: logit soft-capping; GPT-OSS: attention sinks), else 'sdpa' (which kvrag switches to its ``kvrag_sdpa``)."""
    return "eager" if family in ("gemma2", "gpt_oss") else "sdpa"


def tiny_model(
    family: str,
    *,
    rope: dict[str, Any] | None = None,
    seed: int = 0,
    num_layers: int = 2,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    init_std: float = INIT_STD,
    sliding_window: int | None = None,
    quantize: str | None = None,
) -> LoadedModel:
    """A random-weight model of ``family`` with the tiny tokenizer, wrapped like :func:`kvrag.models.load_model`.

    Weights depend only on ``(family, rope, seed, num_layers, init_std)`` (not on ``sliding_window``); the global torch RNG state is left
    untouched.

    Args:
        family: one of :data:`FAMILIES`.
        rope: ``rope_parameters`` overrides (see :func:`tiny_config`).
        seed: weight-initialization seed.
        num_layers: decoder layers.
        dtype: compute dtype.
        device: device.
        init_std: std of the random weights, see :data:`INIT_STD`.
        sliding_window: sliding attention window (see :func:`tiny_config`).
        quantize: weight quantization of the short products ("int4" / "int8", :mod:`kvrag.kv.quant`).

    Raises:
        UnsupportedModelError: the rope override is a variant kvrag cannot serve (e.g. 'dynamic').
    """
    from transformers import AutoModelForCausalLM

    config = tiny_config(family, rope=rope, num_layers=num_layers, init_std=init_std, sliding_window=sliding_window)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation(family),
                                                 dtype=torch.float32)
    model = model.to(device=device, dtype=dtype).eval()
    name = f"tiny-{family}" if sliding_window is None else f"tiny-{family}-sw{sliding_window}"
    return wrap_model(model, tiny_tokenizer(), name=name, dtype=dtype, quantize=quantize)


def tiny_engine(family: str = "qwen2", *, store: Any = None, init_std: float = 0.1, seed: int = 0,
                **config: Any) -> Any:
    """A :class:`~kvrag.engine.engine.KVRAGEngine` over :func:`tiny_model` (a memory store by default): what the
    adapters' fast unit tests wrap, so that a framework's whole request path runs in seconds without a real model.

    Args:
        family: model family, see :data:`FAMILIES`.
        store: a KV store or store URL (default: a fresh :class:`~kvrag.store.memory.MemoryStore`).
        init_std: weight std; 0.1 (default here) makes chunk positions matter, so reuse methods differ from full.
        seed: weight-initialization seed.
        **config: :class:`~kvrag.config.EngineConfig` fields (e.g. ``method="full"``).
    """
    from kvrag.config import EngineConfig
    from kvrag.engine.engine import KVRAGEngine
    from kvrag.store.memory import MemoryStore

    lm = tiny_model(family, init_std=init_std, seed=seed)
    if isinstance(store, str):
        from kvrag.store.factory import store_from_url

        store = store_from_url(store)
    return KVRAGEngine(lm, store if store is not None else MemoryStore(), EngineConfig(**config))


__all__ = ["ALL_FAMILIES", "CHAT_TEMPLATE", "FAMILIES", "INIT_STD", "MORE_FAMILIES", "attn_implementation", "SPECIAL_TOKENS", "tiny_config", "tiny_engine", "tiny_model",
           "tiny_tokenizer"]
