"""`jvllm generate | chat | verify | convert | compile-report` (serve, bench and launch are added by
their modules)."""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

from jvllm.converters.deps import MissingDependencyError


def _speculative_config(s: str) -> dict:
    """--speculative-config: a JSON object (vLLM's speculative_config keys); checked in full by
    `jvllm.spec_decode.config.SpeculativeConfig`."""
    try:
        d = json.loads(s)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"--speculative-config is not valid JSON ({e}): {s!r}")
    if not isinstance(d, dict):
        raise argparse.ArgumentTypeError(f"--speculative-config must be a JSON object, got {s!r}")
    from jvllm.spec_decode.config import SpeculativeConfig

    try:
        SpeculativeConfig.from_dict(d)
    except (TypeError, ValueError) as e:
        raise argparse.ArgumentTypeError(str(e))
    return d


def _group_size(s: str):
    if s in ("auto", "channel"):
        return s
    try:
        return int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected auto, channel or an integer, got {s!r}") from None


def add_engine_args(p: argparse.ArgumentParser, warmup: str | None = None, background_compile: bool = True):
    """Every LLM(...) engine option as a flag (shared by generate, chat, serve, bench). `warmup`:
    this command's own default for --warmup ($JVLLM_WARMUP still wins); None: EngineConfig's.
    `background_compile`: this command's default for --background-compile."""
    p.add_argument("--dtype", default="auto", help="auto | float32 | bfloat16 | float16")
    p.add_argument("--quantization", "-q", default=None,
                   help="quantized projection weights: fp8 | int8 (default: none, or the checkpoint's own)")
    p.add_argument("--fp8-matmul-backend", default="auto", choices=("auto", "xla", "pallas"),
                   help="weight-only fp8 projections: auto (= xla, measured faster) | xla | pallas (a Pallas kernel)")
    p.add_argument("--quantization-group-size", type=_group_size, default="auto",
                   help="scales of quantized projections: auto | channel (one per output channel) | input rows "
                        "per scale (an integer >= 2: more accurate, slower on GPUs)")
    p.add_argument("--max-model-len", type=int, default=None, help="longest prompt + output (None: the model's)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9, help="share of device memory jvllm may use")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV-cache block")
    p.add_argument("--num-gpu-blocks-override", type=int, default=None, help="KV blocks (None: sized from memory)")
    p.add_argument("--kv-cache-memory-bytes", type=int, default=None, help="KV pool bytes (None: sized from memory)")
    p.add_argument("--kv-cache-dtype", default="auto", help="KV pages: auto (the model dtype) | fp8 | fp8_e4m3")
    p.add_argument("--max-num-batched-tokens", type=int, default=None, help="token budget of one step (None: engine default)")
    p.add_argument("--max-num-seqs", type=int, default=None, help="requests in one step (None: engine default)")
    p.add_argument("--no-enable-prefix-caching", dest="enable_prefix_caching", action="store_false",
                   help="turn prefix caching off (default: on)")
    p.add_argument("--seed", type=int, default=0, help="engine seed")
    p.add_argument("--generation-config", default="auto",
                   help="the model's generation defaults: auto (its generation_config.json) | vllm (none) | a folder")
    p.add_argument("--skip-tokenizer-init", action="store_true", default=None, help="token ids in and out only")
    p.add_argument("--token-buckets", type=lambda s: tuple(int(x) for x in s.split(",")), default=None,
                   help="comma-separated token-count buckets compiled at start-up")
    p.add_argument("--fit-chunks-to-buckets", action=argparse.BooleanOptionalAction, default=False,
                   help="cut a step's last prefill chunk at a token-bucket edge where that pads less")
    p.add_argument("--compilation-cache-dir", default=None, help="persistent XLA cache ('off' to disable)")
    p.add_argument("--attention-backend", default="auto",
                   help="auto (GPU: ragged, else xla) | ragged | ragged_split (split-K for every decode step; ragged splits small decode batches only) | pallas (JAX decode kernel + ragged) | pallas_decode | xla")
    p.add_argument("--async-scheduling", dest="async_scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="dispatch step N+1 before reading step N (None: on in a single process; data-parallel replicas step synchronously)")
    p.add_argument("--query-tile", type=int, default=None, help="tokens per attention query tile of mixed steps")
    p.add_argument("--background-compile", action=argparse.BooleanOptionalAction, default=background_compile,
                   help="compile what a first request needs at start-up and the other programs in a background "
                        "thread (--no-background-compile: every program before serving; default here: "
                        + ("on)" if background_compile else "off)"))
    p.add_argument("--warmup", choices=("all", "first"),
                   default=(os.environ.get("JVLLM_WARMUP") or warmup) if warmup else argparse.SUPPRESS,
                   help="programs compiled at start-up: all, or first (only what a first request needs, the rest "
                        "on first use); " + ("$JVLLM_WARMUP sets the default" if warmup else
                                             "default: $JVLLM_WARMUP, else all"))
    p.add_argument("--batch-invariant", action="store_true",
                   help="a request's tokens and logprobs bit-identical whatever else is in its batch (fixed-tile "
                        "matmuls, no decode-only program, the full sampler for every batch)")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, help="devices per tensor-parallel group")
    p.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1, help="pipeline stages")
    p.add_argument("--data-parallel-size", "-dp", type=int, default=1, help="engine replicas")
    p.add_argument("--enable-expert-parallel", action="store_true",
                   help="mixture of experts: shard the experts over the tensor-parallel devices")
    p.add_argument("--expert-parallel-size", "-ep", type=int, default=1,
                   help="mixture of experts: expert groups per stage (attention replicated over them)")
    p.add_argument("--moe-backend", default="auto", choices=("auto", "xla", "pallas", "tokamax"),
                   help="mixture of experts: grouped-matmul backend (auto: pallas on GPUs, xla elsewhere)")
    p.add_argument("--speculative-config", type=_speculative_config, default=None,
                   help='speculative decoding, a JSON object of vLLM\'s keys: \'{"method": "ngram", '
                        '"num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}\' or '
                        '\'{"model": DRAFT, "num_speculative_tokens": 4}\'; "disable_by_batch_size": N stops '
                        'proposing above N requests')
    p.add_argument("--coordinator-address", default=None, help="multi-host: host:port of process 0")
    p.add_argument("--num-processes", type=int, default=None, help="multi-host: number of processes")
    p.add_argument("--process-id", type=int, default=None, help="multi-host: this process's index")


def engine_kwargs(a) -> dict:
    """EngineConfig kwargs from parsed flags (starts jax.distributed first when asked to)."""
    from jvllm.sharding import initialize_distributed

    initialize_distributed(a.coordinator_address, a.num_processes, a.process_id)
    kw = {"warmup": a.warmup} if hasattr(a, "warmup") else {}  # absent: EngineConfig's default (JVLLM_WARMUP)
    return dict(attention_backend=a.attention_backend, async_scheduling=a.async_scheduling, query_tile=a.query_tile,
                tensor_parallel_size=a.tensor_parallel_size, pipeline_parallel_size=a.pipeline_parallel_size,
                data_parallel_size=a.data_parallel_size, enable_expert_parallel=a.enable_expert_parallel,
                expert_parallel_size=a.expert_parallel_size, quantization=a.quantization,
                fp8_matmul_backend=a.fp8_matmul_backend, quantization_group_size=a.quantization_group_size,
                moe_backend=a.moe_backend, dtype=a.dtype, max_model_len=a.max_model_len, gpu_memory_utilization=a.gpu_memory_utilization,
                block_size=a.block_size, num_gpu_blocks_override=a.num_gpu_blocks_override,
                kv_cache_memory_bytes=a.kv_cache_memory_bytes, kv_cache_dtype=a.kv_cache_dtype,
                max_num_batched_tokens=a.max_num_batched_tokens,
                max_num_seqs=a.max_num_seqs, enable_prefix_caching=a.enable_prefix_caching, seed=a.seed,
                generation_config=a.generation_config,
                skip_tokenizer_init=a.skip_tokenizer_init, token_buckets=a.token_buckets,
                fit_chunks_to_buckets=a.fit_chunks_to_buckets, compilation_cache_dir=a.compilation_cache_dir,
                background_compile=a.background_compile,
                batch_invariant=a.batch_invariant, speculative_config=a.speculative_config, **kw)


def add_sampling_args(p, max_tokens: int):
    """Sampling flags. The CLI's max_tokens default is its own (`generate` 64, `chat` 256); the
    offline API keeps vLLM's SamplingParams default of 16."""
    p.add_argument("--max-tokens", type=int, default=max_tokens, help="tokens to generate per prompt")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass")
    p.add_argument("--top-k", type=int, default=0, help="0 = off")
    p.add_argument("--min-p", type=float, default=0.0, help="0 = off")
    p.add_argument("--sampling-seed", type=int, default=None, help="per-request sampling seed (None: random)")


def sampling_params(a):
    from jvllm import SamplingParams

    return SamplingParams(max_tokens=a.max_tokens, temperature=a.temperature, top_p=a.top_p, top_k=a.top_k,
                          min_p=a.min_p, seed=a.sampling_seed)


def start_engine(a):
    """LLM(a.model, ...) with a line before ("loading MODEL ...") and one after (how long the
    load and the compiles took), on stderr."""
    from jvllm import LLM

    say(f"loading {a.model} ...")
    t0 = time.perf_counter()
    llm = LLM(a.model, **engine_kwargs(a))
    eng = llm.llm_engine
    parts = [f"{name} {getattr(eng, attr):.1f}s" for name, attr in
             (("weights", "load_seconds"), ("compile", "warmup_seconds")) if isinstance(getattr(eng, attr, None), float)]
    say(f"{a.model} ready in {time.perf_counter() - t0:.1f}s" + (f" ({', '.join(parts)})" if parts else ""))
    return llm, time.perf_counter() - t0


def say(msg: str):
    print(f"jvllm: {msg}", file=sys.stderr, flush=True)


def cmd_generate(a):
    llm, t_load = start_engine(a)
    prompts = a.prompt or ["The capital of France is"]
    sp = sampling_params(a)
    t1 = time.perf_counter()
    outs = llm.generate(prompts, sp, use_tqdm=False)
    dt = time.perf_counter() - t1
    n = sum(len(c.token_ids) for o in outs for c in o.outputs)
    for o in outs:
        print(f"--- prompt: {o.prompt!r}")
        print(o.outputs[0].text)
    print(f"\n[jvllm] {len(outs)} prompt(s), {n} tokens in {dt:.2f}s = {n / dt:.1f} tokens/s "
          f"(start-up {t_load:.1f}s incl. load + compile)", file=sys.stderr)
    llm.shutdown()
    failed = sum(c.finish_reason == "error" for o in outs for c in o.outputs)
    if failed:  # the engine logged the error; the output above is cut short, so the exit status says so
        say(f"{failed} of {len(outs)} prompt(s) failed in the engine (the error is logged above)")
        sys.exit(1)


def cmd_chat(a):
    llm, _ = start_engine(a)
    sp = sampling_params(a)
    messages = []
    if a.system:
        messages.append({"role": "system", "content": a.system})
    print("jvllm chat: type a message, empty line or Ctrl-D to quit.", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except EOFError:
            break
        if not line.strip():
            break
        messages.append({"role": "user", "content": line})
        eng = llm.llm_engine
        tok = llm.get_tokenizer()
        ids = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
        if hasattr(ids, "keys"):
            ids = ids["input_ids"]
        from jvllm.sampling_params import RequestOutputKind

        sp.output_kind = RequestOutputKind.DELTA
        rid = eng.add_request(None, {"prompt_token_ids": list(ids)}, sp)
        reply = []
        t0, n = time.perf_counter(), 0
        while eng.has_unfinished_requests():
            for out in eng.step():
                if out.request_id == rid:
                    piece = out.outputs[0].text
                    n += len(out.outputs[0].token_ids)
                    reply.append(piece)
                    print(piece, end="", flush=True)
                    if out.outputs[0].finish_reason == "error":
                        say("the engine failed on this reply (the error is logged above)")
        print(f"\n[{n / max(time.perf_counter() - t0, 1e-9):.1f} tok/s]", file=sys.stderr)
        messages.append({"role": "assistant", "content": "".join(reply)})
    llm.shutdown()


def cmd_verify(a):
    from jvllm.converters.deps import require_torch

    require_torch("jvllm verify")
    import jax

    from jvllm.verify import verify

    with jax.default_device(jax.devices("cpu")[0]):
        ok, _ = verify(a.model, atol=a.atol)
    sys.exit(0 if ok else 1)


def cmd_convert(a):
    from jvllm.converters import convert_to_orbax, load_checkpoint

    r = convert_to_orbax(a.src, a.dst, a.dtype, log=say)
    say(f"reloading {a.dst} to check it ...")
    t0 = time.perf_counter()
    ck = load_checkpoint(a.dst, a.dtype)
    if len(ck.params) != r.num_tensors:
        raise SystemExit(f"jvllm convert: {a.dst} reloaded {len(ck.params)} tensors, {r.num_tensors} were written")
    print(r.table(reload_s=time.perf_counter() - t0))


def cmd_compile_report(a):
    a.warmup = "all"  # the report is of every program
    llm, _ = start_engine(a)
    rows = llm.compile_report()
    eng = llm.llm_engine
    print(f"{'program':<28} {'GFLOP':>10} {'MB accessed':>12} {'temp MB':>9} {'fusions':>8}")
    for r in rows:
        print(f"{r['kind'] + ' ' + r['key']:<28} {r.get('flops', 0) / 1e9:>10.2f} "
              f"{r.get('bytes_accessed', 0) / 1e6:>12.1f} {r.get('temp_bytes', 0) / 1e6:>9.1f} {r.get('fusions', 0):>8}")
    print(f"{len(rows)} programs compiled in {eng.warmup_seconds:.1f}s")
    if a.output_json:
        with open(a.output_json, "w") as f:
            json.dump(dict(programs=rows, warmup_s=eng.warmup_seconds), f, indent=1)
    llm.shutdown()


def show_defaults(parser: argparse.ArgumentParser):
    """Every option's --help line ends with its default (also for options that have no help
    text, such as those other modules register)."""
    parser.formatter_class = argparse.ArgumentDefaultsHelpFormatter
    for action in parser._actions:
        if action.help is None and action.option_strings and action.default is not argparse.SUPPRESS:
            action.help = "(default: %(default)s)"


def build_parser() -> argparse.ArgumentParser:
    """The `jvllm` parser with every subcommand (serve, bench and launch when importable)."""
    from jvllm.converters import DEFAULT_MODEL

    ap = argparse.ArgumentParser(prog="jvllm", description="LLM inference on JAX")
    sub = ap.add_subparsers(dest="cmd", required=True)

    g = sub.add_parser("generate", help="generate text for one or more prompts")
    g.add_argument("prompt", nargs="*", help="prompts (none: one example prompt)")
    g.add_argument("--model", default=DEFAULT_MODEL, help="built-in name, checkpoint folder or .gguf file")
    # one batch of prompts, then exit: compiling every other bucket in the background would only
    # compete with the generation for the cores
    add_engine_args(g, warmup="first")
    add_sampling_args(g, max_tokens=64)
    g.set_defaults(func=cmd_generate)

    c = sub.add_parser("chat", help="interactive chat with the model's chat template")
    c.add_argument("--model", default=DEFAULT_MODEL, help="built-in name, checkpoint folder or .gguf file")
    c.add_argument("--system", default=None, help="system prompt")
    add_engine_args(c)
    add_sampling_args(c, max_tokens=256)
    c.set_defaults(func=cmd_chat)

    v = sub.add_parser("verify", help="compare jvllm's logits with transformers' on a checkpoint (needs torch)")
    v.add_argument("model", nargs="?", default=DEFAULT_MODEL, help="built-in name, checkpoint folder or .gguf file")
    v.add_argument("--atol", type=float, default=None, help="max |logit difference| allowed (None: 1e-3)")
    v.set_defaults(func=cmd_verify)

    cv = sub.add_parser("convert", help="convert a checkpoint to an Orbax folder (params + config + tokenizer)")
    cv.add_argument("src", help="built-in name, checkpoint folder or .gguf file")
    cv.add_argument("dst", help="Orbax folder to write")
    cv.add_argument("--dtype", default="float32", help="float32 | bfloat16 | float16")
    cv.set_defaults(func=cmd_convert)

    cr = sub.add_parser("compile-report", help="compile every bucket and report what XLA produced")
    cr.add_argument("--model", default=DEFAULT_MODEL, help="built-in name, checkpoint folder or .gguf file")
    cr.add_argument("--output-json", default=None, help="also write the rows to this JSON file")
    add_engine_args(cr)
    cr.set_defaults(func=cmd_compile_report)

    for mod in ("jvllm.server.cli", "jvllm.bench", "jvllm.launch"):
        try:
            __import__(mod, fromlist=["register"]).register(sub)
        except ImportError:
            pass
    for p in sub.choices.values():
        show_defaults(p)
    return ap


def main(argv=None):
    from jvllm.platform import cpu_only_default

    cpu_only_default()  # before jax starts: no TPU probe (and its log line) on a CPU-only install
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")  # no "PyTorch was not found" on import
    a = build_parser().parse_args(argv)
    if a.cmd == "verify" and a.atol is None:
        from jvllm.verify import DEFAULT_ATOL

        a.atol = DEFAULT_ATOL
    try:
        a.func(a)
    except MissingDependencyError as e:  # one line, no traceback: what is missing and how to get it
        msg = str(e)
        print(msg if msg.startswith("jvllm") else f"jvllm {a.cmd}: {msg}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
