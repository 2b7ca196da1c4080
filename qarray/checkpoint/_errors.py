"""The one error model files raise."""


class ModelFileError(ValueError):
    """A model file that cannot be served; the message names the tensor."""
