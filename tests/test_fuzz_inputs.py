"""No input ends in a traceback or a silent misreading: property-based fuzzing of the real CLI, in-process.

Generated recipes (unknown and misspelt keys at every depth, values of every wrong type, out-of-range
numbers, malformed YAML and overrides, extends chains that loop or point nowhere, every task with the
other tasks' keys) and generated data files (ragged and quoted csv/tsv, wrong encodings, binary bytes,
truncated compressed files, json lines that are not objects, columns of the wrong type, empty and
whitespace-only texts, a million-character row, duplicate header names) go through ``run.py --dry-run``.
The property: the run starts (its plan printed, exit 0, nothing written) or it exits 2 with exactly one
``error:`` message naming a key or path of the input; never a traceback, and no file outside
``output_dir`` touched.

The budget: a fixed, derandomized number of cases in ``make test`` (about 90 s here); ``make fuzz``
(``FUZZ_EXAMPLES=N``, random cases each time) runs N cases per test. The inputs it found broken are kept
as explicit regression cases in tests/test_config.py and tests/test_cli_errors.py.
"""

from __future__ import annotations

import bz2
import csv
import dataclasses
import gzip
import io
import itertools
import json
import lzma
import os
import re
import shutil
import zipfile
from pathlib import Path
from typing import Dict, List, Set

import pytest
import yaml
from hypothesis import HealthCheck, Phase, event, given, settings
from hypothesis import strategies as st

from helpers import NEGATIVE, NEUTRAL, POSITIVE, ROOT, WORDS, documents, synthetic_rows, write_csv
from in_process import run_captured

EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "0"))  # make fuzz: this many cases per test, random each time


def budget(cases: int):
    """``cases`` derandomized cases in make test (the same ones every run: a failure is reproducible), or
    FUZZ_EXAMPLES random ones. No example database: nothing is written outside the test's own folders."""
    return settings(max_examples=EXAMPLES or cases, derandomize=not EXAMPLES, database=None, deadline=None,
                    print_blob=True, phases=[Phase.explicit, Phase.generate],  # no shrinking: a case costs up to 2 s
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                           HealthCheck.filter_too_much])


# ---------------------------------------------------------------- the schema, as data


def schema() -> Dict[str, tuple]:
    """Every recipe key (dotted) -> (its default, its bounds): read from the dataclasses, so that a key added
    later is fuzzed too."""
    from framework import recipe

    keys = {}

    def walk(instance, prefix):
        for f in dataclasses.fields(instance):
            if f.metadata.get("internal"):
                continue
            value = getattr(instance, f.name)
            if dataclasses.is_dataclass(value):
                walk(value, f"{prefix}{f.name}.")
            else:
                keys[f"{prefix}{f.name}"] = (value, dict(f.metadata))
    walk(recipe.schema()(), "")
    return keys


SCHEMA = schema()
KEYS = sorted(SCHEMA)
SECTIONS = sorted({k.rsplit(".", 1)[0] for k in KEYS if "." in k})
BOUNDED = sorted(k for k, (_, bounds) in SCHEMA.items() if bounds)


def task_keys() -> List[str]:
    from framework.tasks import task_keys as keys

    return list(keys())


# ---------------------------------------------------------------- values and keys


SPECIAL_TEXT = ["", " ", "\t", "  \n ", '"', '""', ",", "\n", "a,b", '"a""b"', "a\tb", "NaN", "null", "None", "~",
                "1", "-1", "0", "1.5", "1e400", "True", "no", "\x00", "\ufeff", "é", "\u202e", "${x}", "???",
                "[1", "{a", "a: b", "- x", "&a", "*a", "!!binary", "%", "@", "`", "|", ">"]
texts = st.one_of(st.sampled_from(SPECIAL_TEXT), st.sampled_from(POSITIVE + NEGATIVE + NEUTRAL + WORDS),
                  st.text(st.characters(codec="utf-8", exclude_categories=["Cs"]), max_size=12))
numbers = st.one_of(st.integers(-(2**70), 2**70), st.floats(allow_nan=True, allow_infinity=True),
                    st.sampled_from([0, -1, 1, 2**31, 2**63, 1e-30, -0.0]))
scalars = st.one_of(st.none(), st.booleans(), numbers, texts)
values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                      st.dictionaries(st.sampled_from(["a", "r", "x", "1"]), inner,
                                                                      max_size=2)), max_leaves=4)


def one_in(n: int) -> st.SearchStrategy:
    """True about once in ``n`` draws (a small integer range is drawn at its ends far more often)."""
    return st.sampled_from([True] + [False] * (n - 1))


@st.composite
def misspelt(draw, word: str) -> str:
    """``word`` with one letter dropped, doubled, swapped or replaced (or another key's name)."""
    if not word or draw(one_in(6)):
        return draw(st.sampled_from([k.rsplit(".", 1)[-1] for k in KEYS] + ["extends", "x", "_", "-"]))
    i = draw(st.integers(0, len(word) - 1))
    how = draw(st.sampled_from(["drop", "double", "swap", "replace", "case"]))
    if how == "drop":
        return word[:i] + word[i + 1:] or "x"
    if how == "double":
        return word[:i] + word[i] + word[i:]
    if how == "swap" and i + 1 < len(word):
        return word[:i] + word[i + 1] + word[i] + word[i + 2:]
    if how == "case":
        return word.upper()
    return word[:i] + draw(st.sampled_from("abcdefghijklmnopqrstuvwxyz_0")) + word[i + 1:]


def near_bounds(bounds: dict) -> st.SearchStrategy:
    edges = [b + d for b in bounds.values() for d in (-1, -1e-9, 0, 1e-9, 1)]
    return st.sampled_from(edges + [float("nan"), float("inf"), -float("inf"), 10**30, -(10**30)])


def set_key(tree: dict, key: str, value) -> None:
    *parents, last = key.split(".")
    node = tree
    for name in parents:
        if not isinstance(node.get(name), dict):
            node[name] = {}
        node = node[name]
    node[last] = value


@st.composite
def mutations(draw, task: str) -> List[tuple]:
    """(dotted key, value) changes to a valid recipe, each a kind of mistake."""
    changes = []
    for _ in range(draw(st.sampled_from([1, 1, 1, 2, 3]))):
        kind = draw(st.sampled_from(["unknown", "misspelt", "wrong_type", "range", "other_task", "choice", "default", "valid", "valid"]))
        key = draw(st.sampled_from(KEYS))
        if kind == "unknown":  # a new name at any depth: the top, a section, inside a leaf
            where = draw(st.sampled_from([""] + [s + "." for s in SECTIONS] + [key + "."]))
            changes.append((where + draw(misspelt(key.rsplit(".", 1)[-1])), draw(values)))
        elif kind == "misspelt":
            prefix, _, leaf = key.rpartition(".")
            changes.append(((prefix + "." if prefix else "") + draw(misspelt(leaf)), SCHEMA[key][0]))
        elif kind == "wrong_type":
            changes.append((key, draw(values)))
        elif kind == "range":
            bounded = draw(st.sampled_from(BOUNDED))
            changes.append((bounded, draw(near_bounds(SCHEMA[bounded][1]))))
        elif kind == "other_task":
            other = draw(st.sampled_from(task_keys()))
            changes.append((other, draw(st.one_of(st.just(SCHEMA.get(other, (1,))[0]), values,
                                                  st.sampled_from([True, 64, 0.3, "x", ["a", "b"]])))))
        elif kind == "choice":
            changes.append((draw(st.sampled_from(["task", "backend", "precision", "optim.name", "optim.scheduler",
                                                  "data.padding", "data.sample_by", "distributed.strategy",
                                                  "checkpoint.resume", "eval.metric"])),
                            draw(st.one_of(texts, st.sampled_from(["text_classification", "causal_lm", "masked_lm",
                                                                   "sft", "gpu", "xla", "fp8", "bf16", "never"])))))
        elif kind == "default":  # a key set to its default: allowed whatever the task
            changes.append((key, SCHEMA[key][0]))
        else:  # a legal value: the run must then start
            changes.append(draw(st.sampled_from([("train.batch_size", 2), ("data.max_train_samples", 16),
                                                 ("seed", 7), ("optim.lr", 0.01), ("train.max_steps", 3)])))
    return changes


def override(key: str, value) -> str:
    """``KEY=VALUE`` with the value in YAML flow style (as a user would type it)."""
    text = yaml.safe_dump(value, default_flow_style=True, width=10**6).strip()
    return f"{key}={text[:-3].strip() if text.endswith('...') else text}"


# ---------------------------------------------------------------- a sandbox and one run


@pytest.fixture(scope="module")
def sandbox(tmp_path_factory, tiny_model, word_tokenizer):
    """Valid inputs (small data, the tiny models' recipes as mappings), and a runner that checks the property."""
    root = tmp_path_factory.mktemp("fuzz")
    inputs = root / "inputs"
    inputs.mkdir()
    classified = write_csv(inputs / "reviews.csv", synthetic_rows(40, seed=5))
    corpus = inputs / "docs.jsonl"
    corpus.write_text("".join(json.dumps(d) + "\n" for d in documents(40, seed=6)))
    common = {"seed": 1, "backend": "cpu", "report": {"enabled": False},
              "train": {"epochs": 1, "batch_size": 4, "log_every": 1}, "optim": {"name": "adamw", "lr": 0.001}}
    recipes = {
        "text_classification": {**common, "task": "text_classification", "model": {"name_or_path": str(tiny_model)},
                                "data": {"train_file": str(classified), "max_length": 32}},
        "causal_lm": {**common, "task": "causal_lm", "data": {"train_file": str(corpus), "block_size": 16},
                      "model": {"tokenizer": str(word_tokenizer), "config": {
                          "model_type": "gpt2", "n_layer": 1, "n_head": 2, "n_embd": 16, "n_positions": 64}}},
        "masked_lm": {**common, "task": "masked_lm", "data": {"train_file": str(corpus), "block_size": 16},
                      "model": {"tokenizer": str(word_tokenizer), "config": {
                          "model_type": "bert", "hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2,
                          "intermediate_size": 32, "max_position_embeddings": 64}}},
    }
    return Sandbox(root, recipes, watched=[inputs, Path(tiny_model), Path(word_tokenizer)])


def snapshot(roots: List[Path], skip: Path) -> Dict[str, tuple]:
    found = {}
    for root in roots:
        for path in [root, *root.rglob("*")]:
            if path == skip or skip in path.parents:
                continue
            stat = path.lstat()
            found[str(path)] = (stat.st_size, stat.st_mtime_ns)
    return found


def input_names(tree, overrides: List[str], paths: List[Path]) -> Set[str]:
    """What an error may name: the input's dotted keys (each prefix too), its override keys, its file paths."""
    names = {str(p) for p in paths} | {p.name for p in paths}

    def walk(node, prefix):
        if isinstance(node, dict):
            for key, value in node.items():
                names.add(f"{prefix}{key}")
                walk(value, f"{prefix}{key}.")
    walk(tree, "")
    for item in overrides:
        key = item.partition("=")[0].lstrip("-")
        names |= {key, item} | {".".join(key.split(".")[:i]) for i in range(1, key.count(".") + 2)}
    return {n for n in names if n.strip()}


def outcome(message: str) -> str:
    """The kind of an error, for the statistics (pytest --hypothesis-show-statistics): its first problem,
    without paths and values."""
    lines = [line.strip()[2:] for line in message.splitlines() if line.strip().startswith("- ")] or [message[7:]]
    kind = re.sub(r"(/|[A-Za-z]:\\)\S+", "PATH", lines[0])
    kind = re.sub(r"'[^']*'|\"[^\"]*\"|\[[^\]]*\]|\{[^}]*\}|-?\d[\d.e+-]*", "V", kind)
    return "refused: " + " ".join(kind.split()[:6])


class Sandbox:
    def __init__(self, root: Path, recipes: Dict[str, dict], watched: List[Path]):
        self.root, self.recipes, self.watched, self.count = root, recipes, watched, itertools.count()

    def case(self) -> Path:
        folder = self.root / f"case{next(self.count)}"
        folder.mkdir()
        return folder

    def check(self, folder: Path, recipe: Path, overrides: List[str], tree, files: List[Path], hf_home: Path):
        """Run ``run.py --dry-run --config RECIPE OVERRIDES output_dir=...`` and check the property."""
        out = folder / "out"
        args = ["--dry-run", "--config", str(recipe), *overrides, f"output_dir={out}"]
        before, top = snapshot([folder, *self.watched], out), sorted(os.listdir(ROOT))
        proc = run_captured(args, hf_home)
        text = proc.stdout + proc.stderr
        shown = f"\nargs: {args}\nstdout: {proc.stdout[-2000:]}\nstderr: {proc.stderr[-3000:]}"
        assert "Traceback" not in text, shown
        assert proc.returncode in (0, 2), shown
        if proc.returncode == 0:
            assert ("plan:" in proc.stdout or "--print-config" in args) and "error:" not in text, shown
            message = ""
            assert not out.exists() or not os.listdir(out), f"a dry run wrote into output_dir{shown}"
        else:
            starts = [i for i, line in enumerate(re.split(r"[\r\n]", proc.stderr)) if line.startswith("error:")]
            assert len(starts) == 1 and "error:" not in proc.stdout, f"not one error: message{shown}"
            message = "error:" + re.split(r"(?:^|[\r\n])error:", proc.stderr, maxsplit=1)[1]
            names = input_names(tree, overrides, [recipe, *files])
            assert any(name in message for name in names), f"the error names nothing of the input{shown}"
        event(outcome(message) if message else "started")
        assert snapshot([folder, *self.watched], out) == before, f"a file outside output_dir changed{shown}"
        assert sorted(os.listdir(ROOT)) == top, f"the working directory changed{shown}"
        shutil.rmtree(folder)
        return proc


# ---------------------------------------------------------------- recipes, extends and overrides


@st.composite
def recipe_cases(draw):
    """(task, the recipe tree, recipe file text or None for the dumped tree, overrides, extends layout)."""
    task = draw(st.sampled_from(["text_classification", "causal_lm", "masked_lm"]))
    changes = draw(mutations(task))
    as_overrides = draw(st.lists(st.booleans(), min_size=len(changes), max_size=len(changes)))
    corrupt_yaml = draw(one_in(10))
    raw_overrides = draw(st.lists(st.one_of(
        st.sampled_from(["train.batch_size=[1", "data.labels={a", 'seed="1', "=3", "train", "train.=1", ".a=1",
                         "a..b=1", "seed=${nope}", "seed=${oc.env:FUZZ_UNSET}", "seed=!!python/object:os.system",
                         "seed=[1,2]", "train=3", "data=[]", "data.sources=[{weight: -1}]", "task=", "extends=x.yaml",
                         "optim.param_groups=[{pattern: '('}]", "model.config=5", "data.train_file=[]"]),
        st.builds(lambda k, v: f"{k}={v}", st.sampled_from(KEYS), texts)), max_size=1 if draw(st.booleans()) else 0))
    extends = draw(st.sampled_from(["none"] * 8 + ["parent", "chain", "loop", "self", "missing", "not_mapping",
                                                    "bad_type"]))
    options = draw(st.lists(st.tuples(st.sampled_from(["--dry-run", "--bogus", "--config", "--print-config",
                                                       "--config=nowhere.yaml", "--dry-run=1", "-x"]),
                                      st.integers(0, 5)), max_size=1 if draw(one_in(5)) else 0))
    cut = draw(st.integers(0, 10**6))
    junk = draw(st.sampled_from(["[", "{", ":", "- ", "\t", '"', "'", "&x ", "*y", "!!python/object:os.system ",
                                 "%TAG", "\x00", "? ", "key: [1, 2", "\n  bad indent: 1\n x:"]))
    return task, changes, as_overrides, corrupt_yaml, raw_overrides, options, extends, cut, junk


@given(case=recipe_cases())
@budget(300)
def test_recipes_and_overrides(sandbox, hf_home, case):
    task, changes, as_overrides, corrupt_yaml, raw_overrides, options, extends, cut, junk = case
    folder = sandbox.case()
    tree = json.loads(json.dumps(sandbox.recipes[task]))
    overrides = []
    for (key, value), by_override in zip(changes, as_overrides):
        if by_override:
            overrides.append(override(key, value))
        else:
            set_key(tree, key, value)
    overrides += raw_overrides
    for option, at in options:  # options may come anywhere among the overrides
        overrides.insert(at % (len(overrides) + 1), option)
    text = yaml.safe_dump(tree, sort_keys=False, allow_unicode=True)
    if corrupt_yaml:
        at = cut % (len(text) + 1)
        text = text[:at] + junk + text[at:]
    recipe = folder / "recipe.yaml"
    files = [recipe]
    parent = folder / "parent.yaml"
    if extends == "parent":  # the recipe's keys split between a parent and the child
        parent.write_text(text)
        text = "extends: parent.yaml\n"
        files.append(parent)
    elif extends == "chain":
        parent.write_text("extends: grandparent.yaml\n" + text)
        (folder / "grandparent.yaml").write_text("seed: 3\n")
        text = "extends: [parent.yaml]\n"
        files += [parent, folder / "grandparent.yaml"]
    elif extends == "loop":
        parent.write_text("extends: recipe.yaml\nseed: 2\n")
        text = "extends: parent.yaml\n" + text
        files.append(parent)
    elif extends == "self":
        text = "extends: recipe.yaml\n" + text
    elif extends == "missing":
        text = "extends: [nowhere.yaml]\n" + text
    elif extends == "not_mapping":
        parent.write_text("- a\n- b\n")
        text = "extends: parent.yaml\n" + text
        files.append(parent)
    elif extends == "bad_type":
        text = "extends: {a: 1}\n" + text
    recipe.write_text(text)
    sandbox.check(folder, recipe, overrides, tree, files, hf_home)


# ---------------------------------------------------------------- data files


COMPRESS = {"": lambda b: b, ".gz": gzip.compress, ".bz2": bz2.compress, ".xz": lzma.compress,
            ".zst": lambda b: __import__("zstandard").ZstdCompressor().compress(b), ".zip": None}
CELLS = st.one_of(texts, st.sampled_from(["pos", "neg", "good film", "the bad plot", "1", "0", "", "  "]))


def zipped(name: str, payload: bytes) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as z:
        z.writestr(name, payload)
    return buffer.getvalue()


@st.composite
def table(draw, delimiter: str) -> str:
    header = draw(st.lists(st.sampled_from(["text", "label", "text", "review", "Text", "", "label ", "x,y", '"q"']),
                           min_size=1, max_size=4))
    clean = draw(one_in(3))  # a well-formed table of odd texts: these runs start, and go through tokenizing
    if clean or draw(st.booleans()):
        header = ["text", "label"] + ([] if clean else header[2:])
    rows = []
    for _ in range(draw(st.integers(0, 30)) if not clean else draw(st.integers(8, 30))):
        width = len(header) if clean or not draw(one_in(6)) else draw(st.integers(0, 6))  # ragged now and then
        row = draw(st.lists(CELLS, min_size=width, max_size=width))
        if clean:
            row[1] = draw(st.sampled_from(["pos", "neg", "pos", "neg", "", " ", "NA", "None", "1"]))
        rows.append(row)
    buffer = io.StringIO()
    if clean or draw(st.booleans()):  # written properly: quotes around what needs them
        writer = csv.writer(buffer, delimiter=delimiter, lineterminator=draw(st.sampled_from(["\n", "\r\n"])))
        writer.writerow(header)
        writer.writerows(rows)
    else:  # joined by hand: delimiters, quotes and newlines inside fields left bare
        buffer.write("\n".join(delimiter.join(row) for row in [header, *rows]) + draw(st.sampled_from(["", "\n"])))
    return buffer.getvalue()


@st.composite
def json_lines(draw) -> str:
    lines = []
    for _ in range(draw(st.integers(0, 30))):
        kind = draw(st.sampled_from(range(10)))
        if kind < 6:
            row = {draw(st.sampled_from(["text", "label", "text", "other"])): draw(st.one_of(CELLS, values))
                   for _ in range(draw(st.integers(0, 3)))}
            lines.append(json.dumps(row))
        elif kind < 8:  # a line that is not an object
            lines.append(json.dumps(draw(st.one_of(st.lists(scalars, max_size=3), scalars))))
        else:  # broken JSON
            good = json.dumps({"text": draw(texts), "label": "pos"})
            lines.append(good[:draw(st.integers(0, len(good) - 1))])
    if draw(one_in(5)):  # a .json file may also hold one array of objects
        return json.dumps([json.loads(line) for line in lines if line.startswith("{") and line.endswith("}")])
    return "\n".join(lines) + "\n"


@st.composite
def data_cases(draw):
    task = draw(st.sampled_from(["text_classification", "causal_lm", "masked_lm"]))
    fmt = draw(st.sampled_from([".csv", ".tsv", ".jsonl", ".json", ".txt", ".parquet"]))
    if fmt in (".csv", ".tsv"):
        text = draw(table("," if fmt == ".csv" else "\t"))
    elif fmt in (".jsonl", ".json"):
        text = draw(json_lines())
    else:
        text = "\n".join(draw(st.lists(CELLS, max_size=30)))
    if draw(one_in(25)):  # a million-character row
        text += ("\n" if fmt in (".txt", ".csv", ".tsv") else "") + (
            json.dumps({"text": "good " * 200_000, "label": "pos"}) if fmt in (".jsonl", ".json")
            else "good " * 200_000 + ("," + "pos" if fmt == ".csv" else "\tpos" if fmt == ".tsv" else ""))
    encoding = draw(st.sampled_from(["utf-8"] * 6 + ["latin-1", "utf-16", "utf-8-sig", "cp1252"]))
    payload = text.encode(encoding, errors="replace")
    if fmt == ".parquet" and draw(st.booleans()):
        payload = parquet(draw)
    if draw(one_in(8)):  # binary bytes dropped in
        at = draw(st.integers(0, len(payload)))
        payload = payload[:at] + draw(st.binary(min_size=1, max_size=16)) + payload[at:]
    compression = draw(st.sampled_from(["", "", "", ".gz", ".bz2", ".xz", ".zst", ".zip"]))
    truncate = compression != "" and draw(one_in(3))
    cut = draw(st.floats(0, 1))
    overrides = draw(st.lists(st.sampled_from(["data.text_column=label", "data.text_column=review",
                                               "data.label_column=text", "data.eval_fraction=0.5",
                                               "data.labels=[pos,neg]", "data.sample_by=document",
                                               "data.sample_by=line", "data.packing=false", "train.batch_size=1",
                                               "data.text_pair_column=label", "data.streaming=true",
                                               "train.max_steps=2"]), max_size=2, unique=True))
    return task, fmt, payload, compression, truncate, cut, overrides, draw(st.booleans())


def parquet(draw) -> bytes:
    import pyarrow as pa
    import pyarrow.parquet as pq

    n = draw(st.integers(0, 20))
    columns = {"text": draw(st.sampled_from([pa.array([f"good film {i}" for i in range(n)]),
                                             pa.array(list(range(n))), pa.array([[i] for i in range(n)]),
                                             pa.array([None] * n, pa.string()), pa.array([" "] * n)])),
               "label": pa.array([["pos", "neg"][i % 2] for i in range(n)])}
    buffer = io.BytesIO()
    pq.write_table(pa.table(columns), buffer)
    return buffer.getvalue()


@given(case=data_cases())
@budget(100)
def test_data_files(sandbox, hf_home, case):
    task, fmt, payload, compression, truncate, cut, overrides, as_eval = case
    folder = sandbox.case()
    data = folder / f"data{fmt}{compression}"
    packed = zipped(f"data{fmt}", payload) if compression == ".zip" else COMPRESS[compression](payload)
    if truncate:
        packed = packed[:int(len(packed) * cut)]
    data.write_bytes(packed)
    tree = json.loads(json.dumps(sandbox.recipes[task]))
    tree["data"]["train_file"] = str(data)
    if as_eval:
        tree["data"]["eval_file"] = str(data)
    recipe = folder / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(tree, sort_keys=False))
    proc = sandbox.check(folder, recipe, overrides, tree, [recipe, data], hf_home)
    if proc.returncode == 0 and task == "text_classification" and fmt in (".csv", ".tsv"):
        # Read as written: the rows with a text and a label, every one of them (train + eval, or each of them
        # when the eval file is the training file), none shifted, split or invented.
        limit = csv.field_size_limit(2**31 - 1)  # the million-character row
        try:
            rows = list(csv.reader(io.StringIO(payload.decode("utf-8-sig")), delimiter="," if fmt == ".csv" else "\t"))
        finally:
            csv.field_size_limit(limit)
        text, label = rows[0].index("text"), rows[0].index("label")
        labels = {"pos", "neg"} if "data.labels=[pos,neg]" in overrides else None
        usable = sum(1 for row in rows[1:] if row and row[text].strip() and row[label] != ""
                     and (labels is None or row[label] in labels))
        plan = dict(re.findall(r"^  (train_examples|eval_examples): (\d+)$", proc.stdout, re.M))
        counted = int(plan["train_examples"]) + (0 if as_eval else int(plan["eval_examples"]))
        assert counted == usable and (not as_eval or int(plan["eval_examples"]) == usable), (usable, proc.stdout)
        event("started, and every row read as written")
