"""Layers, losses and the Sequential model."""

from .layers import GELU, LayerNorm, Linear, ReLU, Tanh, make_layer
from .loss import CrossEntropyLoss, MSELoss, make_loss
from .model import Sequential

__all__ = ["Linear", "ReLU", "GELU", "Tanh", "LayerNorm", "make_layer", "CrossEntropyLoss", "MSELoss", "make_loss",
           "Sequential"]
