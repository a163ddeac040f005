"""Tensor parallelism on torch.distributed: one model, N processes, each with one shard.

    rank 0 (this process)                                      ranks 1 .. N-1 (workers, started by spawn)
    LLM / LLMEngine / EngineCore / Scheduler                   a ModelRunner with a model shard and a KV pool shard
    TensorParallelRunner.execute_model(scheduler_output):
      pipe "step" ─► broadcast (SchedulerOutput, last step's tokens) ─►  apply_sampled, execute_model(...)
      the forward  ◄══ 2 all-reduces per layer, every rank ══►            (the same forward, the same collectives)
      LM head + sampling: rank 0 only

- Every rank runs the same ModelRunner on the same message: the data-only SchedulerOutput, which says what
  changed (new requests, block-table tails, block moves), and the tokens rank 0 sampled in the previous
  step. Each keeps its own persistent batch, so the message stays small. Block ids are the same on every
  rank: each rank's pool has the same blocks, holding that rank's heads.
- The message goes over torch.distributed (`broadcast_object_list`, on a gloo group); the all-reduces in
  the model over the default group: gloo on CPU, NCCL on CUDA.
- Start-up follows the engine core's order (roseinfer/worker/model_runner.py): every rank loads its shard
  and says "loaded"; rank 0 decides the pool's blocks; `initialize_kv_cache` sends the workers that number
  ("kv N"), and each allocates the same blocks (holding its own heads) and says "ready".
- A pipe per worker says "a step is coming" or "exit". Workers sleep on it between steps, so a
  collective's timeout only ever counts time inside a step; and it closes when rank 0 dies, however
  it dies, so a worker that reads EOF exits: no orphans. Workers ignore Ctrl-C (rank 0 handles it).
- Rank 0 checks its workers before each step; a collective that fails (a worker died: gloo sees the
  connection drop at once; or it hung past the timeout) becomes one clear error, and every process stops.
"""

from __future__ import annotations

import contextlib
import datetime
import signal
import traceback
import weakref
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from roseinfer.config import EngineConfig
from roseinfer.core.sched.output import ModelRunnerOutput, SchedulerOutput
from roseinfer.worker.model_runner import ModelRunner

TIMEOUT_S = 120  # a collective waiting longer than this (a peer stuck mid-step) is an error, not a hang


@dataclass
class WorkerSpec:
    """What a worker needs (picklable: it crosses to the spawned process)."""

    config: EngineConfig  # the engine's config (the pool's blocks come later, with "kv N")
    threads: int  # torch threads per rank, on CPU
    port: int  # rank 0's TCPStore, where the ranks find each other


def init_distributed(rank: int, spec: WorkerSpec, store: dist.Store) -> dist.ProcessGroup | None:
    """Join the process group (every rank calls this); return the group for the step broadcasts:
    the default group on CPU (gloo), a gloo group next to NCCL on CUDA (the step's data lives on the host)."""
    cuda = spec.config.model_config.device.type == "cuda"
    backend = "nccl" if cuda else "gloo"
    timeout = datetime.timedelta(seconds=TIMEOUT_S)
    tp = spec.config.parallel_config.tensor_parallel_size
    dist.init_process_group(backend, store=store, rank=rank, world_size=tp, timeout=timeout)
    return dist.new_group(backend="gloo", timeout=timeout) if backend == "nccl" else None


def broadcast(obj, group: dist.ProcessGroup | None):
    """Rank 0 sends `obj`, every other rank returns it (pickled, over torch.distributed)."""
    box = [obj]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]


# ---- the worker: ranks 1 .. N-1 -----------------------------------------------------------------------
def worker_main(rank: int, spec: WorkerSpec, conn) -> None:
    """A worker's whole life: join the group, load its shard, allocate the KV pool rank 0 sizes, then run the
    steps rank 0 sends until told to exit or until the pipe closes (rank 0 is gone)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is rank 0's to handle; it then tells us to exit
    try:
        torch.set_num_threads(spec.threads)
        cuda = spec.config.model_config.device.type == "cuda"
        device = torch.device("cuda", rank) if cuda else torch.device("cpu")
        if cuda:
            torch.cuda.set_device(device)
        timeout = datetime.timedelta(seconds=TIMEOUT_S)
        tp = spec.config.parallel_config.tensor_parallel_size
        store = dist.TCPStore("127.0.0.1", spec.port, tp, is_master=False, timeout=timeout)
        group = init_distributed(rank, spec, store)
        runner = ModelRunner(spec.config, tp_rank=rank, device=device)  # the shard; no KV cache yet
        conn.send(("loaded", None))
        command = _next_command(conn)  # "kv N": the pool's blocks, as rank 0 decided them (None: exit at once)
        if command is not None:
            runner.initialize_kv_cache(int(command.split()[1]))
            conn.send(("ready", runner.kv_cache.nbytes))
    except BaseException:
        _send_quietly(conn, ("error", traceback.format_exc()))
        raise
    while command is not None and (command := _next_command(conn)) is not None:  # a step is coming
        scheduler_output, last = broadcast(None, group)
        runner.apply_sampled(last)  # rank 0's tokens of the previous step
        runner.execute_model(scheduler_output)  # this rank's share of the forward; rank 0 computes the logits
    dist.destroy_process_group()


def _next_command(conn) -> bytes | None:
    """Sleep until rank 0 sends a command; None for "exit", or when the pipe closed (rank 0 is gone)."""
    try:
        command = conn.recv_bytes()
    except (EOFError, OSError):
        return None
    return None if command == b"exit" else command


def _send_quietly(conn, msg) -> None:
    with contextlib.suppress(OSError):  # rank 0 may be gone already
        conn.send(msg)


# ---- rank 0 ---------------------------------------------------------------------------------------------
class Workers:
    """The worker processes and their pipes; `shutdown` stops them (also run by the finalizer, so it must
    not reference the runner)."""

    def __init__(self, procs, conns, old_threads: int):
        self.procs, self.conns, self.old_threads = procs, conns, old_threads
        self.stopped = False

    def dead(self) -> list[str]:
        return [f"rank {r} (pid {p.pid}) exited with code {p.exitcode}"
                for r, p in enumerate(self.procs, start=1) if not p.is_alive()]  # fmt: skip

    def shutdown(self) -> None:
        """Tell every worker to exit, leave the process group (a worker stuck in a collective then gets an
        error at once), wait a little, then terminate whatever is left."""
        if self.stopped:
            return
        self.stopped = True
        for conn in self.conns:
            with contextlib.suppress(OSError):  # that worker is already gone
                conn.send_bytes(b"exit")
            conn.close()
        if dist.is_initialized():
            dist.destroy_process_group()
        for p in self.procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
        torch.set_num_threads(self.old_threads)


class TensorParallelRunner(ModelRunner):
    """Rank 0's model runner: the same steps as ModelRunner, and before each one it sends the workers the same
    message. Starts the workers; `close()` (or garbage collection, or interpreter exit) stops them."""

    def __init__(self, config: EngineConfig):
        if dist.is_initialized():
            raise RuntimeError("a tensor-parallel engine is already running in this process; close() it first")
        tp = config.parallel_config.tensor_parallel_size
        old_threads = torch.get_num_threads()
        threads = max(1, old_threads // tp)  # on CPU the ranks share the cores
        if config.model_config.device.type == "cpu":
            torch.set_num_threads(threads)  # rank 0 is one of the N ranks sharing the cores
        super().__init__(config, tp_rank=0)  # rank 0's shard (the KV pool comes with initialize_kv_cache)
        timeout = datetime.timedelta(seconds=TIMEOUT_S)
        store = dist.TCPStore("127.0.0.1", 0, tp, is_master=True, timeout=timeout, wait_for_workers=False)
        spec = WorkerSpec(config, threads, store.port)  # a free port, picked by the OS: no race with other processes
        ctx = mp.get_context("spawn")
        procs, conns = [], []
        for rank in range(1, tp):
            ours, theirs = ctx.Pipe()
            proc = ctx.Process(target=worker_main, args=(rank, spec, theirs), name=f"roseinfer-tp{rank}", daemon=True)
            proc.start()
            theirs.close()  # only the worker holds its end now: when we die, it reads EOF
            procs.append(proc)
            conns.append(ours)
        self.workers = Workers(procs, conns, old_threads)
        self._finalizer = weakref.finalize(self, self.workers.shutdown)  # on close, GC, or interpreter exit
        self.failed: RuntimeError | None = None
        self._last: ModelRunnerOutput | None = None  # tokens the workers have not seen yet
        try:
            self.group = init_distributed(0, spec, store)
            for rank, conn in enumerate(conns, start=1):
                self._wait_for("loaded", rank, conn)
        except BaseException:
            self.close()
            raise
        self.pids = [p.pid for p in procs]
        self.worker_kv_bytes: list[int] = []

    def initialize_kv_cache(self, num_blocks: int) -> None:
        """Every rank's pool at once: the same `num_blocks` (rank 0 measured them), each holding that rank's heads.
        The workers start first, so that a warm-up's forward (`warmup`) meets them in its all-reduces."""
        try:
            for conn in self.workers.conns:
                conn.send_bytes(b"kv %d" % num_blocks)
            super().initialize_kv_cache(num_blocks)
            self.worker_kv_bytes = [self._wait_for("ready", rank, conn)
                                    for rank, conn in enumerate(self.workers.conns, start=1)]  # fmt: skip
        except BaseException:
            self.close()
            raise

    def _wait_for(self, status: str, rank: int, conn):
        """A worker's next start-up message ("loaded", then "ready" with its KV pool's bytes)."""
        while not conn.poll(0.1):
            if self.workers.dead():
                raise RuntimeError(f"tensor-parallel worker failed to start: {'; '.join(self.workers.dead())}")
        got, detail = conn.recv()
        if got != status:
            raise RuntimeError(f"tensor-parallel worker rank {rank} failed to start:\n{detail}")
        return detail

    def close(self) -> None:
        self._finalizer()  # runs Workers.shutdown once

    def launch_step(self, scheduler_output: SchedulerOutput):
        """Wake every worker, broadcast the step's message (and the tokens of the step before, which the workers
        have not seen), then run rank 0's share of it."""
        if self.failed is not None:
            raise self.failed
        last = self._last
        if last is not None:  # only the tokens cross: the workers need nothing else of it
            last = ModelRunnerOutput(last.req_ids, last.sampled_token_ids or [])
        try:
            if self.workers.dead():
                raise RuntimeError("a worker is gone")
            for conn in self.workers.conns:
                conn.send_bytes(b"step")
            broadcast((scheduler_output, last), self.group)
        except (RuntimeError, OSError) as e:
            raise self._fail(e) from e
        try:
            return super().launch_step(scheduler_output)  # the forward: every rank runs it, with its all-reduces
        except RuntimeError as e:
            raise self._fail(e) from e

    def finish_step(self, handle) -> ModelRunnerOutput:
        self._last = out = super().finish_step(handle)
        return out

    def _fail(self, e: BaseException) -> RuntimeError:
        """One clear error for a step that could not run on every rank; stop every process."""
        for proc in self.workers.procs:  # a killed worker's socket closes a moment before it can be reaped
            proc.join(timeout=0.5)
        dead = self.workers.dead()
        cause = f"worker {'; '.join(dead)}" if dead else f"the step failed ({type(e).__name__}: {e})"
        self.failed = RuntimeError(f"tensor-parallel step failed on rank 0: {cause}. Every worker has been "
                                   "stopped; this engine cannot run any more steps (create a new one)")  # fmt: skip
        self.close()
        return self.failed
