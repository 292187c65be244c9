"""Recipe loading, extends, overrides, and every validation message."""

from pathlib import Path

import pytest

from framework.config import RunConfig, to_yaml
from framework.recipe import load_config
from framework.errors import UserError


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def problems(path, overrides=()):
    with pytest.raises(UserError) as err:
        load_config(path, list(overrides))
    return str(err.value)


@pytest.fixture
def base(tmp_path):
    return write(tmp_path / "base.yaml", "model:\n  name_or_path: some/model\ndata:\n  train_file: a.csv\n"
                                         "train:\n  batch_size: 4\n  epochs: 2\n")


def test_loads_typed_values(base):
    cfg = load_config(base, [])
    assert isinstance(cfg, RunConfig)
    assert cfg.train.batch_size == 4 and cfg.train.epochs == 2.0 and isinstance(cfg.train.epochs, float)
    assert cfg.data.train_file == "a.csv"
    assert cfg.optim.lr == 5e-5  # schema default for a key the recipe leaves out


def test_extends_merges_parent_first(tmp_path, base):
    child = write(tmp_path / "child.yaml", "extends: base.yaml\ntrain:\n  batch_size: 16\n")
    cfg = load_config(child, [])
    assert cfg.train.batch_size == 16 and cfg.train.epochs == 2.0 and cfg.data.train_file == "a.csv"


def test_extends_list_and_chain(tmp_path, base):
    write(tmp_path / "mid.yaml", "extends: base.yaml\noptim:\n  lr: 0.001\n")
    write(tmp_path / "other.yaml", "seed: 7\n")
    child = write(tmp_path / "child.yaml", "extends: [mid.yaml, other.yaml]\n")
    cfg = load_config(child, [])
    assert (cfg.optim.lr, cfg.seed, cfg.train.batch_size) == (0.001, 7, 4)


def test_overrides_win_and_parse_types(base):
    cfg = load_config(base, ["train.batch_size=8", "optim.lr=1e-4", "data.labels=[x,y]", "train.max_steps=null"])
    assert cfg.train.batch_size == 8 and cfg.optim.lr == 1e-4 and cfg.data.labels == ["x", "y"]
    assert cfg.train.max_steps is None


def test_interpolation_resolves(tmp_path):
    recipe = write(tmp_path / "r.yaml", "seed: 3\noutput_dir: runs/seed_${seed}\nmodel:\n  name_or_path: m\ndata:\n  train_file: a.csv\n")
    assert load_config(recipe, []).output_dir == "runs/seed_3"


def test_print_config_round_trips(base, tmp_path):
    cfg = load_config(base, ["optim.lr=0.002"])
    again = load_config(write(tmp_path / "printed.yaml", to_yaml(cfg)), [])
    assert again == cfg


def test_unknown_key_suggests_closest(base):
    assert "unknown key 'train.batchsize'; did you mean 'train.batch_size'?" in problems(base, ["train.batchsize=3"])


def test_unknown_key_in_wrong_section_names_the_right_one(base):
    assert "unknown key 'lr'; did you mean 'optim.lr'?" in problems(base, ["lr=0.1"])


def test_wrong_type_names_key_value_and_allowed(base):
    message = problems(base, ["train.batch_size=abc"])
    assert "train.batch_size: 'abc' is not allowed; expected an integer" in message


def test_choice_lists_allowed_values(base):
    assert "precision: 'fp64' is not allowed; expected one of no, fp16, bf16, fp8, auto" in \
        problems(base, ["precision=fp64"])


def test_words_yaml_11_reads_as_booleans_are_taken_as_typed(base, tmp_path):
    """YAML 1.1 (PyYAML's, OmegaConf's) reads yes, no, on and off as booleans: precision=no, a documented value,
    arrived as false and was refused. Read with YAML 1.2's booleans, a text key gets the word and a boolean key
    still takes it as meant; a quoted 'no' and true/false are unchanged; a recipe file reads the same."""
    cfg = load_config(base, ["precision=no", "train.compile=yes", "train.gradient_checkpointing=Off",
                             "data.text_column=on", "data.label_column='no'", "checkpoint.every_epoch=true"])
    assert (cfg.precision, cfg.train.compile, cfg.train.gradient_checkpointing) == ("no", True, False)
    assert (cfg.data.text_column, cfg.data.label_column, cfg.checkpoint.every_epoch) == ("on", "no", True)
    recipe = write(tmp_path / "words.yaml", "precision: no\nmodel:\n  name_or_path: m\ndata:\n  train_file: a.csv\n"
                                             "report:\n  enabled: off\ntrain:\n  max_grad_norm: 1e-5\n")
    cfg = load_config(recipe, [])
    assert (cfg.precision, cfg.report.enabled, cfg.train.max_grad_norm) == ("no", False, 1e-5)
    assert "train.compile: 'maybe' is not allowed; expected true or false" in problems(base, ["train.compile=maybe"])
    assert load_config(write(tmp_path / "again.yaml", to_yaml(load_config(base, ["precision=no"]))), []).precision == "no"


@pytest.mark.parametrize("override,expected", [
    ("optim.lr=0", "optim.lr: 0.0 is out of range; it must be > 0"),
    ("optim.lr=-1e-3", "optim.lr: -0.001 is out of range; it must be > 0"),
    ("train.batch_size=0", "train.batch_size: 0 is out of range; it must be > 0"),
    ("train.batch_size=-4", "train.batch_size: -4 is out of range; it must be > 0"),
    ("train.gradient_accumulation_steps=0", "train.gradient_accumulation_steps: 0 is out of range; it must be > 0"),
    ("data.eval_fraction=1.5", "data.eval_fraction: 1.5 is out of range; it must be > 0.0 and < 1.0"),
    # found by the fuzzing harness: these failed deep inside (timedelta, numpy's seed, a C int)
    ("distributed.timeout_minutes=1e30", "distributed.timeout_minutes: 1e+30 is out of range; it must be > 0 and <= "),
    ("seed=-1", "seed: -1 is out of range; it must be >= 0 and < 4294967296"),
    ("train.cpu_threads=1000000000000", "train.cpu_threads: 1000000000000 is out of range"),
    ("train.max_steps=99999999999999999999999", "it must be a 64-bit integer"),
    ("train.max_grad_norm=.inf", "train.max_grad_norm: Infinity is out of range; it must be a finite number"),
    ("optim.lr=.nan", "optim.lr: NaN is out of range; it must be a finite number"),
])
def test_out_of_range(base, override, expected):
    assert expected in problems(base, [override])


def test_all_problems_reported_together(base):
    message = problems(base, ["optim.lr=-1", "train.batchsize=2", "train.epochs=x", "precision=int4"])
    assert "4 problem(s)" in message
    for part in ("optim.lr", "train.batchsize", "train.epochs", "precision"):
        assert part in message


def test_missing_recipe_file(tmp_path):
    assert "recipe file" in problems(tmp_path / "nope.yaml") and "does not exist" in problems(tmp_path / "nope.yaml")


def test_missing_parent(tmp_path):
    child = write(tmp_path / "child.yaml", "extends: gone.yaml\n")
    assert "extends 'gone.yaml'" in problems(child)


def test_extends_cycle(tmp_path):
    write(tmp_path / "a.yaml", "extends: b.yaml\n")
    write(tmp_path / "b.yaml", "extends: a.yaml\n")
    assert "cycle" in problems(tmp_path / "a.yaml")


def test_invalid_yaml(tmp_path):
    assert "not valid YAML" in problems(write(tmp_path / "bad.yaml", "train: [unclosed\n"))


def test_override_without_equals(base):
    assert "must look like KEY=VALUE" in problems(base, ["train.batch_size"])


def test_train_file_required(tmp_path):
    assert "data.train_file is required" in problems(write(tmp_path / "r.yaml", "seed: 1\n"))


def test_labels_need_two_classes(base):
    assert "data.labels" in problems(base, ["data.labels=[only]"])


def test_section_must_be_mapping(base):
    assert "train must be a mapping" in problems(base, ["train=3"])


@pytest.mark.parametrize("overrides, expected", [
    (["distributed.mesh=[2,2]"], "distributed.mesh: only distributed.strategy=xla_fsdp takes a mesh"),
    (["distributed.strategy=xla_fsdp", "distributed.mesh=[4]"], "distributed.mesh: [4] must be [data, fsdp]"),
    (["distributed.strategy=xla_fsdp", "distributed.mesh=[0,4]"], "distributed.mesh: [0, 4] must be [data, fsdp]"),
    (["train.profile_steps=[5,3]"], "train.profile_steps: [5, 3] must be [START, END] with 1 <= START <= END"),
    (["train.profile_steps=[0,3]"], "train.profile_steps: [0, 3] must be [START, END]"),
    (["report_to=[tensorbord]"], "report_to: 'tensorbord' is not a tracker; use any of tensorboard, wandb, mlflow"),
    (["report.every_minutes=0"], "report.every_minutes: 0.0 is out of range; it must be > 0"),
])
def test_mesh_profile_and_report_keys(base, overrides, expected):
    assert expected in problems(base, overrides)


# ---------------------------------------------------------------- malformed overrides and task keys (issue 22)


@pytest.mark.parametrize("override, expected", [
    ("train.batch_size=[1", "override 'train.batch_size=[1': the value of train.batch_size is not valid YAML"),
    ("data.labels={a", "override 'data.labels={a': the value of data.labels is not valid YAML"),
    ('seed="7', "override 'seed=\"7': the value of seed is not valid YAML"),
    ("train..batch_size=4", "override 'train..batch_size=4' must look like KEY=VALUE with KEY a dotted key path"),
    ("=4", "override '=4' must look like KEY=VALUE"),
    ("seed=${nowhere}", "seed: cannot resolve its interpolation"),
    ("seed=${oc.env:FRAMEWORK_FUZZ_UNSET_VARIABLE}", "seed: cannot resolve its interpolation"),
    ("data=[]", "overrides data=[]: cannot merge it onto the recipe"),  # was a TypeError from OmegaConf.merge
])
def test_malformed_override_is_named(base, override, expected):
    assert expected in problems(base, [override])


def test_a_child_recipe_cannot_turn_a_section_into_a_list(tmp_path):
    write(tmp_path / "parent.yaml", "data:\n  train_file: a.csv\n")
    child = write(tmp_path / "child.yaml", "extends: parent.yaml\ndata: [1, 2]\n")
    assert f"recipe {child}: cannot merge it onto the recipe" in problems(child)


def test_extends_must_name_recipes(tmp_path):
    for value in ("3", "{a: b}", "[1, 2]"):
        recipe = write(tmp_path / "r.yaml", f"extends: {value}\n")
        assert "extends must be a recipe path or a list of them" in problems(recipe)


@pytest.mark.parametrize("task, override", [
    ("causal_lm", "data.max_length=4096"),
    ("causal_lm", "data.labels=[a,b]"),
    ("causal_lm", "data.mlm_probability=0.3"),
    ("masked_lm", "data.packing=true"),
    ("masked_lm", "eval.prompt=hello"),
    ("text_classification", "data.block_size=64"),
    ("text_classification", "data.packing=false"),
    ("text_classification", "eval.max_new_tokens=8"),
])
def test_a_key_the_task_does_not_read_is_refused(tmp_path, task, override):
    """A task-specific key set for a task that does not read it would be silently ignored."""
    recipe = write(tmp_path / "r.yaml", f"task: {task}\nmodel:\n  config: {{model_type: gpt2}}\n  tokenizer: t\n"
                                        "data:\n  train_file: a.csv\n" if task != "text_classification" else
                   "model:\n  name_or_path: m\ndata:\n  train_file: a.csv\n")
    key = override.split("=")[0]
    assert f"{key}: {task} does not read it" in problems(recipe, [override]) and "remove it" in problems(recipe, [override])


def test_a_task_key_from_extends_is_refused_too(tmp_path):
    write(tmp_path / "parent.yaml", "model:\n  name_or_path: m\ndata:\n  train_file: a.csv\n  max_length: 64\n")
    child = write(tmp_path / "child.yaml", "extends: parent.yaml\ntask: causal_lm\n")
    assert "data.max_length: causal_lm does not read it" in problems(child)


def test_a_printed_recipe_of_every_task_loads_again(tmp_path):
    """--print-config writes every key, task-specific ones at their defaults: that is not setting them."""
    from framework.tasks import registered

    for task in [name for name in registered() if ":" not in name]:  # the built-in ones
        model = "model:\n  name_or_path: m\n" if task == "text_classification" else \
            "model:\n  config: {model_type: gpt2}\n  tokenizer: t\n"
        online = task in ("grpo", "rloo")
        required = f"{task}:\n  reward_functions: [exact_match]\n" if online else ""  # online RL's one required key
        printed = write(tmp_path / f"{task}.yaml", to_yaml(load_config(write(
            tmp_path / "r.yaml", f"task: {task}\n{model}{required}data:\n  train_file: a.csv\n"), [])))
        assert load_config(printed, []).task == task


def test_two_keys_naming_one_column_are_refused(base):
    """Found by the fuzzing harness: a pair column that is the label column failed inside pyarrow."""
    assert "data.label_column and data.text_pair_column name the same column 'label'" in problems(
        base, ["data.text_pair_column=label"])


def test_a_task_section_holds_its_columns_and_the_old_data_spelling_still_loads(base, capsys):
    """sft's and dpo's columns moved from data.* into their sections: the old key is read, with a note."""
    cfg = load_config(base, ["task=dpo", "dpo.chosen_column=good"])
    assert (cfg.dpo.prompt_column, cfg.dpo.chosen_column, cfg.dpo.rejected_column) == ("prompt", "good", "rejected")
    cfg = load_config(base, ["task=sft", "data.messages_column=chats"])
    assert cfg.sft.messages_column == "chats" and not hasattr(cfg.data, "messages_column")
    assert "note: data.messages_column is now sft.messages_column" in capsys.readouterr().err
    assert "keep sft.prompt_column only" in problems(base, ["task=sft", "data.prompt_column=a", "sft.prompt_column=b"])
    assert "unknown key 'data.chosen_column'" in problems(base, ["task=sft", "data.chosen_column=c"])
    assert "dpo: sft does not read it" in problems(base, ["task=sft", "dpo.beta=0.5"])


def test_a_checkpoint_recipe_saved_with_the_old_column_keys_resumes():
    from framework.config import to_dict
    from framework.recipe import resume_differences, schema

    cfg = schema()(task="dpo")
    saved = to_dict(cfg)
    for key in ("prompt_column", "chosen_column", "rejected_column"):
        saved["data"][key] = saved["dpo"].pop(key)
    saved["data"].update(messages_column="messages", completion_column="completion")
    assert resume_differences(saved, cfg) == ([], [])
    saved["data"]["chosen_column"] = "other"
    assert resume_differences(saved, cfg)[0] == ["dpo.chosen_column: 'other' -> 'chosen'"]
