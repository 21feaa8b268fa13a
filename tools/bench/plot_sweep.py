"""Draw a tools/bench/sweep.py JSON: output tokens/s against concurrency (ours, transformers' static
batch, its generate_batch), and TTFT / TPOT percentiles against request rate.

  python -m tools.bench.plot_sweep sweep.json docs/gpu-sweep.png   (needs matplotlib)
"""
from __future__ import annotations

import json
import sys


def main(source: str, target: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = json.load(open(source))
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for key, label, style in (("concurrency", "ours (in-flight batching)", "o-"),
                              ("hf_static", "transformers static batch", "s--")):
        rows = data[key]
        left.plot([r["concurrency"] for r in rows], [r["output_tok_s"] for r in rows], style, label=label)
    batch = data.get("hf_generate_batch") or {}
    if "output_tok_s" in batch:
        left.plot([batch["concurrency"]], [batch["output_tok_s"]], "^", markersize=9,
                  label="transformers generate_batch")
    left.set(xscale="log", yscale="log", xlabel="requests in flight", ylabel="output tokens/s",
             title="Throughput against concurrency")
    left.grid(True, which="both", alpha=0.3)
    left.legend()
    rates = data["rates"]
    x = [r["rate"] for r in rates]
    for metric, quantile, style in (("ttft_ms", "p50", "o-"), ("ttft_ms", "p99", "o:"),
                                    ("tpot_ms", "p50", "s-"), ("tpot_ms", "p99", "s:")):
        right.plot(x, [r[metric][quantile] for r in rates], style, label=f"{metric[:4].upper()} {quantile}")
    right.set(xscale="log", yscale="log", xlabel="offered requests/s (Poisson)", ylabel="ms",
              title="Latency against request rate (ours)")
    right.grid(True, which="both", alpha=0.3)
    right.legend()
    args = data["args"]
    fig.suptitle(f"{data['device']}: {args['model'].split('/')[-1]}, {args['dtype']}, "
                 f"{args['input_len']} in / {args['output_len']} out")
    fig.tight_layout()
    fig.savefig(target, dpi=110)


if __name__ == "__main__":
    main(*sys.argv[1:3])
