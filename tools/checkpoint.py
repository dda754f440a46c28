"""Writers of checkpoints in DeepSeek-V3.2's official HF format: what the tests, bench.py and the demo trainer
use, and what inference never runs (so it lives here, not in nano_nsa.py).

    from tools.checkpoint import save_random_checkpoint
    save_random_checkpoint("/tmp/tiny", Config.tiny())  # config.json, safetensors shards, tokenizer

The names, shapes and dtypes come from `hf_checkpoint.checkpoint_tensors` (the one table the loader checks
against); FP8 weights get power-of-two 128x128 block scales (`weight_scale_inv`), as DeepSeek's conversion
writes them.
"""

import dataclasses
import json
import os
import sys
import zlib

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import chat  # noqa: E402  (the engine's files sit one folder up)
import hf_checkpoint as hf  # noqa: E402
import nano_nsa as m  # noqa: E402


def hf_config(cfg: m.Config):
    """The HF config.json dict of a Config, in the official checkpoint's layout (the inverse of
    Config.from_json)."""
    hf_name = {ours: hf for hf, ours in hf.HF_NAMES.items()}
    fields = {hf_name.get(f.name, f.name): getattr(cfg, f.name) for f in dataclasses.fields(cfg)}
    for name in hf.ROPE_NAMES.values():
        del fields[name]
    rope = {k: getattr(cfg, name) for k, name in hf.ROPE_NAMES.items()}
    return dict(
        architectures=["DeepseekV32ForCausalLM"],
        model_type="deepseek_v32",
        transformers_version="4.44.2",
        num_key_value_heads=cfg.n_heads,
        attention_bias=False,
        attention_dropout=0.0,
        moe_layer_freq=1,
        ep_size=1,
        initializer_range=0.02,
        torch_dtype="bfloat16",
        use_cache=True,
        **hf.HF_FIXED,
        **fields,
        rope_scaling=dict(type="yarn", mscale_all_dim=cfg.mscale, **rope),
        quantization_config=dict(
            quant_method="fp8",
            fmt="e4m3",
            activation_scheme="dynamic",
            weight_block_size=[m.BLOCK, m.BLOCK],
            scale_fmt="ue8m0",
        ),
    )


def quantize_weight(w: torch.Tensor):
    """fp32 [out, in] -> (float8_e4m3fn weight, float32 scale_inv [ceil(out/128), ceil(in/128)]), pow2
    scales."""
    rows = -(-w.shape[0] // m.BLOCK)
    cols = -(-w.shape[1] // m.BLOCK)
    padded = F.pad(w.float(), (0, cols * m.BLOCK - w.shape[1], 0, rows * m.BLOCK - w.shape[0]))
    amax = padded.view(rows, m.BLOCK, cols, m.BLOCK).abs().amax(dim=(1, 3)).clamp(min=1e-4)
    scale = m.pow2_ceil(amax / m.FP8_MAX)  # ue8m0: scales are powers of two
    return (w / m.per_element(scale, w.shape)).to(m.FP8), scale


def random_weight(name: str, shape, kind: str, seed: int, device="cpu") -> torch.Tensor:
    """The reproducible fp32 source of one checkpoint tensor, scaled so activations stay O(1) through
    layers."""
    if name.endswith("shared_head.head.weight"):  # the MTP layer stores copies of the main embedding and head
        name = "lm_head.weight"
    elif name.endswith("embed_tokens.weight"):
        name = "model.embed_tokens.weight"
    g = torch.Generator(device).manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    x = torch.randn(shape, generator=g, device=device)
    if kind == "norm" and name.endswith("weight"):
        return 1.0 + 0.1 * x
    if kind == "norm":
        return 0.1 * x  # LayerNorm bias is small
    if kind == "f32":
        return 0.05 * x  # router bias: selection only
    if "embed_tokens" in name:
        return x
    return x * shape[1] ** -0.5  # unit-gain projections


def stored_dtype(name, kind):
    """dtype of a non-FP8 tensor in the checkpoint: k_norm and the router bias are fp32, the rest bf16."""
    if kind == "f32" or ".k_norm." in name:
        return torch.float32
    return m.BF16


def checkpoint_entries(name, kind, w):
    """The (name, tensor) pairs one weight is stored as: FP8 + its block scales, or one tensor of its
    stored dtype."""
    if kind == "fp8":
        return list(zip((name, name + "_scale_inv"), quantize_weight(w), strict=True))
    return [(name, w.to(stored_dtype(name, kind)))]


def save_random_checkpoint(
    path,
    config: m.Config,
    seed: int = 0,
    shard_bytes: int = 4 << 30,
    tokenizer=True,
    device="cpu",
    weights=None,
    sampling=(1.0, 0.95),
):
    """Write a random-weight DeepSeek-V3.2 checkpoint in the official HF layout (config.json, sharded
    safetensors and index, FP8 weights with pow2 128x128 block scales). device: where values are drawn
    (cuda: others, same format). weights: {HF name: tensor} of a trained model, written through the same
    FP8 path (tools/train_demo.py). sampling: generation_config.json's (temperature, top_p)."""
    from safetensors.torch import save_file
    from tqdm import tqdm

    os.makedirs(path, exist_ok=True)
    write_json(os.path.join(path, "config.json"), hf_config(config))
    generation = dict(
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        do_sample=True,
        temperature=sampling[0],
        top_p=sampling[1],
    )
    write_json(os.path.join(path, "generation_config.json"), generation)
    if tokenizer:
        write_byte_tokenizer(path, config.vocab_size)
    spec = {name: v for name, v in hf.checkpoint_tensors(config).items() if v[1] != "scale"}
    shards = []  # the tensor names of each shard written so far
    current = {}
    total = 0
    progress = tqdm(spec.items(), desc="writing checkpoint", unit="tensor", leave=False)
    for i, (name, (shape, kind)) in enumerate(progress):
        if weights is None:
            w = random_weight(name, shape, kind, seed, device)
        else:
            w = weights[name].float()
        assert list(w.shape) == shape, f"{name}: shape {list(w.shape)}, the checkpoint needs {shape}"
        current.update({n: t.cpu().contiguous() for n, t in checkpoint_entries(name, kind, w)})
        size = sum(t.numel() * t.element_size() for t in current.values())
        if (
            size >= shard_bytes or i == len(spec) - 1
        ):  # the shard count is known only at the end: temporary names
            save_file(current, os.path.join(path, f".shard{len(shards)}.tmp"), metadata={"format": "pt"})
            shards.append(list(current))
            current = {}
            total += size
    weight_map = {}
    for i, names in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        os.replace(os.path.join(path, f".shard{i}.tmp"), os.path.join(path, fname))
        weight_map.update(dict.fromkeys(names, fname))
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    write_json(os.path.join(path, "model.safetensors.index.json"), index)


def fill_random_cache(cache: m.KVCache):
    """Random contents in every slot of a KV pool, layer by layer (a benchmark's kernels then read
    real-looking values): FP8 latents (positive codes, below the NaN code) with power-of-two scales, normal
    rope keys, FP8 indexer keys with scales in [0.5, 1.5)."""
    for i in range(len(cache.latent)):
        layer = cache.layer(i)
        layer.latent[:, : layer.C].random_(0, 0x7F)
        layer.kv_scale.fill_(2**-6)
        layer.pe.normal_()
        layer.ik.copy_((torch.randn(layer.ik.shape, device=layer.ik.device) * 8).to(m.FP8))
    cache.iks.uniform_(0.5, 1.5)


def random_model(cfg: m.Config, device, seed=0, kernels="auto") -> m.Transformer:
    """A model with random weights generated on `device`, tensor by tensor, with the writer's recipe and FP8
    quantization (not its values: the generator differs by device), without a checkpoint on disk: for GPU
    benchmarks of full-width layers. Under torchrun each rank fills only its share."""
    with torch.device(device):
        model = m.Transformer(cfg).eval()
    params = dict(model.named_parameters())
    rank = (m.tp_rank(), m.tp_size())
    for name, (shape, kind) in hf.checkpoint_tensors(cfg).items():
        if kind == "scale" or hf.load_target(params, cfg, name, *rank) is None:  # None: another rank's expert
            continue
        w = random_weight(name, shape, kind, seed, device)
        for entry, t in checkpoint_entries(name, kind, w):
            target = hf.load_target(params, cfg, entry, *rank)
            target.copy_(t[m.rank_slice(t.shape, target.shape)])  # this rank's slice: the whole at one rank
    return hf.share_mtp_copies(model).bind(m.select_ops(kernels, device))


def save_sparse_checkpoint(path, config: m.Config, shard_bytes: int = 5 << 30):
    """The official layout with exact headers and no data: each shard is a sparse file of its full size (its
    holes read as zeros). For what happens before weights are read (checks, memory planning) at the real size,
    on any disk: the 671B checkpoint takes seconds and no space."""
    os.makedirs(path, exist_ok=True)
    write_json(os.path.join(path, "config.json"), hf_config(config))
    shards = [{}]
    size = total = 0
    for name, (shape, kind) in hf.checkpoint_tensors(config).items():
        dtype = {"fp8": m.FP8, "scale": torch.float32}.get(kind) or stored_dtype(name, kind)
        code = {t: name for name, t in hf.SAFETENSORS_DTYPES.items()}[dtype]
        nbytes = dtype.itemsize * shape[0] * (shape[1] if len(shape) > 1 else 1)
        if size + nbytes > shard_bytes and shards[-1]:
            shards.append({})
            size = 0
        shards[-1][name] = {"dtype": code, "shape": shape, "data_offsets": [size, size + nbytes]}
        size += nbytes
        total += nbytes
    weight_map = {}
    for i, header in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        weight_map.update(dict.fromkeys(header, fname))
        end = max(t["data_offsets"][1] for t in header.values())
        text = json.dumps({"__metadata__": {"format": "pt"}, **header}).encode()
        text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned
        with open(os.path.join(path, fname), "wb") as f:
            f.write(len(text).to_bytes(8, "little") + text)
            f.truncate(8 + len(text) + end)  # a hole: no data written
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    write_json(os.path.join(path, "model.safetensors.index.json"), index)


def write_json(file, obj):
    with open(file, "w") as f:
        json.dump(obj, f, indent=2)


def write_byte_tokenizer(path, vocab_size):
    """A self-contained byte-level tokenizer in the HF format: the DeepSeek special tokens at 0..5, one token
    per byte after them, unused ids as placeholders."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    specials = list(chat.SPECIAL_TOKENS)
    assert vocab_size >= len(specials) + 256, "the byte tokenizer needs 262 ids"
    # the byte-level BPE alphabet: printable bytes stand for themselves, the other 68 for chr(256 + n), in
    # order
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), 256)}
    others = [b for b in range(256) if b not in printable]
    alphabet = [
        chr(b) if b in printable else chr(256 + others.index(b)) for b in range(256)
    ]  # token 6 + b: byte b
    placeholders = [f"<｜place▁holder▁no▁{i}｜>" for i in range(vocab_size - len(specials) - 256)]
    vocab = {token: i for i, token in enumerate(specials + alphabet + placeholders)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in specials + placeholders])
    save_tokenizer(path, tok)  # (which makes the chat format's tokens plain added tokens)


def added_token(text):
    """A tokenizer_config.json entry for one special token, as DeepSeek's checkpoints write it."""
    return {
        "__type": "AddedToken",
        "content": text,
        "lstrip": False,
        "normalized": True,
        "rstrip": False,
        "single_word": False,
    }


def save_tokenizer(path, tok):
    """tokenizer.json and the tokenizer_config.json of DeepSeek's checkpoints (BOS / EOS / pad tokens). As in
    DeepSeek-V3.2's tokenizer.json, BOS, EOS and the placeholders are special (decode drops them) and the chat
    format's tokens are not (decode keeps <think> and </think> as text)."""
    data = json.loads(tok.to_str())
    for added in data["added_tokens"]:
        if added["content"] in (chat.USER, chat.ASSISTANT, chat.THINK, chat.END_THINK):
            added.update(special=False, normalized=True)
    type(tok).from_str(json.dumps(data)).save(os.path.join(path, "tokenizer.json"))
    config = {
        "add_bos_token": False,
        "add_eos_token": False,
        "bos_token": added_token(chat.BOS),
        "eos_token": added_token(chat.EOS),
        "pad_token": added_token(chat.EOS),
        "clean_up_tokenization_spaces": False,
        "legacy": True,
        "model_max_length": 131072,
        "tokenizer_class": "LlamaTokenizerFast",
    }
    write_json(os.path.join(path, "tokenizer_config.json"), config)
