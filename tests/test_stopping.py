"""What stops a request, exactly under speculation: min_tokens (its stop tokens kept from being
drawn until it has so many new tokens, in the drafter's proposals and the target's verdicts),
stop_token_ids (more tokens that end it) and ignore_eos (its end-of-sequence tokens do not),
checked against transformers on the embedded pair: `generate(min_new_tokens=...)`, and a greedy
loop of its forward that never stops. Several requests of different settings decode together."""

import pytest
import torch
import transformers
from conftest import EMBEDDED, REPO
from helpers import chain_logits, decode_requests, law, total_variation, two_stage, two_token_law

from specgraph.models.loader import load_model
from specgraph.program import Program
from specgraph.recipe import Recipe, SamplingSpec
from specgraph.sampling import SamplingRows, probs_from_logits

TARGET = EMBEDDED / "target"
EOS, NEWLINE = 0, 199  # the fixture tokenizer's end of sequence, and "\n"
ENDINGS = ["if __name__ == '__main__':\n    main()\n", 'if __name__ == "__main__":\n    unittest.main()\n',
           "__all__ = [\"main\"]\n"]  # files that end here: the target's next token is EOS
NEW = 24
# (prompt, min_tokens, the stop tokens besides EOS) of the requests decoded together
REQUESTS = [(0, 0, ()), (0, 4, ()), (1, 12, ()), (2, 3, (NEWLINE,)), (1, 1, (NEWLINE,)), (2, 0, (NEWLINE,))]
RECIPES = ["autoregressive", "tree", "dynamic", "eagle3"]  # (a chain grows as a static tree does)


@pytest.fixture(scope="module")
def hf():
    return transformers.AutoModelForCausalLM.from_pretrained(TARGET, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def prompts():
    tokenizer = transformers.AutoTokenizer.from_pretrained(TARGET)
    return [tokenizer(text, add_special_tokens=False)["input_ids"] for text in ENDINGS]


def outputs_together(engine, requests: list[dict]) -> list[list[int]]:
    """Each request's output (NEW tokens unless it says), all of them decoded together."""
    return [h.generation.output_ids for h in decode_requests(engine, [{"new": NEW} | r for r in requests])]


@pytest.mark.parametrize("recipe", RECIPES)
def test_min_tokens_and_stop_tokens_decode_as_transformers_generate(recipe, hf, prompts):
    with torch.inference_mode():
        expected = [hf.generate(torch.tensor([prompts[p]]), max_new_tokens=NEW, min_new_tokens=m, do_sample=False,
                                eos_token_id=[EOS, *stops], pad_token_id=EOS)[0, len(prompts[p]):].tolist()
                    for p, m, stops in REQUESTS]
    assert expected[0] == [EOS] and len(expected[1]) > 4 and expected[1][:4] != [EOS] * 4  # min_tokens changes it
    assert any(len(e) < NEW and e[-1] == NEWLINE for e in expected[3:])  # a stop token past min_tokens ends one
    program = Program.from_recipe(Recipe.from_yaml(REPO / "recipes" / f"{recipe}.yaml", speculating(recipe)))
    got = outputs_together(program.executor, [{"prompt": prompts[p], "min_tokens": m, "stops": (EOS, *stops)}
                                              for p, m, stops in REQUESTS])
    assert got == expected
    modes = program.executor.totals.modes
    assert recipe == "autoregressive" or (modes and "ar" not in modes)  # every step drafted


def speculating(recipe: str) -> list[str]:
    """A recipe's overrides: four requests at once, every step speculating where it has a drafter
    (on a CPU, its adaptive policy may choose plain steps throughout)."""
    return ["serving.max_batch=4"] + ([] if recipe == "autoregressive" else ["serving.speculation=always"])


def test_ignore_eos_decodes_past_the_end_of_sequence(hf, prompts):
    """No stop tokens: max_new_tokens tokens, the end-of-sequence token among them, as a greedy loop
    of transformers' forward that never stops gives them."""
    ids = list(prompts[0])
    with torch.inference_mode():
        for _ in range(NEW):
            ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
    expected = ids[len(prompts[0]):]
    assert expected[0] == EOS
    program = Program.from_recipe(Recipe.from_yaml(REPO / "recipes" / "tree.yaml", speculating("tree")))
    assert outputs_together(program.executor, [{"prompt": prompts[0], "stops": ()}]) == [expected]
    assert set(program.executor.totals.modes) == {"depth 4"}  # every step drafted the whole tree


def masked_law(ids: list[int], sampling: dict) -> dict[tuple[int, int], float]:
    """The exact law of the first two sampled tokens after `ids` with EOS never drawn (through our
    module, as helpers.two_token_law)."""
    spec, model = SamplingRows.of([SamplingSpec(**sampling)], "cpu"), load_model(TARGET, torch.float32, "cpu")

    def probs(prefix):
        logits = chain_logits(model, torch.tensor(prefix))[-1:].clone()
        logits[:, EOS] = float("-inf")
        return probs_from_logits(logits, spec)[0]

    first, law = probs(ids), {}
    for a in first.nonzero().flatten().tolist():
        second = probs(ids + [a])
        for b in second.nonzero().flatten().tolist():
            law[(a, b)] = float(first[a] * second[b])
    return law


def test_sampled_min_tokens_follow_the_target_law_without_eos(prompts):
    """Two sampled tokens after a file's end, min_tokens 2, the drafter drawing its children, 1200
    seeds (decoded 16 at a time: each request's draws are its own stream's): their law is the
    target's with EOS never drawn (unmasked, EOS would come first a third of the time or more)."""
    sampling = {"temperature": 1.0, "top_k": 3}
    program = Program.from_recipe(two_stage(TARGET, EMBEDDED / "draft", {"shape": "static", "branching": [2, 1]},
                                            sampling=sampling, max_new_tokens=2, serving={"max_batch": 16}))
    engine, draws = program.executor, 1200
    outputs = outputs_together(engine, [{"prompt": prompts[0], "new": 2, "min_tokens": 2,
                                         "sampling": engine.sampling.model_copy(update={"seed": seed})}
                                        for seed in range(draws)])
    observed = law(outputs)
    exact = masked_law(prompts[0], sampling)
    assert sum(p for (first, _), p in two_token_law(TARGET, prompts[0], sampling).items() if first == EOS) > 0.3
    assert not any(EOS in pair for pair in observed) and set(observed) <= set(exact)
    assert total_variation(observed, exact) < 0.06  # (the expected distance at 1200 draws is about 0.03)
