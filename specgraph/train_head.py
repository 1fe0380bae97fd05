"""`specgraph train-draft`: train an EAGLE-3 head (models/eagle.py) for a Llama-family target.

Each step draws `batch` windows of `seq_len` tokens from the data (its texts tokenized by the
target's tokenizer, joined end to end), runs the target over them once, through our own model, for
the features a head drafts from (the inputs of its three layers: what verification hands over at
inference) and its next-token distributions, and trains the head with EAGLE-3's training-time
test: `ttt` rounds, round j feeding at each position p the head's own output of round j - 1
(round 0: the fused features) with token p + 1 + j, attending to the round-0 pairs up to p and to
its own earlier rounds at p — what a draft node at depth j sees at inference (head.py) — and
predicting token p + 2 + j. Its label is the target's own distribution of that token (softmax of
the target's logits over the draft vocabulary), not the data's token, as EAGLE-3 trains: the head
must predict what the target would say; positions where the target's choice lies outside the draft
vocabulary are left out (their share is reported as the vocabulary's coverage). Round j's loss
weighs 0.8^j. The draft vocabulary is the data's most frequent tokens. The learning rate warms up
linearly (over min(100, steps / 10) steps), then follows a cosine to a tenth of --lr by
`decay_steps` where one is given, else stays.

OUT gets the published layout (config.json naming LlamaForCausalLMEagle3; model.safetensors
without embed_tokens: the target's), and OUT/training/ what a later run resumes from:
state.safetensors (fp32 weights and AdamW moments) and state.json (the step and the settings).
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save
from torch import nn

from specgraph.errors import CheckpointError, SpecgraphError
from specgraph.files import read_text, write_output
from specgraph.models import eagle
from specgraph.models.eagle import Eagle3Head
from specgraph.models.llama import hf_state
from specgraph.models.loader import head_shape, is_head, is_hybrid, load_model, read_config, rope_tables
from specgraph.runtime.stage import Stage
from specgraph.text import Tokenizer

DECAY = 0.8  # round j of the training-time test weighs DECAY ** j (EAGLE-3)
DRAFT_VOCAB = 32000  # a head's vocabulary where none is given (at most the target's)


@dataclass(frozen=True)
class TrainSpec:
    target: Path
    data: Path
    out: Path
    steps: int = 1000
    layers: tuple[int, ...] | None = None  # None: eagle.default_features
    lr: float = 1e-3
    batch: int = 8
    seq_len: int = 256
    ttt: int = 5  # rounds of the training-time test (at least the deepest tree's depth)
    draft_vocab: int | None = None  # at most the target's vocabulary (None: DRAFT_VOCAB or the target's, fewer)
    intermediate_size: int | None = None  # the head's MLP width (None: the target's)
    dtype: str = "float32"  # of the weights written to OUT/model.safetensors
    seed: int = 0
    decay_steps: int | None = None  # the cosine's length (None: a constant rate after the warm-up)
    init: Path | None = None  # a head to start from (its vocabulary, layers and width): None, a random one
    save_every: int = 100
    device: str = "cpu"

    def settings(self) -> dict:
        """What a resumed run must share with the one it resumes (all but the step count and where saves go)."""
        kept = {k: v for k, v in asdict(self).items() if k not in ("steps", "out", "save_every", "device", "dtype")}
        kept |= {"target": str(self.target), "data": hashlib.sha256(self.data.read_bytes()).hexdigest(),
                 "layers": list(self.layers) if self.layers else None,
                 "init": hashlib.sha256((self.init / "model.safetensors").read_bytes()).hexdigest() if self.init else None}
        return kept


def read_texts(path: Path) -> list[str]:
    """The `text` (or `prompt`) of every JSON line of `path`."""
    texts = []
    for n, line in enumerate(read_text(path, "--data").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise SpecgraphError(f"--data: {path} line {n} is not JSON ({exc.msg})") from None
        text = row.get("text", row.get("prompt")) if isinstance(row, dict) else None
        if not isinstance(text, str):
            raise SpecgraphError(f"--data: {path} line {n} needs a 'text' (or 'prompt') string")
        texts.append(text)
    if not texts:
        raise SpecgraphError(f"--data: {path} holds no texts")
    return texts


def check_target(path: Path, draft_vocab: int | None) -> int:
    """A target train-draft can train a head for -> the head's vocabulary (`draft_vocab`, at most the target's)."""
    config = read_config(path)
    if is_head(config) or is_hybrid(config):
        raise CheckpointError(f"{path}: train-draft trains heads for Llama-family targets, not "
                              f"{config.architectures[0]}")
    if draft_vocab is None:
        return min(DRAFT_VOCAB, config.vocab_size)
    if draft_vocab > config.vocab_size:
        raise SpecgraphError(f"--draft-vocab: {draft_vocab} is more than the target's vocabulary of "
                             f"{config.vocab_size}; give at most {config.vocab_size}")
    return draft_vocab


def head_config(target: Path, spec: TrainSpec, layers: tuple[int, ...], draft_vocab: int) -> dict:
    """The target's config.json as a head's: one layer, the draft vocabulary, the layers it reads."""
    config = json.loads((target / "config.json").read_text())
    config |= {"architectures": [eagle.ARCHITECTURE], "num_hidden_layers": 1, "draft_vocab_size": draft_vocab,
               "target_hidden_size": config["hidden_size"], "tie_word_embeddings": False,
               "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(layers)}}
    if spec.intermediate_size is not None:
        config["intermediate_size"] = spec.intermediate_size
    return config


def _rms(x: torch.Tensor, norm: nn.Module) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.eps) * norm.weight


def _rotate(x: torch.Tensor, head: Eagle3Head, positions: torch.Tensor) -> torch.Tensor:
    """x [B, heads, n, K] rotated at `positions` [n] as the stem's tables do."""
    freqs = positions[:, None].float() * head.inv_freq  # [n, K/2]
    emb = torch.cat([freqs, freqs], -1)
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], -1)
    return x * emb.cos() * head.rope_scale + rotated * emb.sin() * head.rope_scale


def rounds(head: Eagle3Head, features: torch.Tensor, tokens: torch.Tensor, ttt: int) -> list[torch.Tensor]:
    """The training-time test (module doc) over windows tokens [B, S] with the target's features
    [B, S, C H] -> each round's draft logits [B, S - 1, Vd] (position p: the pair of features p)."""
    b, s = tokens.shape
    n, device = s - 1, tokens.device
    layer = head.layers[0]
    attn, mlp = layer.self_attn, layer.mlp
    h, kv, d = attn.num_heads, attn.num_kv_heads, attn.head_dim
    hidden = head.fuse(features[:, :n])  # [B, n, H]
    causal = torch.ones(n, n, dtype=torch.bool, device=device).tril()
    keys, values, out = [], [], []
    for j in range(ttt):
        ahead = F.pad(tokens[:, 1 + j :], (0, j))  # [B, n]: token p + 1 + j (past the window: padding)
        x = torch.cat([_rms(head.embed_tokens(ahead), layer.input_layernorm), _rms(hidden, layer.hidden_norm)], -1)
        q, k, v = F.linear(x, attn.qkv_proj.weight, attn.qkv_proj.bias).split([h * d, kv * d, kv * d], -1)
        positions = torch.arange(n, device=device) + j
        q = _rotate(q.view(b, n, h, d).transpose(1, 2), head, positions)  # [B, h, n, K]
        keys.append(_rotate(k.view(b, n, kv, d).transpose(1, 2), head, positions).repeat_interleave(h // kv, 1))
        values.append(v.view(b, n, kv, d).transpose(1, 2).repeat_interleave(h // kv, 1))
        scores = [(q @ keys[0].transpose(-1, -2)).masked_fill(~causal, float("-inf"))]  # [B, h, n, n]: round-0 pairs
        scores += [(q * key).sum(-1, keepdim=True) for key in keys[1:]]  # [B, h, n, 1]: its own earlier rounds
        weights = (torch.cat(scores, -1) / math.sqrt(d)).softmax(-1)
        attended = weights[..., :n] @ values[0]
        for i, value in enumerate(values[1:]):
            attended = attended + weights[..., n + i : n + i + 1] * value
        attended = F.linear(attended.transpose(1, 2).reshape(b, n, h * d), attn.o_proj.weight, attn.o_proj.bias)
        residual = hidden + attended
        gate, up = F.linear(_rms(residual, layer.post_attention_layernorm), mlp.gate_up_proj.weight,
                            mlp.gate_up_proj.bias).chunk(2, -1)
        hidden = residual + F.linear(F.silu(gate) * up, mlp.down_proj.weight, mlp.down_proj.bias)  # [B, n, H]
        out.append(F.linear(_rms(hidden, head.norm), head.lm_head.weight))
    return out


def _start(init: Path, target: Path, device: torch.device) -> Eagle3Head:
    """--init: a head for `target` to start from."""
    config = read_config(init)
    if not is_head(config):
        raise SpecgraphError(f"--init: {init} is not an EAGLE-3 head ({config.architectures[0]})")
    head = load_model(init, torch.float32, device)
    if head.target_vocab != read_config(target).vocab_size:
        raise SpecgraphError(f"--init: {init} is a head for a vocabulary of {head.target_vocab}, not the target's")
    if head.head.features is None:
        raise SpecgraphError(f"--init: {init} names no target layers (eagle_aux_hidden_state_layer_ids)")
    return head


class Trainer:
    def __init__(self, spec: TrainSpec):
        self.spec, device = spec, torch.device(spec.device)
        draft_vocab = check_target(spec.target, spec.draft_vocab)
        target = load_model(spec.target, torch.float32, device)
        start = _start(spec.init, spec.target, device) if spec.init else None
        layers = start.head.features if start else spec.layers or eagle.default_features(target.shape.num_layers)
        if len(layers) != 3 or not all(0 <= i < target.shape.num_layers for i in layers):
            raise SpecgraphError(f"--layers: three layers of the target's {target.shape.num_layers} (0.."
                                 f"{target.shape.num_layers - 1}) (got {','.join(map(str, layers))})")
        stream = [t for ids in Tokenizer(spec.target).encode_all(read_texts(spec.data)) for t in ids]
        if len(stream) <= spec.seq_len:
            raise SpecgraphError(f"--data: {spec.data} holds {len(stream)} tokens; training windows need more than "
                                 f"{spec.seq_len}")
        self.stream = torch.tensor(stream, device=device)
        self.state_dir = spec.out / "training"
        resumed = self._resumed()
        vocab = target.shape.vocab_size
        ids = resumed["d2t"].to(device) + torch.arange(resumed["d2t"].numel(), device=device) if resumed else (
            start.target_ids() if start else torch.bincount(self.stream, minlength=vocab).argsort(descending=True, stable=True)[:draft_vocab]
            .sort().values)  # [Vd] the target ids the head covers
        spec.out.mkdir(parents=True, exist_ok=True)
        config = head_config(spec.target, spec, layers, ids.numel())
        if start:
            config["intermediate_size"] = start.shape.intermediate_size
        write_output(spec.out / "config.json", json.dumps(config, indent=2))
        config = read_config(spec.out)
        with torch.device(device):
            self.head = Eagle3Head(head_shape(config, spec.out))
        self.head.inv_freq, self.head.rope_scale = rope_tables(config, self.head.shape.head_dim, device)
        self.head.d2t.copy_(ids - torch.arange(ids.numel(), device=device))
        self.head.t2d.zero_().index_fill_(0, ids, True)
        self.draft_ids = torch.full((vocab,), -100, dtype=torch.long, device=device).index_copy_(
            0, ids, torch.arange(ids.numel(), device=device))  # [V] target id -> draft id (-100: none)
        self.head.tie_embedding(target.embed_tokens.weight)  # (shared and frozen, as at inference)
        self.params = {n: p for n, p in self.head.named_parameters() if not n.startswith("embed_tokens.")}
        self.optimizer = torch.optim.AdamW(self.params.values(), lr=spec.lr, betas=(0.9, 0.95), weight_decay=0.0)
        self.step = 0
        if resumed:
            self._resume(resumed)
        elif start:
            with torch.no_grad():
                for name, param in self.params.items():
                    param.copy_(start.state_dict()[name])
        else:
            self._initialise()
        self.target = Stage("target", target, spec.seq_len, device, requests=spec.batch, capture=tuple(layers))

    def _resumed(self) -> dict | None:
        """OUT/training's state where a run left one (refused if it trained with other settings)."""
        if not (self.state_dir / "state.json").is_file():
            return None
        meta = json.loads((self.state_dir / "state.json").read_text())
        if meta["settings"] != self.spec.settings():
            changed = sorted(k for k in self.spec.settings() if meta["settings"].get(k) != self.spec.settings()[k])
            raise SpecgraphError(f"-o: {self.spec.out} holds a run with other settings ({', '.join(changed)}); "
                                 "resume it with the same ones, or give another -o")
        return {"meta": meta, **load_file(self.state_dir / "state.safetensors", device=self.spec.device)}

    def _initialise(self) -> None:
        generator = torch.Generator(device=self.spec.device).manual_seed(self.spec.seed)
        for name, param in self.params.items():
            with torch.no_grad():
                if name.endswith("norm.weight"):
                    param.fill_(1.0)
                elif name.endswith(".bias"):
                    param.zero_()
                else:
                    param.normal_(0.0, 0.02, generator=generator)

    def _resume(self, state: dict) -> None:
        self.step = state["meta"]["step"]
        with torch.no_grad():
            for name, param in self.params.items():
                param.copy_(state[f"param.{name}"])
                self.optimizer.state[param] = {"step": torch.tensor(float(self.step)),
                                               "exp_avg": state[f"exp_avg.{name}"].clone(),
                                               "exp_avg_sq": state[f"exp_avg_sq.{name}"].clone()}

    def save(self) -> None:
        """The published layout in OUT, and the state to resume from in OUT/training/."""
        dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[self.spec.dtype]
        published = eagle.to_published(hf_state(self.head))
        _write_tensors(self.spec.out / "model.safetensors", {n: t.to(dtype) if t.is_floating_point() else t
                                                             for n, t in published.items() if n != "embed_tokens.weight"})
        self.state_dir.mkdir(exist_ok=True)
        state = {"d2t": self.head.d2t}
        for name, param in self.params.items():
            moments = self.optimizer.state.get(param, {})
            state[f"param.{name}"] = param.detach()
            for kind in ("exp_avg", "exp_avg_sq"):
                state[f"{kind}.{name}"] = moments.get(kind, torch.zeros_like(param))
        _write_tensors(self.state_dir / "state.safetensors", state)
        meta = {"step": self.step, "settings": self.spec.settings()}
        write_output(self.state_dir / "state.json", json.dumps(meta, indent=2))

    def windows(self) -> torch.Tensor:
        """This step's windows [B, S] (the same for a step whether or not the run was resumed)."""
        generator = torch.Generator(device=self.stream.device).manual_seed(self.spec.seed * 1_000_003 + self.step)
        starts = torch.randint(0, self.stream.numel() - self.spec.seq_len, (self.spec.batch,), generator=generator,
                               device=self.stream.device)
        return self.stream[starts[:, None] + torch.arange(self.spec.seq_len, device=self.stream.device)]

    @torch.no_grad()
    def features(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The target's features and logits at every token of the windows tokens [B, S] -> [B, S, C H], [B, S, V]."""
        b, s = tokens.shape
        device = tokens.device
        offsets = torch.arange(s, device=device).expand(b, -1)
        causal = torch.ones(s, s, dtype=torch.bool, device=device).tril().expand(b, -1, -1)
        packed, layout = self.target.pack(tokens, offsets, torch.arange(b, device=device),
                                          torch.zeros(b, dtype=torch.long, device=device), offsets, causal, s)
        logits, features = self.target.forward_features(packed, layout)
        return features.view(b, s, -1), logits.view(b, s, -1)

    def rate(self) -> float:
        """This step's learning rate: the warm-up, then the cosine where `decay_steps` is given."""
        spec = self.spec
        warm = max(1, min(100, spec.steps // 10))
        if self.step < warm or spec.decay_steps is None:
            return spec.lr * min(1.0, (self.step + 1) / warm)
        done = min(1.0, (self.step - warm) / max(1, spec.decay_steps - warm))
        return spec.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * done)))

    def train_step(self) -> tuple[float, float, float]:
        """One optimizer step -> round 0's loss, its top-1 agreement with the target, and the share of
        the target's choices the draft vocabulary covers."""
        spec = self.spec
        tokens = self.windows()
        features, target_logits = self.features(tokens)
        logits = rounds(self.head, features, tokens, spec.ttt)
        ids = self.head.d2t + torch.arange(self.head.d2t.numel(), device=tokens.device)  # [Vd] their target ids
        chosen = self.draft_ids[target_logits.argmax(-1)]  # [B, S]: the target's choice as a draft id (-100: none)
        wanted = target_logits.index_select(-1, ids).softmax(-1)  # [B, S, Vd]
        losses, accuracy = [], 0.0
        for j, round_logits in enumerate(logits):
            n = tokens.shape[1] - 2 - j  # round j at p predicts token p + 2 + j: the target's logits at p + 1 + j
            covered = (chosen[:, 1 + j : 1 + j + n] >= 0).float()
            predicted = round_logits[:, :n].log_softmax(-1)
            loss = -((wanted[:, 1 + j : 1 + j + n] * predicted).sum(-1) * covered).mean()
            losses.append(DECAY ** j * loss)
            if j == 0:
                accuracy = float((predicted.argmax(-1) == chosen[:, 1 : 1 + n]).float().mean())
                coverage = float(covered.mean())
        for group in self.optimizer.param_groups:
            group["lr"] = self.rate()
        self.optimizer.zero_grad(set_to_none=True)
        sum(losses).backward()
        nn.utils.clip_grad_norm_(self.params.values(), 1.0)
        self.optimizer.step()
        self.step += 1
        return float(losses[0].detach()), accuracy, coverage


def _write_tensors(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    """A safetensors file written atomically (files.write_output: an interrupted save leaves the last one whole)."""
    data = save({n: t.contiguous().cpu() for n, t in tensors.items()})
    write_output(path, lambda f: f.write(data))


def train(spec: TrainSpec) -> Path:
    """Train (or resume training) a head as `spec` says, showing progress -> OUT."""
    from tqdm import tqdm

    trainer = Trainer(spec)
    first, began, covered = trainer.step, time.perf_counter(), []
    window = spec.batch * spec.seq_len
    with tqdm(total=spec.steps, initial=min(trainer.step, spec.steps), desc="train-draft", unit="step") as bar:
        while trainer.step < spec.steps:
            loss, accuracy, coverage = trainer.train_step()
            covered.append(coverage)
            bar.update(1)
            rate = (trainer.step - first) * window / (time.perf_counter() - began)
            bar.set_postfix(loss=f"{loss:.3f}", acc=f"{accuracy:.3f}", tok_s=f"{rate:.0f}")
            if trainer.step % spec.save_every == 0 or trainer.step == spec.steps:
                trainer.save()
    if not (spec.out / "model.safetensors").is_file():  # (resumed at or past --steps: nothing trained, all written)
        trainer.save()
    if covered:
        seconds = time.perf_counter() - began
        print(f"trained steps {first + 1}-{trainer.step}: {(trainer.step - first) * window} tokens in {seconds:.0f} s, "
              f"{(trainer.step - first) * window / seconds:.0f} tokens/s; the draft vocabulary ({trainer.head.d2t.numel()} "
              f"ids) covers {100 * sum(covered) / len(covered):.1f}% of the target's next tokens on the data")
    return spec.out
