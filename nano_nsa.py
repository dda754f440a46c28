"""nano-nsa: DeepSeek-V3.2 inference in one readable file.

Part 1, the model (read top to bottom): Config -> checkpoint format -> tensor parallelism -> building blocks (FP8
linear, norms, YaRN RoPE, Hadamard) -> forward metadata -> lightning indexer -> MLA -> MoE -> Block, MTP layer,
Transformer, KV cache -> loader. It computes what DeepSeek's official `inference/model.py` computes
(../shared/docs/dsv32_spec.md is the specification); where it deliberately differs, a comment says why.
Part 2, the engine: tokenizer and chat encoding, sampling and speculative acceptance, the engine (paged KV pool,
continuous batching, chunked prefill, the MTP speculative loop), CUDA graphs, the CLI.

Dimension legend used in shape comments:
  T tokens (rows) in the forward pass   B requests in the batch   N context positions of a request
  H attention heads   D qk_nope_head_dim (128)   R qk_rope_head_dim (64)   V v_head_dim (128)
  C kv_lora_rank (512)   I indexer heads (64)   J index_head_dim (128)   K index_topk (2048)
  E routed experts   A activated experts per token   S slots in the KV pool
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import time
import zlib
from dataclasses import dataclass, field, fields, replace
from itertools import accumulate
from types import SimpleNamespace
from numbers import Integral, Real

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

BLOCK = 128                      # FP8 block size: 128x128 weight blocks, 1x128 activation groups
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
BF16 = torch.bfloat16


# ---- Config, and the checks that give every fault in a user value or a model file one ValueError line ----------
def _is_num(v, integer=False):         # finite (not nan, inf, or beyond the float range), never a bool
    return isinstance(v, Integral if integer else Real) and not isinstance(v, bool) and abs(v) <= sys.float_info.max


def require(ok, message):
    if not ok:
        raise ValueError(message)


def check_arg(name, value, kind, low=None, high=None, open_low=False):
    """A `kind` value (int, float: finite, or bool) in [low, high] ((low, high] if open_low), else a ValueError."""
    what, ok = {int: ("an integer", _is_num(value, True)), float: ("a finite number", _is_num(value)),
                bool: ("True or False", isinstance(value, bool))}[kind]
    require(ok, f"{name} must be {what} (got {value!r:.80})")
    if low is not None and (value < low or open_low and value == low) or high is not None and value > high:
        rule = f"{'>' if open_low else '>='} {low}" if high is None else f"in {'(' if open_low else '['}{low}, {high}]"
        raise ValueError(f"{name} must be {rule} (got {value!r})")


def read_json(path):
    """A JSON object from a file, or a one-line ValueError naming the file."""
    try:
        with open(path, encoding="utf-8") as f:
            obj = json.load(f)
    except (OSError, ValueError) as e:                  # ValueError: bad JSON or not UTF-8
        raise ValueError(f"{path}: {'cannot read' if isinstance(e, OSError) else 'not valid JSON'} ({e})") from None
    require(isinstance(obj, dict), f"{path}: expected a JSON object, not {type(obj).__name__}")
    return obj


@dataclass
class Config:
    """Every field the model uses; names follow DeepSeek's reference `ModelArgs` (HF names in from_json)."""
    vocab_size: int = 129280
    dim: int = 7168                  # hidden_size
    inter_dim: int = 18432           # dense MLP of the first n_dense_layers layers
    moe_inter_dim: int = 2048        # each routed / shared expert
    n_layers: int = 61               # main-model layers; the MTP layers follow at index n_layers
    n_dense_layers: int = 3          # first_k_dense_replace
    n_mtp_layers: int = 1            # num_nextn_predict_layers
    n_heads: int = 128
    n_routed_experts: int = 256
    n_shared_experts: int = 1
    n_activated_experts: int = 8     # num_experts_per_tok
    n_expert_groups: int = 8         # n_group
    n_limited_groups: int = 4        # topk_group
    route_scale: float = 2.5         # routed_scaling_factor
    q_lora_rank: int = 1536
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    index_n_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 2048
    rope_theta: float = 10000.0
    rope_factor: float = 40.0        # YaRN
    original_seq_len: int = 4096     # YaRN original_max_position_embeddings
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    max_seq_len: int = 163840        # max_position_embeddings
    eps: float = 1e-6                # rms_norm_eps (also the indexer LayerNorm eps)
    bos_token_id: int = 0
    eos_token_id: int = 1
    # lower bounds other than integers >= 1 and floats > 0; HF config.json name -> our name (the names that differ)
    LOW = dict(n_dense_layers=0, n_mtp_layers=0, bos_token_id=0, eos_token_id=0, rope_theta=1.0, mscale=-math.inf)
    HF_NAMES = dict(hidden_size="dim", intermediate_size="inter_dim", moe_intermediate_size="moe_inter_dim",
                    num_hidden_layers="n_layers", first_k_dense_replace="n_dense_layers",
                    num_nextn_predict_layers="n_mtp_layers", num_attention_heads="n_heads",
                    num_experts_per_tok="n_activated_experts", n_group="n_expert_groups",
                    topk_group="n_limited_groups", routed_scaling_factor="route_scale",
                    max_position_embeddings="max_seq_len", rms_norm_eps="eps")
    ROPE_NAMES = dict(factor="rope_factor", original_max_position_embeddings="original_seq_len",
                      beta_fast="beta_fast", beta_slow="beta_slow", mscale="mscale")

    def __post_init__(self):
        """Refuse (one-line ValueError) what the layers cannot run: wrong types or signs first, then shapes."""
        for f in fields(self):
            kind = int if f.type in ("int", int) else float
            check_arg(self.label(f.name), getattr(self, f.name), kind, self.LOW.get(f.name, 1 if kind is int else 0),
                      open_low=kind is float)
        rules = [(self.n_dense_layers <= self.n_layers, "more dense layers than layers"),
                 (self.n_routed_experts % self.n_expert_groups == 0, "experts must split evenly into groups"),
                 (self.n_routed_experts // self.n_expert_groups >= 2, "group score is the sum of the top-2 experts"),
                 (self.n_limited_groups <= self.n_expert_groups and self.n_activated_experts <= self.n_limited_groups
                  * (self.n_routed_experts // self.n_expert_groups), "top-k larger than kept groups"),
                 (self.n_heads * self.v_head_dim % BLOCK == 0, "o_proj input must be a multiple of 128"),
                 (self.index_head_dim == BLOCK, "indexer heads are one 128-wide FP8 group each (Hadamard 128)"),
                 (self.qk_rope_head_dim % 2 == 0 and self.qk_rope_head_dim <= self.index_head_dim,
                  "qk_rope_head_dim must be even and at most index_head_dim"),
                 (self.max_seq_len > self.original_seq_len, "max_seq_len must exceed original_seq_len"),
                 (max(self.bos_token_id, self.eos_token_id) < self.vocab_size, "bos/eos_token_id >= vocab_size")]
        rules += [(getattr(self, n) % BLOCK == 0, f"{self.label(n)} must be a multiple of {BLOCK} (FP8 activation "
                   f"groups)") for n in ("dim", "q_lora_rank", "kv_lora_rank", "inter_dim", "moe_inter_dim")]
        for ok, why in rules:
            require(ok, why)

    def check_tp(self, n):
        """Refuse a tensor-parallel size n (ranks) that would split a head, an expert or the vocabulary unevenly, or
        cut a 128x128 FP8 block across ranks: each rank's rows of q_b / kv_b / w1 / w3 and columns of o_proj / w2."""
        H, qk, D, V = self.n_heads, self.qk_head_dim, self.qk_nope_head_dim, self.v_head_dim
        rules = [("n_heads", H, n), ("n_routed_experts", self.n_routed_experts, n), ("vocab_size", self.vocab_size, n),
                 ("q_b_proj rows (n_heads * qk_head_dim)", H * qk, n * BLOCK),
                 ("kv_b_proj rows (n_heads * (qk_nope_head_dim + v_head_dim))", H * (D + V), n * BLOCK),
                 ("o_proj columns (n_heads * v_head_dim)", H * V, n * BLOCK),
                 ("inter_dim", self.inter_dim if self.n_dense_layers else 0, n * BLOCK),
                 ("shared expert width (moe_inter_dim * n_shared_experts)", self.moe_inter_dim * self.n_shared_experts,
                  n * BLOCK)]
        for what, v, d in rules:
            require(v % d == 0, f"tensor parallel size {n}: {what} = {v} must be a multiple of {d}"
                    + (f" (whole {BLOCK}-wide FP8 blocks per rank)" if d > n else ""))

    @classmethod
    def label(cls, name):                      # our field name, and the config.json one where it differs
        hf = {v: k for k, v in cls.HF_NAMES.items()} | {v: f"rope_scaling.{k}" for k, v in cls.ROPE_NAMES.items()}
        return f"{name} ({hf[name]})" if hf.get(name, name) != name else name

    qk_head_dim = property(lambda self: self.qk_nope_head_dim + self.qk_rope_head_dim)

    @property
    def softmax_scale(self):
        """MLA softmax scale: qk_head_dim^-0.5 times the YaRN mscale squared (0.13523 for the 671B model)."""
        m = 0.1 * self.mscale * math.log(self.rope_factor) + 1.0
        return self.qk_head_dim ** -0.5 * m * m

    @classmethod
    def from_json(cls, path):
        """Build from an HF DeepSeek-V3.2 `config.json` (a file or the directory holding it)."""
        path = os.path.join(path, "config.json") if os.path.isdir(path) else path
        require(os.path.isfile(path), f"no config.json at {path}")
        hf = read_json(path)
        arch, q, rope = hf.get("architectures"), hf.get("quantization_config", {}), hf.get("rope_scaling") or {}
        if hf.get("model_type") != "deepseek_v32" and not (isinstance(arch, list) and "DeepseekV32ForCausalLM" in arch):
            raise ValueError(f"{path} is not a DeepSeek-V3.2 config (model_type={hf.get('model_type')!r})")
        if not isinstance(q, dict) or not isinstance(rope, dict):
            raise ValueError(f"{path}: quantization_config and rope_scaling must be JSON objects")
        for k, v in dict(scoring_func="sigmoid", topk_method="noaux_tc", hidden_act="silu", norm_topk_prob=True,
                         tie_word_embeddings=False).items():
            require(k not in hf or hf[k] == v, f"{path}: {k}={hf.get(k)!r} is not supported (DeepSeek-V3.2 uses {v!r})")
        require(q.get("quant_method") == "fp8" and q.get("fmt", "e4m3") == "e4m3" and q.get("weight_block_size") ==
                [BLOCK, BLOCK], f"{path}: expected quantization_config fp8 e4m3 with weight_block_size [128, 128]")
        if q.get("scale_fmt", "ue8m0") != "ue8m0":     # activation scales are powers of two (ue8m0) here
            raise ValueError(f"{path}: scale_fmt {q['scale_fmt']!r} is not supported (DeepSeek-V3.2 uses 'ue8m0')")
        require(rope.get("type", rope.get("rope_type")) == "yarn", f"{path}: expected rope_scaling of type yarn")
        names = {f.name for f in fields(cls)}
        kw = {cls.HF_NAMES.get(k, k): v for k, v in hf.items() if cls.HF_NAMES.get(k, k) in names}
        kw.update({ours: rope[k] for k, ours in cls.ROPE_NAMES.items() if k in rope})
        try:
            return cls(**kw)
        except ValueError as e:
            raise ValueError(f"{path}: invalid DeepSeek-V3.2 config: {e}") from None

    def to_hf(self):
        """The HF config.json dict, in the official checkpoint's layout."""
        inv = {v: k for k, v in self.HF_NAMES.items()}
        return dict(architectures=["DeepseekV32ForCausalLM"], model_type="deepseek_v32",
                    transformers_version="4.44.2", num_key_value_heads=self.n_heads, attention_bias=False,
                    attention_dropout=0.0, moe_layer_freq=1, scoring_func="sigmoid", topk_method="noaux_tc",
                    norm_topk_prob=True, ep_size=1, hidden_act="silu", initializer_range=0.02,
                    tie_word_embeddings=False, torch_dtype="bfloat16", use_cache=True,
                    **{inv.get(f.name, f.name): getattr(self, f.name) for f in fields(self)
                       if f.name not in self.ROPE_NAMES.values()},
                    rope_scaling=dict(type="yarn", mscale_all_dim=self.mscale,
                                      **{k: getattr(self, ours) for k, ours in self.ROPE_NAMES.items()}),
                    quantization_config=dict(quant_method="fp8", fmt="e4m3", activation_scheme="dynamic",
                                             weight_block_size=[BLOCK, BLOCK], scale_fmt="ue8m0"))

    @classmethod
    def full(cls, n_layers=61):
        """The 671B shapes; n_layers < 61 gives the full-width, few-layer model used for GPU benchmarks."""
        return cls(n_layers=n_layers, n_dense_layers=min(3, max(1, n_layers - 1)))

    @classmethod
    def tiny(cls, **kw):
        """A few layers (first one dense), 8 experts in 4 groups, small dims, index_topk=32: for CPU tests."""
        return cls(**{**dict(vocab_size=288, dim=256, inter_dim=512, moe_inter_dim=128, n_layers=3, n_dense_layers=1,
                             n_heads=4, n_routed_experts=8, n_activated_experts=2, n_expert_groups=4,
                             n_limited_groups=2, q_lora_rank=128, kv_lora_rank=256, qk_nope_head_dim=32,
                             v_head_dim=32, index_n_heads=4, index_topk=32), **kw})


# ---- Checkpoint format: the official HF names, shapes and dtypes (spec section 2) --------------------------------
# kinds: "fp8" = float8_e4m3fn weight + float32 `weight_scale_inv` per 128x128 block; "bf16" = plain bf16 matrix;
# "norm" = norm weight (bf16, or fp32 in some conversions); "f32" = fp32 vector (router bias).
ALLOWED_DTYPES = {"fp8": (FP8,), "scale": (torch.float32,), "bf16": (BF16,), "norm": (BF16, torch.float32),
                  "f32": (torch.float32,)}


def checkpoint_tensors(cfg: Config):
    """{HF tensor name: (shape, kind)} for every tensor of the official checkpoint, scales included."""
    H, I, J, dim = cfg.n_heads, cfg.index_n_heads, cfg.index_head_dim, cfg.dim
    Q, C, R = cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    t = {"model.embed_tokens.weight": ([cfg.vocab_size, dim], "bf16")}
    for i in range(cfg.n_layers + cfg.n_mtp_layers):
        p, a = f"model.layers.{i}.", f"model.layers.{i}.self_attn."
        if i >= cfg.n_layers:   # MTP layer (spec 2.3): its own embedding/head copies, norms, eh_proj, a MoE block
            t.update({p + "embed_tokens.weight": ([cfg.vocab_size, dim], "bf16"),
                      p + "enorm.weight": ([dim], "norm"), p + "hnorm.weight": ([dim], "norm"),
                      p + "eh_proj.weight": ([dim, 2 * dim], "bf16"), p + "shared_head.norm.weight": ([dim], "norm"),
                      p + "shared_head.head.weight": ([cfg.vocab_size, dim], "bf16")})
        t.update({p + "input_layernorm.weight": ([dim], "norm"), a + "q_a_proj.weight": ([Q, dim], "fp8"),
                  a + "q_a_layernorm.weight": ([Q], "norm"), a + "q_b_proj.weight": ([H * cfg.qk_head_dim, Q], "fp8"),
                  a + "kv_a_proj_with_mqa.weight": ([C + R, dim], "fp8"), a + "kv_a_layernorm.weight": ([C], "norm"),
                  a + "kv_b_proj.weight": ([H * (cfg.qk_nope_head_dim + cfg.v_head_dim), C], "fp8"),
                  a + "o_proj.weight": ([dim, H * cfg.v_head_dim], "fp8"),
                  a + "indexer.wq_b.weight": ([I * J, Q], "fp8"), a + "indexer.wk.weight": ([J, dim], "fp8"),
                  a + "indexer.k_norm.weight": ([J], "norm"), a + "indexer.k_norm.bias": ([J], "norm"),
                  a + "indexer.weights_proj.weight": ([I, dim], "bf16"),
                  p + "post_attention_layernorm.weight": ([dim], "norm")})
        mlps = {"mlp.": cfg.inter_dim}
        if i >= cfg.n_dense_layers:                     # MoE: router, routed experts, shared expert
            t[p + "mlp.gate.weight"] = ([cfg.n_routed_experts, dim], "bf16")
            t[p + "mlp.gate.e_score_correction_bias"] = ([cfg.n_routed_experts], "f32")
            mlps = {f"mlp.experts.{e}.": cfg.moe_inter_dim for e in range(cfg.n_routed_experts)}
            mlps["mlp.shared_experts."] = cfg.moe_inter_dim * cfg.n_shared_experts
        for m, inter in mlps.items():
            t[p + m + "gate_proj.weight"] = t[p + m + "up_proj.weight"] = ([inter, dim], "fp8")
            t[p + m + "down_proj.weight"] = ([dim, inter], "fp8")
    t["model.norm.weight"], t["lm_head.weight"] = ([dim], "norm"), ([cfg.vocab_size, dim], "bf16")
    for name, (shape, kind) in list(t.items()):
        if kind == "fp8":
            t[name + "_scale_inv"] = ([-(-shape[0] // BLOCK), -(-shape[1] // BLOCK)], "scale")
    return t


# HF name -> our module name, in one place (the reference's convert.py mapping, plus the MTP layer)
HF_TO_OURS = {"embed_tokens": "embed", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
              "q_a_proj": "wq_a", "q_a_layernorm": "q_norm", "q_b_proj": "wq_b", "kv_a_proj_with_mqa": "wkv_a",
              "kv_a_layernorm": "kv_norm", "kv_b_proj": "wkv_b", "o_proj": "wo", "gate_proj": "w1",
              "down_proj": "w2", "up_proj": "w3", "lm_head": "head", "self_attn": "attn", "mlp": "ffn",
              "weight_scale_inv": "scale", "e_score_correction_bias": "bias"}
MTP_OWN = {"embed_tokens", "enorm", "hnorm", "eh_proj", "shared_head"}   # MTP-layer names outside its block
EXPERT = re.compile(r"(.*\.experts)\.(\d+)\.(w[123])\.(weight|scale)$")


def ours_name(cfg: Config, hf_name: str) -> str:
    parts = hf_name.removeprefix("model.").split(".")
    if parts[0] == "layers" and int(parts[1]) >= cfg.n_layers:       # MTP layer: its decoder block is `block`
        parts = ["mtp", str(int(parts[1]) - cfg.n_layers)] + ([] if parts[2] in MTP_OWN else ["block"]) + parts[2:]
    return ".".join(HF_TO_OURS.get(p, p) for p in parts)


def load_target(params, cfg: Config, hf_name: str):
    """The model tensor a checkpoint tensor is loaded into: its parameter, or a routed expert's slice of the stacked
    weights (gate_proj -> w13[e, :I], up_proj -> w13[e, I:], down_proj -> w2[e]); None for another rank's expert."""
    key = ours_name(cfg, hf_name)
    hit = EXPERT.match(key)
    if not hit:
        return params[key]
    base, e, w, kind = hit.groups()
    stack = params[f"{base}.{'w2' if w == 'w2' else 'w13'}.{kind}"]          # [E_r, ...]: this rank's experts
    e = int(e) - tp_rank() * len(stack)
    if not 0 <= e < len(stack):
        return None
    rows = cfg.moe_inter_dim // (BLOCK if kind == "scale" else 1)
    return stack[e] if w == "w2" else stack[e].narrow(0, rows * (w == "w3"), rows)


def _per_element(scale: torch.Tensor, shape) -> torch.Tensor:
    """Block scales [ceil(out/128), ceil(in/128)] -> one scale per weight element [out, in] (edge blocks cut)."""
    return scale.repeat_interleave(BLOCK, 0)[:shape[0]].repeat_interleave(BLOCK, 1)[:, :shape[1]]


def quantize_weight(w: torch.Tensor):
    """fp32 [out, in] -> (float8_e4m3fn weight, float32 scale_inv [ceil(out/128), ceil(in/128)]), pow2 scales."""
    ro, ri = -(-w.shape[0] // BLOCK), -(-w.shape[1] // BLOCK)
    pad = F.pad(w.float(), (0, ri * BLOCK - w.shape[1], 0, ro * BLOCK - w.shape[0]))
    amax = pad.view(ro, BLOCK, ri, BLOCK).abs().amax(dim=(1, 3)).clamp(min=1e-4)
    scale = pow2_ceil(amax / FP8_MAX)                                   # ue8m0: scales are powers of two
    return (w / _per_element(scale, w.shape)).to(FP8), scale


def weight_dequant(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """W[r, c] = fp8 W8[r, c] * scale_inv[r // 128, c // 128], in fp32 (exact: fp8 has a 4-bit significand)."""
    return w.float() * _per_element(scale, w.shape)


def random_weight(name: str, shape, kind: str, seed: int, device="cpu") -> torch.Tensor:
    """The reproducible fp32 source of one checkpoint tensor, scaled so activations stay O(1) through layers."""
    if name.endswith("shared_head.head.weight"):   # the MTP layer stores copies of the main embedding and head
        name = "lm_head.weight"
    elif name.endswith("embed_tokens.weight"):
        name = "model.embed_tokens.weight"
    g = torch.Generator(device).manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    x = torch.randn(shape, generator=g, device=device)
    if kind == "norm":
        return (1.0 + 0.1 * x) if name.endswith("weight") else 0.1 * x      # LayerNorm bias is small
    if kind == "f32":
        return 0.05 * x                                                    # router bias: selection only
    return x if "embed_tokens" in name else x * shape[1] ** -0.5            # else unit-gain projections


def stored_dtype(name, kind):
    """dtype of a non-FP8 tensor in the checkpoint: k_norm and the router bias are fp32, the rest bf16."""
    return torch.float32 if kind == "f32" or ".k_norm." in name else BF16


def save_random_checkpoint(path, config: Config, seed: int = 0, shard_bytes: int = 4 << 30, tokenizer=True,
                           device="cpu", weights=None):
    """Write a random-weight DeepSeek-V3.2 checkpoint in the official HF layout (config.json, sharded safetensors and
    index, FP8 weights with pow2 128x128 block scales). device: where values are drawn (cuda: others, same format).
    weights: {HF name: tensor} of a trained model, written through the same FP8 path (tools/train_demo.py)."""
    from safetensors.torch import save_file
    from tqdm import tqdm
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config.to_hf(), f, indent=2)
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump(dict(bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id, do_sample=True,
                       temperature=1.0, top_p=0.95), f, indent=2)
    if tokenizer:
        write_byte_tokenizer(path, config.vocab_size)
    shards, cur, total = [], {}, 0          # shards: the tensor names of each shard written so far
    spec = {k: v for k, v in checkpoint_tensors(config).items() if v[1] != "scale"}
    for i, (name, (shape, kind)) in enumerate(tqdm(spec.items(), desc="writing checkpoint", unit="tensor",
                                                   leave=False)):
        w = random_weight(name, shape, kind, seed, device) if weights is None else weights[name].float()
        assert list(w.shape) == shape, f"{name}: shape {list(w.shape)}, the checkpoint needs {shape}"
        w = zip((name, name + "_scale_inv"), quantize_weight(w)) if kind == "fp8" else \
            [(name, w.to(stored_dtype(name, kind)))]
        cur.update({n: t.cpu().contiguous() for n, t in w})
        size = sum(t.numel() * t.element_size() for t in cur.values())
        if size >= shard_bytes or i == len(spec) - 1:   # the shard count is known only at the end: temporary names
            save_file(cur, os.path.join(path, f".shard{len(shards)}.tmp"), metadata={"format": "pt"})
            shards.append(list(cur))
            cur, total = {}, total + size
    weight_map = {}
    for i, names in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        os.replace(os.path.join(path, f".shard{i}.tmp"), os.path.join(path, fname))
        weight_map.update(dict.fromkeys(names, fname))
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, f, indent=2)


# ---- Tensor and expert parallelism (torchrun): each rank holds a shard of the weights, runs the same schedule ---
# Split by rank: MLA heads, dense MLP and shared expert (w1 / w3 rows, w2 columns), routed experts (by index range),
# vocabulary. Replicated: the rest, the indexer and latent KV cache included (every rank selects the same positions).
# One all-reduce per block half (Block), one all-gather of the logits; sampling is identical on every rank.
def init_distributed(device: torch.device) -> torch.device:
    """Under torchrun (WORLD_SIZE > 1): join the ranks once (NCCL on CUDA, gloo on CPU); take GPU LOCAL_RANK."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
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
    """x [..., n] of every rank concatenated in rank order -> [..., ranks * n] (the vocabulary slices of logits)."""
    if tp_size() == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(tp_size())]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, -1)


def end_distributed(graphed):
    """Leave torchrun's process group. NCCL cannot destroy a communicator whose collectives CUDA graphs captured
    (destroy_process_group hangs: pytorch issue 115388), so then the ranks only meet once more and exit."""
    if dist.is_initialized() and graphed:
        dist.barrier()
    elif dist.is_initialized():
        dist.destroy_process_group()


def rank_slice(full, part):
    """The index of this rank's part of a checkpoint tensor of shape `full`, for a parameter of shape `part`: along
    the dimension the layer split (where part is smaller), the rank-th block of that size; the rest whole."""
    r = tp_rank()
    return tuple(slice(None) if f == p else slice(r * p, r * p + p) for f, p in zip(full, part))


# ---- Building blocks: FP8 activation quantization and linear, norms, YaRN RoPE, Hadamard -------------------------
def pow2_ceil(x: torch.Tensor) -> torch.Tensor:
    """Smallest power of two >= x (x > 0), exactly (the reference's exponent bit trick, via frexp)."""
    m, e = torch.frexp(x)                                                   # x = m * 2^e, m in [0.5, 1)
    return torch.ldexp(torch.ones_like(x), torch.where(m == 0.5, e - 1, e))


def act_quant(x: torch.Tensor):
    """Per-row, per-128-column FP8 quantization with power-of-two (ue8m0) scales, as the reference `act_quant`:
    x [..., n] bf16 -> (q [..., n] float8_e4m3fn, s [..., n/128] float32) with x ~= q * s."""
    g = x.float().unflatten(-1, (-1, BLOCK))                                # [..., n/128, 128]
    amax = g.abs().amax(-1).clamp(min=1e-4)
    s = pow2_ceil(amax * torch.tensor(1 / FP8_MAX, dtype=torch.float32))  # fp32 constant, as in the kernel
    q = (g / s[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)                 # round to nearest even
    return q.flatten(-2), s


def act_dequant(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """q [..., n] fp8, s [..., n/128] -> fp32 values (exact)."""
    return (q.float().unflatten(-1, (-1, BLOCK)) * s[..., None]).flatten(-2)


def acc_dtype(x: torch.Tensor):
    """Accumulation dtype of matmuls: fp32 as the reference on GPU. On CPU fp64, the exact limit of any fp32
    summation order: results then do not depend on batch shape, so engine modes can be compared token for token."""
    return torch.float64 if x.device.type == "cpu" else torch.float32


def fp8_linear(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, partial=False) -> torch.Tensor:
    """y = act_quant(x) @ W^T for a block-scaled FP8 weight, bf16 out (partial: the unrounded accumulator, rounded
    after the all-reduce). Pow2 scales keep both operands exact: it equals the reference `fp8_gemm` up to sum order."""
    acc = acc_dtype(x)                                    # act_quant is never skipped: 3-bit mantissa error
    y = F.linear(act_dequant(*act_quant(x)).to(acc), weight_dequant(w, scale).to(acc))
    return y if partial else y.to(BF16)


def _param(*shape, dtype):
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)   # inference only: no grads


def dense_linear(x, w):
    """x W^T for a plain (bf16 / fp32) weight, fp32 out; callers round if needed."""
    return F.linear(x.to(acc_dtype(x)), w.to(acc_dtype(x))).float()


class Linear(nn.Module):
    """x W^T. fp8=True: float8_e4m3fn weight + float32 `scale` per 128x128 block; else a plain `dtype` weight. n: a
    stack of n weights [n, out, in] (the routed experts, read by the MoE kernel). split: 'col' this rank holds out /
    ranks rows, 'row' in / ranks columns (the output is a partial sum the caller all-reduces), None all of it."""
    ops = None                   # bound once by Transformer.bind (fp8_linear / dense_linear)

    def __init__(self, in_features, out_features, fp8=True, dtype=BF16, n=None, split=None):
        super().__init__()
        self.partial = split == "row"                   # output unrounded: rounded after the all-reduce
        out = out_features // tp_size() if split == "col" else out_features
        inp = in_features // tp_size() if split == "row" else in_features
        stack = [n] if n else []
        self.weight = _param(*stack, out, inp, dtype=FP8 if fp8 else dtype)
        self.scale = _param(*stack, -(-out // BLOCK), -(-inp // BLOCK), dtype=torch.float32) if fp8 else None

    def forward(self, x):
        return self.ops.dense_linear(x, self.weight) if self.scale is None else \
            self.ops.fp8_linear(x, self.weight, self.scale, self.partial)


class RMSNorm(nn.Module):
    """RMSNorm in fp32 with an fp32 weight. With `residual`: adds it first (fp32), and returns the new residual
    stream rounded to bf16, as the reference's fused form."""
    def __init__(self, dim, eps):
        super().__init__()
        self.eps, self.weight = eps, _param(dim, dtype=torch.float32)

    def forward(self, x, residual=None):
        x = x.float() if residual is None else x.float() + residual.float()
        y = (self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))).to(BF16)
        return y if residual is None else (y, x.to(BF16))


class Embedding(nn.Module):
    """Vocabulary-parallel: a rank holds vocab / ranks rows; tokens outside them add zeros to the all-reduce."""
    def __init__(self, vocab, dim):
        super().__init__()
        self.weight = _param(vocab // tp_size(), dim, dtype=BF16)

    def forward(self, tokens):
        local = tokens - tp_rank() * self.weight.shape[0]
        mine = (local >= 0) & (local < self.weight.shape[0])
        return all_reduce(F.embedding(local.clamp(0, self.weight.shape[0] - 1), self.weight) * mine[..., None])


_FREQS = {}                                      # f'_i on each device, by the config fields they depend on


def rope_cos_sin(cfg: Config, positions: torch.Tensor):
    """cos/sin of theta[t, i] = fp32(t) * f'_i, each [T, R/2] fp32, with f'_i the YaRN-corrected inverse frequencies
    (spec 3.5): low dims unchanged, high dims / factor. (mscale goes into the softmax scale only.)"""
    d, base = cfg.qk_rope_head_dim, cfg.rope_theta
    key = (d, base, cfg.rope_factor, cfg.original_seq_len, cfg.max_seq_len, cfg.beta_fast, cfg.beta_slow,
           positions.device)
    if key not in _FREQS:                        # once per device: a CUDA graph cannot copy from the host
        freqs = 1.0 / (base ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
        corr = lambda n: d * math.log(cfg.original_seq_len / (n * 2 * math.pi)) / (2 * math.log(base))  # noqa: E731
        low, high = max(math.floor(corr(cfg.beta_fast)), 0), min(math.ceil(corr(cfg.beta_slow)), d - 1)
        ramp = ((torch.arange(d // 2, dtype=torch.float32) - low) / (high - low if high > low else 0.001)).clamp(0, 1)
        _FREQS[key] = (freqs / cfg.rope_factor * ramp + freqs * (1 - ramp)).to(positions.device)
    theta = positions.float()[:, None] * _FREQS[key][None, :]
    return theta.cos(), theta.sin()


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """Rotate x [T, ..., R] by position. interleaved (MLA): pairs (x[2i], x[2i+1]); half-split (indexer):
    pairs (x[i], x[i + R/2]). fp32 math, bf16 out."""
    x1, x2 = (x[..., 0::2].float(), x[..., 1::2].float()) if interleaved else x.float().chunk(2, dim=-1)
    shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[1],)       # broadcast over heads
    cos, sin = cos.view(shape), sin.view(shape)
    o1, o2 = x1 * cos - x2 * sin, x1 * sin + x2 * cos
    return (torch.stack((o1, o2), -1).flatten(-2) if interleaved else torch.cat((o1, o2), -1)).to(BF16)


def hadamard(x: torch.Tensor) -> torch.Tensor:
    """Walsh-Hadamard transform over the last dim in Sylvester order, scaled by n^-0.5 (x @ H_n / sqrt(n));
    fp32 math, bf16 in/out. Orthogonal: it keeps dot products and spreads outliers before FP8 quantization."""
    n, y, h = x.shape[-1], x.float(), 1
    while h < n:                                       # butterfly: pairs (i, i + h) inside blocks of 2h
        y = y.unflatten(-1, (n // (2 * h), 2, h))
        y = torch.stack((y[..., 0, :] + y[..., 1, :], y[..., 0, :] - y[..., 1, :]), dim=-2).flatten(-3)
        h *= 2
    return (y * n ** -0.5).to(BF16)


# ---- Forward metadata and the per-layer cache view ---------------------------------------------------------------
def to_device(x: torch.Tensor, device) -> torch.Tensor:
    """Host -> device without waiting: a copy from pageable memory blocks the host until the GPU reaches it, so the
    engine could never run ahead of the GPU. (torch reuses a pinned block only once its copy has run.)"""
    return x.pin_memory().to(device, non_blocking=True) if torch.device(device).type == "cuda" else x.to(device)


@dataclass
class Meta:
    """Everything a forward pass needs to know about its batch, built once per step, shared by every layer. mode
    'prefill': rows are chunks of prompts; 'decode' / 'verify': each row is its own query (1 or k+1 per request)."""
    mode: str
    positions: torch.Tensor      # [T] absolute position of each row's token
    slots: torch.Tensor          # [T] KV-pool slot the row's token is written to
    row_req: torch.Tensor        # [T] request (row of `table`) each row belongs to
    table: torch.Tensor          # [B, N] KV-pool slot of every context position of each request (page size 1)
    ctx_lens: torch.Tensor       # [T] causal length of each row = position + 1
    cu_seqlens: list             # [B + 1] host: row offsets of each request
    ctx_host: torch.Tensor       # [T] ctx_lens on the host (the kernels' schedule is planned from it)
    max_ctx: int                 # the longest row context (host); under a CUDA graph, the bound it was captured for
    plan: object = None          # the attention kernel's plan for these rows (ops.plan), made once per step
    graphed: bool = False        # the tensors are a CUDA graph's static buffers (ops.plan keeps its own fixed too)

    @classmethod
    def build(cls, mode, starts, lens, table):
        """Request b has rows for positions starts[b] .. starts[b] + lens[b] - 1."""
        positions = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, lens)])
        row_req = to_device(torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens)), table.device)
        pos = to_device(positions, table.device)
        return cls(mode, pos, table[row_req, pos], row_req, table, pos + 1, list(accumulate(lens, initial=0)),
                   positions + 1, int(positions.max()) + 1)

    def step(self, j):
        """The same rows j positions later: the draft steps of a round shift one Meta instead of rebuilding it."""
        pos = self.positions + j
        return replace(self, positions=pos, slots=self.table[self.row_req, pos], ctx_lens=self.ctx_lens + j,
                       ctx_host=self.ctx_host + j, max_ctx=self.max_ctx + j, plan=None)

    def dense(self, index_topk):
        """Prompt chunks whose whole context fits in top-k: DSA selects every position, so attention is plain causal
        attention (per-head form). Every other row, prefill rows included, runs the sparse absorbed form."""
        return self.mode == "prefill" and self.max_ctx <= index_topk

    def request_rows(self):                                # the row slice of each request
        return [slice(a, b) for a, b in zip(self.cu_seqlens[:-1], self.cu_seqlens[1:])]


@dataclass
class LayerCache:
    latent: torch.Tensor         # [S, C + R] bf16  one row per slot: normalized latent (FP8-rounded) | rope key
    ik: torch.Tensor             # [S, J] fp8   indexer key
    iks: torch.Tensor            # [S]    fp32  indexer key scale
    C: int                       # kv_lora_rank
    kv = property(lambda self: self.latent[:, :self.C])   # [S, C] a view: kernels read `latent` whole or split
    pe = property(lambda self: self.latent[:, self.C:])   # [S, R]


# ---- Lightning indexer (DSA): picks the top-K context positions for every query row (spec 3.7) -------------------
def index_quant(x):
    """The indexer's q and k before scoring: Hadamard, then FP8 with one power-of-two scale per 128-vector."""
    return act_quant(hadamard(x))


def index_scores(q8, w, k8, ks):
    """I[t, n] = ks[n] * sum_h w[t, h] * relu(q8[t, h] . k8[n]), fp32 (the reference `fp8_index`).
    q8 [T, I, J] fp8; w [T, I] fp32 (head weight with the q scale folded in); k8 [T or 1, N, J]; ks [T or 1, N]."""
    acc = acc_dtype(q8)
    logits = torch.matmul(q8.to(acc), k8.to(acc).transpose(-1, -2))        # [T, I, N] fp8 products, exact sums
    return ((logits.relu() * w[..., None]).sum(1) * ks).float()            # [T, N] fp32


def topk_positions(scores, ctx_lens, k):
    """Top-min(k, N) positions of each row among its causal context (n < ctx_lens[t]); -1 pads short rows."""
    n = torch.arange(scores.shape[-1], device=scores.device)
    scores = scores.masked_fill(n[None, :] >= ctx_lens[:, None], float("-inf"))   # causal mask before top-k
    # Ties (exact zeros from the ReLU are common) go to the earliest position, whatever the batch shape: the
    # reference's torch.topk breaks them in an implementation-defined order.
    idx = scores.sort(dim=-1, descending=True, stable=True).indices[:, :min(k, scores.shape[-1])]
    return torch.where(idx < ctx_lens[:, None], idx, -1)


def index_topk(q8, w, cache: LayerCache, meta: Meta, k):
    """Reference of the lightning-indexer kernel: score each row's causal context against the cached FP8 keys
    and keep its top-min(k, N) positions [T, min(k, N)] (-1 = none; N = the longest row context)."""
    if meta.mode == "prefill":                           # a prompt chunk's rows share their request's keys
        out = []
        for b, r in enumerate(meta.request_rows()):
            ctx = meta.table[b, :int(meta.ctx_lens[r].max())]                             # [N] slots
            s = index_scores(q8[r], w[r], cache.ik[ctx][None], cache.iks[ctx][None])
            out.append(topk_positions(s, meta.ctx_lens[r], k))
        return torch.cat([F.pad(o, (0, min(k, meta.max_ctx) - o.shape[1]), value=-1) for o in out])
    ctx = meta.table[meta.row_req, :meta.max_ctx]        # decode/verify: flattened rows [T, N]
    return topk_positions(index_scores(q8, w, cache.ik[ctx], cache.iks[ctx]), meta.ctx_lens, k)


class Indexer(nn.Module):
    ops = None                   # the kernel set (TORCH_OPS or kernels.GPU_OPS), bound once by Transformer.bind

    def __init__(self, cfg: Config):
        super().__init__()
        self.cfg, self.wq_b = cfg, Linear(cfg.q_lora_rank, cfg.index_n_heads * cfg.index_head_dim)
        self.wk = Linear(cfg.dim, cfg.index_head_dim)
        self.k_norm = nn.LayerNorm(cfg.index_head_dim, cfg.eps).requires_grad_(False)    # fp32 weight and bias
        self.weights_proj = Linear(cfg.dim, cfg.index_n_heads, fp8=False, dtype=torch.float32)

    def forward(self, x, qr, cos, sin, meta: Meta, cache: LayerCache):
        """-> [T, min(K, N)] selected context positions per row (-1 = none), or None for a dense prompt chunk.
        Writes this pass's keys first, so every row can select its own token."""
        cfg, T, R = self.cfg, x.shape[0], self.cfg.qk_rope_head_dim
        quant = lambda t: self.ops.index_quant(  # noqa: E731   rope on the FIRST R dims, then Hadamard and FP8
            torch.cat([rope(t[..., :R], cos, sin, interleaved=False), t[..., R:]], -1))
        k8, ks = quant(self.k_norm(self.wk(x).float()).to(BF16))                  # [T, J] fp8, [T, 1]
        cache.ik[meta.slots], cache.iks[meta.slots] = k8, ks[:, 0]
        if meta.dense(cfg.index_topk):                   # the whole context is selected: only the keys are needed
            return None
        if meta.max_ctx <= cfg.index_topk:               # every row selects its whole context (SGLang skips too)
            n = torch.arange(meta.max_ctx, device=x.device)
            return torch.where(n < meta.ctx_lens[:, None], n, -1)
        q8, qs = quant(self.wq_b(qr).view(T, cfg.index_n_heads, cfg.index_head_dim))  # [T, I, J] fp8, [T, I, 1]
        w = self.weights_proj(x) * cfg.index_n_heads ** -0.5 * qs[..., 0] * cfg.index_head_dim ** -0.5  # [T, I]
        return self.ops.index_topk(q8, w, cache, meta, cfg.index_topk)


# ---- MLA: multi-head latent attention over the indexer's selection (spec 3.6, 3.8) -------------------------------
def sparse_mla(q_abs, q_pe, cache: LayerCache, slots, meta: Meta, scale):
    """Absorbed ("MQA") sparse attention, one query row per token: the reference of the sparse MLA decode kernel.
    q_abs [T, H, C] (q_nope already multiplied into the latent space), q_pe [T, H, R]; slots [T, K] each row's
    selected KV-pool slots (-1 = none; the valid ones first) -> o_lat [T, H, C] fp32. (`meta.plan` is the kernel's.)"""
    valid, acc = slots >= 0, acc_dtype(q_abs)
    kv, pe = cache.kv[slots.clamp(min=0)].to(acc), cache.pe[slots.clamp(min=0)].to(acc)  # [T, K, C], [T, K, R]
    scores = (q_abs.to(acc) @ kv.transpose(1, 2) + q_pe.to(acc) @ pe.transpose(1, 2)) * scale  # [T, H, K]
    return (scores.masked_fill(~valid[:, None, :], float("-inf")).softmax(-1) @ kv).float()   # [T, H, C]


def dense_attention(q, k, v, scale):
    """Causal per-head attention of a prompt chunk (the reference of the dense prefill kernel): q [S, H, E] the last
    S of N positions, k [N, H, E], v [N, H, V] -> [S, H, V]; row i sees keys 0 .. N - S + i."""
    S, N = q.shape[0], k.shape[0]
    scores = torch.einsum("shd,nhd->hsn", q, k) * scale
    future = torch.arange(N, device=q.device) > torch.arange(S, device=q.device)[:, None] + (N - S)
    return torch.einsum("hsn,nhv->shv", scores.masked_fill(future, float("-inf")).softmax(-1), v)


class MLA(nn.Module):
    ops = None                   # bound once by Transformer.bind, as Indexer.ops
    wkv_b_abs = None             # [H, D + V, C] wkv_b dequantized once at bind: W_UK | W_UV (exact in bf16)

    def __init__(self, cfg: Config):
        super().__init__()
        self.cfg, H = cfg, cfg.n_heads   # split over ranks: q_b / kv_b rows and o_proj columns of this rank's heads
        self.wq_a, self.q_norm = Linear(cfg.dim, cfg.q_lora_rank), RMSNorm(cfg.q_lora_rank, cfg.eps)
        self.wq_b = Linear(cfg.q_lora_rank, H * cfg.qk_head_dim, split="col")
        self.wkv_a = Linear(cfg.dim, cfg.kv_lora_rank + cfg.qk_rope_head_dim)
        self.kv_norm = RMSNorm(cfg.kv_lora_rank, cfg.eps)
        self.wkv_b = Linear(cfg.kv_lora_rank, H * (cfg.qk_nope_head_dim + cfg.v_head_dim), split="col")
        self.wo, self.indexer = Linear(H * cfg.v_head_dim, cfg.dim, split="row"), Indexer(cfg)

    def forward(self, x, cos, sin, meta: Meta, cache: LayerCache):
        """-> this rank's heads' part of the output projection [T, dim], unrounded (Block sums it over ranks)."""
        cfg, T = self.cfg, x.shape[0]
        H, D, R, C = cfg.n_heads // tp_size(), cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.kv_lora_rank
        qr = self.q_norm(self.wq_a(x))                                   # [T, q_lora]; shared with the indexer
        q_nope, q_pe = self.wq_b(qr).view(T, H, D + R).split([D, R], -1)  # [T, H, D], [T, H, R]
        q_pe = rope(q_pe, cos, sin, interleaved=True)
        kv, k_pe = self.wkv_a(x).split([C, R], -1)                       # [T, C], [T, R]
        cache.kv[meta.slots] = act_dequant(*act_quant(self.kv_norm(kv))).to(BF16)   # cached as FP8 ([R] simulates)
        cache.pe[meta.slots] = rope(k_pe, cos, sin, interleaved=True)
        sel = self.indexer(x, qr, cos, sin, meta, cache)                 # [T, K'] context positions, -1 = none
        w = self.wkv_b_abs                                               # fp32/fp64 (torch path) or bf16 (kernels)
        # Attention math in fp32 (fp64 on CPU, see acc_dtype) where the reference rounds intermediates to bf16:
        # fused kernels keep fp32 too, and the per-head and absorbed forms become the same function.
        if sel is None:                                                  # prompt chunk within top-k: dense causal
            o = torch.cat([self.attend_dense(q_nope[r], q_pe[r], w, meta.table[b, :int(meta.ctx_host[r][-1])],
                                             cache) for b, r in enumerate(meta.request_rows())])
        else:                                                            # every other row: sparse, absorbed
            q_abs = torch.einsum("thd,hdc->thc", q_nope.to(w.dtype), w[:, :D])      # absorb W_UK: [T, H, C]
            slots = torch.where(sel >= 0, meta.table[meta.row_req[:, None], sel.clamp(min=0)], -1)
            o_lat = self.ops.sparse_mla(q_abs, q_pe, cache, slots, meta, cfg.softmax_scale)
            o = torch.einsum("thc,hvc->thv", o_lat.to(w.dtype), w[:, D:])          # absorb W_UV: [T, H, V]
        return self.wo(o.to(BF16).flatten(1))

    def attend_dense(self, q_nope, q_pe, w, ctx, cache):
        """Prefill ("MHA") form for one request's rows: expand the context's latents to per-head keys/values."""
        D = self.cfg.qk_nope_head_dim
        kvf = torch.einsum("nc,hec->nhe", cache.kv[ctx].to(w.dtype), w)         # [N, H, D + V]
        k = torch.cat([kvf[..., :D], cache.pe[ctx].to(w.dtype)[:, None, :].expand(-1, kvf.shape[1], -1)], -1)
        q = torch.cat([q_nope, q_pe], -1).to(w.dtype)
        return self.ops.dense_attention(q, k, kvf[..., D:], self.cfg.softmax_scale)   # [S, H, V]


# ---- Feed-forward: SwiGLU MLP and the sigmoid-routed, group-limited MoE (spec 3.4, 3.9) --------------------------
class MLP(nn.Module):
    """SwiGLU; a rank holds inter_dim / ranks of it: its output is an unrounded part of the sum (Block adds them)."""
    def __init__(self, dim, inter_dim):
        super().__init__()
        self.w1, self.w3 = Linear(dim, inter_dim, split="col"), Linear(dim, inter_dim, split="col")
        self.w2 = Linear(inter_dim, dim, split="row")

    def forward(self, x):
        return self.w2((F.silu(self.w1(x).float()) * self.w3(x).float()).to(BF16))


class Gate(nn.Module):
    """Sigmoid scores; the bias only steers selection: top groups by the sum of their top-2 biased scores,
    then top-A experts inside them; weights are the unbiased scores, renormalized, times route_scale."""
    def __init__(self, cfg: Config):
        super().__init__()
        self.cfg, self.weight = cfg, _param(cfg.n_routed_experts, cfg.dim, dtype=BF16)
        self.bias = _param(cfg.n_routed_experts, dtype=torch.float32)                    # selection only

    def forward(self, x):
        cfg, T = self.cfg, x.shape[0]
        s = F.linear(x.float(), self.weight.float()).sigmoid()                            # [T, E] fp32
        sb = (s + self.bias).view(T, cfg.n_expert_groups, -1)                             # [T, G, E/G]
        group_score = sb.topk(2, dim=-1).values.sum(-1)                                   # [T, G]
        keep = group_score.topk(cfg.n_limited_groups, dim=-1).indices                      # the kept groups
        drop = torch.ones_like(group_score, dtype=torch.bool).scatter_(1, keep, False)
        idx = sb.masked_fill(drop[..., None], float("-inf")).flatten(1).topk(cfg.n_activated_experts, -1).indices
        w = s.gather(1, idx)                                                               # [T, A]
        return w / w.sum(-1, keepdim=True) * cfg.route_scale, idx


def moe_experts(x, weights, idx, w13, s13, w2, s2):
    """The routed experts of a MoE layer (the reference of the grouped MoE kernel): each a SwiGLU MLP over the tokens
    that chose it, summed with their routing weights in fp32. x [T, dim] bf16; weights, idx [T, A]; w13
    [E, 2I, dim] (w1 | w3 fused), w2 [E, dim, I] FP8 with their block scales -> [T, dim] fp32."""
    y, inter = torch.zeros(x.shape, dtype=torch.float32, device=x.device), w2.shape[2]
    for e in idx[idx < len(w13)].unique().tolist():        # expert order 0..E-1; idx E: another rank's, skipped
        tok, j = (idx == e).nonzero(as_tuple=True)
        h = fp8_linear(x[tok], w13[e], s13[e])                                        # [n, 2I] bf16
        h = (F.silu(h[:, :inter].float()) * h[:, inter:].float()).to(BF16)
        y[tok] += fp8_linear(h, w2[e], s2[e]).float() * weights[tok, j, None]
    return y


class MoE(nn.Module):
    ops = None                   # bound once by Transformer.bind

    def __init__(self, cfg: Config):
        super().__init__()
        self.gate = Gate(cfg)
        E, inter = cfg.n_routed_experts // tp_size(), cfg.moe_inter_dim       # this rank's experts (expert parallel)
        self.experts = nn.Module()   # stacked: w13 = w1 | w3 fused [E, 2I, dim]; w2 [E, dim, I] (see load_target)
        self.experts.w13, self.experts.w2 = Linear(cfg.dim, 2 * inter, n=E), Linear(inter, cfg.dim, n=E)
        self.shared_experts = MLP(cfg.dim, cfg.moe_inter_dim * cfg.n_shared_experts)

    def forward(self, x):
        """-> this rank's part [T, dim], unrounded: its routed experts' weighted sum plus its slice of the shared expert
        (Block adds the parts, then rounds once; the reference rounds the shared expert's output to bf16 first)."""
        w, idx = self.gate(x)                                                              # [T, A] each (replicated)
        ex, E = self.experts, self.experts.w13.weight.shape[0]
        first = tp_rank() * E                                     # this rank holds experts first .. first + E - 1
        idx = torch.where((idx >= first) & (idx < first + E), idx - first, E)   # E: another rank's, skipped
        return self.ops.moe(x, w, idx, ex.w13.weight, ex.w13.scale, ex.w2.weight, ex.w2.scale) + self.shared_experts(x)


# ---- Block, Transformer, MTP layer (spec 3.10, 3.11) -------------------------------------------------------------
class Block(nn.Module):
    def __init__(self, cfg: Config, moe: bool):
        super().__init__()
        self.attn_norm, self.ffn_norm = RMSNorm(cfg.dim, cfg.eps), RMSNorm(cfg.dim, cfg.eps)
        self.attn, self.ffn = MLA(cfg), MoE(cfg) if moe else MLP(cfg.dim, cfg.inter_dim)

    def forward(self, x, residual, cos, sin, meta, cache):
        x, residual = (self.attn_norm(x), x) if residual is None else self.attn_norm(x, residual)
        # Each half's output is a sum of every rank's part, in fp32 (CPU: fp64), rounded to bf16 once: as at one
        # rank (the reference all-reduces bf16 parts, which makes the tokens depend on the number of ranks)
        x = all_reduce(self.attn(x, cos, sin, meta, cache)).to(BF16)
        x, residual = self.ffn_norm(x, residual)
        return all_reduce(self.ffn(x)).to(BF16), residual


class MTP(nn.Module):
    """Multi-token prediction layer: from the main model's final-normed hidden state at position i and the token
    at i+1, predict the token at i+2: block(eh_proj([enorm(emb(t_{i+1})); hnorm(h_i)])) -> norm -> head."""
    def __init__(self, cfg: Config):
        super().__init__()
        self.cfg, self.embed = cfg, Embedding(cfg.vocab_size, cfg.dim)
        self.enorm, self.hnorm = RMSNorm(cfg.dim, cfg.eps), RMSNorm(cfg.dim, cfg.eps)
        self.eh_proj = Linear(2 * cfg.dim, cfg.dim, fp8=False)            # bf16, unquantized in the checkpoint
        self.block, self.shared_head = Block(cfg, moe=True), nn.Module()
        self.shared_head.norm = RMSNorm(cfg.dim, cfg.eps)
        self.shared_head.head = Linear(cfg.dim, cfg.vocab_size, fp8=False, dtype=torch.float32, split="col")

    def forward(self, next_tokens, h, meta: Meta, cache: LayerCache):
        """next_tokens [T] (t_{i+1}), h [T, dim] main hidden at i after the final norm -> normed hidden [T, dim].
        (vLLM zeroes the embedding at position 0; SGLang and this engine do not.)"""
        cos, sin = rope_cos_sin(self.cfg, meta.positions)
        u = self.eh_proj(torch.cat([self.enorm(self.embed(next_tokens)), self.hnorm(h)], -1)).to(BF16)
        x, residual = self.block(u, None, cos, sin, meta, cache)
        return self.shared_head.norm(x, residual)[0]                  # also the input of the next draft step

    def logits(self, h):
        return all_gather(self.shared_head.head(h))                   # fp32 [T, vocab] (vocabulary slices joined)


# ---- The kernel boundary: the few names through which the GPU path plugs in --------------------------------------
# Layers call these through `self.ops`. Transformer.bind points every layer at one set, once, at load: TORCH_OPS
# (the readable references above, on any device) or kernels.GPU_OPS (the same names and signatures).
TORCH_OPS = SimpleNamespace(
    name="torch reference",
    plan=lambda meta, cfg: None,          # (kernels: the attention schedule of a step's rows, made once per step)
    index_quant=index_quant,              # indexer q / k: Hadamard + FP8 quantization     (Indexer)
    index_topk=index_topk,                # indexer scores + causal mask + top-k           (Indexer)
    sparse_mla=sparse_mla,                # absorbed sparse attention, one row per token  (MLA: decode/verify/long)
    dense_attention=dense_attention,      # causal per-head attention of short prompts     (MLA: prefill)
    fp8_linear=fp8_linear,                # act-quant + block-scaled FP8 GEMM                (Linear)
    dense_linear=dense_linear,            # bf16/fp32 weights: lm_head, weights_proj, eh_proj (Linear)
    moe=moe_experts,                      # routed experts, grouped, weighted sum            (MoE)
    attn_dtype=acc_dtype,                 # dtype of wkv_b's absorbed halves (exact: pow2-scaled FP8 fits bf16)
    dense_dtype=lambda w: w.dtype)        # dtype plain Linear weights are kept in (kernels: bf16, as stored)


class Transformer(nn.Module):
    ops = TORCH_OPS

    def __init__(self, cfg: Config):
        super().__init__()
        cfg.check_tp(tp_size())
        self.cfg, self.embed = cfg, Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg, moe=i >= cfg.n_dense_layers) for i in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.eps)
        self.head = Linear(cfg.dim, cfg.vocab_size, fp8=False, dtype=torch.float32, split="col")   # fp32, as [R]
        self.mtp = nn.ModuleList(MTP(cfg) for _ in range(cfg.n_mtp_layers))

    def bind(self, ops):
        """Point every layer at one kernel set and prepare the weights it reads (once, after loading)."""
        for mod in self.modules():
            if hasattr(type(mod), "ops"):
                mod.ops = ops
            if isinstance(mod, Linear) and mod.scale is None:     # lm_head etc.: bf16 in the checkpoint
                mod.weight.data = mod.weight.data.to(ops.dense_dtype(mod.weight))
            if isinstance(mod, MLA):        # wkv_b dequantized once, split per head into W_UK | W_UV
                w = weight_dequant(mod.wkv_b.weight, mod.wkv_b.scale).to(ops.attn_dtype(mod.wkv_b.weight))
                mod.wkv_b_abs = w.view(-1, mod.cfg.qk_nope_head_dim + mod.cfg.v_head_dim, mod.cfg.kv_lora_rank)
        return self

    @torch.inference_mode()
    def forward(self, tokens, meta: Meta, cache: KVCache):
        """tokens [T] -> hidden [T, dim] bf16 after the final norm (the lm_head input, also what MTP consumes)."""
        meta.plan = meta.plan or self.ops.plan(meta, self.cfg)   # once per step: every layer and MTP pass reuse it
        cos, sin = rope_cos_sin(self.cfg, meta.positions)
        h, residual = self.embed(tokens), None
        for i, layer in enumerate(self.layers):
            h, residual = layer(h, residual, cos, sin, meta, cache.layer(i))
        return self.norm(h, residual)[0]

    def logits(self, h):
        return all_gather(self.head(h))                               # fp32 [T, vocab] (vocabulary slices joined)

    @torch.inference_mode()
    def mtp_forward(self, next_tokens, h, meta: Meta, cache: KVCache, j=0):
        meta.plan = meta.plan or self.ops.plan(meta, self.cfg)
        return self.mtp[j](next_tokens, h, meta, cache.layer(self.cfg.n_layers + j))


class KVCache:
    """The KV pool of every layer (main layers, then MTP layers), addressed by slot: the FP8-rounded latent and the
    rope key in one bf16 row (1152 B/token/layer at full size), the indexer key (FP8, 128 B) and its fp32 scale."""
    def __init__(self, cfg: Config, num_slots: int, device="cpu"):
        L, self.C = cfg.n_layers + cfg.n_mtp_layers, cfg.kv_lora_rank
        self.latent = torch.zeros(L, num_slots, cfg.kv_lora_rank + cfg.qk_rope_head_dim, dtype=BF16, device=device)
        self.ik = torch.zeros(L, num_slots, cfg.index_head_dim, dtype=FP8, device=device)
        self.iks = torch.zeros(L, num_slots, dtype=torch.float32, device=device)

    @staticmethod
    def bytes_per_token(cfg: Config):
        return (cfg.n_layers + cfg.n_mtp_layers) * (2 * (cfg.kv_lora_rank + cfg.qk_rope_head_dim)
                                                    + cfg.index_head_dim + 4)

    def layer(self, i):
        return LayerCache(self.latent[i], self.ik[i], self.iks[i], self.C)


# ---- Loader: reads any DeepSeek-V3.2 checkpoint directory shard by shard, validating every tensor ----------------
SAFETENSORS_DTYPES = {"F8_E4M3": FP8, "BF16": BF16, "F32": torch.float32}     # the ones DeepSeek-V3.2 uses


def _shard_files(path):
    """The shard files and, with an index, its weight map {tensor: file}."""
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
            raise ValueError(f"{index}: expected a weight_map of tensor name -> shard file name")
        files = sorted(set(weight_map.values()))
    elif os.path.isfile(os.path.join(path, "model.safetensors")):
        files, weight_map = ["model.safetensors"], {}
    else:
        raise ValueError(f"{path}: no model.safetensors.index.json or model.safetensors (safetensors only)")
    for f in files:
        require(os.path.isfile(os.path.join(path, f)),
                f"{path}: shard {f} listed in model.safetensors.index.json is missing")
    return [os.path.join(path, f) for f in files], weight_map


def open_checkpoint(path) -> Config:
    """The config of a checkpoint directory, after checking config.json, each shard's header (safetensors checks its
    length, JSON, dtypes, each tensor's byte span), then every tensor's presence, shape and dtype; no weights read."""
    from safetensors import safe_open
    if not isinstance(path, (str, os.PathLike)) or not os.path.isdir(path):
        raise ValueError(f"model directory {path!r} does not exist (or is not a directory)")
    cfg = Config.from_json(path)
    expected, found = checkpoint_tensors(cfg), {}
    files, weight_map = _shard_files(path)
    for file in files:
        try:
            with safe_open(file, "pt") as f:
                header = {n: (s.get_shape(), s.get_dtype()) for n in f.keys() for s in [f.get_slice(n)]}
        except Exception as e:                   # safetensors raises its own SafetensorError (and OSError)
            raise ValueError(f"{file}: not a safetensors file, or damaged or truncated "
                             f"({' '.join(str(e).split())})") from None
        for name, (shape, dtype) in header.items():
            if name in found:
                raise ValueError(f"{path}: tensor {name} is in both {found[name][2]} and {os.path.basename(file)}")
            found[name] = (shape, dtype, os.path.basename(file))
    for name, file in weight_map.items():
        if name in found and found[name][2] != file:
            raise ValueError(f"{path}: tensor {name} is in {found[name][2]}, but the index says {file}")
    for name, (shape, dtype, file) in found.items():
        require(name in expected, f"{path}: unexpected tensor {name} in {file} (not part of DeepSeek-V3.2 with this "
                f"config)")
        want_shape, kind = expected[name]
        require(shape == want_shape, f"{path}: tensor {name} has shape {shape}, expected {want_shape} (in {file})")
        if SAFETENSORS_DTYPES.get(dtype) not in ALLOWED_DTYPES[kind]:
            raise ValueError(f"{path}: tensor {name} has dtype {dtype}, expected "
                             f"{' or '.join(str(d).removeprefix('torch.') for d in ALLOWED_DTYPES[kind])} (in {file})")
    for name, (shape, kind) in expected.items():
        require(name in found, f"{path}: missing tensor {name} (expected {kind} {shape})")
    return cfg


def select_ops(kernels, device):
    """The kernel set for a device: 'torch' the references; 'gpu' kernels.py (an error where it cannot run);
    'auto' kernels.py on a GPU that supports it, else the references."""
    require(kernels in ("auto", "torch", "gpu"), f"kernels must be 'auto', 'torch' or 'gpu' (got {kernels!r})")
    if kernels == "torch" or (kernels == "auto" and torch.device(device).type != "cuda"):
        return TORCH_OPS
    require(torch.device(device).type == "cuda", f"kernels='gpu' needs a CUDA device (got {device})")
    import kernels as gpu_kernels                  # Triton + flashinfer: imported only on the GPU path
    why = gpu_kernels.unsupported(torch.device(device))
    require(not why or kernels != "gpu", f"the GPU kernels cannot run here: {why}")
    return TORCH_OPS if why else gpu_kernels.GPU_OPS


def load_model(path, device="cpu", kernels="auto", cfg=None) -> Transformer:
    """Load a DeepSeek-V3.2 HF checkpoint directory (cfg: open_checkpoint(path), if the caller has it). FP8 weights
    stay FP8; norms, router bias, weights_proj and the heads are upcast to fp32 one tensor at a time, as the
    reference does; a tensor holding nan or inf is refused by name. Under torchrun a rank reads only its share."""
    from safetensors import safe_open
    from tqdm import tqdm
    cfg = cfg or open_checkpoint(path)
    with torch.device("meta"):                          # the layers' shapes only: no memory touched twice
        model = Transformer(cfg).to_empty(device=device).eval()
    params, files = dict(model.named_parameters()), _shard_files(path)[0]
    total = sum(os.path.getsize(f) for f in files) // tp_size()        # about what each rank reads
    model.loaded_bytes = 0
    with tqdm(total=total, unit="B", unit_scale=True, desc="loading", leave=False,
              disable=total < (256 << 20) or tp_rank() > 0) as bar:
        for file in files:
            with safe_open(file, "pt", device="cpu") as f:
                for name in f.keys():
                    p = load_target(params, cfg, name)
                    if p is None:                                      # another rank's expert: not read
                        continue
                    part = f.get_slice(name)                           # reads this rank's slice only
                    t = part[rank_slice(part.get_shape(), p.shape)]
                    p.copy_(t)
                    bad = (p.view(torch.uint8) & 0x7F == 0x7F) if p.dtype == FP8 else ~p.isfinite()  # e4m3fn nan
                    if bad.any():
                        raise ValueError(f"{file}: tensor {name} holds {int(bad.sum())} nan or inf values")
                    model.loaded_bytes += t.numel() * t.element_size()
                    bar.update(t.numel() * t.element_size())
    return _share_mtp_copies(model).bind(select_ops(kernels, device))


def _share_mtp_copies(model):
    for m in model.mtp:            # the MTP embedding/head are copies of the main ones: share them when equal
        for copy, main in ((m.embed, model.embed), (m.shared_head.head, model.head)):
            if torch.equal(copy.weight, main.weight):
                copy.weight = main.weight
    return model


# ==== Part 2: the engine ==========================================================================================
# ---- Tokenizer and DeepSeek-V3.2 chat encoding (spec section 5) --------------------------------------------------
BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
USER, ASSISTANT, THINK, END_THINK = "<｜User｜>", "<｜Assistant｜>", "<think>", "</think>"


def encode_chat(messages, thinking=False) -> str:
    """DeepSeek-V3.2 chat format: BOS, system text, per user turn `<｜User｜>{c}<｜Assistant｜>` then `<think>` (the
    last user turn, thinking mode) or `</think>`; assistant turns end with EOS; earlier reasoning is dropped."""
    last_user = max(i for i, m in enumerate(messages) if m["role"] == "user")
    out = BOS
    for i, m in enumerate(messages):
        if m["role"] == "system":
            out += m["content"]
        elif m["role"] == "user":
            out += USER + m["content"] + ASSISTANT + (THINK if thinking and i == last_user else END_THINK)
        elif m["role"] == "assistant":
            reasoning = m.get("reasoning_content") if thinking and i > last_user else None
            out += (reasoning + END_THINK if reasoning else "") + m["content"] + EOS
        else:
            raise ValueError(f"unknown chat role {m['role']!r}")
    return out


def write_byte_tokenizer(path, vocab_size):
    """A self-contained byte-level tokenizer in the HF format: the DeepSeek special tokens at 0..5, one token
    per byte after them, unused ids as placeholders."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    specials = [BOS, EOS, USER, ASSISTANT, THINK, END_THINK]
    assert vocab_size >= len(specials) + 256, "the byte tokenizer needs 262 ids"
    # the byte-level BPE alphabet: printable bytes stand for themselves, the other 68 for chr(256 + n), in order
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), 256)}
    others = [b for b in range(256) if b not in printable]
    alphabet = [chr(b) if b in printable else chr(256 + others.index(b)) for b in range(256)]   # token 6 + b: byte b
    placeholders = [f"<｜place▁holder▁no▁{i}｜>" for i in range(vocab_size - len(specials) - 256)]
    vocab = {tok: i for i, tok in enumerate(specials + alphabet + placeholders)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in specials + placeholders])
    save_tokenizer(path, tok)


def save_tokenizer(path, tok):
    """tokenizer.json and the tokenizer_config.json of DeepSeek's checkpoints (BOS / EOS / pad tokens)."""
    tok.save(os.path.join(path, "tokenizer.json"))
    token = lambda t: {"__type": "AddedToken", "content": t, "lstrip": False, "normalized": True,  # noqa: E731
                       "rstrip": False, "single_word": False}
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"add_bos_token": False, "add_eos_token": False, "bos_token": token(BOS), "eos_token": token(EOS),
                   "pad_token": token(EOS), "clean_up_tokenization_spaces": False, "legacy": True,
                   "model_max_length": 131072, "tokenizer_class": "LlamaTokenizerFast"}, f, indent=2)


def load_tokenizer(model_dir, cfg: Config):
    """tokenizer.json, checked against the model: no token id >= vocab_size, the chat format's special tokens each
    encode as one token, and BOS / EOS are the config's bos_token_id / eos_token_id."""
    from tokenizers import Tokenizer
    file = os.path.join(model_dir, "tokenizer.json")
    require(os.path.isfile(file), f"{model_dir}: no tokenizer.json")
    try:
        tok = Tokenizer.from_file(file)
    except Exception as e:                      # the tokenizers library raises a bare Exception
        raise ValueError(f"{file}: not a valid tokenizer ({' '.join(str(e).split())})") from None
    top = max(tok.get_vocab(with_added_tokens=True).values(), default=-1)
    require(top < cfg.vocab_size, f"{file}: has token id {top}, but the model's vocab_size is {cfg.vocab_size}")
    for t in (BOS, EOS, USER, ASSISTANT, THINK, END_THINK):
        if tok.encode(t, add_special_tokens=False).ids != [tok.token_to_id(t)]:
            raise ValueError(f"{file}: the special token {t} is missing (the chat format needs it as one token)")
    for t, key, want in ((BOS, "bos", cfg.bos_token_id), (EOS, "eos", cfg.eos_token_id)):
        if tok.token_to_id(t) != want:
            raise ValueError(f"{file}: {t} is token {tok.token_to_id(t)}, but config.json has {key}_token_id {want}")
    return tok


DEMO_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "demo")


def default_model_dir() -> str:
    """The embedded default: demo/, a tiny DeepSeek-V3.2 trained on Python's standard library (tools/train_demo.py)
    and stored in the official FP8 format; it writes Python, and its MTP drafts are accepted."""
    if not os.path.isfile(os.path.join(DEMO_DIR, "model.safetensors.index.json")):
        raise ValueError(f"no --model given, and the demo checkpoint is missing from {DEMO_DIR}")
    return DEMO_DIR


# ---- Sampling and speculative acceptance -------------------------------------------------------------------------
def probs_from_logits(logits, temperature, top_p):
    """fp32 logits [n, V] -> sampling distribution: softmax(logits / T) restricted to the top-p nucleus."""
    p = torch.softmax(logits.float() / temperature, -1)
    if top_p < 1.0:
        sp, si = p.sort(-1, descending=True)
        sp = sp.masked_fill(sp.cumsum(-1) - sp >= top_p, 0.0)     # drop tokens once the nucleus holds top_p
        p = torch.zeros_like(p).scatter_(-1, si, sp)
        p = p / p.sum(-1, keepdim=True)
    return p


def sample_no_sync(probs, gen):
    """Exponential race: argmax p / E with E ~ Exp(1) is an exact draw from p, with no host round trip."""
    e = torch.empty_like(probs).exponential_(1, generator=gen).clamp_(min=torch.finfo(probs.dtype).tiny)
    return (probs / e).argmax(-1)                             # (E = 0 would make 0/0 = nan win for p = 0)


def residual_probs(p, q):
    """Where a draft token was rejected, sample from normalize(max(p - q, 0)) (p itself if p == q)."""
    r = (p - q).clamp(min=0)
    return r / r.sum() if r.sum() > 0 else p


def speculative_accept(draft, q, logits, temperature, top_p, gen):
    """Verify k drafts against the main model's logits [k+1, V] -> the emitted tokens (accepted drafts, then one of the
    main model's). Greedy: the longest prefix equal to the argmax. Sampling: accept x with probability min(1, p(x) /
    q(x)), else draw from max(p - q, 0): the output follows the main model's distribution exactly."""
    if temperature == 0:
        target = logits.argmax(-1).tolist()
        a = next((j for j, x in enumerate(draft) if x != target[j]), len(draft))
        return draft[:a] + [target[a]]
    p = probs_from_logits(logits, temperature, top_p)
    for j, x in enumerate(draft):
        if torch.rand((), generator=gen, device=p.device) * q[j, x] > p[j, x]:       # reject
            return draft[:j] + [int(sample_no_sync(residual_probs(p[j], q[j]), gen))]
    return draft + [int(sample_no_sync(p[-1], gen))]


# ---- Engine: requests, paged KV pool, continuous batching, the MTP speculative loop ------------------------------
@dataclass
class Request:
    idx: int                     # position in the caller's prompt list
    tokens: list                 # prompt + generated so far
    prompt_len: int
    max_new_tokens: int
    temperature: float
    top_p: float
    gen: torch.Generator
    prefill_target: int          # prefill positions [0, target): the prompt, or all but the last token if resumed
    num_cached: int = 0          # positions whose main-model KV is in the pool; decode phase: len(tokens) - 1
    pages: list = field(default_factory=list)
    page_row: torch.Tensor = None    # `pages` as a tensor, rebuilt only when they change (long contexts: thousands)
    draft: list = None           # draft tokens for the next verify
    q: torch.Tensor = None       # [k, V] their draft distributions (sampling only)
    logits: list = field(default_factory=list)   # main-model logits rows of the emitted tokens (return_logits)
    accept_lengths: list = field(default_factory=list)
    finish: str = None           # "eos" | "length" once done
    generated = property(lambda self: self.tokens[self.prompt_len:])


@dataclass
class Result:
    token_ids: list
    text: str
    accept_lengths: list
    logits: torch.Tensor = None
    finish_reason: str = None


class LLM:
    """DeepSeek-V3.2 engine. Every step is a prefill step (chunks of prompts, then the MTP layer over the same chunks)
    or a decode round over all running requests (verify, accept, draft-extend, draft: _decode_round)."""
    # generate's numeric arguments: check_arg's (kind, low, high, open_low); the CLI checks them before loading
    SAMPLING = dict(max_new_tokens=(int, 0, None, True), temperature=(float, 0), top_p=(float, 0, 1, True), seed=(int,))

    def __init__(self, model_dir=None, device=None, mtp=1, kv_cache_bytes=None, page_size=16, max_batch=64,
                 max_prefill_tokens=1024, max_context=None, kernels="auto", model=None, cuda_graphs=True):
        for name, v in dict(mtp=mtp, page_size=page_size, max_batch=max_batch, max_prefill_tokens=max_prefill_tokens,
                            kv_cache_bytes=kv_cache_bytes, max_context=max_context).items():
            if v is not None or name not in ("kv_cache_bytes", "max_context"):       # these two: None = automatic
                check_arg(name, v, int, int(name != "mtp"))
        try:
            dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        except (RuntimeError, TypeError):
            raise ValueError(f"unknown device {device!r}") from None
        self.device = dev = init_distributed(dev)                        # torchrun: join the ranks, take a GPU
        n_gpus = torch.cuda.device_count()                               # 0 without CUDA
        if dev.type not in ("cpu", "cuda") or dev.type == "cuda" and (dev.index or 0) >= n_gpus:
            raise ValueError(f"device {device!r}: " + ("nano-nsa runs on cpu or cuda" if dev.type != "cuda" else
                             f"this machine has {n_gpus} CUDA devices" if n_gpus else "CUDA is not available"))
        model_dir = model_dir or default_model_dir()
        self.cfg = cfg = model.cfg if model else open_checkpoint(model_dir)   # config + shard headers: no weights yet
        self.tokenizer = load_tokenizer(model_dir, cfg)
        require(mtp == 0 or cfg.n_mtp_layers > 0, f"mtp={mtp}: needs a checkpoint with an MTP layer")
        page, cuda = KVCache.bytes_per_token(cfg) * page_size, dev.type == "cuda"
        memory = torch.cuda.mem_get_info(dev)[1] if cuda else os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        if kv_cache_bytes is not None and not 2 * page <= kv_cache_bytes <= memory:     # page 0: the dummy page
            raise ValueError(f"kv_cache_bytes={kv_cache_bytes}: " + (
                f"less than two pages of the KV pool ({2 * page} bytes)" if kv_cache_bytes < 2 * page else
                f"more than the {memory} bytes of {dev.type} memory"))
        self.model = model or load_model(model_dir, dev, kernels, cfg)  # model: built already (bench.py)
        self.announce = dev.type == "cuda" and tp_rank() == 0   # say once, at the first generate, which kernels run
        self.k, self.page_size, self.max_batch, self.max_prefill_tokens = mtp, page_size, max_batch, max_prefill_tokens
        # default pool: CPU 256 MiB, GPU 80% of what is free; the smallest over ranks (one schedule for all)
        num_pages = (kv_cache_bytes or (int(torch.cuda.mem_get_info(dev)[0] * 0.8) if cuda else 256 << 20)) // page
        num_pages = int(all_reduce(torch.tensor([num_pages], device=dev), dist.ReduceOp.MIN))
        self.cache = KVCache(cfg, num_pages * page_size, self.device)
        self.free_pages = list(range(1, num_pages))             # page 0 is never given out: slot 0 is the dummy slot
        self.max_context = min(max_context or cfg.max_seq_len, cfg.max_seq_len)   # that padded rows write to
        self.stats, torch_ops = {}, self.model.ops is TORCH_OPS      # the torch references sync the host: no graphs
        self.graphs = CudaGraphs(self) if cuda_graphs and cuda and not torch_ops else None

    # --- paged KV pool: a request owns pages; position p lives in slot pages[p // P] * P + p % P ---------------
    def _reserve(self, req, n_positions):
        need = -(-n_positions // self.page_size) - len(req.pages)
        if need > len(self.free_pages):
            return False
        req.pages += [self.free_pages.pop() for _ in range(max(need, 0))]
        return True

    def _release(self, req):
        self.free_pages += req.pages
        req.pages, req.page_row = [], None

    def _table(self, reqs):
        """[B, N] slot of every position of each request (page size 1 view of the page tables)."""
        pages = torch.zeros(len(reqs), max(len(r.pages) for r in reqs), dtype=torch.long)
        for b, r in enumerate(reqs):
            if r.page_row is None or len(r.page_row) != len(r.pages):
                r.page_row = torch.tensor(r.pages)
            pages[b, :len(r.pages)] = r.page_row
        pages = to_device(pages, self.device)
        return (pages[:, :, None] * self.page_size + torch.arange(self.page_size, device=self.device)).flatten(1)

    # --- the engine loop --------------------------------------------------------------------------------------
    def generate(self, prompts, max_new_tokens=256, temperature=0.0, top_p=1.0, seed=None, return_logits=False,
                 thinking=False, raw=False, on_tokens=None):
        """prompts: strings (chat-encoded as a user turn; raw=True: plain completion) or lists of token ids."""
        token_ids = lambda p: isinstance(p, (list, tuple)) and all(_is_num(t, True) for t in p)  # noqa: E731
        if isinstance(prompts, str) or token_ids(prompts) and len(prompts) > 0:
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)) or not all(isinstance(p, str) or token_ids(p) for p in prompts):
            raise ValueError(f"prompts must be a string, a list of token ids, or a list of those (got {prompts!r:.80})")
        for name, v in dict(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                            return_logits=return_logits, thinking=thinking, raw=raw,
                            seed=0 if seed is None else seed).items():
            check_arg(name, v, *self.SAMPLING.get(name, (bool,)))
        require(on_tokens is None or callable(on_tokens), f"on_tokens must be a function (got {on_tokens!r:.80})")
        if not prompts:
            return []
        temperature = max(temperature, 1e-5) if temperature > 0 else 0     # as the reference: no overflow in logits/T
        capacity = len(self.free_pages) * self.page_size
        if seed is None:                                        # a fresh seed, the same on every rank
            seed = int(all_reduce(torch.tensor([int.from_bytes(os.urandom(6), "little")], device=self.device),
                                  dist.ReduceOp.MAX))
        reqs = []
        for i, p in enumerate(prompts):
            ids = self.encode(p, thinking, raw)
            require(ids, f"prompt {i} is empty")
            require(min(ids) >= 0 and max(ids) < self.cfg.vocab_size,
                    f"prompt {i} has token ids outside [0, {self.cfg.vocab_size})")
            if len(ids) + max_new_tokens > self.max_context:
                raise ValueError(f"prompt {i} has {len(ids)} tokens; with max_new_tokens={max_new_tokens} it exceeds "
                                 f"the context limit of {self.max_context} tokens")
            if len(ids) + max_new_tokens + 2 * self.k + 1 > capacity:
                raise ValueError(f"prompt {i} ({len(ids)} tokens + {max_new_tokens} new) can never fit in the KV pool "
                                 f"of {capacity} slots; give the engine a larger kv_cache_bytes")
            gen = torch.Generator(self.device).manual_seed((seed * 1_000_003 + i) % 2 ** 63)
            reqs.append(Request(i, list(ids), len(ids), max_new_tokens, temperature, top_p, gen, len(ids)))
        if self.announce:
            print(f"nano-nsa: {torch.cuda.get_device_name(self.device)}, kernels: {self.model.ops.name}",
                  file=sys.stderr)
            self.announce = False
        self.waiting, self.running = list(reqs), []
        self.on_tokens, self.return_logits, self.preemptions = on_tokens, return_logits, 0
        t0, rounds = time.perf_counter(), 0
        while self.waiting or self.running:
            while self.waiting and len(self.running) < self.max_batch and \
                    self._reserve(self.waiting[0], self.waiting[0].prefill_target + self.k + 1):  # prompt, 1st drafts
                self.running.append(self.waiting.pop(0))
            prefilling = [r for r in self.running if r.num_cached < r.prefill_target]
            if prefilling:
                self._prefill_step(prefilling)
            elif self.running:
                self._decode_round(list(self.running))
                rounds += 1
        dt, n_tok = time.perf_counter() - t0, sum(len(r.generated) for r in reqs)
        acc = [a for r in reqs for a in r.accept_lengths]
        self.stats = dict(tokens=n_tok, seconds=dt, tokens_per_s=n_tok / dt, decode_rounds=rounds,
                          preemptions=self.preemptions, mean_accept_length=sum(acc) / len(acc) if acc else None,
                          accept_histogram={n: acc.count(n) for n in range(1, self.k + 2)} if self.k else {})
        return [Result(r.generated, self.tokenizer.decode(r.generated), r.accept_lengths,
                       (torch.stack(r.logits) if r.logits else torch.zeros(0, self.cfg.vocab_size))
                       if return_logits else None, r.finish) for r in reqs]

    def encode(self, prompt, thinking=False, raw=False):
        if not isinstance(prompt, str):
            return [int(t) for t in prompt]
        text = BOS + prompt if raw else encode_chat([{"role": "user", "content": prompt}], thinking)
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def _emit(self, r, new_tokens, logits_rows):
        """Append emitted tokens, stopping at EOS or max_new_tokens (a finished request retires after the step)."""
        for j, t in enumerate(new_tokens):
            if t == self.cfg.eos_token_id or len(r.generated) >= r.max_new_tokens:
                r.finish = "eos" if t == self.cfg.eos_token_id else "length"
                break
            r.tokens.append(t)
            if self.return_logits:
                r.logits.append(logits_rows[j].float().cpu())
            if self.on_tokens:
                self.on_tokens(r.idx, [t])
        if r.finish is None and len(r.generated) >= r.max_new_tokens:
            r.finish = "length"

    def _retire(self):
        for r in [r for r in self.running if r.finish]:
            self.running.remove(r)
            self._release(r)

    def _sample(self, r, logits):
        """One token from logits [V]: the argmax (greedy) or a draw from the temperature / top-p distribution."""
        return int(logits.argmax()) if r.temperature == 0 else \
            int(sample_no_sync(probs_from_logits(logits[None], r.temperature, r.top_p)[0], r.gen))

    def _pick(self, reqs, logits, j):
        """Draft token j of each request from the MTP logits [B, V], on the device: the argmax, or a draw from the
        request's distribution q, kept for the acceptance test. (Tests swap in an oracle here.)"""
        tokens, q = logits.argmax(-1), [None] * len(reqs)
        for b, r in enumerate(reqs):
            if r.temperature > 0:
                q[b] = probs_from_logits(logits[b:b + 1], r.temperature, r.top_p)[0]
                tokens[b] = sample_no_sync(q[b], r.gen)
        return tokens, q

    def _prefill_step(self, reqs):
        """Prompt chunks, up to max_prefill_tokens rows in all, through the main model, then the MTP layer."""
        chunks, budget = [], self.max_prefill_tokens            # (request, first position, length)
        for r in reqs:
            if (n := min(r.prefill_target - r.num_cached, budget)) <= 0:
                break
            chunks.append((r, r.num_cached, n))
            budget -= n
        reqs, starts, lens = zip(*chunks)
        meta = Meta.build("prefill", starts, lens, self._table(reqs))
        tokens = torch.tensor([t for r, s, n in chunks for t in r.tokens[s:s + n]], device=self.device)
        h = self.model(tokens, meta, self.cache)
        last = [c - 1 for c in meta.cu_seqlens[1:]]
        logits = self.model.logits(h[last])
        for b, (r, s, n) in enumerate(chunks):
            r.num_cached += n
            if r.num_cached == len(r.tokens):                            # fresh prompt done: sample token 1
                self._emit(r, [self._sample(r, logits[b])], logits[b:b + 1])
        if self.k == 0:
            return self._retire()
        # MTP over the same chunk: position p pairs the main hidden h_p with the next token x_{p+1}
        live = [b for b, (r, s, n) in enumerate(chunks) if r.finish is None]
        next_tokens = torch.tensor([r.tokens[s + i + 1] if b in live else 0 for b, (r, s, n) in enumerate(chunks)
                                    for i in range(n)], device=self.device)
        hm = self.model.mtp_forward(next_tokens, h, meta, self.cache)
        done = [b for b in live if chunks[b][0].num_cached == chunks[b][0].prefill_target]
        if done:
            self._draft([chunks[b][0] for b in done], hm[[last[b] for b in done]])
        self._retire()

    def _forward(self, kind, tokens, meta, h=None, j=0):
        """A forward pass of the decode round, replayed from a CUDA graph where the engine has them: 'verify' (the main
        model, k + 1 rows per request), 'extend' (the MTP layer over the same rows), 'draft' (MTP, 1 row each)."""
        if self.graphs:
            return self.graphs.run(kind, tokens, meta, h, j)
        return self.model(tokens, meta, self.cache) if kind == "verify" else \
            self.model.mtp_forward(tokens, h, meta, self.cache, j)

    def _draft(self, reqs, h):
        """k draft tokens per request, left on the device (r.draft [k]): the first from the MTP row that just ran at
        position L-1 (hidden h), the rest from k-1 MTP decode steps at L-1+j, over one Meta shifted per step."""
        mtp, picks, meta = self.model.mtp, [], None                     # picks: (tokens [B], q) per draft step
        for j in range(self.k):
            if j > 0:
                meta = meta.step(1) if meta else self._meta("decode", reqs, [r.num_cached for r in reqs], 1)
                h = self._forward("draft", picks[-1][0], meta, h, j=min(j, len(mtp) - 1))
            picks.append(self._pick(reqs, mtp[min(j, len(mtp) - 1)].logits(h), j))
        drafts = torch.stack([tokens for tokens, _ in picks], 1)                # [B, k]
        for b, r in enumerate(reqs):
            r.draft = drafts[b]
            r.q = torch.stack([q[b] for _, q in picks]) if r.temperature > 0 else None

    def _meta(self, mode, reqs, starts, n):
        return Meta.build(mode, starts, [n] * len(reqs), self._table(reqs))

    def _decode_round(self, reqs):
        """Verify every request's k drafts in one main-model pass (k + 1 decode rows each), accept, run the MTP layer
        over the same rows (draft-extend: rows past the accepted tokens are padding, so shapes and metadata do not
        depend on what was accepted), draft k new tokens. One read-back per round settles the greedy requests."""
        k = self.k
        for r in list(reqs):    # pages for the round; a full pool preempts the newest request, to be recomputed later
            while r in self.running and not self._reserve(r, r.num_cached + 2 * k + 1):
                victim = self.running.pop()                          # newest admitted
                self._release(victim)
                self.preemptions += 1
                victim.num_cached, victim.draft, victim.q = 0, None, None
                victim.prefill_target = len(victim.tokens) - 1       # its last token is known: no resampling
                self.waiting.insert(0, victim)
        reqs = [r for r in reqs if r in self.running]
        if not reqs:
            return
        B, L = len(reqs), [r.num_cached for r in reqs]
        meta = self._meta("verify" if k else "decode", reqs, L, k + 1)       # rows x_L, d_1..d_k at L..L+k
        last = to_device(torch.tensor([r.tokens[-1] for r in reqs]), self.device)
        drafts = torch.stack([r.draft for r in reqs]) if k else last[:, None][:, :0]      # [B, k]
        h = self._forward("verify", torch.cat([last[:, None], drafts], 1).flatten(), meta)
        logits = self.model.logits(h).view(B, k + 1, -1)
        target = logits.argmax(-1)                                                # [B, k + 1]
        accepted = (drafts == target[:, :k]).cumprod(1).sum(1)                   # greedy: leading drafts == argmax
        host = torch.cat([target, accepted[:, None]], 1).tolist()               # the round's one read-back
        news = []
        for b, r in enumerate(reqs):
            if r.temperature == 0:
                new = host[b][:host[b][-1] + 1]                                   # accepted drafts, then the argmax
            elif k:                                                              # sampling reads its own draws
                new = speculative_accept(r.draft.tolist(), r.q, logits[b], r.temperature, r.top_p, r.gen)
            else:
                new = [self._sample(r, logits[b, 0])]
            if k:
                r.accept_lengths.append(len(new))
            r.num_cached += len(new)                              # x_L and the accepted drafts now have KV
            self._emit(r, new, logits[b])
            news.append(new if r.finish is None else [])
        self._retire()
        live = [b for b in range(B) if news[b]]
        if not k or not live:
            return
        # draft-extend: the MTP layer over the verify rows, pairs (h_{L+j}, x_{L+j+1}); padding rows: the dummy slot
        keep = to_device(torch.tensor([[j < len(new) for j in range(k + 1)] for new in news]), self.device).flatten()
        nxt = to_device(torch.tensor([new + [0] * (k + 1 - len(new)) for new in news]), self.device).flatten()
        hm = self._forward("extend", nxt, replace(meta, slots=torch.where(keep, meta.slots, 0)), h)
        self._draft([reqs[b] for b in live], hm[[b * (k + 1) + len(news[b]) - 1 for b in live]])


def graph_buckets(max_bs, rows_per_req, tp=1):
    """Batch sizes captured for rows_per_req rows per request: 1, 2, 4, 8, then every 16 up to the first >= max_bs,
    those whose rows split evenly over tp ranks (SGLang's rule: at TP 8, bs=1 with 4 rows pads to bs=2, not 8)."""
    step = tp // math.gcd(tp, rows_per_req)                  # bs must be a multiple of this
    top = -(-max_bs // step) * step
    return [b for b in sorted({1, 2, 4, 8, *range(16, top, 16), top}) if b <= top and b % step == 0]


class CudaGraphs:
    """The decode round's forward passes ('verify', 'extend', 'draft': see LLM._forward) as CUDA graphs, one per
    batch-size bucket and context bound (the indexer's width is a shape: index_topk at start, powers of two above it
    on first use). A replay copies the step's inputs into static buffers (padding rows write the dummy slot 0 and
    read one position) after making the step's attention plan (ops.plan: host work, exact lengths)."""
    def __init__(self, llm):
        cfg, dev, k, t0 = llm.cfg, llm.device, llm.k, time.perf_counter()
        self.llm, self.rows = llm, dict(verify=k + 1, extend=k + 1, draft=1)
        kinds = ["verify"] + ["extend"] * (k > 0) + ["draft"] * (k > 1)
        self.buckets = {kind: graph_buckets(llm.max_batch, self.rows[kind], tp_size()) for kind in kinds}
        max_bs = max(b[-1] for b in self.buckets.values())
        rows, self.max_width = max_bs * (k + 1), -(-(llm.max_context + 2 * k + 2) // llm.page_size) * llm.page_size
        self.tokens, self.positions, self.slots, self.ctx = (torch.zeros(rows, dtype=torch.long, device=dev)
                                                             for _ in range(4))
        self.h = torch.zeros(rows, cfg.dim, dtype=BF16, device=dev)
        self.table = torch.zeros(max_bs, self.max_width, dtype=torch.long, device=dev)
        self.graphs, self.pool = {}, None
        for kind in kinds:
            for bs in self.buckets[kind]:
                self._capture(kind, bs, self.width(cfg.index_topk), j=min(kind == "draft", cfg.n_mtp_layers - 1))
        print(f"nano-nsa: captured {len(self.graphs)} CUDA graphs in {time.perf_counter() - t0:.1f} s: " +
              ", ".join(f"{kind} bs {','.join(map(str, b))}" for kind, b in self.buckets.items()) +
              f" (contexts <= {cfg.index_topk}; longer ones are captured on first use)", file=sys.stderr)

    def width(self, max_ctx):
        """The context bound a step runs under: index_topk, or the next power of two (the indexer's score width)."""
        topk = self.llm.cfg.index_topk
        return topk if max_ctx <= topk else min(1 << (max_ctx - 1).bit_length(), self.max_width)

    def _capture(self, kind, bs, width, j):
        llm, n, T = self.llm, self.rows[kind], bs * self.rows[kind]
        meta = Meta("decode", self.positions[:T], self.slots[:T],
                    torch.arange(bs, device=llm.device).repeat_interleave(n), self.table[:bs, :width], self.ctx[:T],
                    list(range(0, T + 1, n)), torch.ones(T, dtype=torch.long), width, graphed=True)
        self.positions[:T], self.slots[:T], self.ctx[:T] = 0, 0, 1
        meta.plan = llm.model.ops.plan(meta, llm.cfg)
        forward = (lambda: llm.model(self.tokens[:T], meta, llm.cache)) if kind == "verify" else \
            (lambda: llm.model.mtp_forward(self.tokens[:T], self.h[:T], meta, llm.cache, j))
        forward()                                                      # warm-up: compiles and autotunes kernels
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, self.pool):
            out = forward()
        self.pool = self.pool or graph.pool()                          # all graphs share one memory pool
        self.graphs[kind, bs, width, j] = (graph, meta, out)

    def run(self, kind, tokens, meta, h=None, j=0):
        n, B = self.rows[kind], meta.table.shape[0]
        bs, width = next(b for b in self.buckets[kind] if b >= B), self.width(meta.max_ctx)
        if (kind, bs, width, j) not in self.graphs:
            t0 = time.perf_counter()
            self._capture(kind, bs, width, j)
            print(f"nano-nsa: captured the {kind} graph for bs {bs}, contexts <= {width} in "
                  f"{time.perf_counter() - t0:.2f} s", file=sys.stderr)
        graph, static, out = self.graphs[kind, bs, width, j]
        T, Tp = B * n, bs * n
        for buf, x in ((self.tokens, tokens), (self.positions, meta.positions), (self.slots, meta.slots),
                       (self.ctx, meta.ctx_lens)) + (((self.h, h),) if h is not None else ()):
            buf[:T] = x
        self.positions[T:Tp], self.slots[T:Tp], self.ctx[T:Tp] = 0, 0, 1          # padding rows
        self.table[:B, :meta.table.shape[1]], self.table[B:bs, 0] = meta.table, 0
        static.ctx_host = F.pad(meta.ctx_host, (0, Tp - T), value=1)
        static.plan = self.llm.model.ops.plan(static, self.llm.cfg)      # exact lengths, before the replay
        graph.replay()
        return out[:T]


# ---- CLI ---------------------------------------------------------------------------------------------------------
def main(argv=None):
    ap = argparse.ArgumentParser(
        description="DeepSeek-V3.2 inference (DSA sparse attention, MTP speculative decoding).")
    ap.error = lambda message: ap.exit(2, f"error: {message}\n")          # one line, no usage dump
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
    ap.add_argument("--kernels", default="auto", choices=["auto", "torch", "gpu"],
                    help="auto: kernels.py on a GPU that supports it; torch: the readable reference path")
    ap.add_argument("--no-cuda-graphs", action="store_true", help="run decode rounds eagerly (GPU)")
    ap.add_argument("--json", action="store_true", help="print one JSON document instead of streaming text")
    args = ap.parse_args(argv)
    try:
        prompts = list(args.prompt)
        if args.prompt_file:
            try:
                with open(args.prompt_file, encoding="utf-8") as f:
                    prompts += [line.rstrip("\n") for line in f if line.strip()]
            except UnicodeDecodeError as e:
                raise ValueError(f"{args.prompt_file}: not UTF-8 text ({e.reason} at byte {e.start})") from None
        require(prompts, "give at least one --prompt or a --prompt-file")
        for name, rule in LLM.SAMPLING.items():                # before any work: a model may take minutes to load
            check_arg(name, getattr(args, name), *rule)
        llm = LLM(args.model, device=args.device, mtp=args.mtp, max_context=args.max_context,
                  kernels=args.kernels, cuda_graphs=not args.no_cuda_graphs)
        quiet = tp_rank() > 0                    # torchrun: every rank computes the same tokens; rank 0 prints
        stream = not args.json and len(prompts) == 1 and not quiet
        streamed, printed = [], [""]

        def on_tokens(i, toks):                  # one prompt: print its newly decodable text (whole UTF-8 chars)
            streamed.extend(toks)
            text = llm.tokenizer.decode(streamed)
            if not text.endswith("\ufffd"):
                print(text[len(printed[0]):], end="", flush=True)
                printed[0] = text
        results = llm.generate(prompts, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                               top_p=args.top_p, seed=args.seed, thinking=args.thinking, raw=args.raw,
                               on_tokens=on_tokens if stream else None)
    except (ValueError, OSError) as e:                         # bad input: one line, no traceback
        print("error: " + str(e).replace("\n", " "), file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    end_distributed(llm.graphs is not None)
    s = llm.stats
    if quiet:
        return 0
    if args.json:
        print(json.dumps({"results": [dict(prompt=p, token_ids=r.token_ids, text=r.text, finish_reason=r.finish_reason,
                                           accept_lengths=r.accept_lengths) for p, r in zip(prompts, results)],
                          "stats": s}))
        return 0
    for p, r in zip(prompts, results):
        print(f"--- {p!r}\n{r.text}" if not stream else "")       # streamed: the text is out, end its line
    spec = (f", mean accepted length {s['mean_accept_length']:.2f}, acceptance histogram {s['accept_histogram']}"
            if s["mean_accept_length"] is not None else "")
    print(f"[{s['tokens']} tokens in {s['seconds']:.2f} s, {s['tokens_per_s']:.1f} tokens/s{spec}]", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
