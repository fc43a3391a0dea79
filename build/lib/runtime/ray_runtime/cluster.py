"""Start a private Ray instance on loopback, or join an existing cluster.

A local instance (no address) is started in-process with ``ray.init(address="local")`` so it
never attaches to somebody else's Ray on a shared machine, with every listener on 127.0.0.1:

* ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` (without it Ray on Linux replaces 127.0.0.1 by the
  routable address and the GCS and raylet listen on all interfaces) and
  ``_node_ip_address="127.0.0.1"``;
* no dashboard; a bounded object store; a private namespace and temp dir;
* token authentication with a private token (Ray 2.60 enables token auth for new local
  instances and would otherwise write ``~/.ray/auth_token``), unless ``RAY_AUTH_MODE`` is set.

After the start, :func:`check_loopback` inspects the listening sockets of the instance's
processes (:func:`listening_addresses`) and fails if any listens beyond loopback. Shutdown
is in-process (``ray.shutdown()``), which stops only this instance: never ``ray stop``.

Hygiene: the private temp folder is 0700 and nothing in it is group/other-writable (Ray
makes its folders 0777; :meth:`ClusterHandle.tighten` undoes that); the temp folder and the
token are removed on every exit path (failed start included), and folders left by a run
that was killed (``kill -9``) are removed by the next start (:func:`sweep_stale`).

The instance dies with its driver, whatever kills it (:mod:`.reaper`): every process of it
carries ``DTA_RAY_INSTANCE=<token>`` in its environment, and a watcher in its own session
kills them all (and removes the private folders) once the driver is gone -- SIGKILL
included; after a normal ``shutdown`` it kills what ``ray.shutdown()`` left.

Joining: an address on loopback (``127.0.0.1:PORT``, ``localhost:PORT``) stays on loopback
on the client too (without it Ray swaps in the machine's routable address and waits ~5
minutes on a loopback-only head); the address is probed first, so nothing listening is an
error within seconds.
"""
from __future__ import annotations

import ipaddress
import os
import secrets
import shutil
import socket
import stat
import tempfile
import time
from dataclasses import dataclass, field

import psutil

LOOPBACK_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
OWNER_FILE = ".dta-owner-pid"  # in each private folder: "<pid> <pid namespace>" of its creator
PRIVATE_PREFIXES = ("dta-ray-", "dta-auth-", "dta-pg-")
JOIN_PROBE_S = 5.0


class ClusterError(RuntimeError):
    pass


# ---------------------------------------------------------------------- listeners --
@dataclass(frozen=True)
class Listener:
    pid: int
    name: str
    ip: str
    port: int

    @property
    def loopback(self) -> bool:
        return is_loopback(self.ip)


def is_loopback(ip: str) -> bool:
    try:
        addr = ipaddress.ip_address(ip.split("%")[0])
    except ValueError:
        return False
    mapped = getattr(addr, "ipv4_mapped", None)  # ::ffff:127.0.0.1
    return (mapped or addr).is_loopback


def listening_addresses(pids) -> list[Listener]:
    """Every TCP/UDP socket in LISTEN state (TCP) or bound (UDP) of the given processes."""
    out = []
    for pid in sorted(set(int(p) for p in pids)):
        try:
            proc = psutil.Process(pid)
            name = proc.name()
            conns = proc.net_connections(kind="inet")
        except (psutil.NoSuchProcess, psutil.ZombieProcess):
            continue
        except psutil.AccessDenied as exc:
            raise ClusterError(f"cannot inspect the sockets of process {pid}: {exc}") from None
        for c in conns:
            if not c.laddr:
                continue
            if c.type == socket.SOCK_STREAM and c.status != psutil.CONN_LISTEN:
                continue
            if c.type == socket.SOCK_DGRAM and c.raddr:  # connected UDP: not a listener
                continue
            out.append(Listener(pid, name, c.laddr.ip, c.laddr.port))
    return out


def process_tree(root_pid: int | None = None) -> list[int]:
    """``root_pid`` (default: this process) and all its descendants."""
    root = psutil.Process(root_pid or os.getpid())
    return [root.pid] + [p.pid for p in root.children(recursive=True)]


def check_loopback(pids) -> list[Listener]:
    listeners = listening_addresses(pids)
    bad = [x for x in listeners if not x.loopback]
    if bad:
        shown = ", ".join(f"{x.name} (pid {x.pid}) on {x.ip}:{x.port}" for x in bad)
        raise ClusterError(f"Ray listens beyond loopback: {shown}")
    return listeners


# ------------------------------------------------------------------------- auth --
AUTH_VARS = ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN_PATH")


def ensure_local_auth(directory: str) -> dict | None:
    """Token auth for a local instance with a private token in ``directory``, unless the
    user chose a mode (``RAY_AUTH_MODE`` set): then nothing changes and None is returned.

    Otherwise the variables are set for this process (Ray's processes inherit them) and
    their previous values are returned, for :func:`restore_auth` at shutdown."""
    if os.environ.get("RAY_AUTH_MODE") is not None:
        return None
    path = os.path.join(directory, "auth_token")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32))
    previous = {k: os.environ.get(k) for k in AUTH_VARS}
    os.environ["RAY_AUTH_MODE"] = "token"
    os.environ["RAY_AUTH_TOKEN_PATH"] = path
    _refresh_ray_auth()
    return previous


def restore_auth(previous: dict | None) -> None:
    if previous is None:
        return
    for key, value in previous.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    _refresh_ray_auth()


def _refresh_ray_auth() -> None:
    """Make an already-imported Ray see the new auth environment (Ray caches its config
    at import; this is what Ray itself does when it turns token auth on)."""
    try:
        from ray._raylet import AuthenticationTokenLoader, Config
    except ImportError:
        return
    Config.initialize("")
    AuthenticationTokenLoader.instance().reset_cache()


# ------------------------------------------------------------------------ cluster --
@dataclass
class ClusterHandle:
    """What :func:`start_or_join` did; :meth:`shutdown` undoes exactly that."""

    local: bool  # a private instance started by this process
    address: str | None  # the GCS address
    temp_dir: str | None = None
    owned_temp_dir: bool = False
    reused: bool = False  # Ray was already initialized: shutdown leaves it alone
    listeners: list = field(default_factory=list)
    start_s: float = 0.0
    auth_dir: str | None = None  # the private token's directory (removed at shutdown)
    auth_restore: dict | None = None  # auth variables to restore at shutdown
    token: str | None = None  # the local instance's DTA_RAY_INSTANCE marker (.reaper)
    watcher: object = None  # the .reaper process that kills the instance with its driver

    def tighten(self) -> None:
        """No group/other access to the private temp folder; nothing in it writable by
        group or others (Ray chmods its session folders 0777)."""
        if self.local and self.owned_temp_dir and self.temp_dir:
            tighten_tree(self.temp_dir)

    def pids(self) -> list[int]:
        """Processes of the local instance (this process and its descendants)."""
        return process_tree() if self.local else []

    def shutdown(self) -> None:
        import ray

        if self.reused:
            return
        if ray.is_initialized():
            ray.shutdown()
        if self.watcher is not None:  # what ray.shutdown() left of the instance
            from runtime.ray_runtime.reaper import stop_watcher

            stop_watcher(self.watcher)
            self.watcher = None
        if self.owned_temp_dir and self.temp_dir:
            shutil.rmtree(self.temp_dir, ignore_errors=True)
            self.owned_temp_dir = False
        if self.auth_dir:
            restore_auth(self.auth_restore)
            shutil.rmtree(self.auth_dir, ignore_errors=True)
            self.auth_dir = self.auth_restore = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()


def start_or_join(ray_cfg, *, address: str | None = None, log_to_driver: bool | None = None,
                  verify_loopback: bool = True) -> ClusterHandle:
    """Join ``address`` (argument, else ``ray_cfg.address``), or start a private local
    instance on 127.0.0.1 when neither is given. Reuses an already-initialized Ray."""
    import ray

    address = address or (ray_cfg.address if ray_cfg is not None else None)
    namespace = getattr(ray_cfg, "namespace", None) or "dta"
    if log_to_driver is None:
        log_to_driver = bool(getattr(ray_cfg, "log_to_driver", True))
    if ray.is_initialized():
        ctx = ray.get_runtime_context()
        return ClusterHandle(local=False, address=getattr(ctx, "gcs_address", None),
                             reused=True)
    t0 = time.perf_counter()
    sweep_stale()
    if address:
        kw = {}
        host = probe_address(address)
        if host is not None and is_loopback(_resolve(host)):
            _loopback_only()  # the client stays on loopback too
            kw["_node_ip_address"] = "127.0.0.1"
        try:
            info = ray.init(address=address, namespace=namespace, log_to_driver=log_to_driver,
                            **kw)
        except ConnectionError as exc:
            raise ClusterError(f"cannot join the Ray cluster at {address!r}: {exc}") from None
        except Exception as exc:
            if "auth" in type(exc).__name__.lower() or "token" in str(exc).lower():
                raise ClusterError(
                    f"the Ray cluster at {address!r} refused the connection ({exc}); it uses "
                    "token authentication: set RAY_AUTH_MODE=token and RAY_AUTH_TOKEN_PATH "
                    "(or RAY_AUTH_TOKEN) to the cluster's token") from None
            raise
        return ClusterHandle(local=False, address=info.address_info.get("gcs_address"),
                             start_s=time.perf_counter() - t0)

    _loopback_only()
    owned = ray_cfg is None or not getattr(ray_cfg, "temp_dir", None)
    # Ray's socket paths must stay short: a short private directory under /tmp.
    temp_dir = private_dir("dta-ray-", "/tmp") if owned else ray_cfg.temp_dir
    auth_dir = private_dir("dta-auth-")
    auth_restore = ensure_local_auth(auth_dir)
    if auth_restore is None:  # the user's own auth settings: no private token
        shutil.rmtree(auth_dir, ignore_errors=True)
        auth_dir = None
    object_store = int(getattr(ray_cfg, "object_store_memory", 256 * 1024 ** 2))
    num_cpus = None
    if ray_cfg is not None:
        # Enough CPU slots for the workers even on a 2-core machine (they share cores).
        need = ray_cfg.num_workers * float(ray_cfg.cpus_per_worker)
        num_cpus = max(int(-(-need // 1)), psutil.cpu_count() or 1)
    from runtime.ray_runtime.reaper import MARKER, start_watcher, stop_watcher

    token = secrets.token_hex(8)  # every process of the instance carries it (.reaper)
    watcher = start_watcher(token, [d for d in (temp_dir if owned else None, auth_dir) if d])
    os.environ[MARKER] = token
    try:
        info = ray.init(address="local", _node_ip_address="127.0.0.1", include_dashboard=False,
                        object_store_memory=object_store, namespace=namespace,
                        _temp_dir=temp_dir, num_cpus=num_cpus, log_to_driver=log_to_driver,
                        configure_logging=True, logging_level="WARNING")
    except Exception:
        stop_watcher(watcher)  # and what a failed start left
        if owned:
            shutil.rmtree(temp_dir, ignore_errors=True)
        if auth_dir:
            restore_auth(auth_restore)
            shutil.rmtree(auth_dir, ignore_errors=True)
        raise
    finally:  # the instance's processes have it; what this process starts later does not
        os.environ.pop(MARKER, None)
    handle = ClusterHandle(local=True, address=info.address_info.get("gcs_address"),
                           temp_dir=temp_dir, owned_temp_dir=owned,
                           start_s=time.perf_counter() - t0, auth_dir=auth_dir,
                           auth_restore=auth_restore, token=token, watcher=watcher)
    try:
        handle.tighten()
        if verify_loopback:
            handle.listeners = check_loopback(handle.pids())
    except BaseException:
        handle.shutdown()
        raise
    return handle


# ---------------------------------------------------------------- private folders --
def _pid_namespace() -> str:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return "unknown"


def owner_record(pid: int) -> str:
    """What a private folder's owner file holds: the pid and the pid namespace it lives in (a
    pid means nothing outside its namespace: a run inside ``unshare -p`` shares /tmp)."""
    return f"{int(pid)} {_pid_namespace()}"


def private_dir(prefix: str, parent: str | None = None) -> str:
    """A fresh 0700 folder that records its owner (for :func:`sweep_stale`)."""
    path = tempfile.mkdtemp(prefix=prefix, dir=parent)
    os.chmod(path, 0o700)
    with open(os.path.join(path, OWNER_FILE), "w") as f:
        f.write(owner_record(os.getpid()))
    return path


def tighten_tree(root: str) -> None:
    os.chmod(root, 0o700)
    for base, dirs, files in os.walk(root):
        for name in dirs + files:
            path = os.path.join(base, name)
            try:
                st = os.lstat(path)
                if not stat.S_ISLNK(st.st_mode) and st.st_mode & 0o022:
                    os.chmod(path, stat.S_IMODE(st.st_mode) & ~0o022)
            except OSError:
                pass  # gone meanwhile


def sweep_stale(parents: tuple[str, ...] | None = None) -> list[str]:
    """Remove this user's private folders whose creating process is gone (a run killed
    with SIGKILL cannot clean up after itself); returns those removed. A folder made in
    another pid namespace (or recording no namespace) is left alone: its pid cannot be
    checked from here."""
    removed, here = [], _pid_namespace()
    parents = parents or tuple(dict.fromkeys(["/tmp", tempfile.gettempdir()]))
    for parent in parents:
        try:
            names = os.listdir(parent)
        except OSError:
            continue
        for name in names:
            if not name.startswith(PRIVATE_PREFIXES):
                continue
            path = os.path.join(parent, name)
            try:
                if os.lstat(path).st_uid != os.getuid() or not os.path.isdir(path):
                    continue
                with open(os.path.join(path, OWNER_FILE)) as f:
                    pid_text, _, namespace = f.read().strip().partition(" ")
                pid = int(pid_text or 0)
            except (OSError, ValueError):
                continue  # not ours, or not made by this code
            if namespace != here:
                continue  # another pid namespace's run (or an old folder): not ours to judge
            if pid and not psutil.pid_exists(pid):
                shutil.rmtree(path, ignore_errors=True)
                removed.append(path)
    return removed


# ------------------------------------------------------------------------- joining --
def _split(address: str) -> tuple[str, int] | None:
    text = address.split("://", 1)[-1]
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit():
        return None
    return host.strip("[]"), int(port)


def _resolve(host: str) -> str:
    try:
        return socket.getaddrinfo(host, None)[0][4][0]
    except OSError:
        return host


def probe_address(address: str) -> str | None:
    """The host of a ``host:port`` GCS address after checking something listens there
    (a ClusterError within seconds otherwise); None for other forms (``auto``, ``ray://``)."""
    if address == "auto" or address.startswith("ray://"):
        return None
    parts = _split(address)
    if parts is None:
        return None
    host, port = parts
    try:
        with socket.create_connection((host, port), timeout=JOIN_PROBE_S):
            pass
    except OSError as exc:
        raise ClusterError(f"cannot join the Ray cluster at {address!r}: nothing answers on "
                           f"{host}:{port} ({exc.strerror or exc}); is the head running "
                           "(`ray start --head --port PORT`)?") from None
    return host


def _loopback_only() -> None:
    """Keep a local instance on 127.0.0.1. Ray reads the variable when it is imported (and
    its processes inherit it), so an already-imported Ray gets the constant set as well."""
    os.environ.update(LOOPBACK_ENV)
    from ray._private import ray_constants

    ray_constants.ENABLE_RAY_CLUSTER = False


def cluster_has_gpus() -> bool:
    import ray

    return float(ray.cluster_resources().get("GPU", 0)) > 0
