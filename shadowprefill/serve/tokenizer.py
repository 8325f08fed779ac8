"""A trivial byte-level tokenizer and chat template for the built-in engine server.

The project's tiny models have no trained tokenizer; the server maps text to token ids one UTF-8 byte per
token, shifted past three special ids (0 pad, 1 BOS, 2 EOS), so any vocabulary of >= 259 ids serves text.
Decoding drops ids that are not bytes (specials, or ids past the byte range that a random-weight model
may sample) so every generated id still maps to a (possibly empty) string.

The chat template is plain text, one turn per message: `<|role|>\\ncontent\\n`, then `<|assistant|>\\n`
when a generation prompt is added. A conversation's rendering up to the end of an assistant message's
content (`continue_final_message=True`) is a prefix of the next turn's rendering: that is the "next
turn's prefix" the manager shadows for chat calls (paper appendix D.1). The vLLM harness ships the same
template as a Jinja string (`CHAT_TEMPLATE_JINJA`) so both peers render chats identically.
"""
from __future__ import annotations

from typing import Sequence

NUM_SPECIAL = 3
BOS_ID, EOS_ID = 1, 2

CHAT_TEMPLATE_JINJA = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}"
    "{% if not (loop.last and continue_final_message is defined and continue_final_message) %}\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


class ByteTokenizer:
    """UTF-8 bytes <-> token ids `byte + 3`; needs `vocab_size >= 259`."""

    def __init__(self, vocab_size: int) -> None:
        if isinstance(vocab_size, bool) or not isinstance(vocab_size, int):
            raise TypeError(f"vocab_size must be an int, got {type(vocab_size).__name__}")
        if vocab_size < 256 + NUM_SPECIAL:
            raise ValueError(f"vocab_size must be >= {256 + NUM_SPECIAL} for a byte tokenizer, got {vocab_size}")
        self.vocab_size = vocab_size

    def encode(self, text: str) -> list[int]:
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        return [b + NUM_SPECIAL for b in text.encode("utf-8")]

    def decode(self, token_ids: Sequence[int]) -> str:
        data = bytes(t - NUM_SPECIAL for t in token_ids if NUM_SPECIAL <= t < 256 + NUM_SPECIAL)
        return data.decode("utf-8", errors="replace")


def render_chat(messages, add_generation_prompt: bool = True, continue_final_message: bool = False) -> str:
    """Render OpenAI-style chat `messages` ([{"role", "content"}]) with the template above."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list")
    if add_generation_prompt and continue_final_message:
        raise ValueError("add_generation_prompt and continue_final_message are mutually exclusive")
    parts = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ValueError(f"messages[{i}] must be an object with a string 'role'")
        content = m.get("content", "")
        if isinstance(content, list):          # [{"type": "text", "text": ...}] parts
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
        if not isinstance(content, str):
            raise ValueError(f"messages[{i}].content must be a string or a list of text parts")
        last = i == len(messages) - 1
        parts.append(f"<|{m['role']}|>\n{content}" + ("" if last and continue_final_message else "\n"))
    if add_generation_prompt:
        parts.append("<|assistant|>\n")
    return "".join(parts)
