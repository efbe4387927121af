"""accord: train transformer models on any hardware from one recipe, with the same result."""

__version__ = "0.1.0"
