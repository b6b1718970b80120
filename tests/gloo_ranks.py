"""Run a test module's ``check_*`` functions on gloo processes, one per rank.

Each distributed test module defines ``check_<name>(rank) -> list[str]`` functions (the
problems found, empty when the rank saw the right answer) and a module-scoped fixture
that calls :func:`run_checks` once; its tests then assert per check that every rank
reported nothing. The ranks are real processes (``torch.multiprocessing.spawn``) joined
by a gloo process group, as a user's ``torchrun`` would start them.
"""

from __future__ import annotations

import datetime
import gc
import json
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import raggedfn

Check = Callable[[int], list[str]]


def checks_of(namespace: Mapping[str, object]) -> dict[str, Check]:
    """The ``check_*`` functions of a module's globals, by name without the prefix."""
    return {
        name.removeprefix("check_"): fn  # type: ignore[misc]
        for name, fn in namespace.items()
        if name.startswith("check_") and callable(fn)
    }


def run_checks(
    checks: dict[str, Check],
    world: int,
    directory: Path,
    *,
    ignore_warnings: tuple[tuple[str, type[Warning]], ...] = (),
) -> list[dict[str, list[str]]]:
    """Every check on ``world`` gloo ranks; one ``{check: problems}`` per rank."""
    args = (world, checks, str(directory / "rendezvous"), str(directory), ignore_warnings)
    mp.spawn(_worker, args=args, nprocs=world)
    return [json.loads((directory / f"rank{r}.json").read_text()) for r in range(world)]


def _worker(
    rank: int,
    world: int,
    checks: dict[str, Check],
    init_file: str,
    out_dir: str,
    ignore_warnings: tuple[tuple[str, type[Warning]], ...],
) -> None:
    warnings.simplefilter("error")  # as pytest's filterwarnings, which a spawned worker lacks
    for message, category in ignore_warnings:
        warnings.filterwarnings("ignore", message, category)
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=120),
    )
    results = {}
    for name, check in checks.items():
        try:
            results[name] = check(rank)
        except Exception as error:  # reported as a problem: a raise would leave peers waiting
            results[name] = [f"raised {type(error).__name__}: {error}"]
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))
    # free what holds the group while it is alive (map's traces keep FSDP2's modules)
    raggedfn.map_cache_clear()
    gc.collect()
    dist.barrier()  # no rank tears the group down under a peer (gloo aborts that peer)
    dist.destroy_process_group()
