"""Request-level batching baseline: what TorchServe users run today (docs/benchmark-serving.md
"The baseline").

TorchServe's own dynamic batching (`batchSize`, `maxBatchDelay`, default worker mode) hands this
handler a batch; it left-pads the prompts, runs one transformers `generate()` with
`max_new_tokens` = the batch's largest `max_tokens`, cuts each output to its own, and answers
every request when the whole batch is done. Same request and response shapes as the orcaserve
handler (`orcaserve.handler.openai.protocol`). A benchmark comparator, not part of the orcaserve
package; `orcaserve-bench baseline --export-path model-store` builds its archive.
"""

from __future__ import annotations

import copy
import json
import logging
import time
from typing import Any

log = logging.getLogger(__name__)

DEFAULT_NAME = "smollm2-baseline"
_UNSUPPORTED: tuple[tuple[str, Any], ...] = (
    ("min_p", 0.0),
    ("repetition_penalty", 1.0),
    ("presence_penalty", 0.0),
    ("frequency_penalty", 0.0),
    ("logprobs", None),
    ("logit_bias", {}),
)


class BaselineHandler:
    """TorchServe handler (default worker mode): one padded `generate()` per TorchServe batch."""

    def __init__(self) -> None:
        self.initialized = False
        self.model: Any = None
        self.tokenizer: Any = None
        self.model_name = DEFAULT_NAME
        self.max_model_len = 2048
        self.default_max_tokens: int | None = None
        self.batches = 0

    # ---- lifecycle ---------------------------------------------------------------------------
    def initialize(self, context: Any) -> None:
        import torch

        from orcaserve.handler.config import resolve_model_path
        from orcaserve.scheduler.config import EngineConfig
        from orcaserve.scheduler.model.loader import eos_token_ids, load_model_and_tokenizer

        cfg = dict((getattr(context, "model_yaml_config", None) or {}).get("handler") or {})
        model_dir = (getattr(context, "system_properties", None) or {}).get("model_dir")
        path = resolve_model_path(cfg.get("model_path"), model_dir)
        threads = cfg.get("torch_threads")
        if threads:
            torch.set_num_threads(int(threads))
        # The same dtype rule as orcaserve's engine, so a comparison is like for like by default.
        dtype = EngineConfig(dtype=cfg.get("dtype"), device="cpu").resolved_dtype()
        self.model, self.tokenizer = load_model_and_tokenizer(path, dtype, torch.device("cpu"))
        self.tokenizer.padding_side = "left"
        self.pad_id = self.tokenizer.pad_token_id
        if self.pad_id is None:
            self.pad_id = self.tokenizer.eos_token_id
        self.eos_ids = eos_token_ids(self.model, self.tokenizer)
        limit = getattr(self.model.config, "max_position_embeddings", None) or 2048
        self.max_model_len = int(cfg.get("max_model_len") or limit)
        self.default_max_tokens = cfg.get("default_max_tokens")
        self.model_name = cfg.get("served_model_name") or getattr(context, "model_name", None) or DEFAULT_NAME
        self.initialized = True
        log.info("baseline handler ready: %s, max_model_len %d", path, self.max_model_len)

    # ---- requests ----------------------------------------------------------------------------
    def _parse(self, item: dict, idx: int, context: Any):
        from orcaserve.handler.openai.body import decode_body
        from orcaserve.handler.openai.protocol import ProtocolError, parse_request, route
        from orcaserve.scheduler.prompt import encode_prompt

        kind = route(context.get_request_header(idx, "url_path"))
        raw = item.get("body") if item.get("body") is not None else item.get("data")
        if raw is None:
            raise ProtocolError("request body must be a JSON object (send Content-Type: application/json)")
        req = parse_request(decode_body(raw), kind, None, self.default_max_tokens)
        p = req.params
        for name, neutral in _UNSUPPORTED:
            if getattr(p, name) != neutral:
                raise ProtocolError(f"{name} is not supported by the request-level baseline", name)
        if p.stop_token_ids or not p.greedy:  # the benchmarks compare greedy decoding only
            field = "stop_token_ids" if p.stop_token_ids else "temperature"
            raise ProtocolError(f"{field} is not supported by the request-level baseline (greedy only)", field)
        # raises InvalidRequest naming the field
        ids = encode_prompt(self.tokenizer, req.prompt, self.model.config.vocab_size, self.max_model_len)
        # Like the engine: generation stops at the context limit.
        p.max_tokens = min(p.max_tokens, self.max_model_len - len(ids))
        return req, ids

    def handle(self, data: list, context: Any) -> list:
        from orcaserve.handler.openai.errors import http_error
        from orcaserve.handler.openai.protocol import ProtocolError
        from orcaserve.scheduler.errors import EngineError

        received = time.time()
        out: list = [None] * len(data)
        jobs = []
        for i, item in enumerate(data):
            try:
                req, ids = self._parse(item if isinstance(item, dict) else {}, i, context)
                jobs.append((i, req, ids))
            except Exception as e:  # one bad request must not fail its batch; the prompt refused as the engine does
                if not isinstance(e, (ProtocolError, EngineError)):
                    log.exception("parsing request %d failed", i)
                answer = http_error(e)
                out[i] = self._error(context, i, answer.status, answer.body)
        if jobs:
            try:
                results = self._generate([(req, ids) for _, req, ids in jobs])
            except Exception as e:
                log.exception("batch generation failed")
                answer = http_error(e)
                for i, _, _ in jobs:
                    out[i] = self._error(context, i, answer.status, answer.body)
                return out
            finished = time.time()
            self.batches += 1
            batch = {
                "id": self.batches,
                "size": len(jobs),
                "received": received,
                "start": results["start"],
                "end": finished,
                "max_new_tokens": results["max_new_tokens"],
                "padded_prompt_len": results["padded_len"],
            }
            for (i, req, ids), (text, reason, n) in zip(jobs, results["rows"]):
                out[i] = self._respond(context, i, req, len(ids), text, reason, n, batch)
        return out

    def _generate(self, batch: list) -> dict:
        """One padded `generate()` for the whole batch; per-row (text, finish_reason, tokens)."""
        import torch

        n_new = max(req.params.max_tokens for req, _ in batch)
        width = max(len(ids) for _, ids in batch)
        input_ids = torch.tensor([[self.pad_id] * (width - len(ids)) + ids for _, ids in batch])
        mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for _, ids in batch])
        params = [req.params for req, _ in batch]
        gc = copy.deepcopy(self.model.generation_config)
        gc.max_new_tokens = n_new
        gc.min_new_tokens = None
        gc.pad_token_id = self.pad_id
        # EOS may end the batch early only if no request in it ignores EOS.
        gc.eos_token_id = None if any(p.ignore_eos for p in params) else sorted(self.eos_ids) or None
        gc.temperature, gc.top_k, gc.top_p, gc.do_sample = None, None, None, False
        start = time.time()
        with torch.inference_mode():
            seqs = self.model.generate(input_ids=input_ids, attention_mask=mask, generation_config=gc)
        rows = []
        for (req, _), gen in zip(batch, seqs[:, width:].tolist()):
            p = req.params
            toks, reason = gen[: p.max_tokens], "length"
            if not p.ignore_eos:
                for j, t in enumerate(toks):
                    if t in self.eos_ids:
                        toks, reason = toks[:j], "stop"
                        break
            text = self.tokenizer.decode(toks, skip_special_tokens=True)
            if p.stop:
                cut = min((text.find(s) for s in p.stop if s in text), default=-1)
                if cut >= 0:
                    text, reason = text[:cut], "stop"
            if reason == "length" and len(toks) < p.max_tokens:
                reason = "stop"
            rows.append((text, reason, len(toks)))
        return {"rows": rows, "start": start, "max_new_tokens": n_new, "padded_len": width}

    # ---- responses ---------------------------------------------------------------------------
    def _respond(
        self, context: Any, idx: int, req, n_prompt: int, text: str, reason: str, n_out: int, batch: dict
    ) -> str:
        from orcaserve.handler.openai.protocol import CHAT
        from orcaserve.handler.openai.responses import SSE_DONE, final_response, sse, stream_chunk

        rid = (context.get_request_id(idx) if hasattr(context, "get_request_id") else None) or f"req-{time.time_ns()}"
        kind = req.kind
        if not req.stream:
            context.set_response_content_type(idx, "application/json")
            body = final_response(kind, rid, self.model_name, text, reason, n_prompt, n_out)
            body["baseline_batch"] = batch  # extra key: lets the benchmark draw the batches
            return json.dumps(body)
        created = int(time.time())
        context.set_response_content_type(idx, "text/event-stream")
        pieces = []
        if kind == CHAT:
            pieces.append(sse(stream_chunk(kind, rid, self.model_name, created, text="", role=True)))
        if text:
            pieces.append(sse(stream_chunk(kind, rid, self.model_name, created, text=text)))
        last = stream_chunk(
            kind, rid, self.model_name, created, text=None if kind == CHAT else "", finish_reason=reason
        )
        last["baseline_batch"] = batch
        pieces.append(sse(last))
        if req.include_usage:
            pieces.append(sse(stream_chunk(kind, rid, self.model_name, created, usage=(n_prompt, n_out))))
        pieces.append(SSE_DONE)
        return "".join(pieces)

    @staticmethod
    def _error(context: Any, idx: int, status: int, body: dict) -> str:
        from orcaserve.handler.openai.protocol import HTTP_PHRASES

        context.set_response_status(status, HTTP_PHRASES.get(status, ""), idx)
        context.set_response_content_type(idx, "application/json")
        return json.dumps(body)
