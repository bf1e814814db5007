"""Asynchronous rollouts in a process of their own (`rollout.async_worker: process`).

The thread of `rlhflab.rollout.async_rollouts` shares the interpreter with the trainer: while
the trainer's update runs Python (the loss, the optimizer's per-parameter loop, the sampler's
per-token loop) the two take turns on the GIL, so on small models the overlap is bounded. Here
the behaviour copy of the policy and its `hf` engine live in a spawned process, which only
generates: it receives weight snapshots (through state-dict slots in shared memory, allocated
once) and generation requests, and sends back the rollout and its decoded texts.

Everything that decides *what* is sampled stays in the trainer's process and runs in step order
when a job is queued (`prepare`): the prompt stream, the sharding over ranks, and the one seed a
`generate` call draws, taken from the sampler's generator as the thread would (the worker gets
that generator's state, draws the same seed, and the trainer's generator steps past it). Scoring
and the gather over ranks run in the trainer's process when the batch is taken (`finish`), in
step order on the run's own process group. So a process run draws the same prompts, seeds and
tokens as a thread run (and the schedule and staleness are the thread's: k = max_staleness);
`state()` / `load()` checkpoint the same batches, as the thread's do.

CPU only (the process shares tensors through shared memory; on a GPU the thread is used: its
generation kernels release the GIL). A worker that raises, or dies, stops the run with one line
naming it; the trainer never waits on a dead worker.
"""

from __future__ import annotations

import copy
import queue
from collections.abc import Callable

import torch

from rlhflab.rollout.async_rollouts import _decode_batch, _encode_batch
from rlhflab.rollout.dynamic import ScoredBatch
from rlhflab.rollout.sampler import Rollout

#: prepare(step) -> (prompt indices, request for the worker, or None for a rank with no prompts)
PrepareFn = Callable[[int], tuple[list[int], dict | None]]
#: finish(step, prompt indices, rollout or None, texts) -> (global batch, stats)
FinishFn = Callable[[int, list[int], Rollout | None, list[str]], tuple[ScoredBatch, dict]]

POLL_S = 1.0  # how often a wait checks that the worker is alive


def _worker(model, slots, make_engine, tokenizer, threads, requests, results) -> None:
    """The worker's loop: ("weights", i) loads the snapshot in shared slot i into the behaviour
    copy, "generate" messages sample a request and answer (step, the rollout's fields as numpy
    arrays, texts); an exception is answered as
    ("error", step, its line); "stop" ends the loop, and so does the trainer's death (it is
    polled every `POLL_S` seconds), so a killed run leaves no worker behind."""
    from rlhflab.rollout.engines import generating
    from rlhflab.rollout.sampler import decode_completions

    if threads is not None:
        torch.set_num_threads(threads)
    import multiprocessing

    parent = multiprocessing.parent_process()
    step = None
    try:
        engine = make_engine(model)
        while True:
            try:
                msg = requests.get(timeout=POLL_S)
            except queue.Empty:
                if parent is not None and not parent.is_alive():
                    return  # the trainer is gone (killed): nothing will ask again
                continue
            if msg[0] == "stop":
                return
            if msg[0] == "weights":
                model.load_state_dict(slots[msg[1]])
                engine.update_weights(model.named_parameters())
                continue
            _, step, req = msg
            generator = torch.Generator().set_state(req["rng_state"])
            with torch.no_grad(), generating(model, engine, train_after=False):
                rollout = engine.generate(req["prompts"], req["params"], generator=generator,
                                          rows=req["rows"], n_rows=req["n_rows"],
                                          width=req["width"])  # fmt: skip
            texts = decode_completions(tokenizer, rollout, engine.stop_token_ids)
            # by value through the pipe (a tensor would get a shared-memory segment of its own)
            fields = {k: getattr(rollout, k).cpu().numpy() for k in Rollout.__dataclass_fields__}
            results.put(("ok", step, fields, texts))
    except BaseException as exc:  # reported to the trainer, then the worker ends
        line = f"{type(exc).__name__}: {exc}".splitlines()[0]
        results.put(("error", step, line))


class ProcessRollouts:
    """`rollout.mode: async` with the generation in a spawned process (see the module
    docstring); the interface of `AsyncRollouts` (`next`, `state`, `load`, `close`).

    Args:
        model: the trainer's policy (unwrapped, on the CPU); a copy is the behaviour policy.
        make_engine: `make_engine(model)` builds the worker's engine (picklable: a
            `functools.partial` of a module-level function).
        tokenizer: decodes the completions in the worker.
        prepare, finish: `PrepareFn`, `FinishFn` (the sampler's halves of one draw).
        max_staleness: k >= 1; total_steps: no batch beyond this step.
        threads: torch intra-op threads of the worker (None: torch's default).

    Raises:
        ValueError: max_staleness < 1. (The caller refuses a model off the CPU:
            `rlhflab.experience.Sampler`, naming `rollout.async_worker`.)
    """

    def __init__(self, model: torch.nn.Module, make_engine: Callable, tokenizer,
                 prepare: PrepareFn, finish: FinishFn, *, max_staleness: int, total_steps: int,
                 threads: int | None = None) -> None:  # fmt: skip
        if max_staleness < 1:
            raise ValueError(f"rollout.max_staleness must be >= 1, got {max_staleness}")
        import torch.multiprocessing as mp

        behaviour = copy.deepcopy(model).requires_grad_(False)
        # Weight snapshots travel through k + 2 state-dict slots in shared memory, allocated once
        # (a tensor sent through a queue gets a shared-memory segment of its own: ~40 ms a
        # snapshot for the quickstart's 0.9 M-parameter model, against ~2 ms to copy it). A slot
        # is written again k + 2 snapshots later, and that is safe: a snapshot sent at next(j)
        # precedes the request of step j + k, so once the batch of step s - 1 is back (before
        # next(s) writes) every snapshot sent at next(j) with j <= s - 1 - k is loaded, and the
        # slot next(s) writes was last written at the latest by next(s - k - 2).
        self.slots = [
            {k: torch.empty_like(v).share_memory_() for k, v in model.state_dict().items()}
            for _ in range(max_staleness + 2)
        ]
        self._slot = 0
        ctx = mp.get_context("spawn")
        self.requests, self.results = ctx.Queue(), ctx.Queue()
        self.proc = ctx.Process(
            target=_worker, name="rlhflab-rollouts", daemon=True,
            args=(behaviour, self.slots, make_engine, tokenizer, threads, self.requests,
                  self.results),
        )  # fmt: skip
        self.proc.start()
        del behaviour  # the worker holds it now
        self.prepare, self.finish = prepare, finish
        self.k, self.total = max_staleness, total_steps
        self.pending: dict[int, tuple[int, list[int], bool]] = {}  # step -> (version, chosen, sent)
        self.arrived: dict[int, tuple[dict, list[str]]] = {}  # a worker's answers, by step
        self.finished: dict[int, tuple] = {}  # step -> (version, batch, stats, chosen): scored
        self.submitted = 0
        self._closed = False

    def _queue(self, step: int, model: torch.nn.Module) -> None:
        version = step - 1
        upto = min(step + self.k, self.total)
        if self.submitted >= upto:
            return
        slot = self.slots[self._slot]
        with torch.no_grad():
            for k, v in model.state_dict().items():
                slot[k].copy_(v)
        self.requests.put(("weights", self._slot))
        self._slot = (self._slot + 1) % len(self.slots)
        for s in range(max(self.submitted + 1, step), upto + 1):
            chosen, request = self.prepare(s)
            if request is not None:
                self.requests.put(("generate", s, request))
            self.pending[s] = (version, chosen, request is not None)
        self.submitted = upto

    def _wait(self, step: int) -> tuple[dict, list[str]]:
        while step not in self.arrived:
            try:
                msg = self.results.get(timeout=POLL_S)
            except queue.Empty:
                if not self.proc.is_alive():
                    raise RuntimeError(
                        f"async rollouts: the generation process died (exit code "
                        f"{self.proc.exitcode}) before the batch of step {step}"
                    ) from None
                continue
            if msg[0] == "error":
                where = "to start" if msg[1] is None else f"at step {msg[1]}"
                raise RuntimeError(f"async rollouts: the generation process failed {where}: "
                                   f"{msg[2]}")  # fmt: skip
            self.arrived[msg[1]] = (msg[2], msg[3])
        return self.arrived.pop(step)

    def _finish(self, step: int) -> tuple[int, ScoredBatch, dict, list[int]]:
        if step not in self.finished:
            version, chosen, sent = self.pending.pop(step)
            rollout, texts = None, []
            if sent:
                fields, texts = self._wait(step)
                rollout = Rollout(**{k: torch.from_numpy(v) for k, v in fields.items()})
            batch, stats = self.finish(step, chosen, rollout, texts)
            self.finished[step] = (version, batch, stats, chosen)
        return self.finished.pop(step)

    def next(self, step: int, model: torch.nn.Module) -> tuple[ScoredBatch, dict, list[int]]:
        """The batch of `step`, after queueing every batch up to step + k with a snapshot of
        `model`; as `AsyncRollouts.next`. Raises RuntimeError when the worker failed or died."""
        self._queue(step, model)
        if step not in self.pending and step not in self.finished:
            raise RuntimeError(f"async rollouts: no batch queued for step {step}")
        version = step - 1
        behaviour_version, batch, stats, chosen = self._finish(step)
        stats = {**stats, "staleness": float(version - behaviour_version),
                 "behaviour_version": float(behaviour_version)}  # fmt: skip
        return batch, stats, chosen

    def state(self) -> dict:
        """The queued batches as JSON (scored and gathered first, in step order), as
        `AsyncRollouts.state`."""
        for step in sorted(self.pending):
            self.finished[step] = self._finish(step)
        out = [
            {"step": s, "version": v, "stats": st, "chosen": c, "batch": _encode_batch(b)}
            for s, (v, b, st, c) in sorted(self.finished.items())
        ]
        return {"submitted": self.submitted, "queued": out}

    def load(self, state: dict, problems_of: Callable[[list[int]], list], device) -> None:
        """Put the queued batches of `state()` back (finished: they are not generated again)."""
        self.pending, self.finished = {}, {}
        for item in state["queued"]:
            batch = _decode_batch(item["batch"], problems_of(item["chosen"]), device)
            self.finished[int(item["step"])] = (int(item["version"]), batch, item["stats"],
                                                item["chosen"])  # fmt: skip
        self.submitted = int(state["submitted"])

    def close(self) -> None:
        """Stop the worker (queued requests are dropped)."""
        if self._closed:
            return
        self._closed = True
        if self.proc.is_alive():
            self.requests.put(("stop",))
            self.proc.join(timeout=10)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()
        for q in (self.requests, self.results):
            q.cancel_join_thread()
            q.close()
