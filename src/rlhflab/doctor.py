"""`rlhflab doctor`: check a new machine end to end, one table and one JSON.

Every row is one check that passes, fails (with a one-line reason) or is skipped (with why):

    versions             python, torch, CUDA, NCCL, transformers, vLLM (when installed)
    devices              the CUDA devices and their memory, bf16 and TF32 support; else the CPU
    collective           all-reduce and all-gather of float32 tensors under the project's launcher
                         on the backend the trainers use (`distributed.backend_for`: gloo on CPU,
                         "cpu:gloo,cuda:nccl" on CUDA), checked for the right sum, timed (GB/s)
    train/<family>       each trainer family (sft, policy_gradient, direct_alignment,
                         reward_model, distill), 2 optimizer steps in one process
    ddp/<family>         the same under `rlhflab train --nproc N` with parallel.strategy=ddp
    fsdp2/<family>       ... and fsdp2 (bf16 mixed precision on CUDA)
    resume/fsdp2         GRPO under fsdp2 with a sharded checkpoint at world size N, resumed at
                         world size 1 (needs N >= 2)
    engine               the rollout engine's generated tokens/s against plain transformers
                         `generate` on the same model and batch (hf eager and static decode; vLLM
                         when installed)
    packing              padding-free scoring = the padded layout (log-probs, gradients) and no
                         attention across sequence boundaries, for every attention
                         implementation the machine has (`sdpa`, `eager`; flash-attn on CUDA when
                         installed: the only place its varlen kernel is checked;
                         `rollout.packing_check`)
    plan                 `rlhflab plan`'s per-GPU estimate against the measured
                         `torch.cuda.max_memory_allocated` of a 2-step GRPO run (CUDA only)

N, the ranks of the launched rows: the CUDA device count on a GPU machine (one GPU: one rank in
a process group of one, on NCCL, `rlhflab train --nproc 1`), else 2 gloo processes on the CPU
(as the test suite runs them). The trainers run on a tiny from-scratch model (a 300-token
tokenizer trained on the task), the same on every machine, with the trainers' defaults for the
device (bf16 autocast on CUDA GPUs that have it; the policy-gradient rows add the static decode
and the bf16 generation copy on CUDA).

`--quick` (CI) runs versions, devices, collective, the five single-process trainer rows,
fsdp2/policy_gradient, engine and packing; it leaves out the other ddp / fsdp2 rows, resume/fsdp2 and
plan.

Isolation: every check but versions and devices runs in child processes (its own session, killed
as a group after the row's timeout: a hang is a failed row, never a hung doctor); any exception
becomes the row's one-line reason. Exit status: 0 when no row failed, 1 otherwise.

Peak memory is measured only in the plan row (CUDA `max_memory_allocated`); the other rows and
every row on CPU report none.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

FAMILIES = ("sft", "policy_gradient", "direct_alignment", "reward_model", "distill")
#: The rows of `--quick`, in order.
QUICK_ROWS = (
    "versions",
    "devices",
    "collective",
    *(f"train/{f}" for f in FAMILIES),
    "fsdp2/policy_gradient",
    "engine",
    "packing",
)
STATUSES = ("pass", "fail", "skip")
#: Seconds a row may run (a child process group past it is killed and the row fails).
TIMEOUT_S = {"quick": 150.0, "full": 240.0}


@dataclass
class Row:
    """One check's outcome: `status` pass | fail | skip, a one-line `reason` (why it failed or
    was skipped; what was measured when it passed), `numbers` {name: value with its unit in the
    name, e.g. "all_reduce_GBps"}, `seconds` (wall time of the check)."""

    name: str
    status: str
    reason: str
    numbers: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"row {self.name}: status {self.status!r} not in {STATUSES}")
        self.reason = one_line(self.reason)

    def to_dict(self) -> dict:
        return {"name": self.name, "status": self.status, "reason": self.reason,
                "numbers": self.numbers, "seconds": round(self.seconds, 2)}  # fmt: skip


class CheckFailed(Exception):
    """A check's failure with its one-line reason (and the numbers measured before it)."""

    def __init__(self, reason: str, numbers: dict | None = None):
        super().__init__(reason)
        self.numbers = numbers or {}


class TimedOut(CheckFailed):
    """A check's child process ran past its timeout and was killed (`run_child`)."""


class Skipped(Exception):
    """A check that does not apply on this machine; the message says why."""


def one_line(text: str, limit: int = 300) -> str:
    """`text` as one line: whitespace runs collapsed, cut to `limit` characters (with "…")."""
    line = " ".join(str(text).split())
    return line if len(line) <= limit else line[: limit - 1] + "…"


def exit_code(rows: list[Row]) -> int:
    """1 when any row failed, else 0 (skipped rows do not fail the doctor)."""
    return 1 if any(r.status == "fail" for r in rows) else 0


def failure_line(stdout: str, stderr: str, rc: int) -> str:
    """The one-line reason of a failed child process: its last `error: ...` line (rlhflab's
    user errors and the launcher's rank lines), else the last line of a Python traceback (the
    exception), else the last non-empty line of stderr / stdout; with the exit code."""
    lines = [x.strip() for x in (stderr + "\n" + stdout).splitlines() if x.strip()]
    errors = [x for x in lines if x.startswith("error:") or x.startswith("health:")]
    exc = [x for x in stderr.splitlines() if x and not x[0].isspace() and ": " in x
           and x.split(":")[0].replace(".", "").isidentifier()]  # fmt: skip
    line = errors[-1] if errors else exc[-1] if exc else lines[-1] if lines else "no output"
    how = f"killed by signal {-rc}" if rc < 0 else f"exit code {rc}"
    return f"{line} ({how})"


def run_child(cmd: list[str], timeout_s: float, env: dict | None = None, cwd=None) -> str:
    """Run `cmd` in its own session; its stdout. Raises CheckFailed with a one-line reason when
    it exits non-zero (`failure_line`) or runs past `timeout_s` (its whole process group, e.g.
    torchrun and its ranks, is killed first)."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, cwd=cwd, start_new_session=True)  # fmt: skip
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise TimedOut(f"timed out after {timeout_s:.0f} s (killed)") from None
    if proc.returncode != 0:
        raise CheckFailed(failure_line(out, err, proc.returncode))
    return out


# ---------------------------------------------------------------------------------------------
# The machine
# ---------------------------------------------------------------------------------------------


def _version(dist_name: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist_name)
    except PackageNotFoundError:
        return None


def check_versions(ctx: Context) -> Row:
    import torch

    nccl = None
    if torch.cuda.is_available():
        with contextlib.suppress(Exception):
            nccl = ".".join(map(str, torch.cuda.nccl.version()))
    numbers = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "nccl": nccl,
        "transformers": _version("transformers"),
        "vllm": _version("vllm"),
        "rlhflab": _version("rlhflab"),
    }
    shown = ", ".join(f"{k} {v}" for k, v in numbers.items() if v and k != "rlhflab")
    return Row("versions", "pass", shown, numbers)


def matmul_tflops(device: str, dtype, n: int, reps: int = 5) -> float:
    """Measured TFLOPS of an (n, n) @ (n, n) matmul in `dtype` on `device`: the best of `reps`
    timed calls after one warm-up (`rlhflab.throughput.measure_matmul_tflops`); on CUDA the
    cache is emptied afterwards, so the doctor's own process holds no GPU memory for the rows."""
    import torch

    from rlhflab.throughput import measure_matmul_tflops

    tflops = measure_matmul_tflops(n, repeats=reps, device=device, dtype=dtype)
    if device == "cuda":
        torch.cuda.empty_cache()
    return tflops


def _nvidia_smi_gpus() -> list[str]:
    """The GPUs `nvidia-smi -L` lists ([] without nvidia-smi, or when it fails within 20 s)."""
    if not shutil.which("nvidia-smi"):
        return []
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return []
    return [x.strip() for x in out.stdout.splitlines() if x.startswith("GPU ")]


def check_devices(ctx: Context) -> Row:
    import torch

    if not torch.cuda.is_available():
        listed = _nvidia_smi_gpus()
        if listed:
            raise CheckFailed(
                f"nvidia-smi lists {len(listed)} GPU(s) ({listed[0]}) but torch.cuda.is_available() "
                f"is False: torch {torch.__version__} is a CPU build or does not match the driver"
            )
        cpu = platform.processor() or platform.machine()
        n = os.cpu_count()
        tf = matmul_tflops("cpu", torch.float32, 512)
        numbers = {"device": "cpu", "cpu_count": n, "bf16_autocast": True, "tf32": False,
                   "matmul_fp32_TFLOPS": round(tf, 4)}  # fmt: skip
        text = f"no CUDA device: CPU ({cpu}), {n} cores; fp32 matmul {tf * 1e3:.1f} GFLOPS"
        return Row("devices", "pass", text, numbers)
    gpus = []
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        gpus.append({"name": p.name, "memory_GiB": round(p.total_memory / 2**30, 1),
                     "capability": f"{p.major}.{p.minor}"})  # fmt: skip
    bf16 = torch.cuda.is_bf16_supported()
    tf32 = torch.cuda.get_device_capability(0)[0] >= 8  # Ampere and later have TF32 tensor cores
    numbers = {"device": "cuda", "count": len(gpus), "gpus": gpus, "bf16": bf16, "tf32": tf32}
    names = sorted({g["name"] for g in gpus})
    tf = matmul_tflops("cuda", torch.bfloat16 if bf16 else torch.float16, 8192, reps=10)
    numbers["matmul_bf16_TFLOPS"] = round(tf, 1)
    text = (f"{len(gpus)}× {'/'.join(names)}, {gpus[0]['memory_GiB']} GiB each; "
            f"bf16 {'yes' if bf16 else 'no'}, TF32 {'yes' if tf32 else 'no'}; "
            f"matmul {tf:.0f} TFLOPS")  # fmt: skip
    if ctx.peak_tflops:
        numbers["matmul_share_of_peak"] = round(tf / ctx.peak_tflops, 3)
        text += f" ({tf / ctx.peak_tflops:.0%} of the given peak {ctx.peak_tflops:g})"
    return Row("devices", "pass", text, numbers)


# ---------------------------------------------------------------------------------------------
# Collective
# ---------------------------------------------------------------------------------------------


def _launcher(ctx: Context, nproc: int, module_args: list[str]) -> list[str]:
    return [sys.executable, "-m", "rlhflab.distributed.launch", "--standalone",
            f"--nproc-per-node={nproc}", "-m", *module_args]  # fmt: skip


def check_collective(ctx: Context) -> Row:
    out = ctx.work / "collective.json"
    mib = 64 if ctx.cuda else 8
    env = ctx.env(launched=True)
    cmd = _launcher(ctx, ctx.ranks, ["rlhflab.doctor", "collective", str(out), str(mib)])
    run_child(cmd, ctx.timeout_s, env=env)
    res = json.loads(out.read_text())
    if not res["ok"]:
        raise CheckFailed(res["why"], res)
    text = (f"{res['world']} rank(s) on {res['backend']}: all-reduce {res['all_reduce_GBps']:.2f}"
            f" GB/s, all-gather {res['all_gather_GBps']:.2f} GB/s ({mib} MiB per rank, algbw)")  # fmt: skip
    return Row("collective", "pass", text, res)


def _collective_worker(out: str, mib: int, reps: int = 5) -> None:
    """One rank of the collective check (run under the launcher). Bandwidths are nccl-tests'
    `algbw` (bytes of one rank's buffer, for the all-gather of the whole output, over the time of
    one call) and `busbw` (algbw × 2(n-1)/n for all-reduce, × (n-1)/n for all-gather; nccl-tests'
    doc/PERFORMANCE.md)."""
    import torch

    from rlhflab import distributed, faults
    from rlhflab.serialize import write_json_atomic

    distributed.setup("ddp", timeout_s=60)
    dev = distributed.device()
    world, rank = distributed.world_size(), distributed.rank()
    n = mib * 2**20 // 4
    cuda = dev.type == "cuda"

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(dev)

    faults.hit("collective", 1)
    x = torch.full((n,), float(rank + 1), device=dev)
    y = distributed.all_reduce_sum(x.clone())
    want = world * (world + 1) / 2  # Σ_{r=0}^{w-1} (r + 1)
    ok_reduce = bool((y == want).all())
    g = distributed.all_gather_tensor(x)
    ok_gather = g.shape == (world, n) and all(
        bool((g[r] == r + 1).all()) for r in range(world)
    )  # fmt: skip

    def seconds_per_call(call) -> float:
        """Mean wall seconds of `reps` calls, every rank starting together, queued work done."""
        sync()
        distributed.barrier()
        t0 = time.perf_counter()
        for _ in range(reps):
            call()
        sync()
        return (time.perf_counter() - t0) / reps

    t_reduce = seconds_per_call(lambda: distributed.all_reduce_sum(y))
    t_gather = seconds_per_call(lambda: distributed.all_gather_tensor(x))
    nbytes = n * 4
    res = {
        "ok": ok_reduce and ok_gather, "world": world, "backend": distributed.backend_for(dev),
        "device": str(dev), "MiB_per_rank": mib, "reps": reps,
        "all_reduce_s": t_reduce, "all_gather_s": t_gather,
        "all_reduce_GBps": nbytes / t_reduce / 1e9,
        "all_gather_GBps": world * nbytes / t_gather / 1e9,
        "all_reduce_busbw_GBps": nbytes / t_reduce / 1e9 * 2 * (world - 1) / world,
        "all_gather_busbw_GBps": world * nbytes / t_gather / 1e9 * (world - 1) / world,
        "why": "" if ok_reduce and ok_gather else
        f"wrong result: all-reduce {'ok' if ok_reduce else 'wrong'}, "
        f"all-gather {'ok' if ok_gather else 'wrong'}",
    }  # fmt: skip
    if rank == 0:
        write_json_atomic(Path(out), res)
    distributed.teardown()


# ---------------------------------------------------------------------------------------------
# Trainers
# ---------------------------------------------------------------------------------------------

TASK = {
    "name": "chain_sum",
    "config": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1},
    "n_train": 300, "n_heldout": 16, "seed": 0, "answer_format": "plain", "reward": "binary",
}  # fmt: skip


def trainer_config(family: str, root: Path, base_model: str | None, cuda: bool,
                   teacher: str | None = None, ranks: int = 2) -> dict:  # fmt: skip
    """The raw config of a 2-step run of `family` on the tiny model (`base_model`: the
    train/sft row's model directory, for every family but sft; `teacher`, for distill: the
    train/direct_alignment row's model: DPO on gold-chosen pairs moves it away from the SFT
    start in 2 steps, while 2 GRPO steps of an untrained model may not, and the SFT model itself
    is refused as its own teacher). Global batches (and the data they draw from) are `ranks`
    times a per-rank share, so that they split over `ranks` processes (8 GPUs as well as 2)."""
    k = ranks
    common = {"task": TASK, "eval": {"n": 0}, "tracking": {"console": False},
              "optim": {"lr": 1e-3}, "run": {"name": family, "root": str(root)}}  # fmt: skip
    model = {"name_or_path": base_model}
    if family == "sft":
        return {"trainer": "sft", **common,
                "model": {"build": {"size": "tiny", "vocab_size": 300,
                                    "max_position_embeddings": 64, "tokenizer_texts": 300}},
                "train": {"steps": 2, "batch_size": 4 * k, "micro_batch_size": 4, "max_len": 48}}  # fmt: skip
    if family == "policy_gradient":
        rollout = {"prompts_per_step": 2 * k, "group_size": 4, "max_new_tokens": 6}
        if cuda:  # the GPU path: static decode (CUDA graph) with the bf16 generation copy
            rollout.update(decode="static", half_weights=True)
        return {"trainer": "policy_gradient", **common, "model": model, "rollout": rollout,
                "train": {"steps": 2, "micro_batch_size": 8}}  # fmt: skip
    if family == "direct_alignment":
        return {"trainer": "direct_alignment", **common, "model": model,
                "data": {"heldout_pairs": 2 * k},
                "verifiable": {"n_prompts": 4 * k, "samples_per_prompt": 4, "max_new_tokens": 6,
                               "chosen": "gold"},
                "train": {"steps": 2, "batch_size": 2 * k, "micro_batch_size": 2},
                "eval": {"n": 0, "pref_every": 0}}  # fmt: skip
    if family == "reward_model":
        return {"trainer": "reward_model", "kind": "orm", **common, "model": model,
                "data": {"source": "task_samples", "n_prompts": 4 * k, "samples_per_prompt": 2,
                         "max_new_tokens": 6, "max_len": 48},
                "train": {"steps": 2, "batch_size": 4 * k, "micro_batch_size": 4},
                "eval": {"best_of_n": [1, 2], "n_problems": 2 * k, "max_new_tokens": 6}}  # fmt: skip
    if family == "distill":
        return {"trainer": "distill", **common, "model": model,
                "teacher": {"source": "model", "name_or_path": teacher},
                "rollout": {"prompts_per_step": 2 * k, "group_size": 1, "max_new_tokens": 6},
                "train": {"steps": 2, "micro_batch_size": 2}}  # fmt: skip
    raise ValueError(f"unknown trainer family {family!r}")


def _train(ctx: Context, name: str, family: str, strategy: str | None, nproc: int | None,
           extra: list[str] | None = None, resume: str | None = None,
           cfg_ranks: int | None = None) -> dict:  # fmt: skip
    """`rlhflab train` of `family`'s config (with `--nproc`); its final_results.json. The
    config's batches split over `cfg_ranks` (default: nproc, else 2)."""
    import yaml

    base = None if family == "sft" else ctx.base_model()
    teacher = ctx.teacher_model() if family == "distill" else None
    root = ctx.work / name.replace("/", "-")
    raw = trainer_config(family, root, base, ctx.cuda, teacher, cfg_ranks or nproc or 2)
    cfg = ctx.work / f"{name.replace('/', '-')}.yaml"
    cfg.write_text(yaml.safe_dump(raw))
    cmd = [sys.executable, "-m", "rlhflab", "train", str(cfg)]
    if nproc is not None:
        cmd += ["--nproc", str(nproc)]
    if strategy is not None:
        cmd.append(f"parallel.strategy={strategy}")
        if strategy == "fsdp2" and ctx.cuda:
            cmd.append("parallel.mixed_precision=bf16")
    cmd += extra or []
    if resume:
        cmd += ["--allow-config-change", f"--resume={resume}"]
    run_child(cmd, ctx.timeout_s, env=ctx.env(launched=nproc is not None))
    runs = sorted(root.glob("*/final_results.json"), key=lambda p: p.stat().st_mtime)
    if not runs:
        raise CheckFailed(f"no final_results.json under {root}")
    res = json.loads(runs[-1].read_text())
    steps = res.get("steps")
    want = 3 if resume else 2
    if steps != want:
        raise CheckFailed(f"ran {steps} steps, expected {want}")
    loss = res.get("final_loss")
    if loss is not None and not (isinstance(loss, int | float) and abs(loss) < float("inf")):
        raise CheckFailed(f"final loss {loss}")
    return res


def check_train(family: str) -> Callable[[Context], Row]:
    def check(ctx: Context) -> Row:
        t0 = time.perf_counter()
        res = _train(ctx, f"train/{family}", family, None, None)
        if family == "sft":
            ctx.base = res["model_dir"]
        elif family == "direct_alignment":
            ctx.teacher = res["model_dir"]
        nums = {"steps": res["steps"], "final_loss": res.get("final_loss"),
                "wall_s": round(time.perf_counter() - t0, 2), "world_size": res.get("world_size")}  # fmt: skip
        loss = nums["final_loss"]
        text = "2 steps in one process" + (f", final loss {loss:.3f}" if loss is not None else "")
        return Row(f"train/{family}", "pass", text, nums)

    return check


def check_launched(strategy: str, family: str) -> Callable[[Context], Row]:
    def check(ctx: Context) -> Row:
        res = _train(ctx, f"{strategy}/{family}", family, strategy, ctx.ranks)
        world = res.get("world_size")
        if world != ctx.ranks:
            raise CheckFailed(f"world_size {world} in its results, expected {ctx.ranks}")
        loss = res.get("final_loss")
        nums = {"steps": res["steps"], "final_loss": loss, "world_size": world}
        text = (f"2 steps on {world} rank(s) ({ctx.backend})"
                + (f", final loss {loss:.3f}" if loss is not None else ""))  # fmt: skip
        return Row(f"{strategy}/{family}", "pass", text, nums)

    return check


def check_resume(ctx: Context) -> Row:
    if ctx.ranks < 2:
        raise Skipped("one device: resume at another world size needs >= 2")
    name = "resume/fsdp2"
    first = _train(ctx, name, "policy_gradient", "fsdp2", ctx.ranks, ["checkpoint.every=1"])
    run_dir = first["run_dir"]
    ck = sorted(Path(run_dir, "checkpoints").glob("step-*"))
    shards = sorted(p.name for p in ck[-1].glob("model-rank*")) if ck else []
    if len(shards) != ctx.ranks:
        raise CheckFailed(f"expected {ctx.ranks} model shards in the checkpoint, found {shards}")
    res = _train(
        ctx,
        name,
        "policy_gradient",
        "fsdp2",
        1,
        ["train.steps=3"],
        resume=run_dir,
        cfg_ranks=ctx.ranks,
    )  # the saved run's config (its batches on one rank)
    if res.get("world_size") != 1:
        raise CheckFailed(f"resumed at world_size {res.get('world_size')}, expected 1")
    nums = {"saved_world": ctx.ranks, "resumed_world": 1, "steps": res["steps"]}
    return Row(name, "pass", f"sharded checkpoint of {ctx.ranks} ranks resumed on 1 rank, "
               "step 3 done", nums)  # fmt: skip


# ---------------------------------------------------------------------------------------------
# Rollout engine, plan
# ---------------------------------------------------------------------------------------------


def check_engine(ctx: Context) -> Row:
    out = ctx.work / "engine.json"
    run_child([sys.executable, "-m", "rlhflab.doctor", "engine", str(out)], ctx.timeout_s,
              env=ctx.env())  # fmt: skip
    res = json.loads(out.read_text())
    sides = res["sides"]
    base = sides["generate"]["tokens_per_s"]
    parts = [f"{s} {v['tokens_per_s']:,.0f}" for s, v in sides.items()]
    text = f"tokens/s: {', '.join(parts)}"
    best = max(v["tokens_per_s"] for s, v in sides.items() if s != "generate")
    text += f"; best engine {best / base:.2f}× generate"
    if res.get("vllm_skip"):
        text += f"; vLLM skipped: {res['vllm_skip']}"
    return Row("engine", "pass", text, res)


def check_packing(ctx: Context) -> Row:
    out = ctx.work / "packing.json"
    run_child([sys.executable, "-m", "rlhflab.doctor", "packing", str(out)], ctx.timeout_s,
              env=ctx.env())  # fmt: skip
    res = json.loads(out.read_text())
    scored = [a for a in res["arms"] if "check" not in a]
    bad = [a for a in res["arms"] if not a["ok"]]
    impls = sorted({a["attn"] for a in scored}, key=[a["attn"] for a in scored].index)
    worst = max(a["max_dlogp"] for a in scored)
    text = (f"packed = padded for {', '.join(impls)} ({len(scored)} arms, "
            f"{'/'.join(sorted({a['precision'] for a in scored}))}): max |Δ logp| {worst:.1e}; "
            "no attention across sequence boundaries")  # fmt: skip
    if bad:
        first = bad[0]
        what = (
            "attention crossed a sequence boundary"
            if "check" in first
            else f"|Δ logp| {first['max_dlogp']:.2e}, |Δ grad| rel {first['max_dgrad_rel']:.2e}"
        )
        raise CheckFailed(f"packed != padded: {first['attn']} ({first.get('precision', '')} "
                          f"{first['layout']}): {what}; keep padded scoring "
                          "(model.attn_implementation=sdpa) until it is fixed", res)  # fmt: skip
    return Row("packing", "pass", text, res)


def _packing_worker(out: str) -> None:
    """`rollout.packing_check.check_packing` on its tiny model, 12 sequences, every attention
    implementation this machine has (float64 on CPU; float32 and bf16 autocast on CUDA)."""
    import torch

    from rlhflab.rollout import packing_check as pc
    from rlhflab.serialize import write_json_atomic

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = pc.tiny_model(device)
    ro = pc.random_rollout(12, model.config.vocab_size, device)
    res = pc.check_packing(model, ro, impls=pc.attention_implementations(device),
                           precisions=pc.precisions_for(device))  # fmt: skip
    write_json_atomic(Path(out), {"device": device, **res})


def _engine_worker(out: str) -> None:
    """Tokens/s of plain `generate` and of the built-in engine (eager; static decode, with the
    bf16 generation copy on CUDA) on one random Qwen3-shape model and batch, fixed length
    (no stop token), after one warm-up call each; the vLLM engine when installed."""
    import importlib.util

    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from rlhflab.rollout.engines import SamplingParams
    from rlhflab.rollout.engines.hf import HFEngine
    from rlhflab.serialize import write_json_atomic

    cuda = torch.cuda.is_available()
    dev = "cuda" if cuda else "cpu"
    if cuda:
        shape = dict(hidden_size=1024, num_hidden_layers=8, num_attention_heads=16,
                     num_key_value_heads=8, head_dim=64, intermediate_size=3072, vocab_size=8192)  # fmt: skip
        prompts, group, plen, new = 32, 8, 32, 64
    else:
        shape = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=16, intermediate_size=128, vocab_size=512)  # fmt: skip
        prompts, group, plen, new = 4, 2, 8, 16
    cfg = Qwen3Config(**shape, max_position_embeddings=512, tie_word_embeddings=True,
                      eos_token_id=shape["vocab_size"] - 1, pad_token_id=0)  # fmt: skip
    torch.manual_seed(0)
    with torch.device(dev):
        live = Qwen3ForCausalLM(cfg).eval()  # the trainer's float32 policy
    half = torch.bfloat16 if cuda else None
    gen_model = live
    if cuda:
        gen_model = Qwen3ForCausalLM(cfg).to(dev, torch.bfloat16).eval()
        gen_model.load_state_dict(live.state_dict())
    gen_model.generation_config.eos_token_id = None
    kw = dict(pad_token_id=0, stop_token_ids=(-1,))  # -1 never occurs: fixed length
    engines = {
        "hf_eager": HFEngine(live, autocast_dtype=half, decode="eager", **kw),
        "hf_static": HFEngine(live, autocast_dtype=half, decode="static", half_weights=cuda,
                              **kw),
    }  # fmt: skip
    g = torch.Generator().manual_seed(0)
    ids_cpu = torch.randint(1, shape["vocab_size"] - 2, (prompts, plen), generator=g)
    ids = ids_cpu.to(dev)
    lists = ids_cpu.tolist()

    def call(side: str, n_new: int) -> int:
        if side == "generate":
            with torch.no_grad():
                o = gen_model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                       do_sample=True, num_return_sequences=group, top_k=0,
                                       max_new_tokens=n_new, min_new_tokens=n_new,
                                       pad_token_id=0)  # fmt: skip
            return o.size(0) * (o.size(1) - plen)
        params = SamplingParams(n=group, max_new_tokens=n_new, temperature=1.0)
        gen = torch.Generator(device=dev).manual_seed(1)
        return int(engines[side].generate(lists, params, generator=gen).mask.sum())

    sides = {}
    for side in ("generate", "hf_eager", "hf_static"):
        call(side, 4)
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        n = call(side, new)
        if cuda:
            torch.cuda.synchronize()
        wall = time.perf_counter() - t0
        if n != prompts * group * new:
            raise RuntimeError(f"{side}: {n} tokens generated, expected {prompts * group * new}")
        sides[side] = {"tokens": n, "wall_s": round(wall, 4), "tokens_per_s": n / wall}
    vllm_skip = None if importlib.util.find_spec("vllm") else "vLLM not installed"
    if vllm_skip is None:
        vllm_skip = "vLLM installed; this doctor does not time it yet"
    params = sum(p.numel() for p in live.parameters())
    write_json_atomic(Path(out), {"device": dev, "parameters": params, "prompts": prompts,
                                  "group": group, "prompt_len": plen, "new_tokens": new,
                                  "sides": sides, "vllm_skip": vllm_skip})  # fmt: skip


#: The plan row's model: a random Qwen3 shape of ~0.1 B parameters (the tiny model's memory is
#: all fixed overhead) with the tiny model's tokenizer and vocabulary; the prompt length planned.
PLAN_SHAPE = dict(hidden_size=1024, num_hidden_layers=8, num_attention_heads=16,
                  num_key_value_heads=8, head_dim=64, intermediate_size=3072,
                  max_position_embeddings=256)  # fmt: skip
PLAN_PROMPT_LEN = 64


def check_plan(ctx: Context) -> Row:
    if not ctx.cuda:
        raise Skipped("no CUDA device: plan predicts GPU memory (max_memory_allocated)")
    out = ctx.work / "plan.json"
    run_child([sys.executable, "-m", "rlhflab.doctor", "plan", ctx.base_model(), str(ctx.work),
               str(out)], ctx.timeout_s, env=ctx.env())  # fmt: skip
    res = json.loads(out.read_text())
    pred, meas = res["predicted_GiB"], res["measured_GiB"]
    text = (f"GRPO 2 steps, {res['parameters'] / 1e6:.0f} M params: plan {pred:.2f} GiB per GPU, "
            f"measured peak {meas:.2f} GiB (max_memory_allocated), measured/plan "
            f"{meas / pred:.2f}")  # fmt: skip
    return Row("plan", "pass", text, res)


def _plan_worker(base_model: str, work: str, out: str) -> None:
    """2 GRPO steps in this process on a `PLAN_SHAPE` model saved with `base_model`'s tokenizer;
    `rlhflab plan`'s per_gpu_gib of the same config (prompt length `PLAN_PROMPT_LEN`) beside the
    run's `torch.cuda.max_memory_allocated`."""
    import torch
    import yaml
    from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

    from rlhflab.config import load_config
    from rlhflab.plan import plan
    from rlhflab.serialize import write_json_atomic
    from rlhflab.trainers import run_config

    model_dir = Path(work, "plan-model")
    tok = AutoTokenizer.from_pretrained(base_model)
    torch.manual_seed(0)
    shape = dict(PLAN_SHAPE, vocab_size=len(tok))  # every sampled id decodes
    cfg = Qwen3Config(**shape, tie_word_embeddings=False, pad_token_id=tok.pad_token_id,
                      eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id)  # fmt: skip
    model = Qwen3ForCausalLM(cfg)
    params = sum(p.numel() for p in model.parameters())
    model.save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    del model
    raw = trainer_config("policy_gradient", Path(work, "plan-runs"), str(model_dir), True)
    raw["rollout"].update(prompts_per_step=16, group_size=8, max_new_tokens=32)
    raw["train"]["micro_batch_size"] = 32
    cfg_path = Path(work, "plan.yaml")
    cfg_path.write_text(yaml.safe_dump(raw))
    torch.cuda.reset_peak_memory_stats()
    run_config(load_config(str(cfg_path), []))
    measured = torch.cuda.max_memory_allocated() / 2**30
    total = torch.cuda.get_device_properties(0).total_memory / 2**30
    p = plan(str(model_dir), gpus=1, gpu_memory_gib=total, config=str(cfg_path),
             overrides=["train.micro_batch_size=32"], prompt_len=PLAN_PROMPT_LEN, suggest=False)  # fmt: skip
    write_json_atomic(Path(out), {"predicted_GiB": p["per_gpu_gib"], "measured_GiB": measured,
                                  "ratio_measured_over_plan": measured / p["per_gpu_gib"],
                                  "binding_phase": p.get("binding_phase"), "parameters": params,
                                  "prompt_len_planned": PLAN_PROMPT_LEN})  # fmt: skip


# ---------------------------------------------------------------------------------------------
# The run
# ---------------------------------------------------------------------------------------------


class Context:
    """What the checks share: the work directory, the device, the ranks of launched rows, the
    row timeout and the tiny base model (the train/sft row's, built on first use)."""

    def __init__(self, work: Path, quick: bool, timeout_s: float, peak_tflops: float | None = None):
        import torch

        self.peak_tflops = peak_tflops
        self.work = work
        self.quick = quick
        self.timeout_s = timeout_s
        self.row_limit_s = timeout_s  # a row's own timeout, before a --budget cuts it
        self.budget_cut_s: float | None = None  # the --budget (s) when it cut this row's timeout
        self.cuda = torch.cuda.is_available()
        self.ranks = torch.cuda.device_count() if self.cuda else 2
        self.backend = "cpu:gloo,cuda:nccl" if self.cuda else "gloo"
        self.base: str | None = None
        self.teacher: str | None = None

    def env(self, launched: bool = False) -> dict:
        env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HUB_DISABLE_TELEMETRY="1",
                   HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")  # fmt: skip
        src = str(Path(__file__).resolve().parents[1])  # children import this rlhflab
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [src, env.get("PYTHONPATH")]))
        if launched:
            env.setdefault("OMP_NUM_THREADS", "1")
            if self.ranks == 1:  # one GPU: the launched path with one rank (NCCL)
                from rlhflab.distributed import ONE_RANK_ENV

                env[ONE_RANK_ENV] = "1"
        return env

    def base_model(self) -> str:
        if self.base is None:
            raise CheckFailed("needs the train/sft row's model, which failed")
        return self.base

    def teacher_model(self) -> str:
        if self.teacher is None:
            raise CheckFailed("needs the train/direct_alignment row's model (the teacher), "
                              "which failed")  # fmt: skip
        return self.teacher


def checks(quick: bool) -> dict[str, Callable[[Context], Row]]:
    """{row name: check} in the order they run; `quick`: `QUICK_ROWS` only."""
    out: dict[str, Callable[[Context], Row]] = {
        "versions": check_versions,
        "devices": check_devices,
        "collective": check_collective,
    }
    out.update({f"train/{f}": check_train(f) for f in FAMILIES})
    for strategy in ("ddp", "fsdp2"):
        out.update({f"{strategy}/{f}": check_launched(strategy, f) for f in FAMILIES})
    out["resume/fsdp2"] = check_resume
    out["engine"] = check_engine
    out["packing"] = check_packing
    out["plan"] = check_plan
    if quick:
        out = {k: v for k, v in out.items() if k in QUICK_ROWS}
    return out


def _needs_base(name: str) -> bool:
    """Whether row `name` trains from the train/sft row's model."""
    kind, _, family = name.partition("/")
    return name in ("resume/fsdp2", "plan") or (
        kind in ("train", "ddp", "fsdp2") and family != "sft"
    )


def run_check(name: str, fn: Callable[[Context], Row], ctx: Context) -> Row:
    """`fn(ctx)` as a row: an exception becomes a failed row with its one-line reason; a timeout
    that the `--budget` cut short (`ctx.budget_cut_s`, the budget in seconds, is set) is a skip,
    "not finished", since the row did not get its own timeout."""
    t0 = time.perf_counter()
    try:
        row = fn(ctx)
    except Skipped as exc:
        row = Row(name, "skip", str(exc))
    except TimedOut as exc:
        if ctx.budget_cut_s is None:
            row = Row(name, "fail", str(exc), exc.numbers)
        else:
            row = Row(name, "skip", f"not finished: the --budget of {ctx.budget_cut_s:.0f} s ran "
                      f"out {time.perf_counter() - t0:.0f} s into this row (its timeout is "
                      f"{ctx.row_limit_s:.0f} s)")  # fmt: skip
    except CheckFailed as exc:
        row = Row(name, "fail", str(exc), exc.numbers)
    except Exception as exc:  # a bug in the check or the machine: the row's reason
        row = Row(name, "fail", f"{type(exc).__name__}: {exc}")
    row.seconds = time.perf_counter() - t0
    return row


def run_doctor(*, quick: bool = False, out: str | Path | None = None, only: list[str] | None = None,
               peak_tflops: float | None = None, timeout_s: float | None = None,
               budget_s: float | None = None,
               echo: Callable[[Row], None] | None = None) -> dict:  # fmt: skip
    """Run the checks (all, `QUICK_ROWS` with `quick`, or the rows named in `only`, plus
    train/sft when a selected row needs its model); write the report JSON to `out` (atomically)
    when given, after every row ("complete": false) and at the end ("complete": true), so a
    doctor killed from outside leaves the rows it finished. Returns {"quick", "only",
    "peak_tflops", "budget_s", "complete", "rows": [Row.to_dict()], "failed", "exit_code",
    "wall_s"}. `timeout_s`: seconds per row (`TIMEOUT_S` by default); `budget_s`: seconds for
    the whole run: a row's timeout is cut to what is left (a row the cut timeout stops is a skip,
    "not finished", not a fail), and rows that would start with under 5 s left are skipped,
    saying so. `echo(row)` is called as each row ends (progress).
    Raises ConfigError naming the unknown rows of `only`."""
    from rlhflab.errors import ConfigError

    table = checks(quick and not only)
    if only:
        unknown = [n for n in only if n not in table]
        if unknown:
            raise ConfigError(f"--only: unknown row(s) {', '.join(unknown)} "
                              f"(rows: {', '.join(table)})")  # fmt: skip
        wanted = set(only)
        if any(_needs_base(n) for n in only):
            wanted.add("train/sft")
        if any(n.endswith("/distill") for n in only):
            wanted.add("train/direct_alignment")
        table = {k: v for k, v in table.items() if k in wanted}
    limit = timeout_s or TIMEOUT_S["quick" if quick else "full"]
    t0 = time.perf_counter()
    work = Path(tempfile.mkdtemp(prefix="rlhflab-doctor-"))
    rows: list[Row] = []

    def report(complete: bool) -> dict:
        rep = {
            "quick": quick, "only": only, "peak_tflops": peak_tflops, "budget_s": budget_s,
            "complete": complete, "rows": [r.to_dict() for r in rows],
            "failed": [r.name for r in rows if r.status == "fail"],
            "exit_code": exit_code(rows), "wall_s": round(time.perf_counter() - t0, 1),
        }  # fmt: skip
        if out:  # after every row too, so a doctor killed from outside leaves the rows it ran
            from rlhflab.serialize import write_json_atomic

            Path(out).parent.mkdir(parents=True, exist_ok=True)
            write_json_atomic(Path(out), rep)
        return rep

    try:
        ctx = Context(work, quick, limit, peak_tflops)
        for name, fn in table.items():
            left = None if budget_s is None else budget_s - (time.perf_counter() - t0)
            if left is not None and left < 5:
                row = Row(name, "skip", f"not run: the --budget of {budget_s:.0f} s was spent")
            else:
                cut = left is not None and left < limit
                ctx.timeout_s = min(limit, left) if cut else limit
                ctx.budget_cut_s = budget_s if cut else None
                row = run_check(name, fn, ctx)
            rows.append(row)
            if echo:
                echo(row)
            report(complete=False)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return report(complete=True)


def render(report: dict) -> None:
    """The report as one rich table on stdout (check, status, seconds, reason)."""
    from rich.console import Console
    from rich.table import Table

    style = {"pass": "green", "fail": "bold red", "skip": "yellow"}
    t = Table(title=f"rlhflab doctor{' --quick' if report['quick'] else ''}")
    t.add_column("check")
    t.add_column("status")
    t.add_column("s", justify="right")
    t.add_column("result / reason", overflow="fold")
    for r in report["rows"]:
        s = r["status"]
        t.add_row(r["name"], f"[{style[s]}]{s}[/]", f"{r['seconds']:.0f}", r["reason"])
    Console(width=max(100, shutil.get_terminal_size((120, 20)).columns)).print(t)
    n = {s: sum(r["status"] == s for r in report["rows"]) for s in STATUSES}
    verdict = "FAIL: " + ", ".join(report["failed"]) if report["failed"] else "all checks passed"
    print(f"{n['pass']} passed, {n['fail']} failed, {n['skip']} skipped in "
          f"{report['wall_s']:.0f} s — {verdict}")  # fmt: skip


def _worker_main(argv: list[str]) -> int:
    kind, *rest = argv
    if kind == "collective":
        _collective_worker(rest[0], int(rest[1]))
    elif kind == "engine":
        _engine_worker(rest[0])
    elif kind == "packing":
        _packing_worker(rest[0])
    elif kind == "plan":
        _plan_worker(rest[0], rest[1], rest[2])
    else:
        print(f"error: rlhflab.doctor: unknown worker {kind!r}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(_worker_main(sys.argv[1:]))
