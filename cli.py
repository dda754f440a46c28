"""The command line of `python nano_nsa.py`: its options, reading prompts, streaming text, printing results
and generate's stats (LLM.stats), and leaving torchrun's process group. nano_nsa.main ties them to the
engine; a reader of the engine can skip this file."""

import argparse
import functools
import json
import os
import sys

import torch
import torch.distributed as dist

import hf_checkpoint
from checks import SAMPLING, check_arg, check_modes, check_texts, require


def parse(argv):
    """The options, parsed; a bad option is one line and exit code 2 (no usage dump)."""
    ap = argparse.ArgumentParser(
        description="DeepSeek-V3.2 inference (DSA sparse attention, MTP speculative decoding)."
    )
    ap.add_argument("--model", help="DeepSeek-V3.2 checkpoint directory (default: demo/, a tiny trained one)")
    ap.add_argument("--prompt", action="append", default=[], help="prompt text (repeatable)")
    ap.add_argument("--prompt-file", help="a file with one prompt per line")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    from_model = "default: the model's generation_config.json, else "
    ap.add_argument("--temperature", type=float, help=from_model + "0 (greedy)")
    ap.add_argument("--top-p", type=float, help=from_model + "1")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--mtp", type=int, default=1, help="draft tokens per round (0 = no speculative decoding)")
    ap.add_argument("--device", help="cpu or cuda (default: cuda if available)")
    ap.add_argument("--thinking", action="store_true", help="chat in thinking mode")
    ap.add_argument("--raw", action="store_true", help="plain completion, no chat template")
    ap.add_argument("--max-context", type=int, help="refuse prompts + max_new_tokens longer than this")
    pool_help = "the KV pool, GiB (default: 0.25 on a CPU, 80%% of the free memory on a GPU)"
    ap.add_argument("--kv-cache-gb", type=float, help=pool_help)
    kernels_help = "auto: kernels.py if the GPU supports it; torch: the references; gpu: kernels.py or error"
    ap.add_argument("--kernels", default="auto", choices=["auto", "torch", "gpu"], help=kernels_help)
    ap.add_argument("--no-cuda-graphs", action="store_true", help="run decode rounds eagerly (GPU)")
    ap.add_argument("--json", action="store_true", help="print one JSON document instead of streaming text")
    explain_help = "narrate the request's prefill and first rounds (explain.py; one prompt; no CUDA graphs)"
    ap.add_argument("--explain", action="store_true", help=explain_help)
    ap.error = lambda message: ap.exit(2, f"error: {message}\n")
    return ap.parse_args(argv)


def read_prompts(args):
    """The prompts of --prompt and --prompt-file, after checking generate's options as generate will (before
    any work: a model may take minutes to load)."""
    prompts = list(args.prompt)
    if args.prompt_file:
        try:
            with open(args.prompt_file, encoding="utf-8-sig") as f:  # (a byte-order mark is not text)
                lines = [line.rstrip("\n") for line in f if line.strip()]
        except UnicodeDecodeError as e:
            raise ValueError(f"{args.prompt_file}: not UTF-8 text ({e.reason} at byte {e.start})") from None
        require(lines, f"{args.prompt_file}: no prompt in it (one a line; blank lines are skipped)")
        prompts += lines
    require(prompts, "give at least one --prompt or a --prompt-file")
    require(not args.explain or len(prompts) == 1, f"--explain takes one prompt (got {len(prompts)})")
    check_texts(prompts)
    # temperature and top_p not given: the checkpoint's decoding defaults (generation_config.json) or greedy
    model_dir = args.model or hf_checkpoint.default_model_dir()
    defaults = dict(temperature=0.0, top_p=1.0) | hf_checkpoint.generation_defaults(model_dir)
    for name, value in defaults.items():
        setattr(args, name, value if getattr(args, name) is None else getattr(args, name))
    for name, rule in SAMPLING.items():
        check_arg(name, getattr(args, name), *rule)
    check_modes(args.thinking, args.raw)
    return prompts


def engine_options(args):
    """LLM's options from the command line's (--kv-cache-gb checked, then in bytes)."""
    pool = None
    if args.kv_cache_gb is not None:
        check_arg("--kv-cache-gb", args.kv_cache_gb, float, 0, open_low=True)
        pool = int(args.kv_cache_gb * 2**30)
    return dict(
        kv_cache_bytes=pool,
        device=args.device,
        mtp=args.mtp,
        max_context=args.max_context,
        kernels=args.kernels,
        cuda_graphs=not (args.no_cuda_graphs or args.explain),  # (--explain reads each op's tensors)
    )


def generate_options(args):
    """generate's options from the flags (read_prompts filled in the decoding defaults)."""
    names = ("max_new_tokens", "temperature", "top_p", "seed", "thinking", "raw")
    return {name: getattr(args, name) for name in names}


def streams(args, prompts):
    """Whether the text streams as it is generated: one prompt, not --json."""
    return not args.json and len(prompts) == 1


def exit_code(main):
    """main(argv) as a process's exit code: 0 once it returns; 1 for a bad input or settings too large for the
    machine's memory (error: one line); 130 for Ctrl-C."""

    @functools.wraps(main)
    def run(argv=None):
        try:
            main(argv)
        except (ValueError, OSError, RuntimeError) as e:  # (RuntimeError: out of memory; error raises others)
            return error(e)
        except KeyboardInterrupt:
            return 130
        return 0

    return run


def error(e):
    """A bad input, or settings too large for the machine's memory: one line on stderr, exit code 1. Any other
    RuntimeError is a bug: raised again, with its traceback."""
    out_of_memory = isinstance(e, torch.OutOfMemoryError) or "can't allocate memory" in str(e)  # (GPU, CPU)
    if isinstance(e, RuntimeError) and not out_of_memory:
        raise e
    if isinstance(e, BrokenPipeError):  # stdout's reader went away (`| head`): nothing to tell it
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # (nor a second error at exit)
        return 1
    print("error: " + str(e).replace("\n", " "), file=sys.stderr)
    return 1


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


def print_results(args, prompts, results, stats, stream):
    """The texts (the rest of a streamed one: stream held back an unfinished character at its end), or one
    JSON document, then a line of stats on stderr."""
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
        if stream:
            print(r.text[len(stream.printed) :], flush=True)  # (streamed already, but for such a character)
        else:
            print(f"--- {p!r}\n{r.text}")
    spec = ""
    if stats["mean_accept_length"] is not None:
        spec = f", mean accepted length {stats['mean_accept_length']:.2f}"
        spec += f", acceptance histogram {stats['accept_histogram']}"
    speed = f"{stats['tokens']} tokens in {stats['seconds']:.2f} s, {stats['tokens_per_s']:.1f} tokens/s"
    n, k = stats["longest_context"], stats["index_topk"]
    dsa = f"; DSA: every token saw all of its <= {n} positions (within top-{k})"
    if n > k:
        dsa = f"; DSA: each token attended to the indexer's top {k} of its up to {n} positions"
    print(f"[{speed}{spec}{dsa}]", file=sys.stderr)


def end_distributed(graphed):
    """Leave torchrun's process group. NCCL cannot destroy a communicator whose collectives CUDA graphs
    captured (destroy_process_group hangs: pytorch issue 115388), so then the ranks only meet once more and
    exit."""
    if dist.is_initialized() and graphed:
        dist.barrier()
    elif dist.is_initialized():
        dist.destroy_process_group()
