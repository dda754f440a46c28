"""nano-nsa GPU kernels: the fast versions of the ops the layers call through `self.ops`.

Each public op has a readable torch reference of the same name and signature in nano_nsa.py (TORCH_OPS); tests
compare them on random inputs at the real shapes (test_nano.py, marked `gpu`). `GPU_OPS` at the end is the set
`nano_nsa.select_ops` binds on a GPU that `unsupported()` accepts; its `capture` (CUDA graphs) alone has no
reference (and `swiglu_linear`, which `mlp` calls: w2's half of nano_nsa.mlp).

Batch invariance: a row's result never depends on the other rows of its batch (docs/batch_invariance.md):
tile shapes and split-K come from the weight's shape, attention splits from the row's own selection, and every
reduction runs in a fixed order (no float atomics).

The FP8 act-quant, GEMMs and grouped MoE live in fp8_gemm.py, the sampling kernels in sampling_kernels.py,
both re-exported here. Triton and flashinfer are imported by these three modules only: nano_nsa imports this
one on a CUDA device alone.
"""

import gc
import sys
import threading
import time
from dataclasses import replace
from types import SimpleNamespace

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.language.extra import libdevice

from fp8_gemm import (  # noqa: F401  (re-exported: kernels.act_quant, kernels.gemm_config, ...)
    _SIDE_STREAMS,
    ACT_QUANT_GROUPS,
    BF16,
    GEMM_BLOCK_M,
    GEMM_LOCKS,
    GEMM_PARTIAL_BYTES,
    GEMM_PROGRAMS,
    GEMM_SPLITS,
    HEAD_ROWS_CACHED,
    QUANTIZED_KEPT,
    _pow2_quant,
    _rows,
    act_quant,
    dense_linear,
    fp8_linear,
    gemm_config,
    head_linear,
    moe_grouped,
    moe_layout,
    remember_quantized,
    stream_depth,
    swiglu_linear,
)
from sampling_kernels import probs_from_logits, rejection_sample, sample

try:  # Gluon, Triton's lower-level frontend (Triton >= 3.5): the Hopper sparse MLA kernel
    import mla_hopper
except ImportError:
    mla_hopper = None

# Triton keys its kernel cache by a hash of its own installation, computed at a process's first kernel call
# (about 0.4 s). Started here, on a thread (hashing releases the GIL), it overlaps the weights' loading.
if hasattr(triton.runtime.cache, "triton_key"):
    threading.Thread(target=triton.runtime.cache.triton_key, daemon=True).start()


def unsupported(device: torch.device):
    """Why the kernels cannot run on `device`, or None."""
    major, _ = torch.cuda.get_device_capability(device)
    if major not in (9, 10):
        return f"compute capability {major}.x: the kernels are for Hopper (9.0) and Blackwell (10.x)"
    if major == 9:
        return None
    try:
        import flashinfer  # noqa: F401  (Blackwell's sparse MLA)
    except ImportError:
        return "flashinfer is not installed (pip install flashinfer-python; see README)"
    return None


# ---- Lightning indexer: FP8 scores over the paged key cache, causal mask, top-k (docs/model.md §5) ---------
RANK_SELECT_PAIRS = 1 << 28  # rows x N^2 key comparisons up to which the rank kernel replaces torch.topk


@triton.jit
def _index_keys_kernel(
    q_ptr,
    qs_ptr,
    w_ptr,
    scale,
    k_ptr,
    ks_ptr,
    table_ptr,
    row_req_ptr,
    ctx_ptr,
    out_ptr,
    table_stride,
    out_stride,
    H: tl.constexpr,
    H_PAD: tl.constexpr,
    J: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """One (row t, block of context positions n): score = ks[n] * sum_h w[t, h] * relu(q8[t, h] . k8[n]), w[t,
    h] = weights[t, h] * scale * qs[t, h] (nano_nsa.head_weights' order), as a sortable int64 key: the score's
    bits made monotone in the high word, 2^31 - 1 - n in the low one, so that top-k breaks exact ties towards
    the earliest position as the reference does; n >= ctx[t] (the causal mask) gets the smallest key. H_PAD:
    the H heads padded to a tensor-core tile (>= 16)."""
    t, nb = tl.program_id(0), tl.program_id(1)
    ctx = tl.load(ctx_ptr + t)
    n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    keep = n < ctx
    key = tl.full([BLOCK_N], -(2**63), tl.int64)
    if nb * BLOCK_N < ctx:
        req = tl.load(row_req_ptr + t).to(tl.int64)
        slot = tl.load(table_ptr + req * table_stride + n, mask=keep, other=0).to(tl.int64)
        h, j = tl.arange(0, H_PAD), tl.arange(0, J)
        q = tl.load(
            q_ptr + t.to(tl.int64) * H * J + h[:, None] * J + j[None, :], mask=h[:, None] < H, other=0.0
        )
        k = tl.load(k_ptr + slot[:, None] * J + j[None, :], mask=keep[:, None], other=0.0)  # [BLOCK_N, J] fp8
        logits = tl.dot(q, tl.trans(k))  # [H_PAD, BLOCK_N] fp32
        w = tl.load(w_ptr + t * H + h, mask=h < H, other=0.0) * scale
        w = w * tl.load(qs_ptr + t * H + h, mask=h < H, other=0.0)
        s = tl.sum(tl.maximum(logits, 0.0) * w[:, None], 0) * tl.load(ks_ptr + slot, mask=keep, other=0.0)
        b = s.to(tl.int32, bitcast=True)
        b = tl.where(s == 0.0, 0, b)  # -0.0 == +0.0
        b = tl.where(b < 0, b ^ 0x7FFFFFFF, b)  # negative floats: reverse their order
        key = tl.where(keep, (b.to(tl.int64) << 32) | (0x7FFFFFFF - n).to(tl.int64), key)
    tl.store(out_ptr + t.to(tl.int64) * out_stride + n, key, mask=n < out_stride)


@triton.jit
def _rank_select_kernel(keys_ptr, ctx_ptr, out_ptr, N, width, BLOCK_I: tl.constexpr, BLOCK_J: tl.constexpr):
    """One (row t, block of positions i): the row's top-`width` positions by key, descending, without a sort:
    the keys are distinct, so i's rank (how many of the row's keys are larger) is its place in out[t] (kept if
    < width). A row whose context fits in width selects all of it instead, in position order, then -1."""
    t = tl.program_id(0).to(tl.int64)
    i = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    ctx = tl.load(ctx_ptr + t)
    out = out_ptr + t * width
    if ctx <= width:
        tl.store(out + i, tl.where(i < ctx, i, -1).to(tl.int64), mask=i < width)
    elif tl.program_id(1) * BLOCK_I < ctx:
        row = keys_ptr + t * N
        key = tl.load(row + i, mask=i < ctx, other=-(2**63))
        rank = tl.zeros([BLOCK_I], tl.int32)
        for j0 in range(0, ctx, BLOCK_J):  # keys past the context are the smallest: never larger
            j = j0 + tl.arange(0, BLOCK_J)
            other = tl.load(row + j, mask=j < ctx, other=-(2**63))
            rank += tl.sum((other[None, :] > key[:, None]).to(tl.int32), 1)
        tl.store(out + rank, i.to(tl.int64), mask=(i < ctx) & (rank < width))


def index_topk(q8, qs, weights, scale, cache, meta, topk):
    """Kernel of nano_nsa.index_topk: rows flattened over (request x draft position), each scoring only the
    keys below its own causal length, through its request's page-table row; then top-min(topk, N) per row."""
    T, H, J = q8.shape
    N = meta.max_ctx
    keys = torch.empty(T, N, dtype=torch.int64, device=q8.device)
    BLOCK_N = 64
    queries = (q8.contiguous(), qs.float().contiguous(), weights.float().contiguous(), scale)
    keys_in = (cache.ik, cache.iks, meta.table, meta.row_req, meta.ctx_lens, keys, meta.table.stride(0), N)
    H_PAD = max(16, triton.next_power_of_2(H))
    _index_keys_kernel[(T, triton.cdiv(N, BLOCK_N))](
        *queries, *keys_in, H=H, H_PAD=H_PAD, J=J, BLOCK_N=BLOCK_N, num_warps=4
    )
    width = min(topk, N)
    if T * N * N <= RANK_SELECT_PAIRS:  # few rows, short contexts (decode at small batch): rank, no sort
        selected = torch.empty(T, width, dtype=torch.int64, device=q8.device)
        _rank_select_kernel[(T, triton.cdiv(N, 16))](
            keys, meta.ctx_lens, selected, N, width, BLOCK_I=16, BLOCK_J=512, num_warps=4
        )
        return selected
    # sorted: the keys are distinct, so the order is unique (unsorted, it may follow torch's algorithm, which
    # depends on the number of rows), and sparse_mla sums a row's slots in that order
    idx = keys.topk(width, dim=-1, sorted=True).indices
    # a row whose whole context fits in topk selects all of it (its masked keys may sit anywhere in the top-k)
    n = torch.arange(width, device=q8.device)
    everything = torch.where(n < meta.ctx_lens[:, None], n, -1)
    return torch.where((meta.ctx_lens <= width)[:, None], everything, idx)


# ---- Sparse MLA: each query row over its own selected KV-pool slots, in fixed chunks of its selection ----
MLA_CHUNK = 128  # selected slots per program: a row's split follows its own selection, never the batch
MLA_BLOCK_N = 128  # slots per inner step: a chunk is one step (64-slot steps: 10-40% slower at every size)
MLA_BLOCK_H = 64  # heads per program (fewer for a model with fewer heads), whatever the number of rows
LOG2E = 1.4426950408889634  # log2(e)
MLA_HOPPER_CHUNK = 256  # selected slots per chunk of the Gluon kernel (mla_hopper), a fixed split too
MLA_HOPPER_FILL = 0.9  # the Gluon kernel's launch keeps at least this many programs, as a fraction of the SMs
MLA_PARTIAL_BYTES = 256 << 20  # bound on the fp32 partial outputs of one launch (long prefills run in parts)
WORKSPACE_BYTES = 256 << 20  # trtllm-gen's workspace (Blackwell)
_BLACKWELL = {}  # that workspace, made at the first call (zeroed, as trtllm-gen requires)
TRTLLM_PAGE = 64  # tokens a page of the rows handed to trtllm-gen (it takes 32 or 64; SGLang's cache is 64)
TRTLLM_HEADS = (32, 64, 128)  # the head counts flashinfer tests its trtllm-gen MLA at (DeepSeek's 512 + 64)


@triton.jit
def _load_latents(
    kv8_ptr, kvs_ptr, pec_ptr, slot, valid, ROW, C: tl.constexpr, R: tl.constexpr, BLOCK_N: tl.constexpr
):
    """The cache rows of BLOCK_N slots (valid: which are real) -> (latents [BLOCK_N, C] bf16, dequantized from
    FP8 and their 1x128 scales, exactly; rope keys [BLOCK_N, R] bf16)."""
    c, g, r = tl.arange(0, C), tl.arange(0, C // 128), tl.arange(0, R)
    kv = tl.load(kv8_ptr + slot[:, None] * ROW + c[None, :], mask=valid[:, None], other=0.0)  # fp8
    ks = tl.load(kvs_ptr + slot[:, None] * (ROW // 4) + g[None, :], mask=valid[:, None], other=0.0)
    kv = tl.reshape(tl.reshape(kv.to(tl.float32), [BLOCK_N, C // 128, 128]) * ks[:, :, None], [BLOCK_N, C])
    pe = tl.load(pec_ptr + slot[:, None] * (ROW // 2) + r[None, :], mask=valid[:, None], other=0.0)
    return kv.to(tl.bfloat16), pe


@triton.jit
def _sparse_mla_kernel(
    q_ptr,
    qpe_ptr,
    kv8_ptr,
    kvs_ptr,
    pec_ptr,
    sel_ptr,
    table_ptr,
    row_req_ptr,
    ctx_ptr,
    out_ptr,
    part_ptr,
    ml_ptr,
    T,
    H,
    W,
    table_stride,
    scale,
    ROW: tl.constexpr,
    C: tl.constexpr,
    R: tl.constexpr,
    SPLITS: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """One (row t, block of heads, chunk s of the row's selection): online softmax over the chunk's slots,
    BLOCK_N at a time, in order. The row's valid positions come first (min(ctx[t], W) of them); steps past
    them are skipped (they would add exact zeros), so a row's result does not depend on the batch's width.
    The cache rows (ROW bytes: kv8 | kvs | pec, typed views) are dequantized as loaded: FP8 times a power of
    two is exact in bf16, so the dot products see the values a bf16 cache held."""
    t, hb, s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = h < H
    c, r = tl.arange(0, C), tl.arange(0, R)
    qrow = t.to(tl.int64) * H + h
    q = tl.load(q_ptr + qrow[:, None] * C + c[None, :], mask=hmask[:, None], other=0.0)  # [BH, C] bf16
    qpe = tl.load(qpe_ptr + qrow[:, None] * R + r[None, :], mask=hmask[:, None], other=0.0)  # [BH, R]
    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    lsum = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, C], tl.float32)
    n_valid = tl.minimum(tl.load(ctx_ptr + t), W)
    table = table_ptr + tl.load(row_req_ptr + t).to(tl.int64) * table_stride
    for j0 in range(s * CHUNK, tl.minimum(s * CHUNK + CHUNK, n_valid), BLOCK_N):
        j = j0 + tl.arange(0, BLOCK_N)
        pos = tl.load(sel_ptr + t.to(tl.int64) * W + j, mask=j < n_valid, other=-1)
        valid = pos >= 0
        slot = tl.maximum(tl.load(table + pos, mask=valid, other=0).to(tl.int64), 0)
        kv, pe = _load_latents(kv8_ptr, kvs_ptr, pec_ptr, slot, valid, ROW, C, R, BLOCK_N)  # [BN, C], [BN, R]
        score = (tl.dot(q, tl.trans(kv)) + tl.dot(qpe, tl.trans(pe))) * scale  # [BH, BN] fp32
        score = tl.where(valid[None, :], score, float("-inf"))
        m_new = tl.maximum(m, tl.max(score, 1))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # no valid slot yet: keep zeros, not NaN
        alpha = tl.exp(m - m_ref)
        p = tl.exp(score - m_ref[:, None])
        lsum = lsum * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(kv.dtype), kv)
        m = m_new
    _mla_store(acc, m, lsum, out_ptr, part_ptr, ml_ptr, T * H, qrow, hmask, C, SPLITS)


@triton.jit
def _mla_store(
    acc, m, lsum, out_ptr, part_ptr, ml_ptr, TH, qrow, hmask, C: tl.constexpr, SPLITS: tl.constexpr
):
    """A program's end for its query rows qrow (t * H + h; hmask: real heads): SPLITS == 1, their normalized
    output; else the chunk's unnormalized partial and (max, sum) for _mla_combine_kernel (TH = T * H)."""
    c = tl.arange(0, C)
    if SPLITS == 1:
        out = (acc / lsum[:, None]).to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + qrow[:, None] * C + c[None, :], out, mask=hmask[:, None])
    else:
        part = tl.program_id(2).to(tl.int64) * TH + qrow  # [SPLITS, T, H] rows of C
        tl.store(part_ptr + part[:, None] * C + c[None, :], acc, mask=hmask[:, None])
        tl.store(ml_ptr + part * 2, m, mask=hmask)
        tl.store(ml_ptr + part * 2 + 1, lsum, mask=hmask)


@triton.jit
def _mla_combine_kernel(part_ptr, ml_ptr, out_ptr, T, H, SPLITS: tl.constexpr, C: tl.constexpr):
    """One (row, head): the chunks' partial softmaxes merged in chunk order (a chunk with no slot adds
    exact zeros; the chunk holding the maximum is weighted by exactly 1, as if it were alone)."""
    t, h = tl.program_id(0), tl.program_id(1)
    c = tl.arange(0, C)
    m_max = float("-inf")
    for s in tl.static_range(SPLITS):
        m_max = tl.maximum(m_max, tl.load(ml_ptr + ((s * T + t).to(tl.int64) * H + h) * 2))
    acc = tl.zeros([C], tl.float32)
    lsum = 0.0
    for s in tl.static_range(SPLITS):
        part = (s * T + t).to(tl.int64) * H + h
        m_s = tl.load(ml_ptr + part * 2)
        w = tl.where(m_s == m_max, 1.0, tl.exp(m_s - m_max))
        lsum += tl.load(ml_ptr + part * 2 + 1) * w
        acc += tl.load(part_ptr + part * C + c) * w
    out = acc / lsum
    tl.store(out_ptr + (t.to(tl.int64) * H + h) * C + c, out.to(out_ptr.dtype.element_ty))


def sparse_mla(q_abs, q_pe, cache, selected, meta, scale):
    """Kernel of nano_nsa.sparse_mla: bf16 q and cache, fp32 softmax and sums, bf16 out. Batch-invariant: a
    row is split into chunks of a fixed number of its own selected slots, merged in chunk order, whatever else
    runs (flashinfer's FA3 scheduler splits the KV by the number of rows: a row's bits changed with its
    batch). On Hopper at DeepSeek's shapes the rows go to mla_hopper's Gluon kernel (sparse_mla_path); on
    Blackwell to trtllm-gen, which is not batch-invariant."""
    T, H, C = q_abs.shape
    R = q_pe.shape[-1]
    path = sparse_mla_path(q_abs.device, H, C, R)
    if path == "trtllm-gen":
        return _sparse_mla_blackwell(q_abs, q_pe, cache, selected, meta, scale)
    W = selected.shape[1]
    if path == "gluon":  # (scale in log2 units: its softmax runs in exp2)
        kernel, block_h, chunk, scale = mla_hopper.sparse_mla_kernel, 64, MLA_HOPPER_CHUNK, scale * LOG2E
        config = dict(num_warps=8)
    else:
        kernel, chunk = _sparse_mla_kernel, MLA_CHUNK
        block_h = min(MLA_BLOCK_H, max(16, triton.next_power_of_2(H)))  # a launch config fixed by the model
        # (one step: nothing to pipeline; a 128-slot tile leaves no room for a second)
        config = dict(BLOCK_H=block_h, BLOCK_N=MLA_BLOCK_N, num_warps=8, num_stages=1)
    splits = triton.cdiv(W, chunk)
    config.update(C=C, R=R, SPLITS=splits, CHUNK=chunk)
    out = torch.empty(T, H, C, dtype=BF16, device=q_abs.device)
    step = max(1, MLA_PARTIAL_BYTES // (splits * H * C * 4))  # rows per launch (independent of each other)
    for t0 in range(0, T, step):
        rows = slice(t0, min(T, t0 + step))
        n = rows.stop - rows.start
        part = torch.empty(splits * n * H * C if splits > 1 else 0, dtype=torch.float32, device=q_abs.device)
        ml = torch.empty(splits * n * H * 2 if splits > 1 else 0, dtype=torch.float32, device=q_abs.device)
        q, qpe = (x[rows].to(BF16).contiguous() for x in (q_abs, q_pe))
        sel, req, ctx = (x[rows].contiguous() for x in (selected, meta.row_req, meta.ctx_lens))
        inputs = (q, qpe, cache.kv, cache.kv_scale, cache.pe, sel, meta.table, req, ctx, out[rows], part, ml)
        sizes = (n, H, W, meta.table.stride(0), scale)
        grid = (n, triton.cdiv(H, block_h), splits)
        if path == "gluon":  # (a program runs several of a row's chunks, each still its own split)
            config["CHUNKS"] = mla_hopper_chunks(n * grid[1], splits, q_abs.device)
            grid = (n, grid[1], triton.cdiv(splits, config["CHUNKS"]))
        kernel[grid](*inputs, *sizes, ROW=cache.latent.stride(0), **config)
        if splits > 1:
            _mla_combine_kernel[(n, H)](part, ml, out[rows], n, H, SPLITS=splits, C=C, num_warps=4)
    return out


def mla_hopper_chunks(programs, splits, device):
    """Chunks a program of the Gluon kernel runs one after another, for `programs` (row, 64 heads) pairs of
    `splits` chunks each: the most (a power of two) that still launch MLA_HOPPER_FILL x the SMs' count of
    programs (at top-2048 and 128 heads: 2 from 15 rows, 4 from 30, all 8 from 60). Each chunk keeps its own
    softmax and partial, merged as before, so the bits do not depend on it; only the launch does."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    chunks = 1
    while chunks < splits and programs * triton.cdiv(splits, 2 * chunks) >= sms * MLA_HOPPER_FILL:
        chunks *= 2
    return chunks


def sparse_mla_path(device, H, C, R):
    """The sparse MLA kernel for H heads over a C + R latent: "gluon" (mla_hopper) on Hopper at DeepSeek's
    512 + 64 with a multiple of 64 heads; "trtllm-gen" (_sparse_mla_blackwell) on Blackwell at the shapes
    flashinfer has it for (512 + 64, TRTLLM_HEADS heads: its tests'); else "triton" (the tiny configurations'
    4 heads of 256 + 64 may have no trtllm-gen kernel). GPU_OPS.name says which ran (the engine prints it
    after its warm-up)."""
    major = torch.cuda.get_device_capability(device)[0]
    deepseek = (C, R) == (512, 64)
    if major == 9 and deepseek and H % 64 == 0 and mla_hopper is not None:
        GPU_OPS.name = GPU_OPS_NAME.format("Gluon sparse MLA (Hopper)")
        return "gluon"
    blackwell = major == 10
    path = "trtllm-gen" if blackwell and deepseek and H in TRTLLM_HEADS else "triton"
    if blackwell:
        kernel = "flashinfer's trtllm-gen sparse MLA [unverified on hardware]"
        if path == "triton":
            kernel = f"Triton sparse MLA [trtllm-gen has none for {H} heads of {C} + {R}]"
        GPU_OPS.name = GPU_OPS_NAME.format(kernel)
    return path


def _sparse_mla_blackwell(q_abs, q_pe, cache, selected, meta, scale):
    """Blackwell (SM100/103): flashinfer's trtllm-gen sparse MLA decode (flashinfer/mla/_core.py,
    trtllm_batch_decode_with_kv_cache_mla, called as SGLang's NSA backend calls it: _forward_trtllm), every
    row a request of one query token over its own selection. The selected rows are dequantized to bf16 first
    (trtllm-gen takes one K scale, not the cache's per-128 ones) into a dense cache of 64-token pages, which
    the sparse kernel reads as flat rows: the indices name rows of it (-1 pads). UNVERIFIED ON HARDWARE: never
    run (no Blackwell GPU was available); checked against flashinfer 0.7.2.post1's argument contract on a CPU
    (test_nano.py, a stand-in that computes from the arguments). Not batch-invariant: trtllm-gen splits the KV
    by a heuristic on batch size and SM count, so a row's bits may depend on its batch (the Triton kernel
    above is batch-invariant and runs on Blackwell too)."""
    from flashinfer.mla import trtllm_batch_decode_with_kv_cache_mla

    T, H, C = q_abs.shape
    R = q_pe.shape[-1]
    W = selected.shape[1]
    # the width padded with -1 to whole pages: the kernel loads its top-k indices 4 at a time (a multiple of
    # 4), and the T x K gathered rows then fill pages of TRTLLM_PAGE tokens (trtllm-gen takes 32 or 64)
    K = triton.cdiv(W, TRTLLM_PAGE) * TRTLLM_PAGE
    selected = F.pad(selected, (0, K - W), value=-1)
    slots = meta.table[meta.row_req[:, None], selected.clamp(min=0)]  # [T, K] KV-pool slots
    kv, pe = cache.latents(slots)  # [T, K, C] fp32 (exact in bf16), [T, K, R] bf16
    pages = torch.cat([kv.to(BF16), pe], -1).view(T * K // TRTLLM_PAGE, 1, TRTLLM_PAGE, C + R)
    rows = torch.arange(T * K, dtype=torch.int32, device=q_abs.device).view(T, 1, K)  # row t: t*K + k
    if "workspace" not in _BLACKWELL:
        _BLACKWELL["workspace"] = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=q_abs.device)
    out = trtllm_batch_decode_with_kv_cache_mla(
        query=torch.cat([q_abs.to(BF16), q_pe.to(BF16)], -1)[:, None],  # [T, 1, H, C + R]
        kv_cache=pages,
        workspace_buffer=_BLACKWELL["workspace"],
        qk_nope_head_dim=128,  # DeepSeek-V3.2's (the absorbed form does not read it)
        kv_lora_rank=C,
        qk_rope_head_dim=R,
        block_tables=torch.where(selected[:, None] >= 0, rows, -1),  # [T, 1, K]
        seq_lens=meta.ctx_lens.clamp(max=W).to(torch.int32),  # a row's valid selections (they come first)
        max_seq_len=W,
        sparse_mla_top_k=K,
        bmm1_scale=scale,
        backend="trtllm-gen",
    )
    return out.view(T, H, C)


# ---- Dense causal attention: prompt chunks whose context fits in top-k (DSA selects all of it) ----
def dense_attention(q, k, v, scale):
    """Kernel of nano_nsa.dense_attention: torch SDPA (flash / memory-efficient), lower-right causal mask
    (is_causal where the chunk is the whole context, the same kernel: importing torch's mask object costs
    seconds at start, as it imports torch._dynamo)."""
    mask = None
    if q.shape[0] < k.shape[0]:  # a later chunk of a prompt
        from torch.nn.attention.bias import causal_lower_right

        mask = causal_lower_right(q.shape[0], k.shape[0])
    q, k, v = (x.transpose(0, 1)[None] for x in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale)
    return out[0].transpose(0, 1)


# ---- RMSNorm, with its output's act_quant in the same kernel ----
@triton.jit
def _rms_norm_kernel(
    x_ptr,
    r_ptr,
    w_ptr,
    y_ptr,
    res_ptr,
    q_ptr,
    s_ptr,
    x_stride,
    D,
    eps,
    RES: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """One row: (x rounded to bf16 + r) in fp32, its mean square summed in one fixed order, y = w * x / rms
    (bf16), and y's act_quant (q, s: FP8 in 1x128 groups, as fp8_gemm.act_quant)."""
    row = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, BLOCK)
    mask = d < D
    x = tl.load(x_ptr + row * x_stride + d, mask=mask, other=0.0).to(tl.bfloat16).to(tl.float32)
    if RES:
        x += tl.load(r_ptr + row * D + d, mask=mask, other=0.0).to(tl.float32)
        tl.store(res_ptr + row * D + d, x.to(tl.bfloat16), mask=mask)
    inv = tl.rsqrt(tl.sum(x * x, 0) / D + eps)
    w = tl.load(w_ptr + d, mask=mask, other=0.0)
    y = (w * (x * inv)).to(tl.bfloat16)
    tl.store(y_ptr + row * D + d, y, mask=mask)
    q, s = _pow2_quant(tl.reshape(y.to(tl.float32), [BLOCK // 128, 128]))
    tl.store(q_ptr + row * D + d, tl.reshape(q, [BLOCK]), mask=mask)
    g = tl.arange(0, BLOCK // 128)
    tl.store(s_ptr + row * (D // 128) + g, s, mask=g < D // 128)


def rms_norm(x, residual, weight, eps):
    """Kernel of nano_nsa.rms_norm: one program per row (a row's sum never depends on the number of rows); the
    output's act_quant is made in the same kernel and remembered (it feeds FP8 linears)."""
    D = x.shape[-1]
    x2 = _rows(x, D)
    T = x2.shape[0]
    y = torch.empty(T, D, dtype=BF16, device=x.device)
    q = torch.empty(T, D, dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty(T, D // 128, dtype=torch.float32, device=x.device)
    res = None
    r2 = None
    if residual is not None:
        r2 = residual.reshape(-1, D).contiguous()
        res = torch.empty(T, D, dtype=BF16, device=x.device)
    if T:
        BLOCK = triton.next_power_of_2(D)
        _rms_norm_kernel[(T,)](
            x2, r2, weight, y, res, q, s, x2.stride(0), D, eps, RES=r2 is not None, BLOCK=BLOCK, num_warps=8
        )
    y = y.view(*x.shape[:-1], D)
    remember_quantized(y, q.view(y.shape), s.view(*x.shape[:-1], D // 128))
    if residual is None:
        return y
    return y, res.view(*x.shape[:-1], D)


# ---- The router: sigmoid scores, group-limited top-k, routing weights (docs/model.md §6) -------------------
@triton.jit
def _route_kernel(
    logits_ptr,
    bias_ptr,
    w_ptr,
    idx_ptr,
    scale,
    G: tl.constexpr,
    EG: tl.constexpr,
    TOP_G: tl.constexpr,
    A: tl.constexpr,
    G_PAD: tl.constexpr,
    EG_PAD: tl.constexpr,
    A_PAD: tl.constexpr,
):
    """One token: scores = sigmoid(logits) as [G, EG]; the TOP_G groups with the largest sum of their two best
    biased scores, then the A best biased experts in them, each pick the first maximum (ties to the lowest
    index, as the reference's stable sort); weights = their unbiased scores, normalized, times scale. *_PAD:
    sizes padded (with -inf) to powers of two."""
    t = tl.program_id(0).to(tl.int64)
    g = tl.arange(0, G_PAD)
    j = tl.arange(0, EG_PAD)
    valid = (g[:, None] < G) & (j[None, :] < EG)
    e = g[:, None] * EG + j[None, :]  # [G_PAD, EG_PAD] expert ids
    logits = tl.load(logits_ptr + t * G * EG + e, mask=valid, other=0.0)
    scores = tl.math.div_rn(1.0, 1.0 + libdevice.exp(-logits))
    biased = tl.where(valid, scores + tl.load(bias_ptr + e, mask=valid, other=0.0), float("-inf"))
    best = tl.argmax(biased, 1)
    second = tl.max(tl.where(j[None, :] == best[:, None], float("-inf"), biased), 1)
    group_score = tl.max(biased, 1) + second
    kept = g < 0
    for _ in tl.static_range(TOP_G):
        pick = tl.argmax(tl.where(kept, float("-inf"), group_score), 0)
        kept = kept | (g == pick)
    candidates = tl.reshape(tl.where(kept[:, None], biased, float("-inf")), [G_PAD * EG_PAD])
    flat_scores = tl.reshape(scores, [G_PAD * EG_PAD])
    flat = tl.arange(0, G_PAD * EG_PAD)  # (g, j) in order: ties fall to the lowest expert id
    a = tl.arange(0, A_PAD)
    chosen = tl.zeros([A_PAD], dtype=tl.int64)
    weights = tl.zeros([A_PAD], dtype=tl.float32)
    for i in tl.static_range(A):
        pick = tl.argmax(candidates, 0)
        expert = (pick // EG_PAD) * EG + pick % EG_PAD
        chosen = tl.where(a == i, expert.to(tl.int64), chosen)
        weights = tl.where(a == i, tl.sum(tl.where(flat == pick, flat_scores, 0.0), 0), weights)
        candidates = tl.where(flat == pick, float("-inf"), candidates)
    total = tl.sum(weights, 0)
    tl.store(w_ptr + t * A + a, weights / total * scale, mask=a < A)
    tl.store(idx_ptr + t * A + a, chosen, mask=a < A)


def route(logits, bias, groups, top_groups, top_experts, scale):
    """Kernel of nano_nsa.route: the whole router after its product, one program per token."""
    T, E = logits.shape
    weights = torch.empty(T, top_experts, dtype=torch.float32, device=logits.device)
    idx = torch.empty(T, top_experts, dtype=torch.int64, device=logits.device)
    if T:
        pad = triton.next_power_of_2
        shape = dict(G=groups, EG=E // groups, TOP_G=top_groups, A=top_experts)
        pads = dict(G_PAD=pad(groups), EG_PAD=pad(E // groups), A_PAD=pad(top_experts))
        _route_kernel[(T,)](
            logits.float().contiguous(), bias, weights, idx, scale, **shape, **pads, num_warps=1
        )
    return weights, idx


# ---- RoPE, MLA's latent cache write, the indexer's q / k quantization: fp32 math ----
NO_FMA = dict(enable_fp_fusion=False)  # each product rounded alone, as torch's separate kernels round it
_SYLVESTER = {}  # (n, device): the n x n +-1 Sylvester-Hadamard matrix


@triton.jit
def _rotate(x1, x2, cos, sin, FIRST: tl.constexpr):
    """The rotated pair's first (x1 cos - x2 sin) or second (x1 sin + x2 cos) element (NO_FMA launches)."""
    if FIRST:
        return x1 * cos - x2 * sin
    return x1 * sin + x2 * cos


@triton.jit
def _rope_cos_sin_kernel(pos_ptr, freqs_ptr, cos_ptr, sin_ptr, T, HALF: tl.constexpr, BLOCK_T: tl.constexpr):
    """Rows [BLOCK_T] of theta = fp32(position) * f'_i, then its cos and sin: libdevice's, as torch's."""
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    i = tl.arange(0, HALF)
    theta = (
        tl.load(pos_ptr + t, mask=t < T, other=0).to(tl.float32)[:, None] * tl.load(freqs_ptr + i)[None, :]
    )
    out = t[:, None].to(tl.int64) * HALF + i[None, :]
    tl.store(cos_ptr + out, libdevice.cos(theta), mask=(t < T)[:, None])
    tl.store(sin_ptr + out, libdevice.sin(theta), mask=(t < T)[:, None])


def rope_cos_sin(freqs, positions):
    """Kernel of nano_nsa.rope_cos_sin: both in one launch (the reference: three), the same bits."""
    T, half = positions.shape[0], freqs.shape[0]
    cos, sin = torch.empty(2, T, half, dtype=torch.float32, device=positions.device)
    if T:
        grid = (triton.cdiv(T, 16),)
        _rope_cos_sin_kernel[grid](positions, freqs, cos, sin, T, HALF=half, BLOCK_T=16, num_warps=1)
    return cos, sin


@triton.jit
def _rope_kernel(
    x_ptr,
    cos_ptr,
    sin_ptr,
    y_ptr,
    H,
    x_stride,
    head_stride,
    R: tl.constexpr,
    BLOCK_H: tl.constexpr,
    INTERLEAVED: tl.constexpr,
):
    """One (row, block of heads): x[t, h] rotated by the row's position, pairs (2i, 2i+1) or (i, i + R/2)."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    i = tl.arange(0, R // 2)
    if INTERLEAVED:
        first = 2 * i
        second = 2 * i + 1
    else:
        first = i
        second = i + R // 2
    mask = h[:, None] < H
    x = x_ptr + t * x_stride + h[:, None] * head_stride
    x1 = tl.load(x + first[None, :], mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x + second[None, :], mask=mask, other=0.0).to(tl.float32)
    cos = tl.load(cos_ptr + t * (R // 2) + i)[None, :]
    sin = tl.load(sin_ptr + t * (R // 2) + i)[None, :]
    y = y_ptr + (t * H + h[:, None]) * R
    tl.store(y + first[None, :], _rotate(x1, x2, cos, sin, True).to(tl.bfloat16), mask=mask)
    tl.store(y + second[None, :], _rotate(x1, x2, cos, sin, False).to(tl.bfloat16), mask=mask)


def rope(x, cos, sin, interleaved):
    """Kernel of nano_nsa.rope for x [T, R] or [T, H, R] (any row and head strides) -> bf16, contiguous."""
    T, R = x.shape[0], x.shape[-1]
    x3 = x.view(T, 1, R) if x.dim() == 2 else x
    assert x3.stride(2) == 1
    H = x3.shape[1]
    y = torch.empty(T, H, R, dtype=BF16, device=x.device)
    BLOCK_H = min(16, triton.next_power_of_2(H))
    if T:
        config = dict(R=R, BLOCK_H=BLOCK_H, INTERLEAVED=interleaved, num_warps=1, **NO_FMA)
        _rope_kernel[(T, triton.cdiv(H, BLOCK_H))](x3, cos, sin, y, H, *x3.stride()[:2], **config)
    return y.view(x.shape)


@triton.jit
def _store_latent_kernel(
    kv_ptr,
    pe_ptr,
    w_ptr,
    cos_ptr,
    sin_ptr,
    slots_ptr,
    kv8_ptr,
    kvs_ptr,
    pec_ptr,
    kv_stride,
    pe_stride,
    ROW: tl.constexpr,
    eps,
    C: tl.constexpr,
    C_PAD: tl.constexpr,
    R: tl.constexpr,
):
    """One row: its latent RMS-normalized (fp32, one fixed sum order), rounded to bf16, quantized to FP8
    (1x128 groups, pow2 scales), and its rope key rotated (interleaved pairs), into its slot's cache row of
    ROW bytes (kv8, kvs, pec: the row's FP8 latent, fp32 scales and bf16 rope key, views of its bytes)."""
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + t).to(tl.int64)
    c = tl.arange(0, C_PAD)
    x = tl.load(kv_ptr + t * kv_stride + c, mask=c < C, other=0.0).to(tl.float32)
    inv = tl.rsqrt(tl.sum(x * x, 0) / C + eps)
    y = (tl.load(w_ptr + c, mask=c < C, other=0.0) * (x * inv)).to(tl.bfloat16).to(tl.float32)
    q, s = _pow2_quant(tl.reshape(y, [C_PAD // 128, 128]))
    tl.store(kv8_ptr + slot * ROW + c, tl.reshape(q, [C_PAD]), mask=c < C)
    g = tl.arange(0, C_PAD // 128)
    tl.store(kvs_ptr + slot * (ROW // 4) + g, s, mask=g < C // 128)
    i = tl.arange(0, R // 2)
    x1 = tl.load(pe_ptr + t * pe_stride + 2 * i).to(tl.float32)
    x2 = tl.load(pe_ptr + t * pe_stride + 2 * i + 1).to(tl.float32)
    cos = tl.load(cos_ptr + t * (R // 2) + i)
    sin = tl.load(sin_ptr + t * (R // 2) + i)
    pe_row = pec_ptr + slot * (ROW // 2)
    tl.store(pe_row + 2 * i, _rotate(x1, x2, cos, sin, True).to(tl.bfloat16))
    tl.store(pe_row + 2 * i + 1, _rotate(x1, x2, cos, sin, False).to(tl.bfloat16))


def store_latent(kv, k_pe, norm_weight, eps, cos, sin, cache, slots):
    """Kernel of nano_nsa.store_latent: MLA's cache write, one launch."""
    T, C = kv.shape
    R = k_pe.shape[1]
    assert kv.stride(1) == 1 and k_pe.stride(1) == 1
    if T:
        config = dict(C=C, C_PAD=triton.next_power_of_2(C), R=R, num_warps=4, **NO_FMA)
        row = (cache.kv, cache.kv_scale, cache.pe, kv.stride(0), k_pe.stride(0), cache.latent.stride(0))
        _store_latent_kernel[(T,)](kv, k_pe, norm_weight, cos, sin, slots, *row, eps, **config)


@triton.jit
def _index_quant_kernel(
    x_ptr,
    cos_ptr,
    sin_ptr,
    had_ptr,
    norm_w_ptr,
    norm_b_ptr,
    slots_ptr,
    q_ptr,
    s_ptr,
    M,
    heads,
    x_stride,
    had_scale,
    eps,
    R: tl.constexpr,
    J: tl.constexpr,
    BLOCK_M: tl.constexpr,
    NORM: tl.constexpr,
    SLOTS: tl.constexpr,
):
    """BLOCK_M rows (row r: token r // heads): NORM: LayerNorm first (fp32), rounded to bf16; RoPE on the
    first R dims (half-split pairs), rounded to bf16; the Hadamard transform as one tensor-core product with
    the +-1 Sylvester matrix (exact products, fp32 sums) times J^-0.5, rounded to bf16; then FP8 with one pow2
    scale per row, into row r or (SLOTS) cache row slots[r]."""
    r = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    valid = r < M
    r = r.to(tl.int64)
    t = r // heads
    c = tl.arange(0, J)
    rot = c < R
    half = c < R // 2
    partner = tl.where(half, c + R // 2, c - R // 2)
    x = tl.load(x_ptr + r[:, None] * x_stride + c[None, :], mask=valid[:, None], other=0.0).to(tl.float32)
    pair_mask = valid[:, None] & rot[None, :]
    xp = tl.load(x_ptr + r[:, None] * x_stride + partner[None, :], mask=pair_mask, other=0.0).to(tl.float32)
    if NORM:
        x, xp = _layer_norm(x, xp, partner, norm_w_ptr, norm_b_ptr, eps, J)
    i = c % (R // 2)
    cos = tl.load(cos_ptr + t[:, None] * (R // 2) + i[None, :], mask=pair_mask, other=0.0)
    sin = tl.load(sin_ptr + t[:, None] * (R // 2) + i[None, :], mask=pair_mask, other=0.0)
    first = _rotate(x, xp, cos, sin, True)  # x is the pair's first element
    second = _rotate(xp, x, cos, sin, False)  # x is the second
    y = tl.where(half[None, :], first, tl.where(rot[None, :], second, x)).to(tl.bfloat16)
    had = tl.load(had_ptr + c[:, None] * J + c[None, :])
    h = (tl.dot(y, had) * had_scale).to(tl.bfloat16).to(tl.float32)
    q, s = _pow2_quant(h)
    out = r
    if SLOTS:
        out = tl.load(slots_ptr + r, mask=valid, other=0)
    tl.store(q_ptr + out[:, None] * J + c[None, :], q, mask=valid[:, None])
    tl.store(s_ptr + out, s, mask=valid)


@triton.jit
def _layer_norm(x, xp, partner, w_ptr, b_ptr, eps, J: tl.constexpr):
    """LayerNorm of each row of x [rows, J] (fp32, mean then variance, as two fixed-order sums), rounded to
    bf16; xp holds the same rows permuted by `partner` and is normalized alike."""
    c = tl.arange(0, J)
    mean = tl.sum(x, 1) / J
    var = tl.sum((x - mean[:, None]) * (x - mean[:, None]), 1) / J
    inv = tl.rsqrt(var + eps)[:, None]
    y = (x - mean[:, None]) * inv * tl.load(w_ptr + c)[None, :] + tl.load(b_ptr + c)[None, :]
    yp = (xp - mean[:, None]) * inv * tl.load(w_ptr + partner)[None, :] + tl.load(b_ptr + partner)[None, :]
    return y.to(tl.bfloat16).to(tl.float32), yp.to(tl.bfloat16).to(tl.float32)


def _index_quant(x, cos, sin, q, s, slots=None, norm=(None, None, 0.0)):
    """Launches _index_quant_kernel over x [T, J] or [T, I, J]: FP8 rows into q and pow2 scales into s (at
    rows `slots` if given); norm: LayerNorm's (weight, bias, eps) to apply first."""
    J = x.shape[-1]
    if (J, x.device) not in _SYLVESTER:  # built at the first (eager) call, before any graph capture
        h = torch.ones(1, 1)
        while h.shape[0] < J:
            h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)])
        _SYLVESTER[J, x.device] = h.to(device=x.device, dtype=BF16)  # symmetric: x @ H = x @ H^T
    x2 = _rows(x, J)
    M = x2.shape[0]
    heads = M // max(x.shape[0], 1)
    BLOCK_M = 16
    if M:
        shape = dict(R=2 * cos.shape[-1], J=J, BLOCK_M=BLOCK_M, num_warps=4, **NO_FMA)
        flags = dict(NORM=norm[0] is not None, SLOTS=slots is not None)
        inputs = (x2, cos, sin, _SYLVESTER[J, x.device], *norm[:2], slots, q, s)
        _index_quant_kernel[(triton.cdiv(M, BLOCK_M),)](
            *inputs, M, heads, x2.stride(0), J**-0.5, norm[2], **shape, **flags
        )


def index_quant(x, cos, sin):
    """Kernel of nano_nsa.index_quant: x [T, J] (keys) or [T, I, J] (queries) -> (q8 like x, s [..., 1])."""
    q = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty(x.shape[:-1], dtype=torch.float32, device=x.device)
    _index_quant(x, cos, sin, q, s)
    return q, s[..., None]


def store_index_key(k, norm_weight, norm_bias, eps, cos, sin, cache, slots):
    """Kernel of nano_nsa.store_index_key: LayerNorm, RoPE, Hadamard, FP8 and the cache write, one launch."""
    _index_quant(k, cos, sin, cache.ik, cache.iks, slots, (norm_weight, norm_bias, eps))


# ---- Streams: independent parts of a layer run side by side ----
def side_by_side(first, first_args, second, second_args):
    """Kernel of nano_nsa.side_by_side: second(*second_args) on a side stream while first(*first_args) runs on
    the current one, which then waits for it (in a CUDA graph: two branches that join). The side stream has
    the higher priority, so second should be the longer chain. A part may fork again: each depth has a stream
    of its own. Both parts read only tensors that their caller holds until the join, so neither stream frees
    what the other reads; split-K GEMMs on two streams count tiles in separate arrays (fp8_gemm._LOCKS)."""
    # (streams looked up by device index: torch's lookup of "the current device" asks the driver each time)
    main = torch.cuda.current_stream(torch.cuda.current_device())
    streams = _SIDE_STREAMS.setdefault(main.device, [])
    depth = stream_depth(main.device)
    if depth == len(streams):
        streams.append(torch.cuda.Stream(main.device, priority=-1))
    side = streams[depth]
    side.wait_stream(main)
    torch.cuda.set_stream(side)
    try:
        second_out = second(*second_args)
    finally:
        torch.cuda.set_stream(main)
    first_out = first(*first_args)
    main.wait_stream(side)
    return first_out, second_out


# ---- Weights that one GEMM reads, stacked once at bind; the layer ops that read them ----
def _stack(lins):
    """The FP8 Linears lins (one input, whole outputs) stacked by output rows (dim 1 of the experts' [E, out,
    in]) into one weight and one block scale, kept as lins[0].fused = (lins, weight, scale, sizes); their
    parameters become views of the stack, so their own storage is freed. Each part but the last must be whole
    128-row blocks (so the scales stack alike), else nothing is stacked."""
    dim = lins[0].weight.dim() - 2
    sizes = [lin.weight.shape[dim] for lin in lins]
    if any(lin.partial or not lin.fp8 for lin in lins) or any(n % 128 for n in sizes[:-1]):
        return
    weight = torch.cat([lin.weight.data for lin in lins], dim)
    scale = torch.cat([lin.scale.data for lin in lins], dim)
    row = 0
    for lin, n in zip(lins, sizes, strict=True):
        lin.weight.data = weight.narrow(dim, row, n)
        lin.scale.data = scale.narrow(dim, row // 128, lin.scale.shape[dim])
        row += n
    lins[0].fused = (tuple(lins), weight, scale, sizes)


def prepare(model):
    """The GPU's prepare (nano_nsa.dequantize_weights is the references'), called once by Transformer.bind:
    plain weights in bf16; every MLA's wq_a | indexer.wk | wkv_a (kv_a's 576 rows last) and every
    SwiGLU's w1 | w3 (dense MLPs and the routed experts) stacked (_stack)."""
    for mod in model.modules():
        if getattr(mod, "fp8", None) is False:  # a plain Linear (lm_head etc.): bf16, as in the checkpoint
            mod.weight.data = mod.weight.data.to(BF16)
        if type(mod).__name__ == "MLA":
            _stack((mod.wq_a, mod.indexer.wk, mod.wkv_a))
        elif hasattr(mod, "w1") and hasattr(mod, "w3"):
            _stack((mod.w1, mod.w3))


def _stacked(*lins):
    """(weight, scale, sizes) of prepare's stack of exactly the Linears lins, or None."""
    fused = getattr(lins[0], "fused", None)
    if fused is None or fused[0] != lins:
        return None
    return fused[1:]


def linears(x, *lins):
    """Kernel of nano_nsa.linears: each Linear's output on x, one GEMM where prepare stacked them."""
    stacked = _stacked(*lins)
    if stacked is None:
        return tuple(lin(x) for lin in lins)
    return fp8_linear(x, stacked[0], stacked[1]).split(stacked[2], -1)


def mlp(x, w1, w3, w2):
    """Kernel of nano_nsa.mlp (the op mlp): w1 | w3 as one GEMM where prepare stacked them, then
    SwiGLU's activation inside w2's act-quant; w2's output unrounded where w2.partial."""
    stacked = _stacked(w1, w3)
    h = torch.cat([w1(x), w3(x)], -1) if stacked is None else fp8_linear(x, stacked[0], stacked[1])
    return swiglu_linear(h, *w2.operands(), partial=w2.partial)


def moe(x, weights, idx, experts):
    """Kernel of nano_nsa.moe (the op moe): moe_grouped on the experts' w1 | w3 stack (prepare's) and
    w2."""
    stacked = _stacked(experts.w1, experts.w3)
    if stacked is None:  # not prepared: stacked for this call
        w1, w3 = experts.w1, experts.w3
        stacked = (torch.cat([w1.weight, w3.weight], 1), torch.cat([w1.scale, w3.scale], 1))
    return moe_grouped(x, weights, idx, stacked[0], stacked[1], *experts.w2.operands())


# ---- The engine's GPU mechanics: CUDA graph capture and the read-back of a round ----
def capture(fn, pool, inputs, what):
    """fn() captured as a CUDA graph after one eager run (which builds its kernels) -> (the graph, fn's
    outputs, which each replay overwrites). pool: the memory pool the graphs share
    (torch.cuda.graph_pool_handle()). inputs: the tensors fn reads, zeroed for the warm-up run
    (every row of a round then writes the dummy slot 0; a replay reads what is copied in later), restored
    after the capture. what: a line to stderr names the graph."""
    t0 = time.perf_counter()
    kept = [(t, t.clone()) for t in inputs]
    for t, _ in kept:
        t.zero_()
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    collecting = gc.isenabled()
    gc.disable()  # an old engine's graphs, freed by the collector during a capture, would break it
    try:  # (torch.cuda.graph empties the allocator's cache first: an old engine's freed pool is reused)
        with torch.cuda.graph(graph, pool):
            out = fn()
    finally:
        if collecting:  # (as the caller had it)
            gc.enable()
        for t, saved in kept:  # (a capture that failed leaves the inputs as they were too)
            t.copy_(saved)
    print(f"nano-nsa: captured {what} in {time.perf_counter() - t0:.2f} s", file=sys.stderr)
    return graph, out


@triton.jit
def _decode_rows_kernel(start_ptr, table_ptr, out_ptr, T, table_stride, N: tl.constexpr):
    """Rows [128] of decode_rows: row r is request r // N's, at position start[r // N] + r % N; out [4, T]."""
    r = tl.program_id(0) * 128 + tl.arange(0, 128)
    mask = r < T
    b = (r // N).to(tl.int64)
    p = tl.load(start_ptr + b, mask=mask, other=0) + r % N
    tl.store(out_ptr + r, p, mask=mask)
    tl.store(out_ptr + T + r, b, mask=mask)
    tl.store(out_ptr + 2 * T + r, tl.load(table_ptr + b * table_stride + p, mask=mask, other=0), mask=mask)
    tl.store(out_ptr + 3 * T + r, p + 1, mask=mask)


def decode_rows(start, n, table):
    """Kernel of nano_nsa.decode_rows: one launch (the reference: six or seven). Every position must lie
    inside its row of the table (round_lookahead sees to it): unlike torch's indexing, nothing checks it."""
    assert table.stride(1) == 1 and start.is_contiguous()
    T = len(start) * n
    out = torch.empty(4, T, dtype=torch.long, device=start.device)
    if T:
        _decode_rows_kernel[(triton.cdiv(T, 128),)](start, table, out, T, table.stride(0), N=n)
    return out.unbind()


@triton.jit
def _take_kernel(
    ids_ptr,
    tok,
    start,
    seeds,
    temp,
    top_p,
    o_tok,
    o_start,
    o_seeds,
    o_temp,
    o_top_p,
    N,
    BLOCK_N: tl.constexpr,
):
    """Row b of take: the small fields of row ids[b] (N tokens a row)."""
    b = tl.program_id(0)
    row = tl.load(ids_ptr + b).to(tl.int64)
    j = tl.arange(0, BLOCK_N)
    tl.store(o_tok + b * N + j, tl.load(tok + row * N + j, mask=j < N), mask=j < N)
    tl.store(o_start + b, tl.load(start + row))
    tl.store(o_seeds + b, tl.load(seeds + row))
    tl.store(o_temp + b, tl.load(temp + row))
    tl.store(o_top_p + b, tl.load(top_p + row))


def take(batch, ids):
    """Kernel of nano_nsa.Batch.take: the rows ids of the small fields in one launch (the reference: a gather
    a field); q's rows (the drafts' distributions, k x vocab each) by torch's gather."""
    small = (batch.tokens, batch.start, batch.seeds, batch.temperature, batch.top_p)
    assert ids.is_contiguous() and all(x.is_contiguous() for x in small)
    out = [x.new_empty((len(ids), *x.shape[1:])) for x in small]
    N = batch.tokens.shape[1]
    if len(ids):
        _take_kernel[(len(ids),)](ids, *small, *out, N, BLOCK_N=triton.next_power_of_2(N))
    tokens, start, seeds, temperature, top_p = out
    q = None if batch.q is None else batch.q[ids]
    return replace(batch, tokens=tokens, start=start, q=q, seeds=seeds, temperature=temperature, top_p=top_p)


def read_back(x):
    """Kernel of nano_nsa.read_back: start copying x to pinned host memory -> a function that waits for that
    copy (an event: work queued after it need not finish) and returns x.tolist()."""
    host = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
    host.copy_(x, non_blocking=True)
    copied = torch.cuda.Event()
    copied.record(torch.cuda.current_stream(x.device))

    def wait():
        copied.synchronize()
        return host.tolist()

    return wait


# ---- The kernel set: the names and signatures of nano_nsa.TORCH_OPS, and `capture` ----
def bf16_dtype(w):
    """bf16, whatever w's dtype: attn_dtype (wkv_b's absorbed halves)."""
    return BF16


GPU_OPS_NAME = "kernels.py ({}, indexer, FP8 / bf16 GEMMs and MoE; SDPA prefill)"  # {}: sparse_mla_path's
GPU_OPS = SimpleNamespace(
    name=GPU_OPS_NAME.format("Triton sparse MLA"),
    prepare=prepare,
    index_quant=index_quant,
    store_index_key=store_index_key,
    index_topk=index_topk,
    sparse_mla=sparse_mla,
    dense_attention=dense_attention,
    head_linear=head_linear,
    rope_cos_sin=rope_cos_sin,
    rope=rope,
    store_latent=store_latent,
    rms_norm=rms_norm,
    fp8_linear=fp8_linear,
    linears=linears,
    mlp=mlp,
    swiglu_linear=swiglu_linear,
    dense_linear=dense_linear,
    route=route,
    moe=moe,
    side_by_side=side_by_side,
    sample=sample,
    probs_from_logits=probs_from_logits,
    rejection_sample=rejection_sample,
    decode_rows=decode_rows,
    take=take,
    read_back=read_back,
    capture=capture,
    attn_dtype=bf16_dtype,
)
