"""Bad input: one clear message naming the key or file, exit status 2, no traceback, nothing lost."""

import pytest

from helpers import synthetic_rows, tiny_args, write_csv
from in_process import run_main
from framework.cli import main


def fails(capsys, args):
    """Run the CLI in-process; return its error message after checking the status."""
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "error: " in err and "Traceback" not in err
    return err[err.index("error: "):]  # after any progress bars of the data loading


@pytest.fixture
def args(tiny_model, easy_data, tmp_path):
    return lambda *extra: tiny_args(tiny_model, easy_data, tmp_path / "out", *extra)


def test_missing_recipe_file_through_the_process(cli, tmp_path):
    proc = cli(["--config", str(tmp_path / "nope.yaml")], check=False)
    assert proc.returncode == 2
    assert "recipe file" in proc.stderr and "does not exist" in proc.stderr and "Traceback" not in proc.stderr


def test_bad_keys_through_the_process(cli, args):
    proc = cli(args("optim.lr=-1", "train.batchsize=4"), check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "optim.lr: -1.0 is out of range" in proc.stderr and "did you mean 'train.batch_size'" in proc.stderr


def test_missing_data_file(capsys, args, tmp_path):
    err = fails(capsys, args(f"data.train_file={tmp_path / 'missing.csv'}"))
    assert "data.train_file" in err and "missing.csv does not exist" in err


def test_a_data_file_that_is_a_folder_is_named_so(capsys, args, tmp_path):
    err = fails(capsys, args(f"data.train_file={tmp_path}"))
    assert f"data.train_file: {tmp_path} is a folder, not a file" in err and f"{tmp_path / '*.jsonl'}" in err


def test_unknown_data_format(capsys, args, tmp_path):
    (tmp_path / "data.xlsx").write_text("hello\n")
    assert "cannot tell the format" in fails(capsys, args(f"data.train_file={tmp_path / 'data.xlsx'}"))


@pytest.mark.parametrize("name,content", [("header.csv", "text,label\n"), ("empty.jsonl", ""),
                                          ("list.json", "[]\n"), ("blank.txt", "\n\n")])
def test_a_data_file_without_rows_is_named_so(capsys, args, tmp_path, name, content):
    """A file of no examples, in any format, is one sentence, not the datasets builder's internals."""
    (tmp_path / name).write_text(content)
    err = fails(capsys, args(f"data.train_file={tmp_path / name}"))
    assert f"data.train_file: {tmp_path / name} holds no rows" in err and "give at least one example" in err


def test_column_not_in_data_names_the_columns(capsys, args):
    err = fails(capsys, args("data.text_column=review"))
    assert "data.text_column: column 'review' is not in" in err and "its columns are text, label" in err


def test_labels_the_file_lacks_name_the_filter_and_the_files_labels(capsys, args):
    err = fails(capsys, args("data.labels=[happy,sad]"))
    assert "data.labels: none of ['happy', 'sad'] is a label of data.train_file" in err
    assert "its column 'label' holds neg, pos" in err


def test_single_class(capsys, tiny_model, tmp_path):
    rows = [r for r in synthetic_rows(100, seed=2) if r["label"] == "pos"]
    data = write_csv(tmp_path / "one.csv", rows)
    err = fails(capsys, tiny_args(tiny_model, data, tmp_path / "out"))
    assert "has a single class" in err and "data.label_column 'label'" in err


def test_eval_labels_unseen_in_training(capsys, tiny_model, easy_data, tmp_path):
    data = write_csv(tmp_path / "eval.csv", [{"text": "a movie", "label": "meh"}, {"text": "good", "label": "pos"}])
    err = fails(capsys, tiny_args(tiny_model, easy_data, tmp_path / "out", f"data.eval_file={data}"))
    assert "labels ['meh']" in err


def test_too_little_data_for_one_step(capsys, args):
    assert "fewer than one optimizer step takes" in fails(capsys, args("train.batch_size=1000"))


def test_max_length_beyond_the_models_positions(capsys, args):
    err = fails(capsys, args("data.max_length=128", "data.padding=max_length"))  # the tiny model has 64 positions
    assert "data.max_length=128 is longer than the model takes (max_position_embeddings 64)" in err
    assert "data.max_length=64 or less" in err


def test_model_folder_missing(capsys, args, tmp_path):
    err = fails(capsys, args(f"model.name_or_path={tmp_path / 'no_model'}"))
    assert "model.name_or_path: folder" in err and "does not exist" in err


def test_model_folder_without_config(capsys, args, tmp_path):
    (tmp_path / "empty_model").mkdir()
    assert "has no config.json" in fails(capsys, args(f"model.name_or_path={tmp_path / 'empty_model'}"))


def test_hub_id_while_offline_says_how_to_use_a_local_folder(capsys, args, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")  # nothing listens there
    err = fails(capsys, args("model.name_or_path=bert-base-uncased"))
    assert "is unreachable" in err and "point it at a local folder" in err


def test_hub_dataset_while_offline(capsys, args, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")
    err = fails(capsys, args("data.train_file=null", "data.dataset=rotten_tomatoes"))
    assert "data.dataset" in err and "use data.train_file" in err


# ---------------------------------------------------------------- inputs found by tests/test_fuzz_inputs.py (issue 22)


def test_malformed_override_through_the_cli(capsys, args):
    err = fails(capsys, args("train.batch_size=[1"))
    assert "override 'train.batch_size=[1': the value of train.batch_size is not valid YAML" in err


@pytest.mark.parametrize("lines, expected", [
    # the first data row longer than the header: pandas would take its surplus leading fields as an index
    (["text,label", "row 0,pos,extra,cols", "a good film,pos"], "line 2 has 4 fields, but its header has 2"),
    (["text,label", "a good film,pos", "row 0,pos,extra,cols"], "line 3 has 4 fields, but its header has 2"),
    (["text,label", "a good film,pos", "a bad film"], "line 3 has 1 fields, but its header has 2"),
    (["text,text", "a good film,pos"], "names column 'text' more than once"),
    ([], "has no header line"),
])
def test_a_table_pandas_would_misread_is_refused_naming_the_line(capsys, tiny_model, tmp_path, lines, expected):
    data = tmp_path / "ragged.csv"
    data.write_text("".join(line + "\n" for line in lines + ["a bad film,neg"] * 20 if lines))
    err = fails(capsys, tiny_args(tiny_model, data, tmp_path / "out"))
    assert f"data.train_file: {data}" in err and expected in err


def test_quoted_fields_and_blank_lines_are_read_as_pandas_reads_them(capsys, tiny_model, tmp_path, hf_home):
    data = tmp_path / "quoted.csv"
    data.write_text('text,label\n"a good, fine film",pos\n\n"a bad\nfilm",neg\n' * 20)
    assert run_main(tiny_args(tiny_model, data, tmp_path / "out", "--dry-run"), hf_home) == 0


def test_a_file_not_in_utf8_is_named(capsys, tiny_model, tmp_path):
    data = tmp_path / "latin1.csv"
    data.write_bytes("text,label\ncaf\u00e9 tr\u00e8s bien,pos\nmauvais,neg\n".encode("latin-1") * 10)
    err = fails(capsys, tiny_args(tiny_model, data, tmp_path / "out"))
    assert f"{data} is not UTF-8 text" in err


def test_a_truncated_compressed_file_is_named(capsys, tiny_model, easy_data, tmp_path):
    import gzip

    data = tmp_path / "cut.csv.gz"
    data.write_bytes(gzip.compress(easy_data.read_bytes())[:300])
    err = fails(capsys, tiny_args(tiny_model, data, tmp_path / "out"))
    assert f"data.train_file: cannot read {data}" in err


def test_a_text_column_of_numbers_names_the_column_and_its_type(capsys, word_tokenizer, tmp_path):
    from helpers import lm_args

    data = tmp_path / "numbers.jsonl"
    data.write_text("".join(f'{{"text": {i}}}\n' for i in range(50)))
    err = fails(capsys, lm_args(word_tokenizer, data, tmp_path / "out"))
    assert f"data.text_column: column 'text' of data.train_file {data} holds int64 values, not text" in err


def test_a_key_the_task_does_not_read_through_the_cli(capsys, word_tokenizer, corpus, tmp_path):
    from helpers import lm_args

    err = fails(capsys, lm_args(word_tokenizer, corpus, tmp_path / "out", "data.max_length=4096"))
    assert ("data.max_length: causal_lm does not read it (it reads model.config_overrides, data.packing, "
            "data.block_size") in err


@pytest.mark.parametrize("labels", ["data.labels=[pos,neg]", None])
def test_a_label_column_of_mixed_json_values_is_named(capsys, tiny_model, tmp_path, labels):
    """Found by the fuzzing harness: json labels of several types (an arrow.json column) crashed pyarrow's unique()."""
    data = tmp_path / "mixed.jsonl"
    data.write_text('{"text": "a good film", "label": [1]}\n{"text": "a bad film", "label": "neg"}\n'
                    '{"text": "a fine film", "label": {"a": 1}}\n' * 10)
    err = fails(capsys, tiny_args(tiny_model, data, tmp_path / "out", *([labels] if labels else [])))
    assert f"data.label_column: column 'label' of data.train_file {data} holds values of several JSON types" in err


def test_a_table_value_pandas_reads_as_missing_is_kept(tiny_model, tmp_path, hf_home, capsys):
    """Only an empty field is missing: pandas' default would drop reviews whose text is "None" or "NA"."""
    data = tmp_path / "na.csv"
    data.write_text("text,label\n" + "None,pos\nNA,neg\nnull,pos\nn/a,neg\n" * 5)
    assert run_main(tiny_args(tiny_model, data, tmp_path / "out", "--dry-run", "train.batch_size=2"), hf_home) == 0
    plan = capsys.readouterr().out
    assert "train_examples: 18" in plan and "eval_examples: 2" in plan


def test_options_may_come_among_the_overrides(tiny_model, easy_data, tmp_path, hf_home, capsys):
    """Found by the fuzzing harness: an option after an override made argparse exit (SystemExit, its own usage)."""
    args = tiny_args(tiny_model, easy_data, tmp_path / "out")
    assert run_main(args[:2] + ["seed=3", "--print-config"] + args[2:], hf_home) == 0
    assert "seed: 3" in capsys.readouterr().out


@pytest.mark.parametrize("argv, expected", [(["--bogus"], "error: unrecognized arguments: --bogus; usage: run.py"),
                                            (["--config"], "error: argument --config: expected one argument")])
def test_a_bad_option_is_one_error_line(capsys, argv, expected):
    assert main(argv) == 2
    assert capsys.readouterr().err.startswith(expected)


@pytest.mark.parametrize("recipe, override, expected", [
    ("tiny_mlm.yaml", "model.config.num_attention_heads=3", "model.config: cannot build the model: The hidden size"),
    ("tiny_lm.yaml", "model.config.n_head=3", "model.config: cannot build the model: `embed_dim` must be divisible"),
    ("tiny_mlm.yaml", "model.config.hidden_size=':16'", "model.config: cannot build a model config from"),
])
def test_a_model_config_its_library_refuses_is_named(capsys, word_tokenizer, corpus, tmp_path, recipe, override,
                                                     expected):
    """Found by the fuzzing harness: masked_lm built its model from the config unguarded (a ValueError), and a
    config value of the wrong type fails transformers 5's strict dataclass (not a ValueError)."""
    from helpers import ROOT

    err = fails(capsys, ["--config", str(ROOT / "tests" / recipe), f"model.tokenizer={word_tokenizer}",
                         f"data.train_file={corpus}", f"output_dir={tmp_path / 'out'}", override])
    assert expected in err



# Found by the fuzzing harness: datasets' json reader (pyarrow's read_json) died of a segmentation fault on this file.
PYARROW_CRASH = b'null\n{"text": "follows", "label": "\n{"text": "a", "label\n{"label": "", "text": {"r": {"x": []}}}\n{}\n{"other": "\\ufeff", "text": "garden"}\n{"other": "good film"}\n{}\n{"text": "0", "label": "p\n{"text": "", "label": "pos\n{"text": "had"}\n{}\n{"text": "`", "label"\n{}\n{"other": "\\udb7c\\udd5d\\u00d4@[\\u008e\\u009c\\ud846\\udc526\\u0084\\u00e0\\u009b6"}\n{}\n{}\n{"text": "[1"}\n{"text": "U\\u009c"}\n{"text": "\\u202e", "label": {"r": {}, "1": []}}\n{"text": "[1"}\n{}\n{"text": "great", "other": "null"}\n{"text": "\\"\\""}\n{}\n'


@pytest.mark.parametrize("content, expected", [
    (PYARROW_CRASH, "line 1 holds a NoneType, not an object"),
    (b'{"text": "a good film", "label": "pos"}\n[1, 2]\n', "line 2 holds a list, not an object"),
    (b'{"text": "a good film", "label": "pos"}\n{"text": "a bad\n', "line 2 is not valid JSON"),
])
def test_json_lines_that_are_not_objects_are_named(capsys, tiny_model, tmp_path, content, expected):
    data = tmp_path / "rows.json"
    data.write_bytes(content)
    err = fails(capsys, tiny_args(tiny_model, data, tmp_path / "out"))
    assert f"data.train_file: {data} {expected}" in err


def test_precision_as_the_docs_spell_it(capsys, args, hf_home):
    """precision=no on the command line, as README and --help-keys spell it, is the recipe's value (YAML read it as
    false, refused); precision=auto decides on this machine and the plan says what and why: bf16 on a CPU with AMX,
    no elsewhere (framework/backend/selection.py's auto_precision)."""
    from framework.backend.hardware import cpu_flags

    assert main(args("precision=no", "--print-config")) == 0
    assert "\nprecision: 'no'\n" in capsys.readouterr().out
    assert run_main(args("precision=auto", "--dry-run"), hf_home) == 0
    out = capsys.readouterr().out
    chosen = "bf16" if "amx_bf16" in cpu_flags() else "no"
    assert f"note: precision: auto is {chosen} here (the CPU has" in out and f"\n  precision: {chosen}\n" in out
