# Copied verbatim from /work/shared/peers/hf_baseline.py (the HF transformers peer for W1/B1, see
# shared BENCHMARKS.md) so that the GPU machine, which receives only this repository, can run it.
# Env: NREQ (requests, default 256), OUTN (output tokens, default 256), OUT (result dir). Do not edit.
"""CEO measurement: HF transformers (PyTorch) on the same GPU, Llama-3-8B-shaped random bf16 weights.
The peer a JAX engine must beat: padded batch generate, continuous batching generate_batch, batch-1 decode."""
import time, json, os, sys
import numpy as np, torch
import transformers
from transformers import LlamaConfig, LlamaForCausalLM, GenerationConfig

def workload(n, seed=0, lo=64, hi=1024, vocab=128000):
    rng = np.random.default_rng(seed)
    lens = rng.integers(lo, hi + 1, n)
    return [rng.integers(100, vocab, l).tolist() for l in lens]

def main():
    out = dict(torch=torch.__version__, transformers=transformers.__version__)
    OUTN = int(os.environ.get("OUTN", 256)); NREQ = int(os.environ.get("NREQ", 256))
    cfg = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0,
                      bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    t = time.perf_counter()
    with torch.device("cuda"):
        m = LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    out["init_s"] = time.perf_counter() - t
    print(json.dumps(out), flush=True)
    # batch-1 decode
    ids = torch.randint(100, 128000, (1, 512), device="cuda")
    gc = GenerationConfig(max_new_tokens=128, min_new_tokens=128, do_sample=False, eos_token_id=None, pad_token_id=0)
    m.generate(ids, generation_config=gc)
    torch.cuda.synchronize(); t = time.perf_counter()
    m.generate(ids, generation_config=gc); torch.cuda.synchronize()
    dt = time.perf_counter() - t
    out["b1_decode_tok_s_eager"] = 128 / dt; print(json.dumps(out), flush=True)
    reqs = workload(NREQ)
    # continuous batching
    try:
        gcb = GenerationConfig(max_new_tokens=OUTN, do_sample=False, eos_token_id=-1, pad_token_id=0)
        m.generate_batch(reqs[:8], generation_config=gcb, max_new_tokens=16)  # warm
        torch.cuda.synchronize(); t = time.perf_counter()
        res = m.generate_batch(reqs, generation_config=gcb, max_new_tokens=OUTN)
        torch.cuda.synchronize(); dt = time.perf_counter() - t
        ntok = sum(len(r.generated_tokens) for r in res.values())
        out["cb_generate_batch"] = dict(requests=len(res), out_tokens=ntok, s=dt, out_tok_s=ntok / dt)
    except Exception as e:
        out["cb_generate_batch"] = repr(e)[:500]
    print(json.dumps(out), flush=True)
    # padded static batches
    try:
        B = 64; ntok = 0; m.generation_config.pad_token_id = 0
        gcp = GenerationConfig(max_new_tokens=OUTN, min_new_tokens=OUTN, do_sample=False, eos_token_id=None, pad_token_id=0)
        torch.cuda.synchronize(); t = time.perf_counter()
        for i in range(0, len(reqs), B):
            chunk = reqs[i:i + B]; L = max(map(len, chunk))
            ids = torch.zeros((len(chunk), L), dtype=torch.long); att = torch.zeros_like(ids)
            for j, r in enumerate(chunk):
                ids[j, L - len(r):] = torch.tensor(r); att[j, L - len(r):] = 1
            g = m.generate(ids.cuda(), attention_mask=att.cuda(), generation_config=gcp)
            ntok += (g.shape[1] - L) * len(chunk)
        torch.cuda.synchronize(); dt = time.perf_counter() - t
        out["padded_generate_b64"] = dict(out_tokens=ntok, s=dt, out_tok_s=ntok / dt)
    except Exception as e:
        out["padded_generate_b64"] = repr(e)[:500]
    print(json.dumps(out), flush=True)
    os.makedirs(os.environ.get("OUT", "/tmp/out"), exist_ok=True)
    json.dump(out, open(os.path.join(os.environ.get("OUT", "/tmp/out"), "hf_baseline.json"), "w"), indent=1)

if __name__ == "__main__":
    main()
