"""Supported architectures and loading Hugging Face checkpoints."""

from engine.models.loader import SUPPORTED_ARCHITECTURES, LoadedModel, load_model

__all__ = ["SUPPORTED_ARCHITECTURES", "LoadedModel", "load_model"]
