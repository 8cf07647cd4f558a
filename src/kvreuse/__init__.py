"""kvreuse: an LLM inference server that never computes the same attention state twice."""

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
