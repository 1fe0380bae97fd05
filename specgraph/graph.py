"""SpecGraph: the decoding topology as a networkx graph.

Nodes are stages (attribute `spec`: StageSpec, `model`: ModelSpec, `index`: position in the
recipe); an edge u -> v with kind "verifies" means stage v verifies the drafts of stage u.
Passes annotate nodes with further attributes; the graph attribute `recipe` holds the Recipe.
"""

from __future__ import annotations

import networkx as nx
from transformers import PretrainedConfig

from specgraph.errors import RecipeError
from specgraph.recipe import Recipe


class SpecGraph:
    def __init__(self, graph: nx.DiGraph):
        self.g = graph

    @classmethod
    def from_recipe(cls, recipe: Recipe) -> SpecGraph:
        g = nx.DiGraph(recipe=recipe)
        for i, stage in enumerate(recipe.stages):
            if stage.name in g:
                raise RecipeError(f"stages.{i}.name: {stage.name!r} is used by two stages; names must be unique")
            if stage.model not in recipe.models:
                raise RecipeError(f"stages.{i}.model: {stage.model!r} is not in models "
                                  f"(defined: {', '.join(recipe.models)})")
            g.add_node(stage.name, spec=stage, model=recipe.models[stage.model], index=i)
        for i, stage in enumerate(recipe.stages):
            if stage.verifies is None:
                continue
            if stage.verifies not in g:
                raise RecipeError(f"stages.{i}.verifies: {stage.verifies!r} is not a stage "
                                  f"(stages: {', '.join(g.nodes)})")
            if stage.verifies == stage.name:
                raise RecipeError(f"stages.{i}.verifies: a stage cannot verify itself")
            g.add_edge(stage.verifies, stage.name, kind="verifies")
        graph = cls(g)
        graph.check()
        return graph

    @property
    def recipe(self) -> Recipe:
        return self.g.graph["recipe"]

    def copy(self) -> SpecGraph:
        g = self.g.copy()
        for name in g.nodes:
            g.nodes[name].update(dict(self.g.nodes[name]))
        return SpecGraph(g)

    def stages(self) -> list[str]:
        """Stage names from the first drafter to the final target."""
        return list(nx.topological_sort(self.g))

    def node(self, name: str) -> dict:
        return self.g.nodes[name]

    @property
    def target(self) -> str:
        return self.stages()[-1]

    def drafter_of(self, name: str) -> str | None:
        preds = list(self.g.predecessors(name))
        return preds[0] if preds else None

    def check(self) -> None:
        """The stages must form one chain: each stage after the first verifies exactly the one before."""
        if not nx.is_directed_acyclic_graph(self.g):
            cycle = " -> ".join(u for u, _ in nx.find_cycle(self.g))
            raise RecipeError(f"stages: 'verifies' edges form a cycle ({cycle}); each stage must verify a smaller one")
        for name in sorted(self.g.nodes, key=lambda n: -self.node(n)["index"]):
            i = self.node(name)["index"]
            if self.g.out_degree(name) > 1:
                raise RecipeError(f"stages.{i}: {name!r} is verified by {self.g.out_degree(name)} stages; "
                                  "at most one stage may verify it")
            if len(self.g) > 1 and self.g.degree(name) == 0:
                raise RecipeError(f"stages.{i}.verifies: stage {name!r} verifies nothing and nothing verifies it; "
                                  f"set verifies to one of: {', '.join(n for n in self.g.nodes if n != name)}")
        order = [self.node(n)["index"] for n in self.stages()]
        if len(self.g) > 1 and not nx.is_weakly_connected(self.g):
            raise RecipeError("stages: the 'verifies' edges must link all stages into one chain")
        if order != sorted(order):
            raise RecipeError("stages: list the stages smallest model first, each verifying the one before it")

    def describe(self, keys: tuple[str, ...] | None = None) -> str:
        """Stages, edges and annotations (all of them, or only `keys`)."""
        lines = []
        for name in self.stages():
            attrs = self.node(name)
            extra = {k: v for k, v in attrs.items()
                     if k not in ("spec", "model", "index") and (keys is None or k in keys)}
            lines.append(f"  [{attrs['index']}] {name} (model {attrs['spec'].model}: {attrs['model'].path})")
            lines.extend(f"        {k} = {_short(v)}" for k, v in extra.items())
            for succ in self.g.successors(name):
                lines.append(f"      --verifies--> {succ}")
        return "\n".join(lines)

    def to_dot(self) -> str:
        out = [f'digraph "{self.recipe.name}" {{', "  rankdir=LR;"]
        for name in self.stages():
            attrs = self.node(name)
            label = "\\n".join([name, f"model: {attrs['spec'].model}"] +
                               [f"{k}: {_short(attrs[k])}" for k in ("device", "tree", "rule") if k in attrs])
            out.append(f'  "{name}" [shape=box, label="{label}"];')
        out += [f'  "{u}" -> "{v}" [label="verifies"];' for u, v in self.g.edges]
        return "\n".join(out + ["}"])


def _short(value) -> str:
    """`value` on one line of at most 100 characters; a checkpoint's config as its architecture and size."""
    if isinstance(value, PretrainedConfig):
        value = (f"{type(value).__name__} ({value.architectures[0]}: {value.num_hidden_layers} layers, hidden "
                 f"{value.hidden_size}, vocab {value.vocab_size})")
    text = " ".join(str(value).split()).replace('"', "'")
    return text if len(text) <= 100 else text[:97] + "..."
