"""A model's forward on the device around the arena's recorded decode step (issue 52, item 2):
weights.py (the weights' device formats), specs.py (the fwd_* kernels' dispatch arithmetic),
model.py (DeviceForward), split.py (SplitForward: over an arena split by layers or by KV heads)."""
from .model import DeviceForward
from .split import SplitForward
from .weights import ModelWeights, from_gguf, random_weights

__all__ = ["DeviceForward", "ModelWeights", "SplitForward", "from_gguf", "random_weights"]
