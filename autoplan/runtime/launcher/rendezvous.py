"""A rank's process group: loopback-only for a local job ([Note: loopback only]), and the waits
allowed while the ranks start and once they run steps ([Note: start-up and step timeouts]).

Apart so that the launcher (launch.py, which spawns the ranks) and a rank's training loop
(training.py, which bounds its waits once started) share it without importing each other.
"""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator
from datetime import timedelta

import torch

__all__ = ["STARTUP_TIMEOUT_S", "bound_waits", "hosted_store", "startup_timeout", "loopback_interface",
           "loopback_process_group"]

STARTUP_TIMEOUT_S = 300.0
"""How long a rank waits on its peers while the ranks start (joining the process group, building
their stages): at least this, whatever --timeout says. Ranks start seconds apart (each imports torch:
15-25 s on a loaded machine, issue 29) and trace the model apart, so `--timeout 1.5` failed every run
at start-up with DistNetworkError. A rank that dies meanwhile is seen by the launcher at once; only a
rank hung during start-up waits this long. See [Note: start-up and step timeouts]."""


@contextlib.contextmanager
def hosted_store(timeout: timedelta = timedelta(seconds=STARTUP_TIMEOUT_S)) -> Iterator[int]:
    """The store of a local job, held by the process that spawns the ranks; yields its port.

    [Note: a port held from the start] The launcher used to pick a free port (bind to port 0, close)
    and rank 0 bound it again once it had imported torch, 15-25 s later on a loaded machine. In that
    gap another process could take the port (CI saw it: "rank 0 failed: OSError: [Errno 98] Address
    already in use"). Here the listening socket is bound once, to 127.0.0.1 ([Note: loopback only]),
    and kept open until the job ends; the spawning process serves the TCPStore on it, as torchrun's
    agent serves its own store (TORCHELASTIC_USE_AGENT_STORE), and every rank connects as a client."""
    import torch.distributed as dist

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(128)
        port = listener.getsockname()[1]
        store = dist.TCPStore("127.0.0.1", port, None, True, timeout, wait_for_workers=False,
                              master_listen_fd=listener.fileno())
        listener.detach()  # the store owns the socket now and closes it when it is freed
    try:
        yield port
    finally:
        del store


def loopback_process_group(rank: int, world_size: int, port: int, timeout: timedelta) -> None:
    """The process group of a local job, reachable from this machine only ([Note: loopback only]),
    through the store `hosted_store` serves on `port` ([Note: a port held from the start]).

    [Note: loopback only] `init_process_group` from MASTER_ADDR/MASTER_PORT makes rank 0's TCPStore
    listen on every interface (`[::]`), whatever MASTER_ADDR says: any host that reaches the machine
    could connect to a local job. The launcher binds the store's listening socket to 127.0.0.1 itself
    and hands it to the store (`master_listen_fd`, as torchrun's agent hands over its own socket);
    gloo and NCCL pick their interfaces from GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME, which the
    launcher sets to the loopback interface unless the user set them."""
    import torch.distributed as dist

    from autoplan.runtime.api import default_device

    store = dist.TCPStore("127.0.0.1", port, world_size, False, timeout)
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(default_device())
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)


def startup_timeout(timeout: timedelta) -> timedelta:
    """The wait allowed while the ranks start: `timeout`, or STARTUP_TIMEOUT_S if that is longer.

    [Note: start-up and step timeouts] `--timeout` is "seconds any rank waits on another" once the
    ranks run steps. Start-up waits are on peers that are still importing torch or tracing the
    model, which takes seconds to minutes whatever the run's timeout: the process group, its
    subgroups and the pipeline's transfers are made with this allowance (`loopback_process_group`,
    `partition`), then `bound_waits` sets every one of them to `timeout` before the first step."""
    return max(timeout, timedelta(seconds=STARTUP_TIMEOUT_S))


def bound_waits(pm, timeout: timedelta) -> None:
    """After start-up: every process group this rank belongs to (the world, the meshes' and
    partition's subgroups) and the pipeline's sends and receives time out after `timeout`."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    for group in list(c10d._world.pg_map):
        if group is not dist.GroupMember.NON_GROUP_MEMBER:
            c10d._set_pg_timeout(timeout, group)
    pm.executor.comm.timeout = timeout


def loopback_interface() -> str:
    """The name of the loopback interface ("lo" on Linux, "lo0" on macOS and the BSDs)."""
    with contextlib.suppress(OSError, AttributeError):
        for _, name in socket.if_nameindex():
            if name.startswith("lo"):
                return name
    return "lo"
