"""Shared session fixtures. They are built once per test session and shared by every test:
do not mutate them (no weight edits, no set_attn_implementation); build your own if you must."""

import pytest


@pytest.fixture(scope="session")
def default_model():
    """SmolLM2-135M-Instruct, fp32, CPU. The first run ever converts the GGUF (~25 s)."""
    from kvreuse.models.loader import load_model

    return load_model("default")


@pytest.fixture(scope="session")
def tiny_llama():
    """Tiny random Llama (2 layers, hidden 64, 4 heads / 2 KV heads, head_dim 16), fp32, seed 0."""
    from kvreuse.models.tiny import tiny_model

    return tiny_model("llama", seed=0)


@pytest.fixture(scope="session")
def tiny_gemma3():
    """Tiny random Gemma 3 text model: 4 layers (sliding 8, full, sliding 8, full), fp32, seed 0."""
    from kvreuse.models.tiny import tiny_model

    return tiny_model("gemma3", seed=0)
