"""lm-evaluation-harness (framework/harness.py, framework/evaluate.py): a tiny causal LM trained through the real
CLI with eval.harness scores a tiny local multiple-choice task; its accuracy equals this file's own log-likelihood
choice over the same rows, and it is in metrics.jsonl, summary.json, TensorBoard and the report. The command scores a
finished run (the shipped local tasks too) without touching its other outputs; bad input exits 2 with one line.
Classification's per-class figures and confusion matrix equal scikit-learn's.

One run (module-scoped) serves the harness tests: importing lm-eval alone takes about 5 s."""

import hashlib
import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from helpers import (NEGATIVE, OBJECTS, POSITIVE, SUBJECTS, VERBS, lm_args, read_metrics, synthetic_rows, tiny_args,
                     write_csv)
from in_process import fresh_process, run_main

TASK = "tiny_next_words"
STEPS, EVERY = 60, 30


def task_rows(n: int, seed: int):
    """After 'SUBJECT VERB', which comes next: the object (what the documents have there), a subject or a verb."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        choices = [rng.choice(OBJECTS), rng.choice(SUBJECTS), f"{rng.choice(VERBS)} {rng.choice(OBJECTS)}"]
        rng.shuffle(choices)
        obj = next(c for c in choices if c in OBJECTS)
        rows.append({"context": f"{rng.choice(SUBJECTS)} {rng.choice(VERBS)}", "choices": choices,
                     "label": choices.index(obj)})
    return rows


def write_task(folder: Path) -> Path:
    """An lm-eval task over a local jsonl file, as a user would write one (dataset_path: json)."""
    folder.mkdir(parents=True, exist_ok=True)
    data = folder / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in task_rows(36, seed=5)))
    (folder / f"{TASK}.yaml").write_text(f"""task: {TASK}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: label
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
  - metric: acc_norm
    aggregation: mean
    higher_is_better: true
""")
    return data


@pytest.fixture(scope="module")
def harness_run(tmp_path_factory, hf_home, word_tokenizer, corpus):
    """(run folder, task folder): the tiny LM trained 60 steps, the harness at steps 30 and 60."""
    root = tmp_path_factory.mktemp("harness")
    tasks, out = root / "tasks", root / "run"
    write_task(tasks)
    assert run_main(lm_args(word_tokenizer, corpus, out, f"train.max_steps={STEPS}", f"eval.harness.tasks=[{TASK}]",
                            f"eval.harness.include_path=[{tasks}]", f"eval.harness.every_steps={EVERY}",
                            "eval.harness.batch_size=4", "report.enabled=true", "report_to=[tensorboard]"),
                    hf_home) == 0
    return out, tasks


def own_choices(model_dir: Path, rows):
    """Per row, the choice with the largest summed log-probability of its tokens after the context (acc), and
    per character of the choice (acc_norm): the harness's rule, computed here from the model's logits."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    picks, picks_norm = [], []
    with torch.no_grad():
        for row in rows:
            context = tokenizer(row["context"], add_special_tokens=False)["input_ids"]
            sums = []
            for choice in row["choices"]:
                target = tokenizer(" " + choice, add_special_tokens=False)["input_ids"]
                log_probs = model(torch.tensor([context + target])).logits[0].log_softmax(-1)
                positions = torch.arange(len(context) - 1, len(context) + len(target) - 1)
                sums.append(float(log_probs[positions, torch.tensor(target)].sum()))
            picks.append(int(np.argmax(sums)))
            picks_norm.append(int(np.argmax(np.array(sums) / [len(c) for c in row["choices"]])))
    labels = np.array([row["label"] for row in rows])
    return float(np.mean(np.array(picks) == labels)), float(np.mean(np.array(picks_norm) == labels))


def rows_of(tasks: Path):
    return [json.loads(line) for line in (tasks / "rows.jsonl").read_text().splitlines()]


def test_harness_accuracy_equals_own_log_likelihood_choice(harness_run):
    out, tasks = harness_run
    figures = json.loads((out / "summary.json").read_text())["harness"]["tasks"][TASK]
    acc, acc_norm = own_choices(out / "model", rows_of(tasks))
    print(f"harness acc {figures['acc']:.4f} acc_norm {figures['acc_norm']:.4f}; own {acc:.4f} {acc_norm:.4f}")
    assert figures["samples"] == 36
    assert figures["acc"] == acc and figures["acc_norm"] == acc_norm
    assert acc > 0.6  # trained: well above a third, the chance of three choices


def test_harness_results_are_in_every_output(harness_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out, _ = harness_run
    summary = json.loads((out / "summary.json").read_text())
    records = [r for r in read_metrics(out) if f"harness/{TASK}/acc" in r]
    assert [r["step"] for r in records] == [EVERY, STEPS]  # every 30 steps; the last one is also the end
    assert summary["harness"]["step"] == STEPS and summary["harness"]["lm_eval"] == "0.4.13"
    assert {k: v for k, v in records[-1].items() if k.startswith(f"harness/{TASK}/")} == {
        f"harness/{TASK}/{k}": v for k, v in summary["harness"]["tasks"][TASK].items()}
    scalars = {}
    for folder in {p.parent for p in out.rglob("events.out.tfevents.*")}:
        events = EventAccumulator(str(folder))
        events.Reload()
        if f"harness/{TASK}/acc" in events.Tags()["scalars"]:
            scalars = {e.step: e.value for e in events.Scalars(f"harness/{TASK}/acc")}
    assert scalars == {r["step"]: float(np.float32(r[f"harness/{TASK}/acc"])) for r in records}
    page = (out / "report.html").read_text()
    assert "<h2>lm-evaluation-harness</h2>" in page and f"<td>{TASK}</td>" in page
    assert "plots/harness.png" in page and (out / "plots" / "harness.png").stat().st_size > 0


def test_an_adapted_model_scores_as_its_merged_model(harness_run, word_tokenizer, tmp_path):
    """A LoRA-adapted model goes to the harness as the peft model: the figures of its merged model, which equal the
    own choice over the same rows."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from framework.config import HarnessConfig
    from framework.harness import Harness

    out, tasks = harness_run
    tokenizer = AutoTokenizer.from_pretrained(out / "model")
    torch.manual_seed(0)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(out / "model"),
                           LoraConfig(r=4, target_modules=["c_attn"], init_lora_weights=False))
    harness = Harness(HarnessConfig(tasks=[TASK], include_path=[str(tasks)]), seed=42)
    adapted = harness.evaluate(model, tokenizer)["tasks"][TASK]
    merged = model.merge_and_unload()
    assert harness.evaluate(merged, tokenizer)["tasks"][TASK] == adapted
    merged.save_pretrained(tmp_path / "merged")
    tokenizer.save_pretrained(tmp_path / "merged")
    assert (adapted["acc"], adapted["acc_norm"]) == own_choices(tmp_path / "merged", rows_of(tasks))


def test_evaluate_scores_a_finished_run_without_touching_it(harness_run, hf_home, capsys):
    """The command on the run folder: the tiny task (its first 8 rows, as --limit says, equal to the own choice over
    them) and the shipped local tasks, into RUN/harness.json; every other file as it was; a second call is refused."""
    from framework.evaluate import main

    out, tasks = harness_run
    before = {p: hashlib.sha256(p.read_bytes()).hexdigest() for p in out.rglob("*") if p.is_file()}
    args = [str(out), "--tasks", f"{TASK},rt_sentiment,hamlet_next_line", "--include-path", str(tasks), "--limit", "8"]
    with fresh_process(hf_home):
        assert main(args) == 0
    result = json.loads((out / "harness.json").read_text())
    assert set(result["tasks"]) == {TASK, "rt_sentiment", "hamlet_next_line"}
    assert all(figures["samples"] == 8 for figures in result["tasks"].values())
    acc, acc_norm = own_choices(out / "model", rows_of(tasks)[:8])
    assert (result["tasks"][TASK]["acc"], result["tasks"][TASK]["acc_norm"]) == (acc, acc_norm)
    assert {p: hashlib.sha256(p.read_bytes()).hexdigest() for p in out.rglob("*") if p.is_file()
            and p.name != "harness.json"} == before
    capsys.readouterr()
    with fresh_process(hf_home):
        assert main(args) == 2
    assert capsys.readouterr().err == (f"error: {out / 'harness.json'} exists (an earlier evaluation); pass --out "
                                       "another file, or --overwrite\n")


def test_evaluate_refuses_bad_input_with_one_line(harness_run, tmp_path, capsys, monkeypatch):
    """No model there; an unknown task, and offline (the Hub's address refuses connections) one of lm-eval's own
    tasks, whose data is on the Hub: exit 2, one line naming them and the fix."""
    from huggingface_hub import constants

    from framework.evaluate import main

    out, _ = harness_run
    assert main([str(tmp_path / "nowhere"), "--tasks", "rt_sentiment"]) == 2
    assert capsys.readouterr().err.startswith(f"error: {tmp_path / 'nowhere'} does not exist")
    assert main([str(tmp_path), "--tasks", "rt_sentiment"]) == 2
    assert capsys.readouterr().err.startswith(f"error: {tmp_path} holds no model (no model/, config.json")
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    assert main([str(out), "--tasks", "no_such_task_anywhere,hellaswag", "--out", str(tmp_path / "h.json")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: --tasks: 'no_such_task_anywhere' is not an lm-eval task "
                                                   "(local tasks: hamlet_next_line, rt_sentiment)")
    assert ("--tasks: 'hellaswag' reads its data from the Hugging Face Hub and the Hub (127.0.0.1) is unreachable"
            in err and "use a local task (hamlet_next_line, rt_sentiment)" in err)
    assert not (tmp_path / "h.json").exists()


@pytest.mark.parametrize("override, message", [
    ("eval.harness.batch_size=2", "eval.harness.tasks: name at least one lm-eval task"),
    ("eval.harness.tasks=[rt_sentiment]", "eval.harness: lm-evaluation-harness scores causal language models, not "
                                          "text_classification; remove eval.harness"),
])
def test_recipe_refuses_a_harness_it_cannot_run(tiny_model, easy_data, hf_home, tmp_path, capsys, override, message):
    assert run_main(tiny_args(tiny_model, easy_data, tmp_path / "out", override), hf_home) == 2
    assert message in capsys.readouterr().err


# ---------------------------------------------------------------- classification


def test_per_class_figures_and_confusion_matrix_equal_scikit_learn():
    """Four classes, one of them never predicted and one never true: the matrix, precision, recall, F1 and support
    per class, and the macro F1 over the classes present, as scikit-learn computes them."""
    from sklearn.metrics import confusion_matrix, f1_score, precision_recall_fscore_support

    from framework.config import RunConfig
    from framework.tasks import get_task

    classification = get_task("text_classification").bind(RunConfig(), None, None)

    rng = np.random.default_rng(0)
    labels = rng.choice([0, 1, 3], size=200)
    preds = np.where(rng.random(200) < 0.6, labels, rng.choice([0, 2, 3], size=200))
    figures = classification.metrics({"predictions": preds, "labels": labels, "loss": rng.random(200)})
    classes = [0, 1, 2, 3]
    assert figures["confusion_matrix"] == confusion_matrix(labels, preds, labels=classes).tolist()
    precision, recall, f1, support = precision_recall_fscore_support(labels, preds, labels=classes, zero_division=0)
    for c in classes:
        mine = figures["per_class"][str(c)]
        assert (mine["precision"], mine["recall"], mine["f1"], mine["support"]) == pytest.approx(
            (precision[c], recall[c], f1[c], support[c]), abs=1e-12)
    assert figures["f1"] == pytest.approx(f1_score(labels, preds, average="macro", labels=classes), abs=1e-12)


def test_classification_run_reports_its_classes(tiny_model, tmp_path, hf_home):
    """Three classes through the real CLI: summary.json's eval has the matrix (its diagonal is the accuracy's count)
    and per-class figures; the report shows them by name with the confusion matrix figure."""
    rows = synthetic_rows(240, seed=2)
    rng = random.Random(3)
    for row in rows[::3]:  # a third neutral: their sentiment word replaced by filler
        row["text"] = " ".join("film" if w in POSITIVE + NEGATIVE else w for w in row["text"].split())
        row["label"] = "neu"
    rng.shuffle(rows)
    data, out = write_csv(tmp_path / "three.csv", rows), tmp_path / "out"
    assert run_main(tiny_args(tiny_model, data, out, "train.max_steps=8", "report.enabled=true"), hf_home) == 0
    evaluation = json.loads((out / "summary.json").read_text())["eval"]
    matrix = np.array(evaluation["confusion_matrix"])
    assert matrix.shape == (3, 3) and matrix.sum() == evaluation["examples"]
    assert np.trace(matrix) == round(evaluation["accuracy"] * evaluation["examples"])
    assert [evaluation["per_class"][c]["support"] for c in "012"] == matrix.sum(axis=1).tolist()
    page = (out / "report.html").read_text()
    assert "<h2>Classes (eval)</h2>" in page and all(f"<td>{name}</td>" in page for name in ("neg", "neu", "pos"))
    assert "plots/confusion.png" in page and (out / "plots" / "confusion.png").stat().st_size > 0
