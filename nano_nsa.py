"""nano-nsa: DeepSeek-V3.2 inference in one readable file.

Read it top to bottom. Part 1 is the model: Config -> building blocks (the FP8 block format, norms, YaRN RoPE,
Hadamard) -> forward metadata and the KV cache -> the lightning indexer -> MLA -> MoE -> Block, MTP layer,
Transformer -> the kernel boundary -> tensor parallelism -> the loader. It computes what DeepSeek's official
`inference/model.py` computes, as docs/model.md teaches it; where it deliberately differs, a comment says why.
Part 2 is the engine: chat encoding -> sampling and speculative acceptance -> requests -> the KV page pool ->
the scheduler -> the speculative round (verify, accept, draft-extend, draft) -> CUDA graphs -> `LLM`: one
request's life, generate and its steps (prefill, decode round), the host one round ahead -> `main`. What a
reader can skip lives beside this file: the checkpoint format and its checks (hf_checkpoint.py), the checks of
user arguments (checks.py), the chat template (chat.py), the command line (cli.py), --explain (explain.py),
and the GPU kernels under the same names as the references (kernels.py, fp8_gemm.py, sampling_kernels.py).

Dimension legend used in shape comments:
  T tokens (rows) in the forward pass   B requests in the batch   N context positions of a request
  H attention heads   D qk_nope_head_dim (128)   R qk_rope_head_dim (64)   V v_head_dim (128)
  C kv_lora_rank (512)   I indexer heads (64)   J index_head_dim (128)   K index_topk (2048)
  E routed experts   A activated experts per token   F moe_inter_dim (2048)   S slots in the KV pool
  k draft tokens per round   W the page table's width, a bound on every row's causal length (Meta.max_ctx)
Part 2's words that Part 1 uses: a verify row is the main model's row for a drafted token; a draft is a token
the MTP layer guesses; slot 0 of the KV pool is a dummy that rows holding no real token write (PagePool).
"""

from __future__ import annotations

import functools
import math
import os
import sys
import time
from dataclasses import dataclass, field, fields, replace
from itertools import accumulate
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import checks
import cli
import explain
import hf_checkpoint
from chat import BOS, EOS, SPECIAL_TOKENS, encode_chat
from checks import require
from parallel import all_gather, all_reduce, init_distributed, rank_local, rank_slice, tp_rank, tp_size

BLOCK = 128  # FP8 block size: 128x128 weight blocks, 1x128 activation groups
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
BF16 = torch.bfloat16


# ==== Part 1: the model =====================================================================================
# ---- Config: every field the model uses --------------------------------------------------------------------
@dataclass
class Config:
    """The model's shape; field names follow DeepSeek's reference `ModelArgs` (config.json's names, where they
    differ, in hf_checkpoint.HF_NAMES)."""

    vocab_size: int = 129280
    dim: int = 7168  # hidden_size
    inter_dim: int = 18432  # dense MLP of the first n_dense_layers layers
    moe_inter_dim: int = 2048  # each routed / shared expert
    n_layers: int = 61  # main-model layers; the MTP layers follow at index n_layers
    n_dense_layers: int = 3  # first_k_dense_replace
    n_mtp_layers: int = 1  # num_nextn_predict_layers
    n_heads: int = 128
    n_routed_experts: int = 256
    n_shared_experts: int = 1
    n_activated_experts: int = 8  # num_experts_per_tok
    n_expert_groups: int = 8  # n_group
    n_limited_groups: int = 4  # topk_group
    route_scale: float = 2.5  # routed_scaling_factor
    q_lora_rank: int = 1536
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    index_n_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 2048
    rope_theta: float = 10000.0
    rope_factor: float = 40.0  # YaRN
    original_seq_len: int = 4096  # YaRN original_max_position_embeddings
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    max_seq_len: int = 163840  # max_position_embeddings
    eps: float = 1e-6  # rms_norm_eps (also the indexer LayerNorm eps)
    bos_token_id: int = 0
    eos_token_id: int = 1

    def __post_init__(self):  # refuse what the layers cannot run, with a one-line error
        hf_checkpoint.check_config(self, fields(self))

    @property
    def qk_head_dim(self):
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def softmax_scale(self):
        """MLA softmax scale: qk_head_dim^-0.5 times the YaRN mscale squared (0.13523 for the 671B model)."""
        m = 0.1 * self.mscale * math.log(self.rope_factor) + 1.0
        return self.qk_head_dim**-0.5 * m * m

    @classmethod
    def full(cls, n_layers=61):
        """The 671B shapes; n_layers < 61 gives the full-width, few-layer model used for GPU benchmarks (at
        most 3 dense layers, and at least one MoE layer when n_layers > 1)."""
        return cls(n_layers=n_layers, n_dense_layers=min(3, max(1, n_layers - 1)))

    @classmethod
    def tiny(cls, **overrides):
        """A few layers (first one dense), 8 experts in 4 groups, small dims, index_topk=32: for CPU tests."""
        return cls(**(TINY | overrides))

    @classmethod
    def from_json(cls, path):
        """Build from an HF DeepSeek-V3.2 `config.json` (a file or the directory holding it)."""
        return hf_checkpoint.read_config(cls, path)


TINY = dict(vocab_size=288, dim=256, inter_dim=512, moe_inter_dim=128, n_layers=3, n_dense_layers=1)
TINY |= dict(n_heads=4, q_lora_rank=128, kv_lora_rank=256, qk_nope_head_dim=32, v_head_dim=32)  # MLA
TINY |= dict(n_routed_experts=8, n_activated_experts=2, n_expert_groups=4, n_limited_groups=2)  # MoE
TINY |= dict(index_n_heads=4, index_topk=32)  # the indexer


# ---- Building blocks: FP8 activation quantization and linear, norms, YaRN RoPE, Hadamard, stable top-k -----
# Two things are used in this part before their own sections, and are all a layer needs to know of them:
#   self.ops   the kernel set every layer calls its heavy math through ("The kernel boundary" below): torch
#              references written here, or kernels.py's GPU versions of the same names, bound once at load;
#   tp_size(), tp_rank(), all_reduce()   tensor parallelism ("Tensor parallelism" below): 1, 0 and nothing at
#              one rank; under torchrun a layer holds its rank's share of the weights and sums the parts
#              (rank_local(idx, n): idx shifted into this rank's n-row shard, and whether this rank holds it).
# The FP8 block format (docs/model.md §2): a weight W [out, in] is stored as float8_e4m3fn W8 with one float32
# scale per 128x128 block, a power of two (ue8m0), W = W8 * scale (weight_dequant); an activation is quantized
# per row in 1x128 groups with power-of-two scales too (act_quant). Products of such values are exact: only
# fp8_linear's sums round. On the GPU one block-scaled FP8 GEMM (fp8_gemm.py), here both dequantized.
def pow2_ceil(x: torch.Tensor) -> torch.Tensor:
    """Smallest power of two >= x (x > 0 normal fp32), exactly, by the reference's exponent bit trick: a
    nonzero mantissa carries into the exponent, then the mantissa is cleared."""
    bits = x.view(torch.int32) + 0x7FFFFF
    return (bits & -0x800000).view(torch.float32)


def act_quant(x: torch.Tensor):
    """Per-row, per-128-column FP8 quantization with power-of-two (ue8m0) scales, as the reference
    `act_quant`: x [..., n] bf16 -> (q [..., n] float8_e4m3fn, s [..., n/128] float32) with x ~= q * s."""
    groups = x.float().unflatten(-1, (-1, BLOCK))  # [..., n/128, 128]
    amax = groups.abs().amax(-1).clamp(min=1e-4)
    s = pow2_ceil(amax * torch.tensor(1 / FP8_MAX, dtype=torch.float32))  # fp32 constant, as in the kernel
    q = (groups / s[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)  # round to nearest even
    return q.flatten(-2), s


def act_dequant(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """q [..., n] fp8, s [..., n/128] -> fp32 values (exact)."""
    return (q.float().unflatten(-1, (-1, BLOCK)) * s[..., None]).flatten(-2)


def per_element(scale: torch.Tensor, shape) -> torch.Tensor:
    """Block scales [..., ceil(out/128), ceil(in/128)] (edge blocks partial) -> per element [..., out, in]."""
    rows = scale.repeat_interleave(BLOCK, -2)[..., : shape[-2], :]
    return rows.repeat_interleave(BLOCK, -1)[..., : shape[-1]]


def weight_dequant(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """W[r, c] = W8[r, c] * scale[r // 128, c // 128] (the checkpoint's weight_scale_inv), in fp32 (exact)."""
    return w.float() * per_element(scale, w.shape)


def acc_dtype(x: torch.Tensor):
    """Accumulation dtype of matmuls: fp32 on a GPU, as the reference; fp64 on a CPU, where a sum's order then
    practically never shows once rounded, so results do not depend on the batch (docs/model.md §10)."""
    return torch.float64 if x.device.type == "cpu" else torch.float32


def fp8_linear(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, partial=False) -> torch.Tensor:
    """y = act_quant(x) @ W^T for a block-scaled FP8 weight, bf16 out (partial: unrounded). Exact operands,
    only the sums round; act_quant is never skipped (as in the reference). scale None: w was dequantized at
    load (dequantize_weights)."""
    acc = acc_dtype(x)
    if scale is not None:
        w = weight_dequant(w, scale)
    y = F.linear(act_dequant(*act_quant(x)).to(acc), w.to(acc))
    return y if partial else y.to(BF16)


def dense_linear(x, w):
    """x W^T for a plain (bf16 / fp32) weight, fp32 out; callers round if needed."""
    acc = acc_dtype(x)
    return F.linear(x.to(acc), w.to(acc)).float()


def param(*shape, dtype):
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)  # inference only: no grads


class Linear(nn.Module):
    """x W^T. fp8=True: float8_e4m3fn weight + float32 `scale` per 128x128 block; else a plain `dtype` weight.
    n: a stack of n weights [n, out, in] (the routed experts, read by the MoE op). split (Megatron's column /
    row parallel): 'col' this rank holds out / tp_size() output features (rows of W), 'row' in / tp_size()
    input features (columns of W: the output is a partial sum, unrounded until Block), None all of it."""

    dequantized = None  # the references' copy of the weight, made at load (DEQUANTIZE_AT_LOAD_BYTES)

    def __init__(self, in_features, out_features, fp8=True, dtype=BF16, n=None, split=None):
        super().__init__()
        self.fp8 = fp8
        self.split = split  # (hf_checkpoint.weight_bytes counts a split weight's bytes as the ranks')
        self.partial = split == "row"  # output unrounded (Block)
        if split == "col":
            out_features //= tp_size()
        if split == "row":
            in_features //= tp_size()
        stack = [n] if n else []
        self.weight = param(*stack, out_features, in_features, dtype=FP8 if fp8 else dtype)
        blocks = (-(-out_features // BLOCK), -(-in_features // BLOCK))  # ceil: 128x128 blocks, partial edges
        self.scale = param(*stack, *blocks, dtype=torch.float32) if fp8 else None

    def forward(self, x):
        weight, scale = self.operands()
        if not self.fp8:
            return self.ops.dense_linear(x, weight)
        return self.ops.fp8_linear(x, weight, scale, self.partial)

    def operands(self):
        """(weight, scale) as the ops read them: the weight as loaded and its block scales (None for a plain
        weight), or the references' copy (Linear.dequantized) and None."""
        if self.dequantized is not None:
            return self.dequantized, None
        return self.weight, self.scale


def linears(x, *lins):
    """Several Linear layers of the same input x -> their outputs (MLA's three products of x; on the GPU one
    GEMM over the weights kernels.prepare stacked at load)."""
    return tuple(lin(x) for lin in lins)


def swiglu(gate, up):
    """SwiGLU's activation silu(gate) * up in fp32, rounded to bf16 (as the reference's silu(w1 x) * w3 x)."""
    return (F.silu(gate.float()) * up.float()).to(BF16)


def mlp(x, w1, w3, w2):
    """The SwiGLU MLP w2(silu(x W1^T) * x W3^T), unrounded (w2 split by rows). On the GPU w1 | w3 are one
    GEMM, and SwiGLU runs inside w2's act-quant."""
    return w2(swiglu(w1(x), w3(x)))


def side_by_side(first, first_args, second, second_args):
    """(first(*first_args), second(*second_args)): independent parts of a layer, joined when both are done.
    Here in turn; on the GPU at once (kernels.side_by_side), second (the longer chain) on a higher-priority
    stream, so one part's short, latency-bound kernels fill the SMs the other leaves idle: same bits."""
    return first(*first_args), second(*second_args)


def rms_norm(x, residual, weight, eps):
    """RMSNorm in fp32 with an fp32 weight, bf16 out; x is rounded to bf16 first (a block half's output
    arrives unrounded: Block). With `residual`: adds it first (fp32), and also returns the new residual
    stream in bf16, as the reference's fused form."""
    x = x.to(BF16).float()
    if residual is not None:
        x = x + residual.float()
    y = (weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))).to(BF16)
    if residual is None:
        return y
    return y, x.to(BF16)


class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.eps = eps
        self.weight = param(dim, dtype=torch.float32)

    def forward(self, x, residual=None):
        return self.ops.rms_norm(x, residual, self.weight, self.eps)


class Embedding(nn.Module):
    """Vocabulary-parallel: a rank holds vocab / tp_size() rows; other tokens add zeros to the all-reduce."""

    def __init__(self, vocab, dim):
        super().__init__()
        self.weight = param(vocab // tp_size(), dim, dtype=BF16)

    def forward(self, tokens):
        if tp_size() == 1:  # (one lookup: the masking below costs six kernels per pass)
            return F.embedding(tokens, self.weight)
        local, mine = rank_local(tokens, len(self.weight))  # (another rank's: clamped to a row, then masked)
        return all_reduce(F.embedding(local.clamp(0, len(self.weight) - 1), self.weight) * mine[..., None])


def yarn_frequencies(cfg: Config):
    """f'_i, the YaRN-corrected inverse frequencies (docs/model.md §3): low dims as they are, high dims /
    rope_factor, a linear ramp between the dims turning beta_fast and beta_slow times in original_seq_len."""
    d, base = cfg.qk_rope_head_dim, cfg.rope_theta
    freqs = 1.0 / (base ** (torch.arange(0, d, 2, dtype=torch.float32) / d))

    def dim_of(turns):  # the dim whose frequency turns `turns` times over the original context
        return d * math.log(cfg.original_seq_len / (turns * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(dim_of(cfg.beta_fast)), 0)
    high = min(math.ceil(dim_of(cfg.beta_slow)), d - 1)
    width = high - low if high > low else 0.001
    smooth = 1 - ((torch.arange(d // 2, dtype=torch.float32) - low) / width).clamp(0, 1)  # 1 - the ramp
    return freqs / cfg.rope_factor * (1 - smooth) + freqs * smooth


def rope_cos_sin(freqs: torch.Tensor, positions: torch.Tensor):
    """cos/sin of theta[t, i] = fp32(t) * f'_i (freqs: yarn_frequencies, on the device), each [T, R/2] fp32:
    once per pass, by the model (the op rope_cos_sin). (YaRN's mscale goes into the softmax scale.)"""
    theta = positions[:, None] * freqs  # (int64 times fp32: in fp32)
    return theta.cos(), theta.sin()


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """Rotate x [T, ..., R] by position. interleaved (MLA): pairs (x[2i], x[2i+1]); half-split (indexer):
    pairs (x[i], x[i + R/2]). fp32 math, bf16 out."""
    # the last dim as [R/2, 2] (interleaved: pairs side by side) or [2, R/2] (half-split: R/2 apart), so a
    # pair's two members lie along dim `pair`
    pair = -1 if interleaved else -2
    x1, x2 = x.float().unflatten(-1, (-1, 2) if interleaved else (2, -1)).unbind(pair)
    shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[1],)  # broadcast over heads
    cos, sin = cos.view(shape), sin.view(shape)
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), pair).flatten(-2).to(BF16)


def hadamard(x: torch.Tensor) -> torch.Tensor:
    """Walsh-Hadamard transform over the last dim in Sylvester order, scaled by n^-0.5 (x @ H_n / sqrt(n));
    fp32 math, bf16 in/out. Orthogonal: it keeps dot products and spreads outliers before FP8 quantization."""
    n = x.shape[-1]
    y = x.float()
    h = 1
    while h < n:  # butterfly: pairs (i, i + h) inside blocks of 2h
        y = y.unflatten(-1, (n // (2 * h), 2, h))
        y = torch.stack((y[..., 0, :] + y[..., 1, :], y[..., 0, :] - y[..., 1, :]), dim=-2).flatten(-3)
        h *= 2
    return (y * n**-0.5).to(BF16)


def top_indices(x, k):
    """Indices of the k largest values along the last dim, ties to the lowest index (docs/model.md §10)."""
    return x.sort(dim=-1, descending=True, stable=True).indices[..., :k]


# ---- Forward metadata: one Meta per forward pass, shared by every layer; the KV cache, a layer's view ------
def to_device(x: torch.Tensor, device) -> torch.Tensor:
    """Host -> device without waiting: a copy from pageable memory blocks the host until the GPU reaches it,
    so the engine could never run ahead. (torch reuses a pinned block only once its copy has run.)"""
    if torch.device(device).type == "cuda":
        return x.pin_memory().to(device, non_blocking=True)
    return x.to(device)


def decode_rows(start, n, table):
    """Meta.decode's rows, n per request at positions start[b] .. start[b] + n - 1 (the op decode_rows, one
    launch on a GPU): start [B], table [B, W] -> (positions, row_req, slots, ctx_lens) [B*n] each."""
    positions = (start[:, None] + torch.arange(n, device=start.device)).flatten()
    rows = torch.arange(len(start), device=start.device).repeat_interleave(n)
    return positions, rows, table[rows, positions], positions + 1


@dataclass
class Meta:
    """What a forward pass knows of its rows, built once, shared by every layer: by Meta.rows (a prefill
    step) or Meta.decode (Part 2's speculative decoding: the MTP layer drafts k tokens, one pass of k+1 rows
    checks them). mode 'decode': each row is a query of its own (a decode, verify or draft row, or a prompt
    token: Part 2's Scheduler.form) with its own position, and so its own causal length; 'prefill': rows are
    long prompt chunks, which may attend in MLA's per-head form (MLA.forward)."""

    mode: str
    positions: torch.Tensor  # [T] absolute position of each row's token
    row_req: torch.Tensor  # [T] request (row of `table`) each row belongs to
    table: torch.Tensor  # [B, W] table[b, p]: request b's position p's KV-pool slot (PagePool.table)
    cu_seqlens: list  # [B + 1] host: row offsets of each request (None in a CUDA graph: Meta.rows)
    slots: torch.Tensor  # [T] the slot each row writes: its position's, or the dummy slot 0 (PagePool)
    ctx_lens: torch.Tensor  # [T] each row's causal length: position + 1

    @property
    def max_ctx(self):
        """W, the table's width: the indexer scores W positions, no row's causal length exceeds W. Meta.rows:
        the longest row's; a decode round: LLM.decode's bound (CudaGraphs.width rounds it up). W <= K also
        means the indexer selects every position without scoring (and a long prompt chunk may attend in the
        per-head form: MLA.forward)."""
        return self.table.shape[1]

    @classmethod
    def rows(cls, mode, positions, row_req, table, cu_seqlens=None):
        """A prefill step's rows from each one's position and request [T] (on the device; table [B, W], W the
        longest row's causal length): their slots and causal lengths, one gather (in a prompt step's CUDA
        graph too, Part 2: there with no cu_seqlens, which only the references and the per-head form read)."""
        return cls(mode, positions, row_req, table, cu_seqlens, table[row_req, positions], positions + 1)

    @classmethod
    def decode(cls, ops, start, n, table):
        """Request b's rows at positions start[b] .. start[b] + n - 1 (start [B], on the device): a verify's
        x_L, d_1..d_k (n = k+1; draft-extend reuses them) or a draft step's token (n = 1). Each is a decode
        row of its own: its causal length is its position + 1 (the indexer masks the rest: topk_positions).
        E.g. start [10], n 4: positions 10..13, causal lengths 11..14 (Part 2: speculative_round, draft)."""
        positions, rows, slots, ctx_lens = ops.decode_rows(start, n, table)
        cu_seqlens = list(range(0, len(positions) + 1, n))
        return cls("decode", positions, rows, table, cu_seqlens, slots=slots, ctx_lens=ctx_lens)

    def request_rows(self):
        return [slice(a, b) for a, b in zip(self.cu_seqlens[:-1], self.cu_seqlens[1:], strict=True)]


@dataclass
class LayerCache:
    """One layer's KV pool, a row per slot. MLA caches, per token, one C-dim latent shared by every head (the
    kv_norm of wkv_a's first C outputs) and one R-dim rope key. Its row is DeepSeek's FP8 layout (FlashMLA's,
    vLLM's `fp8_ds_mla`): the normalized latent as FP8 in 1x128 groups (the official cache rounds it so), the
    groups' power-of-two fp32 scales, then the rotated rope key in bf16: 512 + 16 + 128 = 656 bytes at full
    size, against 1152 for the same values in bf16; typed views of the row's bytes."""

    # bytes [0, C): kv, C fp8 | [C, C * 33/32): kv_scale, C/128 fp32 | [C * 33/32, end): pe, R bf16
    latent: torch.Tensor  # [S, C + C/32 + 2R] uint8 (C + C/32 = C * 33/32): the whole MLA row
    ik: torch.Tensor  # [S, J] fp8   indexer key
    iks: torch.Tensor  # [S]    fp32  indexer key scale
    C: int  # kv_lora_rank

    @property
    def kv(self):  # [S, C] fp8
        return self.latent[:, : self.C].view(FP8)

    @property
    def kv_scale(self):  # [S, C/128] fp32
        return self.latent[:, self.C : self.C * 33 // 32].view(torch.float32)

    @property
    def pe(self):  # [S, R] bf16
        return self.latent[:, self.C * 33 // 32 :].view(BF16)

    def latents(self, slots):
        """The cached latents of `slots` (any shape) -> (kv [..., C] fp32, exact; pe [..., R] bf16)."""
        return act_dequant(self.kv[slots], self.kv_scale[slots]), self.pe[slots]


class KVCache:
    """Every layer's LayerCache tensors stacked [L, S, ...] (main layers, then MTP layers; mtp_layers False:
    an engine that does not draft keeps none of theirs), addressed by slot."""

    def __init__(self, cfg: Config, num_slots: int, device="cpu", mtp_layers=True):
        L = cfg.n_layers + cfg.n_mtp_layers * mtp_layers
        self.C = cfg.kv_lora_rank
        self.latent = torch.zeros(L, num_slots, self.row_bytes(cfg), dtype=torch.uint8, device=device)
        self.ik = torch.zeros(L, num_slots, cfg.index_head_dim, dtype=FP8, device=device)
        self.iks = torch.zeros(L, num_slots, dtype=torch.float32, device=device)

    @staticmethod
    def row_bytes(cfg: Config):
        """Bytes of MLA's cache row (LayerCache's byte map)."""
        return cfg.kv_lora_rank + cfg.kv_lora_rank // 32 + 2 * cfg.qk_rope_head_dim

    @staticmethod
    def bytes_per_token(cfg: Config, mtp_layers=True):  # (a one-slot cache's bytes, allocated nowhere)
        return sum(t.nbytes for t in KVCache(cfg, 1, "meta", mtp_layers).tensors())

    def layer(self, i):
        return LayerCache(self.latent[i], self.ik[i], self.iks[i], self.C)

    def tensors(self):  # (every layer's: a preempted request's KV moves to host memory and back)
        return self.latent, self.ik, self.iks


# ---- Lightning indexer (DSA): the top-K context positions of a row (docs/model.md §5) ---------------------
def index_quant(x, cos, sin):
    """The indexer's q [T, I, J] or k [T, J] before scoring: RoPE on the FIRST R dims (half-split pairs,
    unlike MLA), Hadamard, then FP8 with one pow2 scale per 128-vector -> (fp8 like x, scales [..., 1])."""
    R = 2 * cos.shape[-1]
    x = torch.cat([rope(x[..., :R], cos, sin, interleaved=False), x[..., R:]], -1)
    return act_quant(hadamard(x))


def store_index_key(k, norm_weight, norm_bias, eps, cos, sin, cache: LayerCache, slots):
    """The indexer's cache write for this pass's tokens (the reference of its kernel): the key k [T, J] (wk's
    output) LayerNormed in fp32 (k_norm), rounded to bf16, then index_quant, into the cache rows `slots`."""
    k = F.layer_norm(k.float(), k.shape[-1:], norm_weight, norm_bias, eps).to(BF16)
    k8, ks = index_quant(k, cos, sin)  # [T, J] fp8, [T, 1]
    cache.ik[slots] = k8
    cache.iks[slots] = ks[:, 0]


def index_scores(q8, w, k8, ks):
    """score[t, n] = ks[n] * sum_h w[t, h] * relu(q8[t, h] . k8[n]), fp32 (the reference `fp8_index`). q8 [T,
    I, J] fp8; w [T, I] fp32 (head_weights: the q scales folded in); k8 [T or 1, N, J]; ks [T or 1, N]."""
    acc = acc_dtype(q8)
    logits = torch.matmul(q8.to(acc), k8.to(acc).transpose(-1, -2))  # [T, I, N] (CPU: exact sums in fp64)
    return ((logits.relu() * w[..., None]).sum(1) * ks).float()  # [T, N] fp32


def topk_positions(scores, ctx_lens, topk):
    """Top-min(topk, N) positions of each row among its causal context (n < ctx_lens[t]); -1 pads short
    rows. A row whose context fits in top-k selects all of it, in position order (as the kernel does). E.g.
    topk 4, N 6: a row of causal length 3 -> [0, 1, 2, -1]; of length 6 -> its 4 best-scored of 0..5."""
    n = torch.arange(scores.shape[-1], device=scores.device)
    scores = scores.masked_fill(n[None, :] >= ctx_lens[:, None], float("-inf"))  # causal mask before top-k
    # ties (ReLU's exact zeros are common) to the earliest position: top_indices
    idx = top_indices(scores, min(topk, scores.shape[-1]))
    idx = torch.where((ctx_lens <= topk)[:, None], n[: idx.shape[-1]], idx)  # (all of it, in order)
    return torch.where(idx < ctx_lens[:, None], idx, -1)


def head_weights(weights, scale, qs):
    """Each query head's weight in the indexer's score: weights_proj's output [T, I] times the constant
    `scale` (I^-0.5 J^-0.5, docs/model.md §5) and the head's FP8 query scale qs [T, I, 1] -> [T, I]."""
    return weights * scale * qs[..., 0]


def index_topk(q8, qs, weights, scale, cache: LayerCache, meta: Meta, topk):
    """Reference of the lightning-indexer kernel: score each row's causal context against the cached FP8 keys
    (q8 [T, I, J] with its scales qs, the heads weighted by head_weights(weights, scale, qs)) and keep its top
    positions [T, min(topk, W)] (-1 = none). The rows of one request (a prompt chunk, its k+1 verify rows)
    share its keys: gathered once, W = meta.max_ctx wide."""
    w = head_weights(weights, scale, qs)
    out = []
    for b, rows in enumerate(meta.request_rows()):
        ctx = meta.table[b]  # [W] slots
        scores = index_scores(q8[rows], w[rows], cache.ik[ctx][None], cache.iks[ctx][None])
        out.append(topk_positions(scores, meta.ctx_lens[rows], topk))
    return torch.cat(out)


class Indexer(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.cfg = cfg
        self.wq_b = Linear(cfg.q_lora_rank, cfg.index_n_heads * cfg.index_head_dim)
        self.wk = Linear(cfg.dim, cfg.index_head_dim)
        self.k_norm = nn.LayerNorm(cfg.index_head_dim, cfg.eps).requires_grad_(False)  # fp32 weight and bias
        self.weights_proj = Linear(cfg.dim, cfg.index_n_heads, fp8=False, dtype=torch.float32)

    def forward(self, x, qr, k, cos, sin, meta: Meta, cache: LayerCache):
        """x [T, dim], qr [T, q_lora] (MLA's normed query latent), k = wk(x) [T, J] (MLA runs it with its own
        products of x) -> [T, min(K, W)] selected context positions per row (-1 = none; unread for a dense
        prompt chunk: MLA.forward). Writes this pass's keys first, so every row can select its own token."""
        cfg = self.cfg
        norm = self.k_norm
        self.ops.store_index_key(k, norm.weight, norm.bias, norm.eps, cos, sin, cache, meta.slots)
        if meta.max_ctx <= cfg.index_topk:  # every row selects its whole context (SGLang skips too)
            n = torch.arange(meta.max_ctx, device=x.device)
            return torch.where(n < meta.ctx_lens[:, None], n, -1)
        # the heads' weights, from x, beside the queries' longer chain, from qr
        weights, (q8, qs) = self.ops.side_by_side(self.weights_proj, (x,), self.queries, (qr, cos, sin))
        scale = cfg.index_n_heads**-0.5 * cfg.index_head_dim**-0.5  # (applied by index_topk: head_weights)
        return self.ops.index_topk(q8, qs, weights, scale, cache, meta, cfg.index_topk)

    def queries(self, qr, cos, sin):
        """The indexer's queries from MLA's normed query latent qr -> (q8 [T, I, J], scales [T, I, 1])."""
        q = self.wq_b(qr).view(qr.shape[0], self.cfg.index_n_heads, self.cfg.index_head_dim)
        return self.ops.index_quant(q, cos, sin)


# ---- MLA: multi-head latent attention over the indexer's selection (docs/model.md §4) ----------------------
# The sparse MLA reference runs its rows in blocks whose gathered latents (rows x K x (C + R), 8-byte fp64s on
# the CPU) take at most about this much, to stay in cache (rows are computed alone: any size, the same bits).
SPARSE_MLA_BLOCK_BYTES = 8 << 20


def sparse_mla(q_abs, q_pe, cache: LayerCache, selected, meta: Meta, scale):
    """Absorbed ("MQA") sparse attention, one query row per token (the sparse MLA decode kernel's reference):
    q_abs [T, H, C] (q_nope in the latent space), q_pe [T, H, R]; selected [T, K'] (K' = min(K, W)), each
    row's context positions (-1 = none; valid ones first) -> o_lat [T, H, C] in acc_dtype."""
    valid = selected >= 0  # [T, K]; the slots of the others are read (position 0's) and masked
    slots = meta.table[meta.row_req[:, None], selected.clamp(min=0)]  # [T, K] KV-pool slots
    acc = acc_dtype(q_abs)
    block = max(1, SPARSE_MLA_BLOCK_BYTES // (slots.shape[1] * (q_abs.shape[-1] + q_pe.shape[-1]) * 8))
    out = []
    for first in range(0, len(slots), block):
        rows = slice(first, first + block)
        kv, pe = cache.latents(slots[rows])  # [t, K, C], [t, K, R]
        kv, pe = kv.to(acc), pe.to(acc)
        scores = q_abs[rows].to(acc) @ kv.transpose(1, 2) + q_pe[rows].to(acc) @ pe.transpose(1, 2)
        scores = (scores * scale).masked_fill(~valid[rows, None, :], float("-inf"))  # [t, H, K]
        out.append(scores.softmax(-1) @ kv)  # [t, H, C] (in acc_dtype, not rounded: attend_dense's neither)
    return torch.cat(out)


def dense_attention(q, k, v, scale):
    """Causal per-head attention of a prompt chunk (the dense prefill kernel's reference): q [L, H, D + R] the
    last L of N positions, k [N, H, D + R], v [N, H, V] -> [L, H, V]; row i sees keys 0 .. N - L + i."""
    L, N = q.shape[0], k.shape[0]
    scores = torch.einsum("lhd,nhd->hln", q, k) * scale
    future = torch.arange(N, device=q.device) > torch.arange(L, device=q.device)[:, None] + (N - L)
    return torch.einsum("hln,nhv->lhv", scores.masked_fill(future, float("-inf")).softmax(-1), v)


def head_linear(x, w):
    """One linear map per head (MLA's absorbed W_UK and W_UV): x [T, H, n_in], w [H, n_out, n_in] -> [T, H,
    n_out] in w's dtype (the reference of the kernel's fixed-order GEMM)."""
    return torch.einsum("thk,hnk->thn", x.to(w.dtype), w)


def store_latent(kv, k_pe, norm_weight, eps, cos, sin, cache: LayerCache, slots):
    """MLA's cache write for this pass's tokens (the reference of its kernel): the latent kv [T, C]
    RMS-normalized (kv_norm) and quantized to FP8 as the official cache stores it (1x128 groups, pow2 scales),
    and the rope key k_pe [T, R] rotated, into the cache rows `slots`."""
    cache.kv[slots], cache.kv_scale[slots] = act_quant(rms_norm(kv, None, norm_weight, eps))
    cache.pe[slots] = rope(k_pe, cos, sin, interleaved=True)


class MLA(nn.Module):
    # The absorbed form: per head, k_nope = W_UK c and v = W_UV c for a cached latent c, so q_nope . k_nope =
    # (W_UK^T q_nope) . c. The queries move into the C-dim latent space, attention runs over the latents
    # themselves (every head reads the same C + R values a position: "MQA"), and W_UV maps the result to
    # values (sparse_mla, then head_linear). The per-head form expands the latents instead (attend_dense).
    # wkv_b dequantized at load (bind), split per head, in ops.attn_dtype (acc_dtype; kernels.py: bf16)
    w_uk = None  # [H, C, D] W_UK, transposed: q_nope -> latent space
    w_uv = None  # [H, V, C] W_UV: latent -> values

    def __init__(self, cfg: Config):
        super().__init__()
        self.cfg = cfg
        H = cfg.n_heads  # split over ranks: wq_b / wkv_b rows and wo columns of this rank's heads
        self.wq_a = Linear(cfg.dim, cfg.q_lora_rank)
        self.q_norm = RMSNorm(cfg.q_lora_rank, cfg.eps)
        self.wq_b = Linear(cfg.q_lora_rank, H * cfg.qk_head_dim, split="col")
        self.wkv_a = Linear(cfg.dim, cfg.kv_lora_rank + cfg.qk_rope_head_dim)
        self.kv_norm = RMSNorm(cfg.kv_lora_rank, cfg.eps)
        self.wkv_b = Linear(cfg.kv_lora_rank, H * (cfg.qk_nope_head_dim + cfg.v_head_dim), split="col")
        self.wo = Linear(H * cfg.v_head_dim, cfg.dim, split="row")
        self.indexer = Indexer(cfg)

    def forward(self, x, cos, sin, meta: Meta, cache: LayerCache):
        """-> this rank's heads' part of the output projection [T, dim], unrounded. Attention runs in
        acc_dtype (docs/model.md §10), so the per-head and absorbed forms are the same function."""
        cfg = self.cfg
        C, R = cfg.kv_lora_rank, cfg.qk_rope_head_dim
        # the three products of x: MLA's query and latent projections, the indexer's key (one GEMM on a GPU)
        q_a, k_index, kv_a = self.ops.linears(x, self.wq_a, self.indexer.wk, self.wkv_a)
        qr = self.q_norm(q_a)  # [T, q_lora]; shared with the indexer
        kv, k_pe = kv_a.split([C, R], -1)  # [T, C], [T, R]
        norm = self.kv_norm  # this pass's latents go to the cache first: attention reads them from there
        self.ops.store_latent(kv, k_pe, norm.weight, norm.eps, cos, sin, cache, meta.slots)
        # A long prompt chunk whose whole context fits in top-k selects every position: plain causal
        # attention in the per-head form, whose expanded keys serve its many rows. Every other row takes the
        # sparse absorbed form: decode rows (absorbing one query row costs less than expanding its context),
        # short prompt chunks, which run as decode rows (Scheduler.form), and chunks of longer contexts.
        sparse = meta.mode == "decode" or meta.max_ctx > cfg.index_topk
        # the queries (q: q_abs [T, H, C] if sparse, else q_nope [T, H, D]) beside the indexer's selection
        (q, q_pe), selected = self.ops.side_by_side(
            self.queries, (qr, cos, sin, sparse), self.indexer, (x, qr, k_index, cos, sin, meta, cache)
        )
        if sparse:  # sparse attention over the selected latents; W_UV maps the result back to values
            o_lat = self.ops.sparse_mla(q, q_pe, cache, selected, meta, cfg.softmax_scale)
            o = self.ops.head_linear(o_lat, self.w_uv)  # [T, H, V]
        else:
            o = self.attend_dense(q, q_pe, meta, cache)
        return self.wo(o.to(BF16).flatten(1))

    def queries(self, qr, cos, sin, absorbed):
        """The query heads from the normed query latent qr [T, q_lora] -> (q_nope [T, H, D], q_pe [T, H, R]
        rotated). absorbed: q_nope moved into the latent space through W_UK, [T, H, C] (the absorbed form)."""
        D, R = self.cfg.qk_nope_head_dim, self.cfg.qk_rope_head_dim
        q_nope, q_pe = self.wq_b(qr).unflatten(-1, (-1, D + R)).split([D, R], -1)
        if absorbed:  # (before the rope: on a GPU, W_UK then overlaps more of the indexer)
            q_nope = self.ops.head_linear(q_nope, self.w_uk)  # absorb W_UK: [T, H, C]
        q_pe = self.ops.rope(q_pe, cos, sin, interleaved=True)
        return q_nope, q_pe

    def attend_dense(self, q_nope, q_pe, meta, cache):
        """Prefill ("MHA") form: each request's prompt chunk against its causal context, the context's
        latents expanded to per-head keys and values."""
        dtype, out = self.w_uk.dtype, []
        for b, rows in enumerate(meta.request_rows()):
            kv, k_pe = cache.latents(meta.table[b, : int(meta.ctx_lens[rows.stop - 1])])  # [N, C], [N, R]
            kv = kv.to(dtype)
            k_nope = torch.einsum("nc,hcd->nhd", kv, self.w_uk)  # [N, H, D]
            v = torch.einsum("nc,hvc->nhv", kv, self.w_uv)  # [N, H, V]
            k_pe = k_pe.to(dtype)[:, None].expand(-1, k_nope.shape[1], -1)  # [N, H, R]: shared by the heads
            k = torch.cat([k_nope, k_pe], -1)
            q = torch.cat([q_nope[rows], q_pe[rows]], -1).to(dtype)
            out.append(self.ops.dense_attention(q, k, v, self.cfg.softmax_scale))  # [L, H, V]
        return torch.cat(out)


# ---- Feed-forward: SwiGLU MLP and the sigmoid-routed, group-limited MoE (docs/model.md §3, §6) -------------
class MLP(nn.Module):
    """SwiGLU (mlp). A rank holds inter_dim / tp_size() of it: its output is unrounded (Block)."""

    def __init__(self, dim, inter_dim):
        super().__init__()
        self.w1 = Linear(dim, inter_dim, split="col")  # gate_proj
        self.w3 = Linear(dim, inter_dim, split="col")  # up_proj
        self.w2 = Linear(inter_dim, dim, split="row")  # down_proj

    def forward(self, x):
        return self.ops.mlp(x, self.w1, self.w3, self.w2)


def route(logits, bias, groups, top_groups, top_experts, scale):
    """The router's choice (its kernel's reference): logits [T, E] -> (weights [T, A] fp32, experts [T, A]).
    Sigmoid scores; the bias only steers selection: the top_groups groups by their top-2 biased scores' sum,
    then the top_experts experts in them; weights: the unbiased scores renormalized, times scale."""
    T = logits.shape[0]
    # [T, E] fp32: sigmoid(x) as the softmax of (x, 0), row by row (torch's CPU sigmoid is not: model.md §10)
    scores = torch.stack([logits, torch.zeros_like(logits)], -1).softmax(-1)[..., 0]
    biased = (scores + bias).view(T, groups, -1)  # [T, G, E/G]
    group_score = biased.topk(2, dim=-1).values.sum(-1)  # [T, G]
    keep = top_indices(group_score, top_groups)  # the kept groups
    drop = torch.ones_like(group_score, dtype=torch.bool).scatter_(1, keep, False)
    biased = biased.masked_fill(drop[..., None], float("-inf")).flatten(1)
    experts = top_indices(biased, top_experts)  # [T, A]
    weights = scores.gather(1, experts)
    return weights / weights.sum(-1, keepdim=True) * scale, experts


class Gate(nn.Module):
    """The router: the product of bf16 x and weight in acc_dtype (each term exact; fp32 out), then `route`."""

    def __init__(self, cfg: Config):
        super().__init__()
        self.cfg = cfg
        self.weight = param(cfg.n_routed_experts, cfg.dim, dtype=BF16)
        self.bias = param(cfg.n_routed_experts, dtype=torch.float32)  # selection only

    def forward(self, x):
        """-> (routing weights [T, A] fp32, expert indices [T, A])."""
        cfg = self.cfg
        logits = self.ops.dense_linear(x, self.weight)  # [T, E] fp32
        limits = (cfg.n_expert_groups, cfg.n_limited_groups, cfg.n_activated_experts)  # groups, kept, experts
        return self.ops.route(logits, self.bias, *limits, cfg.route_scale)


def expert_linear(linear, e):
    """Expert e's weight of the stack `linear` as a Linear would apply it: x -> fp8_linear(x, W_e), bf16."""
    w, scales = linear.operands()
    return functools.partial(fp8_linear, w=w[e], scale=None if scales is None else scales[e])


def moe(x, weights, idx, experts):
    """The routed experts (the reference of the grouped MoE kernel): each a SwiGLU MLP over the tokens that
    chose it, summed with their routing weights in fp32. x [T, dim] bf16; weights, idx [T, A] (idx E: another
    rank's expert: MoE.routed); experts.w1, w3 [E, F, dim], w2 [E, dim, F] FP8 stacks -> [T, dim] fp32.
    Grouped as the kernel: one SwiGLU MLP (mlp) per expert over the rows of the tokens that chose it, tokens
    and experts ascending, so each token's outputs are summed in that order."""
    y = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in idx[idx < experts.w1.weight.shape[0]].unique().tolist():  # (idx E: another rank's, skipped)
        t, a = (idx == e).nonzero(as_tuple=True)  # the tokens that chose e, and which choice it was
        out = mlp(x[t], *(expert_linear(lin, e) for lin in (experts.w1, experts.w3, experts.w2)))  # bf16
        y.index_add_(0, t, out.float() * weights[t, a, None])  # (t repeats if a token chose e twice)
    return y


class MoE(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.gate = Gate(cfg)
        E = cfg.n_routed_experts // tp_size()  # this rank's experts (expert parallel), stacked by index
        self.experts = nn.Module()
        self.experts.w1 = Linear(cfg.dim, cfg.moe_inter_dim, n=E)  # [E, F, dim]
        self.experts.w3 = Linear(cfg.dim, cfg.moe_inter_dim, n=E)  # [E, F, dim]
        self.experts.w2 = Linear(cfg.moe_inter_dim, cfg.dim, n=E)  # [E, dim, F]
        self.shared_experts = MLP(cfg.dim, cfg.moe_inter_dim * cfg.n_shared_experts)

    def forward(self, x):
        """-> this rank's part [T, dim], unrounded: its routed experts' weighted sum plus its slice of the
        shared expert (unrounded too: docs/model.md §10)."""
        shared, routed = self.ops.side_by_side(self.shared_experts, (x,), self.routed, (x,))
        return routed + shared

    def routed(self, x):
        """The router's choice, then this rank's routed experts' weighted sum [T, dim] fp32."""
        weights, idx = self.gate(x)  # [T, A] each (replicated)
        if tp_size() > 1:
            E = self.experts.w1.weight.shape[0]
            local, mine = rank_local(idx, E)  # this rank holds experts tp_rank() * E onwards, E of them
            idx = torch.where(mine, local, E)  # E: another rank's, skipped
        return self.ops.moe(x, weights, idx, self.experts)


# ---- Block, MTP layer, Transformer (docs/model.md §7) ------------------------------------------------------
class Block(nn.Module):
    def __init__(self, cfg: Config, moe: bool):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.dim, cfg.eps)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.eps)
        self.attn = MLA(cfg)
        self.ffn = MoE(cfg) if moe else MLP(cfg.dim, cfg.inter_dim)

    def forward(self, x, residual, cos, sin, meta, cache):
        x, residual = self.attn_norm(x, residual)  # x: the last block's FFN half (the first: the embedding)
        # each half: every rank's unrounded part summed, rounded once by the next norm (docs/model.md §10)
        x = all_reduce(self.attn(x, cos, sin, meta, cache))
        x, residual = self.ffn_norm(x, residual)
        return all_reduce(self.ffn(x)), residual  # (the FFN half's fp32 sum, the bf16 residual stream)


class MTP(nn.Module):
    """Multi-token prediction layer: from the main model's final-normed hidden state h_i and the token
    t_{i+1}, predict t_{i+2}: block(eh_proj([enorm(emb(t_{i+1})); hnorm(h_i)])) -> norm -> head."""

    def __init__(self, cfg: Config):
        super().__init__()
        # the embedding and the head: copies of the main model's in the checkpoint, shared at load where equal
        self.embed = Embedding(cfg.vocab_size, cfg.dim)
        self.enorm = RMSNorm(cfg.dim, cfg.eps)
        self.hnorm = RMSNorm(cfg.dim, cfg.eps)
        self.eh_proj = Linear(2 * cfg.dim, cfg.dim, fp8=False)  # bf16, unquantized in the checkpoint
        self.block = Block(cfg, moe=True)
        self.shared_head = nn.Module()
        self.shared_head.norm = RMSNorm(cfg.dim, cfg.eps)
        self.shared_head.head = Linear(cfg.dim, cfg.vocab_size, fp8=False, dtype=torch.float32, split="col")

    def forward(self, next_tokens, h, cos, sin, meta: Meta, cache: LayerCache):
        """next_tokens [T] (t_{i+1}), h [T, dim] main hidden at i after the final norm -> normed hidden [T,
        dim]."""
        u = self.eh_proj(torch.cat([self.enorm(self.embed(next_tokens)), self.hnorm(h)], -1)).to(BF16)
        # a residual stream of its own, starting at -0.0 (as Transformer.forward's)
        x, residual = self.block(u, torch.full_like(u, -0.0), cos, sin, meta, cache)
        return self.shared_head.norm(x, residual)[0]  # also the next draft step's h (as SGLang chains it)

    def logits(self, h):
        return all_gather(self.shared_head.head(h))  # fp32 [T, vocab] (vocabulary slices joined)


class Transformer(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        hf_checkpoint.check_tp(cfg, tp_size())  # no head, expert or FP8 block split unevenly
        self.cfg = cfg
        self.embed = Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg, moe=i >= cfg.n_dense_layers) for i in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.eps)
        # the lm_head in fp32, as the reference's
        self.head = Linear(cfg.dim, cfg.vocab_size, fp8=False, dtype=torch.float32, split="col")
        self.mtp = nn.ModuleList(MTP(cfg) for _ in range(cfg.n_mtp_layers))

    def bind(self, ops):
        """Point every layer at one kernel set and prepare the weights it reads (once, after loading)."""
        for mod in self.modules():
            mod.ops = ops  # the layers call their heavy math through self.ops
            if isinstance(mod, MLA):  # wkv_b dequantized once, split per head into W_UK | W_UV
                w = weight_dequant(mod.wkv_b.weight, mod.wkv_b.scale).to(ops.attn_dtype(mod.wkv_b.weight))
                D = mod.cfg.qk_nope_head_dim
                w = w.view(-1, D + mod.cfg.v_head_dim, mod.cfg.kv_lora_rank)  # [H, D + V, C]
                mod.w_uk = w[:, :D].transpose(1, 2).contiguous()
                mod.w_uv = w[:, D:].contiguous()
        ops.prepare(self)  # the references dequantize weights; the kernels stack the ones one GEMM reads
        self.freqs = yarn_frequencies(self.cfg).to(self.norm.weight.device)  # RoPE's f'_i (rope_cos_sin)
        return self

    @torch.inference_mode()
    def forward(self, tokens, meta: Meta, cache: KVCache):
        """tokens [T] -> hidden [T, dim] bf16 after the final norm (the lm_head's input, and MTP's)."""
        cos, sin = self.ops.rope_cos_sin(self.freqs, meta.positions)
        h = self.embed(tokens)
        residual = torch.full_like(h, -0.0)  # the residual stream: x + (-0.0) is x bit for bit, -0.0 too
        for i, layer in enumerate(self.layers):
            h, residual = layer(h, residual, cos, sin, meta, cache.layer(i))
        return self.norm(h, residual)[0]

    def logits(self, h):
        return all_gather(self.head(h))  # fp32 [T, vocab] (vocabulary slices joined)

    @torch.inference_mode()
    def mtp_forward(self, next_tokens, h, meta: Meta, cache: KVCache):
        """The first MTP layer: it makes every draft, chained (DeepSeek-V3.2 has one; a checkpoint with more
        loads them unused, as a later layer would need its own KV of the prompt)."""
        cos, sin = self.ops.rope_cos_sin(self.freqs, meta.positions)
        return self.mtp[0](next_tokens, h, cos, sin, meta, cache.layer(self.cfg.n_layers))


# ---- The kernel boundary: the few names through which the GPU path plugs in --------------------------------
# Layers call these through `self.ops`. Transformer.bind points every layer at one set, once, at load
# (load_model calls it): TORCH_OPS (the readable references above, on any device) or kernels.GPU_OPS (the same
# names and signatures, and `capture`, GPU only: CUDA graphs run with the kernels alone).
# The references dequantize a model's FP8 weights once, at load, when the copies (8 bytes a weight on the CPU)
# take at most this much, and widen its plain ones too (Linear.dequantized; Linear.operands hands it to the
# ops); a bigger model dequantizes each weight at each call (the same, exact values).
DEQUANTIZE_AT_LOAD_BYTES = 2 << 30


def dequantize_weights(model):
    """TORCH_OPS.prepare: every Linear gets the copy it computes with, one for a weight two Linears share; not
    wkv_b, read only through bind's W_UK and W_UV."""
    linears = [m for name, m in model.named_modules() if isinstance(m, Linear) and not name.endswith("wkv_b")]
    weights = {mod.weight for mod in linears}  # (a shared one once)
    if sum(w.numel() for w in weights) * 8 > DEQUANTIZE_AT_LOAD_BYTES:
        return
    copies = {}  # weight -> the copy the references read
    for mod in linears:
        if mod.weight not in copies:
            w = weight_dequant(mod.weight, mod.scale) if mod.fp8 else mod.weight.detach()
            copies[mod.weight] = w.to(acc_dtype(mod.weight))
        mod.dequantized = copies[mod.weight]  # (a tensor, not a second parameter)


TORCH_OPS = SimpleNamespace(
    name="torch reference",
    index_quant=index_quant,  # indexer queries: RoPE, Hadamard, FP8               (Indexer)
    store_index_key=store_index_key,  # indexer keys: LayerNorm, index_quant, cache write (Indexer)
    index_topk=index_topk,  # indexer scores + causal mask + top-k            (Indexer)
    sparse_mla=sparse_mla,  # absorbed sparse attention, one row per token   (MLA: decode/verify/long)
    dense_attention=dense_attention,  # causal per-head attention of short prompts  (MLA: prefill)
    head_linear=head_linear,  # one linear map per head: W_UK, W_UV absorbed  (MLA: sparse rows)
    rope_cos_sin=rope_cos_sin,  # RoPE's angles, once per pass               (Transformer)
    rope=rope,  # rotary embedding of MLA's queries                            (MLA)
    store_latent=store_latent,  # MLA's cache write: norm, FP8 round trip, rope  (MLA)
    linears=linears,  # several Linears of one input (GPU: one GEMM)         (MLA)
    rms_norm=rms_norm,  # RMSNorm, with the residual add fused                   (RMSNorm)
    fp8_linear=fp8_linear,  # act-quant + block-scaled FP8 GEMM                (Linear)
    dense_linear=dense_linear,  # bf16/fp32 weights: heads, weights_proj, eh_proj, router (Linear, Gate)
    mlp=mlp,  # SwiGLU MLP (GPU: w1 | w3 one GEMM, SwiGLU in w2's act-quant) (MLP)
    route=route,  # the router after its product: group-limited top-k, weights (Gate)
    moe=moe,  # routed experts, grouped, weighted sum                (MoE)
    side_by_side=side_by_side,  # independent parts of a layer: GPU, streams (MLA, Indexer, MoE)
    decode_rows=decode_rows,  # a round's decode rows: positions, requests, slots, lengths (Meta.decode)
    prepare=dequantize_weights,  # the weights as the ops read them, once at load (Transformer.bind)
    attn_dtype=acc_dtype,  # dtype of W_UK, W_UV (kernels.py: bf16, exact), so of dense attention's inputs
)  # (Part 2 adds the engine's ops: sample, probs_from_logits, rejection_sample, read_back, take)


def select_ops(kernels, device):
    """The kernel set for a device: 'torch' the references; 'gpu' kernels.py (an error where it cannot run);
    'auto' kernels.py on a GPU that supports it, else the references."""
    checks.check_kernels(kernels, device)
    if kernels == "torch" or torch.device(device).type != "cuda":
        return TORCH_OPS
    import kernels as gpu_kernels  # Triton (and flashinfer on Blackwell): imported on the GPU path only

    why = gpu_kernels.unsupported(torch.device(device))
    require(not why or kernels == "auto", f"the GPU kernels cannot run here: {why}")
    return TORCH_OPS if why else gpu_kernels.GPU_OPS


# ---- Tensor and expert parallelism (torchrun): each rank holds a shard of the weights ----------------------
# Every rank runs the same schedule. Split by rank: MLA heads, dense MLP and shared expert (w1 / w3 rows, w2
# columns), routed experts (by index range), vocabulary. Replicated: the rest, the indexer and latent KV cache
# included (every rank selects the same positions). One all-reduce per block half (Block) and one of the
# embedding, one all-gather of the logits; sampling is identical on every rank.
# The torch.distributed calls behind tp_size, tp_rank, all_reduce, all_gather and rank_slice: parallel.py.


# ---- Loader: reads any DeepSeek-V3.2 checkpoint directory shard by shard, validating every tensor ----------
def load_model(path, device="cpu", kernels="auto", cfg=None) -> Transformer:
    """Load a DeepSeek-V3.2 HF checkpoint directory (cfg: its config, if the caller has opened it). FP8
    weights stay FP8; norms, router bias, weights_proj and the heads are upcast to fp32 one tensor at a time
    (the copy into their fp32 parameters), as the reference does; a tensor holding nan or inf is refused by
    name. Under torchrun a rank reads only its share."""
    from safetensors import safe_open

    cfg = cfg or hf_checkpoint.open_checkpoint(path, Config)
    ops = select_ops(kernels, device)  # (kernels that cannot run here: refused before any weight is read)
    with torch.device(device):  # parameters made empty (torch.empty), where they will live
        model = Transformer(cfg).eval()
    params = dict(model.named_parameters())
    files = hf_checkpoint.shard_files(path)[0]  # the shard files ([1]: the weight map)
    with hf_checkpoint.progress_bar(files, tp_rank(), tp_size()) as bar:  # (rank 0's, for a large model)
        for file in files:
            with safe_open(file, "pt", device="cpu") as f:
                for name in f.keys():
                    target = hf_checkpoint.load_target(params, cfg, name, tp_rank(), tp_size())
                    if target is None:  # another rank's expert: not read
                        continue
                    part = f.get_slice(name)
                    t = part[rank_slice(part.get_shape(), target.shape)]  # reads this rank's slice only
                    target.copy_(t)
                    hf_checkpoint.check_values(target, name, file)
                    bar.update(t.numel() * t.element_size())
    del params  # (it would keep the MTP layer's copies of the embedding and head that the next line drops)
    return hf_checkpoint.share_mtp_copies(model).bind(ops)


# ==== Part 2: the engine ====================================================================================
# ---- Tokenizer and DeepSeek-V3.2 chat encoding (docs/model.md §9) ------------------------------------------
# A prompt becomes the chat template's text, BOS + `<｜User｜>{prompt}<｜Assistant｜></think>` (`<think>` in
# thinking mode; chat.py's encode_chat), then token ids by the checkpoint's tokenizer.json (LLM.encode).


# ---- Sampling and speculative acceptance, on the device ----------------------------------------------------
# Every random number is a hash of (the request's seed, the position of the token it decides, what it decides:
# a `stream`), never of a row's place in a batch or of how many numbers were drawn before: a counter-based
# generator, as Philox is. So a seeded request draws the same numbers alone or in any batch, on any device.
TARGET, DRAFT, ACCEPT = 1, 2, 3  # streams: the main model's token, a draft token, a draft's acceptance test
M32 = 0xFFFFFFFF


def mix32(x):
    """A 32-bit hash of x (xorshift-multiply by 0x45D9F3B, twice), in int64 (the products stay below 2^63)."""
    x = ((x >> 16) ^ x) * 0x45D9F3B & M32
    x = ((x >> 16) ^ x) * 0x45D9F3B & M32
    return (x >> 16) ^ x


def uniform(seeds, positions, stream, n):
    """Uniform numbers in (0, 1] [*positions.shape, n], a hash of (seed, position, stream, column); seeds
    (int64, >= 0) broadcast against positions. 32 bits in fp32: as fine as 2^-32 near 0 (exponential). (The
    key enters twice: from key ^ column alone, keys that differ in low bits only would give permuted rows.)"""
    key = mix32(mix32(mix32(seeds & M32) ^ (seeds >> 32)) ^ positions)
    key = mix32(key ^ stream)[..., None]
    bits = mix32(mix32(key ^ torch.arange(n, device=positions.device)) ^ key)
    return (bits.float() + 0.5) / 2**32


def exponential(u):
    """E = -log(1 - u) ~ Exp(1) for u uniform, computed as log1p is: exact where u is small, where the race
    decides the unlikely tokens; u = 1 counts as 1 - 2^-25, so E is never inf (docs/model.md §10)."""
    w = (1 - u).clamp(min=2**-25)
    return torch.where(w == 1, u, -torch.log(w) * u / (1 - w))


def sample(probs, seeds, positions, stream):
    """One draw from each row of probs [..., V] (weights, not necessarily normalized) by the exponential race:
    argmax p / E, E ~ Exp(1), is an exact draw from p with no host round trip (down to about 1e-10: a token
    that unlikely still wins as often as it should)."""
    e = exponential(uniform(seeds, positions, stream, probs.shape[-1]))
    return (probs / e.to(probs.dtype)).argmax(-1)


def probs_from_logits(logits, temperature, top_p):
    """fp32 logits [..., V] -> each row's sampling distribution: softmax(logits / T) cut to the top-p nucleus
    (the most likely tokens until they hold top_p) and renormalized; one-hot on the argmax where T = 0
    (greedy). temperature, top_p [...] per row. A row's total is its last cumulative sum, not a row sum
    (whose order would depend on the row count)."""
    greedy = (temperature == 0)[..., None]  # (sampling_kernels.probs_from_logits: no sort)
    p = torch.softmax(logits.to(acc_dtype(logits)) / torch.where(greedy, 1.0, temperature[..., None]), -1)
    sp, si = p.sort(dim=-1, descending=True, stable=True)
    before = sp.cumsum(-1) - sp  # the mass of the tokens more likely than each
    sp = sp.masked_fill((before >= top_p[..., None]) & (top_p[..., None] < 1), 0.0)
    p = torch.zeros_like(p).scatter_(-1, si, sp / sp.cumsum(-1)[..., -1:])
    onehot = F.one_hot(logits.argmax(-1), logits.shape[-1]).to(p.dtype)
    return torch.where(greedy, onehot, p)


@dataclass
class Batch:
    """Decode rounds' inputs, on the device, one row per request: its tokens and position, its drafts'
    distributions, and how it draws. The engine keeps one Batch, the decode state (LLM.state), with a row per
    request it runs (Request.row; row 0 is padding's): the host writes a row once (LLM.start), then each round
    reads its requests' rows (take) and writes the next round's inputs back."""

    tokens: torch.Tensor  # [B, k+1] x_L (the last token), then the drafts d_1..d_k
    start: torch.Tensor  # [B] L: the position of x_L (its KV and the drafts' are written this round)
    q: torch.Tensor  # [B, k, vocab] the drafts' distributions (one-hot for greedy; None where k = 0)
    seeds: torch.Tensor  # [B] int64
    temperature: torch.Tensor  # [B] fp32, 0 for greedy
    top_p: torch.Tensor  # [B] fp32

    @classmethod
    def empty(cls, n, k, vocab, device):
        """n rows of zeros (top_p 1: a padding row is a greedy request at position 0 writing slot 0)."""
        ints = functools.partial(torch.zeros, dtype=torch.long, device=device)
        floats = functools.partial(torch.zeros, device=device)
        q = floats(n, k, vocab, dtype=acc_dtype(floats(0))) if k else None  # (as probs_from_logits gives)
        return cls(ints(n, k + 1), ints(n), q, ints(n), floats(n), floats(n) + 1)

    def take(self, ids):
        """The rows ids [B] as a round's Batch (each field's rows ids)."""
        return Batch(*(x if x is None else x[ids] for x in vars(self).values()))


def residual_probs(p, q):
    """Where a draft was rejected, the main model's token is drawn from max(p - q, 0) (p itself if p == q)."""
    r = (p - q).clamp(min=0)
    return torch.where(r.amax(-1, keepdim=True) > 0, r, p)


def rejection_sample(p, q, drafts, seeds, start):
    """Speculative sampling's acceptance rule (accept runs it): p [B, k+1, V] the main model's distributions
    of the tokens at positions L+1..L+k+1 (from its rows at L..L+k; L = start [B]), q [B, k, V] those d_1..d_k
    were drawn from (None where k = 0), drafts [B, k] -> (emitted [B, k+1], counts [B]). Keeps d_j with
    probability min(1, p(d_j) / q(d_j)), then draws from residual_probs (from p after k acceptances): the
    output follows p exactly. Greedy, temperature 0, is its one-hot case: p(d) = 1 at the argmax, so u q(d) <=
    1 keeps that draft whatever q is; p(d) = 0 rejects any other; max(p - q, 0) is non-zero only at the argmax
    (else the draw falls back to p): the longest prefix of drafts equal to the argmax, then the argmax.
    For example, k = 3 and the acceptance tests keep d_1, d_2, not d_3: a = 2 accepted, t is drawn from
    row 2's residual, emitted [d_1, d_2, t, d_3] (a request emits its first counts = 3, never the rest)."""
    B, n, _ = p.shape
    zero = torch.zeros_like(p[:, :1])
    # [B, k+1, V]: the drafts' distributions, then zeros (after k acceptances the residual is p itself)
    q = zero if q is None else torch.cat([q, zero], 1)
    positions = start[:, None] + 1 + torch.arange(n, device=start.device)  # of the token each row decides
    px, qx = (d[:, :-1].gather(-1, drafts[..., None])[..., 0] for d in (p, q))  # [B, k]: p(d_j), q(d_j)
    u = uniform(seeds[:, None], positions[:, :-1], ACCEPT, 1)[..., 0]
    passes = (u * qx <= px) & (px > 0)  # [B, k] each draft's test (p > 0: where q is 0 too, 0 <= 0 passes)
    # a [B]: the drafts accepted, those before the first failed test (passes [1, 1, 0]: cumprod [1, 1, 0], 2)
    a = passes.long().cumprod(1).sum(1)
    rows = torch.arange(B, device=start.device)
    t = sample(residual_probs(p[rows, a], q[rows, a]), seeds, positions[rows, a], TARGET)  # row a's token
    emitted = torch.cat([drafts, t[:, None]], 1)  # [B, k+1]: d_1..d_k, then a free column
    emitted[rows, a] = t  # t after the a accepted drafts (what follows it is not emitted)
    return emitted, a + 1


def accept(ops, batch: Batch, logits):
    """Speculative acceptance of every request at once, on the device: logits [B, k+1, V], the main model's at
    the rows of batch.tokens (x_L, d_1..d_k) -> (emitted [B, k+1], counts [B]): rejection_sample on the rows'
    distributions, for every request (a greedy one's are one-hot: see rejection_sample)."""
    p = ops.probs_from_logits(logits, batch.temperature[:, None], batch.top_p[:, None])  # [B, k+1, V]
    return ops.rejection_sample(p, batch.q, batch.tokens[:, 1:], batch.seeds, batch.start)


# ---- Requests and results ----------------------------------------------------------------------------------
@dataclass(eq=False)
class Request:
    idx: int  # position in the caller's prompt list
    tokens: list  # prompt + generated so far
    prompt_len: int
    max_new_tokens: int
    temperature: float
    top_p: float
    seed: int  # keys its random numbers (with each token's position)
    num_cached: int = 0  # positions whose main-model KV is in the pool; decode phase: len(tokens) - 1
    pages: list = field(default_factory=list)
    swapped: list = None  # its KV in host memory while preempted (PagePool.swap_out)
    row: int = None  # its row of the engine's decode state once it starts decoding (LLM.start)
    return_logits: bool = False  # keep the main-model logits row of every emitted token in `logits`
    on_tokens: object = None  # called as on_tokens(idx, [token]) for every emitted token
    logits: list = field(default_factory=list)
    accept_lengths: list = field(default_factory=list)  # per round: tokens emitted, before EOS/length cuts
    finish: str = None  # "eos" | "length" once done

    @property
    def generated(self):
        return self.tokens[self.prompt_len :]

    def emit(self, new_tokens, logits_rows, eos_id):
        """Append emitted tokens, stopping at EOS or max_new_tokens (a finished request retires after the
        step). logits_rows: the main model's logits row of each (kept with return_logits)."""
        for i, t in enumerate(new_tokens):
            if t == eos_id:
                self.finish = "eos"
                return
            self.tokens.append(t)
            if self.return_logits:
                self.logits.append(logits_rows[i].float().cpu())
            if self.on_tokens:
                self.on_tokens(self.idx, [t])
            if len(self.generated) == self.max_new_tokens:
                self.finish = "length"
                return


@dataclass
class Result:
    token_ids: list
    text: str
    accept_lengths: list
    logits: torch.Tensor = None
    finish_reason: str = None


# ---- The KV page pool: request position p is slot pages[p // ps] * ps + p % ps (ps: page_size) -------------
class PagePool:
    """Hands out the KV cache's slots by pages of `page_size`. Page 0 is never given out: its slot 0 is the
    dummy slot, written by rows that hold no real token (a CUDA graph's padding rows: CudaGraphs;
    draft-extend's rows past what a request emitted: speculative_round)."""

    def __init__(self, cache: KVCache, page_size):
        self.cache = cache
        self.page_size = page_size
        self.device = cache.latent.device
        self.free = list(range(1, cache.latent.shape[1] // page_size))
        self.changes = 0  # counts every change of any request's pages: the last table stays valid until then
        self.last_table = (None, None)  # (changes, requests) -> their table, the last one made

    @property
    def free_slots(self):
        return len(self.free) * self.page_size

    def reserve(self, req, n_positions):
        """Give `req` pages for positions [0, n_positions); False (and nothing given) if the pool is short."""
        need = -(-n_positions // self.page_size) - len(req.pages)
        if need > len(self.free):
            return False
        if need > 0:
            req.pages += [self.free.pop() for _ in range(need)]
            self.changes += 1
        return True

    def release(self, req):
        self.free += req.pages
        req.pages = []
        self.changes += 1

    def swap_out(self, req):
        """Move a preempted request's KV (every layer, every slot of its pages) to host memory and give its
        pages back: swapped in later, it has exactly the bits it had (docs/batch_invariance.md). The copy
        waits for the round in flight, so it holds that round's writes too."""
        slots = self.table([req])[0]
        req.swapped = [t[:, slots].cpu() for t in self.cache.tensors()]
        self.release(req)

    def swap_in(self, req, n_positions):
        """Pages for a swapped-out request's positions [0, n_positions) (at least those it had) with its KV
        copied back; False (nothing changed) if the pool is short."""
        had = req.swapped[0].shape[1]  # the slots it had
        if not self.reserve(req, max(n_positions, had)):
            return False
        slots = self.table([req])[0][:had]
        for t, saved in zip(self.cache.tensors(), req.swapped, strict=True):
            t[:, slots] = saved.to(self.device)
        req.swapped = None
        return True

    def table(self, reqs):
        """[B, W] slot of every position of each request (the page size 1 view that the kernels read); the
        last one made again while no pages changed (consecutive rounds of a batch share one)."""
        key = (self.changes, [id(r) for r in reqs])
        if self.last_table[0] == key:
            return self.last_table[1]
        rows = [torch.tensor(r.pages, dtype=torch.long) for r in reqs]
        pages = to_device(nn.utils.rnn.pad_sequence(rows, batch_first=True), self.device)  # 0s past a row's
        offsets = torch.arange(self.page_size, device=self.device)
        table = (pages[:, :, None] * self.page_size + offsets).flatten(1)
        self.last_table = (key, table)
        return table


# ---- The scheduler: admission, chunked prefill, preemption -------------------------------------------------
# A prompt chunk of at most this many rows runs as decode rows (Scheduler.form): absorbing its queries costs
# less than expanding its context for the per-head form, as for a decode row. Longer ones: the per-head form.
DECODE_ROWS_MAX = 256


def round_lookahead(num_draft):
    """How many positions past L = num_cached a round may write; k = num_draft. A round from L writes L..L+k
    (verify) and up to L+2k-1 (its k-1 draft steps). But the host's L is a round stale (the host one round
    ahead, end of LLM): the round in flight moves it to L' <= L+k+1, so the next writes up to L'+2k-1 <= L+3k,
    3k+1 positions from L; 3k+2 so that k = 0 (writing L+1) fits too."""
    return 3 * num_draft + 2


class Scheduler:
    """Which requests run in the next step. Requests wait in arrival order and are admitted while the batch
    has room and the pool has pages for their prompt and first drafts. A step is a prefill step while any
    running request has prompt left before its last token (chunks of at most max_prefill_tokens rows in all),
    else a decode round over every running request. A round short of pages preempts the newest request: its KV
    moves to host memory and its pages go back; first in the queue, it goes on where it stopped."""

    def __init__(self, pool: PagePool, max_batch, max_prefill_tokens, num_draft, index_topk):
        self.pool = pool
        self.max_batch = max_batch
        self.max_prefill_tokens = max_prefill_tokens
        self.num_draft = num_draft
        self.index_topk = index_topk
        self.waiting = []
        self.running = []
        self.preemptions = 0

    def schedule(self):
        """-> ("prefill", chunks [(request, first position, length)]) or ("decode", the running requests, each
        with its pages for the round reserved)."""
        self.admit()
        # (a prompt's last token is x_L of its first decode round: LLM.prefill)
        prefilling = [r for r in self.running if r.num_cached < r.prompt_len - 1]
        if prefilling:
            return "prefill", self.prefill_chunks(prefilling)
        return "decode", self.reserve_round()

    def admit(self):
        while self.waiting and len(self.running) < self.max_batch:
            req = self.waiting[0]
            if req.swapped is not None:  # only with the pages of a round: else preempted again at once
                admitted = self.pool.swap_in(req, req.num_cached + round_lookahead(self.num_draft))
            else:  # its prompt and about a first verify's rows (reserve_round adds the rest of a round's)
                admitted = self.pool.reserve(req, req.prompt_len + self.num_draft + 1)
            if not admitted:
                return
            self.running.append(self.waiting.pop(0))

    def prefill_chunks(self, reqs):
        """This step's prompt chunks, at most max_prefill_tokens rows in all: a prompt is cut at fixed
        multiples of it, and a step never mixes chunks of two forms, so a chunk does not depend on what else
        runs. A chunk that does not fit waits for the next step, and so do those after it."""
        chunks, forms = [], set()
        budget = self.max_prefill_tokens
        for r in reqs:
            n = min(r.prompt_len - 1 - r.num_cached, self.max_prefill_tokens)
            forms.add(self.form(r.num_cached, n))
            if n > budget or len(forms) > 1:  # (the step's first chunk decides its form)
                break
            chunks.append((r, r.num_cached, n))
            budget -= n
        return chunks

    def form(self, start, n):
        """A chunk of n prompt positions from `start` runs as decode rows ('decode', each its own query:
        Meta), and so in a CUDA graph if its step is short (LLM.prefill), unless it is long and its context
        fits in top-k: then 'prefill', attending in MLA's per-head form, cheaper for many rows."""
        return "prefill" if n > DECODE_ROWS_MAX and start + n <= self.index_topk else "decode"

    def reserve_round(self):
        """Pages for a decode round of every running request; preempts the newest while the pool is short."""
        lookahead = round_lookahead(self.num_draft)
        for r in list(self.running):
            while r in self.running and not self.pool.reserve(r, r.num_cached + lookahead):
                # swapped out while still running: a Ctrl-C at any point leaves it in a list drop_all empties
                self.pool.swap_out(self.running[-1])
                self.waiting.insert(0, self.running.pop())
                self.preemptions += 1
        return list(self.running)

    def retire(self):
        for r in [r for r in self.running if r.finish]:
            self.running.remove(r)
            self.pool.release(r)
        for r in [r for r in self.waiting if r.finish]:  # preempted while its last round was in flight
            self.waiting.remove(r)
            r.swapped = None

    def drop_all(self):
        """Forget every request (a generate that was interrupted), giving their pages back (a waiting one has
        pages while it is being swapped in)."""
        for r in self.running + self.waiting:
            self.pool.release(r)
        self.running = []
        self.waiting = []


# ---- The speculative round: verify -> accept -> draft-extend -> draft, one function of device tensors ------
def speculative_round(model, cache, state: Batch, ids, table):
    """One decode round of the requests in rows ids [B] of `state` (table [B, W]: their page-table rows),
    greedy and sampled alike, on the device with no host synchronization (a CUDA graph captures it whole) ->
    (emitted [B, k+2]: the emitted tokens, then how many; the verify logits [B, k+1, V]); their rows then hold
    the next round's inputs. The four phases:
    1. verify: the main model over x_L, d_1..d_k of every request, each a decode row of its own, with its own
       position and causal length (the indexer masks each row's future before its top-k);
    2. accept: the drafts the main model agrees with, then one token of its own (accept);
    3. draft-extend: the MTP layer over the same rows, pairs (h_p, x_{p+1}) with the emitted tokens as the
       x's; rows past what a request emitted write the dummy slot 0, so shapes do not depend on acceptance;
    4. draft: k new drafts from the last emitted row (draft).
    For example, k = 3, L = 10, two drafts accepted:
      verify   rows at positions 10..13 (tokens x_10, d_1, d_2, d_3); row p's logits decide the token at p + 1
      accept   emitted d_1, d_2, t (t: the main model's token for position 13): counts 3
      extend   MTP rows 10, 11, 12 pair h_p with x_{p+1} = d_1, d_2, t; row 13 writes the dummy slot 0
      draft    L' = 13: the MTP row at 12 drafts d'_1 (position 14), steps at 13 and 14 draft d'_2, d'_3
      next     the round's tokens t, d'_1, d'_2, d'_3 at positions 13..16"""
    batch = model.ops.take(state, ids)  # their rows (Batch.take; on a GPU one launch)
    B, n = batch.tokens.shape
    dev = batch.tokens.device
    # The metadata, built once (one launch): the verify's every layer reads this Meta of its B*(k+1) rows at
    # positions L..L+k, draft-extend reuses it (its slots masked), and each draft step builds one of B rows.
    meta = Meta.decode(model.ops, batch.start, n, table)
    h = model(batch.tokens.flatten(), meta, cache)  # 1. verify
    logits = model.logits(h).view(B, n, -1)
    emitted, counts = accept(model.ops, batch, logits)  # 2. accept
    next_tokens = emitted  # (k = 0: the one token emitted)
    if n > 1:  # 3. draft-extend: the same rows, their positions and lengths as they are
        # (the docstring's example in brackets: k = 3, L = 10, counts = 3)
        kept = (torch.arange(n, device=dev) < counts[:, None]).flatten()  # rows x was emitted at [1, 1, 1, 0]
        extend = replace(meta, slots=meta.slots * kept)  # (row 13 writes the dummy slot 0)
        h = model.mtp_forward(emitted.flatten() * kept, h, extend, cache)  # x_{p+1}: [d_1, d_2, t, 0]
        last = (counts - 1)[:, None]  # each request's last emitted row [2], position L + 2 = 12
        h = h.view(B, n, -1)[torch.arange(B, device=dev), last[:, 0]]
        start = batch.start + counts  # L': the position of the last emitted token [13]
        drafts, q = draft(model, cache, h, start, batch, table)  # 4. draft
        next_tokens = torch.cat([emitted.gather(1, last), drafts], 1)
        state.q[ids] = q
    state.tokens[ids] = next_tokens
    state.start.index_add_(0, ids, counts)
    state.start[0].zero_()  # padding's row: it stays at position 0, so its rows stay inside any table's width
    return torch.cat([emitted, counts[:, None]], 1), logits


def prompt_rows(tokens, start, n, b):
    """Request b's prompt rows at positions start .. start + n - 1 (tokens: its token ids) -> [4, n] on the
    host: each row's token x_p, the next token x_{p+1}, the position p, and b."""
    x, positions = torch.tensor(tokens[start : start + n + 1]), torch.arange(start, start + n)
    return torch.stack([x[:-1], x[1:], positions, torch.full_like(positions, b)])


def prompt_pass(model, cache, rows, table, num_draft, mode="decode", cu_seqlens=None):
    """A prefill step's pass over its prompt rows [4, T] (prompt_rows, on the device; table [B, W]): the
    main model, then the MTP layer over the same rows (its own KV), position p pairing the main hidden h_p
    with the prompt's next token x_{p+1} -> the hidden states the next tokens are guessed from (the MTP
    layer's; num_draft 0: the main model's, unused)."""
    tokens, next_tokens, positions, row_req = rows
    meta = Meta.rows(mode, positions, row_req, table, cu_seqlens)  # (in a CUDA graph: built by it)
    h = model(tokens, meta, cache)
    return model.mtp_forward(next_tokens, h, meta, cache) if num_draft else h


def draft(model, cache, h, start, batch, table):
    """The batch's k draft tokens per request, on the device: d_1 from the MTP row just run at position start
    - 1 (start [B]: L', the next round's, not batch.start; its hidden state h [B, dim]), then k-1 chained MTP
    decode steps at positions start, start + 1, ... -> (drafts [B, k], the distributions q [B, k, vocab] they
    were drawn from: one-hot on the argmax for a greedy request). With speculative_round's example, L' = 13:
      step 0   h from the MTP row at 12 (x_13 = t)        -> d'_1, the token at 14
      step 1   MTP row at 13: h chained, input d'_1         -> d'_2, the token at 15
      step 2   MTP row at 14: h chained, input d'_2         -> d'_3, the token at 16"""
    tokens, dists = [], []
    for step in range(batch.tokens.shape[1] - 1):
        if step:  # the MTP layer's own output h, chained with the draft before, at position start + step - 1
            meta = Meta.decode(model.ops, start + (step - 1), 1, table)
            h = model.mtp_forward(tokens[-1], h, meta, cache)
        logits = model.mtp[0].logits(h)  # [B, V]; d_{step+1} is the token at position start + step + 1
        dists.append(model.ops.probs_from_logits(logits, batch.temperature, batch.top_p))
        tokens.append(model.ops.sample(dists[-1], batch.seeds, start + (step + 1), DRAFT))
    return torch.stack(tokens, 1), torch.stack(dists, 1)


def read_back(x):
    """The host's copy of a round's result x, for later -> a function returning x.tolist() (kernels.read_back
    starts the copy now and waits for it only when called: the host queues the next round in between)."""
    return x.tolist


# the kernel boundary's engine ops (GPU: sampling_kernels.py, 1-13 launches each, the references ~20-30;
# read_back and take: kernels.py)
TORCH_OPS.sample, TORCH_OPS.probs_from_logits = sample, probs_from_logits
TORCH_OPS.rejection_sample, TORCH_OPS.read_back, TORCH_OPS.take = rejection_sample, read_back, Batch.take


# ---- CUDA graphs: the round per batch-size bucket, a prompt step per row-count bucket ----------------------
def graph_buckets(max_bs):
    """Batch sizes captured: 1, 2, 4, 8, then every 16 below max_bs, and max_bs itself (a batch of B requests
    replays the smallest bucket that holds B; max_bs 64: 1, 2, 4, 8, 16, 32, 48, 64)."""
    return sorted({b for b in (1, 2, 4, 8, *range(16, max_bs, 16)) if b < max_bs} | {max_bs})


# A prefill step of decode rows (Scheduler.form) replays a graph of prompt_pass, padded to the smallest of
# these row counts that holds it; longer steps run eagerly (a step holds at most max_prefill_tokens rows).
PROMPT_BUCKETS = (16, 32, 64, 128, 256, 512, 1024)


class CudaGraphs:
    """speculative_round and prompt_pass as CUDA graphs, each captured when a step first needs it: a round
    per batch-size bucket, a prompt step per row-count bucket, each per context bound too (the indexer's
    width, a graph's shape). A replay reads its rows from static buffers through one static table: a round,
    the decode state's rows named in `ids`; a prompt step, each row's tokens, position and request in
    `prompt_rows`. Padding rows: the decode state's row 0, or position 0 of request B's table row (the
    step has B requests), both all dummy slot 0."""

    def __init__(self, llm, max_batch, page_size):  # (llm: the engine, next section, whose state they read)
        self.model, self.cache, self.state, self.num_draft = llm.model, llm.cache, llm.state, llm.num_draft
        self.buckets = graph_buckets(max_batch)
        context = llm.max_context + round_lookahead(llm.num_draft) + 1  # a bound on any step's table width
        self.max_width = -(-context // page_size) * page_size
        self.table = torch.zeros(max_batch + 1, self.max_width, dtype=torch.long, device=llm.device)
        self.ids = self.table.new_zeros(max_batch)  # the round's rows of the decode state
        self.prompt_rows = self.table.new_zeros(4, PROMPT_BUCKETS[-1])  # x_p, x_{p+1}, p, request, a row each
        self.graphs = {}
        self.memory_pool = torch.cuda.graph_pool_handle()  # one CUDA memory pool for all of them

    def width(self, max_ctx):
        """The context bound a step runs under (the indexer's width), from the width of its table: index_topk
        if that covers it, else the next power of two; at most max_width."""
        topk = self.model.cfg.index_topk
        return min(topk if max_ctx <= topk else 1 << (max_ctx - 1).bit_length(), self.max_width)

    def run(self, ids, table):
        """speculative_round's replay for the requests of rows ids [B] (table [B, W]: W bounds their contexts)
        -> the graph's outputs, overwritten by its next replay (rows past B are padding)."""
        B = len(ids)
        bs, width = next(b for b in self.buckets if b >= B), self.width(table.shape[1])
        self.ids[:B] = ids
        self.table[:B, : table.shape[1]] = table  # (columns past it: stale, past every row's causal length)
        self.ids[B:bs], self.table[B:bs, :width] = 0, 0  # padding rows (none where B = bs)
        return self.replay(("round", bs, width))

    def prompt(self, rows, table):
        """prompt_pass's replay for a prefill step's rows [4, T] (on the host: prompt_rows) of B requests
        (table [B, W]) -> the hidden states of its rows, then padding's (overwritten by the next replay)."""
        (B, W), T = table.shape, rows.shape[1]
        n = next(b for b in PROMPT_BUCKETS if b >= T)
        padding = prompt_rows([0, 0], 0, 1, B).expand(4, n - T)  # position 0 of table row B: dummy slot 0
        self.prompt_rows[:, :n] = to_device(torch.cat([rows, padding], 1), self.table.device)
        self.table[:B, :W], self.table[B] = table, 0
        return self.replay(("prompt", n, self.width(W)))

    def replay(self, key):
        if key not in self.graphs:
            self.capture(key)
        graph, out = self.graphs[key]
        graph.replay()
        return out

    def capture(self, key):
        """Capture a step for (kind, bucket, context bound) on the static inputs (which kernels.capture zeroes
        for its warm-up run, then restores)."""
        kind, n, width = key
        if kind == "round":
            tensors = (self.model, self.cache, self.state, self.ids[:n], self.table[:n, :width])
            step, what = functools.partial(speculative_round, *tensors), f"the round for bs {n}"
        else:
            tensors = (self.model, self.cache, self.prompt_rows[:, :n], self.table[:, :width], self.num_draft)
            step, what = functools.partial(prompt_pass, *tensors), f"prompt steps of {n} rows"
        inputs, what = [self.ids, self.table, self.prompt_rows], f"{what}, contexts <= {width}"
        self.graphs[key] = self.model.ops.capture(step, self.memory_pool, inputs, what)


# ---- LLM: the engine, tying the parts together -------------------------------------------------------------
# One request's life (docs/serving.md draws it), step by step:
#   generate   its prompt becomes tokens and a Request, queued in the scheduler (make_requests)
#   admit      it runs once the batch has room and the pool has pages for its prompt (Scheduler.admit)
#   prefill    prefill steps write the KV of every prompt position but the last, in chunks (LLM.prefill)
#   start      it gets a row of the decode state: its last prompt token and first drafts (LLM.start)
#   rounds     each decode step is one speculative round of every running request, which emits 1 to k+1
#              tokens for each (LLM.decode: speculative_round, then LLM.apply and Request.emit)
#   finish     at EOS or max_new_tokens; retired, it gives its pages and row back (Scheduler.retire)
# Read LLM.decode first as if the host waited for each round. It does not: it keeps one round in flight, "the
# host one round ahead", the last methods of LLM, a mechanism to skip on a first read.
class LLM:
    """DeepSeek-V3.2 engine: generate() queues requests, then runs steps until every request is done."""

    def __init__(
        self,
        model_dir=None,
        device=None,
        mtp=1,
        kv_cache_bytes=None,
        page_size=16,
        max_batch=64,
        max_prefill_tokens=1024,
        max_context=None,
        kernels="auto",
        model=None,
        cuda_graphs=True,
    ):
        """mtp: draft tokens per round (0: no speculative decoding). kv_cache_bytes: the KV pool (default:
        CPU 256 MiB, GPU 80% of the free memory). model: a Transformer built already (bench.py), else
        loaded from model_dir. Arguments and model files are checked before any weight is read."""
        checks.check_engine_args(locals())
        self.device = init_distributed(checks.check_device(device))  # torchrun: join the ranks, take a GPU
        model_dir = hf_checkpoint.default_model_dir() if model_dir is None else model_dir
        self.cfg = model.cfg if model else hf_checkpoint.open_checkpoint(model_dir, Config)  # no weights read
        require(mtp == 0 or self.cfg.n_mtp_layers > 0, f"mtp={mtp}: needs a checkpoint with an MTP layer")
        kv_bytes = KVCache.bytes_per_token(self.cfg, mtp > 0)  # a token's KV in every layer that keeps it
        if model is None:  # before any allocation
            hf_checkpoint.check_fits(self.cfg, self.device, Transformer, kv_bytes)
        self.tokenizer = hf_checkpoint.load_tokenizer(model_dir, self.cfg, SPECIAL_TOKENS, BOS, EOS)
        checks.check_pool_bytes(kv_cache_bytes, kv_bytes * page_size, self.device)
        self.model = model or load_model(model_dir, self.device, kernels, self.cfg)
        self.num_draft = mtp
        self.max_context = min(max_context or self.cfg.max_seq_len, self.cfg.max_seq_len)
        # the pages the pool's bytes hold (its default: after the weights), the fewest over the ranks
        pages = checks.pool_pages(kv_cache_bytes, page_size, kv_bytes, self.device, round_lookahead(mtp))
        self.cache = KVCache(self.cfg, pages * page_size, self.device, mtp > 0)
        self.pool = PagePool(self.cache, page_size)
        self.scheduler = Scheduler(self.pool, max_batch, max_prefill_tokens, mtp, self.cfg.index_topk)
        # a row per running or preempted request (at most max_batch: admit stops at a preempted one), row 0
        self.state = Batch.empty(max_batch + 1, mtp, self.cfg.vocab_size, self.device)
        # (the torch references sync the host: no graphs for them)
        graphed = cuda_graphs and self.device.type == "cuda" and self.model.ops is not TORCH_OPS
        self.graphs = CudaGraphs(self, max_batch, page_size) if graphed else None
        self.launched = None  # (requests, read back, logits) of the round launched and not applied yet
        self.rows = (None, None)  # (requests, their rows of `state`) of the last round
        self.stats = {}
        if self.device.type == "cuda":
            self.warm_up()

    def warm_up(self):
        """Build the GPU kernels (Triton compiles them at first use, and caches them on disk) and the graphs
        of one short request before any generate the caller times; other graphs are captured at first use."""
        t0 = time.perf_counter()
        self.generate([[self.cfg.bos_token_id] * 16], max_new_tokens=2)
        where = f"{torch.cuda.get_device_name(self.device)}, kernels: {self.model.ops.name}"
        if tp_rank() == 0:
            print(f"nano-nsa: {where}; built them in {time.perf_counter() - t0:.1f} s", file=sys.stderr)

    def generate(
        self,
        prompts,
        max_new_tokens=256,
        temperature=0.0,
        top_p=1.0,
        seed=None,
        return_logits=False,
        thinking=False,
        raw=False,
        on_tokens=None,
    ):
        """prompts: strings (chat-encoded as a user turn; raw=True: plain completion) or lists of token
        ids. max_new_tokens and seed: one value for every prompt or a list of one per prompt (one seed s:
        prompt i draws with seed s + i; None: a fresh one)."""
        prompts = checks.check_generate_args(prompts, dict(locals()), on_tokens)
        reqs = self.make_requests(prompts, max_new_tokens, temperature, top_p, seed, thinking, raw)
        for r in reqs:
            r.return_logits, r.on_tokens = return_logits, on_tokens
        t0 = time.perf_counter()
        self.scheduler.waiting += reqs
        self.scheduler.preemptions = 0
        rounds = 0
        try:
            while self.scheduler.waiting or self.scheduler.running:  # a step: schedule, run, retire
                mode, work = self.scheduler.schedule()
                if mode == "prefill":
                    self.prefill(work)
                elif work:
                    rounds += self.decode(work)  # (False: the round in flight ended every request)
                self.scheduler.retire()
            self.settle()  # a round launched after its requests finished: nothing to emit
        except BaseException:  # interrupted (Ctrl-C, an on_tokens that raised): no request is left behind
            self.launched = None
            self.scheduler.drop_all()
            raise
        seconds = time.perf_counter() - t0
        self.stats = self.summary(reqs, seconds, rounds)
        return [self.result(r, return_logits) for r in reqs]

    def prefill(self, chunks):
        """Prompt chunks [(request, first position, length)] into the KV cache (prompt_pass), as a CUDA graph
        if they run as decode rows (Scheduler.form) and fit the largest of PROMPT_BUCKETS, else eagerly.
        A prompt's last token x_{P-1} is not prefilled: it is x_L of the request's first decode round, so
        every token a request emits is drawn by a round. That round's k drafts all repeat the MTP layer's
        guess of x_P from the last prefilled row, an argmax, so drawn from a one-hot q (exact acceptance).
        Only d_1 is a real guess (chaining would need MTP decode steps here): d_2..d_k are placeholders,
        mostly rejected, free as their verify rows run anyway."""
        reqs, starts, lens = zip(*chunks, strict=True)
        # the step's rows [4, T] on the host: x_p, x_{p+1}, p and the request of each
        rows = torch.cat([prompt_rows(r.tokens, s, n, b) for b, (r, s, n) in enumerate(chunks)], 1)
        mode, table = self.scheduler.form(starts[0], lens[0]), self.pool.table(reqs)
        table = table[:, : max(s + n for s, n in zip(starts, lens, strict=True))]  # W: the longest row's
        if self.graphs and mode == "decode" and rows.shape[1] <= PROMPT_BUCKETS[-1]:
            h = self.graphs.prompt(rows, table)
        else:  # (cu_seqlens: each request's rows, for the references and the per-head form)
            rows, cu_seqlens = to_device(rows, self.device), list(accumulate(lens, initial=0))
            h = prompt_pass(self.model, self.cache, rows, table, self.num_draft, mode, cu_seqlens)
        for r, _, n in chunks:
            r.num_cached += n
        ends = accumulate(lens)  # (each request's rows end there)
        done = [(r, end - 1) for r, end in zip(reqs, ends, strict=True) if r.num_cached == r.prompt_len - 1]
        guess = None
        if self.num_draft and done:  # x_P, the guess every draft of their first round repeats
            last = to_device(torch.tensor([row for _, row in done]), self.device)  # (h[list] would wait)
            guess = self.model.mtp[0].logits(h[last]).argmax(-1)[:, None]
        self.start([r for r, _ in done], guess)  # they decode from now on: their rows of the decode state

    def decode(self, reqs):
        """One speculative round of `reqs` from their rows of the decode state (LLM.start writes a request's
        first), launched, then applied: each request emits what it accepted (LLM.apply; run_ahead applies the
        round before instead). Returns whether a round was launched."""
        reqs = self.settle_near_end(reqs)
        if not reqs:
            return False
        self.start([r for r in reqs if r.row is None])
        if self.rows[0] != reqs:  # the batch's rows of the decode state (on the device, kept while it stays)
            self.rows = (reqs, to_device(torch.tensor([r.row for r in reqs]), self.device))
        ids = self.rows[1]
        # their page tables (with reserve_round's new pages), cut to the furthest position it may write
        table = self.pool.table(reqs)[:, : max(r.num_cached for r in reqs) + round_lookahead(self.num_draft)]
        if self.graphs:
            emitted, logits = self.graphs.run(ids, table)
        else:
            emitted, logits = speculative_round(self.model, self.cache, self.state, ids, table)
        if any(r.return_logits for r in reqs):  # (a CUDA graph's next replay overwrites them)
            logits = logits.clone()
        self.run_ahead(reqs, self.model.ops.read_back(emitted), logits)
        return True

    def start(self, reqs, drafts=None):
        """Give requests whose prompt is prefilled a free row of the decode state (row 0 is padding's), and
        write their first round's inputs there: the last prompt token and its position, how they draw, the
        drafts [B, 1] (LLM.prefill's guess, for all k, one-hot q; None: zeros, for a one-token prompt)."""
        if not reqs:
            return
        live = {r.row for r in self.scheduler.running + self.scheduler.waiting + reqs}
        free = (row for row in range(1, len(self.state.start)) if row not in live)
        for r in reqs:
            r.row = next(free)
        s, ids = self.state, to_device(torch.tensor([r.row for r in reqs]), self.device)
        host = to_device(torch.tensor([[r.tokens[-1], r.num_cached, r.seed] for r in reqs]), self.device)
        s.tokens[ids, 0], s.start[ids], s.seeds[ids] = host.unbind(1)
        how = to_device(torch.tensor([[r.temperature, r.top_p] for r in reqs]), self.device)
        s.temperature[ids], s.top_p[ids] = how.unbind(1)
        if self.num_draft:
            drafts = torch.zeros_like(s.tokens[ids, :1]) if drafts is None else drafts  # [B, 1 or k]
            s.tokens[ids, 1:] = drafts
            s.q[ids] = F.one_hot(drafts, self.cfg.vocab_size).to(s.q.dtype)

    def apply(self, reqs, fetch, logits):
        """Apply a launched round to its requests: each emits its accepted tokens. fetch() waits for the
        round's one read-back (ops.read_back), rows [e_0 .. e_k, count] (the emitted tokens, then how many are
        real); rows past len(reqs) are a graph's padding, dropped by the zip."""
        for b, (r, row) in enumerate(zip(reqs, fetch(), strict=False)):
            if r.finish is not None:  # it finished the round before (this round was in flight)
                continue
            new = row[: row[-1]]
            if self.num_draft:
                r.accept_lengths.append(len(new))
            r.num_cached += len(new)  # x_L and the accepted drafts now have KV
            r.emit(new, logits[b], self.cfg.eos_token_id)

    def make_requests(self, prompts, max_new_tokens, temperature, top_p, seed, thinking, raw):
        """One Request per prompt, refused (checks.check_prompt) if empty, out of the vocabulary or too long.
        Seeds: a list as given, else s + i for prompt i (seed None: a fresh s, the same on all ranks)."""
        if temperature > 0:
            temperature = max(temperature, 1e-5)  # as the reference: no overflow in logits / T
        top_p = max(top_p, 1e-30)  # (above 0 in fp32: the nucleus always holds the most likely token)
        if seed is None:
            fresh = torch.tensor([int.from_bytes(os.urandom(6), "little")], device=self.device)
            seed = int(all_reduce(fresh, dist.ReduceOp.MAX))
        seeds = seed if isinstance(seed, (list, tuple)) else [int(seed) + i for i in range(len(prompts))]
        budgets = checks.per_prompt("max_new_tokens", max_new_tokens, len(prompts))
        room = (self.cfg.vocab_size, self.max_context, self.pool.free_slots, round_lookahead(self.num_draft))
        reqs = []
        for i, prompt in enumerate(prompts):
            ids = self.encode(prompt, thinking, raw)
            checks.check_prompt(i, ids, budgets[i], *room)
            seed = int(seeds[i]) % 2**63  # (in [0, 2^63); int: a numpy integer would overflow)
            reqs.append(Request(i, list(ids), len(ids), budgets[i], temperature, top_p, seed))
        return reqs

    def encode(self, prompt, thinking=False, raw=False):
        if not isinstance(prompt, str):
            return [int(t) for t in prompt]
        text = BOS + prompt if raw else encode_chat([{"role": "user", "content": prompt}], thinking)
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def result(self, r, return_logits):
        logits = None
        if return_logits:
            logits = torch.stack(r.logits) if r.logits else torch.zeros(0, self.cfg.vocab_size)
        return Result(r.generated, self.tokenizer.decode(r.generated), r.accept_lengths, logits, r.finish)

    def summary(self, reqs, seconds, rounds):
        """LLM.stats: speed, rounds, preemptions, MTP acceptance, DSA's top-k and the longest context."""
        tokens = sum(len(r.generated) for r in reqs)
        accepts = [a for r in reqs for a in r.accept_lengths]  # tokens each round of each request emitted
        stats = dict(tokens=tokens, seconds=seconds, tokens_per_s=tokens / seconds, decode_rounds=rounds)
        stats.update(preemptions=self.scheduler.preemptions, index_topk=self.cfg.index_topk)
        stats["longest_context"] = max((len(r.tokens) for r in reqs), default=0)
        stats["mean_accept_length"] = sum(accepts) / len(accepts) if accepts else None
        stats["accept_histogram"] = {n: accepts.count(n) for n in range(1, self.num_draft + 2) if accepts}
        return stats

    # ---- The host one round ahead (skip on a first read) ----
    # decode applies each round one step late: it launches round n+1, then applies round n (waits for its
    # tokens, emits them) while the GPU runs n+1, so the host's work hides behind the GPU's. Why it is safe:
    # - n+1 needs no host input from n: it starts from the rows of `state` that n wrote on the device.
    # - Its pages: schedule reserves them while the host's num_cached is a round stale, so it reserves more
    #   (round_lookahead covers the writes of n and n+1 from the stale position).
    # - A request that n finished still runs in n+1; retire frees its pages and row at once. n+1 writes only
    #   into them, and the GPU runs in launch order, so a next owner's writes land after n+1's.
    # - Its tokens from n+1 are dropped by apply (r.finish is set); settle_near_end avoids such wasted rounds.
    def run_ahead(self, reqs, fetch, logits):
        """Keep the round just launched in flight, and apply the one before it (none after a settle)."""
        previous, self.launched = self.launched, (reqs, fetch, logits)
        if previous:
            self.apply(*previous)

    def settle_near_end(self, reqs):
        """Near the end, when the round in flight may finish every request of `reqs`, apply it first (a round
        launched after it could be wasted work that generate waits for) -> the requests still unfinished."""
        if all(len(r.generated) + self.num_draft + 1 >= r.max_new_tokens for r in reqs):
            self.settle()
        return [r for r in reqs if r.finish is None]

    def settle(self):
        """Apply the round in flight, if any (LLM.apply)."""
        if self.launched is not None:
            self.apply(*self.launched)
            self.launched = None


@cli.exit_code  # (main's exit codes: 0, 1 for a bad input or too little memory, 130 for Ctrl-C)
def main(argv=None):
    """`python nano_nsa.py --prompt "..."` (the options: cli.py): generates, streaming a single prompt's text,
    then prints a line of speed and acceptance. A bad input is one line and exit code 1, never a traceback."""
    args = cli.parse(argv)
    prompts = cli.read_prompts(args)
    llm = LLM(args.model, **cli.engine_options(args))
    recorder = explain.attach(llm) if args.explain else None  # --explain: record the engine's steps
    stream = cli.TextStream(llm.tokenizer) if cli.streams(args, prompts) and tp_rank() == 0 else None
    results = llm.generate(prompts, on_tokens=stream, **cli.generate_options(args))
    if tp_rank() == 0:  # torchrun: every rank computed the same tokens (asked before leaving the group)
        cli.print_results(args, prompts, results, llm.stats, stream)
        if recorder:  # ... and narrate them
            print(recorder.narrate(results[0]))
    cli.end_distributed(llm.graphs is not None)


if __name__ == "__main__":
    raise SystemExit(main())
