"""The recipe schema: construction from YAML and Python, overrides, and one-line errors."""

from pathlib import Path

import pytest
import yaml

from specgraph.errors import RecipeError
from specgraph.recipe import ChainTree, DynamicTree, Recipe, StaticTree, apply_override

REPO = Path(__file__).resolve().parent.parent
BASE = {"name": "r", "models": {"t": {"path": "m/t"}, "d": {"path": "m/d"}},
        "stages": [{"name": "d", "model": "d", "tree": {"shape": "chain", "length": 3}},
                   {"name": "t", "model": "t", "verifies": "d"}]}


def with_(path: str, value) -> dict:
    data = yaml.safe_load(yaml.safe_dump(BASE))
    apply_override(data, f"{path}={yaml.safe_dump(value, default_flow_style=True).strip()}")
    return data


def error_of(data) -> str:
    with pytest.raises(RecipeError) as info:
        Recipe.from_dict(data, base_dir="/base")
    message = str(info.value)
    assert "\n" not in message
    return message


def test_yaml_and_python_give_the_same_recipe(tmp_path):
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(BASE))
    from_yaml = Recipe.from_yaml(tmp_path / "r.yaml")
    from_python = Recipe(name="r", models={"t": {"path": tmp_path / "m/t"}, "d": {"path": tmp_path / "m/d"}},
                         stages=[{"name": "d", "model": "d", "tree": ChainTree(length=3)},
                                 {"name": "t", "model": "t", "verifies": "d"}])
    assert from_yaml == from_python
    assert from_yaml.models["t"].path == tmp_path / "m" / "t"  # relative to the recipe's folder


def test_defaults():
    recipe = Recipe.from_dict(BASE)
    assert recipe.execution == "serial" and recipe.max_new_tokens == 256
    assert recipe.sampling.temperature == 0 and recipe.stages[1].devices == ["auto"]
    assert recipe.stages[1].verify.rule is None  # resolved by the validate pass


def test_tree_shapes_parse():
    data = with_("stages.0.tree", {"shape": "static", "branching": [2, 1]})
    assert isinstance(Recipe.from_dict(data).stages[0].tree, StaticTree)
    data = with_("stages.0.tree", {"shape": "dynamic", "width": 2, "depth": 3, "nodes": 6})
    assert Recipe.from_dict(data).stages[0].tree == DynamicTree(width=2, depth=3, nodes=6)


def test_overrides_reach_nested_fields(tmp_path):
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(BASE))
    recipe = Recipe.from_yaml(tmp_path / "r.yaml", ["stages.0.devices=[cpu]", "sampling.temperature=0.5",
                                                    "stages.1.verify.rule=sampling", "prompt=def f(x)"])
    assert recipe.stages[0].devices == ["cpu"] and recipe.sampling.temperature == 0.5
    assert recipe.stages[1].verify.rule == "sampling" and recipe.prompt == "def f(x)"


@pytest.mark.parametrize("override, expected", [
    ("stages.7.name=x", "stages.7 is not an index of a list of 2"),
    ("noequals", "expected KEY=VALUE"),
    ("name.x=1", "name is not a mapping or list"),
])
def test_bad_overrides(override, expected):
    with pytest.raises(RecipeError, match=expected):
        apply_override(yaml.safe_load(yaml.safe_dump(BASE)), override)


@pytest.mark.parametrize("path, value, expected", [
    ("stages.0.colour", "red", "stages.0.colour: unknown key; valid keys here: name, model, devices, tree"),
    ("bogus", 1, "bogus: unknown key; valid keys here: name, models, stages"),
    ("stages.0.tree.foo", 1, "stages.0.tree.foo: unknown key; valid keys here: shape, length"),
    ("max_new_tokens", "many", "max_new_tokens: Input should be a valid integer"),
    ("max_new_tokens", 0, "max_new_tokens: Input should be greater than 0"),
    ("models.t.dtype", "int8", "models.t.dtype: Input should be 'auto', 'float32', 'bfloat16' or 'float16'"),
    ("stages.0.tree", {"shape": "dynamic", "width": 2, "depth": 2, "nodes": 0}, "stages.0.tree.nodes: Input should be greater than 0"),
    ("stages.0.tree", {"shape": "chain", "length": 0}, "stages.0.tree.length: Input should be greater than 0"),
    ("stages.0.tree", {"shape": "static", "branching": [2], "paths": [[0]]}, "exactly one of 'branching' or 'paths'"),
    ("stages.0.tree", {"shape": "static", "paths": [[0, 0]]}, "has no parent path [0]"),
    ("stages.0.tree", {"shape": "static", "paths": [[1]]}, "skips its elder sibling [0]"),
    ("stages.0.tree", {"shape": "ring"}, "stages.0.tree: Input tag 'ring' found using 'shape' does not match"),
    ("sampling.top_p", 0, "sampling.top_p: Input should be greater than 0"),
    ("execution", "parallel", "execution: Input should be 'serial', 'disaggregated' or 'pipeline'"),
    ("stages.1.verify.rule", "typo", "stages.1.verify.rule: Input should be 'greedy', 'sampling' or 'typical'"),
    ("stages.1.verify.rule", "residual", "stages.1.verify.rule: the residual rule was deleted; 'sampling', lossless"),
    ("stages", [], "stages: List should have at least 1 item"),
])
def test_malformed_recipes_name_the_field(path, value, expected):
    assert expected in error_of(with_(path, value))


def test_missing_required_field():
    data = yaml.safe_load(yaml.safe_dump(BASE))
    del data["stages"][0]["model"]
    assert error_of(data) == "stages.0.model: required field is missing"


def test_recipe_file_errors(tmp_path):
    with pytest.raises(RecipeError, match="does not exist"):
        Recipe.from_yaml(tmp_path / "none.yaml")
    (tmp_path / "bad.yaml").write_text("name: [unclosed")
    with pytest.raises(RecipeError, match="not valid YAML"):
        Recipe.from_yaml(tmp_path / "bad.yaml")
    (tmp_path / "list.yaml").write_text("- 1\n- 2\n")
    with pytest.raises(RecipeError, match="a recipe is a YAML mapping"):
        Recipe.from_yaml(tmp_path / "list.yaml")


def test_shipped_recipes_parse():
    for path in sorted((REPO / "recipes").glob("*.yaml")):
        assert Recipe.from_yaml(path).name == path.stem
