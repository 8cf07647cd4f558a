"""kvreuse: an LLM inference server that never computes the same attention state twice."""

import os

# PyTorch's CPU allocator puts allocations of 2 MB and more on transparent huge pages (decode
# streams every weight once a step; on 4 KB pages it misses the TLB every 4 KB: see
# kvreuse/models/huge_pages.py). Read by torch at its first allocation, so it takes effect where
# kvreuse is imported first (the CLI); THP_MEM_ALLOC_ENABLE=0 keeps 4 KB pages.
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

__version__ = "0.1.0"

__all__ = ["LLM", "SamplingParams", "__version__"]


def __getattr__(name: str):
    # Lazy so that `import kvreuse.cache.block_pool` (router, simulator) never imports torch.
    if name == "LLM":
        from kvreuse.llm import LLM

        return LLM
    if name == "SamplingParams":
        from kvreuse.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(name)
