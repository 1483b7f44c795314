"""Incremental detokenization and stop-string matching."""
from __future__ import annotations

from loraserve.sequence import Sequence

_REPLACEMENT = "\ufffd"


def append_new_text(tokenizer, seq: Sequence) -> str:
    """Decode the tokens generated since the last call; returns the text added to seq.text.

    Decodes a short window before the new tokens so a token's leading space or a
    multi-byte character split over tokens comes out right; text ending in an
    incomplete character is held back until the next token completes it.
    """
    ids = seq.output_token_ids
    skip = seq.sampling_params.skip_special_tokens
    prefix = tokenizer.decode(ids[seq.prefix_offset:seq.read_offset], skip_special_tokens=skip)
    full = tokenizer.decode(ids[seq.prefix_offset:], skip_special_tokens=skip)
    if len(full) <= len(prefix) or full.endswith(_REPLACEMENT):
        return ""
    new = full[len(prefix):]
    seq.text += new
    seq.prefix_offset = seq.read_offset
    seq.read_offset = len(ids)
    return new


def find_stop_string(seq: Sequence, new_text_len: int) -> str | None:
    """If a stop string appears in the newly added text, cut seq.text before it (after it with
    include_stop_str_in_output) and return it."""
    stops = seq.sampling_params.stop_strings
    if not stops or new_text_len == 0:
        return None
    for stop in stops:
        start = max(0, len(seq.text) - new_text_len - len(stop) + 1)
        idx = seq.text.find(stop, start)
        if idx != -1:
            seq.text = seq.text[:idx + (len(stop) if seq.sampling_params.include_stop_str_in_output else 0)]
            return stop
    return None
