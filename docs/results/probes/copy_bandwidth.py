# One-off probe, kept for the record: run 29 in docs/benchmarks.md (python3 docs/results/probes/copy_bandwidth.py on commit
# 66d451d, whose measure_copy_bandwidth timed single copies from the host; the event-timed loop here is how it measures now).
"""Copy bandwidth on one H200: the harness's host-timed best of 6 single 1 GiB copies vs CUDA events over 10 back-to-back copies."""
import time, torch
from specgraph.bench.harness import measure_copy_bandwidth
dev = torch.device("cuda")
nbytes = 1 << 30
src = torch.empty(nbytes // 4, device=dev); dst = torch.empty_like(src)
for _ in range(3): dst.copy_(src)
torch.cuda.synchronize()
host = [measure_copy_bandwidth(dev) / 1e12 for _ in range(5)]
events = []
for _ in range(5):
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(10): dst.copy_(src)
    b.record(); b.synchronize()
    events.append(2 * nbytes * 10 / (a.elapsed_time(b) / 1e3) / 1e12)
print("host-timed best of 6 (TB/s):", ["%.3f" % x for x in host])
print("events, 10 copies (TB/s):   ", ["%.3f" % x for x in events])
