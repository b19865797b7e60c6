"""Re-create hpctrain/datasets/digits.h5 from scikit-learn's copy of the UCI digits (see docs/data.md).

    pip install scikit-learn && python jobs/data/make_digits.py
"""

import os
import sys

import h5py
import numpy as np

try:
    from sklearn.datasets import load_digits
except ImportError:
    sys.exit("make_digits.py needs scikit-learn (its copy of the UCI digits): pip install scikit-learn")

OUT = os.path.join(os.path.dirname(__file__), "..", "..", "hpctrain", "datasets", "digits.h5")

digits = load_digits()
x = (digits.data / 16.0).astype(np.float32)
y = digits.target.astype(np.int64)
perm = np.random.default_rng(0).permutation(len(x))
with h5py.File(OUT, "w") as f:
    f.create_dataset("inputs", data=x[perm])
    f.create_dataset("targets", data=y[perm])
    f.attrs["source"] = "UCI Optical Recognition of Handwritten Digits (8x8), as shipped by scikit-learn load_digits"
    f.attrs["license"] = "CC BY 4.0"
    f.attrs["preprocessing"] = "pixels / 16 -> float32 in [0, 1]; rows permuted with numpy default_rng(0)"
print(f"wrote {os.path.normpath(OUT)}: inputs {x.shape}, targets {y.shape}")
