"""Shared test setup. Tiny models run single-threaded: their ops are too small to gain from threads, and
two cores shared with other work make thread hand-offs the dominant cost."""

import torch

torch.set_num_threads(1)
