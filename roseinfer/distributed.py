"""Stage 15: tensor parallelism on torch.distributed: one model, N processes, each with one shard.

    rank 0 (this process)                                    ranks 1 .. N-1 (workers, started by spawn)
    LLM / LLMEngine / Scheduler / BlockSpaceManager          only a model shard, a KV pool shard, a ModelRunner
    TensorParallelRunner.execute_model(sched):
      move_blocks:    pipe "step" ─► broadcast SchedulerOutput (block moves only) ─►  runner.move_blocks(...)
      compute_logits: pipe "step" ─► broadcast StepInput (the ModelInput tensors) ─►  model.forward_paged(...)
                      forward_paged ◄══ 2 all-reduces per layer, every rank ══►       (same collectives)
                      LM head + sampling: rank 0 only

- Rank 0 keeps everything that decides (scheduler, block manager, sampling). Block ids are the same on
  every rank, because every rank's pool has the same blocks, each holding that rank's heads.
- The step's tensors go over torch.distributed (`broadcast_object_list`, on a gloo group); the all-reduces
  in the model over the default group: gloo on CPU, NCCL on CUDA.
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

from roseinfer.attention import AttentionBackend, AttentionMetadata, get_backend
from roseinfer.kv_cache import KVCache
from roseinfer.model import GPT2
from roseinfer.model_runner import ModelInput, ModelRunner
from roseinfer.scheduler_output import SchedulerOutput

TIMEOUT_S = 120  # a collective waiting longer than this (a peer stuck mid-step) is an error, not a hang


@dataclass
class WorkerSpec:
    """What a worker needs to build its shard (picklable: it crosses to the spawned process)."""

    model_dir: str
    dtype: torch.dtype
    device_type: str  # "cpu" (gloo) or "cuda" (NCCL; rank r uses cuda:r)
    attention_backend: str
    block_size: int
    num_blocks: int
    num_cpu_blocks: int  # stage 12's host pool, sharded the same way
    tp_size: int
    threads: int  # torch threads per rank, on CPU
    port: int  # rank 0's TCPStore, where the ranks find each other


@dataclass
class StepInput:
    """A `ModelInput` without the Python sessions: the tensors and host numbers every rank's forward needs."""

    input_ids: torch.Tensor  # [N]
    positions: torch.Tensor  # [N]
    slot_mapping: torch.Tensor  # [N]
    query_start_loc: torch.Tensor  # [B + 1]
    seq_lens: torch.Tensor  # [B]
    block_tables: torch.Tensor  # [B, max_blocks]
    num_decodes: int
    max_query_len: int
    query_start_loc_cpu: list[int]
    seq_lens_cpu: list[int]

    @classmethod
    def from_model_input(cls, inp: ModelInput) -> StepInput:
        m = inp.attn_metadata
        return cls(inp.input_ids.cpu(), inp.positions.cpu(), m.slot_mapping.cpu(), m.query_start_loc.cpu(),
                   m.seq_lens.cpu(), m.block_tables.cpu(), m.num_decodes, m.max_query_len, m.query_start_loc_cpu,
                   m.seq_lens_cpu)  # fmt: skip

    def metadata(self, runner: ModelRunner) -> AttentionMetadata:
        """The AttentionMetadata again, on this rank: its own backend, scratch buffer and per-step plan."""
        dev = runner.device
        meta = AttentionMetadata(self.slot_mapping.to(dev), self.query_start_loc.to(dev), self.seq_lens.to(dev),
                                 self.block_tables.to(dev), self.num_decodes, self.max_query_len,
                                 self.query_start_loc_cpu, self.seq_lens_cpu, runner.backend,
                                 runner.gather_buffer)  # fmt: skip
        if runner.backend.prepare is not None:
            meta.plan = runner.backend.prepare(meta, runner.block_size)
        return meta


def init_distributed(rank: int, spec: WorkerSpec, store: dist.Store) -> dist.ProcessGroup | None:
    """Join the process group (every rank calls this); return the group for the step broadcasts:
    the default group on CPU (gloo), a gloo group next to NCCL on CUDA (the step's data lives on the host)."""
    backend = "nccl" if spec.device_type == "cuda" else "gloo"
    timeout = datetime.timedelta(seconds=TIMEOUT_S)
    dist.init_process_group(backend, store=store, rank=rank, world_size=spec.tp_size, timeout=timeout)
    return dist.new_group(backend="gloo", timeout=timeout) if backend == "nccl" else None


def broadcast(obj, group: dist.ProcessGroup | None):
    """Rank 0 sends `obj`, every other rank returns it (pickled, over torch.distributed)."""
    box = [obj]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]


# ---- the worker: ranks 1 .. N-1 -----------------------------------------------------------------------
def worker_main(rank: int, spec: WorkerSpec, conn) -> None:
    """A worker's whole life: join the group, load its shard, then run the steps rank 0 sends until
    told to exit or until the pipe closes (rank 0 is gone)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is rank 0's to handle; it then tells us to exit
    try:
        from roseinfer.loader import load_model

        torch.set_num_threads(spec.threads)
        device = torch.device("cuda", rank) if spec.device_type == "cuda" else torch.device("cpu")
        if device.type == "cuda":
            torch.cuda.set_device(device)
        timeout = datetime.timedelta(seconds=TIMEOUT_S)
        store = dist.TCPStore("127.0.0.1", spec.port, spec.tp_size, is_master=False, timeout=timeout)
        group = init_distributed(rank, spec, store)
        model, _ = load_model(spec.model_dir, device, spec.dtype, tp_rank=rank, tp_size=spec.tp_size)
        cfg, n = model.config, spec.tp_size
        kv = KVCache(cfg, spec.num_blocks, spec.block_size, spec.dtype, device, tp_size=n)
        host = KVCache(cfg, spec.num_cpu_blocks, spec.block_size, spec.dtype, device, host=True, tp_size=n)
        runner = ModelRunner(model, kv, get_backend(spec.attention_backend, device), device,
                             host_kv_cache=host if spec.num_cpu_blocks else None)  # fmt: skip
        conn.send(("ready", kv.nbytes))
    except BaseException:
        _send_quietly(conn, ("error", traceback.format_exc()))
        raise
    with torch.inference_mode():
        while True:
            try:
                if conn.recv_bytes() == b"exit":
                    break
            except (EOFError, OSError):  # the pipe closed: rank 0 is gone
                break
            work = broadcast(None, group)
            if isinstance(work, SchedulerOutput):  # block moves only (the sessions stay on rank 0)
                runner.move_blocks(work)
            else:  # a StepInput: this rank's share of the forward; rank 0 computes the logits
                model.forward_paged(work.input_ids.to(device), work.positions.to(device), kv.layers,
                                    work.metadata(runner))  # fmt: skip
    dist.destroy_process_group()


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
    """Rank 0's model runner: the same steps as ModelRunner, and before each forward (and each block move)
    it sends the workers the same work. Starts the workers; `close()` (or garbage collection, or interpreter
    exit) stops them."""

    def __init__(self, model: GPT2, kv_cache: KVCache, backend: AttentionBackend, device: torch.device,
                 host_kv_cache: KVCache | None, spec: WorkerSpec):  # fmt: skip
        super().__init__(model, kv_cache, backend, device, host_kv_cache=host_kv_cache)
        if dist.is_initialized():
            raise RuntimeError("a tensor-parallel engine is already running in this process; close() it first")
        old_threads = torch.get_num_threads()
        if device.type == "cpu":
            torch.set_num_threads(spec.threads)  # rank 0 is one of the N ranks sharing the cores
        timeout = datetime.timedelta(seconds=TIMEOUT_S)
        store = dist.TCPStore("127.0.0.1", 0, spec.tp_size, is_master=True, timeout=timeout, wait_for_workers=False)
        spec.port = store.port  # a free port, picked by the OS: no race with other processes
        ctx = mp.get_context("spawn")
        procs, conns = [], []
        for rank in range(1, spec.tp_size):
            ours, theirs = ctx.Pipe()
            proc = ctx.Process(target=worker_main, args=(rank, spec, theirs), name=f"roseinfer-tp{rank}", daemon=True)
            proc.start()
            theirs.close()  # only the worker holds its end now: when we die, it reads EOF
            procs.append(proc)
            conns.append(ours)
        self.workers = Workers(procs, conns, old_threads)
        self._finalizer = weakref.finalize(self, self.workers.shutdown)  # on close, GC, or interpreter exit
        self.failed: RuntimeError | None = None
        try:
            self.group = init_distributed(0, spec, store)
            self.worker_kv_bytes = [self._wait_ready(rank, conn) for rank, conn in enumerate(conns, start=1)]
        except BaseException:
            self.close()
            raise
        self.pids = [p.pid for p in procs]

    def _wait_ready(self, rank: int, conn) -> int:
        while not conn.poll(0.1):
            if self.workers.dead():
                raise RuntimeError(f"tensor-parallel worker failed to start: {'; '.join(self.workers.dead())}")
        status, detail = conn.recv()
        if status != "ready":
            raise RuntimeError(f"tensor-parallel worker rank {rank} failed to start:\n{detail}")
        return detail  # its KV pool's bytes

    def close(self) -> None:
        self._finalizer()  # runs Workers.shutdown once

    def _send(self, work: SchedulerOutput | StepInput) -> None:
        """Wake every worker, then broadcast this step's work."""
        if self.failed is not None:
            raise self.failed
        try:
            if self.workers.dead():
                raise RuntimeError("a worker is gone")
            for conn in self.workers.conns:
                conn.send_bytes(b"step")
            broadcast(work, self.group)
        except (RuntimeError, OSError) as e:
            raise self._fail(e) from e

    def _fail(self, e: BaseException) -> RuntimeError:
        """One clear error for a step that could not run on every rank; stop every process."""
        for proc in self.workers.procs:  # a killed worker's socket closes a moment before it can be reaped
            proc.join(timeout=0.5)
        dead = self.workers.dead()
        why = f"worker {'; '.join(dead)}" if dead else f"the step failed ({type(e).__name__}: {e})"
        self.failed = RuntimeError(f"tensor-parallel step failed on rank 0: {why}. Every worker has been "
                                   "stopped; this engine cannot run any more steps (create a new one)")  # fmt: skip
        self.close()
        return self.failed

    def move_blocks(self, sched: SchedulerOutput) -> None:
        if sched.blocks_to_swap_out or sched.blocks_to_swap_in or sched.blocks_to_copy:
            self._send(SchedulerOutput([], {}, {}, blocks_to_copy=sched.blocks_to_copy,
                                       blocks_to_swap_out=sched.blocks_to_swap_out,
                                       blocks_to_swap_in=sched.blocks_to_swap_in))  # fmt: skip
        super().move_blocks(sched)

    def compute_logits(self, inp: ModelInput) -> torch.Tensor:
        self._send(StepInput.from_model_input(inp))
        try:
            return super().compute_logits(inp)  # the forward: every rank runs it, with its all-reduces
        except RuntimeError as e:
            raise self._fail(e) from e
