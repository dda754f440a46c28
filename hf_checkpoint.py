"""DeepSeek-V3.2's official HuggingFace checkpoint format, and the checks that turn a bad model directory into
one error line before a weight is read: config.json (its names, the values DeepSeek-V3.2 fixes, every field's
type and range), the safetensors index and every shard's header against the table of the official tensors
(names, shapes, dtypes; docs/model.md §8), and tokenizer.json. nano_nsa.py's loader and LLM call
`open_checkpoint` (config.json, then `check_tensors`); Config calls `check_config` and `read_config`;
tools/checkpoint.py writes checkpoints from the same table.
"""

import dataclasses
import json
import math
import os

import torch

from checks import check_arg, require
from parallel import tp_size

BLOCK = 128  # FP8 block size (nano_nsa.BLOCK)
FP8 = torch.float8_e4m3fn
BF16 = torch.bfloat16

# ---- config.json: the names that differ from ours, and the values DeepSeek-V3.2 fixes --------------------
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
ROPE_KEYS = {"type", "rope_type", "mscale_all_dim", *ROPE_NAMES}  # rope_scaling's keys in DeepSeek-V3.2
HF_FIXED = dict(
    scoring_func="sigmoid",
    topk_method="noaux_tc",
    hidden_act="silu",
    norm_topk_prob=True,
    tie_word_embeddings=False,
)
# the smallest value of the fields that may be below 1 (integers) or 0 (floats, which must be above it)
LOW = dict(n_dense_layers=0, n_mtp_layers=0, bos_token_id=0, eos_token_id=0, rope_theta=1.0, mscale=-math.inf)


def read_json(path):
    """A JSON object from a file, or a one-line ValueError naming the file."""
    try:
        with open(path, encoding="utf-8") as f:
            obj = json.load(f)
    except OSError as e:
        raise ValueError(f"{path}: cannot read ({e})") from None
    except (ValueError, RecursionError) as e:  # bad JSON, not UTF-8, or nested deeper than Python recurses
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    require(isinstance(obj, dict), f"{path}: expected a JSON object, not {type(obj).__name__}")
    return obj


def config_fields(path, names):
    """{our field name: value} from an HF DeepSeek-V3.2 config.json (a file or the directory holding it),
    for the fields in `names`, after checking what this engine does not read but DeepSeek-V3.2 fixes."""
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    require(os.path.isfile(path), f"no config.json at {path}")
    hf = read_json(path)
    check_hf(path, hf)
    renamed = {*HF_NAMES.values(), *ROPE_NAMES.values()}  # fields config.json names otherwise, or nests
    kw = {HF_NAMES.get(k, k): v for k, v in hf.items() if HF_NAMES.get(k, k) in names and k not in renamed}
    rope = hf.get("rope_scaling") or {}
    kw.update({ours: rope[k] for k, ours in ROPE_NAMES.items() if k in rope})
    return path, kw


def read_config(config_class, path):
    """config_class (nano_nsa.Config) from an HF DeepSeek-V3.2 config.json (a file or the directory holding
    it); its checks' refusals name the file."""
    path, kw = config_fields(path, {f.name for f in dataclasses.fields(config_class)})
    try:
        return config_class(**kw)
    except ValueError as e:
        raise ValueError(f"{path}: invalid DeepSeek-V3.2 config: {e}") from None


def open_checkpoint(path, config_class):
    """The config of a checkpoint directory, after checking config.json, each shard's header, then every
    tensor's presence, shape and dtype against the official checkpoint's table: no weights read."""
    is_dir = isinstance(path, (str, os.PathLike)) and os.path.isdir(path)
    require(is_dir, f"model directory {path!r} does not exist (or is not a directory)")
    cfg = read_config(config_class, path)
    check_tensors(path, cfg)
    return cfg


def check_hf(path, hf):
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
    for k, v in HF_FIXED.items():
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
    rope_types = [rope[k] for k in ("type", "rope_type") if k in rope]  # (HF reads rope_type first)
    yarn = rope_types and all(t == "yarn" for t in rope_types)
    require(yarn, f"{path}: expected rope_scaling of type yarn")
    other = sorted(set(rope) - ROPE_KEYS)  # (e.g. attention_factor: HF scales cos / sin by it)
    require(
        not other, f"{path}: rope_scaling.{other[0] if other else ''} is not supported (DeepSeek-V3.2's YaRN)"
    )
    # HF and vLLM take the softmax scale's mscale from mscale_all_dim, the reference from mscale: the same
    # math only where they agree (1.0 both in DeepSeek-V3.2)
    mscale, all_dim = rope.get("mscale", 1.0), rope.get("mscale_all_dim")
    require(
        all_dim is not None, f"{path}: rope_scaling has no mscale_all_dim (DeepSeek-V3.2's: 1.0, as mscale)"
    )
    require(
        all_dim == mscale,
        f"{path}: rope_scaling.mscale_all_dim={all_dim!r} must equal rope_scaling.mscale={mscale!r}",
    )


def label(name):
    """Our field name, and the config.json one where it differs."""
    hf = {ours: hf for hf, ours in HF_NAMES.items()}
    hf |= {ours: f"rope_scaling.{k}" for k, ours in ROPE_NAMES.items()}
    if hf.get(name, name) != name:
        return f"{name} ({hf[name]})"
    return name


def check_config(cfg, fields):
    """Refuse (one ValueError line) what the layers cannot run: types and signs first (integers >= 1 and
    floats > 0 unless LOW says otherwise), then shapes."""
    for f in fields:
        kind = int if f.type in ("int", int) else float
        low = LOW.get(f.name, 1 if kind is int else 0)
        check_arg(label(f.name), getattr(cfg, f.name), kind, low, open_low=kind is float)
    for ok, why in shape_rules(cfg):
        require(ok, why)


def shape_rules(cfg):
    group = cfg.n_routed_experts // cfg.n_expert_groups
    rules = [
        (cfg.n_dense_layers <= cfg.n_layers, "more dense layers than layers"),
        (cfg.n_routed_experts % cfg.n_expert_groups == 0, "experts must split evenly into groups"),
        (group >= 2, "group score is the sum of the top-2 experts"),
        (cfg.n_limited_groups <= cfg.n_expert_groups, "top-k larger than kept groups"),
        (cfg.n_activated_experts <= cfg.n_limited_groups * group, "top-k larger than kept groups"),
        (cfg.n_heads * cfg.v_head_dim % BLOCK == 0, "o_proj input must be a multiple of 128"),
        (cfg.index_head_dim == BLOCK, "indexer heads are one 128-wide FP8 group each (Hadamard 128)"),
        (
            cfg.qk_rope_head_dim % 2 == 0 and cfg.qk_rope_head_dim <= cfg.index_head_dim,
            "qk_rope_head_dim must be even and at most index_head_dim",
        ),
        (cfg.max_seq_len > cfg.original_seq_len, "max_seq_len must exceed original_seq_len"),
        (cfg.rope_factor >= 1, f"{label('rope_factor')} must be >= 1 (YaRN stretches the context)"),
        (max(cfg.bos_token_id, cfg.eos_token_id) < cfg.vocab_size, "bos/eos_token_id >= vocab_size"),
    ]
    for name in ("dim", "q_lora_rank", "kv_lora_rank", "inter_dim", "moe_inter_dim"):
        why = f"{label(name)} must be a multiple of {BLOCK} (FP8 activation groups)"
        rules.append((getattr(cfg, name) % BLOCK == 0, why))
    return rules


def check_tp(cfg, n):
    """Refuse a tensor-parallel size n (ranks) that would split a head, an expert or the vocabulary unevenly,
    or cut a 128x128 FP8 block across ranks: each rank's rows of q_b / kv_b / w1 / w3 and columns of o_proj /
    w2."""
    H = cfg.n_heads
    blocks = n * BLOCK
    rules = [
        ("n_heads", H, n),
        ("n_routed_experts", cfg.n_routed_experts, n),
        ("vocab_size", cfg.vocab_size, n),
        ("q_b_proj rows (n_heads * qk_head_dim)", H * cfg.qk_head_dim, blocks),
        (
            "kv_b_proj rows (n_heads * (qk_nope_head_dim + v_head_dim))",
            H * (cfg.qk_nope_head_dim + cfg.v_head_dim),
            blocks,
        ),
        ("o_proj columns (n_heads * v_head_dim)", H * cfg.v_head_dim, blocks),
        ("inter_dim", cfg.inter_dim if cfg.n_dense_layers else 0, blocks),
        (
            "shared expert width (moe_inter_dim * n_shared_experts)",
            cfg.moe_inter_dim * cfg.n_shared_experts,
            blocks,
        ),
    ]
    for what, value, divisor in rules:
        why = f"tensor parallel size {n}: {what} = {value} must be a multiple of {divisor}"
        if divisor > n:
            why += f" (whole {BLOCK}-wide FP8 blocks per rank)"
        require(value % divisor == 0, why)


def tp_ok(cfg, n):
    try:
        check_tp(cfg, n)
    except ValueError:
        return False
    return True


# ---- The tensors: the official HF names, shapes and dtypes (docs/model.md §8) ------------------------------
# kinds: "fp8" = float8_e4m3fn weight + float32 `weight_scale_inv` per 128x128 block; "bf16" = plain bf16
# matrix; "norm" = norm weight (bf16, or fp32 in some conversions); "f32" = fp32 vector (router bias).
ALLOWED_DTYPES = {
    "fp8": (FP8,),
    "scale": (torch.float32,),
    "bf16": (BF16,),
    "norm": (BF16, torch.float32),
    "f32": (torch.float32,),
}
SAFETENSORS_DTYPES = {"F8_E4M3": FP8, "BF16": BF16, "F32": torch.float32}  # the ones DeepSeek-V3.2 uses


def checkpoint_tensors(cfg):
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


def attention_tensors(cfg, prefix):
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


def ffn_tensors(cfg, prefix, moe):
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


def mtp_tensors(cfg, prefix):
    """The MTP layer's own tensors outside its decoder block (docs/model.md §8): embedding and head copies,
    norms, eh_proj."""
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


def ours_name(n_layers, hf_name: str) -> str:
    """Our parameter name of a checkpoint tensor (of a model with n_layers main layers; routed experts keep
    their index: load_target stacks them)."""
    parts = hf_name.removeprefix("model.").split(".")
    if parts[0] == "layers" and int(parts[1]) >= n_layers:  # MTP layer: its decoder block is `block`
        block = [] if parts[2] in MTP_OWN else ["block"]
        parts = ["mtp", str(int(parts[1]) - n_layers)] + block + parts[2:]
    return ".".join(HF_TO_OURS.get(p, p) for p in parts)


def load_target(params, cfg, hf_name: str, rank, ranks):
    """The model tensor (of `params`) a checkpoint tensor is loaded into: its parameter, or for a routed
    expert its place in the stack of rank `rank` of `ranks` (layers.3.ffn.experts.5.w1.weight ->
    layers.3.ffn.experts.w1.weight[5 - the rank's first]); None for another rank's expert."""
    parts = ours_name(cfg.n_layers, hf_name).split(".")
    if "experts" not in parts:
        return params[".".join(parts)]
    at = parts.index("experts") + 1  # the expert's index follows
    per_rank = cfg.n_routed_experts // ranks
    index = int(parts.pop(at)) - rank * per_rank
    if not 0 <= index < per_rank:
        return None
    return params[".".join(parts)][index]


def share_mtp_copies(model):
    """The checkpoint stores the MTP layer's embedding and head as copies of the main model's: a loaded model
    shares them where they are equal (one copy in memory)."""
    for mtp in model.mtp:
        for twin, main in ((mtp.embed, model.embed), (mtp.shared_head.head, model.head)):
            if torch.equal(twin.weight, main.weight):
                twin.weight = main.weight
    return model


# ---- The shards: the index and every header, checked against the table (no weights read) ----------------
def shard_files(path):
    """The shard files and, with an index, its weight map {tensor: file}."""
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        weight_map = read_json(index).get("weight_map")
        is_map = isinstance(weight_map, dict) and all(isinstance(f, str) for f in weight_map.values())
        require(is_map, f"{index}: expected a weight_map of tensor name -> shard file name")
        require(weight_map, f"{index}: its weight_map lists no tensors")
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


def progress_bar(files, rank, ranks):
    """load_model's progress bar over the bytes a rank reads (about its share of the files'), shown by rank 0
    where that share is 256 MiB or more."""
    from tqdm import tqdm

    total = sum(os.path.getsize(f) for f in files) // ranks
    quiet = total < (256 << 20) or rank > 0
    return tqdm(total=total, unit="B", unit_scale=True, desc="loading", leave=False, disable=quiet)


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


def check_tensors(path, cfg):
    """Every shard's header, then every tensor's presence, shape and dtype, against the official table."""
    found = read_headers(path)
    # (the expected table grows with layers x experts: a config.json claiming far more than the shards hold is
    # refused before it is built, which would take minutes and all the memory)
    layers = {name.split(".")[2] for name in found if name.startswith("model.layers.")}
    experts = {name.split(".mlp.experts.")[1].split(".")[0] for name in found if ".mlp.experts." in name}
    moe = cfg.n_layers - cfg.n_dense_layers + cfg.n_mtp_layers > 0
    for n, what, held in (
        (cfg.n_layers + cfg.n_mtp_layers, "layers", layers),
        (cfg.n_routed_experts * moe, "routed experts", experts),
    ):
        require(
            n <= len(held), f"{path}: config.json has {n} {what}, but the shards hold tensors of {len(held)}"
        )
    expected = checkpoint_tensors(cfg)
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


def check_values(t, name, file):
    """A tensor as read: no nan or inf; an FP8 weight's block scales positive powers of two (scale_fmt ue8m0:
    what makes a dequantized weight exact in bf16, docs/model.md §2)."""
    if t.dtype == FP8:
        bad = t.view(torch.uint8) & 0x7F == 0x7F  # e4m3fn's nan (it has no inf)
    else:
        bad = ~t.isfinite()
    require(not bad.any(), f"{file}: tensor {name} holds {int(bad.sum())} nan or inf values")
    if name.endswith("_scale_inv"):
        bad = (t <= 0) | (torch.frexp(t).mantissa != 0.5)
        what = "block scales that are not positive powers of two (scale_fmt 'ue8m0')"
        require(not bad.any(), f"{file}: tensor {name} holds {int(bad.sum())} {what}")


# ---- tokenizer.json and the demo model ---------------------------------------------------------------------
def load_tokenizer(model_dir, cfg, special_tokens, bos, eos):
    """tokenizer.json, checked against the model: no token id >= vocab_size, the chat format's special tokens
    each encode as one token, and BOS / EOS are the config's bos_token_id / eos_token_id."""
    from tokenizers import Tokenizer

    file = os.path.join(model_dir, "tokenizer.json")
    require(os.path.isfile(file), f"{model_dir}: no tokenizer.json")
    try:
        tok = Tokenizer.from_file(file)
    except Exception as e:  # the tokenizers library raises a bare Exception
        raise ValueError(f"{file}: not a valid tokenizer ({' '.join(str(e).split())})") from None
    cuts = tok.truncation or tok.padding
    require(not cuts, f"{file}: truncation and padding must be off (they would cut or pad every prompt)")
    top = max(tok.get_vocab(with_added_tokens=True).values(), default=-1)
    require(
        top < cfg.vocab_size, f"{file}: has token id {top}, but the model's vocab_size is {cfg.vocab_size}"
    )
    for t in special_tokens:
        one_token = tok.encode(t, add_special_tokens=False).ids == [tok.token_to_id(t)]
        require(
            one_token, f"{file}: the special token {t} is missing (the chat format needs it as one token)"
        )
    for t, key, want in ((bos, "bos", cfg.bos_token_id), (eos, "eos", cfg.eos_token_id)):
        got = tok.token_to_id(t)
        require(got == want, f"{file}: {t} is token {got}, but config.json has {key}_token_id {want}")
    return tok


def generation_defaults(path):
    """The decoding defaults a checkpoint ships in generation_config.json, as HF and vLLM read them:
    {temperature, top_p} (do_sample false: greedy), {} without the file. The command line's flags override."""
    file = os.path.join(path, "generation_config.json")
    if not os.path.isfile(file):
        return {}
    g = read_json(file)
    found = {name: g[name] for name in ("temperature", "top_p") if name in g}
    if g.get("do_sample") is False:
        found["temperature"] = 0.0
    for name, value in found.items():
        check_arg(
            f"{file}: {name}", value, float, 0, 1 if name == "top_p" else None, open_low=name == "top_p"
        )
    return found


DEMO_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "demo")


def default_model_dir():
    """The embedded default: demo/, a tiny DeepSeek-V3.2 trained on Python's standard library
    (tools/train_demo.py) and stored in the official FP8 format; it writes Python, and its MTP drafts are
    accepted."""
    present = os.path.isfile(os.path.join(DEMO_DIR, "model.safetensors.index.json"))
    require(present, f"no --model given, and the demo checkpoint is missing from {DEMO_DIR}")
    return DEMO_DIR


# ---- Will it fit: the weights' bytes and a minimal KV pool against the device's memory -------------------
MIN_POOL_TOKENS = 4096  # the smallest KV pool worth loading a model for


def weight_bytes(cfg, model_class, ranks):
    """(bytes every rank holds whole, bytes split over the ranks) of the parameters loading allocates, from
    the layers' shapes on the meta device: split are Linear split, the vocabulary and the routed experts."""
    with torch.device("meta"):
        model = model_class(cfg)
    split_bytes = 0
    whole_bytes = 0
    for mod in model.modules():
        split = type(mod).__name__ == "Embedding" or getattr(mod, "split", None) is not None
        for p in mod.parameters(recurse=False):
            if split or p.dim() == 3:  # p.dim() == 3: stacked routed experts
                split_bytes += p.numel() * p.element_size() * ranks
            else:
                whole_bytes += p.numel() * p.element_size()
    return whole_bytes, split_bytes


def check_fits(cfg, device, model_class, kv_bytes_per_token):
    """Refuse, before allocating anything, a model whose share of the weights plus a minimal KV pool exceeds
    this device's free memory (GPU) or the available RAM (CPU), saying what would fit (at how many ranks)."""
    ranks = tp_size()
    if device.type == "cuda":
        free = torch.cuda.mem_get_info(device)[0]
        where = f"{torch.cuda.get_device_name(device)} has {free / 1e9:.1f} GB free"
    else:
        free = available_ram()
        where = f"this machine has {free / 1e9:.1f} GB of RAM available"
    whole, split = weight_bytes(cfg, model_class, ranks)
    kv = MIN_POOL_TOKENS * kv_bytes_per_token
    need = whole + split // ranks + kv
    if need <= free:
        return
    why = f"the model needs {need / 1e9:.1f} GB per rank (weights + a {MIN_POOL_TOKENS}-token KV pool)"
    why += f", but {where}"
    allowed = [n for n in (1, 2, 4, 8, 16, 32, 64) if n > ranks and tp_ok(cfg, n)]
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
