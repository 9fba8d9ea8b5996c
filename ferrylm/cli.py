"""`ferry`: the command line. Engine flags are generated from the config fields (one spelling per knob);
errors the library raises on purpose (`FerryError`) print as one line, never a traceback.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time

from ferrylm.errors import FerryError, InvalidRequestError


# Engine flags are generated from the config dataclasses (ferrylm/config.py): a field is a flag of the same
# name with its docstring as help and its default; only what argparse cannot read off a field is said here.
FLAG_EXTRAS: dict[str, dict] = {
    "model": dict(help="HF model directory, .gguf file or ferry store (default: embedded SmolLM2-135M-Instruct)"),
    "device": dict(help="cpu | cuda | cuda:N"),
    "dtype": dict(choices=["auto", "float32", "bfloat16", "float16"]),
    "enable_prefix_caching": dict(flag="--no-prefix-caching"),
    "enable_chunked_prefill": dict(flag="--no-chunked-prefill"),
    "moe_backend": dict(choices=["auto", "torch"]),
    "attention_backend": dict(choices=["auto", "torch", "triton"]),
    "async_scheduling": dict(choices=["auto", "on", "off"]),
    "kv_cache_dtype": dict(choices=["auto", "fp8", "int8"]),
    "gpu_memory_budget": dict(type=str, metavar="BYTES", help="device memory ferrylm may use, e.g. 16GiB; a model "
                              "that does not fit is placed across device and host memory"),
    "place": dict(metavar="SELECTOR=gpu|cpu", help="placement rule, repeatable: experts=cpu, layers.0-7=gpu, "
                  "layers.4.experts.0-3=gpu, lm_head=gpu"),
    "expert_cache_policy": dict(choices=["lru", "lfu"]),
    "experts": dict(choices=["auto", "gpu", "cpu"]),
    "tp_groups": dict(choices=["auto", "in-order"]),
}
NOT_FLAGS = {"model_overrides"}


def _engine_fields():
    import dataclasses

    from ferrylm.config import SECTIONS, EngineConfig, field_docs

    for cls in (EngineConfig, *SECTIONS.values()):
        docs = field_docs(cls)
        for f in dataclasses.fields(cls):
            if f.name not in SECTIONS and f.name not in NOT_FLAGS:
                yield f, docs.get(f.name, "")


def add_engine_args(p, skip=frozenset(), **defaults) -> None:
    """Every engine knob but those in `skip` as a flag on `p` (a parser or an argument group); `defaults` overrides
    a field's default for this subcommand."""
    for f, doc in _engine_fields():
        if f.name in skip:
            continue
        extra = dict(FLAG_EXTRAS.get(f.name, {}))
        default = defaults.get(f.name, f.default)
        on = str(f.type) == "bool" and default is True  # a knob on by default is turned off by its flag
        flag = extra.pop("flag", ("--no-" if on else "--") + f.name.replace("_", "-"))
        kw = dict(dest=f.name, default=default, help=extra.pop("help", doc.split(". ")[0].strip() or None))
        ann = str(f.type)
        if ann == "bool":
            kw["action"] = "store_false" if flag.startswith("--no-") else "store_true"
            if kw["action"] == "store_false" and kw["help"]:
                kw["help"] = "turn off: " + kw["help"]
        elif ann.startswith("tuple"):
            kw.update(action="append", default=list(default))
        else:
            kw["type"] = int if ann.startswith("int") else float if ann.startswith("float") else str
        kw.update(extra)
        p.add_argument(flag, **kw)


def engine_kwargs(a: argparse.Namespace) -> dict:
    """The engine options of parsed flags, for `LLM(a.model, **engine_kwargs(a))`."""
    return {f.name: tuple(getattr(a, f.name)) if str(f.type).startswith("tuple") else getattr(a, f.name)
            for f, _ in _engine_fields() if f.name != "model"}


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=-1)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def sampling_params(a: argparse.Namespace, seed: int | None = None):
    from ferrylm.sampling_params import SamplingParams

    return SamplingParams(max_tokens=a.max_tokens, temperature=a.temperature, top_p=a.top_p, top_k=a.top_k,
                          min_p=a.min_p, repetition_penalty=a.repetition_penalty, stop=a.stop, seed=seed)


def load_llm(a: argparse.Namespace):
    from rich.progress import Progress

    from ferrylm import LLM

    with Progress(transient=True) as bar:
        task = bar.add_task("loading weights", total=None)
        llm = LLM(a.model, progress=lambda name: bar.advance(task), **engine_kwargs(a))
    return llm


def stream(llm, prompt_ids: list[int], params) -> tuple[str, int, float]:
    """Runs one request, printing text as it arrives; returns (text, tokens, seconds after first token)."""
    engine = llm.engine
    rid = engine.add_request(prompt_ids, params)
    printed, t_first, n = "", None, 0
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.request_id != rid:
                continue
            out = o.outputs[0]
            if t_first is None and out.token_ids:
                t_first = time.perf_counter()
            n = len(out.token_ids)
            sys.stdout.write(out.text[len(printed):])
            sys.stdout.flush()
            printed = out.text
    sys.stdout.write("\n")
    return printed, n, time.perf_counter() - (t_first or time.perf_counter())


def encode_prompt(llm, messages_or_text, chat: bool) -> list[int]:
    tok = llm.engine.tokenizer_required()
    if chat:
        return tok.encode(tok.apply_chat_template(messages_or_text, add_generation_prompt=True), add_special_tokens=False)
    return tok.encode(messages_or_text)


def cmd_generate(a: argparse.Namespace) -> None:
    llm = load_llm(a)
    tok = llm.engine.tokenizer_required()
    chat = a.chat if a.chat is not None else tok.chat_template is not None
    ids = encode_prompt(llm, [{"role": "user", "content": a.prompt}] if chat else a.prompt, chat)
    _, n, secs = stream(llm, ids, sampling_params(a, seed=a.seed))
    if a.stats:
        rate = (n - 1) / secs if n > 1 and secs > 0 else float("nan")
        print(f"[{n} tokens, {rate:.1f} tokens/s after the first]", file=sys.stderr)
        runner = llm.engine.runner
        if not runner.placement.fully_resident:
            st = runner.placed.stats
            hit = "n/a" if st.hit_rate is None else f"{st.hit_rate:.1%}"
            print(f"[offload: {st.h2d_bytes / max(n, 1) / 2**20:.1f} MiB host->device per token, expert cache hit "
                  f"rate {hit}, {st.weight_waits} waits on copies, {st.weight_wait_s * 1e3:.1f} ms in all]",
                  file=sys.stderr)
            if st.expert_hits + st.expert_misses:
                print(f"[experts {st.per_step()}]", file=sys.stderr)


def cmd_chat(a: argparse.Namespace) -> None:
    llm = load_llm(a)
    history = [{"role": "system", "content": a.system}] if a.system else []
    print("ferry chat: type a message, /reset to clear, /exit or Ctrl-D to quit", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except EOFError:
            print(file=sys.stderr)
            return
        if line.strip() in ("/exit", "/quit"):
            return
        if line.strip() == "/reset":
            history = history[:1] if a.system else []
            continue
        if not line.strip():
            continue
        history.append({"role": "user", "content": line})
        try:
            text, _, _ = stream(llm, encode_prompt(llm, history, chat=True), sampling_params(a))
        except InvalidRequestError as e:  # e.g. the conversation outgrew the context: keep the session
            history.pop()
            print(f"ferry chat: {e} (/reset starts over)", file=sys.stderr)
            continue
        history.append({"role": "assistant", "content": text})


def cmd_profile(a: argparse.Namespace) -> None:
    from ferrylm import files
    from ferrylm.errors import ConfigError
    from ferrylm.offload import expert_profile

    # everything that can be wrong with the flags is said before the model loads and the workload runs
    if a.repeat < 1:
        raise ConfigError(f"--repeat {a.repeat}: run the prompts 1 or more times")
    if a.trace_steps is not None and a.trace_steps < 0:
        raise ConfigError(f"--trace-steps {a.trace_steps}: a number of decode steps, 0 or more")
    out = files.writable_target("--output", a.output, "experts.json")
    if a.prompts:
        try:
            with open(a.prompts) as f:
                prompts = [line.rstrip("\n") for line in f if line.strip()]
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"--prompts {a.prompts}: {getattr(e, 'strerror', None) or e}") from None
        if not prompts:
            raise ConfigError(f"--prompts {a.prompts}: no prompt in it (one a line)")
    else:
        prompts = expert_profile.PROMPTS
    llm = load_llm(a)
    if llm.engine.tokenizer is None:
        print("ferry profile: the model has no tokenizer: profiling on random token ids", file=sys.stderr)
    profile = expert_profile.record(llm, prompts * a.repeat, sampling_params(a, seed=a.seed), a.seed,
                                    **({} if a.trace_steps is None else {"trace_steps": a.trace_steps}))
    try:
        expert_profile.write(profile, out)
    except OSError as e:
        raise ConfigError(f"--output {a.output}: cannot write it ({e.strerror or e})") from None
    total = sum(sum(v) for v in profile["layers"].values())
    traced = len(next(iter(profile.get("decode_trace", {}).values()), []))
    print(f"wrote {a.output}: {len(profile['layers'])} MoE layers, {total} routed assignments over "
          f"{len(prompts) * a.repeat} prompts" + (f", {traced} decode steps traced at batch 1" if traced else ""),
          file=sys.stderr)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ferry", description="ferrylm: LLM inference engine and server")
    parser.add_argument("-v", "--verbose", action="store_true",
                        help=f"log what the engine does (INFO; ${LOG_LEVEL_ENV} sets the level, -v lowers it to INFO)")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text for one prompt, streamed to the terminal")
    g.add_argument("prompt")
    mode = g.add_mutually_exclusive_group()
    mode.add_argument("--chat", dest="chat", action="store_true", default=None,
                      help="wrap the prompt in the chat template (default when the model has one)")
    mode.add_argument("--raw", dest="chat", action="store_false", help="plain completion, no chat template")
    g.add_argument("--stats", action="store_true", help="print tokens/s to stderr at the end (an offloaded model: "
                   "also the bytes moved, the expert hit rate and where each step's experts ran)")
    add_engine_args(g, max_num_seqs=1)  # one prompt: a KV pool for one sequence
    add_sampling_args(g)
    g.set_defaults(func=cmd_generate)

    c = sub.add_parser("chat", help="interactive chat in the terminal")
    c.add_argument("--system", default=None, help="system prompt")
    add_engine_args(c, max_num_seqs=1)
    add_sampling_args(c)
    c.set_defaults(func=cmd_chat)

    pr = sub.add_parser("profile", help="record expert routing over a workload; --expert-profile uses the file")
    pr.add_argument("--output", "-o", required=True, help="profile JSON to write")
    pr.add_argument("--prompts", default=None, help="text file, one prompt per line (default: a built-in mix)")
    pr.add_argument("--repeat", type=int, default=1, help="run the prompts this many times")
    pr.add_argument("--trace-steps", type=int, default=None,
                    help="then run the prompts one at a time, recording the routing of this many decode steps "
                         "(how tokens reuse experts: `ferry plan` replays the slot policy on it; 0: none; "
                         "default expert_profile.TRACE_STEPS, 256)")
    add_engine_args(pr)
    add_sampling_args(pr)
    pr.set_defaults(func=cmd_profile, max_tokens=64)

    from ferrylm.server.cli import add_export_tokenizer_parser, add_serve_parser
    from ferrylm.weights.convert import add_convert_parser
    from ferrylm.plan.cli import add_plan_parser
    from ferrylm.hw.cli import add_doctor_parser
    from ferrylm.bench.cli import add_bench_parser

    add_serve_parser(sub)
    add_export_tokenizer_parser(sub)
    add_convert_parser(sub)
    add_plan_parser(sub)
    add_doctor_parser(sub)
    add_bench_parser(sub)
    return parser


def _torchrun_rank() -> int:
    from ferrylm.parallel.launch import torchrun_env

    env = torchrun_env()
    return int(env["RANK"]) if env else 0


LOG_LEVEL_ENV = "FERRY_LOG_LEVEL"
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def parse_log_level(raw: str | None) -> int | None:
    """A $FERRY_LOG_LEVEL value as a logging level: a name logging knows (any case: DEBUG ... CRITICAL, WARN,
    FATAL) or a number; WARNING when unset or empty; None when it is neither."""
    name = (raw or "").strip().upper() or "WARNING"
    if name.lstrip("-").isdigit():
        return int(name)
    level = logging.getLevelName(name)  # a known name's number, else a string
    return level if isinstance(level, int) and name != "NOTSET" else None


def log_level(verbose: bool, env: dict | None = None) -> int:
    """The level `ferry` logs at: $FERRY_LOG_LEVEL (`parse_log_level`; WARNING when unset, empty or not a level:
    `main` says so on stderr and runs on, so a stray value never stops a server or `ferry doctor`, which judges it),
    lowered to INFO by -v."""
    level = parse_log_level((os.environ if env is None else env).get(LOG_LEVEL_ENV))
    level = logging.WARNING if level is None else level
    return min(level, logging.INFO) if verbose else level


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    raw = os.environ.get(LOG_LEVEL_ENV)
    if parse_log_level(raw) is None:
        print(f"ferry: warning: {LOG_LEVEL_ENV}={raw!r} is not a level ({', '.join(LOG_LEVELS)} or a number); "
              "logging at WARNING", file=sys.stderr)
    try:
        logging.basicConfig(level=log_level(args.verbose), format="%(levelname)s %(name)s: %(message)s")
        if hasattr(args, "tensor_parallel_size") and _torchrun_rank() > 0:  # a worker: serves rank 0's steps
            from ferrylm.config import engine_config
            from ferrylm.parallel.launch import torchrun_worker

            return torchrun_worker(engine_config(model=args.model, model_overrides={}, **engine_kwargs(args)))
        args.func(args)
    except FerryError as e:
        print(f"ferry: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
