"""vLLM's ExampleHiddenStatesConnector for vLLM's CPU build, loaded out of tree by engines/vllm_runner.py --hidden
(`kv_connector_module_path`), in vLLM's venv: it imports nothing of the project.

The stock connector (vLLM 0.32.0) copies a finished request's hidden states out of the KV-cache-like buffer into
pinned host memory on a CUDA stream, which torch's CPU build cannot do ("pin_memory=True requires a CUDA or other
accelerator backend"). On a CPU that buffer is already host memory: this one copies synchronously and hands the
write to the stock connector's thread pool, with its lock files and file layout. On a GPU the stock one is used.
Found and measured in results/smollm2/vllm_hidden_states/."""

import fcntl
import os
from functools import partial

import torch
from vllm.distributed.kv_transfer.kv_connector.v1 import example_hidden_states_connector as stock


class CopyDone:
    """Stands for the CUDA event the stock connector records: a synchronous copy is done when made."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        """The copy was synchronous: nothing is left to wait for."""


class CPUHiddenStatesConnector(stock.ExampleHiddenStatesConnector):
    def _submit_async_write(self, pending) -> None:
        if not self._is_tp_rank_zero:
            return
        block_ids = torch.tensor(pending.block_ids, dtype=torch.long)
        offsets = torch.arange(self._block_size, dtype=torch.long)
        slots = (offsets[None, :] + block_ids[:, None] * self._block_size).flatten()
        hidden = stock.extract_from_kv_cache(self._kv_cache, slots, pending.token_ids.shape[0]).clone()
        tensors = {"hidden_states": hidden, "token_ids": pending.token_ids.clone()}
        os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        if lock_fd is None and self.use_lock:
            lock_fd = os.open(pending.filename + ".lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
            fcntl.flock(lock_fd, fcntl.LOCK_EX)
        done = CopyDone()
        future = self._executor.submit(self._write_tensors, tensors, done, pending.filename, lock_fd)
        self._req_copy_events[pending.req_id] = done
        self._req_futures[pending.req_id] = future
        future.add_done_callback(partial(self._on_write_done, pending.req_id))
