"""The consolidation quality experiment on the tiny world (the paper's Figure 5, scaled down).

    python recipes/consolidation.py [--out DIR]

Fully fine-tunes one variant of the tiny base per task (cached under the world's variants/), consolidates the
first 2, 3 and 4 of them, and compares each variant's held-out loss and exact match as its own model, under
the consolidated expert map, and as the weight average. Same as `esftctl bench consolidate`.
"""

from __future__ import annotations

import subprocess
import sys

if __name__ == "__main__":
    sys.exit(subprocess.call([sys.executable, "-m", "esftctl.cli", "bench", "consolidate", *sys.argv[1:]]))
