"""`moechat chat` (and `moechat` with no command): a plain line-mode chat until the Textual app lands.

Each turn renders the whole conversation through the chat template and streams the reply.
Ctrl+C stops a reply (the partial reply is kept), Ctrl+D or an empty stdin ends the chat.
"""

from __future__ import annotations

import argparse
import sys
import threading

from moechat.engine.generate import DoneEvent, SamplingParams, TokenEvent, generate
from moechat.engine.loader import LoadedModel, load_model

from .demo_model import resolve_model
from .run_cmd import add_cache_arguments, cache_settings

# A base model continuing the plain format writes the user's next line itself: stop there.
PLAIN_STOPS = ("\nUser:", "\nuser:")


def add_chat_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", help="path to a .gguf model (default: the built-in demo)")
    p.add_argument("-n", "--n-predict", type=int, default=256, help="most tokens per reply (default 256)")
    p.add_argument("-c", "--ctx-size", type=int, default=4096)
    p.add_argument("--temp", type=float, default=0.7)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--system", default=None, help="system prompt")
    p.add_argument("--chat-template", default=None, metavar="FILE")
    add_cache_arguments(p)


def run_chat(args: argparse.Namespace) -> int:
    params = SamplingParams(temperature=args.temp, seed=args.seed)
    params.validate()
    lm = load_model(resolve_model(args.model), n_ctx=args.ctx_size, chat_template=args.chat_template,
                    cache=cache_settings(args))  # fmt: skip
    plain = lm.template.origin == "plain fallback"
    messages: list[dict[str, str]] = [{"role": "system", "content": args.system}] if args.system else []
    interactive = sys.stdin.isatty()
    if interactive:
        print(f"moechat: {lm.config.name} ({lm.config.arch}). Ctrl+C stops a reply, Ctrl+D quits.", file=sys.stderr)
    try:
        while True:
            try:
                line = input("you> " if interactive else "")
            except EOFError:
                break
            if not line.strip():
                continue
            messages.append({"role": "user", "content": line})
            prompt = lm.tokenizer.encode(lm.template.render(messages), parse_special=True)
            if len(prompt) >= lm.n_ctx:
                print("moechat: the conversation no longer fits the context; start a new chat", file=sys.stderr)
                messages.pop()
                continue
            reply = _reply(lm, prompt, args.n_predict, params, plain)
            messages.append({"role": "assistant", "content": reply})
    finally:
        lm.close()
    return 0


def _reply(lm: LoadedModel, prompt: list[int], n: int, params: SamplingParams, plain: bool) -> str:
    stop = threading.Event()
    text = ""
    shown = 0
    max_tokens = min(n, lm.n_ctx - len(prompt))
    try:
        for ev in generate(lm.model, lm.tokenizer, prompt, lm.new_cache(), max_tokens=max_tokens, params=params,
                           stop=stop):  # fmt: skip
            if isinstance(ev, TokenEvent):
                text += ev.text
                cut = min((text.find(s) for s in PLAIN_STOPS if plain and s in text), default=-1)
                if cut >= 0:
                    text = text[:cut]
                    stop.set()
                # Hold back what could be the start of a stop string.
                safe = len(text) - (max(len(s) for s in PLAIN_STOPS) if plain and not stop.is_set() else 0)
                if safe > shown:
                    sys.stdout.write(text[shown:safe])
                    sys.stdout.flush()
                    shown = safe
            elif isinstance(ev, DoneEvent) and shown < len(text):
                sys.stdout.write(text[shown:])
    except KeyboardInterrupt:
        sys.stdout.write(text[shown:] + " [stopped]")
    sys.stdout.write("\n")
    sys.stdout.flush()
    return text.strip()
