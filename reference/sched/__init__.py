"""Requests and the continuous batcher (control plane: plain Python, shared by reference/ and
fast/).

API:

    seq = Sequence(prompt_token_ids, *, max_tokens=16, tenant="default", arrival_time=None,
                   predicted_output_len=None, eos_token_id=None, stop_token_ids=(), cache_salt=None,
                   request=None)            # request: the engine's own object, never read here
    sched = Scheduler(BlockManager(num_blocks, block_size),
                      SchedulerConfig(max_num_batched_tokens=512, max_num_seqs=64,
                      max_model_len=None,
                                      watermark=0.0),
                      policy=FCFS(), tenants=None)
    sched.add(seq, now)                     # RequestError / UnknownTenantError, nothing changed
    batch = sched.schedule(now)             # Batch: entries, block_copies (src, dst), preempted
    for e in batch.entries:                 # ScheduledSeq: seq, start, num_new_tokens, token_ids,
        ...                                 #   positions, block_table, slot_mapping(bs),
        context_len,
                                            #   needs_sample (sample a token from the last
                                            position?), is_prefill
    finished = sched.postprocess(batch, [token or None per entry], now)
    sched.abort(seq_id, now)                # frees everything; returns the Sequence or None
    sched.has_unfinished(), sched.waiting, sched.running

Sequence state: status (WAITING/RUNNING/FINISHED/ABORTED), token_ids (prompt + output),
output_token_ids, num_computed_tokens, num_cached_tokens, block_table, finish_reason
("length"/"stop"/"abort"), num_preemptions, first_scheduled_time, first_token_time, finish_time.

Policies (``policy.py``): FCFS(), SJF(aging), WFQ(tenants, within), sjf_wfq(tenants, aging),
Static() (static batching baseline), make_policy(name, tenants, aging). A policy is
``key(seq, now)`` (smaller: admitted first; largest running: preempted first),
``pick(waiting, now)`` (the smallest key, possibly faster) and hooks ``on_add``,
``on_schedule(seq, n)``, ``on_finish``. Sequence's constructor arguments keep their order (callers
pass them positionally). Tenants (``tenants.py``):
``Tenants({"acme": "paid", "bob": "free"}, {"paid": 4, "free": 1})``; ``Tenants.open()`` accepts
all. Errors: SchedulerError > ConfigError, RequestError, UnknownTenantError (all ValueError).
"""

from reference.sched.batch import Batch, ScheduledSeq, SchedulerConfig
from reference.sched.errors import ConfigError, RequestError, SchedulerError, UnknownTenantError
from reference.sched.policy import FCFS, SJF, WFQ, Policy, Static, make_policy, sjf_wfq
from reference.sched.scheduler import Scheduler
from reference.sched.sequence import Sequence, SequenceStatus
from reference.sched.tenants import DEFAULT_PLAN_WEIGHTS, Tenants

__all__ = ["Batch", "ScheduledSeq", "SchedulerConfig", "ConfigError", "RequestError",
           "SchedulerError",
           "UnknownTenantError", "FCFS", "SJF", "WFQ", "Policy", "Static", "make_policy", "sjf_wfq",
           "Scheduler", "Sequence", "SequenceStatus", "DEFAULT_PLAN_WEIGHTS", "Tenants"]
