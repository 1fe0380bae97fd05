"""SpecGraph construction and its structural checks."""

import pytest

from specgraph.errors import RecipeError
from specgraph.graph import SpecGraph
from specgraph.recipe import Recipe


def graph_of(stages, models=("a", "b", "c")) -> SpecGraph:
    recipe = Recipe.from_dict({"name": "g", "models": {m: {"path": f"/m/{m}"} for m in models}, "stages": stages})
    return SpecGraph.from_recipe(recipe)


def test_chain_of_stages_becomes_verifies_edges():
    g = graph_of([{"name": "d", "model": "a"}, {"name": "m", "model": "b", "verifies": "d"},
                  {"name": "t", "model": "c", "verifies": "m"}])
    assert g.stages() == ["d", "m", "t"] and g.target == "t"
    assert list(g.g.edges(data="kind")) == [("d", "m", "verifies"), ("m", "t", "verifies")]
    assert g.drafter_of("t") == "m" and g.drafter_of("d") is None
    dot = g.to_dot()
    assert '"d" -> "m" [label="verifies"]' in dot and dot.startswith('digraph "g"')


def test_single_stage_is_a_valid_graph():
    assert graph_of([{"name": "t", "model": "a"}]).stages() == ["t"]


@pytest.mark.parametrize("stages, expected", [
    ([{"name": "d", "model": "a", "verifies": "t"}, {"name": "t", "model": "b", "verifies": "d"}],
     "stages: 'verifies' edges form a cycle"),
    ([{"name": "d", "model": "a"}, {"name": "t", "model": "b", "verifies": "x"}],
     "stages.1.verifies: 'x' is not a stage (stages: d, t)"),
    ([{"name": "d", "model": "a"}, {"name": "t", "model": "b"}],
     "stages.1.verifies: stage 't' verifies nothing and nothing verifies it; set verifies to one of: d"),
    ([{"name": "d", "model": "a"}, {"name": "t", "model": "zz", "verifies": "d"}],
     "stages.1.model: 'zz' is not in models (defined: a, b, c)"),
    ([{"name": "d", "model": "a"}, {"name": "d", "model": "b", "verifies": "d"}],
     "stages.1.name: 'd' is used by two stages"),
    ([{"name": "d", "model": "a", "verifies": "d"}], "stages.0.verifies: a stage cannot verify itself"),
    ([{"name": "d", "model": "a"}, {"name": "m", "model": "b", "verifies": "d"}, {"name": "t", "model": "c", "verifies": "d"}],
     "'d' is verified by 2 stages"),
    ([{"name": "t", "model": "a", "verifies": "d"}, {"name": "d", "model": "b"}],
     "list the stages smallest model first"),
])
def test_bad_topologies(stages, expected):
    with pytest.raises(RecipeError) as info:
        graph_of(stages)
    assert expected in str(info.value)
