"""The one error type every fast/ wrapper raises for an input it cannot take."""


class KernelInputError(ValueError):
    """A kernel wrapper got a tensor of the wrong dtype, shape, device or layout.

    The message names the argument and says what was expected and what was given, so the mistake
    shows up at the call, not as a crash or a silent misread deep inside a Triton kernel.
    """
