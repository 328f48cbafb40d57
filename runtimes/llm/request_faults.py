"""Faults while serving one request, beside the step loop: that request alone fails (finish_reason "error", with an
id in the log) and the step is retried without it (runtimes/fault_isolation.py bisects it). The engine then checks
itself with a 1-token greedy request of its own; if that fails too, the engine is broken: EngineFaultError ends the
engine loop (the replica then reports itself dead and is restarted)."""

from __future__ import annotations

from collections.abc import Callable

from foundation.request_errors import record_failure
from runtimes.fault_isolation import EngineFaultError
from runtimes.llm.output_processor import OutputProcessor
from runtimes.llm.outputs import RequestOutput
from runtimes.llm.request import RequestStatus
from runtimes.llm.sequences import SequenceTable

Abort = Callable[[str, RequestStatus], list[RequestOutput]]  # end a request (all its samples) for this reason


class RequestFaults:
    """`abort` ends a request; `start_check(request_id)` queues the self-check under that id."""

    def __init__(self, table: SequenceTable, outputs: OutputProcessor, abort: Abort,
                 start_check: Callable[[str], None]) -> None:
        self.table = table
        self.outputs = outputs
        self.abort = abort
        self.start_check = start_check
        self.num_request_faults = 0
        self.self_check_id: str | None = None  # the self-check in flight after a request fault

    def fail(self, child_id: str, error: Exception) -> list[RequestOutput]:
        """End the request that `child_id` belongs to (all its samples) with finish_reason "error", free its
        blocks, log the traceback under an error id, and start a self-check of the engine."""
        seq = self.table.get(child_id)
        parent_id = child_id if seq is None else seq.parent_id
        if parent_id == self.self_check_id:
            raise EngineFaultError(f"the engine failed its self-check after a request fault: {error!r}") from error
        error_id = record_failure("request failed in the engine; it alone is stopped", parent_id, error)
        self.num_request_faults += 1
        outputs = self.abort(parent_id, RequestStatus.FINISHED_ERROR)
        if not outputs and seq is not None:  # it had just finished when the fault came: still tell its caller
            outputs = [self.outputs.output(seq, [], "", None)]
        for out in outputs:
            out.finished, out.finish_reason, out.error_id = True, RequestStatus.FINISHED_ERROR.value, error_id
        if self.self_check_id is None:
            self.self_check_id = f"self-check-{self.num_request_faults}"
            self.start_check(self.self_check_id)
        return outputs

    def after_step(self) -> None:
        """The self-check finished: it passed, so the faults were the requests' own."""
        if self.self_check_id is not None and self.self_check_id not in self.table:
            self.self_check_id = None
