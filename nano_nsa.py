"""nano-nsa: DeepSeek-V3.2 inference in one readable file.

Read it top to bottom. Part 1 is the model: Config -> the checkpoint format -> building blocks (FP8 linear,
norms, YaRN RoPE, Hadamard) -> forward metadata -> the lightning indexer -> MLA -> MoE -> Block, MTP layer,
Transformer, KV cache -> the kernel boundary -> tensor parallelism -> the loader. It computes what DeepSeek's
official `inference/model.py` computes (../shared/docs/dsv32_spec.md is the specification); where it
deliberately differs, a comment says why. Part 2 is the engine: tokenizer and chat encoding -> sampling and
speculative acceptance -> requests -> the KV page pool -> the scheduler -> the runner (the prefill step and
the speculative round: verify, accept, draft-extend, draft) -> CUDA graphs -> `LLM.generate` -> the CLI.

Dimension legend used in shape comments:
  T tokens (rows) in the forward pass   B requests in the batch   N context positions of a request
  H attention heads   D qk_nope_head_dim (128)   R qk_rope_head_dim (64)   V v_head_dim (128)
  C kv_lora_rank (512)   I indexer heads (64)   J index_head_dim (128)   K index_topk (2048)
  E routed experts   A activated experts per token   S slots in the KV pool   k draft tokens per round
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import re
import sys
import time
from dataclasses import dataclass, field, fields, replace
from itertools import accumulate
from numbers import Integral, Real
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

BLOCK = 128  # FP8 block size: 128x128 weight blocks, 1x128 activation groups
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
BF16 = torch.bfloat16


# ---- Errors: every fault in a user value or a model file is one ValueError line (CLI: printed, exit 1) ---
def require(ok, message):
    if not ok:
        raise ValueError(message)


def is_number(value, integer=False):
    """A finite number (not nan, inf, or beyond the float range), never a bool."""
    kind = Integral if integer else Real
    return isinstance(value, kind) and not isinstance(value, bool) and abs(value) <= sys.float_info.max


def check_arg(name, value, kind, low=None, high=None, open_low=False):
    """A `kind` value (int, float: finite, or bool) in [low, high] ((low, high] if open_low), else a
    ValueError."""
    what = {int: "an integer", float: "a finite number", bool: "True or False"}[kind]
    if kind is bool:
        ok = isinstance(value, bool)
    else:
        ok = is_number(value, integer=kind is int)
    require(ok, f"{name} must be {what} (got {value!r:.80})")
    too_low = low is not None and (value < low or (open_low and value == low))
    too_high = high is not None and value > high
    if too_low or too_high:
        bracket = "(" if open_low else "["
        if high is None:
            rule = f"{'>' if open_low else '>='} {low}"
        else:
            rule = f"in {bracket}{low}, {high}]"
        raise ValueError(f"{name} must be {rule} (got {value!r})")


def read_json(path):
    """A JSON object from a file, or a one-line ValueError naming the file."""
    try:
        with open(path, encoding="utf-8") as f:
            obj = json.load(f)
    except OSError as e:
        raise ValueError(f"{path}: cannot read ({e})") from None
    except ValueError as e:  # bad JSON or not UTF-8
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    require(isinstance(obj, dict), f"{path}: expected a JSON object, not {type(obj).__name__}")
    return obj


# ---- Config: every field the model uses --------------------------------------------------------------------
@dataclass
class Config:
    """The model's shape; field names follow DeepSeek's reference `ModelArgs` (config.json names in
    HF_NAMES)."""

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
        """The 671B shapes; n_layers < 61 gives the full-width, few-layer model used for GPU benchmarks."""
        return cls(n_layers=n_layers, n_dense_layers=min(3, max(1, n_layers - 1)))

    @classmethod
    def tiny(cls, **overrides):
        """A few layers (first one dense), 8 experts in 4 groups, small dims, index_topk=32: for CPU tests."""
        return cls(**(TINY | overrides))

    # -- reading an HF config.json: the names that differ, and the values DeepSeek-V3.2 fixes --
    HF_NAMES = dict(
        hidden_size="dim",
        intermediate_size="inter_dim",
        moe_intermediate_size="moe_inter_dim",
        num_hidden_layers="n_layers",
        first_k_dense_replace="n_dense_layers",
        num_nextn_predict_layers="n_mtp_layers",
        num_attention_heads="n_heads",
        num_experts_per_tok="n_activated_experts",
        n_group="n_expert_groups",
        topk_group="n_limited_groups",
        routed_scaling_factor="route_scale",
        max_position_embeddings="max_seq_len",
        rms_norm_eps="eps",
    )
    ROPE_NAMES = dict(
        factor="rope_factor",
        original_max_position_embeddings="original_seq_len",
        beta_fast="beta_fast",
        beta_slow="beta_slow",
        mscale="mscale",
    )
    HF_FIXED = dict(
        scoring_func="sigmoid",
        topk_method="noaux_tc",
        hidden_act="silu",
        norm_topk_prob=True,
        tie_word_embeddings=False,
    )

    @classmethod
    def from_json(cls, path):
        """Build from an HF DeepSeek-V3.2 `config.json` (a file or the directory holding it)."""
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        require(os.path.isfile(path), f"no config.json at {path}")
        hf = read_json(path)
        cls.check_hf(path, hf)
        names = {f.name for f in fields(cls)}
        kw = {cls.HF_NAMES.get(k, k): v for k, v in hf.items() if cls.HF_NAMES.get(k, k) in names}
        rope = hf.get("rope_scaling") or {}
        kw.update({ours: rope[k] for k, ours in cls.ROPE_NAMES.items() if k in rope})
        try:
            return cls(**kw)
        except ValueError as e:
            raise ValueError(f"{path}: invalid DeepSeek-V3.2 config: {e}") from None

    # -- checks: refuse (one ValueError line) what the layers cannot run --
    LOW = dict(
        n_dense_layers=0, n_mtp_layers=0, bos_token_id=0, eos_token_id=0, rope_theta=1.0, mscale=-math.inf
    )

    def __post_init__(self):
        """Types and signs first (integers >= 1 and floats > 0 unless LOW says otherwise), then shapes."""
        for f in fields(self):
            kind = int if f.type in ("int", int) else float
            low = self.LOW.get(f.name, 1 if kind is int else 0)
            check_arg(self.label(f.name), getattr(self, f.name), kind, low, open_low=kind is float)
        for ok, why in self.shape_rules():
            require(ok, why)

    def shape_rules(self):
        group = self.n_routed_experts // self.n_expert_groups
        rules = [
            (self.n_dense_layers <= self.n_layers, "more dense layers than layers"),
            (self.n_routed_experts % self.n_expert_groups == 0, "experts must split evenly into groups"),
            (group >= 2, "group score is the sum of the top-2 experts"),
            (self.n_limited_groups <= self.n_expert_groups, "top-k larger than kept groups"),
            (self.n_activated_experts <= self.n_limited_groups * group, "top-k larger than kept groups"),
            (self.n_heads * self.v_head_dim % BLOCK == 0, "o_proj input must be a multiple of 128"),
            (self.index_head_dim == BLOCK, "indexer heads are one 128-wide FP8 group each (Hadamard 128)"),
            (
                self.qk_rope_head_dim % 2 == 0 and self.qk_rope_head_dim <= self.index_head_dim,
                "qk_rope_head_dim must be even and at most index_head_dim",
            ),
            (self.max_seq_len > self.original_seq_len, "max_seq_len must exceed original_seq_len"),
            (max(self.bos_token_id, self.eos_token_id) < self.vocab_size, "bos/eos_token_id >= vocab_size"),
        ]
        for name in ("dim", "q_lora_rank", "kv_lora_rank", "inter_dim", "moe_inter_dim"):
            why = f"{self.label(name)} must be a multiple of {BLOCK} (FP8 activation groups)"
            rules.append((getattr(self, name) % BLOCK == 0, why))
        return rules

    @classmethod
    def check_hf(cls, path, hf):
        """The config.json values this engine does not read but DeepSeek-V3.2 fixes."""
        arch = hf.get("architectures")
        is_v32 = hf.get("model_type") == "deepseek_v32" or (
            isinstance(arch, list) and "DeepseekV32ForCausalLM" in arch
        )
        require(is_v32, f"{path} is not a DeepSeek-V3.2 config (model_type={hf.get('model_type')!r})")
        quant = hf.get("quantization_config", {})
        rope = hf.get("rope_scaling") or {}
        is_objects = isinstance(quant, dict) and isinstance(rope, dict)
        require(is_objects, f"{path}: quantization_config and rope_scaling must be JSON objects")
        for k, v in cls.HF_FIXED.items():
            require(
                k not in hf or hf[k] == v,
                f"{path}: {k}={hf.get(k)!r} is not supported (DeepSeek-V3.2 uses {v!r})",
            )
        fp8 = quant.get("quant_method") == "fp8" and quant.get("fmt", "e4m3") == "e4m3"
        blocks = quant.get("weight_block_size") == [BLOCK, BLOCK]
        require(
            fp8 and blocks, f"{path}: expected quantization_config fp8 e4m3 with weight_block_size [128, 128]"
        )
        scale_fmt = quant.get("scale_fmt", "ue8m0")  # activation scales are powers of two (ue8m0) here
        require(
            scale_fmt == "ue8m0",
            f"{path}: scale_fmt {scale_fmt!r} is not supported (DeepSeek-V3.2 uses 'ue8m0')",
        )
        rope_type = rope.get("type", rope.get("rope_type"))
        require(rope_type == "yarn", f"{path}: expected rope_scaling of type yarn")

    def check_tp(self, n):
        """Refuse a tensor-parallel size n (ranks) that would split a head, an expert or the vocabulary
        unevenly, or cut a 128x128 FP8 block across ranks: each rank's rows of q_b / kv_b / w1 / w3 and
        columns of o_proj / w2."""
        H = self.n_heads
        blocks = n * BLOCK
        rules = [
            ("n_heads", H, n),
            ("n_routed_experts", self.n_routed_experts, n),
            ("vocab_size", self.vocab_size, n),
            ("q_b_proj rows (n_heads * qk_head_dim)", H * self.qk_head_dim, blocks),
            (
                "kv_b_proj rows (n_heads * (qk_nope_head_dim + v_head_dim))",
                H * (self.qk_nope_head_dim + self.v_head_dim),
                blocks,
            ),
            ("o_proj columns (n_heads * v_head_dim)", H * self.v_head_dim, blocks),
            ("inter_dim", self.inter_dim if self.n_dense_layers else 0, blocks),
            (
                "shared expert width (moe_inter_dim * n_shared_experts)",
                self.moe_inter_dim * self.n_shared_experts,
                blocks,
            ),
        ]
        for what, value, divisor in rules:
            why = f"tensor parallel size {n}: {what} = {value} must be a multiple of {divisor}"
            if divisor > n:
                why += f" (whole {BLOCK}-wide FP8 blocks per rank)"
            require(value % divisor == 0, why)

    @classmethod
    def label(cls, name):
        """Our field name, and the config.json one where it differs."""
        hf = {ours: hf for hf, ours in cls.HF_NAMES.items()}
        hf |= {ours: f"rope_scaling.{k}" for k, ours in cls.ROPE_NAMES.items()}
        if hf.get(name, name) != name:
            return f"{name} ({hf[name]})"
        return name


TINY = dict(
    vocab_size=288,
    dim=256,
    inter_dim=512,
    moe_inter_dim=128,
    n_layers=3,
    n_dense_layers=1,
    n_heads=4,
    n_routed_experts=8,
    n_activated_experts=2,
    n_expert_groups=4,
    n_limited_groups=2,
    q_lora_rank=128,
    kv_lora_rank=256,
    qk_nope_head_dim=32,
    v_head_dim=32,
    index_n_heads=4,
    index_topk=32,
)


# ---- The checkpoint format: the official HF names, shapes and dtypes (spec section 2) ----------------------
# kinds: "fp8" = float8_e4m3fn weight + float32 `weight_scale_inv` per 128x128 block; "bf16" = plain bf16
# matrix; "norm" = norm weight (bf16, or fp32 in some conversions); "f32" = fp32 vector (router bias).
ALLOWED_DTYPES = {
    "fp8": (FP8,),
    "scale": (torch.float32,),
    "bf16": (BF16,),
    "norm": (BF16, torch.float32),
    "f32": (torch.float32,),
}


def checkpoint_tensors(cfg: Config):
    """{HF tensor name: (shape, kind)} for every tensor of the official checkpoint, scales included."""
    tensors = {"model.embed_tokens.weight": ([cfg.vocab_size, cfg.dim], "bf16")}
    for i in range(cfg.n_layers + cfg.n_mtp_layers):
        prefix = f"model.layers.{i}."
        if i >= cfg.n_layers:
            tensors |= mtp_tensors(cfg, prefix)
        tensors |= attention_tensors(cfg, prefix)
        tensors |= ffn_tensors(cfg, prefix, moe=i >= cfg.n_dense_layers)
    tensors["model.norm.weight"] = ([cfg.dim], "norm")
    tensors["lm_head.weight"] = ([cfg.vocab_size, cfg.dim], "bf16")
    for name, (shape, kind) in list(tensors.items()):
        if kind == "fp8":
            tensors[name + "_scale_inv"] = ([-(-shape[0] // BLOCK), -(-shape[1] // BLOCK)], "scale")
    return tensors


def attention_tensors(cfg: Config, prefix):
    """A layer's norms, MLA projections and lightning indexer."""
    H, dim = cfg.n_heads, cfg.dim
    Q, C, R = cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    index_q = cfg.index_n_heads * cfg.index_head_dim
    a = prefix + "self_attn."
    return {
        prefix + "input_layernorm.weight": ([dim], "norm"),
        a + "q_a_proj.weight": ([Q, dim], "fp8"),
        a + "q_a_layernorm.weight": ([Q], "norm"),
        a + "q_b_proj.weight": ([H * cfg.qk_head_dim, Q], "fp8"),
        a + "kv_a_proj_with_mqa.weight": ([C + R, dim], "fp8"),
        a + "kv_a_layernorm.weight": ([C], "norm"),
        a + "kv_b_proj.weight": ([H * (cfg.qk_nope_head_dim + cfg.v_head_dim), C], "fp8"),
        a + "o_proj.weight": ([dim, H * cfg.v_head_dim], "fp8"),
        a + "indexer.wq_b.weight": ([index_q, Q], "fp8"),
        a + "indexer.wk.weight": ([cfg.index_head_dim, dim], "fp8"),
        a + "indexer.k_norm.weight": ([cfg.index_head_dim], "norm"),
        a + "indexer.k_norm.bias": ([cfg.index_head_dim], "norm"),
        a + "indexer.weights_proj.weight": ([cfg.index_n_heads, dim], "bf16"),
        prefix + "post_attention_layernorm.weight": ([dim], "norm"),
    }


def ffn_tensors(cfg: Config, prefix, moe):
    """A dense SwiGLU MLP, or a MoE: router, routed experts, shared expert."""
    tensors = {}
    mlps = {"mlp.": cfg.inter_dim}
    if moe:
        tensors[prefix + "mlp.gate.weight"] = ([cfg.n_routed_experts, cfg.dim], "bf16")
        tensors[prefix + "mlp.gate.e_score_correction_bias"] = ([cfg.n_routed_experts], "f32")
        mlps = {f"mlp.experts.{e}.": cfg.moe_inter_dim for e in range(cfg.n_routed_experts)}
        mlps["mlp.shared_experts."] = cfg.moe_inter_dim * cfg.n_shared_experts
    for mlp, inter in mlps.items():
        tensors[prefix + mlp + "gate_proj.weight"] = ([inter, cfg.dim], "fp8")
        tensors[prefix + mlp + "up_proj.weight"] = ([inter, cfg.dim], "fp8")
        tensors[prefix + mlp + "down_proj.weight"] = ([cfg.dim, inter], "fp8")
    return tensors


def mtp_tensors(cfg: Config, prefix):
    """The MTP layer's own tensors outside its decoder block (spec 2.3): embedding and head copies, norms,
    eh_proj."""
    return {
        prefix + "embed_tokens.weight": ([cfg.vocab_size, cfg.dim], "bf16"),
        prefix + "enorm.weight": ([cfg.dim], "norm"),
        prefix + "hnorm.weight": ([cfg.dim], "norm"),
        prefix + "eh_proj.weight": ([cfg.dim, 2 * cfg.dim], "bf16"),
        prefix + "shared_head.norm.weight": ([cfg.dim], "norm"),
        prefix + "shared_head.head.weight": ([cfg.vocab_size, cfg.dim], "bf16"),
    }


# HF name -> our module name, in one place (the reference's convert.py mapping, plus the MTP layer)
HF_TO_OURS = {
    "embed_tokens": "embed",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "q_a_proj": "wq_a",
    "q_a_layernorm": "q_norm",
    "q_b_proj": "wq_b",
    "kv_a_proj_with_mqa": "wkv_a",
    "kv_a_layernorm": "kv_norm",
    "kv_b_proj": "wkv_b",
    "o_proj": "wo",
    "gate_proj": "w1",
    "down_proj": "w2",
    "up_proj": "w3",
    "lm_head": "head",
    "self_attn": "attn",
    "mlp": "ffn",
    "weight_scale_inv": "scale",
    "e_score_correction_bias": "bias",
}
MTP_OWN = {"embed_tokens", "enorm", "hnorm", "eh_proj", "shared_head"}  # MTP-layer names outside its block
EXPERT = re.compile(r"(.*\.experts)\.(\d+)\.(w[123])\.(weight|scale)$")  # a routed expert's: stacked
# Weights apart in the checkpoint that one product reads here, stacked by rows at load (load_target): every
# SwiGLU MLP's gate_proj | up_proj (w13), and MLA's q_a_proj | indexer.wk | kv_a_proj_with_mqa (wqkv_a: the
# three read the same x). Each part starts on a whole 128-row block (kv_a's 576 rows go last), so the block
# scales stack alike.
STACKED = re.compile(r"(.*)\.(w1|w3|wq_a|indexer\.wk|wkv_a)\.(weight|scale)$")


def stack_of(key):
    """(the stacked parameter, the part) for our name of a part of a stacked weight; else (key, None)."""
    match = STACKED.match(key)
    if match is None:
        return key, None
    prefix, part, kind = match.groups()
    stack = "w13" if part in ("w1", "w3") else "wqkv_a"
    return f"{prefix}.{stack}.{kind}", part


def stacked_rows(cfg: Config, part, stack_rows, unit):
    """The rows of a stacked parameter (stack_rows of them) that `part` fills: in weight rows (unit 1) or in
    block-scale rows (unit BLOCK)."""
    if part in ("w1", "w3"):  # two halves
        half = stack_rows // 2
        return slice(half if part == "w3" else 0, half if part == "w1" else stack_rows)
    Q, J = cfg.q_lora_rank, cfg.index_head_dim
    end = Q + J + cfg.kv_lora_rank + cfg.qk_rope_head_dim
    first, last = {"wq_a": (0, Q), "indexer.wk": (Q, Q + J), "wkv_a": (Q + J, end)}[part]
    return slice(first // unit, -(-last // unit))


def ours_name(cfg: Config, hf_name: str) -> str:
    parts = hf_name.removeprefix("model.").split(".")
    if parts[0] == "layers" and int(parts[1]) >= cfg.n_layers:  # MTP layer: its decoder block is `block`
        block = [] if parts[2] in MTP_OWN else ["block"]
        parts = ["mtp", str(int(parts[1]) - cfg.n_layers)] + block + parts[2:]
    return ".".join(HF_TO_OURS.get(p, p) for p in parts)


# ---- Building blocks: FP8 activation quantization and linear, norms, YaRN RoPE, Hadamard, stable top-k -----
# Two names are used in this part before their own sections, and are all a layer needs to know of them:
#   self.ops   the kernel set every layer calls its heavy math through ("The kernel boundary" below): torch
#              references written here, or kernels.py's GPU versions of the same names, bound once at load;
#   tp_size(), tp_rank(), all_reduce()   tensor parallelism ("Tensor parallelism" below): 1, 0 and nothing at
#              one rank; under torchrun a layer holds its rank's share of the weights and sums the parts.
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
    """Block scales [..., ceil(out/128), ceil(in/128)] -> one scale per weight element [..., out, in] (edge
    blocks cut)."""
    rows = scale.repeat_interleave(BLOCK, -2)[..., : shape[-2], :]
    return rows.repeat_interleave(BLOCK, -1)[..., : shape[-1]]


def weight_dequant(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """W[r, c] = fp8 W8[r, c] * scale_inv[r // 128, c // 128], in fp32 (exact: fp8 has a 4-bit
    significand)."""
    return w.float() * per_element(scale, w.shape)


def acc_dtype(x: torch.Tensor):
    """Accumulation dtype of matmuls: fp32 as the reference on GPU. On CPU fp64, the exact limit of any
    fp32 summation order: results then do not depend on batch shape, so engine modes can be compared token
    for token."""
    if x.device.type == "cpu":
        return torch.float64
    return torch.float32


# The references dequantize a model's FP8 weights once, at load, when the copies (8 bytes a weight on the CPU)
# take at most this much; a bigger model dequantizes each weight at each call (same values: FP8 times a power
# of two is exact in fp32 and fp64). On the demo model per-call dequantizing was ~65% of the CPU's time. Its
# plain weights (the heads, fp32) are then widened to fp64 once too, not at each call (~5% of a CPU round).
DEQUANTIZE_AT_LOAD_BYTES = 2 << 30


def fp8_linear(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, partial=False) -> torch.Tensor:
    """y = act_quant(x) @ W^T for a block-scaled FP8 weight, bf16 out (partial: the unrounded accumulator,
    rounded after the all-reduce). Pow2 scales keep both operands exact: it equals the reference `fp8_gemm`
    up to sum order. act_quant is never skipped: it rounds x to a 3-bit mantissa, as the reference does.
    scale None: w was dequantized at load (DEQUANTIZE_AT_LOAD_BYTES)."""
    acc = acc_dtype(x)
    if scale is not None:
        w = weight_dequant(w, scale)
    y = F.linear(act_dequant(*act_quant(x)).to(acc), w.to(acc))
    if partial:
        return y
    return y.to(BF16)


def swiglu(h):
    """SwiGLU's activation silu(gate) * up of h = [gate | up] [..., 2I]: fp32, rounded to bf16 (as the
    reference's silu(w1 x) * w3 x)."""
    inter = h.shape[-1] // 2
    return (F.silu(h[..., :inter].float()) * h[..., inter:].float()).to(BF16)


def swiglu_linear(h, w, scale, partial=False):
    """SwiGLU's down projection: fp8_linear of swiglu(h)."""
    return fp8_linear(swiglu(h), w, scale, partial)


def dense_linear(x, w):
    """x W^T for a plain (bf16 / fp32) weight, fp32 out; callers round if needed."""
    acc = acc_dtype(x)
    return F.linear(x.to(acc), w.to(acc)).float()


def param(*shape, dtype):
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)  # inference only: no grads


class Linear(nn.Module):
    """x W^T. fp8=True: float8_e4m3fn weight + float32 `scale` per 128x128 block; else a plain `dtype`
    weight. n: a stack of n weights [n, out, in] (the routed experts, read by the MoE kernel). split: 'col'
    this rank holds out / ranks rows, 'row' in / ranks columns (the output is a partial sum the caller
    all-reduces), None all of it."""

    ops = None  # bound once by Transformer.bind (fp8_linear / dense_linear)
    dequantized = None  # the weight dequantized (FP8) or widened (plain) at bind, for the references

    def __init__(self, in_features, out_features, fp8=True, dtype=BF16, n=None, split=None):
        super().__init__()
        self.fp8 = fp8
        self.split = split
        self.partial = split == "row"  # output unrounded: rounded after the all-reduce
        if split == "col":
            out_features //= tp_size()
        if split == "row":
            in_features //= tp_size()
        stack = [n] if n else []
        self.weight = param(*stack, out_features, in_features, dtype=FP8 if fp8 else dtype)
        self.scale = None
        if fp8:
            self.scale = param(
                *stack, -(-out_features // BLOCK), -(-in_features // BLOCK), dtype=torch.float32
            )

    def forward(self, x):
        weight, scale = self.operands()
        if not self.fp8:
            return self.ops.dense_linear(x, weight)
        return self.ops.fp8_linear(x, weight, scale, self.partial)

    def operands(self):
        """(weight, scale) as the ops read them: the weight as loaded and its block scales (None for a plain
        weight), or the copy the references dequantized or widened at load and None."""
        if self.dequantized is not None:
            return self.dequantized, None
        return self.weight, self.scale


def rms_norm(x, residual, weight, eps):
    """RMSNorm in fp32 with an fp32 weight, bf16 out, of x rounded to bf16 first (a block's half arrives as
    its fp32 sum: rounded here, once, as the reference's layers return bf16). With `residual`: adds it first
    (fp32), and also returns the new residual stream rounded to bf16, as the reference's fused form. (The
    kernel's reference: torch splits a row's mean over more threads when there are fewer rows, so its bits
    depend on the batch.)"""
    x = x.to(BF16).float()
    if residual is not None:
        x = x + residual.float()
    y = (weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))).to(BF16)
    if residual is None:
        return y
    return y, x.to(BF16)


class RMSNorm(nn.Module):
    ops = None  # bound once by Transformer.bind (rms_norm)

    def __init__(self, dim, eps):
        super().__init__()
        self.eps = eps
        self.weight = param(dim, dtype=torch.float32)

    def forward(self, x, residual=None):
        return self.ops.rms_norm(x, residual, self.weight, self.eps)


class Embedding(nn.Module):
    """Vocabulary-parallel: a rank holds vocab / ranks rows; tokens outside them add zeros to the
    all-reduce."""

    def __init__(self, vocab, dim):
        super().__init__()
        self.weight = param(vocab // tp_size(), dim, dtype=BF16)

    def forward(self, tokens):
        if tp_size() == 1:  # (one lookup: the masking below costs five kernels per pass)
            return F.embedding(tokens, self.weight)
        rows = self.weight.shape[0]
        local = tokens - tp_rank() * rows
        mine = (local >= 0) & (local < rows)
        return all_reduce(F.embedding(local.clamp(0, rows - 1), self.weight) * mine[..., None])


_FREQS = {}  # f'_i on each device, by the config fields they depend on


def yarn_frequencies(cfg: Config):
    """f'_i, the YaRN-corrected inverse frequencies (spec 3.5): low dims unchanged, high dims / rope_factor, a
    linear ramp between the dims that turn beta_fast and beta_slow times over original_seq_len."""
    d, base = cfg.qk_rope_head_dim, cfg.rope_theta
    freqs = 1.0 / (base ** (torch.arange(0, d, 2, dtype=torch.float32) / d))

    def dim_of(turns):  # the dim whose frequency turns `turns` times over the original context
        return d * math.log(cfg.original_seq_len / (turns * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(dim_of(cfg.beta_fast)), 0)
    high = min(math.ceil(dim_of(cfg.beta_slow)), d - 1)
    width = high - low if high > low else 0.001
    ramp = ((torch.arange(d // 2, dtype=torch.float32) - low) / width).clamp(0, 1)
    return freqs / cfg.rope_factor * ramp + freqs * (1 - ramp)


def rope_cos_sin(cfg: Config, positions: torch.Tensor):
    """cos/sin of theta[t, i] = fp32(t) * f'_i, each [T, R/2] fp32. (YaRN's mscale goes into the softmax
    scale.)"""
    key = (cfg.qk_rope_head_dim, cfg.rope_theta, cfg.rope_factor, cfg.original_seq_len, cfg.max_seq_len)
    key += (cfg.beta_fast, cfg.beta_slow, positions.device)
    if key not in _FREQS:  # once per device: a CUDA graph cannot copy from the host
        _FREQS[key] = yarn_frequencies(cfg).to(positions.device)
    theta = positions.float()[:, None] * _FREQS[key][None, :]
    return theta.cos(), theta.sin()


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """Rotate x [T, ..., R] by position. interleaved (MLA): pairs (x[2i], x[2i+1]); half-split (indexer):
    pairs (x[i], x[i + R/2]). fp32 math, bf16 out."""
    if interleaved:
        x1, x2 = x[..., 0::2].float(), x[..., 1::2].float()
    else:
        x1, x2 = x.float().chunk(2, dim=-1)
    shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[1],)  # broadcast over heads
    cos, sin = cos.view(shape), sin.view(shape)
    o1 = x1 * cos - x2 * sin
    o2 = x1 * sin + x2 * cos
    if interleaved:
        return torch.stack((o1, o2), -1).flatten(-2).to(BF16)
    return torch.cat((o1, o2), -1).to(BF16)


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
    """Indices of the k largest values along the last dim, ties to the lowest index, whatever the batch
    (torch.topk breaks ties in an order that may change with the batch shape)."""
    return x.sort(dim=-1, descending=True, stable=True).indices[..., :k]


def side_by_side(first, second):
    """(first(), second()) for two independent parts of a layer, which meet only after both are done (MLA's
    queries and the indexer, and inside the indexer its head weights and its queries; the shared and the
    routed experts). The reference runs them one after the other; the GPU runs second(), the longer chain, on
    a second stream of higher priority while first() runs, so that one part's short, latency-bound kernels
    fill the SMs that the other leaves idle (SGLang overlaps the first and the last pair alike). The same
    kernels on the same inputs: the same bits either way."""
    return first(), second()


# ---- Forward metadata: one Meta per forward pass, shared by every layer; the per-layer cache view ----------
def to_device(x: torch.Tensor, device) -> torch.Tensor:
    """Host -> device without waiting: a copy from pageable memory blocks the host until the GPU reaches
    it, so the engine could never run ahead of the GPU. (torch reuses a pinned block only once its copy has
    run.)"""
    if torch.device(device).type == "cuda":
        return x.pin_memory().to(device, non_blocking=True)
    return x.to(device)


@dataclass
class Meta:
    """Everything a forward pass needs to know about its batch, built once per step, shared by every layer.
    mode 'prefill': rows are chunks of prompts; 'decode' / 'verify': each row is its own query (1 or k+1
    per request)."""

    mode: str
    positions: torch.Tensor  # [T] absolute position of each row's token
    slots: torch.Tensor  # [T] KV-pool slot the row's token is written to
    row_req: torch.Tensor  # [T] request (row of `table`) each row belongs to
    table: torch.Tensor  # [B, N] KV-pool slot of every context position of each request (page size 1)
    ctx_lens: torch.Tensor  # [T] causal length of each row = position + 1
    cu_seqlens: list  # [B + 1] host: row offsets of each request
    ctx_host: torch.Tensor  # [T] ctx_lens on the host (prefill chunks slice their context by it)
    max_ctx: int  # the longest row context (host); under a CUDA graph, the bound it was captured for

    @classmethod
    def build(cls, mode, starts, lens, table):
        """Request b has rows for positions starts[b] .. starts[b] + lens[b] - 1."""
        positions = [s + i for s, n in zip(starts, lens, strict=True) for i in range(n)]
        row_req = [b for b, n in enumerate(lens) for _ in range(n)]
        pos, row_req = to_device(torch.tensor([positions, row_req]), table.device)  # one copy
        return cls(
            mode,
            positions=pos,
            slots=table[row_req, pos],
            row_req=row_req,
            table=table,
            ctx_lens=pos + 1,
            cu_seqlens=list(accumulate(lens, initial=0)),
            ctx_host=torch.tensor(positions) + 1,
            max_ctx=max(positions) + 1,
        )

    def step(self, shift):
        """The same rows `shift` positions later: the draft steps of a round shift one Meta, not rebuild
        it."""
        pos = self.positions + shift
        return replace(
            self,
            positions=pos,
            slots=self.table[self.row_req, pos],
            ctx_lens=self.ctx_lens + shift,
            ctx_host=self.ctx_host + shift,
            max_ctx=self.max_ctx + shift,
        )

    def dense(self, index_topk):
        """Prompt chunks whose whole context fits in top-k: DSA selects every position, so attention is
        plain causal attention (per-head form). Every other row, prefill rows included, runs the sparse
        absorbed form."""
        return self.mode == "prefill" and self.max_ctx <= index_topk

    def request_rows(self):
        """The row slice of each request."""
        return [slice(a, b) for a, b in zip(self.cu_seqlens[:-1], self.cu_seqlens[1:], strict=True)]


@dataclass
class LayerCache:
    latent: torch.Tensor  # [S, C + R] bf16  one row per slot: normalized latent (FP8-rounded) | rope key
    ik: torch.Tensor  # [S, J] fp8   indexer key
    iks: torch.Tensor  # [S]    fp32  indexer key scale
    C: int  # kv_lora_rank

    @property
    def kv(self):  # [S, C] a view: kernels read `latent` whole or split
        return self.latent[:, : self.C]

    @property
    def pe(self):  # [S, R]
        return self.latent[:, self.C :]


# ---- Lightning indexer (DSA): picks the top-K context positions for every query row (spec 3.7) -------------
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


def index_scores(q8, head_weights, k8, ks):
    """I[t, n] = ks[n] * sum_h w[t, h] * relu(q8[t, h] . k8[n]), fp32 (the reference `fp8_index`). q8 [T,
    I, J] fp8; head_weights w [T, I] fp32 (the q scale folded in: head_weights); k8 [T or 1, N, J]; ks [T or
    1, N]."""
    acc = acc_dtype(q8)
    logits = torch.matmul(q8.to(acc), k8.to(acc).transpose(-1, -2))  # [T, I, N] fp8 products, exact sums
    return ((logits.relu() * head_weights[..., None]).sum(1) * ks).float()  # [T, N] fp32


def topk_positions(scores, ctx_lens, topk):
    """Top-min(topk, N) positions of each row among its causal context (n < ctx_lens[t]); -1 pads short
    rows."""
    n = torch.arange(scores.shape[-1], device=scores.device)
    scores = scores.masked_fill(n[None, :] >= ctx_lens[:, None], float("-inf"))  # causal mask before top-k
    # Ties (exact zeros from the ReLU are common) go to the earliest position, whatever the batch shape: the
    # reference's torch.topk breaks them in an implementation-defined order.
    idx = top_indices(scores, min(topk, scores.shape[-1]))
    return torch.where(idx < ctx_lens[:, None], idx, -1)


def head_weights(weights, scale, qs):
    """Each query head's weight in the indexer's score: weights_proj's output [T, I] times the constant
    `scale` and the head's FP8 query scale qs [T, I, 1] -> [T, I]."""
    return weights * scale * qs[..., 0]


def index_topk(q8, qs, weights, scale, cache: LayerCache, meta: Meta, topk):
    """Reference of the lightning-indexer kernel: score each row's causal context against the cached FP8 keys
    (q8 [T, I, J] with its scales qs, the heads weighted by head_weights(weights, scale, qs)) and keep its
    top-min(topk, N) positions [T, min(topk, N)] (-1 = none; N = the longest row context). The rows of one
    request (a prompt chunk, a verify row and its drafts) share its keys: gathered once."""
    w = head_weights(weights, scale, qs)
    out = []
    width = min(topk, meta.max_ctx)
    for b, rows in enumerate(meta.request_rows()):
        ctx = meta.table[b, : int(meta.ctx_host[rows].max())]  # [N] slots
        scores = index_scores(q8[rows], w[rows], cache.ik[ctx][None], cache.iks[ctx][None])
        selected = topk_positions(scores, meta.ctx_lens[rows], topk)
        out.append(F.pad(selected, (0, width - selected.shape[1]), value=-1))
    return torch.cat(out)


class Indexer(nn.Module):
    ops = None  # the kernel set (TORCH_OPS or kernels.GPU_OPS), bound once by Transformer.bind

    def __init__(self, cfg: Config):
        super().__init__()
        self.cfg = cfg
        self.wq_b = Linear(cfg.q_lora_rank, cfg.index_n_heads * cfg.index_head_dim)
        # the key projection wk is part of MLA's wqkv_a (it reads the same x)
        self.k_norm = nn.LayerNorm(cfg.index_head_dim, cfg.eps).requires_grad_(False)  # fp32 weight and bias
        self.weights_proj = Linear(cfg.dim, cfg.index_n_heads, fp8=False, dtype=torch.float32)

    def forward(self, x, qr, k, cos, sin, meta: Meta, cache: LayerCache):
        """x [T, dim], qr [T, q_lora] (MLA's normed query latent), k [T, J] (x's key projection, wk) -> [T,
        min(K, N)] selected context positions per row (-1 = none), or None for a dense prompt chunk. Writes
        this pass's keys first, so every row can select its own token."""
        cfg = self.cfg
        norm = self.k_norm
        self.ops.store_index_key(k, norm.weight, norm.bias, norm.eps, cos, sin, cache, meta.slots)
        if meta.dense(cfg.index_topk):  # the whole context is selected: only the keys are needed
            return None
        if meta.max_ctx <= cfg.index_topk:  # every row selects its whole context (SGLang skips too)
            n = torch.arange(meta.max_ctx, device=x.device)
            return torch.where(n < meta.ctx_lens[:, None], n, -1)
        # the heads' weights, from x, beside the queries' longer chain, from qr
        weights, (q8, qs) = self.ops.side_by_side(
            lambda: self.weights_proj(x),
            lambda: self.queries(qr, cos, sin),
        )
        scale = cfg.index_n_heads**-0.5 * cfg.index_head_dim**-0.5  # (applied by index_topk: head_weights)
        return self.ops.index_topk(q8, qs, weights, scale, cache, meta, cfg.index_topk)

    def queries(self, qr, cos, sin):
        """The indexer's query heads from MLA's normed query latent qr [T, q_lora] -> (q8 [T, I, J] fp8, their
        scales [T, I, 1])."""
        q = self.wq_b(qr).view(qr.shape[0], self.cfg.index_n_heads, self.cfg.index_head_dim)
        return self.ops.index_quant(q, cos, sin)


# ---- MLA: multi-head latent attention over the indexer's selection (spec 3.6, 3.8) -------------------------
# The sparse MLA reference runs its rows in blocks whose gathered latents (rows x K x (C + R), fp64 on CPU)
# take at most about this much, so that a block stays in the CPU's cache: on the demo's prefill (blocks of 14
# rows) 3.5x faster than one gather of every row. Each row is computed alone either way: the same bits.
SPARSE_MLA_BLOCK_BYTES = 8 << 20


def sparse_mla(q_abs, q_pe, cache: LayerCache, selected, meta: Meta, scale):
    """Absorbed ("MQA") sparse attention, one query row per token: the reference of the sparse MLA decode
    kernel. q_abs [T, H, C] (q_nope already multiplied into the latent space), q_pe [T, H, R]; selected [T,
    K] each row's selected context positions (-1 = none; the valid ones first) -> o_lat [T, H, C] fp32."""
    slots = meta.table[meta.row_req[:, None], selected.clamp(min=0)]
    slots = torch.where(selected >= 0, slots, -1)  # [T, K] KV-pool slots
    acc = acc_dtype(q_abs)
    block = max(1, SPARSE_MLA_BLOCK_BYTES // (slots.shape[1] * cache.latent.shape[1] * 8))
    out = []
    for first in range(0, len(slots), block):
        rows = slice(first, first + block)
        kv = cache.kv[slots[rows].clamp(min=0)].to(acc)  # [t, K, C]
        pe = cache.pe[slots[rows].clamp(min=0)].to(acc)  # [t, K, R]
        scores = q_abs[rows].to(acc) @ kv.transpose(1, 2) + q_pe[rows].to(acc) @ pe.transpose(1, 2)
        scores = (scores * scale).masked_fill(~(slots[rows] >= 0)[:, None, :], float("-inf"))  # [t, H, K]
        out.append((scores.softmax(-1) @ kv).float())  # [t, H, C]
    return torch.cat(out)


def dense_attention(q, k, v, scale):
    """Causal per-head attention of a prompt chunk (the reference of the dense prefill kernel): q [S, H, E]
    the last S of N positions, k [N, H, E], v [N, H, V] -> [S, H, V]; row i sees keys 0 .. N - S + i."""
    S, N = q.shape[0], k.shape[0]
    scores = torch.einsum("shd,nhd->hsn", q, k) * scale
    future = torch.arange(N, device=q.device) > torch.arange(S, device=q.device)[:, None] + (N - S)
    return torch.einsum("hsn,nhv->shv", scores.masked_fill(future, float("-inf")).softmax(-1), v)


def head_linear(x, w):
    """One linear map per head (MLA's absorbed W_UK and W_UV): x [T, H, K], w [H, N, K] -> [T, H, N] in w's
    dtype (the reference of the kernel's fixed-order GEMM)."""
    return torch.einsum("thk,hnk->thn", x.to(w.dtype), w)


def store_latent(kv, k_pe, norm_weight, eps, cos, sin, cache: LayerCache, slots):
    """MLA's cache write for this pass's tokens (the reference of its kernel): the latent kv [T, C]
    RMS-normalized (kv_norm) and rounded through FP8 as the official cache stores it (1x128 groups, kept as
    the exact bf16 values), and the rope key k_pe [T, R] rotated, into the cache rows `slots`."""
    latent = rms_norm(kv, None, norm_weight, eps)
    cache.kv[slots] = act_dequant(*act_quant(latent)).to(BF16)
    cache.pe[slots] = rope(k_pe, cos, sin, interleaved=True)


class MLA(nn.Module):
    ops = None  # bound once by Transformer.bind, as Indexer.ops
    # wkv_b dequantized once at bind (exact in bf16), split per head: fp32/fp64 (torch path), bf16 (kernels)
    w_uk = None  # [H, C, D] W_UK, transposed: q_nope -> latent space
    w_uv = None  # [H, V, C] W_UV: latent -> values

    def __init__(self, cfg: Config):
        super().__init__()
        self.cfg = cfg
        H = cfg.n_heads  # split over ranks: q_b / kv_b rows and o_proj columns of this rank's heads
        # q_a_proj | the indexer's wk | kv_a_proj_with_mqa: the three products of x as one (see STACKED)
        self.wqkv_a = Linear(
            cfg.dim, cfg.q_lora_rank + cfg.index_head_dim + cfg.kv_lora_rank + cfg.qk_rope_head_dim
        )
        self.q_norm = RMSNorm(cfg.q_lora_rank, cfg.eps)
        self.wq_b = Linear(cfg.q_lora_rank, H * cfg.qk_head_dim, split="col")
        self.kv_norm = RMSNorm(cfg.kv_lora_rank, cfg.eps)
        self.wkv_b = Linear(cfg.kv_lora_rank, H * (cfg.qk_nope_head_dim + cfg.v_head_dim), split="col")
        self.wo = Linear(H * cfg.v_head_dim, cfg.dim, split="row")
        self.indexer = Indexer(cfg)

    def forward(self, x, cos, sin, meta: Meta, cache: LayerCache):
        """-> this rank's heads' part of the output projection [T, dim], unrounded (Block sums it over
        ranks). Attention math runs in fp32 (fp64 on CPU, see acc_dtype) where the reference rounds
        intermediates to bf16: fused kernels keep fp32 too, and the per-head and absorbed forms become the
        same function."""
        cfg = self.cfg
        R, C = cfg.qk_rope_head_dim, cfg.kv_lora_rank
        q_a, k_index, kv_a = self.wqkv_a(x).split([cfg.q_lora_rank, cfg.index_head_dim, C + R], -1)
        qr = self.q_norm(q_a)  # [T, q_lora]; shared with the indexer
        kv, k_pe = kv_a.split([C, R], -1)  # [T, C], [T, R]
        sparse = not meta.dense(cfg.index_topk)  # prompt chunks within top-k attend densely, per head

        def latents_then_queries():  # attention reads this pass's latents from the cache after the join
            norm = self.kv_norm
            self.ops.store_latent(kv, k_pe, norm.weight, norm.eps, cos, sin, cache, meta.slots)
            return self.queries(qr, cos, sin, absorbed=sparse)

        # The queries beside the indexer's selection [T, K'] (context positions, -1 = none; None when dense)
        (q, q_pe), selected = self.ops.side_by_side(
            latents_then_queries,
            lambda: self.indexer(x, qr, k_index, cos, sin, meta, cache),
        )
        if sparse:  # sparse attention over the selected latents; W_UV maps the result back to values
            o_lat = self.ops.sparse_mla(q, q_pe, cache, selected, meta, cfg.softmax_scale)
            o = self.ops.head_linear(o_lat, self.w_uv)  # [T, H, V]
        else:
            o = self.attend_chunks(q, q_pe, meta, cache)
        return self.wo(o.to(BF16).flatten(1))

    def queries(self, qr, cos, sin, absorbed):
        """The query heads from the normed query latent qr [T, q_lora] -> (q_nope [T, H, D], q_pe [T, H, R]
        rotated). absorbed: q_nope moved into the latent space through W_UK, [T, H, C] (the absorbed form)."""
        cfg, T = self.cfg, qr.shape[0]
        D, R = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
        q_nope, q_pe = self.wq_b(qr).view(T, -1, D + R).split([D, R], -1)
        if absorbed:  # (before the rope: on a GPU W_UK then ends before the indexer's rank kernel starts)
            q_nope = self.ops.head_linear(q_nope, self.w_uk)  # absorb W_UK: [T, H, C]
        q_pe = self.ops.rope(q_pe, cos, sin, interleaved=True)
        return q_nope, q_pe

    def attend_chunks(self, q_nope, q_pe, meta, cache):
        """Each request's prompt chunk against its causal context, in the per-head form."""
        out = []
        for b, rows in enumerate(meta.request_rows()):
            ctx = meta.table[b, : int(meta.ctx_host[rows][-1])]  # [N] slots
            out.append(self.attend_dense(q_nope[rows], q_pe[rows], ctx, cache))
        return torch.cat(out)

    def attend_dense(self, q_nope, q_pe, ctx, cache):
        """Prefill ("MHA") form for one request's rows: expand the context's latents to per-head
        keys/values."""
        dtype = self.w_uk.dtype
        kv = cache.kv[ctx].to(dtype)  # [N, C]
        k_nope = torch.einsum("nc,hcd->nhd", kv, self.w_uk)  # [N, H, D]
        v = torch.einsum("nc,hvc->nhv", kv, self.w_uv)  # [N, H, V]
        k_pe = cache.pe[ctx].to(dtype)[:, None, :].expand(-1, k_nope.shape[1], -1)  # [N, H, R]: shared
        k = torch.cat([k_nope, k_pe], -1)
        q = torch.cat([q_nope, q_pe], -1).to(dtype)
        return self.ops.dense_attention(q, k, v, self.cfg.softmax_scale)  # [S, H, V]


# ---- Feed-forward: SwiGLU MLP and the sigmoid-routed, group-limited MoE (spec 3.4, 3.9) --------------------
class MLP(nn.Module):
    """SwiGLU, w2(silu(x W1) * x W3), with W1 | W3 stacked in one weight w13 (one product; see load_target).
    A rank holds inter_dim / ranks of it: its output is an unrounded part of the sum (Block adds them)."""

    ops = None  # bound once by Transformer.bind (swiglu_linear)

    def __init__(self, dim, inter_dim):
        super().__init__()
        self.w13 = Linear(dim, 2 * inter_dim, split="col")  # gate_proj | up_proj: [2I, dim]
        self.w2 = Linear(inter_dim, dim, split="row")

    def forward(self, x):
        return self.ops.swiglu_linear(self.w13(x), *self.w2.operands(), partial=True)


def route(logits, bias, groups, top_groups, top_experts, scale):
    """The router's choice from its logits [T, E] (the reference of the router kernel): sigmoid scores; the
    bias only steers selection: the top_groups groups with the largest sum of their top-2 biased scores, then
    the top_experts experts inside them; weights are the unbiased scores, renormalized, times scale. ->
    (routing weights [T, A] fp32, expert indices [T, A])."""
    T = logits.shape[0]
    scores = logits.sigmoid()  # [T, E] fp32
    biased = (scores + bias).view(T, groups, -1)  # [T, G, E/G]
    group_score = biased.topk(2, dim=-1).values.sum(-1)  # [T, G]
    keep = top_indices(group_score, top_groups)  # the kept groups
    drop = torch.ones_like(group_score, dtype=torch.bool).scatter_(1, keep, False)
    biased = biased.masked_fill(drop[..., None], float("-inf")).flatten(1)
    experts = top_indices(biased, top_experts)  # [T, A]
    weights = scores.gather(1, experts)
    return weights / weights.sum(-1, keepdim=True) * scale, experts


class Gate(nn.Module):
    """The router: a bf16 product (exact: bf16 x and weight, fp32 sums), then `route`."""

    ops = None  # bound once by Transformer.bind (dense_linear, route)

    def __init__(self, cfg: Config):
        super().__init__()
        self.cfg = cfg
        self.weight = param(cfg.n_routed_experts, cfg.dim, dtype=BF16)
        self.bias = param(cfg.n_routed_experts, dtype=torch.float32)  # selection only

    def forward(self, x):
        """-> (routing weights [T, A] fp32, expert indices [T, A])."""
        cfg = self.cfg
        logits = self.ops.dense_linear(x, self.weight)  # [T, E] fp32
        return self.ops.route(
            logits,
            self.bias,
            cfg.n_expert_groups,
            cfg.n_limited_groups,
            cfg.n_activated_experts,
            cfg.route_scale,
        )


def moe_experts(x, weights, idx, w13, s13, w2, s2):
    """The routed experts of a MoE layer (the reference of the grouped MoE kernel): each a SwiGLU MLP over
    the tokens that chose it, summed with their routing weights in fp32. x [T, dim] bf16; weights, idx [T,
    A]; w13 [E, 2I, dim] (w1 | w3 fused), w2 [E, dim, I] FP8 with their block scales -> [T, dim] fp32.
    Grouped as the kernel: the (token, choice) pairs sorted by expert, one GEMM per expert over its rows (a
    row is quantized alike in any group: act_quant works per row, so each is quantized once)."""
    T, A = idx.shape
    idx, order = idx.sort(-1)  # each token's experts ascending: summed in that order
    pair = idx.flatten().argsort(stable=True)  # [P] pairs t * A + a by expert, tokens ascending in each
    pair = pair[idx.flatten()[pair] < len(w13)]  # idx E: another rank's, skipped
    y = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    if len(pair) == 0:
        return y
    experts, counts = idx.flatten()[pair].unique_consecutive(return_counts=True)
    groups = (experts.tolist(), counts.tolist())
    h = grouped_linear(act_dequant(*act_quant(x)).to(acc_dtype(x))[pair // A], w13, s13, *groups)  # [P, 2I]
    h = swiglu(h)
    out = grouped_linear(act_dequant(*act_quant(h)).to(acc_dtype(h)), w2, s2, *groups)  # [P, dim] bf16
    each = torch.zeros(T * A, x.shape[1], dtype=torch.float32, device=x.device)  # [T * A, dim]
    each[pair] = out.float() * weights.gather(1, order).flatten()[pair, None]
    for a in range(A):
        y += each.view(T, A, -1)[:, a]
    return y


def grouped_linear(rows, w, scales, experts, counts):
    """rows [P, in] (already quantized, acc dtype) sorted by expert, counts[i] of them for experts[i], each
    times its expert's weight -> [P, out] bf16: fp8_linear's math, one GEMM per group. scales None: w was
    dequantized at load."""
    out = []
    for e, part in zip(experts, rows.split(counts), strict=True):
        w_e = w[e]
        if scales is not None:
            w_e = weight_dequant(w_e, scales[e])
        out.append(F.linear(part, w_e.to(rows.dtype)))
    return torch.cat(out).to(BF16)


class MoE(nn.Module):
    ops = None  # bound once by Transformer.bind

    def __init__(self, cfg: Config):
        super().__init__()
        self.gate = Gate(cfg)
        E = cfg.n_routed_experts // tp_size()  # this rank's experts (expert parallel)
        # stacked: w13 = w1 | w3 fused [E, 2I, dim]; w2 [E, dim, I] (see load_target)
        self.experts = nn.Module()
        self.experts.w13 = Linear(cfg.dim, 2 * cfg.moe_inter_dim, n=E)
        self.experts.w2 = Linear(cfg.moe_inter_dim, cfg.dim, n=E)
        self.shared_experts = MLP(cfg.dim, cfg.moe_inter_dim * cfg.n_shared_experts)

    def forward(self, x):
        """-> this rank's part [T, dim], unrounded: its routed experts' weighted sum plus its slice of the
        shared expert (Block adds the parts, then rounds once; the reference rounds the shared expert's
        output to bf16 first)."""
        shared, routed = self.ops.side_by_side(lambda: self.shared_experts(x), lambda: self.routed(x))
        return routed + shared

    def routed(self, x):
        """The router's choice, then this rank's routed experts' weighted sum [T, dim] fp32."""
        weights, idx = self.gate(x)  # [T, A] each (replicated)
        w13, w2 = self.experts.w13, self.experts.w2
        if tp_size() > 1:
            E = w13.weight.shape[0]
            first = tp_rank() * E  # this rank holds experts first .. first + E - 1
            mine = (idx >= first) & (idx < first + E)
            idx = torch.where(mine, idx - first, E)  # E: another rank's, skipped
        return self.ops.moe(x, weights, idx, *w13.operands(), *w2.operands())


# ---- Block, MTP layer, Transformer, KV cache (spec 3.10, 3.11) ---------------------------------------------
class Block(nn.Module):
    def __init__(self, cfg: Config, moe: bool):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.dim, cfg.eps)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.eps)
        self.attn = MLA(cfg)
        self.ffn = MoE(cfg) if moe else MLP(cfg.dim, cfg.inter_dim)

    def forward(self, x, residual, cos, sin, meta, cache):
        if residual is None:
            residual = x
            x = self.attn_norm(x)
        else:
            x, residual = self.attn_norm(x, residual)
        # Each half's output is a sum of every rank's part, in fp32 (CPU: fp64), rounded to bf16 once, by the
        # norm that takes it: as at one rank (the reference all-reduces bf16 parts, which makes the tokens
        # depend on the number of ranks)
        x = all_reduce(self.attn(x, cos, sin, meta, cache))
        x, residual = self.ffn_norm(x, residual)
        return all_reduce(self.ffn(x)), residual  # (the FFN half's fp32 sum, the bf16 residual stream)


class MTP(nn.Module):
    """Multi-token prediction layer: from the main model's final-normed hidden state at position i and the
    token at i+1, predict the token at i+2: block(eh_proj([enorm(emb(t_{i+1})); hnorm(h_i)])) -> norm ->
    head."""

    def __init__(self, cfg: Config):
        super().__init__()
        self.cfg = cfg
        self.embed = Embedding(cfg.vocab_size, cfg.dim)
        self.enorm = RMSNorm(cfg.dim, cfg.eps)
        self.hnorm = RMSNorm(cfg.dim, cfg.eps)
        self.eh_proj = Linear(2 * cfg.dim, cfg.dim, fp8=False)  # bf16, unquantized in the checkpoint
        self.block = Block(cfg, moe=True)
        self.shared_head = nn.Module()
        self.shared_head.norm = RMSNorm(cfg.dim, cfg.eps)
        self.shared_head.head = Linear(cfg.dim, cfg.vocab_size, fp8=False, dtype=torch.float32, split="col")

    def forward(self, next_tokens, h, meta: Meta, cache: LayerCache):
        """next_tokens [T] (t_{i+1}), h [T, dim] main hidden at i after the final norm -> normed hidden [T,
        dim]. (vLLM zeroes the embedding at position 0; SGLang and this engine do not.)"""
        cos, sin = rope_cos_sin(self.cfg, meta.positions)
        u = self.eh_proj(torch.cat([self.enorm(self.embed(next_tokens)), self.hnorm(h)], -1)).to(BF16)
        x, residual = self.block(u, None, cos, sin, meta, cache)
        return self.shared_head.norm(x, residual)[0]  # also the input of the next draft step

    def logits(self, h):
        return all_gather(self.shared_head.head(h))  # fp32 [T, vocab] (vocabulary slices joined)


class Transformer(nn.Module):
    ops = None  # the kernel set its layers call, bound by `bind`

    def __init__(self, cfg: Config):
        super().__init__()
        cfg.check_tp(tp_size())
        self.cfg = cfg
        self.embed = Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg, moe=i >= cfg.n_dense_layers) for i in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.eps)
        # fp32, as [R]
        self.head = Linear(cfg.dim, cfg.vocab_size, fp8=False, dtype=torch.float32, split="col")
        self.mtp = nn.ModuleList(MTP(cfg) for _ in range(cfg.n_mtp_layers))

    def bind(self, ops):
        """Point every layer at one kernel set and prepare the weights it reads (once, after loading)."""
        fp8_weights = sum(p.numel() for p in self.parameters() if p.dtype == FP8)
        dequantize = ops.dequantize_fp8 and fp8_weights * 8 <= DEQUANTIZE_AT_LOAD_BYTES
        copies = {}  # weight -> the copy the references read
        for mod in self.modules():
            if hasattr(type(mod), "ops"):
                mod.ops = ops
            if isinstance(mod, Linear) and not mod.fp8:  # lm_head etc.: bf16 in the checkpoint
                mod.weight.data = mod.weight.data.to(ops.dense_dtype(mod.weight))
            if isinstance(mod, MLA):  # wkv_b dequantized once, split per head into W_UK | W_UV
                w = weight_dequant(mod.wkv_b.weight, mod.wkv_b.scale).to(ops.attn_dtype(mod.wkv_b.weight))
                D = mod.cfg.qk_nope_head_dim
                w = w.view(-1, D + mod.cfg.v_head_dim, mod.cfg.kv_lora_rank)  # [H, D + V, C]
                mod.w_uk = w[:, :D].transpose(1, 2).contiguous()
                mod.w_uv = w[:, D:].contiguous()
            if isinstance(mod, Linear) and dequantize and mod.weight not in copies:
                w = weight_dequant(mod.weight, mod.scale) if mod.fp8 else mod.weight.detach()
                copies[mod.weight] = w.to(acc_dtype(mod.weight))  # plain weights (the heads): widened alike
            if isinstance(mod, Linear) and dequantize:  # a shared weight (the MTP head) shares its copy
                mod.dequantized = copies[mod.weight]  # (a tensor, not a second parameter)
        return self

    @torch.inference_mode()
    def forward(self, tokens, meta: Meta, cache: KVCache):
        """tokens [T] -> hidden [T, dim] bf16 after the final norm (the lm_head input, also what MTP
        consumes)."""
        cos, sin = rope_cos_sin(self.cfg, meta.positions)
        h = self.embed(tokens)
        residual = None
        for i, layer in enumerate(self.layers):
            h, residual = layer(h, residual, cos, sin, meta, cache.layer(i))
        return self.norm(h, residual)[0]

    def logits(self, h):
        return all_gather(self.head(h))  # fp32 [T, vocab] (vocabulary slices joined)

    @torch.inference_mode()
    def mtp_forward(self, next_tokens, h, meta: Meta, cache: KVCache, mtp_layer=0):
        return self.mtp[mtp_layer](next_tokens, h, meta, cache.layer(self.cfg.n_layers + mtp_layer))


class KVCache:
    """The KV pool of every layer (main layers, then MTP layers), addressed by slot: the FP8-rounded latent
    and the rope key in one bf16 row (1152 B/token/layer at full size), the indexer key (FP8, 128 B) and
    its fp32 scale."""

    def __init__(self, cfg: Config, num_slots: int, device="cpu"):
        L = cfg.n_layers + cfg.n_mtp_layers
        self.C = cfg.kv_lora_rank
        self.latent = torch.zeros(
            L, num_slots, cfg.kv_lora_rank + cfg.qk_rope_head_dim, dtype=BF16, device=device
        )
        self.ik = torch.zeros(L, num_slots, cfg.index_head_dim, dtype=FP8, device=device)
        self.iks = torch.zeros(L, num_slots, dtype=torch.float32, device=device)

    @staticmethod
    def bytes_per_token(cfg: Config):
        latent = 2 * (cfg.kv_lora_rank + cfg.qk_rope_head_dim)
        return (cfg.n_layers + cfg.n_mtp_layers) * (latent + cfg.index_head_dim + 4)

    def layer(self, i):
        return LayerCache(self.latent[i], self.ik[i], self.iks[i], self.C)


# ---- The kernel boundary: the few names through which the GPU path plugs in --------------------------------
# Layers call these through `self.ops`. Transformer.bind points every layer at one set, once, at load:
# TORCH_OPS (the readable references above, on any device) or kernels.GPU_OPS (the same names and signatures).
TORCH_OPS = SimpleNamespace(
    name="torch reference",
    index_quant=index_quant,  # indexer queries: RoPE, Hadamard, FP8               (Indexer)
    store_index_key=store_index_key,  # indexer keys: LayerNorm, index_quant, cache write (Indexer)
    index_topk=index_topk,  # indexer scores + causal mask + top-k            (Indexer)
    sparse_mla=sparse_mla,  # absorbed sparse attention, one row per token   (MLA: decode/verify/long)
    dense_attention=dense_attention,  # causal per-head attention of short prompts  (MLA: prefill)
    head_linear=head_linear,  # one linear map per head: W_UK, W_UV absorbed  (MLA: sparse rows)
    rope=rope,  # rotary embedding of MLA's queries                            (MLA)
    store_latent=store_latent,  # MLA's cache write: norm, FP8 round trip, rope  (MLA)
    rms_norm=rms_norm,  # RMSNorm, with the residual add fused                   (RMSNorm)
    fp8_linear=fp8_linear,  # act-quant + block-scaled FP8 GEMM                (Linear)
    swiglu_linear=swiglu_linear,  # SwiGLU's activation, then fp8_linear       (MLP)
    dense_linear=dense_linear,  # bf16/fp32 weights: lm_head, weights_proj, eh_proj (Linear)
    route=route,  # the router after its product: group-limited top-k, weights (Gate)
    moe=moe_experts,  # routed experts, grouped, weighted sum                (MoE)
    side_by_side=side_by_side,  # independent parts of a layer: GPU, streams (MLA, Indexer, MoE)
    dequantize_fp8=True,  # FP8 weights dequantized once at load when small enough (DEQUANTIZE_AT_LOAD_BYTES)
    attn_dtype=acc_dtype,  # dtype of wkv_b's absorbed halves (exact: pow2-scaled FP8 fits bf16)
    dense_dtype=lambda w: w.dtype,  # dtype plain Linear weights are kept in (kernels: bf16, as stored)
)


def select_ops(kernels, device):
    """The kernel set for a device: 'torch' the references; 'gpu' kernels.py (an error where it cannot run);
    'auto' kernels.py on a GPU that supports it, else the references."""
    require(
        kernels in ("auto", "torch", "gpu"), f"kernels must be 'auto', 'torch' or 'gpu' (got {kernels!r})"
    )
    on_gpu = torch.device(device).type == "cuda"
    if kernels == "torch" or (kernels == "auto" and not on_gpu):
        return TORCH_OPS
    require(on_gpu, f"kernels='gpu' needs a CUDA device (got {device})")
    import kernels as gpu_kernels  # Triton + flashinfer: imported only on the GPU path

    why = gpu_kernels.unsupported(torch.device(device))
    require(not why or kernels != "gpu", f"the GPU kernels cannot run here: {why}")
    if why:
        return TORCH_OPS
    return gpu_kernels.GPU_OPS


# ---- Tensor and expert parallelism (torchrun): each rank holds a shard of the weights ---------------------
# Every rank runs the same schedule. Split by rank: MLA heads, dense MLP and shared expert (w1 / w3 rows, w2
# columns), routed experts (by index range), vocabulary. Replicated: the rest, the indexer and latent KV cache
# included (every rank selects the same positions). One all-reduce per block half (Block), one all-gather of
# the logits; sampling is identical on every rank.
def init_distributed(device: torch.device) -> torch.device:
    """Under torchrun (WORLD_SIZE > 1): join the ranks once (NCCL on CUDA, gloo on CPU); take GPU
    LOCAL_RANK."""
    if int(os.environ.get("WORLD_SIZE", "1")) == 1:
        return device
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return device


def tp_size():
    """The number of ranks the model is split over (1 without torchrun)."""
    return dist.get_world_size() if dist.is_initialized() else 1


def tp_rank():
    return dist.get_rank() if dist.is_initialized() else 0


def all_reduce(x, op=dist.ReduceOp.SUM):
    """x summed (or op) over ranks, in place; nothing at one rank."""
    if tp_size() > 1:
        dist.all_reduce(x, op)
    return x


def all_gather(x):
    """x [..., n] of every rank concatenated in rank order -> [..., ranks * n] (the vocabulary slices of
    logits)."""
    if tp_size() == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(tp_size())]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, -1)


def end_distributed(graphed):
    """Leave torchrun's process group. NCCL cannot destroy a communicator whose collectives CUDA graphs
    captured (destroy_process_group hangs: pytorch issue 115388), so then the ranks only meet once more and
    exit."""
    if dist.is_initialized() and graphed:
        dist.barrier()
    elif dist.is_initialized():
        dist.destroy_process_group()


def rank_slice(full, part):
    """The index of this rank's part of a checkpoint tensor of shape `full`, for a parameter of shape
    `part`: along the dimension the layer split (where part is smaller), the rank-th block of that size;
    the rest whole."""
    r = tp_rank()
    return tuple(slice(None) if f == p else slice(r * p, r * p + p) for f, p in zip(full, part, strict=True))


# ---- Loader: reads any DeepSeek-V3.2 checkpoint directory shard by shard, validating every tensor ----------
SAFETENSORS_DTYPES = {"F8_E4M3": FP8, "BF16": BF16, "F32": torch.float32}  # the ones DeepSeek-V3.2 uses


def shard_files(path):
    """The shard files and, with an index, its weight map {tensor: file}."""
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        weight_map = read_json(index).get("weight_map")
        is_map = isinstance(weight_map, dict) and all(isinstance(f, str) for f in weight_map.values())
        require(is_map, f"{index}: expected a weight_map of tensor name -> shard file name")
        files = sorted(set(weight_map.values()))
    elif os.path.isfile(os.path.join(path, "model.safetensors")):
        files = ["model.safetensors"]
        weight_map = {}
    else:
        raise ValueError(f"{path}: no model.safetensors.index.json or model.safetensors (safetensors only)")
    for f in files:
        missing = f"{path}: shard {f} listed in model.safetensors.index.json is missing"
        require(os.path.isfile(os.path.join(path, f)), missing)
    return [os.path.join(path, f) for f in files], weight_map


def read_headers(path):
    """{tensor name: (shape, dtype, shard file)} from every shard's header (safetensors checks its length,
    JSON, dtypes and each tensor's byte span), checked against the index's weight map; no weights read."""
    from safetensors import safe_open

    files, weight_map = shard_files(path)
    found = {}
    for file in files:
        try:
            with safe_open(file, "pt") as f:
                header = {
                    name: (f.get_slice(name).get_shape(), f.get_slice(name).get_dtype()) for name in f.keys()
                }
        except Exception as e:  # safetensors raises its own SafetensorError (and OSError)
            why = " ".join(str(e).split())
            raise ValueError(f"{file}: not a safetensors file, or damaged or truncated ({why})") from None
        for name, (shape, dtype) in header.items():
            if name in found:
                raise ValueError(
                    f"{path}: tensor {name} is in both {found[name][2]} and {os.path.basename(file)}"
                )
            found[name] = (shape, dtype, os.path.basename(file))
    for name, file in weight_map.items():
        if name in found and found[name][2] != file:
            raise ValueError(f"{path}: tensor {name} is in {found[name][2]}, but the index says {file}")
    return found


def open_checkpoint(path) -> Config:
    """The config of a checkpoint directory, after checking config.json, each shard's header, then every
    tensor's presence, shape and dtype against the official checkpoint's table; no weights read."""
    is_dir = isinstance(path, (str, os.PathLike)) and os.path.isdir(path)
    require(is_dir, f"model directory {path!r} does not exist (or is not a directory)")
    cfg = Config.from_json(path)
    expected = checkpoint_tensors(cfg)
    found = read_headers(path)
    for name, (shape, dtype, file) in found.items():
        unexpected = (
            f"{path}: unexpected tensor {name} in {file} (not part of DeepSeek-V3.2 with this config)"
        )
        require(name in expected, unexpected)
        want_shape, kind = expected[name]
        require(
            shape == want_shape, f"{path}: tensor {name} has shape {shape}, expected {want_shape} (in {file})"
        )
        allowed = ALLOWED_DTYPES[kind]
        names = " or ".join(str(d).removeprefix("torch.") for d in allowed)
        ok = SAFETENSORS_DTYPES.get(dtype) in allowed
        require(ok, f"{path}: tensor {name} has dtype {dtype}, expected {names} (in {file})")
    for name, (shape, kind) in expected.items():
        require(name in found, f"{path}: missing tensor {name} (expected {kind} {shape})")
    return cfg


def load_target(params, cfg: Config, hf_name: str):
    """The model tensor a checkpoint tensor is loaded into: its parameter, or rows of a stacked one (STACKED:
    gate_proj -> w13[:I], up_proj -> w13[I:]; q_a_proj, indexer.wk, kv_a_proj_with_mqa -> wqkv_a), a routed
    expert's at its index in this rank's stack (w13[e], w2[e]); None for another rank's expert."""
    key = ours_name(cfg, hf_name)
    expert = EXPERT.match(key)
    if expert:  # e.g. layers.3.ffn.experts.5.w1.weight -> layers.3.ffn.experts.w1.weight, index 5 - first
        key = f"{expert[1]}.{expert[3]}.{expert[4]}"
        per_rank = cfg.n_routed_experts // tp_size()
        index = int(expert[2]) - tp_rank() * per_rank
        if not 0 <= index < per_rank:
            return None
    key, part = stack_of(key)
    target = params[key]
    if expert:
        target = target[index]
    if part:
        unit = 1 if key.endswith(".weight") else BLOCK
        target = target[stacked_rows(cfg, part, target.shape[0], unit)]
    return target


def load_model(path, device="cpu", kernels="auto", cfg=None) -> Transformer:
    """Load a DeepSeek-V3.2 HF checkpoint directory (cfg: open_checkpoint(path), if the caller has it). FP8
    weights stay FP8; norms, router bias, weights_proj and the heads are upcast to fp32 one tensor at a
    time, as the reference does; a tensor holding nan or inf is refused by name. Under torchrun a rank
    reads only its share."""
    from safetensors import safe_open
    from tqdm import tqdm

    cfg = cfg or open_checkpoint(path)
    with torch.device("meta"):  # the layers' shapes only: no memory touched twice
        model = Transformer(cfg).to_empty(device=device).eval()
    params = dict(model.named_parameters())
    files = shard_files(path)[0]
    total = sum(os.path.getsize(f) for f in files) // tp_size()  # about what each rank reads
    quiet = total < (256 << 20) or tp_rank() > 0
    with tqdm(total=total, unit="B", unit_scale=True, desc="loading", leave=False, disable=quiet) as bar:
        for file in files:
            with safe_open(file, "pt", device="cpu") as f:
                for name in f.keys():
                    target = load_target(params, cfg, name)
                    if target is None:  # another rank's expert: not read
                        continue
                    part = f.get_slice(name)
                    t = part[rank_slice(part.get_shape(), target.shape)]  # reads this rank's slice only
                    target.copy_(t)
                    check_finite(target, f"{file}: tensor {name}")
                    bar.update(t.numel() * t.element_size())
    return share_mtp_copies(model).bind(select_ops(kernels, device))


def check_finite(t, what):
    if t.dtype == FP8:
        bad = t.view(torch.uint8) & 0x7F == 0x7F  # e4m3fn's nan (it has no inf)
    else:
        bad = ~t.isfinite()
    require(not bad.any(), f"{what} holds {int(bad.sum())} nan or inf values")


def share_mtp_copies(model):
    """The MTP embedding and head are copies of the main ones in the checkpoint: share them when equal."""
    for mtp in model.mtp:
        for copy, main in ((mtp.embed, model.embed), (mtp.shared_head.head, model.head)):
            if torch.equal(copy.weight, main.weight):
                copy.weight = main.weight
    return model


# ==== Part 2: the engine ====================================================================================
# ---- Tokenizer and DeepSeek-V3.2 chat encoding (spec section 5) --------------------------------------------
BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
THINK = "<think>"
END_THINK = "</think>"
SPECIAL_TOKENS = (BOS, EOS, USER, ASSISTANT, THINK, END_THINK)  # token ids 0..5 in DeepSeek's tokenizer


def encode_chat(messages, thinking=False) -> str:
    """DeepSeek-V3.2 chat format: BOS, system text, per user turn `<｜User｜>{c}<｜Assistant｜>`, then
    `<think>` (the last user turn, thinking mode) or `</think>`; assistant turns end with EOS; earlier
    reasoning is dropped."""
    last_user = max(i for i, m in enumerate(messages) if m["role"] == "user")
    out = BOS
    for i, m in enumerate(messages):
        if m["role"] == "system":
            out += m["content"]
        elif m["role"] == "user":
            think = THINK if thinking and i == last_user else END_THINK
            out += USER + m["content"] + ASSISTANT + think
        elif m["role"] == "assistant":
            reasoning = m.get("reasoning_content") if thinking and i > last_user else None
            if reasoning:
                out += reasoning + END_THINK
            out += m["content"] + EOS
        else:
            raise ValueError(f"unknown chat role {m['role']!r}")
    return out


def load_tokenizer(model_dir, cfg: Config):
    """tokenizer.json, checked against the model: no token id >= vocab_size, the chat format's special
    tokens each encode as one token, and BOS / EOS are the config's bos_token_id / eos_token_id."""
    from tokenizers import Tokenizer

    file = os.path.join(model_dir, "tokenizer.json")
    require(os.path.isfile(file), f"{model_dir}: no tokenizer.json")
    try:
        tok = Tokenizer.from_file(file)
    except Exception as e:  # the tokenizers library raises a bare Exception
        raise ValueError(f"{file}: not a valid tokenizer ({' '.join(str(e).split())})") from None
    top = max(tok.get_vocab(with_added_tokens=True).values(), default=-1)
    require(
        top < cfg.vocab_size, f"{file}: has token id {top}, but the model's vocab_size is {cfg.vocab_size}"
    )
    for t in SPECIAL_TOKENS:
        one_token = tok.encode(t, add_special_tokens=False).ids == [tok.token_to_id(t)]
        require(
            one_token, f"{file}: the special token {t} is missing (the chat format needs it as one token)"
        )
    for t, key, want in ((BOS, "bos", cfg.bos_token_id), (EOS, "eos", cfg.eos_token_id)):
        got = tok.token_to_id(t)
        require(got == want, f"{file}: {t} is token {got}, but config.json has {key}_token_id {want}")
    return tok


DEMO_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "demo")


def default_model_dir() -> str:
    """The embedded default: demo/, a tiny DeepSeek-V3.2 trained on Python's standard library
    (tools/train_demo.py) and stored in the official FP8 format; it writes Python, and its MTP drafts are
    accepted."""
    present = os.path.isfile(os.path.join(DEMO_DIR, "model.safetensors.index.json"))
    require(present, f"no --model given, and the demo checkpoint is missing from {DEMO_DIR}")
    return DEMO_DIR


# ---- Sampling and speculative acceptance -------------------------------------------------------------------
def probs_from_logits(logits, temperature, top_p):
    """fp32 logits [n, V] -> sampling distribution: softmax(logits / T) restricted to the top-p nucleus."""
    p = torch.softmax(logits.float() / temperature, -1)
    if top_p < 1.0:
        sp, si = p.sort(-1, descending=True)
        sp = sp.masked_fill(sp.cumsum(-1) - sp >= top_p, 0.0)  # drop tokens once the nucleus holds top_p
        p = torch.zeros_like(p).scatter_(-1, si, sp)
        p = p / p.sum(-1, keepdim=True)
    return p


def sample_no_sync(probs, gen):
    """Exponential race: argmax p / E with E ~ Exp(1) is an exact draw from p, with no host round trip."""
    e = torch.empty_like(probs).exponential_(1, generator=gen)
    e = e.clamp_(min=torch.finfo(probs.dtype).tiny)  # E = 0 would make 0/0 = nan win for p = 0
    return (probs / e).argmax(-1)


def residual_probs(p, q):
    """Where a draft token was rejected, sample from normalize(max(p - q, 0)) (p itself if p == q)."""
    r = (p - q).clamp(min=0)
    if r.sum() > 0:
        return r / r.sum()
    return p


def speculative_accept(draft, q, logits, temperature, top_p, gen):
    """Verify k drafts against the main model's logits [k+1, V] -> the emitted tokens (accepted drafts,
    then one of the main model's). Greedy: the longest prefix equal to the argmax. Sampling: accept x with
    probability min(1, p(x) / q(x)), else draw from max(p - q, 0): the output follows the main model's
    distribution exactly."""
    if temperature == 0:
        target = logits.argmax(-1).tolist()
        a = next((j for j, x in enumerate(draft) if x != target[j]), len(draft))
        return draft[:a] + [target[a]]
    p = probs_from_logits(logits, temperature, top_p)
    for j, x in enumerate(draft):
        if torch.rand((), generator=gen, device=p.device) * q[j, x] > p[j, x]:  # reject
            return draft[:j] + [int(sample_no_sync(residual_probs(p[j], q[j]), gen))]
    return draft + [int(sample_no_sync(p[-1], gen))]


def sample(req, logits):
    """One token from logits [V]: the argmax (greedy) or a draw from the request's temperature / top-p
    distribution."""
    if req.temperature == 0:
        return int(logits.argmax())
    return int(sample_no_sync(probs_from_logits(logits[None], req.temperature, req.top_p)[0], req.gen))


def pick_drafts(reqs, logits):
    """One draft token per request from the MTP logits [B, V], left on the device: the argmax, or for a
    sampling request a draw from its distribution q, which the acceptance test needs -> (tokens [B], [q or
    None per request])."""
    tokens = logits.argmax(-1)
    q = [None] * len(reqs)
    for b, r in enumerate(reqs):
        if r.temperature > 0:
            q[b] = probs_from_logits(logits[b : b + 1], r.temperature, r.top_p)[0]
            tokens[b] = sample_no_sync(q[b], r.gen)
    return tokens, q


# ---- Requests, results, and the checks at the engine's entry points ----------------------------------------
@dataclass
class Request:
    idx: int  # position in the caller's prompt list
    tokens: list  # prompt + generated so far
    prompt_len: int
    max_new_tokens: int
    temperature: float
    top_p: float
    gen: torch.Generator
    prefill_target: int  # prefill positions [0, target): the prompt
    num_cached: int = 0  # positions whose main-model KV is in the pool; decode phase: len(tokens) - 1
    pages: list = field(default_factory=list)
    swapped: tuple = None  # its KV in host memory while preempted (PagePool.swap_out)
    page_row: torch.Tensor = None  # `pages` as a tensor, rebuilt only when they change
    draft: torch.Tensor = None  # [k] draft tokens for the next verify (on the device)
    q: torch.Tensor = None  # [k, V] their draft distributions (sampling only)
    return_logits: bool = False  # keep the main-model logits row of every emitted token in `logits`
    on_tokens: object = None  # called as on_tokens(idx, [token]) for every emitted token
    logits: list = field(default_factory=list)
    accept_lengths: list = field(default_factory=list)  # tokens emitted by each decode round
    finish: str = None  # "eos" | "length" once done

    @property
    def generated(self):
        return self.tokens[self.prompt_len :]

    def emit(self, new_tokens, logits_rows, eos_id):
        """Append emitted tokens, stopping at EOS or max_new_tokens (a finished request retires after the
        step)."""
        for t, row in zip(new_tokens, logits_rows, strict=False):  # logits_rows may hold more rows
            if t == eos_id:
                self.finish = "eos"
                return
            if len(self.generated) >= self.max_new_tokens:
                break
            self.tokens.append(t)
            if self.return_logits:
                self.logits.append(row.float().cpu())
            if self.on_tokens:
                self.on_tokens(self.idx, [t])
        if len(self.generated) >= self.max_new_tokens:
            self.finish = "length"


@dataclass
class Result:
    token_ids: list
    text: str
    accept_lengths: list
    logits: torch.Tensor = None
    finish_reason: str = None


# LLM's integer arguments and their smallest values; None means automatic for kv_cache_bytes and max_context
ENGINE_ARGS = dict(mtp=0, page_size=1, max_batch=1, max_prefill_tokens=1, kv_cache_bytes=1, max_context=1)
# generate's numeric arguments: check_arg's (kind, low, high, open_low); the CLI checks them before loading
SAMPLING = dict(
    max_new_tokens=(int, 0, None, True), temperature=(float, 0), top_p=(float, 0, 1, True), seed=(int,)
)
FLAGS = ("return_logits", "thinking", "raw")


def check_engine_args(args):
    for name, low in ENGINE_ARGS.items():
        automatic = name in ("kv_cache_bytes", "max_context") and args[name] is None
        if not automatic:
            check_arg(name, args[name], int, low)


def check_device(device):
    """The torch device for a user's `device` value (None: a GPU if there is one); under torchrun this
    rank's GPU."""
    try:
        dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    except (RuntimeError, TypeError):
        raise ValueError(f"unknown device {device!r}") from None
    dev = init_distributed(dev)  # torchrun: join the ranks, take a GPU
    n_gpus = torch.cuda.device_count()  # 0 without CUDA
    require(dev.type in ("cpu", "cuda"), f"device {device!r}: nano-nsa runs on cpu or cuda")
    if dev.type == "cuda":
        require(n_gpus > 0, f"device {device!r}: CUDA is not available")
        require((dev.index or 0) < n_gpus, f"device {device!r}: this machine has {n_gpus} CUDA devices")
    return dev


def check_pool_bytes(kv_cache_bytes, page_bytes, device):
    """A KV pool of at least two pages (page 0 is the dummy page) and at most the device's memory."""
    if kv_cache_bytes is None:
        return
    if device.type == "cuda":
        memory = torch.cuda.mem_get_info(device)[1]
    else:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    low = 2 * page_bytes
    require(
        kv_cache_bytes >= low,
        f"kv_cache_bytes={kv_cache_bytes}: less than two pages of the KV pool ({low} bytes)",
    )
    too_big = f"kv_cache_bytes={kv_cache_bytes}: more than the {memory} bytes of {device.type} memory"
    require(kv_cache_bytes <= memory, too_big)


MIN_POOL_TOKENS = 4096  # the smallest KV pool worth loading a model for


def weight_bytes(cfg: Config):
    """(bytes every rank holds whole, bytes split over the ranks) of the parameters loading allocates, from
    the layers' shapes on the meta device: split are Linear split, the vocabulary and the routed experts."""
    with torch.device("meta"):
        model = Transformer(cfg)
    split_bytes = 0
    whole_bytes = 0
    for mod in model.modules():
        split = isinstance(mod, Embedding) or getattr(mod, "split", None) is not None
        for p in mod.parameters(recurse=False):
            if split or p.dim() == 3:  # p.dim() == 3: stacked routed experts
                split_bytes += p.numel() * p.element_size() * tp_size()
            else:
                whole_bytes += p.numel() * p.element_size()
    return whole_bytes, split_bytes


def check_fits(cfg: Config, device):
    """Refuse, before allocating anything, a model whose share of the weights plus a minimal KV pool exceeds
    this device's free memory (GPU) or the available RAM (CPU), saying what would fit."""
    if device.type == "cuda":
        free = torch.cuda.mem_get_info(device)[0]
        where = f"{torch.cuda.get_device_name(device)} has {free / 1e9:.1f} GB free"
    else:
        free = available_ram()
        where = f"this machine has {free / 1e9:.1f} GB of RAM available"
    whole, split = weight_bytes(cfg)
    kv = MIN_POOL_TOKENS * KVCache.bytes_per_token(cfg)
    need = whole + split // tp_size() + kv
    if need <= free:
        return
    why = f"the model needs {need / 1e9:.1f} GB per rank (weights + a {MIN_POOL_TOKENS}-token KV pool)"
    why += f", but {where}"
    allowed = [n for n in (1, 2, 4, 8, 16, 32, 64) if n > tp_size() and tp_sizes_ok(cfg, n)]
    for n in allowed:
        per_rank = whole + split // n + kv
        if per_rank <= free:
            raise ValueError(
                f"{why}; it fits with torchrun --nproc-per-node {n} ({per_rank / 1e9:.1f} GB per rank)"
            )
    if allowed:
        per_rank = whole + split // allowed[-1] + kv
        why += f"; even torchrun --nproc-per-node {allowed[-1]} needs {per_rank / 1e9:.1f} GB per rank"
    raise ValueError(why)


def tp_sizes_ok(cfg: Config, n):
    try:
        cfg.check_tp(n)
    except ValueError:
        return False
    return True


def available_ram():
    """MemAvailable from /proc/meminfo (what can be allocated without swapping), else the physical memory."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def is_token_list(p):
    return isinstance(p, (list, tuple)) and all(is_number(t, integer=True) for t in p)


def check_generate_args(prompts, args, on_tokens):
    """prompts as a list (a single prompt wrapped), after checking every argument of generate."""
    if isinstance(prompts, str) or (is_token_list(prompts) and len(prompts) > 0):
        prompts = [prompts]
    is_list = isinstance(prompts, (list, tuple)) and all(
        isinstance(p, str) or is_token_list(p) for p in prompts
    )
    require(
        is_list, f"prompts must be a string, a list of token ids, or a list of those (got {prompts!r:.80})"
    )
    max_new = args["max_new_tokens"]
    per_prompt = isinstance(max_new, (list, tuple))  # max_new_tokens: one value, or one per prompt
    if per_prompt:
        count = f"max_new_tokens has {len(max_new)} values for {len(prompts)} prompts"
        require(len(max_new) == len(prompts), count)
    for name, rule in SAMPLING.items():
        values = [args[name]]
        if name == "max_new_tokens" and per_prompt:
            values = max_new
        for value in values:
            check_arg(name, value, *rule)
    for name in FLAGS:
        check_arg(name, args[name], bool)
    require(on_tokens is None or callable(on_tokens), f"on_tokens must be a function (got {on_tokens!r:.80})")
    return list(prompts)


# ---- The KV page pool: a request owns pages; position p lives in slot pages[p // P] * P + p % P ------------
class PagePool:
    """Hands out the KV cache's slots by pages of `page_size`. Page 0 is never given out: its slot 0 is the
    dummy slot that padding rows write to."""

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
        req.page_row = None
        self.changes += 1

    def swap_out(self, req):
        """Move a preempted request's KV (every layer, every slot of its pages) to host memory and give its
        pages back. Swapping it in later restores exactly the bits it had: recomputing them through the
        prefill path would not (its numerics differ from the decode path that first wrote them)."""
        slots = self.table([req])[0]
        req.swapped = (
            self.cache.latent[:, slots].cpu(),
            self.cache.ik[:, slots].cpu(),
            self.cache.iks[:, slots].cpu(),
        )
        self.release(req)

    def swap_in(self, req):
        """Pages for a swapped-out request with its KV copied back; False (nothing changed) if the pool is
        short."""
        latent, ik, iks = req.swapped
        if not self.reserve(req, latent.shape[1]):
            return False
        slots = self.table([req])[0]
        self.cache.latent[:, slots] = latent.to(self.device)
        self.cache.ik[:, slots] = ik.to(self.device)
        self.cache.iks[:, slots] = iks.to(self.device)
        req.swapped = None
        return True

    def table(self, reqs):
        """[B, N] slot of every position of each request (the page size 1 view that the kernels read); the
        last one made again while no pages changed (a decode round and its draft steps share one)."""
        key = (self.changes, [id(r) for r in reqs])
        if self.last_table[0] == key:
            return self.last_table[1]
        pages = torch.zeros(len(reqs), max(len(r.pages) for r in reqs), dtype=torch.long)
        for b, r in enumerate(reqs):
            if r.page_row is None or len(r.page_row) != len(r.pages):
                r.page_row = torch.tensor(r.pages)
            pages[b, : len(r.pages)] = r.page_row
        pages = to_device(pages, self.device)
        offsets = torch.arange(self.page_size, device=self.device)
        table = (pages[:, :, None] * self.page_size + offsets).flatten(1)
        self.last_table = (key, table)
        return table


# ---- The scheduler: admission, chunked prefill, preemption -------------------------------------------------
def round_lookahead(num_draft):
    """KV positions a decode round may write past a request's num_cached L as the host knows it, with k =
    num_draft. A greedy batch keeps one round in flight (Runner.greedy_round), which moves L by up to k+1
    before the host learns it; then verify writes L'..L'+k, accepting moves L' to at most L'+k+1, and the
    k-1 draft steps write up to L'+2k-1. Reserved: (k+1) + 2k+1 (k = 0: the round in flight and one decode
    row)."""
    return 3 * num_draft + 2


class Scheduler:
    """Which requests run in the next step. Requests wait in arrival order and are admitted while the batch
    has room and the pool has pages for their prompt and first drafts. A step is a prefill step while any
    running request has prompt left (chunks of at most max_prefill_tokens rows in all), else a decode round
    over every running request. A round that cannot get its pages preempts the newest request: its KV moves
    to host memory, its pages go back, and it waits at the front of the queue to be swapped in and go on
    exactly where it stopped (same KV, same drafts)."""

    def __init__(self, pool: PagePool, max_batch, max_prefill_tokens, num_draft, index_topk):
        self.pool = pool
        self.max_batch = max_batch
        self.max_prefill_tokens = max_prefill_tokens
        self.num_draft = num_draft
        self.index_topk = index_topk
        self.waiting = []
        self.running = []
        self.preemptions = 0

    def add(self, reqs):
        self.waiting += reqs

    def has_work(self):
        return bool(self.waiting or self.running)

    def schedule(self):
        """-> ("prefill", [(request, first position, length)]) or ("decode", [requests with pages for a
        round])."""
        self.admit()
        prefilling = [r for r in self.running if r.num_cached < r.prefill_target]
        if prefilling:
            return "prefill", self.prefill_chunks(prefilling)
        return "decode", self.reserve_round()

    def admit(self):
        while self.waiting and len(self.running) < self.max_batch:
            req = self.waiting[0]
            if req.swapped is not None:
                admitted = self.pool.swap_in(req)
            else:
                admitted = self.pool.reserve(req, req.prefill_target + self.num_draft + 1)  # prompt, drafts
            if not admitted:
                return
            self.running.append(self.waiting.pop(0))

    def prefill_chunks(self, reqs):
        """This step's prompt chunks, at most max_prefill_tokens rows in all. Batch-invariant: a prompt is
        cut at fixed multiples of max_prefill_tokens, and a step never mixes chunks whose context fits in
        top-k (dense attention, Meta.dense) with longer ones, so neither a chunk's rows nor its attention form
        depend on what else runs. A chunk that does not fit waits for the next step."""
        chunks = []
        budget = self.max_prefill_tokens
        step_dense = None  # whether this step's chunks attend densely: its first chunk decides
        for r in reqs:
            n = min(r.prefill_target - r.num_cached, self.max_prefill_tokens)
            dense = r.num_cached + n <= self.index_topk
            if step_dense is None:
                step_dense = dense
            if n > budget or dense != step_dense:
                break
            chunks.append((r, r.num_cached, n))
            budget -= n
        return chunks

    def reserve_round(self):
        """Pages for one decode round of every running request, preempting the newest while the pool is
        short."""
        lookahead = round_lookahead(self.num_draft)
        for r in list(self.running):
            while r in self.running and not self.pool.reserve(r, r.num_cached + lookahead):
                self.preempt(self.running[-1])
        return list(self.running)

    def preempt(self, req):
        self.running.remove(req)
        self.pool.swap_out(req)
        self.preemptions += 1
        self.waiting.insert(0, req)

    def retire(self):
        """Finished requests leave the batch and give their pages back."""
        for r in [r for r in self.running if r.finish]:
            self.running.remove(r)
            self.pool.release(r)

    def drop_all(self):
        """Forget every request (a generate that was interrupted): the running ones give their pages back."""
        for r in self.running:
            self.pool.release(r)
        self.running = []
        self.waiting = []


# ---- The runner: a prefill step, and the speculative decode round in four phases ---------------------------
# First the passes of a round as functions of the model (the CUDA graphs capture them), then the Runner.
def decode_pass(model, cache, kind, tokens, meta, h=None, mtp_layer=0, head_rows=None):
    """One forward pass of a decode round and its head -> (hidden, fp32 logits): 'verify' the main model
    over k + 1 rows per request, logits of every row; 'extend' the MTP layer over the same rows, hidden and
    logits of the rows `head_rows` only (one per request); 'draft' MTP, one row per request."""
    if kind == "verify":
        h = model(tokens, meta, cache)
        return h, model.logits(h)
    h = model.mtp_forward(tokens, h, meta, cache, mtp_layer)
    if head_rows is not None:
        h = h[head_rows]
    return h, model.mtp[mtp_layer].logits(h)


def settle_greedy(tokens, logits, num_draft):
    """Greedy acceptance on the device, for the rows x_L, d_1..d_k of each request (tokens [B*(k+1)]) and
    their logits: the argmax of every row, and how many leading drafts equal it -> [B, k+2], each request's
    argmax row then its number of accepted drafts (it emits the accepted drafts, then the argmax after
    them)."""
    n = num_draft + 1
    target = logits.argmax(-1).view(-1, n)  # [B, k + 1]
    drafts = tokens.view(-1, n)[:, 1:]
    accepted = (drafts == target[:, :num_draft]).cumprod(1).sum(1)  # [B]
    return torch.cat([target, accepted[:, None]], 1)


def extend_rows(meta, emitted, counts):
    """Draft-extend's inputs, on the device, from the first counts[b] tokens of each row b of emitted [B,
    k+1] (the tokens request b emitted this round): the x's of its rows (0 past them), its Meta (rows past
    them, a finished request's all, are padding: they write the dummy slot 0) and each request's last
    emitted row."""
    B, n = emitted.shape
    keep = (torch.arange(n, device=emitted.device) < counts[:, None]).long()
    meta = replace(meta, slots=meta.slots * keep.flatten())
    last_emitted = torch.arange(B, device=emitted.device) * n + counts - 1
    return (emitted * keep).flatten(), meta, last_emitted


def greedy_round_pass(model, cache, num_draft, tokens, meta):
    """A greedy batch's decode round on the device, for one CUDA graph: verify (decode_pass), settle_greedy,
    then draft-extend over the verify rows with the emitted tokens as its x's (extend_rows) and num_draft - 1
    MTP steps, each fed the previous argmax, their metadata made on the device -> (settled [B, k+2], verify
    logits [B*(k+1), V], next drafts [B, k]). (The draft steps' Meta has no exact ctx_host: only the kernels
    run this pass.)"""
    h, logits = decode_pass(model, cache, "verify", tokens, meta)
    settled = settle_greedy(tokens, logits, num_draft)
    if num_draft == 0:
        return settled, logits, settled[:, :0]
    target, accepted = settled[:, :-1], settled[:, -1]
    next_tokens, extend_meta, last_emitted = extend_rows(meta, target, accepted + 1)
    h, draft_logits = decode_pass(model, cache, "extend", next_tokens, extend_meta, h, 0, last_emitted)
    drafts = [draft_logits.argmax(-1)]
    starts = meta.positions.view(-1, num_draft + 1)[:, 0] + accepted + 1  # num_cached after accept
    rows = torch.arange(len(starts), device=starts.device)
    for step in range(1, num_draft):
        pos = starts + (step - 1)
        step_meta = replace(
            meta,
            positions=pos,
            slots=meta.table[rows, pos],
            row_req=rows,
            ctx_lens=pos + 1,
            cu_seqlens=list(range(len(rows) + 1)),
            ctx_host=torch.ones(len(rows), dtype=torch.long),
        )
        mtp_layer = min(step, len(model.mtp) - 1)
        h, draft_logits = decode_pass(model, cache, "draft", drafts[-1], step_meta, h, mtp_layer)
        drafts.append(draft_logits.argmax(-1))
    return settled, logits, torch.stack(drafts, 1)


class Runner:
    """Runs the model over the scheduler's steps. A decode round, with k = num_draft draft tokens per
    request, lays out rows_per_request = k + 1 rows per request: the last token x_L and the drafts d_1..d_k
    at positions L..L+k. Verify runs them through the main model; accept keeps the drafts the main model
    agrees with plus one token of its own; draft-extend runs the MTP layer over the same rows (so its
    shapes and metadata do not depend on what was accepted); draft proposes the next k tokens. Every row is
    a decode row with its own causal length."""

    def __init__(self, model: Transformer, cache: KVCache, pool: PagePool, num_draft, graphs=None):
        self.model = model
        self.cfg = model.cfg
        self.cache = cache
        self.pool = pool
        self.num_draft = num_draft
        self.rows_per_request = num_draft + 1
        self.graphs = graphs
        self.device = cache.latent.device
        self.in_flight = None  # a greedy round launched and not yet accepted: (its requests, its outputs)

    def forward(self, kind, tokens, meta, h=None, mtp_layer=0, head_rows=None):
        """A forward pass of the decode round and its head (decode_pass), replayed from a CUDA graph where
        the engine has them."""
        if self.graphs:
            return self.graphs.run(kind, tokens, meta, h, mtp_layer, head_rows)
        return decode_pass(self.model, self.cache, kind, tokens, meta, h, mtp_layer, head_rows)

    def prefill(self, chunks):
        """Prompt chunks [(request, first position, length)] through the main model, then the MTP layer
        over the same rows. A request whose prompt is done samples its first token (a fresh one) and
        drafts."""
        reqs, starts, lens = zip(*chunks, strict=True)
        meta = Meta.build("prefill", starts, lens, self.pool.table(reqs))
        tokens = torch.tensor([t for r, s, n in chunks for t in r.tokens[s : s + n]], device=self.device)
        h = self.model(tokens, meta, self.cache)
        last = [end - 1 for end in meta.cu_seqlens[1:]]  # each chunk's last row
        logits = self.model.logits(h[last])
        for b, (r, _, n) in enumerate(chunks):
            r.num_cached += n
            if r.num_cached == len(r.tokens):  # the prompt is done: sample its first token
                r.emit([sample(r, logits[b])], logits[b : b + 1], self.cfg.eos_token_id)
        if self.num_draft == 0:
            return
        # the MTP layer over the same rows: position p pairs the main hidden h_p with the next token x_{p+1}
        live = [r.finish is None for r in reqs]
        next_tokens = [
            r.tokens[s + i + 1] if ok else 0
            for (r, s, n), ok in zip(chunks, live, strict=True)
            for i in range(n)
        ]
        hm = self.model.mtp_forward(torch.tensor(next_tokens, device=self.device), h, meta, self.cache)
        done = [b for b, r in enumerate(reqs) if live[b] and r.num_cached == r.prefill_target]
        if done:
            hm = hm[[last[b] for b in done]]
            self.draft([reqs[b] for b in done], hm, self.model.mtp[0].logits(hm))

    def decode_round(self, reqs):
        """verify -> accept -> draft-extend -> draft, with one read-back of the GPU. A greedy batch under CUDA
        graphs runs the four phases as one graph (greedy_round)."""
        if self.graphs and all(r.temperature == 0 for r in reqs):
            self.greedy_round(reqs)
            return
        self.accept_in_flight()
        meta, tokens = self.verify_rows(reqs)
        h, logits = self.forward("verify", tokens, meta)
        settled = settle_greedy(tokens, logits, self.num_draft)
        logits = logits.view(len(reqs), self.rows_per_request, -1)
        emitted = self.accept(reqs, logits, settled.tolist())  # the round's one read-back
        live = [b for b, new in enumerate(emitted) if new]  # requests that go on
        if self.num_draft == 0 or not live:
            return
        hm, logits = self.draft_extend(meta, h, emitted, live)
        self.draft([reqs[b] for b in live], hm, logits)

    def greedy_round(self, reqs):
        """A greedy batch's round as one CUDA graph replay (greedy_round_pass: verify, acceptance settled on
        the device, draft-extend over the emitted tokens, the draft steps), which also leaves the next
        round's inputs on the device. So while the same batch goes on, round n+1 is launched before round n
        is read back and accepted: the host accepts round n while the GPU runs round n+1. A batch that
        changes (a request finished, joined or was preempted) first accepts the round in flight, then starts
        from the host's state. A request that finishes drafts on for a round, into its own pages."""
        previous = self.in_flight
        launched = None
        if previous is not None and [id(r) for r in previous[0]] == [id(r) for r in reqs]:  # the same batch
            reach = max(r.num_cached for r in reqs) + round_lookahead(self.num_draft)  # a bound: see there
            launched = self.graphs.go_on(len(reqs), self.pool.table(reqs), reach)
        if launched is None:  # a new batch (or a context bound whose graph is not captured yet)
            self.accept_in_flight()
            previous = None
            meta, tokens = self.verify_rows(reqs)
            launched = self.graphs.run("greedy", tokens, meta)
        if any(r.return_logits for r in reqs):  # the next replay overwrites them
            read_back, logits, drafts = launched
            launched = (read_back, logits.clone(), drafts)
        self.in_flight = (reqs, launched)
        if previous is not None:
            self.accept_launched(*previous)

    def accept_in_flight(self):
        """Accept the greedy round in flight, if there is one."""
        if self.in_flight is not None:
            self.accept_launched(*self.in_flight)
            self.in_flight = None

    def accept_launched(self, reqs, launched):
        """Read a launched greedy round back (its one read-back), accept it, and keep each request's next
        drafts."""
        read_back, logits, drafts = launched
        logits = logits.view(len(reqs), self.rows_per_request, -1)
        emitted = self.accept(reqs, logits, read_back())
        for b, new in enumerate(emitted):
            if new and self.num_draft:
                reqs[b].draft = drafts[b]
                reqs[b].q = None

    def verify_rows(self, reqs):
        """The verify rows of every request: x_L, d_1..d_k at positions L..L+k -> (meta, tokens [B*(k+1)])."""
        mode = "verify" if self.num_draft else "decode"
        starts = [r.num_cached for r in reqs]
        meta = Meta.build(mode, starts, [self.rows_per_request] * len(reqs), self.pool.table(reqs))
        last = to_device(torch.tensor([r.tokens[-1] for r in reqs]), self.device)  # [B]
        if not self.num_draft:
            return meta, last
        drafts = torch.stack([r.draft for r in reqs])  # [B, k]
        return meta, torch.cat([last[:, None], drafts], 1).flatten()

    def accept(self, reqs, logits, greedy):
        """The tokens each request emits this round. Greedy: the longest prefix of drafts equal to the main
        model's argmax, then its argmax after them, settled on the device (settle_greedy): `greedy` holds
        each request's argmax row and its number of accepted drafts, read back. Sampling: the rejection test
        of speculative_accept (the output follows the main model's distribution)."""
        k = self.num_draft
        emitted = []
        for b, r in enumerate(reqs):
            if r.finish is not None:  # finished in the round before (a greedy round in flight)
                emitted.append([])
                continue
            if r.temperature == 0:
                new = greedy[b][: greedy[b][-1] + 1]  # the accepted drafts, then the argmax
            elif k:
                new = speculative_accept(r.draft.tolist(), r.q, logits[b], r.temperature, r.top_p, r.gen)
            else:
                new = [sample(r, logits[b, 0])]
            if k:
                r.accept_lengths.append(len(new))
            r.num_cached += len(new)  # x_L and the accepted drafts now have KV
            r.emit(new, logits[b], self.cfg.eos_token_id)
            emitted.append(new if r.finish is None else [])
        return emitted

    def draft_extend(self, meta, h, emitted, live):
        """The MTP layer over the verify rows, pairs (h_{L+j}, x_{L+j+1}): the emitted tokens are the x's
        (extend_rows). -> (MTP hidden, MTP logits) of the last emitted row of each request in `live`."""
        n = self.rows_per_request
        padded = [t for new in emitted for t in new + [0] * (n - len(new))]
        host = torch.tensor(padded + [len(new) for new in emitted] + live)
        sizes = [len(padded), len(emitted), len(live)]
        tokens, counts, live_rows = to_device(host, self.device).split(sizes)
        next_tokens, meta, last_emitted = extend_rows(meta, tokens.view(-1, n), counts)
        return self.forward("extend", next_tokens, meta, h, head_rows=last_emitted[live_rows])

    def draft(self, reqs, h, logits):
        """k draft tokens per request, left on the device (r.draft [k]): the first from the MTP logits of
        the row that just ran at position L-1 (h its hidden state); the rest from k-1 MTP decode steps at
        L, L+1, ..., each fed the previous draft, over one Meta built once and shifted per step."""
        chosen = [pick_drafts(reqs, logits)]  # (tokens [B], q per request) of each draft step
        meta = None
        for step in range(1, self.num_draft):
            if step == 1:
                meta = Meta.build(
                    "decode", [r.num_cached for r in reqs], [1] * len(reqs), self.pool.table(reqs)
                )
            else:
                meta = meta.step(1)
            mtp_layer = min(step, len(self.model.mtp) - 1)
            h, logits = self.forward("draft", chosen[-1][0], meta, h, mtp_layer)
            chosen.append(pick_drafts(reqs, logits))
        drafts = torch.stack([tokens for tokens, _ in chosen], 1)  # [B, k]
        for b, r in enumerate(reqs):
            r.draft = drafts[b]
            r.q = None
            if r.temperature > 0:
                r.q = torch.stack([q[b] for _, q in chosen])


# ---- CUDA graphs: the decode round's forward passes captured per batch-size bucket -------------------------
def start_read_back(x):
    """Start copying x (CUDA) to the host without waiting -> a function that waits for that copy and returns
    x.tolist(): pinned memory and an event, so that work queued after the copy need not finish first."""
    host = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
    host.copy_(x, non_blocking=True)
    copied = torch.cuda.Event()
    copied.record()

    def wait():
        copied.synchronize()
        return host.tolist()

    return wait


def graph_buckets(max_bs, rows_per_req, tp=1):
    """Batch sizes captured for rows_per_req rows per request: 1, 2, 4, 8, then every 16 up to the first >=
    max_bs, those whose rows split evenly over tp ranks (SGLang's rule: at TP 8, bs=1 with 4 rows pads to
    bs=2, not 8)."""
    step = tp // math.gcd(tp, rows_per_req)  # bs must be a multiple of this
    top = -(-max_bs // step) * step
    return [b for b in sorted({1, 2, 4, 8, *range(16, top, 16), top}) if b <= top and b % step == 0]


class CudaGraphs:
    """The decode round's forward passes as CUDA graphs, one per batch-size bucket and context bound (the
    indexer's width is a shape: index_topk at start, powers of two above it on first use): 'greedy' (a
    greedy batch's whole round, greedy_round_pass), and for sampling batches 'verify', 'extend' and 'draft'
    (see Runner.forward). A replay copies the step's inputs into static buffers (padding rows write the
    dummy slot 0)."""

    def __init__(self, model: Transformer, cache: KVCache, num_draft, max_batch, max_context, page_size):
        cfg, dev = model.cfg, cache.latent.device
        t0 = time.perf_counter()
        self.model = model
        self.cache = cache
        self.num_draft = num_draft
        self.rows = dict(greedy=num_draft + 1, verify=num_draft + 1, extend=num_draft + 1, draft=1)
        kinds = ["greedy", "verify"] + ["extend"] * (num_draft > 0) + ["draft"] * (num_draft > 1)
        self.buckets = {kind: graph_buckets(max_batch, self.rows[kind], tp_size()) for kind in kinds}
        max_bs = max(b[-1] for b in self.buckets.values())
        rows = max_bs * (num_draft + 1)
        # the furthest position a round writes, and one
        context = max_context + round_lookahead(num_draft) + 1
        self.max_width = -(-context // page_size) * page_size
        self.tokens = torch.zeros(rows, dtype=torch.long, device=dev)
        self.positions = torch.zeros(rows, dtype=torch.long, device=dev)
        self.slots = torch.zeros(rows, dtype=torch.long, device=dev)
        self.ctx = torch.zeros(rows, dtype=torch.long, device=dev)
        self.h = torch.zeros(rows, cfg.dim, dtype=BF16, device=dev)
        self.head_rows = torch.zeros(max_bs, dtype=torch.long, device=dev)  # one row per request (extend)
        self.live = torch.zeros(rows, dtype=torch.long, device=dev)  # 1 for a request's rows, 0 for padding
        self.inputs_left = False  # whether the buffers hold the next inputs of the last greedy replay
        self.table = torch.zeros(max_bs, self.max_width, dtype=torch.long, device=dev)
        self.graphs = {}
        self.pool = None
        for kind in kinds:
            for bs in self.buckets[kind]:
                self.capture(kind, bs, self.width(cfg.index_topk), self.first_mtp_layer(kind))
        captured = ", ".join(f"{kind} bs {','.join(map(str, b))}" for kind, b in self.buckets.items())
        print(
            f"nano-nsa: captured {len(self.graphs)} CUDA graphs in {time.perf_counter() - t0:.1f} s: "
            f"{captured}"
            f" (contexts <= {cfg.index_topk}; longer ones are captured on first use)",
            file=sys.stderr,
        )

    def first_mtp_layer(self, kind):
        """The MTP layer a pass starts on: draft-extend the first, draft steps the second where there is
        one."""
        if kind == "draft":
            return min(1, self.model.cfg.n_mtp_layers - 1)
        return 0

    def width(self, max_ctx):
        """The context bound a step runs under: index_topk, or the next power of two (the indexer's score
        width)."""
        topk = self.model.cfg.index_topk
        if max_ctx <= topk:
            return topk
        return min(1 << (max_ctx - 1).bit_length(), self.max_width)

    def capture(self, kind, bs, width, mtp_layer):
        model, n = self.model, self.rows[kind]
        T = bs * n
        meta = Meta(
            "decode",
            positions=self.positions[:T],
            slots=self.slots[:T],
            row_req=torch.arange(bs, device=self.tokens.device).repeat_interleave(n),
            table=self.table[:bs, :width],
            ctx_lens=self.ctx[:T],
            cu_seqlens=list(range(0, T + 1, n)),
            ctx_host=torch.ones(T, dtype=torch.long),
            max_ctx=width,
        )
        self.positions[:T] = 0  # the warm-up below runs: every row writes the dummy slot 0
        self.slots[:T] = 0
        self.ctx[:T] = 1
        self.table[:bs, :width] = 0  # ('greedy' reads its slots from the table)
        self.head_rows[:bs] = 0  # (a larger batch's rows may be left there)

        head_rows = None
        if kind == "extend":
            head_rows = self.head_rows[:bs]

        def forward():
            if kind == "greedy":
                return self.greedy_pass(meta, T)
            tokens, h = self.tokens[:T], self.h[:T]
            return decode_pass(model, self.cache, kind, tokens, meta, h, mtp_layer, head_rows)

        forward()  # warm-up: compiles and autotunes kernels
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        gc.disable()  # an old engine's graphs, freed by the collector during a capture, would break it
        try:
            with torch.cuda.graph(graph, self.pool):
                out = forward()
        finally:
            gc.enable()
        self.pool = self.pool or graph.pool()  # all graphs share one memory pool
        self.graphs[kind, bs, width, mtp_layer] = (graph, meta, out)

    def greedy_pass(self, meta, T):
        """greedy_round_pass over the first T static rows, its slots read from the page table in the graph;
        then it writes the next round's inputs over its own: each request's argmax after its accepted
        drafts, its next drafts, and its positions moved past what it emitted (padding rows stay at 0)."""
        positions = self.positions[:T]
        meta = replace(meta, slots=meta.table[meta.row_req, positions], ctx_lens=positions + 1)
        out = greedy_round_pass(self.model, self.cache, self.num_draft, self.tokens[:T], meta)
        settled, _, drafts = out
        accepted = settled[:, -1]
        last = settled.gather(1, accepted[:, None])  # [B, 1] the argmax after the accepted drafts: x_L'
        self.tokens[:T] = torch.cat([last, drafts], 1).flatten()
        moved = (accepted + 1).repeat_interleave(self.num_draft + 1) * self.live[:T]
        self.positions[:T] = positions + moved
        return out

    def run(self, kind, tokens, meta, h=None, mtp_layer=0, head_rows=None):
        self.inputs_left = False
        n, B = self.rows[kind], meta.table.shape[0]
        bs = next(b for b in self.buckets[kind] if b >= B)
        reach = meta.max_ctx
        if kind == "greedy":  # its draft steps run k - 1 positions past the verify rows
            reach += self.num_draft
        width = self.width(reach)
        if (kind, bs, width, mtp_layer) not in self.graphs:
            t0 = time.perf_counter()
            self.capture(kind, bs, width, mtp_layer)
            took = time.perf_counter() - t0
            print(
                f"nano-nsa: captured the {kind} graph for bs {bs}, contexts <= {width} in {took:.2f} s",
                file=sys.stderr,
            )
        graph, static, out = self.graphs[kind, bs, width, mtp_layer]
        T, padded = B * n, bs * n
        self.tokens[:T] = tokens
        self.positions[:T] = meta.positions
        self.slots[:T] = meta.slots
        self.ctx[:T] = meta.ctx_lens
        if h is not None:
            self.h[:T] = h
        self.positions[T:padded] = 0  # padding rows: write the dummy slot, read one position
        self.slots[T:padded] = 0
        self.ctx[T:padded] = 1
        self.table[:B, : meta.table.shape[1]] = meta.table
        self.table[B:bs, :width] = 0  # (so every position of a padding row is the dummy slot)
        rows = T
        if head_rows is not None:
            rows = len(head_rows)
            self.head_rows[:rows] = head_rows
            self.head_rows[rows:bs] = 0
        if kind == "greedy":  # its rows that move on to the next round (see greedy_pass)
            self.live[:T] = 1
            self.live[T:padded] = 0
            return self.replay_greedy(graph, out, B)
        graph.replay()
        h_out, logits = out
        return h_out[:rows], logits[:rows]

    def go_on(self, B, table, reach):
        """Replay a greedy batch's round on the inputs its last replay left in the static buffers (the same B
        requests in the same order), with the page table as it is now (`reach`: a bound on the round's
        contexts) -> as run; None where the graph of that context bound is not captured yet."""
        bs = next(b for b in self.buckets["greedy"] if b >= B)
        key = ("greedy", bs, self.width(reach), 0)
        if not self.inputs_left or key not in self.graphs:
            return None
        self.table[:B, : table.shape[1]] = table  # the pages reserved since
        graph, _, out = self.graphs[key]
        return self.replay_greedy(graph, out, B)

    def replay_greedy(self, graph, out, B):
        """-> (a function that waits for the round's settled rows [B, k+2] and returns them as lists, its
        logits [B*(k+1), V] (static: the next replay overwrites them), its next drafts [B, k])."""
        graph.replay()
        self.inputs_left = True
        settled, logits, drafts = out
        return start_read_back(settled[:B]), logits[: B * (self.num_draft + 1)], drafts[:B].clone()


# ---- LLM: the engine, tying the parts together -------------------------------------------------------------
class LLM:
    """DeepSeek-V3.2 engine: generate() admits requests, then runs steps until every request is done. A
    step asks the scheduler what to run, runs it (a prefill step, or a decode round of verify, accept,
    draft-extend, draft), and retires what finished."""

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
        loaded from model_dir."""
        check_engine_args(locals())
        self.device = check_device(device)
        model_dir = model_dir or default_model_dir()
        if model is None:
            self.cfg = open_checkpoint(model_dir)  # config + shard headers: no weights yet
            check_fits(self.cfg, self.device)  # before any allocation
        else:
            self.cfg = model.cfg
        self.tokenizer = load_tokenizer(model_dir, self.cfg)
        require(mtp == 0 or self.cfg.n_mtp_layers > 0, f"mtp={mtp}: needs a checkpoint with an MTP layer")
        page_bytes = KVCache.bytes_per_token(self.cfg) * page_size
        check_pool_bytes(kv_cache_bytes, page_bytes, self.device)
        self.model = model or load_model(model_dir, self.device, kernels, self.cfg)
        self.num_draft = mtp
        self.max_context = min(max_context or self.cfg.max_seq_len, self.cfg.max_seq_len)
        num_pages = self.pool_pages(kv_cache_bytes, page_bytes)
        self.cache = KVCache(self.cfg, num_pages * page_size, self.device)
        self.pool = PagePool(self.cache, page_size)
        self.scheduler = Scheduler(self.pool, max_batch, max_prefill_tokens, mtp, self.cfg.index_topk)
        graphs = None  # the torch references sync the host: no graphs for them
        if cuda_graphs and self.device.type == "cuda" and self.model.ops is not TORCH_OPS:
            graphs = CudaGraphs(self.model, self.cache, mtp, max_batch, self.max_context, page_size)
        self.runner = Runner(self.model, self.cache, self.pool, mtp, graphs)
        # say which kernels run, at the first generate
        self.announce = self.device.type == "cuda" and tp_rank() == 0
        self.stats = {}
        if self.device.type == "cuda":
            self.warm_up()

    def warm_up(self):
        """Build the prefill path's GPU kernels (Triton compiles them at first use: seconds on a fresh
        machine) before any generate the caller times, and say how long it took."""
        t0 = time.perf_counter()
        self.generate([[self.cfg.bos_token_id] * n for n in (5, 16)], max_new_tokens=2)
        if tp_rank() == 0:
            print(f"nano-nsa: built the prefill kernels in {time.perf_counter() - t0:.1f} s", file=sys.stderr)

    @property
    def graphs(self):
        """The CUDA graphs the runner replays (None: eager rounds)."""
        return self.runner.graphs

    def pool_pages(self, kv_cache_bytes, page_bytes):
        """Pages of the KV pool: kv_cache_bytes, or CPU 256 MiB, GPU 80% of what is free; the smallest over
        ranks (one schedule for all)."""
        if kv_cache_bytes is None and self.device.type == "cuda":
            kv_cache_bytes = int(torch.cuda.mem_get_info(self.device)[0] * 0.8)
        elif kv_cache_bytes is None:
            kv_cache_bytes = 256 << 20
        pages = torch.tensor([kv_cache_bytes // page_bytes], device=self.device)
        return int(all_reduce(pages, dist.ReduceOp.MIN))

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
        ids. max_new_tokens: one value for every prompt, or a list of one per prompt."""
        args = dict(locals(), seed=0 if seed is None else seed)
        prompts = check_generate_args(prompts, args, on_tokens)
        if not prompts:
            return []
        reqs = self.make_requests(prompts, args, seed)
        if self.announce:
            print(
                f"nano-nsa: {torch.cuda.get_device_name(self.device)}, kernels: {self.model.ops.name}",
                file=sys.stderr,
            )
            self.announce = False
        t0 = time.perf_counter()
        self.scheduler.add(reqs)
        self.scheduler.preemptions = 0
        rounds = 0
        try:
            while self.scheduler.has_work():
                rounds += self.step() == "decode"
            self.runner.accept_in_flight()  # a round launched after its requests finished: nothing to emit
        except BaseException:  # interrupted (Ctrl-C, an on_tokens that raised): no request is left behind
            self.runner.in_flight = None
            self.scheduler.drop_all()
            raise
        self.stats = self.summary(reqs, time.perf_counter() - t0, rounds)
        results = []
        for r in reqs:
            logits = None
            if return_logits:
                logits = torch.stack(r.logits) if r.logits else torch.zeros(0, self.cfg.vocab_size)
            results.append(
                Result(r.generated, self.tokenizer.decode(r.generated), r.accept_lengths, logits, r.finish)
            )
        return results

    def step(self):
        """One engine step: schedule -> run -> retire. Returns what ran ("prefill" or "decode")."""
        mode, batch = self.scheduler.schedule()
        if mode == "prefill":
            self.runner.prefill(batch)
        elif batch:
            self.runner.decode_round(batch)
        self.scheduler.retire()
        return mode

    def make_requests(self, prompts, args, seed):
        """One Request per prompt, each refused (ValueError) if it is empty, out of the vocabulary, or too
        long."""
        temperature = args["temperature"]
        if temperature > 0:
            temperature = max(temperature, 1e-5)  # as the reference: no overflow in logits / T
        if seed is None:  # a fresh seed, the same on every rank
            fresh = torch.tensor([int.from_bytes(os.urandom(6), "little")], device=self.device)
            seed = int(all_reduce(fresh, dist.ReduceOp.MAX))
        capacity = self.pool.free_slots
        budgets = args["max_new_tokens"]
        if not isinstance(budgets, (list, tuple)):  # one value for every prompt
            budgets = [budgets] * len(prompts)
        reqs = []
        for i, prompt in enumerate(prompts):
            max_new = budgets[i]
            ids = self.encode(prompt, args["thinking"], args["raw"])
            require(ids, f"prompt {i} is empty")
            in_vocab = min(ids) >= 0 and max(ids) < self.cfg.vocab_size
            require(in_vocab, f"prompt {i} has token ids outside [0, {self.cfg.vocab_size})")
            too_long = (
                f"prompt {i} has {len(ids)} tokens; with max_new_tokens={max_new} it exceeds the context "
                f"limit of {self.max_context} tokens"
            )
            require(len(ids) + max_new <= self.max_context, too_long)
            never_fits = (
                f"prompt {i} ({len(ids)} tokens + {max_new} new) can never fit in the KV pool of {capacity} "
                "slots; give the engine a larger kv_cache_bytes"
            )
            require(len(ids) + max_new + round_lookahead(self.num_draft) <= capacity, never_fits)
            gen = torch.Generator(self.device).manual_seed((seed * 1_000_003 + i) % 2**63)
            req = Request(
                i, list(ids), len(ids), max_new, temperature, args["top_p"], gen, prefill_target=len(ids)
            )
            req.return_logits = args["return_logits"]
            req.on_tokens = args["on_tokens"]
            reqs.append(req)
        return reqs

    def encode(self, prompt, thinking=False, raw=False):
        if not isinstance(prompt, str):
            return [int(t) for t in prompt]
        if raw:
            text = BOS + prompt
        else:
            text = encode_chat([{"role": "user", "content": prompt}], thinking)
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def summary(self, reqs, seconds, rounds):
        tokens = sum(len(r.generated) for r in reqs)
        accepts = [a for r in reqs for a in r.accept_lengths]
        histogram = {}
        if self.num_draft:
            histogram = {n: accepts.count(n) for n in range(1, self.num_draft + 2)}
        return dict(
            tokens=tokens,
            seconds=seconds,
            tokens_per_s=tokens / seconds,
            decode_rounds=rounds,
            preemptions=self.scheduler.preemptions,
            mean_accept_length=sum(accepts) / len(accepts) if accepts else None,
            accept_histogram=histogram,
        )


# ---- CLI ---------------------------------------------------------------------------------------------------
def build_parser():
    ap = argparse.ArgumentParser(
        description="DeepSeek-V3.2 inference (DSA sparse attention, MTP speculative decoding)."
    )
    ap.add_argument("--model", help="DeepSeek-V3.2 checkpoint directory (default: demo/, a tiny trained one)")
    ap.add_argument("--prompt", action="append", default=[], help="prompt text (repeatable)")
    ap.add_argument("--prompt-file", help="a file with one prompt per line")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--mtp", type=int, default=1, help="draft tokens per round (0 = no speculative decoding)")
    ap.add_argument("--device", help="cpu or cuda (default: cuda if available)")
    ap.add_argument("--thinking", action="store_true", help="chat in thinking mode")
    ap.add_argument("--raw", action="store_true", help="plain completion, no chat template")
    ap.add_argument("--max-context", type=int, help="refuse prompts + max_new_tokens longer than this")
    kernels_help = "auto: kernels.py on a GPU that supports it; torch: the readable reference path"
    ap.add_argument("--kernels", default="auto", choices=["auto", "torch", "gpu"], help=kernels_help)
    ap.add_argument("--no-cuda-graphs", action="store_true", help="run decode rounds eagerly (GPU)")
    ap.add_argument("--json", action="store_true", help="print one JSON document instead of streaming text")
    return ap


def read_prompts(args):
    prompts = list(args.prompt)
    if args.prompt_file:
        try:
            with open(args.prompt_file, encoding="utf-8") as f:
                prompts += [line.rstrip("\n") for line in f if line.strip()]
        except UnicodeDecodeError as e:
            raise ValueError(f"{args.prompt_file}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    require(prompts, "give at least one --prompt or a --prompt-file")
    return prompts


class TextStream:
    """on_tokens for one prompt: prints its newly decodable text as tokens arrive (whole UTF-8 characters
    only)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.tokens = []
        self.printed = ""

    def __call__(self, idx, tokens):
        self.tokens.extend(tokens)
        text = self.tokenizer.decode(self.tokens)
        if not text.endswith("\ufffd"):
            print(text[len(self.printed) :], end="", flush=True)
            self.printed = text


def print_results(args, prompts, results, stats, streamed):
    if args.json:
        rows = [
            dict(
                prompt=p,
                token_ids=r.token_ids,
                text=r.text,
                finish_reason=r.finish_reason,
                accept_lengths=r.accept_lengths,
            )
            for p, r in zip(prompts, results, strict=True)
        ]
        print(json.dumps({"results": rows, "stats": stats}))
        return
    for p, r in zip(prompts, results, strict=True):
        if streamed:
            print("")  # the text is out already: end its line
        else:
            print(f"--- {p!r}\n{r.text}")
    spec = ""
    if stats["mean_accept_length"] is not None:
        spec = f", mean accepted length {stats['mean_accept_length']:.2f}"
        spec += f", acceptance histogram {stats['accept_histogram']}"
    speed = f"{stats['tokens']} tokens in {stats['seconds']:.2f} s, {stats['tokens_per_s']:.1f} tokens/s"
    print(f"[{speed}{spec}]", file=sys.stderr)


def main(argv=None):
    ap = build_parser()
    ap.error = lambda message: ap.exit(2, f"error: {message}\n")  # one line, no usage dump
    args = ap.parse_args(argv)
    try:
        prompts = read_prompts(args)
        for name, rule in SAMPLING.items():  # before any work: a model may take minutes to load
            check_arg(name, getattr(args, name), *rule)
        llm = LLM(
            args.model,
            device=args.device,
            mtp=args.mtp,
            max_context=args.max_context,
            kernels=args.kernels,
            cuda_graphs=not args.no_cuda_graphs,
        )
        quiet = tp_rank() > 0  # torchrun: every rank computes the same tokens; rank 0 prints
        stream = not args.json and len(prompts) == 1 and not quiet
        results = llm.generate(
            prompts,
            max_new_tokens=args.max_new_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            seed=args.seed,
            thinking=args.thinking,
            raw=args.raw,
            on_tokens=TextStream(llm.tokenizer) if stream else None,
        )
    except (ValueError, OSError) as e:  # bad input: one line, no traceback
        print("error: " + str(e).replace("\n", " "), file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    end_distributed(llm.graphs is not None)
    if not quiet:
        print_results(args, prompts, results, llm.stats, stream)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
