"""--explain: one request's life through the engine, recorded from what the engine computed and narrated.

    rec = explain.attach(llm)           # an engine built with cuda_graphs=False: recording reads tensors
    result = llm.generate([prompt])[0]  # runs as always; the recorder only watches
    print(rec.narrate(result))          # prefill, the first rounds phase by phase, a line for the rest

How it watches, without a print or hook in the layers: through the kernel boundary. Every module of the model
gets its own copy of the model's ops table (a SimpleNamespace with the same names), a few names of it wrapped
to record their inputs or outputs before handing them on unchanged:
    the model's own      take (a round's x_L and drafts), decode_rows (its rows: position, causal length,
                         slot), rejection_sample (drafts, emitted tokens, counts), sample (the new drafts)
    each MLA's           side_by_side: the queries beside the indexer, whose output is the positions each row
                         attends to, whether the indexer scored them (index_topk) or took every position
                         because the table is no wider than index_topk (then index_topk is not called)
    each indexer's       index_topk: marks that the indexer really scored and selected
and three of the engine's named steps, wrapped on the instance: LLM.prefill (its chunks), LLM.apply (the
tokens a round's request kept, and whether it finished) and Scheduler.retire (the pages it gave back).
A round runs verify -> accept -> draft-extend -> draft (nano_nsa.speculative_round): the recorder tells the
phases apart by the order of those calls. Recorded tensors are copied to the host at once, so on a GPU the
engine must run eagerly (no CUDA graph replays the ops' Python). A recorder watches one generate call (it keys
requests by their place in the prompt list); detach() gives the engine back its own ops and methods. It keeps
every layer's rows of every prefill step and of the first `rounds` rounds: meant for prompts of hundreds or
thousands of tokens, not for serving.
"""

import textwrap
from dataclasses import dataclass, field
from types import SimpleNamespace

import torch


@dataclass
class Attention:
    """One MLA layer's rows in one forward pass, as its side_by_side saw them."""

    layer: object  # a main layer's index, or "mtp" (the MTP layer's block)
    phase: str  # "prefill", "verify", "extend" or "draft"
    positions: list  # each row's position
    ctx_lens: list  # each row's causal length (position + 1)
    slots: list  # the KV slot each row writes (0: the dummy slot)
    width: int  # the table's width W (Meta.max_ctx): the indexer scores W positions, or skips if W <= K
    scored: bool  # index_topk ran (False: every row keeps its whole context, unscored)
    kept: list  # how many positions each row attends to
    selected: torch.Tensor = None  # [rows, min(K, W)] the kept positions (-1: none); the chosen layers only


@dataclass
class Prefill:
    """A prefill step: prompt chunks (request, first position, length) through the main model, then MTP."""

    step: int
    chunks: list
    attention: list = field(default_factory=list)


@dataclass
class Round:
    """A speculative round, per request row b: tokens[b] = x_L, d_1..d_k at positions start[b]..+k."""

    step: int
    number: int  # 1, 2, ... in launch order
    reqs: list  # the request (idx) of each row
    pages: dict  # request idx -> its pages (PagePool) when the round ran
    tokens: list
    start: list
    greedy: list
    verify: dict = None  # decode_rows of the verify: positions, ctx_lens, slots (flat, k+1 a request)
    attention: list = field(default_factory=list)
    p_q: list = None  # [b][j] (p(d_j), q(d_j)): the acceptance test's two probabilities
    emitted: list = None  # [b] the k+1 tokens rejection_sample returned (the first counts[b] are real)
    counts: list = None
    draft_rows: list = field(default_factory=list)  # [step] positions of the MTP's chained decode rows
    drafts: list = field(default_factory=list)  # [step] (tokens [B], positions [B], q(token) [B])
    kept: dict = field(default_factory=dict)  # request idx -> (tokens it kept, finish) once applied


def layer_label(name):
    """'layers.3.attn' -> 3; 'mtp.0.block.attn' -> 'mtp'."""
    parts = name.split(".")
    return int(parts[1]) if parts[0] == "layers" else "mtp"


class Recorder:
    """Records what an engine does for its requests (attach installs it). steps: Prefill and Round records in
    order; rounds: the Round records; retired: (after step, request idx, pages given back). rounds: how many
    rounds keep their attention records; layers: whose selections keep their positions (a main layer's
    index, or "mtp")."""

    def __init__(self, llm, rounds=3, layers=(0,)):
        self.llm, self.cfg, self.tokenizer = llm, llm.cfg, llm.tokenizer
        self.detail, self.layers = rounds, set(layers)
        self.steps, self.rounds, self.retired = [], [], []
        self.current = None  # the step whose ops are running
        self.phase = None
        self.scored = False
        self.applied = 0  # rounds applied so far (LLM.apply runs them in launch order)
        self.base = llm.model.ops
        self.requests = {}  # idx -> Request, as seen

    # ---- installing and removing ----
    def install(self):
        for name, mod in self.llm.model.named_modules():
            mod.ops = self.table(name)
        llm, sched = self.llm, self.llm.scheduler
        llm.prefill = self.wrap(llm.prefill, self.prefill_done, self.prefill_begins)
        llm.apply = self.wrap(llm.apply, self.applied_round, self.apply_begins)
        sched.retire = self.wrap(sched.retire, lambda out: None, self.retire_begins)
        return self

    def detach(self):
        """Give the model back its ops table and the engine its own methods."""
        for mod in self.llm.model.modules():
            mod.ops = self.base
        for obj, name in ((self.llm, "prefill"), (self.llm, "apply"), (self.llm.scheduler, "retire")):
            vars(obj).pop(name, None)

    def table(self, name):
        """The ops table of module `name`: the model's, with its recorded names wrapped."""
        ops, base = SimpleNamespace(**vars(self.base)), self.base
        if name == "":  # the Transformer: the engine's ops (speculative_round, draft, accept)
            ops.take = self.wrap(base.take, self.took)
            ops.decode_rows = self.wrap(base.decode_rows, self.decode_rows)
            ops.rejection_sample = self.wrap(base.rejection_sample, self.accepted)
            ops.sample = self.wrap(base.sample, self.drafted)
        elif name.endswith(".attn"):
            label = layer_label(name)
            after = lambda out, *args, **kwargs: self.attended(label, out, *args, **kwargs)  # noqa: E731
            ops.side_by_side = self.wrap(base.side_by_side, after, self.attention_begins)
        elif name.endswith(".attn.indexer"):
            ops.index_topk = self.wrap(base.index_topk, self.indexed)
        return ops

    @staticmethod
    def wrap(fn, after, before=None):
        """fn, calling before(*args) first (if given) and after(its result, *args) once it returns (the
        recorders' parameters are named as the ops' and steps' own)."""

        def wrapped(*args, **kwargs):
            if before:
                before(*args, **kwargs)
            out = fn(*args, **kwargs)
            after(out, *args, **kwargs)
            return out

        return wrapped

    # ---- the engine's steps ----
    def prefill_begins(self, chunks):
        self.requests.update({r.idx: r for r, _, _ in chunks})
        self.current = Prefill(len(self.steps), [(r.idx, s, n) for r, s, n in chunks])
        self.steps.append(self.current)
        self.phase = "prefill"

    def prefill_done(self, out, chunks):
        self.current = None

    def apply_begins(self, reqs, fetch, logits):
        self.before = [(len(r.tokens), r.finish) for r in reqs]  # where the round's tokens will go

    def applied_round(self, out, reqs, fetch, logits):
        rnd = self.rounds[self.applied]  # (LLM.apply takes rounds in launch order)
        self.applied += 1
        for r, (n, finish) in zip(reqs, self.before, strict=True):
            if finish is None:  # (a request that had finished skips the round: nothing kept)
                rnd.kept[r.idx] = (r.tokens[n:], r.finish)

    def retire_begins(self):
        sched = self.llm.scheduler
        gone = [(r.idx, list(r.pages)) for r in sched.running + sched.waiting if r.finish]
        self.retired += [(len(self.steps) - 1, idx, pages) for idx, pages in gone]

    # ---- a round's ops ----
    def took(self, batch, state, ids):
        rows = {r.row: r for r in self.llm.scheduler.running}
        reqs = [rows[i] for i in ids.tolist()]
        self.requests.update({r.idx: r for r in reqs})
        tokens, start, greedy = batch.tokens.tolist(), batch.start.tolist(), (batch.temperature == 0).tolist()
        pages = {r.idx: list(r.pages) for r in reqs}
        args = (len(self.steps), len(self.rounds) + 1, [r.idx for r in reqs], pages, tokens, start, greedy)
        self.current = Round(*args)
        self.steps.append(self.current)
        self.rounds.append(self.current)
        self.phase = "verify"

    def decode_rows(self, out, start, n, table):
        if not isinstance(self.current, Round):
            return
        positions, _, slots, ctx_lens = (t.tolist() for t in out)
        if self.phase == "verify":
            self.current.verify = dict(positions=positions, ctx_lens=ctx_lens, slots=slots)
        else:  # a chained draft step of the MTP layer
            self.phase = "draft"
            self.current.draft_rows.append(positions)

    def accepted(self, out, p, q, drafts, seeds, start):
        emitted, counts = out
        rnd = self.current
        rnd.emitted, rnd.counts = emitted.tolist(), counts.tolist()
        px = p[:, : drafts.shape[1]].gather(-1, drafts[..., None])[..., 0]
        qx = q.gather(-1, drafts[..., None])[..., 0] if q is not None else px
        rnd.p_q = torch.stack([px, qx], -1).tolist()
        self.phase = "extend"  # the MTP layer's pass over the verify rows comes next

    def drafted(self, token, probs, seeds, positions, stream):
        if isinstance(self.current, Round):
            q = probs.gather(-1, token[:, None])[:, 0]
            self.current.drafts.append((token.tolist(), positions.tolist(), q.tolist()))
            self.phase = "draft"

    # ---- attention, layer by layer ----
    def indexed(self, out, *args, **kwargs):
        self.scored = True

    def attention_begins(self, *args, **kwargs):
        self.scored = False

    def attended(self, label, out, first, first_args, second, second_args):
        if self.current is None or (isinstance(self.current, Round) and self.current.number > self.detail):
            return
        meta = next(a for a in second_args if hasattr(a, "ctx_lens"))  # the indexer's Meta
        selected = out[1]
        kept = (selected >= 0).sum(-1).tolist()
        rows = (meta.positions.tolist(), meta.ctx_lens.tolist(), meta.slots.tolist())
        att = Attention(label, self.phase, *rows, meta.max_ctx, self.scored, kept)
        if label in self.layers:
            att.selected = selected.to("cpu", torch.int32)
        self.current.attention.append(att)

    # ---- reading the records ----
    def show(self, token):
        """A token as text: its decoded string's repr (BOS and EOS by name)."""
        names = {self.cfg.bos_token_id: "BOS", self.cfg.eos_token_id: "EOS"}
        return names.get(token) or repr(self.tokenizer.decode([token]))

    def narrate(self, result=None, idx=0):
        """The story of request idx (its Result, if given, for the finish): see narrate_lines."""
        return "\n".join(narrate_lines(self, idx, result))


def attach(llm, rounds=3, layers=(0,)):
    """Start recording what llm does (Recorder) -> the recorder. The engine must run eagerly: build it with
    cuda_graphs=False (the CLI's --explain does)."""
    if llm.graphs is not None:
        raise ValueError("--explain records each op as it runs: build the engine with cuda_graphs=False")
    if hasattr(llm.model.ops, "recorder"):
        raise ValueError("a recorder is attached to this engine already")
    rec = Recorder(llm, rounds, layers).install()
    llm.model.ops.recorder = rec  # (the Transformer's table, the wrapping one: marked)
    return rec


# ---- the narration -----------------------------------------------------------------------------------------
WIDTH = 110  # prose wraps at this width; token lists and tables never do (the reprs keep their spaces)


def plural(count, word):
    """'1 page', '2 pages'."""
    return f"{count} {word}{'s' * (count != 1)}"


def para(indent, text):
    """A paragraph, wrapped at WIDTH, its later lines indented under its first word."""
    return textwrap.wrap(text, WIDTH, initial_indent=indent, subsequent_indent=" " * (len(indent) + 2))


def narrate_lines(rec, idx, result):
    """Header, prefill, the first rec.detail rounds phase by phase, a line for the rest, the finish."""
    req = rec.requests.get(idx)
    if req is None:
        return [f"explain: request {idx} ran no step"]
    k, K, ps = rec.llm.num_draft, rec.cfg.index_topk, rec.llm.pool.page_size
    pages = next((r.pages[idx] for r in rec.rounds if idx in r.pages), req.pages)
    shown = pages if len(pages) <= 6 else f"{pages[:3]} ... {pages[-2:]}"
    prompt = plural(req.prompt_len, "prompt token")
    lines = [f"=== explain: request {idx}: {prompt}, up to {req.max_new_tokens} new ==="]
    lines += para(
        "",
        f"{k} drafts a round (--mtp {k}); the indexer keeps K = {K} positions a row; kernels: "
        f"{rec.base.name}. KV pages of {ps} slots: {plural(len(pages), 'page')} {shown}, position p in page "
        f"p // {ps} "
        "(page 0 holds the dummy slot 0, never handed out)",
    )
    prefills = [s for s in rec.steps if isinstance(s, Prefill) and any(c[0] == idx for c in s.chunks)]
    lines += prefill_lines(rec, idx, req, prefills)
    rounds = [r for r in rec.rounds if idx in r.reqs]
    for rnd in rounds[: rec.detail]:
        lines += round_lines(rec, idx, rnd)
    lines += rest_lines(rec, idx, rounds[rec.detail :])
    return lines + finish_lines(rec, idx, req, rounds, result)


def prefill_lines(rec, idx, req, prefills):
    """The prompt's chunks: positions, all kept or top K, what the indexer kept; the MTP layer's guess."""
    P, K = req.prompt_len, rec.cfg.index_topk
    if not prefills:
        return ["", "prefill: none (a one-token prompt: its token is x_L of round 1)"]
    lines = [""] + para(
        "",
        f"prefill: the main model{', then the MTP layer,' * bool(rec.llm.num_draft)} over positions "
        f"0..{P - 2} in {plural(len(prefills), 'step')}. "
        f"The last prompt token {rec.show(req.tokens[P - 1])} (position {P - 1}) is not prefilled: it is "
        "x_L, the first token round 1 verifies.",
    )
    for step in prefills:
        b = [c[0] for c in step.chunks].index(idx)
        rows = slice(sum(c[2] for c in step.chunks[:b]), sum(c[2] for c in step.chunks[: b + 1]))
        _, s, n = step.chunks[b]
        att = next((a for a in step.attention if a.layer == 0), None)
        lines += para("  ", f"step {step.step + 1}: positions {s}..{s + n - 1} ({n} rows), {form(att, K)}")
        if att is not None:
            lines += kept_lines(att.positions[rows], att.ctx_lens[rows], att.kept[rows], K)
    first = next((r for r in rec.rounds if idx in r.reqs), None)
    if first is not None and rec.llm.num_draft:
        guess = first.tokens[first.reqs.index(idx)][1]
        lines += para(
            "  ",
            f"the MTP layer's guess for position {P}, from the last prefilled row: {rec.show(guess)}; round "
            f"1's {rec.llm.num_draft} drafts all repeat it (only d1 is a real guess)",
        )
    return lines


def form(att, K, short=False):
    """What a pass's indexer did: kept all (it skipped the scoring) or kept the top K (it scored)."""
    if att is None:
        return "(not recorded)"
    if short and att.scored:
        return f"top K: the table is {att.width} wide > K, the indexer scored each row's context, kept {K}"
    if short:
        return f"all kept: the table is {att.width} wide <= K, the indexer kept every row's context unscored"
    if not att.scored:
        return (
            f"all kept: the table is {att.width} wide <= K = {K}, so the indexer keeps every row's whole "
            "causal context without scoring (index_topk is not called)"
        )
    return (
        f"top K: the table is {att.width} wide > K = {K}, so the indexer scores each row's causal context "
        f"and keeps its top {K} (index_topk); MLA attends to the kept positions only"
    )


def kept_lines(positions, ctx_lens, kept, K):
    """Prefill rows grouped: those whose causal context fits in K keep it all; the others keep K of it."""
    whole = [i for i, (c, n) in enumerate(zip(ctx_lens, kept, strict=True)) if n == c]
    some = [i for i in range(len(kept)) if i not in set(whole)]
    lines = []
    if whole:
        first, last = positions[whole[0]], positions[whole[-1]]
        lines.append(f"    rows at positions {first}..{last} (causal length <= {K}): kept all of it")
    if some:
        counts = "/".join(map(str, sorted({kept[i] for i in some})))
        lines.append(
            f"    rows at positions {positions[some[0]]}..{positions[some[-1]]}: kept {counts} of their "
            f"{ctx_lens[some[0]]}..{ctx_lens[some[-1]]} positions"
        )
    return lines


def round_lines(rec, idx, rnd):
    """One round of request idx, phase by phase: verify, accept, draft-extend, draft."""
    b, k, K = rnd.reqs.index(idx), len(rnd.tokens[0]) - 1, rec.cfg.index_topk
    L, rows = rnd.start[b], slice(b * (len(rnd.tokens[0])), (b + 1) * len(rnd.tokens[0]))
    main = next((a for a in rnd.attention if a.layer == 0), None)
    first = ""
    if rnd.number == 1 and k:  # (a one-token prompt has no prefill, so no guess: its drafts are token 0)
        prefilled = any(isinstance(s, Prefill) and idx in [c[0] for c in s.chunks] for s in rec.steps)
        first = (
            " (its drafts: the prefill's guess, repeated)" if prefilled else " (drafts: token 0, no guess)"
        )
    lines = ["", f"round {rnd.number} (step {rnd.step + 1}): L = {L}, the position of x_L{first}"]
    if main is None:
        return lines + ["  (not recorded)"]
    what = (
        f"over x_L and the {k} drafts, {k + 1} decode rows, each with" if k else "over x_L, a decode row with"
    )
    how = f"its own causal length; {form(main, K, short=True)}"
    lines += para("  verify   " if k else "  decode   ", f"the main model {what} {how}")
    lines.append("             row   position  causal length  kept (layer 0)  token")
    positions, ctx, kept = rnd.verify["positions"][rows], rnd.verify["ctx_lens"][rows], main.kept[rows]
    for j, name in enumerate(["x_L"] + [f"d{j}" for j in range(1, k + 1)]):
        token = rec.show(rnd.tokens[b][j])
        lines.append(
            f"             {name:<4}{positions[j]:>10}{ctx[j]:>15}{kept[j]:>9} of {ctx[j]:<6} {token}"
        )
    lines += accept_lines(rec, rnd, b)
    if k:
        lines += extend_lines(rec, rnd, b)
        lines += draft_lines(rec, rnd, b)
    return lines


def accept_lines(rec, rnd, b):
    """Which drafts the main model accepted (sampled: with p(d) and q(d), the test being u q <= p), its own
    token, what the round emitted."""
    tokens, count, emitted = rnd.tokens[b], rnd.counts[b], rnd.emitted[b]
    k, L = len(tokens) - 1, rnd.start[b]
    own = f"the main model's own token for position {L + count}"
    if not k:
        return [f"  accept   {own}: {rec.show(emitted[0])}", f"           emitted 1: {rec.show(emitted[0])}"]
    lines = []
    for j in range(1, k + 1):
        what = "accepted" if j < count else "rejected" if j == count else "not checked (after a rejection)"
        if j <= count and not rnd.greedy[b]:
            p, q = rnd.p_q[b][j - 1]
            what += f" (p {prob(p)}, q {prob(q)})"
        lines.append(f"{'  accept   ' if j == 1 else ' ' * 11}d{j} {rec.show(tokens[j])} {what}")
    bonus = "the bonus, after every draft" if count == k + 1 else f"in place of d{count}"
    return lines + [
        f"           {own} ({bonus}): {rec.show(emitted[count - 1])}",
        f"           emitted {count}: {' '.join(rec.show(t) for t in emitted[:count])}",
    ]


def prob(x):
    """A probability, two decimals (a small one in two significant digits)."""
    return f"{x:.2f}" if x >= 0.01 or x == 0 else f"{x:.1e}"


def extend_lines(rec, rnd, b):
    """Draft-extend: the MTP layer over the verify rows; rows past the emitted tokens write slot 0."""
    k, L, count = len(rnd.tokens[b]) - 1, rnd.start[b], rnd.counts[b]
    mtp = next((a for a in rnd.attention if a.layer == "mtp" and a.phase == "extend"), None)
    lines = para(
        "  extend   ",
        f"the MTP layer over the same {k + 1} rows: row p pairs the main model's h_p with the token "
        "emitted after it, and writes the MTP layer's KV of position p",
    )
    for j in range(k + 1):
        slot = mtp.slots[b * (k + 1) + j] if mtp else "?"
        if j < count:
            lines.append(
                f"             row {L + j}: h_{L + j} + {rec.show(rnd.emitted[b][j])} -> slot {slot}"
            )
        else:
            lines.append(f"             row {L + j}: nothing emitted at {L + j + 1} -> the dummy slot {slot}")
    return lines


def draft_lines(rec, rnd, b):
    """Draft: d'1 from the last emitted token's extend row, then chained MTP decode steps."""
    L2 = rnd.start[b] + rnd.counts[b]
    steps = [a for a in rnd.attention if a.layer == "mtp" and a.phase == "draft"]
    lines = [f"  draft    L' = {L2}, the position of the last emitted token; the new drafts:"]
    for j, (tokens, positions, q) in enumerate(rnd.drafts):
        source = f"the extend row at {L2 - 1}"
        if j:
            att = steps[j - 1] if j - 1 < len(steps) else None
            kept = f", kept {att.kept[b]} of {att.ctx_lens[b]}" if att else ""
            source = f"MTP decode row {rnd.draft_rows[j - 1][b]} on d'{j}{kept}"
        drawn = "" if rnd.greedy[b] else f" (q {prob(q[b])})"
        lines.append(f"             d'{j + 1} at {positions[b]}: {rec.show(tokens[b])}{drawn}  <- {source}")
    nxt = [rnd.emitted[b][rnd.counts[b] - 1]] + [t[b] for t, _, _ in rnd.drafts]
    shown = " ".join(rec.show(t) for t in nxt)
    lines.append(f"  next     round {rnd.number + 1} verifies {shown} at positions {L2}..{L2 + len(nxt) - 1}")
    return lines


def rest_lines(rec, idx, rounds):
    """One line for the rounds after the narrated ones."""
    applied = [r for r in rounds if idx in r.kept]
    if not applied:
        return []
    counts = [r.counts[r.reqs.index(idx)] for r in applied]
    hist = {n: counts.count(n) for n in range(1, rec.llm.num_draft + 2)}
    widest = max(r.verify["ctx_lens"][-1] for r in applied)
    first, last, mean = applied[0].number, applied[-1].number, sum(counts) / len(counts)
    which = f"rounds {first}..{last}" if last > first else f"round {first}"
    return [""] + para(
        "",
        f"{which}: {plural(len(applied), 'more round')} emitted {plural(sum(counts), 'token')}; rounds by "
        f"tokens emitted {hist} (mean {mean:.2f}); their verify rows kept min({rec.cfg.index_topk}, causal "
        f"length) of up to {widest} positions",
    )


def finish_lines(rec, idx, req, rounds, result):
    """How the request finished, the rounds launched after that, its retirement."""
    finish = result.finish_reason if result is not None else req.finish
    last = next((r for r in reversed(rounds) if idx in r.kept and r.kept[idx][1]), None)
    lines = [""]
    if last is not None:
        kept, count = len(last.kept[idx][0]), last.counts[last.reqs.index(idx)]
        why = "EOS" if finish == "eos" else f"max_new_tokens ({req.max_new_tokens}) reached"
        lines.append(
            f"finish: {finish}: {why} in round {last.number} (it kept {kept} of its {plural(count, 'token')})"
        )
        for r in rounds[rounds.index(last) + 1 :]:
            lines += para(
                "  ",
                f"round {r.number} had been launched before round {last.number} was applied (the host runs "
                "one round ahead): its tokens are dropped",
            )
    for step, i, pages in rec.retired:
        if i == idx:
            lines.append(
                f"retire: after step {step + 1}, it gives {plural(len(pages), 'page')} back to the pool"
            )
    lines.append(
        f"generated {plural(len(req.tokens) - req.prompt_len, 'token')} in {plural(len(rounds), 'round')}"
    )
    return lines
