"""bench.py: nano-nsa measured on a GPU. Prints the device, a table per part, and one JSON line at the end.

  python bench.py decode --layers 9 --mtp 0 1 3   # decode rounds on the full-width model: batch 1-64, context 1K-128K,
                                                  # MTP off/on, roofline, CUDA graphs vs eager, verify cost, metadata
  python bench.py baseline                        # HF transformers vs nano-nsa on the same checkpoints on disk
  python bench.py fp8                             # FP8 linears and the grouped MoE at decode shapes, vs the roofline
  python bench.py demo                            # the trained demo model: speculative decoding (--mtp 1, 3) vs none

Random FP8 weights are generated on the GPU (random_model below). The attention micro-benchmarks, the checkpoint
write/load and the 32K-prompt runs quoted in the README came from this file at commit 4a9f43d, the torch scaled_mm
comparison from commit fea361d.
"""
import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from types import SimpleNamespace

import torch

import nano_nsa as m


def random_model(cfg: m.Config, device, seed=0, kernels="auto") -> m.Transformer:
    """A model with random weights generated on `device`, tensor by tensor, with the checkpoint writer's recipe and
    FP8 quantization (not its values: the generator differs by device). For GPU benchmarks of full-width layers
    that no checkpoint on disk holds; the loader itself is exercised by `load_model`."""
    with torch.device("meta"):
        model = m.Transformer(cfg).to_empty(device=device).eval()
    params = dict(model.named_parameters())
    for name, (shape, kind) in m.checkpoint_tensors(cfg).items():
        if kind == "scale" or m.load_target(params, cfg, name) is None:    # None: another rank's expert (torchrun)
            continue
        w = m.random_weight(name, shape, kind, seed, device)
        for n, t in zip((name, name + "_scale_inv"), m.quantize_weight(w) if kind == "fp8" else
                        [w.to(m.stored_dtype(name, kind))]):
            p = m.load_target(params, cfg, n)
            p.copy_(t[m.rank_slice(t.shape, p.shape)])                 # this rank's slice: the whole at one rank
    return m._share_mtp_copies(model).bind(m.select_ops(kernels, device))


def cuda_time(fn, warmup=3, iters=20, graph=False):
    """Median milliseconds of fn() by CUDA events after warm-up; graph=True: of fn() captured once in a CUDA graph
    and replayed (device time, with no Python launch overhead)."""
    if graph:
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            fn()
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        fn, warmup = g.replay, 2
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def host_time(fn, iters=20):
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / iters * 1e3


def table(title, header, rows):
    print(f"\n{title}\n" + " | ".join(header) + "\n" + " | ".join("---" for _ in header))
    for r in rows:
        print(" | ".join(f"{v:.3g}" if isinstance(v, float) else str(v) for v in r))


def hbm_bandwidth():
    """Device-to-device copy of 2 GiB, counting bytes read and written: the ceiling the kernels are held to."""
    a = torch.empty(1 << 31, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    return 2 * a.numel() / cuda_time(lambda: b.copy_(a), 2, 10) / 1e9           # TB/s


def fp8(args, out):
    import kernels
    bw = hbm_bandwidth()
    gen = torch.Generator("cuda").manual_seed(0)

    def weight(*shape):
        w = torch.empty(*shape, dtype=m.FP8, device="cuda")
        for i in range(0, shape[0], 16):
            w[i:i + 16] = torch.randn(w[i:i + 16].shape, generator=gen, device="cuda").to(m.FP8)
        return w, torch.full((*shape[:-2], -(-shape[-2] // 128), shape[-1] // 128), 2.0 ** -7, device="cuda")
    rows = []

    def measure(name, M, read, fn, ref, ref_iters):         # graph, eager, torch reference -> one row; graph time
        t, te = cuda_time(fn, graph=True), cuda_time(fn)
        t_ref = cuda_time(ref, 1, ref_iters)
        rows.append((name, M, read / 1e6, t * 1e3, te * 1e3, read / t / 1e9 / bw, t_ref / te))
        return t
    for name, (N, K) in dict(wq_a=(1536, 7168), wq_b=(24576, 1536), wkv_a=(576, 7168), wo=(7168, 16384),
                             dense_w1=(18432, 7168), dense_w2=(7168, 18432), indexer_wk=(128, 7168)).items():
        w, s = weight(N, K)
        for M in (1, 4, 16, 64):
            x = torch.randn(M, K, device="cuda").to(m.BF16)
            measure(name, M, N * K + 4 * s.numel() + 2 * M * (K + N), lambda: kernels.fp8_linear(x, w, s),
                    lambda: m.fp8_linear(x, w, s), 5)
    (w13, s13), (w2, s2) = weight(256, 4096, 7168), weight(256, 7168, 2048)
    for M in (1, 4, 16, 64):
        idx = torch.rand(M, 256, generator=gen, device="cuda").topk(8, -1).indices
        wts, x = torch.rand(M, 8, device="cuda"), torch.randn(M, 7168, device="cuda").to(m.BF16)
        touched = idx.unique().numel()
        read = touched * (w13[0].numel() + w2[0].numel() + 4 * (s13[0].numel() + s2[0].numel()))
        measure(f"moe ({touched} experts)", M, read, lambda: kernels.moe(x, wts, idx, w13, s13, w2, s2),
                lambda: m.moe_experts(x, wts, idx, w13, s13, w2, s2), 3)
    table(f"FP8 kernels (HBM copy bandwidth measured now: {bw:.2f} TB/s)",
          ["kernel", "M", "MB read", "us (CUDA graph)", "us (eager)", "fraction of HBM bw (graph)",
           "eager speedup vs torch reference"], rows)
    out["hbm_TBps"], out["fp8"] = bw, rows


def decode_batch(llm, bs, ctx, rounds, seed=0):
    """bs requests in the decode phase with ctx positions already in the KV cache (random values: a step's cost does
    not depend on them), so a step at 64 x 32K context is measured without 2M tokens of prefill."""
    g = torch.Generator().manual_seed(seed)
    llm.waiting, llm.running, llm.on_tokens, llm.return_logits, llm.preemptions = [], [], None, False, 0
    for i in range(bs):
        ids = torch.randint(6, llm.cfg.vocab_size, (ctx + 1,), generator=g).tolist()
        r = m.Request(i, ids, ctx + 1, 1 << 30, 0.0, 1.0, torch.Generator(llm.device), ctx + 1, num_cached=ctx)
        assert llm._reserve(r, ctx + (rounds + 3) * (2 * llm.k + 1)), "KV pool too small for the benchmark"
        r.draft = torch.randint(6, llm.cfg.vocab_size, (llm.k,), device=llm.device)
        llm.running.append(r)
    return list(llm.running)


def time_rounds(llm, bs, ctx, rounds=12):
    """Wall-clock ms per decode round (each round ends with its one read-back) and tokens emitted per round."""
    reqs = decode_batch(llm, bs, ctx, rounds + 2)
    for _ in range(2):                                       # warm-up (captures this context bound's graphs)
        llm._decode_round(list(llm.running))
    n0 = sum(len(r.tokens) for r in reqs)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(rounds):
        llm._decode_round(list(llm.running))
    torch.cuda.synchronize()
    ms = (time.perf_counter() - t0) / rounds * 1e3
    for r in reqs:
        llm._release(r)
    return ms, (sum(len(r.tokens) for r in reqs) - n0) / rounds


def nbytes(*mods):
    return sum(t.numel() * t.element_size() for mod in mods for t in mod.parameters())


def step_bytes(cfg, layers, bs, rows, ctx, experts):
    """Bytes a forward through `layers` must read from HBM: every weight it uses once (routed experts: the distinct
    ones its tokens chose, `experts` per MoE layer), and per request its KV: the top-k latent rows (576 bf16) and,
    beyond top-k, the indexer keys of the whole context (128 FP8 + fp32 scale)."""
    K = cfg.index_topk
    kv = bs * (min(ctx + rows, K) * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * 2 +
               (ctx + rows) * (cfg.index_head_dim + 4) * (ctx + rows > K))
    total, seen = 0, iter(experts)
    for layer in layers:
        attn, ffn = layer.attn, layer.ffn
        total += nbytes(attn) - nbytes(attn.wkv_b) + attn.wkv_b_abs.numel() * 2 + kv
        total += nbytes(ffn.gate, ffn.shared_experts) + nbytes(ffn.experts) // cfg.n_routed_experts * next(seen) \
            if isinstance(ffn, m.MoE) else nbytes(ffn)
    return total


def distinct_experts(model, fn):
    """Run fn() eagerly and return the number of distinct routed experts of each MoE call, in order."""
    seen = []
    hooks = [g.register_forward_hook(lambda g, x, out: seen.append(int(out[1].unique().numel())))
             for g in model.modules() if isinstance(g, m.Gate)]
    try:
        fn()
    finally:
        for h in hooks:
            h.remove()
    return seen


def decode(args, out):
    """Decode rounds on the full-width model (real layer shapes, all 256 experts, random FP8 weights built on the
    GPU): tokens/s and round time at batch 1..64 and contexts 1K / 32K (128K at batch 1), MTP off and on, against
    the memory-bandwidth roofline measured in the same run; CUDA graphs vs eager; verify rows vs a decode row;
    metadata once per step vs per layer."""
    bw, cfg, t0 = hbm_bandwidth() * 1e12, m.Config.full(n_layers=args.layers), time.perf_counter()
    model = random_model(cfg, "cuda")
    t_build, tok_dir = time.perf_counter() - t0, tempfile.mkdtemp()
    m.write_byte_tokenizer(tok_dir, cfg.vocab_size)
    res, extra = [], dict(kv_tokens_fit=int(torch.cuda.mem_get_info()[0] * 0.9) // m.KVCache.bytes_per_token(cfg))
    print(f"Config.full(n_layers={args.layers}) + MTP built in {t_build:.0f} s; HBM copy {bw / 1e12:.2f} TB/s; "
          f"KV {m.KVCache.bytes_per_token(cfg)} B/token; {extra['kv_tokens_fit']} tokens fit in 90% of the free "
          f"memory", flush=True)
    if args.prefill:                                   # one long prompt, chunked prefill (eager), then one token
        llm = m.LLM(tok_dir, device="cuda", mtp=0, model=model, max_prefill_tokens=4096, cuda_graphs=False,
                    kv_cache_bytes=(args.prefill + 8192) * m.KVCache.bytes_per_token(cfg))
        prompt = torch.randint(6, cfg.vocab_size, (args.prefill,)).tolist()
        llm.generate([prompt[:4096]], max_new_tokens=1)                         # warm-up (JIT builds)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        llm.generate([prompt], max_new_tokens=1)
        torch.cuda.synchronize()
        extra["prefill_s"] = time.perf_counter() - t0
        print(f"prefill of a {args.prefill}-token prompt: {extra['prefill_s']:.2f} s", flush=True)
        llm = None
        gc.collect()
    points = [(bs, ctx) for ctx in args.contexts for bs in args.batch if bs * ctx <= args.max_tokens]
    points += [(1, c) for c in args.long]
    for k in args.mtp:
        torch.cuda.empty_cache()
        kv = (max(bs * (ctx + 64 * (2 * k + 1)) for bs, ctx in points) + 4096) * m.KVCache.bytes_per_token(cfg)
        t0 = time.perf_counter()
        llm = m.LLM(tok_dir, device="cuda", mtp=k, model=model, kv_cache_bytes=kv, max_batch=max(args.batch))
        t_capture = time.perf_counter() - t0
        llm.cache.latent.normal_()
        for ik in llm.cache.ik:                                # layer by layer: a few GB of fp32 at a time
            ik.copy_((torch.randn(ik.shape, device="cuda") * 8).to(m.FP8))
        llm.cache.iks.uniform_(0.5, 1.5)
        eos, llm.cfg.eos_token_id = llm.cfg.eos_token_id, -1   # random tokens must not end a request
        for bs, ctx in points:
            ms, toks = time_rounds(llm, bs, ctx)
            reqs = decode_batch(llm, bs, ctx, 2)
            meta = llm._meta("verify", reqs, [ctx] * bs, k + 1)
            tokens = torch.randint(6, cfg.vocab_size, (bs * (k + 1),), device="cuda")
            h = model(tokens, meta, llm.cache)
            seen = distinct_experts(model, lambda: model(tokens, meta, llm.cache))
            layers_b, head_b, mtp_b = step_bytes(cfg, model.layers, bs, k + 1, ctx, seen), nbytes(model.head), 0
            if k:                      # draft-extend (bs x (k+1) rows) + k-1 draft steps (bs rows): MTP layer + head
                d_meta, mtp = llm._meta("decode", reqs, [ctx + 1] * bs, 1), model.mtp[0]
                ext = distinct_experts(model, lambda: model.mtp_forward(tokens, h, meta, llm.cache))
                drf = distinct_experts(model, lambda: model.mtp_forward(tokens[:bs], h[:bs], d_meta, llm.cache))
                mtp_b = step_bytes(cfg, [mtp.block], bs, k + 1, ctx, ext) + (k - 1) * step_bytes(
                    cfg, [mtp.block], bs, 1, ctx, drf) + k * (nbytes(mtp.eh_proj) + head_b)
            key = ("verify", next(b for b in llm.graphs.buckets["verify"] if b >= bs), llm.graphs.width(ctx + k + 1), 0)
            llm._forward("verify", tokens, meta)               # plan + static buffers for this step, then replay alone
            t_layers = cuda_time(llm.graphs.graphs[key][0].replay)
            parts = time_parts(model, lambda: model(tokens, llm._meta("verify", reqs, [ctx] * bs, k + 1), llm.cache),
                               llm.graphs.graphs[key][0].replay)
            if bs == 1 and ctx == points[0][1]:
                extra[f"profile_mtp{k}"] = profile_replay(llm.graphs.graphs[key][0].replay, cfg.n_layers)
            for r in reqs:
                llm._release(r)
            step_b = layers_b + head_b + mtp_b
            row = dict(mtp=k, bs=bs, ctx=ctx, round_ms=ms, tok_per_round=toks, tok_s=toks / ms * 1e3,
                       tok_s_all_accepted=bs * (k + 1) / ms * 1e3, step_GB=step_b / 1e9,
                       roofline=step_b / bw / (ms / 1e3), layers_ms=t_layers,
                       layers_roofline=layers_b / bw / (t_layers / 1e3),
                       experts=round(statistics.mean(seen), 1) if seen else 0, tp=m.tp_size(), **parts)
            res.append(row)
            print(row, flush=True)
        # CUDA graphs vs eager, bs=1 at the first context
        graphs, llm.graphs = llm.graphs, None
        eager_ms, _ = time_rounds(llm, 1, args.contexts[0], rounds=4)
        llm.graphs = graphs
        extra[f"eager_vs_graphs_mtp{k}"] = dict(eager_ms=eager_ms, graphs_ms=res[[r["mtp"] for r in res].index(k)]
                                                ["round_ms"], capture_s=t_capture, graphs=len(graphs.graphs))
        if k == max(args.mtp):
            big = max(args.batch)
            extra["metadata"] = metadata_cost(llm, cfg, k, big, max(c for b, c in points if b == big))
        llm.cfg.eos_token_id = eos
        llm = graphs = None                                    # (the engine and its graphs hold each other)
        gc.collect()
    table(f"Decode rounds, Config.full(n_layers={args.layers}) + MTP layer, CUDA graphs; roofline = bytes the round "
          f"must read / measured HBM bandwidth ({bw / 1e12:.2f} TB/s) / round time",
          ["mtp", "bs", "ctx", "round ms", "tokens/round", "tokens/s", "tokens/s if all drafts accepted", "GB/round",
           "roofline", "layers ms (graph)", "layers roofline", "experts/MoE layer", "TP ranks", "attention ms",
           "indexer ms", "MoE ms", "all-reduce ms"],
          [tuple(r.values()) for r in res])
    table("CUDA graphs vs eager (bs=1)", ["what", "eager ms", "graphs ms", "capture s", "graphs"],
          [(k_, *v.values()) for k_, v in extra.items() if k_.startswith("eager")])
    verify_attention(out)
    extra.update(peak_gib=torch.cuda.max_memory_allocated() / 2**30, kv_bytes_per_token=m.KVCache.bytes_per_token(cfg))
    print(f"peak GPU memory {extra['peak_gib']:.1f} GiB, KV {extra['kv_bytes_per_token']} B/token")
    out["decode"], out["decode_extra"] = res, extra


def verify_attention(out):
    """Attention of a verify step (4 rows of one request) at 4K and 32K context: through the decode path (each row
    its own sparse CSR row over its top-k, as the engine runs it) vs a prefill-style path (the rows as one causal
    chunk over the whole context in the per-head form, latents expanded through wkv_b, SDPA)."""
    import kernels
    cfg, res = m.Config.full(n_layers=2), []
    H, C, R, D, V, K = cfg.n_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.qk_nope_head_dim, cfg.v_head_dim, \
        cfg.index_topk
    for ctx in (4096, 32768):
        S = ctx + 4 + 64                                    # one request, 4 verify rows, a random page table
        meta = m.Meta.build("verify", [ctx], [4], torch.randperm(S, device="cuda")[None, :ctx + 4])
        cache = m.LayerCache(torch.randn(S, C + R, device="cuda").to(m.BF16), torch.zeros(S, 128, device="cuda").to(
            m.FP8), torch.ones(S, device="cuda"), C)
        meta.plan = kernels.plan(meta, cfg)
        slots = meta.table[0][torch.stack([torch.randperm(ctx, device="cuda")[:K] for _ in range(4)])]   # top-k each
        q_abs, q_pe = torch.randn(4, H, C, device="cuda").to(m.BF16), torch.randn(4, H, R, device="cuda").to(m.BF16)
        t_dec = cuda_time(lambda: kernels.sparse_mla(q_abs, q_pe, cache, slots, meta, cfg.softmax_scale))
        w = (torch.randn(H, D + V, C, device="cuda") * 0.05).to(m.BF16)
        q_nope, mla = torch.randn(4, H, D, device="cuda").to(m.BF16), SimpleNamespace(cfg=cfg, ops=kernels)
        t_pre = cuda_time(lambda: m.MLA.attend_dense(mla, q_nope, q_pe, w, meta.table[0, :ctx + 4], cache))  # as MLA
        res.append(dict(ctx=ctx, decode_rows_ms=t_dec, prefill_style_ms=t_pre, ratio=t_pre / t_dec))
    table("Verify attention, 4 rows, one layer: decode rows (sparse, top-k each) vs prefill-style (one causal chunk, "
          "per-head form, whole context)", ["ctx", "decode rows ms", "prefill-style ms", "prefill / decode"],
          [tuple(r.values()) for r in res])
    out["verify_attention"] = res


def kernel_events(fn):
    """The CUDA kernels of one call of fn (torch.profiler), totals per kernel name."""
    from torch.profiler import profile, ProfilerActivity
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e for e in prof.key_averages() if e.device_type.name == "CUDA"]


def time_parts(model, fn, replay):
    """Kernel time (ms) of one step by part: attention (MLA without its indexer), indexer, MoE (routed + shared
    experts) from one eager call of fn, with torch.profiler ranges opened and closed by forward hooks (a CPU range
    counts the kernels its ops launched); all-reduce from the NCCL kernels of one graph replay (eager, their time
    would include the ranks waiting for each other)."""
    from torch.profiler import profile, ProfilerActivity, record_function
    open_, hooks, t = [], [], dict(mla=0.0, indexer=0.0, moe=0.0)
    for mod in model.modules():
        name = {m.Indexer: "indexer", m.MLA: "mla", m.MoE: "moe"}.get(type(mod))
        if name:
            hooks += [mod.register_forward_pre_hook(lambda *_, n=name: open_.append(record_function(n).__enter__())),
                      mod.register_forward_hook(lambda *_: open_.pop().__exit__(None, None, None))]
    try:
        fn()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
    finally:
        for h in hooks:
            h.remove()
    for e in prof.events():
        if e.device_type.name == "CPU" and e.name in t:
            t[e.name] += e.device_time_total / 1e3
    ar = sum(e.device_time_total for e in kernel_events(replay) if "nccl" in e.key.lower()) / 1e3
    return dict(attention_ms=t["mla"] - t["indexer"], indexer_ms=t["indexer"], moe_ms=t["moe"], allreduce_ms=ar)


def profile_replay(fn, n_layers, top=12):
    """Kernels of one replay of a graph by total device time: where a step's time goes."""
    ev = kernel_events(fn)
    n, ms = sum(e.count for e in ev), sum(e.device_time_total for e in ev) / 1e3
    rows = sorted(((e.key[:60], e.count, e.device_time_total / 1e3) for e in ev), key=lambda r: -r[2])[:top]
    table(f"One replay of the bs=1 verify graph ({n_layers} layers): {n} kernels, {ms:.3f} ms of kernel time",
          ["kernel", "launches", "ms"], rows)
    return dict(kernels=n, kernel_ms=ms, top=rows)


def metadata_cost(llm, cfg, k, big_bs, ctx):
    """Host + device time and kernel launches of one step's metadata (Meta.build + ops.plan), and what per-layer /
    per-draft-step rebuilding would cost: the engine builds it once per step and shifts it for draft steps."""
    from torch.profiler import profile, ProfilerActivity
    res = {}
    for bs in (1, big_bs):
        reqs = decode_batch(llm, bs, ctx, 2)

        def build(j=0):
            meta = llm._meta("verify", reqs, [r.num_cached + j for r in reqs], k + 1)
            meta.plan = llm.model.ops.plan(meta, cfg)
            return meta
        build()
        t_build = host_time(lambda: build(int(time.perf_counter_ns() % 7) + 1), iters=10)   # new lengths: no reuse
        base = build(1)
        t_step = host_time(lambda: base.step(1), iters=10)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            build(9)
            torch.cuda.synchronize()
        launches = sum(e.count for e in prof.key_averages() if e.device_type.name == "CUDA")
        for r in reqs:
            llm._release(r)
        # once: verify (extend reuses it), the first draft step, then shifts; per layer: every layer and draft step
        res[f"bs{bs}"] = dict(build_ms=t_build, shift_ms=t_step, kernels=launches,
                              once_ms=2 * t_build + max(k - 2, 0) * t_step,
                              per_layer_ms=(cfg.n_layers + 1 + k - 1) * t_build, per_layer_61_ms=(62 + k - 1) * t_build)
    table(f"Metadata per decode round (mtp={k}, {ctx} context): once per step vs per layer and per draft step",
          ["bs", "build+plan ms", "shift ms", "kernels", "once/round ms", f"per layer ms ({cfg.n_layers}+1 layers)",
           "per layer ms (61+1 layers)"], [(b, *v.values()) for b, v in res.items()])
    return res


def hf_loadable(path):
    """HF's FP8 dequantization refuses a weight whose rows are not whole 128-blocks (kv_a_proj_with_mqa: 576 rows, a
    partial last block, as in the official checkpoint): store those few weights exactly dequantized to bf16, and
    tell HF not to convert them. Every other tensor stays as written."""
    from safetensors.torch import load_file, save_file
    index = os.path.join(path, "model.safetensors.index.json")
    idx = m.read_json(index)
    for shard in sorted({f for n, f in idx["weight_map"].items() if n.endswith("kv_a_proj_with_mqa.weight")}):
        ts = load_file(os.path.join(path, shard))
        for n in [n for n in ts if n.endswith("kv_a_proj_with_mqa.weight")]:
            ts[n] = m.weight_dequant(ts[n], ts.pop(n + "_scale_inv")).to(m.BF16)
            del idx["weight_map"][n + "_scale_inv"]
        save_file(ts, os.path.join(path, shard), metadata={"format": "pt"})
    hf = m.read_json(os.path.join(path, "config.json"))
    hf["quantization_config"]["modules_to_not_convert"] = ["kv_a_proj_with_mqa"]
    for file, obj in ((index, idx), (os.path.join(path, "config.json"), hf)):
        with open(file, "w") as f:
            json.dump(obj, f)


def baseline(args, out):
    """HF transformers' DeepseekV32ForCausalLM.generate vs nano-nsa on the same checkpoints on disk (the tiny one and
    the full-width 2-layer one), greedy, no MTP: tokens/s at batch 1 and 16 and greedy-token agreement. HF loads the
    FP8 weights dequantized to bf16 (its FP8 kernels are fetched from a hub at run time, impossible here)."""
    import shutil
    import transformers
    res, N = [], args.new_tokens
    for name, cfg in (("tiny", m.Config.tiny()), ("full-width 2 layers", m.Config.full(n_layers=2))):
        path = tempfile.mkdtemp()
        m.save_random_checkpoint(path, cfg, device="cuda")
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(6, 250, (32,), generator=g).tolist() for _ in range(16)]
        llm = m.LLM(path, device="cuda", mtp=0, kv_cache_bytes=2 << 30)
        llm.cfg.eos_token_id = -1                                      # N tokens each, as min_new_tokens below
        ours = {}
        for bs in (1, 16):
            llm.generate(prompts[:bs], max_new_tokens=2)
            t0 = time.perf_counter()
            toks = [r.token_ids for r in llm.generate(prompts[:bs], max_new_tokens=N)]
            ours[bs] = toks, bs * N / (time.perf_counter() - t0)
        del llm                                                      # (the engine and its graphs hold each other)
        gc.collect()
        torch.cuda.empty_cache()
        hf_loadable(path)
        hf = transformers.AutoModelForCausalLM.from_pretrained(
            path, device_map="cuda", dtype=torch.bfloat16,
            quantization_config=transformers.FineGrainedFP8Config(dequantize=True))
        for bs in (1, 16):
            ids = torch.tensor(prompts[:bs], device="cuda")
            kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=N, min_new_tokens=N, do_sample=False)
            hf.generate(ids, **{**kw, "max_new_tokens": 2, "min_new_tokens": 2})
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            theirs = hf.generate(ids, **kw)[:, ids.shape[1]:].tolist()      # (tolist waits for the GPU)
            hf_tok_s = bs * N / (time.perf_counter() - t0)
            agree = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), N) for x, y in zip(ours[bs][0], theirs)]
            res.append(dict(model=name, bs=bs, hf_tok_s=hf_tok_s, ours_tok_s=ours[bs][1],
                            speedup=ours[bs][1] / hf_tok_s, leading_equal=f"{statistics.mean(agree):.1f}/{N}",
                            all_equal=sum(a == N for a in agree)))
            print(res[-1], flush=True)
        del hf
        torch.cuda.empty_cache()
        shutil.rmtree(path)
    table(f"HF transformers {transformers.__version__} (bf16, dequantized at load) vs nano-nsa (FP8 kernels, CUDA "
          f"graphs), greedy, {N} new tokens after a 32-token prompt",
          ["model", "bs", "HF tok/s", "nano-nsa tok/s", "speedup", "mean leading equal tokens", "requests all equal"],
          [tuple(r.values()) for r in res])
    out["baseline"] = res


def demo(args, out):
    """The trained demo model (demo/): greedy completion of its held-out code prompts, one request at a time (bs=1),
    --mtp 0, 1, 3 with CUDA graphs: tokens/s end to end (prefill included), mean accepted length, speedup over
    --mtp 0 measured in the same run, and whether the tokens equal --mtp 0's."""
    with open(os.path.join(m.DEMO_DIR, "eval.json")) as f:
        prompts = json.load(f)["prompts"]
    res, plain = [], None
    for k in (0, 1, 3):
        llm = m.LLM(device="cuda", mtp=k)
        llm.generate(prompts[:2], max_new_tokens=16, raw=True)                  # JIT, graph capture
        t0, got = time.perf_counter(), [llm.generate(p, max_new_tokens=128, raw=True)[0] for p in prompts]
        tok_s = sum(len(r.token_ids) for r in got) / (time.perf_counter() - t0)
        plain = plain or (tok_s, [r.token_ids for r in got])
        rounds = [a for r in got for a in r.accept_lengths]
        res.append(dict(mtp=k, tok_s=tok_s, speedup=tok_s / plain[0], mean_accept=sum(rounds) / len(rounds) if k else 1,
                        equal_to_mtp0=sum(r.token_ids == p for r, p in zip(got, plain[1]))))
        print(res[-1], flush=True)
        del llm
        gc.collect()
    table(f"demo model, bs=1, {len(prompts)} held-out prompts x 128 new tokens, greedy, CUDA graphs",
          ["--mtp", "tokens/s", "speedup vs --mtp 0", "mean accepted length", "requests equal to --mtp 0"],
          [tuple(r.values()) for r in res])
    out["demo"] = res


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=["fp8", "decode", "baseline", "demo"], nargs="+")
    ap.add_argument("--layers", type=int, default=9, help="main-model layers of Config.full (decode)")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--mtp", type=int, nargs="+", default=[0, 1, 3])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 4, 16, 64])
    ap.add_argument("--contexts", type=int, nargs="+", default=[1024, 32768])
    ap.add_argument("--long", type=int, nargs="*", default=[131072], help="contexts measured at batch 1 only")
    ap.add_argument("--max-tokens", type=int, default=64 * 32768, help="skip points above bs x context")
    ap.add_argument("--prefill", type=int, default=0, help="decode: also time the prefill of a prompt this long")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench.py needs a CUDA GPU")
    m.init_distributed(torch.device("cuda"))          # torchrun --nproc-per-node N bench.py ...: N ranks, one GPU each
    out = dict(device=torch.cuda.get_device_name(), date=time.strftime("%Y-%m-%d"), torch=torch.__version__)
    print(f"device: {out['device']}, torch {out['torch']}, {out['date']}")
    for what in args.what:
        dict(fp8=fp8, decode=decode, baseline=baseline, demo=demo)[what](args, out)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
