"""Incremental detokenization of one request, with stop strings and safe streaming deltas.

Each new token is decoded together with a few tokens before it (prefix_offset .. read_offset),
and only the text beyond the prefix's text is emitted:

    tokens:  ... | prefix_offset ....... read_offset | new tokens
    text:          decode(prefix window)              | emitted = decode(all from prefix) minus it

A byte-level BPE token can end inside a multi-byte UTF-8 character; its decode then ends in
U+FFFD, and the offsets stay put until a later token completes the character. The cost per
token is a decode of a handful of tokens, never of the whole output.
"""
from __future__ import annotations

from typing import Any, Sequence

from kvmesh.engine.sampling_params import SamplingParams

# NOTE: prompt tokens used as decoding context, so that a first output token decodes as it
# would mid-text (SentencePiece drops a leading space at the start of a string).
_PROMPT_CONTEXT = 5
_REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Text of one request's output, updated token by token.

    `tokenizer` is a transformers fast tokenizer, or any object with `convert_ids_to_tokens`,
    `convert_tokens_to_string` and `all_special_ids`."""

    def __init__(self, tokenizer: Any, prompt_token_ids: Sequence[int], params: SamplingParams) -> None:
        self._tokenizer = tokenizer
        self._skip_ids: frozenset[int] = (
            frozenset(tokenizer.all_special_ids) if params.skip_special_tokens else frozenset())
        self._stop: list[str] = list(params.stop)
        self._include_stop = params.include_stop_str_in_output
        self._min_tokens = params.min_tokens
        self._max_stop_len = max((len(s) for s in self._stop), default=0)
        # NOTE: hold back all but one character of the longest stop string, so a stop string
        # split across tokens is never streamed in part. With include_stop_str_in_output a
        # partial stop string is part of the output anyway, so nothing needs holding back.
        self._hold_back = self._max_stop_len - 1 if self._stop and not self._include_stop else 0

        self._tokens: list[str] = self._convert(list(prompt_token_ids)[-(_PROMPT_CONTEXT + 2):])
        self._read_offset = len(self._tokens)
        self._prefix_offset = max(self._read_offset - _PROMPT_CONTEXT, 0)
        self._prefix_text = self._to_string(self._prefix_offset, self._read_offset)

        self.output_token_ids: list[int] = []   # every id given to update(), even after a stop
        self.stop_string: str | None = None     # the stop string that ended the output, if any
        self._pieces: list[str] = []            # output text, in chunks (joined lazily)
        self._num_chars = 0
        self._num_sent = 0                      # characters already returned by get_delta

    @property
    def output_text(self) -> str:
        """All text so far, cut at the stop string (kept with include_stop_str_in_output)."""
        if len(self._pieces) > 1:
            self._pieces = ["".join(self._pieces)]
        return self._pieces[0] if self._pieces else ""

    def update(self, new_token_ids: Sequence[int], stop_terminated: bool = False) -> str | None:
        """Append tokens; return the stop string if one now appears in the text, else None.

        stop_terminated: the last id is the EOS or stop token that ends the request (the
        output stage's token stop check said so); as in vLLM it is not detokenized unless
        include_stop_str_in_output. Once a stop string has matched, later ids change no text."""
        last = len(new_token_ids) - 1
        for i, token_id in enumerate(new_token_ids):
            self.output_token_ids.append(token_id)
            if self.stop_string is not None:
                continue
            if stop_terminated and i == last and not self._include_stop:
                continue
            start = self._num_chars
            text = self._decode_next(token_id)
            if not text:
                continue
            self._pieces.append(text)
            self._num_chars += len(text)
            if self._stop and len(self.output_token_ids) > self._min_tokens:
                self._check_stop(start)
        return self.stop_string

    def get_delta(self, finished: bool) -> str:
        """Text not returned yet. While unfinished, the last len(longest stop) - 1 characters
        are held back; once finished (or stopped by a stop string) everything is released."""
        hold = 0 if finished or self.stop_string is not None else self._hold_back
        end = self._num_chars - hold
        if end <= self._num_sent:
            return ""
        delta = self._text_from(self._num_sent)[: end - self._num_sent]
        self._num_sent = end
        return delta

    def _decode_next(self, token_id: int) -> str:
        if token_id in self._skip_ids:
            return ""
        self._tokens.extend(self._convert([token_id]))
        text = self._to_string(self._prefix_offset, len(self._tokens))
        if len(text) <= len(self._prefix_text) or text.endswith(_REPLACEMENT_CHAR):
            # An incomplete UTF-8 character (or nothing visible yet): wait for more tokens.
            return ""
        new_text = text[len(self._prefix_text):]
        self._prefix_offset, self._read_offset = self._read_offset, len(self._tokens)
        self._prefix_text = self._to_string(self._prefix_offset, self._read_offset)
        return new_text

    def _check_stop(self, start: int) -> None:
        """Find the earliest stop string that ends in the text added after `start`."""
        window_start = max(start - (self._max_stop_len - 1), 0)
        window = self._text_from(window_start)
        best: tuple[int, str] | None = None
        for stop in self._stop:
            # A match must end after `start`: earlier text was already searched.
            pos = window.find(stop, max(start - (len(stop) - 1), 0) - window_start)
            if pos != -1 and (best is None or pos < best[0]):
                best = (pos, stop)
        if best is None:
            return
        pos, stop = best
        cut = window_start + pos + (len(stop) if self._include_stop else 0)
        text = self.output_text[:cut]
        self._pieces = [text] if text else []
        self._num_chars = cut
        self.stop_string = stop

    def _text_from(self, start: int) -> str:
        """output_text[start:], touching only the chunks that hold it."""
        need = self._num_chars - start
        if need <= 0:
            return ""
        parts: list[str] = []
        got = 0
        for piece in reversed(self._pieces):
            parts.append(piece)
            got += len(piece)
            if got >= need:
                break
        text = "".join(reversed(parts))
        return text[len(text) - need:]

    def _convert(self, token_ids: list[int]) -> list[str]:
        ids = [t for t in token_ids if t not in self._skip_ids]
        return list(self._tokenizer.convert_ids_to_tokens(ids)) if ids else []

    def _to_string(self, start: int, end: int) -> str:
        if start >= end:
            return ""
        return self._tokenizer.convert_tokens_to_string(self._tokens[start:end])
