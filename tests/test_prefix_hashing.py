"""Properties of kvgate's chained block hashes."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from cacheindex.hashing import chain_hashes, context_seed, prompt_block_hashes

tokens_st = st.lists(st.integers(min_value=0, max_value=2**32 - 1), max_size=200)
block_st = st.integers(min_value=1, max_value=16)


@settings(derandomize=True, max_examples=200)
@given(tokens=tokens_st, extra=tokens_st, bs=block_st)
def test_same_prefix_same_hashes(tokens: list[int], extra: list[int], bs: int) -> None:
    a = prompt_block_hashes(tokens, bs, model="m")
    b = prompt_block_hashes(tokens + extra, bs, model="m")
    assert b[: len(a)] == a
    assert prompt_block_hashes(list(tokens), bs, model="m") == a


@settings(derandomize=True, max_examples=200)
@given(tokens=tokens_st, bs=block_st)
def test_only_full_blocks(tokens: list[int], bs: int) -> None:
    assert len(prompt_block_hashes(tokens, bs, model="m")) == len(tokens) // bs


@settings(derandomize=True, max_examples=200)
@given(tokens=st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=200), bs=block_st, data=st.data())
def test_changing_a_token_changes_its_block_and_all_later(tokens: list[int], bs: int, data: st.DataObject) -> None:
    i = data.draw(st.integers(0, len(tokens) - 1))
    changed = list(tokens)
    changed[i] = (changed[i] + 1) % 2**32
    a = prompt_block_hashes(tokens, bs, model="m")
    b = prompt_block_hashes(changed, bs, model="m")
    first = i // bs
    assert a[:first] == b[:first]
    assert all(x != y for x, y in zip(a[first:], b[first:], strict=True))


@settings(derandomize=True, max_examples=100)
@given(tokens=st.lists(st.integers(0, 2**32 - 1), min_size=16, max_size=64))
def test_salt_model_and_lora_separate_contexts(tokens: list[int]) -> None:
    base = prompt_block_hashes(tokens, 16, model="m")
    others = [
        prompt_block_hashes(tokens, 16, model="m", cache_salt="tenant-a"),
        prompt_block_hashes(tokens, 16, model="m", cache_salt="tenant-b"),
        prompt_block_hashes(tokens, 16, model="m2"),
        prompt_block_hashes(tokens, 16, model="m", lora="adapter"),
    ]
    all_hashes = [set(base)] + [set(o) for o in others]
    for i, x in enumerate(all_hashes):
        for y in all_hashes[i + 1 :]:
            assert not x & y


def test_context_fields_are_length_prefixed() -> None:
    assert context_seed("ab", "c") != context_seed("a", "bc")
    assert context_seed("m", None, None) == context_seed("m", "", "")


def test_chain_continues_from_a_parent() -> None:
    tokens = list(range(64))
    whole = chain_hashes(tokens, 16, 7)
    assert chain_hashes(tokens[32:], 16, whole[1]) == whole[2:]


def test_large_token_ids_fall_back_to_64_bit_lanes() -> None:
    small = chain_hashes([1, 2, 3, 4], 2, 0)
    big = chain_hashes([2**40, 2, 3, 4], 2, 0)
    assert len(big) == 2 and big[0] != small[0]
    assert chain_hashes([2**40, 2, 3, 4], 2, 0) == big
