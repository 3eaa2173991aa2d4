"""Incremental detokenization with stop strings.

Decoding a growing token list one token at a time breaks on tokens that are only part
of a UTF-8 character or that merge with their neighbours (SentencePiece spaces). The
trick used across the field: decode a short window of recent tokens twice, with and
without the newest ones, and emit the difference once it no longer ends in an
incomplete character (U+FFFD). With a fast (Rust) tokenizer that is one call per token,
``tokenizers.decoders.DecodeStream.step``, which keeps the window in Rust; other
tokenizers get two ``decode`` calls per token in Python.

Stop strings may span tokens, so while a request runs the last ``max_stop_len - 1``
characters are held back; when a stop string appears the text is cut there.
"""

from __future__ import annotations

from collections.abc import Sequence


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer,
        stop: Sequence[str] = (),
        include_stop_str_in_output: bool = False,
        skip_special_tokens: bool = True,
    ):
        self.tokenizer = tokenizer
        self.stop = tuple(stop)
        self.include_stop = include_stop_str_in_output
        self.skip_special = skip_special_tokens
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.token_ids: list[int] = []
        self.prefix_offset = 0  # start of the context window
        self.read_offset = 0  # tokens before this are already in self.text
        self.text = ""  # all decoded text so far
        self.emitted = 0  # characters of self.text handed out
        self.stopped = False
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._stream = None
        if backend is not None:
            from tokenizers.decoders import DecodeStream

            self._backend = backend
            self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special)

    def add(self, token_id: int) -> None:
        """Append one token; sets ``stopped`` when a stop string appears."""
        if self.stopped:
            return
        if self._stream is not None:
            new = self._stream.step(self._backend, token_id)
            if new:
                before = len(self.text)
                self.text += new
                self._check_stop(before)
            return
        self.token_ids.append(token_id)
        prefix = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.token_ids[self.prefix_offset :])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            new = full[len(prefix) :]
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.token_ids)
            before = len(self.text)
            self.text += new
            self._check_stop(before)

    def _check_stop(self, before: int) -> None:
        if not self.stop:
            return
        # only search where a new match can start
        lo = max(0, before - self.hold)
        best = -1
        best_len = 0
        for s in self.stop:
            i = self.text.find(s, lo)
            if i != -1 and (best == -1 or i < best):
                best, best_len = i, len(s)
        if best != -1:
            self.text = self.text[: best + (best_len if self.include_stop else 0)]
            self.stopped = True

    def take(self, final: bool) -> str:
        """Text not handed out yet; while running, keep back a possible stop prefix."""
        if final or self.stopped:
            end = len(self.text)
        else:
            end = max(self.emitted, len(self.text) - self.hold)
        out = self.text[self.emitted : end]
        self.emitted = end
        return out
