"""Build a tiny random Llama that vLLM can serve offline (no model hub needed).

``python -m torch_kv_tier.integrations.vllm.tiny_model OUT_DIR`` writes a 2-layer Llama (hidden
256, 4 attention heads over 2 KV heads, vocabulary 1024, seeded random weights) with
``save_pretrained``, plus a word-level ``PreTrainedTokenizerFast`` whose vocabulary is ``w0``
... ``w1019`` and four special tokens. Its output is noise, but it is *deterministic* noise:
greedy decoding of the same prompt gives the same tokens whether its KV was computed or loaded,
which is what an offload test needs. Same seed, same bytes.

Needs ``transformers`` and ``tokenizers`` (both come with vLLM). Single-threaded, no network.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from torch_kv_tier.cli_numbers import integer

logger = logging.getLogger(__name__)

VOCAB_SIZE = 1024
SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", "<pad>")
WORDS = VOCAB_SIZE - len(SPECIAL_TOKENS)  # ordinary tokens: ``word(0)`` .. ``word(WORDS - 1)``
# Positions the model supports: the longest prompt + output a test can send.
MAX_POSITIONS = 2048


def word(i: int) -> str:
    """The text of ordinary token ``i`` (0 <= i < ``WORDS``)."""
    return f"w{i}"


def prompt(token_ids: list[int]) -> str:
    """A prompt whose tokenization is exactly one token per entry of ``token_ids``."""
    return " ".join(word(i) for i in token_ids)


def build(out_dir: Path, seed: int = 0) -> Path:
    """Write the model and its tokenizer to ``out_dir`` (created); returns ``out_dir``."""
    import torch
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    out_dir.mkdir(parents=True, exist_ok=True)
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    vocab.update({word(i): len(SPECIAL_TOKENS) + i for i in range(WORDS)})
    tokenizer = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        model_max_length=MAX_POSITIONS,
    )
    fast.save_pretrained(out_dir)

    config = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=MAX_POSITIONS,
        bos_token_id=vocab["<s>"],
        eos_token_id=vocab["</s>"],
        pad_token_id=vocab["<pad>"],
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).bfloat16()
    model.save_pretrained(out_dir)
    logger.info("tiny Llama written to %s", out_dir)
    return out_dir


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path, help="directory to write the model into")
    parser.add_argument("--seed", type=integer, default=0)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    print(build(args.out_dir, seed=args.seed))


if __name__ == "__main__":
    main()
