"""A model's forward on the device around the arena's recorded decode step (issue 52, item 2):
weights.py (the weights' device formats), specs.py (the fwd_* kernels' dispatch arithmetic),
model.py (DeviceForward)."""
from .model import DeviceForward
from .weights import ModelWeights, from_gguf, random_weights

__all__ = ["DeviceForward", "ModelWeights", "from_gguf", "random_weights"]
