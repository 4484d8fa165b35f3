"""Micro-benchmark: block hashing of an 8k-token prompt, and (when a tokenizer dir is given) HF chat tokenization.

usage: python bench/bench_hashing.py [HF_TOKENIZER_DIR]
"""

from __future__ import annotations

import random
import sys
import time

from cacheindex.hashing import prompt_block_hashes


def per_call_us(fn: object, n: int) -> float:
    assert callable(fn)
    fn()
    start = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - start) / n * 1e6


def main(argv: list[str]) -> int:
    rng = random.Random(0)
    tokens = [rng.randrange(2**17) for _ in range(8192)]
    for bs in (16, 32, 128):
        us = per_call_us(lambda bs=bs: prompt_block_hashes(tokens, bs, model="m"), 500)
        print(f"hash 8192 tokens, block {bs:>3}: {us:8.1f} us")
    if argv:
        from cacheindex.tokenizers import HfPromptTokenizer
        from engine_pool.tiny_model import corpus_text

        tok = HfPromptTokenizer(argv[0])
        text = corpus_text()
        for chars in (400, 4000, 40000):
            msgs = [{"role": "system", "content": text[:chars]}, {"role": "user", "content": "hi"}]
            n = len(tok.tokenize_chat(msgs))
            us = per_call_us(lambda msgs=msgs: tok.tokenize_chat(msgs), 20)
            print(f"hf chat tokenize {chars:>6} chars ({n:>5} tokens): {us / 1000:8.2f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
