"""`moechat serve`: the engine process of the chat app behind OpenAI's HTTP API."""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import os
import sys
import threading
from typing import Any

from moechat.app.run_cmd import add_config_flag
from moechat.app.settings import APP, ENGINE, MODEL_HELP, SAMPLING, SERVE, add_flags

API_KEY_ENV = "MOECHAT_API_KEY"


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", help=MODEL_HELP)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8080, help="port (default 8080; 0: any free one, printed)")
    p.add_argument("--api-key", default=os.environ.get(API_KEY_ENV), metavar="KEY",
                   help=f"every endpoint but /health then needs 'Authorization: Bearer KEY' (env {API_KEY_ENV}, "
                        "which keeps the key out of the process list)")  # fmt: skip
    add_flags(p, (*SAMPLING, *ENGINE, *SERVE))
    add_config_flag(p)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def run_serve(args: argparse.Namespace) -> int:
    from moechat.app.settings import check_model_file, from_args, print_warnings, sampling_params

    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in 0..65535, got {args.port}")
    if args.api_key is not None and not args.api_key.strip():
        raise ValueError("--api-key is empty")
    settings, warnings, _ = from_args(args, (*SAMPLING, *ENGINE, *SERVE))
    print_warnings(warnings)
    defaults = sampling_params(settings)  # bad values fail before the engine loads
    check_model_file(args.model)
    if not is_loopback(args.host) and not args.api_key:
        print(f"moechat: warning: serving on {args.host} without --api-key: anyone who reaches this address can "
              "use the model", file=sys.stderr)  # fmt: skip
    import uvicorn
    from moechat.app.engine_process import EngineSpec, ProcessEngine
    from moechat.app.paths import app_paths
    from moechat.app.run_cmd import StatusLine
    from moechat.app.serve.server import Gate, bind, build_app

    # The port first: one in use is one line within a second, not after the model's load; /health
    # says "loading" while the model loads behind the bound port.
    sock = bind(args.host, args.port)
    host, port = sock.getsockname()[:2]
    gate = Gate()
    server = uvicorn.Server(uvicorn.Config(gate, host=args.host, port=args.port, log_level="warning",
                                           access_log=False, lifespan="off"))  # fmt: skip
    loaded: list[Any] = []  # the engine, once loaded
    failed: list[BaseException] = []
    print(f"moechat: listening on http://{host}:{port} (loading the model: /health says loading)",
          file=sys.stderr, flush=True)  # fmt: skip

    def load() -> None:
        try:
            status = StatusLine()
            # The model runs in the engine's own process: this one (HTTP) loads neither torch nor the UI.
            engine = ProcessEngine(EngineSpec(args.model, settings, str(app_paths().data / "warm"),
                                              slots=settings.parallel), status)  # fmt: skip
            loaded.append(engine)
            status.done()
            gate.open(build_app(engine, defaults, api_key=args.api_key, parallel=settings.parallel))
            print(f"moechat: serving {engine.info.name} on http://{host}:{port}/v1 (Ctrl+C stops)",
                  file=sys.stderr, flush=True)  # fmt: skip
        except BaseException as e:  # the reason is said once the server has stopped
            failed.append(e)
            server.should_exit = True

    loader = threading.Thread(target=load, name="moechat-serve-load", daemon=True)
    loader.start()
    try:
        asyncio.run(server.serve(sockets=[sock]))
    finally:
        sock.close()
        gate.close()
        for engine in loaded:
            engine.close()
    if failed:
        raise failed[0]
    return 0


def add_attach_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("url", nargs="?", default="http://127.0.0.1:8080", help="the server (default http://127.0.0.1:8080)")
    p.add_argument(
        "--api-key",
        default=os.environ.get(API_KEY_ENV),
        metavar="KEY",
        help=f"the server's --api-key (env {API_KEY_ENV}, which keeps the key out of the process list)",
    )
    add_flags(p, (*SAMPLING, *APP))
    add_config_flag(p)


def run_attach(args: argparse.Namespace) -> int:
    """The chat app on a running server: its dashboard fed by the server's stats, its chat a client."""
    from pathlib import Path

    from moechat.app.paths import app_paths
    from moechat.app.settings import resolve

    given = getattr(args, "config", None)
    config = Path(given) if given else app_paths().config / "config.toml"
    if given and not config.is_file():
        raise ValueError(f"--config {config}: no such file")
    # The model's own defaults live on the server; here only what this client asks for and shows.
    settings, warnings = resolve({n: getattr(args, n, None) for n in (*SAMPLING, *APP)}, config_path=config)
    if not (sys.stdin.isatty() and sys.stdout.isatty()):
        raise ValueError("moechat attach opens the chat app: it needs a terminal")
    from moechat.app.serve.remote import RemoteEngine
    from moechat.app.tui import MoechatApp, run_tui

    def connect(progress: object) -> RemoteEngine:
        return RemoteEngine(args.url, args.api_key)

    app = MoechatApp(connect, settings, config_path=config, warnings=warnings, attached=True)
    return run_tui(app, app_paths().log / "moechat.log")
