"""bench_demo.py: `python bench.py demo`, the trained demo model end to end on a GPU: tokens/s with and
without MTP, greedy and sampled, alone and in a batch; the time to first token and its share; LLM()'s time."""

import json
import math
import os
import statistics
import time

import hf_checkpoint
import nano_nsa as m
from bench import table


def demo_pass(llm, prompts, kind, bs):
    """One pass over the prompts, 128 new tokens each, each alone (bs=1) or all in one generate call, prompt i
    seeded i either way -> (tokens/s, results). kind "sampled": temperature 0.6, top_p 0.95; "first": greedy,
    one new token (the prefill and one round: the time to first token)."""
    sampling = dict(temperature=0.6, top_p=0.95) if kind == "sampled" else {}
    new = 1 if kind == "first" else 128
    t0 = time.perf_counter()
    if bs == 1:
        got = [llm.generate(p, new, seed=i, raw=True, **sampling)[0] for i, p in enumerate(prompts)]
    else:
        got = llm.generate(prompts, new, seed=0, raw=True, **sampling)
    return sum(len(r.token_ids) for r in got) / (time.perf_counter() - t0), got


def demo(args, out):
    """The demo model's held-out prompts, tokens/s end to end (the median of five passes, the settings
    interleaved so that the machine's drift falls on each alike). Greedy at bs=1, --mtp 0, 1, 3: speedup over
    --mtp 0, mean accepted length, whether the tokens equal its. Sampled vs greedy at bs=1 and at one batch of
    every prompt (one generate call), --mtp 0 and 3: their ratio, sampled --mtp 3 / 0, accepted length. The
    time to first token at each (the prefill share: the first tokens' time over the pass's); LLM()'s time."""
    with open(os.path.join(hf_checkpoint.DEMO_DIR, "eval.json")) as f:
        prompts = json.load(f)["prompts"]
    n = len(prompts)
    llms, llm_s = {}, {}
    for k in (0, 1, 3):
        t0 = time.perf_counter()
        llms[k] = m.LLM(device="cuda", mtp=k)
        llm_s[k] = time.perf_counter() - t0  # (the process's first also loads the kernels: Triton's cache)
    settings = [("greedy", 1, 1)]  # and greedy, sampled and first tokens at bs=1 and bs=n with --mtp 0, 3
    settings += [(kind, k, bs) for kind in ("greedy", "sampled", "first") for k in (0, 3) for bs in (1, n)]
    tok_s, got = timed_passes(llms, prompts, settings)
    accept = {
        s: statistics.mean(a for r in v for a in r.accept_lengths) if s[1] else 1 for s, v in got.items()
    }
    first_ms = {(k, bs): 1e3 / tok_s["first", k, bs] * (1 if bs == 1 else n) for k in (0, 3) for bs in (1, n)}

    def prefill_share(s):  # the first tokens' time over the pass's (bs=1: n of them, one after another)
        pass_s = sum(len(r.token_ids) for r in got[s]) / tok_s[s]
        return first_ms[s[1:]] * (n if s[2] == 1 else 1) / 1e3 / pass_s

    greedy, sampled = [], []
    for k in (0, 1, 3):
        s, plain = ("greedy", k, 1), ("greedy", 0, 1)
        equal = sum(a.token_ids == b.token_ids for a, b in zip(got[s], got[plain], strict=True))
        greedy.append(dict(mtp=k, tok_s=tok_s[s], speedup=tok_s[s] / tok_s[plain]))
        greedy[-1].update(
            mean_accept=accept[s], equal_to_mtp0=equal, prefill=prefill_share(s) if k != 1 else math.nan
        )
    for bs in (1, n):
        for k in (0, 3):
            s, g = ("sampled", k, bs), ("greedy", k, bs)
            row = dict(bs=bs, mtp=k, tok_s=tok_s[s], greedy_tok_s=tok_s[g], vs_greedy=tok_s[s] / tok_s[g])
            sampled.append(dict(row, vs_mtp0=tok_s[s] / tok_s["sampled", 0, bs], mean_accept=accept[s]))
            sampled[-1].update(prefill=prefill_share(s), greedy_prefill=prefill_share(g))
    table(
        f"demo model, bs=1, {n} held-out prompts x 128 new tokens, greedy, CUDA graphs, median of 5 passes",
        "--mtp | tokens/s | speedup vs --mtp 0 | mean accepted length | requests equal to --mtp 0 | "
        "prefill share",
        [tuple(r.values()) for r in greedy],
    )
    table(
        f"demo model, {n} held-out prompts x 128 new tokens, sampled (temperature 0.6, top_p 0.95, fixed "
        f"seeds) vs greedy; bs={n}: one generate call; CUDA graphs, median of 5 passes",
        "bs | --mtp | sampled tokens/s | greedy tokens/s | sampled / greedy | sampled / sampled --mtp 0 | "
        "mean accepted length (sampled) | prefill share (sampled) | prefill share (greedy)",
        [tuple(r.values()) for r in sampled],
    )
    first = first_token_table(first_ms, llm_s, n)
    out.update(demo=greedy, demo_sampling=sampled, demo_first_token=first)


def timed_passes(llms, prompts, settings):
    """Six passes of every setting (kind, --mtp, bs), interleaved; the first not timed (JIT builds, the
    graphs) -> (each setting's median tokens/s of the other five, its results: the same in every pass)."""
    speeds = {s: [] for s in settings}
    got = {}
    for i in range(6):
        for kind, k, bs in settings:
            tok_s, got[kind, k, bs] = demo_pass(llms[k], prompts, kind, bs)
            if i:
                speeds[kind, k, bs].append(tok_s)
    for s in settings:
        print(f"{s}: tokens/s of the passes {[round(x) for x in speeds[s]]}", flush=True)
    return {s: statistics.median(v) for s, v in speeds.items()}, got


def first_token_table(first_ms, llm_s, n):
    """The time to first token at --mtp 0 and 3, alone and all n in one call, beside LLM()'s time: printed,
    and returned as rows."""
    first = [
        dict(mtp=k, bs=bs, first_token_ms=first_ms[k, bs], llm_s=llm_s[k]) for k in (0, 3) for bs in (1, n)
    ]
    table(
        f"demo model, time to first token (prefill and one round): a held-out prompt alone, and all {n} in "
        "one generate call; LLM() in this process (the first: the kernels loaded too)",
        "--mtp | bs | first token ms | LLM() s",
        [tuple(r.values()) for r in first],
    )
    return first
