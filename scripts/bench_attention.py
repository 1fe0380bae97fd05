"""The step attention (specgraph/kernels/attention/triton.py) on a GPU at the shapes the engine gives it, against
PyTorch's fused attention (scaled_dot_product_attention: FlashAttention on these GPUs) where one applies: prompt
chunks (R fresh prompts of P tokens in one forward, laid out as `Runner._prompt_chunks` lays them: each row's
region as wide as the chunk's bucket) and decode steps (R requests of one token over a context of C slots), at the
head layouts of the Llama-3.2-1B and Llama-3-8B shapes, for each row-block size of `--block-m`. Microseconds a
call (one layer), over CUDA-graph replays; each variant first checked against the reference. Run from the
repository root after scripts/gpu_setup.sh: `python3 scripts/bench_attention.py [--json OUT.json]`."""
import argparse
import json

import torch
import torch.nn.functional as F

import specgraph.kernels.attention.triton as step
from specgraph.bench.timing import graph_time_us
from specgraph.kernels.attention import attention_reference
from specgraph.layout import Layout

HEADS = {"llama-3.2-1b": (32, 8, 64), "llama-3-8b": (32, 8, 128)}  # query heads, KV heads, head dim
BLOCK, CAPACITY = 64, 4096  # the engine's block size and a stage's virtual slots (the prompt forwards' width)


def prompt_layout(prompts: int, tokens: int, bucket: int, device) -> Layout:
    """`prompts` fresh prompts of `tokens` tokens, each a region of `bucket` offsets (causal)."""
    per_row = CAPACITY // BLOCK
    table = (1 + torch.randperm(prompts * per_row)).view(prompts, per_row)
    causal = torch.ones(tokens, bucket, dtype=torch.bool).tril()
    visible = causal.repeat(prompts, 1)  # [R P, bucket]
    offsets = torch.arange(tokens).repeat(prompts)
    layout = Layout.build(table, BLOCK, torch.arange(prompts), torch.zeros(prompts, dtype=torch.long),
                          torch.full((prompts,), tokens), offsets, visible, offsets.clone(), CAPACITY, False)
    return layout.to(device)


def decode_layout(requests: int, context: int, device) -> Layout:
    """`requests` one-token steps, each over `context` committed slots."""
    per_row = -(-(context + 1) // BLOCK)
    table = (1 + torch.randperm(requests * per_row)).view(requests, per_row)
    layout = Layout.build(table, BLOCK, torch.arange(requests), torch.full((requests,), context),
                          torch.ones(requests, dtype=torch.long), torch.zeros(requests, dtype=torch.long),
                          torch.ones(requests, 1, dtype=torch.bool), torch.full((requests,), context), per_row * BLOCK,
                          False)
    return layout.to(device)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--block-m", default="32,64,128")
    parser.add_argument("--json", help="also write the table here")
    args = parser.parse_args()
    device, dtype = torch.device("cuda"), torch.bfloat16
    print(f"{torch.cuda.get_device_name()}; microseconds a layer's call")
    print(f"{'shape':14s} {'case':28s} " + " ".join(f"{'block ' + b:>10s}" for b in args.block_m.split(","))
          + f" {'sdpa':>8s}")
    rows = []
    for shape, (h, h_kv, d) in HEADS.items():
        cases = [(f"prompts {r}x{p} (bucket {b})", prompt_layout(r, p, b, device), (r, p))
                 for r, p, b in ((2, 256, 512), (8, 256, 2048), (1, 512, 512))]
        cases += [(f"decode {r} x context {c}", decode_layout(r, c, device), None) for r, c in ((1, 512), (32, 512),
                                                                                              (64, 512))]
        for name, layout, prompts in cases:
            slots = int(layout.table.max() + 1) * BLOCK
            q = torch.randn(1, h, layout.tokens, d, device=device, dtype=dtype)
            k, v = (torch.randn(1, h_kv, slots, d, device=device, dtype=dtype) for _ in range(2))
            inputs = (q, k, v, *layout.attention_inputs(h))
            expected = attention_reference(*inputs).float()
            times = []
            for block_m in args.block_m.split(","):
                step.MAX_BLOCK_M = int(block_m)
                error = (step.attention(*inputs).float() - expected).abs().max().item()
                assert error < 2e-2, (shape, name, block_m, error)
                times.append(graph_time_us(lambda: step.attention(*inputs)))
            sdpa = None
            if prompts:  # each prompt's causal attention alone, its K and V contiguous (a lower bound on the work)
                r, p = prompts
                qs = q.view(1, h, r, p, d).transpose(1, 2).reshape(r, h, p, d)
                ks, vs = (torch.randn(r, h_kv, p, d, device=device, dtype=dtype) for _ in range(2))
                sdpa = graph_time_us(lambda: F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True))
            rows.append({"shape": shape, "case": name, "us_by_block_m": dict(zip(args.block_m.split(","), times)),
                         "sdpa_us": sdpa})
            print(f"{shape:14s} {name:28s} " + " ".join(f"{t:10.1f}" for t in times)
                  + (f" {sdpa:8.1f}" if sdpa else ""), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
