"""The engine's sampling kernels (nano_nsa's "Sampling and speculative acceptance"): the counter-based uniform
numbers, the exponential race that draws a token (sample), the softmax cut to the top-p nucleus
(probs_from_logits), and speculative sampling's acceptance (rejection_sample). Each public function's torch
reference is the function of the same name in nano_nsa.py; kernels.py re-exports the engine's three (uniform
is the tests' window on the numbers the others hash in registers). Over a full vocabulary a row is split over
programs (split_rows): one program a row of 129,280 tokens left the GPU idle (0.73 ms a probs_from_logits row
on an H200, 74 us split). A short row (the demo's 2048 tokens) is held in one program's registers instead
(_probs_row_kernel).
"""

import math

import torch
import triton
import triton.language as tl

# ---- Sampling's random numbers: a counter-based hash of (seed, position, stream, column) ----
TARGET, ACCEPT = tl.constexpr(1), tl.constexpr(3)  # nano_nsa's streams (the tests compare the draws)


@triton.jit
def _mix32(x):
    """nano_nsa.mix32 on int64 holding 32-bit values (the same integer steps: the same bits)."""
    x = (((x >> 16) ^ x) * 0x45D9F3B) & 0xFFFFFFFF
    x = (((x >> 16) ^ x) * 0x45D9F3B) & 0xFFFFFFFF
    return (x >> 16) ^ x


@triton.jit
def _key(seed, pos, stream):
    """nano_nsa.uniform's key: the hash of a seed, a position and the stream."""
    key = _mix32(_mix32(_mix32(seed & 0xFFFFFFFF) ^ (seed >> 32)) ^ pos)
    return _mix32(key ^ stream)


@triton.jit
def _row_key(seed_ptr, pos_ptr, r, stream):
    """Row r's key, from its seed and its position."""
    return _key(tl.load(seed_ptr + r), tl.load(pos_ptr + r), stream)


@triton.jit
def _uniform_block(key, cols):
    """The uniform numbers of a row's columns cols, from its key (32 bits in fp32, in (0, 1])."""
    return (_mix32(_mix32(key ^ cols.to(tl.int64)) ^ key).to(tl.float32) + 0.5) / 4294967296.0


@triton.jit
def _exponential(u):
    """nano_nsa.exponential: E = -log(1 - u), in the same steps (log1p's Goldberg form)."""
    w = tl.maximum(1.0 - u, 2.0**-25)
    return tl.where(w == 1.0, u, -tl.log(w) * u / (1.0 - w))


@triton.jit
def _uniform_kernel(seed_ptr, pos_ptr, out_ptr, n, stream, BLOCK: tl.constexpr):
    """One row (a seed and a position) per program's first axis, BLOCK columns per its second."""
    r = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    u = _uniform_block(_row_key(seed_ptr, pos_ptr, r, stream), cols)
    tl.store(out_ptr + r.to(tl.int64) * n + cols, u, mask=cols < n)


def _seeded_rows(seeds, positions):
    """(seeds, positions) broadcast together and flattened to one per row, and the rows' shape."""
    seeds, positions = torch.broadcast_tensors(seeds, positions)
    return seeds.reshape(-1).contiguous(), positions.reshape(-1).contiguous(), positions.shape


def uniform(seeds, positions, stream, n):
    """Kernel of nano_nsa.uniform, bit for bit: one launch instead of some twenty elementwise ones."""
    seeds, positions, shape = _seeded_rows(seeds, positions)
    out = torch.empty(len(positions), n, dtype=torch.float32, device=positions.device)
    BLOCK = min(1024, triton.next_power_of_2(n))
    if len(positions):
        _uniform_kernel[(len(positions), triton.cdiv(n, BLOCK))](
            seeds, positions, out, n, stream, BLOCK=BLOCK
        )
    return out.view(*shape, n)


# ---- Sampling: the race and the nucleus, a row split over programs ----
# One program per row leaves the GPU idle over a full vocabulary (0.73 ms a row of 129,280 on an H200). So a
# row is split into chunks of ROW_CHUNK entries, a program each, and the kernels run in phases: each reads
# what the phases before left for the whole row in a small fp32 workspace [row, field, chunk] (indices and
# counts are exact in it), reduced over the chunks in an order fixed by the row's length, whatever the batch.
# A row of one chunk (up to four ROW_CHUNKs) runs every phase in one program and one launch, a longer one a
# launch per phase. probs_from_logits' fields (PROBS_FIELDS): 0 a chunk's max, 1 its first index, 2 its
# weights' total, 3 its weight above the threshold, 4 its weights equal to it, 5 its kept weight; 6 + 2 p, 7 +
# 2 p the bounds search pass p searched (float bits); 6 + 2 PASSES + 16 p + j the weight above pass p's j-th
# value.
ROW_CHUNK = 4096  # (a multiple of the kernels' steps of 1024 columns)
PASSES = tl.constexpr(8)  # of the nucleus threshold's search: 16 values a pass, 2^30 float bits to one in 8
PROBS_FIELDS = tl.constexpr(6 + 18 * PASSES.value)


def split_rows(kernel, x, fields, phases, *args):
    """kernel(x, *args, workspace, V, FIRST, LAST, CHUNK, SP) over x's rows (its first axis; V its last) x
    their chunks, for phases 0 .. phases - 1 (a launch runs FIRST .. LAST), with a workspace of `fields`
    floats a row and chunk."""
    rows, V = len(x), x.shape[-1]
    S = 1 if V <= 4 * ROW_CHUNK else triton.cdiv(V, ROW_CHUNK)
    chunk = triton.next_power_of_2(V) if S == 1 else ROW_CHUNK
    ws = torch.empty(rows, fields, S, dtype=torch.float32, device=x.device)
    for first, last in [(0, phases - 1)] if S == 1 else [(p, p) for p in range(phases)]:
        kernel[(rows, S)](x, *args, ws, V, first, last, chunk, triton.next_power_of_2(S))


@triton.jit
def _chunk_sum(ws, field, before, SP: tl.constexpr):
    """A workspace field summed over the row's chunks before `before` (an order fixed by the row's length)."""
    s = tl.arange(0, SP)
    return tl.sum(tl.load(ws + field * tl.num_programs(1) + s, mask=s < before, other=0.0), 0)


@triton.jit
def _row_argmax(ws, SP: tl.constexpr):
    """The row's first argmax, from its chunks' maxima (workspace field 0) and their first indices (1)."""
    s, S = tl.arange(0, SP), tl.num_programs(1)
    best = tl.load(ws + s, mask=s < S, other=-float("inf"))
    winner = tl.min(tl.where(best == tl.max(best, 0), s, SP), 0)  # the first chunk holding the max
    return tl.load(ws + S + winner).to(tl.int32)


@triton.jit
def _race(race, offset, best, first):
    """The race's max and its first index so far, after a block of it whose first column is offset."""
    first = tl.where(tl.max(race, 0) > best, offset + tl.argmax(race, 0), first)
    return tl.maximum(best, tl.max(race, 0)), first


@triton.jit
def _sample_kernel(
    p_ptr,
    seed_ptr,
    pos_ptr,
    out_ptr,
    stream,
    ws_ptr,
    V,
    FIRST: tl.constexpr,
    LAST: tl.constexpr,
    CHUNK: tl.constexpr,
    SP: tl.constexpr,
):
    """Phase 0, per chunk: its max of the race p / E (E = _exponential(u), u as _uniform_kernel makes them;
    -1 past the row) and its first index. Phase 1, chunk 0: the row's first argmax."""
    r, c = tl.program_id(0), tl.program_id(1)
    ws = ws_ptr + r.to(tl.int64) * 2 * tl.num_programs(1)
    for phase in tl.static_range(FIRST, LAST + 1):
        if phase == 0:
            key = _row_key(seed_ptr, pos_ptr, r, stream)
            best, first = tl.zeros([], tl.float32) - 1.0, tl.zeros([], tl.int32)
            for i in range(0, CHUNK, 1024):
                cols = c * CHUNK + i + tl.arange(0, 1024)
                p = tl.load(p_ptr + r.to(tl.int64) * V + cols, mask=cols < V, other=-1.0)
                race = tl.where(cols < V, p / _exponential(_uniform_block(key, cols)), -1.0)
                best, first = _race(race, c * CHUNK + i, best, first)
            tl.store(ws + c, best)
            tl.store(ws + tl.num_programs(1) + c, first.to(tl.float32))
        elif c == 0:
            tl.store(out_ptr + r, _row_argmax(ws, SP).to(tl.int64))
        tl.debug_barrier()  # (what a phase stored, read by the program's other threads in the next)


def sample(probs, seeds, positions, stream):
    """Kernel of nano_nsa.sample: the numbers, the race and its argmax in one launch per call (two over a full
    vocabulary; the reference's seven). (Its log may round the last bit otherwise than torch's: a tie in p / E
    could then go another way.)"""
    seeds, positions, shape = _seeded_rows(seeds, positions)
    p = probs.reshape(-1, probs.shape[-1]).float().contiguous()
    out = torch.empty(len(p), dtype=torch.long, device=p.device)
    if len(p):
        split_rows(_sample_kernel, p, 2, 2, seeds, positions, out, stream)
    return out.view(shape)


@triton.jit
def _kept(p_ptr, q_ptr, d_ptr, seed, start, r, V, K: tl.constexpr):
    """How many of request r's k drafts d_ptr[0..k-1] are kept: d_ptr[j] (d_{j+1}) is if u q <= p and p > 0 at
    it (u its ACCEPT number) and the j drafts before it were (a == j)."""
    a = tl.zeros([], tl.int32)
    for j in tl.static_range(K):
        d = tl.load(d_ptr + j)
        px = tl.load(p_ptr + (r * (K + 1) + j).to(tl.int64) * V + d)
        qx = tl.load(q_ptr + (r * K + j).to(tl.int64) * V + d)
        u = _uniform_block(_key(seed, start + 1 + j, ACCEPT), tl.zeros([], tl.int64))
        a += ((u * qx <= px) & (px > 0) & (a == j)).to(tl.int32)
    return a


@triton.jit
def _rejection_kernel(
    p_ptr,
    q_ptr,
    d_ptr,
    d_stride,
    seed_ptr,
    start_ptr,
    out_ptr,
    K: tl.constexpr,
    ws_ptr,
    V,
    FIRST: tl.constexpr,
    LAST: tl.constexpr,
    CHUNK: tl.constexpr,
    SP: tl.constexpr,
):
    """nano_nsa.rejection_sample for request r. Every program first finds a, the drafts kept (_kept: scalar
    loads). Phase 0, per chunk: the race over the residual max(p_a - q_a, 0) and the race over p_a (E as
    _sample_kernel makes them; each race's max and first index: workspace fields 0-1 and 2-3) and the
    residual's max (4). Phase 1, chunk 0: the draw (the residual's race, or p's where the residual is 0) and
    the row's k+1 tokens and count."""
    r, c, S = tl.program_id(0), tl.program_id(1), tl.num_programs(1)
    ws = ws_ptr + r.to(tl.int64) * 5 * S
    seed, start = tl.load(seed_ptr + r), tl.load(start_ptr + r)
    drafts = d_ptr + r * d_stride  # request r's k drafts
    a = _kept(p_ptr, q_ptr, drafts, seed, start, r, V, K)
    for phase in tl.static_range(FIRST, LAST + 1):
        if phase == 0:
            key = _key(seed, start + 1 + a, TARGET)
            p_row = p_ptr + (r * (K + 1) + a).to(tl.int64) * V
            q_row = q_ptr + (r * K + a).to(tl.int64) * V
            best_r, first_r = tl.zeros([], tl.float32) - 1.0, tl.zeros([], tl.int32)
            best_p, first_p = tl.zeros([], tl.float32) - 1.0, tl.zeros([], tl.int32)
            top = tl.zeros([], tl.float32)
            for i in range(0, CHUNK, 1024):
                cols = c * CHUNK + i + tl.arange(0, 1024)
                inside = cols < V
                p = tl.load(p_row + cols, mask=inside, other=0.0)
                q = tl.load(q_row + cols, mask=inside & (a < K), other=0.0)  # (after k kept: q = 0)
                res = tl.maximum(p - q, 0.0)
                e = _exponential(_uniform_block(key, cols))
                best_r, first_r = _race(tl.where(inside, res / e, -1.0), c * CHUNK + i, best_r, first_r)
                best_p, first_p = _race(tl.where(inside, p / e, -1.0), c * CHUNK + i, best_p, first_p)
                top = tl.maximum(top, tl.max(res, 0))
            tl.store(ws + c, best_r)
            tl.store(ws + S + c, first_r.to(tl.float32))
            tl.store(ws + 2 * S + c, best_p)
            tl.store(ws + 3 * S + c, first_p.to(tl.float32))
            tl.store(ws + 4 * S + c, top)
        elif c == 0:
            s = tl.arange(0, SP)
            residual = tl.max(tl.load(ws + 4 * S + s, mask=s < S, other=0.0), 0) > 0
            last = tl.where(residual, _row_argmax(ws, SP), _row_argmax(ws + 2 * S, SP)).to(tl.int64)
            out = out_ptr + r.to(tl.int64) * (K + 2)
            for j in tl.static_range(K):  # the drafts, the draw at a
                tl.store(out + j, tl.where(j == a, last, tl.load(drafts + j)))
            tl.store(out + K, last)  # (also where a < k: the reference's cat leaves it there)
            tl.store(out + K + 1, (a + 1).to(tl.int64))
        tl.debug_barrier()  # (what a phase stored, read by the program's other threads in the next)


def rejection_sample(p, q, drafts, seeds, start):
    """Kernel of nano_nsa.rejection_sample: the tests, the residual and its draw in one launch (two over a
    full vocabulary) instead of some thirty kernels. The tokens are the reference's where the race's E has
    the same bits (see sample)."""
    B, n, V = p.shape
    assert drafts.stride(-1) == 1, "the drafts' rows are read with their row stride, each row contiguous"
    p = p.float().contiguous()
    q = p if q is None else q.float().contiguous()  # (k = 0: q is never read)
    out = torch.empty(B, n + 1, dtype=torch.long, device=p.device)
    if B:
        args = (q, drafts, drafts.stride(0), seeds.contiguous(), start.contiguous(), out, n - 1)
        split_rows(_rejection_kernel, p, 5, 2, *args)
    return out[:, :n], out[:, n]


@triton.jit
def _nucleus(e, mask, v0, g0, target, tied_before):
    """Which of a block's weights e the nucleus keeps: all above the threshold v0, and of those equal to it
    the first ones in index order while the weight before them (g0 above v0, then the ties before) stays below
    target (top_p times the row's total)."""
    tied = (e == v0) & mask
    rank = tied_before + tl.cumsum(tied.to(tl.int32), 0) - tied.to(tl.int32)
    keep = (e > v0) | (tied & (g0 + rank.to(tl.float32) * v0 < target))
    return keep & mask, tied_before + tl.sum(tied.to(tl.int32), 0)


@triton.jit
def _tries(lo, hi):
    """The 16 values (float bits, int64) a search pass tries between the bounds lo and hi, evenly apart."""
    return lo + ((hi - lo) * (tl.arange(0, 16) + 1)) // 17


@triton.jit
def _bounds(ws, p, target, top, SP: tl.constexpr):
    """The threshold's search over float bits: the bits [lo, hi] left to search pass p (p = PASSES: hi is the
    threshold v0). The weight above a value falls as the value rises; v0 is the smallest value whose weight
    above is below target. A pass tries 16 values between lo and hi and keeps the span between the two
    around v0; pass p's first chunk stores the bounds it searched [6 + 2 p, 7 + 2 p: float bits as fp32], so
    that pass p + 1 narrows them once."""
    if p == 0:
        return tl.zeros([], tl.int64), top
    k, s, S = tl.arange(0, 16), tl.arange(0, SP), tl.num_programs(1)
    lo = tl.load(ws + (4 + 2 * p) * S).to(tl.int32, bitcast=True).to(tl.int64)  # (pass p - 1's bounds)
    hi = tl.load(ws + (5 + 2 * p) * S).to(tl.int32, bitcast=True).to(tl.int64)
    g = tl.load(
        ws + (6 + 2 * PASSES + 16 * (p - 1) + k[:, None]) * S + s[None, :], mask=s[None, :] < S, other=0.0
    )
    return _narrow(lo, hi, tl.sum(g, 1), target)


@triton.jit
def _narrow(lo, hi, g, target):
    """A search pass's outcome: of the 16 values _tries(lo, hi), g [16] the weight above each, the bounds of
    the span left around the threshold v0."""
    k, c = tl.arange(0, 16), _tries(lo, hi)
    n_above = tl.sum((g >= target).to(tl.int32), 0)  # the values with too much weight above
    hi_next = tl.where(n_above < 16, tl.sum(tl.where(k == n_above, c, 0), 0), hi)
    return tl.where(n_above > 0, tl.sum(tl.where(k == n_above - 1, c, 0), 0) + 1, lo), hi_next


@triton.jit
def _weights_phase(x, row, ws, c, S, V, t, phase, CHUNK: tl.constexpr, SP: tl.constexpr):
    """Phase 0: the chunk's max of y = logits / T and its first index [workspace fields 0, 1]. Phase 1: the
    weights e = exp(y - the row's max), stored in the output row (later phases read these very bits), and
    their total [2]."""
    s = tl.arange(0, SP)
    if phase == 0:  # (each of a step's lanes keeps its max and the first column holding it)
        m, first = tl.full([1024], -float("inf"), tl.float32), tl.zeros([1024], tl.int32)
    else:
        m, total = tl.max(tl.load(ws + s, mask=s < S, other=-float("inf")), 0), tl.zeros([1024], tl.float32)
    for i in range(0, CHUNK, 1024):
        cols = c * CHUNK + i + tl.arange(0, 1024)
        y = tl.load(x + cols, mask=cols < V, other=-float("inf")) / tl.where(t == 0, 1.0, t)
        if phase == 0:
            first = tl.where(y > m, cols, first)
            m = tl.maximum(m, y)
        else:
            e = tl.where(cols < V, tl.exp(y - m), 0.0)
            tl.store(row + cols, e, mask=cols < V)
            total += e
    if phase == 0:
        tl.store(ws + c, tl.max(m, 0))
        tl.store(ws + S + c, tl.min(tl.where(m == tl.max(m, 0), first, V), 0).to(tl.float32))
    else:
        tl.store(ws + 2 * S + c, tl.sum(total, 0))


@triton.jit
def _nucleus_phase(row, ws, c, S, V, top_p, phase, CHUNK: tl.constexpr, SP: tl.constexpr):
    """The phases over the weights [the workspace fields each writes]: 2 .. PASSES + 1 the threshold's search
    (_bounds; the bounds searched [6 + 2 p, 7 + 2 p] and the weight above each value tried [6 + 2 PASSES + 16
    p + j]); PASSES + 2 the weight above the threshold v0 [3] and the count of weights equal to it [4]; PASSES
    + 3 the weight the nucleus keeps [5]; PASSES + 4 the kept weights normalized, into the output row."""
    STEP: tl.constexpr = 256 if phase < PASSES + 2 else 1024  # columns a step ([256, 16] in a search pass)
    k = tl.arange(0, 16)
    target = top_p * _chunk_sum(ws, 2, S, SP)
    top = tl.where(top_p < 1.0, 0x3F800000, 0).to(tl.int64)  # bits of 1.0 (the largest e), or 0: keep all
    lo, hi = _bounds(ws, phase - 2 if phase < PASSES + 2 else PASSES, target, top, SP)
    tries = _tries(lo, hi).to(tl.int32).to(tl.float32, bitcast=True)
    v0, g = hi.to(tl.int32).to(tl.float32, bitcast=True), tl.zeros([STEP, 16], tl.float32)
    if phase > PASSES + 2:
        g0, tied = _chunk_sum(ws, 3, S, SP), _chunk_sum(ws, 4, c, SP).to(tl.int32)  # (ties in earlier chunks)
    total, ties = tl.zeros([STEP], tl.float32), tl.zeros([STEP], tl.int32)
    for i in range(0, CHUNK, STEP):
        cols = c * CHUNK + i + tl.arange(0, STEP)
        e = tl.load(row + cols, mask=cols < V, other=0.0)
        if phase < PASSES + 2:
            g += tl.where(e[:, None] > tries[None, :], e[:, None], 0.0)
        elif phase == PASSES + 2:
            total += tl.where(e > v0, e, 0.0)
            ties += ((e == v0) & (cols < V)).to(tl.int32)
        else:
            keep, tied = _nucleus(e, cols < V, v0, g0, target, tied)
            total += tl.where(keep, e, 0.0)
            if phase == PASSES + 4:
                tl.store(row + cols, tl.where(keep, e / _chunk_sum(ws, 5, S, SP), 0.0), mask=cols < V)
    if phase < PASSES + 2:
        bounds = tl.where(k == 0, lo, hi).to(tl.int32).to(tl.float32, bitcast=True)
        tl.store(ws + (6 + 2 * (phase - 2) + k) * S, bounds, mask=(k < 2) & (c == 0))  # by the first chunk
        tl.store(ws + (6 + 2 * PASSES + 16 * (phase - 2) + k) * S + c, tl.sum(g, 0))
    elif phase == PASSES + 2:
        tl.store(ws + 3 * S + c, tl.sum(total, 0))
        tl.store(ws + 4 * S + c, tl.sum(ties, 0).to(tl.float32))
    elif phase == PASSES + 3:
        tl.store(ws + 5 * S + c, tl.sum(total, 0))


@triton.jit
def _probs_kernel(
    x_ptr,
    temp_ptr,
    top_p_ptr,
    group,
    out_ptr,
    ws_ptr,
    V,
    FIRST: tl.constexpr,
    LAST: tl.constexpr,
    CHUNK: tl.constexpr,
    SP: tl.constexpr,
):
    """Per chunk of a row, phases FIRST .. LAST of PASSES + 5: _weights_phase's two, then _nucleus_phase's. A
    greedy row (T = 0) runs only the first phase and, in the last, writes its one-hot on the row's first
    max."""
    r, c, S = tl.program_id(0), tl.program_id(1), tl.num_programs(1)
    x, row = x_ptr + r.to(tl.int64) * V, out_ptr + r.to(tl.int64) * V
    ws = ws_ptr + r.to(tl.int64) * PROBS_FIELDS * S
    t, top_p = tl.load(temp_ptr + r // group), tl.load(top_p_ptr + r // group)
    for phase in tl.static_range(FIRST, LAST + 1):
        if phase == 0:
            _weights_phase(x, row, ws, c, S, V, t, phase, CHUNK, SP)
        elif t == 0:
            if phase == PASSES + 4:
                hot = _row_argmax(ws, SP)
                for i in range(0, CHUNK, 1024):
                    cols = c * CHUNK + i + tl.arange(0, 1024)
                    tl.store(row + cols, (cols == hot).to(tl.float32), mask=cols < V)
        elif phase == 1:
            _weights_phase(x, row, ws, c, S, V, t, phase, CHUNK, SP)
        else:
            _nucleus_phase(row, ws, c, S, V, top_p, phase, CHUNK, SP)
        tl.debug_barrier()  # (between the phases of one program: what one stored, the next reads)


# A row of up to ROW_IN_REGISTERS tokens is held in one program's registers instead, every phase at once: over
# the demo's 2048 tokens 10.5 us a row against 30.5 through the phases' memory (H200, 2026-11-26).
ROW_IN_REGISTERS = 8192


@triton.jit
def _probs_row_kernel(x_ptr, temp_ptr, top_p_ptr, group, out_ptr, V, BLOCK: tl.constexpr):
    """_probs_kernel's phases for a row in registers, a program a row: the weights e and their total; the
    threshold's search, each pass's 16 weights above summed over the row at once; the kept weights
    normalized. A greedy row, or one whose max (e = 1) alone holds top_p of the total, is the one-hot on its
    first max (what the search would keep)."""
    r, cols = tl.program_id(0), tl.arange(0, BLOCK)
    t, top_p = tl.load(temp_ptr + r // group), tl.load(top_p_ptr + r // group)
    x, row = x_ptr + r.to(tl.int64) * V, out_ptr + r.to(tl.int64) * V
    y = tl.load(x + cols, mask=cols < V, other=-float("inf")) / tl.where(t == 0, 1.0, t)
    m = tl.max(y, 0)
    e = tl.where(cols < V, tl.exp(y - m), 0.0)
    target = top_p * tl.sum(e, 0)
    if (t == 0) | ((top_p < 1.0) & (target <= 1.0)):
        hot = tl.min(tl.where(y == m, cols, BLOCK), 0)
        tl.store(row + cols, (cols == hot).to(tl.float32), mask=cols < V)
    else:
        lo, hi = tl.zeros([], tl.int64), tl.where(top_p < 1.0, 0x3F800000, 0).to(tl.int64)  # as _bounds'
        for _ in tl.static_range(PASSES):
            tries = _tries(lo, hi).to(tl.int32).to(tl.float32, bitcast=True)
            above = tl.sum(tl.where(e[:, None] > tries[None, :], e[:, None], 0.0), 0)  # [16]
            lo, hi = _narrow(lo, hi, above, target)
        v0 = hi.to(tl.int32).to(tl.float32, bitcast=True)
        g0 = tl.sum(tl.where(e > v0, e, 0.0), 0)
        keep, _ = _nucleus(e, cols < V, v0, g0, target, tl.zeros([], tl.int32))
        tl.store(row + cols, tl.where(keep, e / tl.sum(tl.where(keep, e, 0.0), 0), 0.0), mask=cols < V)


def probs_from_logits(logits, temperature, top_p):
    """Kernel of nano_nsa.probs_from_logits: one launch for all rows (PASSES + 5 when rows are split) instead
    of some twenty kernels. Its sums run in another order than the reference's, which may move a token at the
    nucleus' edge where the mass before it is within rounding of top_p."""
    shape, V = logits.shape, logits.shape[-1]
    x = logits.reshape(-1, V).float().contiguous()
    t, tp, group = _per_request(temperature, top_p, shape[:-1])
    out = torch.empty_like(x)
    if len(x) and V <= ROW_IN_REGISTERS:
        # A block of at least 256 (masked columns weigh 0): over 8 or 16 columns, and 128 at 8 warps, the
        # compiled search kept too few tokens, as if the [block, 16] sums counted some weights twice (Triton
        # 3.6, H200; test_gpu_probs_kernel_matches_reference[7])
        block = max(256, triton.next_power_of_2(V))
        config = dict(BLOCK=block, num_warps=8 if block <= 2048 else 32)
        _probs_row_kernel[(len(x),)](x, t, tp, group, out, V, **config)
    elif len(x):
        split_rows(_probs_kernel, x, PROBS_FIELDS.value, PASSES.value + 5, t, tp, group, out)
    return out.view(shape)


def _per_request(temperature, top_p, rows):
    """temperature and top_p broadcast to the rows' shape -> (both as fp32 vectors, the consecutive rows that
    share each value): no copies where both vary along the same leading dims alone (a request's [B, 1] over
    its k+1 rows), else one value a row."""
    varying = []
    for v in (temperature, top_p):
        dims = (1,) * (len(rows) - v.dim()) + tuple(v.shape)
        while dims and dims[-1] == 1:  # (dims a value is broadcast over)
            dims = dims[:-1]
        varying.append(dims)
    if varying[0] == varying[1] and tuple(rows[: len(varying[0])]) == varying[0]:
        group = math.prod(rows[len(varying[0]) :])
        return temperature.float().reshape(-1).contiguous(), top_p.float().reshape(-1).contiguous(), group
    return *(v.expand(rows).reshape(-1).float().contiguous() for v in (temperature, top_p)), 1
