"""nano-nsa tests: every model-level claim against an independent formulation, on fresh random inputs.

Run: python -m pytest -q           the quick run: each claim proved once (conftest.py), about a minute
     python -m pytest -q --full    every test (CI: .ci/run); tests marked `full` repeat a claim, or are slow
GPU tests are marked `gpu` and skip without CUDA.

On CPU the engine accumulates matmuls in fp64 (see `acc_dtype`), so two formulations that are the same math
agree to fp64 rounding before the shared bf16 roundings: where a test compares such paths it demands (near)
equality.
"""

import contextlib
import copy
import functools
import json
import math
import os
import re
import shutil
import sys
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

import chat
import checks
import cli
import hf_checkpoint as hf
import nano_nsa as m
from tools.checkpoint import (
    hf_config,
    random_model,
    random_weight,
    save_random_checkpoint,
    save_sparse_checkpoint,
    write_byte_tokenizer,
)

SHARED = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "shared")
full = pytest.mark.full  # with --full only (conftest.py): a claim the quick run proves already, or slow


def quick_sample(cases, *quick):
    """Parametrize values: the `quick` ones in every run, the others with --full only."""
    return [case if case in quick else pytest.param(case, marks=full) for case in cases]


# ------------------------------------------------------------------------------------------------------------
# fixtures and independent re-implementations (written from the spec, not calling the code under test)
# ------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("tiny"))
    save_random_checkpoint(path, m.Config.tiny(), seed=0, shard_bytes=1 << 20)  # several shards
    return path


@pytest.fixture(scope="session")
def model(tiny_dir):
    return m.load_model(tiny_dir)


def fake_quant_ref(x):
    """FP8 e4m3 per-128-group quantize/dequantize with s = 2^ceil(log2(amax / 448)), written from spec 3.3."""
    g = x.double().reshape(*x.shape[:-1], -1, 128)
    amax = g.abs().amax(-1, keepdim=True).clamp(min=1e-4)
    s = 2.0 ** torch.ceil(torch.log2(amax / 448))
    return ((g / s).clamp(-448, 448).float().to(torch.float8_e4m3fn).double() * s).reshape(x.shape)


def rms_norm_ref(x, weight, eps):
    """RMSNorm as the reference's (spec 3.2): fp32 math with the fp32 weight, bf16 out."""
    x = x.float()
    return (weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))).to(torch.bfloat16)


def sylvester(n):
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


def cos_sin(cfg, positions):
    """RoPE's cos and sin at positions for cfg's frequencies (a model holds them: Transformer.bind)."""
    return m.rope_cos_sin(m.yarn_frequencies(cfg).to(positions.device), positions)


def yarn_ref(cfg):
    """The YaRN frequencies f'_i, in the fp32 steps of the reference `precompute_freqs_cis` (spec 3.5)."""
    d = cfg.qk_rope_head_dim
    f = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))

    def corr(r):
        return d * math.log(cfg.original_seq_len / (r * 2 * math.pi)) / (2 * math.log(cfg.rope_theta))

    lo, hi = max(math.floor(corr(cfg.beta_fast)), 0), min(math.ceil(corr(cfg.beta_slow)), d - 1)
    smooth = 1 - ((torch.arange(d // 2, dtype=torch.float32) - lo) / (hi - lo)).clamp(0, 1)
    return f / cfg.rope_factor * (1 - smooth) + f * smooth


def rope_ref(x, pos, cfg, interleaved):
    """RoPE through complex multiplication, as the reference `apply_rotary_emb` (x [S, ..., R])."""
    d = cfg.qk_rope_head_dim
    cis = torch.polar(torch.ones(len(pos), d // 2), torch.outer(pos.float(), yarn_ref(cfg)))
    shape = x.shape
    xf = x.float()
    if not interleaved:
        xf = xf.view(*shape[:-1], 2, -1).transpose(-1, -2)
    xc = torch.view_as_complex(xf.contiguous().view(*shape[:-1], -1, 2))
    y = torch.view_as_real(xc * cis.view(len(pos), *([1] * (x.dim() - 2)), d // 2)).flatten(-2)
    if not interleaved:
        y = torch.cat([y[..., 0::2], y[..., 1::2]], -1)
    return y.to(torch.bfloat16)


def capture(module, store, what="input"):
    def hook(mod, args, out):
        store.append(args if what == "input" else out)

    return module.register_forward_hook(hook)


def single_prefill(model, tokens, num_slots=512):
    """Run one sequence from position 0; returns (hidden, meta, cache)."""
    cache = m.KVCache(model.cfg, num_slots)
    table = torch.randperm(num_slots)[None]  # a scattered page table: slots are looked up
    meta = build_meta("prefill", [0], [len(tokens)], table)
    return model(tokens, meta, cache), meta, cache


def prefill_capturing(model, n_tokens, seed, taps):
    """single_prefill of random tokens with forward hooks; taps {name: (module, "input" | "output")}.
    Returns ({name: the first captured args or output}, hidden, meta, cache)."""
    torch.manual_seed(seed)
    got = {name: [] for name in taps}
    hooks = [capture(mod, got[name], what) for name, (mod, what) in taps.items()]
    h, meta, cache = single_prefill(model, torch.randint(6, model.cfg.vocab_size, (n_tokens,)))
    for hk in hooks:
        hk.remove()
    return {name: v[0] for name, v in got.items()}, h, meta, cache


def projection(attn, part, x):
    """x times one of MLA's projections of x ("wq_a", "indexer.wk" or "wkv_a": the checkpoint's q_a_proj,
    indexer.wk, kv_a_proj_with_mqa) as an FP8 linear of its own."""
    lin = attn.indexer.wk if part == "indexer.wk" else getattr(attn, part)
    return m.fp8_linear(x, lin.weight, lin.scale)


def linear_ref(x, lin):
    """An FP8 linear from spec 3.3, in fp64 and unrounded: x fake-quantized in 1x128 groups (fake_quant_ref)
    times the block-dequantized weight (lin: anything with the checkpoint's .weight and .scale)."""
    return fake_quant_ref(x) @ m.weight_dequant(lin.weight, lin.scale).double().T


def mlp_ref(x, w1, w3, w2):
    """SwiGLU (spec 3.4) in fp64, unrounded: w2(silu(x W1^T) * x W3^T), the gate and up products and their
    product rounded to bf16 as the reference's linears return them."""
    gate, up = linear_ref(x, w1).to(torch.bfloat16), linear_ref(x, w3).to(torch.bfloat16)
    return linear_ref((F.silu(gate.float()) * up.float()).to(torch.bfloat16), w2)


def naive_mla(attn, x, pos, latent, kpe, allowed):
    """Per-head MLA in fp64 from spec 3.6: q from x, per-head K = [W_UK c, k_pe], V = W_UV c over the context
    latents c, softmax over `allowed` [S, N] keys. Returns the o_proj input [S, H*V]."""
    cfg = attn.cfg
    H, D, R, V = cfg.n_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    qr = rms_norm_ref(linear_ref(x, attn.wq_a).to(torch.bfloat16), attn.q_norm.weight, cfg.eps)
    q = linear_ref(qr, attn.wq_b).to(torch.bfloat16).view(len(x), H, D + R)
    q = torch.cat([q[..., :D], rope_ref(q[..., D:], pos, cfg, interleaved=True)], -1).double()
    w = m.weight_dequant(attn.wkv_b.weight, attn.wkv_b.scale).double().view(H, D + V, -1)
    k_nope = torch.einsum("hdc,nc->nhd", w[:, :D], latent.double())
    v = torch.einsum("hvc,nc->nhv", w[:, D:], latent.double())
    k = torch.cat([k_nope, kpe.double()[:, None].expand(-1, H, -1)], -1)
    scores = torch.einsum("shd,nhd->shn", q, k) * cfg.softmax_scale
    scores = scores.masked_fill(~allowed[:, None, :], float("-inf"))
    return torch.einsum("shn,nhv->shv", scores.softmax(-1), v).flatten(1)


def moe_ref(x, moe, cfg):
    """The MoE (spec 3.9) in fp64: sigmoid scores; the bias steers selection only: the n_limited_groups groups
    of the largest top-2 biased score sums, then the top experts in them; weights: the unbiased scores of the
    chosen, renormalized, times route_scale; each chosen expert's SwiGLU output rounded to bf16 (as the
    reference's experts return it) times its weight, plus the shared expert. -> (output [T, dim] unrounded,
    chosen experts [T, A])."""
    s = (x.double() @ moe.gate.weight.double().T).sigmoid()
    biased = (s + moe.gate.bias.double()).view(len(x), cfg.n_expert_groups, -1)
    keep = biased.topk(2, -1).values.sum(-1).topk(cfg.n_limited_groups, -1).indices
    masked = torch.full_like(biased, float("-inf"))
    for t in range(len(x)):
        masked[t, keep[t]] = biased[t, keep[t]]
    idx = masked.flatten(1).topk(cfg.n_activated_experts, -1).indices
    weights = s.gather(1, idx) / s.gather(1, idx).sum(-1, keepdim=True) * cfg.route_scale
    ex = moe.experts

    def expert(e):  # expert e's three linears, from the stacks
        return [SimpleNamespace(weight=lin.weight[e], scale=lin.scale[e]) for lin in (ex.w1, ex.w3, ex.w2)]

    y = mlp_ref(x, moe.shared_experts.w1, moe.shared_experts.w3, moe.shared_experts.w2)
    for t in range(len(x)):
        for e, w in zip(idx[t].tolist(), weights[t].tolist(), strict=True):
            y[t] += mlp_ref(x[t : t + 1], *expert(e))[0].to(torch.bfloat16).double() * w
    return y, idx


def assert_bf16_close(got, want, what):
    """`got` was rounded to bf16 once from a value equal to `want` up to fp64 rounding: half a bf16 ulp (2^-9
    relative) apart, plus an absolute floor for entries near zero."""
    err = (got.double() - want.double()).abs()
    bound = 2**-8 * want.double().abs() + 1e-6 * want.double().abs().max()
    assert (err <= bound).all(), f"{what}: max err {err.max():.3e}, max |want| {want.abs().max():.3e}"


# ------------------------------------------------------------------------------------------------------------
# config and checkpoint format
# ------------------------------------------------------------------------------------------------------------
def test_config_json_round_trip(tmp_path):
    for cfg in (m.Config.tiny(), m.Config.full(), m.Config.full(n_layers=2)):
        with open(tmp_path / "config.json", "w") as f:
            json.dump(hf_config(cfg), f)
        assert m.Config.from_json(str(tmp_path)) == cfg
    hf = hf_config(m.Config.full())
    assert hf["num_hidden_layers"] == 61 and hf["first_k_dense_replace"] == 3 and hf["n_group"] == 8
    assert hf["quantization_config"]["weight_block_size"] == [128, 128]
    assert abs(m.Config.full().softmax_scale - 0.1352337788608801) < 1e-12


def test_config_json_reads_only_its_own_names(tmp_path):
    """Keys spelled as this engine's names of renamed or nested fields (eps, not rms_norm_eps; mscale outside
    rope_scaling) are not config.json's: they change nothing (they used to override the real fields)."""
    hf = hf_config(m.Config.tiny()) | dict(eps=0.5, max_seq_len=5000, route_scale=1.0, mscale=3.0, dim=128)
    (tmp_path / "config.json").write_text(json.dumps(hf))
    assert m.Config.from_json(str(tmp_path)) == m.Config.tiny()


def test_config_rejects_other_models(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 4096}))
    with pytest.raises(ValueError, match="not a DeepSeek-V3.2 config"):
        m.Config.from_json(str(tmp_path))
    hf = hf_config(m.Config.tiny())
    hf["quantization_config"]["scale_fmt"] = None
    (tmp_path / "config.json").write_text(json.dumps(hf))
    with pytest.raises(ValueError, match="scale_fmt None is not supported"):
        m.Config.from_json(str(tmp_path))
    hf["quantization_config"]["scale_fmt"] = "ue8m0"
    hf["n_group"] = 3
    (tmp_path / "config.json").write_text(json.dumps(hf))
    with pytest.raises(ValueError, match="invalid DeepSeek-V3.2 config: experts must split evenly"):
        m.Config.from_json(str(tmp_path))


def test_full_checkpoint_names_and_shapes():
    """Spot-check the 671B tensor table against spec 2.1 / 2.3 (names, shapes, scale shapes incl. edge
    blocks)."""
    t = hf.checkpoint_tensors(m.Config.full())
    L = "model.layers."
    assert t[L + "0.self_attn.kv_a_proj_with_mqa.weight_scale_inv"][0] == [5, 56]
    assert t[L + "0.self_attn.q_b_proj.weight"][0] == [24576, 1536]
    assert t[L + "0.self_attn.kv_b_proj.weight_scale_inv"][0] == [256, 4]
    assert t[L + "0.self_attn.o_proj.weight_scale_inv"][0] == [56, 128]
    assert t[L + "0.self_attn.indexer.wk.weight_scale_inv"][0] == [1, 56]
    assert t[L + "0.self_attn.indexer.weights_proj.weight"] == ([64, 7168], "bf16")
    assert t[L + "2.mlp.down_proj.weight_scale_inv"][0] == [56, 144]
    assert t[L + "3.mlp.experts.255.up_proj.weight_scale_inv"][0] == [16, 56]
    assert t[L + "60.mlp.gate.e_score_correction_bias"] == ([256], "f32")
    assert (
        t[L + "61.eh_proj.weight"] == ([7168, 14336], "bf16") and L + "61.eh_proj.weight_scale_inv" not in t
    )
    assert t[L + "61.shared_head.head.weight"][0] == [129280, 7168]
    assert L + "61.mlp.experts.0.gate_proj.weight" in t and L + "62.enorm.weight" not in t
    assert len([k for k in t if k.startswith(L + "61.") and k.endswith("_proj.weight")]) == 3 * 257 + 6


def test_full_width_model_matches_checkpoint_table():
    """The module tree built for the 671B config (on the meta device: no memory) has exactly the checkpoint's
    tensors under the name mapping, with the same shapes; the routed experts' tensors fill their stacks (w1,
    w2, w3 [E, ...]) exactly, element for element."""
    cfg = m.Config.full()
    with torch.device("meta"):
        model = m.Transformer(cfg)
    params = dict(model.named_parameters())
    filled = dict.fromkeys(params, 0)
    for k, (shape, _kind) in hf.checkpoint_tensors(cfg).items():
        assert list(hf.load_target(params, cfg, k, 0, 1).shape) == shape, k
        owner = re.sub(r"\.experts\.\d+\.", ".experts.", hf.ours_name(cfg.n_layers, k))
        filled[owner] += math.prod(shape)
    assert filled == {k: p.numel() for k, p in params.items()}


@full  # the random checkpoints' sanity
def test_random_checkpoint_activations_stay_realistic(model):
    """Residual stream RMS stays O(1) through every layer (finite, neither vanishing nor exploding)."""
    taps = {i: (layer, "output") for i, layer in enumerate(model.layers)}
    got, h, _, _ = prefill_capturing(model, 50, 16, taps)
    for i, (x, res) in got.items():
        for name, t in (("ffn out", x), ("residual", res)):
            rms = t.float().pow(2).mean().sqrt()
            assert torch.isfinite(t.float()).all() and 0.05 < rms < 20, f"layer {i} {name} rms {rms:.3g}"
    assert 0.5 < model.logits(h).std() < 20


def test_write_load_round_trip_exact(tiny_dir, model):
    from safetensors.torch import load_file

    with open(os.path.join(tiny_dir, "model.safetensors.index.json")) as f:
        index = json.load(f)
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    params = dict(model.named_parameters(remove_duplicate=False))
    expected = hf.checkpoint_tensors(model.cfg)
    seen = set()
    for file in files:
        for name, t in load_file(os.path.join(tiny_dir, file)).items():
            assert index["weight_map"][name] == file
            p = hf.load_target(params, model.cfg, name, 0, 1)
            kind = expected[name][1]
            assert p.dtype == {"fp8": torch.float8_e4m3fn, "scale": torch.float32}.get(kind, p.dtype)
            assert torch.equal(p.float(), t.float()), name  # bit-exact, upcasts are exact
            seen.add(name)
    assert seen == set(expected)
    assert model.layers[0].attn.wq_a.weight.dtype == torch.float8_e4m3fn
    assert model.norm.weight.dtype == torch.float32 and model.head.weight.dtype == torch.float32


@full
def test_index_total_size_is_the_tensor_bytes(tiny_dir, tmp_path):
    """model.safetensors.index.json's metadata.total_size is the bytes of every tensor (as in the official
    index), for the random and the sparse writer alike."""
    from safetensors import safe_open

    save_sparse_checkpoint(str(tmp_path), m.Config.tiny(), shard_bytes=1 << 20)
    for path in (tiny_dir, str(tmp_path)):
        total = 0
        for file in hf.shard_files(path)[0]:
            with safe_open(file, "pt") as f:
                for name in f.keys():
                    t = f.get_slice(name)
                    dtype = hf.SAFETENSORS_DTYPES[t.get_dtype()]
                    total += math.prod(t.get_shape()) * dtype.itemsize
        with open(os.path.join(path, "model.safetensors.index.json")) as f:
            assert json.load(f)["metadata"]["total_size"] == total, path


@full
def test_weights_dequantized_at_load_give_the_same_logits(tiny_dir, model, monkeypatch):
    """The references' FP8 weights dequantized once at load (DEQUANTIZE_AT_LOAD_BYTES) vs at every call:
    the same values, so bit-identical logits, with and without MTP; the FP8 parameters stay as loaded."""
    assert model.layers[0].attn.wq_a.dequantized is not None  # the tiny model is small enough
    prompts = mixed_prompts(3)
    at_load = {
        k: make_llm(tiny_dir, k).generate(prompts, max_new_tokens=6, return_logits=True) for k in (0, 2)
    }
    monkeypatch.setattr(m, "DEQUANTIZE_AT_LOAD_BYTES", 0)
    per_call_model = m.load_model(tiny_dir)
    assert per_call_model.layers[0].attn.wq_a.dequantized is None
    for k, want in at_load.items():
        got = m.LLM(tiny_dir, device="cpu", mtp=k, model=per_call_model).generate(
            prompts, max_new_tokens=6, return_logits=True
        )
        for a, b in zip(got, want, strict=True):
            assert a.token_ids == b.token_ids and torch.equal(a.logits, b.logits)


@full
def test_dequantize_at_load_counts_the_widened_plain_weights_too(tiny_dir, model, monkeypatch):
    """DEQUANTIZE_AT_LOAD_BYTES bounds every copy the references would make: the plain weights widened to the
    accumulation dtype (the fp32 heads, weights_proj, eh_proj) as well as the dequantized FP8 ones. wkv_b gets
    none: only its halves W_UK and W_UV, made at bind, are read."""
    named = model.named_modules()
    linears = {mod.weight for n, mod in named if isinstance(mod, m.Linear) and not n.endswith("wkv_b")}
    fp8 = sum(w.numel() for w in linears if w.dtype == torch.float8_e4m3fn)
    assert sum(w.numel() for w in linears) > fp8  # the plain weights add to the copies
    monkeypatch.setattr(m, "DEQUANTIZE_AT_LOAD_BYTES", fp8 * 8)  # room for the FP8 copies alone
    assert m.load_model(tiny_dir).head.dequantized is None
    monkeypatch.setattr(m, "DEQUANTIZE_AT_LOAD_BYTES", sum(w.numel() for w in linears) * 8)
    loaded = m.load_model(tiny_dir)
    assert loaded.head.dequantized is not None and loaded.layers[0].attn.wq_a.dequantized is not None
    assert all(layer.attn.wkv_b.dequantized is None for layer in loaded.layers)


@full
def test_random_model_on_device_equals_written_checkpoint(tiny_dir, model):
    """random_model (its GPU-side generator) follows the writer's recipe: on CPU it gives the same
    tensors."""
    built = random_model(m.Config.tiny(), "cpu", seed=0)
    want = dict(model.named_parameters())
    for name, p in built.named_parameters():
        assert torch.equal(p.float(), want[name].float()), name


@pytest.mark.parametrize(
    "fault", quick_sample(["missing", "unexpected", "unexpected_short", "shape", "dtype"], "missing", "shape")
)
def test_loader_rejects_bad_tensors(tiny_dir, tmp_path, fault):
    from safetensors.torch import load_file, save_file

    bad = str(tmp_path / "bad")
    shutil.copytree(tiny_dir, bad)
    with open(os.path.join(bad, "model.safetensors.index.json")) as f:
        index = json.load(f)
    victim = "model.layers.1.self_attn.kv_b_proj.weight"
    file = os.path.join(bad, index["weight_map"][victim])
    tensors = load_file(file)
    if fault == "missing":
        del tensors[victim]
        message = f"missing tensor {victim}"
    elif fault == "unexpected":
        victim = "model.layers.1.self_attn.rotary_emb.inv_freq"
        tensors[victim] = torch.zeros(32)
        message = f"unexpected tensor {victim}"
    elif fault == "unexpected_short":  # an experts name too short for a layer's (an IndexError once)
        victim = "model.mlp.experts.0.weight"
        tensors[victim] = torch.zeros(32)
        message = f"unexpected tensor {victim}"
    elif fault == "shape":
        tensors[victim] = tensors[victim][:-1].contiguous()
        message = f"tensor {victim} has shape"
    else:
        tensors[victim] = tensors[victim].to(torch.bfloat16)
        message = f"tensor {victim} has dtype BF16, expected float8_e4m3fn"
    save_file(tensors, file, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=message.replace(".", r"\.")):
        m.load_model(bad)


def test_fp8_block_dequant_matches_source(model):
    """Written FP8 weights dequantize to the seeded source within FP8 error, edge blocks included."""
    cfg = model.cfg
    params = dict(model.named_parameters(remove_duplicate=False))
    checked_edge = False
    for name, (shape, kind) in hf.checkpoint_tensors(cfg).items():
        if kind != "fp8" or ".experts." in name and ".experts.0." not in name:
            continue
        w8, s = (
            hf.load_target(params, cfg, name, 0, 1),
            hf.load_target(params, cfg, name + "_scale_inv", 0, 1),
        )
        assert torch.equal(s, 2.0 ** torch.log2(s).round()), f"{name}: scales are not powers of two"
        src = random_weight(name, shape, kind, seed=0)
        deq = m.weight_dequant(w8, s)
        s_full = s.repeat_interleave(128, 0)[: shape[0]].repeat_interleave(128, 1)[:, : shape[1]]
        err = (deq - src).abs()
        # e4m3: 3 mantissa bits -> half-ulp 2^-4 relative for normals; subnormal spacing 2^-9 times the block
        # scale
        assert (err <= 2**-4 * src.abs() + 2**-10 * s_full).all(), name
        assert err.max() > 0, f"{name}: no quantization happened"
        if shape[0] % 128:
            edge = slice(shape[0] // 128 * 128, shape[0])
            assert (err[edge] <= 2**-4 * src[edge].abs() + 2**-10 * s_full[edge]).all()
            checked_edge = True
    assert checked_edge, "no weight with a partial edge block was checked"


# ------------------------------------------------------------------------------------------------------------
# units that end-to-end logits on random weights cannot see (spec section 9)
# ------------------------------------------------------------------------------------------------------------
def test_activation_quantization_before_fp8_linear(model):
    lin = model.layers[0].attn.wq_a
    x = (torch.randn(7, model.cfg.dim) * torch.logspace(-2, 1, model.cfg.dim)).to(torch.bfloat16)
    w = m.weight_dequant(lin.weight, lin.scale).double()
    want = (fake_quant_ref(x) @ w.T).to(torch.bfloat16)
    unquantized = (x.double() @ w.T).to(torch.bfloat16)
    got = lin(x)
    assert torch.equal(got, want)
    assert (unquantized.float() - want.float()).abs().max() > 1e-2 * want.float().abs().max()
    q, s = m.act_quant(x)
    assert q.dtype == torch.float8_e4m3fn and torch.equal(s, 2.0 ** torch.log2(s).round())
    assert torch.equal(m.act_dequant(q, s), fake_quant_ref(x).float())


def test_cached_latent_is_fp8_round_tripped(model):
    attn = model.layers[1].attn
    got, _, meta, cache = prefill_capturing(model, 40, 1, {"x": (attn, "input")})
    x = got["x"][0]
    kv = attn.kv_norm(projection(attn, "wkv_a", x)[:, : model.cfg.kv_lora_rank])
    cached = cache.layer(1).latents(meta.slots)[0]  # FP8 values times their scales
    assert cache.layer(1).kv.dtype == m.FP8 and torch.equal(cached.double(), fake_quant_ref(kv))
    assert not torch.equal(cached, kv.float()), "the latent was cached without the FP8 rounding"


def test_indexer_key_uses_hadamard(model):
    got, _, meta, cache = prefill_capturing(model, 30, 2, {"x": (model.layers[0].attn, "input")})
    cfg = model.cfg
    idx = model.layers[0].attn.indexer
    x = got["x"][0]
    k = projection(model.layers[0].attn, "indexer.wk", x).float()
    k = F.layer_norm(k, (128,), idx.k_norm.weight, idx.k_norm.bias, cfg.eps)
    k = k.to(torch.bfloat16)
    k = torch.cat([rope_ref(k[:, :64], meta.positions, cfg, interleaved=False), k[:, 64:]], -1)
    with_h = fake_quant_ref((k.double() @ sylvester(128) / math.sqrt(128)).to(torch.bfloat16))
    without_h = fake_quant_ref(k)
    cached = cache.ik[0][meta.slots].double() * cache.iks[0][meta.slots, None].double()
    assert torch.equal(cached, with_h)
    assert not torch.equal(cached, without_h)


def test_final_norm_hidden_is_what_mtp_and_head_see(model):
    got, h, _, _ = prefill_capturing(model, 12, 3, {"last": (model.layers[-1], "output")})
    x, residual = got["last"]  # the last FFN half as its unrounded sum: the norm rounds it to bf16 first
    r = x.to(torch.bfloat16).float() + residual.float()
    want = rms_norm_ref(r, model.norm.weight, model.cfg.eps)
    assert torch.equal(h, want), "forward must return the hidden state after the final norm"
    assert not torch.equal(h, r.to(torch.bfloat16))
    assert torch.equal(model.logits(h), (h.double() @ model.head.weight.double().T).float())


def test_residual_stream_adds_every_half(model):
    """Each block half's norm input, recomputed from the spec's x = x + f(norm(x)): the residual stream (the
    embedding plus every earlier half's output, each rounded to bf16 as the reference's layers return them,
    the stream rounded to bf16 after each add) plus the last half's output, normed in fp32 as it is (the fused
    add + norm); the final norm sees the sum after the last half. Half outputs and norm inputs are captured at
    the attention and FFN modules; the norm is rms_norm_ref, written from the spec."""
    cfg = model.cfg
    taps = {}
    norms = []  # (layer, half, its norm) in the order they run
    for i, layer in enumerate(model.layers):
        for half in ("attn", "ffn"):
            taps[(i, half, "in")] = (getattr(layer, half), "input")
            taps[(i, half, "out")] = (getattr(layer, half), "output")
            norms.append((i, half, getattr(layer, f"{half}_norm")))
    torch.manual_seed(13)
    tokens = torch.randint(6, cfg.vocab_size, (20,))
    got = {name: [] for name in taps}
    hooks = [capture(mod, got[name], what) for name, (mod, what) in taps.items()]
    h, _, _ = single_prefill(model, tokens)
    for hk in hooks:
        hk.remove()
    stream = torch.full((len(tokens), cfg.dim), -0.0)  # the residual stream, bf16 values in fp32
    out = F.embedding(tokens, model.embed.weight)  # what the first norm adds to it
    for i, half, norm in norms:
        total = stream + out.to(torch.bfloat16).float()
        want = rms_norm_ref(total, norm.weight, cfg.eps)
        assert torch.equal(got[(i, half, "in")][0][0], want), f"layer {i} {half} input"
        stream, out = total.to(torch.bfloat16).float(), got[(i, half, "out")][0]
    assert torch.equal(
        h, rms_norm_ref(stream + out.to(torch.bfloat16).float(), model.norm.weight, cfg.eps)
    ), "final norm"


def test_meta_decode_equals_meta_rows():
    """Meta.decode (a round's rows from start positions on the device, through the op decode_rows) against
    Meta.rows (the same rows as prompt_rows makes them on the host): positions, row requests, slots, causal
    lengths."""
    table = torch.randperm(5000)[:120].view(3, 40) + 1
    start = torch.tensor([5, 0, 33])
    for n in (1, 4):
        got = m.Meta.decode(m.TORCH_OPS, start, n, table)
        want = build_meta("decode", start.tolist(), [n] * 3, table)
        for name in ("positions", "row_req", "slots", "ctx_lens"):
            assert torch.equal(getattr(got, name), getattr(want, name)), (n, name)
        assert got.cu_seqlens == want.cu_seqlens and got.table is table


def test_hadamard_and_rope_match_references():
    torch.manual_seed(4)
    x = torch.randn(5, 3, 128).to(torch.bfloat16)
    assert torch.equal(m.hadamard(x), (x.double() @ sylvester(128) / math.sqrt(128)).to(torch.bfloat16))
    cfg = m.Config.tiny()
    pos = torch.randint(0, 100000, (5,))
    cos, sin = cos_sin(cfg, pos)
    y = torch.randn(5, 3, 64).to(torch.bfloat16)
    for inter in (True, False):
        got, want = m.rope(y, cos, sin, interleaved=inter), rope_ref(y, pos, cfg, interleaved=inter)
        assert (got.float() - want.float()).abs().max() <= 2**-7 * want.float().abs().max()
    assert not torch.equal(m.rope(y, cos, sin, True), m.rope(y, cos, sin, False))
    # the angles bit for bit (1 - (1 - ramp) is not always the ramp in fp32: the 671B model's f'_12 differed)
    for cfg in (m.Config.full(), m.Config.tiny(beta_fast=24.0, rope_factor=8.0)):
        assert torch.equal(m.yarn_frequencies(cfg), yarn_ref(cfg))
        theta = torch.outer(torch.arange(20000, dtype=torch.float32), yarn_ref(cfg))
        assert torch.equal(cos_sin(cfg, torch.arange(20000))[0], theta.cos())


# ------------------------------------------------------------------------------------------------------------
# MLA, DSA: absorbed vs per-head, sparse vs dense, selection vs an fp32 recomputation
# ------------------------------------------------------------------------------------------------------------
def _prefill_then_decode(model, prompt, extra):
    """Prefill `prompt`, then run `extra` tokens as verify rows (each its own decode row); capture layer-1
    attention input of both passes (joined: [len(prompt) + len(extra), dim], row p = position p), and the
    selection and o_proj input of the verify pass."""
    cache = m.KVCache(model.cfg, 512)
    table = torch.randperm(512)[None]
    attn = model.layers[1].attn
    ins, sel, o = [], [], []
    hook = capture(attn, ins)
    model(prompt, build_meta("prefill", [0], [len(prompt)], table), cache)
    hook.remove()
    hooks = [capture(attn, ins), capture(attn.indexer, sel, "output"), capture(attn.wo, o)]
    meta = build_meta("decode", [len(prompt)], [len(extra)], table)
    model(extra, meta, cache)
    for hk in hooks:
        hk.remove()
    return attn, torch.cat([ins[0][0], ins[1][0]]), sel[0], o[0][0], meta


def test_absorbed_decode_equals_naive_per_head_mla(model):
    """Sparse absorbed decode (MLA.forward -> sparse_mla over the FP8 cache) vs naive_mla, per-head MLA in
    fp64 over the indexer's selection. The reference never reads the KV cache: every context position's
    latent is recomputed from layer 1's attention input at that position (the prompt's, captured during its
    prefill; the verify rows' own) as spec 3.6 caches it: kv_a = wkv_a(x) (projection, i.e. m.fp8_linear,
    checked against spec 3.3 by test_activation_quantization_before_fp8_linear), kv = RMSNorm(kv_a[:C])
    with kv_norm's weight (spec 3.2, rms_norm_ref) rounded through FP8 in 1x128 groups with pow2 scales
    (fake_quant_ref), k_pe = kv_a[C:] rotated by interleaved RoPE at its position (rope_ref). A latent
    written to the wrong slot, stored without the norm or the FP8 round trip, or a cached key left unrotated
    is then not shared by both sides. (Bound: the latents equal the cache's bit for bit, so only o's bf16
    rounding remains, within half an ulp: the bound assert_bf16_close already is.)"""
    cfg = model.cfg
    C = cfg.kv_lora_rank
    torch.manual_seed(5)
    prompt = torch.randint(6, cfg.vocab_size, (50,))
    extra = torch.randint(6, cfg.vocab_size, (3,))
    attn, x_all, sel, o, meta = _prefill_then_decode(model, prompt, extra)
    n = len(prompt) + len(extra)
    assert int(meta.ctx_lens.max()) == n and meta.positions.tolist() == list(range(len(prompt), n))
    kv_a = projection(attn, "wkv_a", x_all)  # [n, C + R] bf16
    kv = kv_a[:, :C].float()
    kv = rms_norm_ref(kv, attn.kv_norm.weight, cfg.eps)
    latent = fake_quant_ref(kv)  # [n, C] fp64
    kpe = rope_ref(kv_a[:, C:], torch.arange(n), cfg, interleaved=True)  # [n, R] bf16
    allowed = torch.zeros(len(extra), n, dtype=torch.bool)
    for t in range(len(extra)):
        allowed[t, sel[t][sel[t] >= 0]] = True
    assert allowed.sum(1).tolist() == [cfg.index_topk] * 3  # 51..53 context, top-32 each
    assert not allowed[:, len(prompt) + 1 :].triu().any()  # causal: row t sees positions <= 50 + t
    want = naive_mla(attn, x_all[len(prompt) :], meta.positions, latent, kpe, allowed)
    assert_bf16_close(o, want, "absorbed vs per-head")


def test_sparse_with_topk_covering_context_equals_dense(model, monkeypatch):
    """With a top-k that covers the context the indexer keeps every causal position, so the absorbed sparse
    form (sparse_mla over the selection) is causal attention: 70 decode rows from position 0 (decode rows take
    the sparse form whatever the context; a prompt chunk this short attends densely) against naive_mla, the
    per-head fp64 form, masked causally, over the same cached latents; and against the engine's dense form
    (attend_dense) of the same 70 tokens as one prompt chunk. Spies count which form each pass ran."""
    cfg = model.cfg
    monkeypatch.setattr(cfg, "index_topk", 4096)
    calls = []
    for name, owner in (("sparse_mla", m.TORCH_OPS), ("attend_dense", m.MLA)):
        spied = getattr(owner, name)
        monkeypatch.setattr(owner, name, lambda *a, f=spied, n=name: calls.append(n) or f(*a))
    attn = model.layers[2].attn
    torch.manual_seed(6)
    tokens = torch.randint(6, cfg.vocab_size, (70,))
    table = torch.randperm(512)[None]
    outs = {}
    for mode in ("decode", "prefill"):
        got = {"x": [], "o": []}
        hooks = [capture(attn, got["x"]), capture(attn.wo, got["o"])]
        cache, meta = m.KVCache(cfg, 512), build_meta(mode, [0], [70], table)
        calls.clear()
        model(tokens, meta, cache)
        for hk in hooks:
            hk.remove()
        assert calls == [{"decode": "sparse_mla", "prefill": "attend_dense"}[mode]] * cfg.n_layers, calls
        causal = torch.ones(70, 70, dtype=torch.bool).tril()
        want = naive_mla(attn, got["x"][0][0], meta.positions, *cache.layer(2).latents(meta.slots), causal)
        assert_bf16_close(got["o"][0][0], want, f"{mode} rows (top-k covers all) vs dense causal")
        outs[mode] = got["o"][0][0]
    assert torch.equal(outs["decode"], outs["prefill"])  # (CPU: both forms are one function in fp64)


def test_indexer_selects_true_topk_and_attention_is_masked_dense(model):
    cfg = model.cfg
    S = 90
    attn = model.layers[1].attn
    got, _, meta, cache = prefill_capturing(
        model, S, 7, {"x": (attn, "input"), "sel": (attn.indexer, "output"), "o": (attn.wo, "input")}
    )
    x = got["x"][0]
    sel = got["sel"]
    # independent fp32 recomputation of I[s, t] (spec 3.7), explicit Hadamard matrix and FP8 fake-quantization
    idx = attn.indexer
    H = sylvester(128) / math.sqrt(128)
    qr = attn.q_norm(projection(attn, "wq_a", x))
    q = idx.wq_b(qr).view(S, cfg.index_n_heads, 128)
    q = torch.cat([rope_ref(q[..., :64], meta.positions, cfg, False), q[..., 64:]], -1)
    k = projection(attn, "indexer.wk", x).float()
    k = F.layer_norm(k, (128,), idx.k_norm.weight, idx.k_norm.bias, cfg.eps)
    k = k.to(torch.bfloat16)
    k = torch.cat([rope_ref(k[:, :64], meta.positions, cfg, False), k[:, 64:]], -1)
    qh = fake_quant_ref((q.double() @ H).to(torch.bfloat16))
    kh = fake_quant_ref((k.double() @ H).to(torch.bfloat16))
    w = x.double() @ idx.weights_proj.weight.double().T * cfg.index_n_heads**-0.5 * 128**-0.5
    scores = torch.einsum("shd,td->sht", qh, kh).relu().mul(w[..., None]).sum(1).float()  # [S, S]
    causal = torch.ones(S, S, dtype=torch.bool).tril()
    scores = scores.masked_fill(~causal, float("-inf"))
    checked = 0
    for s in range(S):
        picked = sel[s][sel[s] >= 0]
        n = min(cfg.index_topk, s + 1)
        assert len(picked) == n and len(set(picked.tolist())) == n and (picked <= s).all()
        if s + 1 > cfg.index_topk:
            kth = scores[s].topk(n).values[-1]
            tol = 1e-5 * scores[s, : s + 1].abs().max()
            chosen = torch.zeros(S, dtype=torch.bool)
            chosen[picked] = True
            others = scores[s][~chosen & causal[s]]
            assert (scores[s][chosen] >= kth - tol).all() and (others <= kth + tol).all()
            checked += 1
    assert checked == S - cfg.index_topk
    allowed = torch.zeros(S, S, dtype=torch.bool)
    for s in range(S):
        allowed[s, sel[s][sel[s] >= 0]] = True
    assert not torch.equal(allowed, causal)
    want = naive_mla(attn, x, meta.positions, *cache.layer(1).latents(meta.slots), allowed)
    assert_bf16_close(got["o"][0], want, "sparse attention vs dense masked to the selection")


# ------------------------------------------------------------------------------------------------------------
# whole model: decode vs prefill, chunked prefill, MTP
# ------------------------------------------------------------------------------------------------------------
def test_decode_token_by_token_equals_prefill(model):
    """Several requests batched, contexts past index_topk. On CPU the two paths compute the same sums in fp64
    and round to bf16 at the same points, so logits agree to fp64 rounding (bound 1e-4 relative; observed:
    equal)."""
    cfg = model.cfg
    torch.manual_seed(8)
    lens = [45, 20, 33]
    steps = 6
    seqs = [torch.randint(6, cfg.vocab_size, (n + steps,)) for n in lens]
    table = torch.randperm(3 * 128).view(3, 128)
    ref_cache = m.KVCache(cfg, 3 * 128)
    full = build_meta("prefill", [0] * 3, [len(s) for s in seqs], table)
    ref = model.logits(model(torch.cat(seqs), full, ref_cache))
    cache = m.KVCache(cfg, 3 * 128)
    model(
        torch.cat([s[:n] for s, n in zip(seqs, lens, strict=True)]),
        build_meta("prefill", [0] * 3, lens, table),
        cache,
    )
    for i in range(steps):
        meta = build_meta("decode", [n + i for n in lens], [1] * 3, table)
        got = model.logits(
            model(torch.stack([s[n + i] for s, n in zip(seqs, lens, strict=True)]), meta, cache)
        )
        want = ref[[full.cu_seqlens[b] + lens[b] + i for b in range(3)]]
        assert (got - want).abs().max() <= 1e-4 * want.abs().max(), f"step {i}"


def _chunk_plan(targets, max_prefill_tokens=100, index_topk=150):
    """Run the scheduler's prefill-chunk choice to the end over prompts whose prefilled part (all but the
    last token) has the given lengths: the chunks (request, first position, length) of every step."""
    from types import SimpleNamespace

    sched = m.Scheduler(None, 8, max_prefill_tokens, 0, index_topk)
    reqs = [SimpleNamespace(idx=i, prompt_len=n + 1, num_cached=0) for i, n in enumerate(targets)]
    steps = []
    while any(r.num_cached < r.prompt_len - 1 for r in reqs):
        chunks = sched.prefill_chunks([r for r in reqs if r.num_cached < r.prompt_len - 1])
        steps.append([(r.idx, start, n) for r, start, n in chunks])
        for r, _, n in chunks:
            r.num_cached += n
    return steps


def test_prompt_chunks_do_not_depend_on_other_requests(monkeypatch):
    """A prompt is cut at multiples of max_prefill_tokens whatever runs before it (a chunk that does not fit
    waits), and no step mixes chunks of the per-head form (more than DECODE_ROWS_MAX rows, the context
    within top-k) with decode rows."""
    monkeypatch.setattr(m, "DECODE_ROWS_MAX", 40)  # (both forms at these sizes)
    alone = [c for step in _chunk_plan([250]) for c in step]
    assert alone == [(0, 0, 100), (0, 100, 100), (0, 200, 50)]
    forms = set()
    for others in ([30], [30, 60], [120, 5], [260]):
        steps = _chunk_plan(others + [250])
        last = len(others)
        assert [(0, s, n) for step in steps for i, s, n in step if i == last] == alone, others
        for step in steps:
            assert sum(n for _, _, n in step) <= 100
            step_forms = {n > 40 and s + n <= 150 for _, s, n in step}  # per-head or decode rows
            assert len(step_forms) == 1, step  # never together
            forms |= step_forms
    assert forms == {True, False}  # (both occurred)


@full
def test_max_new_tokens_per_prompt(tiny_dir):
    """max_new_tokens as a list: each prompt its own budget, and the same tokens as when run by itself."""
    llm = make_llm(tiny_dir, 1)
    prompts = mixed_prompts(3)
    out = llm.generate(prompts, max_new_tokens=[3, 9, 5])
    for r, n, p in zip(out, [3, 9, 5], prompts, strict=True):
        assert len(r.token_ids) == n or r.finish_reason == "eos"
        assert r.token_ids == llm.generate([p], max_new_tokens=n)[0].token_ids


def test_two_prefill_chunks_equal_one(model):
    cfg = model.cfg
    torch.manual_seed(9)
    seqs = [torch.randint(6, cfg.vocab_size, (n,)) for n in (70, 41)]
    cut = [37, 10]
    table = torch.randperm(256).view(2, 128)
    c1, c2 = m.KVCache(cfg, 256), m.KVCache(cfg, 256)
    one = model.logits(model(torch.cat(seqs), build_meta("prefill", [0, 0], [70, 41], table), c1))
    model(
        torch.cat([s[:c] for s, c in zip(seqs, cut, strict=True)]),
        build_meta("prefill", [0, 0], cut, table),
        c2,
    )
    two = model.logits(
        model(
            torch.cat([s[c:] for s, c in zip(seqs, cut, strict=True)]),
            build_meta("prefill", cut, [70 - 37, 41 - 10], table),
            c2,
        )
    )
    want = torch.cat([one[37:70], one[70 + 10 :]])
    assert (two - want).abs().max() <= 1e-4 * want.abs().max()
    C = cfg.kv_lora_rank
    assert torch.equal(c1.latent[..., :C], c2.latent[..., :C]) and torch.equal(c1.ik.float(), c2.ik.float())


class BF16LayerCache(m.LayerCache):
    """The cache layout before issue 34, written here as it was: the FP8-rounded latent, dequantized, and the
    rope key in one bf16 row of C + R values."""

    def latents(self, slots):
        return self.latent[slots, : self.C].float(), self.latent[slots, self.C :]


def store_latent_bf16(kv, k_pe, norm_weight, eps, cos, sin, cache, slots):
    """store_latent for BF16LayerCache: the same values, dequantized into bf16."""
    latent = m.act_dequant(*m.act_quant(m.rms_norm(kv, None, norm_weight, eps)))
    cache.latent[slots, : cache.C] = latent.to(m.BF16)
    cache.latent[slots, cache.C :] = m.rope(k_pe, cos, sin, interleaved=True)


def test_fp8_latent_cache_gives_the_bf16_layouts_logits(model, monkeypatch):
    """The cache in DeepSeek's FP8 layout (656 bytes a token and layer at full size) holds the values the
    bf16 layout held (FP8 times a power of two is exact): a prompt chunk within top-k (dense attention), one
    past it (the indexer selects, sparse attention), then decode rows and an MTP step give bit-identical
    logits with either layout."""
    cfg = model.cfg
    assert m.KVCache.row_bytes(m.Config.full()) == 656
    torch.manual_seed(3)
    seq = torch.randint(6, cfg.vocab_size, (60,))
    table = torch.arange(128)[None]
    runs = []
    for layout in ("fp8", "bf16"):
        cache = m.KVCache(cfg, 128)
        if layout == "bf16":
            L, C = cache.latent.shape[0], cfg.kv_lora_rank
            bf16 = torch.zeros(L, 128, C + cfg.qk_rope_head_dim, dtype=m.BF16)
            monkeypatch.setattr(
                cache, "layer", lambda i, b=bf16, c=cache, C=C: BF16LayerCache(b[i], c.ik[i], c.iks[i], C)
            )
            monkeypatch.setattr(m.TORCH_OPS, "store_latent", store_latent_bf16)
        logits = []
        for start, n, mode in ((0, 20, "prefill"), (20, 30, "prefill"), (50, 1, "decode"), (51, 4, "decode")):
            meta = build_meta(mode, [start], [n], table)
            h = model(seq[start : start + n], meta, cache)
            logits += [
                model.logits(h),
                model.mtp[0].logits(model.mtp_forward(seq[start + 1 : start + n + 1], h, meta, cache)),
            ]
        runs.append(logits)
    assert cfg.index_topk < 50  # the second chunk and the decode rows run the indexer and sparse attention
    for got, want in zip(*runs, strict=True):
        assert torch.equal(got, want)


def test_mtp_layer_matches_spec(model):
    """MTP (spec 3.11) recomputed from this file's references alone, no module of the engine computing any
    part: u = eh_proj([enorm(emb(t_{i+1})); hnorm(h_i)]); then a block of its own over u (its residual stream
    starts at u): the attention norm, per-head MLA (naive_mla) over the latents recomputed as spec 3.6 caches
    them (25 positions: within top-k, every causal one is kept), o_proj, the residual add, the FFN norm, the
    MoE (moe_ref); then shared_head's norm of the last residual add, and the head (the main model's, shared).
    The references round where the reference model does, in fp64 between (as the engine on a CPU: observed
    bit-identical)."""
    cfg = model.cfg
    C = cfg.kv_lora_rank
    torch.manual_seed(10)
    tokens = torch.randint(6, cfg.vocab_size, (25,))
    h, meta, cache = single_prefill(model, tokens)
    nxt = torch.cat([tokens[1:], torch.tensor([7])])
    got_h = model.mtp_forward(nxt, h, meta, cache)
    got = model.mtp[0].logits(got_h)

    mtp = model.mtp[0]
    block, attn = mtp.block, mtp.block.attn
    e = F.embedding(nxt, mtp.embed.weight)
    both = [rms_norm_ref(e, mtp.enorm.weight, cfg.eps), rms_norm_ref(h, mtp.hnorm.weight, cfg.eps)]
    u = (torch.cat(both, -1).double() @ mtp.eh_proj.weight.double().T).to(torch.bfloat16)
    x = rms_norm_ref(u, block.attn_norm.weight, cfg.eps)
    kv_a = linear_ref(x, attn.wkv_a).to(torch.bfloat16)
    latent = fake_quant_ref(rms_norm_ref(kv_a[:, :C], attn.kv_norm.weight, cfg.eps))
    kpe = rope_ref(kv_a[:, C:], meta.positions, cfg, interleaved=True)
    causal = torch.ones(len(tokens), len(tokens), dtype=torch.bool).tril()
    o = naive_mla(attn, x, meta.positions, latent, kpe, causal).to(torch.bfloat16)
    stream = u.float() + linear_ref(o, attn.wo).to(torch.bfloat16).float()  # the residual add (fp32)
    ffn, _ = moe_ref(rms_norm_ref(stream, block.ffn_norm.weight, cfg.eps), block.ffn, cfg)
    last = stream.to(torch.bfloat16).float() + ffn.to(torch.bfloat16).float()
    want_h = rms_norm_ref(last, mtp.shared_head.norm.weight, cfg.eps)
    assert_bf16_close(got_h, want_h, "MTP hidden")
    assert torch.equal(got, (got_h.double() @ model.head.weight.double().T).float())  # the head in fp32
    assert mtp.shared_head.head.weight is model.head.weight, "equal copies of the head should be shared"


def test_route_of_a_row_does_not_depend_on_its_batch():
    """The router's weights and choices of a row, bit for bit, alone or at any place in a batch of any size
    (torch's CPU sigmoid rounds a batch's last few elements otherwise: a row alone is all of them)."""
    cfg = m.Config.tiny()  # 8 experts: a row is less than a CPU vector loop's step
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(70, cfg.n_routed_experts, generator=gen) * 3
    bias = torch.randn(cfg.n_routed_experts, generator=gen) * 0.1
    limits = (cfg.n_expert_groups, cfg.n_limited_groups, cfg.n_activated_experts, cfg.route_scale)
    alone = [m.route(logits[t : t + 1], bias, *limits) for t in range(len(logits))]
    for T in range(1, len(logits) + 1):
        weights, idx = m.route(logits[:T], bias, *limits)
        assert torch.equal(weights, torch.cat([w for w, _ in alone[:T]]))
        assert torch.equal(idx, torch.cat([i for _, i in alone[:T]]))


def test_moe_routing_and_output_match_spec(model, monkeypatch):
    """Gate (spec 3.9) recomputed in fp64: the bias steers selection only; group-limited top-k; weights are
    the unbiased scores renormalized times route_scale; output = sum of weighted experts + shared expert."""
    cfg = model.cfg
    moe = model.layers[1].ffn
    monkeypatch.setattr(moe.gate.bias, "data", moe.gate.bias.data * 20)  # make the bias change selections
    torch.manual_seed(11)
    x = torch.randn(64, cfg.dim).to(torch.bfloat16)
    w, idx = moe.gate(x)
    s = (x.double() @ moe.gate.weight.double().T).sigmoid()
    sb = s + moe.gate.bias.double()
    G = cfg.n_expert_groups
    gs = sb.view(64, G, -1).topk(2, -1).values.sum(-1)
    keep = gs.topk(cfg.n_limited_groups, -1).indices
    masked = torch.full_like(sb, float("-inf")).view(64, G, -1)
    for t in range(64):
        masked[t, keep[t]] = sb.view(64, G, -1)[t, keep[t]]
    want_idx = masked.flatten(1).topk(cfg.n_activated_experts, -1).indices
    assert torch.equal(idx.sort(-1).values, want_idx.sort(-1).values)
    assert not torch.equal(
        s.topk(cfg.n_activated_experts, -1).indices.sort(-1).values, want_idx.sort(-1).values
    )
    want_w = s.gather(1, idx) / s.gather(1, idx).sum(-1, keepdim=True) * cfg.route_scale
    assert torch.allclose(w.double(), want_w, rtol=1e-6)
    y = moe(x)
    ex = moe.experts

    def expert(e, v):  # one routed expert alone, from its w1 / w3 / w2 of the stacks
        g = m.fp8_linear(v, ex.w1.weight[e], ex.w1.scale[e]).float()
        u = m.fp8_linear(v, ex.w3.weight[e], ex.w3.scale[e]).float()
        return m.fp8_linear((F.silu(g) * u).to(torch.bfloat16), ex.w2.weight[e], ex.w2.scale[e])

    want_y = torch.stack(
        [
            sum(expert(int(e), x[t : t + 1])[0].float() * w[t, j] for j, e in enumerate(idx[t]))
            + moe.shared_experts(x[t : t + 1])[0].float()
            for t in range(64)
        ]
    )
    assert_bf16_close(y, want_y, "MoE output")


def test_moe_reference_sums_every_choice(model):
    """moe (the grouped kernel's reference) against each (token, choice) alone: a token that lists an expert
    twice gets both terms (the GPU test's one_expert_for_all case can make such rows), and another rank's
    expert (idx E) adds nothing, whether some or all of a token's choices are."""
    torch.manual_seed(13)
    ex = model.layers[1].ffn.experts
    E = ex.w1.weight.shape[0]
    idx = torch.tensor([[1, 1, 2, 3], [E, 0, E, 5], [7, 6, 5, 4], [E, E, E, E], [2, 2, 2, 2]])
    x = torch.randn(len(idx), model.cfg.dim).to(torch.bfloat16)
    w = torch.rand(idx.shape) + 0.1

    def expert(e, v):  # one routed expert alone, from its w1 / w3 / w2 of the stacks
        g = m.fp8_linear(v, ex.w1.weight[e], ex.w1.scale[e]).float()
        u = m.fp8_linear(v, ex.w3.weight[e], ex.w3.scale[e]).float()
        return m.fp8_linear((F.silu(g) * u).to(torch.bfloat16), ex.w2.weight[e], ex.w2.scale[e])[0].float()

    want = torch.zeros(len(idx), model.cfg.dim, dtype=torch.float64)
    for t, row in enumerate(idx.tolist()):
        for j, e in enumerate(row):
            if e < E:
                want[t] += expert(e, x[t : t + 1]).double() * float(w[t, j])
    got = m.moe(x, w, idx, ex)
    assert torch.equal(got[3], torch.zeros_like(got[3]))
    assert_bf16_close(got, want, "MoE reference, every (token, choice)")


def test_dense_mlp_and_shared_expert_match_spec(model):
    """The SwiGLU MLP (spec 3.4) recomputed in fp64 from the dequantized weights: w2(silu(x W1^T) * x W3^T),
    each input FP8-quantized first (fake_quant_ref), the gate and up products rounded to bf16 as the
    reference's linears return them; for the first layer's dense MLP and a MoE layer's shared expert (which
    test_moe_routing_and_output_match_spec computes through the code under test)."""
    torch.manual_seed(12)
    x = torch.randn(9, model.cfg.dim).to(torch.bfloat16)

    def linear(v, lin):
        return fake_quant_ref(v) @ m.weight_dequant(lin.weight, lin.scale).double().T

    for what, mlp in (
        ("dense MLP", model.layers[0].ffn),
        ("shared expert", model.layers[1].ffn.shared_experts),
    ):
        gate, up = linear(x, mlp.w1).to(torch.bfloat16), linear(x, mlp.w3).to(torch.bfloat16)
        want = linear((F.silu(gate.float()) * up.float()).to(torch.bfloat16), mlp.w2)
        swapped = linear((F.silu(up.float()) * gate.float()).to(torch.bfloat16), mlp.w2)
        got = mlp(x)
        assert_bf16_close(got, want, what)
        assert (swapped - want).abs().max() > 0.1 * want.abs().max()  # gate and up told apart


# ------------------------------------------------------------------------------------------------------------
# engine: speculative decoding, rejection sampling, continuous batching, KV pool, chat encoding, CLI
# ------------------------------------------------------------------------------------------------------------
_LLMS = {}


TOKENS = (m.SPECIAL_TOKENS, m.BOS, m.EOS)  # what LLM checks tokenizer.json against


def make_llm(tiny_dir, mtp, **kw):
    key = (mtp, tuple(sorted(kw.items())))
    if key not in _LLMS:
        _LLMS[key] = m.LLM(tiny_dir, device="cpu", mtp=mtp, **kw)
    return _LLMS[key]


def build_meta(mode, starts, lens, table):
    """A prefill step's Meta as LLM.prefill builds it (prompt_rows, Meta.rows): request b's rows at positions
    starts[b] .. starts[b] + lens[b] - 1, the table cut to the longest row's causal length."""
    chunks = [
        m.prompt_rows([0] * (s + n + 1), s, n, b) for b, (s, n) in enumerate(zip(starts, lens, strict=True))
    ]
    rows = torch.cat(chunks, 1).to(table.device)
    cu_seqlens = [0, *torch.tensor(lens).cumsum(0).tolist()]
    width = max(s + n for s, n in zip(starts, lens, strict=True))
    return m.Meta.rows(mode, rows[2], rows[3], table[:, :width], cu_seqlens)


def mixed_prompts(n=8, seed=12):
    g = torch.Generator().manual_seed(seed)
    lens = [3, 70, 17, 41, 9, 55, 28, 36, 64, 12][:n]
    return [torch.randint(6, 262, (k,), generator=g).tolist() for k in lens]


def oracle_drafts(monkeypatch, prompts, reference, wrong_every=7):
    """Replace the round's draft phase (nano_nsa.draft) by an oracle that proposes the plain run's next
    tokens, wrong where (position + seed) % wrong_every == 0, so verify accepts runs of drafts and rejects
    others. The requests are told apart by their seeds: generate with seed=0 (prompt i draws with seed i)."""
    seqs = [list(p) + list(r) for p, r in zip(prompts, reference, strict=True)]
    width = max(len(x) for x in seqs) + 64
    want = torch.tensor([x + [5] * (width - len(x)) for x in seqs])  # [n, width]: the token at each position

    on_device = {}  # `want` on each device, copied at the first (eager) call: a CUDA graph captures it

    def draft(model, cache, h, start, batch, table):
        k = batch.tokens.shape[1] - 1
        if start.device not in on_device:
            on_device[start.device] = want.to(start.device)
        truth = on_device[start.device]
        seeds = batch.seeds[:, None]
        pos = (start[:, None] + 1 + torch.arange(k, device=start.device)).clamp(max=width - 1)  # d_1..d_k
        t = truth[seeds.clamp(max=len(seqs) - 1), pos]
        drafts = torch.where((pos + seeds) % wrong_every == 0, (t + 1) % 262, t)
        return drafts, F.one_hot(drafts, model.cfg.vocab_size).to(batch.q.dtype)  # (greedy: any q will do)

    monkeypatch.setattr(m, "draft", draft)


@pytest.mark.parametrize("mtp", [0, 2])
@full  # the host one round ahead
def test_no_round_is_launched_past_the_end(tiny_dir, monkeypatch, mtp):
    """The host runs one round ahead, but not past the end: requests that end by length get no round whose
    tokens are then dropped. Every launched round is applied (counted by accept_lengths; at mtp 0 one round a
    token), and a batch's tokens are those of its requests alone."""
    llm = make_llm(tiny_dir, mtp)
    monkeypatch.setattr(llm.cfg, "eos_token_id", -1)  # every request ends by length
    calls = []
    round_ = m.speculative_round
    monkeypatch.setattr(m, "speculative_round", lambda *a: calls.append(1) or round_(*a))
    prompts, budgets = mixed_prompts(3), [9, 5, 7]
    alone = [llm.generate([p], max_new_tokens=n)[0].token_ids for p, n in zip(prompts, budgets, strict=True)]
    assert [len(t) for t in alone] == budgets
    calls.clear()
    out = llm.generate([prompts[0]], max_new_tokens=9)[0]
    assert len(calls) == (len(out.accept_lengths) if mtp else 9), calls
    batch = llm.generate(prompts, max_new_tokens=budgets)
    assert [r.token_ids for r in batch] == alone


@pytest.mark.parametrize("temperature", [0.0, 0.8])
@full  # the host one round ahead
def test_the_host_waits_for_a_round_only_near_the_end(tiny_dir, monkeypatch, temperature):
    """A round starts from the rows the round before left on the device, so the host accepts round n while
    round n+1 runs even when the batch changes (a request finished, another was admitted): it waits for the
    round in flight (LLM.settle applying one) only when that round may end every request it still runs."""
    llm = make_llm(tiny_dir, 2, max_batch=2)
    monkeypatch.setattr(llm.cfg, "eos_token_id", -1)  # every request ends by length
    waits, settle = [], llm.settle

    def spy():
        if llm.launched is not None:
            live = [r for r in llm.launched[0] if r.finish is None]
            waits.append(all(len(r.generated) + 3 >= r.max_new_tokens for r in live))
        settle()

    prompts, budgets = mixed_prompts(5), [6, 12, 4, 9, 7]
    out = llm.generate(prompts, max_new_tokens=budgets, temperature=temperature, seed=3)
    assert [len(r.token_ids) for r in out] == budgets
    monkeypatch.setattr(llm, "settle", spy)
    again = llm.generate(prompts, max_new_tokens=budgets, temperature=temperature, seed=3)
    assert [r.token_ids for r in again] == [r.token_ids for r in out]
    assert waits and all(waits), waits  # (the batch changed four times)


@full
def test_interrupted_generate_leaves_the_engine_clean(tiny_dir):
    """A generate stopped by an exception (here an on_tokens that raises, as Ctrl-C would) leaves no request
    in the scheduler and no page taken: the next generate gives a fresh engine's tokens."""
    llm = m.LLM(tiny_dir, device="cpu", mtp=2)
    prompts = mixed_prompts(3)
    want = llm.generate(prompts, max_new_tokens=8)
    free = llm.pool.free_slots

    def stop(idx, tokens):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        llm.generate(prompts, max_new_tokens=8, on_tokens=stop)
    assert not (llm.scheduler.waiting or llm.scheduler.running) and llm.pool.free_slots == free
    again = llm.generate(prompts, max_new_tokens=8)
    assert [r.token_ids for r in again] == [r.token_ids for r in want]


@pytest.mark.parametrize("where", ["swap_out", "swap_in"])
@full
def test_a_generate_interrupted_in_a_kv_swap_leaks_no_page(tiny_dir, where, monkeypatch):
    """Ctrl-C while a preempted request's KV is copied to host memory or back (the longest host work of a
    step): every page comes back to the pool (they leaked: the request was in no queue while swapped out, or
    held pages in the waiting queue while swapped in), and the next generate gives a fresh engine's tokens."""
    per_token = m.KVCache.bytes_per_token(m.Config.tiny())
    llm = m.LLM(tiny_dir, device="cpu", mtp=2, kv_cache_bytes=per_token * 168, page_size=8)
    prompts, free = mixed_prompts(6, seed=14), llm.pool.free_slots
    want = llm.generate(prompts, max_new_tokens=16)
    assert llm.stats["preemptions"] > 0
    swap = getattr(llm.pool, where)

    def ctrl_c():
        raise KeyboardInterrupt

    def interrupted(req, *args):  # the copy of the KV raises, as a Ctrl-C in it would
        with monkeypatch.context() as patch:
            patch.setattr(llm.cache, "tensors", ctrl_c)
            return swap(req, *args)

    monkeypatch.setattr(llm.pool, where, interrupted)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(prompts, max_new_tokens=16)
    assert not (llm.scheduler.waiting or llm.scheduler.running)
    assert llm.pool.free_slots == free, f"{(free - llm.pool.free_slots) // 8} pages leaked"
    monkeypatch.setattr(llm.pool, where, swap)
    assert [r.token_ids for r in llm.generate(prompts, max_new_tokens=16)] == [r.token_ids for r in want]


@pytest.mark.parametrize("mtp", quick_sample([1, 2, 3], 3))
def test_speculative_greedy_equals_plain_greedy(tiny_dir, monkeypatch, mtp):
    prompts = mixed_prompts(8)
    plain = make_llm(tiny_dir, 0).generate(prompts, max_new_tokens=20, return_logits=True)
    ref = [r.token_ids for r in plain]
    assert ref == [r.logits.argmax(-1).tolist() for r in plain]  # greedy: the argmax of each step's logits
    assert any(len(p) + 20 > m.Config.tiny().index_topk for p in prompts)
    spec = make_llm(tiny_dir, mtp)
    mtp_out = spec.generate(prompts, max_new_tokens=20)  # the random MTP layer's own drafts
    assert [r.token_ids for r in mtp_out] == ref
    oracle_drafts(monkeypatch, prompts, ref)
    out = spec.generate(prompts, max_new_tokens=20, return_logits=True, seed=0)  # drafts accepted in runs
    assert [r.token_ids for r in out] == ref
    for a, b in zip(out, plain, strict=True):
        assert len(a.logits) == len(a.token_ids)
        assert (a.logits - b.logits).abs().max() <= 1e-4 * b.logits.abs().max()
    if mtp > 1:
        assert spec.stats["mean_accept_length"] > 1.5 and max(spec.stats["accept_histogram"]) == mtp + 1
        assert spec.stats["accept_histogram"][mtp + 1] > 0


def _chi2(counts, p):
    n = counts.sum()
    return float(((counts - n * p) ** 2 / (n * p)).sum())


CHI2_CRIT_DF5 = 20.515  # chi-square critical value, 5 degrees of freedom, p = 0.001


def _sample_spec(p, q, n_seeds):
    """For seeds 0..n-1, one request each in one batch: draw k drafts from q, verify them against p (m.accept)
    -> the emitted token lists."""
    k = q.shape[0]
    seeds = torch.arange(n_seeds)
    start = torch.zeros(n_seeds, dtype=torch.long)
    qs = q[None].expand(n_seeds, -1, -1).double()
    drafts = m.sample(qs, seeds[:, None], 1 + torch.arange(k), m.DRAFT)  # [n, k]
    tokens = torch.cat([torch.zeros(n_seeds, 1, dtype=torch.long), drafts], 1)
    batch = m.Batch(tokens, start, qs, seeds, torch.ones(n_seeds), torch.ones(n_seeds))
    emitted, counts = m.accept(m.TORCH_OPS, batch, p.log()[None].expand(n_seeds, -1, -1))
    return [e[:c].tolist() for e, c in zip(emitted, counts, strict=True)]


@pytest.mark.parametrize("broken", [None, "residual", "always_accept"])
def test_rejection_sampling_is_exact(monkeypatch, broken):
    """Over many seeds on a 6-token vocabulary, the first emitted token follows p (the main model), and the
    second (when the first draft was accepted) follows p_1; a broken acceptance rule is detected by the same
    test."""
    g = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(3, 6, generator=g) * 1.5, -1)  # main-model rows for k=2 (+ bonus)
    q = torch.softmax(torch.randn(2, 6, generator=g) * 1.5, -1)  # draft distributions
    if broken == "residual":
        monkeypatch.setattr(m, "residual_probs", lambda p_, q_: p_)  # resample from p instead of max(p-q, 0)
    elif broken == "always_accept":
        uniform = m.uniform

        def never_rejects(seeds, positions, stream, n):  # the acceptance test's numbers all 0
            return uniform(seeds, positions, stream, n) * (stream != m.ACCEPT)

        monkeypatch.setattr(m, "uniform", never_rejects)
    outs = _sample_spec(p, q, 12000)
    first = torch.bincount(torch.tensor([o[0] for o in outs]), minlength=6).double()
    second = torch.bincount(torch.tensor([o[1] for o in outs if len(o) > 1]), minlength=6).double()
    stat = max(_chi2(first, p[0].double()), _chi2(second, p[1].double()))
    if broken is None:
        assert stat < CHI2_CRIT_DF5, f"chi2 {stat:.1f}"
    else:
        assert stat > CHI2_CRIT_DF5, f"the broken rule ({broken}) went undetected: chi2 {stat:.1f}"


def test_a_greedy_row_accepts_its_argmax_whatever_its_q():
    """A greedy row's p is one-hot on its argmax: whatever its q (any values here; the engine's is one-hot
    on its drafts), it must keep exactly the drafts equal to its argmax and then emit the argmax."""
    g = torch.Generator().manual_seed(5)
    B, k, V = 64, 3, 6
    logits = torch.randn(B, k + 1, V, generator=g, dtype=torch.float64)
    best = logits.argmax(-1)  # [B, k+1]
    drafts = torch.where(torch.rand(B, k, generator=g) < 0.6, best[:, :k], (best[:, :k] + 1) % V)
    q = torch.rand(B, k, V, generator=g, dtype=torch.float64)
    q[::2] = q[::2] * (torch.rand(B // 2, k, V, generator=g) < 0.5)  # stale q, zero at some wrong drafts
    tokens = torch.cat([torch.zeros(B, 1, dtype=torch.long), drafts], 1)
    batch = m.Batch(
        tokens, torch.zeros(B, dtype=torch.long), q, torch.arange(B), torch.zeros(B), torch.ones(B)
    )
    emitted, counts = m.accept(m.TORCH_OPS, batch, logits)
    want = (drafts == best[:, :k]).cumprod(1).sum(1) + 1
    assert torch.equal(counts, want)
    for b in range(B):  # the accepted drafts, then the argmax at the first wrong one
        assert emitted[b, : want[b]].tolist() == best[b, : want[b]].tolist()


@full
def test_no_two_rows_of_uniform_numbers_are_a_permutation_of_each_other():
    """Each (position, stream) of a request draws its own numbers. Columns keyed as mix(key ^ column) made
    two rows whose keys differ by a small d the same numbers in columns c and c ^ d: a request's draws at
    such positions were tied (about 250 pairs of positions in 4096 tokens at vocab 129,280; here 7 pairs of
    rows among 4096 positions x 3 streams at 512 columns)."""
    positions = torch.arange(4096)
    rows = torch.cat([m.uniform(torch.tensor(7), positions, s, 512) for s in (m.TARGET, m.DRAFT, m.ACCEPT)])
    assert len(torch.unique(rows.sort(-1).values, dim=0)) == len(rows)


@full
def test_the_race_draws_unlikely_tokens_as_often_as_they_should():
    """A token of probability p wins the exponential race when its E is below about p times the winner's: so
    for p down to 1e-10 the numbers must reach that small an E. `uniform`'s smallest numbers lie on a 2^-32
    grid, and `exponential` maps them to -log1p(-u) (fp64, torch's own) within fp32 rounding, everywhere in
    (0, 1]. (As -log u of 24-bit numbers, E was never below 3e-8: a token of 7.5e-9 was drawn at 0.15x.)"""
    u = m.uniform(torch.tensor(3), torch.arange(64), m.TARGET, 1 << 16)  # 4M numbers
    small = u[u < 2**-12].double() * 2**32 - 0.5
    assert len(small) > 500 and torch.equal(small, small.round())  # on the 2^-32 grid
    grid = torch.cat([(torch.arange(64) + 0.5) / 2**32, u.flatten()[:4096], torch.tensor([1 - 2**-24])])
    want = -torch.log1p(-grid.double())
    assert ((m.exponential(grid.float()).double() - want).abs() / want).max() < 1e-6
    assert abs(m.exponential(torch.tensor([1.0])).item() - 25 * math.log(2)) < 1e-5  # (2^-25 of them)
    one = torch.tensor([[0.0, 1.0, 0.0, 0.0]])  # (the only token of p > 0 draws u = 1 at this position)
    assert m.uniform(torch.tensor(7), torch.tensor([779784]), m.TARGET, 4)[0, 1] == 1
    assert m.sample(one, torch.tensor(7), torch.tensor([779784]), m.TARGET).item() == 1
    probs = torch.tensor([[1 - 1e-9, 1e-9]]).double()  # the tiny token wins iff E1 < 1e-9 E0 (about)
    e = m.exponential(torch.tensor([[0.5, 2.5 / 2**32]]))  # its u the third smallest number
    assert (probs / e.double()).argmax(-1).item() == 1


def seeded_sampling_is_batch_invariant(llm, prompts, max_new_tokens):
    """A seeded sampled request's tokens alone, in a batch, in another order and admitted as others finish
    (max_batch 2 on the engine given) are one and the same; returns them."""
    seeds = [1000 + 37 * i for i in range(len(prompts))]
    kw = dict(max_new_tokens=max_new_tokens, temperature=0.8, top_p=0.9)
    together = [r.token_ids for r in llm.generate(prompts, seed=seeds, **kw)]
    backwards = [r.token_ids for r in llm.generate(prompts[::-1], seed=seeds[::-1], **kw)]
    assert backwards[::-1] == together
    for i in (0, len(prompts) - 1):
        assert llm.generate([prompts[i]], seed=[seeds[i]], **kw)[0].token_ids == together[i]
    greedy = [r.token_ids for r in llm.generate(prompts, max_new_tokens=max_new_tokens)]
    assert together != greedy  # (sampling did sample)
    return together


@pytest.mark.parametrize("mtp", quick_sample([0, 2], 2))
def test_seeded_sampling_does_not_depend_on_the_batch(tiny_dir, mtp):
    """Sampling draws from a counter-based generator keyed by a request's seed and each token's position, so a
    seeded request gives the same tokens alone or in any batch (at the same --mtp), as greedy ones do."""
    prompts = mixed_prompts(5, seed=31)
    want = seeded_sampling_is_batch_invariant(make_llm(tiny_dir, mtp), prompts, 12)
    small = make_llm(tiny_dir, mtp, max_batch=2)  # requests join as others finish: other batches
    assert [
        r.token_ids
        for r in small.generate(
            prompts, max_new_tokens=12, temperature=0.8, top_p=0.9, seed=[1000 + 37 * i for i in range(5)]
        )
    ] == want


@full
def test_every_decode_round_is_the_one_speculative_round(tiny_dir, monkeypatch):
    """Greedy and sampled requests, with and without drafts, run their decode rounds through one function,
    speculative_round (verify, accept, draft-extend, draft on the device), once per round, with no mode: its
    arguments are the model, the cache, the decode state, the rows and their page tables (a greedy request is
    one at temperature 0)."""
    calls = []
    round_ = m.speculative_round
    monkeypatch.setattr(m, "speculative_round", lambda *a: calls.append(len(a)) or round_(*a))
    for mtp in (0, 2):
        llm = make_llm(tiny_dir, mtp)
        for temperature in (0.0, 0.7):
            calls.clear()
            llm.generate(mixed_prompts(3), max_new_tokens=6, temperature=temperature, seed=1)
            assert len(calls) == llm.stats["decode_rounds"] > 0 and set(calls) == {5}


def test_continuous_batching_equals_each_prompt_alone(tiny_dir):
    prompts = mixed_prompts(8, seed=13)
    llm = make_llm(tiny_dir, 2, max_batch=3, max_prefill_tokens=24)  # admission as others finish; chunked
    together = llm.generate(prompts, max_new_tokens=12)
    for p, r in zip(prompts, together, strict=True):
        assert llm.generate([p], max_new_tokens=12)[0].token_ids == r.token_ids


@full  # preemption
def test_full_kv_pool_waits_or_preempts(tiny_dir):
    prompts = mixed_prompts(6, seed=14)
    free = make_llm(tiny_dir, 2).generate(prompts, max_new_tokens=16)
    per_token = m.KVCache.bytes_per_token(m.Config.tiny())
    # 160 slots (+ dummy page) for ~300
    small = make_llm(tiny_dir, 2, kv_cache_bytes=per_token * 168, page_size=8)
    out = small.generate(prompts, max_new_tokens=16)
    assert [r.token_ids for r in out] == [r.token_ids for r in free]
    assert small.stats["preemptions"] > 0
    assert len(small.pool.free) == 168 // 8 - 1, "pages leaked"  # all but the dummy page
    with pytest.raises(ValueError, match="can never fit in the KV pool"):
        small.generate([list(range(6, 200))], max_new_tokens=16)


@full  # preemption
def test_preempted_requests_continue_with_the_kv_they_had(tiny_dir):
    """Preemption swaps a request's KV to host memory and back: with a pool small enough to preempt, sampled
    tokens and every emitted token's logits equal those of a pool where nothing is preempted, bit for bit."""
    prompts = mixed_prompts(6, seed=21)
    per_token = m.KVCache.bytes_per_token(m.Config.tiny())
    kw = dict(max_new_tokens=16, temperature=0.8, top_p=0.95, seed=3, return_logits=True)
    large = make_llm(tiny_dir, 2).generate(prompts, **kw)
    small = make_llm(tiny_dir, 2, kv_cache_bytes=per_token * 168, page_size=8)
    out = small.generate(prompts, **kw)
    assert small.stats["preemptions"] > 0
    for a, b in zip(out, large, strict=True):
        assert a.token_ids == b.token_ids
        assert torch.equal(a.logits, b.logits)
    assert len(small.pool.free) == 168 // 8 - 1, "pages leaked"


@full  # preemption
def test_a_request_preempted_in_its_last_round_is_not_swapped_back(tiny_dir, monkeypatch):
    """A request preempted while the round that ends it is in flight finishes in the queue: it leaves it at
    once, and its KV is never copied back (a pool size where this happens, found by trying sizes). Tokens
    equal a pool that never preempts."""
    per_token = m.KVCache.bytes_per_token(m.Config.tiny())
    prompts, budgets = mixed_prompts(6, seed=21), [5, 9, 13, 16, 7, 11]
    roomy = make_llm(tiny_dir, 3)
    small = make_llm(tiny_dir, 3, kv_cache_bytes=per_token * 8 * 16, page_size=8)
    for llm in (roomy, small):
        monkeypatch.setattr(llm.cfg, "eos_token_id", -1)  # every request ends by length
    want = roomy.generate(prompts, max_new_tokens=budgets)
    finished = []  # the finish of each request swapped back in
    swap_in = small.pool.swap_in
    monkeypatch.setattr(small.pool, "swap_in", lambda r, n: finished.append(r.finish) or swap_in(r, n))
    out = small.generate(prompts, max_new_tokens=budgets)
    assert small.stats["preemptions"] > 0 and finished and not any(finished), finished
    assert [r.token_ids for r in out] == [r.token_ids for r in want]
    assert [len(r.token_ids) for r in out] == budgets
    assert len(small.pool.free) == 16 - 1, "pages leaked"


@full  # preemption
def test_a_preempted_request_comes_back_only_with_the_pages_of_a_round(tiny_dir, monkeypatch):
    """A preempted request is swapped back in only when the pool has the pages of its next round: never
    swapped out again at the position it came back at (swapped back with the pages it had and no more, it
    was preempted again at once, its KV copied to the host and back for nothing, 7 times here). Tokens equal a
    pool that never preempts."""
    per_token = m.KVCache.bytes_per_token(m.Config.tiny())
    prompts = [[7] * 10, [8] * 10]
    roomy = make_llm(tiny_dir, 1)
    small = make_llm(tiny_dir, 1, kv_cache_bytes=per_token * 8 * 8, page_size=8)
    for llm in (roomy, small):
        monkeypatch.setattr(llm.cfg, "eos_token_id", -1)  # every request ends by length
    want = roomy.generate(prompts, max_new_tokens=40)
    swapped_out = []  # (request, its position) at each swap-out
    swap_out = small.pool.swap_out
    monkeypatch.setattr(
        small.pool, "swap_out", lambda r: swapped_out.append((r.idx, r.num_cached)) or swap_out(r)
    )
    out = small.generate(prompts, max_new_tokens=40)
    assert swapped_out and len(set(swapped_out)) == len(swapped_out), swapped_out
    assert [r.token_ids for r in out] == [r.token_ids for r in want]
    assert len(small.pool.free) == 8 - 1, "pages leaked"


@full
def test_an_engine_that_does_not_draft_keeps_no_mtp_kv(tiny_dir, monkeypatch):
    """--mtp 0 never runs the MTP layer: its pool holds the main layers' KV only, so the same bytes hold more
    tokens (n_layers + 1 layers' worth over n_layers'; the memory check sizes its minimal pool so too), and
    its tokens are --mtp 1's."""
    cfg, per_token = m.Config.tiny(), m.KVCache.bytes_per_token(m.Config.tiny())
    checked = []  # the KV bytes per token each engine's memory check counts
    monkeypatch.setattr(
        m.hf_checkpoint, "check_fits", lambda cfg, device, model_class, kv: checked.append(kv)
    )
    for mtp in (0, 1):
        m.LLM(tiny_dir, device="cpu", mtp=mtp, kv_cache_bytes=per_token * 8 * 4, page_size=8)
    assert checked == [per_token * cfg.n_layers // (cfg.n_layers + 1), per_token]
    plain = make_llm(tiny_dir, 0, kv_cache_bytes=per_token * 8 * 48, page_size=8)
    drafting = make_llm(tiny_dir, 1, kv_cache_bytes=per_token * 8 * 48, page_size=8)
    assert plain.cache.latent.shape[0] == cfg.n_layers == drafting.cache.latent.shape[0] - 1
    pages = [llm.cache.latent.shape[1] // 8 for llm in (plain, drafting)]
    assert pages == [48 * (cfg.n_layers + 1) // cfg.n_layers, 48]
    prompts = mixed_prompts(3)
    got, want = (llm.generate(prompts, max_new_tokens=8) for llm in (plain, drafting))
    assert [r.token_ids for r in got] == [r.token_ids for r in want]


@full
def test_a_checkpoint_without_an_mtp_layer_runs_without_drafts_only(tmp_path, monkeypatch):
    """A checkpoint with no MTP layer (num_nextn_predict_layers 0) refuses --mtp > 0 in one line before any
    weight is read, and generates at --mtp 0."""
    save_random_checkpoint(str(tmp_path), m.Config.tiny(n_mtp_layers=0), seed=4)
    with (
        monkeypatch.context() as patch,
        pytest.raises(ValueError, match="mtp=2: needs a checkpoint with an MTP"),
    ):
        patch.setattr(m, "load_model", lambda *a: pytest.fail("weights read before the check"))
        m.LLM(str(tmp_path), device="cpu", mtp=2)
    out = m.LLM(str(tmp_path), device="cpu", mtp=0).generate([[0, 7, 9]], max_new_tokens=3)
    assert len(out[0].token_ids) == 3 or out[0].finish_reason == "eos"


@full  # the quick run: seeded sampling alone == batch
def test_sampling_runs_and_is_seeded(tiny_dir):
    llm = make_llm(tiny_dir, 2)
    a = llm.generate(mixed_prompts(3), max_new_tokens=10, temperature=0.9, top_p=0.9, seed=5)
    b = llm.generate(mixed_prompts(3), max_new_tokens=10, temperature=0.9, top_p=0.9, seed=5)
    c = llm.generate(mixed_prompts(3), max_new_tokens=10, temperature=0.9, top_p=0.9, seed=6)
    assert [r.token_ids for r in a] == [r.token_ids for r in b] != [r.token_ids for r in c]
    assert all(len(r.token_ids) == 10 or r.finish_reason == "eos" for r in a)


@full
def test_chat_encoding_refuses_an_unknown_role():
    with pytest.raises(ValueError, match="^unknown chat role 'tool'$"):
        m.encode_chat([{"role": "user", "content": "hi"}, {"role": "tool", "content": "42"}])


@pytest.mark.skipif(
    not os.path.isfile(os.path.join(SHARED, "data", "deepseek-v3.2", "tokenizer.json")),
    reason="../shared/data/deepseek-v3.2 not present",
)
def test_chat_encoding_with_real_tokenizer():
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(os.path.join(SHARED, "data", "deepseek-v3.2", "tokenizer.json"))
    msgs = [
        {"role": "user", "content": "hello"},
        {"role": "assistant", "content": "Hello! I am DeepSeek."},
        {"role": "user", "content": "1+1=?"},
    ]
    ids = tok.encode(m.encode_chat(msgs, thinking=True), add_special_tokens=False).ids
    assert ids == [
        0,
        128803,
        33310,
        128804,
        128799,
        19923,
        3,
        342,
        1030,
        22651,
        4374,
        1465,
        16,
        1,
        128803,
        19,
        13,
        19,
        127252,
        128804,
        128798,
    ]
    plain = tok.encode(m.encode_chat(msgs[:1]), add_special_tokens=False).ids
    assert plain == [0, 128803, 33310, 128804, 128799]


def _cli(args, _unused=None, launch=(), cwd=None):
    """`python [launch...] nano_nsa.py args` (launch: e.g. torchrun's module and options)."""
    import subprocess
    import sys

    env = dict(os.environ, OMP_NUM_THREADS="1")
    here = os.path.dirname(os.path.abspath(__file__))
    return subprocess.run(
        [sys.executable, *launch, os.path.join(here, "nano_nsa.py")] + args,
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        cwd=cwd,
    )


@full  # a process of its own
def test_cli_end_to_end(tiny_dir, tmp_path):
    r = _cli(
        [
            "--model",
            tiny_dir,
            "--prompt",
            "a",
            "--prompt",
            "bb",
            "--json",
            "--max-new-tokens",
            "5",
            "--temperature",
            "0.7",
            "--top-p",
            "0.9",
        ],
        tmp_path / "cache",
    )
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert len(doc["results"]) == 2 and all(len(x["token_ids"]) <= 5 for x in doc["results"])
    assert doc["stats"]["tokens"] == sum(len(x["token_ids"]) for x in doc["results"])
    # the API's tokens and texts for the same settings (the CLI's defaults: --seed 0, --mtp 1)
    api = make_llm(tiny_dir, 1).generate(["a", "bb"], max_new_tokens=5, temperature=0.7, top_p=0.9, seed=0)
    assert [(x["token_ids"], x["text"]) for x in doc["results"]] == [(r.token_ids, r.text) for r in api]


CLI_INPUT_FAULTS = [
    "missing_dir",
    "not_deepseek",
    "too_long",
    "max_new_tokens",
    "temperature",
    "top_p_zero",
    "top_p_big",
    "unknown_option",
    "no_cuda",
    "bad_device",
    "no_prompt",
    "blank_prompt_file",
    "thinking_raw",
    "kv_gb_zero",
    "kv_gb_inf",
]


@pytest.mark.parametrize(
    "case", quick_sample(CLI_INPUT_FAULTS, "missing_dir", "max_new_tokens", "unknown_option")
)
def test_cli_bad_input_is_one_clear_line(tiny_dir, tmp_path, case, capsys):
    (tmp_path / "blank.txt").write_text("\n  \n\n")
    bad = tmp_path / "llama"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({"model_type": "llama"}))
    base = ["--model", tiny_dir, "--prompt", "hi"]
    argv, message = {
        "missing_dir": (["--model", str(tmp_path / "nope"), "--prompt", "hi"], "does not exist"),
        "not_deepseek": (["--model", str(bad), "--prompt", "hi"], "not a DeepSeek-V3.2 config"),
        "too_long": (
            base[:2] + ["--prompt", "x" * 100, "--max-context", "64"],
            "exceeds the context limit of 64",
        ),
        "max_new_tokens": (base + ["--max-new-tokens", "0"], "max_new_tokens must be > 0"),
        "temperature": (base + ["--temperature", "-1"], "temperature must be >= 0"),
        "top_p_zero": (base + ["--top-p", "0"], "top_p must be in (0, 1]"),
        "top_p_big": (base + ["--top-p", "1.5"], "top_p must be in (0, 1]"),
        "unknown_option": (base + ["--bogus"], "unrecognized arguments: --bogus"),
        "no_cuda": (base + ["--device", "cuda"], "CUDA is not available"),
        "bad_device": (base + ["--device", "tpu9"], "unknown device"),
        "no_prompt": (base[:2], "give at least one --prompt or a --prompt-file"),
        "blank_prompt_file": (
            base[:2] + ["--prompt-file", str(tmp_path / "blank.txt")],
            "blank.txt: no prompt in it (one a line; blank lines are skipped)",
        ),
        "thinking_raw": (base + ["--thinking", "--raw"], "thinking=True is a mode of the chat template"),
        "kv_gb_zero": (base + ["--kv-cache-gb", "0"], "--kv-cache-gb must be > 0"),
        "kv_gb_inf": (base + ["--kv-cache-gb", "inf"], "--kv-cache-gb must be a finite number"),
    }[case]
    if case == "no_cuda" and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    try:
        rc = m.main(argv)
    except SystemExit as e:
        rc = e.code
    err = capsys.readouterr().err.strip()
    assert (
        rc != 0
        and err.startswith("error: ")
        and message in err
        and "\n" not in err
        and "Traceback" not in err
    )


@full
def test_cli_kv_cache_gb_sizes_the_pool(tiny_dir, monkeypatch):
    """--kv-cache-gb is LLM's kv_cache_bytes in GiB (the remedy check_prompt names for a request that can
    never fit)."""
    got = {}
    monkeypatch.setattr(
        m, "LLM", lambda model, **kw: got.update(kw) or (_ for _ in ()).throw(ValueError("x"))
    )
    m.main(["--model", tiny_dir, "--prompt", "hi", "--kv-cache-gb", "0.5"])
    assert got["kv_cache_bytes"] == 1 << 29
    m.main(["--model", tiny_dir, "--prompt", "hi"])
    assert got["kv_cache_bytes"] is None


@full
def test_cli_out_of_memory_is_one_line_and_other_runtime_errors_are_raised(tiny_dir, monkeypatch, capsys):
    """Settings too large for the machine end in one line, on the CPU too, whose allocator raises a plain
    RuntimeError (a huge --mtp: the references' scores of thousands of verify rows); any other RuntimeError
    is a bug, raised with its traceback."""
    errors = {
        "cpu": RuntimeError(
            "DefaultCPUAllocator: can't allocate memory: you tried to allocate 3457920224 bytes"
        ),
        "gpu": torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 488.00 GiB"),
    }
    for e in errors.values():
        monkeypatch.setattr(m.LLM, "generate", lambda self, *a, e=e, **kw: (_ for _ in ()).throw(e))
        assert "allocate" in _cli_error(["--model", tiny_dir, "--prompt", "hi", "--mtp", "0"], capsys)
    monkeypatch.setattr(m.LLM, "generate", lambda self, *a, **kw: (_ for _ in ()).throw(RuntimeError("bug")))
    with pytest.raises(RuntimeError, match="bug"):
        m.main(["--model", tiny_dir, "--prompt", "hi", "--mtp", "0"])


@full
def test_cli_prints_the_held_back_end_of_a_streamed_text(capsys):
    """A streamed text is printed as whole characters; where generation stops inside one (its text ends in
    U+FFFD), print_results prints that held-back end, so the stream ends as the text does."""
    stats = dict(
        tokens=3, seconds=1.0, tokens_per_s=3.0, mean_accept_length=None, index_topk=4, longest_context=5
    )
    result = SimpleNamespace(text="Named\ufffd")
    cli.print_results(SimpleNamespace(json=False), ["p"], [result], stats, SimpleNamespace(printed="Named"))
    assert capsys.readouterr().out == "\ufffd\n"


@full  # a process of its own
def test_cli_reader_that_goes_away_is_no_traceback():
    """`python nano_nsa.py ... | head -c 1`: stdout's reader takes the first byte of the streamed text, then
    closes the pipe while generation goes on; the command exits with code 1 and writes nothing to stderr (no
    BrokenPipeError traceback, no error line, no stats line). A run that fails before it prints gives no
    first byte and an error line."""
    import subprocess

    argv = ["--prompt", QUICK_START_PROMPT, "--raw", "--max-new-tokens", "200", "--mtp", "0"]
    argv += ["--temperature", "0", "--device", "cpu"]  # (the demo: code, no early EOS)
    p = subprocess.Popen(
        [sys.executable, "nano_nsa.py", *argv],
        cwd=os.path.dirname(m.__file__),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    first = p.stdout.read(1)  # (blocks until the text starts streaming, or the process ends)
    p.stdout.close()
    err = p.stderr.read().decode()
    assert first, f"generation never started: {err}"
    assert p.wait() == 1 and err == "", err


@full
def test_thinking_with_raw_is_refused(tiny_dir):
    with pytest.raises(ValueError, match="thinking=True is a mode of the chat template"):
        make_llm(tiny_dir, 0).generate(["hi"], thinking=True, raw=True)


@full
def test_context_limit_of_the_model(tiny_dir):
    llm = make_llm(tiny_dir, 1)
    with pytest.raises(ValueError, match="exceeds the context limit of 163840"):
        llm.generate([[7] * 163830], max_new_tokens=20)


@pytest.mark.parametrize("mtp_layers", [1, 2])
@full
def test_mtp_drafts_match_recomputed_mtp(tiny_dir, tmp_path, monkeypatch, mtp_layers):
    """Draft-extend keeps the MTP layer's cache and hidden state right: every round's first draft equals the
    MTP argmax recomputed from scratch (main prefill over the final sequence, MTP over pairs (h_p, x_{p+1})),
    and the second draft equals one chained MTP step at the next position. A checkpoint with two MTP layers
    drafts with the first one only (the second has no KV of the prompt to attend to)."""
    cfg = m.Config.tiny(n_mtp_layers=mtp_layers)
    if mtp_layers == 1:
        llm = make_llm(tiny_dir, 2)
    else:
        save_random_checkpoint(str(tmp_path), cfg, seed=3)
        llm = m.LLM(str(tmp_path), device="cpu", mtp=2)
    records = []
    orig = m.draft

    def draft(model, cache, h, start, batch, table):
        drafts, q = orig(model, cache, h, start, batch, table)
        records.extend(zip(batch.seeds.tolist(), start.tolist(), drafts.tolist(), strict=True))
        return drafts, q

    monkeypatch.setattr(m, "draft", draft)
    prompts = mixed_prompts(4, seed=15)
    out = llm.generate(prompts, max_new_tokens=14, seed=0)  # (prompt i has seed i)
    model = llm.model
    checked = 0
    for i, (p, r) in enumerate(zip(prompts, out, strict=True)):
        seq = torch.tensor(p + r.token_ids)
        cache = m.KVCache(cfg, 256)
        table = torch.arange(256)[None]
        meta = build_meta("prefill", [0], [len(seq) - 1], table)
        h = model(seq[:-1], meta, cache)
        hm = model.mtp_forward(seq[1:], h, meta, cache)  # position p: (h_p, x_{p+1})
        d1_ref = model.mtp[0].logits(hm).argmax(-1)  # predicts x_{p+2}
        for idx, L, d in records:
            if idx != i or L > len(seq) - 1:
                continue
            assert d[0] == int(d1_ref[L - 1]), f"prompt {i}: first draft at L={L}"
            c2 = m.KVCache(cfg, 256)
            c2.latent[:], c2.ik[:], c2.iks[:] = cache.latent, cache.ik, cache.iks
            step = model.mtp_forward(
                torch.tensor([d[0]]), hm[L - 1 : L], build_meta("decode", [L], [1], table), c2
            )
            assert d[1] == int(model.mtp[0].logits(step).argmax()), f"prompt {i}: second draft at L={L}"
            checked += 1
    assert checked >= 8


@full
def test_draft_extend_writes_the_kv_of_emitted_rows_only(tiny_dir, monkeypatch):
    """Draft-extend runs the MTP layer over every verify row, but only the rows whose token was emitted write
    their KV (their positions' slots); the rows past what a request emitted write the dummy slot 0, with token
    0. Drafts accepted in runs of every length (an oracle), so every split of a round is seen."""
    llm = make_llm(tiny_dir, 3)
    prompts = mixed_prompts(4)
    ref = [r.token_ids for r in make_llm(tiny_dir, 0).generate(prompts, max_new_tokens=14)]
    oracle_drafts(monkeypatch, prompts, ref, wrong_every=5)
    calls, rounds = [], []
    mtp_forward = llm.model.mtp_forward

    def spy_mtp(tokens, h, meta, cache):
        calls.append((tokens.clone(), meta.slots.clone(), meta.table[meta.row_req, meta.positions]))
        return mtp_forward(tokens, h, meta, cache)

    round_ = m.speculative_round

    def spy_round(*args):
        first = len(calls)
        out, logits = round_(*args)
        rounds.append((calls[first], out[:, :-1].clone(), out[:, -1].clone()))
        return out, logits

    monkeypatch.setattr(llm.model, "mtp_forward", spy_mtp)
    monkeypatch.setattr(m, "speculative_round", spy_round)
    assert [r.token_ids for r in llm.generate(prompts, max_new_tokens=14, seed=0)] == ref
    seen = set()
    for (tokens, slots, own), emitted, counts in rounds:
        B = len(counts)
        kept = torch.arange(4)[None, :] < counts[:, None]  # [B, k+1]
        assert torch.equal(slots.view(B, 4), torch.where(kept, own.view(B, 4), 0))
        assert (own.view(B, 4)[kept] > 0).all()
        assert torch.equal(tokens.view(B, 4), torch.where(kept, emitted, 0))
        seen |= set(counts.tolist())
    assert seen == {1, 2, 3, 4}, seen


@full
def test_sampled_drafts_draw_from_their_own_stream(tiny_dir):
    """A sampled draft of position p is the exponential race over its distribution q with the numbers of
    (seed, p, DRAFT): not TARGET's, which the main model's residual draw at p uses (the same numbers would tie
    the two draws, and the emitted token would no longer follow the main model)."""
    model = make_llm(tiny_dir, 2).model
    cfg, B, k = model.cfg, 8, 2
    g = torch.Generator().manual_seed(22)
    h = (torch.randn(B, cfg.dim, generator=g)).to(torch.bfloat16)
    start = torch.randint(1, 20, (B,), generator=g)
    table = torch.arange(1, 1 + B * 32).view(B, 32)
    seeds = torch.randint(0, 2**40, (B,), generator=g)
    batch = m.Batch(
        torch.zeros(B, k + 1, dtype=torch.long),
        start,
        None,
        seeds,
        torch.full((B,), 1.5),
        torch.ones(B),
    )
    drafts, q = m.draft(model, m.KVCache(cfg, 1 + B * 32), h, start, batch, table)

    def race(stream, j):
        e = m.exponential(m.uniform(seeds, start + j + 1, stream, cfg.vocab_size)).double()
        return (q[:, j].double() / e).argmax(-1)

    for j in range(k):
        assert torch.equal(drafts[:, j], race(m.DRAFT, j)), f"draft {j + 1}"
    assert any(not torch.equal(race(m.DRAFT, j), race(m.TARGET, j)) for j in range(k))


@full
def test_bench_refuses_what_does_not_fit_in_one_line():
    """bench.py decode checks the full-width model and its KV pool against the GPU's free memory before it
    allocates: on an 80 GB H100 (about 78 GiB free) the README's 9 layers are refused in one line that names
    the largest --layers that fits; on an H200 (about 139 GiB) they run."""
    import bench

    positions = bench.kv_positions([(bs, 4096) for bs in (1, 16, 64)], 3)
    line = bench.check_fits(9, positions, 78 << 30)
    assert line.startswith("error: Config.full(n_layers=9) needs") and "\n" not in line
    fits = int(re.search(r"--layers (\d+) fits", line)[1])
    assert 1 <= fits < 9 and bench.check_fits(fits, positions, 78 << 30) is None
    assert bench.check_fits(fits + 1, positions, 78 << 30) is not None
    assert bench.check_fits(9, positions, 139 << 30) is None


@full
def test_bench_decode_batch_writes_how_its_requests_draw(tiny_dir):
    """bench.decode_batch writes its requests' rows of the decode state (LLM.start), so how they draw comes
    through its arguments: the rows of a sampled benchmark sample. (Setting a request's temperature afterwards
    leaves its row greedy: issue 32's tenth pass timed such rows as sampled ones.)"""
    import bench

    llm = make_llm(tiny_dir, 2)
    reqs = bench.decode_batch(llm, 3, 40, 2, temperature=0.6, top_p=0.95)
    rows = torch.tensor([r.row for r in reqs])
    assert torch.equal(llm.state.temperature[rows], torch.full((3,), 0.6))
    assert torch.equal(llm.state.top_p[rows], torch.full((3,), 0.95))
    bench.release(llm, reqs)


@full
def test_memory_check_counts_each_ranks_share_of_the_split_weights(monkeypatch):
    """hf_checkpoint.weight_bytes (what loading allocates, whole and split over ranks) against a model built
    as rank 0 of 2 builds it: its parameters' bytes are the whole part plus half the split part (the
    check's "fits with torchrun --nproc-per-node 2" counts the ranks' shares, not the full split weights)."""
    cfg = m.Config.full(n_layers=4)
    whole, split = hf.weight_bytes(cfg, m.Transformer, 1)
    monkeypatch.setattr(m, "tp_size", lambda: 2)
    with torch.device("meta"):
        rank = m.Transformer(cfg)
    assert sum(p.numel() * p.element_size() for p in rank.parameters()) == whole + split // 2
    assert split > whole  # the vocabulary, the heads, the experts and MLA's heads


@full
def test_cuda_graph_buckets():
    """Buckets: 1, 2, 4, 8, then every 16 below max_bs, and max_bs; every batch size has one that holds it."""
    assert m.graph_buckets(64) == [1, 2, 4, 8, 16, 32, 48, 64]
    assert m.graph_buckets(1) == [1] and m.graph_buckets(5) == [1, 2, 4, 5]
    assert m.graph_buckets(20) == [1, 2, 4, 8, 16, 20]
    for max_bs in range(1, 100):
        buckets = m.graph_buckets(max_bs)
        assert buckets == sorted(set(buckets)) and buckets[-1] == max_bs
        assert all(b in (1, 2, 4, 8, max_bs) or b % 16 == 0 for b in buckets)


@full
def test_verify_and_draft_extend_use_the_decode_path(tiny_dir, monkeypatch):
    """Outside prefill steps, no row goes through the per-head (prefill) attention form (which a prompt
    chunk of more than DECODE_ROWS_MAX rows within top-k does go through: the spy sees it)."""
    monkeypatch.setattr(m, "DECODE_ROWS_MAX", 8)  # (the 17-token prompt's 16 rows, within top-k 32)
    llm = make_llm(tiny_dir, 3)
    in_round = [False]
    rounds, dense = [], []
    orig_round, orig_attend = m.LLM.decode, m.MLA.attend_dense

    def decode_round(self, reqs):
        in_round[0] = True
        rounds.append(len(reqs))
        try:
            return orig_round(self, reqs)
        finally:
            in_round[0] = False

    def attend(self, *a, **k):
        assert not in_round[0], "a decode round used the prefill attention path"
        dense.append(1)
        return orig_attend(self, *a, **k)

    monkeypatch.setattr(m.LLM, "decode", decode_round)
    monkeypatch.setattr(m.MLA, "attend_dense", attend)
    llm.generate(mixed_prompts(3), max_new_tokens=6)
    assert dense and rounds, (len(dense), rounds)  # both paths ran: the spies saw them


# ------------------------------------------------------------------------------------------------------------
# GPU (skipped without CUDA; run on the GPU machine)
# ------------------------------------------------------------------------------------------------------------
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@gpu
def test_gpu_device_and_kernel_refusals_are_one_line(monkeypatch):
    """A CUDA device index this machine lacks, and kernels='gpu' where kernels.py cannot run (its reason
    forced here): one line each; kernels='auto' falls back to the references."""
    import kernels

    n = torch.cuda.device_count()
    with pytest.raises(ValueError, match=f"^device 'cuda:{n}': this machine has {n} CUDA devices$"):
        checks.check_device(f"cuda:{n}")
    monkeypatch.setattr(kernels, "unsupported", lambda device: "a reason (forced)")
    with pytest.raises(ValueError, match=r"^the GPU kernels cannot run here: a reason \(forced\)$"):
        m.select_ops("gpu", "cuda")
    assert m.select_ops("auto", "cuda") is m.TORCH_OPS and m.select_ops("torch", "cuda") is m.TORCH_OPS


@pytest.mark.parametrize("device", [pytest.param("cpu", marks=full), pytest.param("cuda", marks=gpu)])
def test_gpu_or_cpu_model_that_does_not_fit_says_so_before_allocating(tmp_path, device):
    """The 671B checkpoint (exact headers, sparse data) on a machine too small for it: one line that says what
    it needs, what there is and what would fit, exit 1, no traceback, in seconds (nothing is allocated)."""
    import subprocess
    import time

    save_sparse_checkpoint(str(tmp_path), m.Config.full())
    assert hf.open_checkpoint(str(tmp_path), m.Config) == m.Config.full()  # the headers are the official ones
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "nano_nsa.py")
    t0 = time.time()
    cli = [sys.executable, script, "--model", str(tmp_path), "--prompt", "hi", "--device", device]
    r = subprocess.run(cli, capture_output=True, text=True, timeout=120)
    seconds = time.time() - t0
    print(f"{device}: {r.stderr.strip()} ({seconds:.1f} s)")
    assert r.returncode == 1 and r.stdout == ""
    assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr
    assert re.match(r"error: the model needs 69\d\.\d GB per rank .* but .* GB", r.stderr)
    assert "torchrun --nproc-per-node" in r.stderr and "GB per rank" in r.stderr.split(";")[-1]
    assert seconds < 60


# ------------------------------------------------------------------------------------------------------------
# the GPU tests' comparisons: what another device or a kernel may change, fixed from the numerics (never from
# the run's own measured difference), and what must be equal. Each is tested here on the CPU: it rejects a
# mutant that the comparison it replaced let through.
# ------------------------------------------------------------------------------------------------------------
def _first_split(a, b, margins):
    """Compare token lists a and b; return (number of leading equal tokens, margin of `margins` at the
    split)."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n, (margins[n] if n < min(len(a), len(b)) else None)


def _margin(logits):
    top2 = logits.topk(2, dim=-1).values
    return (top2[..., 0] - top2[..., 1]).tolist()


def assert_runs_identical(want, got, what):
    """A batch-invariant, deterministic path (CUDA graphs vs eager, speculative vs plain on the kernels):
    every request's tokens equal and its logits equal bit for bit."""
    for i, (a, b) in enumerate(zip(want, got, strict=True)):
        n, _ = _first_split(a.token_ids, b.token_ids, _margin(a.logits))
        assert a.token_ids == b.token_ids, f"{what}: prompt {i}: tokens differ from token {n}"
        diff = (a.logits - b.logits).abs().max().item() if a.logits.shape == b.logits.shape else None
        assert torch.equal(a.logits, b.logits), f"{what}: prompt {i}: logits differ (max {diff})"


def assert_greedy_runs_agree(want, got, bounds, min_share, what):
    """Greedy runs of the same prompts on two paths that round differently (the CPU's fp64 against a GPU's
    fp32 sums, bf16 attention and FP8 tensor cores). While a request's tokens agree both see the same context,
    so its logits rows, up to and with the first that parts them, agree within stated bounds of the two paths'
    numerical difference (never measured from the run), bounds = (row, mean): each row's largest difference
    within `row` (a routing choice or an FP8 rounding that flips moves a row more than most), their mean
    within `mean`. Tokens part only at a near-tie, where the reference's top-1 margin is under 2 x mean; the
    rest of that request is not compared, and at least min_share of all tokens are. -> (tokens compared, the
    largest row difference, the mean)."""
    row_bound, mean_bound = bounds
    compared, diffs = 0, []
    for i, (a, b) in enumerate(zip(want, got, strict=True)):
        n, margin = _first_split(a.token_ids, b.token_ids, _margin(a.logits))
        shared = min(n + 1, len(a.logits), len(b.logits))  # the rows of a context both runs share
        rows = (a.logits[:shared] - b.logits[:shared]).abs().amax(-1).tolist()
        worst = max(rows, default=0.0)
        assert worst <= row_bound, f"{what}: prompt {i}: a logits row {worst:.3g} apart (bound {row_bound})"
        diffs += rows
        assert margin is None or margin < 2 * mean_bound, f"{what}: prompt {i} parts at margin {margin:.3g}"
        compared += n
    mean = sum(diffs) / max(len(diffs), 1)
    assert mean <= mean_bound, f"{what}: logits rows {mean:.3g} apart on average (bound {mean_bound})"
    total = sum(len(r.token_ids) for r in want)
    assert compared >= min_share * total, f"{what}: {compared} of {total} tokens compared before a near-tie"
    return compared, round(max(diffs, default=0.0), 4), round(mean, 4)


def assert_tp_run_equals_one(one, rank, what):
    """A tensor-parallel run's record (_tp_run) against TP=1's: the greedy tokens with MTP off and on, every
    draft and accept length equal, and the first token's logits (the prefill: the same products, split over
    the ranks and summed before the one rounding per block half) bit for bit."""
    for k in (0, 2):
        assert rank["tokens"][k] == one["tokens"][k], f"{what}: tokens at mtp={k}"
    assert rank["drafts"] == one["drafts"] and sum(map(len, one["drafts"])) > 20, f"{what}: drafts"
    assert rank["accept"] == one["accept"], f"{what}: accept lengths"
    for i, (a, b) in enumerate(zip(rank["logits"], one["logits"], strict=True)):
        assert torch.equal(a[0], b[0]), f"{what}: prompt {i}: first-token logits differ"


def e4m3_ordinal(x):
    """Each e4m3 value's place on the representable grid, in order: its code's magnitude bits, negated for a
    set sign bit (+0 and -0 are both 0), so that adjacent representable values are one apart."""
    code = x.view(torch.uint8).to(torch.int16)
    return torch.where(code >= 128, 128 - code, code)


def assert_fp8_within_one_step(got, got_scale, want, want_scale, max_share, what):
    """FP8 values with power-of-two scales, one per group of the last dim (scale [..., G] for values [..., G x
    n]), against the reference's, where another fp32 summation order may round a value to a neighbouring bf16
    before quantization: the value then lands one e4m3 step away, or a group's amax on the other side of a
    power of two (its scale one binade off, its values rounded on the other grid). So: every scale equal or
    one binade off; every value within one e4m3 step, both read on the coarser of the two scales' grids (the
    finer value rounded onto it); at most max_share of the scales, and of the values, differ at all. A wrong
    column, group or scale is many steps off. -> (share of the values, share of the scales that differ)."""
    assert got.shape == want.shape and got_scale.shape == want_scale.shape, what
    ratio = got_scale / want_scale
    assert ((ratio == 1) | (ratio == 2) | (ratio == 0.5)).all(), f"{what}: a scale more than one binade off"
    coarse = torch.maximum(got_scale, want_scale)[..., None]
    got_v, want_v = (
        q.float().unflatten(-1, (s.shape[-1], -1)) * s[..., None]
        for q, s in ((got, got_scale), (want, want_scale))
    )
    steps = (e4m3_ordinal((got_v / coarse).to(m.FP8)) - e4m3_ordinal((want_v / coarse).to(m.FP8))).abs()
    worst = steps.max().item()
    assert worst <= 1, f"{what}: a value {worst} e4m3 steps off, at {(steps == worst).nonzero()[0].tolist()}"
    values, scales = (got_v != want_v).float().mean().item(), (ratio != 1).float().mean().item()
    assert values <= max_share and scales <= max_share, (
        f"{what}: {values:.3%} of the values and {scales:.3%} of the scales differ (at most {max_share:.3%})"
    )
    return values, scales


def _fp8_rounded_two_ways(shape, gen, binade):
    """act_quant of random bf16 vectors [..., 128], and of the same with what another summation order may
    change: 0.5% of the values one bf16 step away; binade: vector 0's amax 56 = 448 / 8 (scale 2^-3), one
    bf16 step above it (scale 2^-2) -> ((q, s) of the second, (q, s) of the first)."""
    x = (torch.randn(*shape, generator=gen) * 3).to(torch.bfloat16)
    x.view(-1, shape[-1])[0, 0] = 56.0
    other = x.clone()
    steps = (torch.rand(shape, generator=gen) < 0.005).to(torch.int16)
    other.view(torch.int16).add_(steps)  # (the next bf16 away from zero)
    other.view(-1, shape[-1])[0, 0] = 56.25 if binade else 56.0
    return m.act_quant(other), m.act_quant(x)


def test_fp8_step_checker_rejects_a_wrong_column_group_or_scale_that_share_bounds_let_through():
    """assert_fp8_within_one_step accepts what two summation orders do to FP8 values (_fp8_rounded_two_ways),
    and rejects a wrong column, a wrong group and a wrong scale, each of which the criterion it replaced let
    through: store_index_key's (at most 1% of the values and of the scales differ), index_quant's (0.1%),
    store_latent's (a relative norm error below 1e-2, at most 1% of the values differ)."""
    gen = torch.Generator().manual_seed(7)
    old = {
        "share": lambda q, s, rq, rs, share: (
            (s != rs).float().mean() <= share and (q.float() != rq.float()).float().mean() <= share
        ),
        "norm": lambda q, s, rq, rs, share: (
            (m.act_dequant(q, s) - m.act_dequant(rq, rs)).norm() / m.act_dequant(rq, rs).norm() < 1e-2
            and (m.act_dequant(q, s) != m.act_dequant(rq, rs)).float().mean() <= share
        ),
    }
    for shape, share in (((300, 128), 0.01), ((300, 64, 128), 1e-3)):
        (q, s), ref = _fp8_rounded_two_ways(shape, gen, binade=True)
        values, scales = assert_fp8_within_one_step(q, s, *ref, share, "two summation orders")
        assert values > 0 and scales > 0  # (steps and a binade to accept)
    # the mutants, made from kernel-like results with no binade off (the old criteria count those)
    keys, key_ref = _fp8_rounded_two_ways((300, 128), gen, binade=False)  # the indexer's keys: a scale a row
    queries, query_ref = _fp8_rounded_two_ways((300, 64, 128), gen, binade=False)  # queries: a (token, head)
    latents = m.rms_norm(
        torch.randn(300, 512, generator=gen), None, torch.rand(512, generator=gen) + 0.5, 1e-6
    )
    latent_ref = m.act_quant(latents)  # MLA's latents: four scales a row
    wrong_column = keys[0].clone()
    wrong_column[:, 37] = wrong_column[:, 38]
    wrong_group = queries[0].clone(), queries[1].clone()
    wrong_group[0][5, 9], wrong_group[1][5, 9] = queries[0][6, 9], queries[1][6, 9]
    wrong_scale = keys[1].clone()
    wrong_scale[9] *= 2
    off = latents.clone()
    off[:, 17] *= 1.2  # (e.g. the neighbour's norm weight)
    mutants = {  # name: (q, s, the reference, its test's share, the old criterion)
        "store_index_key, a wrong column": (wrong_column, keys[1], key_ref, 0.01, "share"),
        "index_quant, a wrong group": (*wrong_group, query_ref, 1e-3, "share"),
        "store_index_key, a wrong scale": (keys[0], wrong_scale, key_ref, 0.01, "share"),
        "store_latent, a column 20% off": (*m.act_quant(off), latent_ref, 0.01, "norm"),
    }
    for name, (q, s, ref, share, criterion) in mutants.items():
        assert old[criterion](q, s, *ref, share), f"{name}: the old criterion rejects it too"
        with pytest.raises(AssertionError, match="e4m3 steps off"):
            assert_fp8_within_one_step(q, s, *ref, share, name)


def _greedy_result(logits):
    return SimpleNamespace(token_ids=logits.argmax(-1).tolist(), logits=logits)


def test_greedy_agreement_checker_rejects_logits_that_the_self_calibrated_tolerance_let_through():
    """assert_greedy_runs_agree, at the kernels' bounds, accepts a GPU run whose logits stay within them, and
    rejects two runs that test_gpu_engine_agrees_with_cpu's old criterion (a parting excused at a margin
    under 4x the run's own first-token logit difference, itself below 0.3; 60% of the tokens compared) let
    through: decode rows with one logit 0.8 off, which parts the tokens at a margin of 0.15; and every row
    with a column 0.24 off."""
    gen = torch.Generator().manual_seed(11)
    want_logits = [torch.randn(12, 64, generator=gen) * 3 for _ in range(8)]
    top2 = want_logits[0][3].topk(2).indices
    want_logits[0][3, top2[1]] = want_logits[0][3, top2[0]] - 0.15  # a margin of 0.15 at token 3
    want = [_greedy_result(x) for x in want_logits]

    def old(want, got):
        noise = max((a.logits[0] - b.logits[0]).abs().max().item() for a, b in zip(want, got, strict=True))
        splits = [
            _first_split(a.token_ids, b.token_ids, _margin(a.logits)) for a, b in zip(want, got, strict=True)
        ]
        compared = sum(n for n, _ in splits)
        excused = all(margin is None or margin < 4 * noise for _, margin in splits)
        return excused and noise < 0.3 and compared >= 0.6 * sum(len(r.token_ids) for r in want)

    bounds = GPU_LOGIT_BOUNDS["gpu"]
    noisy = [x + (torch.rand(x.shape, generator=gen) - 0.5) * 0.1 for x in want_logits]  # within 0.05
    assert_greedy_runs_agree(want, [_greedy_result(x) for x in noisy], bounds, 0.6, "within the bounds")
    decode_bug = [x.clone() for x in noisy]
    decode_bug[0][1:, top2[1]] += 0.8
    wrong_column = [x.clone() for x in noisy]
    for x in wrong_column:
        x[:, 5] += 0.24  # (e.g. a wrong column of the head)
    for name, logits in (("a decode row 0.8 off", decode_bug), ("a column 0.24 off", wrong_column)):
        got = [_greedy_result(x) for x in logits]
        assert old(want, got), f"{name}: the old criterion rejects it too"
        with pytest.raises(AssertionError, match="apart"):
            assert_greedy_runs_agree(want, got, bounds, 0.6, name)


def test_tp_checker_rejects_runs_that_the_self_calibrated_tolerance_let_through():
    """assert_tp_run_equals_one rejects a TP run whose tokens part from TP=1's, or whose drafts differ from
    TP=1's (its ranks agreeing), both of which test_gpu_tensor_parallel_equals_one's old criterion let
    through: a split at a top-1 margin under 4x the run's own first-token logit difference (here 0.3: any
    margin under 1.2), and drafts compared between ranks only."""
    gen = torch.Generator().manual_seed(2)
    logits = [torch.randn(8, 50, generator=gen) for _ in range(4)]
    tokens = [x.argmax(-1).tolist() for x in logits]
    drafts = torch.randint(0, 50, (12, 2), generator=gen).tolist()
    one = dict(tokens={0: tokens, 2: tokens}, drafts=drafts, accept=[[2, 1, 3]] * 4, logits=logits)
    assert_tp_run_equals_one(one, copy.deepcopy(one), "the same run")

    def old(one, rank):
        noise = max(
            (a[0] - b[0]).abs().max().item() for a, b in zip(rank["logits"], one["logits"], strict=True)
        )
        splits = [
            _first_split(a, b, _margin(one["logits"][i]))
            for k in (0, 2)
            for i, (a, b) in enumerate(zip(one["tokens"][k], rank["tokens"][k], strict=True))
        ]
        return all(margin is None or margin < max(4 * noise, 1e-3) for _, margin in splits)

    parted = copy.deepcopy(one)
    parted["logits"][0][0, 0] += 0.3
    j = next(j for j, x in enumerate(_margin(logits[1])) if 0.1 < x < 1.2)
    parted["tokens"][2][1][j] = int(logits[1][j].topk(2).indices[1])  # the runner-up, at a margin under 1.2
    other_drafts = copy.deepcopy(one)
    other_drafts["drafts"][5][1] = (drafts[5][1] + 1) % 50
    for name, rank in (("tokens part", parted), ("drafts differ", other_drafts)):
        assert old(one, rank), f"{name}: the old criterion rejects it too"
        with pytest.raises(AssertionError):
            assert_tp_run_equals_one(one, rank, name)


@pytest.fixture(scope="session")
def calm_dir(tiny_dir, tmp_path_factory):
    """The tiny checkpoint with its residual-branch outputs (o_proj, down_proj) scaled by 1/8 through their
    power-of-two block scales (the FP8 format stays exact). A random 3-layer model amplifies any numerical
    noise chaotically (1% noise in attention moves the tiny model's logits by 1.7, as much as their spread);
    damped branches keep it near 0.06, so its greedy decisions stay far from that noise: a checkpoint far from
    ties."""
    return _damped_copy(tiny_dir, str(tmp_path_factory.mktemp("calm")))


def _damped_copy(src_dir, path):
    from safetensors.torch import load_file, save_file

    for name in os.listdir(src_dir):
        src = os.path.join(src_dir, name)
        if name.endswith(".safetensors"):
            ts = load_file(src)
            ts.update(
                {
                    k: v / 8
                    for k, v in ts.items()
                    if k.endswith(("o_proj.weight_scale_inv", "down_proj.weight_scale_inv"))
                }
            )
            save_file(ts, os.path.join(path, name), metadata={"format": "pt"})
        else:
            shutil.copy(src, path)
    return path


# how far the GPU's logits may lie from the CPU's on a context both share, (any row, the mean row): stated,
# not measured by the run (test_gpu_engine_agrees_with_cpu says where they come from)
GPU_LOGIT_BOUNDS = {"torch": (0.1, 0.01), "gpu": (0.75, 0.1)}


@gpu
@pytest.mark.parametrize("kernels", ["torch", "gpu"])
def test_gpu_engine_agrees_with_cpu(calm_dir, kernels):
    """The engine on CUDA (torch references, or kernels.py) gives the CPU's greedy tokens, with and without
    MTP (k = 1, 3), and speculative == plain on the GPU. The CPU sums in fp64; the torch path on the GPU in
    fp32; the kernels round attention intermediates to bf16 and sum FP8 products on Hopper's tensor cores
    (~14-bit accumulation inside each 128 block), as the official reference's kernels do. The logits of a
    context both devices share (every row up to the first that parts their tokens), on logits of spread 1,
    measured on an H200 over three sets of 8 prompts: torch path, rows equal but a few up to 0.04; kernels,
    rows 0.03-0.09 apart (mean 0.06), a few up to 0.47 (a routing choice or an FP8 rounding that flips);
    tokens parted only at margins <= 0.02. Bounds (assert_greedy_runs_agree, GPU_LOGIT_BOUNDS): any row
    0.1 / 0.75, the mean row 0.01 / 0.1, partings at margins under twice the mean bound; at least 90% of the
    tokens before a near-tie on the torch path (93 or 96 of 96 measured: its prompt rows sum in another order
    than the CPU's), 60% with the kernels (82 measured). The kernels are
    batch-invariant: on the GPU speculative decoding gives plain decoding's tokens and logits bit for bit; the
    torch path (cuBLAS picks its kernels by shape) agrees within its bounds."""
    prompts = mixed_prompts(8)
    cpu = m.LLM(calm_dir, device="cpu", mtp=0).generate(prompts, max_new_tokens=12, return_logits=True)
    runs = {
        k: m.LLM(calm_dir, device="cuda", mtp=k, kernels=kernels).generate(
            prompts, max_new_tokens=12, return_logits=True
        )
        for k in (0, 1, 3)
    }
    bounds, share = GPU_LOGIT_BOUNDS[kernels], (0.9 if kernels == "torch" else 0.6)
    counts = {
        f"cpu~gpu mtp={k}": assert_greedy_runs_agree(cpu, runs[k], bounds, share, f"CPU vs GPU mtp={k}")
        for k in runs
    }
    for k in (1, 3):
        if kernels == "gpu":
            assert_runs_identical(runs[0], runs[k], f"GPU plain vs mtp={k}")
        else:
            counts[f"gpu plain~gpu mtp={k}"] = assert_greedy_runs_agree(
                runs[0], runs[k], bounds, share, f"GPU plain vs mtp={k}"
            )
    total = sum(len(r.token_ids) for r in cpu)
    print(f"[{kernels}] tokens compared of {total}, the largest and the mean logits row difference:", counts)


@gpu
@pytest.mark.parametrize("mtp", [0, 3])
def test_gpu_seeded_sampling_does_not_depend_on_the_batch(calm_dir, mtp):
    """On the GPU, with CUDA graphs (buckets padded with dummy rows): a seeded sampled request's tokens alone,
    in a batch, reversed and admitted as others finish are one and the same (as on the CPU)."""
    prompts = mixed_prompts(8, seed=31)
    want = seeded_sampling_is_batch_invariant(m.LLM(calm_dir, device="cuda", mtp=mtp), prompts, 16)
    small = m.LLM(calm_dir, device="cuda", mtp=mtp, max_batch=3)
    kw = dict(max_new_tokens=16, temperature=0.8, top_p=0.9, seed=[1000 + 37 * i for i in range(8)])
    assert [r.token_ids for r in small.generate(prompts, **kw)] == want


@gpu
@pytest.mark.parametrize("mtp", [0, 1, 3])
def test_gpu_cuda_graphs_equal_eager(calm_dir, mtp):
    """Prompt steps and decode rounds through CUDA graphs (buckets padded with dummy rows, context bounds
    captured on first use) give the eager steps' greedy tokens and logits bit for bit (the kernels are
    batch-invariant: a padded batch or a wider indexer bound changes no row), and so the same acceptance."""
    prompts = mixed_prompts(8)  # contexts beyond index_topk: sparse, wider bounds
    eager = m.LLM(calm_dir, device="cuda", mtp=mtp, cuda_graphs=False)
    assert eager.graphs is None
    want = eager.generate(prompts, max_new_tokens=16, return_logits=True)
    llm = m.LLM(calm_dir, device="cuda", mtp=mtp)
    assert llm.graphs is not None and len(llm.graphs.graphs) > 0
    got = llm.generate(prompts, max_new_tokens=16, return_logits=True)
    for r in got:  # greedy: every token is its logits row's argmax (rows kept from rounds still in flight)
        assert r.logits.argmax(-1).tolist() == r.token_ids
    widths = {width for _, _, width in llm.graphs.graphs}
    assert max(widths) > m.Config.tiny().index_topk, widths  # a longer context bound was captured
    assert {kind for kind, _, _ in llm.graphs.graphs} == {"round", "prompt"}  # the prompts through graphs too
    assert_runs_identical(want, got, f"graphs vs eager mtp={mtp}")
    assert llm.stats["accept_histogram"] == eager.stats["accept_histogram"]
    print(f"mtp={mtp}: {sum(len(r.token_ids) for r in want)} tokens and their logits equal")


@gpu
def test_gpu_side_by_side_equals_one_stream(calm_dir, monkeypatch):
    """kernels.side_by_side (streams; in a CUDA graph, branches) gives the bits of the reference, one
    part after the other: three split-K FP8 GEMMs run at once, the second part forking again (three streams),
    eagerly and replayed from a graph, many times (their tile counters must not collide), and an engine's
    logits (prefill, then decode rounds through CUDA graphs at mtp 3) with kernels.py against kernels.py with
    the reference's side_by_side."""
    import kernels

    gen = torch.Generator("cuda").manual_seed(11)
    shapes = [(7168, 16384), (4096, 7168), (2240, 7168)]  # o_proj, the shared expert's w13, wqkv_a: split-K
    weights = [_random_fp8(n, k, gen) for n, k in shapes]
    xs = [torch.randn(4, k, device="cuda", generator=gen).to(m.BF16) for _, k in shapes]
    assert all(kernels.gemm_config(n, k)["SPLIT_K"] > 1 for n, k in shapes)
    want = [kernels.fp8_linear(xs[i], *weights[i]) for i in range(3)]

    def two(i, j):
        return kernels.side_by_side(
            kernels.fp8_linear, (xs[i], *weights[i]), kernels.fp8_linear, (xs[j], *weights[j])
        )

    def all_three():
        first, (second, third) = kernels.side_by_side(kernels.fp8_linear, (xs[0], *weights[0]), two, (1, 2))
        return first, second, third

    eager = [all_three() for _ in range(20)]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = [all_three() for _ in range(10)]
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        assert all(torch.equal(a, b) for out in eager + captured for a, b in zip(out, want, strict=True))
    prompts = mixed_prompts(4)
    streams = m.LLM(calm_dir, device="cuda", mtp=3).generate(prompts, max_new_tokens=12, return_logits=True)
    monkeypatch.setattr(kernels.GPU_OPS, "side_by_side", m.side_by_side)
    one = m.LLM(calm_dir, device="cuda", mtp=3).generate(prompts, max_new_tokens=12, return_logits=True)
    for a, b in zip(streams, one, strict=True):
        assert a.token_ids == b.token_ids and torch.equal(a.logits, b.logits)


@gpu
def test_gpu_engines_rebuilt_between_large_generates_capture_cleanly(calm_dir):
    """Engines built and dropped between large generate calls, with the cyclic garbage collector made to run
    on almost every allocation, and each dropped engine left in a reference cycle so that only the collector
    frees it (and its CUDA graphs): a collection in the middle of a later capture would reset those graphs
    there, which CUDA refuses (cudaErrorStreamCaptureInvalidated). Capture runs with the collector off."""
    import gc

    prompts = mixed_prompts(8) * 4
    threshold = gc.get_threshold()
    gc.set_threshold(1, 1, 1)
    try:
        for i in range(6):
            llm = m.LLM(calm_dir, device="cuda", mtp=i % 3, kv_cache_bytes=64 << 20)
            out = llm.generate(prompts, max_new_tokens=24, return_logits=True)
            assert [len(r.token_ids) for r in out] == [len(r.logits) for r in out]
            assert all(len(r.token_ids) == 24 or r.finish_reason == "eos" for r in out)
            cycle = [llm]
            cycle.append(cycle)  # garbage that only the collector frees
            del llm, cycle, out
    finally:
        gc.set_threshold(*threshold)


def _random_fp8(n, k, gen):
    w = (torch.randn(n, k, device="cuda", generator=gen) * 0.5).to(m.FP8)
    scale = 2.0 ** torch.randint(-9, -5, (-(-n // 128), k // 128), device="cuda", generator=gen).float()
    return w, scale


def _random_latents(S, C, gen, R=64):
    """S rows of MLA's cache (the FP8 layout) holding random latents (act_quant of normal values) and rope
    keys."""
    cache = m.LayerCache(torch.zeros(S, C + C // 32 + 2 * R, dtype=torch.uint8, device="cuda"), None, None, C)
    cache.kv[:], cache.kv_scale[:] = m.act_quant(torch.randn(S, C, device="cuda", generator=gen).to(m.BF16))
    cache.pe[:] = torch.randn(S, R, device="cuda", generator=gen).to(m.BF16)
    return cache.latent


def _decode_rows(batch, ctx, cfg, gen):
    """A KV pool with random latents and indexer keys, and one decode row per request at context ctx."""
    S = batch * ctx + 1
    cache = m.LayerCache(
        _random_latents(S, cfg.kv_lora_rank, gen, cfg.qk_rope_head_dim),
        (torch.randn(S, cfg.index_head_dim, device="cuda", generator=gen) * 8).to(m.FP8),
        torch.rand(S, device="cuda", generator=gen) + 0.5,
        cfg.kv_lora_rank,
    )
    table = 1 + torch.randperm(S - 1, device="cuda", generator=gen)[: batch * ctx].view(batch, ctx)
    return cache, table


def _random_bf16_rows(batch, gen, *shape, scale=1.0):
    return (torch.randn(batch, *shape, device="cuda", generator=gen) * scale).to(m.BF16)


def _random_bf16(gen, *shape, scale=0.01):
    return (torch.randn(*shape, device="cuda", generator=gen) * scale).to(m.BF16)


def _batch_op_rowwise(op, batch, gen, cfg):
    """_batch_op's quantization, norm, RoPE and routing ops; None for another op."""
    import kernels

    rows = functools.partial(_random_bf16_rows, batch, gen)
    if op == "act_quant":
        x = rows(7168)
        return lambda n: torch.cat([t.float().flatten(1) for t in kernels.act_quant(x[:n])], 1)
    if op == "index_quant_q":  # the indexer's queries (64 heads)
        x = rows(64, 128)
        cos, sin = cos_sin(cfg, torch.randint(0, 100000, (batch,), device="cuda", generator=gen))
        return lambda n: torch.cat(
            [t.float().flatten(1) for t in kernels.index_quant(x[:n], cos[:n], sin[:n])], 1
        )
    if op == "store_index_key":  # the indexer's keys, LayerNorm included, written to slots 0 .. n - 1
        x = rows(128, scale=3.0)
        norm_weight = torch.rand(128, device="cuda", generator=gen) + 0.5
        norm_bias = torch.randn(128, device="cuda", generator=gen) * 0.1
        cos, sin = cos_sin(cfg, torch.randint(0, 100000, (batch,), device="cuda", generator=gen))
        cache = m.LayerCache(
            None, torch.zeros(batch, 128, dtype=m.FP8, device="cuda"), torch.zeros(batch, device="cuda"), 0
        )

        def keys(n):
            slots = torch.arange(n, device="cuda")
            kernels.store_index_key(x[:n], norm_weight, norm_bias, 1e-6, cos[:n], sin[:n], cache, slots)
            return torch.cat([cache.ik[:n].float(), cache.iks[:n, None]], 1)

        return keys
    if op == "rope_q":  # MLA's query rotation, on the strided q_pe view of q_b's output
        q = rows(128, 192)[..., 128:]
        cos, sin = cos_sin(cfg, torch.randint(0, 100000, (batch,), device="cuda", generator=gen))
        return lambda n: kernels.rope(q[:n], cos[:n], sin[:n], interleaved=True).flatten(1)
    if op == "route":  # the router after its product
        logits = torch.randn(batch, 256, device="cuda", generator=gen)
        bias = torch.randn(256, device="cuda", generator=gen) * 0.1
        return lambda n: torch.cat([t.float() for t in kernels.route(logits[:n], bias, 8, 4, 8, 2.5)], 1)
    if op in ("rmsnorm", "rmsnorm_q"):  # with the residual add (its fp32 sum is returned too)
        dim = 7168 if op == "rmsnorm" else 1536
        weight = torch.rand(dim, device="cuda", generator=gen) + 0.5
        x = rows(dim)
        residual = rows(dim)
        return lambda n: torch.cat(kernels.rms_norm(x[:n], residual[:n], weight, 1e-6), 1)
    return None


def _batch_op_gemm(op, batch, gen, cfg):
    """_batch_op's GEMMs: FP8 and dense linears, MLA's absorbed head products, MoE; None for another op."""
    import kernels

    rows = functools.partial(_random_bf16_rows, batch, gen)
    if op == "swiglu_linear":  # the shared expert's down projection, SwiGLU and act-quant folded in
        w, scale = _random_fp8(7168, 2048, gen)
        h = rows(4096)
        return lambda n: kernels.swiglu_linear(h[:n], w, scale)
    if op.startswith("fp8_linear"):
        shapes = dict(
            fp8_linear_wqkv_a=(2240, 7168), fp8_linear_wo=(7168, 16384), fp8_linear_wq_b=(24576, 1536)
        )
        n_out, k = shapes[op]
        w, scale = _random_fp8(n_out, k, gen)
        x = rows(k)
        return lambda n: kernels.fp8_linear(x[:n], w, scale)
    if op.startswith("dense_linear"):
        n_out, k = dict(head=(cfg.vocab_size, 7168), weights_proj=(64, 7168), eh_proj=(7168, 14336))[op[13:]]
        w = _random_bf16(gen, n_out, k)
        x = rows(k)
        return lambda n: kernels.dense_linear(x[:n], w)
    if op == "gate":  # the router's scores (Gate.forward)
        w = _random_bf16(gen, 256, 7168)
        x = rows(7168)
        return lambda n: kernels.dense_linear(x[:n], w)
    if op in ("absorb_q", "absorb_o"):  # MLA's absorbed W_UK / W_UV products
        w_uk = _random_bf16(gen, 128, 512, 128, scale=0.05)
        w_uv = _random_bf16(gen, 128, 128, 512, scale=0.05)
        if op == "absorb_q":
            q = rows(128, 128)
            return lambda n: kernels.head_linear(q[:n], w_uk)
        o = rows(128, 512)
        return lambda n: kernels.head_linear(o[:n], w_uv)
    if op == "moe":
        w13, s13 = _random_fp8(256 * 4096, 7168, gen)
        w2, s2 = _random_fp8(256 * 7168, 2048, gen)
        w13 = w13.view(256, 4096, 7168)
        s13 = s13.view(256, 32, 56)
        w2 = w2.view(256, 7168, 2048)
        s2 = s2.view(256, 56, 16)
        x = rows(7168)
        idx = torch.rand(batch, 256, device="cuda", generator=gen).topk(8, -1).indices
        weights = torch.rand(batch, 8, device="cuda", generator=gen)
        return lambda n: kernels.moe_grouped(x[:n], weights[:n], idx[:n], w13, s13, w2, s2)
    return None


def _batch_op_attention(op, batch, gen, cfg):
    """_batch_op's decode attention over a 4096-token context: index_topk, or else sparse_mla."""
    import kernels

    rows = functools.partial(_random_bf16_rows, batch, gen)
    ctx = 4096
    cache, table = _decode_rows(batch, ctx, cfg, gen)

    def meta_for(n):  # every row at the same context: the batch changes nothing but the number of rows
        return build_meta("decode", [ctx - 1] * n, [1] * n, table[:n])

    if op == "index_topk":
        q8 = (torch.randn(batch, 64, 128, device="cuda", generator=gen) * 4).to(m.FP8)
        qs = 2.0 ** torch.randint(-8, -2, (batch, 64, 1), device="cuda", generator=gen).float()
        weights = torch.rand(batch, 64, device="cuda", generator=gen)
        return lambda n: kernels.index_topk(
            q8[:n], qs[:n], weights[:n], 0.011, cache, meta_for(n), 1024
        ).float()
    q_abs = rows(128, 512)
    q_pe = rows(128, 64)
    chosen = torch.rand(batch, ctx, device="cuda", generator=gen).topk(2048, -1).indices
    return lambda n: kernels.sparse_mla(
        q_abs[:n], q_pe[:n], cache, chosen[:n], meta_for(n), cfg.softmax_scale
    )


def _batch_op(op, batch, gen):
    """fn(n) -> the output rows of `op` over the first n of `batch` rows of random inputs (real shapes)."""
    cfg = m.Config.full(2)
    for build in (_batch_op_rowwise, _batch_op_gemm):
        fn = build(op, batch, gen, cfg)
        if fn is not None:
            return fn
    return _batch_op_attention(op, batch, gen, cfg)


BATCH_OPS = ["act_quant", "index_quant_q", "store_index_key", "rmsnorm", "rmsnorm_q"]
BATCH_OPS += ["fp8_linear_wqkv_a", "fp8_linear_wq_b", "fp8_linear_wo"]
BATCH_OPS += ["dense_linear_head", "dense_linear_weights_proj", "dense_linear_eh_proj", "gate"]
BATCH_OPS += ["rope_q", "swiglu_linear", "route"]
BATCH_OPS += ["absorb_q", "absorb_o", "moe", "index_topk", "sparse_mla"]


@gpu
@pytest.mark.parametrize("op", BATCH_OPS)
def test_gpu_op_row_does_not_depend_on_batch(op):
    """Batch invariance, op by op at full-width shapes, every op a decode or verify row goes through: a row's
    output computed alone equals, bit for bit, the same row computed inside batches of 2 to 256 rows of other
    inputs, and as one of a prefill chunk's 1024 rows (run twice: no run-to-run nondeterminism either)."""
    gen = torch.Generator("cuda").manual_seed(BATCH_OPS.index(op))
    biggest = 64 if op == "moe" else 1024
    sizes = [n for n in (2, 3, 4, 5, 16, 64, 256, 1024) if n <= biggest]
    fn = _batch_op(op, biggest, gen)
    alone = fn(1)[0]
    diffs = {n: (fn(n)[0].float() - alone.float()).abs().max().item() for n in sizes}
    diffs["again"] = (fn(1)[0].float() - alone.float()).abs().max().item()
    print(f"{op}: max |row in batch - row alone| by batch size {diffs}")
    assert all(d == 0 for d in diffs.values()), diffs


def _stdlib_texts(n, seed):
    """n slices of 40 to 1500 characters of Python's standard library sources."""
    import random

    rng = random.Random(seed)
    root = os.path.dirname(os.__file__)
    files = sorted(f for f in os.listdir(root) if f.endswith(".py"))
    texts = []
    while len(texts) < n:
        with open(os.path.join(root, rng.choice(files)), errors="replace") as f:
            src = f.read()
        size = rng.randint(40, 1500)
        if len(src) > size:
            start = rng.randrange(len(src) - size)
            texts.append(src[start : start + size])
    return texts


def _runs_agree(name, want, got):
    """The requests whose tokens differ between two runs (printed), and the count."""
    differ = [i for i, (a, b) in enumerate(zip(want, got, strict=True)) if a.token_ids != b.token_ids]
    print(
        f"{name}: {len(want) - len(differ)} of {len(want)} requests give identical tokens; differ: {differ}"
    )
    return len(differ)


@gpu
@pytest.mark.parametrize("which", ["demo", "tiny"])
def test_gpu_tokens_do_not_depend_on_batch_preemption_or_speculation(which, tiny_dir):
    """The batch-invariance load test: 192 requests of random lengths (demo: stdlib text of 40 to 1500
    characters; tiny: random token ids), 16 to 128 new tokens each, greedy, max_batch 64, CUDA graphs. Every
    request gives the same tokens with --mtp 0 and --mtp 3, with a pool small enough for many preemptions
    and with a large one, and 12 of them run alone."""
    import random

    rng = random.Random(18)
    if which == "demo":
        model_dir = hf.DEMO_DIR
        prompts = _stdlib_texts(192, seed=18)
    else:
        model_dir = tiny_dir
        prompts = [[rng.randrange(6, 262) for _ in range(rng.randint(10, 400))] for _ in range(192)]
    budgets = [rng.randint(16, 128) for _ in prompts]
    small = 24 << 20 if which == "demo" else 16 << 20

    def engine(mtp, pool):
        llm = m.LLM(model_dir, device="cuda", mtp=mtp, kv_cache_bytes=pool, max_batch=64)
        llm.cfg.eos_token_id = -1  # every request runs its whole budget: the longest, most varied batches
        return llm

    def run(llm, idx):
        out = llm.generate([prompts[i] for i in idx], max_new_tokens=[budgets[i] for i in idx], raw=True)
        return out, llm.stats["preemptions"]

    everything = range(len(prompts))
    plain, preempted = run(engine(0, small), everything)
    spec, spec_preempted = run(engine(3, small), everything)
    roomy_engine = engine(0, 2 << 30)
    roomy, roomy_preempted = run(roomy_engine, everything)
    print(
        f"{which}: preemptions {preempted} (mtp 0), {spec_preempted} (mtp 3), {roomy_preempted} (2 GB pool)"
    )
    assert preempted >= 20 and spec_preempted >= 20 and roomy_preempted == 0
    assert [len(r.token_ids) for r in plain] == budgets
    differ = _runs_agree(f"{which} mtp 0 vs mtp 3", plain, spec)
    differ += _runs_agree(f"{which} small vs large pool", plain, roomy)
    alone = rng.sample(list(everything), 12)
    by_itself = [run(roomy_engine, [i])[0][0] for i in alone]
    differ += _runs_agree(f"{which} alone vs in the batch", [plain[i] for i in alone], by_itself)
    assert differ == 0


@gpu
def test_gpu_full_width_logits_do_not_depend_on_the_batch(tmp_path, monkeypatch):
    """Config.full(2) with random FP8 weights, kernels and CUDA graphs: one request's logits, bit for bit,
    alone (bs=1), inside a batch of 16 requests of other prompts (short and long, chunked prefill), and as
    verify rows of --mtp 3 (oracle drafts, so that runs of drafts are accepted and their rows emit)."""
    cfg = m.Config.full(2)
    model = random_model(cfg, "cuda")
    write_byte_tokenizer(str(tmp_path), cfg.vocab_size)
    g = torch.Generator().manual_seed(5)
    lengths = [2300, 40, 700, 3000, 5, 1500, 90, 2049, 300, 12, 2600, 64, 1024, 450, 2100, 33]
    prompts = [torch.randint(6, 250, (n,), generator=g).tolist() for n in lengths]

    def run(mtp, ps):
        llm = m.LLM(str(tmp_path), device="cuda", model=model, mtp=mtp, max_batch=16, kv_cache_bytes=2 << 30)
        eos = cfg.eos_token_id
        cfg.eos_token_id = -1  # random weights: no request may end early
        try:
            return llm.generate(ps, max_new_tokens=10, return_logits=True, seed=0)  # (oracle_drafts)
        finally:
            cfg.eos_token_id = eos

    alone = run(0, prompts[:1])[0]
    batch = run(0, prompts)
    oracle_drafts(monkeypatch, prompts, [r.token_ids for r in batch])
    verify = run(3, prompts[:1])[0]
    verify_batch = run(3, prompts)
    for name, got in dict(batch=batch[0], verify=verify, verify_batch=verify_batch[0]).items():
        diff = (got.logits - alone.logits).abs().amax(1).tolist()  # per emitted token (0: from the prefill)
        print(
            f"full width, request 0: alone vs {name}: tokens equal {got.token_ids == alone.token_ids}, "
            f"max logit difference per token {diff}, accepted {got.accept_lengths}"
        )
        assert got.token_ids == alone.token_ids and torch.equal(got.logits, alone.logits), name
    assert max(verify.accept_lengths) > 1  # rows past the first emitted


def _rejection_case(V, gen, device="cpu"):
    """Inputs of rejection_sample for 32 requests at k = 3 (and the same at k = 0), the drafts a strided view
    as the engine passes them (its batch.tokens[:, 1:]): drafts drawn from q, the argmax, or uniformly; q of
    most rows a sharper p (more weight than p on p's likely tokens), so that a rejection's residual draw
    often differs from a draw from p (the check below counts them; 1-9 of the rows for seeds 0-39 and each
    V tested); a greedy row (one-hot p); a row with p = q (all kept); a row whose first draft has p = q = 0
    (rejected with a zero residual: the draw falls back to p); a row whose residual is 0 on the first half of
    the vocabulary (zero in a split row's first chunks, not in its last); the seeds up to 2^62."""
    B, k = 32, 3
    logits = torch.randn(B, k + 1, V, generator=gen) * 2
    p = torch.softmax(logits, -1)
    p[:, :, : V // 2] *= torch.rand(B, k + 1, 1, generator=gen) < 0.3  # some rows lose half their tokens
    p = p / p.sum(-1, keepdim=True)
    q = torch.softmax(torch.randn(B, k, V, generator=gen) * 2, -1)
    q[8:] = torch.softmax(logits[8:, :k] * 1.5 + 0.3 * torch.randn(B - 8, k, V, generator=gen), -1)
    q[4, 0, 5] = 0.0
    q[4, 0] /= q[4, 0].sum()
    drafts = torch.multinomial(q.flatten(0, 1), 1, generator=gen).view(B, k)
    drafts[1] = p[1, :k].argmax(-1)
    drafts[6] = torch.randint(0, V, (k,), generator=gen)
    p[2] = F.one_hot(torch.randint(0, V, (k + 1,), generator=gen), V).float()  # a greedy row
    drafts[2, :2] = p[2, :2].argmax(-1)
    p[3, :k] = q[3]  # p = q: every draft is kept
    p[4, 0], drafts[4, 0] = q[4, 0], 5
    q[5, 0] = 1.5 * p[5, 0] * (torch.arange(V) < V // 2)  # the residual is p's second half
    drafts[5, 0] = p[5, 0, : V // 2].argmin()  # (p set to 0 there: rejected)
    p[5, 0, drafts[5, 0]] = 0.0
    tokens = torch.cat([torch.zeros(B, 1, dtype=torch.long), drafts], 1)
    seeds = torch.randint(0, 2**62, (B,), generator=gen)
    start = torch.randint(0, 10**6, (B,), generator=gen)
    cases = [(p, q, tokens[:, 1:], seeds, start), (p[:, :1].contiguous(), None, tokens[:, 1:1], seeds, start)]
    return [tuple(x if x is None else x.to(device) for x in case) for case in cases]


def _check_rejection_kernel(kernel, V, gen, device="cpu"):
    """kernel (sampling_kernels.rejection_sample) against nano_nsa.rejection_sample on _rejection_case: the
    same tokens and counts. And the case tests what it should: at k = 3 some rows keep every draft, and some
    reject one and draw another token from the residual than a draw from p would be."""
    cases = _rejection_case(V, gen, device)
    for args in cases:
        want, got = m.rejection_sample(*args), kernel(*args)
        assert all(torch.equal(w, g) for w, g in zip(want, got, strict=True)), (V, want, got)
    emitted, counts = m.rejection_sample(*cases[0])
    residual = m.residual_probs
    m.residual_probs = lambda p, q: p  # a draw from p where the residual's should be
    try:
        from_p = m.rejection_sample(*cases[0])[0]
    finally:
        m.residual_probs = residual
    last = counts[:, None] - 1
    differ = (counts < 4) & (emitted.gather(1, last) != from_p.gather(1, last))[:, 0]
    assert (counts == 4).any() and differ.any(), (V, counts, differ)


_INTERPRETED_SAMPLING = """
import torch, nano_nsa as m, sampling_kernels as k
from test_nano import _check_rejection_kernel
k.ROW_CHUNK = 1024  # rows of more than 4096 tokens split into chunks of 1024: the split path on small rows
k.ROW_IN_REGISTERS = 2048  # rows of up to 2048 in registers, of 2049-4096 the phases in one program
gen = torch.Generator().manual_seed(0)
for V in (7, 1500, 3000, 5000):
    logits = torch.randn(4, 2, V, generator=gen) * 3
    logits[0, 0, :3] = logits[0, 0, 3]  # tied tokens
    logits[1, 1, [5, V // 2, V - 1]] = 40.0  # a greedy row's maximum three times: the first one wins
    logits[2, 1, 3] = 30.0  # a token that holds the nucleus (top-p 0.9) alone
    logits[3, 1, [3, 4]] = 30.0  # two tied ones, each more than top-p 0.4 of the mass: the first alone
    if V > 4096:  # 40 tied tokens holding most of the mass, across the chunk boundary at 1024, cut by top-p
        logits[3, 0, 1000:1040] = 20.0
    t = torch.tensor([0.6, 0.0, 1.0, 2.0])[:, None]
    top_p = torch.tensor([[0.95, 0.95], [0.9, 0.9], [1.0, 0.9], [0.5, 0.4]])
    want, got = m.probs_from_logits(logits, t, top_p), k.probs_from_logits(logits, t, top_p)
    assert ((got > 0) == (want > 0)).all(), V
    assert (got - want).abs().max() < 1e-6, V
    # one temperature and top-p a request over its two rows, as accept passes them (read, not copied): the
    # same as one value a row
    one, rows = top_p[:, 1:], (t.expand(4, 2).contiguous(), top_p[:, 1:].expand(4, 2).contiguous())
    assert torch.equal(k.probs_from_logits(logits, t, one), k.probs_from_logits(logits, *rows)), V
    seeds = torch.randint(0, 2**62, (4, 1), generator=gen)
    positions = torch.randint(0, 10**6, (2,), generator=gen)
    p = want.float()
    assert torch.equal(k.sample(p, seeds, positions, m.DRAFT), m.sample(p, seeds, positions, m.DRAFT)), V
    assert torch.equal(k.uniform(seeds, positions, m.ACCEPT, V), m.uniform(seeds, positions, m.ACCEPT, V)), V
    _check_rejection_kernel(k.rejection_sample, V, gen)  # k = 3, and k = 0 (q None)
one = torch.tensor([[0.0, 1.0, 0.0, 0.0]])  # u = 1 for the only token of p > 0: it still wins
assert k.sample(one, torch.tensor(7), torch.tensor([779784]), m.TARGET).item() == 1
print("ok")
"""


@full  # slow: about 80 s in the interpreter
def test_sampling_kernels_run_in_the_triton_interpreter():
    """The sampling kernels' logic without a GPU: Triton's interpreter runs them on the CPU against the
    references, a row in one program and rows split over programs (chunks made small), with ties at the
    nucleus' edge across a chunk boundary and a greedy row whose maximum repeats. (Skipped where Triton is
    not installed: .ci/run installs it for this test; the GPU tests below run the compiled kernels.)"""
    pytest.importorskip("triton")
    import subprocess

    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    here = os.path.dirname(os.path.abspath(__file__))
    r = subprocess.run(
        [sys.executable, "-c", _INTERPRETED_SAMPLING],
        capture_output=True,
        text=True,
        env=env,
        cwd=here,
        timeout=600,
    )
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-3000:]


@gpu
@pytest.mark.parametrize("V", [7, 2048, 129280])
def test_gpu_sample_kernel_matches_reference(V):
    """The exponential race in one launch: the reference's token for every row (distributions with zeros, as
    a nucleus leaves them; seeds per request, positions per draft)."""
    import kernels

    gen = torch.Generator().manual_seed(V)
    probs = torch.softmax(torch.randn(5, 3, V, generator=gen) * 2, -1)
    probs[:, :, : V // 2] *= torch.rand(5, 3, 1, generator=gen) < 0.5  # some rows lose half their tokens
    seeds = torch.randint(0, 2**63 - 1, (5, 1), generator=gen)
    positions = torch.randint(0, 200000, (3,), generator=gen)
    want = m.sample(probs, seeds, positions, m.DRAFT)
    got = kernels.sample(probs.cuda(), seeds.cuda(), positions.cuda(), m.DRAFT).cpu()
    assert got.shape == (5, 3) and torch.equal(got, want)
    one = torch.zeros(1, V).index_fill_(1, torch.tensor([1]), 1.0)  # u = 1 for its only token of p > 0
    assert (
        kernels.sample(one.cuda(), torch.tensor(7).cuda(), torch.tensor([779784]).cuda(), m.TARGET).item()
        == 1
    )


@gpu
@pytest.mark.parametrize("V", [7, 2048, 129280])
def test_gpu_rejection_kernel_matches_reference(V):
    """Speculative sampling's acceptance in one launch (two over a full vocabulary, split over programs): the
    reference's kept drafts, draw and count for every row of _rejection_case, at k = 3 and k = 0."""
    import kernels

    _check_rejection_kernel(kernels.GPU_OPS.rejection_sample, V, torch.Generator().manual_seed(V), "cuda")


@gpu
@pytest.mark.parametrize("V", [7, 2048, 6000, 10000, 129280])
def test_gpu_probs_kernel_matches_reference(V):
    """Sampling distributions (softmax / T cut to the top-p nucleus; one-hot for T = 0) from the kernel (a row
    in registers up to 8192 tokens, the phases in one program up to 16384, a row split over programs for a
    full vocabulary) vs the reference's sort: the same kept tokens (ties included, also across the split) and
    probabilities within fp32 rounding, for temperatures 0-2 and top-p 0.5-1, as a round calls it ([B, k+1,
    V] with per-request settings)."""
    import kernels

    gen = torch.Generator().manual_seed(V)
    logits = torch.randn(4, 3, V, generator=gen) * 3
    logits[0, 0, :3] = logits[0, 0, 3]  # tied tokens
    logits[2, 2, 3] = 30.0  # a token that holds the nucleus (top-p 0.9) alone
    logits[3, 2, [3, 4]] = 30.0  # two tied ones, each more than top-p 0.4 of the mass: the first alone
    if V > 4096:  # 200 tied tokens holding most of the mass, across the kernel's chunks of 4096, cut by top-p
        logits[3, 0, 4000:4200] = 20.0
    temperature = torch.tensor([0.6, 0.0, 1.0, 2.0])[:, None]
    top_p = torch.tensor([[0.95] * 3, [0.9] * 3, [1.0, 1.0, 0.9], [0.5, 0.5, 0.4]])
    want = m.probs_from_logits(logits.cuda(), temperature.cuda(), top_p.cuda()).cpu()
    got = kernels.probs_from_logits(logits.cuda(), temperature.cuda(), top_p.cuda()).cpu()
    differ = ((got > 0) != (want > 0)).any(-1).nonzero().tolist()
    for b, j in differ:  # (print what differs)
        print(V, b, j, want[b, j].tolist()[:8], got[b, j].tolist()[:8], logits[b, j].tolist()[:8])
    assert not differ
    assert (got - want).abs().max() < 1e-6 and torch.allclose(got.sum(-1), torch.ones(4, 3), atol=1e-5)


@gpu
@pytest.mark.parametrize("n", [1, 5, 2048, 129280])
def test_gpu_uniform_kernel_is_bit_exact(n):
    """Sampling's counter-based uniform numbers: the kernel gives the reference's bits for random seeds (up to
    2^63) and positions, broadcast as the engine calls it (a seed per request, positions per draft)."""
    import sampling_kernels

    gen = torch.Generator().manual_seed(n)
    seeds = torch.randint(0, 2**63 - 1, (7, 1), generator=gen)
    positions = torch.randint(0, 200000, (7, 3), generator=gen)
    want = m.uniform(seeds, positions, m.ACCEPT, n)
    got = sampling_kernels.uniform(seeds.cuda(), positions.cuda(), m.ACCEPT, n).cpu()
    assert got.shape == want.shape == (7, 3, n) and torch.equal(got, want)
    assert 0 < want.min() and want.max() < 1
    if n >= 2048:  # (a mean over enough numbers)
        assert abs(want.mean().item() - 0.5) < 0.01


@gpu
@pytest.mark.parametrize("heads", [64, 0])
def test_gpu_index_quant_kernel_matches_reference(heads):
    """The indexer's q (64 heads) and k (no head dim): RoPE + Hadamard as one tensor-core product + act-quant
    in one kernel vs rope + the butterfly reference + act_quant: FP8 values and scales equal except where the
    two fp32 summation orders round a value to a neighbouring bf16, which moves it one e4m3 step (or its
    group's scale one binade), in at most 0.1% of the values and of the (token, head) groups."""
    import kernels

    gen = torch.Generator("cuda").manual_seed(3 + heads)
    shape = (300, heads, 128) if heads else (300, 128)
    x = (torch.randn(*shape, device="cuda", generator=gen) * 3).to(m.BF16)
    cos, sin = cos_sin(m.Config(), torch.randint(0, 100000, (300,), device="cuda", generator=gen))
    q, s = kernels.index_quant(x, cos, sin)
    q_ref, s_ref = m.index_quant(x, cos, sin)
    values, scales = assert_fp8_within_one_step(q, s, q_ref, s_ref, 1e-3, f"index_quant, {heads} heads")
    print(f"index_quant {heads} heads: {values:.2e} of the values, {scales:.2e} of the scales one step off")


@gpu
@pytest.mark.parametrize("T", [1, 5, 300])
def test_gpu_store_index_key_matches_reference(T):
    """The indexer's cache write in one kernel (LayerNorm, RoPE, Hadamard, FP8, the slot writes) vs the
    reference (F.layer_norm, index_quant, two index writes) into random slots of a pool: only the written rows
    change; the scales and FP8 values equal except where the two fp32 summation orders (the norm's, the
    Hadamard's) round a value to a neighbouring bf16: one e4m3 step (or a row's scale one binade), in at most
    1% of the values and of the rows."""
    import kernels

    gen = torch.Generator("cuda").manual_seed(T)
    k = (torch.randn(T, 128, device="cuda", generator=gen) * 3 + 1).to(m.BF16)
    norm_weight = torch.rand(128, device="cuda", generator=gen) + 0.5
    norm_bias = torch.randn(128, device="cuda", generator=gen) * 0.1
    cos, sin = cos_sin(m.Config(), torch.randint(0, 160000, (T,), device="cuda", generator=gen))
    S = 2 * T + 8
    slots = torch.randperm(S, device="cuda", generator=gen)[:T]
    ik = (torch.randn(S, 128, device="cuda", generator=gen) * 8).to(m.FP8)
    iks = torch.rand(S, device="cuda", generator=gen)
    caches = [m.LayerCache(None, ik.clone(), iks.clone(), 0) for _ in range(2)]
    kernels.store_index_key(k, norm_weight, norm_bias, 1e-6, cos, sin, caches[0], slots)
    m.store_index_key(k, norm_weight, norm_bias, 1e-6, cos, sin, caches[1], slots)
    got, want = caches[0].ik.float(), caches[1].ik.float()
    untouched = torch.ones(S, dtype=torch.bool, device="cuda").index_fill_(0, slots, False)
    assert torch.equal(got[untouched], want[untouched])
    assert torch.equal(caches[0].iks[untouched], caches[1].iks[untouched])
    assert not torch.equal(got[slots], ik[slots].float())  # the rows were written
    keys = [(c.ik[slots], c.iks[slots, None]) for c in caches]
    values, scales = assert_fp8_within_one_step(*keys[0], *keys[1], 0.01, f"store_index_key T={T}")
    print(f"store_index_key T={T}: {values:.2e} of the values, {scales:.2e} of the scales one step off")


@gpu
@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("T,H", [(1, 128), (300, 16), (7, 1)])
def test_gpu_rope_matches_reference(T, H, interleaved):
    """The Triton rotation (no FMA, products rounded as torch rounds them) vs the reference on a strided view
    (q_pe inside q_b's output): equal, or at most one bf16 step apart."""
    import kernels

    gen = torch.Generator("cuda").manual_seed(T + H)
    x = (torch.randn(T, H, 192, device="cuda", generator=gen) * 4).to(m.BF16)[..., 128:]
    cos, sin = cos_sin(m.Config(), torch.randint(0, 160000, (T,), device="cuda", generator=gen))
    got, want = kernels.rope(x, cos, sin, interleaved).float(), m.rope(x, cos, sin, interleaved).float()
    assert got.shape == want.shape
    assert ((got - want).abs() <= 2**-7 * want.abs()).all()
    print(f"rope T={T} H={H}: {(got != want).float().mean().item():.2e} of values one bf16 step apart")


@gpu
def test_gpu_round_metadata_kernels_equal_references():
    """decode_rows (Meta.decode's positions, requests and slots) and rope_cos_sin (RoPE's angles), one launch
    each, bit for bit the references' (torch's cos and sin are libdevice's too): random starts read through a
    strided page table, every position the 671B model allows and a few past it, and no rows at all."""
    import kernels

    gen = torch.Generator("cuda").manual_seed(5)
    for B, n in ((1, 1), (3, 4), (64, 4), (200, 1), (0, 2)):
        start = torch.randint(0, 900, (B,), device="cuda", generator=gen)
        table = torch.randint(1, 10**6, (B, 1061), device="cuda", generator=gen)[:, :1000]
        want, got = m.decode_rows(start, n, table), kernels.decode_rows(start, n, table)
        assert all(torch.equal(w, g) for w, g in zip(want, got, strict=True)), (B, n)
    for cfg in (m.Config(), m.Config.tiny(beta_fast=24.0, rope_factor=8.0)):
        freqs = m.yarn_frequencies(cfg).cuda()
        every = torch.arange(cfg.max_seq_len + 64, device="cuda")
        for pos in (every, torch.randint(0, 10**6, (77,), device="cuda", generator=gen), every[:0]):
            want, got = m.rope_cos_sin(freqs, pos), kernels.rope_cos_sin(freqs, pos)
            assert all(torch.equal(w, g) for w, g in zip(want, got, strict=True)), len(pos)


@gpu
def test_gpu_take_equals_reference():
    """Batch.take (a round's rows of the decode state) in one launch, bit for bit the reference's: random
    fields, rows repeated and in any order (padding's row 0 among them), with drafts and without, no rows."""
    import kernels

    gen = torch.Generator("cuda").manual_seed(7)
    for k, n, B in ((0, 65, 64), (3, 17, 12), (3, 5, 0), (1, 9, 1)):
        state = m.Batch.empty(n, k, 100, "cuda")
        for x in (state.tokens, state.start, state.seeds):
            x.random_(0, 2**40, generator=gen)
        for x in (state.temperature, state.top_p) + ((state.q,) if k else ()):
            x.uniform_(generator=gen)
        ids = torch.randint(0, n, (B,), device="cuda", generator=gen)
        ids[: B // 2] = 0
        want, got = state.take(ids), kernels.take(state, ids)
        for w, g in zip(vars(want).values(), vars(got).values(), strict=True):
            assert (w is None and g is None) or torch.equal(w, g), (k, n, B)


@gpu
@pytest.mark.parametrize("C", [512, 256])
@pytest.mark.parametrize("T", [1, 5, 300])
def test_gpu_store_latent_matches_reference(T, C):
    """MLA's cache write in one kernel vs the reference (rms_norm, act_quant round trip, rope, two index
    writes) into random slots of a pool: only the written rows change; the rope keys equal up to one bf16
    step; the FP8 latents and their scales equal except where the norm's fp32 sum order rounds a value to a
    neighbouring bf16: one e4m3 step (or a group's scale one binade), in at most 1% of the values and of the
    groups."""
    import kernels

    gen = torch.Generator("cuda").manual_seed(T + C)
    R = 64
    kv_a = (torch.randn(T, C + R, device="cuda", generator=gen) * 2).to(m.BF16)
    kv, k_pe = kv_a.split([C, R], -1)
    weight = torch.rand(C, device="cuda", generator=gen) + 0.5
    cos, sin = cos_sin(m.Config(), torch.randint(0, 160000, (T,), device="cuda", generator=gen))
    slots = torch.randperm(2 * T + 8, device="cuda", generator=gen)[:T]
    pools = [_random_latents(2 * T + 8, C, gen, R) for _ in range(2)]
    pools[1].copy_(pools[0])
    caches = [m.LayerCache(pool, None, None, C) for pool in pools]
    kernels.store_latent(kv, k_pe, weight, 1e-6, cos, sin, caches[0], slots)
    m.store_latent(kv, k_pe, weight, 1e-6, cos, sin, caches[1], slots)
    untouched = torch.ones(len(pools[0]), dtype=torch.bool, device="cuda").index_fill_(0, slots, False)
    assert torch.equal(pools[0][untouched], pools[1][untouched])
    pe, pe_ref = (c.pe[slots].float() for c in caches)
    assert ((pe - pe_ref).abs() <= 2**-7 * pe_ref.abs()).all()
    latents = [(c.kv[slots], c.kv_scale[slots]) for c in caches]
    values, scales = assert_fp8_within_one_step(*latents[0], *latents[1], 0.01, f"store_latent T={T} C={C}")
    print(f"store_latent T={T} C={C}: {values:.2e} of the values, {scales:.2e} of the scales one step off")


@gpu
@pytest.mark.parametrize("shape", [(256, 8, 4, 8), (8, 4, 2, 2), (24, 4, 2, 3)])
@pytest.mark.parametrize("T", [1, 7, 300])
def test_gpu_route_matches_reference(T, shape):
    """The one-kernel router vs the reference (sigmoid, biased group top-2 sums, group-limited top-k, weights)
    at DeepSeek-V3.2's 256 experts in 8 groups, the demo's and a shape of no powers of two: the same experts
    in the same order, weights to fp32 rounding."""
    import kernels

    E, groups, top_groups, top_experts = shape
    gen = torch.Generator("cuda").manual_seed(T + E)
    logits = torch.randn(T, E, device="cuda", generator=gen) * 2
    bias = torch.randn(E, device="cuda", generator=gen) * 0.1
    got_w, got_i = kernels.route(logits, bias, groups, top_groups, top_experts, 2.5)
    want_w, want_i = m.route(logits, bias, groups, top_groups, top_experts, 2.5)
    assert torch.equal(got_i, want_i)
    torch.testing.assert_close(got_w, want_w, rtol=1e-5, atol=1e-6)


@gpu
@pytest.mark.parametrize("N,K", [(7168, 2048), (7168, 18432), (256, 128)])
@pytest.mark.parametrize("M", [1, 4, 300])
def test_gpu_swiglu_linear_matches_reference(M, N, K):
    """SwiGLU's down projection with the activation and act-quant in the GEMM (M <= 256) or in act_quant
    (above) vs the reference, at the shared expert's, the dense MLP's and the demo's shapes (bound 1e-2
    relative, as fp8_linear)."""
    import kernels

    gen = torch.Generator("cuda").manual_seed(M + N + K)
    w, s = _fp8_weight(N, K, gen=gen)
    h = (torch.randn(M, 2 * K, generator=gen, device="cuda") * 2).to(m.BF16)
    got = kernels.swiglu_linear(h, w, s).float()
    want = m.fp8_linear(m.swiglu(h[:, :K], h[:, K:]), w, s).float()
    assert got.shape == (M, N) and ((got - want).norm() / want.norm()).item() < 1e-2


def _rand_fp8(*shape, gen, device="cuda"):
    return (torch.randn(*shape, generator=gen, device=device) * 8).clamp(-448, 448).to(m.FP8)


def _random_rows(lens_per_req, rows_per_req, gen, max_slots):
    """A verify-style Meta: request b has rows at positions n_b .. n_b + rows - 1 (expanded causal lengths),
    its page-table row a random permutation of KV-pool slots."""
    B = len(lens_per_req)
    width = max(lens_per_req) + rows_per_req
    table = torch.stack([torch.randperm(max_slots, generator=gen, device="cuda")[:width] for _ in range(B)])
    return build_meta("decode", lens_per_req, [rows_per_req] * B, table)


@gpu
@pytest.mark.parametrize(
    "B,rows,ctx,heads,K",
    [
        (1, 1, 1024, 64, 2048),
        (1, 4, 65536, 64, 2048),
        (4, 2, 8192, 64, 2048),
        (64, 1, 4096, 64, 2048),
        (8, 3, None, 64, 2048),
        (4, 2, 70, 4, 32),
    ],
)
def test_gpu_indexer_kernel_matches_reference(B, rows, ctx, heads, K):
    """Real shapes (64 heads x 128, top-k 2048): the Triton indexer selects the reference's positions. Sets
    may differ only at near-ties: the kernel's FP8 tensor-core dots accumulate with about 14 bits of precision
    on Hopper (DeepSeek-V3 report, 3.3.2; the official fp8_index kernel runs on the same units), so a position
    may swap across the k-th score only if its exact (fp64) score is within 2^-11 of the row's largest |score|
    of it, and such swaps must stay rare (at most 1% of a row's selection)."""
    import kernels

    gen = torch.Generator("cuda").manual_seed(B * 1000 + rows)
    lens = [ctx] * B if ctx else torch.randint(100, 20000, (B,), generator=gen, device="cuda").tolist()
    S = max(lens) * B + rows * B + 64
    meta = _random_rows(lens, rows, gen, S)
    cache = m.LayerCache(
        None,
        _rand_fp8(S, 128, gen=gen),
        2.0 ** torch.randint(-8, -2, (S,), generator=gen, device="cuda").float(),
        512,
    )
    T = B * rows
    q8 = _rand_fp8(T, heads, 128, gen=gen)
    qs = 2.0 ** torch.randint(-8, -2, (T, heads, 1), generator=gen, device="cuda").float()
    weights = torch.randn(T, heads, generator=gen, device="cuda")
    scale = heads**-0.5 * 128**-0.5
    got = kernels.index_topk(q8, qs, weights, scale, cache, meta, K)
    want = m.index_topk(q8, qs, weights, scale, cache, meta, K)
    assert got.shape == want.shape
    ctx_rows = meta.table[meta.row_req, : meta.max_ctx]
    w = m.head_weights(weights, scale, qs).cpu().double()
    exact = m.index_scores(q8.cpu(), w, cache.ik[ctx_rows].cpu(), cache.iks[ctx_rows].cpu().double())
    mismatched = 0
    for t in range(T):
        g, r = set(got[t].tolist()) - {-1}, set(want[t].tolist()) - {-1}
        assert len(g) == len(r) == min(K, int(meta.ctx_lens[t]))
        diff = sorted(g ^ r)
        if diff:
            kth = exact[t, sorted(r, key=lambda n: exact[t, n].item())[0]]
            bound = 2**-11 * exact[t, : int(meta.ctx_lens[t])].abs().max()
            assert (exact[t, diff] - kth).abs().max() <= bound, (
                f"row {t}: positions {diff[:8]} differ and are not near-ties"
            )
            assert len(diff) <= 0.01 * len(r), f"row {t}: {len(diff)} swaps"
            mismatched += len(diff)
    print(f"B={B} rows={rows} ctx={lens[:4]}: {mismatched} near-tie swaps over {T} rows")


@gpu
@pytest.mark.parametrize("B,rows,ctx", [(1, 1, 4096), (1, 4, 8000), (3, 2, None)])
def test_gpu_rank_select_equals_topk(B, rows, ctx, monkeypatch):
    """The indexer's two ways to its top-k give the same selection, element for element (its keys are
    distinct, so the sorted top-k is unique): the rank kernel (few rows and short contexts) and torch.topk
    (forced by RANK_SELECT_PAIRS = 0). Scores include many exact zeros (a third of the query heads are zero,
    head weights of both signs) and rows whose context fits in top-k."""
    import kernels

    gen = torch.Generator("cuda").manual_seed(B + rows)
    lens = [ctx] * B if ctx else [1500, 2049, 2600]
    S = max(lens) * B + rows * B + 64
    meta = _random_rows(lens, rows, gen, S)
    cache = m.LayerCache(None, _rand_fp8(S, 128, gen=gen), torch.rand(S, generator=gen, device="cuda"), 512)
    T = B * rows
    q8 = _rand_fp8(T, 64, 128, gen=gen)
    q8[:, ::3] = 0
    qs = 2.0 ** torch.randint(-8, -2, (T, 64, 1), generator=gen, device="cuda").float()
    w = torch.randn(T, 64, generator=gen, device="cuda")
    assert T * meta.max_ctx**2 <= kernels.RANK_SELECT_PAIRS
    ranked = kernels.index_topk(q8, qs, w, 0.011, cache, meta, 2048)
    monkeypatch.setattr(kernels, "RANK_SELECT_PAIRS", 0)
    assert torch.equal(ranked, kernels.index_topk(q8, qs, w, 0.011, cache, meta, 2048))


def _sparse_case(B, rows, ctx, gen, K=2048, H=128, C=512):
    """B requests of `rows` query rows each, of context ctx (a list: each request's; None: random)."""
    if isinstance(ctx, list):
        lens = ctx
    elif ctx:
        lens = [ctx] * B
    else:
        lens = torch.randint(1, 40000, (B,), generator=gen, device="cuda").tolist()
    S = max(lens) * B + rows * B + 64
    meta = _random_rows(lens, rows, gen, S)
    cache = m.LayerCache(_random_latents(S, C, gen), None, None, C)
    T = B * rows
    width = min(K, meta.max_ctx)

    def selection():  # distinct random positions below each row's length, valid ones first, -1 after
        pos = (
            torch.rand(T, meta.max_ctx, generator=gen, device="cuda")
            .masked_fill(torch.arange(meta.max_ctx, device="cuda") >= meta.ctx_lens[:, None], 2)
            .argsort(-1)[:, :width]
        )
        return torch.where(torch.arange(width, device="cuda") < meta.ctx_lens[:, None], pos, -1)

    q_abs = torch.randn(T, H, C, generator=gen, device="cuda") * 0.5
    q_pe = (torch.randn(T, H, 64, generator=gen, device="cuda") * 0.5).to(m.BF16)
    return meta, cache, q_abs, q_pe, selection


@gpu
@pytest.mark.parametrize(
    "B,rows,ctx,tiny,heads",
    [
        (1, 1, 1024, 0, 128),
        (1, 4, 65536, 0, 128),
        (16, 2, 4096, 0, 128),
        (64, 1, 32768, 0, 128),
        (8, 3, None, 0, 128),
        (5, 2, 2047, 0, 128),
        (4, 2, 4096, 0, 64),
        (2, 3, 100, 0, 64),
        (3, 1, 1, 0, 64),
        (4, 2, 50, 1, 4),
        (3, 4, 20, 1, 4),
    ],
)
def test_gpu_sparse_mla_kernel_matches_reference(B, rows, ctx, tiny, heads):
    """The sparse MLA kernel's rows (on Hopper at 64 and 128 heads of 512 + 64: the Gluon kernel; in the tiny
    configuration: the Triton one) vs the fp32 reference at top-k 2048: rows of different lengths in one call
    (selections split into several chunks and merged, lengths below top-k, -1 pads), two 'layers' with
    different selections over one Meta. Bound 1e-2 relative (Frobenius): q, p and the output are rounded to
    bf16 (2^-9 each), softmax and sums stay fp32. And a row alone gives the bits it gives in the batch."""
    import kernels

    gen = torch.Generator("cuda").manual_seed(B * 7 + rows)
    cfg = m.Config.tiny() if tiny else m.Config.full(n_layers=2)
    path = kernels.sparse_mla_path(torch.device("cuda"), heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim)
    if torch.cuda.get_device_capability()[0] == 9:  # Hopper
        assert path == ("triton" if tiny else "gluon")
    meta, cache, q_abs, q_pe, selection = _sparse_case(
        B, rows, ctx, gen, cfg.index_topk, heads, cfg.kv_lora_rank
    )
    for layer in range(2):
        selected = selection()
        got = kernels.sparse_mla(q_abs, q_pe, cache, selected, meta, cfg.softmax_scale)
        want = m.sparse_mla(q_abs.to(m.BF16).float(), q_pe, cache, selected, meta, cfg.softmax_scale)
        err = ((got.float() - want).norm() / want.norm()).item()
        print(f"B={B} rows={rows} ctx={ctx} heads={heads} ({path}) layer {layer}: rel err {err:.2e}")
        assert err < 1e-2
        last = meta.cu_seqlens[-1] - 1  # the batch's last row, alone (its own Meta: one row of one request)
        req = meta.row_req[last : last + 1]
        alone = m.Meta.rows("decode", meta.positions[last : last + 1], req * 0, meta.table[req], [0, 1])
        one = kernels.sparse_mla(q_abs[last:][:1], q_pe[last:][:1], cache, selected[last:][:1], alone, 1.0)
        assert torch.equal(one, kernels.sparse_mla(q_abs, q_pe, cache, selected, meta, 1.0)[last:][:1])


@gpu
def test_gpu_sparse_mla_chunks_per_program_change_no_bit(monkeypatch):
    """The Gluon kernel's schedule (how many of a row's chunks one program runs) is a launch choice: one,
    two, three (the last program short of its three) or all eight chunks a program give the same bits, over
    rows shorter than a chunk, a few chunks long and past top-k (-1 pads after the short rows' selections),
    and match the reference."""
    import kernels

    if kernels.sparse_mla_path(torch.device("cuda"), 128, 512, 64) != "gluon":
        pytest.skip("the Gluon kernel runs on Hopper")
    gen = torch.Generator("cuda").manual_seed(5)
    cfg = m.Config.full(n_layers=2)
    lens = [1, 300, 1500, 2047, 4096, 40000]
    meta, cache, q_abs, q_pe, selection = _sparse_case(len(lens), 2, lens, gen, cfg.index_topk, 128, 512)
    selected = selection()
    outs = []
    for chunks in (1, 2, 3, 8):
        monkeypatch.setattr(
            kernels, "mla_hopper_chunks", lambda programs, splits, device, c=chunks: min(c, splits)
        )
        outs.append(kernels.sparse_mla(q_abs, q_pe, cache, selected, meta, cfg.softmax_scale))
    want = m.sparse_mla(q_abs.to(m.BF16).float(), q_pe, cache, selected, meta, cfg.softmax_scale)
    assert ((outs[0].float() - want).norm() / want.norm()).item() < 1e-2
    assert all(torch.equal(outs[0], out) for out in outs[1:])


@gpu
@pytest.mark.parametrize(
    "S,N,H,E,V",
    [
        (1, 1, 128, 192, 128),
        (100, 100, 128, 192, 128),
        (37, 2048, 128, 192, 128),
        (2048, 2048, 128, 192, 128),
        (30, 30, 4, 96, 32),
        (7, 25, 4, 96, 32),
    ],
)
def test_gpu_dense_attention_kernel_matches_reference(S, N, H, E, V):
    """SDPA (bf16 in, fp32 softmax) vs the fp32 reference on the same bf16 inputs, 128 heads of 192 / 128;
    rows are the last S of N positions (a chunk after cached tokens). Bound 1e-2 relative: bf16 output
    rounding and bf16 probabilities inside the kernel."""
    import kernels

    gen = torch.Generator("cuda").manual_seed(S + N)
    q, k = (torch.randn(n, H, E, generator=gen, device="cuda").to(m.BF16) for n in (S, N))
    v = torch.randn(N, H, V, generator=gen, device="cuda").to(m.BF16)
    scale = m.Config().softmax_scale
    got = kernels.dense_attention(q, k, v, scale).float()
    want = m.dense_attention(q.float(), k.float(), v.float(), scale)
    assert ((got - want).norm() / want.norm()).item() < 1e-2


@full
def test_eos_stops_generation_inside_accepted_drafts(tiny_dir, monkeypatch):
    prompts = mixed_prompts(4, seed=17)
    ref = [r.token_ids for r in make_llm(tiny_dir, 0).generate(prompts, max_new_tokens=16)]
    eos = ref[1][6]  # pretend this token is EOS
    for mtp in (0, 3):
        llm = make_llm(tiny_dir, mtp)
        monkeypatch.setattr(llm.cfg, "eos_token_id", eos)
        if mtp:
            oracle_drafts(monkeypatch, prompts, ref)
        out = llm.generate(prompts, max_new_tokens=16, seed=0)
        for r, want in zip(out, ref, strict=True):
            cut = want.index(eos) if eos in want else len(want)
            assert r.token_ids == want[:cut] and r.finish_reason == ("eos" if eos in want else "length")


@full
def test_finish_reason_does_not_depend_on_rounds():
    """EOS right after the last token the budget allows: "length", whether the two arrive in one round
    (accepted drafts) or in two (--mtp 0)."""

    def emitted(rounds):
        r = m.Request(0, [5], 1, 2, 0.0, 1.0, 0)  # a budget of 2 new tokens
        for tokens in rounds:
            if r.finish is None:
                r.emit(tokens, None, eos_id=1)
        return r.generated, r.finish

    assert emitted([[7, 8, 1]]) == emitted([[7], [8], [1]]) == ([7, 8], "length")
    assert emitted([[7, 1, 9]]) == emitted([[7], [1]]) == ([7], "eos")


@full
def test_generate_of_no_prompts(tiny_dir):
    llm = make_llm(tiny_dir, 1)
    assert llm.generate([]) == [] and llm.stats["tokens"] == 0 and llm.stats["decode_rounds"] == 0


@full
def test_first_token_eos_with_logits(tiny_dir, monkeypatch):
    """A request whose first token is EOS returns no tokens and an empty logits matrix (it used to crash)."""
    llm = make_llm(tiny_dir, 1)
    first = llm.generate([[5, 6, 7]], max_new_tokens=4)[0].token_ids[0]
    monkeypatch.setattr(llm.cfg, "eos_token_id", first)
    r = llm.generate([[5, 6, 7]], max_new_tokens=4, return_logits=True)[0]
    assert (
        r.token_ids == [] and r.finish_reason == "eos" and r.logits.shape == (0, m.Config.tiny().vocab_size)
    )


@full
def test_streaming_and_prompt_encodings(tiny_dir):
    llm = make_llm(tiny_dir, 2)
    streamed = {}
    out = llm.generate(
        ["hi", "there"], max_new_tokens=9, on_tokens=lambda i, t: streamed.setdefault(i, []).extend(t)
    )
    assert [streamed[0], streamed[1]] == [r.token_ids for r in out]
    tok = llm.tokenizer

    def ids(s):
        return tok.encode(s, add_special_tokens=False).ids

    assert llm.encode("hi") == ids(m.BOS + chat.USER) + ids("hi") + ids(chat.ASSISTANT + chat.END_THINK)
    assert llm.encode("hi", thinking=True)[-1] == tok.token_to_id(chat.THINK)
    assert llm.encode("hi", raw=True) == [0] + ids("hi") and len(ids("hi")) == 2
    assert llm.encode([5, 9, 11]) == [5, 9, 11]
    for bad, msg in (([[5, 288]], "outside"), ([[]], "empty")):
        with pytest.raises(ValueError, match=msg):
            llm.generate(bad)


@full  # a process of its own
def test_cli_prompt_file_and_process_exit_codes(tiny_dir, tmp_path):
    (tmp_path / "p.txt").write_text("first prompt\n\nsecond prompt\n")
    r = _cli(
        [
            "--model",
            tiny_dir,
            "--prompt-file",
            str(tmp_path / "p.txt"),
            "--max-new-tokens",
            "3",
            "--mtp",
            "0",
        ],
        tmp_path,
    )
    assert r.returncode == 0 and r.stdout.count("--- ") == 2, r.stderr
    r = _cli(["--model", tiny_dir, "--prompt", "x", "--max-new-tokens", "0"], tmp_path)
    assert r.returncode == 1 and r.stderr.strip() == "error: max_new_tokens must be > 0 (got 0)"
    r = _cli(["--model", tiny_dir, "--prompt", "x", "--max-new-tokens", "many"], tmp_path)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "invalid int value" in r.stderr


def _chi2_crit(df, z=3.09):
    """Chi-square critical value at p = 0.001 (Wilson-Hilferty approximation)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


@pytest.mark.parametrize("broken", [None, "wrong_row"])
@full  # 1500 requests; the quick run: test_rejection_sampling_is_exact
def test_speculative_sampling_follows_main_model_end_to_end(tiny_dir, monkeypatch, broken):
    """The engine with the (random) MTP layer drafting: each request's 2nd token is the main model's draw
    after its first round accepted prefill's guess (one-hot q), or is settled by its second round (an accepted
    MTP draft, or a residual draw). Pooled over 1500 seeds, its counts match the main model's own
    distributions (the returned logits rows) by a chi-square test; judging a draft by the wrong verify row is
    caught. (The acceptance rule itself is checked on exact distributions in
    test_rejection_sampling_is_exact.)"""
    if broken:
        accept = m.accept
        monkeypatch.setattr(m, "accept", lambda ops, b, lg: accept(ops, b, torch.roll(lg, -1, 1)))
    llm = make_llm(tiny_dir, 1, max_batch=2048)
    monkeypatch.setattr(llm.cfg, "eos_token_id", -1)  # EOS would hide the logits row of the 2nd token
    T = 0.6
    top_p = 0.95
    out = llm.generate(
        [[0, 40, 50, 60]] * 1500, max_new_tokens=2, temperature=T, top_p=top_p, seed=3, return_logits=True
    )
    assert all(len(r.token_ids) == 2 for r in out)
    params = torch.tensor([T]), torch.tensor([top_p])
    expected = sum(m.probs_from_logits(r.logits[1:2], *params)[0].double() for r in out)
    observed = torch.bincount(torch.tensor([r.token_ids[1] for r in out]), minlength=len(expected)).double()
    big = expected >= 5
    e = torch.cat([expected[big], expected[~big].sum()[None]])
    o = torch.cat([observed[big], observed[~big].sum()[None]])
    stat, df = float(((o - e) ** 2 / e).sum()), len(e) - 1
    rejected = sum(r.accept_lengths[:2] == [1, 1] for r in out)  # the 2nd token a residual draw
    assert rejected > 300, "the draft was rarely rejected: the residual rule is not exercised"
    if broken is None:
        assert stat < _chi2_crit(df), f"chi2 {stat:.1f} for df {df}"
    else:
        assert stat > _chi2_crit(df), f"the wrong verify row went undetected: chi2 {stat:.1f} for df {df}"


# ------------------------------------------------------------------------------------------------------------
# faults in a checkpoint or in user parameters: one clear line naming what is wrong, never a traceback
# ------------------------------------------------------------------------------------------------------------
def _cli_error(argv, capsys):
    """Run the CLI in-process; it must exit non-zero with one `error: ...` line and no traceback."""
    try:
        rc = m.main(argv)
    except SystemExit as e:
        rc = e.code
    err = capsys.readouterr().err.strip()
    assert rc != 0 and err.startswith("error: ") and "\n" not in err and "Traceback" not in err, (rc, err)
    return err


def _damaged_copy(tiny_dir, tmp_path):
    bad = str(tmp_path / "bad")
    shutil.copytree(tiny_dir, bad)
    with open(os.path.join(bad, "model.safetensors.index.json")) as f:
        return bad, json.load(f)["weight_map"]


def _rewrite_header(file, edit):
    """Apply edit(header dict) to a shard's JSON header, keeping its data bytes."""
    raw = open(file, "rb").read()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    edit(header)
    h = json.dumps(header).encode()
    open(file, "wb").write(len(h).to_bytes(8, "little") + h + raw[8 + n :])


SHARD_FAULTS = [
    "truncated",
    "empty",
    "header_length",
    "corrupt_header",
    "header_not_object",
    "wrong_length",
    "overlap",
    "extra_bytes",
    "bad_dtype",
    "duplicate",
    "index_not_json",
    "index_no_weight_map",
    "index_empty_weight_map",
    "index_wrong_shard",
    "nan_bf16",
    "nan_fp8",
    "scale_not_pow2",
    "scale_zero",
]


def _break_shard_layout(fault, file, victim):
    """Damage a shard's bytes or header, for safetensors itself to refuse; -> the expected error's parts."""
    raw = open(file, "rb").read()
    damaged = [f"{file}: not a safetensors file, or damaged or truncated ("]  # then safetensors' own words
    if fault == "truncated":
        open(file, "wb").write(raw[:-1000])
    elif fault == "empty":
        open(file, "wb").write(b"")
    elif fault == "header_length":
        open(file, "wb").write((1 << 60).to_bytes(8, "little") + raw[8:])
    elif fault == "corrupt_header":
        open(file, "wb").write(raw[:8] + raw[8:20].replace(b'"', b"\xff") + raw[20:])
    elif fault == "header_not_object":
        _rewrite_header(file, lambda h: h.update({victim: "F8_E4M3"}))
    elif fault == "wrong_length":
        _rewrite_header(file, lambda h: h[victim]["shape"].__setitem__(0, h[victim]["shape"][0] - 1))
    elif fault == "overlap":
        _rewrite_header(
            file, lambda h: h[victim].update(data_offsets=[o - 8 for o in h[victim]["data_offsets"]])
        )
    elif fault == "extra_bytes":
        open(file, "ab").write(b"\0" * 8)
    elif fault == "bad_dtype":
        _rewrite_header(file, lambda h: h[victim].update(dtype="F8_E9M9"))
        return damaged + ["F8_E9M9"]
    else:
        raise AssertionError(f"not a shard layout fault: {fault}")
    return damaged


def _break_index(fault, bad, victim, shard, other):
    """Damage model.safetensors.index.json; -> the expected error's parts."""
    index = os.path.join(bad, "model.safetensors.index.json")
    doc = json.load(open(index))
    if fault == "index_not_json":
        open(index, "w").write(json.dumps(doc)[:-5])
        return ["model.safetensors.index.json: not valid JSON"]
    if fault == "index_no_weight_map":
        open(index, "w").write(json.dumps({"metadata": doc["metadata"]}))
        return ["model.safetensors.index.json: expected a weight_map"]
    if fault == "index_empty_weight_map":  # (was: "config.json has 4 layers, but the shards hold ... 0")
        open(index, "w").write(json.dumps({"metadata": doc["metadata"], "weight_map": {}}))
        return ["model.safetensors.index.json: its weight_map lists no tensors"]
    doc["weight_map"][victim] = other
    open(index, "w").write(json.dumps(doc))
    return [shard, f"tensor {victim} is in {shard}, but the index says {other}"]


def _break_tensors(fault, bad, file, victim, shard, other):
    """Rewrite a shard's tensors: the victim also in another shard, or one nan in a bf16 tensor, or the fp8
    nan code in an fp8 one, or one of the victim's block scales 0.75 or 0; -> the expected error's parts."""
    from safetensors.torch import load_file, save_file

    if fault == "duplicate":
        tensors = load_file(os.path.join(bad, other))
        tensors[victim] = load_file(file)[victim]
        save_file(tensors, os.path.join(bad, other), metadata={"format": "pt"})
        return [shard, f"tensor {victim} is in both", other]
    tensors = load_file(file)
    if fault.startswith("scale"):  # a block scale that is not a positive power of two (ue8m0)
        name = victim + "_scale_inv"
        tensors[name].view(-1)[1] = 0.75 if fault == "scale_not_pow2" else 0.0
        save_file(tensors, file, metadata={"format": "pt"})
        return [shard, f"tensor {name} holds 1 block scales that are not positive powers of two"]
    name = victim if fault == "nan_fp8" else next(k for k, t in tensors.items() if t.dtype == torch.bfloat16)
    flat = tensors[name].view(torch.uint8).flatten() if fault == "nan_fp8" else tensors[name].flatten()
    flat[7] = 0x7F if fault == "nan_fp8" else float("nan")
    save_file(tensors, file, metadata={"format": "pt"})
    return [shard, f"tensor {name} holds 1 nan or inf values"]


@pytest.mark.parametrize("fault", quick_sample(SHARD_FAULTS, "truncated", "index_wrong_shard", "nan_fp8"))
def test_damaged_shard_is_one_clear_line(tiny_dir, tmp_path, fault, capsys):
    """Every damaged shard or index gives one ValueError line naming the file (and the tensor where there is
    one), before any weight is read (except nan / inf values, found while reading); the CLI prints it, exit
    code 1. A damaged safetensors header or data span is found by safetensors itself as the shard opens."""
    bad, weight_map = _damaged_copy(tiny_dir, tmp_path)
    victim = "model.layers.1.self_attn.kv_b_proj.weight"
    shard = weight_map[victim]
    file = os.path.join(bad, shard)
    other = next(f for f in sorted(set(weight_map.values())) if f != shard)
    if fault.startswith("index"):
        expect = _break_index(fault, bad, victim, shard, other)
    elif fault == "duplicate" or fault.startswith(("nan", "scale")):
        expect = _break_tensors(fault, bad, file, victim, shard, other)
    else:
        expect = _break_shard_layout(fault, file, victim)
    with pytest.raises(ValueError) as e:
        m.load_model(bad)
    assert all(x in str(e.value) for x in expect) and "\n" not in str(e.value), str(e.value)
    err = _cli_error(["--model", bad, "--prompt", "hi"], capsys)
    assert err == f"error: {e.value}"


@pytest.mark.parametrize("field", ["num_hidden_layers", "n_routed_experts"])
@full
def test_a_config_claiming_far_more_than_the_shards_hold_is_refused_at_once(tiny_dir, tmp_path, field):
    """config.json with 10^5 layers (or 8 x 10^5 experts) over the tiny checkpoint's shards: refused in one
    line in seconds (the table of expected tensors, built first, took minutes and ran out of memory)."""
    import time

    bad, _ = _damaged_copy(tiny_dir, tmp_path)
    hf_cfg = json.load(open(os.path.join(bad, "config.json")))
    hf_cfg[field] = 10**5 if field == "num_hidden_layers" else 8 * 10**5
    open(os.path.join(bad, "config.json"), "w").write(json.dumps(hf_cfg))
    t0 = time.perf_counter()
    with pytest.raises(ValueError) as e:
        m.LLM(bad, device="cpu")
    claims, holds = ("100001 layers", 4) if field == "num_hidden_layers" else ("800000 routed experts", 8)
    assert str(e.value) == f"{bad}: config.json has {claims}, but the shards hold tensors of {holds}"
    assert time.perf_counter() - t0 < 10


TOKENIZER_FAULTS = ["missing", "not_json", "not_a_tokenizer", "ids_beyond_vocab", "missing_special", "eos_id"]
TOKENIZER_FAULTS += ["truncation", "padding"]  # (they would cut or pad every prompt, silently)


@pytest.mark.parametrize("fault", quick_sample(TOKENIZER_FAULTS, "missing", "eos_id"))
def test_damaged_tokenizer_is_one_clear_line(tiny_dir, tmp_path, fault, capsys, monkeypatch):
    """A missing or corrupt tokenizer.json, one with ids the model does not have, one without the chat
    format's special tokens, or one whose EOS is not the config's: refused by name before any weight is
    loaded."""
    bad, _ = _damaged_copy(tiny_dir, tmp_path)
    tok = os.path.join(bad, "tokenizer.json")
    expect = ["tokenizer.json"]
    if fault == "missing":
        os.remove(tok)
        expect += ["no tokenizer.json"]
    elif fault == "not_json":
        open(tok, "w").write(open(tok).read()[:1000])
        expect += ["not a valid tokenizer"]
    elif fault == "not_a_tokenizer":
        open(tok, "w").write(json.dumps({"version": "1.0", "model": 5}))
        expect += ["not a valid tokenizer"]
    elif fault == "ids_beyond_vocab":
        write_byte_tokenizer(bad, 300)
        expect += ["has token id 299, but the model's vocab_size is 288"]
    elif fault == "missing_special":  # still in the vocab, but no longer one (special) token
        doc = json.load(open(tok))
        doc["added_tokens"] = [t for t in doc["added_tokens"] if t["content"] != chat.USER]
        open(tok, "w").write(json.dumps(doc))
        expect += [f"the special token {chat.USER} is missing"]
    elif fault in ("truncation", "padding"):
        doc = json.load(open(tok))
        doc["truncation"] = dict(direction="Right", max_length=3, strategy="LongestFirst", stride=0)
        if fault == "padding":
            doc["truncation"] = None
            doc["padding"] = dict(
                strategy="BatchLongest", direction="Right", pad_to_multiple_of=64, pad_id=1, pad_type_id=0
            )
            doc["padding"]["pad_token"] = m.EOS
        open(tok, "w").write(json.dumps(doc))
        expect += ["truncation and padding must be off (they would cut or pad every prompt)"]
    else:
        cfg = json.load(open(os.path.join(bad, "config.json")))
        cfg["eos_token_id"] = 2
        open(os.path.join(bad, "config.json"), "w").write(json.dumps(cfg))
        expect += [f"{m.EOS} is token 1, but config.json has eos_token_id 2"]
    monkeypatch.setattr(
        m, "load_model", lambda *a, **k: pytest.fail("weights loaded before the tokenizer check")
    )
    with pytest.raises(ValueError) as e:
        m.LLM(bad, device="cpu")
    assert all(x in str(e.value) for x in expect) and "\n" not in str(e.value), str(e.value)
    assert _cli_error(["--model", bad, "--prompt", "hi"], capsys) == f"error: {e.value}"


@full
def test_written_tokenizer_decodes_the_chat_tokens_as_deepseeks_does(tmp_path):
    """In DeepSeek-V3.2's tokenizer.json BOS / EOS are special (dropped by decode) but <｜User｜>,
    <｜Assistant｜>, <think> and </think> are not: decode keeps them as text (a thinking answer shows its
    </think>). The written tokenizer flags them alike."""
    from tokenizers import Tokenizer

    write_byte_tokenizer(str(tmp_path), 288)
    tok = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    turns = (chat.USER, chat.ASSISTANT, chat.THINK, chat.END_THINK)
    assert tok.decode([tok.token_to_id(t) for t in (m.BOS, *turns, m.EOS)]) == "".join(turns)
    special = {
        t["content"]: t["special"] for t in json.load(open(tmp_path / "tokenizer.json"))["added_tokens"]
    }
    real = os.path.join(SHARED, "data", "deepseek-v3.2", "tokenizer.json")
    if os.path.isfile(real):
        want = {t["content"]: t["special"] for t in json.load(open(real))["added_tokens"]}
        assert {t: special[t] for t in m.SPECIAL_TOKENS} == {t: want[t] for t in m.SPECIAL_TOKENS}


@full
def test_real_tokenizer_passes_the_checks(tmp_path):
    real = os.path.join(SHARED, "data", "deepseek-v3.2", "tokenizer.json")
    if not os.path.isfile(real):
        pytest.skip("the DeepSeek-V3.2 tokenizer is not in ../shared")
    os.symlink(real, tmp_path / "tokenizer.json")
    tok = hf.load_tokenizer(str(tmp_path), m.Config.full(), *TOKENS)
    assert tok.token_to_id(chat.USER) == 128803
    with pytest.raises(ValueError, match="has token id 128814, but the model's vocab_size is 128000"):
        hf.load_tokenizer(
            str(tmp_path), m.Config(**{**m.Config.full().__dict__, "vocab_size": 128000}), *TOKENS
        )


CONFIG_FAULTS = {  # case: (edit of the HF config dict, or raw file bytes; what the message must say)
    "not_json": (b'{"model_type": "deepseek_v32",', "not valid JSON"),
    "not_utf8": (b'{"model_type": "\xff"}', "not valid JSON"),
    "not_object": (b"[1, 2]", "expected a JSON object, not list"),
    "string_size": (dict(hidden_size="256"), "dim (hidden_size) must be an integer (got '256')"),
    "float_layers": (
        dict(num_hidden_layers=3.0),
        "n_layers (num_hidden_layers) must be an integer (got 3.0)",
    ),
    "bool_groups": (dict(n_group=True), "n_expert_groups (n_group) must be an integer (got True)"),
    "null_topk": (dict(index_topk=None), "index_topk must be an integer (got None)"),
    "negative_experts": (dict(n_routed_experts=-8), "n_routed_experts must be >= 1 (got -8)"),
    "zero_heads": (dict(num_attention_heads=0), "n_heads (num_attention_heads) must be >= 1 (got 0)"),
    "zero_mtp_ok_negative_not": (
        dict(num_nextn_predict_layers=-1),
        "n_mtp_layers (num_nextn_predict_layers) must be >= 0 (got -1)",
    ),
    "nan_eps": (dict(rms_norm_eps=float("nan")), "eps (rms_norm_eps) must be a finite number (got nan)"),
    "negative_eps": (dict(rms_norm_eps=-1e-6), "eps (rms_norm_eps) must be > 0 (got -1e-06)"),
    "string_scale": (
        dict(routed_scaling_factor="2.5"),
        "route_scale (routed_scaling_factor) must be a finite",
    ),
    "inf_rope_factor": ("rope_inf", "rope_factor (rope_scaling.factor) must be a finite number (got inf)"),
    "rope_theta_one": (dict(rope_theta=1), "rope_theta must be > 1.0 (got 1)"),
    "eos_beyond_vocab": (dict(eos_token_id=288), "bos/eos_token_id >= vocab_size"),
    "not_multiple": (dict(hidden_size=200), "dim (hidden_size) must be a multiple of 128"),
    "rope_not_object": (
        dict(rope_scaling="yarn"),
        "quantization_config and rope_scaling must be JSON objects",
    ),
    "quant_not_object": (
        dict(quantization_config=[]),
        "quantization_config and rope_scaling must be JSON objects",
    ),
    "architectures_int": (dict(model_type=None, architectures=5), "is not a DeepSeek-V3.2 config"),
    "deeply_nested": (
        b'{"model_type": "deepseek_v32", "x": ' + b"[" * 10**5 + b"]" * 10**5 + b"}",
        "not valid JSON",
    ),
    "rope_factor_half": (
        "rope_half",
        "rope_factor (rope_scaling.factor) must be >= 1 (YaRN stretches the context)",
    ),
    "softmax_router": (
        dict(scoring_func="softmax"),
        "scoring_func='softmax' is not supported (DeepSeek-V3.2 uses 'sigmoid')",
    ),
    "tied_embeddings": (
        dict(tie_word_embeddings=True),
        "tie_word_embeddings=True is not supported (DeepSeek-V3.2 uses False)",
    ),
    "fp8_e5m2": (
        dict(quantization_config=dict(quant_method="fp8", fmt="e5m2", weight_block_size=[128, 128])),
        "expected quantization_config fp8 e4m3 with weight_block_size [128, 128]",
    ),
    "blocks_64": (
        dict(quantization_config=dict(quant_method="fp8", weight_block_size=[64, 64])),
        "expected quantization_config fp8 e4m3 with weight_block_size [128, 128]",
    ),
    "rope_linear": (
        dict(rope_scaling=dict(type="linear", factor=40.0)),
        "expected rope_scaling of type yarn",
    ),
    # HF and vLLM take the softmax scale's mscale from mscale_all_dim (the reference from mscale): refused
    # unless they agree; keys of other RoPE variants (attention_factor scales cos / sin) change the math too
    "mscale_all_dim_differs": (
        "rope_mscale_all_dim",
        "rope_scaling.mscale_all_dim=0.707 must equal rope_scaling.mscale=1.0",
    ),
    "mscale_all_dim_missing": ("rope_no_mscale_all_dim", "rope_scaling has no mscale_all_dim"),
    "rope_attention_factor": ("rope_attention_factor", "rope_scaling.attention_factor is not supported"),
    # HF reads rope_type before type: both must say yarn
    "rope_type_linear": ("rope_type_linear", "expected rope_scaling of type yarn"),
}


@pytest.mark.parametrize("kw", [dict(page_size=10**9), dict(mtp=10**6)])
@full
def test_a_kv_pool_that_cannot_hold_one_round_is_refused(tiny_dir, kw):
    """A page_size or mtp so large that the pool cannot hold one request's round: refused as the engine is
    built (on a GPU, before the graphs' buffers are), not at each generate with a misleading hint."""
    with pytest.raises(ValueError) as e:
        m.LLM(tiny_dir, device="cpu", **kw)
    assert "usable slots, fewer than one request's decode round needs" in str(e.value), str(e.value)
    assert "give a larger kv_cache_bytes, or a smaller page_size or mtp" in str(e.value)


@full
def test_out_of_memory_is_one_line_from_the_cli(tiny_dir, capsys, monkeypatch):
    """Settings too large for the GPU (a huge mtp or max_batch: the graphs' buffers) end in torch's one-line
    out-of-memory message, not a traceback."""

    def oom(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 488.28 GiB.")

    monkeypatch.setattr(m.LLM, "generate", oom)
    err = _cli_error(["--model", tiny_dir, "--prompt", "hi", "--device", "cpu"], capsys)
    assert err == "error: CUDA out of memory. Tried to allocate 488.28 GiB."


def test_missing_model_files_are_one_clear_line(tiny_dir, tmp_path, monkeypatch):
    """No config.json, a config.json that cannot be read, no weights, no demo checkpoint: one line each."""
    with pytest.raises(ValueError, match=f"^no config.json at {tmp_path}/config.json$"):
        m.Config.from_json(str(tmp_path))
    (tmp_path / "config.json").mkdir()  # (a path that exists, but not a file that opens)
    with pytest.raises(ValueError, match=f"^{tmp_path}/config.json: cannot read \\(.*Is a directory"):
        hf.read_json(str(tmp_path / "config.json"))
    weightless = tmp_path / "weightless"
    weightless.mkdir()
    shutil.copy(os.path.join(tiny_dir, "config.json"), weightless)
    with pytest.raises(ValueError) as e:
        m.LLM(str(weightless), device="cpu")
    assert (
        str(e.value)
        == f"{weightless}: no model.safetensors.index.json or model.safetensors (safetensors only)"
    )
    monkeypatch.setattr(hf, "DEMO_DIR", str(tmp_path / "demo"))
    with pytest.raises(ValueError, match="^no --model given, and the demo checkpoint is missing from "):
        m.LLM(device="cpu")


@pytest.mark.parametrize("case", quick_sample(CONFIG_FAULTS, "not_json", "string_size", "softmax_router"))
def test_broken_config_is_one_clear_line(tmp_path, case, capsys):
    """config.json that is not JSON, or whose values are of the wrong type or impossible for the model: one
    line naming the file and the field (its config.json name too), from the API and the CLI."""
    edit, message = CONFIG_FAULTS[case]
    path = tmp_path / "config.json"
    if isinstance(edit, bytes):
        path.write_bytes(edit)
    else:
        hf = hf_config(m.Config.tiny())
        if edit in ("rope_inf", "rope_half"):
            hf["rope_scaling"]["factor"] = float("inf") if edit == "rope_inf" else 0.5
        elif edit == "rope_mscale_all_dim":
            hf["rope_scaling"]["mscale_all_dim"] = 0.707
        elif edit == "rope_no_mscale_all_dim":  # (HF then applies no mscale to the softmax scale)
            del hf["rope_scaling"]["mscale_all_dim"]
        elif edit == "rope_attention_factor":
            hf["rope_scaling"]["attention_factor"] = 1.2
        elif edit == "rope_type_linear":
            hf["rope_scaling"]["rope_type"] = "linear"
        else:
            hf.update(edit)
        path.write_text(json.dumps(hf))  # json writes nan / inf as NaN / Infinity, as it reads them
    with pytest.raises(ValueError) as e:
        m.Config.from_json(str(tmp_path))
    assert str(path) in str(e.value) and message in str(e.value) and "\n" not in str(e.value), str(e.value)
    assert _cli_error(["--model", str(tmp_path), "--prompt", "hi"], capsys) == f"error: {e.value}"


@full
def test_config_class_refuses_wrong_types():
    for kw, message in (
        (dict(dim=256.0), "dim (hidden_size) must be an integer"),
        (dict(n_layers=True), "got True"),
        (dict(mscale=float("inf")), "mscale (rope_scaling.mscale) must be a finite number"),
        (dict(beta_slow=0.0), "beta_slow (rope_scaling.beta_slow) must be > 0"),
    ):
        with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
            m.Config.tiny(**kw)
    assert m.Config.tiny(n_dense_layers=0, n_mtp_layers=0, mscale=-0.5).n_mtp_layers == 0  # these may be 0


GENERATE_FAULTS = {  # case: (generate arguments, the message)
    "temperature_nan": (dict(temperature=float("nan")), "temperature must be a finite number (got nan)"),
    "temperature_inf": (dict(temperature=float("inf")), "temperature must be a finite number (got inf)"),
    "temperature_str": (dict(temperature="0.5"), "temperature must be a finite number (got '0.5')"),
    "temperature_none": (dict(temperature=None), "temperature must be a finite number (got None)"),
    "temperature_negative": (dict(temperature=-0.1), "temperature must be >= 0 (got -0.1)"),
    "top_p_nan": (dict(top_p=float("nan")), "top_p must be a finite number (got nan)"),
    "top_p_inf": (dict(top_p=float("inf")), "top_p must be a finite number (got inf)"),
    "top_p_str": (dict(top_p="0.9"), "top_p must be a finite number (got '0.9')"),
    "top_p_zero": (dict(top_p=0.0), "top_p must be in (0, 1] (got 0.0)"),
    "max_new_tokens_float": (dict(max_new_tokens=2.0), "max_new_tokens must be an integer (got 2.0)"),
    "max_new_tokens_bool": (dict(max_new_tokens=True), "max_new_tokens must be an integer (got True)"),
    "max_new_tokens_str": (dict(max_new_tokens="8"), "max_new_tokens must be an integer (got '8')"),
    "max_new_tokens_none": (dict(max_new_tokens=None), "max_new_tokens must be an integer (got None)"),
    "max_new_tokens_negative": (dict(max_new_tokens=-3), "max_new_tokens must be > 0 (got -3)"),
    "max_new_tokens_list_length": (dict(max_new_tokens=[2, 3]), "max_new_tokens has 2 values for 1 prompts"),
    "max_new_tokens_list_zero": (dict(max_new_tokens=[0]), "max_new_tokens must be > 0 (got 0)"),
    "seed_float": (dict(seed=1.5), "seed must be an integer (got 1.5)"),
    "seed_zero_float": (dict(seed=0.0), "seed must be an integer (got 0.0)"),
    "seed_str": (dict(seed="42"), "seed must be an integer (got '42')"),
    "seed_list_none": (dict(prompts=["hi", "yo"], seed=[1, None]), "seed must be an integer (got None)"),
    "thinking_str": (dict(thinking="yes"), "thinking must be True or False (got 'yes')"),
    "raw_int": (dict(raw=1), "raw must be True or False (got 1)"),
    "return_logits_none": (dict(return_logits=None), "return_logits must be True or False (got None)"),
    "on_tokens": (dict(on_tokens=5), "on_tokens must be a function (got 5)"),
    "prompts_none": (dict(prompts=None), "prompts must be a string, a list of token ids, or a list of those"),
    "prompts_int": (dict(prompts=5), "(got 5)"),
    "prompt_str_id": (dict(prompts=[[1, "a"]]), "(got [[1, 'a']])"),
    "prompt_float_id": (dict(prompts=[[1.5, 2]]), "(got [[1.5, 2]])"),
    "prompt_bool_id": (dict(prompts=[[True, 2]]), "(got [[True, 2]])"),
    "prompt_none": (dict(prompts=["hi", None]), "(got ['hi', None])"),
    "prompt_nested": (dict(prompts=[[1, [2]]]), "(got [[1, [2]]])"),
    "prompt_tensor": (dict(prompts=torch.tensor([1, 2])), "(got tensor([1, 2]))"),
    "prompt_id_too_big": (dict(prompts=[[5, 288]]), "prompt 0 has token ids outside [0, 288)"),
    "prompt_surrogate": (  # (what Python makes of a byte that is not UTF-8 in a command line argument)
        dict(prompts=["hi", "ok\udcff"]),
        "prompt 1 is not valid Unicode text (a lone surrogate at character 2)",
    ),
}


@pytest.mark.parametrize(
    "case", quick_sample(GENERATE_FAULTS, "temperature_nan", "max_new_tokens_float", "prompt_id_too_big")
)
def test_bad_generate_arguments_are_refused(tiny_dir, case):
    kw, message = GENERATE_FAULTS[case]
    llm = make_llm(tiny_dir, 1)
    kw = {"prompts": "hi", "max_new_tokens": 2, **kw}
    with pytest.raises(ValueError) as e:
        llm.generate(**kw)
    assert message in str(e.value) and "\n" not in str(e.value), str(e.value)


LLM_FAULTS = {  # case: (LLM arguments, the message)
    "mtp_float": (dict(mtp=1.0), "mtp must be an integer (got 1.0)"),
    "mtp_bool": (dict(mtp=True), "mtp must be an integer (got True)"),
    "mtp_negative": (dict(mtp=-1), "mtp must be >= 0 (got -1)"),
    "page_size_zero": (dict(page_size=0), "page_size must be >= 1 (got 0)"),
    "page_size_float": (dict(page_size=16.0), "page_size must be an integer (got 16.0)"),
    "max_batch_bool": (dict(max_batch=True), "max_batch must be an integer (got True)"),
    "max_prefill_str": (dict(max_prefill_tokens="8"), "max_prefill_tokens must be an integer (got '8')"),
    "kv_float": (dict(kv_cache_bytes=1.5e9), "kv_cache_bytes must be an integer (got 1500000000.0)"),
    "kv_str": (dict(kv_cache_bytes="1G"), "kv_cache_bytes must be an integer (got '1G')"),
    "kv_too_small": (dict(kv_cache_bytes=1000), "kv_cache_bytes=1000: less than two pages of the KV pool"),
    "kv_too_big": (dict(kv_cache_bytes=10**18), "kv_cache_bytes=1000000000000000000: more than the"),
    "max_context_zero": (dict(max_context=0), "max_context must be >= 1 (got 0)"),
    "max_context_float": (dict(max_context=4096.0), "max_context must be an integer (got 4096.0)"),
    "device_meta": (dict(device="meta"), "device 'meta': nano-nsa runs on cpu or cuda"),
    "device_list": (dict(device=["cpu"]), "unknown device ['cpu']"),
    "model_dir_int": (dict(model_dir=5), "model directory 5 does not exist"),
    "model_dir_file": ("file", "does not exist (or is not a directory)"),
    "model_dir_empty": (dict(model_dir=""), "model directory '' does not exist"),
    "device_empty": (dict(device=""), "unknown device ''"),
    "cuda_graphs_str": (dict(cuda_graphs="no"), "cuda_graphs must be True or False (got 'no')"),
    "kernels_word": (dict(kernels="fast"), "kernels must be 'auto', 'torch' or 'gpu' (got 'fast')"),
    "kernels_gpu_on_cpu": (dict(kernels="gpu"), "kernels='gpu' needs a CUDA device (got cpu)"),
}


@pytest.mark.parametrize("case", quick_sample(LLM_FAULTS, "mtp_negative", "kv_too_small", "device_meta"))
def test_bad_llm_arguments_are_refused_before_loading(tiny_dir, tmp_path, case, monkeypatch):
    kw, message = LLM_FAULTS[case]
    if kw == "file":
        (tmp_path / "f").write_text("")
        kw = dict(model_dir=str(tmp_path / "f"))
    monkeypatch.setattr(hf, "load_target", lambda *a: pytest.fail("a weight read before the argument check"))
    with pytest.raises(ValueError) as e:
        m.LLM(**{"model_dir": tiny_dir, "device": "cpu", **kw})
    assert message in str(e.value) and "\n" not in str(e.value), str(e.value)


CLI_FAULTS = {  # case: (extra CLI arguments, the message)
    "temperature_nan": (["--temperature", "nan"], "temperature must be a finite number (got nan)"),
    "temperature_inf": (["--temperature", "inf"], "temperature must be a finite number (got inf)"),
    "top_p_nan": (["--top-p", "nan"], "top_p must be a finite number (got nan)"),
    "top_p_inf": (["--top-p", "inf"], "top_p must be a finite number (got inf)"),
    "max_context_zero": (["--max-context", "0"], "max_context must be >= 1 (got 0)"),
    "max_context_negative": (["--max-context", "-5"], "max_context must be >= 1 (got -5)"),
    "mtp_negative": (["--mtp", "-1"], "mtp must be >= 0 (got -1)"),
    "max_new_tokens_negative": (["--max-new-tokens", "-2"], "max_new_tokens must be > 0 (got -2)"),
    "max_new_tokens_float": (
        ["--max-new-tokens", "2.5"],
        "argument --max-new-tokens: invalid int value: '2.5'",
    ),
    "seed_float": (["--seed", "1.5"], "argument --seed: invalid int value: '1.5'"),
    "temperature_word": (["--temperature", "hot"], "argument --temperature: invalid float value: 'hot'"),
    "device_meta": (["--device", "meta"], "nano-nsa runs on cpu or cuda"),
    "prompt_file_missing": (["--prompt-file", "nope.txt"], "No such file or directory: 'nope.txt'"),
    "prompt_file_binary": (["--prompt-file", "bin"], "bin: not UTF-8 text (invalid start byte at byte 3)"),
    "prompt_not_utf8": (["--prompt", "x\udcff"], "prompt 1 is not valid Unicode text (a lone surrogate"),
    "model_empty": (["--model", ""], "model directory '' does not exist (or is not a directory)"),
    "model_is_file": (["--model", "bin"], "model directory 'bin' does not exist (or is not a directory)"),
}


@pytest.mark.parametrize("case", quick_sample(CLI_FAULTS, "temperature_nan", "prompt_file_binary"))
def test_cli_bad_options_are_one_clear_line(tiny_dir, tmp_path, case, capsys, monkeypatch):
    """Each refused before any weight is loaded."""
    extra, message = CLI_FAULTS[case]
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(
        m, "load_model", lambda *a, **k: pytest.fail("weights loaded before the option check")
    )
    (tmp_path / "bin").write_bytes(b"ok\n\xff\xfe\n")
    err = _cli_error(["--model", tiny_dir, "--prompt", "hi", "--max-new-tokens", "2"] + extra, capsys)
    assert message in err, err


@full
def test_tiny_top_p_keeps_the_most_likely_token(tiny_dir):
    """top_p far below fp32's range still keeps the nucleus's first token, so sampling is the argmax (it
    became 0 in fp32, masked every token, and drew token 0 forever)."""
    llm = make_llm(tiny_dir, 1)
    greedy = llm.generate(["hi", [7, 8, 9]], max_new_tokens=6)
    tiny = llm.generate(["hi", [7, 8, 9]], max_new_tokens=6, temperature=0.7, top_p=1e-300, seed=1)
    assert [r.token_ids for r in tiny] == [r.token_ids for r in greedy]


def test_probs_from_logits_matches_a_nucleus_written_from_its_definition():
    """probs_from_logits against the nucleus by its definition, token by token: softmax(logits / T) in fp64,
    the tokens by decreasing probability until they hold top_p (a token is in while the mass before it is
    below top_p), renormalized; one-hot on the argmax at T = 0. Fresh random logits and parameters, and rows
    of equal logits where a cumulative mass equals top_p exactly (V = 8: every mass is a multiple of 1/8), the
    edge where the nucleus must end."""
    g = torch.Generator().manual_seed(21)
    B, V = 12, 50
    logits = torch.randn(B, V, generator=g) * 3
    temperature = torch.rand(B, generator=g) * 1.5 + 0.1
    temperature[:2] = 0.0
    top_p = torch.rand(B, generator=g)
    top_p[2] = 1.0
    edge = torch.full((4, 8), float(torch.randn(1, generator=g)))  # p = 1/8 each, masses j/8 exact
    edge_p = torch.tensor([1 / 8, 3 / 8, 1 / 2, 7 / 8])

    def nucleus(row, t, top):
        if t == 0:
            return F.one_hot(row.argmax(), len(row)).double()
        p = torch.softmax(row.double() / float(t), -1)
        keep, mass = torch.zeros(len(row), dtype=torch.bool), 0.0
        for i in p.argsort(descending=True, stable=True).tolist():
            if mass >= float(top) and float(top) < 1:
                break
            keep[i], mass = True, mass + float(p[i])
        return torch.where(keep, p, 0.0) / p[keep].sum()

    for rows, ts, tops in ((logits, temperature, top_p), (edge, torch.rand(4, generator=g) + 0.5, edge_p)):
        got = m.probs_from_logits(rows, ts, tops)
        want = torch.stack([nucleus(*args) for args in zip(rows, ts, tops, strict=True)])
        assert torch.equal(got > 0, want > 0)
        assert (got - want).abs().max() < 1e-12
    assert [int((r > 0).sum()) for r in got] == [1, 3, 4, 7]


@full
def test_a_numpy_integer_seed_is_its_int(tiny_dir):
    np = pytest.importorskip("numpy")
    llm = make_llm(tiny_dir, 1)
    a, b = (llm.generate(["hi", "yo"], 6, temperature=1.0, seed=s) for s in (np.int64(5), 5))
    assert [r.token_ids for r in a] == [r.token_ids for r in b]


@full
def test_a_prompt_file_with_a_byte_order_mark(tmp_path):
    (tmp_path / "p.txt").write_bytes("\ufeffhello\n\nworld\n".encode())
    assert cli.read_prompts(cli.parse(["--prompt-file", str(tmp_path / "p.txt")])) == ["hello", "world"]


@full
def test_tiny_temperature_samples_like_the_reference_floor(tiny_dir):
    """logits / T overflows for a tiny T; as the reference, T is floored at 1e-5: no nan, the same draws."""
    llm = make_llm(tiny_dir, 1)
    a, b = (llm.generate(["hi", [7, 8, 9]], max_new_tokens=6, temperature=t, seed=3) for t in (1e-300, 1e-5))
    assert [r.token_ids for r in a] == [r.token_ids for r in b] and all(len(r.token_ids) for r in a)


@pytest.mark.parametrize("fault", ["truncated_shard", "corrupt_tokenizer"])
@full  # a process of its own
def test_damaged_model_process_exit_is_one_line(tiny_dir, tmp_path, fault):
    """As a user runs it: a separate process, exit code 1, one line on stderr, no traceback."""
    bad, weight_map = _damaged_copy(tiny_dir, tmp_path)
    file = os.path.join(
        bad, "tokenizer.json" if fault == "corrupt_tokenizer" else sorted(set(weight_map.values()))[0]
    )
    open(file, "wb").write(open(file, "rb").read()[:-50])
    r = _cli(["--model", bad, "--prompt", "hi"], tmp_path)
    assert r.returncode == 1 and r.stderr.count("\n") == 1 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.startswith(f"error: {file}: ") and (
        "truncated" in r.stderr or "not a valid tokenizer" in r.stderr
    )


# ------------------------------------------------------------------------------------------------------------
# GPU: FP8 activation quantization, block-scaled GEMM, grouped MoE (real shapes; skipped without CUDA)
# ------------------------------------------------------------------------------------------------------------
def _fp8_weight(*shape, gen):
    """Random FP8 weights with random power-of-two 128x128 block scales, built in chunks (11 GB for 256
    experts)."""
    w = torch.empty(*shape, dtype=m.FP8, device="cuda")
    for i in range(0, shape[0], 16):
        w[i : i + 16] = (
            (torch.randn(w[i : i + 16].shape, generator=gen, device="cuda") * 32).clamp(-448, 448).to(m.FP8)
        )
    s = (
        2.0
        ** torch.randint(
            -14, -11, (*shape[:-2], -(-shape[-2] // 128), shape[-1] // 128), generator=gen, device="cuda"
        ).float()
    )
    return w, s


@gpu
@pytest.mark.parametrize("M,K", [(1, 7168), (7, 1536), (512, 2048), (64, 16384)])
def test_gpu_act_quant_kernel_is_bit_exact(M, K):
    """Triton act_quant = the reference bit for bit (same pow2 scale rule, round-to-nearest-even e4m3), on
    values with outliers spanning many binades."""
    import kernels

    gen = torch.Generator("cuda").manual_seed(M + K)
    x = (
        torch.randn(M, K, generator=gen, device="cuda")
        * torch.randn(M, K, generator=gen, device="cuda").mul(3).exp()
    ).to(m.BF16)
    (q, s), (rq, rs) = kernels.act_quant(x), m.act_quant(x)
    assert torch.equal(s, rs) and torch.equal(q.view(torch.uint8), rq.view(torch.uint8))


@gpu
@pytest.mark.parametrize(
    "N,K",
    [
        (1536, 7168),
        (24576, 1536),
        (576, 7168),
        (7168, 16384),
        (18432, 7168),
        (7168, 18432),
        (128, 7168),
        (200, 2048),
    ],
)
@pytest.mark.parametrize("M", [1, 4, 16, 64, 512])
def test_gpu_fp8_linear_matches_reference(M, N, K):
    """The Triton block-scaled FP8 GEMM (with act-quant) vs the reference at the real projection shapes (q_a,
    q_b, kv_a, o, dense w1 / w2, indexer wk), and a weight whose last tile is partial, read by TMA (200 x
    2048). Bound 1e-2 relative (Frobenius): the output is rounded to bf16 (2^-9) and Hopper's FP8 tensor cores
    sum each 128-wide block with about 14 bits before its fp32 promotion."""
    import kernels

    gen = torch.Generator("cuda").manual_seed(M * 7 + N + K)
    w, s = _fp8_weight(N, K, gen=gen)
    x = torch.randn(M, K, generator=gen, device="cuda").to(m.BF16)
    got, want = kernels.fp8_linear(x, w, s).float(), m.fp8_linear(x, w, s).float()
    assert got.shape == (M, N) and ((got - want).norm() / want.norm()).item() < 1e-2


@gpu
@pytest.mark.parametrize(
    "N,K", [(129280, 7168), (64, 7168), (7168, 14336), (256, 7168), (8, 256), (100, 200)]
)
@pytest.mark.parametrize("M", [1, 4, 64, 300])
def test_gpu_dense_linear_matches_reference(M, N, K):
    """The Triton bf16 GEMM (fp32 out) vs the reference at the lm_head, weights_proj, eh_proj and router
    shapes (and a K that is no multiple of 128): bf16 products are exact in fp32, so only the sum order
    differs (bound 1e-5 relative)."""
    import kernels

    gen = torch.Generator("cuda").manual_seed(M + N + K)
    w = (torch.randn(N, K, generator=gen, device="cuda") * 0.02).to(m.BF16)
    x = torch.randn(M, K, generator=gen, device="cuda").to(m.BF16)
    got, want = kernels.dense_linear(x, w), m.dense_linear(x, w)
    assert got.dtype == torch.float32 and got.shape == (M, N)
    assert ((got - want).norm() / want.norm()).item() < 1e-5


@gpu
def test_gpu_gemm_rows_are_not_bounded_by_the_split_k_counters():
    """A GEMM without split-K uses no tile counters, so its tiles are not bounded by GEMM_LOCKS: the lm_head
    (2020 column tiles) over 2112 rows (a verify pass of 264 requests x 8 rows) is 33 x 2020 > 65536 tiles."""
    import fp8_gemm
    import kernels

    M, N, K = 2112, 129280, 7168
    assert fp8_gemm.gemm_config(N, K, fp8=False)["SPLIT_K"] == 1
    gen = torch.Generator("cuda").manual_seed(5)
    w = (torch.randn(N, K, generator=gen, device="cuda") * 0.02).to(m.BF16)
    x = torch.randn(M, K, generator=gen, device="cuda").to(m.BF16)
    got, want = kernels.dense_linear(x, w), m.dense_linear(x, w)
    assert ((got - want).norm() / want.norm()).item() < 1e-5


@gpu
@pytest.mark.parametrize(
    "H,K,N", [(128, 128, 512), (128, 512, 128), (16, 128, 512), (8, 64, 256), (4, 256, 32)]
)
@pytest.mark.parametrize("T", [1, 4, 65, 300])
def test_gpu_head_linear_matches_reference(T, H, K, N):
    """The grouped Triton GEMM with one weight per head vs the reference einsum at W_UK / W_UV shapes (full
    width, 8 ranks, the demo, the tiny model): bf16 out, fp32 sums (bound 1e-2 relative: the bf16
    rounding)."""
    import kernels

    gen = torch.Generator("cuda").manual_seed(T + H + K + N)
    x = torch.randn(T, H, K, generator=gen, device="cuda").to(m.BF16)
    w = (torch.randn(H, N, K, generator=gen, device="cuda") * 0.05).to(m.BF16)
    got, want = kernels.head_linear(x, w).float(), m.head_linear(x.float(), w.float())
    assert got.shape == (T, H, N) and ((got - want).norm() / want.norm()).item() < 1e-2


@gpu
@pytest.mark.parametrize("D", [7168, 1536, 512, 256])
@pytest.mark.parametrize("T", [1, 5, 300])
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("dtype", [m.BF16, torch.float32])
def test_gpu_rms_norm_matches_reference(T, D, with_residual, dtype):
    """The Triton RMSNorm (residual add fused) vs the reference at the model's norm widths, on a strided input
    as q_a gets from wqkv_a, in bf16 or as a block half's unrounded fp32 sum (rounded to bf16 first): the
    residual stream exactly, the output to bf16 rounding (fp32 sums in another order)."""
    import kernels

    gen = torch.Generator("cuda").manual_seed(T + D)
    x = torch.randn(T, D + 64, generator=gen, device="cuda").to(dtype)[:, :D]  # a strided view
    residual = torch.randn(T, D, generator=gen, device="cuda").to(m.BF16) if with_residual else None
    weight = torch.rand(D, generator=gen, device="cuda") + 0.5
    got, want = kernels.rms_norm(x, residual, weight, 1e-6), m.rms_norm(x, residual, weight, 1e-6)
    if with_residual:
        assert torch.equal(got[1], want[1])
        got, want = got[0], want[0]
    assert got.dtype == m.BF16 and ((got.float() - want.float()).abs() <= 2**-7 * want.float().abs()).all()
    # the output's act_quant, made in the norm's kernel and served from there: the reference's, bit for bit
    q, s = kernels.act_quant(got)
    assert q is kernels.act_quant(got)[0], "the norm's quantization was not reused"
    q_ref, s_ref = m.act_quant(got)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)) and torch.equal(s, s_ref)


@pytest.fixture(scope="module")
def experts_full():
    gen = torch.Generator("cuda").manual_seed(5)
    return _fp8_weight(256, 4096, 7168, gen=gen) + _fp8_weight(256, 7168, 2048, gen=gen)


def stacked_experts(w13, s13, w2, s2):
    """A stand-in for MoE.experts over the kernel's stacked weights: w1 | w3 are w13's halves."""
    inter = w13.shape[1] // 2

    def linear(w, s):
        return SimpleNamespace(weight=w, scale=s, operands=lambda: (w, s))

    w1 = linear(w13[:, :inter], s13[:, : inter // 128])
    return SimpleNamespace(w1=w1, w3=linear(w13[:, inter:], s13[:, inter // 128 :]), w2=linear(w2, s2))


def _moe_layout_reference(idx, E, block):
    """The grouped GEMMs' row layout, written out: experts 0 .. E (E: another rank's, as expert -1) in order,
    each one's (token, choice) pairs in pair order, padded with -1 rows to whole blocks; then -1 rows up to
    the launch's upper bound. -> (token per row, the row itself or -1 for padding, row of each pair, expert
    per block)."""
    T, A = idx.shape
    flat = idx.flatten().tolist()
    n_blocks = min(E + 1, T * A) + -(-T * A // block)
    token, pos, experts = [], [0] * (T * A), []
    for e in range(E + 1):
        pairs = [p for p, x in enumerate(flat) if x == e]
        for p in pairs:
            pos[p] = len(token)
            token.append(p // A)
        token += [-1] * (-len(pairs) % block)
        experts += [e if e < E else -1] * (-(-len(pairs) // block))
    token += [-1] * (n_blocks * block - len(token))
    experts += [-1] * (n_blocks - len(experts))
    live = [r if t >= 0 else -1 for r, t in enumerate(token)]
    return token, live, pos, experts


@gpu
@pytest.mark.parametrize(
    "T,A,E",
    [
        (1, 8, 256),
        (4, 8, 256),
        (16, 8, 256),
        (17, 8, 256),
        (300, 8, 256),
        (7, 2, 8),
        (2048, 8, 256),
        (5000, 8, 256),
    ],
)
def test_gpu_moe_layout_kernel_is_the_sorted_layout(T, A, E):
    """The layout of kernels.moe (counts, padded offsets, each pair's row, each block's expert) is exactly the
    written-out layout, with a third of the choices another rank's expert (idx E): one program (up to 128
    pairs) or blocks of 128 or more pairs counted, then placed."""
    import kernels

    gen = torch.Generator("cuda").manual_seed(T)
    idx = torch.rand(T, E, generator=gen, device="cuda").topk(A, -1).indices
    idx = torch.where(torch.rand(T, A, generator=gen, device="cuda") < 0.3, E, idx)
    want = _moe_layout_reference(idx, E, kernels.GEMM_BLOCK_M)
    got = kernels.moe_layout(idx, E)
    assert [t.tolist() for t in got] == list(want)


@gpu
@pytest.mark.parametrize("case", ["random", "one_expert_for_all", "other_ranks"])
@pytest.mark.parametrize("T", [1, 4, 16, 64, 512])
def test_gpu_moe_kernel_matches_reference(experts_full, T, case):
    """Grouped FP8 MoE vs the per-expert reference loop: 256 experts, top-8, dim 7168, moe_inter 2048; tokens
    that all pick the same expert, (at small T) most experts picked by no token, and choices of another rank's
    experts (idx 256: skipped). Bound 1e-2 relative: two bf16 roundings (h, expert output), FP8 tensor-core
    accumulation, and the rare h element whose act-quant rounding flips by one e4m3 step between the two
    summation orders."""
    import kernels

    gen = torch.Generator("cuda").manual_seed(T + len(case))
    idx = torch.rand(T, 256, generator=gen, device="cuda").topk(8, -1).indices
    if case == "one_expert_for_all":
        idx[:, 0] = 3
        idx[:, 1:] = torch.where(idx[:, 1:] == 3, 200, idx[:, 1:])
    if case == "other_ranks":
        idx = torch.where(torch.rand(T, 8, generator=gen, device="cuda") < 0.3, 256, idx)
    weights = torch.rand(T, 8, generator=gen, device="cuda") + 0.1
    x = torch.randn(T, 7168, generator=gen, device="cuda").to(m.BF16)
    got = kernels.moe_grouped(x, weights, idx, *experts_full)
    want = m.moe(x, weights, idx, stacked_experts(*experts_full))
    err = ((got - want).norm() / want.norm()).item()
    print(f"MoE T={T} {case}: {idx.unique().numel()} experts used, rel err {err:.2e}")
    assert err < 1e-2


# ------------------------------------------------------------------------------------------------------------
# tensor and expert parallelism: torchrun with gloo on CPU, TP=2 against TP=1
# ------------------------------------------------------------------------------------------------------------
# Config.tiny whose splits are whole 128-blocks at 2 and 4 ranks
TP_CONFIG = dict(n_heads=16, n_shared_experts=4)


@pytest.fixture(scope="session")
def calm_tp_dir(tmp_path_factory):
    src = str(tmp_path_factory.mktemp("tp_src"))
    save_random_checkpoint(src, m.Config.tiny(**TP_CONFIG), seed=1, shard_bytes=1 << 20)
    return _damped_copy(src, str(tmp_path_factory.mktemp("tp_calm")))


@contextlib.contextmanager
def count_reads():
    """Within the block, safetensors.safe_open is wrapped so that every tensor slice the loader reads adds its
    bytes to the yielded counter [n] (headers and shapes cost nothing)."""
    import safetensors

    real = safetensors.safe_open
    counter = [0]

    class Slice:
        def __init__(self, part):
            self.part = part

        def get_shape(self):
            return self.part.get_shape()

        def get_dtype(self):
            return self.part.get_dtype()

        def __getitem__(self, index):
            t = self.part[index]
            counter[0] += t.numel() * t.element_size()
            return t

    class File:
        def __init__(self, *args, **kwargs):
            self.file = real(*args, **kwargs)

        def __enter__(self):
            self.file.__enter__()
            return self

        def __exit__(self, *exc):
            return self.file.__exit__(*exc)

        def keys(self):
            return self.file.keys()

        def get_slice(self, name):
            return Slice(self.file.get_slice(name))

    safetensors.safe_open = File
    try:
        yield counter
    finally:
        safetensors.safe_open = real


def _tp_run(model_dir, out, device="cpu", kernels="torch"):
    """What each rank does (the whole run at TP=1): greedy tokens for the prompts in out/prompts.json with MTP
    off and with 2 drafts, recording every indexer selection, every draft token and the bytes the loader read;
    saved to out/rank{r}.pt."""
    with count_reads() as bytes_read:  # GPUs: room for ranks in kv_cache_bytes
        llm = m.LLM(model_dir, device=device, mtp=2, kernels=kernels, kv_cache_bytes=64 << 20)
    # MTP off runs eagerly: its indexer selections are recorded in every step (a CUDA graph's replays are not
    # seen from Python); with 2 drafts the rounds run through CUDA graphs on a GPU (captured under NCCL at
    # TP > 1)
    llms = {
        0: m.LLM(
            model_dir, device=device, mtp=0, model=llm.model, kv_cache_bytes=64 << 20, cuda_graphs=False
        ),
        2: llm,
    }
    llm.cfg.eos_token_id = -1  # every request runs all its tokens
    with open(os.path.join(out, "prompts.json")) as f:
        prompts = json.load(f)
    ops = llm.model.ops
    selections = []
    drafts = []
    draft = m.draft
    index_topk = ops.index_topk
    capturing = torch.cuda.is_current_stream_capturing if device == "cuda" else (lambda: False)

    def record(sel):
        if not capturing():  # a graph's capture: a static buffer, rewritten by replays
            selections.append(sel.clone())
        return sel

    def record_drafts(*a):
        out = draft(*a)
        if not capturing():
            drafts.append(out[0].clone())
        return out

    ops.index_topk = lambda *a: record(index_topk(*a))
    m.draft = record_drafts
    try:
        runs = {k: e.generate(prompts, max_new_tokens=8, return_logits=True) for k, e in llms.items()}
    finally:
        ops.index_topk = index_topk
        m.draft = draft
    torch.save(
        dict(
            tokens={k: [r.token_ids for r in rs] for k, rs in runs.items()},
            selections=selections,
            drafts=[t.tolist() for t in drafts],
            accept=[r.accept_lengths for r in runs[2]],
            logits=[r.logits for r in runs[0]],
            bytes=bytes_read[0],
        ),
        os.path.join(out, f"rank{m.tp_rank()}.pt"),
    )


def _tp_share(cfg, name, nbytes, rank, ranks):
    """Bytes of checkpoint tensor `name` that rank `rank` must read, from the official reference's TP layout
    (spec 2.4): routed experts whole, by index range; MLA q_b / kv_b / o_proj, dense MLP and shared expert,
    embeddings and heads one equal slice per rank (their block scales alike); everything else (the indexer
    too) whole."""
    expert = re.search(r"\.experts\.(\d+)\.", name)
    if expert:
        return nbytes if int(expert[1]) // (cfg.n_routed_experts // ranks) == rank else 0
    split = re.search(
        r"self_attn\.(q_b_proj|kv_b_proj|o_proj)\.|mlp\.(shared_experts\.)?(gate|up|down)_proj\.|"
        r"embed_tokens|lm_head|shared_head\.head",
        name,
    )
    return nbytes // ranks if split else nbytes


def _tp_torchrun(model_dir, tmp_path, n, device, kernels):
    """`torchrun --nproc-per-node n` of `test_nano.py tp-run`, its records written to tmp_path / "tp"."""
    import subprocess

    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(
        os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([here, os.environ.get("PYTHONPATH", "")])
    )
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            str(n),
            os.path.join(here, "test_nano.py"),
            "tp-run",
            model_dir,
            str(tmp_path / "tp"),
            device,
            kernels,
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        cwd=str(tmp_path),
    )
    assert r.returncode == 0, r.stderr[-3000:]


def _check_ranks_agree(ranks):
    """Every rank the same tokens, drafts, accept lengths, logits and indexer selections."""
    for x in ranks[1:]:
        for key in ("tokens", "drafts", "accept"):
            assert x[key] == ranks[0][key], key
        assert all(torch.equal(a, b) for a, b in zip(x["logits"], ranks[0]["logits"], strict=True))
        assert len(x["selections"]) == len(ranks[0]["selections"]) > 20
        assert all(torch.equal(a, b) for a, b in zip(x["selections"], ranks[0]["selections"], strict=True)), (
            "indexer selections"
        )


def _check_bytes_read(model_dir, one, ranks, n):
    """TP=1 read the whole checkpoint, and each rank exactly its share of it."""
    from safetensors.torch import load_file

    cfg = m.Config.from_json(model_dir)
    sizes = {
        k: t.numel() * t.element_size()
        for f in os.listdir(model_dir)
        if f.endswith(".safetensors")
        for k, t in load_file(os.path.join(model_dir, f)).items()
    }
    assert one["bytes"] == sum(sizes.values())
    for rank, got in enumerate(ranks):
        assert got["bytes"] == sum(_tp_share(cfg, k, b, rank, n) for k, b in sizes.items()), f"rank {rank}"


def _tp_runs(model_dir, tmp_path, n, device, kernels):
    """TP=1 in this process, then `torchrun --nproc-per-node n` of the same; -> (TP=1's record, the ranks'
    records), after checking what must hold on any device: every rank the same tokens, drafts, logits and
    indexer selections (in every layer and step), and each rank's bytes read = its share of the checkpoint
    (computed here)."""
    g = torch.Generator().manual_seed(5)  # contexts > index_topk 32: real top-k selections
    prompts = [torch.randint(6, 262, (k,), generator=g).tolist() for k in (70, 41, 55, 36)]
    os.makedirs(tmp_path / "tp")
    for d in (tmp_path, tmp_path / "tp"):
        (d / "prompts.json").write_text(json.dumps(prompts))
    _tp_run(model_dir, str(tmp_path), device, kernels)
    _tp_torchrun(model_dir, tmp_path, n, device, kernels)
    one, *ranks = (
        torch.load(d / f"rank{i}.pt", map_location="cpu")
        for d, i in [(tmp_path, 0)] + [(tmp_path / "tp", i) for i in range(n)]
    )
    _check_ranks_agree(ranks)
    assert max(s.shape[1] for s in one["selections"]) == 32  # top-k of longer contexts ran
    _check_bytes_read(model_dir, one, ranks, n)
    return one, ranks


@full
def test_tensor_parallel_sizes_that_would_cut_fp8_blocks_are_refused():
    """The 671B shapes split into whole 128-blocks at 1 to 16 ranks, not at 32 (18432 / 32 = 576 dense MLP
    rows) or 3 (heads); Config.tiny's q_b_proj (4 heads x 96 = 384 rows) cannot split in two."""
    for n in (1, 2, 4, 8, 16):
        hf.check_tp(m.Config.full(), n)
    for cfg, n, why in [
        (m.Config.full(), 32, "inter_dim = 18432 must be a multiple of 4096"),
        (m.Config.full(), 3, "n_heads = 128 must be a multiple of 3"),
        (m.Config.tiny(), 2, "q_b_proj rows (n_heads * qk_head_dim) = 384 must be a multiple of 256"),
    ]:
        with pytest.raises(ValueError, match=re.escape(f"tensor parallel size {n}: {why}")):
            hf.check_tp(cfg, n)
    hf.check_tp(m.Config.tiny(**TP_CONFIG), 4)


@full  # torchrun: two processes of their own
def test_tensor_parallel_two_ranks_equal_one(calm_tp_dir, tmp_path):
    """torchrun --nproc-per-node 2 (gloo on CPU) gives TP=1's greedy tokens with MTP off and on, and the same
    draft tokens (the MTP layer is sharded right too); both ranks' indexers select the same positions in every
    layer and step; each rank read exactly its share of the checkpoint's bytes (its experts, its slices of the
    split tensors, the replicated ones whole)."""
    dist = pytest.importorskip("torch.distributed")
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    one, ranks = _tp_runs(calm_tp_dir, tmp_path, 2, "cpu", "torch")
    # the parts are summed before the one rounding per block half, so TP=2 computes TP=1's numbers (CPU: fp64
    # sums, equal to ~1e-16 before that rounding): every logit bit for bit
    assert_tp_run_equals_one(one, ranks[0], "TP=2 vs TP=1")
    assert all(torch.equal(a, b) for a, b in zip(ranks[0]["logits"], one["logits"], strict=True))


@full  # torchrun: two processes of their own
def test_tensor_parallel_cli_prints_once(calm_tp_dir, tmp_path):
    """`torchrun --nproc-per-node 2 nano_nsa.py` (gloo on CPU) prints what one process prints: a streamed
    prompt's text once, one stats line, one --json document (rank 0 only). end_distributed once ran before
    the rank 0 test: with the group destroyed every rank was rank 0, and printed the results."""
    dist = pytest.importorskip("torch.distributed")
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    base = ["--model", calm_tp_dir, "--device", "cpu", "--kernels", "torch", "--max-new-tokens", "6"]
    runs = (["--prompt", "hi", "--mtp", "0"], ["--prompt", "hi", "--prompt", "yo", "--mtp", "2", "--json"])
    for args in runs:
        one, two = (
            _cli(base + args, launch=launch, cwd=str(tmp_path))
            for launch in ((), ("-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"))
        )
        assert one.returncode == two.returncode == 0, two.stderr[-3000:]
        if "--json" in args:  # one document (json.loads refuses two), the same results and counts
            docs = [json.loads(r.stdout) for r in (one, two)]
            for d in docs:
                del d["stats"]["seconds"], d["stats"]["tokens_per_s"]
            assert docs[1] == docs[0] and len(docs[0]["results"]) == 2
        else:
            assert two.stdout == one.stdout
            assert len(re.findall(r"^\[6 tokens in ", two.stderr, re.M)) == 1, two.stderr


@gpu
@pytest.mark.parametrize("n", [2, 4])
def test_gpu_tensor_parallel_equals_one(calm_tp_dir, tmp_path, n):
    """On n GPUs (NCCL, kernels.py): every rank the same tokens, drafts and indexer selections, each its share
    of the bytes; and TP=1's run on one GPU (assert_tp_run_equals_one): greedy tokens with MTP off and on,
    every draft and accept length, and the first token's logits bit for bit (each half's parts summed in fp32
    before its one rounding, as at one rank)."""
    if torch.cuda.device_count() < n:
        pytest.skip(f"needs {n} GPUs")
    one, ranks = _tp_runs(calm_tp_dir, tmp_path, n, "cuda", "gpu")
    assert_tp_run_equals_one(one, ranks[0], f"TP={n} vs TP=1")
    diff = max((a - b).abs().max().item() for a, b in zip(ranks[0]["logits"], one["logits"], strict=True))
    tokens = sum(map(len, one["tokens"][0])) + sum(map(len, one["tokens"][2]))
    print(f"TP={n} vs TP=1 on GPU: {tokens} of {tokens} tokens equal, largest logit difference {diff:.2e}")


# torchrun test_nano.py tp-run DIR OUT DEVICE KERNELS
if __name__ == "__main__" and sys.argv[1:2] == ["tp-run"]:
    import faulthandler  # a hung rank: its Python stack, not a silent timeout

    faulthandler.dump_traceback_later(float(os.environ.get("NANO_TP_HANG_S", 240)), exit=True)
    _tp_run(*sys.argv[2:6])
    cli.end_distributed(graphed=sys.argv[4] == "cuda")


# ------------------------------------------------------------------------------------------------------------
# the demo model (demo/, trained by tools/train_demo.py): an FP8 checkpoint that really predicts Python
# ------------------------------------------------------------------------------------------------------------
DEMO_EVAL = os.path.join(hf.DEMO_DIR, "eval.json")
needs_demo = pytest.mark.skipif(not os.path.isfile(DEMO_EVAL), reason="demo/ checkpoint not present")


@needs_demo
@full
def test_cpu_tokens_do_not_depend_on_where_max_prefill_tokens_cuts_a_prompt():
    """On the CPU the dense per-head form (a prompt chunk whose context fits in top-k) and the absorbed sparse
    form (a longer one) are one function in fp64, so where max_prefill_tokens cuts a prompt, which decides the
    form of each chunk, does not change its logits. sparse_mla once rounded its result to fp32 and the dense
    form did not: this held-out prompt's first logits then differed by 0.46 (a value of layer 2 rounded to
    another bf16 number before wo, and the router amplified it)."""
    with open(DEMO_EVAL) as f:
        prompt = json.load(f)["heldout_chunks"][4][122:363]  # 241 tokens (the demo's index_topk: 128)
    kw = dict(max_new_tokens=1, return_logits=True)
    logits = [
        m.LLM(device="cpu", mtp=0, max_prefill_tokens=n).generate([prompt], **kw)[0].logits for n in (512, 64)
    ]
    assert torch.equal(*logits)


def _train_demo():
    import importlib.util

    here = os.path.dirname(os.path.abspath(__file__))
    spec = importlib.util.spec_from_file_location("train_demo", os.path.join(here, "tools", "train_demo.py"))
    td = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(td)
    return td


QUICK_START_PROMPT = "def fibonacci(n):\n    if n < 2:"  # the README's


@needs_demo
@full  # a process of its own
def test_cli_default_model_is_the_demo_and_writes_python():
    """The README's quick start, `python nano_nsa.py --prompt $'def fibonacci(n):\n    if n < 2:' --raw`: the
    default checkpoint is demo/, and it continues code: indented lines and Python keywords (a random model
    prints byte noise)."""
    r = _cli(["--prompt", QUICK_START_PROMPT, "--raw", "--max-new-tokens", "48", "--mtp", "3"])
    assert r.returncode == 0, r.stderr
    text = r.stdout
    indented = [ln for ln in text.splitlines() if re.match(r"^( {4})+\S", ln)]
    keywords = set(re.findall(r"\b(def|return|if|else|for|in|self|import|None|not|and|or|class)\b", text))
    print(repr(text), r.stderr.strip().splitlines()[-1])
    assert len(indented) >= 2 and len(keywords) >= 2, text
    mean = float(re.search(r"mean accepted length ([0-9.]+)", r.stderr)[1])
    assert mean > 1.0  # some drafts accepted (random MTP layers: 1.00)


@needs_demo
@full  # slow: the demo model
def test_demo_fp8_held_out_loss_within_2pct_of_bf16():
    """The exported FP8 model's held-out loss, from the engine's own prefill logits (load_model, FP8 GEMMs,
    FP8 latent cache, sparse top-k), against the bf16 model's loss on the same chunks, measured by the
    training script before export (the bf16 weights are not shipped). The first 4 of the 32 stored chunks (512
    tokens each)."""
    td = _train_demo()
    with open(DEMO_EVAL) as f:
        ev = json.load(f)
    fp8 = td.engine_loss(hf.DEMO_DIR, ev["heldout_chunks"][:4], torch.device("cpu"))
    bf16 = ev["bf16_loss"][:4]
    print(f"held-out loss: FP8 engine {sum(fp8) / 4:.4f}, bf16 {sum(bf16) / 4:.4f}")
    assert sum(fp8) <= 1.02 * sum(bf16)
    assert sum(fp8) / 4 < 4.0  # a trained model (uniform over 2048 ids: 7.6)


@needs_demo
@full  # slow: the demo model, 70 s
def test_demo_mtp_acceptance_and_speculative_equals_plain():
    """Greedy --mtp 3 on the held-out code prompts stored with the demo: mean accepted length (drafts + bonus
    per round) at least 2.0, and the tokens equal plain greedy decoding (--mtp 0) token for token."""
    with open(DEMO_EVAL) as f:
        prompts = json.load(f)["prompts"]
    spec = m.LLM(mtp=3, device="cpu")
    got = spec.generate(prompts, max_new_tokens=48, raw=True)
    plain = m.LLM(mtp=0, device="cpu").generate(prompts, max_new_tokens=48, raw=True)
    print(
        f"mean accepted length {spec.stats['mean_accept_length']:.2f}, "
        f"histogram {spec.stats['accept_histogram']}"
    )
    assert [r.token_ids for r in got] == [r.token_ids for r in plain]
    assert spec.stats["mean_accept_length"] >= 2.0


@full
def test_demo_training_copy_computes_what_the_engine_computes(tmp_path):
    """tools/train_demo.py keeps differentiable copies of the layers; exported through the FP8 writer and
    loaded by the engine, a random model of the demo's shapes gives the same next-token and MTP distributions
    as the copy (with its FP8 fake quantization on), up to rounding: the engine rounds to bf16 where the copy
    keeps fp32, which moves FP8 activation roundings and, rarely, a routing choice. A wrong name,
    transposition or convention (rope, softmax scale, MTP concat order) would give differences of the order of
    the logits themselves."""
    td = _train_demo()
    torch.manual_seed(0)
    cfg = m.Config(**{**td.DEMO, "n_layers": 2, "n_dense_layers": 1})
    model = td.Model(cfg).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            if isinstance(layer.mlp, td.MoE):
                layer.mlp.gate.e_score_correction_bias.normal_(0, 0.05)
    td.export(model, None, str(tmp_path))
    eng = m.load_model(str(tmp_path))
    S = 300  # > index_topk: the indexer selects
    toks = torch.randint(6, cfg.vocab_size, (S + 1,))
    x, nxt = toks[:-1], toks[1:]
    cache = m.KVCache(cfg, S + 1)
    meta = build_meta("prefill", [0], [S], torch.arange(S)[None])
    h = eng(x, meta, cache)
    want = [eng.logits(h), eng.mtp[0].logits(eng.mtp_forward(nxt, h, meta, cache))]
    td.QAT["on"] = True
    try:
        with torch.no_grad():
            logits, mtp_logits, _ = model(x[None], nxt[None], True, 1)
    finally:
        td.QAT["on"] = False
    for what, a, b in zip(("main", "mtp"), want, [logits[0], mtp_logits[0][0]], strict=True):
        diff = (a.log_softmax(-1) - b.float().log_softmax(-1)).abs().mean().item()
        agree = (a.argmax(-1) == b.argmax(-1)).float().mean().item()
        spread = (a.log_softmax(-1) - a.log_softmax(-1)[torch.randperm(S)]).abs().mean().item()
        print(
            f"{what}: mean |log p| difference {diff:.4f} (between positions: {spread:.3f}), "
            f"top-1 agreement {agree:.3f}"
        )
        assert diff < 0.1 * spread and agree >= 0.75


@full  # slow: training, 2-3 minutes
def test_train_demo_smoke_runs_every_stage(tmp_path):
    """tools/train_demo.py --smoke: corpus, tokenizer, a few training steps through the dense, sparse and FP8
    phases, export, and the engine's measurements; the checkpoint passes the loader's checks and its tokenizer
    the engine's."""
    import subprocess

    here = os.path.dirname(os.path.abspath(__file__))
    script = os.path.join(here, "tools", "train_demo.py")
    r = subprocess.run(
        [sys.executable, script, "--out", str(tmp_path), "--smoke"],
        capture_output=True,
        text=True,
        timeout=600,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert "sparse True, fp8 True" in r.stdout  # the last phase ran
    cfg = hf.open_checkpoint(str(tmp_path), m.Config)
    hf.load_tokenizer(str(tmp_path), cfg, *TOKENS)
    with open(tmp_path / "eval.json") as f:
        ev = json.load(f)
    assert (
        len(ev["heldout_chunks"]) == len(ev["bf16_loss"]) == len(ev["fp8_engine_loss"]) == 2 and ev["prompts"]
    )
    assert abs(sum(ev["fp8_engine_loss"]) / sum(ev["bf16_loss"]) - 1) < 0.02


# ------------------------------------------------------------------------------------------------------------
# the Blackwell sparse MLA call against flashinfer's argument contract, on a CPU (no Blackwell GPU has run it)
# ------------------------------------------------------------------------------------------------------------
def _flashinfer_refuses(bad, message):
    """flashinfer raises a ValueError in Python and a TVM FFI error in its launcher: a ValueError for both."""
    if bad:
        raise ValueError(message)


def _sparse_attention_from_arguments(q, rows, table, lens, C, bmm1_scale, bmm2_scale):
    """What the sparse kernel computes, in fp64, bf16 out: out[b, t, h] = bmm2_scale * softmax_i(bmm1_scale *
    q[b, t, h] . rows[i]) @ rows[i, :C] over i, the first lens[b] indices of table[b, t] (rows: the cache as
    flat [-1, C + R] rows). None of them may be -1: what the kernel does with one is not documented."""
    B, q_len, H, _ = q.shape
    out = torch.empty(B, q_len, H, C, dtype=torch.bfloat16)
    for b in range(B):
        for t in range(q_len):
            idx = table[b, t, : int(lens[b])].long()
            outside = (idx < 0) | (idx >= len(rows))
            _flashinfer_refuses(bool(outside.any()), "an index past the cache, or -1")
            keys = rows[idx].double()
            p = (q[b, t].double() @ keys.T * bmm1_scale).softmax(-1)
            out[b, t] = (p @ keys[:, :C] * bmm2_scale).to(torch.bfloat16)
    return out


def trtllm_gen_sparse_mla_stand_in(flashinfer_function):
    """A stand-in for flashinfer 0.7.2.post1's trtllm_batch_decode_with_kv_cache_mla(backend="trtllm-gen",
    sparse_mla_top_k > 0): the call must bind to the real function's signature; the stand-in refuses what
    flashinfer's Python layer and kernel launcher refuse (each check names the wheel's file and function),
    then computes the sparse attention from the arguments alone (_sparse_attention_from_arguments)."""
    import inspect

    signature = inspect.signature(flashinfer_function)

    def stand_in(**kw):
        signature.bind(**kw)
        q, kv, table, lens = kw["query"], kw["kv_cache"], kw["block_tables"], kw["seq_lens"]
        top_k, C, R = kw["sparse_mla_top_k"], kw["kv_lora_rank"], kw["qk_rope_head_dim"]
        _flashinfer_refuses(kw.get("backend") != "trtllm-gen" or top_k <= 0, "not trtllm-gen's sparse MLA")
        # flashinfer/mla/_core.py, _trtllm_batch_decode_with_kv_cache_mla_impl
        _flashinfer_refuses(lens is None, "seq_lens is required for trtllm-gen and cute-dsl MLA backends")
        block = kv.size(-2)
        _flashinfer_refuses(block not in (32, 64), f"trtllm-gen requires block_size in (32, 64), got {block}")
        # _core.py, _check_trtllm_gen_mla_shape (the 4-dim query; a 3-dim cache is unsqueezed to 4 dims)
        _flashinfer_refuses(q.ndim != 4 or kv.ndim not in (3, 4), "Expected query.ndim == 4, kv_cache 3 or 4")
        B, q_len, H, D = q.shape
        # (it also takes 256 + 64 and 512 + 0 latents; its sparse tests run DeepSeek's 512 + 64 alone)
        _flashinfer_refuses((C, R) != (512, 64), f"Unsupported MLA dimensions, got {C} and {R}")
        _flashinfer_refuses(D != C + R or kv.size(-1) != C + R, f"Expected head dim {C + R} for query and kv")
        shape = (B, q_len, top_k)
        _flashinfer_refuses(table.shape != shape, f"Expected page_table.shape == {shape}, got {table.shape}")
        # the heads: _core.py refuses 64 < H < 128 for trtllm-gen; tests/attention/test_trtllm_gen_mla.py
        # (supported_mla_layer_dimensions, test_trtllm_batch_decode_mla_sparse) run 128, 64 and 32
        _flashinfer_refuses(H not in (32, 64, 128), f"no tested trtllm-gen MLA kernel for {H} heads")
        # flashinfer/data/csrc/trtllm_fmha_kernel_launcher.cu, trtllm_paged_attention_decode: the kernel is
        # chosen by the query's and the cache's dtypes (a bf16 query: a bf16 cache), the tables read as int*
        _flashinfer_refuses(q.dtype != torch.bfloat16 or kv.dtype != q.dtype, "a bf16 query and cache")
        _flashinfer_refuses(torch.int32 != table.dtype or torch.int32 != lens.dtype, "int32 tables")
        _flashinfer_refuses(lens.shape != (B,), f"seq_lens: one per request, got {lens.shape}")
        # flashinfer/data/include/flashinfer/trtllm/fmha/kernelParams.h, KernelParams::setKernelParams: the
        # indices load 16 bytes at a time, and sparse MLA reads K as flat rows of D (a contiguous cache)
        _flashinfer_refuses(top_k % 4 != 0, "SparseMlaTopK must be a multiple of 4")
        _flashinfer_refuses(not kv.is_contiguous(), "sparse MLA reads the cache as flat rows")
        # .../fmha/fmhaKernels.cuh, selectSparseMlaGenerationKernel: a row's KV is min(max_seq_len, top-k)
        _flashinfer_refuses(bool((lens > min(top_k, kw["max_seq_len"])).any()), "seq_lens past top-k")
        devices = {x.device for x in (q, kv, table, lens, kw["workspace_buffer"])}
        _flashinfer_refuses(len(devices) != 1, f"tensors on {devices}")
        scales = kw["bmm1_scale"], kw.get("bmm2_scale", 1.0)
        return _sparse_attention_from_arguments(q, kv.reshape(-1, C + R), table, lens, C, *scales)

    return stand_in


def _blackwell_rows(table_width, starts, n, seed):
    """Decode rows at DeepSeek-V3.2's shapes on a CPU (128 heads, a 512 + 64 latent): the FP8 cache written by
    store_latent; request b's n rows at positions starts[b] ..; a table `table_width` wide; each row's
    selection as the indexer gives it: min(K, W) wide, valid positions first (all of a short context, distinct
    random ones of a long one), -1 after -> (q_abs, q_pe, cache, selected, meta, scale)."""
    cfg = m.Config.full(n_layers=1)
    gen = torch.Generator().manual_seed(seed)
    B, C, R, H = len(starts), cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.n_heads
    S = B * table_width + 1  # (slot 0: the dummy slot)
    cache = m.KVCache(cfg, S, mtp_layers=False).layer(0)
    cos, sin = cos_sin(cfg, torch.randint(0, 4096, (S,), generator=gen))
    kv, k_pe = (torch.randn(S, d, generator=gen).to(m.BF16) for d in (C, R))
    m.store_latent(kv, k_pe, torch.rand(C, generator=gen) + 0.5, cfg.eps, cos, sin, cache, torch.arange(S))
    table = 1 + torch.randperm(S - 1, generator=gen).view(B, table_width)
    meta = m.Meta.decode(m.TORCH_OPS, torch.tensor(starts), n, table)
    W, ctx = min(cfg.index_topk, table_width), meta.ctx_lens[:, None]
    later = torch.arange(table_width) >= ctx  # past a row's causal length: sorted last
    order = torch.rand(len(ctx), table_width, generator=gen).masked_fill(later, 2).argsort(-1)[:, :W]
    selected = torch.where(torch.arange(W) < ctx, order, -1)
    q_abs = torch.randn(len(ctx), H, C, generator=gen) * 0.5
    q_pe = (torch.randn(len(ctx), H, R, generator=gen) * 0.5).to(m.BF16)
    return q_abs, q_pe, cache, selected, meta, cfg.softmax_scale


BLACKWELL_WIDTHS = {  # table width, the requests' first positions, rows per request (a verify's k + 1)
    "eager": (37, [4, 17, 35], 2),  # an eager round's width, the table's: 37, not a multiple of 4
    "graph": (2600, [0, 90, 2300], 2),  # a CUDA graph's: K = 2048; contexts of 1 .. 92 and past 2048
}


def _run_blackwell(width, monkeypatch):
    """kernels._sparse_mla_blackwell on BLACKWELL_WIDTHS[width], flashinfer's function replaced by the
    stand-in -> (its output, nano_nsa.sparse_mla's on the same rows, the arguments it passed flashinfer)."""
    mla = pytest.importorskip("flashinfer.mla", reason="flashinfer (requirements.txt; CI installs it)")
    import kernels

    calls = []
    stand_in = trtllm_gen_sparse_mla_stand_in(mla.trtllm_batch_decode_with_kv_cache_mla)

    def recorded(**kw):
        calls.append(kw)
        return stand_in(**kw)

    monkeypatch.setattr(mla, "trtllm_batch_decode_with_kv_cache_mla", recorded)
    # (trtllm-gen's 256 MiB workspace, which the stand-in does not read, is made on the first call)
    monkeypatch.setitem(kernels._BLACKWELL, "workspace", torch.zeros(1024, dtype=torch.uint8))
    q_abs, q_pe, cache, selected, meta, scale = _blackwell_rows(*BLACKWELL_WIDTHS[width], seed=len(width))
    got = kernels._sparse_mla_blackwell(q_abs, q_pe, cache, selected, meta, scale)
    want = m.sparse_mla(q_abs.to(m.BF16).float(), q_pe, cache, selected, meta, scale)  # fp64 on a CPU
    return got, want, calls[0]


@full  # (flashinfer's first import alone takes 4 s: the quick run leaves the Blackwell contract to CI)
@pytest.mark.parametrize("width", list(BLACKWELL_WIDTHS))
def test_blackwell_sparse_mla_meets_flashinfer_contract(width, monkeypatch):
    """The Blackwell path (kernels._sparse_mla_blackwell), run on a CPU through a stand-in for flashinfer
    0.7.2.post1's trtllm_batch_decode_with_kv_cache_mla (trtllm_gen_sparse_mla_stand_in: the checks its Python
    layer and launcher make, then the attention from the arguments), gives nano_nsa.sparse_mla's result, the
    Triton kernel's reference, rounded to bf16, bit for bit: real shapes (128 heads, 512 + 64, the FP8 cache),
    -1 padded selections, lengths below top-k, an eager width (37) and a CUDA graph's (2048)."""
    got, want, passed = _run_blackwell(width, monkeypatch)
    assert passed["kv_cache"].size(-2) == 64 and passed["sparse_mla_top_k"] % 64 == 0
    assert got.dtype == m.BF16 and torch.equal(got, want.to(m.BF16))  # (both sum in fp64 here)


@full  # (flashinfer's first import alone takes 4 s: the quick run leaves the Blackwell contract to CI)
def test_flashinfer_stand_in_refuses_pages_of_one_slot_and_a_top_k_not_a_multiple_of_4(monkeypatch):
    """The contract can fail: the stand-in refuses the call with the gathered rows as pages of one slot (the
    call before 64-token pages: flashinfer's "trtllm-gen requires block_size in (32, 64), got 1") and with the
    eager width as top-k (the call before its -1 padding: "SparseMlaTopK must be a multiple of 4")."""
    _, _, passed = _run_blackwell("eager", monkeypatch)
    import flashinfer.mla

    stand_in = trtllm_gen_sparse_mla_stand_in(flashinfer.mla.trtllm_batch_decode_with_kv_cache_mla)
    D = passed["kv_cache"].size(-1)
    with pytest.raises(ValueError, match=r"block_size in \(32, 64\), got 1"):
        stand_in(**dict(passed, kv_cache=passed["kv_cache"].view(-1, 1, 1, D)))
    top_37 = dict(block_tables=passed["block_tables"][..., :37].contiguous(), sparse_mla_top_k=37)
    with pytest.raises(ValueError, match="multiple of 4"):
        stand_in(**dict(passed, **top_37))


@full  # (flashinfer's first import alone takes 4 s: the quick run leaves the Blackwell contract to CI)
def test_blackwell_runs_trtllm_gen_where_flashinfer_has_the_kernel(monkeypatch):
    """kernels.sparse_mla_path: the Gluon kernel on Hopper at DeepSeek's 512 + 64 with 128 or 64 heads (TP 1,
    2); trtllm-gen on Blackwell at 512 + 64 with 128, 64 or 32 heads (TP 1, 2, 4); else the Triton kernel (32
    heads on Hopper, 16 on Blackwell, the tiny configuration's 4 heads of 256 + 64); GPU_OPS.name, which the
    engine prints after its warm-up, names the one that ran."""
    import kernels

    monkeypatch.setattr(kernels.GPU_OPS, "name", kernels.GPU_OPS.name)  # (restored after the test)
    cases = [(9, 128, 512, "gluon"), (9, 64, 512, "gluon"), (9, 32, 512, "triton"), (9, 4, 256, "triton")]
    cases += [(10, 128, 512, "trtllm-gen"), (10, 64, 512, "trtllm-gen"), (10, 32, 512, "trtllm-gen")]
    cases += [(10, 16, 512, "triton"), (10, 4, 256, "triton")]
    for major, H, C, path in cases:
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None, cc=(major, 0): cc)
        assert kernels.sparse_mla_path(torch.device("cpu"), H, C, 64) == path
        if path == "gluon":
            assert "Gluon sparse MLA" in kernels.GPU_OPS.name, kernels.GPU_OPS.name
        if major == 10:
            named = "trtllm-gen sparse MLA [" if path == "trtllm-gen" else f"none for {H} heads of {C}"
            assert named in kernels.GPU_OPS.name, kernels.GPU_OPS.name
    assert kernels.GPU_OPS.name.startswith("kernels.py (Triton sparse MLA [")
