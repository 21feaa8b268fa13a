"""The synchronous engine: requests in, one scheduled model step at a time, token deltas out."""
from __future__ import annotations

import concurrent.futures
import itertools
import logging
import time
from dataclasses import dataclass

import numpy as np
import torch

from app.engine.beam_search import BeamGroup
from app.engine.block_manager import BlockManager
from app.engine.config import EngineConfig
from app.engine.errors import AdapterNotLoadedError, InvalidRequestError
from app.engine.executor import WorkerLauncher
from app.engine.guided import GrammarCompiler
from app.engine.lora_loader import LoRAAdapter
from app.engine.model_dir import resolve_model_dir
from app.engine.model_loader import read_model_config
from app.engine.model_runner import LaunchedStep, ModelRunner
from app.engine.outputs import CompletionOutput, EngineStats, FinishReason, RequestMetrics, RequestOutput, merge_outputs
from app.engine.sampling_params import SEED_LIMIT, SamplingParams, request_limits, validate_request
from app.engine.scheduler import Scheduler, SchedulerLimits
from app.engine.sequence import Sequence
from app.engine.speculative import NGramProposer
from app.engine.step_clock import StepClock

logger = logging.getLogger(__name__)
MAX_FAILED_STEPS = 3
FRESH_LOAD_S = 30.0  # how long an adapter loaded for a request that has not arrived is kept from eviction


@dataclass
class Request:
    request_id: str
    params: SamplingParams
    seqs: list[Sequence]  # the n outputs; for beam search, every beam ever created
    beam: BeamGroup | None = None
    arrival_ns: int = 0
    aborted: bool = False
    prompt_sent: bool = False  # its prompt logprobs and context logits went out (with its first output)

    def __post_init__(self):
        p = self.params
        # Sampling that looks at earlier token values (penalties, bad words) or beams need every
        # token on the host; so do the raw logits rows of requests that return them (simplest).
        self._may_overlap = (self.beam is None and not p.needs_penalties and not p.bad_token_ids
                             and not p.returns_logits)

    @property
    def finished(self) -> bool:
        if self.beam is not None:
            return self.beam.done or self.aborted
        for seq in self.seqs:  # a loop, not all(): this runs for every request at every step
            if seq.finish_reason is None:
                return False
        return True

    @property
    def overlappable(self) -> bool:
        """Whether its steps can be queued before the last one is read back (see __post_init__);
        prompt logprobs are read back with the step that computes them."""
        return self._may_overlap and not self.seqs[0].needs_prompt_rows


class LLMEngine:
    def __init__(self, config: EngineConfig, launcher: WorkerLauncher | None = None):
        """`launcher` starts the other ranks of a tensor/pipeline-parallel engine (default: local processes)."""
        self.config = config
        self.model_dir = resolve_model_dir(config.model)
        model_cfg = read_model_config(self.model_dir)
        self.max_seq_len = min(config.max_seq_len or model_cfg.max_seq_len, model_cfg.max_seq_len)
        self.runner = ModelRunner(config, self.model_dir, self.max_seq_len, launcher)
        kv = config.kv_cache_config
        self.block_manager = BlockManager(self.runner.num_blocks, kv.tokens_per_block, kv.enable_block_reuse)
        self._seq_ids = itertools.count()
        self._adapter_loads: dict[str, int] = {}  # name -> which registration of it is loaded
        # Adapters loaded for requests still on their way from the serving layer, and when: no other
        # load evicts them until one of those requests arrives, or FRESH_LOAD_S passes.
        self._fresh_loads: dict[str, float] = {}
        self._load_ids = itertools.count(1)
        spec = config.speculative_config
        self.proposer = self.runner.draft or (NGramProposer(spec) if spec else None)
        self.scheduler = Scheduler(
            SchedulerLimits(config.max_batch_size, config.max_num_tokens, config.enable_chunked_prefill,
                            config.scheduler_policy, config.batching_type, config.max_loras),
            self.block_manager, self._seq_ids, self.proposer)
        self.limits = request_limits(config, model_cfg.vocab_size, self.max_seq_len,
                                     max_cache_tokens=self.runner.num_blocks * kv.tokens_per_block)
        self.eos_ids = frozenset(model_cfg.eos_token_ids)
        self.grammars = GrammarCompiler(self.model_dir, model_cfg.vocab_size, tuple(sorted(self.eos_ids)))
        self.requests: dict[str, Request] = {}
        self.compiling: dict[str, tuple[concurrent.futures.Future, float]] = {}  # guided: grammar, deadline
        self.num_steps = 0
        self._last_context_tokens = 0
        self._last_generation_requests = 0
        self._last_context_requests = 0
        # Overlap pays where a step runs asynchronously: one CUDA device. (On CPU the step computes
        # while it is launched; tests turn it on there to check the bookkeeping.)
        self.overlap = (not config.disable_overlap_scheduler and self.runner.device.type == "cuda"
                        and self.runner.dist is None)
        self._in_flight: LaunchedStep | None = None
        # Overlapped steps are planned as late as the one computing allows (app/engine/step_clock.py).
        self.clock = StepClock() if config.late_planning else None
        self._last_read: LaunchedStep | None = None  # the overlapped step read back last
        self._read_back: list[RequestOutput] = []  # outputs of a step read back while the next one failed
        self._stepping: set[str] = set()  # requests of the step being computed
        self.failed_steps = 0  # in a row

    # -- requests ----------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    adapter_id: str | None = None, arrival_ns: int | None = None, validated: bool = False) -> None:
        """Queue a request; raises InvalidRequestError (naming the field) for input out of range.
        `validated`: `params` are validate_request's answer for this prompt and these limits already
        (the serving loops' generate checked them before the stream started), so the loop need not again."""
        if request_id in self.requests:
            raise InvalidRequestError("request_id", f"{request_id!r} is already in flight")
        if not validated:
            params = validate_request(prompt_token_ids, params, self.limits)
        if adapter_id is not None and adapter_id not in self.runner.loras:
            raise AdapterNotLoadedError("adapter", f"LoRA adapter {adapter_id!r} is not loaded; register it "
                                                   "first (with its path) and then send its name")
        self._fresh_loads.pop(adapter_id, None)
        arrival_ns = arrival_ns or time.time_ns()
        num_seqs = 1 if params.beam_width > 1 else params.n
        # A guide that does not parse is a 400 now; it compiles off this thread, the request waiting.
        compiling = self.grammars.compile(params.guide) if params.guide else None
        seqs = [Sequence(next(self._seq_ids), request_id, i, prompt_token_ids, params, self.eos_ids,
                         self._generator(params, i), adapter_id, arrival_ns) for i in range(num_seqs)]
        if adapter_id is not None:
            for seq in seqs:
                seq.adapter_key = f"{adapter_id}#{self._adapter_loads.get(adapter_id, 0)}"
        beam = BeamGroup(seqs[0], params.beam_width) if params.beam_width > 1 else None
        # A beam search's sequences are its group's: the list grows as beams fork.
        request = Request(request_id, params, beam.seqs if beam else seqs, beam, arrival_ns)
        self.requests[request_id] = request
        if compiling is not None:
            self.compiling[request_id] = (compiling, time.monotonic() + self.grammars.timeout_s)
            return
        for seq in seqs:
            self.scheduler.add(seq)

    def _admit_compiled(self) -> list[RequestOutput]:
        """Guided requests whose grammar is ready join the scheduler. One whose guide failed to
        compile, or ran past GrammarCompiler.timeout_s, ends with a 400; one whose compile never
        started in that time (other guides ahead of it) with a 503, and its compile is dropped.
        Waits a moment for a compile when nothing else is there to run, rather than spin."""
        if not self.scheduler.has_work() and self._in_flight is None:
            concurrent.futures.wait([f for f, _ in self.compiling.values()], timeout=0.01,
                                    return_when=concurrent.futures.FIRST_COMPLETED)
        failed = []
        for request_id, (future, deadline) in list(self.compiling.items()):
            if not future.done() and time.monotonic() < deadline:
                continue
            request, field = self.requests[request_id], self.requests[request_id].params.guide.field
            try:
                if not future.done():
                    started = not future.cancel()
                    raise InvalidRequestError(field, f"did not compile within {self.grammars.timeout_s:g} s") \
                        if started else InvalidRequestError(field, "the guide compiler is busy; retry", status=503)
                matchers = [self.grammars.matcher(future.result(), request.params.guide) for _ in request.seqs]
            except Exception as exc:  # noqa: BLE001 - this request's failure, not the engine's
                output = self.abort_request(request_id)
                output.error = exc if isinstance(exc, InvalidRequestError) else \
                    f"its guide could not be prepared ({type(exc).__name__})"
                failed.append(output)
                continue
            del self.compiling[request_id]
            for seq, matcher in zip(request.seqs, matchers):
                seq.grammar = matcher
                self.scheduler.add(seq)
        return failed

    def prepare_lora(self, name: str, path) -> LoRAAdapter:
        """The slow, stateless part of add_lora (reading, checking, folding), safe to run on a thread
        other than the one stepping the engine; InvalidRequestError says what is wrong with it."""
        return self.runner.loras.prepare(name, path)

    def add_lora(self, name: str, path, prepared: LoRAAdapter | None = None) -> None:
        """Register (or replace) an adapter, `prepared` by prepare_lora already or read here;
        InvalidRequestError says what is wrong with it."""
        # Every request's adapter, those still compiling their guide included, stays loaded, and so do
        # those just loaded for requests on their way (the host cache may hold more than its slots meanwhile).
        now = time.monotonic()
        self._fresh_loads = {n: t for n, t in self._fresh_loads.items() if now - t < FRESH_LOAD_S}
        in_use = {s.adapter_id for r in self.requests.values() for s in r.seqs if s.adapter_id}
        in_use |= set(self._fresh_loads)
        self.runner.add_lora(name, path, in_use, prepared)
        self._fresh_loads[name] = now
        self._adapter_loads[name] = next(self._load_ids)  # blocks cached under an earlier load are not this one's

    def _generator(self, params: SamplingParams, index: int) -> torch.Generator | None:
        if params.seed is None or params.greedy:
            return None
        return torch.Generator(self.runner.device).manual_seed((params.seed + index) % SEED_LIMIT)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request now; its KV blocks go back to the pool before this returns."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        request.aborted = True
        compiling = self.compiling.pop(request_id, None)
        if compiling is not None:
            compiling[0].cancel()  # a compile not yet started is dropped; one running finishes into the cache
        queued = compiling is None  # one still compiling never reached the scheduler
        for seq in request.seqs:
            seq.drop_pending()  # a token still in flight is not output
            if queued and not seq.is_finished:
                self.scheduler.remove(seq)
            if seq.finish_reason is None:
                seq.finish_reason = FinishReason.ABORT
        return self._output(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)  # a request stays until its last step has been read back

    def seconds_to_plan(self) -> float:
        """How long the serving loop may go on taking requests before the next step() should start:
        with a step in flight, until just before it ends (StepClock); otherwise 0."""
        if self.clock is None or self._in_flight is None or not self.requests:
            return 0.0
        return self.clock.seconds_to_plan(time.monotonic())

    def shutdown(self) -> None:
        """Stop the other ranks of a parallel engine, and drop the guides waiting to compile."""
        self.grammars.shutdown()
        self.runner.shutdown()

    # -- the step ----------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One step (see `_step`). A step that raises fails the requests it was computing, alone:
        their KV blocks are freed and their outputs carry the error, while waiting requests and the
        engine go on. Only MAX_FAILED_STEPS failures in a row (a lost device, not a bad request)
        propagate, for the serving layer to replace the engine."""
        began = time.monotonic()  # the host's lead counts from here (StepClock.planned)
        failed = self._admit_compiled() if self.compiling else []  # already out of self.requests: returned whatever
        try:
            outputs = self._step(began)
        except Exception as exc:  # noqa: BLE001 - re-raised once failures repeat
            self.failed_steps += 1
            if self.failed_steps >= MAX_FAILED_STEPS:
                raise
            logger.exception("engine step failed; failing the requests it computed")
            read_back, self._read_back = self._read_back, []
            return failed + read_back + self._fail_stepping(
                f"the engine step computing this request failed ({type(exc).__name__})")
        if self._stepping:  # a step that computed something succeeded
            self.failed_steps = 0
        return failed + outputs

    def _fail_stepping(self, error: str) -> list[RequestOutput]:
        self._in_flight = None  # its requests are among those failed: nothing waits for its tokens
        outputs = [self.abort_request(request_id) for request_id in self._stepping]
        for output in outputs:
            if output is not None:
                output.error = error
        return [output for output in outputs if output is not None]

    def _step(self, began: float) -> list[RequestOutput]:
        """One step. Overlapped (see `overlap`), it queues step k + 1 on the device, then reads back
        step k and returns step k's outputs: the host's scheduling and output work runs while the
        device computes. A token's stop check then comes one step late, so a sequence that ends on
        a stop token may compute one extra token, which is dropped."""
        in_flight = self._in_flight.plan.scheduled if self._in_flight is not None else []
        self._stepping = {item.seq.request_id for item in in_flight}
        overlap = (self.overlap and all(r.overlappable for rid, r in self.requests.items() if rid not in self.compiling)
                   and not self.scheduler.guesses_next())
        if not overlap and self._in_flight is not None:  # catch up before a step that needs every token
            return self._finish(self._take_in_flight())
        plan = self.scheduler.schedule()
        if not overlap:
            if plan.is_empty:
                return []
            self._begin(plan)
            result = self.runner.execute(plan)
            for seq, logprob, top in result.prompt_logprobs:
                seq.add_prompt_logprob(logprob, top)
            for seq, rows in result.context_logits:
                seq.add_context_logits(rows)
            return self._outputs(self.scheduler.update(plan, result.seqs, result.sampled))
        launched = None
        if not plan.is_empty:
            self._begin(plan)
            # A guided row's mask needs the token step k is computing: its sampling waits for the read back.
            guided = any(item.seq.grammar is not None for item in plan.scheduled)
            launched = self.runner.launch(plan, self._in_flight, sample=not guided)
            if self.clock is not None and self._in_flight is not None and not guided:
                self.clock.planned(plan.num_tokens, launched.forward_at - began,
                                   time.monotonic() - launched.forward_at, late=not launched.back_to_back)
        previous = self._take_in_flight() if self._in_flight is not None else None
        seqs = self.scheduler.update(previous.plan, previous.seqs, previous.sample.result()) if previous else []
        self._time(previous, launched)
        if launched is not None and launched.sample is None:
            # Guided rows: their grammars took step k's tokens, so the masks' fill can start; step k's
            # outputs are built after, while it runs. A failure here must not lose them.
            try:
                self.runner.sample(launched)
            except Exception:
                self._read_back = self._outputs(seqs)
                raise
        outputs = self._outputs(seqs)
        if launched is not None:  # after the read back: a sequence that ended on it takes no placeholder
            self.scheduler.update(plan, launched.seqs, None)
            self._in_flight = launched
        return outputs

    def _take_in_flight(self) -> LaunchedStep:
        launched, self._in_flight = self._in_flight, None
        return launched

    def _time(self, read: LaunchedStep | None, computing: LaunchedStep | None) -> None:
        """The clock learns how long the device took for `read` (from the end of the step read back
        before it) and since when `computing` is on the device: since `read` ended, or since its first
        kernel was queued if later (or if nothing was read back: it was queued on an idle device)."""
        if self.clock is None:
            return
        # A step back to back with the one before it was queued while that one computed, and that one
        # was read back in the same step(): the step read back before it, always.
        before, self._last_read = self._last_read, read
        if read is not None and read.back_to_back:
            device_s = read.sample.device_seconds_since(before.sample)
            if device_s is not None:
                self.clock.timed(read.plan.num_tokens, device_s)
        ended = self.clock.ended_at(read.sample) if read is not None else 0.0
        if computing is None:
            self.clock.stopped()
        else:
            self.clock.started(computing.plan.num_tokens, max(ended, computing.forward_at))

    def _begin(self, plan) -> None:
        """The step's counters, before it runs."""
        now = time.time_ns()
        context_tokens = generation_requests = 0
        for item in plan.scheduled:
            seq = item.seq
            self._stepping.add(seq.request_id)
            seq.first_scheduled_ns = seq.first_scheduled_ns or now
            if item.is_decode:
                generation_requests += 1
            else:
                context_tokens += item.num_tokens
        self.num_steps += 1
        self._last_context_tokens = context_tokens
        self._last_generation_requests = generation_requests
        self._last_context_requests = len(plan.scheduled) - generation_requests

    def _finish(self, launched: LaunchedStep) -> list[RequestOutput]:
        """Read an overlapped step back."""
        return self._outputs(self.scheduler.update(launched.plan, launched.seqs, launched.sample.result()))

    def _outputs(self, seqs: list[Sequence]) -> list[RequestOutput]:
        """The outputs of the requests whose sequences took a token; a finished request goes."""
        outputs = []
        for request in {seq.request_id: self.requests[seq.request_id] for seq in seqs}.values():
            output = self._output(request)
            if output is None:  # (a finished request always has an output: its last)
                continue
            outputs.append(output)
            if output.finished:
                if any(seq.left_its_guide for seq in request.seqs):
                    output.error = InvalidRequestError(request.params.guide.field, (
                        "left no token to draw: every token its guide allowed next was also ruled out "
                        "(by bad words or logit_bias)"))
                del self.requests[request.request_id]
        return outputs

    # -- outputs -----------------------------------------------------------------------------------
    def _output(self, request: Request) -> RequestOutput | None:
        if request.beam is not None:
            return self._beam_output(request)
        finished = request.finished
        if not finished and not request.seqs[0].prompt_done:
            return None  # the prompt's logprobs and logits come with the first output: the other outputs wait
        completions = []
        for seq in request.seqs:
            upto = seq.num_emittable()
            if upto == seq.num_emitted and not (seq.finish_reason and finished):
                continue
            new = slice(seq.num_prompt_tokens + seq.num_emitted, seq.num_prompt_tokens + upto)
            completions.append(CompletionOutput(
                index=seq.index, token_ids=seq.token_ids[new],
                logprobs=seq.output_logprobs[seq.num_emitted:upto] if request.params.logprobs else None,
                cumulative_logprob=seq.cumulative_logprob,
                finish_reason=seq.finish_reason.value if seq.finish_reason else None,
                stop_reason=seq.stop_reason,
                top_logprobs=seq.output_top_logprobs[seq.num_emitted:upto] if request.params.top_logprobs else None,
                generation_logits=seq.take_generation_logits(seq.num_emitted, upto)
                if request.params.return_generation_logits else None))
            seq.num_emitted = upto
        if not completions:
            return None
        return self._with_prompt(request, RequestOutput(request.request_id, completions, finished,
                                                        self._metrics(request) if finished else None))

    def _with_prompt(self, request: Request, output: RequestOutput) -> RequestOutput:
        """The request's first output after its prompt logprobs and logits are all taken carries
        them (an output that ends a request before then, aborted, carries none)."""
        first, p = request.seqs[0], request.params
        if (p.prompt_logprobs is None and not p.return_context_logits) or request.prompt_sent or not first.prompt_done:
            return output
        request.prompt_sent = True
        if p.prompt_logprobs is not None:
            output.prompt_logprobs = [None, *first.prompt_logprobs]
        if p.prompt_logprobs:
            output.prompt_top_logprobs = [None, *first.prompt_top_logprobs]
        if p.return_context_logits:
            output.context_logits, first.context_logits = np.concatenate(first.context_logits), []
        return output

    def _beam_output(self, request: Request) -> RequestOutput | None:
        """Beams change until the search ends, so they are sent once, whole, best first: the n best."""
        if not request.finished:
            return None
        group = request.beam
        completions = [CompletionOutput(
            index=i, token_ids=h.token_ids, logprobs=h.logprobs if request.params.logprobs else None,
            cumulative_logprob=sum(h.logprobs), finish_reason=h.finish_reason.value)
            for i, h in enumerate(group.finished[:request.params.n])]
        if request.aborted:
            completions = [CompletionOutput(0, [], None, 0.0, FinishReason.ABORT.value)]
        return self._with_prompt(request, RequestOutput(request.request_id, completions, True, self._metrics(request)))

    def _metrics(self, request: Request) -> RequestMetrics:
        seqs = request.seqs
        return RequestMetrics(
            arrival_time_ns=request.arrival_ns,
            first_scheduled_time_ns=min((s.first_scheduled_ns for s in seqs if s.first_scheduled_ns), default=0),
            first_token_time_ns=min((s.first_token_ns for s in seqs if s.first_token_ns), default=0),
            last_token_time_ns=max(s.last_token_ns for s in seqs),
            num_prompt_tokens=seqs[0].num_prompt_tokens,
            num_output_tokens=(sum(len(h.token_ids) for h in request.beam.finished) if request.beam
                               else sum(s.num_output_tokens for s in seqs)),
            kv_cache_reused_blocks=sum(s.reused_blocks for s in seqs),
            kv_cache_alloc_new_blocks=sum(s.new_blocks for s in seqs),
            num_preemptions=sum(s.num_preemptions for s in seqs),
            total_draft_tokens=sum(s.draft_tokens for s in seqs),
            total_accepted_draft_tokens=sum(s.accepted_draft_tokens for s in seqs))

    # -- introspection -----------------------------------------------------------------------------
    def stats(self) -> EngineStats:
        bm, loras = self.block_manager, self.runner.loras
        return EngineStats(
            num_waiting=len(self.scheduler.waiting), num_running=len(self.scheduler.running),
            num_preempted_total=self.scheduler.num_preempted_total, max_batch_size=self.config.max_batch_size,
            max_num_tokens=self.config.max_num_tokens, tokens_per_block=bm.block_size, max_blocks=bm.num_blocks,
            free_blocks=bm.num_free_blocks, used_blocks=bm.num_blocks - bm.num_free_blocks,
            reused_blocks_total=bm.reused_blocks_total, new_blocks_total=bm.new_blocks_total, steps=self.num_steps,
            context_tokens_last_step=self._last_context_tokens,
            generation_requests_last_step=self._last_generation_requests,
            context_requests_last_step=self._last_context_requests,
            num_paused=sum(1 for seq in self.scheduler.waiting if seq.num_preemptions),
            lora={"host": list(loras.host), "device": list(loras.on_device), "loads": loras.loads,
                  "evictions": loras.evictions, "hits": loras.hits, "misses": loras.misses})

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list[RequestOutput]:
        """Run prompts to completion (offline use, tests, benchmarks); one merged output each."""
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        ids = [f"offline-{next(self._seq_ids)}" for _ in prompts]
        for rid, prompt, p in zip(ids, prompts, params_list):
            self.add_request(rid, prompt, p)
        merged: dict[str, RequestOutput] = {}
        while any(rid in self.requests for rid in ids):
            for out in self.step():
                merged[out.request_id] = merge_outputs(merged.get(out.request_id), out)
        return [merged[rid] for rid in ids]

