"""bench.py: nano-nsa measured on a GPU. Prints the device, a table per part, and one JSON line at the end.

  python bench.py attention      # kernel micro-benchmarks: indexer, sparse MLA rows, plan() cost, dense-vs-sparse
  python bench.py fp8            # FP8 linears and the grouped MoE at decode shapes, vs the HBM roofline
  python bench.py checkpoint     # write + load the full-width 2-layer checkpoint (31 GB), prefill, MTP decode
  python bench.py long-prompt    # a 32K-token prompt on the full-width attention shapes: prefill, then MTP decode

Random FP8 weights are generated on the GPU (random_model below); nothing is read from disk.
"""
import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch

import nano_nsa as m


def random_model(cfg: m.Config, device, seed=0, kernels="auto") -> m.Transformer:
    """A model with random weights generated on `device`, tensor by tensor, with the checkpoint writer's recipe and
    FP8 quantization (not its values: the generator differs by device). For GPU benchmarks of full-width layers
    that no checkpoint on disk holds; the loader itself is exercised by `load_model`."""
    with torch.device("meta"):
        model = m.Transformer(cfg)
    model = model.to_empty(device=device).eval()
    params = dict(model.named_parameters())
    for name, (shape, kind) in m.checkpoint_tensors(cfg).items():
        if kind != "scale":
            w = m.random_weight(name, shape, kind, seed, device)
            if kind == "fp8":
                w, scale = m.quantize_weight(w)
                m.load_target(params, cfg, name + "_scale_inv").copy_(scale)
            m.load_target(params, cfg, name).copy_(w if kind == "fp8" else w.to(m.stored_dtype(name, kind)))
    return m._share_mtp_copies(model).bind(m.select_ops(kernels, device))


def graph_time(fn, iters=20):
    """Median milliseconds of fn() replayed from a CUDA graph: device time, with no Python launch overhead."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return cuda_time(g.replay, 2, iters)


def cuda_time(fn, warmup=3, iters=20):
    """Median milliseconds of fn() by CUDA events after warm-up."""
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


def _rows(B, rows, ctx, S_extra=64):
    """A verify-style Meta: B requests of ctx cached tokens, `rows` decode rows each, random page tables."""
    table_ = torch.stack([torch.randperm(B * (ctx + rows) + S_extra, device="cuda")[:ctx + rows] for _ in range(B)])
    return m.Meta.build("verify", [ctx] * B, [rows] * B, table_), B * (ctx + rows) + S_extra


def attention(args, out):
    import kernels
    cfg = m.Config.full(n_layers=2)
    H, C, R, K = cfg.n_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.index_topk
    res = []
    for B, rows, ctx in [(1, 1, 1024), (1, 1, 32768), (1, 1, 131072), (1, 4, 32768), (16, 1, 32768), (64, 1, 4096),
                         (64, 4, 4096)]:
        meta, S = _rows(B, rows, ctx)
        T = B * rows
        cache = m.LayerCache(torch.randn(S, C + R, device="cuda").to(m.BF16),
                             (torch.randn(S, 128, device="cuda") * 8).to(m.FP8),
                             torch.rand(S, device="cuda") + 0.5, C)
        q8 = (torch.randn(T, 64, 128, device="cuda") * 8).to(m.FP8)
        w = torch.randn(T, 64, device="cuda")
        t_idx = cuda_time(lambda: kernels.index_topk(q8, w, cache, meta, K))
        t_plan = host_time(lambda: kernels.plan(meta, cfg))
        meta.plan = kernels.plan(meta, cfg)
        sel = kernels.index_topk(q8, w, cache, meta, K)
        slots = torch.where(sel >= 0, meta.table[meta.row_req[:, None], sel.clamp(min=0)], -1)
        q_abs, q_pe = torch.randn(T, H, C, device="cuda").to(m.BF16), torch.randn(T, H, R, device="cuda").to(m.BF16)
        t_mla = cuda_time(lambda: kernels.sparse_mla(q_abs, q_pe, cache, slots, meta, cfg.softmax_scale))
        idx_bytes = T * ctx * (128 + 4)                     # FP8 keys + scales each row reads
        mla_bytes = T * min(K, ctx) * (C + R) * 2            # gathered bf16 latent rows
        res.append(dict(B=B, rows=rows, ctx=ctx, indexer_ms=t_idx, indexer_TBps=idx_bytes / t_idx / 1e9,
                        sparse_mla_ms=t_mla, mla_TBps=mla_bytes / t_mla / 1e9, plan_ms=t_plan))
    table("Attention kernels per layer (indexer: Triton scores + top-k; sparse MLA: flashinfer FA3; plan: host)",
          ["B", "rows/req", "ctx", "indexer ms", "indexer TB/s", "sparse MLA ms", "MLA TB/s", "plan ms (host)"],
          [tuple(r.values()) for r in res])
    out["attention"] = res
    # dense (per-head SDPA, latents expanded through wkv_b) vs sparse rows for a fresh prompt of S tokens
    w_abs = torch.randn(H, 256, C, device="cuda").to(m.BF16) * 0.05
    cross = []
    for S in (128, 512, 1024, 2048):
        meta, NS = _rows(1, S, 0)
        meta = m.Meta.build("prefill", [0], [S], meta.table)
        cache = m.LayerCache(torch.randn(NS, C + R, device="cuda").to(m.BF16), None, None, C)
        q_nope, q_pe = torch.randn(S, H, 128, device="cuda").to(m.BF16), torch.randn(S, H, R, device="cuda").to(m.BF16)
        ctx = meta.table[0, :S]

        def dense():
            kvf = torch.einsum("nc,hec->nhe", cache.kv[ctx], w_abs)
            k = torch.cat([kvf[..., :128], cache.pe[ctx][:, None, :].expand(-1, H, -1)], -1)
            return kernels.dense_attention(torch.cat([q_nope, q_pe], -1), k, kvf[..., 128:], cfg.softmax_scale)
        vmeta = m.Meta.build("verify", [0], [S], meta.table)
        vmeta.plan = kernels.plan(vmeta, cfg)
        n = torch.arange(S, device="cuda")
        slots = torch.where(n <= n[:, None], meta.table[0, n][None, :].expand(S, -1), -1)

        def sparse():
            q_abs = torch.einsum("thd,hdc->thc", q_nope, w_abs[:, :128])
            o = kernels.sparse_mla(q_abs, q_pe, cache, slots, vmeta, cfg.softmax_scale)
            return torch.einsum("thc,hvc->thv", o, w_abs[:, 128:])
        cross.append((S, cuda_time(dense), cuda_time(sparse) + host_time(lambda: kernels.plan(vmeta, cfg), 3)))
    table("Prompt chunk attention, one layer: dense per-head (SDPA) vs sparse absorbed rows (FA3, plan incl.)",
          ["prompt tokens", "dense ms", "sparse rows ms"], cross)
    out["prefill_crossover"] = cross


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
    rows, sm_rows = [], []
    for name, (N, K) in dict(wq_a=(1536, 7168), wq_b=(24576, 1536), wkv_a=(576, 7168), wo=(7168, 16384),
                             dense_w1=(18432, 7168), dense_w2=(7168, 18432), indexer_wk=(128, 7168)).items():
        w, s = weight(N, K)
        for M in (1, 4, 16, 64):
            x = torch.randn(M, K, device="cuda").to(m.BF16)
            t, te = graph_time(lambda: kernels.fp8_linear(x, w, s)), cuda_time(lambda: kernels.fp8_linear(x, w, s))
            t_ref = cuda_time(lambda: m.fp8_linear(x, w, s), 1, 5)
            nbytes = N * K + 4 * s.numel() + 2 * M * (K + N)
            rows.append((name, M, nbytes / 1e6, t * 1e3, te * 1e3, nbytes / t / 1e9 / bw, t_ref / te))
            sm_rows.append((name, M, t * 1e3) + scaled_mm_time(x, w, s, t))
    w13, s13 = weight(256, 4096, 7168)
    w2, s2 = weight(256, 7168, 2048)
    for M in (1, 4, 16, 64):
        idx = torch.rand(M, 256, generator=gen, device="cuda").topk(8, -1).indices
        wts = torch.rand(M, 8, device="cuda")
        x = torch.randn(M, 7168, device="cuda").to(m.BF16)
        touched = idx.unique().numel()
        t = graph_time(lambda: kernels.moe(x, wts, idx, w13, s13, w2, s2))
        te = cuda_time(lambda: kernels.moe(x, wts, idx, w13, s13, w2, s2))
        t_ref = cuda_time(lambda: m.moe_experts(x, wts, idx, w13, s13, w2, s2), 1, 3)
        nbytes = touched * (w13[0].numel() + w2[0].numel() + 4 * (s13[0].numel() + s2[0].numel()))
        rows.append((f"moe ({touched} experts)", M, nbytes / 1e6, t * 1e3, te * 1e3, nbytes / t / 1e9 / bw, t_ref / te))
    table("torch blockwise scaled_mm (act-quant by the Triton kernel, scales in column-major) vs the Triton GEMM",
          ["kernel", "M", "Triton us (graph)", "scaled_mm us (graph)", "Triton speedup", "scaled_mm rel err / note"],
          sm_rows)
    table(f"FP8 kernels (HBM copy bandwidth measured now: {bw:.2f} TB/s)",
          ["kernel", "M", "MB read", "us (CUDA graph)", "us (eager)", "fraction of HBM bw (graph)",
           "eager speedup vs torch reference"], rows)
    out["hbm_TBps"], out["fp8"] = bw, rows


def scaled_mm_time(x, w, s, t_triton):
    """torch.nn.functional.scaled_mm with 1x128 / 128x128 block scales, the alternative to the Triton GEMM."""
    import kernels
    from torch.nn.functional import ScalingType, scaled_mm
    q, qs = kernels.act_quant(x)
    pad = -q.shape[0] % 16                                       # cuBLAS wants M in multiples of 16 here
    q, qs = torch.nn.functional.pad(q.view(torch.uint8), (0, 0, 0, pad)).view(m.FP8), \
        torch.nn.functional.pad(qs, (0, 0, 0, pad), value=1.0)
    err = None
    for sb in (s, s.t(), s.t().contiguous(), s.t().contiguous().t()):     # the layout cuBLAS accepts, first found
        fn = lambda: scaled_mm(q, w.t(), qs.t().contiguous().t(), ScalingType.BlockWise1x128,  # noqa: E731
                               sb, ScalingType.BlockWise128x128, output_dtype=m.BF16)
        try:
            y = fn()[:x.shape[0]].float()
            break
        except Exception as e:                                   # report, do not hide
            err = " ".join(str(e).split())[:90]
    else:
        return (float("nan"), float("nan"), err)
    ref = m.fp8_linear(x, w, s).float()
    t = graph_time(fn)
    return (t * 1e3, t / t_triton, f"{((y - ref).norm() / ref.norm()).item():.1e}")


def checkpoint(args, out):
    """The full-width checkpoint through the real writer and loader: write Config.full(n_layers=2) (1 dense + 1 MoE
    layer with 256 experts, + the MTP layer) to disk, load it to the GPU, prefill a prompt and decode with MTP."""
    import shutil
    cfg, path = m.Config.full(n_layers=2), "/tmp/nano-nsa-full2"
    t0 = time.perf_counter()
    m.save_random_checkpoint(path, cfg, device="cuda")
    t_write = time.perf_counter() - t0
    gb = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path)) / 1e9
    res = []
    for mtp in (1, 3):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        llm = m.LLM(path, device="cuda", mtp=mtp, kv_cache_bytes=4 << 30)
        torch.cuda.synchronize()
        t_load = time.perf_counter() - t0
        ids = torch.randint(6, cfg.vocab_size, (args.prompt,), generator=torch.Generator().manual_seed(1)).tolist()
        stamps = []
        t0 = time.perf_counter()
        r = llm.generate([ids], max_new_tokens=args.new_tokens,
                         on_tokens=lambda i, t: stamps.append(time.perf_counter()))[0]
        t_end = time.perf_counter()
        res.append(dict(mtp=mtp, write_s=t_write, GB=gb, load_s=t_load, prefill_s=stamps[0] - t0,
                        decode_tok_s=(len(r.token_ids) - 1) / (t_end - stamps[0]),
                        peak_gib=torch.cuda.max_memory_allocated() / 2**30))
        del llm
    shutil.rmtree(path)
    table(f"Full-width 2-layer checkpoint through the writer and loader ({args.prompt}-token prompt)",
          list(res[0]), [tuple(r.values()) for r in res])
    out["checkpoint"] = res


def long_prompt(args, out):
    cfg = m.Config.full(n_layers=args.layers)
    t0 = time.perf_counter()
    model = random_model(cfg, "cuda", kernels=args.kernels)
    torch.cuda.synchronize()
    t_build = time.perf_counter() - t0
    tok_dir = tempfile.mkdtemp()
    m.write_byte_tokenizer(tok_dir, cfg.vocab_size)
    res = []
    for mtp in args.mtp:
        llm = m.LLM(tok_dir, device="cuda", mtp=mtp, model=model, kv_cache_bytes=args.kv_gib << 30)
        ids = torch.randint(6, cfg.vocab_size, (args.context,), generator=torch.Generator().manual_seed(0)).tolist()
        stamps = []
        torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        r = llm.generate([ids], max_new_tokens=args.new_tokens, raw=True,
                         on_tokens=lambda i, toks: stamps.append((time.perf_counter(), len(toks))))[0]
        t_end = time.perf_counter()
        prefill = stamps[0][0] - t0
        decode = t_end - stamps[0][0]
        res.append(dict(mtp=mtp, context=args.context, prefill_s=prefill, prefill_tok_s=args.context / prefill,
                        decode_s=decode, decode_tok_s=(len(r.token_ids) - 1) / decode,
                        mean_accept=llm.stats["mean_accept_length"],
                        peak_gib=torch.cuda.max_memory_allocated() / 2**30))
    table(f"{args.context}-token prompt, Config.full(n_layers={args.layers}) + MTP (random weights built on the GPU in "
          f"{t_build:.1f} s), kernels={model.ops.name}",
          ["mtp", "context", "prefill s", "prefill tok/s", "decode s", "decode tok/s", "mean accepted", "peak GiB"],
          [tuple(r.values()) for r in res])
    out["long_prompt"] = res


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=["attention", "fp8", "checkpoint", "long-prompt"], nargs="+")
    ap.add_argument("--prompt", type=int, default=1024)
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--mtp", type=int, nargs="+", default=[1, 3])
    ap.add_argument("--kv-gib", type=int, default=8)
    ap.add_argument("--kernels", default="gpu", choices=["gpu", "torch"])
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench.py needs a CUDA GPU")
    out = dict(device=torch.cuda.get_device_name(), date=time.strftime("%Y-%m-%d"), torch=torch.__version__)
    print(f"device: {out['device']}, torch {out['torch']}, {out['date']}")
    for what in args.what:
        dict(attention=attention, fp8=fp8, checkpoint=checkpoint, **{"long-prompt": long_prompt})[what](args, out)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
