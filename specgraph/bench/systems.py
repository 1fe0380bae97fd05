"""The systems a benchmark compares: specgraph executors and transformers' generate.

Each system decodes one prompt at a time and returns a `Run` with wall-clock times measured
around the call (with a device synchronisation on GPUs).
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field

import torch
from transformers import AutoModelForCausalLM, PretrainedConfig

from specgraph.models.hybrid import FULL, HybridModel, to_hf_norms
from specgraph.models.llama import LlamaModel, hf_state
from specgraph.runtime.executor import Executor


@dataclass
class Run:
    output_ids: list[int]
    seconds: float  # prompt in, last token out
    first_token_seconds: float  # prompt in, first step's tokens out (prefill included)
    first_step_tokens: int = 1
    accepted_lengths: list[int] = field(default_factory=list)  # empty where the system does not report steps
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    stats: dict[str, float] = field(default_factory=dict)  # an executor's own measurements (Generation.stats)

    @property
    def decode_tokens(self) -> int:
        return len(self.output_ids) - self.first_step_tokens

    @property
    def decode_seconds(self) -> float:
        return self.seconds - self.first_token_seconds


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class SpecgraphSystem:
    def __init__(self, name: str, executor: Executor, description: str, seed: int):
        """`seed`: every request's (the recipe's sampling.seed)."""
        self.name, self.executor, self.description, self.seed = name, executor, description, seed
        self.device = executor.device

    def run(self, ids: list[int], max_new_tokens: int) -> Run:
        _sync(self.device)
        gen = self.executor.generate(ids, max_new_tokens, self.seed)
        _sync(self.device)
        first = min(gen.accepted_lengths[0], len(gen.output_ids)) if gen.accepted_lengths else 0
        return Run(gen.output_ids, gen.seconds, gen.first_token_seconds, first, gen.accepted_lengths,
                   gen.draft_seconds, gen.verify_seconds, gen.stats)


def hf_mirror(model: LlamaModel | HybridModel, config: PretrainedConfig) -> torch.nn.Module:
    """A transformers model of `model`'s shape that shares its weight tensors (a hybrid's norm
    weights are converted back to the checkpoint's zero-centred form, as copies)."""
    s, hybrid = model.shape, isinstance(model, HybridModel)
    cfg = copy.deepcopy(config)
    cfg.update(dict(vocab_size=s.vocab_size, hidden_size=s.hidden_size, intermediate_size=s.intermediate_size,
                    num_hidden_layers=s.num_layers, num_attention_heads=s.num_heads, num_key_value_heads=s.num_kv_heads,
                    head_dim=s.head_dim, rms_norm_eps=model.norm.eps,
                    tie_word_embeddings=model.lm_head.weight is model.embed_tokens.weight))
    if hybrid:
        cfg.update(dict(layer_types=list(s.layer_types), linear_num_key_heads=s.linear_key_heads,
                        linear_num_value_heads=s.linear_value_heads, linear_key_head_dim=s.linear_key_dim,
                        linear_value_head_dim=s.linear_value_dim))
    device, dtype = model.embed_tokens.weight.device, model.embed_tokens.weight.dtype
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    ours = to_hf_norms(hf_state(model)) if hybrid else hf_state(model)
    state = {(k if k == "lm_head.weight" else f"model.{k}"): v for k, v in ours.items() if k != "inv_freq"}
    hf.load_state_dict(state, assign=True, strict=False)
    hf.model.rotary_emb = type(hf.model.rotary_emb)(cfg).to(device)
    if cfg.tie_word_embeddings:
        hf.lm_head.weight = hf.model.embed_tokens.weight
    if hybrid:  # the config has one eps; per-head norms keep the model's own (widening rescales only hidden-size ones)
        for mine, theirs in zip(model.layers, hf.model.layers):
            if mine.kind == FULL:
                theirs.self_attn.q_norm.eps = theirs.self_attn.k_norm.eps = mine.self_attn.q_norm.eps
            else:
                theirs.linear_attn.norm.variance_epsilon = mine.linear_attn.norm.eps
    leftover = [n for n, t in [*hf.named_parameters(), *hf.named_buffers()] if t.is_meta]
    if leftover:
        raise RuntimeError(f"hf_mirror left {leftover[0]} unset")
    return hf.eval()


class HFSystem:
    """transformers `generate`, greedy; with `assistant` it is assisted generation (batch 1 only)."""

    def __init__(self, name: str, hf: torch.nn.Module, eos_ids: tuple[int, ...], served_vocab: int,
                 assistant: torch.nn.Module | None = None, static_cache: bool = False):
        self.name, self.hf, self.assistant = name, hf, assistant
        self.device = hf.device
        self.kwargs = dict(do_sample=False, eos_token_id=list(eos_ids), pad_token_id=eos_ids[0] if eos_ids else 0)
        if served_vocab < hf.config.vocab_size:  # a widened model: never emit the zero-padded vocabulary
            self.kwargs["suppress_tokens"] = list(range(served_vocab, hf.config.vocab_size))
        if assistant is not None:
            self.kwargs["assistant_model"] = assistant
        if static_cache:
            self.kwargs["cache_implementation"] = "static"
        compiled = static_cache and self.device.type == "cuda"
        self.description = ("assisted generation, dynamic cache, eager" if assistant is not None else
                            "static cache + torch.compile (transformers' auto-compile)" if compiled else
                            "static cache, eager" if static_cache else "dynamic cache, eager")

    @torch.inference_mode()
    def _generate(self, ids: list[int], max_new_tokens: int) -> tuple[list[int], float]:
        inputs = torch.tensor([ids], device=self.device)
        _sync(self.device)
        start = time.perf_counter()
        out = self.hf.generate(inputs, attention_mask=torch.ones_like(inputs), max_new_tokens=max_new_tokens,
                               min_new_tokens=0, **self.kwargs)
        _sync(self.device)
        return out[0, len(ids):].tolist(), time.perf_counter() - start

    def run(self, ids: list[int], max_new_tokens: int) -> Run:
        _, first = self._generate(ids, 1)
        output, seconds = self._generate(ids, max_new_tokens)
        return Run(output, seconds, first, min(1, len(output)))
