"""Where method="auto" should switch from the sort solver to the bracket solver (CPU).

Times lapsum_threshold with each method on Gaussian rows (k = n/16, t = 1) for a batch
of rows and for a single row, and prints the ratio; kAutoSortMaxNCpu in
csrc/common/plan.h is set from this.
"""
import torch

import fastlapsum
from timing import median_ms

torch.manual_seed(0)
print(f"threads {torch.get_num_threads()}")
print(f"{'n':>8} {'rows':>5} {'sort ms':>9} {'bracket ms':>11} {'sort/bracket':>12}")
for n in (64, 128, 256, 384, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 262144):
    for rows in (1, 64):
        x = torch.randn(rows, n)
        ms = {m: median_ms(lambda: fastlapsum.lapsum_threshold(x, n / 16, 1.0, method=m), reps=7)
              for m in ("sort", "bracket")}
        print(f"{n:>8} {rows:>5} {ms['sort']:>9.3f} {ms['bracket']:>11.3f} {ms['sort'] / ms['bracket']:>12.2f}")
