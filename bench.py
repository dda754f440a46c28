"""bench.py: nano-nsa measured on a GPU. Prints the device, markdown tables, and one JSON line at the end
(its device, date and command too: tools/results.py writes docs/results.md from saved runs).

  python bench.py decode --layers 9 --mtp 0 1 3  # full width, batch 1-64, context 1K-128K, MTP off / on
  python bench.py demo                           # the trained demo model: MTP vs none, greedy and sampled

Runs under torchrun too; random FP8 weights are built on the GPU, after a check that they fit.
"""

import argparse
import functools
import gc
import json
import math
import os
import statistics
import sys
import tempfile
import time

import torch

import hf_checkpoint
import nano_nsa as m
from tools.checkpoint import fill_random_cache, random_model, write_byte_tokenizer

HEADROOM = 4 << 30  # activations, graph pools and the bandwidth test beside the weights and the KV pool


def cuda_time(fn, warmup=3, iters=20):
    """Median milliseconds of fn() by CUDA events after warm-up."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def host_time(fn, iters=20, warmup=1):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / iters * 1e3


def table(title, header, rows):
    """A markdown table; header: the column names joined by " | "."""
    print(f"\n{title}\n{header}\n" + " | ".join("---" for _ in header.split(" | ")))
    for r in rows:
        print(" | ".join(f"{v:.3g}" if isinstance(v, float) else str(v) for v in r))


def hbm_bandwidth():
    """TB/s of a device-to-device copy of 2 GiB (bytes read and written): the ceiling of the kernels."""
    a = torch.empty(1 << 31, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    return 2 * a.numel() / cuda_time(lambda: b.copy_(a), 2, 10) / 1e9


def kernel_events(fn, totals=True):
    """The CUDA kernels of one call of fn (torch.profiler): totals per name, or (totals=False) each launch."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    events = prof.key_averages() if totals else prof.events()
    return [e for e in events if e.device_type.name == "CUDA"]


def busy_ms(launches):
    """The time at least one kernel runs: the union of the launches' intervals (two streams overlap)."""
    busy, end = 0.0, -math.inf
    for e in sorted(launches, key=lambda e: e.time_range.start):
        busy += max(0.0, e.time_range.end - max(e.time_range.start, end))
        end = max(end, e.time_range.end)
    return busy / 1e3


def decode_batch(llm, bs, ctx, rounds, seed=0, temperature=0.0, top_p=1.0):
    """bs requests in the decode phase with ctx positions in the KV cache (random: a step's cost does not
    depend on them) and pages for `rounds` rounds: 64 x 32K context without 2M tokens of prefill. How they
    draw is written into their rows of the decode state here (LLM.start): set it through the arguments."""
    g = torch.Generator().manual_seed(seed)
    reqs = []
    for i in range(bs):
        ids = torch.randint(6, llm.cfg.vocab_size, (ctx + 1,), generator=g).tolist()
        r = m.Request(i, ids, ctx + 1, 1 << 30, temperature, top_p, i, num_cached=ctx)
        reserved = llm.pool.reserve(r, ctx + (rounds + 3) * m.round_lookahead(llm.num_draft))
        assert reserved, "KV pool too small for the benchmark"
        reqs.append(r)
    llm.start(reqs, torch.randint(6, llm.cfg.vocab_size, (bs, llm.num_draft), device=llm.device))
    return reqs


def release(llm, reqs):
    """Accept the round in flight (the engine keeps one), then give the requests' pages back."""
    llm.settle()
    for r in reqs:
        llm.pool.release(r)


def time_rounds(llm, bs, ctx, rounds=12):
    """Wall-clock ms per decode round and tokens emitted per round. Each call launches a round, then accepts
    the one before (its one read-back): the engine keeps one in flight."""
    reqs = decode_batch(llm, bs, ctx, rounds + 2)
    for _ in range(2):  # warm-up (captures this batch's and context bound's round graph)
        llm.decode(reqs)
    n0 = sum(len(r.tokens) for r in reqs)
    ms = host_time(lambda: llm.decode(reqs), rounds, warmup=0)
    tokens = sum(len(r.tokens) for r in reqs) - n0
    release(llm, reqs)
    return ms, tokens / rounds


def verify_inputs(llm, reqs, ctx, k):
    """(tokens, meta) of a round's verify pass: k + 1 rows per request from position ctx, under the context
    bound the round's CUDA graph runs with (the indexer's width; the table padded with the dummy slot 0)."""
    width = llm.graphs.width(ctx + m.round_lookahead(k))
    table = llm.pool.table(reqs)
    padded = torch.nn.functional.pad(table, (0, max(0, width - table.shape[1])))
    start = torch.full((len(reqs),), ctx, device=llm.device)
    meta = m.Meta.decode(llm.model.ops, start, k + 1, padded[:, :width])  # (the graph's width)
    return torch.randint(6, llm.cfg.vocab_size, (len(reqs) * (k + 1),), device=llm.device), meta


def graph_of(fn):
    """fn() captured as a CUDA graph, after an eager call that builds its kernels -> the graph's replay, which
    holds fn (the graph reads the tensors fn holds: freed, their memory would be reused)."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()

    return lambda: (graph.replay(), fn)  # (fn, and the tensors it holds, live as long as the replay)


def nbytes(*mods):
    return sum(t.numel() * t.element_size() for mod in mods for t in mod.parameters())


def step_bytes(cfg, layers, bs, rows, ctx, experts):
    """Bytes a forward through `layers` must read: each weight it uses once (of the routed experts, the
    `experts` its tokens chose), per request the top-k latent rows (the FP8 cache's) and past top-k all
    indexer keys."""
    latent = min(ctx + rows, cfg.index_topk) * m.KVCache.row_bytes(cfg)
    index_keys = (ctx + rows) * (cfg.index_head_dim + 4) * (ctx + rows > cfg.index_topk)
    total = 0
    seen = iter(experts)
    for layer in layers:
        attn, ffn = layer.attn, layer.ffn
        absorbed = (attn.w_uk.numel() + attn.w_uv.numel()) * 2  # wkv_b is read as its bf16 halves
        total += nbytes(attn) - nbytes(attn.wkv_b) + absorbed + bs * (latent + index_keys)
        if isinstance(ffn, m.MoE):
            expert = nbytes(ffn.experts) // cfg.n_routed_experts
            total += nbytes(ffn.gate, ffn.shared_experts) + expert * next(seen)
        else:
            total += nbytes(ffn)
    return total


def distinct_experts(model, fn):
    """Run fn() eagerly -> (its result, the number of distinct routed experts of each MoE call, in order)."""
    seen = []
    gates = [g for g in model.modules() if isinstance(g, m.Gate)]
    hooks = [g.register_forward_hook(lambda _, x, out: seen.append(out[1].unique().numel())) for g in gates]
    try:
        result = fn()
    finally:
        for h in hooks:
            h.remove()
    return result, seen


def mtp_bytes(llm, reqs, tokens, h, meta, k, ctx):
    """Bytes of draft-extend (k+1 rows each) + k-1 draft steps (1 row each): MTP layer and head."""
    model, cache, mtp = llm.model, llm.cache, llm.model.mtp[0]
    bs = len(reqs)
    d_meta = m.Meta.decode(model.ops, torch.full((bs,), ctx + 1, device=llm.device), 1, llm.pool.table(reqs))
    _, ext = distinct_experts(model, lambda: model.mtp_forward(tokens, h, meta, cache))
    _, drf = distinct_experts(model, lambda: model.mtp_forward(tokens[:bs], h[:bs], d_meta, cache))
    extend_b = step_bytes(llm.cfg, [mtp.block], bs, k + 1, ctx, ext)
    draft_b = step_bytes(llm.cfg, [mtp.block], bs, 1, ctx, drf)
    return extend_b + (k - 1) * draft_b + k * (nbytes(mtp.eh_proj) + nbytes(model.head))


def allreduce_ms(replay):
    """Kernel ms of the NCCL all-reduces in one replay of a graph (tensor parallel; 0 at one rank)."""
    return sum(e.device_time_total for e in kernel_events(replay) if "nccl" in e.key.lower()) / 1e3


def profile_replay(fn, n_layers, bs, top=12):
    """Kernels of one replay of a graph by total device time: where a step's time goes."""
    ev = kernel_events(fn)
    n = sum(e.count for e in ev)
    ms = sum(e.device_time_total for e in ev) / 1e3
    rows = sorted(((e.key[:60], e.count, e.device_time_total / 1e3) for e in ev), key=lambda r: -r[2])[:top]
    title = f"One replay of bench's bs={bs} verify graph ({n_layers} layers): {n} kernels, {ms:.3f} kernel ms"
    table(title, "kernel | launches | ms", rows)
    return dict(kernels=n, kernel_ms=ms, top=rows)


def round_profile(llm, ctx, round_ms, verify_replay):
    """Kernels of one whole bs=1 decode round (its graph's replay and the engine's own work), per main-model
    layer (bench's verify graph), and the GPU's idle fraction: 1 - the time some kernel runs / round time."""
    reqs = decode_batch(llm, 1, ctx, 4)
    launches = kernel_events(lambda: llm.decode(reqs), totals=False)
    release(llm, reqs)
    verify = kernel_events(verify_replay)
    busy = busy_ms(launches)
    per_layer = sum(e.count for e in verify) / llm.cfg.n_layers
    res = dict(round_kernels=len(launches), kernels_per_layer=per_layer, busy_ms=busy)
    res.update(round_ms=round_ms, idle=max(0.0, 1 - busy / round_ms))
    print(f"bs=1 round: {res}", flush=True)
    return res


def mla_kernel(llm, ctx):
    """The sparse MLA kernel alone (kernels.sparse_mla over the engine's FP8 cache, every row its own top-k of
    ctx positions) at 1 to 256 rows, replayed from a CUDA graph: TFLOPS of attention work, 2 T H K (2C + R),
    and GB/s of the cache rows it gathers, T K x the row's bytes."""
    import kernels

    cfg, cache, rows = llm.cfg, llm.cache.layer(0), []
    H, C, R, K = cfg.n_heads // m.tp_size(), cfg.kv_lora_rank, cfg.qk_rope_head_dim, min(cfg.index_topk, ctx)
    for T in (1, 16, 64, 256):
        gen = torch.Generator("cuda").manual_seed(T)
        slots = 1 + torch.randperm(cache.latent.shape[0] - 1, device="cuda", generator=gen)[None, :ctx]
        pos, req = torch.full((T,), ctx - 1, device="cuda"), torch.zeros_like(slots[0, :T])
        meta = m.Meta("decode", pos, req, slots, [0, T], slots[req, pos], pos + 1)
        sel = torch.rand(T, ctx, device="cuda", generator=gen).argsort(-1)[:, :K]
        # bf16 as the engine's q (an fp32 one would time the kernel's cast to bf16 too)
        q = torch.randn(T, H, C, device="cuda", generator=gen).to(m.BF16)
        q_pe = torch.randn(T, H, R, device="cuda", generator=gen).to(m.BF16)
        ms = cuda_time(
            graph_of(functools.partial(kernels.sparse_mla, q, q_pe, cache, sel, meta, cfg.softmax_scale))
        )
        flops, gathered = 2 * T * H * K * (2 * C + R), T * K * m.KVCache.row_bytes(cfg)
        rows.append((T, H, K, ms, flops / ms / 1e9, gathered / ms / 1e6))
    title = f"Sparse MLA kernel alone (FP8 cache, {m.KVCache.row_bytes(cfg)} B a row; top-{K} of {ctx})"
    table(title, "rows | heads | top-k | ms | TFLOPS | GB/s of rows gathered", rows)
    return rows


def time_prefill(args, model, tok_dir, extra):
    """One long prompt, chunked prefill (eager), then one token."""
    kv_bytes = (args.prefill + 8192) * m.KVCache.bytes_per_token(model.cfg)
    opts = dict(max_prefill_tokens=4096, cuda_graphs=False, kv_cache_bytes=kv_bytes)
    llm = m.LLM(tok_dir, device="cuda", mtp=0, model=model, **opts)
    prompt = torch.randint(6, model.cfg.vocab_size, (args.prefill,)).tolist()
    # warm-up on the same prompt: Triton specializes integer arguments on divisibility by 16, so a shorter
    # warm-up prompt's 4095 rows would leave the 4096-row chunks' kernels to be built inside the timed call
    extra["prefill_s"] = host_time(lambda: llm.generate([prompt], max_new_tokens=1), iters=1, warmup=1) / 1e3
    print(f"prefill of a {args.prefill}-token prompt: {extra['prefill_s']:.2f} s", flush=True)


def measure_point(llm, k, bs, ctx, bw):
    """One row of the decode table -> (row, the replay of bench's verify graph)."""
    model, cfg, cache = llm.model, llm.cfg, llm.cache
    ms, toks = time_rounds(llm, bs, ctx)
    reqs = decode_batch(llm, bs, ctx, 2)
    tokens, meta = verify_inputs(llm, reqs, ctx, k)
    h, seen = distinct_experts(model, lambda: model(tokens, meta, cache))
    graph_b = step_bytes(cfg, model.layers, bs, k + 1, ctx, seen) + nbytes(model.head)  # layers and head
    read = graph_b + (mtp_bytes(llm, reqs, tokens, h, meta, k, ctx) if k else 0)  # + draft-extend, drafts
    # bench's own graph of the verify pass alone (the engine captures the whole round as one graph)
    replay = graph_of(lambda: model.logits(model(tokens, meta, cache)))
    t_layers = cuda_time(replay)
    release(llm, reqs)
    row = dict(mtp=k, bs=bs, ctx=ctx, round_ms=ms, tok_per_round=toks, tok_s=toks / ms * 1e3)
    row.update(tok_s_all_accepted=bs * (k + 1) / ms * 1e3, step_GB=read / 1e9, roofline=read / bw / ms * 1e3)
    row.update(verify_graph_ms=t_layers, verify_graph_roofline=graph_b / bw / t_layers * 1e3)
    row.update(experts=round(statistics.mean(seen), 1) if seen else 0, tp=m.tp_size())
    row.update(allreduce_ms=allreduce_ms(replay))
    print(row, flush=True)
    return row, replay


def kv_positions(points, k):
    """The KV pool of `decode` at k drafts: pages for every point's requests."""
    return max(bs * (ctx + 64 * m.round_lookahead(k)) for bs, ctx in points) + 4096


def check_fits(layers, positions, free):
    """Config.full(layers)'s weights (this rank's share), a KV pool of `positions` and headroom against `free`
    GPU bytes, before anything is allocated -> an error line naming the largest --layers that fits or None."""

    def need(n):
        cfg = m.Config.full(n_layers=n)
        whole, split = hf_checkpoint.weight_bytes(cfg, m.Transformer, m.tp_size())
        return whole + split // m.tp_size() + positions * m.KVCache.bytes_per_token(cfg) + HEADROOM

    if need(layers) <= free:
        return None
    fits = [n for n in range(layers - 1, 0, -1) if need(n) <= free]
    what = f"--layers {fits[0]} fits" if fits else "no --layers fits"
    return (
        f"error: Config.full(n_layers={layers}) needs {need(layers) / 2**30:.1f} GiB (weights, KV pool, "
        f"headroom) but the GPU has {free / 2**30:.1f} GiB free; {what}"
    )


def decode_mtp(args, model, tok_dir, k, points, bw, extra):
    """Every point at k drafts, the bs=1 profile, CUDA graphs vs eager, at the largest k the MLA kernel."""
    torch.cuda.empty_cache()
    positions = kv_positions(points, k)
    opts = dict(kv_cache_bytes=positions * m.KVCache.bytes_per_token(model.cfg), max_batch=max(args.batch))
    t0 = time.perf_counter()
    llm = m.LLM(tok_dir, device="cuda", mtp=k, model=model, **opts)
    t_setup = time.perf_counter() - t0  # the prefill kernels and a warm-up generate
    captures = []  # seconds of each round graph captured from here on (the engine captures at first use)
    capture = llm.graphs.capture
    llm.graphs.capture = lambda key: captures.append(host_time(lambda: capture(key), 1, 0) / 1e3)
    fill_random_cache(llm.cache)
    eos = llm.cfg.eos_token_id  # (the engine checked it against the tokenizer)
    llm.cfg.eos_token_id = -1  # random tokens must not end a request
    rows = []
    for bs, ctx in points:
        row, replay = measure_point(llm, k, bs, ctx, bw)
        rows.append(row)
        if bs == 1 and ctx == points[0][1]:
            extra[f"profile_mtp{k}"] = profile_replay(replay, model.cfg.n_layers, bs)
            extra[f"round_mtp{k}"] = round_profile(llm, ctx, row["round_ms"], replay)
        elif bs == max(args.batch) and ctx == points[0][1]:  # where the time of the largest batch goes
            extra[f"profile_mtp{k}_bs{bs}"] = profile_replay(replay, model.cfg.n_layers, bs)
    graphs, times = llm.graphs, ([], [])  # CUDA graphs vs eager, bs=1 at the first context: interleaved
    for _ in range(3):
        for t, llm.graphs in zip(times, (None, graphs), strict=True):  # (ends with llm.graphs = graphs)
            t.append(time_rounds(llm, 1, args.contexts[0], rounds=4)[0])
    eager_ms, graphs_ms = map(statistics.median, times)
    versus = dict(eager_ms=eager_ms, graphs_ms=graphs_ms, setup_s=t_setup, capture_s=sum(captures))
    extra[f"eager_vs_graphs_mtp{k}"] = dict(versus, graphs=len(graphs.graphs))
    if k == max(args.mtp):
        extra["mla_kernel"] = mla_kernel(llm, args.contexts[0])
    llm.cfg.eos_token_id = eos
    del llm  # (its KV pool and CUDA graphs, before the next)
    gc.collect()
    return rows


def decode(args, out):
    """Decode rounds on Config.full(--layers), random FP8 weights: tokens/s, round and verify-pass time vs the
    HBM roofline measured in the same run, the bs=1 round's kernels, graphs vs eager, sparse MLA's TFLOPS."""
    points = [(bs, ctx) for ctx in args.contexts for bs in args.batch if bs * ctx <= args.max_tokens]
    points += [(1, c) for c in args.long]
    refused = check_fits(args.layers, kv_positions(points, max(args.mtp)), torch.cuda.mem_get_info()[0])
    if refused:
        sys.exit(refused)
    bw = hbm_bandwidth() * 1e12
    cfg = m.Config.full(n_layers=args.layers)
    t0 = time.perf_counter()
    model = random_model(cfg, "cuda")
    t_build = time.perf_counter() - t0
    tok_dir = tempfile.mkdtemp()
    write_byte_tokenizer(tok_dir, cfg.vocab_size)
    per_token = m.KVCache.bytes_per_token(cfg)
    extra = dict(hbm_TBps=bw / 1e12, kv_tokens_fit=int(torch.cuda.mem_get_info()[0] * 0.9) // per_token)
    print(
        f"Config.full(n_layers={args.layers}) + MTP built in {t_build:.0f} s; HBM copy {bw / 1e12:.2f} TB/s; "
        f"KV {per_token} B/token; {extra['kv_tokens_fit']} tokens fit in 90% of the free memory",
        flush=True,
    )
    if args.prefill:
        time_prefill(args, model, tok_dir, extra)
        gc.collect()  # (its engine)
    res = []
    for k in args.mtp:
        res += decode_mtp(args, model, tok_dir, k, points, bw, extra)
    table(
        f"Decode rounds, Config.full(n_layers={args.layers}) + MTP layer, CUDA graphs; roofline = bytes the "
        f"round must read / measured HBM bandwidth ({bw / 1e12:.2f} TB/s) / round time",
        "mtp | bs | ctx | round ms | tokens/round | tokens/s | tokens/s if all drafts accepted | GB/round | "
        "roofline | verify pass ms (own graph) | its roofline | experts/MoE layer | TP ranks | all-reduce ms",
        [tuple(r.values()) for r in res],
    )
    eager = [(key, *v.values()) for key, v in extra.items() if key.startswith("eager")]
    header = "what | eager ms | graphs ms | LLM() s | capture s (graphs after LLM()) | round graphs"
    table("CUDA graphs vs eager (bs=1)", header, eager)
    rounds = [(key, *v.values()) for key, v in extra.items() if key.startswith("round_mtp")]
    header = "what | kernels in the round | kernels per layer (verify pass) | kernel ms | round ms | GPU idle"
    table("One bs=1 decode round", header, rounds)
    plain = {(r["bs"], r["ctx"]): r["round_ms"] for r in res if r["mtp"] == 0}  # (nan: --mtp without 0)
    ratios = [
        (r["mtp"], r["bs"], r["ctx"], r["round_ms"] / plain.get((r["bs"], r["ctx"]), math.nan))
        for r in res
        if r["mtp"]
    ]
    table("MTP round / plain round (same run)", "mtp | bs | ctx | ratio", ratios)
    extra.update(peak_gib=torch.cuda.max_memory_allocated() / 2**30, kv_bytes_per_token=per_token)
    print(f"peak GPU memory {extra['peak_gib']:.1f} GiB, KV {per_token} B/token")
    out.update(decode=res, decode_extra=extra)


def demo(args, out):
    """The trained demo model end to end: bench_demo.py."""
    import bench_demo

    bench_demo.demo(args, out)


MODES = dict(decode=decode, demo=demo)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=list(MODES), nargs="+")
    ap.add_argument("--layers", type=int, default=9, help="main-model layers of Config.full (decode)")
    ap.add_argument("--mtp", type=int, nargs="+", default=[0, 1, 3])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 4, 16, 64])
    ap.add_argument("--contexts", type=int, nargs="+", default=[1024, 32768])
    ap.add_argument("--long", type=int, nargs="*", default=[131072], help="contexts measured at batch 1 only")
    ap.add_argument("--max-tokens", type=int, default=64 * 32768, help="skip points above bs x context")
    ap.add_argument("--prefill", type=int, default=0, help="decode: also time a prefill of this many tokens")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench.py needs a CUDA GPU")
    m.init_distributed(torch.device("cuda"))  # torchrun --nproc-per-node N: N ranks, one GPU each
    if m.tp_rank():  # rank 0 prints the tables and the JSON line (not once per rank)
        sys.stdout = open(os.devnull, "w")
    out = dict(device=torch.cuda.get_device_name(), date=time.strftime("%Y-%m-%d"), torch=torch.__version__)
    launcher = f"torchrun --nproc-per-node {m.tp_size()}" if m.tp_size() > 1 else "python"
    out["command"] = " ".join([launcher, os.path.basename(sys.argv[0]), *sys.argv[1:]])
    print(f"device: {out['device']}, torch {out['torch']}, {out['date']}")
    for what in args.what:
        MODES[what](args, out)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
