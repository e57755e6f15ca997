"""The handoff over ``torch.distributed`` point-to-point (gloo on CPU, NCCL on GPU), launched with torchrun.

The frames, workers and coordinator are the reference's (``reference/disagg``); only the carrier
differs: ``DistEndpoint`` moves each frame as a u64 length then its bytes between two ranks. Rank 0
is the coordinator, ranks 1..P prefill workers, the rest decode workers:

    torchrun --standalone --nproc-per-node 3 -m fast.disagg --model smollm2 --prefill 1 \\
        --prompts IN.jsonl --out OUT.jsonl

Past one machine, use torchrun's rendezvous (``--nnodes``, ``--rdzv-endpoint``) the same way.

``python -m fast.disagg.worker`` is one worker process of ``python -m serve --prefill-workers P
--decode-workers D`` (or started by hand, ``--listen HOST:PORT``) stepping on the fast engine's runner
(``worker_runner.py``): the reference's workers and frames over the torch model and its paged cache.
Conformance level: bit-exact (the same frame bytes as the socket transport).
"""

from fast.disagg.dist import DistEndpoint

__all__ = ["DistEndpoint"]
