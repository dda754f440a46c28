"""explain.py (the recorder) and --explain (its narration), on the demo model: what the narration says is
checked against the engine's own results and against the rules a round follows.

Run: python -m pytest -q test_explain.py        (CPU; the GPU test is marked `gpu` and skips without CUDA)

run_explain does what nano_nsa.main does with --explain (cli.parse, cli.read_prompts, LLM with
cli.engine_options, explain.attach before generate, narrate after).
"""

import os
import re
from collections import Counter

import pytest
import torch

import cli
import explain
import hf_checkpoint as hf
import nano_nsa as m

needs_demo = pytest.mark.skipif(
    not os.path.isfile(os.path.join(hf.DEMO_DIR, "config.json")), reason="demo/ checkpoint not present"
)
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

# Python source of 237 demo tokens: positions past index_topk = 128, so the indexer really selects
PROMPT = '''def merge_ranges(ranges, gap=0):
    """Merge overlapping or touching (start, stop) ranges into a sorted list of disjoint ranges."""
    merged = []
    for start, stop in sorted(ranges):
        if stop < start:
            raise ValueError("a range must not end before it starts")
        if merged and start <= merged[-1][1] + gap:
            last_start, last_stop = merged[-1]
            merged[-1] = (last_start, max(last_stop, stop))
        else:
            merged.append((start, stop))
    return merged


def count_words(lines, ignore_case=True):
    """Count how often each word occurs in the given lines of text."""
    counts = {}
    for line in lines:'''

ROW = re.compile(r"^ {13}(x_L|d\d+) +(\d+) +(\d+) +(\d+) of (\d+) +(.+)$")


def run_explain(argv):
    """nano_nsa.main's --explain path -> (engine, recorder, result, narration)."""
    args = cli.parse(argv + ["--explain"])
    prompts = cli.read_prompts(args)
    llm = m.LLM(args.model, **cli.engine_options(args))
    rec = explain.attach(llm)
    result = llm.generate(prompts, **cli.generate_options(args))[0]
    return llm, rec, result, rec.narrate(result)


def show(llm, t):
    return repr(llm.tokenizer.decode([t]))


def check_rounds(llm, result, text, k):
    """The narrated rounds: verify rows at L..L+k with causal length position + 1 and min(K, it) kept; the
    tokens each emitted are the result's, as many as its accept_lengths say; then the summary of the rest."""
    K = llm.cfg.index_topk
    sections = text.split("\nround ")[1:]
    assert len(sections) == 3, text
    done = 0  # generated tokens narrated so far
    for i, section in enumerate(sections):
        L = int(re.match(r"\d+ \(step \d+\): L = (\d+)", section)[1])
        rows = [ROW.match(line).groups() for line in section.splitlines() if ROW.match(line)]
        assert [r[0] for r in rows] == ["x_L"] + [f"d{j}" for j in range(1, k + 1)]
        for j, (_, pos, ctx, kept, of, _) in enumerate(rows):
            pos, ctx, kept, of = int(pos), int(ctx), int(kept), int(of)
            assert pos == L + j and ctx == pos + 1 and of == ctx and kept == min(K, ctx), (i, rows[j])
        assert rows[0][5] == show(llm, (llm.encode(PROMPT, raw=True) + result.token_ids)[L])  # x_L
        assert (
            "top K: the table is" in " ".join(section.split()) and int(rows[0][2]) > K
        )  # the indexer really selected
        count = int(re.search(r"emitted (\d+): (.*)", section)[1])
        assert count == result.accept_lengths[i]
        tokens = " ".join(show(llm, t) for t in result.token_ids[done : done + count])
        assert f"           emitted {count}: {tokens}\n" in section + "\n"
        done += count
    rest = Counter(result.accept_lengths[3:])
    hist = {n: rest[n] for n in range(1, k + 2)}
    summary = f"rounds by tokens emitted {hist}" in " ".join(text.split())
    assert summary == (len(result.accept_lengths) > 3), text
    assert f"finish: {result.finish_reason}" in text


def check_records(llm, rec, result, k):
    """The recorder's own data: every recorded selection is a set of min(K, causal length) distinct earlier
    positions (all of them where the context fits in K); draft-extend writes the dummy slot 0 exactly on the
    rows past what a round emitted; the drafts sit at L' + 1 .. L' + k."""
    K = llm.cfg.index_topk
    selections = [a for s in rec.steps for a in s.attention if a.selected is not None]
    assert selections and any(a.scored for a in selections)
    for a in selections:
        for row, ctx in zip(a.selected.tolist(), a.ctx_lens, strict=True):
            kept = [p for p in row if p >= 0]
            assert len(kept) == len(set(kept)) == min(K, ctx) and max(kept) < ctx
            if ctx <= K:
                assert sorted(kept) == list(range(ctx))
    first = rec.rounds[0]
    assert first.tokens[0][1:] == [first.tokens[0][1]] * k  # the prefill's guess, repeated
    for rnd in rec.rounds[: rec.detail]:
        extend = next(a for a in rnd.attention if a.phase == "extend")
        verify = rnd.verify["slots"]
        assert extend.slots == [s if j < rnd.counts[0] else 0 for j, s in enumerate(verify)]
        L2 = rnd.start[0] + rnd.counts[0]
        assert [p[0] for _, p, _ in rnd.drafts] == list(range(L2 + 1, L2 + k + 1))
    assert [r.counts[0] for r in rec.rounds if r.kept] == result.accept_lengths
    assert [t for r in rec.rounds for t in r.kept.get(0, ([], None))[0]] == result.token_ids


def check_dense(llm, rec):
    """A short prompt: the table is never wider than K, so the indexer never scores (index_topk is not
    called) and every row keeps its whole context; the narration says so."""
    rec.detach()
    assert all(mod.ops is rec.base for mod in llm.model.modules())
    short = explain.attach(llm)
    result = llm.generate([PROMPT[:60]], max_new_tokens=2, raw=True)[0]
    text = short.narrate(result)
    atts = [a for s in short.steps for a in s.attention]
    assert atts and not any(a.scored for a in atts) and all(a.kept == a.ctx_lens for a in atts)
    assert "all kept: the table is" in text and "index_topk is not called" in text, text


def explain_on(device):
    k = 3
    argv = ["--prompt", PROMPT, "--raw", "--mtp", str(k), "--max-new-tokens", "12", "--device", device]
    llm, rec, result, text = run_explain(argv)
    print(text)
    assert llm.graphs is None
    assert re.search(r"rows at positions 128\.\.\d+: kept 128 of their 129\.\.\d+ positions", text), text
    check_rounds(llm, result, text, k)
    check_records(llm, rec, result, k)
    check_dense(llm, rec)
    return llm


@needs_demo
def test_explain_narrates_what_the_engine_did_cpu():
    llm = explain_on("cpu")
    assert llm.model.ops.name == m.TORCH_OPS.name


def test_explain_flag_takes_one_prompt_and_turns_cuda_graphs_off():
    args = cli.parse(["--prompt", "a", "--explain"])
    assert args.explain and cli.engine_options(args)["cuda_graphs"] is False
    assert cli.engine_options(cli.parse(["--prompt", "a"]))["cuda_graphs"] is True
    with pytest.raises(ValueError, match=r"^--explain takes one prompt \(got 2\)$"):
        cli.read_prompts(cli.parse(["--prompt", "a", "--prompt", "b", "--explain"]))
    with pytest.raises(ValueError, match="cuda_graphs=False"):
        explain.attach(type("Engine", (), {"graphs": object()})())


@gpu
@needs_demo
def test_gpu_explain_narrates_what_the_kernels_did():
    """The same through kernels.GPU_OPS on cuda (--explain turns the CUDA graphs off)."""
    llm = explain_on("cuda")
    assert llm.model.ops.name.startswith("kernels.py")
