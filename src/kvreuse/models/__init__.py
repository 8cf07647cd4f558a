"""Model helpers behind :mod:`kvreuse.models.loader`: spec resolution, the conversion cache and
identity, tiny random-weight test models."""

import os

# Nothing may reach a model hub: set before transformers/huggingface_hub read it at import.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
