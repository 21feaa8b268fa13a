"""Where a rank sits in a tensor x pipeline parallel engine, and the torch.distributed groups it talks on.

Ranks are laid out stage-major: rank = pp_rank * tp_size + tp_rank, so rank 0 (the engine's own
process: scheduler and sampler) is tensor rank 0 of the first pipeline stage. Tensors move on the
world group (NCCL on GPUs, gloo on CPU); the per-step inputs that rank 0 hands every other rank
move on a gloo group of their own, as pickled objects, so the control path never waits on a GPU.
"""
from __future__ import annotations

import datetime
import pickle
from dataclasses import dataclass

import torch
import torch.distributed as dist


CONTROL_BYTES = 1 << 16  # a step's inputs in one broadcast up to this size (a decode step of 256 sequences: ~40 kB)


@dataclass(frozen=True)
class ParallelLayout:
    tp_size: int = 1
    pp_size: int = 1
    rank: int = 0

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp_size

    @property
    def pp_rank(self) -> int:
        return self.rank // self.tp_size

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    def stage_layers(self, num_layers: int) -> range:
        """This stage's decoder layers: contiguous, the first stages take one more when uneven."""
        if num_layers < self.pp_size:
            raise ValueError(f"pipeline_parallel_size {self.pp_size} exceeds the model's {num_layers} layers")
        base, extra = divmod(num_layers, self.pp_size)
        start = self.pp_rank * base + min(self.pp_rank, extra)
        return range(start, start + base + (self.pp_rank < extra))

    def check_model(self, num_heads: int, num_kv_heads: int, intermediate_size: int, num_layers: int) -> None:
        """One sentence naming what the model cannot be split by."""
        for name, value in (("num_attention_heads", num_heads), ("num_key_value_heads", num_kv_heads),
                            ("intermediate_size", intermediate_size)):
            if value % self.tp_size:
                raise ValueError(f"tensor_parallel_size {self.tp_size} must divide the model's {name} ({value})")
        self.stage_layers(num_layers)


class TensorParallel:
    """The group a layer's shards all-reduce over; size 1 makes every call a no-op."""

    def __init__(self, size: int = 1, rank: int = 0, group=None):
        self.size, self.rank, self.group = size, rank, group

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x


SINGLE = TensorParallel()


class Distributed:
    """This process's membership of the engine's world: its groups and the messages between ranks."""

    def __init__(self, layout: ParallelLayout, init_method: str, device: torch.device, timeout_s: float = 600.0):
        self.layout = layout
        self.device = device
        backend = "nccl" if device.type == "cuda" else "gloo"
        if device.type == "cuda":
            torch.cuda.set_device(device)
        timeout = datetime.timedelta(seconds=timeout_s)
        dist.init_process_group(backend, init_method=init_method, rank=layout.rank,
                                world_size=layout.world_size, timeout=timeout)
        self.control = dist.new_group(backend="gloo", timeout=timeout) if backend != "gloo" else dist.group.WORLD
        tp_group = None
        for stage in range(layout.pp_size):  # every rank creates every group, in the same order
            ranks = list(range(stage * layout.tp_size, (stage + 1) * layout.tp_size))
            group = dist.new_group(ranks) if layout.tp_size > 1 else None
            if stage == layout.pp_rank:
                tp_group = group
        self.tp = TensorParallel(layout.tp_size, layout.tp_rank, tp_group)
        self._control_buffer = torch.zeros(CONTROL_BYTES, dtype=torch.uint8)

    # -- control: rank 0 to everyone ---------------------------------------------------------------
    def broadcast(self, message=None):
        """Rank 0 sends `message` (pickled); every other rank receives and returns it. One broadcast
        of a fixed buffer (length, then the bytes) carries a step's inputs; only a message larger
        than the buffer takes a second. torch's broadcast_object_list always takes two (size, then
        payload): 0.8-0.95 ms against 0.2-0.3 ms a step between two ranks on the 2-core dev VM."""
        buffer = self._control_buffer
        if self.layout.rank == 0:
            data = bytearray(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))  # one copy, sliced as views
            head = min(len(data), CONTROL_BYTES - 8)
            buffer[:8] = torch.frombuffer(bytearray(len(data).to_bytes(8, "little")), dtype=torch.uint8)
            buffer[8:8 + head] = torch.frombuffer(memoryview(data)[:head], dtype=torch.uint8)
            dist.broadcast(buffer, 0, group=self.control)
            if len(data) > head:
                dist.broadcast(torch.frombuffer(memoryview(data)[head:], dtype=torch.uint8), 0, group=self.control)
            return message
        dist.broadcast(buffer, 0, group=self.control)
        size = int.from_bytes(buffer[:8].numpy().tobytes(), "little")
        head = min(size, CONTROL_BYTES - 8)
        data = buffer[8:8 + head].numpy().tobytes()
        if size > head:
            rest = torch.empty(size - head, dtype=torch.uint8)
            dist.broadcast(rest, 0, group=self.control)
            data += rest.numpy().tobytes()
        return pickle.loads(data)

    def min_int(self, value: int) -> int:
        t = torch.tensor([value], dtype=torch.long)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.control)
        return int(t.item())

    # -- pipeline: stage to stage ------------------------------------------------------------------
    def _peer(self, stage: int) -> int:
        return stage * self.layout.tp_size + self.layout.tp_rank

    def send_next_stage(self, x: torch.Tensor):
        return dist.isend(x.contiguous(), self._peer(self.layout.pp_rank + 1))

    def recv_prev_stage(self, shape, dtype) -> torch.Tensor:
        x = torch.empty(shape, dtype=dtype, device=self.device)
        dist.recv(x, self._peer(self.layout.pp_rank - 1))
        return x

    def send_to_driver(self, x: torch.Tensor):
        return dist.isend(x.contiguous(), 0)

    def recv_from_last_stage(self, shape, dtype) -> torch.Tensor:
        x = torch.empty(shape, dtype=dtype, device=self.device)
        dist.recv(x, (self.layout.pp_size - 1) * self.layout.tp_size)
        return x

    def close(self) -> None:
        # NCCL's destroy and abort both hung on H200s once CUDA graphs had captured its kernels:
        # on a GPU the group ends with the process (a parallel GPU engine is one per process).
        if dist.is_initialized() and self.device.type != "cuda":
            dist.destroy_process_group()
