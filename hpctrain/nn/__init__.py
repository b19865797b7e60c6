"""Layers, losses, the model specs (MLP, GPT) with their pipeline parts."""

from ..layer_kinds import register_layer
from .layers import GELU, Layer, LayerNorm, Linear, ReLU, Tanh, make_layer
from .loss import CrossEntropyLoss, MSELoss, make_loss
from .gpt import GPTSpec, make_model
from .model import ModelPart, ModelSpec

__all__ = ["Layer", "register_layer", "Linear", "ReLU", "GELU", "Tanh", "LayerNorm", "make_layer", "CrossEntropyLoss", "MSELoss", "make_loss",
           "ModelSpec", "ModelPart", "GPTSpec", "make_model"]
