"""The Markdown tables of a ``peer_server.py`` result, as docs/benchmarks.md shows them.

.venv/bin/python bench/peer/peer_table.py bench/results/peer_server_<file>_<cpu>.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

LLAMA, LLAMA_NP16, KVREUSE = "llama-server", "llama-server -np 16", "kvreuse"  # the servers' names in a result


def _faster(ratio: float) -> str:
    """A speed-up as people say it: ``2.78x faster`` or ``1.45x slower``."""
    return f"{ratio:.2f}x faster" if ratio >= 1 else f"{1 / ratio:.2f}x slower"


def _s(x: float) -> str:
    return f"{x:.2f} s" if x >= 1 else f"{x * 1e3:.0f} ms"


def markdown(doc: dict) -> str:
    """The one-at-a-time table (medians, kvreuse vs llama-server), the load table, llama-bench
    and the machine's limits, from a result of ``peer_server.py``."""
    med, st, lim = doc["median"], doc["settings"], doc["limits"]
    ll, kv = med[LLAMA], med[KVREUSE]
    rows = ["| work | llama-server | kvreuse serve | kvreuse vs llama-server |", "| --- | --- | --- | --- |"]
    for s in st["sizes"]:
        k = f"cold_ttft_s_{s}"
        rows.append(f"| cold prefill {s:,} (TTFT) | {_s(ll[k])} | {_s(kv[k])} | {_faster(ll[k] / kv[k])} |")
    for s in st["sizes"]:
        k = f"cached_ttft_s_{s}"
        rows.append(f"| cached {s:,} + {st['suffix']} new (TTFT) | {_s(ll[k])} | {_s(kv[k])} | {kv[k] / ll[k]:.2f}x |")
    floor, floor_c = lim["decode_floor_tok_s"], lim["decode_cached_floor_tok_s"]
    for key, label, fl in [
        ("decode_tok_s", f"decode, batch 1, {st['decode']} tokens after {st['short']}", floor),
        (
            "decode_cached_tok_s",
            f"decode, batch 1, {st['decode']} tokens after the cached {st['sizes'][0]:,} + {st['suffix']}",
            floor_c,
        ),
    ]:
        rows.append(
            f"| {label} (floor {fl:.0f}) | {ll[key]:.1f} tok/s ({ll[key] / fl:.0%} of floor) | "
            f"{kv[key]:.1f} tok/s ({kv[key] / fl:.0%}) | {kv[key] / ll[key]:.2f}x |"
        )
    ctx = st["system"] + st["user"]
    rows.append(
        f"| a lone stream's ITL at {ctx:,} tokens of context | {ll['lone_itl_ms']:.1f} ms | "
        f"{kv['lone_itl_ms']:.1f} ms | {kv['lone_itl_ms'] / ll['lone_itl_ms']:.2f}x |"
    )
    out = ["\n".join(rows)]
    if doc["load"]:
        names = [n for n in (LLAMA, LLAMA_NP16, KVREUSE) if any(n in v for v in doc["load"].values())]
        head = "| streams | figure | " + " | ".join(names) + " |"
        load_rows = [head, "|" + " --- |" * (len(names) + 2)]
        for conc in sorted(doc["load"], key=int):
            per = doc["load"][conc]
            for key, label, fmt in [
                ("itl_p50_ms", "ITL p50", "{:.0f} ms"),
                ("itl_p99_ms", "ITL p99", "{:.0f} ms"),
                ("ttft_p50_ms", "TTFT p50", "{:.0f} ms"),
                ("output_tok_s", "aggregate output tok/s", "{:.1f}"),
            ]:
                cells = [fmt.format(per[n][key]) if n in per else "" for n in names]
                load_rows.append(f"| {conc} | {label} | " + " | ".join(cells) + " |")
            lone = [f"{med[n]['lone_itl_ms']:.1f} ms" if n in per and n in med else "" for n in names]
            load_rows.append(f"| {conc} | lone stream's ITL | " + " | ".join(lone) + " |")
        out.append("\n".join(load_rows))
    if doc["llama_bench"]:
        out.append(
            "`llama-bench -t {} -fa 1`: ".format(lim["threads"])
            + ", ".join(f"{r['test']} {r['tok_s']:.1f} tok/s" for r in doc["llama_bench"])
            + "."
        )
    g = doc["gguf"]
    out.append(
        f"Machine ({doc['machine']['cpu_model']}, `{doc['cpu_tag']}`, {lim['threads']} threads, same run): "
        f"read {lim['read_gb_s']:.1f} GB/s (`torch.sum` over 256 MB), copy {lim['copy_gb_s']:.1f} GB/s "
        f"(read + write), GEMM 2048^3 fp32 {lim['gemm_gflops_fp32']:.0f} / bf16 {lim['gemm_gflops_bf16']:.0f} "
        f"GFLOP/s; weights {g['weight_bytes'] / 1e6:.1f} MB, K/V {g['kv_bytes_per_token']:,} B per token "
        f"(f16/bf16): decode floor {floor:.0f} tok/s at {lim['decode_floor_context']} tokens of context, "
        f"{floor_c:.0f} at {lim['decode_cached_floor_context']:,}. Load average "
        f"{doc['load_average']['start'][0]:.1f} at the start, {doc['load_average']['after_servers'][0]:.1f} "
        f"after the servers; {doc['wall_s'] / 60:.0f} min."
    )
    return "\n\n".join(out)


if __name__ == "__main__":
    print(markdown(json.loads(Path(sys.argv[1]).read_text())))
