"""Resume never continues a different recipe, never writes outside its own output_dir, and "run the same
command again" is true: after a kill, with overwrite=true, under `make run`. Values from the environment
never reach the outputs."""

import hashlib
import json
import shutil
import subprocess
from pathlib import Path

import pytest

from helpers import (KILL_SCRIPT, ROOT, assert_bitwise_equal_models, crash_then_resume, environment, launch_cmd,
                     read_metrics, tiny_args)
from in_process import run_captured, run_main

# 20 steps; a checkpoint every 5; the kill lands at micro-batch 13, after step 10's checkpoint.
COMMON = ["train.max_steps=20", "train.log_every=1", "checkpoint.every_steps=5", "checkpoint.keep_last=4"]


def snapshot(folder: Path) -> dict:
    """Every file under ``folder`` with its SHA-256: equal snapshots mean nothing was written or removed."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_model, easy_data, hf_home):
    """An uninterrupted run, and the same recipe killed (SIGKILL) at micro-batch 13: an unfinished run
    with checkpoints at steps 5 and 10 and no summary."""
    root = tmp_path_factory.mktemp("resume")
    whole, killed = root / "whole", root / "killed"
    assert run_main(tiny_args(tiny_model, easy_data, whole, *COMMON), hf_home) == 0
    proc = subprocess.run(launch_cmd(KILL_SCRIPT, None) + tiny_args(tiny_model, easy_data, killed, *COMMON),
                          cwd=ROOT, capture_output=True, text=True, env=environment(hf_home, KILL_AT_MICRO="13"), timeout=600)
    assert proc.returncode == -9, proc.stderr[-2000:]
    assert sorted(p.name for p in (killed / "checkpoints").iterdir()) == ["step_10", "step_5"]
    return whole, killed


@pytest.fixture
def unfinished(runs, tmp_path):
    """A private copy of the killed run."""
    copy = tmp_path / "unfinished"
    shutil.copytree(runs[1], copy)
    return copy


def run(capsys, hf_home, args):
    status = run_main(args, hf_home)
    out, err = capsys.readouterr()
    assert "Traceback" not in err
    return status, out, err


def test_a_changed_recipe_is_refused_naming_each_key_and_nothing_changes(capsys, tiny_model, easy_data, hf_home,
                                                                         unfinished):
    before = snapshot(unfinished)
    status, _, err = run(capsys, hf_home, tiny_args(tiny_model, easy_data, unfinished, *COMMON, "optim.lr=2e-3",
                                                    "seed=7"))
    assert status == 2
    assert "holds an unfinished run trained with a different recipe" in err
    assert "optim.lr: 0.001 -> 0.002" in err and "seed: 42 -> 7" in err
    assert "rerun the original recipe" in err and "new output_dir" in err
    assert snapshot(unfinished) == before


def test_settings_that_cannot_change_the_result_resume_bitwise(capsys, tiny_model, easy_data, hf_home, runs,
                                                               unfinished):
    status, out, _ = run(capsys, hf_home, tiny_args(tiny_model, easy_data, unfinished, *COMMON, "train.log_every=2",
                                                    "checkpoint.keep_last=3", "eval.every_steps=7",
                                                    "train.eval_batch_size=5"))
    assert status == 0
    assert "resuming from" in out and "step_10" in out
    for change in ("train.log_every: 1 -> 2", "checkpoint.keep_last: 4 -> 3", "eval.every_steps: null -> 7",
                   "train.eval_batch_size: null -> 5"):
        assert f"note: resuming with a changed setting that cannot change the result: {change}" in out
    assert_bitwise_equal_models(runs[0], unfinished)


def test_rerunning_with_overwrite_true_resumes_the_same_recipe(capsys, tiny_model, easy_data, hf_home, runs,
                                                               unfinished):
    status, out, _ = run(capsys, hf_home, tiny_args(tiny_model, easy_data, unfinished, *COMMON, "overwrite=true"))
    assert status == 0 and "resuming from" in out and "so it is resumed, not replaced" in out
    assert_bitwise_equal_models(runs[0], unfinished)
    losses = {r["step"]: r["loss"] for r in read_metrics(unfinished) if "loss" in r}
    assert losses == {r["step"]: r["loss"] for r in read_metrics(runs[0]) if "loss" in r}


def test_overwrite_true_replaces_an_unfinished_run_of_another_recipe(capsys, tiny_model, easy_data, hf_home,
                                                                     unfinished):
    status, out, _ = run(capsys, hf_home, tiny_args(tiny_model, easy_data, unfinished, *COMMON, "overwrite=true",
                                                    "optim.lr=2e-3"))
    assert status == 0 and "resuming from" not in out
    assert [r["step"] for r in read_metrics(unfinished) if "loss" in r] == list(range(1, 21))
    assert json.loads((unfinished / "summary.json").read_text())["train"]["resumed_from_step"] is None


def test_resume_from_a_path_writes_only_into_its_own_output_dir(capsys, tiny_model, easy_data, hf_home, runs,
                                                                unfinished, tmp_path):
    before, out = snapshot(unfinished), tmp_path / "continued"
    status, stdout, _ = run(capsys, hf_home, tiny_args(tiny_model, easy_data, out, *COMMON,
                                                       f"checkpoint.resume={unfinished}/checkpoints/step_10"))
    assert status == 0 and "resuming from" in stdout
    assert snapshot(unfinished) == before  # the source run is read, never written
    assert [r["step"] for r in read_metrics(out) if "loss" in r] == list(range(11, 21))
    assert json.loads((out / "summary.json").read_text())["train"]["resumed_from_step"] == 10
    assert_bitwise_equal_models(runs[0], out)


def test_resume_from_a_path_into_another_runs_output_dir_is_refused(capsys, tiny_model, easy_data, hf_home, runs,
                                                                   unfinished, tmp_path):
    other = tmp_path / "other"
    shutil.copytree(runs[0], other)
    before = snapshot(other)
    status, _, err = run(capsys, hf_home, tiny_args(tiny_model, easy_data, other, *COMMON,
                                                    f"checkpoint.resume={unfinished}/checkpoints/step_10"))
    assert status == 2 and f"the run in {other} already finished" in err and "new output_dir" in err
    assert snapshot(other) == before


def test_a_run_resumed_from_a_path_and_killed_resumes_again_with_the_same_command(hf_home, tiny_model, easy_data,
                                                                                runs, unfinished, tmp_path):
    """The same command again continues the run's own newer checkpoint (step 15), not the path's (step 10)."""
    out = tmp_path / "continued"
    args = tiny_args(tiny_model, easy_data, out, *COMMON, f"checkpoint.resume={unfinished}/checkpoints/step_10")
    proc = crash_then_resume(hf_home, args, kill_at_micro=7)  # step 17 of 20, after step 15's checkpoint
    assert f"resuming from {out}/checkpoints/step_15" in proc.stdout
    assert_bitwise_equal_models(runs[0], out)
    assert [r["step"] for r in read_metrics(out) if "loss" in r] == list(range(11, 21))


def test_resume_from_a_path_with_another_recipe_is_refused(capsys, tiny_model, easy_data, hf_home, unfinished,
                                                          tmp_path):
    status, _, err = run(capsys, hf_home, tiny_args(tiny_model, easy_data, tmp_path / "new", *COMMON,
                                                    "optim.lr=2e-3",
                                                    f"checkpoint.resume={unfinished}/checkpoints/step_10"))
    assert status == 2 and "was trained with a different recipe" in err
    assert "optim.lr: 0.001 -> 0.002" in err
    assert not (tmp_path / "new").exists()


def test_a_different_number_of_devices_is_refused(capsys, tiny_model, easy_data, hf_home, unfinished):
    """A checkpoint from before checkpoints recorded their layout resumes on its device count only (here edited to
    hold no layout and say 2 devices, as an older 2-process run's would); others reshard (tests/test_resharding.py)."""
    for step in ("step_5", "step_10"):
        state_file = unfinished / "checkpoints" / step / "trainer_state.json"
        record = json.loads(state_file.read_text())
        assert record["devices"] == 1 and record.pop("layout")["devices"] == 1
        state_file.write_text(json.dumps({**record, "devices": 2}))
    status, _, err = run(capsys, hf_home, tiny_args(tiny_model, easy_data, unfinished, *COMMON))
    assert status == 2 and "was trained on 2 device(s)" in err and "this launch has 1" in err


def test_an_unfinished_run_without_a_checkpoint_starts_over(hf_home, tiny_model, easy_data, tmp_path):
    """Killed before its first checkpoint, the same command starts the run over in place."""
    out = tmp_path / "early"
    args = tiny_args(tiny_model, easy_data, out, *COMMON)
    proc = subprocess.run(launch_cmd(KILL_SCRIPT, None) + args, cwd=ROOT, capture_output=True, text=True,
                          env=environment(hf_home, KILL_AT_MICRO="3"), timeout=600)
    assert proc.returncode == -9 and (out / "config.yaml").is_file() and not (out / "checkpoints").exists()
    again = run_captured(args, hf_home)
    assert again.returncode == 0, again.stderr[-2000:]
    assert "without a checkpoint; starting it over" in again.stdout
    assert [r["step"] for r in read_metrics(out) if "loss" in r] == list(range(1, 21))


def test_every_minutes_saves_by_the_clock(capsys, tiny_model, easy_data, hf_home, tmp_path):
    """A tiny interval (under a millisecond) is due after every step: every step is saved."""
    out = tmp_path / "clock"
    status, _, _ = run(capsys, hf_home, tiny_args(tiny_model, easy_data, out, "train.max_steps=6",
                                                  "checkpoint.every_minutes=0.00001", "checkpoint.keep_last=10"))
    assert status == 0
    assert sorted(int(p.name.split("_")[1]) for p in (out / "checkpoints").glob("step_*")) == [1, 2, 3, 4, 5, 6]


@pytest.mark.slow
def test_the_default_recipe_resumes_after_a_kill(cli, hf_home, tmp_path):
    """The default recipe saves by the clock (checkpoint.every_minutes), so a kill at any time is resumable;
    here with a minute shortened to keep the test small."""
    args = [f"output_dir={tmp_path / 'default'}", "data.max_train_samples=320", "data.max_eval_samples=64",
            "train.log_every=2", "checkpoint.every_minutes=0.00001"]
    proc = crash_then_resume(hf_home, args, kill_at_micro=7)
    assert "resuming from" in proc.stdout and "step_6" in proc.stdout


def test_values_from_the_environment_are_never_written_out(capsys, tiny_model, easy_data, hf_home, tmp_path,
                                                           monkeypatch):
    secret = "hf_s3cr3t_t0ken_value"
    monkeypatch.setenv("FRAMEWORK_TEST_TOKEN", secret)
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("extends: %s\nmodel:\n  token: ${oc.env:FRAMEWORK_TEST_TOKEN}\nreport_to: [tensorboard]\n"
                      % (ROOT / "tests" / "tiny.yaml"))
    out = tmp_path / "out"
    args = ["--config", str(recipe), f"model.name_or_path={tiny_model}", f"data.train_file={easy_data}",
            f"output_dir={out}", "train.max_steps=3", "checkpoint.every_steps=2"]
    status, stdout, stderr = run(capsys, hf_home, args)
    assert status == 0
    assert secret not in stdout + stderr
    written = [p for p in out.rglob("*") if p.is_file()]
    assert any("events.out.tfevents" in p.name for p in written) and (out / "checkpoints" / "step_2").is_dir()
    for path in written:
        assert secret.encode() not in path.read_bytes(), path
    assert "token: ${oc.env:FRAMEWORK_TEST_TOKEN}" in (out / "config.yaml").read_text()
    assert run_main(["--print-config", *args], hf_home) == 0
    assert secret not in capsys.readouterr().out


def test_make_run_continues_its_newest_unfinished_run(tmp_path):
    """`make run` again picks up the newest run folder without summary.json; with none it starts a new one."""
    finished, unfinished_run = tmp_path / "default-20260101-000000", tmp_path / "default-20260102-000000"
    finished.mkdir(), unfinished_run.mkdir()
    (finished / "summary.json").write_text("{}")

    def make_run() -> str:
        proc = subprocess.run(["make", "-s", "-o", "install", "run", "LAUNCH=echo", f"RUNS={tmp_path}"], cwd=ROOT,
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stderr
        return proc.stdout

    assert f"continuing the unfinished run in {unfinished_run}" in make_run()
    (unfinished_run / "summary.json").write_text("{}")
    started = make_run()
    assert "training into" in started and f"output_dir={tmp_path}/default-2" in started
    assert str(unfinished_run) not in started and str(finished) not in started


def test_overwrite_replaces_the_trackers_logs_too(capsys, tiny_model, easy_data, hf_home, tmp_path):
    out = tmp_path / "out"
    args = tiny_args(tiny_model, easy_data, out, "train.max_steps=2", "report_to=[tensorboard]")
    assert run_main(args, hf_home) == 0
    first = set(out.rglob("events.out.tfevents.*"))
    assert run_main(args + ["overwrite=true"], hf_home) == 0
    second = set(out.rglob("events.out.tfevents.*"))
    assert second and len(second) == len(first) and not first & second  # only the new run's, not both mixed
