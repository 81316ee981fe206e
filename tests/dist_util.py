"""Multi-process tests on the CPU: spawn W processes, one gloo process group, run a
module-level function on every rank, and fail clearly when any rank fails.

    from dist_util import run_ranks
    results = run_ranks(_check_something, world_size=2, args=(...,))

``fn(rank, world_size, *args)`` runs after ``torch.distributed`` is initialized (gloo,
a ``file://`` store in a fresh temporary directory, so no TCP port can collide) and
with one torch and one memfit thread per process (the machine is shared, and the
same thread count in every process keeps the CPU kernels' summation order fixed).
Its return value comes back pickled (tensors are copied, not shared), in rank order.

Each spawn costs seconds (every process imports torch): group checks into one
function per spawn.
"""

from __future__ import annotations

import io
import os
import queue as queue_mod
import tempfile
import time
import traceback

import pytest

from proc_util import describe_exit

DEFAULT_TIMEOUT_S = 120.0


def _worker(rank: int, world_size: int, init_file: str, fn, args, results) -> None:
    # Runs in the spawned process.
    try:
        import torch
        import torch.distributed as dist

        import memfit

        torch.set_num_threads(1)
        memfit.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                                world_size=world_size)
        # gloo's init returns on one rank before its peer has finished connecting: a
        # rank whose fn returns (and tears down) at once would break the peer's init,
        # so the peer reports a "connectFullMesh failed" instead of its own result.
        dist.barrier()
        try:
            out = fn(rank, world_size, *args)
            buf = io.BytesIO()
            torch.save(out, buf)  # tensors by value: nothing shared with a dead process
            results.put((rank, "ok", buf.getvalue()))
        finally:
            dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - every failure goes back to the parent
        results.put((rank, "error", traceback.format_exc()))


def run_ranks(fn, world_size: int = 2, args: tuple = (), timeout: float = DEFAULT_TIMEOUT_S) -> list:
    """Runs ``fn(rank, world_size, *args)`` on ``world_size`` spawned processes and
    returns the per-rank results in rank order. Fails the test with every failing
    rank's traceback, and kills all ranks after ``timeout`` seconds (a rank that dies
    or hangs in a collective blocks the others)."""
    import torch
    import torch.multiprocessing as mp

    if getattr(fn, "__module__", "__main__") == "__main__" or "<locals>" in fn.__qualname__:
        raise ValueError("run_ranks: fn must be a module-level function (spawn imports it by name)")
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="memfit_dist_") as tmp:
        init_file = os.path.join(tmp, "store")
        procs = [ctx.Process(target=_worker, args=(r, world_size, init_file, fn, args, results),
                             daemon=True) for r in range(world_size)]
        for p in procs:
            p.start()
        got: dict = {}
        deadline = time.monotonic() + timeout
        try:
            while len(got) < world_size:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                try:
                    rank, kind, payload = results.get(timeout=min(left, 1.0))
                except queue_mod.Empty:
                    # a rank that died without reporting (killed, segfault) never will
                    dead = [r for r, p in enumerate(procs)
                            if r not in got and p.exitcode is not None and p.exitcode != 0]
                    if dead and results.empty():
                        for r in dead:
                            got[r] = ("error", f"rank {r} ended ({describe_exit(procs[r].exitcode)}) "
                                      "without reporting")
                    continue
                got[rank] = (kind, payload)
                if kind == "error":
                    # the others may now hang in a collective: give them a moment, then stop
                    deadline = min(deadline, time.monotonic() + 10.0)
        finally:
            for p in procs:
                p.join(timeout=0.5 if len(got) < world_size else 10.0)
            for p in procs:
                if p.is_alive():
                    p.kill()
                    p.join()
    errors = [f"--- rank {r} ---\n{got[r][1]}" for r in sorted(got) if got[r][0] == "error"]
    missing = [r for r in range(world_size) if r not in got]
    if errors or missing:
        msg = "\n".join(errors)
        if missing:
            msg += f"\nranks {missing} did not finish within {timeout:.0f} s"
        pytest.fail(f"{fn.__qualname__} failed on {world_size} ranks:\n{msg}", pytrace=False)
    return [torch.load(io.BytesIO(got[r][1]), weights_only=False) for r in range(world_size)]


def checkpoint_spawns(checks_rank, prefix: str, timeouts=(180, 240)) -> tuple:
    """Module-scoped fixtures ``(ckpt_dirs, one_rank, two_ranks)`` for a file whose
    ``checks_rank(rank, world, save_to, load_from)`` runs every check of one world size
    in one spawn, saving a checkpoint to ``save_to`` and resuming the one in
    ``load_from`` (None: none): ``ckpt_dirs`` is two fresh directories (world sizes 1
    and 2), ``one_rank`` the 1-rank result, ``two_ranks`` the 2-rank results (a list),
    spawned after one_rank as it resumes that run's checkpoint. In the test file::

        ckpt_dirs, one_rank, two_ranks = checkpoint_spawns(_checks_rank, "muon")
    """

    @pytest.fixture(scope="module")
    def ckpt_dirs(tmp_path_factory):
        return (str(tmp_path_factory.mktemp(f"{prefix}_w1")),
                str(tmp_path_factory.mktemp(f"{prefix}_w2")))

    @pytest.fixture(scope="module")
    def one_rank(ckpt_dirs):
        return run_ranks(checks_rank, world_size=1, args=(ckpt_dirs[0], None),
                         timeout=timeouts[0])[0]

    @pytest.fixture(scope="module")
    def two_ranks(ckpt_dirs, one_rank):
        return run_ranks(checks_rank, world_size=2, args=(ckpt_dirs[1], ckpt_dirs[0]),
                         timeout=timeouts[1])

    return ckpt_dirs, one_rank, two_ranks


__all__ = ["run_ranks", "checkpoint_spawns", "DEFAULT_TIMEOUT_S"]
