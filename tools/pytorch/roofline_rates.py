#!/usr/bin/env python3
"""The two rates of `memplan plan --roofline FLOPS,BYTES`, measured in PyTorch on this
machine (dev-time tool, not needed to build memplan).

Usage:
    python tools/pytorch/roofline_rates.py [--threads N]

FLOPS: the FLOP rate of fp32 convolutions the size of ResNet-50's at batch 8 (a 3x3
64->64 and a 1x1 256->64 convolution on 56x56, a 3x3 256->256 on 14x14; multiply-add =
2), the kind of op whose rerun is compute-bound. BYTES: the bytes per second that
elementwise kernels move (relu, add, addcmul on 25.7 MB tensors; inputs read plus
output written), the kind whose rerun is one pass over memory. Each is the median of
20 runs after a warm-up. Prints `FLOPS,BYTES` as --roofline takes them, e.g. 123.3G,27.5G.
"""

from __future__ import annotations

import argparse
import statistics
import time


def median_seconds(f, runs=20):
    f()
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        f()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main():
    import torch

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2, help="torch threads (default 2, as the other tools)")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    flops = seconds = 0.0
    with torch.no_grad():
        for n, cin, cout, hw, k in [(8, 64, 64, 56, 3), (8, 256, 64, 56, 1), (8, 256, 256, 14, 3)]:
            x = torch.randn(n, cin, hw, hw)
            w = torch.randn(cout, cin, k, k)
            seconds += median_seconds(lambda: torch.nn.functional.conv2d(x, w, padding=k // 2))
            flops += 2.0 * n * cout * hw * hw * cin * k * k
        moved = spent = 0.0
        x = torch.randn(8, 256, 56, 56)
        y = torch.randn(8, 256, 56, 56)
        a_ = torch.randn(1, 256, 1, 1)
        b_ = torch.randn(1, 256, 1, 1)
        size = x.numel() * x.element_size()
        for f, traffic in [(lambda: torch.relu(x), 2), (lambda: torch.add(x, y), 3),
                           (lambda: torch.addcmul(b_, x, a_), 2)]:
            spent += median_seconds(f)
            moved += traffic * size
    f_rate, b_rate = flops / seconds, moved / spent
    print("convolutions: %.1f GFLOP/s; elementwise: %.1f GB/s" % (f_rate / 1e9, b_rate / 1e9))
    print("--roofline %.4gG,%.4gG" % (f_rate / 1e9, b_rate / 1e9))


if __name__ == "__main__":
    main()
