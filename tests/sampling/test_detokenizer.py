"""IncrementalDetokenizer: multi-byte characters split across byte-level tokens, stop strings
split across tokens (streamed and final), hold-back, special tokens; a property test against
tokenizer.decode."""
from __future__ import annotations

import functools

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvmesh.engine.detokenizer import IncrementalDetokenizer
from kvmesh.engine.sampling_params import SamplingParams

EOS = "<|endoftext|>"
IM_START = "<|im_start|>"


@functools.lru_cache(maxsize=1)
def _byte_to_char() -> dict[int, str]:
    """GPT-2's bytes_to_unicode: the printable stand-in of each byte in a byte-level vocab."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def byte_ids(tokenizer, text: str) -> list[int]:
    """One token per UTF-8 byte: every multi-byte character is split across tokens."""
    table = _byte_to_char()
    return tokenizer.convert_tokens_to_ids([table[b] for b in text.encode("utf-8")])


def _stream(tok, ids, params=None, prompt="Say: ", chunks=None):
    """Feed ids (one at a time, or in the given chunk sizes); return (detok, deltas, stop)."""
    detok = IncrementalDetokenizer(tok, tok.encode(prompt, add_special_tokens=False),
                                   params or SamplingParams())
    deltas, stop, i = [], None, 0
    for size in chunks or [1] * len(ids):
        stop = detok.update(ids[i:i + size])
        i += size
        deltas.append(detok.get_delta(finished=stop is not None))
        if stop is not None:
            break
    deltas.append(detok.get_delta(finished=True))
    return detok, deltas, stop


# multi-byte characters -------------------------------------------------------------------

@pytest.mark.parametrize("text", ["a你🙂b", "héllo wörld", "🙂🙃", "€ 10", "你好世界"])
def test_multibyte_chars_split_across_tokens(any_tokenizer, text):
    ids = byte_ids(any_tokenizer, text)
    assert len(ids) > len(text)                       # characters really are split
    detok, deltas, _ = _stream(any_tokenizer, ids)
    assert "".join(deltas) == detok.output_text == text
    assert all("\ufffd" not in d for d in deltas)


def test_incomplete_char_is_held_until_complete(bpe):
    ids = byte_ids(bpe, "a🙂")                       # 1 + 4 tokens
    detok = IncrementalDetokenizer(bpe, [], SamplingParams())
    seen = []
    for t in ids:
        detok.update([t])
        seen.append(detok.get_delta(finished=False))
    assert seen == ["a", "", "", "", "🙂"]


def test_merged_tokens_and_prompt_context(any_tokenizer):
    ids = any_tokenizer.encode(" hello world, héllo 你好", add_special_tokens=False)
    detok, deltas, _ = _stream(any_tokenizer, ids, prompt="Greeting:")
    assert "".join(deltas) == " hello world, héllo 你好"


# stop strings ----------------------------------------------------------------------------

def test_stop_string_split_across_tokens(bpe):
    ids = byte_ids(bpe, "hello world, stop here")   # one character per token
    detok, deltas, stop = _stream(bpe, ids, SamplingParams(stop=["stop"]))
    assert stop == "stop" == detok.stop_string
    assert detok.output_text == "hello world, "
    assert "".join(deltas) == "hello world, "
    assert all("s" not in d for d in deltas)           # no part of "stop" was streamed
    assert len(detok.output_token_ids) == len("hello world, stop")


def test_stop_string_inside_one_merged_token(bpe):
    ids = bpe.encode("hello again", add_special_tokens=False)
    assert any("llo" in t for t in bpe.convert_ids_to_tokens(ids))   # "lo" sits inside one token
    detok, deltas, stop = _stream(bpe, ids, SamplingParams(stop=["lo"]))
    assert stop == "lo" and detok.output_text == "hel" == "".join(deltas)


def test_include_stop_str_in_output(bpe):
    ids = byte_ids(bpe, "hello world, stop here")
    params = SamplingParams(stop=["stop"], include_stop_str_in_output=True)
    detok, deltas, stop = _stream(bpe, ids, params)
    assert stop == "stop"
    assert detok.output_text == "hello world, stop" == "".join(deltas)


def test_multibyte_stop_string(bpe):
    ids = byte_ids(bpe, "你好吗 🙂 ok")
    detok, deltas, stop = _stream(bpe, ids, SamplingParams(stop=["🙂"]))
    assert stop == "🙂" and detok.output_text == "你好吗 " == "".join(deltas)


def test_earliest_ending_stop_string_wins(bpe):
    ids = byte_ids(bpe, "one two three")
    detok, _, stop = _stream(bpe, ids, SamplingParams(stop=["three", "two", "wo t"]))
    assert stop == "two" and detok.output_text == "one "


def test_stop_string_in_the_first_min_tokens_is_ignored(bpe):
    ids = byte_ids(bpe, "ab stop cd stop ef")
    params = SamplingParams(stop=["stop"], min_tokens=7, max_tokens=100)
    detok, deltas, stop = _stream(bpe, ids, params)
    assert stop == "stop" and detok.output_text == "ab stop cd " == "".join(deltas)


def test_tokens_after_a_stop_change_nothing(bpe):
    detok = IncrementalDetokenizer(bpe, [], SamplingParams(stop=["!"]))
    assert detok.update(byte_ids(bpe, "hi! more")) == "!"
    assert detok.update(byte_ids(bpe, "x")) == "!"
    assert detok.output_text == "hi" and detok.get_delta(finished=True) == "hi"


def test_hold_back_of_longest_stop_minus_one(bpe):
    detok = IncrementalDetokenizer(bpe, [], SamplingParams(stop=["###", "x"]))
    got = []
    for ch in "abcdef":
        assert detok.update(byte_ids(bpe, ch)) is None
        got.append(detok.get_delta(finished=False))
    assert got == ["", "", "a", "b", "c", "d"]
    assert detok.get_delta(finished=True) == "ef"
    assert detok.get_delta(finished=True) == ""


def test_no_hold_back_without_stop_strings(bpe):
    detok = IncrementalDetokenizer(bpe, [], SamplingParams())
    detok.update(byte_ids(bpe, "ab"))
    assert detok.get_delta(finished=False) == "ab"


def test_partial_stop_string_is_released_when_it_does_not_complete(bpe):
    ids = byte_ids(bpe, "a st")
    detok, deltas, stop = _stream(bpe, ids, SamplingParams(stop=["stop"]))
    assert stop is None and "".join(deltas) == "a st"
    assert deltas[-1] == " st"                        # held back (3 chars) until finish


# special tokens and stop tokens ----------------------------------------------------------

def test_skip_special_tokens(bpe):
    eos, im = bpe.convert_tokens_to_ids([EOS, IM_START])
    ids = byte_ids(bpe, "ab") + [im] + byte_ids(bpe, "c") + [eos]
    skip, deltas, _ = _stream(bpe, ids, SamplingParams(skip_special_tokens=True))
    assert skip.output_text == "abc" == "".join(deltas) == bpe.decode(ids, skip_special_tokens=True)
    keep, deltas, _ = _stream(bpe, ids, SamplingParams(skip_special_tokens=False))
    assert keep.output_text == f"ab{IM_START}c{EOS}" == "".join(deltas)


def test_stop_terminated_token_is_not_detokenized(bpe):
    eos = bpe.convert_tokens_to_ids(EOS)
    params = SamplingParams(skip_special_tokens=False)
    detok = IncrementalDetokenizer(bpe, [], params)
    detok.update(byte_ids(bpe, "ok"))
    detok.update([eos], stop_terminated=True)
    assert detok.output_text == "ok" and detok.output_token_ids[-1] == eos
    # A stop_token_ids hit on a normal token: left out, unless include_stop_str_in_output.
    nl = byte_ids(bpe, "\n")
    for include, text in [(False, "ok"), (True, "ok\n")]:
        detok = IncrementalDetokenizer(bpe, [], SamplingParams(stop_token_ids=nl, include_stop_str_in_output=include))
        detok.update(byte_ids(bpe, "ok") + nl, stop_terminated=True)
        assert detok.output_text == text


# properties ------------------------------------------------------------------------------

_ALPHABET = "abcdehlorwstp ,.\n" + "éöüï€你好世界" + "🙂🙃"
_texts = st.text(alphabet=_ALPHABET, min_size=0, max_size=40)


def _ids_for(tok, text: str, split_bytes: bool) -> list[int]:
    return byte_ids(tok, text) if split_bytes else tok.encode(text, add_special_tokens=False)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(prompt=_texts, text=_texts, split_bytes=st.booleans(), specials=st.lists(st.integers(0, 60), max_size=3),
       chunk_seed=st.lists(st.integers(1, 4), min_size=1, max_size=8))
def test_deltas_concatenate_to_decode(any_tokenizer, prompt, text, split_bytes, specials, chunk_seed):
    tok = any_tokenizer
    ids = _ids_for(tok, text, split_bytes)
    special = sorted(tok.all_special_ids)[0]
    for pos in specials:                              # sprinkle skipped special tokens
        ids.insert(min(pos, len(ids)), special)
    chunks, total, k = [], 0, 0
    while total < len(ids):
        size = min(chunk_seed[k % len(chunk_seed)], len(ids) - total)
        chunks.append(size)
        total += size
        k += 1
    detok, deltas, stop = _stream(tok, ids, prompt=prompt, chunks=chunks)
    assert stop is None
    assert "".join(deltas) == detok.output_text == tok.decode(ids, skip_special_tokens=True) == text


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=_texts, stop=st.text(alphabet=_ALPHABET, min_size=1, max_size=4), split_bytes=st.booleans(),
       include=st.booleans())
def test_stop_string_streaming_is_a_prefix_of_the_final_text(bpe, text, stop, split_bytes, include):
    ids = _ids_for(bpe, text, split_bytes)
    params = SamplingParams(stop=[stop], include_stop_str_in_output=include)
    detok = IncrementalDetokenizer(bpe, [], params)
    streamed = ""
    for t in ids:
        found = detok.update([t])
        streamed += detok.get_delta(finished=found is not None)
        assert detok.output_text.startswith(streamed)   # never a character that is later cut
        if found:
            break
    streamed += detok.get_delta(finished=True)
    at = text.find(stop)
    expected = text if at == -1 else text[:at + (len(stop) if include else 0)]
    assert streamed == detok.output_text == expected
    assert detok.stop_string == (None if at == -1 else stop)


class _CountingTokenizer:
    """Duck-typed tokenizer that records how many tokens each convert_tokens_to_string sees."""

    def __init__(self, inner):
        self.inner, self.sizes = inner, []
        self.all_special_ids = inner.all_special_ids

    def convert_ids_to_tokens(self, ids):
        return self.inner.convert_ids_to_tokens(ids)

    def convert_tokens_to_string(self, tokens):
        self.sizes.append(len(tokens))
        return self.inner.convert_tokens_to_string(tokens)


def test_work_per_token_is_bounded(bpe):
    text = "héllo wörld 你好 🙂 " * 100
    ids = byte_ids(bpe, text)
    counting = _CountingTokenizer(bpe)
    detok = IncrementalDetokenizer(counting, byte_ids(bpe, "prompt"), SamplingParams(stop=["never!"]))
    out = []
    for t in ids:
        detok.update([t])
        out.append(detok.get_delta(finished=False))
    out.append(detok.get_delta(finished=True))
    assert "".join(out) == text
    assert max(counting.sizes) <= 9        # a few tokens of context, never the whole output
