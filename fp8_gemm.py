"""FP8 activation quantization, the block-scaled GEMM, and the grouped MoE built on it (docs/model.md §2).

act_quant (1x128 groups, pow2 scales); _gemm: FP8 (or bf16) GEMM with split-K fixed by the weight's shape, the
partials summed in order by a tile's last program, long weight walks by TMA; fp8_linear, swiglu_linear,
dense_linear, head_linear and moe_grouped on it. Each public function's torch reference is the function of the
same name in nano_nsa.py (moe_grouped's: nano_nsa.moe; swiglu_linear's: w2's half of nano_nsa.mlp). kernels.py
re-exports every name here.
"""

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice
from triton.tools.tensor_descriptor import TensorDescriptor

BF16 = torch.bfloat16

ACT_QUANT_GROUPS = 8  # 128-wide groups per program: a one-row 16384-wide input is 16 programs, not one
_QUANTIZED = {}  # id(x) -> (x, q, s): the last few activations quantized (act_quant, rms_norm), kept alive
QUANTIZED_KEPT = 4
GEMM_BLOCK_M = 64  # one tile height for every M: a row's sums never depend on how many rows there are
GEMM_PROGRAMS = 256  # split-K aims at this many programs for one row tile (about 2 per SM of an H200)
GEMM_SPLITS = 16  # at most: the tile's last program adds the partials one after another
GEMM_PARTIAL_BYTES = 64 << 20  # bound on the split-K partials of one launch (long prefills run in parts)
GEMM_LOCKS = 1 << 16  # split-K tile counters, zero between launches
_LOCKS = {}  # (device, stream_depth below) -> the counters (made at the first, eager, call)
_HEAD_ROWS = {}  # (T, H, device) -> head_linear's row map and block heads (_head_rows)
HEAD_ROWS_CACHED = 256  # T up to this is kept for good; of longer T only the last


# Split-K counters are kept per stream depth (kernels.side_by_side forks the streams): one copy, here.
_SIDE_STREAMS = {}  # device -> side_by_side's second streams: a part on the k-th forks onto the k+1-th


def stream_depth(device):
    """0 on the stream the engine runs on (or captures on); k on side_by_side's k-th second stream."""
    current = torch.cuda.current_stream(device)
    streams = _SIDE_STREAMS.get(device, [])
    return next((k + 1 for k, s in enumerate(streams) if s == current), 0)


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
    """One row's 1x128 groups, GROUPS at a time (each quantized alone: how they are shared out changes no
    bit), of x (SWIGLU: of silu(x[:, :K]) * x[:, K:]) -> q e4m3, s fp32. rows_ptr: a row whose entry is
    negative is padding (the MoE's expert blocks), left alone."""
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


def remember_quantized(x, q, s):
    """Keep x's quantization for act_quant: MLA's normed query latent feeds wq_b and the indexer's wq_b, a
    FFN's normed input feeds the shared and the routed experts, and every norm quantizes its own output."""
    while len(_QUANTIZED) >= QUANTIZED_KEPT:
        del _QUANTIZED[next(iter(_QUANTIZED))]
    _QUANTIZED[id(x)] = (x, q, s)


def _rows(x, K):
    """x as rows [-1, K] with unit column stride (copied only where needed)."""
    x2 = x.reshape(-1, K)
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def act_quant(x, swiglu=False, rows=None):
    """Kernel of nano_nsa.act_quant (bit-exact): x [..., K] -> (q e4m3, s [..., K/128] fp32); swiglu: of
    silu(gate) * up (rounded to bf16) for x = [gate | up]; rows [M]: a row whose entry is negative is
    padding, left unset. A tensor quantized already (remember_quantized) is not quantized again (never
    written into)."""
    seen = _QUANTIZED.get(id(x))
    if not swiglu and seen is not None and seen[0] is x:
        return seen[1], seen[2]
    K = x.shape[-1] // (2 if swiglu else 1)
    x2 = _rows(x, x.shape[-1])
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
    (SCALED=False: bf16 A and B, no scales). GATHER: row m of A is rows[m] (-1: padding); SCATTER: written to
    row rows[m] of C. GROUPED: row block pid_m reads expert experts[pid_m]'s B (-1: none). SPLIT_K > 1:
    program k sums the k blocks k, k + SPLIT_K, ...; the tile's last program adds the partials in split order
    (_gemm_store). B_TMA: B's tiles by TMA through b_desc."""
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
    """acc plus the k block kb's product of the tiles a and b, times (SCALED) each row's sa[kb] and the tile's
    weight-block scale sb[kb]. sa is a power of two (act_quant's), so product * (sa * sb) rounds once, as
    (product * sa) * sb does: the same bits with one multiply per element (docs/performance.md)."""
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
    """A tile's end: acc into c; with split-K, this program's partial into its slice of [SPLIT_K, M, N], and
    the tile's last program to finish (an int counter per tile) adds the slices into c in split order."""
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


def gemm_config(N, K, grouped=False, fp8=True):
    """Tile width, split-K, pipeline depth and weight loads of the GEMM of an [N, K] weight, from its shape
    alone (never from the number of rows, which would make a row's sum order depend on the batch); from sweeps
    at 1 to 64 rows on an H200 (docs/performance.md). Grouped (the MoE experts, MLA's per-head maps): no
    split. Otherwise split-K to fill the SMs at one row tile (at most GEMM_SPLITS and 128 KB of fp32 partials
    per row; none for 16 k blocks or fewer), and 16-wide tiles for N <= 256. An FP8 weight comes by TMA when a
    program walks 32 k blocks or more (16 grouped). Only split-K changes a bit: it orders the sums."""
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
    """A8 [*, K] (rows picked by `rows` if given), B8 [N, K] or [E, N, K] (with `experts` per block of
    GEMM_BLOCK_M rows) -> C [M, N] out_dtype (scatter: C [*, N] at rows `rows`), fp32 sums of each 128-block
    product times its two scales in an order fixed by the weight's shape. sa = sb = None: bf16, no scales."""
    K = b.shape[-1]
    config = gemm_config(N, K, grouped=experts is not None, fp8=sb is not None)
    config["B_TMA"] &= b.is_contiguous()
    assert 128 % config["BLOCK_N"] == 0  # a tile reads one row of weight-block scales (_gemm_k_block)
    split = config["SPLIT_K"]
    flags = dict(SCALED=sa is not None, GATHER=rows is not None, SCATTER=scatter, GROUPED=experts is not None)
    c = torch.empty(a.shape[0] if scatter else M, N, device=a.device, dtype=out_dtype)
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
        assert split == 1 or grid[0] * grid[1] <= GEMM_LOCKS  # (a counter per tile: split-K's alone)
        part = torch.empty(split, m, N, device=a.device, dtype=torch.float32) if split > 1 else None
        scales_a = None if sa is None else sa[m0:]
        out = c if scatter else c[m0 : m0 + m]  # (the gathered and grouped GEMMs never run in parts: m0 = 0)
        operands = (a[m0:], scales_a, rows, b, sb, experts, out, part, _LOCKS[locks], b_desc)
        _gemm_kernel[grid](*operands, m, N, K, a.stride(0), BLOCK_M=GEMM_BLOCK_M, **flags, **config)
    return c


def fp8_linear(x, w, scale, partial=False):
    """Kernel of nano_nsa.fp8_linear: act_quant then the block-scaled FP8 GEMM, bf16 out (partial: fp32)."""
    return _quantized_linear(*act_quant(x), w, scale, partial)


def swiglu_linear(h, w, scale, partial=False):
    """w2's half of nano_nsa.mlp: SwiGLU's activation and act-quant in one kernel, then the GEMM."""
    return _quantized_linear(*act_quant(h, swiglu=True), w, scale, partial)


def _quantized_linear(q, s, w, scale, partial):
    """Act-quantized rows (q [..., K] e4m3, s [..., K/128]) times the FP8 weight -> [..., N] bf16 or fp32."""
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
def _mark_padding(token_ptr, live_ptr, first, R, stride):
    """-1 in token and live for the 1024-row blocks first, first + stride, ... (stride programs together mark
    all R rows); the pairs' rows are written over them after."""
    for r0 in range(first * 1024, R, stride * 1024):
        r = r0 + tl.arange(0, 1024)
        tl.store(token_ptr + r, tl.full([1024], -1, tl.int64), mask=r < R)
        tl.store(live_ptr + r, tl.full([1024], -1, tl.int64), mask=r < R)


@triton.jit
def _moe_count_kernel(idx_ptr, hist_ptr, token_ptr, live_ptr, P, R, E_PAD: tl.constexpr, BLK: tl.constexpr):
    """Program b: the expert histogram of pairs [b * BLK, (b + 1) * BLK) (idx as the router wrote it, int64),
    and its share of the padding marks."""
    b = tl.program_id(0)
    p = b * BLK + tl.arange(0, BLK)
    e = tl.load(idx_ptr + p, mask=p < P, other=0).to(tl.int32)
    tl.store(hist_ptr + b * E_PAD + tl.arange(0, E_PAD), tl.histogram(e, E_PAD, mask=p < P))
    _mark_padding(token_ptr, live_ptr, b, R, tl.num_programs(0))


@triton.jit
def _moe_place_kernel(
    idx_ptr,
    hist_ptr,
    token_ptr,
    live_ptr,
    pos_ptr,
    expert_ptr,
    P,
    R,
    n_blocks,
    NB,
    A: tl.constexpr,
    E: tl.constexpr,
    E_PAD: tl.constexpr,
    BM: tl.constexpr,
    BLK: tl.constexpr,
    SUB: tl.constexpr,
    ONE: tl.constexpr,
):
    """Program b places pairs [b * BLK, (b + 1) * BLK) of the P = T * A (token, choice) pairs for the grouped
    GEMMs: rows sorted by expert (in pair order within one) into blocks of BM rows, each expert's padded to
    whole blocks. Expert e's rows start at its padded offset (from the NB blocks' histograms), then come its
    pairs of earlier blocks, then this block's in order. Writes pos[p] (pair p's row), token[row] and
    live[row], and the expert of its share of the GEMM blocks (-1: none). idx E (another rank's expert) sorts
    last, as -1. E_PAD: E + 1 rounded up to a power of two; SUB: pairs per step. ONE: the only block, which
    counts its pairs and marks the padding itself (one launch instead of two)."""
    b = tl.program_id(0)
    bins = tl.arange(0, E_PAD)
    if ONE:
        every = tl.arange(0, BLK)  # (names of their own: a loop below must not see them as its variables)
        choices = tl.load(idx_ptr + every, mask=every < P, other=0).to(tl.int32)
        total = tl.histogram(choices, E_PAD, mask=every < P)
        before = tl.zeros([E_PAD], tl.int32)
        _mark_padding(token_ptr, live_ptr, 0, R, 1)
        tl.debug_barrier()  # every padding mark is written before the pairs' rows overwrite theirs
    else:
        total = tl.zeros([E_PAD], tl.int32)
        before = tl.zeros([E_PAD], tl.int32)
        for c0 in range(0, NB, 8):  # the histograms, 8 blocks at a time
            c = c0 + tl.arange(0, 8)
            h = tl.load(hist_ptr + c[:, None] * E_PAD + bins[None, :], mask=(c < NB)[:, None], other=0)
            total += tl.sum(h, 0)
            before += tl.sum(tl.where((c < b)[:, None], h, 0), 0)
    padded = (total + BM - 1) // BM * BM
    pad_end = tl.cumsum(padded, 0)  # expert e's rows: [pad_end[e] - padded[e], pad_end[e])
    for q0 in range(b * SUB, n_blocks, NB * SUB):  # this program's share of the blocks' experts
        q = q0 + tl.arange(0, SUB)
        e = tl.sum((pad_end[None, :] <= q[:, None] * BM).to(tl.int32), 1)  # the expert holding row q * BM
        tl.store(expert_ptr + q, tl.where(e < E, e, -1), mask=q < n_blocks)
    placed = pad_end - padded + before  # the next free row of each expert
    for p0 in range(b * BLK, tl.minimum(b * BLK + BLK, P), SUB):
        p = p0 + tl.arange(0, SUB)
        e = tl.load(idx_ptr + p, mask=p < P, other=E_PAD).to(tl.int32)
        mine = e[:, None] == bins[None, :]  # [SUB, E_PAD] one-hot
        earlier = (e[:, None] == e[None, :]) & (p[None, :] < p[:, None])  # same expert, before in this step
        row = tl.sum(tl.where(mine, placed[None, :], 0), 1) + tl.sum(earlier.to(tl.int32), 1)
        tl.store(pos_ptr + p, row.to(tl.int64), mask=p < P)
        tl.store(token_ptr + row, (p // A).to(tl.int64), mask=p < P)
        tl.store(live_ptr + row, row.to(tl.int64), mask=p < P)
        placed += tl.sum(mine.to(tl.int32), 0)


def moe_layout(idx, E):
    """The grouped GEMMs' layout for expert choices idx [T, A] of E experts: (token [R], live [R], pos
    [T * A], expert [R / GEMM_BLOCK_M]), R an upper bound on the padded rows known on the host (no sync).
    Up to 128 pairs: one program; more: blocks of pairs counted, then placed, in two launches of at most 128
    programs (one program laying out 2048 pairs alone took 160 us, now 18). The layout is the same whatever
    the blocks."""
    T, A = idx.shape
    P = T * A
    bm = GEMM_BLOCK_M
    n_blocks = min(E + 1, P) + triton.cdiv(P, bm)
    token = torch.empty(n_blocks * bm, dtype=torch.int64, device=idx.device)
    live = torch.empty_like(token)
    pos = torch.empty(P, dtype=torch.int64, device=idx.device)
    experts = torch.empty(n_blocks, dtype=torch.int32, device=idx.device)
    E_PAD = triton.next_power_of_2(E + 1)
    blk = triton.next_power_of_2(max(32, min(P, 128), triton.cdiv(P, 128)))  # one block iff P <= 128
    nb = triton.cdiv(P, blk)
    hist = torch.empty(nb if nb > 1 else 0, E_PAD, dtype=torch.int32, device=idx.device)
    idx = idx.contiguous()
    if nb > 1:
        _moe_count_kernel[(nb,)](idx, hist, token, live, P, len(token), E_PAD=E_PAD, BLK=blk, num_warps=4)
    shape = dict(A=A, E=E, E_PAD=E_PAD, BM=bm, BLK=blk, SUB=32, ONE=nb == 1, num_warps=4)
    _moe_place_kernel[(nb,)](idx, hist, token, live, pos, experts, P, len(token), n_blocks, nb, **shape)
    return token, live, pos, experts


def moe_grouped(x, weights, idx, w13, s13, w2, s2):
    """Kernel of nano_nsa.moe on the experts' stacks (w13 [E, 2I, dim] = w1 | w3), with no host sync:
    the (token, expert) pairs sorted into blocks of GEMM_BLOCK_M rows of one expert each (moe_layout); a
    grouped FP8 GEMM for w1|w3, SwiGLU in the act-quant, a grouped GEMM for w2, then each token's rows summed
    in choice order. Batch-invariant: one tile height, no split-K, no atomics. idx E (another rank's expert)
    falls in blocks of expert -1, which the GEMMs skip."""
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
        o, pos, weights.float().contiguous(), y, dim, A=A, BLOCK=BLOCK, num_warps=4
    )
    return y


def dense_linear(x, w):
    """Kernel of nano_nsa.dense_linear: bf16 weight (lm_head, weights_proj, eh_proj, the router), fp32 sums
    and output, through the GEMM above, whose sum order is fixed by the weight's shape (cuBLAS picks its own
    by the number of rows: different bits from 16 rows for eh_proj, from 2 for the router)."""
    x2 = _rows(x.to(BF16), x.shape[-1])
    y = _gemm(x2, None, w, None, x2.shape[0], w.shape[0], out_dtype=torch.float32)
    return y.view(*x.shape[:-1], w.shape[0])


def _head_rows(T, H, device):
    """head_linear's row map [H * Tp] and block heads for T rows, kept for decode-sized T (CUDA graphs read
    them) and, outside a capture, for the last longer T (the layers of one prompt chunk share it)."""
    key = (T, H, device)
    kept = T <= HEAD_ROWS_CACHED or not torch.cuda.is_current_stream_capturing()  # (a capture makes its own)
    if kept and key in _HEAD_ROWS:
        return _HEAD_ROWS[key]
    Tp = triton.cdiv(T, GEMM_BLOCK_M) * GEMM_BLOCK_M
    t = torch.arange(Tp, device=device)
    rows = torch.where(t < T, t * H + torch.arange(H, device=device)[:, None], -1).flatten()
    heads = torch.arange(H, device=device, dtype=torch.int32).repeat_interleave(Tp // GEMM_BLOCK_M)
    if kept and T > HEAD_ROWS_CACHED:  # one longer T at a time
        for old in [k for k in _HEAD_ROWS if k[0] > HEAD_ROWS_CACHED]:
            del _HEAD_ROWS[old]
    if kept:
        _HEAD_ROWS[key] = (rows, heads)
    return rows, heads


def head_linear(x, w):
    """Kernel of nano_nsa.head_linear (MLA's absorbed W_UK, W_UV): x [T, H, K] by each head's w [H, N, K] ->
    [T, H, N] bf16, as the MoE's grouped GEMM with heads for experts: head h's rows (t * H + h) fill blocks of
    their own, so the sum order is fixed by the weight's shape (cuBLAS's follows T)."""
    T, H, K = x.shape
    rows, heads = _head_rows(T, H, x.device)
    x2 = x.to(BF16)
    if x2.stride(2) != 1 or x2.stride(0) != H * x2.stride(1):  # rows t * H + h one stride apart
        x2 = x2.contiguous()
    a = x2.as_strided((T * H, K), (x2.stride(1), 1))
    y = _gemm(a, None, w, None, len(rows), w.shape[1], rows=rows, experts=heads, scatter=True)
    return y.view(T, H, -1)
