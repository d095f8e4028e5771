"""A CPU-only stand-in for vLLM 0.32.0's ExampleHiddenStatesConnector (the connector speculators' "file"
backend names). The stock one fails on vLLM's CPU build in _submit_async_write: it copies the extracted hidden
states into pinned host memory on a CUDA copy stream (`torch.empty_like(..., pin_memory=True)`, torch.cuda.Stream,
torch.cuda.Event), and torch's CPU build has no pinned-memory allocator. On a CPU the KV cache already lives in host
memory, so this subclass copies synchronously and hands the write to the same thread pool; everything else
(lock files, scheduler bookkeeping, the file layout) is the stock connector's.

Loaded out of tree, as hs_connectors' FP8HiddenStatesConnector is:
    kv_transfer_config={"kv_connector": "CPUHiddenStatesConnector",
                        "kv_connector_module_path": "cpu_hidden_states_connector", ...}
"""

import fcntl
import os
from functools import partial

import torch
from vllm.distributed.kv_transfer.kv_connector.v1 import example_hidden_states_connector as _eh


class _Done:
    """Stands for the CUDA event the stock connector records: the copy is finished when it is made."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        """Nothing to wait for: the copy above was synchronous."""


class CPUHiddenStatesConnector(_eh.ExampleHiddenStatesConnector):
    def _submit_async_write(self, pending) -> None:
        if not self._is_tp_rank_zero:
            return
        assert self._kv_cache is not None
        block_ids = torch.tensor(pending.block_ids, dtype=torch.long)
        offsets = torch.arange(self._block_size, dtype=torch.long)
        slot_mapping = (offsets[None, :] + block_ids[:, None] * self._block_size).flatten()
        hidden = _eh.extract_from_kv_cache(self._kv_cache, slot_mapping, pending.token_ids.shape[0]).clone()
        tensors = {"hidden_states": hidden, "token_ids": pending.token_ids.clone()}
        assert self._req_futures.get(pending.req_id) is None, "Found another KV transfer request with same req_id!"
        os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        if lock_fd is None and self.use_lock:
            lock_fd = os.open(pending.filename + ".lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
            fcntl.flock(lock_fd, fcntl.LOCK_EX)
        done = _Done()
        future = self._executor.submit(self._write_tensors, tensors, done, pending.filename, lock_fd)
        self._req_copy_events[pending.req_id] = done
        self._req_futures[pending.req_id] = future
        future.add_done_callback(partial(self._on_write_done, pending.req_id))
