"""The disaggregated workers in torch: the ``torch.distributed`` carrier and the fast engine's runner.

The frames, workers and coordinator are the reference's (``reference/disagg``). ``DistEndpoint``
(``dist.py``) carries each frame as a u64 length then its bytes between two ranks; the HTTP door uses it
under torchrun (``torchrun ... -m serve --dist-workers P``, ``serve/disagg_dist.py``).

``python -m fast.disagg.worker`` is one worker process of ``python -m serve --prefill-workers P
--decode-workers D`` (or started by hand, ``--listen HOST:PORT``) stepping on the fast engine's runner
(``worker_runner.py``): the reference's workers and frames over the torch model and its paged cache.
Conformance level: bit-exact (the same frame bytes as the socket transport).
"""

from fast.disagg.dist import DistEndpoint

__all__ = ["DistEndpoint"]
