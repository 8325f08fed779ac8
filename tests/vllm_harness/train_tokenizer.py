"""Train a tiny byte-level BPE tokenizer offline and add it to the harness checkpoints (vLLM venv).

    python tests/vllm_harness/train_tokenizer.py CKPT_DIR [CKPT_DIR ...]

The vocabulary is exactly 512 ids (the models' vocab_size), so every id a random-weight model samples
detokenizes; the training text is generated here (lower-case pseudo-words), nothing is downloaded.
The chat template renders `<|role|>\\ncontent\\n` per message, the same as the built-in server's.
"""
import json
import random
import sys
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

VOCAB = 512
SPECIALS = ["<unk>", "<s>", "</s>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}"
    "{% if not (loop.last and continue_final_message is defined and continue_final_message) %}\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def corpus(n: int = 20000, seed: int = 0):
    rng = random.Random(seed)
    letters = "abcdefghijklmnopqrstuvwxyz"
    for _ in range(n):
        yield " ".join("".join(rng.choice(letters[:rng.randint(5, 26)]) for _ in range(rng.randint(1, 8)))
                       for _ in range(rng.randint(3, 20)))


def train() -> Tokenizer:
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus(), trainer)
    missing = VOCAB - tok.get_vocab_size()
    if missing > 0:                       # pad to exactly VOCAB ids
        tok.add_tokens([f"<pad_{i}>" for i in range(missing)])
    assert tok.get_vocab_size() == VOCAB, tok.get_vocab_size()
    return tok


if __name__ == "__main__":
    tok = train()
    for d in map(Path, sys.argv[1:]):
        tok.save(str(d / "tokenizer.json"))
        (d / "tokenizer_config.json").write_text(json.dumps({
            "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
            "unk_token": "<unk>", "model_max_length": 4096, "chat_template": CHAT_TEMPLATE,
            "add_bos_token": False}, indent=2))
        cfg = json.loads((d / "config.json").read_text())
        cfg.update(bos_token_id=1, eos_token_id=2)
        (d / "config.json").write_text(json.dumps(cfg, indent=2))
        print(f"[vllm-harness] tokenizer ({VOCAB} ids) -> {d}")
