"""The fast engine: the reference engine's one control plane over a torch model runner.

    from fast.engine import Engine
    engine = Engine.load("smollm2", dtype="bfloat16" | "float32", compressed=False, **engine_kwargs)
    engine.add_request / step / stream / generate / abort / output, as ``reference.engine.Engine``

Files: ``model.py`` (the Llama forward in torch over ``fast/kv``), ``linear.py`` (plain or compressed
projection matrices), ``torch_runner.py`` (the ``ModelRunner`` the engine drives), ``graphs.py`` (CUDA
graphs for decode steps), ``engine.py`` (``Engine.load``).
"""

from fast.engine.engine import Engine, FastModel
from fast.engine.model import TorchLlama
from fast.engine.torch_runner import TorchRunner

__all__ = ["Engine", "FastModel", "TorchLlama", "TorchRunner"]
