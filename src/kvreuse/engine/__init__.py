"""The engine: requests (``sequence``), scheduling (``scheduler``), the model runner and paged
attention, sampling and stop checks, the synchronous ``LLMEngine`` (``llm_engine``) and the
thread that serves it to asyncio (``async_engine``)."""

__all__ = ["EngineConfig", "LLMEngine", "RequestOutput"]


def __getattr__(name: str):
    # Lazy: importing kvreuse.engine.sequence must not import torch and the model runner.
    if name in __all__:
        from kvreuse.engine import llm_engine

        return getattr(llm_engine, name)
    raise AttributeError(name)
