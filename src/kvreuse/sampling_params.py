"""How to pick each next token: the knobs of the OpenAI and vLLM APIs."""

from __future__ import annotations

from dataclasses import dataclass

MAX_LOGPROBS = 20  # OpenAI's and vLLM's limit on logprobs / top_logprobs
GREEDY_BELOW = 1e-5  # temperatures below this sample greedily
# The sampler compares top_p with fp32 probability mass: a top_p below float32's smallest normal
# (1.18e-38) is 0 there (or flushed to 0 on a GPU), which would drop every token. 1e-37 is the
# smallest power of ten that survives; any top_p this small already keeps only the top token.
MIN_TOP_P = 1e-37
MAX_STOP_SEQUENCES = 4  # OpenAI's limit
MAX_STOP_CHARS = 1024  # per stop string: streaming holds back len(stop) - 1 characters of text


@dataclass(frozen=True)
class SamplingParams:
    """Validated at construction; ``ValueError`` names the offending field.

    ``temperature`` below 1e-5 (0 included) is greedy (1/T would overflow fp32 logits); ``top_p``
    is in ``[MIN_TOP_P, 1]``. ``top_k == 0`` means no top-k cut. ``seed`` makes a
    request's sampling reproducible regardless of what else is batched with it.
    ``logprobs=k`` puts a ``TokenLogprobs`` per output token on each ``RequestOutput``:
    the raw model distribution (before temperature, top-k, top-p), as vLLM does.
    ``speculative=False`` opts a request out of prompt-lookup speculation (only greedy
    requests speculate, and only when the engine has ``speculative_tokens > 0``).
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None  # None: no logprobs; k in [0, 20]: the sampled token's plus the top k
    speculative: bool = True  # False: never draft for this request (prompt lookup, engine/spec_decode.py)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        else:
            object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not 0.0 <= float(self.temperature) <= 2.0:  # NaN fails too
            raise ValueError(f"temperature must be in [0, 2], got {self.temperature!r}")
        if not MIN_TOP_P <= float(self.top_p) <= 1.0:  # NaN fails too
            raise ValueError(f"top_p must be in [{MIN_TOP_P}, 1] (smaller rounds to 0 in float32), got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            if self.top_k == -1:  # vLLM spells "off" as -1
                object.__setattr__(self, "top_k", 0)
            else:
                raise ValueError(f"top_k must be an integer >= 0 (or -1 for off), got {self.top_k!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError("stop must be a string or a list of non-empty strings")
        k = self.logprobs
        if k is not None and (not isinstance(k, int) or isinstance(k, bool) or not 0 <= k <= MAX_LOGPROBS):
            raise ValueError(f"logprobs must be an integer in [0, {MAX_LOGPROBS}], got {k!r}")
        if not isinstance(self.speculative, bool):
            raise ValueError(f"speculative must be true or false, got {self.speculative!r}")
        if len(self.stop) > MAX_STOP_SEQUENCES:
            raise ValueError(f"stop accepts at most {MAX_STOP_SEQUENCES} sequences, got {len(self.stop)}")
        if any(len(s) > MAX_STOP_CHARS for s in self.stop):
            longest = max(len(s) for s in self.stop)
            raise ValueError(f"stop strings must be at most {MAX_STOP_CHARS} characters, got one of {longest}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW  # 1/T overflows for tiny T (vLLM's _SAMPLING_EPS)
