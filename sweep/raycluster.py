"""Joining or starting the Ray cluster a sweep runs on (sweep/driver.py): `prepare_ray_auth` sets token
authentication for a cluster the driver may embed, before Ray is imported; `connect_ray` joins the cluster
`--ray-address` names (or `RAY_ADDRESS`, or a running local one) or starts an embedded one whose single node
carries every host's resource, and turns a refused or unreachable cluster into one line naming the flag
(the token's settings named, never the token), with Ray's own stderr retries kept in the sweep's log.
"""

from __future__ import annotations

import logging
import os
import secrets
import sys
from pathlib import Path

from runtime.core.errors import InputError
from sweep import hosts

log = logging.getLogger("sweep.driver")  # the driver's logger: its records read as the driver's


def prepare_ray_auth(address: str) -> None:
    """Token authentication for a Ray cluster this driver may start itself (`--ray-address local`, or
    `auto` without RAY_ADDRESS), set in the environment before Ray is imported (Ray reads it once).

    An embedded cluster's gRPC servers bind every interface whatever one asks (Ray's choice;
    ray.init's hidden `_node_ip_address` changes nothing there: measured, docs/sweep.md), so unless
    RAY_AUTH_MODE is set, the driver sets it to `token` and, when no token exists (RAY_AUTH_TOKEN,
    RAY_AUTH_TOKEN_PATH, ~/.ray/auth_token), gives the run a random one in RAY_AUTH_TOKEN, which the
    cluster's processes inherit (no file written): nobody else on the network can join the cluster
    or submit work to it. A cluster joined with `auto` that uses ~/.ray/auth_token still matches."""
    if address != "local" and not (address == "auto" and not os.environ.get("RAY_ADDRESS")):
        return
    if os.environ.get("RAY_AUTH_MODE"):
        return
    os.environ["RAY_AUTH_MODE"] = "token"
    if not (os.environ.get("RAY_AUTH_TOKEN") or os.environ.get("RAY_AUTH_TOKEN_PATH")
            or (Path.home() / ".ray" / "auth_token").is_file()):
        os.environ["RAY_AUTH_TOKEN"] = secrets.token_hex(32)


def connect_ray(address: str, host_specs, num_cpus: int | None, verbose: bool = False,  # noqa: ANN001
                extra_resources: dict[str, float] | None = None) -> tuple[bool, str | None]:
    """Join or start Ray: (True when this driver started and owns an embedded cluster, the session folder).

    Quiet unless `verbose`: the workers' output stays in Ray's session logs (in Ray's temp folder, not linked
    from --out: it goes with the cluster), Ray's own driver-side messages go to <out>/logs/sweep.log (joining a
    running cluster, also what Ray's C++ client writes to stderr: one line here instead when it is refused)."""
    import ray

    env = os.environ.get("RAY_ADDRESS")
    if address == "auto" and env:
        address = env
    quiet = {"logging_level": logging.INFO if verbose else logging.WARNING, "log_to_driver": verbose}
    if address not in ("auto", "local"):
        flag = "RAY_ADDRESS" if env and address == env else "--ray-address"
        with _stderr_captured() as said:
            try:
                ctx = ray.init(address=address, **quiet)
                exc = None
            except (ConnectionError, RuntimeError, ValueError) as e:
                exc = e
        for line in said():  # Ray's own retries (its C++ client writes them to stderr): into the sweep's log
            log.info("ray: %s", line)
        if exc is not None:
            if any(m in line for line in said() for m in AUTH_REFUSED):
                raise InputError(f"{flag} {address}: the Ray cluster refused this client's token ("
                                 f"{_token_state()}): set RAY_AUTH_MODE=token and RAY_AUTH_TOKEN_PATH (or "
                                 f"RAY_AUTH_TOKEN) to the cluster's token; for infra/local_cluster.sh run "
                                 f". {LOCAL_CLUSTER_ENV}, which sets both") from None
            raise InputError(f"{flag} {address}: cannot join the Ray cluster "
                             f"({str(exc).splitlines()[0] if str(exc) else type(exc).__name__})") from None
        return False, ctx.address_info.get("session_dir")
    if address == "auto":
        try:
            ctx = ray.init(address="auto", **quiet)
            return False, ctx.address_info.get("session_dir")
        except ConnectionError:
            pass
    # explicit: a private single-node cluster, no dashboard, with token authentication unless
    # RAY_AUTH_MODE=disabled was asked for (prepare_ray_auth, before Ray was imported)
    if os.environ.get("RAY_AUTH_MODE", "").lower() == "disabled":
        log.warning("embedded Ray without token authentication (RAY_AUTH_MODE=disabled): anyone who reaches "
                    "this machine's Ray ports can run code on it")
    # address="local": always a new cluster, never one another user left running on this machine
    resources = {**hosts.local_resources(host_specs), **(extra_resources or {})}  # its one node holds the model
    ctx = ray.init(address="local", num_cpus=num_cpus or os.cpu_count(), resources=resources,
                   include_dashboard=False, object_store_memory=256 * 2**20, **quiet)
    return True, ctx.address_info.get("session_dir")


# what Ray's client writes when the cluster wants a token it did not get (Ray 2.60: "Unauthenticated: RPC error:
# InvalidAuthToken: Authentication token is missing or incorrect")
AUTH_REFUSED = ("InvalidAuthToken", "Unauthenticated")
# infra/local_cluster.sh's client settings (its state folder: EXPERTSWEEP_LOCAL_CLUSTER, else $TMPDIR or /tmp)
LOCAL_CLUSTER_ENV = Path(os.environ.get("EXPERTSWEEP_LOCAL_CLUSTER")
                         or Path(os.environ.get("TMPDIR") or "/tmp") / "expertsweep-ray-local") / "client.env"


def _token_state() -> str:
    """What this client offered: the settings Ray reads for its token (names only, never the token)."""
    mode = os.environ.get("RAY_AUTH_MODE")
    if os.environ.get("RAY_AUTH_TOKEN"):
        where = "RAY_AUTH_TOKEN"
    elif os.environ.get("RAY_AUTH_TOKEN_PATH"):
        where = f"RAY_AUTH_TOKEN_PATH={os.environ['RAY_AUTH_TOKEN_PATH']}"
    elif (Path.home() / ".ray" / "auth_token").is_file():
        where = "~/.ray/auth_token"
    else:
        where = "no token"
    return f"RAY_AUTH_MODE={mode or 'unset'}, {where}"


class _stderr_captured:
    """File descriptor 2 into a temporary file while the block runs (Ray's C++ client logs there, outside Python's
    logging); `said()` gives its lines after the block."""

    def __enter__(self):  # noqa: ANN204
        import tempfile

        sys.stderr.flush()
        self.file = tempfile.TemporaryFile(mode="w+b")
        self.saved = os.dup(2)
        os.dup2(self.file.fileno(), 2)
        self.lines: list[str] = []
        return lambda: self.lines

    def __exit__(self, *exc: object) -> None:
        sys.stderr.flush()
        os.dup2(self.saved, 2)
        os.close(self.saved)
        self.file.seek(0)
        self.lines = [ln for ln in self.file.read().decode(errors="replace").splitlines() if ln.strip()]
        self.file.close()
