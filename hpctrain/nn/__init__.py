"""Layers, losses, and the model spec with its pipeline parts."""

from .layers import GELU, LayerNorm, Linear, ReLU, Tanh, make_layer
from .loss import CrossEntropyLoss, MSELoss, make_loss
from .model import ModelPart, ModelSpec

__all__ = ["Linear", "ReLU", "GELU", "Tanh", "LayerNorm", "make_layer", "CrossEntropyLoss", "MSELoss", "make_loss",
           "ModelSpec", "ModelPart"]
