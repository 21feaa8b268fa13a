"""The engine-vs-DAG table of a tools/gpu/serve_bench.sh run, as markdown, from its JSON files.

    python tools/gpu/serve_table.py gpu-results/serve            # engine-<n>.json: the last one
    python tools/gpu/serve_table.py docs/results --prefix gpu-h100-serve- --engine engine-2

One row per route and level: the engine alone, the DAG from each number of client processes
measured, the DAG's share of the engine, the run with twice the client processes against it (near
1.0: the client is not the bound), and p50 latencies of the engine and the DAG. Then, where the runs
measured them (the Triton route), the DAG's TTFT by stage.
"""
from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

NAME = re.compile(r"(?P<kind>engine|dag (?P<route>\w+)) c=(?P<c>\d+)(?: x(?P<p>\d+) clients)?")


def load(directory: Path, prefix: str, engine: str | None) -> tuple[dict, dict, str]:
    """(engine rows by level, DAG rows by (route, level, clients), device name)."""
    engines = sorted(directory.glob(f"{prefix}engine-*.json"))
    if engine:
        engines = [directory / f"{prefix}{engine}.json"]
    by_engine, by_dag, device = {}, {}, "?"
    for path in engines[-1:] + sorted(directory.glob(f"{prefix}dag-*.json")):
        report = json.loads(path.read_text())
        device = report["machine"].get("device", device) if "engine" in path.name else device
        # A route run twice in one call (serve_bench.sh's ROUTES) wrote dag-triton-2-*.json: its own rows.
        run = re.fullmatch(rf"{re.escape(prefix)}dag-(?P<run>.+?)(?:-high)?", path.stem)
        for row in report["results"]:
            m = NAME.fullmatch(row["name"])
            if m and m["kind"] == "engine":
                by_engine[int(m["c"])] = row
            elif m:
                by_dag[run["run"] if run else m["route"], int(m["c"]), int(m["p"] or 1)] = row
    return by_engine, by_dag, device


def markdown(by_engine: dict, by_dag: dict, clients: int | None = None) -> str:
    """One row per route and level. DAG tok/s from every client count measured; the ratio to the
    engine and the latencies from `clients` processes (default: the fewest above one), and beside
    it the run with twice as many: near 1.0, the client is not the bound."""
    counts = sorted({p for _, _, p in by_dag})
    pick = clients or next((p for p in counts if p > 1), 1)

    def p50(row, key):
        return f"{row[key]['p50']:,.1f}" if row and row.get(key) else "-"

    def toks(row):
        return f"{row['output_tok_s']:,.0f}" if row else "-"

    head = " | ".join(f"DAG tok/s, {p} client{'s' if p > 1 else ''}" for p in counts)
    lines = [f"| route | streams | requests | engine tok/s | {head} | DAG / engine | {2 * pick} / {pick} clients "
             f"| TTFT p50 engine / DAG ms | TPOT p50 engine / DAG ms | ITL p99 DAG ms |",
             "| --- |" + " ---: |" * (9 + len(counts))]
    for route, c in sorted({(r, c) for r, c, _ in by_dag}, key=lambda k: (not k[0].startswith("triton"), k)):
        eng = by_engine.get(c)
        dag = by_dag.get((route, c, min(pick, c))) or by_dag.get((route, c, 1))
        double = by_dag.get((route, c, 2 * pick)) if c >= 2 * pick else None
        ratio = f"{dag['output_tok_s'] / eng['output_tok_s']:.2f}" if eng else "-"
        scale = f"{double['output_tok_s'] / dag['output_tok_s']:.2f}" if double else "-"
        itl = f"{dag['itl_ms']['p99']:,.0f}" if dag.get("itl_ms") else "-"
        cells = " | ".join(toks(by_dag.get((route, c, p))) for p in counts)
        lines.append(f"| {route} | {c} | {dag['num_requests']:,} | {toks(eng)} | {cells} | {ratio} | {scale} "
                     f"| {p50(eng, 'ttft_ms')} / {p50(dag, 'ttft_ms')} | {p50(eng, 'tpot_ms')} / {p50(dag, 'tpot_ms')} "
                     f"| {itl} |")
    return "\n".join(lines)


def stages_markdown(by_dag: dict) -> str:
    """The DAG's TTFT by stage, p50 / p90 ms, for the runs that measured stages (the Triton route)."""
    staged = {key: row["ttft_stages_ms"] for key, row in sorted(by_dag.items()) if row.get("ttft_stages_ms")}
    if not staged:
        return ""
    stages = list(next(iter(staged.values())))
    lines = ["| route | streams | clients | " + " | ".join(f"{s} p50 / p90 ms" for s in stages) + " |",
             "| --- |" + " ---: |" * (2 + len(stages))]
    for (route, c, p), row in staged.items():
        cells = " | ".join(f"{row[s]['p50']:,.1f} / {row[s]['p90']:,.1f}" for s in stages)
        lines.append(f"| {route} | {c} | {p} | {cells} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("directory", type=Path)
    parser.add_argument("--prefix", default="", help="file names start with this (e.g. gpu-h100-serve-)")
    parser.add_argument("--engine", default=None, help="which engine run, e.g. engine-2 (default: the last)")
    parser.add_argument("--clients", type=int, default=None,
                        help="the DAG run the ratio and latencies come from (default: the fewest processes above 1)")
    args = parser.parse_args(argv)
    by_engine, by_dag, device = load(args.directory, args.prefix, args.engine)
    print(f"device: {device}\n" + markdown(by_engine, by_dag, args.clients))
    if stages := stages_markdown(by_dag):
        print("\nTTFT by stage (the DAG):\n" + stages)


if __name__ == "__main__":
    main()
