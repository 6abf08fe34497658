import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# One intra-op thread: the tiny models gain nothing from more, and single-threaded reductions
# make repeated runs bit-identical (the resume and determinism tests compare exactly).
torch.set_num_threads(1)
