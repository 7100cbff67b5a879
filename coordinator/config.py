"""Settings read from the environment, in one place.

Numbers with units live in smoltorrent/defaults.py; this module only says
which environment variable overrides which of them.
"""

from __future__ import annotations

import os
import re
import socket
from pathlib import Path

from smoltorrent import defaults
from smoltorrent.cluster_key import KEY_FILE_NAME, key_from_env, read_key_file
from smoltorrent.errors import ConfigError

REDIS_SCHEMES = ("redis://", "rediss://", "unix://")


def home() -> Path:
    """SMOLTORRENT_HOME (default ~/.smoltorrent): embedded Redis, local node data, logs.

    Read at each call, parsed only when it changed: pathlib interns each part it parses,
    and a part no live path holds leaves Python's interned table and comes back at the
    next parse. A pool child asks several times per chunk, and that churn doubled the
    table it shares with the worker (1.9 MB private per child at 16 GB); the Path kept
    here holds its parts, so they stay (bench/RESULTS.md, 2026-11-29 chainmem)."""
    global _home
    raw = (os.environ.get("SMOLTORRENT_HOME"), os.environ.get("HOME"))  # "~" follows HOME
    if _home is None or _home[0] != raw:
        path = Path(raw[0] if raw[0] is not None else Path.home() / ".smoltorrent")
        _home = (raw, path.expanduser())
    return _home[1]


_home: tuple[tuple[str | None, str | None], Path] | None = None  # (environment, home())


def shown_url(url: str) -> str:
    """`url` with its password masked, as Celery's banner shows it: what a command prints
    ends up in logs and bug reports."""
    scheme, sep, rest = url.partition("://")
    userinfo, at, hostpart = rest.rpartition("@")
    if not (sep and at and ":" in userinfo):
        return url
    return f"{scheme}://{userinfo.split(':', 1)[0]}:**@{hostpart}"


def redis_url_from_env() -> str | None:
    url = os.environ.get("SMOLTORRENT_REDIS_URL") or None
    if url is not None and not url.startswith(REDIS_SCHEMES):
        raise ConfigError(
            f"SMOLTORRENT_REDIS_URL={shown_url(url)!r} is not a Redis URL: write it as"
            " redis://HOST:PORT/0 (e.g. redis://127.0.0.1:6379/0), or unset it to use the"
            " embedded Redis"
        )
    return url


def redis_advice() -> str:
    """What to do about a Redis that does not answer, in the words of whose it is. A shared
    one (SMOLTORRENT_REDIS_URL): it is the cluster's, so bring it back or reach it; unsetting
    the variable would give this machine an empty Redis of its own, no fix. The embedded
    one: `smoltorrent redis status` says how it is."""
    url = redis_url_from_env()
    if url:
        return (
            f"this machine uses the cluster's Redis at {shown_url(url)} (SMOLTORRENT_REDIS_URL):"
            " check that it runs and that this machine reaches it (host, port, password,"
            " firewall), then try again"
        )
    return "start it (`smoltorrent redis status` says how the embedded Redis is), then try again"


def host_id() -> str:
    """This machine's name for routing: store and gather run where the file is."""
    raw = os.environ.get("SMOLTORRENT_HOST_ID") or socket.gethostname()
    return re.sub(r"[^A-Za-z0-9_.-]", "-", raw) or "localhost"


def cluster_key_file() -> Path:
    """Where `smoltorrent init` writes the cluster key, and where this side finds it."""
    return home() / KEY_FILE_NAME


def cluster_key() -> bytes | None:
    """SMOLTORRENT_CLUSTER_KEY, else the file SMOLTORRENT_CLUSTER_KEY_FILE names, else
    <home>/cluster.key if it exists, else None (smoltorrent/cluster_key.py). Read at each
    call: a file is a few bytes, and a key replaced (`init --force`) is seen at once."""
    key = key_from_env()
    if key is not None:
        return key
    path = cluster_key_file()
    return read_key_file(path) if path.exists() else None


GATHER_DIRS_ENV = "SMOLTORRENT_GATHER_DIRS"


def gather_dirs() -> list[Path]:
    """Where a worker writes a gather sent to it through the broker (whoever reaches the
    broker can send one): the staging directory, where smoltorrent.load gathers, and
    SMOLTORRENT_GATHER_DIRS (separated by os.pathsep). Never the whole home: a message
    could otherwise overwrite a user's files. A gather run in the asking process (the CLI,
    load) writes wherever its user can."""
    text = os.environ.get(GATHER_DIRS_ENV, "")
    return [home() / "staging", *(Path(p).expanduser() for p in text.split(os.pathsep) if p)]


def _int_from_env(name: str, default: int, what: str) -> int:
    text = os.environ.get(name)
    if text is None or text == "":
        return default
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise ConfigError(
            f"{name}={text!r} is not {what}: set a whole number such as {default}, or unset it"
            f" for the default ({default})"
        )
    return value


def transfer_retries() -> int:
    return _int_from_env(
        "SMOLTORRENT_TRANSFER_RETRIES", defaults.TRANSFER_RETRIES, "a number of retries"
    )


def local_keep() -> int:
    """Committed saves kept on this machine for load to read first (SMOLTORRENT_LOCAL_KEEP;
    0 keeps none)."""
    return _int_from_env("SMOLTORRENT_LOCAL_KEEP", defaults.LOCAL_KEEP, "a number of saves")


def local_tier_bytes() -> int:
    """Bytes the saves kept on this machine may take together (SMOLTORRENT_LOCAL_BYTES)."""
    return _int_from_env("SMOLTORRENT_LOCAL_BYTES", defaults.LOCAL_TIER_BYTES, "a number of bytes")


def writer_nice() -> int:
    """The nice value, at least, of a trainer's writer process and of its autogroup
    (SMOLTORRENT_WRITER_NICE; 0 runs it as its trainer)."""
    what = f"a nice value from 0 to {defaults.WRITER_NICE_MAX}"
    value = _int_from_env("SMOLTORRENT_WRITER_NICE", defaults.WRITER_NICE, what)
    if value > defaults.WRITER_NICE_MAX:
        raise ConfigError(
            f"SMOLTORRENT_WRITER_NICE={value} is not {what}: set one such as "
            f"{defaults.WRITER_NICE}, or unset it for the default ({defaults.WRITER_NICE})"
        )
    return value


def socket_timeout() -> float:
    """Seconds a worker waits on a silent node (SMOLTORRENT_SOCKET_TIMEOUT_S, the variable
    nodes read too, default SOCKET_TIMEOUT_S): how soon a hung node is replaced."""
    text = os.environ.get("SMOLTORRENT_SOCKET_TIMEOUT_S")
    if not text:
        return defaults.SOCKET_TIMEOUT_S
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not 0 < value < float("inf"):
        raise ConfigError(
            f"SMOLTORRENT_SOCKET_TIMEOUT_S={text!r} is not a positive number of seconds: fix"
            " it or unset it for the default"
        )
    return value


BWLIMIT_ENV = "SMOLTORRENT_BWLIMIT"
_RATE = re.compile(r"(?P<number>\d+(?:\.\d*)?|\.\d+)\s*(?P<unit>[a-z]*?)(?:/s)?", re.I)
# Decimal like the MB/s of every summary line; binary and bit units as rsync and tc write them.
_RATE_UNITS = {
    "": 1, "b": 1, "k": 1e3, "kb": 1e3, "m": 1e6, "mb": 1e6, "g": 1e9, "gb": 1e9,
    "kib": 2**10, "mib": 2**20, "gib": 2**30,
    "kbit": 1e3 / 8, "mbit": 1e6 / 8, "gbit": 1e9 / 8,
}  # fmt: skip


def parse_rate(text: str) -> int:
    """A rate in bytes per second from text such as 50M (50 MB/s), 12.5MB/s, 400Mbit, 8MiB
    or 0 (no limit); ValueError, saying what is understood, otherwise."""
    match = _RATE.fullmatch(text.strip())
    unit = match["unit"].lower() if match else None
    if unit not in _RATE_UNITS:
        raise ValueError(
            f"{text!r} is not a rate: write bytes per second such as 50M (50 MB/s), 8MiB,"
            " or a bit rate such as 400Mbit; 0 means no limit"
        )
    return int(float(match["number"]) * _RATE_UNITS[unit])


def bwlimit() -> int | None:
    """The cluster's default limit on a store's or gather's traffic through this host, in
    bytes/s (SMOLTORRENT_BWLIMIT, e.g. 50M; 0: none; None when unset), for a store or
    gather that names none (--bwlimit): checkpoint traffic then leaves room for training's
    own. Set it where the worker runs; a CLI or API call that has it set passes it on."""
    text = os.environ.get(BWLIMIT_ENV, "").strip()
    if not text:
        return None
    try:
        return parse_rate(text)
    except ValueError as exc:
        raise ConfigError(f"{BWLIMIT_ENV}: {exc}; or unset it for no limit") from None


def bwlimit_for(named: str | int | None) -> int:
    """The bytes/s a store or gather keeps to (0: no limit): the one its request named,
    else this process's SMOLTORRENT_BWLIMIT."""
    if named is not None and named != "":
        return int(named)
    return bwlimit() or 0


def chain_replication() -> bool:
    """Whether a store of R >= 2 copies sends each shard once, down a chain of its nodes
    (SMOLTORRENT_CHAIN, default 1); 0 sends every copy from this host, one transfer each."""
    return os.environ.get("SMOLTORRENT_CHAIN", "1").strip() not in ("0", "false", "no", "off")


def worker_mingle() -> bool:
    """Whether a starting worker asks the others for their revoked tasks and clocks
    (SMOLTORRENT_WORKER_MINGLE, default 1: Celery's default). Asking waits a whole second
    for answers at every worker start; smoltorrent revokes nothing, so 0 (the tests, where
    workers start hundreds of times) loses nothing it uses."""
    return os.environ.get("SMOLTORRENT_WORKER_MINGLE", "1").strip() not in (
        "0",
        "false",
        "no",
        "off",
    )


def chunked_store() -> bool:
    """Whether a store cuts a checkpoint into content-addressed chunks (manifest schema 3;
    SMOLTORRENT_CHUNKS, default defaults.CHUNKED_STORE: on); 0 stores whole-shard blobs
    (schema 2), as before."""
    given = os.environ.get("SMOLTORRENT_CHUNKS", "").strip().lower()
    if not given:
        return defaults.CHUNKED_STORE
    return given not in ("0", "false", "no", "off")


def encode_mode() -> str:
    """How a chunked store encodes new chunks (SMOLTORRENT_ENCODE: auto, zstd or raw;
    default auto): see coordinator/plan/encoding.py."""
    return os.environ.get("SMOLTORRENT_ENCODE", "auto").strip().lower() or "auto"


def spool_root() -> Path:
    """Where a store keeps the chunks it encoded until they are on the nodes
    (SMOLTORRENT_HOME/spool, one directory per version)."""
    return home() / "spool"


def transfer_time_base() -> int:
    """Seconds every transfer's time limit starts from (SMOLTORRENT_TRANSFER_TIME_BASE_S)."""
    return _int_from_env(
        "SMOLTORRENT_TRANSFER_TIME_BASE_S", defaults.TRANSFER_TIME_BASE_S, "a number of seconds"
    )


def no_node_retries() -> int:
    """Times a store that finds no live node backs off and plans again before it fails
    (SMOLTORRENT_NO_NODE_RETRIES)."""
    return _int_from_env(
        "SMOLTORRENT_NO_NODE_RETRIES", defaults.NO_NODE_RETRIES, "a number of retries"
    )


def _seconds_from_env(name: str, default: float) -> float:
    """A positive number of seconds from `name`, else `default`; ConfigError if malformed."""
    text = os.environ.get(name)
    if text is None or text == "":
        return default
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 < value < float("inf"):
        raise ConfigError(
            f"{name}={text!r} is not a positive number of seconds: set one such as {default:g},"
            f" or unset it for the default ({default:g})"
        )
    return value


def health_interval() -> float:
    """Seconds between health sweeps (SMOLTORRENT_HEALTH_INTERVAL_S)."""
    return _seconds_from_env("SMOLTORRENT_HEALTH_INTERVAL_S", defaults.HEALTH_INTERVAL_S)


def dead_after() -> float:
    """Seconds of silence after which a node is dead (SMOLTORRENT_DEAD_AFTER_S)."""
    return _seconds_from_env("SMOLTORRENT_DEAD_AFTER_S", defaults.DEAD_AFTER_S)


def step_patience() -> float:
    """Seconds save_sharded(wait=True) waits for a rank that has not begun its part of the
    step (SMOLTORRENT_STEP_PATIENCE_S)."""
    return _seconds_from_env("SMOLTORRENT_STEP_PATIENCE_S", defaults.STEP_PATIENCE_S)


def scrub_interval() -> float:
    """Seconds between scrub sweeps (SMOLTORRENT_SCRUB_INTERVAL_S)."""
    return _seconds_from_env("SMOLTORRENT_SCRUB_INTERVAL_S", defaults.SCRUB_INTERVAL_S)


def repair_interval() -> float:
    """Seconds between repair sweeps (SMOLTORRENT_REPAIR_INTERVAL_S)."""
    return _seconds_from_env("SMOLTORRENT_REPAIR_INTERVAL_S", defaults.REPAIR_INTERVAL_S)


def repair_backoff() -> float:
    """Seconds a repair target waits after a failed copy, doubling
    (SMOLTORRENT_REPAIR_BACKOFF_S)."""
    return _seconds_from_env("SMOLTORRENT_REPAIR_BACKOFF_S", defaults.REPAIR_BACKOFF_S)


def repair_backoff_max() -> float:
    """The longest repair backoff, in seconds: at least the first one."""
    return max(defaults.REPAIR_BACKOFF_MAX_S, repair_backoff())


def repairs_per_node() -> int:
    """Repair sessions one node takes part in at once (SMOLTORRENT_REPAIRS_PER_NODE): a
    safety cap beside the repair rate (repair_bps)."""
    value = _int_from_env(
        "SMOLTORRENT_REPAIRS_PER_NODE", defaults.REPAIRS_PER_NODE, "a number of copies"
    )
    return max(value, 1)


REPAIR_BPS_ENV = "SMOLTORRENT_REPAIR_BPS"


def repair_bps() -> int:
    """The bytes/s each node's repair pushes keep to together (SMOLTORRENT_REPAIR_BPS, a
    rate as SMOLTORRENT_BWLIMIT takes it, e.g. 10M or 80Mbit; 0: no limit). Read where the
    repair tasks run and sent with each push: the node paces its pushes at it."""
    text = os.environ.get(REPAIR_BPS_ENV, "").strip()
    if not text:
        return defaults.REPAIR_BPS
    try:
        return parse_rate(text)
    except ValueError as exc:
        raise ConfigError(f"{REPAIR_BPS_ENV}: {exc}") from None


DISCOVER_ENV = "SMOLTORRENT_DISCOVER"


def discover_enabled() -> bool:
    """SMOLTORRENT_DISCOVER=1: the worker registers every node it finds over mDNS."""
    text = os.environ.get(DISCOVER_ENV, "").strip().lower()
    if text in ("", "0", "no", "off", "false"):
        return False
    if text in ("1", "yes", "on", "true"):
        return True
    raise ConfigError(f"{DISCOVER_ENV}={text!r} is not a switch: set 1 (browse) or 0 (do not)")


def check_environment() -> None:
    """Read every setting once, so a bad one is a one-line ConfigError before any work."""
    redis_url_from_env()
    transfer_retries()
    transfer_time_base()
    keep_last()
    health_interval()
    dead_after()
    repair_interval()
    repairs_per_node()
    repair_bps()
    scrub_interval()
    retention_interval()
    crosscheck_interval()
    orphan_grace()
    discover_enabled()
    bwlimit()
    cluster_key()


def host_queue(host: str) -> str:
    return f"host.{host}"


def transfer_queue(host: str) -> str:
    return f"transfers.{host}"


CONTROL_QUEUE = "control"


def reconcile_interval() -> float:
    """Seconds between reconcile sweeps (SMOLTORRENT_RECONCILE_INTERVAL_S)."""
    return float(os.environ.get("SMOLTORRENT_RECONCILE_INTERVAL_S", defaults.RECONCILE_INTERVAL_S))


def reconcile_grace() -> float:
    """Seconds a step may take before the sweep re-sends it (SMOLTORRENT_RECONCILE_GRACE_S)."""
    return float(os.environ.get("SMOLTORRENT_RECONCILE_GRACE_S", defaults.RECONCILE_GRACE_S))


def keep_last() -> int:
    """Committed versions kept per name (SMOLTORRENT_KEEP_LAST, at least 1)."""
    keep = _int_from_env("SMOLTORRENT_KEEP_LAST", defaults.KEEP_LAST, "a number of versions")
    if keep < 1:
        raise ConfigError(
            "SMOLTORRENT_KEEP_LAST=0 would leave a name with no version to gather: set 1 or"
            f" more, or unset it for the default ({defaults.KEEP_LAST})"
        )
    return keep


def retention_interval() -> float:
    """Seconds between retention sweeps (SMOLTORRENT_RETENTION_INTERVAL_S)."""
    return _seconds_from_env("SMOLTORRENT_RETENTION_INTERVAL_S", defaults.RETENTION_INTERVAL_S)


def crosscheck_interval() -> float:
    """Seconds between crosscheck sweeps (SMOLTORRENT_CROSSCHECK_INTERVAL_S)."""
    return _seconds_from_env("SMOLTORRENT_CROSSCHECK_INTERVAL_S", defaults.CROSSCHECK_INTERVAL_S)


def orphan_grace() -> float:
    """Seconds an unused copy stays before it is collected (SMOLTORRENT_ORPHAN_GRACE_S;
    0 collects an orphan on the pass after the one that found it)."""
    if os.environ.get("SMOLTORRENT_ORPHAN_GRACE_S", "").strip() == "0":
        return 0.0
    return _seconds_from_env("SMOLTORRENT_ORPHAN_GRACE_S", defaults.ORPHAN_GRACE_S)
