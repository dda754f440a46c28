"""nano-nsa GPU kernels: the fast versions of the names the layers call through `self.ops`.

Each function here has a readable torch reference with the same signature in nano_nsa.py (TORCH_OPS); tests
compare them on fresh random inputs at the real shapes (test_nano.py, marked `gpu`). `GPU_OPS` at the end is
the set `nano_nsa.select_ops` binds on a GPU that `unsupported()` accepts.

  plan            the attention schedule of a step's rows (flashinfer plan), once per step, for all layers
  index_topk      lightning indexer: Triton FP8 scores over the paged key cache + causal mask + top-k
  sparse_mla      absorbed sparse MLA rows: flashinfer FA3 (Hopper) / trtllm-gen (Blackwell, unverified here)
  dense_attention causal per-head attention of short prompt chunks (torch SDPA)
  fp8_linear      Triton act-quant (1x128, pow2 scales) + Triton block-scaled FP8 GEMM (split-K at decode)
  moe             routed experts: GPU-side sort by expert, two grouped Triton FP8 GEMMs, weighted sum; no sync
  dense_linear    bf16 weights with fp32 accumulation (lm_head, weights_proj, eh_proj)

Triton and flashinfer are imported here only: nano_nsa imports this module on a CUDA device alone.
"""

from types import SimpleNamespace

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

BF16 = torch.bfloat16
WORKSPACE_BYTES = 256 << 20  # flashinfer's float workspace (split-KV partial outputs)


def to_device(x, device):
    """As nano_nsa.to_device: through pinned memory, so the host never waits on the GPU."""
    return x.pin_memory().to(device, non_blocking=True)


def unsupported(device: torch.device):
    """Why the kernels cannot run on `device`, or None."""
    major, _ = torch.cuda.get_device_capability(device)
    if major not in (9, 10):
        return f"compute capability {major}.x: the kernels are for Hopper (9.0) and Blackwell (10.x)"
    try:
        import flashinfer  # noqa: F401
    except ImportError:
        return "flashinfer is not installed (pip install flashinfer-python; see README)"
    return None


# ------------------------------------------------------------------------------------------------------------
# Lightning indexer: FP8 scores over the paged key cache, causal mask, top-k (spec 3.7)
# ------------------------------------------------------------------------------------------------------------
@triton.jit
def _index_keys_kernel(
    q_ptr,
    w_ptr,
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
    written as a sortable int64 key: the score's bits made monotone in the high word, (2^31 - 1 - n) in the
    low word, so top-k breaks exact ties towards the earliest position as the reference does. Positions
    n >= ctx[t] (the causal mask) get the smallest key. H: the indexer's heads, H_PAD: H padded to a
    tensor-core tile (>= 16)."""
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
        w = tl.load(w_ptr + t * H + h, mask=h < H, other=0.0)
        s = tl.sum(tl.maximum(logits, 0.0) * w[:, None], 0) * tl.load(ks_ptr + slot, mask=keep, other=0.0)
        b = s.to(tl.int32, bitcast=True)
        b = tl.where(s == 0.0, 0, b)  # -0.0 == +0.0
        b = tl.where(b < 0, b ^ 0x7FFFFFFF, b)  # negative floats: reverse their order
        key = tl.where(keep, (b.to(tl.int64) << 32) | (0x7FFFFFFF - n).to(tl.int64), key)
    tl.store(out_ptr + t.to(tl.int64) * out_stride + n, key, mask=n < out_stride)


_SYLVESTER = {}  # (n, device): the n x n +-1 Sylvester-Hadamard matrix


def index_quant(x):
    """Kernel of nano_nsa.index_quant: the Hadamard transform as one fp32 GEMM with the +-1 Sylvester matrix
    (the reference's 7-stage butterfly is ~30 small kernels), scaled and rounded to bf16 as the reference,
    then the Triton act-quant."""
    n = x.shape[-1]
    if (n, x.device) not in _SYLVESTER:  # built at the first (eager) call, before any graph capture
        h = torch.ones(1, 1)
        while h.shape[0] < n:
            h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)])
        _SYLVESTER[n, x.device] = h.to(x.device)
    return act_quant(((x.float() @ _SYLVESTER[n, x.device]) * n**-0.5).to(BF16))


def index_topk(q8, head_weights, cache, meta, topk):
    """Kernel of nano_nsa.index_topk: rows flattened over (request x draft position), each scoring only the
    keys below its own causal length, through its request's page-table row; then top-min(topk, N) per row."""
    T, H, J = q8.shape
    N = meta.max_ctx
    keys = torch.empty(T, N, dtype=torch.int64, device=q8.device)
    BLOCK_N = 64
    _index_keys_kernel[(T, triton.cdiv(N, BLOCK_N))](
        q8.contiguous(),
        head_weights.float().contiguous(),
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
    idx = keys.topk(width, dim=-1, sorted=False).indices
    # a row whose whole context fits in topk selects all of it (its masked keys may sit anywhere in the top-k)
    n = torch.arange(width, device=q8.device)
    everything = torch.where(n < meta.ctx_lens[:, None], n, -1)
    return torch.where((meta.ctx_lens <= width)[:, None], everything, idx)


# ------------------------------------------------------------------------------------------------------------
# Sparse MLA rows: one CSR row per query token over its selected KV-pool slots (page size 1)
# ------------------------------------------------------------------------------------------------------------
# (device, rows of a CUDA graph or None, model shape): a flashinfer wrapper, its last plan, an event;
# (device): the flashinfer workspace the wrappers of that device share
_state = {}


def _ranks():
    """Tensor parallel: each rank attends with its own heads only (n_heads / ranks of them)."""
    return torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1


def _graph_buffers(rows, topk, dev):
    """A CUDA graph's fixed metadata buffers, sized for `rows` rows of at most `topk` slots: the CSR
    `kv_indices` (one spare entry at the end: the sink), each selected slot's destination in it, the row
    lengths. Its graphs captured their addresses, so every plan refreshes them in place."""
    return dict(
        kv_indices=torch.zeros(rows * topk + 1, dtype=torch.int32, device=dev),
        dest=torch.zeros(rows * topk, dtype=torch.long, device=dev),
        kv_len=torch.zeros(rows, dtype=torch.int32, device=dev),
    )


def _wrapper_graph_args(st, rows, dev):
    """The FA3 wrapper's keyword arguments for flashinfer's use_cuda_graph mode (none for eager steps)."""
    if rows is None:
        return {}
    return dict(
        use_cuda_graph=True,
        qo_indptr=torch.arange(rows + 1, dtype=torch.int32, device=dev),
        kv_indptr=torch.zeros(rows + 1, dtype=torch.int32, device=dev),
        kv_indices=st["fixed"]["kv_indices"],
        kv_len_arr=st["fixed"]["kv_len"],
    )


def _planner(dev, rows, cfg):
    """The wrapper plans of `rows` rows run through (rows=None: eager steps, any shape). A CUDA graph's
    wrapper owns fixed metadata buffers (flashinfer's use_cuda_graph mode) that its graphs captured,
    replanned in place."""
    topk = cfg.index_topk
    key = (dev, rows, cfg.n_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.softmax_scale, topk)
    if key in _state:
        return _state[key]
    from flashinfer.mla import BatchMLAPagedAttentionWrapper

    if dev not in _state:
        _state[dev] = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=dev)  # (trtllm-gen: zeroed)
    st = dict(workspace=_state[dev], last=None, lens=None, event=None, wrapper=None, key=key)
    _state[key] = st
    if rows is not None:
        st["fixed"] = _graph_buffers(rows, topk, dev)
    if torch.cuda.get_device_capability(dev)[0] == 9:  # Hopper: FA3; Blackwell: no plan
        graph = _wrapper_graph_args(st, rows, dev)
        st["wrapper"] = BatchMLAPagedAttentionWrapper(st["workspace"], backend="fa3", **graph)
    return st


def plan(meta, cfg):
    """The schedule of a step's sparse rows, made on the host once per step and shared by every layer: row t
    reads kv_len[t] = min(ctx[t], top-k) slots. flashinfer bakes these lengths into its plan, not the slots,
    so each layer writes its own selection into the planned `kv_indices` buffer (`dest` below) and runs. A
    step whose lengths equal the last plan's on the same wrapper reuses it (draft-extend after verify; draft
    steps once every context exceeds top-k). Dense prompt chunks need no plan."""
    if meta.dense(cfg.index_topk):
        return None
    dev = meta.positions.device
    K = cfg.index_topk
    T = len(meta.ctx_host)
    st = _planner(dev, T if meta.graphed else None, cfg)
    width = min(K, meta.max_ctx)
    kv_len = meta.ctx_host.clamp(max=K).to(torch.int32)
    if st["last"] is not None and st["last"]["width"] == width and torch.equal(st["lens"], kv_len):
        return st["last"]
    # flashinfer stages a plan through pinned memory: the last one must have landed
    if st["event"] is not None:
        st["event"].synchronize()
    kv_indptr = F.pad(kv_len.cumsum(0), (1, 0)).to(torch.int32)
    kv_indices, dest, kv_len_dev = _kv_destinations(st, kv_len, kv_indptr, width, dev)
    p = dict(
        kv_indices=kv_indices,
        dest=dest.flatten(),
        kv_len=kv_len_dev,
        width=width,
        state=st["key"],
        max_kv_len=int(kv_len.max()),
        scale=cfg.softmax_scale,
        qk_nope_head_dim=cfg.qk_nope_head_dim,
    )
    if st["wrapper"] is not None:
        _plan_wrapper(st, T, kv_indptr, kv_indices, kv_len, cfg)
    st["last"] = p
    st["lens"] = kv_len
    return p


def _kv_destinations(st, kv_len, kv_indptr, width, dev):
    """The destination map of a step's selections [T, width] in the CSR `kv_indices` buffer: row t's column
    j < kv_len[t] goes to kv_indptr[t] + j, its unused columns to the buffer's last entry (a sink). Returns
    (kv_indices, dest, kv_len on the device); under a CUDA graph, its fixed buffers, refreshed in place."""
    total = int(kv_indptr[-1])
    fixed = st.get("fixed")
    if fixed:
        kv_indices = fixed["kv_indices"]
    else:
        kv_indices = torch.zeros(total + 1, dtype=torch.int32, device=dev)
    j = torch.arange(width, device=dev)
    kv_len_dev = to_device(kv_len, dev)
    starts = to_device(kv_indptr[:-1], dev)
    sink = len(kv_indices) - 1  # the unused columns of a row land here
    dest = torch.where(j < kv_len_dev[:, None], starts[:, None] + j, sink)
    if fixed:  # a graph's buffers: refreshed in place
        fixed["dest"].copy_(dest.flatten())
        fixed["kv_len"].copy_(kv_len_dev)
        dest = fixed["dest"]
        kv_len_dev = fixed["kv_len"]
    return kv_indices, dest, kv_len_dev


def _plan_wrapper(st, T, kv_indptr, kv_indices, kv_len, cfg):
    """Plans the FA3 wrapper for T rows of new lengths (the fast replan where it was planned before, else
    flashinfer's public plan()), then records the event the next plan waits on."""
    qo_indptr = torch.arange(T + 1, dtype=torch.int32)
    if st["last"] is None or not _replan(st, qo_indptr, kv_indptr, kv_indices, kv_len, cfg):
        _flashinfer_plan(st["wrapper"], qo_indptr, kv_indptr, kv_indices, kv_len, cfg)
    st["event"] = torch.cuda.Event()
    st["event"].record()


def _flashinfer_plan(wrapper, qo_indptr, kv_indptr, kv_indices, kv_len, cfg):
    """flashinfer's public plan(): one bf16 query token a row over its page-size-1 KV slots, not causal."""
    from flashinfer.mla._batch_mla._contracts import MLAPlanMetadata

    wrapper.plan(
        metadata=MLAPlanMetadata.csr(qo_indptr, kv_indptr, kv_indices, kv_len),
        num_heads=cfg.n_heads // _ranks(),
        head_dim_ckv=cfg.kv_lora_rank,
        head_dim_kpe=cfg.qk_rope_head_dim,
        page_size=1,
        causal=False,
        sm_scale=cfg.softmax_scale,
        q_data_type=BF16,
        kv_data_type=BF16,
        query_layout="split",
        kv_cache_layout="split",
    )


def _replan(st, qo_indptr, kv_indptr, kv_indices, kv_len, cfg):
    """New lengths for a wrapper planned before: flashinfer's C++ scheduler alone, without the validation and
    snapshots of its Python plan() (measured ~1 ms a call, more than a whole decode step's kernels at bs=1).
    Reaches into flashinfer 0.7.2's FA3 backend (pinned in requirements.txt); False: use the public plan()."""
    be = getattr(st["wrapper"], "_planned_backend", None)
    if be is None or not hasattr(be, "_cached_module") or not hasattr(be, "_plan_info"):
        return False
    info, _ = be._cached_module.plan_with_staged_workspace_bytes(
        be._float_workspace_buffer,
        be._int_workspace_buffer,
        be._pin_memory_int_workspace_buffer,
        qo_indptr,
        kv_indptr,
        kv_len,
        cfg.n_heads // _ranks(),
        cfg.kv_lora_rank,
        False,
    )
    if "fixed" in st:  # a CUDA graph replays the captured workspace offsets: they must hold
        assert list(info) == list(be._plan_info), "flashinfer moved its plan's workspace under a CUDA graph"
        be._kv_indptr_buf.copy_(to_device(kv_indptr, kv_indices.device))
    else:
        be._plan_info = info
        be._kv_indices_buf = kv_indices
        dev = kv_indices.device
        be._kv_indptr_buf = to_device(kv_indptr, dev)
        be._kv_len_arr_buf = to_device(kv_len, dev)
    return True


def sparse_mla(q_abs, q_pe, cache, slots, meta, scale):
    """Kernel of nano_nsa.sparse_mla: bf16 q and cache, fp32 softmax and accumulation, bf16 out."""
    p = meta.plan
    st = _state[p["state"]]
    assert p is st["last"], "a step's plan was replaced before its layers ran (plan once per step)"
    assert slots.shape[1] == p["width"]
    p["kv_indices"].scatter_(0, p["dest"], slots.flatten().to(torch.int32))  # this layer's slots, packed rows
    if st["wrapper"] is None:
        return _sparse_mla_blackwell(q_abs, q_pe, cache, slots, p, st)
    T, H, C = q_abs.shape
    out = torch.empty(T, H, C, dtype=BF16, device=q_abs.device)
    latent = cache.latent[:, None, :]  # [S, page 1, C + R]
    st["wrapper"].run(
        query=(q_abs.to(BF16).contiguous(), q_pe.to(BF16).contiguous()),
        kv_cache=(latent[..., :C], latent[..., C:]),
        out=out,
    )
    return out


def _sparse_mla_blackwell(q_abs, q_pe, cache, slots, p, st):
    """Blackwell (SM100/103) variant: flashinfer's trtllm-gen sparse MLA decode, every row its own request of
    one query token with its own (expanded) length, so verify and draft-extend rows go through it as decode
    rows. UNVERIFIED ON HARDWARE: no Blackwell GPU was available to this project; it is written from
    flashinfer's documented signature and has never been executed."""
    from flashinfer.mla import trtllm_batch_decode_with_kv_cache_mla

    T, H, C = q_abs.shape
    q = torch.cat([q_abs.to(BF16), q_pe.to(BF16)], -1)[:, None]  # [T, 1, H, C + R]
    out = trtllm_batch_decode_with_kv_cache_mla(
        query=q,
        kv_cache=cache.latent[:, None, :],
        workspace_buffer=st["workspace"],
        qk_nope_head_dim=p["qk_nope_head_dim"],
        kv_lora_rank=C,
        qk_rope_head_dim=q_pe.shape[-1],
        block_tables=slots.to(torch.int32)[:, None, :],
        seq_lens=p["kv_len"],
        max_seq_len=p["max_kv_len"],
        sparse_mla_top_k=p["width"],
        bmm1_scale=p["scale"],
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
def _act_quant_kernel(x_ptr, q_ptr, s_ptr, K: tl.constexpr, NG: tl.constexpr):
    """One row: 1x128 groups, scale = the power of two >= amax / 448 (ue8m0), q = x / scale rounded to
    e4m3."""
    row = tl.program_id(0).to(tl.int64)
    g, c = tl.arange(0, NG), tl.arange(0, 128)
    ok = g[:, None] < K // 128
    x = tl.load(x_ptr + row * K + g[:, None] * 128 + c[None, :], mask=ok, other=0.0).to(tl.float32)
    s = tl.maximum(tl.max(tl.abs(x), 1), 1e-4) * (1.0 / 448.0)
    bits = s.to(tl.int32, bitcast=True)
    bits = tl.where((bits & 0x7FFFFF) != 0, ((bits >> 23) + 1) << 23, bits)  # round up to a power of two
    s = bits.to(tl.float32, bitcast=True)
    q = tl.clamp(x / s[:, None], -448.0, 448.0).to(tl.float8e4nv)
    tl.store(q_ptr + row * K + g[:, None] * 128 + c[None, :], q, mask=ok)
    tl.store(s_ptr + row * (K // 128) + g, s, mask=g < K // 128)


def act_quant(x):
    """Kernel of nano_nsa.act_quant (bit-exact): x [..., K] -> (q [..., K] e4m3, s [..., K/128] fp32)."""
    K = x.shape[-1]
    x2 = x.reshape(-1, K).contiguous()
    q = torch.empty(x2.shape, dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty(x2.shape[0], K // 128, dtype=torch.float32, device=x.device)
    if x2.shape[0]:
        _act_quant_kernel[(x2.shape[0],)](x2, q, s, K=K, NG=triton.next_power_of_2(K // 128), num_warps=4)
    return q.view(x.shape), s.view(*x.shape[:-1], K // 128)


@triton.jit
def _fp8_gemm_kernel(
    a_ptr,
    as_ptr,
    rows_ptr,
    b_ptr,
    bs_ptr,
    expert_ptr,
    c_ptr,
    M,
    N,
    K,
    GATHER: tl.constexpr,
    GROUPED: tl.constexpr,
    SPLIT_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """C[m, n] = sum over 128-wide k blocks of (A8[m, kb] . B8[n, kb]) * sa[m, kb] * sb[n // 128, kb], fp32.
    GATHER: row m of A is rows[m] (-1: a padding row). GROUPED: this block of M rows belongs to expert
    experts[pid_m] (-1: none) and reads that expert's B. SPLIT_K > 1: k blocks split over programs, atomically
    summed (small N at decode would otherwise leave most SMs idle)."""
    pid_m, pid_n, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    kc = tl.arange(0, 128)
    KB = K // 128
    valid_m = offs_m < M
    rows = offs_m.to(tl.int64)
    if GATHER:
        rows = tl.load(rows_ptr + offs_m, mask=valid_m, other=-1).to(tl.int64)
        valid_m = rows >= 0
        rows = tl.maximum(rows, 0)
    n_kb = KB
    if GROUPED:
        e = tl.load(expert_ptr + pid_m)
        n_kb = tl.where(e >= 0, KB, 0)
        e = tl.maximum(e, 0).to(tl.int64)
        b_ptr += e * N * K
        bs_ptr += e * ((N + 127) // 128) * KB
    valid_n = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(pid_k, n_kb, SPLIT_K):
        a = tl.load(a_ptr + rows[:, None] * K + kb * 128 + kc[None, :], mask=valid_m[:, None], other=0.0)
        b = tl.load(
            b_ptr + offs_n[:, None].to(tl.int64) * K + kb * 128 + kc[None, :],
            mask=valid_n[:, None],
            other=0.0,
        )
        sa = tl.load(as_ptr + rows * KB + kb, mask=valid_m, other=0.0)
        sb = tl.load(bs_ptr + (offs_n // 128) * KB + kb, mask=valid_n, other=0.0)
        acc += tl.dot(a, tl.trans(b)) * sa[:, None] * sb[None, :]
    c = c_ptr + offs_m[:, None].to(tl.int64) * N + offs_n[None, :]
    mask = (offs_m < M)[:, None] & valid_n[None, :]
    if SPLIT_K == 1:
        tl.store(c, acc.to(c_ptr.dtype.element_ty), mask=mask)
    else:
        tl.atomic_add(c, acc, mask=mask)


def _gemm(a, sa, b, sb, M, N, rows=None, experts=None, block_m=16, out_dtype=BF16):
    """A8 [*, K] (rows picked by `rows` if given), B8 [N, K] or [E, N, K] (with `experts` per block of block_m
    rows) -> C [M, N] out_dtype, fp32 accumulation of each 128-block product times its two scales."""
    K = b.shape[-1]
    grid_mn = triton.cdiv(M, block_m) * triton.cdiv(N, 64)
    split = max(1, min(K // 128, 256 // grid_mn)) if experts is None else 1  # fill 132 SMs at decode
    if split > 1:  # the programs of a split add their partial sums into c atomically, in fp32
        c = torch.zeros(M, N, device=a.device, dtype=torch.float32)
    else:
        c = torch.empty(M, N, device=a.device, dtype=out_dtype)
    _fp8_gemm_kernel[(triton.cdiv(M, block_m), triton.cdiv(N, 64), split)](
        a,
        sa,
        rows,
        b,
        sb,
        experts,
        c,
        M,
        N,
        K,
        GATHER=rows is not None,
        GROUPED=experts is not None,
        SPLIT_K=split,
        BLOCK_M=block_m,
        BLOCK_N=64,
        num_warps=4,
        num_stages=3,
    )
    return c.to(out_dtype)


def fp8_linear(x, w, scale, partial=False):
    """Kernel of nano_nsa.fp8_linear: act_quant then the block-scaled FP8 GEMM, bf16 out (partial: fp32)."""
    q, s = act_quant(x)
    M = q.numel() // q.shape[-1]
    block_m = 16 if M <= 16 else 64
    out_dtype = torch.float32 if partial else BF16
    y = _gemm(q.view(M, -1), s.view(M, -1), w, scale, M, w.shape[0], block_m=block_m, out_dtype=out_dtype)
    return y.view(*x.shape[:-1], w.shape[0])


def moe(x, weights, idx, w13, s13, w2, s2):
    """Kernel of nano_nsa.moe_experts, with no host synchronization: the (token, expert) pairs are sorted by
    expert into blocks of block_m rows (each expert's rows padded to whole blocks, so a block reads one
    expert's weights, and an expert with at most block_m rows reads its weights once); one grouped FP8 GEMM
    for w1|w3, SiLU-and-multiply, act-quant, one grouped GEMM for w2, then the weighted sum back into token
    rows. Expert parallel: idx E (another rank's expert) is sorted into blocks of expert -1, which the GEMMs
    skip."""
    T, A = idx.shape
    E, I2, dim = w13.shape
    P = T * A
    bm = 16 if P <= 64 * 16 else 64
    n_blocks = min(E + 1, P) + triton.cdiv(P, bm)  # an upper bound on the padded blocks, known on host
    flat = idx.flatten()
    order = flat.argsort(stable=True)
    counts = torch.zeros(E + 1, dtype=torch.int64, device=x.device).index_add_(0, flat, torch.ones_like(flat))
    padded = (counts + bm - 1) // bm * bm
    pad_end, cnt_end = padded.cumsum(0), counts.cumsum(0)
    e_sorted = flat[order]
    dest = (
        pad_end[e_sorted] - padded[e_sorted] + torch.arange(P, device=x.device) - (cnt_end - counts)[e_sorted]
    )
    R = n_blocks * bm
    token = torch.full((R,), -1, dtype=torch.int64, device=x.device).index_put_((dest,), order // A)
    weight = torch.zeros(R, dtype=torch.float32, device=x.device).index_put_(
        (dest,), weights.flatten()[order]
    )
    starts = torch.arange(n_blocks, device=x.device) * bm
    experts = torch.searchsorted(pad_end, starts, right=True).to(torch.int32)
    experts = torch.where(experts < E, experts, -1)
    q, s = act_quant(x)
    h = _gemm(q, s, w13, s13, R, I2, rows=token, experts=experts, block_m=bm)  # [R, 2I] bf16
    h = (F.silu(h[:, : I2 // 2].float()) * h[:, I2 // 2 :].float()).to(BF16)
    q2, s2_ = act_quant(h)
    o = _gemm(q2, s2_, w2, s2, R, dim, experts=experts, block_m=bm)  # [R, dim] bf16
    y = torch.zeros(T + 1, dim, dtype=torch.float32, device=x.device)  # row T: padding rows
    y.index_add_(0, torch.where(token >= 0, token, T), o.float() * weight[:, None])
    return y[:T]


def dense_linear(x, w):
    """Kernel of nano_nsa.dense_linear: bf16 weight (lm_head, weights_proj, eh_proj; exact copies of the
    checkpoint's bf16), fp32 accumulation and output: half the bytes of the reference's fp32 upcast."""
    x2 = x.reshape(-1, x.shape[-1]).to(BF16)
    return torch.mm(x2, w.t(), out_dtype=torch.float32).view(*x.shape[:-1], w.shape[0])


# ------------------------------------------------------------------------------------------------------------
# The kernel set: the same names and signatures as nano_nsa.TORCH_OPS
# ------------------------------------------------------------------------------------------------------------
def bf16_dtype(w):
    """The dtype the kernels keep a weight in, whatever w's own: bf16 (attn_dtype: wkv_b's absorbed halves;
    dense_dtype: plain Linear weights, bf16 as the checkpoint stores them)."""
    return BF16


GPU_OPS = SimpleNamespace(
    name="kernels.py (flashinfer sparse MLA, Triton indexer / FP8 GEMM / MoE, SDPA prefill)",
    plan=plan,
    index_quant=index_quant,
    index_topk=index_topk,
    sparse_mla=sparse_mla,
    dense_attention=dense_attention,
    fp8_linear=fp8_linear,
    dense_linear=dense_linear,
    moe=moe,
    attn_dtype=bf16_dtype,
    dense_dtype=bf16_dtype,
)
