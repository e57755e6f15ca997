"""The one exception the codec raises for bad input: corrupt, truncated or malformed data."""


class CodecError(ValueError):
    """A compressed tensor or container is corrupt, truncated, malformed or of an unknown version.

    The message names the tensor (or file) and the check that failed. The codec never returns data
    it could not verify: a failed check always raises this.
    """
