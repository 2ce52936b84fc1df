"""`moechat run`: generate from a prompt on the command line, streaming to stdout."""

from __future__ import annotations

import argparse
import sys
import threading

from moechat.engine.generate import DoneEvent, SamplingParams, TokenEvent, generate
from moechat.engine.loader import load_model


def add_run_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="path to a .gguf model")
    p.add_argument("-p", "--prompt", required=True, help="the prompt")
    p.add_argument("-n", "--n-predict", type=int, default=128, help="tokens to generate (default 128)")
    p.add_argument("-c", "--ctx-size", type=int, default=4096, help="context size in tokens (default 4096)")
    p.add_argument("--temp", type=float, default=0.8, help="temperature; 0 = greedy (default 0.8)")
    p.add_argument("--top-k", type=int, default=40)
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--min-p", type=float, default=0.05)
    p.add_argument("--repeat-penalty", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None, help="same seed, same tokens")
    p.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-generation tokens")
    p.add_argument("--chat-template", default=None, metavar="FILE", help="Jinja chat template overriding the GGUF's")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--chat", dest="chat", action="store_true", default=None, help="prompt as one user turn")
    mode.add_argument("--raw", dest="chat", action="store_false", help="prompt as given (BOS per the model)")


def run(args: argparse.Namespace) -> int:
    params = SamplingParams(
        temperature=args.temp, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
        repeat_penalty=args.repeat_penalty, seed=args.seed,
    )  # fmt: skip
    params.validate()
    if args.n_predict < 0:
        raise ValueError(f"-n/--n-predict must be >= 0, got {args.n_predict}")
    lm = load_model(args.model, n_ctx=args.ctx_size, chat_template=args.chat_template)
    chat = args.chat if args.chat is not None else lm.template.origin != "plain fallback"
    prompt = lm.chat_prompt(args.prompt) if chat else lm.tokenizer.encode(args.prompt)
    stop = threading.Event()
    out = sys.stdout
    try:
        for ev in generate(lm.model, lm.tokenizer, prompt, lm.new_cache(), max_tokens=args.n_predict,
                           params=params, ignore_eos=args.ignore_eos, stop=stop):  # fmt: skip
            if isinstance(ev, TokenEvent):
                out.write(ev.text)
                out.flush()
            elif isinstance(ev, DoneEvent):
                out.write("\n")
                print(
                    f"prompt: {ev.n_prompt} tokens, {ev.prompt_tps:.1f} t/s | "
                    f"generation: {ev.n_generated} tokens, {ev.gen_tps:.1f} t/s | stop: {ev.stop_reason}",
                    file=sys.stderr,
                )
    except KeyboardInterrupt:
        out.write("\n")
        out.flush()
        print("moechat: interrupted", file=sys.stderr)
        return 130
    return 0
