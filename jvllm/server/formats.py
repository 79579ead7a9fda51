"""JSON shapes of what the server answers besides text: completions- and chat-format logprobs,
prompt logprobs, hidden states. Logprobs of -inf (or NaN) become -9999.0 (JSON has no infinities);
a token without decoded text is written `token_id:N`.

text_offset (completions format): each token's offset is the sum of the lengths of the token
strings before it (`offset` is where the list starts), as vLLM computes it: it never goes back,
and a token cut inside a UTF-8 character counts its replacement string.
"""
from __future__ import annotations

def clamp_logprob(x: float | None) -> float | None:
    if x is None:
        return None
    return max(x, -9999.0) if x == x else -9999.0


def hidden_states_json(hs: dict) -> dict:
    """{"layer": one [hidden] list of floats per token, or None when no token was computed};
    non-finite values (a float16 overflow) become null (JSON has no NaN / Infinity)."""
    import math

    import numpy as np

    def rows(a):
        if a is None:
            return None
        a = np.asarray(a, np.float32)
        out = a.tolist()
        if not np.isfinite(a).all():
            out = [[x if math.isfinite(x) else None for x in r] for r in out]
        return out

    return {str(k): rows(v) for k, v in hs.items()}


def token_text(lp, tid: int) -> str:
    s = getattr(lp, "decoded_token", None)
    return s if s is not None else f"token_id:{tid}"


def end_offset(lp: dict, start: int = 0) -> int:
    """The text_offset after the last token of completion-format logprobs `lp`."""
    return lp["text_offset"][-1] + len(lp["tokens"][-1]) if lp["tokens"] else start


def completion_logprobs(token_ids, entries, offset: int) -> dict:
    tokens, tlps, tops, offs = [], [], [], []
    for tid, e in zip(token_ids, entries):
        lp = e.get(tid)
        s = token_text(lp, tid)
        tokens.append(s)
        tlps.append(clamp_logprob(lp.logprob) if lp is not None else None)
        tops.append({token_text(v, k): clamp_logprob(v.logprob) for k, v in e.items()})
        offs.append(offset)
        offset += len(s)
    return {"tokens": tokens, "token_logprobs": tlps, "top_logprobs": tops, "text_offset": offs}


def chat_logprobs(token_ids, entries, top_n: int) -> dict:
    content = []
    for tid, e in zip(token_ids, entries):
        lp = e.get(tid)
        s = token_text(lp, tid)
        top = sorted(((k, v) for k, v in e.items() if v.rank is not None and v.rank <= top_n),
                     key=lambda kv: kv[1].rank)
        content.append({"token": s, "logprob": clamp_logprob(lp.logprob) if lp is not None else None,
                        "bytes": list(s.encode("utf-8")),
                        "top_logprobs": [{"token": token_text(v, k), "logprob": clamp_logprob(v.logprob),
                                          "bytes": list(token_text(v, k).encode("utf-8"))} for k, v in top]})
    return {"content": content}


def prompt_logprobs_json(plp):
    if plp is None:
        return None
    return [None if e is None else {str(k): {"logprob": clamp_logprob(v.logprob), "rank": v.rank,
                                             "decoded_token": v.decoded_token} for k, v in e.items()}
            for e in plp]
