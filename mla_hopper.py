"""Sparse MLA decode on Hopper (SM90), written in Gluon, Triton's lower-level frontend: the kernel of
kernels.sparse_mla at DeepSeek's shapes (heads a multiple of 64, a 512 + 64 latent), where Triton's own
compiler leaves the FP8 cache rows' gathers unpipelined. Same contract and same definition
(nano_nsa.sparse_mla); kernels.py keeps the Triton kernel for every other shape.

The arithmetic: a row's selection is cut into chunks of CHUNK entries (kernels.MLA_HOPPER_CHUNK, 256: a
constant, so a row's split depends on its own selection alone, never on its batch), each chunk's softmax
is its own (a fresh max and sum, its own partial output), and kernels._mla_combine_kernel merges the
partials in chunk order. The schedule: one program is one query row t, 64 of its heads (the MMAs' M) and
CHUNKS consecutive chunks of it (kernels.mla_hopper_chunks: 1 for a few rows, up to all of a row's chunks
for many), which changes no bit: a program loads the row's queries once and runs its chunks as one stream
of 64-entry blocks, storing a chunk's partial after the chunk's last block while the copies of the next
chunk's first block are already in flight. Block i is computed while the blocks after it load:

    prefetch  the positions of block i + 3 and the KV-pool slots of block i + 2 (ordinary loads, first
              used a block later: a use stalls the thread until its load returns), block i + 1's scales
              into registers
    copy      cp.async gathers block i + 1's FP8 latents and bf16 rope keys into a two-deep ring of shared
              memory (640 of a cache row's 656 bytes: its 16 bytes of scales go to registers)
    dequant   block i's latents times their per-128 scales -> bf16 in shared memory (exact: a power of two)
    QK^T      S = Q_nope K^T in four 128-column wgmmas, each issued as soon as its group is dequantized (the
              tensor cores run group k while the threads dequantize group k + 1), + Q_pe PE^T in one
              (8 warps: each warpgroup 32 of the block's 64 columns)
    softmax   online, in exp2, fp32
    PV        O += P V, V the same bf16 latents (each warpgroup 256 of the 512 output columns), left
              running through block i + 1's issue of copies and its wait for them

Shared memory: Q 64 + 8 KB, the bf16 tile 64 KB, the ring 2 x (32 + 8) KB: 216 KB, one program an SM. A
launch whose selections fit in one chunk (a width W <= CHUNK) is normalized here, with no merge."""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    warpgroup_mma,
    warpgroup_mma_init,
    warpgroup_mma_wait,
)

NUM_WARPS = gl.constexpr(8)  # two warpgroups (the layouts below assume 8; kernels.sparse_mla launches 8)
# a block's rows as the copies and the dequant hold them: 4 rows a warp (a thread holds rows r and r + 32),
# 8 threads a row, 16 bytes a thread (latents, fp8), 8 rope values (bf16) or the row's 4 scales; the same
# rows in each, so a block's slots ([64], LATENT_ROWS's slice) serve all three with no exchange of threads
LATENT_ROWS = gl.constexpr(gl.BlockedLayout([1, 16], [4, 8], [8, 1], [1, 0]))
PE_ROWS = gl.constexpr(gl.BlockedLayout([1, 8], [4, 8], [8, 1], [1, 0]))
SCALE_ROWS = gl.constexpr(gl.BlockedLayout([1, 4], [4, 8], [8, 1], [1, 0]))
# wgmma layouts: each warpgroup's 4 warps stack along the 64 heads, the two warpgroups split N: O [64, C]
# (each 256 of its columns), S [64, 64] (each 32), and P as PV's A operand (each warpgroup all of it)
O_LAYOUT = gl.constexpr(gl.NVMMADistributedLayout([3, 0], [4, 2], [16, 256, 16]))
S_LAYOUT = gl.constexpr(gl.NVMMADistributedLayout([3, 0], [4, 2], [16, 32, 16]))
P_LAYOUT = gl.constexpr(gl.DotOperandLayout(0, O_LAYOUT, 2))


@gluon.jit
def _positions(sel, j0, end, LAYOUT: gl.constexpr):
    """A row's selected positions j0 .. j0 + 63 (-1: none: past end, or a -1 pad). sel: the selection's
    int64 words read as int32 pairs, low word first (positions and slots are below 2^30, their offsets
    doubled in int32): an int32 load needs no conversion, and a conversion, like any use, would stall the
    thread until the load returns."""
    j = j0 + gl.arange(0, 64, layout=LAYOUT)
    return gl.load(sel + 2 * j, mask=j < end, other=-1)


@gluon.jit
def _slots(table, pos):
    """The KV-pool slots of positions pos (-1 where pos is; table read as int32 pairs, as _positions)."""
    return gl.load(table + 2 * pos, mask=pos >= 0, other=-1)


@gluon.jit
def _issue_copies(kv8_ptr, pec_ptr, slot, raw, pe, ROW: gl.constexpr, C: gl.constexpr, R: gl.constexpr):
    """cp.async of a block's FP8 latents [64, C] into raw and bf16 rope keys [64, R] into pe (invalid
    slots: zeros)."""
    c = gl.arange(0, C, layout=gl.SliceLayout(0, LATENT_ROWS))
    ptr = kv8_ptr + gl.maximum(slot, 0).to(gl.int64)[:, None] * ROW + c[None, :]
    async_copy.async_copy_global_to_shared(raw, ptr, mask=(slot >= 0)[:, None])
    s = gl.convert_layout(slot, gl.SliceLayout(1, PE_ROWS))  # (the same rows: no exchange)
    r = gl.arange(0, R, layout=gl.SliceLayout(0, PE_ROWS))
    ptr = pec_ptr + gl.maximum(s, 0).to(gl.int64)[:, None] * (ROW // 2) + r[None, :]
    async_copy.async_copy_global_to_shared(pe, ptr, mask=(s >= 0)[:, None])
    async_copy.commit_group()


@gluon.jit
def _load_scales(kvs_ptr, slot, ROW: gl.constexpr, C: gl.constexpr):
    """A block's latent scales [64, C // 128] fp32 (a 1x128 group each)."""
    s = gl.convert_layout(slot, gl.SliceLayout(1, SCALE_ROWS))
    g = gl.arange(0, C // 128, layout=gl.SliceLayout(0, SCALE_ROWS))
    ptr = kvs_ptr + gl.maximum(s, 0).to(gl.int64)[:, None] * (ROW // 4) + g[None, :]
    return gl.load(ptr, mask=(s >= 0)[:, None], other=0.0)


@gluon.jit
def _dequant(raw, scales, kv, k: gl.constexpr):
    """Group k of a block: raw FP8 latents [64, 128] (shared) times their scales (column k of [64, C // 128])
    -> kv's columns 128 k ..., bf16 (shared, wgmma's)."""
    g = gl.arange(0, scales.shape[1], layout=gl.SliceLayout(0, SCALE_ROWS))
    x = raw.slice(k * 128, 128, dim=1).load(LATENT_ROWS).to(gl.float32)
    sk = gl.sum(gl.where(g[None, :] == k, scales, 0.0), 1)  # [64]: the scales of group k
    sk = gl.convert_layout(sk, gl.SliceLayout(1, LATENT_ROWS))  # (the same rows: no exchange)
    kv.slice(k * 128, 128, dim=1).store((x * sk[:, None]).to(gl.bfloat16))


@gluon.jit
def sparse_mla_kernel(
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
    scale_log2,
    CHUNKS,
    ROW: gl.constexpr,
    C: gl.constexpr,
    R: gl.constexpr,
    SPLITS: gl.constexpr,
    CHUNK: gl.constexpr,
):
    """One (row t, 64 heads, CHUNKS consecutive chunks from chunk p * CHUNKS): see the module's docstring.
    scale_log2: the softmax scale times log2(e). ROW: a cache row's bytes, read through three typed views
    (kv8 fp8, kvs fp32, pec bf16), whose row strides are ROW, ROW // 4 and ROW // 2 elements. Output as
    kernels._sparse_mla_kernel's (_mla_store's layout: normalized, or each chunk's partial and (max, sum) in
    natural-log units)."""
    t, hb, p = gl.program_id(0), gl.program_id(1), gl.program_id(2)
    buffers = _shared_memory(C, R)  # (q, q_pe, the bf16 tile, the ring's latents and rope keys)
    _load_queries(q_ptr, qpe_ptr, buffers[0], buffers[1], t, hb, H, C, R)
    n_valid = gl.minimum(gl.load(ctx_ptr + t).to(gl.int32), W)
    first = p * CHUNKS
    chunks = gl.minimum(CHUNKS, SPLITS - first)
    table = table_ptr + gl.load(row_req_ptr + t).to(gl.int64) * table_stride
    table = table.to(gl.pointer_type(gl.int32), bitcast=True)
    sel = (sel_ptr + t.to(gl.int64) * W).to(gl.pointer_type(gl.int32), bitcast=True)
    row = (sel, table, first * CHUNK, gl.minimum((first + chunks) * CHUNK, n_valid))
    out = (out_ptr, part_ptr, ml_ptr, T * H, t, hb, H, first, chunks)
    cache = (kv8_ptr, kvs_ptr, pec_ptr)
    _attend(buffers, cache, row, out, scale_log2, ROW, C, R, SPLITS, CHUNK)


@gluon.jit
def _shared_memory(C: gl.constexpr, R: gl.constexpr):
    """The program's buffers: the queries [64, C] and [64, R], the bf16 tile [64, C], and the two-deep ring
    of raw FP8 latents [2, 64, C] and rope keys [2, 64, R]."""
    q_smem = gl.allocate_shared_memory(
        gl.bfloat16, [64, C], gl.NVMMASharedLayout.get_default_for([64, C], gl.bfloat16)
    )
    qpe_smem = gl.allocate_shared_memory(
        gl.bfloat16, [64, R], gl.NVMMASharedLayout.get_default_for([64, R], gl.bfloat16)
    )
    kv = gl.allocate_shared_memory(
        gl.bfloat16, [64, C], gl.NVMMASharedLayout.get_default_for([64, C], gl.bfloat16)
    )
    # (unswizzled: a warp reads 128 contiguous bytes of 4 rows, which no swizzle would spread further)
    raw = gl.allocate_shared_memory(gl.float8e4nv, [2, 64, C], gl.SwizzledSharedLayout(16, 1, 1, [1, 0]))
    pe = gl.allocate_shared_memory(
        gl.bfloat16, [2, 64, R], gl.NVMMASharedLayout.get_default_for([64, R], gl.bfloat16)
    )
    return q_smem, qpe_smem, kv, raw, pe


@gluon.jit
def _load_queries(q_ptr, qpe_ptr, q_smem, qpe_smem, t, hb, H, C: gl.constexpr, R: gl.constexpr):
    """Row t's 64 heads from hb * 64 on: q [64, C] and q_pe [64, R] into shared memory (wgmma's A)."""
    ld: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [NUM_WARPS, 1], [1, 0])
    h = hb * 64 + gl.arange(0, 64, layout=gl.SliceLayout(1, ld))
    qrow = t.to(gl.int64) * H + h
    c = gl.arange(0, C, layout=gl.SliceLayout(0, ld))
    q_smem.store(gl.load(q_ptr + qrow[:, None] * C + c[None, :]))
    r = gl.arange(0, R, layout=gl.SliceLayout(0, ld))
    qpe_smem.store(gl.load(qpe_ptr + qrow[:, None] * R + r[None, :]))


@gluon.jit
def _attend(
    buffers,
    cache,
    row,
    out,
    scale_log2,
    ROW: gl.constexpr,
    C: gl.constexpr,
    R: gl.constexpr,
    SPLITS: gl.constexpr,
    CHUNK: gl.constexpr,
):
    """The program's chunks (row: the row's selection and page-table row, the first chunk's first entry, the
    last chunk's end; out: where and which chunks to store), each from a fresh softmax state and stored at
    its end, the copies running ahead across the chunks' boundaries (the module's loop)."""
    q_smem, qpe_smem, kv, raw, pe = buffers
    kv8_ptr, kvs_ptr, pec_ptr = cache
    sel, table, start, end = row
    out_ptr, part_ptr, ml_ptr, TH, t, hb, H, first, chunks = out
    # the prefetch chain (the module's docstring): entering block i, slot_next holds block i + 1's slots and
    # pos_after block i + 2's positions; block i loads positions (i + 3) -> slots (i + 2) -> copies and
    # scales (i + 1), each used a block after its issue
    rows: gl.constexpr = gl.SliceLayout(1, LATENT_ROWS)
    slot = _slots(table, _positions(sel, start, end, rows))
    _issue_copies(kv8_ptr, pec_ptr, slot, raw.index(0), pe.index(0), ROW, C, R)
    scales = _load_scales(kvs_ptr, slot, ROW, C)
    cols = _positions(sel, start, end, gl.SliceLayout(0, S_LAYOUT))  # (S's columns: -1 masks one)
    chain = (_slots(table, _positions(sel, start + 64, end, rows)), _positions(sel, start + 128, end, rows))
    per_chunk: gl.constexpr = CHUNK // 64
    for k in range(0, chunks):
        m = gl.full([64], float("-inf"), gl.float32, gl.SliceLayout(1, S_LAYOUT))
        lsum = gl.zeros([64], gl.float32, gl.SliceLayout(1, S_LAYOUT))
        acc = warpgroup_mma_init(gl.zeros([64, C], gl.float32, O_LAYOUT))  # (a running wgmma's, in the loop)
        blocks = gl.minimum(gl.maximum(gl.cdiv(end - start - k * CHUNK, 64), 0), per_chunk)
        for j in range(0, blocks):
            i = k * per_chunk + j
            sc, acc, scales, cols_next, chain = _next_scores(
                buffers, cache, row, i, scales, chain, acc, ROW, C, R
            )
            p, alpha, m, lsum = _online_softmax(sc, cols >= 0, m, lsum, scale_log2)
            cols = cols_next
            acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, O_LAYOUT))[:, None]
            acc = warpgroup_mma(gl.convert_layout(p.to(gl.bfloat16), P_LAYOUT), kv, acc, is_async=True)
        acc = warpgroup_mma_wait(0, deps=[acc])
        _store(acc, m, lsum, out_ptr, part_ptr, ml_ptr, TH, t, hb, first + k, H, C, SPLITS, O_LAYOUT)
    async_copy.wait_group(0)


@gluon.jit
def _next_scores(
    buffers, cache, row, i, scales, chain, acc, ROW: gl.constexpr, C: gl.constexpr, R: gl.constexpr
):
    """Block i's scores S [64, 64] (its copies landed, PV(i - 1) waited for), block i + 1's copies issued
    and the chain moved a block on -> (S, O after PV(i - 1), block i + 1's scales and column positions,
    the chain). Nothing loaded here is used before block i + 1: a use waits for the load."""
    q_smem, qpe_smem, kv, raw, pe = buffers
    kv8_ptr, kvs_ptr, pec_ptr = cache
    sel, table, start, end = row
    slot_next, pos_after = chain
    b = i % 2
    gl.thread_barrier()  # every warp is done with ring 1 - b (block i - 1's rope keys: the other QK^T)
    _issue_copies(kv8_ptr, pec_ptr, slot_next, raw.index(1 - b), pe.index(1 - b), ROW, C, R)
    scales_next = _load_scales(kvs_ptr, slot_next, ROW, C)
    cols_next = _positions(sel, start + (i + 1) * 64, end, gl.SliceLayout(0, S_LAYOUT))
    slot_after = _slots(table, pos_after)
    pos_after = _positions(sel, start + (i + 3) * 64, end, gl.SliceLayout(1, LATENT_ROWS))  # (block i + 3's)
    async_copy.wait_group(1)  # block i's copies (this thread's)
    acc = warpgroup_mma_wait(0, deps=[acc])  # block i - 1's PV: it read kv
    gl.thread_barrier()  # every thread's copies of block i landed; both warpgroups' PV(i - 1) left kv
    sc = _scores(q_smem, qpe_smem, raw, pe, b, scales, kv, C)
    return sc, acc, scales_next, cols_next, (slot_after, pos_after)


@gluon.jit
def _scores(q_smem, qpe_smem, raw, pe, b, scales, kv, C: gl.constexpr):
    """A block's S = Q K^T [64, 64] fp32 from ring b, by 128-column groups, each issued as soon as its group
    is dequantized into kv (the tensor cores run group k while the threads dequantize group k + 1)."""
    sc = gl.zeros([64, 64], gl.float32, S_LAYOUT)
    for k in gl.static_range(C // 128):
        _dequant(raw.index(b), scales, kv, k)
        gl.thread_barrier()  # (then the fence: the threads' writes visible to wgmma's async proxy)
        fence_async_shared()
        cols = kv.slice(k * 128, 128, dim=1).permute((1, 0))
        sc = warpgroup_mma(q_smem.slice(k * 128, 128, dim=1), cols, sc, use_acc=k > 0, is_async=True)
    sc = warpgroup_mma(qpe_smem, pe.index(b).permute((1, 0)), sc, is_async=True)
    return warpgroup_mma_wait(0, deps=[sc])


@gluon.jit
def _online_softmax(sc, valid, m, lsum, scale_log2):
    """One block's step of the online softmax, in exp2 (valid: S's real columns) -> (P, the factor alpha
    that rescales what came before, the new max, the new sum)."""
    sc = gl.where(valid[None, :], sc * scale_log2, float("-inf"))
    m_new = gl.maximum(m, gl.max(sc, 1))
    m_ref = gl.where(m_new == float("-inf"), 0.0, m_new)  # no valid slot yet: keep zeros, not NaN
    alpha = gl.exp2(m - m_ref)
    p = gl.exp2(sc - m_ref[:, None])
    return p, alpha, m_new, lsum * alpha + gl.sum(p, 1)


@gluon.jit
def _store(
    acc,
    m,
    lsum,
    out_ptr,
    part_ptr,
    ml_ptr,
    TH,
    t,
    hb,
    s,
    H,
    C: gl.constexpr,
    SPLITS: gl.constexpr,
    o_layout: gl.constexpr,
):
    """kernels._mla_store's layout: SPLITS == 1, the normalized output; else chunk s's partial and (max,
    sum), the max in natural-log units (the combine kernel's)."""
    h = hb * 64 + gl.arange(0, 64, layout=gl.SliceLayout(1, o_layout))
    c = gl.arange(0, C, layout=gl.SliceLayout(0, o_layout))
    qrow = t.to(gl.int64) * H + h
    if SPLITS == 1:
        l_o = gl.convert_layout(lsum, gl.SliceLayout(1, o_layout))
        gl.store(out_ptr + qrow[:, None] * C + c[None, :], (acc / l_o[:, None]).to(gl.bfloat16))
    else:
        part = s.to(gl.int64) * TH + qrow
        gl.store(part_ptr + part[:, None] * C + c[None, :], acc)
        part_s = gl.convert_layout(part, m.type.layout)
        gl.store(ml_ptr + part_s * 2, m * 0.6931471805599453)  # (ln 2: from log2 units to natural)
        gl.store(ml_ptr + part_s * 2 + 1, lsum)
