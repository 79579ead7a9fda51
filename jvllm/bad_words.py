"""`SamplingParams.bad_words`, as vLLM applies them: the words tokenized once per request
(`bad_words_token_ids`, at admission) and the ids banned before each output token
(`bad_word_bans`, host side, into the step's vocabulary mask)."""
from __future__ import annotations


def bad_words_token_ids(bad_words: list[str], tokenizer, vocab_size: int) -> list[list[int]]:
    """vLLM's tokenization of `bad_words`: each word (its leading spaces stripped) without and with
    one leading space; the spaced form counts only when its first token differs from the unspaced
    form's and it has as many tokens (otherwise it is the same word split differently). Raises
    ValueError for a word that gives no tokens or ids outside [0, vocab_size)."""
    out: list[list[int]] = []
    for word in bad_words:
        plain = list(tokenizer.encode(word.lstrip(), add_special_tokens=False))
        if not plain:
            raise ValueError(f"bad_words: {word!r} gives no tokens")
        out.append(plain)
        spaced = list(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
            out.append(spaced)
    bad = sorted({t for ids in out for t in ids if not 0 <= t < vocab_size})
    if bad:
        raise ValueError(f"bad_words give token ids {bad[:8]} outside the vocabulary [0, {vocab_size})")
    return out


def bad_word_bans(words_ids: list[list[int]], output_ids: list[int]) -> set[int]:
    """Token ids banned for the next output token: a one-token word always, a longer word's last
    token when the output ends in the word's other tokens (vLLM: output tokens only, not the prompt)."""
    bans = set()
    for ids in words_ids:
        k = len(ids) - 1
        if k == 0 or (k <= len(output_ids) and output_ids[len(output_ids) - k:] == ids[:k]):
            bans.add(ids[-1])
    return bans
