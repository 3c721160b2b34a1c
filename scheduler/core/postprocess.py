"""The step's last part, postprocess: a request's new token, failure or abort made into its
`RequestOutput`.

A step is schedule -> run -> sample -> postprocess (engine.py). This part is apart because it is
about one request's answer, not the batch: it appends the token, detokenizes incrementally
(scheduler/detokenizer.py, one detokenizer per unfinished request, held here), checks stop strings,
stop tokens, the grammar's end and the length limits, finishes the request when one is met, and
attaches log-probabilities. Like the engine, it is used by the engine thread alone.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from itertools import repeat
from typing import TYPE_CHECKING, Any

from orcaserve.scheduler.core.choices import Choices
from orcaserve.scheduler.core.outputs import RequestOutput, RequestTimes
from orcaserve.scheduler.core.request import Request, RequestStatus
from orcaserve.scheduler.core.scheduler import Scheduler
from orcaserve.scheduler.core.stats import EngineStats

if TYPE_CHECKING:
    from orcaserve.scheduler.core.token_logprob import TokenLogprob
    from orcaserve.scheduler.detokenizer import IncrementalDetokenizer

log = logging.getLogger(__name__)
FINISHED = RequestStatus.FINISHED


class Postprocessor:
    """The outputs of the engine's requests (`Engine.postprocessor`); a request's detokenizer is
    given with `add` when it is queued and dropped when it finishes."""

    def __init__(self, scheduler: Scheduler, choices: Choices, stats: EngineStats, max_model_len: int) -> None:
        self.scheduler = scheduler
        self.choices = choices
        self.stats = stats
        self.max_model_len = max_model_len
        self._detok: dict[str, IncrementalDetokenizer] = {}

    def add(self, request_id: str, detok: IncrementalDetokenizer) -> None:
        self._detok[request_id] = detok

    def step(
        self,
        reqs: Sequence[Request],
        ids: Sequence[int],
        logprobs: Sequence[TokenLogprob | None] | None,
        fail: Callable[[Request, Exception], RequestOutput],
    ) -> list[RequestOutput]:
        """A step's sampled `ids` given to its requests (`reqs`, in row order), in one pass: an
        output for each; a request finished since the step was launched drops its token, and one
        whose post-processing raises fails alone (`fail`)."""
        now = time.time()
        outputs: list[RequestOutput] = []
        append, detoks, max_model_len = outputs.append, self._detok, self.max_model_len
        # The loop body is a request's whole postprocess, inline: it runs for every request every
        # step, so without a call it can do without (docs/host-overlap.md "Cheaper host work per request").
        for req, token, logprob in zip(reqs, ids, logprobs if logprobs is not None else repeat(None)):
            if req.status is FINISHED:
                continue
            try:
                grammar = req.grammar
                if grammar is not None:
                    grammar.accept(token)  # raises if the token left the grammar: this request fails alone
                # The token takes its placeholder's place (the oldest: a step in flight holds
                # one) or, the synchronous engine's case, with none in flight, comes last.
                out_ids = req.output_token_ids
                out_ids.append(token)
                num_out = len(out_ids)  # num_tokens may count a placeholder of a step in flight
                num_prompt = len(req.prompt_token_ids)
                all_ids = req.all_token_ids
                if num_prompt + num_out > len(all_ids):
                    all_ids.append(token)
                else:
                    all_ids[num_prompt + num_out - 1] = token
                if logprob is not None and req.logprobs is not None:
                    req.logprobs.append(logprob)
                shown = req.times_shown
                if shown is None:  # its first token: its outputs share one copy of its times until it finishes
                    times = req.times
                    times.first_token = now
                    shown = req.times_shown = RequestTimes(times.arrival, times.first_scheduled, now, None)
                new_text = detoks[req.request_id].step(out_ids)  # None: a stop string ended the text
                if new_text is None or token in req.stop_token_ids or (grammar is not None and grammar.terminated):
                    append(self._stop(req, "stop", token, logprob, new_text, now))
                elif num_out >= req.params.max_tokens or num_prompt + num_out >= max_model_len:
                    append(self._stop(req, "length", token, logprob, new_text, now))
                elif req.final_only:  # its consumer reads the final output alone: nothing to build
                    continue
                else:  # the common case, built directly: one object per request and step
                    out = RequestOutput(
                        req.group_id,
                        [token],
                        [],
                        new_text,
                        "",
                        False,
                        None,
                        num_prompt,
                        num_out,
                        shown,  # until it finishes, they do not change
                        req.num_preemptions,
                        req.num_cached_tokens,
                        None,
                        ([logprob] if logprob else []) if req.logprobs is not None else None,
                        None,
                        req.index,
                    )
                    if req.prompt_logprobs is not None and num_out <= 1:  # a choice's first output
                        out.prompt_token_ids, out.prompt_logprobs = req.prompt_token_ids, req.prompt_logprobs
                    append(out)
            except Exception as e:
                log.exception("post-processing failed; failing request %s", req.request_id)
                append(fail(req, e))
        return outputs

    def _stop(
        self, req: Request, reason: str, token: int, logprob: TokenLogprob | None, new_text: str | None, now: float
    ) -> RequestOutput:
        """`req` met a stop or a limit with `token`, sampled in the step that ended at `now`."""
        self.scheduler.finish_request(req, reason)
        req.times.finished = now
        return self.finish(req, [token], [logprob] if logprob else None, new_text or "")

    def fail(self, req: Request, error: Exception) -> RequestOutput:
        """Finish `req` as failed; its output carries the error instead of text. The engine
        records the occupancy after it (`Engine._fail`)."""
        if req.status != RequestStatus.FINISHED:
            self.scheduler.finish_request(req, "error")
        self._detok.pop(req.request_id, None)
        self.choices.finished(req)
        self.stats.num_failed += 1
        error_text = f"{type(error).__name__}: {error}"
        return _request_output(req, [], "", "", finished=True, finish_reason="error", error=error_text)

    def finish(
        self, req: Request, new_ids: list[int], new_logprobs: list[TokenLogprob] | None = None, released: str = ""
    ) -> RequestOutput:
        """The final output of `req`, already finished (by a stop or limit, or an abort);
        `released`: text of its last token already taken from the detokenizer."""
        if req.times.finished is None:
            req.times.finished = time.time()
        out = self._output(req, new_ids, new_logprobs, finished=True, released=released)
        del self._detok[req.request_id]
        self.choices.finished(req)
        self.stats.record_finish(req)
        return out

    def _output(
        self,
        req: Request,
        new_ids: list[int],
        new_logprobs: list[TokenLogprob] | None,
        finished: bool = False,
        released: str = "",
    ) -> RequestOutput:
        detok = self._detok[req.request_id]
        return _request_output(
            req,
            new_ids,
            released + detok.release(finished),
            detok.text if finished else "",
            finished=finished,
            finish_reason=req.finish_reason if finished else None,
            new_logprobs=(new_logprobs or []) if req.logprobs is not None else None,
            logprobs=list(req.logprobs) if finished and req.logprobs is not None else None,
            **_prompt_logprobs(req, len(new_ids), finished),
        )


def _request_output(
    req: Request,
    new_ids: list[int],
    new_text: str,
    text: str,
    *,
    finished: bool,
    finish_reason: str | None,
    **rest: Any,
) -> RequestOutput:
    """`req`'s output: the fields every output takes from the request the same way (a token's,
    an abort's or a failure's), then what differs, given (`rest`: error, log-probabilities)."""
    return RequestOutput(
        request_id=req.group_id,
        index=req.index,
        new_token_ids=new_ids,
        output_token_ids=list(req.output_token_ids) if finished else [],  # the whole answer, on the final only
        new_text=new_text,
        text=text,
        finished=finished,
        finish_reason=finish_reason,
        prompt_tokens=req.num_prompt_tokens,
        completion_tokens=len(req.output_token_ids),
        times=req.times.snapshot(),
        num_preemptions=req.num_preemptions,
        num_cached_tokens=req.num_cached_tokens,
        **rest,
    )


def _prompt_logprobs(req: Request, num_new: int, finished: bool) -> dict:
    """The prompt's log-probabilities, on a choice's first output and on its final one."""
    if req.prompt_logprobs is None or not (finished or len(req.output_token_ids) <= num_new):
        return {}
    return {"prompt_token_ids": req.prompt_token_ids, "prompt_logprobs": req.prompt_logprobs}
