"""nano-nsa GPU kernels: the fast versions of the names the layers call through `self.ops`.

Each function here has a readable torch reference with the same signature in nano_nsa.py (TORCH_OPS); tests
compare them on fresh random inputs at the real shapes (test_nano.py, marked `gpu`). `GPU_OPS` at the end is
the set `nano_nsa.select_ops` binds on a GPU that `unsupported()` accepts.

  index_quant     the indexer's queries: RoPE + Hadamard (one tensor-core product) + FP8, one launch;
                  store_index_key: its keys, LayerNorm first and written to the cache, one launch
  index_topk      lightning indexer: Triton FP8 scores over the paged key cache + causal mask + top-k
  sparse_mla      absorbed sparse MLA rows: Triton, fixed chunks of each row's selection (Hopper);
                  flashinfer trtllm-gen (Blackwell, unverified here)
  dense_attention causal per-head attention of short prompt chunks (torch SDPA)
  head_linear     a linear map per head (MLA's absorbed W_UK, W_UV): the grouped Triton GEMM
  rope, store_latent   MLA's query rotation; its cache write (norm, FP8 round trip, rotation), one launch
  rms_norm        RMSNorm (with the residual add): Triton, one program per row
  fp8_linear      Triton act-quant (1x128, pow2 scales) + block-scaled FP8 GEMM (split-K by weight shape,
                  the partials summed in order by the tile's last program; long weight walks by TMA);
                  swiglu_linear: SwiGLU in the quant
  dense_linear    bf16 weights with fp32 accumulation (lm_head, weights_proj, eh_proj, router): Triton GEMM
  route           the router after its product (sigmoid, group-limited top-k, weights): one launch
  moe             routed experts: one-launch sort by expert, two grouped FP8 GEMMs, ordered combine; no sync

Batch invariance: a row's result never depends on the other rows of its batch (docs/batch_invariance.md):
tile shapes and split-K come from the weight's shape, attention splits from the row's own selection, and every
reduction runs in a fixed order (no float atomics).

Triton and flashinfer are imported here only: nano_nsa imports this module on a CUDA device alone.
"""

from types import SimpleNamespace

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.language.extra import libdevice
from triton.tools.tensor_descriptor import TensorDescriptor

BF16 = torch.bfloat16


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


# ------------------------------------------------------------------------------------------------------------
# Lightning indexer: FP8 scores over the paged key cache, causal mask, top-k (spec 3.7)
# ------------------------------------------------------------------------------------------------------------
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
    """One (row t, block of context positions n): score = ks[n] * sum_h w[t, h] * relu(q8[t, h] . k8[n]),
    w[t, h] = weights[t, h] * scale * qs[t, h] (nano_nsa.head_weights, in its order), written as a sortable
    int64 key: the score's bits made monotone in the high word, (2^31 - 1 - n) in the low word, so top-k
    breaks exact ties towards the earliest position as the reference does. Positions n >= ctx[t] (the causal
    mask) get the smallest key. H: the indexer's heads, H_PAD: H padded to a tensor-core tile (>= 16)."""
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
    """One (row t, block of positions i): the top-`width` positions of the row's keys, sorted by key,
    descending, without a sort: the keys are distinct, so position i's rank (how many of the row's keys are
    larger) is its place, and it is written to out[t, rank] if rank < width. A row whose context fits in
    width (ctx <= width) selects its whole context instead, in position order, then -1."""
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


RANK_SELECT_PAIRS = 1 << 28  # rows x N^2 key comparisons up to which the rank kernel replaces torch.topk


def index_topk(q8, qs, weights, scale, cache, meta, topk):
    """Kernel of nano_nsa.index_topk: rows flattened over (request x draft position), each scoring only the
    keys below its own causal length, through its request's page-table row (the heads' weights made in the
    score kernel); then top-min(topk, N) per row."""
    T, H, J = q8.shape
    N = meta.max_ctx
    keys = torch.empty(T, N, dtype=torch.int64, device=q8.device)
    BLOCK_N = 64
    _index_keys_kernel[(T, triton.cdiv(N, BLOCK_N))](
        q8.contiguous(),
        qs.float().contiguous(),
        weights.float().contiguous(),
        scale,
        cache.ik,
        cache.iks,
        meta.table,
        meta.row_req,
        meta.ctx_lens,
        keys,
        meta.table.stride(0),
        N,
        H=H,
        H_PAD=max(16, triton.next_power_of_2(H)),
        J=J,
        BLOCK_N=BLOCK_N,
        num_warps=4,
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


# ------------------------------------------------------------------------------------------------------------
# Sparse MLA rows: each query row over its own selected KV-pool slots, split in fixed chunks of its selection
# ------------------------------------------------------------------------------------------------------------
MLA_CHUNK = 128  # selected slots per program: a row's split follows its own selection, never the batch
MLA_BLOCK_N = 64  # slots per inner step
MLA_BLOCK_H = 64  # heads per program (fewer for a model with fewer heads), whatever the number of rows
MLA_PARTIAL_BYTES = 256 << 20  # bound on the fp32 partial outputs of one launch (long prefills run in parts)


@triton.jit
def _sparse_mla_kernel(
    q_ptr,
    qpe_ptr,
    kv_ptr,
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
    C: tl.constexpr,
    R: tl.constexpr,
    SPLITS: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """One (row t, block of heads, chunk s of the row's selection): online softmax over the chunk's slots
    (its selected positions through its request's page-table row), BLOCK_N at a time, in order. The row's
    valid positions come first (min(ctx[t], W) of them); steps past them are skipped, and would change nothing
    (an empty step adds exact zeros), so a row's result does not depend on the batch's width W."""
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
        slot = tl.load(table + pos, mask=valid, other=0).to(tl.int64)
        row = tl.maximum(slot, 0) * (C + R)
        kv = tl.load(kv_ptr + row[:, None] + c[None, :], mask=valid[:, None], other=0.0)  # [BN, C]
        pe = tl.load(kv_ptr + row[:, None] + C + r[None, :], mask=valid[:, None], other=0.0)  # [BN, R]
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
    """A program's end, for its query rows qrow (t * H + h of its heads h; hmask: the real ones): SPLITS == 1,
    their normalized output; else their chunk's unnormalized partial and its (max, sum), for
    _mla_combine_kernel (TH = T * H query rows per chunk)."""
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
    row is split into chunks of MLA_CHUNK of its own selected slots, merged in chunk order, whatever else runs
    (flashinfer's FA3 scheduler splits the KV by the number of rows, so the same row gave different bits in
    different batches). Blackwell: flashinfer's trtllm-gen decode kernel (unverified, see below)."""
    if torch.cuda.get_device_capability(q_abs.device)[0] == 10:
        return _sparse_mla_blackwell(q_abs, q_pe, cache, selected, meta, scale)
    T, H, C = q_abs.shape
    R = q_pe.shape[-1]
    W = selected.shape[1]
    splits = triton.cdiv(W, MLA_CHUNK)
    block_h = min(MLA_BLOCK_H, max(16, triton.next_power_of_2(H)))  # a launch config fixed by the model
    out = torch.empty(T, H, C, dtype=BF16, device=q_abs.device)
    step = max(1, MLA_PARTIAL_BYTES // (splits * H * C * 4))  # rows per launch (independent of each other)
    for t0 in range(0, T, step):
        rows = slice(t0, min(T, t0 + step))
        n = rows.stop - rows.start
        part = torch.empty(splits * n * H * C if splits > 1 else 0, dtype=torch.float32, device=q_abs.device)
        ml = torch.empty(splits * n * H * 2 if splits > 1 else 0, dtype=torch.float32, device=q_abs.device)
        _sparse_mla_kernel[(n, triton.cdiv(H, block_h), splits)](
            q_abs[rows].to(BF16).contiguous(),
            q_pe[rows].to(BF16).contiguous(),
            cache.latent,
            selected[rows].contiguous(),
            meta.table,
            meta.row_req[rows].contiguous(),
            meta.ctx_lens[rows].contiguous(),
            out[rows],
            part,
            ml,
            n,
            H,
            W,
            meta.table.stride(0),
            scale,
            C=C,
            R=R,
            SPLITS=splits,
            CHUNK=MLA_CHUNK,
            BLOCK_H=block_h,
            BLOCK_N=MLA_BLOCK_N,
            num_warps=8,
            num_stages=3,
        )
        if splits > 1:
            _mla_combine_kernel[(n, H)](part, ml, out[rows], n, H, SPLITS=splits, C=C, num_warps=4)
    return out


WORKSPACE_BYTES = 256 << 20  # trtllm-gen's workspace (Blackwell)
_BLACKWELL = {}  # that workspace, made at the first call (zeroed, as trtllm-gen requires)


def _sparse_mla_blackwell(q_abs, q_pe, cache, selected, meta, scale):
    """Blackwell (SM100/103) variant: flashinfer's trtllm-gen sparse MLA decode, every row its own request of
    one query token with its own (expanded) length, so verify and draft-extend rows go through it as decode
    rows. UNVERIFIED ON HARDWARE: no Blackwell GPU was available to this project; it is written from
    flashinfer's documented signature and has never been executed, and whether its split of the KV depends on
    the batch is not known (the Triton kernel above is batch-invariant and runs on Blackwell too)."""
    from flashinfer.mla import trtllm_batch_decode_with_kv_cache_mla

    T, H, C = q_abs.shape
    W = selected.shape[1]
    slots = meta.table[meta.row_req[:, None], selected.clamp(min=0)]
    slots = torch.where(selected >= 0, slots, -1)  # [T, W] KV-pool slots
    if "workspace" not in _BLACKWELL:
        _BLACKWELL["workspace"] = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=q_abs.device)
    q = torch.cat([q_abs.to(BF16), q_pe.to(BF16)], -1)[:, None]  # [T, 1, H, C + R]
    out = trtllm_batch_decode_with_kv_cache_mla(
        query=q,
        kv_cache=cache.latent[:, None, :],
        workspace_buffer=_BLACKWELL["workspace"],
        qk_nope_head_dim=128,  # DeepSeek-V3.2's (the absorbed form does not read it)
        kv_lora_rank=C,
        qk_rope_head_dim=q_pe.shape[-1],
        block_tables=slots.to(torch.int32)[:, None, :],
        seq_lens=meta.ctx_lens.clamp(max=W).to(torch.int32),
        max_seq_len=W,
        sparse_mla_top_k=W,
        bmm1_scale=scale,
        backend="trtllm-gen",
    )
    return out.view(T, H, C)


# ------------------------------------------------------------------------------------------------------------
# Dense causal attention for prompt chunks whose context fits in top-k (DSA selects everything there)
# ------------------------------------------------------------------------------------------------------------
def dense_attention(q, k, v, scale):
    """Kernel of nano_nsa.dense_attention: torch SDPA (flash / memory-efficient) with a lower-right causal
    mask."""
    from torch.nn.attention.bias import causal_lower_right

    S, N = q.shape[0], k.shape[0]
    o = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None],
        k.transpose(0, 1)[None],
        v.transpose(0, 1)[None],
        attn_mask=causal_lower_right(S, N),
        scale=scale,
    )
    return o[0].transpose(0, 1)


# ------------------------------------------------------------------------------------------------------------
# FP8: activation quantization, block-scaled GEMM, grouped MoE (spec 3, 6)
# ------------------------------------------------------------------------------------------------------------
@triton.jit
def _pow2_quant(x):
    """x [rows, 128] fp32 -> (q e4m3, s [rows] fp32): scale = the power of two >= amax / 448 (ue8m0), q =
    x / scale rounded to e4m3. Every FP8 activation (act_quant, the cached latent, the indexer) runs this."""
    s = tl.maximum(tl.max(tl.abs(x), 1), 1e-4) * (1.0 / 448.0)
    bits = s.to(tl.int32, bitcast=True)
    bits = tl.where((bits & 0x7FFFFF) != 0, ((bits >> 23) + 1) << 23, bits)  # round up to a power of two
    s = bits.to(tl.float32, bitcast=True)
    return tl.clamp(x / s[:, None], -448.0, 448.0).to(tl.float8e4nv), s


@triton.jit
def _swiglu(gate, up):
    """silu(gate) * up in fp32 as torch computes it (exact exp, IEEE division), rounded to bf16."""
    silu = tl.math.div_rn(gate, 1.0 + libdevice.exp(-gate))
    return (silu * up).to(tl.bfloat16).to(tl.float32)


@triton.jit
def _act_quant_kernel(
    x_ptr, q_ptr, s_ptr, rows_ptr, x_stride, K: tl.constexpr, GROUPS: tl.constexpr, SWIGLU: tl.constexpr
):
    """One row's 1x128 groups GROUPS at a time (each group is quantized alone: how they are shared out changes
    no bit) of x (SWIGLU: of silu(x[:, :K]) * x[:, K:]) -> q e4m3, s fp32. rows_ptr (not None): a row whose
    entry is negative is padding (the MoE's expert blocks), left alone."""
    row = tl.program_id(0).to(tl.int64)
    padding = False
    if rows_ptr is not None:
        padding = tl.load(rows_ptr + row) < 0
    if not padding:
        g = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)
        live = g < K // 128
        ok = live[:, None]
        offs = g[:, None] * 128 + tl.arange(0, 128)[None, :]
        x = tl.load(x_ptr + row * x_stride + offs, mask=ok, other=0.0).to(tl.float32)
        if SWIGLU:
            x = _swiglu(x, tl.load(x_ptr + row * x_stride + K + offs, mask=ok, other=0.0).to(tl.float32))
        q, s = _pow2_quant(x)
        tl.store(q_ptr + row * K + offs, q, mask=ok)
        tl.store(s_ptr + row * (K // 128) + g, s, mask=live)


ACT_QUANT_GROUPS = 8  # 128-wide groups per program: a one-row 16384-wide input is 16 programs, not one


_QUANTIZED = {}  # id(x) -> (x, q, s): the last few activations quantized (act_quant, rms_norm), kept alive
QUANTIZED_KEPT = 4


def remember_quantized(x, q, s):
    """Keep x's quantization for act_quant: MLA's normed query latent feeds wq_b and the indexer's wq_b, a
    FFN's normed input feeds the shared and the routed experts, and every norm quantizes its own output."""
    while len(_QUANTIZED) >= QUANTIZED_KEPT:
        del _QUANTIZED[next(iter(_QUANTIZED))]
    _QUANTIZED[id(x)] = (x, q, s)


def act_quant(x, swiglu=False, rows=None):
    """Kernel of nano_nsa.act_quant (bit-exact): x [..., K] -> (q [..., K] e4m3, s [..., K/128] fp32). swiglu:
    of SwiGLU's activation silu(gate) * up (fp32, rounded to bf16) for x = [gate | up] [..., 2K]. rows [M]:
    the rows whose entry is negative are padding, skipped (their q and s are left unset). A tensor quantized
    already (remember_quantized) is not quantized again: the same object, which the layers never write into
    once made, so the same values."""
    seen = _QUANTIZED.get(id(x))
    if not swiglu and seen is not None and seen[0] is x:
        return seen[1], seen[2]
    K = x.shape[-1] // (2 if swiglu else 1)
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    q = torch.empty(x2.shape[0], K, dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty(x2.shape[0], K // 128, dtype=torch.float32, device=x.device)
    if x2.shape[0]:
        groups = min(ACT_QUANT_GROUPS, triton.next_power_of_2(K // 128))
        grid = (x2.shape[0], triton.cdiv(K // 128, groups))
        _act_quant_kernel[grid](x2, q, s, rows, x2.stride(0), K=K, GROUPS=groups, SWIGLU=swiglu, num_warps=4)
    q, s = q.view(*x.shape[:-1], K), s.view(*x.shape[:-1], K // 128)
    if not swiglu:
        remember_quantized(x, q, s)
    return q, s


@triton.jit
def _gemm_kernel(
    a_ptr,
    as_ptr,
    rows_ptr,
    b_ptr,
    bs_ptr,
    expert_ptr,
    c_ptr,
    part_ptr,
    lock_ptr,
    b_desc,
    M,
    N,
    K,
    a_stride,
    B_TMA: tl.constexpr,
    SCALED: tl.constexpr,
    GATHER: tl.constexpr,
    SCATTER: tl.constexpr,
    GROUPED: tl.constexpr,
    SPLIT_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """C[m, n] = sum over 128-wide k blocks of (A8[m, kb] . B8[n, kb]) * sa[m, kb] * sb[n // 128, kb], fp32
    (SCALED=False: bf16 A and B, no scales). GATHER: row m of A is rows[m] (-1: a padding row); SCATTER: and
    it is written to row rows[m] of C. GROUPED: the M-row block reads expert experts[pid_m]'s B (-1: no B).
    SPLIT_K > 1: program k sums the k blocks k, k + SPLIT_K, ...; the tile's last program to finish adds the
    partials in split order (_gemm_store). B_TMA: B's tiles come by TMA through b_desc (B as rows of K)."""
    pid_m, pid_n, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    KB = tl.cdiv(K, 128)
    rows, valid_m = _gemm_rows(rows_ptr, offs_m, M, GATHER)
    n_kb = KB
    b_row0 = pid_n * BLOCK_N
    if GROUPED:  # the tile's expert: its weights and scales (none: no k blocks, zero rows)
        e = tl.load(expert_ptr + pid_m)
        n_kb = tl.where(e >= 0, KB, 0)
        b_row0 += tl.maximum(e, 0) * N
        b_ptr += tl.maximum(e, 0).to(tl.int64) * N * K
        if SCALED:
            bs_ptr += tl.maximum(e, 0).to(tl.int64) * ((N + 127) // 128) * KB
    valid_n = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    a_rows = a_ptr + rows[:, None] * a_stride  # each row's start, and its scales' (SCALED)
    b_rows = b_ptr + offs_n[:, None].to(tl.int64) * K
    if SCALED:  # each row's scales; the tile's one row of weight-block scales (BLOCK_N divides 128)
        as_ptr += rows * KB
        bs_ptr += (pid_n * BLOCK_N // 128) * KB
    for kb in range(pid_k, n_kb, SPLIT_K):
        a = _load_k_block(a_rows, valid_m, kb, K)
        b = _weight_k_block(b_rows, b_desc, b_row0, valid_n, kb, K, B_TMA)
        acc = _gemm_k_block(acc, a, as_ptr, b, bs_ptr, valid_m, kb, SCALED)
    out_rows = offs_m.to(tl.int64)
    if SCATTER:
        out_rows = rows
    c = c_ptr + out_rows[:, None] * N + offs_n[None, :]
    mask = valid_m[:, None] & valid_n[None, :]
    _gemm_store(acc, c, part_ptr, lock_ptr, offs_m, offs_n, mask, M, N, SPLIT_K)


@triton.jit
def _load_k_block(rows, valid, kb, K):
    """The k block kb (128 columns) of the rows starting at `rows` (zeros where not valid)."""
    kc = kb * 128 + tl.arange(0, 128)
    return tl.load(rows + kc[None, :], mask=valid[:, None] & (kc < K)[None, :], other=0.0)


@triton.jit
def _weight_k_block(b_rows, b_desc, b_row0, valid_n, kb, K, B_TMA: tl.constexpr):
    """The k block kb of the tile's weight rows: by TMA from row b_row0 of b_desc (rows past N read zeros or
    the next expert's: never stored), or by plain loads from the rows starting at b_rows."""
    if B_TMA:
        return b_desc.load([b_row0, kb * 128])
    return _load_k_block(b_rows, valid_n, kb, K)


@triton.jit
def _gemm_k_block(acc, a, sa, b, sb, valid_m, kb, SCALED: tl.constexpr):
    """acc plus the k block kb's product of the A tile a and the B tile b, times its two scales when SCALED:
    each row's sa[kb] and the tile's weight-block scale sb[kb]. sa is a power of two (act_quant's), so
    product * (sa * sb) rounds once, as (product * sa) * sb does: the same bits with one multiply per
    element (one program's 56-block walk at one row: 23.3 -> 18.0 us; docs/performance.md, ninth pass)."""
    if SCALED:
        sa = tl.load(sa + kb, mask=valid_m, other=0.0)
        sb = tl.load(sb + kb)
        return acc + tl.dot(a, tl.trans(b)) * (sa * sb)[:, None]
    return tl.dot(a, tl.trans(b), acc)


@triton.jit
def _gemm_rows(rows_ptr, offs_m, M, GATHER: tl.constexpr):
    """A row tile's rows of A, and which are real: offs_m, or GATHER: rows[offs_m] (-1: a padding row)."""
    valid = offs_m < M
    rows = offs_m.to(tl.int64)
    if GATHER:
        rows = tl.load(rows_ptr + offs_m, mask=valid, other=-1).to(tl.int64)
        valid = rows >= 0
        rows = tl.maximum(rows, 0)
    return rows, valid


@triton.jit
def _gemm_store(acc, c, part_ptr, lock_ptr, offs_m, offs_n, mask, M, N, SPLIT_K: tl.constexpr):
    """A tile's end: without split-K, acc goes to c. Else this program's partial goes to its slice of the
    partials [SPLIT_K, M, N]; the tile's last program to finish (an int counter per tile) adds the SPLIT_K
    slices in split order, 8 loads in flight at a time, and writes c."""
    if SPLIT_K == 1:
        tl.store(c, acc.to(c.dtype.element_ty), mask=mask)
    else:
        MN = M * N
        part = part_ptr + offs_m[:, None].to(tl.int64) * N + offs_n[None, :]
        lock = lock_ptr + tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)
        tl.store(part + tl.program_id(2).to(tl.int64) * MN, acc, mask=mask)
        tl.debug_barrier()  # every thread's partial is out before the tile's count goes up
        if tl.atomic_add(lock, 1) == SPLIT_K - 1:  # (acq_rel: the other programs' partials are visible)
            total = tl.zeros(acc.shape, dtype=tl.float32)
            for s0 in range(0, SPLIT_K, 8):
                for i in tl.static_range(8):
                    split = mask & (s0 + i < SPLIT_K)
                    total += tl.load(part + (s0 + i) * MN, mask=split, other=0.0, cache_modifier=".cg")
            tl.store(c, total.to(c.dtype.element_ty), mask=mask)
            tl.atomic_xchg(lock, 0)  # ready for the next launch


GEMM_BLOCK_M = 64  # one tile height for every M: a row's sums never depend on how many rows there are
GEMM_PROGRAMS = 256  # split-K aims at this many programs for one row tile (about 2 per SM of an H200)
GEMM_SPLITS = 16  # at most: the tile's last program adds the partials one after another
GEMM_PARTIAL_BYTES = 64 << 20  # bound on the split-K partials of one launch (long prefills run in parts)
GEMM_LOCKS = 1 << 16  # split-K tile counters, zero between launches
_LOCKS = {}  # (device, stream depth: see side_by_side) -> the counters (made at the first, eager, call)


def gemm_config(N, K, grouped=False, fp8=True):
    """Tile width, split-K, pipeline depth and weight loads of the GEMM with an [N, K] weight, from its shape
    only (never from the number of rows, which would make a row's sum order depend on the batch); chosen by
    sweeps at 1 to 64 rows on an H200 (docs/performance.md).
    - Grouped (the MoE experts, whose blocks of rows fill the SMs; MLA's per-head maps): no split, 128-wide
      tiles for the experts' long rows.
    - Otherwise split-K for enough programs to fill the SMs at one row tile, at most GEMM_SPLITS splits and
      128 KB of fp32 partials per row, and no split for a short K (16 blocks or fewer: the partial sum would
      cost more than it saves); 128-wide tiles for a very long K (o_proj, the dense MLP's w2), 16-wide ones
      for 256 columns or fewer (the router 7.9 -> 6.4 us, weights_proj 7.5 -> 5.6 us at one row).
    - An FP8 weight arrives by TMA, 4 tiles in flight, when each program walks it for 16 k blocks or more
      (grouped) or 32 or more (otherwise: the shared expert's w2, 16 blocks, is 1.3 us faster with plain
      loads); plain loads measured faster for bf16 weights and for short walks. A long unsplit walk (the
      dense MLP's w1|w3) runs 128-wide tiles 3 deep: 72 -> 64 us at one row, 79 -> 68 us at 64 rows.
    Of these choices only split-K changes a bit: it orders the sums."""
    k_blocks = K // 128
    long_rows = grouped and k_blocks >= 8
    block_n = 64
    if long_rows or (not grouped and k_blocks >= 128):
        block_n = 128
    if not grouped and N <= 256:  # few columns (the router, weights_proj): narrow tiles, more programs
        block_n = 16
    split = 1
    if not grouped and k_blocks > 16:
        split = max(1, min(GEMM_SPLITS, k_blocks, GEMM_PROGRAMS // triton.cdiv(N, block_n), 32768 // N))
    walk = k_blocks // split
    tma = fp8 and (walk >= 32 or (grouped and walk >= 16))
    stages = 3
    if tma or long_rows:
        stages = 4
    if fp8 and not grouped and split == 1 and walk >= 32:  # (the split was 1 at 64 wide: it stays 1 at 128)
        block_n = 128
        stages = 3
    return dict(BLOCK_N=block_n, SPLIT_K=split, B_TMA=tma, num_warps=4, num_stages=stages)


def _gemm(a, sa, b, sb, M, N, rows=None, experts=None, scatter=False, out_dtype=BF16):
    """A8 [*, K] (rows picked by `rows` if given), B8 [N, K] or [E, N, K]
    (with `experts` per block of GEMM_BLOCK_M rows) -> C [M, N] out_dtype (scatter: C [*, N] at rows
    `rows`), fp32 accumulation of each 128-block product times its two scales, in an order fixed by the
    weight's shape. sa = sb = None: bf16 A and B, no scales."""
    K = b.shape[-1]
    config = gemm_config(N, K, grouped=experts is not None, fp8=sb is not None)
    config["B_TMA"] &= b.is_contiguous()
    assert 128 % config["BLOCK_N"] == 0  # a tile reads one row of weight-block scales (_gemm_k_block)
    split = config["SPLIT_K"]
    if scatter:
        c = torch.empty(a.shape[0], N, device=a.device, dtype=out_dtype)
    else:
        c = torch.empty(M, N, device=a.device, dtype=out_dtype)
    locks = (a.device, stream_depth(a.device))
    if locks not in _LOCKS:  # two GEMMs running at once (side_by_side) count their tiles apart
        _LOCKS[locks] = torch.zeros(GEMM_LOCKS, dtype=torch.int32, device=a.device)
    b_desc = None
    if config["B_TMA"]:  # the weight as rows of K (the experts' stacked one after another)
        b_desc = TensorDescriptor.from_tensor(b.view(-1, K), [config["BLOCK_N"], 128])
    step = M if split == 1 else max(GEMM_BLOCK_M, GEMM_PARTIAL_BYTES // (split * N * 4))
    for m0 in range(0, M, step):  # rows are independent: a long prefill runs in parts of bounded memory
        m = min(step, M - m0)
        grid = (triton.cdiv(m, GEMM_BLOCK_M), triton.cdiv(N, config["BLOCK_N"]), split)
        assert grid[0] * grid[1] <= GEMM_LOCKS
        part = None
        if split > 1:
            part = torch.empty(split, m, N, device=a.device, dtype=torch.float32)
        scales_a = None
        if sa is not None:
            scales_a = sa[m0:]
        out = c  # (the gathered and grouped GEMMs never run in parts: m0 = 0)
        if not scatter:
            out = c[m0 : m0 + m]
        _gemm_kernel[grid](
            a[m0:],
            scales_a,
            rows,
            b,
            sb,
            experts,
            out,
            part,
            _LOCKS[locks],
            b_desc,
            m,
            N,
            K,
            a.stride(0),
            SCALED=sa is not None,
            GATHER=rows is not None,
            SCATTER=scatter,
            GROUPED=experts is not None,
            BLOCK_M=GEMM_BLOCK_M,
            **config,
        )
    return c


def fp8_linear(x, w, scale, partial=False):
    """Kernel of nano_nsa.fp8_linear: act_quant then the block-scaled FP8 GEMM, bf16 out (partial: fp32)."""
    return _quantized_linear(*act_quant(x), w, scale, partial)


def swiglu_linear(h, w, scale, partial=False):
    """Kernel of nano_nsa.swiglu_linear: SwiGLU's activation and act-quant in one kernel, then the GEMM."""
    return _quantized_linear(*act_quant(h, swiglu=True), w, scale, partial)


def _quantized_linear(q, s, w, scale, partial):
    """Act-quantized rows (q [..., K] e4m3, s [..., K/128]) times the FP8 weight -> [..., N] bf16 (partial:
    fp32)."""
    M = q.numel() // q.shape[-1]
    out_dtype = torch.float32 if partial else BF16
    y = _gemm(q.view(M, -1), s.view(M, -1), w, scale, M, w.shape[0], out_dtype=out_dtype)
    return y.view(*q.shape[:-1], w.shape[0])


@triton.jit
def _combine_kernel(o_ptr, pos_ptr, w_ptr, y_ptr, D, A: tl.constexpr, BLOCK: tl.constexpr):
    """y[t] = sum over a = 0..A-1, in that order, of w[t, a] * o[pos[t, a]] (fp32): a token's expert rows
    gathered and summed in a fixed order (index_add_'s float atomics add them in any order)."""
    t = tl.program_id(0).to(tl.int64)
    d = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = d < D
    acc = tl.zeros([BLOCK], tl.float32)
    for a in tl.static_range(A):
        row = tl.load(pos_ptr + t * A + a)
        acc += tl.load(o_ptr + row * D + d, mask=mask, other=0.0).to(tl.float32) * tl.load(w_ptr + t * A + a)
    tl.store(y_ptr + t * D + d, acc, mask=mask)


@triton.jit
def _moe_layout_kernel(
    idx_ptr,
    token_ptr,
    live_ptr,
    pos_ptr,
    expert_ptr,
    P,
    R,
    n_blocks,
    A: tl.constexpr,
    E: tl.constexpr,
    E_PAD: tl.constexpr,
    BM: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """One program lays out the P = T * A (token, choice) pairs for the grouped GEMMs: sorted by expert
    (pairs in their own order inside an expert) into blocks of BM rows, each expert's rows padded to whole
    blocks. Writes token[r] (the token of sorted row r, -1 for padding), live[r] (r, -1 for padding), pos[p]
    (the sorted row of pair p) and expert[b] (block b's expert, -1 for none). idx E (another rank's expert)
    sorts last, as expert -1. E_PAD: E + 1 rounded up to a power of two; BLOCK: pairs per step."""
    bins = tl.arange(0, E_PAD)
    counts = tl.zeros([E_PAD], tl.int32)
    for p0 in range(0, P, BLOCK):
        p = p0 + tl.arange(0, BLOCK)
        e = tl.load(idx_ptr + p, mask=p < P, other=0).to(tl.int32)  # idx as the router wrote it: int64
        counts += tl.histogram(e, E_PAD, mask=p < P)
    padded = (counts + BM - 1) // BM * BM
    pad_end = tl.cumsum(padded, 0)  # expert e's rows: [pad_end[e] - padded[e], pad_end[e])
    for b0 in range(0, n_blocks, BLOCK):
        b = b0 + tl.arange(0, BLOCK)
        e = tl.sum((pad_end[None, :] <= b[:, None] * BM).to(tl.int32), 1)  # the expert holding row b * BM
        tl.store(expert_ptr + b, tl.where(e < E, e, -1), mask=b < n_blocks)
    for r0 in range(0, R, 1024):
        r = r0 + tl.arange(0, 1024)
        tl.store(token_ptr + r, tl.full([1024], -1, tl.int64), mask=r < R)
        tl.store(live_ptr + r, tl.full([1024], -1, tl.int64), mask=r < R)
    tl.debug_barrier()  # every padding row is written before the pairs' rows overwrite theirs
    placed = pad_end - padded  # the next free row of each expert
    for p0 in range(0, P, BLOCK):
        p = p0 + tl.arange(0, BLOCK)
        e = tl.load(idx_ptr + p, mask=p < P, other=E_PAD).to(tl.int32)
        mine = e[:, None] == bins[None, :]  # [BLOCK, E_PAD] one-hot
        earlier = (e[:, None] == e[None, :]) & (p[None, :] < p[:, None])  # same expert, before in this block
        row = tl.sum(tl.where(mine, placed[None, :], 0), 1) + tl.sum(earlier.to(tl.int32), 1)
        tl.store(pos_ptr + p, row.to(tl.int64), mask=p < P)
        tl.store(token_ptr + row, (p // A).to(tl.int64), mask=p < P)
        tl.store(live_ptr + row, row.to(tl.int64), mask=p < P)
        placed += tl.sum(mine.to(tl.int32), 0)


def moe_layout(idx, E):
    """_moe_layout_kernel's outputs for expert choices idx [T, A] of E experts: (token [R], live [R], pos
    [T * A], expert [R / GEMM_BLOCK_M]), R an upper bound on the padded rows known on the host (no sync)."""
    T, A = idx.shape
    P = T * A
    bm = GEMM_BLOCK_M
    n_blocks = min(E + 1, P) + triton.cdiv(P, bm)
    token = torch.empty(n_blocks * bm, dtype=torch.int64, device=idx.device)
    live = torch.empty_like(token)
    pos = torch.empty(P, dtype=torch.int64, device=idx.device)
    experts = torch.empty(n_blocks, dtype=torch.int32, device=idx.device)
    layout = (idx.contiguous(), token, live, pos, experts, P, len(token), n_blocks)
    E_PAD = triton.next_power_of_2(E + 1)
    _moe_layout_kernel[(1,)](*layout, A=A, E=E, E_PAD=E_PAD, BM=bm, BLOCK=32, num_warps=4)
    return token, live, pos, experts


def moe(x, weights, idx, w13, s13, w2, s2):
    """Kernel of nano_nsa.moe_experts, with no host synchronization: the (token, expert) pairs are sorted by
    expert into blocks of GEMM_BLOCK_M rows (each expert's rows padded to whole blocks, so a block reads one
    expert's weights: one launch, _moe_layout_kernel); one grouped FP8 GEMM for w1|w3, SwiGLU's activation
    with its act-quant, one grouped GEMM for w2, then each token's rows gathered back and summed in choice
    order. Batch-invariant: one tile height and no split-K whatever the number of pairs, no atomics. Expert
    parallel: idx E (another rank's expert) is sorted into blocks of expert -1, which the GEMMs skip."""
    T, A = idx.shape
    E, I2, dim = w13.shape
    token, live, pos, experts = moe_layout(idx, E)
    R = len(token)
    q, s = act_quant(x)
    h = _gemm(q, s, w13, s13, R, I2, rows=token, experts=experts)  # [R, 2I] bf16
    q, s = act_quant(h, swiglu=True, rows=token)  # SwiGLU's activation, quantized (padding rows skipped)
    o = _gemm(q, s, w2, s2, R, dim, rows=live, experts=experts, scatter=True)  # [R, dim] bf16 (padding unset)
    y = torch.empty(T, dim, dtype=torch.float32, device=x.device)
    BLOCK = 1024
    _combine_kernel[(T, triton.cdiv(dim, BLOCK))](
        o,
        pos,
        weights.float().contiguous(),
        y,
        dim,
        A=A,
        BLOCK=BLOCK,
        num_warps=4,
    )
    return y


def dense_linear(x, w):
    """Kernel of nano_nsa.dense_linear: bf16 weight (lm_head, weights_proj, eh_proj, the router; exact copies
    of the checkpoint's bf16), fp32 accumulation and output (half the bytes of the reference's fp32 upcast),
    through the GEMM above, whose sum order is fixed by the weight's shape. (cuBLAS picks its algorithm, and
    with it the sum order, by the number of rows: measured different bits from 16 rows for eh_proj and from
    2 rows for the router's fp32 product.)"""
    x2 = x.reshape(-1, x.shape[-1]).to(BF16)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    y = _gemm(x2, None, w, None, x2.shape[0], w.shape[0], out_dtype=torch.float32)
    return y.view(*x.shape[:-1], w.shape[0])


_HEAD_ROWS = {}  # (T, H, device) -> head_linear's row map and block heads, made once for decode-sized T
HEAD_ROWS_CACHED = 256  # (prompt chunks, of any length, build theirs at each call)


def head_linear(x, w):
    """Kernel of nano_nsa.head_linear (MLA's absorbed W_UK, W_UV): x [T, H, K] times each head's w [H, N, K]
    -> [T, H, N] bf16, as the grouped GEMM of the MoE with heads for experts: head h's rows t (its input and
    output row t * H + h) fill blocks of their own, T rounded up to a tile, so the sum order is fixed by the
    weight's shape. (cuBLAS's batched GEMM picks its algorithm by T.)"""
    T, H, K = x.shape
    key = (T, H, x.device)
    if key in _HEAD_ROWS:
        rows, heads = _HEAD_ROWS[key]
    else:
        Tp = triton.cdiv(T, GEMM_BLOCK_M) * GEMM_BLOCK_M
        t = torch.arange(Tp, device=x.device)
        rows = torch.where(t < T, t * H + torch.arange(H, device=x.device)[:, None], -1).flatten()  # [H * Tp]
        heads = torch.arange(H, device=x.device, dtype=torch.int32).repeat_interleave(Tp // GEMM_BLOCK_M)
        if T <= HEAD_ROWS_CACHED:
            _HEAD_ROWS[key] = (rows, heads)
    x2 = x.to(BF16)
    if x2.stride(2) != 1 or x2.stride(0) != H * x2.stride(1):  # rows t * H + h one stride apart
        x2 = x2.contiguous()
    a = x2.as_strided((T * H, K), (x2.stride(1), 1))
    y = _gemm(a, None, w, None, len(rows), w.shape[1], rows=rows, experts=heads, scatter=True)
    return y.view(T, H, -1)


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
    (bf16), and y's act_quant (q, s: FP8 in 1x128 groups, as _act_quant_kernel)."""
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
    """Kernel of nano_nsa.rms_norm: one program per row, so a row's sum never depends on the number of
    rows. The output's act_quant is made in the same kernel and remembered (every norm's output feeds FP8
    linears, but the final ones')."""
    D = x.shape[-1]
    x2 = x.reshape(-1, D)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
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
            x2,
            r2,
            weight,
            y,
            res,
            q,
            s,
            x2.stride(0),
            D,
            eps,
            RES=residual is not None,
            BLOCK=BLOCK,
            num_warps=8,
        )
    y = y.view(*x.shape[:-1], D)
    remember_quantized(y, q.view(y.shape), s.view(*x.shape[:-1], D // 128))
    if residual is None:
        return y
    return y, res.view(*x.shape[:-1], D)


# ------------------------------------------------------------------------------------------------------------
# The router: sigmoid scores, group-limited top-k, routing weights (spec 3.9)
# ------------------------------------------------------------------------------------------------------------
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
    biased scores, then the A best biased experts inside them, each pick the first maximum (ties to the
    lowest index, as the reference's stable sort); weights = their unbiased scores, normalized, times scale.
    (*_PAD: the powers of two the shapes are padded to, with -inf.)"""
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
    """Kernel of nano_nsa.route: the whole router after its product, one program per token (the reference
    takes ~15 kernels)."""
    T, E = logits.shape
    weights = torch.empty(T, top_experts, dtype=torch.float32, device=logits.device)
    idx = torch.empty(T, top_experts, dtype=torch.int64, device=logits.device)
    if T:
        _route_kernel[(T,)](
            logits.float().contiguous(),
            bias,
            weights,
            idx,
            scale,
            G=groups,
            EG=E // groups,
            TOP_G=top_groups,
            A=top_experts,
            G_PAD=triton.next_power_of_2(groups),
            EG_PAD=triton.next_power_of_2(E // groups),
            A_PAD=triton.next_power_of_2(top_experts),
            num_warps=1,
        )
    return weights, idx


# ------------------------------------------------------------------------------------------------------------
# RoPE, MLA's latent cache write, the indexer's q / k quantization: one program per row, fp32 math
# ------------------------------------------------------------------------------------------------------------
@triton.jit
def _rotate(x1, x2, cos, sin, FIRST: tl.constexpr):
    """The rotated pair's first (x1 cos - x2 sin) or second (x1 sin + x2 cos) element, each product rounded
    as torch's separate kernels round it (launched with enable_fp_fusion=False: no FMA)."""
    if FIRST:
        return x1 * cos - x2 * sin
    return x1 * sin + x2 * cos


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
    """One (row, block of heads): y[t, h] = x[t, h] rotated by the row's position; interleaved pairs (2i,
    2i+1) or half-split pairs (i, i + R/2)."""
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
        _rope_kernel[(T, triton.cdiv(H, BLOCK_H))](
            x3,
            cos,
            sin,
            y,
            H,
            x3.stride(0),
            x3.stride(1),
            R=R,
            BLOCK_H=BLOCK_H,
            INTERLEAVED=interleaved,
            num_warps=1,
            enable_fp_fusion=False,
        )
    return y.view(x.shape)


@triton.jit
def _store_latent_kernel(
    kv_ptr,
    pe_ptr,
    w_ptr,
    cos_ptr,
    sin_ptr,
    slots_ptr,
    cache_ptr,
    kv_stride,
    pe_stride,
    eps,
    C: tl.constexpr,
    C_PAD: tl.constexpr,
    R: tl.constexpr,
):
    """One row: its latent RMS-normalized (fp32, one fixed sum order), rounded to bf16, FP8 round-tripped
    (1x128 groups, pow2 scales), and its rope key rotated (interleaved pairs), both into its slot's cache
    row [C | R]."""
    t = tl.program_id(0).to(tl.int64)
    row = cache_ptr + tl.load(slots_ptr + t) * (C + R)
    c = tl.arange(0, C_PAD)
    x = tl.load(kv_ptr + t * kv_stride + c, mask=c < C, other=0.0).to(tl.float32)
    inv = tl.rsqrt(tl.sum(x * x, 0) / C + eps)
    y = (tl.load(w_ptr + c, mask=c < C, other=0.0) * (x * inv)).to(tl.bfloat16).to(tl.float32)
    q, s = _pow2_quant(tl.reshape(y, [C_PAD // 128, 128]))
    latent = tl.reshape(q.to(tl.float32) * s[:, None], [C_PAD])
    tl.store(row + c, latent.to(tl.bfloat16), mask=c < C)
    i = tl.arange(0, R // 2)
    x1 = tl.load(pe_ptr + t * pe_stride + 2 * i).to(tl.float32)
    x2 = tl.load(pe_ptr + t * pe_stride + 2 * i + 1).to(tl.float32)
    cos = tl.load(cos_ptr + t * (R // 2) + i)
    sin = tl.load(sin_ptr + t * (R // 2) + i)
    tl.store(row + C + 2 * i, _rotate(x1, x2, cos, sin, True).to(tl.bfloat16))
    tl.store(row + C + 2 * i + 1, _rotate(x1, x2, cos, sin, False).to(tl.bfloat16))


def store_latent(kv, k_pe, norm_weight, eps, cos, sin, cache, slots):
    """Kernel of nano_nsa.store_latent: MLA's cache write, one launch."""
    T, C = kv.shape
    R = k_pe.shape[1]
    assert kv.stride(1) == 1 and k_pe.stride(1) == 1
    if T:
        _store_latent_kernel[(T,)](
            kv,
            k_pe,
            norm_weight,
            cos,
            sin,
            slots,
            cache.latent,
            kv.stride(0),
            k_pe.stride(0),
            eps,
            C=C,
            C_PAD=triton.next_power_of_2(C),
            R=R,
            num_warps=4,
            enable_fp_fusion=False,
        )


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
    """BLOCK_M rows (row r: token r // heads): NORM: LayerNorm first (fp32, weight and bias), rounded to
    bf16; RoPE on the first R dims (half-split pairs), rounded to bf16; the Hadamard transform as one
    tensor-core product with the +-1 Sylvester matrix (exact bf16 products, fp32 sums), times J^-0.5, rounded
    to bf16; then FP8 with one pow2 scale per row, written to row r, or SLOTS: to cache row slots[r]."""
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


_SYLVESTER = {}  # (n, device): the n x n +-1 Sylvester-Hadamard matrix


def _index_quant(x, cos, sin, q, s, slots=None, norm=(None, None, 0.0)):
    """Launches _index_quant_kernel over x [T, J] or [T, I, J]: FP8 rows into q and pow2 scales into s (at
    rows `slots` if given); norm: LayerNorm's (weight, bias, eps) to apply first."""
    J = x.shape[-1]
    if (J, x.device) not in _SYLVESTER:  # built at the first (eager) call, before any graph capture
        h = torch.ones(1, 1)
        while h.shape[0] < J:
            h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)])
        _SYLVESTER[J, x.device] = h.to(device=x.device, dtype=BF16)  # symmetric: x @ H = x @ H^T
    x2 = x.reshape(-1, J)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    M = x2.shape[0]
    heads = M // max(x.shape[0], 1)
    BLOCK_M = 16
    if M:
        _index_quant_kernel[(triton.cdiv(M, BLOCK_M),)](
            x2,
            cos,
            sin,
            _SYLVESTER[J, x.device],
            *norm[:2],
            slots,
            q,
            s,
            M,
            heads,
            x2.stride(0),
            J**-0.5,
            norm[2],
            R=2 * cos.shape[-1],
            J=J,
            BLOCK_M=BLOCK_M,
            NORM=norm[0] is not None,
            SLOTS=slots is not None,
            num_warps=4,
            enable_fp_fusion=False,
        )


def index_quant(x, cos, sin):
    """Kernel of nano_nsa.index_quant: x [T, J] (keys) or [T, I, J] (queries) -> (q8 like x, s [..., 1]), one
    launch. (The reference's 7-stage butterfly is ~30 small kernels.)"""
    q = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty(x.shape[:-1], dtype=torch.float32, device=x.device)
    _index_quant(x, cos, sin, q, s)
    return q, s[..., None]


def store_index_key(k, norm_weight, norm_bias, eps, cos, sin, cache, slots):
    """Kernel of nano_nsa.store_index_key: LayerNorm, RoPE, Hadamard, FP8 and the cache write, one launch."""
    _index_quant(k, cos, sin, cache.ik, cache.iks, slots, (norm_weight, norm_bias, eps))


# ------------------------------------------------------------------------------------------------------------
# Streams: independent parts of a layer run side by side
# ------------------------------------------------------------------------------------------------------------
_SIDE_STREAMS = {}  # device -> side_by_side's second streams: a part on the k-th forks onto the k+1-th


def stream_depth(device):
    """0 on the stream the engine runs on (or captures on); k on side_by_side's k-th second stream."""
    current = torch.cuda.current_stream(device)
    streams = _SIDE_STREAMS.get(device, [])
    return next((k + 1 for k, s in enumerate(streams) if s == current), 0)


def side_by_side(first, second):
    """Kernel of nano_nsa.side_by_side: second() on a second stream while first() runs on the current one,
    which then waits for it (captured in a CUDA graph: two branches that join). The second stream has the
    higher priority: the GPU schedules second()'s blocks first, so second() should be the longer chain (in a
    bs=1 layer of the 671B shapes the seventh pass measured the indexer at 43 us against the queries' 27 us,
    the routed experts at 119 us against the shared expert's 25). A part may fork again (the indexer's query
    path beside its head weights): each depth has a stream of its own. Both parts read only tensors that their
    caller holds until the join, so neither stream frees what the other reads; split-K GEMMs on different
    streams count their tiles in separate arrays (_LOCKS)."""
    main = torch.cuda.current_stream()
    streams = _SIDE_STREAMS.setdefault(main.device, [])
    depth = stream_depth(main.device)
    if depth == len(streams):
        streams.append(torch.cuda.Stream(main.device, priority=-1))
    side = streams[depth]
    side.wait_stream(main)
    with torch.cuda.stream(side):
        second_out = second()
    first_out = first()
    main.wait_stream(side)
    return first_out, second_out


# ------------------------------------------------------------------------------------------------------------
# The kernel set: the same names and signatures as nano_nsa.TORCH_OPS
# ------------------------------------------------------------------------------------------------------------
def bf16_dtype(w):
    """The dtype the kernels keep a weight in, whatever w's own: bf16 (attn_dtype: wkv_b's absorbed halves;
    dense_dtype: plain Linear weights, bf16 as the checkpoint stores them)."""
    return BF16


GPU_OPS = SimpleNamespace(
    name="kernels.py (Triton sparse MLA, indexer, FP8 / bf16 GEMMs and MoE; SDPA prefill)",
    index_quant=index_quant,
    store_index_key=store_index_key,
    index_topk=index_topk,
    sparse_mla=sparse_mla,
    dense_attention=dense_attention,
    head_linear=head_linear,
    rope=rope,
    store_latent=store_latent,
    rms_norm=rms_norm,
    fp8_linear=fp8_linear,
    swiglu_linear=swiglu_linear,
    dense_linear=dense_linear,
    route=route,
    moe=moe,
    side_by_side=side_by_side,
    dequantize_fp8=False,
    attn_dtype=bf16_dtype,
    dense_dtype=bf16_dtype,
)
