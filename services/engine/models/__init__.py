"""Model families (one module each) and the architecture registry (`registry.py`)."""
from __future__ import annotations

from kvmesh.engine.models.registry import get_model_class

__all__ = ["get_model_class"]
