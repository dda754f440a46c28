"""tools/results.py: docs/results.md from saved bench.py runs. Each file holds one run's stdout, whose last
JSON line is the run (bench.py prints it last). The page is replaced, never appended to.

    python bench.py decode --layers 9 --mtp 0 3 --batch 1 16 64 --contexts 4096 --long 131072 > decode.txt
    python bench.py demo > demo.txt
    python tools/results.py decode.txt demo.txt            # writes docs/results.md (-o: elsewhere)

A value a run did not record prints as "-".
"""

import argparse
import json
import math
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HEADER = """# Results

The current numbers of `bench.py`, each table naming the device, date and command of the run it comes from.
`tools/results.py` writes this page from saved runs; to bring it up to date, measure again and replace it:

```bash
python bench.py decode --layers 9 --mtp 0 3 --batch 1 16 64 --contexts 4096 --long 131072 > decode.txt
python bench.py demo > demo.txt
python tools/results.py decode.txt demo.txt
```

The full-width rows run `Config.full(n_layers=9)`: the 671B model's layer shapes (3 dense and 6 MoE layers of
256 experts, and the MTP layer) with random FP8 weights, so drafts are almost never accepted: an `--mtp` row
measures what speculation costs, not what it buys. The demo model is trained: its rows show acceptance.
Roofline: the bytes a round must read (each weight it uses once, of the routed experts those its tokens chose,
each request's selected FP8 cache rows and indexer keys) / the HBM bandwidth the same run measured / the
round's time. How the GPU path gets there: [performance.md](performance.md).
"""


def load_run(path):
    """The file's last line that parses as a JSON object (the rows printed before it are Python dicts)."""
    with open(path) as f:
        for line in reversed(f.read().splitlines()):
            if line.startswith("{"):
                try:
                    return json.loads(line)
                except json.JSONDecodeError:
                    continue
    sys.exit(f"error: {path} has no JSON line (bench.py prints one when a run finishes)")


def fmt(v, spec=None):
    """v by spec, else an int in full and a float to 3 significant digits; a string as it is; None as '-'."""
    if v is None or isinstance(v, str):
        return "-" if v is None else v
    if spec or isinstance(v, int):
        return format(v, spec or ",")
    return f"{v:.{max(0, 2 - math.floor(math.log10(abs(v))))}f}" if v else "0"


def table(header, rows):
    """A markdown table's lines: header, the column names; rows, lists of cells."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(row) + " |" for row in rows]


def section(title, run, header, rows, note=None):
    """A table under its title and the line naming its run (device, date, torch, command)."""
    command = run.get("command")
    how = f"`{command}`" if command else "command not recorded"
    where = f"{run.get('device', 'device not recorded')}, {run.get('date', 'date not recorded')}"
    lines = [f"### {title}", "", f"{where}, torch {run.get('torch', '-')}: {how}", ""]
    return lines + ([note, ""] if note else []) + table(header, rows) + [""]


def decode_table(run):
    """Every decode row, its round's cost against the plain round of the same run, batch and context."""
    rows = run["decode"]
    plain = {(r["bs"], r["ctx"]): r.get("round_ms") for r in rows if r["mtp"] == 0}
    cells = []
    for r in rows:
        base, ms = plain.get((r["bs"], r["ctx"])), r.get("round_ms")
        ratio = ms / base if r["mtp"] and isinstance(ms, float) and isinstance(base, float) else None
        ctx = f"{r['ctx'] // 1024}K" if r["ctx"] % 1024 == 0 else str(r["ctx"])
        cells.append([str(r["mtp"]), str(r["bs"]), ctx, fmt(ms), fmt(r.get("tok_s"), ".0f")])
        cells[-1] += [fmt(r.get("step_GB")), fmt(r.get("roofline"), ".1%"), fmt(r.get("verify_graph_ms"))]
        cells[-1] += [fmt(r.get("verify_graph_roofline"), ".1%"), fmt(r.get("experts"), ".1f")]
        cells[-1].append(fmt(ratio, ".2f"))
    header = ["`--mtp`", "bs", "context", "round ms", "tokens/s", "GB a round", "roofline", "verify ms"]
    header += ["its roofline", "experts per MoE layer", "round / plain round"]
    ranks = max(r.get("tp", 1) for r in rows)
    title = "Decode rounds at full width, CUDA graphs"
    title += f", {ranks} tensor-parallel ranks" if ranks > 1 else ""
    extra = run.get("decode_extra", {})
    facts = [
        ("HBM copy {} TB/s", "hbm_TBps"),
        ("KV {} bytes a token", "kv_bytes_per_token"),
        ("{} tokens fit in 90% of the free memory", "kv_tokens_fit"),
        ("a prefill of `--prefill` tokens {} s", "prefill_s"),
        ("peak memory {} GiB", "peak_gib"),
    ]
    facts = [text.format(fmt(extra[key])) for text, key in facts if key in extra]
    note = "The same run: " + "; ".join(facts) + "." if facts else None
    return section(title, run, header, cells, note)


def round_table(run, extra):
    """The bs=1 round at the first context: CUDA graphs against eager, its kernels, the GPU's idle share."""
    cells = []
    for k in sorted({r["mtp"] for r in run.get("decode", [])}):
        rnd, vs = extra.get(f"round_mtp{k}", {}), extra.get(f"eager_vs_graphs_mtp{k}", {})
        if rnd or vs:
            row = [str(k), fmt(vs.get("graphs_ms")), fmt(vs.get("eager_ms")), fmt(rnd.get("round_kernels"))]
            cells.append(row + [fmt(rnd.get("kernels_per_layer"), ".1f"), fmt(rnd.get("idle"), ".1%")])
    header = ["`--mtp`", "round ms, CUDA graphs", "round ms, eager", "kernels in the round"]
    header += ["kernels per layer", "GPU idle"]
    return section("One bs=1 round", run, header, cells) if cells else []


def mla_table(run, extra):
    """The sparse MLA kernel alone, replayed from a CUDA graph."""
    rows = extra.get("mla_kernel")
    if not rows:
        return []
    cells = [[*map(str, r[:3]), fmt(r[3]), fmt(r[4], ".0f"), fmt(r[5], ".0f")] for r in rows]
    header = ["rows", "heads", "top-k", "ms", "TFLOPS", "GB/s of cache rows gathered"]
    return section("The sparse MLA kernel alone (FP8 cache)", run, header, cells)


def profile_tables(run, extra):
    """The kernels of one replay of the verify step at the largest batch, by device time."""
    lines = []
    for key, prof in extra.items():
        if key.startswith("profile_mtp") and "_bs" in key:
            k, bs = key[len("profile_mtp") :].split("_bs")
            rows = f"{int(k) + 1} row{'s' * (k != '0')} a request"
            title = f"Where the verify step's time goes: bs={bs}, `--mtp {k}` ({rows})"
            total = f"{fmt(prof.get('kernels'))} kernels, {fmt(prof.get('kernel_ms'))} ms of kernels"
            total += " in one replay of bench.py's own graph of the verify step."
            cells = [[f"`{name}`", fmt(n), fmt(ms)] for name, n, ms in prof.get("top", [])]
            lines += section(title, run, ["kernel", "launches", "ms"], cells, total)
    return lines


def demo_tables(run):
    """Greedy at bs=1 by --mtp, then sampled against greedy: every ratio within the run."""
    greedy, sampled = run.get("demo", []), run.get("demo_sampling", [])
    n = max((r["bs"] for r in sampled), default=None)
    lines = []
    if greedy:
        cells = [[str(r["mtp"]), fmt(r.get("tok_s"), ".0f"), fmt(r.get("speedup"), ".2f")] for r in greedy]
        for c, r in zip(cells, greedy, strict=True):
            c += [fmt(r.get("mean_accept"), ".2f"), f"{fmt(r.get('equal_to_mtp0'))} of {fmt(n)}"]
        header = ["`--mtp`", "tokens/s", "speedup vs `--mtp 0`", "tokens a round"]
        header += ["requests equal to `--mtp 0`"]
        title = "The demo model, greedy, bs=1 (held-out prompts x 128 new tokens, the median of 5 timings)"
        lines += section(title, run, header, cells)
    if sampled:
        cells = [[str(r["bs"]), str(r["mtp"]), fmt(r.get("tok_s"), ".0f")] for r in sampled]
        for c, r in zip(cells, sampled, strict=True):
            c += [fmt(r.get("greedy_tok_s"), ".0f"), fmt(r.get("vs_greedy"), ".2f")]
            c += [fmt(r.get("vs_mtp0"), ".2f"), fmt(r.get("mean_accept"), ".2f")]
        header = ["bs", "`--mtp`", "sampled tokens/s", "greedy tokens/s", "sampled / greedy"]
        header += ["sampled / sampled `--mtp 0`", "tokens a round (sampled)"]
        title = "The demo model, sampled (temperature 0.6, top-p 0.95, fixed seeds) against greedy"
        lines += section(title, run, header, cells)
    first = run.get("demo_first_token", [])
    if first:
        cells = [[str(r["mtp"]), str(r["bs"]), fmt(r.get("first_token_ms"), ".2f")] for r in first]
        for c, r in zip(cells, first, strict=True):
            share = {(s["bs"], s["mtp"]): s.get("greedy_prefill") for s in sampled}.get((r["bs"], r["mtp"]))
            c += [fmt(share, ".2f"), fmt(r.get("llm_s"), ".2f")]
        header = ["`--mtp`", "bs", "time to first token, ms", "prefill share of the greedy pass", "`LLM()` s"]
        title = "The demo model, time to first token (prefill and one round): a prompt alone, all in one call"
        lines += section(title, run, header, cells)
    return lines


def page(runs):
    """The whole page: the decode tables of every run that has them, then the demo's."""
    decode, demo = [], []
    for run in runs:
        extra = run.get("decode_extra", {})
        decode += decode_table(run) if run.get("decode") else []
        decode += round_table(run, extra) + mla_table(run, extra) + profile_tables(run, extra)
        demo += demo_tables(run)
    lines = [HEADER]
    lines += ["## Decode rounds: the full-width model", "", *decode] if decode else []
    lines += ["## The demo model: speculative decoding end to end", "", *demo] if demo else []
    return "\n".join(lines).rstrip() + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", help="files, each holding a bench.py run's stdout")
    ap.add_argument("-o", "--out", default=os.path.join(ROOT, "docs", "results.md"))
    args = ap.parse_args()
    text = page([load_run(path) for path in args.runs])
    with open(args.out, "w") as f:
        f.write(text)
    print(f"wrote {args.out} from {len(args.runs)} run(s)")


if __name__ == "__main__":
    main()
