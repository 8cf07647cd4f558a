"""Review reproductions for the weight-only quantization merge (e192403 / 093dd04).

Run: PYTHONPATH=src nice -n 10 /work/main/.venv/bin/python -m pytest -q tests/review/test_quant_review.py
The kernel cases run in a subprocess: the bug segfaults the interpreter.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvreuse.models.quant import fast_bf16_cpu

SRC = str(Path(__file__).resolve().parents[2] / "src")
ENV = {**os.environ, "PYTHONPATH": SRC}


def _run(code: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], env=ENV, capture_output=True, text=True, timeout=timeout)


LAYER = """
import torch
from kvreuse.models.quant import Int8Linear
w = torch.randn(64, {k}, generator=torch.Generator().manual_seed(0))
layer = Int8Linear(w, None, torch.bfloat16)
x = torch.randn(3, {k}, generator=torch.Generator().manual_seed(1)).bfloat16()
ref = x.float() @ layer.dequantized_weight().float().T
rel = ((layer(x).float() - ref).norm() / ref.norm()).item()
print("relerr", rel)
assert rel < 0.02, rel
"""


@pytest.mark.parametrize("k", [16, 40, 72, 24])
def test_int8_linear_bf16_any_in_features(k):
    # _weight_int8pack_mm with bf16 activations needs in_features % 16 == 0 on this CPU:
    # k=40/72 give garbage (1e16..inf), k=24/8 segfault. Int8Linear uses the kernel anyway,
    # and quantize_model *routes* every int4 layer whose in_features % 32 != 0 to Int8Linear.
    r = _run(LAYER.format(k=k))
    assert r.returncode == 0, f"rc={r.returncode} stdout={r.stdout[-300:]} stderr={r.stderr[-300:]}"


ENGINE = """
import torch
from kvreuse import LLM, SamplingParams
from kvreuse.models.tiny import tiny_model
kw = dict(hidden_size=40, intermediate_size=72, num_heads=5, num_kv_heads=1, head_dim=8)
ref = tiny_model("llama", seed=0, dtype="bfloat16", **kw)
q = tiny_model("llama", seed=0, dtype="bfloat16", quantization="{mode}", **kw)
ids = torch.tensor([list(range(100, 120))])
with torch.inference_mode():
    a = ref.model(input_ids=ids, use_cache=False).logits.float()
    b = q.model(input_ids=ids, use_cache=False).logits.float()
print("finite", bool(torch.isfinite(b).all()), "maxdiff", (a - b).abs().max().item(), "ref max", a.abs().max().item())
assert torch.isfinite(b).all() and (a - b).abs().max() < 0.25 * a.abs().max()
out = LLM(loaded=q, kv_cache_memory_gib=0.01, block_size=4).generate([list(range(100, 130))], SamplingParams(max_tokens=4, temperature=0))
print(out[0].token_ids)
"""


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_quantized_bf16_model_with_hidden_not_multiple_of_16(mode):
    # int4 falls back to Int8Linear for in_features 40 / 72 (not multiples of 32) -> same kernel bug.
    if not fast_bf16_cpu():
        pytest.skip("the bf16 int8 kernel path is what fails; this CPU lacks native bf16")
    r = _run(ENGINE.format(mode=mode))
    assert r.returncode == 0, f"rc={r.returncode} stdout={r.stdout[-400:]} stderr={r.stderr[-400:]}"


def test_serve_startup_line_names_the_resolved_dtype_and_quantization(tmp_path):
    port = 18000 + os.getpid() % 1000
    log = tmp_path / "serve.log"
    with log.open("w") as f:
        proc = subprocess.Popen([sys.executable, "-m", "kvreuse", "serve", "--model", "tiny:llama", "--dtype", "auto",
                                 "--quantization", "int4", "--port", str(port), "--kv-cache-memory", "0.01"],
                                env=ENV, stdout=f, stderr=subprocess.STDOUT)
    try:
        deadline = time.time() + 180
        while time.time() < deadline and "listening on" not in log.read_text():
            time.sleep(1)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    line = next(ln for ln in log.read_text().splitlines() if "kvreuse: model" in ln)
    print(line)
    assert ", auto," not in line, line  # says the flag, not what it resolved to (bfloat16 / float32)
    assert "int4" in line, line  # the quantization in use is not reported at all


def test_schema_precompute_can_target_a_quantized_server():
    # serve.sh (the quick start) serves --quantization int4; module files are keyed by model_id,
    # which now includes the scheme, but `kvreuse schema precompute` cannot produce them.
    from kvreuse.pml.schema_cli import _parser
    args = _parser().parse_args(["precompute", "s.pml", "--schema-dir", "d", "--quantization", "int4"])
    assert args.quantization == "int4"
