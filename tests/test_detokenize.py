"""spaces_between_special_tokens (vLLM's semantics) in the incremental detokenizer."""
import pytest

from jvllm import SamplingParams
from jvllm.engine.request import Detokenizer, Request


@pytest.fixture(scope="module")
def wordpiece_tok():
    """A tokenizer whose decoder puts a space between tokens (WordPiece), with two added tokens."""
    import tokenizers
    import transformers

    vocab = {"[UNK]": 0, "hello": 1, "world": 2, "##s": 3}
    tk = tokenizers.Tokenizer(tokenizers.models.WordPiece(vocab, unk_token="[UNK]"))
    tk.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tk.decoder = tokenizers.decoders.WordPiece()
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="[UNK]")
    tok.add_special_tokens({"additional_special_tokens": ["<a>", "<b>"]})
    return tok


def _detok(tok, ids, **kw):
    d = Detokenizer(tok, [], **kw)
    return "".join(d.step(t) for t in ids)


def test_spaces_between_special_tokens(wordpiece_tok):
    tok = wordpiece_tok
    a, b = tok.convert_tokens_to_ids(["<a>", "<b>"])
    ids = [a, b, 1, 3, b, a, 2]
    assert tok.decode(ids) == "<a> <b> hellos <b> <a> world"
    assert _detok(tok, ids, skip_special_tokens=False) == tok.decode(ids)
    assert _detok(tok, ids, skip_special_tokens=False, spaces_between_special_tokens=True) == tok.decode(ids)
    # only the space between two added tokens goes (as vLLM's detokenizer does)
    assert _detok(tok, ids, skip_special_tokens=False, spaces_between_special_tokens=False) == \
        "<a><b> hellos <b><a> world"
    # with the special tokens skipped there is nothing between them to space
    assert _detok(tok, ids, skip_special_tokens=True, spaces_between_special_tokens=False) == \
        _detok(tok, ids, skip_special_tokens=True)


def test_request_text_follows_the_flag(wordpiece_tok):
    tok = wordpiece_tok
    a, b = tok.convert_tokens_to_ids(["<a>", "<b>"])
    texts = {}
    for flag in (True, False):
        sp = SamplingParams(max_tokens=8, skip_special_tokens=False, spaces_between_special_tokens=flag)
        r = Request("r", [a, 1], sp, seed=0, tokenizer=tok)  # the prompt ends in a normal token
        for t in (a, b, 2):
            r.append_token(t, None, None)
        texts[flag] = r.text
    assert texts == {True: " <a> <b> world", False: " <a><b> world"}
    r = Request("r", [1, a], SamplingParams(max_tokens=8, skip_special_tokens=False,
                                            spaces_between_special_tokens=False), seed=0, tokenizer=tok)
    r.append_token(b, None, None)  # follows the prompt's last token, an added one
    assert r.text == "<b>"


@pytest.mark.parametrize("flag", ["skip_special_tokens", "spaces_between_special_tokens", "ignore_eos",
                                  "include_stop_str_in_output"])
def test_flags_must_be_bools(flag):
    with pytest.raises(ValueError, match=rf"{flag} must be True or False, got 'no'"):
        SamplingParams(**{flag: "no"})
