"""The error every weight loader raises for a missing, empty, truncated or malformed source."""

from reference.model.safetensors_io import SafetensorsError


class WeightError(SafetensorsError):
    """Weights could not be loaded. The message names the file (or directory) and the problem."""
