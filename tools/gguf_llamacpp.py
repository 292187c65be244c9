"""GGUF export checked against llama.cpp itself: a model folder (SmolLM2 from assets/ by default) exported by
framework/export.py, then run by llama.cpp (llama-cpp-python's ``llama_cpp.Llama``) and by transformers reading
the same file. `make gguf-llamacpp` installs llama-cpp-python (built from source: many minutes) and runs this::

    .venv/bin/python tools/gguf_llamacpp.py [--model assets/SmolLM2-135M-Instruct] [--gguf q8_0] [--tokens 24]

Checked (exit 0, else 1 with both sides printed): the file carries the folder's chat template; llama.cpp tokenizes the
chat prompt to transformers' ids (asking for BOS where the file says to add one); both continue it greedily with the
same tokens. transformers runs the file's weights dequantized; llama.cpp runs them quantized with its own kernels
(activations rounded too), so the last prompt position's logits differ slightly: printed, not checked. The
continuation of the folder itself (the unrounded weights) is printed beside them.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from framework.export import export_gguf  # noqa: E402  (the checkout's framework, installed or not)

PROMPT = [{"role": "user", "content": "What is 26 + 28? Explain in one sentence."}]


def greedy(model, ids: torch.Tensor, tokens: int) -> list:
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=tokens, do_sample=False, attention_mask=torch.ones_like(ids))
    return out[0, ids.shape[1]:].tolist()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=ROOT / "assets" / "SmolLM2-135M-Instruct")
    parser.add_argument("--gguf", default="q8_0", help="the GGUF type to export and run (default q8_0)")
    parser.add_argument("--tokens", type=int, default=24, help="greedy tokens to compare (default 24)")
    args = parser.parse_args()
    from llama_cpp import Llama

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    text = tokenizer.apply_chat_template(PROMPT, add_generation_prompt=True, tokenize=False)
    ids = tokenizer(text, return_tensors="pt")["input_ids"]
    with tempfile.TemporaryDirectory() as tmp:
        path = export_gguf(args.model, args.gguf, Path(tmp) / f"model-{args.gguf}.gguf")
        print(f"exported {args.model} as {path.name} ({path.stat().st_size >> 20} MB)")
        ours = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name).eval()
        llm = Llama(model_path=str(path), n_ctx=512, n_threads=torch.get_num_threads(), seed=0, verbose=False)
        template = llm.metadata.get("tokenizer.chat_template")
        theirs_ids = llm.tokenize(text.encode(), add_bos=True, special=True)
        llm.eval(theirs_ids)
        theirs_logits = torch.tensor(llm.scores[llm.n_tokens - 1])
        theirs = []
        for token in llm.generate(theirs_ids, top_k=1, temp=0.0, repeat_penalty=1.0, reset=True):
            if len(theirs) == args.tokens or token == llm.token_eos():
                break
            theirs.append(token)
    with torch.no_grad():
        our_logits = ours(ids).logits[0, -1]
    transformers_gguf = greedy(ours, ids, args.tokens)
    folder = greedy(AutoModelForCausalLM.from_pretrained(args.model).eval(), ids, args.tokens)
    checks = {
        "chat template carried": template == tokenizer.chat_template,
        "prompt ids equal": theirs_ids == ids[0].tolist(),
        "greedy continuation equal": theirs == transformers_gguf[:len(theirs)] and len(theirs) > 0,
    }
    print(f"prompt: {len(theirs_ids)} tokens by llama.cpp, {ids.shape[1]} by transformers")
    print(f"last prompt position: max |logit difference| llama.cpp vs transformers (same file) "
          f"{(theirs_logits - our_logits).abs().max().item():.4f}, argmax {theirs_logits.argmax().item()} vs "
          f"{our_logits.argmax().item()}")
    for name, tokens in (("llama.cpp", theirs), ("transformers, the GGUF", transformers_gguf),
                         ("transformers, the folder", folder)):
        print(f"{name}: {tokens}\n    {tokenizer.decode(tokens)!r}")
    for name, ok in checks.items():
        print(f"{'ok' if ok else 'FAILED'}: {name}")
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
