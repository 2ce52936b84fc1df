"""The `moechat` command line."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence

from moechat.app.paths import app_paths

from moechat import __version__

logger = logging.getLogger("moechat")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="moechat",
        description="Chat with a local Mixture-of-Experts GGUF model whose experts live in host RAM.",
    )
    parser.add_argument("--version", action="version", version=f"moechat {__version__}")
    parser.add_argument("--paths", action="store_true", help="print the config, data, cache and log directories")
    parser.add_argument("-v", "--verbose", action="store_true", help="log debug messages to stderr")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    p_inspect = sub.add_parser("inspect", help="show what a GGUF model file holds")
    from moechat.app.settings import MODEL_HELP

    p_inspect.add_argument("model", nargs="?", help=MODEL_HELP)
    p_inspect.add_argument("--hosts", type=int, default=1, metavar="N",
                           help="plan a split of the layers over N hosts (torch.distributed): who maps what, "
                           "what each needs, the bytes per token on the wire")  # fmt: skip
    p_inspect.add_argument("--host-memory", type=float, nargs="+", metavar="GIB",
                           help="each host's memory in GiB, rank 0 first (one value: every host; "
                           "default: this machine's)")  # fmt: skip
    p_inspect.add_argument("-c", "--ctx-size", type=int, default=4096, metavar="N",
                           help="context the plan's KV caches hold (default 4096)")  # fmt: skip
    p_inspect.add_argument("--fit", action="store_true",
                           help="where the model's parts go on the device and the expert cache auto gives it "
                           "(--moe-cache-mib auto)")  # fmt: skip
    p_inspect.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                           help="the device --fit sizes for (default auto)")  # fmt: skip
    p_inspect.add_argument("--emulate-device-mib", type=float, default=0.0, metavar="N",
                           help="--fit on the CPU device: a device memory of N MiB, as a GPU's")  # fmt: skip
    p_inspect.add_argument("--emulate-link-gbps", type=float, default=0.0, metavar="G",
                           help="--fit on the CPU device: uploads over a link of G GB/s, as a GPU's")  # fmt: skip
    p_inspect.add_argument("--remeasure", action="store_true",
                           help="--fit: measure the link's and the CPU's speeds behind --moe-cache-cpu-share auto "
                           "again (kept per machine from the first load)")  # fmt: skip
    p_chat = sub.add_parser("chat", help="chat in the terminal (the default command)")
    from moechat.app.repl import add_chat_arguments

    add_chat_arguments(p_chat)
    p_run = sub.add_parser("run", help="generate text from a prompt")
    from moechat.app.run_cmd import add_run_arguments

    add_run_arguments(p_run)
    from moechat.app.tune_cmd import add_sim_arguments, add_tune_arguments

    add_tune_arguments(sub.add_parser(
        "tune", help="measure this machine and recommend cache size and CPU share",
        description="Measures 7 runs of generation, 2 expert-cache sizes x 3 CPU shares and one without a cache "
        "(runs already measured with the same settings are reused; --fresh measures again), fits a time model to "
        "them, predicts every other size and share by replaying the routing they recorded, and prints the "
        "recommended flags (no cache, where that ran fastest). Exit status: 0 when a recommendation is printed (a "
        "doubtful fit says so in its warnings), 2 for a bad argument or file, 130 when interrupted.",
    ))  # fmt: skip
    add_sim_arguments(sub.add_parser("sim", help="replay a routing trace at other cache sizes, shares and policies"))
    from moechat.app.serve.command import add_attach_arguments, add_serve_arguments

    add_serve_arguments(sub.add_parser("serve", help="serve the model over OpenAI's HTTP API (with /metrics)"))
    add_attach_arguments(sub.add_parser("attach", help="the chat app and its live dashboard on a running server"))
    from moechat.app.export_cmd import add_export_arguments

    add_export_arguments(sub.add_parser("export", help="write the last session's stats as JSON, CSV or Markdown"))
    for command in sub.choices.values():  # `moechat chat -v` as `moechat -v chat`
        command.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS,
                             help="log debug messages to stderr (line-mode chat: and each reply's stats)")  # fmt: skip
    return parser


def _fail(message: str) -> int:
    # One line, no traceback: the message already names the file, place and cause.
    print(f"moechat: error: {message}", file=sys.stderr)
    return 2


COMMANDS = ("inspect", "chat", "run", "tune", "sim", "export", "serve", "attach")


def _could_be_model(arg: str) -> bool:
    """Whether `moechat ARG` may name a model (then the chat opens on it) rather than a mistyped command."""
    return (
        arg.startswith("-")
        or arg.startswith("demo")
        or arg.lower().endswith(".gguf")
        or "/" in arg
        or os.sep in arg
        or os.path.exists(arg)
    )


def check_plan_arguments(hosts: int, host_memory: list[float] | None, n_ctx: int) -> None:
    """`--hosts`, `--host-memory` and `--ctx-size`, checked before the file is read."""
    if hosts < 1:
        raise ValueError(f"--hosts must be at least 1, got {hosts}")
    if host_memory is not None:
        if len(host_memory) not in (1, hosts):
            raise ValueError(f"--host-memory takes one size or one per host ({hosts}), got {len(host_memory)}")
        if any(not m > 0 for m in host_memory):
            raise ValueError("--host-memory sizes must be above 0 GiB")
    if n_ctx < 1:
        raise ValueError(f"--ctx-size must be at least 1, got {n_ctx}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    # `moechat MODEL.gguf [flags]` and `moechat [flags]` mean `moechat chat ...`.
    i = 0
    while i < len(argv) and argv[i] in ("-v", "--verbose"):
        i += 1
    if not (i < len(argv) and argv[i] in COMMANDS) and not any(
        a in ("-h", "--help", "--version", "--paths") for a in argv
    ):
        if i < len(argv) and not _could_be_model(argv[i]):
            return _fail(f"'{argv[i]}' is neither a command ({', '.join(COMMANDS)}) nor a model file (a .gguf path, "
                         "demo or demo:gemma); `moechat --help` lists the commands")  # fmt: skip
        argv = [*argv[:i], "chat", *argv[i:]]
    args = parser.parse_args(argv)
    # -v is moechat's own debug messages: numba's would be tens of thousands of lines on a first start.
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if args.verbose:
        logger.setLevel(logging.DEBUG)
    if args.command == "inspect":
        from moechat.app.settings import check_model_file

        try:
            check_plan_arguments(args.hosts, args.host_memory, args.ctx_size)
            check_model_file(args.model)
        except (ValueError, OSError) as e:
            return _fail(str(e))
    from moechat.engine.malloc import tune_malloc

    tune_malloc()
    if args.paths:
        for name, path in app_paths().as_dict().items():
            print(f"{name:<7} {path}")
        return 0
    try:
        if args.command == "inspect":
            from moechat.app.demo_model import resolve_model
            from moechat.app.inspect_cmd import run_inspect
            from rich.console import Console

            if args.fit:
                from moechat.app.inspect_cmd import run_fit

                return run_fit(str(resolve_model(args.model)), Console(), args.device, args.emulate_device_mib,
                               args.ctx_size, args.emulate_link_gbps, args.remeasure)  # fmt: skip
            return run_inspect(str(resolve_model(args.model)), Console(), hosts=args.hosts,
                               host_memory=args.host_memory, n_ctx=args.ctx_size)  # fmt: skip
        if args.command == "run":
            from moechat.app.run_cmd import run

            return run(args)
        if args.command in ("serve", "attach"):
            from moechat.app.serve.command import run_attach, run_serve

            return run_serve(args) if args.command == "serve" else run_attach(args)
        if args.command in ("tune", "sim"):
            from moechat.app.tune_cmd import run_sim, run_tune

            return run_tune(args) if args.command == "tune" else run_sim(args)
        from moechat.app.repl import run_chat

        if args.command == "export":
            from moechat.app.export_cmd import run_export

            return run_export(args)
        return run_chat(args)
    except (ValueError, OSError) as e:
        from moechat.app.settings import error_line

        return _fail(error_line(e))
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
