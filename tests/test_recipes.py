"""Every shipped recipe, found recursively under recipes/, loads and validates."""

from pathlib import Path

import pytest

from framework.config import load_config

RECIPES = sorted((Path(__file__).resolve().parent.parent / "recipes").rglob("*.yaml"))


def test_recipes_exist():
    assert any(p.name == "text_classification.yaml" for p in RECIPES)


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: str(p.relative_to(p.parents[1])))
def test_recipe_validates(recipe):
    cfg = load_config(recipe, [])
    assert cfg.task and cfg.output_dir
