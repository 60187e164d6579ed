"""Build the tiny random-weight model that the real vLLM serves: a standalone script.

Run by the vLLM venv's python (``VENV/bin/python build_model.py --out DIR``), never imported
by the sidecar: it needs torch, transformers and tokenizers, which live only in that venv.
It imports nothing from ``sidecar``.

Offline and deterministic: the tokenizer is a byte-level BPE trained on the standard library's
own ``.py`` files (the running interpreter's, sorted), the weights come from a fixed seed. The
result is a Llama with 2 layers of width 128 (about 5 MB in bfloat16) whose output is
arbitrary tokens: callers fix lengths with ``ignore_eos`` and ``max_tokens``.
"""

from __future__ import annotations

import argparse
import os
import sys
import sysconfig
from pathlib import Path

SPECIAL = "<|endoftext|>"
VOCAB_SIZE = 8192
# Whatever the roles, one line per message after a role tag; the generation prompt opens the
# assistant's turn. Content is used as a string (vLLM's "string" content format).
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}" + SPECIAL + "\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
# The model's geometry (the notes in docs/real-vllm.md explain the choice: tiny, fast on CPU).
HIDDEN = 128
INTERMEDIATE = 256
LAYERS = 2
HEADS = 4
KV_HEADS = 4
MAX_POSITIONS = 4096


def training_files() -> list[str]:
    """The standard library's top-level .py files, in a fixed order."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(str(p) for p in stdlib.glob("*.py") if p.is_file())
    if not files:
        raise SystemExit(f"no .py files under {stdlib} to train the tokenizer on")
    return files


def build_tokenizer(out: Path) -> int:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE(unk_token=SPECIAL))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=[SPECIAL],
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train(training_files(), trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=SPECIAL,
        eos_token=SPECIAL,
        pad_token=SPECIAL,
        unk_token=SPECIAL,
        model_max_length=MAX_POSITIONS,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out))
    return len(fast)


def build_weights(out: Path, vocab_size: int, special_id: int, seed: int) -> None:
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=HIDDEN,
        intermediate_size=INTERMEDIATE,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        max_position_embeddings=MAX_POSITIONS,
        bos_token_id=special_id,
        eos_token_id=special_id,
        pad_token_id=special_id,
        dtype="bfloat16",
    )
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(str(out), safe_serialization=True)
    GenerationConfig(
        bos_token_id=special_id, eos_token_id=special_id, pad_token_id=special_id
    ).save_pretrained(str(out))


def check(out: Path) -> None:
    """Load what was written the way vLLM will (offline)."""
    from transformers import AutoConfig, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(out))
    config = AutoConfig.from_pretrained(str(out))
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hello"}], tokenize=False, add_generation_prompt=True
    )
    if not isinstance(prompt, str) or "hello" not in prompt:
        raise SystemExit(f"the chat template rendered {prompt!r}")
    if config.vocab_size != len(tokenizer):
        raise SystemExit(f"vocab_size {config.vocab_size} != tokenizer size {len(tokenizer)}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path, help="directory to write (empty)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    vocab_size = build_tokenizer(out)
    from transformers import AutoTokenizer

    special_id = AutoTokenizer.from_pretrained(str(out)).convert_tokens_to_ids(SPECIAL)
    build_weights(out, vocab_size, int(special_id), args.seed)
    check(out)
    print(f"built {out}: vocab {vocab_size}, special token id {special_id}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
