"""The engine: requests, sampling, streaming and metrics around the model and the scheduler.

    engine = Engine(LlamaModel.load("smollm2"), load_tokenizer("smollm2"), policy="fcfs")
    engine.add_request(prompt, SamplingParams(...), tenant="default") -> request id
    engine.step() -> [TokenEvent]; engine.events(); engine.stream(prompt, params);
    engine.generate(prompts)
    engine.abort(request_id); engine.output(request_id) -> RequestOutput (tokens, text, metrics)

Bad input raises an ``EngineError`` subclass naming the field, and nothing is queued: ``generate``
checks every prompt and the parameters before it queues any.
"""

from reference.engine.engine import Engine, RequestRejected, StepRecord, UnknownRequestError
from reference.engine.params import EngineError, SamplingParams, SamplingParamsError
from reference.engine.request import RequestMetrics, RequestOutput, TokenEvent
from reference.engine.sampling import probabilities, sample

__all__ = ["Engine", "EngineError", "RequestMetrics", "RequestOutput", "RequestRejected",
           "SamplingParams",
           "SamplingParamsError", "StepRecord", "TokenEvent", "UnknownRequestError",
           "probabilities", "sample"]
