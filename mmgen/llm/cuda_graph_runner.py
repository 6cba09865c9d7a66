"""CUDA-graph decode runner: one captured decoder step (+ logits) per batch-size bucket.

Small-batch decode is bound by host launch overhead; a captured graph replays the whole step with one
launch. Each bucket's graph reads fixed-address inputs (token ids, positions, rows, seq_lens, slots,
encoder lengths) and the backend's static metadata buffers. A live batch of bs requests replays the
smallest bucket >= bs: its rows are copied in, the rest padded with a harmless request (row 0, one
decoder token, one encoder token, writing its K/V to slot 0 of the scratch page that the allocator
never hands out), and the backend recomputes the metadata of the padded batch with its eager
function and copies it into the static buffers before the replay.

Without CUDA (or with use_cuda_graph=False) the same path runs eagerly on the static buffers, which
is how CPU tests check the capture/replay metadata path against eager decoding.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mmgen.errors import MmgenError, ValidationError
from mmgen.llm.backends.base import AttentionBackend
from mmgen.llm.forward_batch import ForwardBatch, ForwardMode

DEFAULT_BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64)


class CudaGraphRunner:
    """Decode steps of `model` through `backend`, replayed from graphs captured per batch size.

    model: has decode(input_ids, positions, batch, backend) -> hidden and compute_logits(hidden).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        backend: AttentionBackend,
        batch_sizes: Sequence[int] = DEFAULT_BATCH_SIZES,
        use_cuda_graph: bool | None = None,
    ) -> None:
        if not backend.supports_cuda_graph:
            raise ValidationError(f"the {backend.name} attention backend cannot run in CUDA graphs")
        sizes = sorted(set(int(b) for b in batch_sizes))
        if not sizes or sizes[0] < 1:
            raise ValidationError(f"CUDA-graph batch sizes must be integers >= 1, got {list(batch_sizes)}")
        self.model = model
        self.backend = backend
        self.batch_sizes = tuple(sizes)
        self.max_bs = sizes[-1]
        self.device = backend.req_to_token.device
        self.use_cuda_graph = self.device.type == "cuda" if use_cuda_graph is None else use_cuda_graph
        blocker = backend.cuda_graph_blocker() if self.use_cuda_graph else None
        if blocker is not None:  # refuse before capturing: a failed capture leaves a broken CUDA state
            raise MmgenError(blocker)
        if self.use_cuda_graph and self.device.type != "cuda":
            raise ValidationError("use_cuda_graph=True needs the model and KV pools on a CUDA device")
        backend.init_cuda_graph_state(self.max_bs, self.max_bs)

        # Static inputs as rows of two buffers, so padding a bucket is one fill per dtype.
        self.long_inputs = torch.zeros(4, self.max_bs, dtype=torch.int64, device=self.device)
        self.int_inputs = torch.zeros(2, self.max_bs, dtype=torch.int32, device=self.device)
        self.input_ids, self.positions, self.req_pool_indices, self.out_cache_loc = self.long_inputs
        self.seq_lens, self.encoder_lens = self.int_inputs
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.captured: set[int] = set()

    def bucket(self, batch_size: int) -> int:
        """The smallest captured batch size that holds batch_size requests."""
        for size in self.batch_sizes:
            if size >= batch_size:
                return size
        raise MmgenError(f"batch of {batch_size} exceeds the largest CUDA-graph batch size {self.max_bs}")

    def can_run(self, batch: ForwardBatch) -> bool:
        return (
            batch.forward_mode is ForwardMode.DECODE
            and 1 <= batch.batch_size <= self.max_bs
            and batch.encoder_lens is not None
        )

    def _static_batch(
        self, bs: int, seq_lens_cpu: torch.Tensor, encoder_lens_cpu: torch.Tensor
    ) -> ForwardBatch:
        """A DECODE batch of bs requests whose device tensors are views of the static inputs."""
        return ForwardBatch(
            forward_mode=ForwardMode.DECODE,
            batch_size=bs,
            req_pool_indices=self.req_pool_indices[:bs],
            seq_lens=self.seq_lens[:bs],
            seq_lens_cpu=seq_lens_cpu,
            out_cache_loc=self.out_cache_loc[:bs],
            positions=self.positions[:bs],
            encoder_lens=self.encoder_lens[:bs],
            encoder_lens_cpu=encoder_lens_cpu,
        )

    def _fill(self, bs: int, batch: ForwardBatch | None, input_ids: torch.Tensor | None) -> ForwardBatch:
        """Copy the live rows of batch into the static inputs and pad rows [n, bs) -> the padded batch.

        A padding row is request row 0 with one decoder and one encoder token, writing slot 0.
        """
        n = 0 if batch is None else batch.batch_size
        if batch is not None:
            assert input_ids is not None and batch.encoder_lens is not None
            self.input_ids[:n].copy_(input_ids)
            self.positions[:n].copy_(batch.positions)
            self.req_pool_indices[:n].copy_(batch.req_pool_indices)
            self.seq_lens[:n].copy_(batch.seq_lens)
            self.out_cache_loc[:n].copy_(batch.out_cache_loc)
            self.encoder_lens[:n].copy_(batch.encoder_lens)
        if n == bs:
            assert batch is not None and batch.encoder_lens_cpu is not None
            return self._static_batch(bs, batch.seq_lens_cpu, batch.encoder_lens_cpu)
        self.long_inputs[:, n:bs].zero_()
        self.int_inputs[:, n:bs].fill_(1)
        pad_ones = torch.ones(bs - n, dtype=torch.int32)
        if batch is None:
            seq_cpu, enc_cpu = pad_ones, pad_ones
        else:
            assert batch.encoder_lens_cpu is not None
            seq_cpu = torch.cat([batch.seq_lens_cpu.to(torch.int32), pad_ones])
            enc_cpu = torch.cat([batch.encoder_lens_cpu.to(torch.int32), pad_ones])
        return self._static_batch(bs, seq_cpu, enc_cpu)

    def _forward(self, bs: int, batch: ForwardBatch) -> torch.Tensor:
        hidden = self.model.decode(self.input_ids[:bs], self.positions[:bs], batch, self.backend)
        return self.model.compute_logits(hidden)

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every bucket, largest first (smaller graphs then reuse the shared memory pool)."""
        pool = None
        for bs in reversed(self.batch_sizes):
            batch = self._fill(bs, None, None)
            self.backend.init_forward_metadata_capture_cuda_graph(batch)
            if self.use_cuda_graph:
                stream = torch.cuda.Stream(self.device)
                stream.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(stream):
                    for _ in range(2):  # warm up: JIT builds and allocator state happen outside the graph
                        self._forward(bs, batch)
                torch.cuda.current_stream(self.device).wait_stream(stream)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self.outputs[bs] = self._forward(bs, batch)
                pool = graph.pool()
                self.graphs[bs] = graph
            self.captured.add(bs)

    @torch.inference_mode()
    def prepare(self, batch: ForwardBatch, input_ids: torch.Tensor) -> tuple[int, ForwardBatch]:
        """The host work before a replay: batch's rows into the static inputs, padded to its bucket, and the
        backend's metadata of the padded batch into its static buffers -> (bucket, padded batch)."""
        if not self.can_run(batch):
            raise MmgenError(
                f"CUDA-graph runner takes DECODE batches of 1..{self.max_bs} encoder-decoder requests, "
                f"got {batch.forward_mode.name} of {batch.batch_size}"
            )
        bs = self.bucket(batch.batch_size)
        if bs not in self.captured:
            raise MmgenError(f"no CUDA graph captured for batch size {bs}: call capture() first")
        padded = self._fill(bs, batch, input_ids)
        self.backend.init_forward_metadata_replay_cuda_graph(padded)
        return bs, padded

    @torch.inference_mode()
    def replay(self, batch: ForwardBatch, input_ids: torch.Tensor) -> torch.Tensor:
        """One decode step: input_ids int64 [B] for the DECODE batch -> fp32 logits [B, vocab]."""
        bs, padded = self.prepare(batch, input_ids)
        if self.use_cuda_graph:
            self.graphs[bs].replay()
            # A copy: the graph's output buffer is overwritten by the next replay.
            return self.outputs[bs][: batch.batch_size].clone()
        return self._forward(bs, padded)[: batch.batch_size]
