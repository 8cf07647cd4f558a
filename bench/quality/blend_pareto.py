"""The seam-repair Pareto curve for schema-free documents: answer agreement with full prefill
(bench/quality/blend_quality.py --mode documents, each set) against TTFT at ~4k tokens over HTTP
(bench/prefix/docs_ttft.py), for the repair settings both measured. Reads their JSON files; runs
nothing.

    python bench/quality/blend_pareto.py [--quality bench/results/blend_quality_documents_float32.json ...]
                                 [--ttft bench/results/docs_ttft.json] [--server fp32]
    -> bench/results/blend_pareto.json, bench/results/blend_pareto.png
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: bench.common
from bench.common import RESULTS, pyplot, save_png, write_json


def points(quality: list[dict], ttft: dict, server: str) -> dict[str, list[dict]]:
    """Per question set: one point per repair setting found in both (no repair included, and
    full prefill at 100% agreement), with its agreement, accuracy, recomputed share and TTFT."""
    s = ttft["servers"][server]
    # (first_tokens, ratio, deviation_layer, last_tokens) -> TTFT
    timed = {(0, 0.0, 1, 0): s["ttft_median_s"]["documents"]}
    for kind, blend in ttft["repairs"].items():
        key = (
            blend["first_tokens"],
            float(blend["ratio"]),
            blend.get("deviation_layer", 1),
            blend.get("last_tokens", 0),
        )
        timed[key] = s["ttft_median_s"][kind]
    out: dict[str, list[dict]] = {}
    for result in quality:
        for name, qs in result["sets"].items():
            rows = out.setdefault(name, [])
            if not any(r.get("full") for r in rows):
                rows.append(
                    {
                        "full": True,
                        "ttft_s": s["ttft_median_s"]["full"],
                        "answer_agreement": 1.0,
                        "accuracy": qs["full"]["accuracy"],
                        "recomputed_fraction": 1.0,
                    }
                )
            for row in qs["settings"]:
                key = (
                    row["first_tokens"],
                    float(row["ratio"]),
                    row.get("deviation_layer", 1),
                    row.get("last_tokens", 0),
                )
                if key in timed and not any(r.get("key") == list(key) for r in rows):
                    rows.append(
                        {
                            "key": list(key),
                            "ttft_s": timed[key],
                            "answer_agreement": row["answer_agreement"],
                            "accuracy": row["accuracy"],
                            "recomputed_fraction": row["recomputed_fraction"],
                        }
                    )
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quality", nargs="+", default=[str(RESULTS / "blend_quality_documents_float32.json")])
    ap.add_argument("--ttft", default=str(RESULTS / "docs_ttft.json"))
    ap.add_argument("--server", default="fp32")
    args = ap.parse_args()
    quality = [json.loads(Path(p).read_text()) for p in args.quality]
    ttft = json.loads(Path(args.ttft).read_text())
    result = {
        "server": args.server,
        "prompt_tokens": ttft["servers"][args.server]["prompt_tokens"],
        "sets": points(quality, ttft, args.server),
    }
    write_json(RESULTS / "blend_pareto.json", result)
    plot(result, RESULTS / "blend_pareto.png")


def plot(result: dict, path: Path) -> None:
    plt = pyplot()

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, rows in result["sets"].items():
        rows = sorted(rows, key=lambda r: r["ttft_s"])
        (line,) = ax.plot(
            [r["ttft_s"] for r in rows], [100 * r["answer_agreement"] for r in rows], marker="o", label=f"{name} set"
        )
        for r in rows:
            k = r.get("key")
            label = (
                "full prefill"
                if r.get("full")
                else "no repair"
                if k == [0, 0.0, 1, 0]
                else f"{k[0]}/{k[1]:g}" + (f"/last {k[3]}" if k[3] else "") + (f"/layer {k[2]}" if k[2] != 1 else "")
            )
            ax.annotate(
                label,
                (r["ttft_s"], 100 * r["answer_agreement"]),
                fontsize=7,
                xytext=(4, -9),
                textcoords="offset points",
                color=line.get_color(),
            )
    ax.set_xscale("log")
    ax.set_xlabel(f"TTFT at {result['prompt_tokens']} tokens, {result['server']}, HTTP (s, log)")
    ax.set_ylabel("answer agreement with full prefill (%)")
    ax.set_title("schema-free documents: seam repair first_tokens/ratio[/last_tokens], quality vs TTFT", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    save_png(fig, path)


if __name__ == "__main__":
    main()
