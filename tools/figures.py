#!/usr/bin/env python3
"""Draw the docs' figures of the engine at work, from its own data: the demo model on the CPU, recorded by
explain.py's recorder (greedy decoding, so every run draws the same pictures).

    pip install matplotlib          # this script's dependency only (the engine and the tests need none)
    python tools/figures.py         # writes docs/figures/*.png (a few minutes on a laptop CPU)

indexer_selection.png   which context positions each prompt row keeps, in two layers (prefill chunks of 128)
speculative_round.png   one round of --mtp 3: verify, accept, draft-extend (with the dummy slot), draft
page_table.png          four requests' pages in the KV pool, mid-run (page_size 16, a small pool)
request_life.png        one request from prompt to retirement: prefill chunks, then tokens per round
"""

import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.colors import ListedColormap  # noqa: E402
from matplotlib.patches import FancyBboxPatch, Patch, Rectangle  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import explain  # noqa: E402
import nano_nsa as m  # noqa: E402

OUT = os.path.join(ROOT, "docs", "figures")
DEEP = 4  # the second layer indexer_selection shows (layer 0 is the first)

# a demo prompt of 350 tokens: Python source in the style of the standard library (written for this)
PROMPT = '''import os


def walk_files(top, suffix=".py", skip_hidden=True):
    """Yield the path of every file under top whose name ends with suffix, in sorted order."""
    for root, dirs, files in os.walk(top):
        dirs.sort()
        if skip_hidden:
            dirs[:] = [d for d in dirs if not d.startswith(".")]
        for name in sorted(files):
            if skip_hidden and name.startswith("."):
                continue
            if name.endswith(suffix):
                yield os.path.join(root, name)


def read_lines(path, encoding="utf-8", strip=True):
    """Return the lines of the file at path, without their line endings."""
    with open(path, encoding=encoding) as f:
        lines = f.read().splitlines()
    if strip:
        lines = [line.rstrip() for line in lines]
    return lines


def count_lines(top, suffix=".py"):
    """Return a dict that maps every file under top to its number of non-blank lines."""
    counts = {}
    for path in walk_files(top, suffix):
        lines = read_lines(path)
        counts[path] = sum(1 for line in lines if line)
    return'''

DARK, MID, LIGHT = "#1f3b73", "#7d9bc9", "#e3e9f3"
GREEN, RED, GREY, ORANGE = "#3a8f4b", "#c0392b", "#9a9a9a", "#e08a1e"


def show(rec, token):
    """A token as the figures print it: its text's repr, shortened."""
    text = rec.show(token)
    return text if len(text) <= 14 else text[:12] + "..'"


def solo_run():
    """One greedy --mtp 3 request on the demo prompt, prefilled in chunks of 128 -> (engine, recorder)."""
    llm = m.LLM(device="cpu", mtp=3, max_prefill_tokens=128, cuda_graphs=False)
    rec = explain.attach(llm, rounds=8, layers=(0, DEEP))
    rec.result = llm.generate([PROMPT], max_new_tokens=48, temperature=0.0, raw=True)[0]
    return llm, rec


def save(fig, name):
    path = os.path.join(OUT, name)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    print(f"{path}: {os.path.getsize(path) // 1024} KB")


def selection_grid(rec, layer):
    """The prefill's rows of one layer as a grid [rows, positions]: 0 future, 1 in context but not kept,
    2 kept by the indexer (the rows of every prefill chunk, stacked in position order)."""
    import torch

    atts = [a for s in rec.steps if isinstance(s, explain.Prefill) for a in s.attention if a.layer == layer]
    n = max(p for a in atts for p in a.positions) + 1
    grid = torch.zeros(n, n, dtype=torch.uint8)
    for a in atts:
        for row, pos, ctx in zip(a.selected.long(), a.positions, a.ctx_lens, strict=True):
            grid[pos, :ctx] = 1
            grid[pos, row[row >= 0]] = 2
    return grid, atts


def landmarks(grid, K, n=5, gap=14):
    """Positions most rows keep, among rows whose context exceeds K and positions before the last K (the
    recent band is kept anyway), at least `gap` apart."""
    rows = grid[K:]
    share = (rows == 2).sum(0).float() / (rows >= 1).sum(0).clamp(min=1).float()
    chosen = []
    for p in share[: grid.shape[0] - K].argsort(descending=True, stable=True).tolist():
        if all(abs(p - q) >= gap for q in chosen):
            chosen.append(p)
        if len(chosen) == n:
            break
    return [(p, float(share[p])) for p in sorted(chosen)]


def draw_selection(rec):
    K, tokens = rec.cfg.index_topk, rec.requests[0].tokens
    fig, axes = plt.subplots(1, 2, figsize=(13, 7))
    cmap = ListedColormap(["white", LIGHT, DARK])
    for ax, layer in zip(axes, (0, DEEP), strict=True):
        grid, atts = selection_grid(rec, layer)
        n = grid.shape[0]
        ax.imshow(grid.numpy(), cmap=cmap, vmin=0, vmax=2, interpolation="nearest", aspect="auto")
        for a in atts:  # the prefill chunks, labelled in the white (future) corner
            first, last = a.positions[0], a.positions[-1]
            how = f"top {K} kept" if a.scored else "all kept"
            ax.axhline(first - 0.5, color=ORANGE if first else GREY, lw=1, ls="--")
            ax.text(n - 3, first + 2, f"chunk {first}..{last}\n{how}", ha="right", va="top", fontsize=9)
        marks = [(p, share) for p, share in landmarks(grid, K) if share >= 0.9]
        for p, share in marks:
            arrow = dict(arrowstyle="-", color=RED, lw=0.8)
            label = f"{show(rec, tokens[p])} {share:.0%}"
            ax.annotate(
                label,
                (p, n - 0.5),
                (p, n + 24),
                ha="center",
                va="top",
                rotation=90,
                fontsize=8,
                color=RED,
                arrowprops=arrow,
                annotation_clip=False,
            )
        ax.set_title(f"layer {layer}", fontsize=12)
        note = "\nred: positions kept by >= 90% of the rows past 128 (and their share)" if marks else ""
        ax.set_xlabel("context position (key)" + note, labelpad=70 if marks else 4)
        ax.set_ylabel("prompt row (query position)")
    axes[0].set_xlabel(axes[0].get_xlabel(), labelpad=axes[1].xaxis.labelpad)  # (the two aligned)
    fig.suptitle(
        f"Which positions the lightning indexer keeps: the demo model's prefill of a {n + 1}-token Python "
        f"prompt\n(chunks of 128 rows; a row keeps at most K = {K} positions of its causal context)",
        fontsize=12,
    )
    handles = [
        Patch(color=DARK, label="kept (attended to)"),
        Patch(color=LIGHT, label="in context, not kept"),
        Patch(facecolor="white", edgecolor=GREY, label="future (masked)"),
    ]
    fig.legend(handles=handles, loc="lower center", ncol=3, frameon=False, fontsize=10)
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    save(fig, "indexer_selection.png")


def box(ax, x, y, text, color, sub="", hatch=None, dark=True, size=10):
    """A token box centred at (x, y): text, then smaller lines (sub) under it."""
    w, h, ink = 0.92, 0.84, "white" if dark else "#222222"
    edge = "#c8c8c8" if hatch else "#333333"  # (a hatch is drawn in the edge's colour)
    ax.add_patch(
        FancyBboxPatch(
            (x - w / 2, y - h / 2), w, h, boxstyle="round,pad=0.02", fc=color, ec=edge, lw=0.8, hatch=hatch
        )
    )
    ax.text(x, y + (0.18 if sub else 0), text, ha="center", va="center", fontsize=size, color=ink)
    if sub:
        ax.text(x, y - 0.17, sub, ha="center", va="center", fontsize=size - 2.5, color=ink, linespacing=1.1)


def arrow(ax, start, end, color="#666666"):
    """From the bottom (top) edge of the box at start to the top (bottom) edge of the box at end."""
    up = 1 if end[1] > start[1] else -1
    start, end = (start[0], start[1] + up * 0.43), (end[0], end[1] - up * 0.43)
    ax.annotate("", end, start, arrowprops=dict(arrowstyle="->", color=color, lw=1, shrinkA=0, shrinkB=0))


def pick_round(rec):
    """The first recorded round after the first that accepted some drafts and rejected one."""
    k = rec.llm.num_draft
    return next(r for r in rec.rounds[1 : rec.detail] if 1 < r.counts[0] < k + 1)


LANES = [6.0, 4.8, 3.6, 2.4, 1.2, 0.0]  # verify, accept, extend, drafts, MTP decode rows, next round


def draw_round(rec):
    rnd = pick_round(rec)
    fig, ax = plt.subplots(figsize=(14, 8.2))
    verify_and_accept(ax, rec, rnd)
    extend_and_draft(ax, rec, rnd)
    round_labels(ax, rnd, rnd.start[0], rnd.start[0] + rnd.counts[0] + rec.llm.num_draft)
    fig.tight_layout()
    save(fig, "speculative_round.png")


def verify_and_accept(ax, rec, rnd):
    """Lanes 1 and 2: the main model's k+1 rows at L..L+k, and the token each decides at p + 1."""
    L, count, tokens, emitted = rnd.start[0], rnd.counts[0], rnd.tokens[0], rnd.emitted[0]
    k, main = len(tokens) - 1, next(a for a in rnd.attention if a.layer == 0)
    for j in range(k + 1):
        p, name = L + j, "x_L" if j == 0 else f"d{j}"
        sub = f"{name}   ctx {rnd.verify['ctx_lens'][j]}\nkept {main.kept[j]}"
        box(ax, p, LANES[0], show(rec, tokens[j]), DARK, sub)
        arrow(ax, (p, LANES[0]), (p + 1, LANES[1]))
    for j in range(1, k + 2):
        p = L + j
        if j < count:
            box(ax, p, LANES[1], show(rec, tokens[j]), GREEN, f"d{j} accepted")
        elif j == count:
            why = f"in place of d{j}\n{show(rec, tokens[j])}, rejected" if j <= k else "the bonus token"
            box(ax, p, LANES[1], show(rec, emitted[j - 1]), ORANGE, f"main model's own,\n{why}")
        else:
            box(ax, p, LANES[1], "", "#e6e6e6", f"d{j}: not checked" if j <= k else "not needed", dark=False)


def extend_and_draft(ax, rec, rnd):
    """Lanes 3-6: draft-extend over the verify rows, the new drafts, the chained MTP rows, the next round."""
    L, count, emitted = rnd.start[0], rnd.counts[0], rnd.emitted[0]
    k, L2 = len(rnd.tokens[0]) - 1, L + count
    extend = next(a for a in rnd.attention if a.layer == "mtp" and a.phase == "extend")
    for j in range(k + 1):
        p, slot = L + j, extend.slots[j]
        if j < count:
            box(ax, p, LANES[2], f"h{p} + {show(rec, emitted[j])}", MID, f"MTP KV -> slot {slot}")
            arrow(ax, (p + 1, LANES[1]), (p, LANES[2]), color="#9ab3d9")
        else:
            box(
                ax,
                p,
                LANES[2],
                "(no token)",
                "#f7f7f7",
                "nothing emitted at p + 1:\nwrites the dummy slot 0",
                hatch="//",
                dark=False,
            )
    for j, (drafted, positions, _) in enumerate(rnd.drafts):
        if j == 0:
            source = (L2 - 1, LANES[2])
        else:
            source = (rnd.draft_rows[j - 1][0], LANES[4])
            box(ax, source[0], LANES[4], f"on d'{j}", "#c9d6ec", "MTP decode row", dark=False)
            arrow(ax, (source[0] + 1, LANES[3]), source, color="#9ab3d9")
        box(ax, positions[0], LANES[3], show(rec, drafted[0]), "#4f7cc0", f"d'{j + 1}")
        arrow(ax, source, (positions[0], LANES[3]))
    nxt = [emitted[count - 1]] + [d[0][0] for d in rnd.drafts]
    for j, t in enumerate(nxt):
        box(ax, L2 + j, LANES[5], show(rec, t), DARK, "x_L'" if j == 0 else f"d'{j}")


def round_labels(ax, rnd, first, last):
    names = [
        "1. verify\nthe main model: x_L and k drafts,\nk+1 decode rows (ctx: causal length)",
        "2. accept\nthe token each row decides\n(for position p + 1)",
        "3. draft-extend\nthe MTP layer over the same rows,\nwith the emitted tokens",
        "4. draft\nthe new drafts d'1..d'k",
        "the chained MTP decode rows\n(each on the draft before)",
        "next round verifies\nx_L' and the new drafts",
    ]
    for y, name in zip(LANES, names, strict=True):
        ax.text(first - 0.75, y, name, ha="right", va="center", fontsize=10)
    ax.set_xlim(first - 3.6, last + 0.6)
    ax.set_ylim(LANES[-1] - 0.6, LANES[0] + 0.6)
    ax.set_xticks(range(first, last + 1))
    ax.set_xlabel("position")
    for side in ("top", "right", "left"):
        ax.spines[side].set_visible(False)
    ax.set_yticks([])
    ax.set_title(
        f"One speculative round of the demo model (--mtp 3, greedy): round {rnd.number}, L = {first}: "
        f"{rnd.counts[0] - 1} drafts accepted, {rnd.counts[0]} tokens emitted",
        fontsize=12,
    )


def pages_run():
    """Four greedy --mtp 3 requests of different lengths in one engine: pages of 16 slots, a pool of 48 pages
    -> (recorder, the pool's page count)."""
    pages, page_size = 48, 16
    kv_bytes = m.KVCache.bytes_per_token(m.Config.from_json(os.path.join(ROOT, "demo", "config.json")))
    llm = m.LLM(
        device="cpu",
        mtp=3,
        page_size=page_size,
        kv_cache_bytes=pages * page_size * kv_bytes,
        cuda_graphs=False,
    )
    rec = explain.attach(llm, rounds=0)
    ids = llm.encode(PROMPT, raw=True)
    prompts = [ids[:n] for n in (20, 75, 140, 45)]
    rec.results = llm.generate(prompts, max_new_tokens=[12, 40, 24, 30], temperature=0.0)
    return rec, llm.cache.latent.shape[1] // page_size


REQUEST_COLORS = ["#4f7cc0", "#3a8f4b", "#e08a1e", "#8e5ea2"]


def snapshot(rec):
    """The last recorded round that ran every request."""
    n = len(rec.requests)
    return [r for r in rec.rounds if len(r.reqs) == n][-1]


def draw_pages(rec, num_pages):
    rnd, ps = snapshot(rec), rec.llm.pool.page_size
    owner = {p: idx for idx, pages in rnd.pages.items() for p in pages}
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(14, 7), gridspec_kw=dict(height_ratios=[0.6, 1.7]))
    for p in range(num_pages):  # the pool, page by page
        color = "#f4f4f4" if p == 0 else REQUEST_COLORS[owner[p]] if p in owner else "white"
        top.add_patch(
            Rectangle((p, 0), 0.92, 1, fc=color, ec="#555555", lw=0.7, hatch="//" if p == 0 else None)
        )
        top.text(
            p + 0.46,
            0.5,
            str(p),
            ha="center",
            va="center",
            fontsize=8,
            color="white" if p in owner else "#333333",
        )
    top.annotate(
        "page 0: the dummy slot 0's page,\nnever handed out",
        (0.5, 0),
        (1, -0.9),
        fontsize=9,
        arrowprops=dict(arrowstyle="->", lw=0.8),
    )
    top.set_xlim(-0.5, num_pages + 0.5)
    top.set_ylim(-1.3, 1.1)
    top.axis("off")
    free = num_pages - 1 - len(owner)
    top.set_title(
        f"The KV pool: {num_pages} pages of {ps} slots (slot = page * {ps} + offset); "
        f"{len(owner)} held by 4 requests, {free} free (white)",
        fontsize=11,
    )
    page_tables(bottom, rec, rnd, ps)
    fig.suptitle(
        f"Pages of four requests, as decode round {rnd.number} found them (the demo model, --mtp 3)",
        fontsize=12.5,
    )
    fig.tight_layout()
    save(fig, "page_table.png")


def page_tables(ax, rec, rnd, ps):
    """Each request's pages in position order (req.pages; PagePool.table expands them to slots), shaded by
    what their positions hold: KV written, this round's rows, reserved ahead."""
    k = rec.llm.num_draft
    for b, idx in enumerate(rnd.reqs):
        y, L, pages = len(rnd.reqs) - 1 - b, rnd.start[b], rnd.pages[idx]
        req = rec.requests[idx]
        for j, page in enumerate(pages):
            # positions with KV, this round's verify rows, reserved ahead: darkest to lightest
            for lo, hi, alpha in ((0, L, 1), (L, L + k + 1, 0.55), (L + k + 1, 10**9, 0.15)):
                a, z = max(lo, j * ps), min(hi, (j + 1) * ps)
                if a < z:
                    ax.add_patch(Rectangle((a, y), z - a, 0.7, fc=REQUEST_COLORS[idx], alpha=alpha, lw=0))
            ax.add_patch(Rectangle((j * ps, y), ps, 0.7, fc="none", ec="#333333", lw=0.8))
            ink = "white" if j * ps + ps / 2 < L else "#222222"
            ax.text(
                j * ps + ps / 2, y + 0.35, f"page {page}", ha="center", va="center", fontsize=8.5, color=ink
            )
        ax.text(
            -4,
            y + 0.35,
            f"request {idx}: {req.prompt_len}-token prompt\nL = {L}, {len(pages)} pages",
            ha="right",
            va="center",
            fontsize=9.5,
        )
    idx, p = rnd.reqs[1], ps * 2 + 5  # an example: request 1's position 37
    page = rnd.pages[idx][p // ps]
    y = len(rnd.reqs) - 2 + 0.7
    ax.annotate(
        f"request {idx}, position {p}: pages[{p} // {ps}] = page {page}, slot {page} * {ps} + {p} % {ps} "
        f"= {page * ps + p % ps}",
        (p + 0.5, y),
        (p + 0.5 + 20, y + 0.55),
        fontsize=9,
        arrowprops=dict(arrowstyle="->", lw=0.8),
    )
    width = max(len(p) for p in rnd.pages.values()) * ps
    ax.set_xlim(-70, width + 4)
    ax.set_ylim(-0.6, len(rnd.reqs))
    ax.set_xticks(range(0, width + 1, ps))
    ax.set_xlabel(
        f"request position p (page p // {ps}, offset p % {ps}); dark: KV written, mid: this round's "
        f"{k + 1} verify rows (L..L+{k}), light: reserved ahead (round_lookahead)"
    )
    ax.set_yticks([])
    for side in ("top", "right", "left"):
        ax.spines[side].set_visible(False)


def draw_life(rec):
    """One request's steps in order: its prefill chunks, its rounds (tokens emitted each), finish, retire."""
    req, result, k = rec.requests[0], rec.result, rec.llm.num_draft
    fig, (top, bottom) = plt.subplots(
        2, 1, figsize=(14, 7.4), sharex=True, gridspec_kw=dict(height_ratios=[1, 1.4])
    )
    x = 0
    for step in rec.steps:
        if isinstance(step, explain.Prefill):
            _, s, n = step.chunks[0]
            scored = any(a.scored for a in step.attention)
            label = f"prefill\n{s}..{s + n - 1}\n{f'top {rec.cfg.index_topk}' if scored else 'all kept'}"
            box(top, x, 0.1, "", "#7d9bc9" if scored else "#b9c9e3", label, dark=False, size=10.5)
        else:
            count, kept = step.counts[0], len(step.kept.get(0, ([], None))[0])
            color = ORANGE if step.number == 1 else GREEN if step.kept.get(0, (0, None))[1] else DARK
            box(top, x, 0, f"r{step.number}", color, f"L {step.start[0]}\n+{count}", size=11)
            bottom.bar(x, count, color=color, width=0.8)
            if kept < count:  # the tokens past max_new_tokens (or EOS), emitted but dropped
                bottom.bar(
                    x, count - kept, bottom=kept, color="white", edgecolor=color, hatch="//", width=0.8
                )
        x += 1
    box(top, x, 0, "retire", "#dddddd", f"{len(rec.retired[0][2])} pages\nback", dark=False, size=10.5)
    life_notes(top, bottom, rec, req, result, k, x)
    save(fig, "request_life.png")


def life_notes(top, bottom, rec, req, result, k, last):
    prefills = sum(isinstance(s, explain.Prefill) for s in rec.steps)
    arrow = dict(arrowstyle="->", lw=0.8)
    top.annotate(
        f"prompt: {req.prompt_len} tokens; prefill writes positions\n0..{req.prompt_len - 2}; the last "
        f"one, {req.prompt_len - 1}, is x_L of round 1",
        (0, 0.5),
        (-0.6, 1.35),
        fontsize=10,
        arrowprops=arrow,
    )
    top.annotate(
        f"round 1: its {k} drafts all repeat the\nMTP layer's guess from the prefill",
        (prefills, 0.5),
        (prefills + 3, 1.35),
        fontsize=10,
        arrowprops=arrow,
    )
    top.annotate(
        f"finish: {result.finish_reason} ({len(result.token_ids)} tokens);\nthen retire gives its pages back",
        (last - 1, 0.5),
        (last - 5, 1.35),
        fontsize=10,
        arrowprops=arrow,
    )
    top.set_ylim(-0.6, 2.0)
    top.axis("off")
    bottom.text((prefills - 1) / 2, 0.15, "prefill:\nno tokens", ha="center", fontsize=9.5, color="#555555")
    bottom.set_ylim(0, k + 1.2)
    bottom.set_yticks(range(k + 2))
    bottom.set_ylabel("tokens emitted")
    mean = sum(result.accept_lengths) / len(result.accept_lengths)
    bottom.axhline(mean, color=GREY, ls="--", lw=1)
    bottom.text(
        -0.4, mean + 0.06, f"mean {mean:.2f} a round", ha="left", va="bottom", fontsize=9.5, color="#555555"
    )
    bottom.set_xticks(range(last + 1))
    bottom.set_xticklabels([str(i + 1) for i in range(last + 1)])
    bottom.set_xlabel("engine step (prefill steps, then one decode round each; then retire)")
    for side in ("top", "right"):
        bottom.spines[side].set_visible(False)
    top.set_title(
        f"One request's life (the demo model, --mtp {k}, greedy, prefill chunks of 128):\nprefill, then "
        f"decode rounds that emit 1 to {k + 1} tokens each (hatched: emitted past max_new_tokens, dropped)",
        fontsize=12,
    )
    top.figure.tight_layout()


def main():
    os.makedirs(OUT, exist_ok=True)
    _, rec = solo_run()
    draw_selection(rec)
    draw_round(rec)
    draw_life(rec)
    draw_pages(*pages_run())


if __name__ == "__main__":
    main()
