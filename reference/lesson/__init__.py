"""The reference twins of the lesson kernels of fast/KERNELS.md (``fast/lesson/``)."""
