"""The checks at nano-nsa's entry points: every fault in a user value is one ValueError line naming the
argument (the CLI prints it and exits 1), raised before any work. nano_nsa.py calls these; a reader of the
engine can skip them, and the default they leave: the KV pool's size. (The checks of model files, and
whether a model fits the device, live in hf_checkpoint.py.)"""

import os
import sys
from numbers import Integral, Real

import torch
import torch.distributed as dist

from parallel import all_reduce


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
    check_arg("cuda_graphs", args["cuda_graphs"], bool)


def check_kernels(kernels, device):
    """kernels is 'auto', 'torch' or 'gpu', and 'gpu' comes with a CUDA device."""
    require(
        kernels in ("auto", "torch", "gpu"), f"kernels must be 'auto', 'torch' or 'gpu' (got {kernels!r})"
    )
    gpu = torch.device(device).type == "cuda"
    require(gpu or kernels != "gpu", f"kernels='gpu' needs a CUDA device (got {device})")


def check_device(device):
    """The torch device for a user's `device` value (None: a GPU if there is one)."""
    try:
        default = "cuda" if torch.cuda.is_available() else "cpu"
        dev = torch.device(default if device is None else device)  # ("" and 0 are devices asked for)
    except (RuntimeError, TypeError):
        raise ValueError(f"unknown device {device!r}") from None
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


def pool_bytes(kv_cache_bytes, device):
    """The KV pool's size: kv_cache_bytes, or CPU 256 MiB, GPU 80% of what is free (after loading)."""
    if kv_cache_bytes is not None:
        return kv_cache_bytes
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0] * 0.8)
    return 256 << 20


def pool_pages(kv_cache_bytes, page_size, kv_bytes_per_token, device, lookahead):
    """The KV pool's pages: pool_bytes (after the weights are loaded) in pages, the fewest over the ranks (one
    schedule for all), checked to hold a request (check_pool)."""
    page_bytes = kv_bytes_per_token * page_size
    pages = torch.tensor([pool_bytes(kv_cache_bytes, device) // page_bytes], device=device)
    pages = int(all_reduce(pages, dist.ReduceOp.MIN))
    check_pool(pages, page_size, lookahead)
    return pages


def check_pool(num_pages, page_size, lookahead):
    """A KV pool that can hold one request: a one-token prompt, one new token and the `lookahead` slots a
    decode round may write past them (a huge page_size or mtp leaves none)."""
    need = 2 + lookahead
    room = (num_pages - 1) * page_size  # (page 0 is the dummy page)
    require(
        room >= need,
        f"the KV pool's {num_pages} pages of {page_size} slots hold {max(room, 0)} usable slots, fewer than"
        f" one request's decode round needs ({need}): give a larger kv_cache_bytes, or a smaller page_size"
        " or mtp",
    )


def is_token_list(p):
    return isinstance(p, (list, tuple)) and all(is_number(t, integer=True) for t in p)


def per_prompt(name, value, n):
    """A generate argument that takes one value for every prompt or a list of one per prompt, as a list."""
    if not isinstance(value, (list, tuple)):
        return [value] * n
    require(len(value) == n, f"{name} has {len(value)} values for {n} prompts")
    return list(value)


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
    check_texts(prompts)
    for name, rule in SAMPLING.items():
        values = [args[name]]
        if name in ("max_new_tokens", "seed"):  # one value, or one per prompt
            values = per_prompt(name, args[name], len(prompts))
        for value in values:
            if not (name == "seed" and args[name] is None):  # (None: a fresh seed; not inside a list)
                check_arg(name, value, *rule)
    for name in FLAGS:
        check_arg(name, args[name], bool)
    check_modes(args["thinking"], args["raw"])
    require(on_tokens is None or callable(on_tokens), f"on_tokens must be a function (got {on_tokens!r:.80})")
    return list(prompts)


def check_modes(thinking, raw):
    """thinking is a mode of the chat template; raw prompts have none."""
    require(not (thinking and raw), "thinking=True is a mode of the chat template, which raw=True leaves out")


def check_texts(prompts):
    """Text prompts the tokenizer can take: no lone surrogate (what Python makes of the bytes of a command
    line argument that are not UTF-8)."""
    for i, p in enumerate(prompts):
        if isinstance(p, str):
            bad = next((j for j, c in enumerate(p) if "\ud800" <= c <= "\udfff"), None)
            require(
                bad is None, f"prompt {i} is not valid Unicode text (a lone surrogate at character {bad})"
            )


def check_prompt(i, ids, max_new, vocab_size, max_context, capacity, lookahead):
    """Prompt i's token ids: not empty, in the vocabulary, fitting the context limit and, one day, the KV
    pool of `capacity` slots (with the `lookahead` slots a decode round may write past a request's end)."""
    require(ids, f"prompt {i} is empty")
    in_vocab = min(ids) >= 0 and max(ids) < vocab_size
    require(in_vocab, f"prompt {i} has token ids outside [0, {vocab_size})")
    too_long = (
        f"prompt {i} has {len(ids)} tokens; with max_new_tokens={max_new} it exceeds the context "
        f"limit of {max_context} tokens"
    )
    require(len(ids) + max_new <= max_context, too_long)
    never_fits = (
        f"prompt {i} ({len(ids)} tokens + {max_new} new) can never fit in the KV pool of {capacity} "
        "slots; give the engine a larger kv_cache_bytes (the command line's --kv-cache-gb)"
    )
    require(len(ids) + max_new + lookahead <= capacity, never_fits)
