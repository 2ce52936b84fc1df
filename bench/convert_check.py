"""Files made by llama.cpp's own converter and quantizer, run by moechat against transformers.

    pip install 'moechat[peer]'   # llama-cpp-python (its quantizer) built from source
    pip download llama-cpp-python==0.3.36 --no-deps --no-binary :all: -d /tmp/sdist && tar xzf ...
    python bench/convert_check.py --llama-cpp /tmp/sdist/llama_cpp_python-0.3.36/vendor/llama.cpp

For each family: a tiny transformers model (the test writer's random weights, put into
transformers' own classes) is saved with `save_pretrained`, converted by llama.cpp's
`convert_hf_to_gguf.py` to F32 and Q8_0, and the F32 file quantized to Q4_K_M by llama.cpp's
quantizer. Then:
- layout: the F32 file, read back into transformers' names by tests/testkit/hf_ref.py, equals the
  saved model's weights (so the converter lays tensors out as the test writer does);
- F32: moechat's logits against the saved model over 32 tokens (rel err), and 32 greedy tokens;
- Q8_0 and Q4_K_M: the same against transformers holding the file's dequantized weights.
Prints a table. The converter runs in a subprocess with its own gguf-py; only its vocabulary step
is replaced (a tiny model has no tokenizer files), by the test vocabulary.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from moechat.engine.events import GREEDY, TokenEvent
from moechat.engine.generate import generate
from moechat.engine.loader import LoadedModel, load_model

FAMILIES = ("qwen3next", "qwen35moe", "glm4moe", "deepseek2", "qwen3moe", "qwen2moe", "llama", "olmoe")
PROMPT = "The history of the city begins with a small fishing village on the river, where traders met"

# Runs in the converter's process: its vocabulary step writes the test vocabulary instead.
_CONVERT = """
import json, sys
sys.path.insert(0, {root!r})
sys.argv = ["convert_hf_to_gguf.py", {model!r}, "--outtype", {outtype!r}, "--outfile", {out!r}, *{extra!r}]
import convert_hf_to_gguf as c

vocab = json.load(open({vocab!r}))

def set_vocab(self):
    w = self.gguf_writer
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(vocab["tokens"])
    w.add_token_types(vocab["types"])
    w.add_token_merges(vocab["merges"])
    w.add_bos_token_id(vocab["bos"])
    w.add_eos_token_id(vocab["eos"])
    w.add_add_bos_token(False)

get = c.get_model_class

def patched(name, mmproj=False):
    cls = get(name, mmproj)
    cls.set_vocab = set_vocab
    return cls

c.get_model_class = patched
c.main()
"""


def _saved_model(arch: str, out: Path) -> tuple[Path, Any, Path]:
    """A tiny transformers model of `arch` saved in out/hf, and the test vocabulary as JSON."""
    from testkit.ggufgen import Q, tiny_moe
    from testkit.hf_ref import hf_reference
    from testkit.vocab import qwen_vocab

    # Converters write Qwen3-Next's interval of full attention as 4 whatever the model's layer list says.
    shape: dict[str, Any] = {"n_layers": 4, "extra": {f"{arch}.full_attention_interval": 4}} if arch in _NO_MTP else {}
    if arch == "olmoe":  # its converter writes OLMoE's norm epsilon, 1e-5, whatever the config says
        shape = {"extra": {"olmoe.attention.layer_norm_rms_epsilon": 1e-5}}
    path = tiny_moe(out / "src.gguf", arch=arch, expert_type=Q.F32, **shape)
    src = load_model(path, n_ctx=256, cpu_kernels="exact")
    hf = hf_reference(src.gguf, src.config)
    src.close()
    hf.save_pretrained(out / "hf")
    if arch == "deepseek2":  # DeepSeek-V3's own config.json names its sigmoid routing; transformers' class implies it
        config = json.loads((out / "hf" / "config.json").read_text())
        config |= {"scoring_func": "sigmoid", "topk_method": "noaux_tc"}
        (out / "hf" / "config.json").write_text(json.dumps(config))
    vocab = qwen_vocab(1024)
    vocab_path = out / "vocab.json"
    specials = vocab.specials
    vocab_path.write_text(json.dumps({"tokens": vocab.tokens, "types": vocab.types, "merges": vocab.merges,
                                      "bos": specials["<|endoftext|>"], "eos": specials["<|im_end|>"]}))  # fmt: skip
    return out / "hf", hf, vocab_path


# Families whose converter looks for MTP layers, which a tiny model has none of.
_NO_MTP = ("qwen3next", "qwen35moe")


def _convert(llama_cpp: Path, model: Path, outtype: str, out: Path, vocab: Path, arch: str) -> Path:
    extra = ["--no-mtp"] if arch in _NO_MTP else []
    code = _CONVERT.format(root=str(llama_cpp), model=str(model), outtype=outtype, out=str(out), vocab=str(vocab),
                           extra=extra)  # fmt: skip
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=llama_cpp)
    if r.returncode:
        raise RuntimeError(f"convert_hf_to_gguf.py ({outtype}) failed:\n{r.stderr[-3000:]}")
    return out


def _quantize(src: Path, out: Path, ftype_name: str = "LLAMA_FTYPE_MOSTLY_Q4_K_M") -> Path:
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, ftype_name)
    if llama_cpp.llama_model_quantize(str(src).encode(), str(out).encode(), params) != 0:
        raise RuntimeError(f"llama.cpp could not quantize {src}")
    return out


def _layout_error(lm: LoadedModel, hf: Any) -> float:
    """Largest difference between the saved model's weights and the converted file read back."""
    from testkit.hf_ref import hf_reference

    back = hf_reference(lm.gguf, lm.config).state_dict()
    ref = hf.state_dict()
    if set(back) != set(ref):
        raise RuntimeError(f"tensor names differ: {sorted(set(back) ^ set(ref))[:6]}")
    return max(float((back[k] - ref[k]).abs().max()) for k in ref)


def _against(lm: LoadedModel, hf: Any) -> tuple[float, bool]:
    """Logits rel err over 32 tokens, and whether 32 greedy tokens are the same."""
    ids = lm.tokenizer.encode(PROMPT)[:32]
    with torch.inference_mode():
        ours = lm.model(torch.tensor(ids), 0, lm.new_cache())
        ref = hf(torch.tensor([ids])).logits[0]
        events = generate(lm.model, lm.tokenizer, ids, lm.new_cache(), max_tokens=32, params=GREEDY, ignore_eos=True)
        mine = [e.token for e in events if isinstance(e, TokenEvent) and e.token >= 0]
        theirs = hf.generate(torch.tensor([ids]), max_new_tokens=32, min_new_tokens=32, do_sample=False,
                             eos_token_id=None, pad_token_id=0)[0, len(ids) :].tolist()  # fmt: skip
    return float((ours - ref).abs().max() / ref.abs().max()), mine == theirs


def check(arch: str, llama_cpp: Path, tmp: Path) -> list[tuple[str, str, float, float, bool]]:
    from testkit.hf_ref import hf_reference

    model_dir, hf, vocab = _saved_model(arch, tmp)
    rows = []
    f32_path = _convert(llama_cpp, model_dir, "f32", tmp / "f32.gguf", vocab, arch)
    f32 = load_model(f32_path, n_ctx=256, cpu_kernels="exact")
    layout = _layout_error(f32, hf)
    rel, same = _against(f32, hf)
    rows.append((arch, "F32", layout, rel, same))
    f32.close()
    q8 = _convert(llama_cpp, model_dir, "q8_0", tmp / "q8.gguf", vocab, arch)
    for name, path in (("Q8_0", q8), ("Q4_K_M", _quantize(tmp / "f32.gguf", tmp / "q4km.gguf"))):
        lm = load_model(path, n_ctx=256, cpu_kernels="exact")
        rel, same = _against(lm, hf_reference(lm.gguf, lm.config))
        rows.append((arch, name, float("nan"), rel, same))
        lm.close()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--llama-cpp", type=Path, required=True, help="llama.cpp's source (holds convert_hf_to_gguf.py)")
    ap.add_argument("--arch", action="append", help="these families only (repeatable)")
    args = ap.parse_args()
    print("| family | file | layout max diff | logits rel err | greedy 32 same |\n|---|---|---|---|---|")
    for arch in args.arch or FAMILIES:
        with tempfile.TemporaryDirectory() as tmp:
            try:
                rows = check(arch, args.llama_cpp, Path(tmp))
            except RuntimeError as e:
                print(f"| {arch} | failed: {str(e).splitlines()[-1][:200]} | | | |")
                continue
        for a, kind, layout, rel, same in rows:
            print(f"| {a} | {kind} | {layout:.1e} | {rel:.1e} | {'yes' if same else 'NO'} |")


if __name__ == "__main__":
    main()
