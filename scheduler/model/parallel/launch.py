"""Starting a split model's ranks (docs/tensor-parallel.md, "Two ways in").

`Engine.from_pretrained(path, tensor_parallel_size=N)` calls `start_engine`: the calling process
becomes rank 0 (the engine, its scheduler and sampler) and starts ranks 1..N-1 with
torch.multiprocessing (spawn), as vLLM's `LLM(tensor_parallel_size=N)` does; the torch threads the
caller had are shared out between the ranks. A TorchServe worker does the same from its engine
thread (`tensor_parallel_size` in the handler section).
"""

from __future__ import annotations

import os
import socket
from typing import Any

import torch

from orcaserve.kernels import get_backend
from orcaserve.scheduler.config import EngineConfig
from orcaserve.scheduler.model.build import KVSizing, allocate_kv_caches, prepare_model
from orcaserve.scheduler.model.hub import resolve_model
from orcaserve.scheduler.model.parallel.group import RankFailure, TPGroup, split_threads
from orcaserve.scheduler.model.parallel.load import load_shard
from orcaserve.scheduler.model.parallel.runner import TPModelRunner


def start_engine(engine_cls: Any, path: str, config: EngineConfig) -> Any:
    """Rank 0's engine over `path` split in `config.tensor_parallel_size`; the other ranks are
    started here and stop when it is closed (`TPModelRunner.close`) or gone."""
    world = config.tensor_parallel_size
    path = resolve_model(path)
    processes: list[Any] = []
    threads = split_threads(world, torch.get_num_threads())
    init = f"tcp://127.0.0.1:{_free_port()}"
    ctx = torch.multiprocessing.get_context("spawn")
    for rank in range(1, world):
        p = ctx.Process(target=_rank_main, args=(path, config, rank, init, threads), daemon=True)
        p.start()
        processes.append(p)
    torch.set_num_threads(threads)
    group = TPGroup.join(0, world, init)
    try:
        model, sizing = _load(path, config, group)
        tokenizer = _tokenizer(path)

        def runner(*args: Any, **kwargs: Any) -> TPModelRunner:
            return TPModelRunner(*args, group=group, **kwargs)

        engine = engine_cls(model, tokenizer, config, sizing.num_blocks, sizing.max_model_len, runner_factory=runner)
    except BaseException:
        for p in processes:
            p.terminate()
        group.close()
        raise
    engine.runner.processes = processes
    return engine


def serve_rank(path: str, config: EngineConfig, group: TPGroup) -> None:
    """A rank other than 0: load its slices, then run every step rank 0 broadcasts until STOP."""
    model, sizing = _load(resolve_model(path), config, group)
    kv_caches = allocate_kv_caches(model, config, sizing.num_blocks)
    runner = TPModelRunner(
        model,
        kv_caches,
        config.block_size,
        get_backend(config.resolved_backend()),
        config.resolved_device(),
        group=group,
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens,
        max_model_len=sizing.max_model_len,
    )
    runner.warm_up(config.max_num_batched_tokens, config.max_num_seqs)  # as Engine.__init__ on rank 0
    runner.serve()


def _rank_main(path: str, config: EngineConfig, rank: int, init: str, threads: int) -> None:
    torch.set_num_threads(threads)
    group = TPGroup.join(rank, config.tensor_parallel_size, init)
    try:
        serve_rank(path, config, group)
    except RankFailure:  # rank 0 is gone (it failed, or ended without STOP): nothing left to serve
        pass
    finally:
        group.close()


def _load(path: str, config: EngineConfig, group: TPGroup) -> tuple[Any, KVSizing]:
    model = load_shard(path, group.rank, group.world, config.resolved_dtype())
    sizing = prepare_model(model, config)
    # Ranks holding more KV heads fit fewer blocks in kv_cache_memory: all take the fewest, so the
    # block tables, and the step buffers sized from max_model_len, are the same on every rank.
    return model, KVSizing(group.min_int(sizing.num_blocks), group.min_int(sizing.max_model_len))


def _tokenizer(path: str) -> Any:
    from transformers import AutoTokenizer

    if path.endswith(".gguf"):
        return AutoTokenizer.from_pretrained(os.path.dirname(os.path.abspath(path)), gguf_file=os.path.basename(path))
    return AutoTokenizer.from_pretrained(path)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
