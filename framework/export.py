"""A trained model folder as one GGUF file, the format llama.cpp runs (and the tools built on it: llama-cpp-python,
ollama, LM Studio)::

    python -m framework.export MODEL_DIR --gguf q8_0 [--gguf f16 ...] [--out FILE]

MODEL_DIR: a run's ``output_dir`` (its ``model/`` is written) or a folder ``save_pretrained`` wrote, in safetensors: a
causal LM of the Llama family (llama, SmolLM2, mistral) or qwen2, with a byte-level BPE tokenizer. A LoRA ``model/``
that holds only the adapter is merged into its base first (the base named by ``adapter_config.json``, which must be
a local folder). Each ``--gguf`` type writes one file; without ``--out`` it goes next to the model folder as
``<folder>-<type>.gguf`` (a run's ``model/`` gives ``output_dir/model-q8_0.gguf``). Bad input exits 2 with one
``error:`` line; a disk that fails the write exits 5.

The file is what llama.cpp's ``convert_hf_to_gguf.py`` writes for the same folder (and ``llama-quantize`` for q4_1):
its tensor names (gguf's ``TensorNameMap``), the query and key projections of a Llama permuted into llama.cpp's
rotary layout (transformers' GGUF reader permutes them back), no output matrix when the embeddings are tied, the
hyperparameters under the architecture's keys, and the tokenizer as llama.cpp reads it: the tokens and their types,
the merges, the special ids, whether BOS/EOS are added, the pre-tokenizer's name and the chat template. The weights
are quantized by the ``gguf`` package's own quantizers (``gguf.quants``, ports of ggml's reference ones).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Tuple

import gguf
import numpy as np
import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from framework import disk
from framework.errors import UserError

GGML = gguf.GGMLQuantizationType


@dataclass(frozen=True)
class Kind:
    """One ``--gguf`` type: the file type it declares and the tensor types it writes."""

    file_type: gguf.LlamaFileType
    weights: GGML  # the 2-D weights
    output: GGML  # the output matrix (the token embeddings when they are tied to it): the logits' precision
    about: str


# llama-quantize gives the output matrix of a Q4_1 model Q6_K, or Q8_0 where its rows are not a multiple of 256 long
# (SmolLM2's 576): gguf has no Q6_K quantizer, so Q8_0 always (the shipped SmolLM2 Q4_1 file has Q8_0 there too).
KINDS: Dict[str, Kind] = {
    "f16": Kind(gguf.LlamaFileType.MOSTLY_F16, GGML.F16, GGML.F16, "16-bit floats"),
    "q8_0": Kind(gguf.LlamaFileType.MOSTLY_Q8_0, GGML.Q8_0, GGML.Q8_0, "8-bit blocks of 32 with a scale"),
    "q4_1": Kind(gguf.LlamaFileType.MOSTLY_Q4_1, GGML.Q4_1, GGML.Q8_0,
                 "4-bit blocks of 32 with a scale and a minimum, the output matrix in Q8_0"),
}


@dataclass(frozen=True)
class Architecture:
    arch: gguf.MODEL_ARCH
    permute: bool  # the query and key rows into llama.cpp's rotary layout (its Llama graph rotates pairs i, i+1)


# model_type -> how llama.cpp's converter writes it; mistral is written as llama, as llama.cpp does (its sliding
# window is dropped: llama.cpp's Llama graph attends to the whole context).
ARCHITECTURES: Dict[str, Architecture] = {
    "llama": Architecture(gguf.MODEL_ARCH.LLAMA, permute=True),
    "mistral": Architecture(gguf.MODEL_ARCH.LLAMA, permute=True),
    "qwen2": Architecture(gguf.MODEL_ARCH.QWEN2, permute=False),
}
# Buffers some checkpoints carry that are no weights (llama.cpp's converter skips them too).
SKIPPED = (".rotary_emb.inv_freq",)

# The pre-tokenizer, by the name llama.cpp knows it (tokenizer.ggml.pre): how text is split before the merges.
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+")
SPLITS = {LLAMA3_SPLIT: "llama-bpe", QWEN2_SPLIT: "qwen2"}
NORMALIZERS = (None, "NFC")  # llama.cpp applies none; NFC (Qwen2's) leaves ordinary text as it is


def default_out(model_dir: Path, kind: str) -> Path:
    """Next to the model folder: ``<folder>-<kind>.gguf`` (a run's ``model/`` gives ``output_dir/model-q8_0.gguf``),
    outside it, so that the folder stays what ``save_pretrained`` wrote."""
    model_dir = Path(model_dir).absolute()
    return model_dir.parent / f"{model_dir.name}-{kind}.gguf"


def kind_of(name: str, key: str = "--gguf") -> Kind:
    """The ``Kind`` a type name stands for (any case), or a UserError naming ``key`` (the option or recipe key that
    gave it) and the types there are."""
    kind = KINDS.get(name.lower())
    if kind is None:
        raise UserError(f"{key}: no GGUF type '{name}' here; use one of {', '.join(KINDS)} (k-quants such as "
                        "Q4_K_M need llama.cpp's llama-quantize, run on the f16 file)")
    return kind


def recipe_problems(model_type: Optional[str], tokenizer: Optional[Path], key: str = "export.gguf") -> List[str]:
    """What can be told before a run trains of whether its model will export (``key``: the recipe key asking):
    ``model_type`` (None: not known before the model loads, a Hub model or a GGUF file) and the tokenizer folder
    (None: not a local folder). The rest (weights, rotary scaling, biases) is checked when the file is written."""
    problems = []
    if model_type is not None and model_type not in ARCHITECTURES:
        problems.append(f"{key}: a {model_type} model has no GGUF writer here; GGUF export writes causal LMs of type "
                        f"{', '.join(ARCHITECTURES)}; remove {key}")
    if tokenizer is not None and (tokenizer / "tokenizer.json").is_file():
        try:
            pre_tokenizer_name(tokenizer)
        except UserError as e:
            problems.append(f"{key}: {e}")
    return problems


def locate(path: Path) -> Path:
    """The model folder of a run's ``output_dir`` or of a model folder itself."""
    folder = path / "model" if (path / "model").is_dir() else path
    if (folder / "config.json").is_file() or (folder / "adapter_config.json").is_file():
        return folder
    if not path.exists():
        raise UserError(f"{path} does not exist (relative paths start at {Path.cwd()}); pass a run's output_dir or "
                        "a model folder")
    raise UserError(f"{path} holds no model (no model/, config.json or adapter_config.json): pass a finished run's "
                    "output_dir or a folder written by save_pretrained")


def export_gguf(model_dir: Path, kind: str, out: Path) -> Path:
    """Write the model folder ``model_dir`` (or the adapter in it, merged into its base) as the GGUF file ``out``
    of type ``kind`` (``KINDS``); returns ``out``. The file appears complete or not at all (written under a
    temporary name, then renamed). Raises UserError for a folder, type or ``out`` it cannot write, WriteFailed when
    the disk fails it."""
    model_dir, out = Path(model_dir), Path(out)
    spec = kind_of(kind)
    _check_out(out)
    if (model_dir / "config.json").is_file():
        _write(model_dir, spec, out)
        return out
    if not (model_dir / "adapter_config.json").is_file():
        raise UserError(f"{model_dir} holds no model (no config.json or adapter_config.json): pass a folder written "
                        "by save_pretrained")
    base = _adapter_base(model_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=disk.PARTIAL, dir=out.parent) as merged:
        _merge_adapter(model_dir, base, Path(merged))
        _write(Path(merged), spec, out, name=_name(model_dir))
    return out


def _check_out(out: Path) -> None:
    """A UserError naming --out when the file cannot be written there, before any work."""
    if out.is_dir():
        raise UserError(f"--out: {out} is a folder; name the file to write in it, e.g. {out / 'model-q8_0.gguf'}")
    above = next(p for p in (out.absolute(), *out.absolute().parents) if p.exists())
    if not above.is_dir():
        raise UserError(f"--out: cannot write {out}: {above} is a file, not a folder; pick another --out")
    why = disk.unwritable(out.parent)
    if why:
        raise UserError(f"--out: cannot write {out}: {why}; pick another --out")


def _adapter_base(adapter: Path) -> Path:
    """The local model folder a LoRA adapter was trained on (``adapter_config.json``'s base_model_name_or_path)."""
    base = json.loads((adapter / "adapter_config.json").read_text()).get("base_model_name_or_path") or ""
    if not (Path(base) / "config.json").is_file():
        raise UserError(f"{adapter} holds a LoRA adapter whose base '{base}' is not a local model folder, so it "
                        "cannot be merged here; train with peft.merge=true (model/ then holds the merged model) or "
                        "merge it with peft's merge_and_unload and export that folder")
    return Path(base)


def _merge_adapter(adapter: Path, base: Path, target: Path) -> None:
    """The LoRA adapter in ``adapter`` merged into the model folder ``base``, saved into ``target`` with the
    adapter folder's tokenizer (the one the run trained with) or else the base's."""
    from peft import PeftModel  # only here: peft's import is slow and only adapters need it

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    PeftModel.from_pretrained(model, adapter).merge_and_unload().save_pretrained(target)
    AutoTokenizer.from_pretrained(adapter if (adapter / "tokenizer.json").is_file() else base).save_pretrained(target)


def _name(model_dir: Path) -> str:
    """general.name: the run's name for a run's ``model/``, else the folder's."""
    model_dir = Path(model_dir).absolute()
    return model_dir.parent.name if model_dir.name == "model" else model_dir.name


def _write(folder: Path, kind: Kind, out: Path, name: Optional[str] = None) -> None:
    """The model folder ``folder`` (config.json, safetensors, tokenizer) as the GGUF file ``out``."""
    config = AutoConfig.from_pretrained(folder)
    arch = _architecture(folder, config)
    writer = gguf.GGUFWriter(None, gguf.MODEL_ARCH_NAMES[arch.arch])
    writer.add_type(gguf.GGUFType.MODEL)
    writer.add_name(name or _name(folder))
    _add_hyperparameters(writer, config, arch)
    writer.add_file_type(kind.file_type)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    _add_tokenizer(writer, folder, config.vocab_size)
    names = gguf.TensorNameMap(arch.arch, config.num_hidden_layers)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    output = "output.weight" if not tied else "token_embd.weight"
    for hf_name, tensor in _tensors(folder):
        if hf_name.endswith(SKIPPED) or (tied and hf_name == "lm_head.weight"):
            continue
        gguf_name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if gguf_name is None:
            raise UserError(f"{folder}: tensor {hf_name} has no GGUF name for {config.model_type}; only plain "
                            f"{config.model_type} causal LMs are written")
        if arch.permute and hf_name.endswith(("q_proj.weight", "q_proj.bias")):
            tensor = permute(tensor, config.num_attention_heads)
        elif arch.permute and hf_name.endswith(("k_proj.weight", "k_proj.bias")):
            tensor = permute(tensor, _kv_heads(config))
        data, qtype = quantize(tensor, kind.output if gguf_name == output else kind.weights, gguf_name)
        writer.add_tensor(gguf_name, data, raw_dtype=qtype)
    tmp = out.with_name(f"{disk.PARTIAL}{out.name}")
    out.parent.mkdir(parents=True, exist_ok=True)
    with disk.writing(out.name, out.parent, partial=tmp):
        writer.write_header_to_file(tmp)
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        os.replace(tmp, out)


def _architecture(folder: Path, config) -> Architecture:
    """How this model is written, or a UserError saying why it cannot be."""
    classes = getattr(config, "architectures", None) or ["?"]
    arch = ARCHITECTURES.get(config.model_type)
    if arch is None or not classes[0].endswith("ForCausalLM"):
        raise UserError(f"{folder}: a {classes[0]} (model_type {config.model_type}) has no GGUF writer here; "
                        f"GGUF export writes causal LMs of type {', '.join(ARCHITECTURES)}")
    problems = []
    if getattr(config, "quantization_config", None):
        problems.append("its weights are quantized (quantization_config): save the model unquantized")
    rope = getattr(config, "rope_parameters", None) or {}
    if rope.get("rope_type", "default") != "default":
        problems.append(f"its rotary embedding is scaled (rope_type {rope['rope_type']}), which is not written")
    if getattr(config, "hidden_act", "silu") != "silu":
        problems.append(f"its activation is {config.hidden_act}, where llama.cpp computes silu")
    if arch.arch == gguf.MODEL_ARCH.LLAMA and (getattr(config, "attention_bias", False)
                                               or getattr(config, "mlp_bias", False)):
        problems.append("it has attention or MLP biases, which transformers' GGUF reader drops for llama")
    if problems:
        raise UserError(f"{folder}: cannot write it as GGUF: {'; '.join(problems)}")
    return arch


def _kv_heads(config) -> int:
    return getattr(config, "num_key_value_heads", None) or config.num_attention_heads


def _head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def _add_hyperparameters(writer: gguf.GGUFWriter, config, arch: Architecture) -> None:
    """The keys llama.cpp's converter writes for this architecture (under ``<arch>.``)."""
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(_kv_heads(config))
    writer.add_rope_freq_base(float((getattr(config, "rope_parameters", None) or {}).get("rope_theta", 10000.0)))
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    head_dim = _head_dim(config)
    if head_dim != config.hidden_size // config.num_attention_heads:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    if arch.arch == gguf.MODEL_ARCH.LLAMA:
        writer.add_rope_dimension_count(head_dim)


def _tensors(folder: Path) -> Iterator[Tuple[str, torch.Tensor]]:
    """(name, float32 tensor) of every weight in the folder's safetensors, shard by shard."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (folder / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        raise UserError(f"{folder} has no model.safetensors: GGUF export reads safetensors weights; save the model "
                        "with save_pretrained (safetensors is its default)")
    for file in files:
        with safe_open(folder / file, framework="pt") as weights:
            for name in weights.keys():
                yield name, weights.get_tensor(name).to(torch.float32)


def permute(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's rotary layout: within each head, the rows of the two halves interleaved (transformers rotates
    dimension i with i + d/2, llama.cpp's Llama graph i with i + 1): what ``convert_hf_to_gguf.py``'s
    ``LlamaModel.permute`` does; transformers' GGUF reader undoes it."""
    return (weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


def quantize(tensor: torch.Tensor, qtype: GGML, gguf_name: str) -> Tuple[np.ndarray, GGML]:
    """(the data to write, its type): norms and other 1-D tensors stay float32, as llama.cpp computes them; a
    matrix whose rows do not split into the type's blocks is written in f16 (llama.cpp's converter's fallback)."""
    data = tensor.numpy()
    if data.ndim <= 1 or gguf_name.endswith("_norm.weight"):
        return data, GGML.F32
    if qtype not in (GGML.F32, GGML.F16) and data.shape[-1] % gguf.GGML_QUANT_SIZES[qtype][0]:
        qtype = GGML.F16
    return gguf.quants.quantize(data, qtype), qtype


def _add_tokenizer(writer: gguf.GGUFWriter, folder: Path, vocab_size: int) -> None:
    """The tokenizer as llama.cpp's converter writes a byte-level BPE one (``_set_vocab_gpt2``): tokens (ids the
    tokenizer lacks below the embedding's size as ``[PAD<i>]``, unused), their types (added tokens control when
    special, user-defined otherwise), the pre-tokenizer's name; then gguf's ``SpecialVocab``: merges, special ids,
    the chat template; whether BOS and EOS are added is what the tokenizer does, measured."""
    pre = pre_tokenizer_name(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    vocab = tokenizer.get_vocab()
    if max(vocab.values()) >= vocab_size:
        raise UserError(f"{folder}: the tokenizer has ids up to {max(vocab.values())} but the model's embeddings "
                        f"only {vocab_size} rows; resize the embeddings (model.resize_token_embeddings) and save again")
    by_id = {i: token for token, i in vocab.items()}
    added = tokenizer.added_tokens_decoder
    tokens: List[str] = []
    types: List[int] = []
    for i in range(vocab_size):
        token = by_id.get(i)
        if token is None:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
        elif i in added:
            tokens.append(token)
            special = added[i].special or (token.startswith("<|") and token.endswith("|>"))
            types.append(gguf.TokenType.CONTROL if special else gguf.TokenType.USER_DEFINED)
        else:
            tokens.append(token)
            types.append(gguf.TokenType.NORMAL)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    special = gguf.SpecialVocab(folder, load_merges=True, n_vocab=vocab_size)
    plain = tokenizer("a", add_special_tokens=False)["input_ids"]
    marked = tokenizer("a")["input_ids"]
    special.add_special_token["bos"] = len(marked) > len(plain) and marked[0] == tokenizer.bos_token_id
    special.add_special_token["eos"] = len(marked) > len(plain) and marked[-1] == tokenizer.eos_token_id
    special.add_to_gguf(writer, quiet=True)


def pre_tokenizer_name(folder: Path) -> str:
    """llama.cpp's name for the way the folder's tokenizer splits text before its merges, or a UserError when it
    is not a byte-level BPE tokenizer llama.cpp splits the same way."""
    path = folder / "tokenizer.json"
    if not path.is_file():
        raise UserError(f"{folder} has no tokenizer.json; GGUF export writes the fast (tokenizers) tokenizer saved "
                        "with the model")
    spec = json.loads(path.read_text())
    model = spec.get("model", {}).get("type")
    normalizer = (spec.get("normalizer") or {}).get("type")
    pre = spec.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
    kinds = [step.get("type") for step in steps]
    name = None
    if kinds == ["ByteLevel"] and steps[0].get("use_regex", True) and not steps[0].get("add_prefix_space"):
        name = "gpt2"
    elif kinds == ["Digits", "ByteLevel"] and steps[0].get("individual_digits") and steps[1].get("use_regex", True):
        name = "smollm"  # SmolLM's own tokenizer: digits one by one, then GPT-2's split
    elif kinds == ["Split", "ByteLevel"] and not steps[1].get("use_regex", True):
        name = SPLITS.get(steps[0].get("pattern", {}).get("Regex"))
    if model != "BPE" or normalizer not in NORMALIZERS or name is None:
        raise UserError(f"{path}: a {model} tokenizer (pre-tokenizer {'+'.join(map(str, kinds))}, normalizer "
                        f"{normalizer}) that GGUF export does not map; it writes byte-level BPE tokenizers split as "
                        "GPT-2, SmolLM, Llama 3 or Qwen2 split text")
    return name


# ---------------------------------------------------------------- command line


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse prints its usage and exits 2; one line here, as the other commands
        raise UserError(f"{message}; usage: {self.format_usage().strip().removeprefix('usage: ')}")


def parse_args(argv: List[str]) -> argparse.Namespace:
    parser = _Parser(prog="python -m framework.export",
                     description="Write a trained model folder as GGUF files, for llama.cpp.")
    parser.add_argument("path", type=Path, metavar="MODEL_DIR", help="a run's output_dir, or a model folder")
    parser.add_argument("--gguf", action="append", required=True, metavar="TYPE",
                        help=f"a GGUF type to write (repeatable): {', '.join(KINDS)}")
    parser.add_argument("--out", type=Path, metavar="FILE",
                        help="the file to write, with one --gguf (default: <model folder>-<type>.gguf next to it)")
    return parser.parse_args(argv)


def main(argv: Optional[List[str]] = None) -> int:
    """Returns the exit status: 0 written, 2 bad input (one ``error:`` line), 5 the disk failed the write."""
    try:
        args = parse_args(sys.argv[1:] if argv is None else argv)
        kinds = list(dict.fromkeys(k.lower() for k in args.gguf))
        for name in kinds:
            kind_of(name)
        if args.out is not None and len(kinds) > 1:
            raise UserError(f"--out names one file but {len(kinds)} --gguf types were given; give one --gguf with "
                            "--out, or leave --out out (each type then goes to <model folder>-<type>.gguf)")
        folder = locate(args.path)
        for name in kinds:
            out = export_gguf(folder, name, args.out or default_out(folder, name))
            print(f"wrote {out} ({name}: {KINDS[name].about}; {disk.size_text(out.stat().st_size)})")
    except UserError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    except disk.WriteFailed as e:
        print(f"error: write failed: {e}", file=sys.stderr, flush=True)
        return 5
    return 0


if __name__ == "__main__":
    sys.exit(main())
