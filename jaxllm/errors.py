"""Errors users see. Each message names the offending input and what is allowed."""


class JaxLLMError(Exception):
    """Base class for errors raised on bad user input."""


class ModelLoadError(JaxLLMError):
    """A model path, file or tensor cannot be loaded."""


class UnsupportedModelError(ModelLoadError):
    """The checkpoint is readable but uses an architecture, quantization or option we lack."""


class OutOfMemoryError(JaxLLMError):
    """Host or device memory could not be allocated; the message names what was being
    allocated and the settings that size it."""
