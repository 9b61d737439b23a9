"""Compare a benchmark's JSON with the side-by-side anchors (``../shared/anchors-h200.json``).

    python3 scripts/anchors_compare.py BENCH_JSON [--anchors PATH] [--slack 0.03]
    python3 scripts/anchors_compare.py NOW_JSON --against BASELINE_JSON [--slack 0.03]

For every anchors row the benchmark timed (the full grid times all 85), prints the project's
graph time at the anchors' commit, this run's, their ratio, and the best peer's figure; then
the rows more than ``--slack`` slower than the anchors' project figure (issue 18: no row may
be) and the rows where a peer is faster. Exit status 1 when a row is over the slack.
Only the same card's figures compare: the script refuses a benchmark from another device.
With ``--against``, the baseline is another run's JSON from the same machine
(``scripts/anchors_replay.py`` at the anchors' commit) instead of the anchors' H200 column;
the peers' columns are then left out, being another card's.
"""
import argparse
import json
import sys
from pathlib import Path

KEY = ("op", "tokens", "num_experts", "topk", "block_size", "max_loras")


def row_key(r):
    return tuple(r.get(k) for k in KEY)


def project_column(anchor_rows):
    """The anchors' project graph column (named after the commit it was measured at)."""
    names = {k for r in anchor_rows for k in r if k.startswith("project_") and k.endswith("_graph_us")}
    if len(names) != 1:
        raise SystemExit(f"expected one project graph column in the anchors, found {sorted(names)}")
    return names.pop()


def uniform_rows(run):
    return {row_key(r): r for r in run["results"]
            if r["op"] != "pair" and r.get("routing", "uniform") == "uniform"}


def compare(bench, baseline_rows, column, slack):
    """The table and whether a row is over the slack: ``bench``'s graph times against
    ``baseline_rows``' ``column`` (the anchors' project column, or another run's graph_us),
    and against the peers' figures where the rows have them."""
    ours = uniform_rows(bench)
    lines, over, behind, timed = [], [], [], 0
    lines.append(f"{'op':5} {'T':>6} {'E':>5} {'K':>3} {'B':>4} {'L':>3} "
                 f"{'anchor':>8} {'now':>8} {'now/anc':>8} {'sglang':>8} {'vllm':>8}")
    for a in baseline_rows:
        r = ours.get(row_key(a))
        if r is None:
            continue
        timed += 1
        now, was = r["graph_us"], a[column]
        ratio = now / was
        sglang, vllm = a.get("sglang_graph_us"), a.get("vllm_graph_us")
        peer = min((x for x in (sglang, vllm) if x), default=None)
        label = (f"{a['op']:5} {a['tokens']:6d} {a['num_experts']:5d} {a['topk']:3d} "
                 f"{a['block_size']:4d} {a.get('max_loras') or '':>3}")
        lines.append(f"{label} {was:8.2f} {now:8.2f} {ratio:8.3f} "
                     f"{sglang if sglang else '-':>8} {vllm if vllm else '-':>8}")
        if ratio > 1 + slack:
            over.append(f"{label}  {now:.2f} vs {was:.2f} ({ratio:.3f}x)")
        if peer is not None and now > peer:
            behind.append(f"{label}  {now:.2f} vs best peer {peer:.2f}")
    lines.append("")
    lines.append(f"{timed} of {len(baseline_rows)} baseline rows timed; column {column}; "
                 f"{len(over)} more than {slack:.0%} slower than it; "
                 f"{len(behind)} behind the best peer")
    lines += [f"  over: {x}" for x in over] + [f"  behind: {x}" for x in behind]
    return "\n".join(lines), bool(over)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("bench_json")
    ap.add_argument("--anchors", default=str(Path(__file__).resolve().parents[2] / "shared"
                                             / "anchors-h200.json"))
    ap.add_argument("--against", help="a baseline run's JSON from the same machine")
    ap.add_argument("--slack", type=float, default=0.03)
    args = ap.parse_args()
    bench = json.loads(Path(args.bench_json).read_text())
    device = bench.get("versions", {}).get("device", "")
    if args.against:
        against = json.loads(Path(args.against).read_text())
        if against.get("versions", {}).get("device") != device:
            raise SystemExit("the two runs come from different devices")
        text, failed = compare(bench, list(uniform_rows(against).values()), "graph_us",
                               args.slack)
    else:
        if "H200" not in device:
            raise SystemExit(f"the anchors were measured on an H200; this ran on {device!r}")
        rows = json.loads(Path(args.anchors).read_text())["rows"]
        text, failed = compare(bench, rows, project_column(rows), args.slack)
    print(text)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
