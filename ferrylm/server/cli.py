"""`ferry serve`: flags, building the engine and the app, running uvicorn, and a clean SIGTERM.

Flags map 1:1 onto `ServerConfig` and (through `ferrylm.cli.add_engine_args`) onto the engine's config.
The HTTP port opens at once and the model loads on the engine thread meanwhile (/health says 503 until
it is ready); if loading fails the server exits with the load error.

SIGTERM: stop accepting, let in-flight requests finish for up to --shutdown-timeout seconds, then end
the rest ourselves (each open stream gets an error event and `[DONE]`, each waiting non-streaming request a
503 envelope) before uvicorn's own deadline (a few seconds later) would cut them at the TCP level; stop the
engine thread and exit 0, whether the model had loaded or not.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys

from ferrylm.errors import FerryError

DEFAULT_SERVED_NAME = "SmolLM2-135M-Instruct"
"""What the embedded default model is called when no --model is given."""
SHUTDOWN_GRACE = 5.0
"""Seconds between our shutdown deadline (streams end with an error event) and uvicorn's (connections cut)."""


def add_serve_args(p: argparse.ArgumentParser) -> None:
    from ferrylm.cli import add_engine_args  # here: ferrylm.cli may import this module at its top

    add_engine_args(p)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None,
                   help="require `Authorization: Bearer KEY` on /v1/*, /tokenize and /detokenize")
    p.add_argument("--served-model-name", nargs="+", default=None,
                   help="name(s) clients use for the model (default: the --model value, or SmolLM2-135M-Instruct)")
    p.add_argument("--max-queued-requests", type=int, default=1024,
                   help="waiting requests beyond which new ones get 503 (-1: unbounded)")
    p.add_argument("--max-request-bytes", type=int, default=16 * 2**20, help="larger request bodies get 413")
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds SIGTERM waits for in-flight requests before aborting them")
    p.add_argument("--disable-access-log", action="store_true", help="no log line per HTTP request")
    p.add_argument("--read-timeout", type=float, default=30.0,
                   help="seconds a client may take to send a request's headers, or pause while sending its body (408)")
    p.add_argument("--tool-call-parser", default=None, choices=["hermes", "llama3_json", "mistral"],
                   help="read tool calls out of generated text when tool_choice is auto (required/named need none)")
    p.add_argument("--metrics-compat", default=None, choices=["vllm"],
                   help="also expose every metric under vLLM's `vllm:` names (for vLLM's dashboards)")


def add_serve_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("serve", help="OpenAI-compatible HTTP server")
    add_serve_args(p)
    p.set_defaults(func=cmd_serve)
    return p


def add_export_tokenizer_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("export-tokenizer", help="write the model's tokenizer as an HF tokenizer directory "
                              "(for benchmark tools such as GuideLLM and AIPerf, offline)")
    p.add_argument("dir", help="directory to write tokenizer.json, tokenizer_config.json, special_tokens_map.json")
    p.add_argument("--model", default=None, help="model path (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--tokenizer", default=None, help="tokenizer directory, if not beside the model")
    p.set_defaults(func=cmd_export_tokenizer)
    return p


def cmd_export_tokenizer(a: argparse.Namespace) -> None:
    """`AutoTokenizer.from_pretrained(DIR)` then counts tokens and renders chat as the server does."""
    import json

    from ferrylm.default_model import default_model_path
    from ferrylm.tokenizer import Tokenizer

    tok = Tokenizer.load(a.tokenizer or a.model or default_model_path())
    os.makedirs(a.dir, exist_ok=True)
    tok.backend.save(os.path.join(a.dir, "tokenizer.json"))
    templates = tok.chat_templates
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False,
              "add_bos_token": bool(tok.add_bos), "add_eos_token": bool(tok.add_eos), **tok.special_tokens}
    if templates:
        config["chat_template"] = (templates["default"] if set(templates) == {"default"} else
                                   [{"name": k, "template": v} for k, v in templates.items()])
    with open(os.path.join(a.dir, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=2, ensure_ascii=False)
    with open(os.path.join(a.dir, "special_tokens_map.json"), "w") as f:
        json.dump(tok.special_tokens, f, indent=2, ensure_ascii=False)
    print(a.dir)


def server_config(a: argparse.Namespace):
    from ferrylm.default_model import default_model_path
    from ferrylm.server.app import ServerConfig

    root = a.model or default_model_path()  # fails now, with its own message, if the default is missing
    names = tuple(a.served_model_name or [a.model or DEFAULT_SERVED_NAME])
    return ServerConfig(served_model_names=names, model_root=root, host=a.host, port=a.port, api_key=a.api_key,
                        max_queued_requests=None if a.max_queued_requests < 0 else a.max_queued_requests,
                        max_request_bytes=a.max_request_bytes, shutdown_timeout=a.shutdown_timeout,
                        access_log=not a.disable_access_log, read_timeout=a.read_timeout,
                        tool_call_parser=a.tool_call_parser, metrics_compat=a.metrics_compat)


def cmd_serve(a: argparse.Namespace) -> None:
    import uvicorn

    from ferrylm.cli import engine_kwargs
    from ferrylm.engine.async_engine import AsyncEngine, EngineUnavailableError
    from ferrylm.server.app import create_app
    from ferrylm.server.read_timeout import protocol_class

    config = server_config(a)
    kwargs = engine_kwargs(a)

    def build_engine():
        from ferrylm import LLM

        return LLM(a.model, **kwargs).engine

    engine = AsyncEngine(build_engine, max_queued_requests=config.max_queued_requests)
    load_error: list[BaseException] = []
    stopping: list[bool] = []

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):
            if not stopping:
                stopping.append(True)
                engine.begin_drain()  # /health turns 503 and new requests are refused while in-flight ones finish
                engine.abort_all_later(config.shutdown_timeout, EngineUnavailableError(
                    "the server is shutting down: the request was aborted after --shutdown-timeout "
                    f"{config.shutdown_timeout:g} s"), then=report_aborted)
            super().handle_exit(sig, frame)

    def report_aborted(n: int) -> None:
        if n:
            logging.getLogger("ferrylm.server").warning("shutdown timeout: aborted %d request(s) in flight", n)

    def on_load_failed(e: BaseException) -> None:
        if stopping:  # SIGTERM while loading: the load was abandoned, not failed
            return
        load_error.append(e)
        server.should_exit = True

    from ferrylm.server import log_errors

    log_errors.install()  # a failing log stream is counted and reported, not silently dropped
    app = create_app(engine, config, on_load_failed=on_load_failed)
    # uvicorn's own deadline is a backstop behind ours: past it, it cancels tasks and cuts streams mid-way
    uv = uvicorn.Config(app, host=config.host, port=config.port, access_log=config.access_log,
                        timeout_graceful_shutdown=config.shutdown_timeout + SHUTDOWN_GRACE, log_level="info",
                        http=protocol_class(config.read_timeout), timeout_keep_alive=5)
    server = Server(uv)
    logging.getLogger("ferrylm.server").setLevel(logging.INFO)
    # uvicorn re-raises a caught SIGTERM once it has shut down; with the default action that would kill the
    # process (exit -15) after a clean drain, so the re-raised signal lands on a no-op instead.
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: None)
    try:
        server.run()
    finally:
        signal.signal(signal.SIGTERM, previous)
    if load_error:
        e = load_error[0]
        if isinstance(e, FerryError):
            raise e
        raise SystemExit(1)
    if stopping and not engine.is_loaded:
        # the engine thread is still inside the model load (torch code cannot be interrupted): leave without
        # waiting for it, and without running interpreter teardown under its feet
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


if __name__ == "__main__":  # `python -m ferrylm.server.cli ...` is `ferry serve ...`
    from ferrylm.cli import main

    sys.exit(main(["serve", *sys.argv[1:]]))
