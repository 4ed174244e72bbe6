"""Suite-wide settings. Triton kernels run on CPU only through the interpreter,
and the variable must be set before triton is first imported."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
