#!/usr/bin/env python3
"""Train the demo model: a tiny DeepSeek-V3.2 that writes Python, in the official FP8 checkpoint format.

    # a GPU: the demo's command, 394 s in all on an H200 (5.8 minutes of training; 2026-11-26, docs/demo.md)
    python tools/train_demo.py --out demo --minutes 5.8
    python tools/train_demo.py --out /tmp/d --smoke    # any machine: every stage on a few steps (the CI test)

Stages, all in this file:
1. Corpus: every .py file of this Python's standard library (sysconfig's "stdlib" path), then about 30 MB of
   its installed packages' .py files (a file kept by a hash of its path), in sorted order; a file is held out
   when crc32 of its relative path is 0 mod 50, so the split does not depend on what else is installed.
2. Tokenizer: byte-level BPE (the `tokenizers` library) trained on the training files, 2048 ids, DeepSeek's
   six special tokens first (BOS = 0, EOS = 1, as in the real checkpoint). A file is encoded as BOS, text,
   EOS.
3. Training: the next-token loss; the MTP layer's next-next-token loss (DeepSeek-V3's MTP objective, weight
   0.3), applied recursively for depths 1..3 with shared weights, as the engine drafts (depth d at position p
   reads depth d-1's output at p-1 instead of the main model's hidden state); the lightning indexer trained to
   match the main attention (DeepSeek-V3.2: KL from the heads' summed attention to the indexer's softmax, on
   detached inputs, so the indexer never steers the model). First half: dense attention (the indexer's
   warm-up); second half: sparse, every query attends to its indexer's top-`index_topk` keys (KL over the
   selected keys only); the last quarter adds FP8 fake quantization (straight-through) of the checkpoint's FP8
   weights, activations, latent cache and indexer q / k, as DeepSeek-V3 trained in FP8. MoE routing: sigmoid
   scores, group-limited top-k, aux-loss-free balancing (the selection bias moves towards the mean load every
   step). AdamW with fp32 master weights, bf16 autocast on the GPU.
4. Export through tools/checkpoint.py's writer (128x128 FP8 blocks, power-of-two scales), then measurement
   through the engine itself: held-out loss from `load_model` prefill logits, MTP acceptance from
   `LLM.generate`. eval.json keeps the held-out chunks, the bf16 model's loss on each (measured here) and the
   held-out prompts.

nano_nsa's layers are inference-only (FP8 parameters without gradients, a KV cache, one Meta per step), so
this script keeps differentiable copies of them, named as the HF checkpoint names its tensors: the same math
in the per-head ("MHA") form that DeepSeek trains with. It reuses nano_nsa's Config, YaRN RoPE, Hadamard, FP8
quantizers and tokenizer, and tools/checkpoint.py's checkpoint writers.
"""

import argparse
import contextlib
import json
import os
import re
import sys
import sysconfig
import time
import zlib
from statistics import fmean as mean

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import chat  # noqa: E402
import nano_nsa as m  # noqa: E402
from tools.checkpoint import quantize_weight, save_random_checkpoint, save_tokenizer  # noqa: E402

SEQ, DEPTHS, MTP_WEIGHT = 512, 3, 0.3
SITE_BYTES = 30e6  # installed packages' code added to the standard library's
DEMO = dict(
    vocab_size=2048,
    dim=256,
    inter_dim=512,
    moe_inter_dim=128,
    n_layers=10,
    n_dense_layers=3,
    n_heads=8,
    n_routed_experts=8,
    n_activated_experts=2,
    n_expert_groups=4,
    n_limited_groups=2,
    route_scale=1.0,
    q_lora_rank=128,
    kv_lora_rank=256,
    qk_nope_head_dim=64,
    qk_rope_head_dim=64,
    v_head_dim=32,
    index_n_heads=4,
    index_head_dim=128,
    index_topk=128,
)


# ------------------------------------------------------------------------------------------------------------
# Corpus and tokenizer
# ------------------------------------------------------------------------------------------------------------
def python_files():
    """[(path, text)] of this Python's .py files, sorted: the standard library (paths relative to it), then
    about SITE_BYTES of the installed packages' (site-packages; paths under "site-packages/", a file kept by
    a hash of its path)."""
    paths = sysconfig.get_paths()
    roots = sorted({paths["purelib"], paths["platlib"]})
    site = [f for root in roots for f in py_files(root, "site-packages/")]
    share = SITE_BYTES / max(1, sum(len(text) for _, text in site))  # the part of it kept, by a path hash
    kept = [(r, t) for r, t in site if zlib.crc32(r.encode()) % 1000 < 1000 * share]
    return py_files(paths["stdlib"]) + kept


def py_files(root, prefix=""):
    """[(prefix + path relative to root, text)] of the .py files under root, sorted (no site-packages)."""
    out = []
    for d, dirs, files in os.walk(root):
        dirs[:] = sorted(x for x in dirs if x not in ("site-packages", "dist-packages", "__pycache__"))
        for f in sorted(x for x in files if x.endswith(".py")):
            path = os.path.join(d, f)  # (a few test files are deliberately not UTF-8: skipped)
            with contextlib.suppress(UnicodeDecodeError, OSError), open(path, encoding="utf-8") as fh:
                out.append((prefix + os.path.relpath(path, root), fh.read()))
    return out


def held_out(rel):
    return zlib.crc32(rel.encode()) % 50 == 0


def train_tokenizer(texts, vocab_size):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = [chat.BOS, chat.EOS, chat.USER, chat.ASSISTANT, chat.THINK, chat.END_THINK]  # ids 0..5
    tok.train_from_iterator(
        texts,
        trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=specials,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        ),
    )
    return tok


def encode_files(tok, texts):
    """One stream: BOS, file, EOS, BOS, next file ..."""
    ids = []
    for e in tok.encode_batch(texts, add_special_tokens=False):
        ids += [0] + e.ids + [1]
    return torch.tensor(ids, dtype=torch.long)


def code_prompts(files, n):
    """Up to n held-out prompts: ~30 lines of a file ending with a `def` line, to be completed."""
    out = []
    for _, text in files:
        hit = re.compile(r"^[ \t]*def [^\n]*:\n", re.M).search(text, 400)
        if hit and len(out) < n:
            start = text.rfind("\n", 0, max(0, hit.end() - 1000)) + 1
            out.append(text[start : hit.end()])
    return out


# ------------------------------------------------------------------------------------------------------------
# The differentiable model, in the HF layout
# ------------------------------------------------------------------------------------------------------------
QAT = {"on": False}  # FP8 fake quantization (straight-through) of what the checkpoint stores as FP8


def ste(x, f):
    """f(x) forward, identity backward."""
    return x + (f(x.detach()).to(x.dtype) - x).detach() if QAT["on"] else x


def fp8_round_trip(x):  # as the engine caches the latent and rounds the indexer's q / k
    return m.act_dequant(*m.act_quant(x)).to(m.BF16)


def fq_weight(w):
    return m.weight_dequant(*quantize_weight(w))


def f32_linear(x, w):
    """fp32 in, fp32 math (autocast off): the router and the indexer's head weights, fp32 in the engine."""
    with torch.autocast(x.device.type, enabled=False):
        return F.linear(x.float(), w.float())


def fp8_linear(x, w):
    """A checkpoint FP8 linear: act_quant(x) @ W8^T (fake-quantized under QAT)."""
    return F.linear(ste(x, lambda t: m.act_dequant(*m.act_quant(t))), ste(w, fq_weight))


class Norm(nn.Module):  # RMSNorm, fp32 math
    def __init__(self, dim, eps):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(dim)), eps

    def forward(self, x):
        x = x.float()
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)


def lin(i, o):
    return nn.Linear(i, o, bias=False)


def rope(x, cos, sin, interleaved):  # x [B, S, ..., R]: nano_nsa.rope rotates [S, ...]
    return m.rope(x.transpose(0, 1), cos, sin, interleaved).transpose(0, 1)


class Indexer(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.c = c
        self.wq_b, self.wk = (
            lin(c.q_lora_rank, c.index_n_heads * c.index_head_dim),
            lin(c.dim, c.index_head_dim),
        )
        self.k_norm, self.weights_proj = (
            nn.LayerNorm(c.index_head_dim, eps=c.eps),
            lin(c.dim, c.index_n_heads),
        )

    def forward(self, x, qr, cos, sin):
        """-> I [B, S, T] = sum_h w_h relu(q_h . k_t): nano_nsa.Indexer's scores before FP8 rounding."""
        c, (B, S, _), R = self.c, x.shape, self.c.qk_rope_head_dim
        q = fp8_linear(qr, self.wq_b.weight).view(B, S, c.index_n_heads, c.index_head_dim)
        k = self.k_norm(fp8_linear(x, self.wk.weight).float())
        q = torch.cat([rope(q[..., :R], cos, sin, False), q[..., R:]], -1)
        k = torch.cat([rope(k[..., :R], cos, sin, False), k[..., R:]], -1)
        q8, k8 = (ste(m.hadamard(t), fp8_round_trip).float() for t in (q, k))  # Hadamard keeps dot products
        w = f32_linear(x, self.weights_proj.weight) * (c.index_n_heads * c.index_head_dim) ** -0.5
        return (torch.einsum("bshj,btj->bsht", q8, k8).relu() * w[..., None]).sum(2)


class Attention(nn.Module):  # HF: self_attn
    def __init__(self, c):
        super().__init__()
        self.c, H = c, c.n_heads
        self.q_a_proj, self.q_a_layernorm = lin(c.dim, c.q_lora_rank), Norm(c.q_lora_rank, c.eps)
        self.q_b_proj = lin(c.q_lora_rank, H * c.qk_head_dim)
        self.kv_a_proj_with_mqa = lin(c.dim, c.kv_lora_rank + c.qk_rope_head_dim)
        self.kv_a_layernorm = Norm(c.kv_lora_rank, c.eps)
        self.kv_b_proj = lin(c.kv_lora_rank, H * (c.qk_nope_head_dim + c.v_head_dim))
        self.o_proj = lin(H * c.v_head_dim, c.dim)
        self.indexer = Indexer(c)

    def forward(self, x, cos, sin, sparse):
        """-> (output [B, S, dim], the indexer's KL loss)."""
        c, (B, S, _) = self.c, x.shape
        H, D, R, C, V = c.n_heads, c.qk_nope_head_dim, c.qk_rope_head_dim, c.kv_lora_rank, c.v_head_dim
        qr = self.q_a_layernorm(fp8_linear(x, self.q_a_proj.weight))
        q_nope, q_pe = fp8_linear(qr, self.q_b_proj.weight).view(B, S, H, D + R).split([D, R], -1)
        kv, k_pe = fp8_linear(x, self.kv_a_proj_with_mqa.weight).split([C, R], -1)
        kv = ste(self.kv_a_layernorm(kv), fp8_round_trip)  # the latent cache is FP8
        k_nope, v = fp8_linear(kv, self.kv_b_proj.weight).view(B, S, H, D + V).split([D, V], -1)
        q_pe, k_pe = rope(q_pe, cos, sin, True), rope(k_pe, cos, sin, True)
        scores = (
            torch.einsum("bshd,bthd->bhst", q_nope, k_nope) + torch.einsum("bshr,btr->bhst", q_pe, k_pe)
        ).float() * c.softmax_scale
        index = self.indexer(x.detach(), qr.detach(), cos, sin)  # [B, S, T]: no gradient into the model
        keep = torch.ones(S, S, dtype=torch.bool, device=x.device).tril().expand(B, S, S)
        index = index.masked_fill(~keep, float("-inf"))
        if sparse and S > c.index_topk:  # DSA: each query keeps its indexer's top-k causal keys
            top = index.detach().topk(c.index_topk, dim=-1).indices
            keep = keep & torch.zeros_like(keep).scatter_(-1, top, True)
        p = scores.masked_fill(~keep[:, None], float("-inf")).softmax(-1)  # [B, H, S, T]
        o = torch.einsum("bhst,bthv->bshv", p.to(v.dtype), v).reshape(B, S, H * V)
        target = p.detach().sum(1) / H  # summed over heads, L1-normalized
        log_q = index.masked_fill(~keep, float("-inf")).log_softmax(-1).masked_fill(~keep, 0)
        kl = (torch.xlogy(target, target) - target * log_q).sum(-1).mean()
        return fp8_linear(o, self.o_proj.weight), kl


class MLP(nn.Module):
    def __init__(self, dim, inter):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = lin(dim, inter), lin(dim, inter), lin(inter, dim)

    def forward(self, x):
        h = F.silu(fp8_linear(x, self.gate_proj.weight)) * fp8_linear(x, self.up_proj.weight)
        return fp8_linear(h, self.down_proj.weight)


class MoE(nn.Module):  # HF: mlp (routed experts exported one by one, see export())
    def __init__(self, c):
        super().__init__()
        self.c = c
        E, inter = c.n_routed_experts, c.moe_inter_dim
        self.gate = nn.Module()
        self.gate.weight = nn.Parameter(torch.randn(E, c.dim) * c.dim**-0.5)
        self.gate.register_buffer("e_score_correction_bias", torch.zeros(E))
        self.w1, self.w3 = (nn.Parameter(torch.randn(E, inter, c.dim) * c.dim**-0.5) for _ in range(2))
        self.w2 = nn.Parameter(torch.randn(E, c.dim, inter) * inter**-0.5)
        self.shared_experts = MLP(c.dim, inter * c.n_shared_experts)
        self.load = torch.zeros(E)

    def forward(self, x):
        """x [N, dim]. Every expert runs on every token (8 small experts: cheaper than dispatch here); the
        routing weights, zero for unselected experts, pick the outputs."""
        c, N = self.c, x.shape[0]
        s = f32_linear(x, self.gate.weight).sigmoid()  # [N, E]
        with torch.no_grad():  # nano_nsa.Gate's selection
            sb = (s + self.gate.e_score_correction_bias).view(N, c.n_expert_groups, -1)
            keep = sb.topk(2, -1).values.sum(-1).topk(c.n_limited_groups, -1).indices
            drop = torch.ones(N, c.n_expert_groups, dtype=torch.bool, device=x.device).scatter_(
                1, keep, False
            )
            idx = (
                sb.masked_fill(drop[..., None], float("-inf"))
                .flatten(1)
                .topk(c.n_activated_experts, -1)
                .indices
            )
            self.load = torch.bincount(idx.flatten(), minlength=c.n_routed_experts).float()
        w = s.gather(1, idx)
        comb = torch.zeros_like(s).scatter(1, idx, w / w.sum(-1, keepdim=True) * c.route_scale)
        xq = ste(x, lambda t: m.act_dequant(*m.act_quant(t)))
        w1, w3, w2 = (
            ste(p, lambda t: torch.stack([fq_weight(e) for e in t])) for p in (self.w1, self.w3, self.w2)
        )
        h = F.silu(torch.einsum("nd,eid->eni", xq, w1)) * torch.einsum("nd,eid->eni", xq, w3)
        y = torch.einsum("eni,edi->end", ste(h, lambda t: m.act_dequant(*m.act_quant(t))), w2)
        return torch.einsum("end,ne->nd", y, comb.to(y.dtype)) + self.shared_experts(x)


class Layer(nn.Module):
    def __init__(self, c, moe):
        super().__init__()
        self.input_layernorm, self.post_attention_layernorm = Norm(c.dim, c.eps), Norm(c.dim, c.eps)
        self.self_attn, self.mlp = Attention(c), (MoE(c) if moe else MLP(c.dim, c.inter_dim))

    def forward(self, x, cos, sin, sparse):
        a, kl = self.self_attn(self.input_layernorm(x), cos, sin, sparse)
        x = x + a
        f = self.post_attention_layernorm(x)
        return x + self.mlp(f.flatten(0, 1)).view(f.shape), kl


class MTPLayer(Layer):  # HF: model.layers.{n_layers}; embedding and head shared with the model
    def __init__(self, c):
        super().__init__(c, moe=True)
        self.enorm, self.hnorm = Norm(c.dim, c.eps), Norm(c.dim, c.eps)
        self.eh_proj = lin(2 * c.dim, c.dim)
        self.shared_head = nn.Module()
        self.shared_head.norm = Norm(c.dim, c.eps)


class Model(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.c = c
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(c.vocab_size, c.dim)
        self.model.layers = nn.ModuleList(
            [Layer(c, i >= c.n_dense_layers) for i in range(c.n_layers)] + [MTPLayer(c)]
        )
        self.model.norm = Norm(c.dim, c.eps)
        self.lm_head = lin(c.dim, c.vocab_size)
        for n, p in self.named_parameters():
            if p.dim() == 2 and "gate.weight" not in n:
                nn.init.normal_(p, std=(1.0 if "embed" in n else p.shape[1] ** -0.5))
        for layer in self.model.layers:  # residual branches start small
            ffn = layer.mlp.shared_experts if isinstance(layer.mlp, MoE) else layer.mlp
            for p in (layer.self_attn.o_proj.weight, ffn.down_proj.weight):
                p.data *= 0.3

    def forward(self, x, nxt, sparse, depths=DEPTHS):
        """x [B, S] tokens, nxt [B, S] the tokens after them -> (logits [B, S, V], [MTP logits of each
        depth], indexer KL). MTP depth d at position p predicts t[p + 2] from t[p + 1] = nxt[p] and a
        hidden state: the main model's at p for d = 0, depth d-1's output at p - 1 after (as the engine's
        draft steps chain)."""
        c, S = self.c, x.shape[1]
        cos, sin = m.rope_cos_sin(m.yarn_frequencies(c).to(x.device), torch.arange(S, device=x.device))
        h, kl = self.model.embed_tokens(x), 0.0
        for layer in self.model.layers[:-1]:
            h, k = layer(h, cos, sin, sparse)
            kl = kl + k
        h = self.model.norm(h)
        mtp, e, hid, mtp_logits = self.model.layers[-1], self.model.embed_tokens(nxt), h, []
        for d in range(depths):
            g, k = mtp(eh_proj(mtp, e, hid), cos, sin, sparse)
            g = mtp.shared_head.norm(g)
            kl = kl + (k if d == 0 else 0.0)
            mtp_logits.append(F.linear(g, self.lm_head.weight))
            hid = torch.cat([h[:, :1], g[:, :-1]], 1)
        return F.linear(h, self.lm_head.weight), mtp_logits, kl


def losses(model, window, sparse, depths=DEPTHS):
    """window [B, S + 2] -> (next-token loss, [next-next-token loss of each MTP depth], indexer KL)."""
    S = window.shape[1] - 2
    logits, mtp_logits, kl = model(window[:, :S], window[:, 1 : S + 1], sparse, depths)
    ce = lambda lg, tgt: F.cross_entropy(lg.flatten(0, 1).float(), tgt.flatten())  # noqa: E731
    return (
        ce(logits, window[:, 1 : S + 1]),
        [ce(lg[:, d:], window[:, d + 2 :]) for d, lg in enumerate(mtp_logits)],
        kl,
    )


def eh_proj(mtp, e, h):  # eh_proj is bf16 in the checkpoint, not FP8
    return F.linear(torch.cat([mtp.enorm(e), mtp.hnorm(h)], -1), mtp.eh_proj.weight)


# ------------------------------------------------------------------------------------------------------------
# Export and evaluation through the engine
# ------------------------------------------------------------------------------------------------------------
def export(model, tok, path):
    """Our tensors under their HF names (routed experts unstacked, MTP embedding / head copied), FP8 through
    nano_nsa's writer."""
    c, w = model.c, {}
    for name, t in model.state_dict().items():
        hit = re.match(r"(.*\.mlp)\.(w[123])$", name)
        if hit:
            proj = dict(w1="gate_proj", w3="up_proj", w2="down_proj")[hit[2]]
            w.update({f"{hit[1]}.experts.{e}.{proj}.weight": t[e] for e in range(len(t))})
        else:
            w[name] = t
    p = f"model.layers.{c.n_layers}."
    w[p + "embed_tokens.weight"], w[p + "shared_head.head.weight"] = (
        w["model.embed_tokens.weight"],
        w["lm_head.weight"],
    )
    # the decoding defaults it ships: a model this small loops at greedy and rambles at temperature 1
    weights = {k: v.detach().float().cpu() for k, v in w.items()}
    save_random_checkpoint(path, c, tokenizer=False, weights=weights, sampling=(0.6, 0.9))
    if tok is not None:
        save_tokenizer(path, tok)


@torch.no_grad()
def engine_loss(path, chunks, device):
    """Mean next-token loss of each chunk [N, SEQ + 1] from the engine's own prefill logits (load_model, one
    Meta per chunk, the kernels of `device`: FP8 GEMMs, FP8 latent cache, the indexer's top-k)."""
    model = m.load_model(path, device)
    cache, out = m.KVCache(model.cfg, SEQ + 1, device), []
    table = torch.arange(SEQ, device=device)[None]
    for ch in chunks:
        ch = torch.as_tensor(ch, device=device)
        positions = torch.arange(SEQ, device=device)
        h = model(ch[:-1], m.Meta.rows("prefill", positions, positions * 0, table, [0, SEQ]), cache)
        out.append(F.cross_entropy(model.logits(h), ch[1:]).item())
    return out


@torch.no_grad()
def bf16_loss(model, chunks, device):
    """The trained model before export (bf16 autocast on a GPU, fp32 on a CPU; no FP8), sparse as the
    engine."""
    out = []
    for ch in chunks:
        window = torch.cat(
            [torch.as_tensor(ch, device=device), torch.zeros(1, dtype=torch.long, device=device)]
        )
        with torch.autocast(device.type, torch.bfloat16, enabled=device.type == "cuda"):
            out.append(losses(model, window[None], True, 0)[0].item())
    return out


# ------------------------------------------------------------------------------------------------------------
def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="checkpoint directory to write")
    ap.add_argument("--minutes", type=float, default=5.0, help="training time budget")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--smoke", action="store_true", help="a few steps of a few files: checks every stage")
    return ap.parse_args()


def prepare_data(args, dev, say):
    """Corpus, tokenizer and token streams -> (tokenizer, train tokens on `dev`, held-out files, held-out
    chunks [N, SEQ + 1]). Under --smoke, fewer files and a batch of 2 (args.batch is set)."""
    files = python_files()
    train = [t for r, t in files if not held_out(r)]
    test = [(r, t) for r, t in files if held_out(r)]
    if args.smoke:
        train, args.batch = train[:40], 2
    size = sum(map(len, train)) / 1e6
    args.corpus = (
        f"standard library and packages: {len(train)} train files ({size:.1f} MB), {len(test)} held out"
    )
    say(f"corpus: {args.corpus}")
    tok = train_tokenizer(train, DEMO["vocab_size"])
    data, held = encode_files(tok, train).to(dev), encode_files(tok, [t for _, t in test])
    say(
        f"tokenizer: {tok.get_vocab_size()} ids; {len(data) / 1e6:.2f} M train tokens "
        f"({sum(map(len, train)) / len(data):.2f} bytes/token), {len(held) / 1e3:.0f} K held-out tokens"
    )
    n_chunks = 2 if args.smoke else 32
    chunks = held[: n_chunks * (SEQ + 1)].view(-1, SEQ + 1)
    return tok, data, test, chunks


def learning_rate(args, step, frac):
    """Linear warm-up over 100 steps, then cosine decay to a tenth of args.lr."""
    return (
        args.lr
        * min(1.0, (step + 1) / 100)
        * (0.1 + 0.9 * 0.5 * (1 + torch.cos(torch.tensor(frac * 3.14159))))
    )


@torch.no_grad()
def balance_experts(model):
    """Aux-loss-free balancing: bias += 1e-3 * sign(mean load - load)."""
    for layer in model.model.layers:
        if isinstance(layer.mlp, MoE):
            load = layer.mlp.load
            layer.mlp.gate.e_score_correction_bias += 1e-3 * torch.sign(load.mean() - load)


def train_model(model, data, chunks, args, dev, say):
    """The training loop (schedule fixed from the first 30 steps' time unless --smoke) -> number of steps."""
    opt = torch.optim.AdamW(
        model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1, fused=dev.type == "cuda"
    )
    budget, steps, step, t_train = args.minutes * 60, (6 if args.smoke else None), 0, time.time()
    while steps is None or step < steps:
        if steps is None and step == 30:  # fix the schedule from the measured step time
            steps = max(100, int(budget / ((time.time() - t_train) / 30)))
            say(f"{(time.time() - t_train) / 30 * 1e3:.0f} ms/step: {steps} steps")
        frac = step / (steps or 10**9)
        lr = learning_rate(args, step, frac)
        for g in opt.param_groups:
            g["lr"] = float(lr)
        sparse, QAT["on"] = frac >= 0.5, frac >= 0.75
        at = torch.randint(0, len(data) - SEQ - 2, (args.batch,), device=dev)
        window = data[at[:, None] + torch.arange(SEQ + 2, device=dev)]
        with torch.autocast(dev.type, torch.bfloat16, enabled=dev.type == "cuda"):
            main_loss, mtp_losses, kl = losses(model, window, sparse)
        loss = main_loss + MTP_WEIGHT * sum(mtp_losses) / DEPTHS + kl
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        balance_experts(model)
        if step % 100 == 0 or step == (steps or 0) - 1:
            say(
                f"step {step}: loss {main_loss.item():.3f}, "
                f"mtp {' '.join(f'{x.item():.3f}' for x in mtp_losses)}, "
                f"indexer KL {kl.item():.3f}, held-out {mean(bf16_loss(model, chunks[:4], dev)):.3f}, "
                f"lr {float(lr):.2e}, sparse {sparse}, fp8 {QAT['on']}"
            )
        step += 1
    return steps


def export_and_evaluate(model, tok, test, chunks, args, dev, say):
    """bf16 held-out loss, export, the engine's FP8 held-out loss and MTP acceptance -> (bf16 losses, FP8
    engine losses, prompts, mean accepted length, checkpoint bytes)."""
    model.eval()
    QAT["on"] = False
    bf16 = bf16_loss(model, chunks, dev)
    os.makedirs(args.out, exist_ok=True)
    export(model, tok, args.out)
    size = sum(os.path.getsize(os.path.join(args.out, f)) for f in os.listdir(args.out))
    say(f"exported to {args.out}: {size / 1e6:.2f} MB; bf16 held-out loss {mean(bf16):.4f}")
    fp8 = engine_loss(args.out, chunks, dev)
    say(f"engine (FP8) held-out loss {mean(fp8):.4f} ({sum(fp8) / sum(bf16) - 1:+.2%} vs bf16)")
    prompts = code_prompts(test, 12)
    llm = m.LLM(args.out, device=dev, mtp=3, kernels="torch")
    llm.generate(prompts, max_new_tokens=2 if args.smoke else 64, raw=True)
    accept = llm.stats["mean_accept_length"]
    say(f"greedy --mtp 3 on {len(prompts)} held-out prompts: mean accepted length {accept}")
    return bf16, fp8, prompts, accept, size


def main():
    args = parse_args()
    torch.manual_seed(args.seed)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    t0 = time.time()
    say = lambda *a: print(f"[{time.time() - t0:6.1f} s]", *a, flush=True)  # noqa: E731
    tok, data, test, chunks = prepare_data(args, dev, say)
    cfg = m.Config(**DEMO)
    model = Model(cfg).to(dev)
    n_params = sum(p.numel() for p in model.parameters())
    say(f"model: {n_params / 1e6:.2f} M parameters")
    steps = train_model(model, data, chunks, args, dev, say)
    bf16, fp8, prompts, accept, size = export_and_evaluate(model, tok, test, chunks, args, dev, say)
    info = dict(
        command="python " + " ".join(sys.argv),
        seed=args.seed,
        data=f"Python {sys.version.split()[0]}'s {args.corpus}",
        config=DEMO,
        seq=SEQ,
        steps=steps,
        batch=args.batch,
        minutes=args.minutes,
        device=(torch.cuda.get_device_name() if dev.type == "cuda" else "cpu"),
        params=n_params,
        bytes=size,
        train_tokens=len(data),
        python=sys.version.split()[0],
        heldout_chunks=chunks.tolist(),
        bf16_loss=bf16,
        fp8_engine_loss=fp8,
        prompts=prompts,
        mtp3_mean_accept_length=accept,
        seconds=round(time.time() - t0),
    )
    with open(os.path.join(args.out, "eval.json"), "w") as f:
        json.dump(info, f)
    say("done")


if __name__ == "__main__":
    main()
