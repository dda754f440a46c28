"""DeepSeek-V3.2's chat template (docs/model.md §9): the special tokens and the text a conversation becomes
before the tokenizer reads it. nano_nsa.LLM.encode calls it; a reader of the engine can skip this file."""

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
THINK = "<think>"
END_THINK = "</think>"
SPECIAL_TOKENS = (BOS, EOS, USER, ASSISTANT, THINK, END_THINK)  # one token each (ids 0, 1, 128798-128804)


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
