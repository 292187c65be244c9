"""Seeing a run: MFU and its FLOPs, the time breakdown, report.html with its plots, run comparison, the profiler,
trackers read back. Runs the tiny model through the real CLI (in this process where the process boundary is not
what is tested)."""

import json
import math
import os
import re
import struct
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from framework.backend.hardware import cpu_peak_flops
from helpers import ROOT, read_metrics, tiny_args
from in_process import fresh_process, run_main


def decoded(path: Path) -> np.ndarray:
    """A PNG's pixels as an array (RGB or RGBA, 0..255)."""
    from PIL import Image

    with Image.open(path) as image:
        return np.asarray(image.convert("RGB"), dtype=np.float64)


def assert_not_blank(path: Path) -> None:
    """A drawn figure: a real image of some size, with ink on it (not one flat colour), mostly background."""
    pixels = decoded(path)
    assert pixels.shape[0] > 150 and pixels.shape[1] > 300, pixels.shape
    ink = (pixels < 200).any(axis=2).mean()  # anything clearly darker than the white background
    assert 0.01 < ink < 0.6, ink
    assert pixels.std() > 20, pixels.std()
    colours = len(np.unique(pixels.reshape(-1, 3)[::7], axis=0))
    assert colours > 8, colours  # lines, text and bars in several colours, not a stripe


@pytest.fixture(scope="module")
def report_run(tmp_path_factory, tiny_model, easy_data, hf_home):
    """One run with everything the report shows: evaluations, checkpoints, a profiled window."""
    out = tmp_path_factory.mktemp("report") / "run"
    assert run_main(tiny_args(tiny_model, easy_data, out, "report.enabled=true", "train.max_steps=24",
                              "eval.every_steps=8", "checkpoint.every_steps=10", "train.profile_steps=[3,4]"),
                    hf_home) == 0
    return out


def test_report_page_and_plots_are_written_and_drawn(report_run):
    page = (report_run / "report.html").read_text()
    for section in ("Final figures", "Curves", "Time", "Plan", "Memory per device", "Recipe"):
        assert f"<h2>{section}</h2>" in page, section
    assert "finished: 24 steps" in page
    for name in ("curves", "time", "memory"):
        assert f"plots/{name}.png" in page
        assert_not_blank(report_run / "plots" / f"{name}.png")
    summary = json.loads((report_run / "summary.json").read_text())
    assert f"{summary['eval']['accuracy']:.4g}" in page  # the final metrics are on the page
    assert "peak_flops" in page and "FLOPs a cycle" in page  # the plan, with the CPU's peak


def test_the_time_breakdown_adds_up_and_sees_each_part(report_run):
    summary = json.loads((report_run / "summary.json").read_text())
    time_ = summary["time"]
    assert set(time_) == {"setup", "data", "compute", "eval", "checkpoint", "report", "finish"}
    assert math.isclose(sum(time_.values()), summary["wall_seconds"], rel_tol=1e-9)
    assert all(v >= 0 for v in time_.values()), time_
    # Evaluated at steps 8, 16 and 24 (the last after the loop), saved at 10 and 20, loaded 24 batches.
    assert time_["eval"] > 0 and time_["checkpoint"] > 0 and time_["data"] > 0 and time_["compute"] > 0
    loop = sum(time_[k] for k in ("data", "compute", "eval", "checkpoint", "report"))
    assert math.isclose(loop, summary["train"]["wall_seconds"], rel_tol=1e-9)


def test_mfu_is_the_model_flops_rate_over_the_cpus_peak(report_run):
    summary = json.loads((report_run / "summary.json").read_text())
    flops = summary["flops"]
    expected, _ = cpu_peak_flops(torch.float32)  # the test process's threads and cores: the run's (1 process)
    assert flops["peak_per_second"] == pytest.approx(expected, rel=1e-6)
    assert math.isclose(flops["per_second"], flops["trained"] / summary["train"]["wall_seconds"], rel_tol=1e-9)
    assert math.isclose(summary["mfu"], flops["per_second"] / flops["peak_per_second"], rel_tol=1e-9)
    assert 0 < summary["mfu"] < 1
    logged = [r for r in read_metrics(report_run) if "loss" in r]
    assert len(logged) == 24 and all(0 < r["mfu"] < 1 and r["tokens_per_second"] > 0 for r in logged)
    assert re.search(r"\d+ cores x [\d.]+ GHz x \d+ float32 FLOPs a cycle", summary["plan"]["peak_flops"])


def test_the_profile_covers_the_steps_asked_for_and_names_the_model_ops(report_run):
    (trace,) = (report_run / "profile").iterdir()
    assert trace.name == "steps_3-4_rank0.json"
    events = json.loads(trace.read_text())["traceEvents"]
    names = {e.get("name") for e in events}
    assert {"optimizer_step_3", "optimizer_step_4"} <= names
    assert not {"optimizer_step_2", "optimizer_step_5"} & names
    # BERT's own ops: embedding lookups, linear layers, attention, the loss, the optimizer's kernel.
    assert {"aten::embedding", "aten::linear", "aten::scaled_dot_product_attention", "aten::cross_entropy_loss",
            "aten::_fused_adamw_"} <= names


def test_comparing_runs_lists_both_and_exactly_the_differing_keys(report_run, tiny_model, easy_data, hf_home,
                                                                   tmp_path):
    other = tmp_path / "other"
    assert run_main(tiny_args(tiny_model, easy_data, other, "train.max_steps=12", "optim.lr=0.003"), hf_home) == 0
    out = tmp_path / "comparison"
    proc = subprocess.run([sys.executable, "-m", "framework.report", str(report_run), str(other), "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].split() == ["recipe", "key", "run", "other"]
    keys = [line.split()[0] for line in lines[1:lines.index("")]]
    # The fixture's run differs in its evaluation, checkpoint, profile and report keys too.
    assert keys == ["checkpoint.every_steps", "eval.every_steps", "optim.lr", "output_dir", "report.enabled",
                    "train.max_steps", "train.profile_steps"]
    rows = {line.split()[0]: line.split()[1:] for line in lines if line.strip()}
    assert rows["optim.lr"] == ["0.001", "0.003"] and rows["checkpoint.every_steps"] == ["10", "null"]
    figures = {line.split()[0]: line.split()[1:] for line in lines[lines.index("") + 1:] if line.strip()}
    assert figures["step"] == ["24", "12"]
    assert set(figures) >= {"eval_accuracy", "eval_loss", "loss", "mfu", "tokens_per_second"}
    page = (out / "compare.html").read_text()
    assert str(report_run) in page and str(other) in page
    assert_not_blank(out / "compare.png")
    again = subprocess.run([sys.executable, "-m", "framework.report", str(report_run), str(other), "--out", str(out)],
                           cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert again.returncode == 2 and "already holds a comparison" in again.stderr  # nothing written over


def test_the_report_command_refuses_a_folder_that_is_no_run(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "framework.report", str(tmp_path)], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 2
    assert proc.stderr.strip() == (f"error: {tmp_path} is not a run's output_dir (it has no config.yaml); pass the "
                                   "output_dir of a run")


def test_the_report_is_rewritten_while_the_run_trains(tiny_model, easy_data, hf_home, tmp_path, monkeypatch):
    """With every_minutes that short (and no limit on drawing's share of the time), the page is rewritten at
    every log step, saying where the run stands."""
    import framework.report as report

    monkeypatch.setattr(report.LivePage, "SHARE", float("inf"))
    pages = []  # those written while the run trains (the final one has no live facts: it reads summary.json)
    original = report.write_report

    def spy(output_dir, live=None):
        page = original(output_dir, live)
        if live is not None:
            pages.append(page.read_text())
        return page

    monkeypatch.setattr(report, "write_report", spy)
    out = tmp_path / "run"
    assert run_main(tiny_args(tiny_model, easy_data, out, "report.enabled=true", "report.every_minutes=1e-9",
                              "train.max_steps=4"), hf_home) == 0
    stood = [re.search(r"not finished \(in progress or stopped\): step (\d+) of 4", page).group(1) for page in pages]
    assert stood == ["1", "2", "3", "4", "4"]  # the last after the final evaluation's log line
    assert "finished: 4 steps" in (out / "report.html").read_text()


def test_the_live_page_takes_at_most_one_percent_of_the_time(tmp_path, monkeypatch):
    """Rewritten at most every every_minutes, and no sooner than 100 times its last drawing took: after a
    drawing of 2 s it waits 200 s (every_minutes 1), after one of 0.3 s the minute."""
    import framework.report as report

    now, drawn = [0.0], []

    def drawing(output_dir, live=None):  # the first takes 2 s, the others 0.3 s
        drawn.append(now[0])
        now[0] += 2.0 if len(drawn) == 1 else 0.3

    monkeypatch.setattr(report.time, "monotonic", lambda: now[0])
    monkeypatch.setattr(report, "write_report", drawing)
    page = report.LivePage(tmp_path, {}, every_minutes=1, clock=report.Clock())
    for second in range(0, 420, 10):  # a log step every 10 s
        now[0] = max(now[0], second)
        page.due()
    assert drawn == [60, 270, 340, 410]  # 62 + 200 s; 270.3 + 60 s; 340.3 + 60 s


def test_a_stopped_run_leaves_a_page_that_says_where_it_stood(tiny_model, easy_data, hf_home, tmp_path):
    out = tmp_path / "run"
    env = {**os.environ, "HF_HOME": str(hf_home), "SIGNAL_AT": "framework.step:SupervisedStep.__call__", "SIGNAL_CALL": "6"}
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "scripts" / "signal_at.py"),
                           *tiny_args(tiny_model, easy_data, out, "report.enabled=true", "train.max_steps=40")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 3, proc.stderr[-3000:]
    assert "not finished (in progress or stopped): step 6 of 40" in (out / "report.html").read_text()
    assert_not_blank(out / "plots" / "curves.png")


# ---------------------------------------------------------------- FLOPs and peaks


def test_model_flops_count_each_matrix_product_once(tiny_model):
    """6 FLOPs per trainable weight that takes part in a product (the embedding lookups do not; an output layer
    tied to the embedding does), 4 per frozen one, and 12 * layers * hidden per token of context."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForSequenceClassification, GPT2Config, GPT2LMHeadModel, LlamaConfig, \
        LlamaForCausalLM

    from framework.flops import model_flops

    bert = AutoModelForSequenceClassification.from_pretrained(tiny_model, num_labels=2)
    c = bert.config
    embedding = (c.vocab_size + c.max_position_embeddings + c.type_vocab_size) * c.hidden_size
    counted = sum(p.numel() for p in bert.parameters()) - embedding
    flops = model_flops(bert)
    assert flops.matmul_parameters == counted
    assert flops.per_token == 6 * counted
    assert flops.per_token_context == 12 * c.num_hidden_layers * c.hidden_size
    assert flops.at(32) == 6 * counted + 12 * c.num_hidden_layers * c.hidden_size * 32

    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=100, n_positions=64, n_embd=32, n_layer=2, n_head=4))
    assert gpt2.lm_head.weight is gpt2.transformer.wte.weight  # tied: one matrix, used as a product at the top
    assert model_flops(gpt2).matmul_parameters == sum(p.numel() for p in gpt2.parameters()) - 64 * 32  # wpe only
    llama = LlamaForCausalLM(LlamaConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False))
    assert model_flops(llama).matmul_parameters == sum(p.numel() for p in llama.parameters()) - 100 * 32
    assert model_flops(llama).per_token_context == 12 * 2 * 4 * 8  # query heads x head size

    lora = get_peft_model(AutoModelForSequenceClassification.from_pretrained(tiny_model, num_labels=2),
                          LoraConfig(r=4, target_modules=["query", "value"], task_type="SEQ_CLS"))
    trainable = sum(p.numel() for p in lora.parameters() if p.requires_grad)
    frozen = model_flops(lora).matmul_parameters - trainable
    assert model_flops(lora).per_token == 6 * trainable + 4 * frozen


def test_the_window_counts_real_tokens_and_their_context(hf_home):
    """Two batches: 3 + 2 real tokens in rows of 4, then one full row: 9 tokens, context 3*3 + 2*2 + 4*4 = 29."""
    from accelerate import Accelerator

    from framework.flops import ModelFlops
    from framework.step import StepResult, real_tokens
    from framework.train import LossWindow

    with fresh_process(hf_home):
        window = LossWindow(Accelerator(cpu=True), ModelFlops(per_token=100.0, per_token_context=10.0,
                                                              matmul_parameters=1))
        for mask in ([[1, 1, 1, 0], [1, 1, 0, 0]], [[1, 1, 1, 1]]):
            mask = torch.tensor(mask)
            window.add(StepResult(torch.tensor(2.0), mask.shape[0], *real_tokens({"attention_mask": mask}), 1))
        closed = window.close()
        assert closed.tokens == 9 and closed.flops == 100.0 * 9 + 10.0 * 29
        assert closed.loss == pytest.approx(4.0 / 3) and closed.micro_steps == 2
        window.add(StepResult(torch.tensor(1.0), 1, *real_tokens({"attention_mask": torch.tensor([[1, 1]])}), 1))
        assert window.close().tokens == 2  # a window counts only its own tokens
        assert window.totals() == (11, 33)


@pytest.mark.parametrize("name, row", [
    ("NVIDIA H100 80GB HBM3", "H100 SXM"), ("NVIDIA H100 PCIe", "H100 PCIe"), ("NVIDIA H100 NVL", "H100 NVL"),
    ("NVIDIA A100-SXM4-80GB", "A100"), ("NVIDIA A100 80GB PCIe", "A100"), ("NVIDIA H200", "H200"),
    ("NVIDIA B200", "B200"), ("TPU v4", "TPU v4"), ("TPU v5 lite", "TPU v5e"), ("TPU v5", "TPU v5p"),
    ("TPU v5p", "TPU v5p"), ("TPU v5litepod", "TPU v5e"), ("TPU v6 lite", "TPU v6e"), ("NVIDIA L4", None), ("CPU", None),
])
def test_device_names_map_to_their_peak_rows(name, row):
    from framework.backend.hardware import chip

    assert chip(name) == row


def test_peak_figures_by_precision():
    from framework.backend.hardware import table_peak

    assert table_peak("H100 SXM", "bf16") == pytest.approx(989.4e12)
    assert table_peak("H200", "fp8") == pytest.approx(1978.9e12)
    assert table_peak("A100", "fp32") == pytest.approx(19.5e12)
    assert table_peak("A100", "fp8") is None  # no fp8 on Ampere: no MFU rather than a wrong one
    assert table_peak("TPU v5e", "fp32") == table_peak("TPU v5e", "bf16") == pytest.approx(197e12)


def test_the_cpu_peak_bounds_what_matrix_products_reach():
    """The CPU's peak is the vector units' bound: a large fp32 product on all the threads reaches a share of it
    (above 0, at most 1: otherwise every MFU on this machine could pass 1), and fewer threads get less."""
    fp32, how = cpu_peak_flops(torch.float32)
    assert fp32 and "cores x" in how
    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    torch.mm(a, b)
    start = time.perf_counter()
    for _ in range(5):
        torch.mm(a, b)
    reached = 5 * 2 * 1024 ** 3 / (time.perf_counter() - start)
    assert 0.05 < reached / fp32 <= 1, (reached, fp32)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        cores = fp32 / cpu_peak_flops(torch.float32)[0]  # the cores all threads use, each one's share alike
        assert cores == round(cores) and 1 <= cores <= threads
    finally:
        torch.set_num_threads(threads)


# ---------------------------------------------------------------- trackers and the progress bar


def _wandb_records(path: Path) -> list:
    """The protobuf records of an offline wandb run file (LevelDB's log format after a 7-byte header)."""
    from wandb.proto import wandb_internal_pb2

    data, block, pos, records, pending = path.read_bytes(), 32768, 7, [], b""
    while pos + 7 <= len(data):
        left = block - pos % block
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if left < 7 or (kind == 0 and length == 0):  # block trailer or padding
            pos += left
            continue
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):  # a whole record, or its last piece
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
    return records


def test_wandb_offline_logs_the_metrics_and_flat_hyperparameters(tiny_model, easy_data, hf_home, tmp_path,
                                                                 monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    out = tmp_path / "out"
    assert run_main(tiny_args(tiny_model, easy_data, out, "train.max_steps=4", "report_to=[wandb]"), hf_home) == 0
    # The run's service process writes the file; it outlives the run inside this process (a user's process ends and
    # its atexit hook waits for it). Under load the history was not yet on disk when read: wait for the service.
    import wandb

    wandb.teardown()
    (run_file,) = out.glob("wandb/offline-run-*/run-*.wandb")  # inside output_dir
    records = _wandb_records(run_file)
    history = [{item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in r.history.item}
               for r in records if r.WhichOneof("record_type") == "history"]
    logged = {r["_step"]: r["loss"] for r in history if "loss" in r}
    assert logged == pytest.approx({r["step"]: r["loss"] for r in read_metrics(out) if "loss" in r}, rel=1e-9)
    config = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for r in records
              if r.WhichOneof("record_type") in ("config", "run")
              for item in (r.config.update if r.WhichOneof("record_type") == "config" else r.run.config.update)}
    assert config["optim.lr"] == 1e-3 and config["train.max_steps"] == 4


def test_mlflow_logs_into_the_output_folder(tiny_model, easy_data, hf_home, tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    out = tmp_path / "out"
    assert run_main(tiny_args(tiny_model, easy_data, out, "train.max_steps=4", "report_to=[mlflow]"), hf_home) == 0
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{out / 'mlflow' / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("framework").experiment_id])
    history = {m.step: m.value for m in client.get_metric_history(run.info.run_id, "loss")}
    assert history == pytest.approx({r["step"]: r["loss"] for r in read_metrics(out) if "loss" in r}, rel=1e-9)
    assert run.data.params["optim.lr"] == "0.001" and run.data.params["train.max_steps"] == "4"


def test_a_tracker_that_is_not_installed_is_named(tiny_model, easy_data, hf_home, tmp_path, capsys):
    out = tmp_path / "out"
    assert run_main(tiny_args(tiny_model, easy_data, out, "report_to=[aim]"), hf_home) == 2
    assert capsys.readouterr().err.strip() == ("error: report_to: aim is not installed; `pip install aim`, or "
                                               "remove it from report_to")
    assert run_main(tiny_args(tiny_model, easy_data, out, "report_to=[tensorbord]"), hf_home) == 2
    assert "report_to: 'tensorbord' is not a tracker" in capsys.readouterr().err
    assert not out.exists()
