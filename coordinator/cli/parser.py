"""The command line's grammar: every command, its arguments and their help, and the
parser that hands a usage error back to main() instead of exiting (main reports it, as
JSON under --json). Building it imports none of the commands' modules.
"""

from __future__ import annotations

import argparse

from coordinator import config
from smoltorrent import __version__, defaults
from worker_server.options import add_serve_arguments, tcp_port


def _rate(text: str) -> int:
    try:
        return config.parse_rate(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _bwlimit_argument(parser: argparse.ArgumentParser, verb: str) -> None:
    parser.add_argument(
        "--bwlimit",
        type=_rate,
        metavar="RATE",
        help=f"{verb} at most RATE through this host's link, all parallel transfers together,"
        " so training's own traffic keeps the rest: 50M (50 MB/s), 8MiB, 400Mbit; 0 for no"
        f" limit (default: ${config.BWLIMIT_ENV}, else none)",
    )


class ParseError(Exception):
    def __init__(self, parser: argparse.ArgumentParser, message: str) -> None:
        super().__init__(message)
        self.parser = parser


class Parser(argparse.ArgumentParser):
    """argparse that lets main() report usage errors itself (as JSON under --json)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise ParseError(self, message)


def _count(minimum: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = minimum - 1
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number >= {minimum}")
        return value

    parse.__name__ = f"number >= {minimum}"
    return parse


EPILOG = """\
Quick start on one machine (everything local, nothing to configure):
  smoltorrent demo

A real cluster across machines (a node with no cluster key listens on loopback only):
  on the training box:    smoltorrent init             # the cluster key file, and what
                                                       # to run where (printed)
  copy the key file to every machine: ~/.smoltorrent/cluster.key
  on every machine:       export SMOLTORRENT_REDIS_URL=redis://:<password>@<redis host>:6379/0
  on each storage node:   smoltorrent serve --key-file ~/.smoltorrent/cluster.key \
                              --data-dir /srv/smoltorrent
  on the training box:    smoltorrent nodes add pi1:7411 pi2:7411 pi3:7411 pi4:7411
                          smoltorrent worker &          # runs the transfers
                          smoltorrent store ckpt/step_100.safetensors
  on any machine:         smoltorrent gather step_100.safetensors -o restored.safetensors
                          (a machine that only reads needs no worker)

Environment:
  SMOLTORRENT_REDIS_URL    Redis for metadata and Celery (default: an embedded one)
  SMOLTORRENT_HOME         state directory (default ~/.smoltorrent)
  SMOLTORRENT_CLUSTER_KEY_FILE  the cluster key file (default $SMOLTORRENT_HOME/cluster.key);
                           nodes with a key refuse unauthenticated peers
  SMOLTORRENT_CLUSTER_KEY  the key itself, instead of a file
"""


def _json_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--json", action="store_true", help="print JSON for scripts (errors too: error, hint)"
    )


def build_parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="smoltorrent",
        description="Keep .safetensors training checkpoints on a cluster of cheap storage "
        "nodes: sharded at tensor boundaries, replicated, verified with SHA-256, and "
        "gathered back byte-identical.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    i = sub.add_parser(
        "init",
        help="make the cluster key file and print what to run on each machine",
        description="Write a new random cluster key to $SMOLTORRENT_HOME/cluster.key"
        " (~/.smoltorrent/cluster.key; mode 0600) and print what to run on each storage node"
        " and on each other training or reading machine. Every node and machine of the"
        " cluster uses this one key: nodes refuse whoever cannot prove it.",
    )
    i.add_argument(
        "--force",
        action="store_true",
        help="replace an existing key (every node and machine then needs the new one)",
    )

    s = sub.add_parser("serve", help="run a shard server (on each storage node)")
    add_serve_arguments(s)

    n = sub.add_parser("nodes", help="register, list and remove storage nodes")
    nsub = n.add_subparsers(dest="nodes_command", required=True, metavar="ACTION")
    na = nsub.add_parser("add", help="register nodes by address (each is contacted)")
    na.add_argument(
        "addresses",
        nargs="+",
        metavar="HOST[:PORT]",
        help=f"node addresses; the port defaults to {defaults.DEFAULT_PORT}",
    )
    na.add_argument(
        "--timeout",
        type=float,
        default=defaults.CONNECT_TIMEOUT_S,
        metavar="S",
        help="seconds each node has to answer (default %(default)s)",
    )
    _json_flag(na)
    nl = nsub.add_parser("ls", help="list registered nodes and whether they answer")
    _json_flag(nl)
    nr = nsub.add_parser("rm", help="forget a node (by id, id prefix or address)")
    nr.add_argument("node")
    _json_flag(nr)

    dc = sub.add_parser(
        "discover",
        help="find storage nodes on this network over mDNS (and register them)",
        description="Browse _smoltorrent._tcp.local. for a few seconds and list every node that"
        " answers: id, address, protocol version, metrics port, and whether it is registered"
        " here. With --register, register the new ones and move known ones that changed"
        " address (by node id: their shards stay theirs). Where multicast does not reach, use"
        " `smoltorrent nodes add HOST`.",
    )
    dc.add_argument("--register", action="store_true", help="register what answers")
    dc.add_argument(
        "--timeout",
        type=float,
        default=defaults.DISCOVER_TIMEOUT_S,
        metavar="S",
        help=f"seconds to listen (default {defaults.DISCOVER_TIMEOUT_S:g})",
    )
    _json_flag(dc)

    w = sub.add_parser("worker", help="run a Celery worker for this host's queues")
    w.add_argument(
        "--concurrency",
        type=_count(1),
        default=defaults.WORKER_CONCURRENCY,
        help=f"tasks this worker runs at once, each in its own process (default"
        f" {defaults.WORKER_CONCURRENCY}; a repair session holds one while its nodes copy)",
    )
    w.add_argument(
        "--loglevel",
        default="INFO",
        help="INFO (default): one line per task that ends, retries or fails (event=...),"
        " and Celery's own; WARNING: only what needs a look",
    )
    w.add_argument(
        "--metrics-port",
        type=int,
        help="serve Prometheus /metrics on this port (or SMOLTORRENT_METRICS_PORT; default off)",
    )
    w.add_argument(
        "--metrics-host",
        help="address /metrics listens on (or SMOLTORRENT_METRICS_HOST; default 127.0.0.1:"
        " metrics have no login; 0.0.0.0 for a Prometheus on another machine)",
    )

    b = sub.add_parser(
        "beat",
        help="run Celery beat: the reconcile sweep (and later sweeps) on schedule",
        description="Send every sweep of beat/schedule.py on time. One instance per cluster "
        "is enough; a second one is harmless (each sweep runs under a Redis lock).",
    )
    b.add_argument(
        "--loglevel",
        default="WARNING",
        help="WARNING (default): only what needs a look; INFO: every sweep sent",
    )

    st = sub.add_parser("store", help="store a checkpoint (waits for the commit)")
    st.add_argument(
        "path",
        help="a .safetensors file on this machine, or a directory of them with its"
        " *.safetensors.index.json (the Hugging Face layout), stored as one unit",
    )
    st.add_argument(
        "--name", help="checkpoint name (default: the file name); any text but control characters"
    )
    st.add_argument(
        "--replicas",
        type=_count(1),
        help=f"copies of each shard (default {defaults.DEFAULT_REPLICAS}); more than the nodes"
        " up is refused; given for bytes already stored, their copies are raised or lowered"
        " to it",
    )
    st.add_argument("--shards", type=_count(1), help="shard count (default: number of live nodes)")
    st.add_argument(
        "--all-files",
        action="store_true",
        help="for a directory: keep every other file in it too (config, optimizer.pt,"
        " trainer_state.json, ...), byte for byte, never parsed; without it only its"
        " .safetensors files and their index are stored",
    )
    _bwlimit_argument(st, "send")
    st.add_argument(
        "--no-wait",
        action="store_true",
        help="return once the store is queued (it goes on; `smoltorrent wait ID` follows it)."
        " Ctrl-C while a store waits does the same: the store goes on, exit 3",
    )
    _json_flag(st)

    g = sub.add_parser("gather", help="rebuild a checkpoint into a file (or a directory)")
    g.add_argument(
        "name", help="a checkpoint name, NAME@LABEL (see `smoltorrent tag`) or NAME@VERSION"
    )
    g.add_argument(
        "-o",
        "--output",
        required=True,
        help="destination file, or an existing directory to write it into under the"
        " checkpoint's file name; for a directory checkpoint, a new or empty directory",
    )
    g.add_argument("--version", help="a version id prefix (default: the current version)")
    g.add_argument(
        "--tensors",
        nargs="+",
        metavar="GLOB",
        help="only the tensors these names or globs match, as a .safetensors file of their"
        " own (only their byte ranges are read, each verified)",
    )
    g.add_argument(
        "--force",
        action="store_true",
        help="replace the output even if it is a file that is not a checkpoint (without it,"
        " only an earlier .safetensors checkpoint there is replaced)",
    )
    _bwlimit_argument(g, "receive")
    _json_flag(g)

    wt = sub.add_parser(
        "wait",
        help="follow a store or gather to its end (after --no-wait or Ctrl-C)",
        description="Follow the store or gather recorded as request ID (printed by"
        " `store --no-wait`, or when Ctrl-C stopped a command waiting) until it ends, then"
        " print what that command would have printed. Exit 0 when it committed (or was"
        " gathered), 1 when it failed, 3 when interrupted again (it still goes on).",
    )
    wt.add_argument("request_id", metavar="ID")
    _json_flag(wt)

    ls = sub.add_parser("ls", help="list checkpoints and their versions")
    ls.add_argument(
        "name",
        nargs="?",
        help="list this checkpoint's versions only; NAME/ lists every name under that prefix",
    )
    _json_flag(ls)

    sh = sub.add_parser(
        "show",
        help="print a checkpoint's safetensors header (no data is gathered)",
        description="Print the safetensors header of a version (the current one by default):"
        " tensor count, dtypes, parameters and metadata, and with --tensors every tensor's"
        " name, dtype and shape. Read from the manifest in Redis: no node is asked and no"
        " tensor byte moves.",
    )
    sh.add_argument(
        "name", help="a checkpoint name, NAME@LABEL (see `smoltorrent tag`) or NAME@VERSION"
    )
    sh.add_argument("--version", help="a version id prefix (default: the current version)")
    sh.add_argument("--tensors", action="store_true", help="list every tensor")
    _json_flag(sh)

    stat = sub.add_parser("status", help="nodes, under-replicated shards, dead letters")
    _json_flag(stat)

    vf = sub.add_parser(
        "verify",
        help="re-hash every copy now and repair what is bad or missing",
        description="Scrub and repair now instead of waiting for the sweeps: every node that "
        "answers re-hashes the copies it holds of every committed version (or of NAME's), bad "
        "and missing copies are copied again node to node, and the report says what was found "
        "and done. Exit 1 if a blob is still below its copies.",
    )
    vf.add_argument("name", nargs="?", help="one checkpoint (default: all)")
    _json_flag(vf)

    rm = sub.add_parser(
        "rm",
        help="remove a checkpoint (all versions) or one version",
        description="Remove one version (--version) or every version of NAME, deleting the"
        " blobs no other version uses. Removing every version asks first on a terminal; a"
        " script says --yes (without it, and with no terminal to ask on, nothing is removed,"
        " exit 2). --dry-run lists what would go and changes nothing. A pinned version is"
        " never removed: `smoltorrent unpin` it first.",
    )
    rm.add_argument("name")
    rm.add_argument("--version", help="a version id prefix")
    rm.add_argument("-y", "--yes", action="store_true", help="remove every version without asking")
    rm.add_argument(
        "--dry-run", action="store_true", help="list the versions that would go; remove nothing"
    )
    _json_flag(rm)

    pin = sub.add_parser(
        "pin",
        help="keep a version from retention (until unpinned)",
        description="Pin a committed version (the current one unless VERSION is given):"
        " retention, the last K per name and the rules of `smoltorrent retain`, never removes"
        " it, and `rm` refuses it, until `smoltorrent unpin`. `ls` marks it pinned.",
    )
    pin.add_argument("name")
    pin.add_argument("version", nargs="?", help="a version id prefix (default: the current one)")
    _json_flag(pin)
    unpin = sub.add_parser("unpin", help="let retention remove a pinned version again")
    unpin.add_argument("name")
    unpin.add_argument("version", nargs="?", help="a version id prefix (default: the current one)")
    _json_flag(unpin)
    tag = sub.add_parser(
        "tag",
        help="label a version, to gather or show it as NAME@LABEL",
        description="Give a committed version of NAME the label LABEL (letters, digits, . _"
        " -), taken from any other version of NAME that had it: `smoltorrent gather"
        " NAME@LABEL -o OUT` and `smoltorrent show NAME@LABEL` then mean that version. A"
        " label does not keep a version from retention: pin it for that. --rm takes the label"
        " off.",
    )
    tag.add_argument("name")
    tag.add_argument("version", help="a version id prefix")
    tag.add_argument("label")
    tag.add_argument("--rm", action="store_true", help="take LABEL off that version")
    _json_flag(tag)
    retain = sub.add_parser(
        "retain",
        help="keep only the K newest checkpoints under a prefix (e.g. a run's steps)",
        description="Retention by prefix: the retention sweep keeps the K newest entries"
        " directly under PREFIX/ (a name, or a folder of names, kept or removed whole),"
        " newest by their latest store request, and removes every version of the older"
        " ones, except a pinned version, one being gathered or still pending. For a run that"
        " saves run1/step_100.safetensors, run1/step_200.safetensors, ... (one name a step,"
        " which the last K per name, SMOLTORRENT_KEEP_LAST, never prunes). Directory and"
        " sharded checkpoints are left to `rm` and save_sharded(keep=). With no argument,"
        " lists the rules.",
    )
    retain.add_argument("prefix", nargs="?", metavar="PREFIX/")
    what = retain.add_mutually_exclusive_group()
    what.add_argument("--keep", type=_count(1), metavar="K", help="entries kept under PREFIX/")
    what.add_argument("--off", action="store_true", help="drop the rule on PREFIX/")
    retain.add_argument(
        "--dry-run", action="store_true", help="list what the next sweep would remove"
    )
    _json_flag(retain)

    d = sub.add_parser("dlq", help="list and replay dead letters (tasks that failed for good)")
    dsub = d.add_subparsers(dest="dlq_command", required=True, metavar="ACTION")
    dl = dsub.add_parser("ls", help="list dead letters")
    _json_flag(dl)
    dr = dsub.add_parser("replay", help="send dead tasks again once the cause is fixed")
    dr.add_argument("task_id", nargs="?")
    dr.add_argument("--all", action="store_true", help="replay every dead letter")
    _json_flag(dr)

    rb = sub.add_parser("rebuild", help="rebuild the metadata from the manifests on the nodes")
    rb.add_argument(
        "addresses",
        nargs="*",
        metavar="HOST:PORT",
        help="nodes to read (default: the registered ones)",
    )
    _json_flag(rb)

    up = sub.add_parser(
        "up",
        help="run a whole stack here in the foreground: Redis, nodes, worker, beat (and more)",
        description="Start the embedded Redis (unless SMOLTORRENT_REDIS_URL names one), local"
        " storage nodes (registered here), the worker and beat, optionally a watcher and"
        " Flower, each as its own process with its log under $SMOLTORRENT_HOME/up/logs. Runs"
        " until SIGTERM or Ctrl-C, then stops every part in order (the worker finishes its"
        " transfers) and leaves nothing running. A part that dies stops the stack (exit 1),"
        " so launchd or systemd can restart it whole.",
    )
    up.add_argument(
        "--nodes",
        type=_count(0),
        default=defaults.UP_NODES,
        help=f"local storage nodes (default {defaults.UP_NODES}; 0 on a machine whose nodes"
        " are elsewhere)",
    )
    up.add_argument("--watch", metavar="DIR", help="also store every checkpoint written under DIR")
    up.add_argument(
        "--name-prefix", default="", metavar="P", help="with --watch: put names under P/"
    )
    up.add_argument("--flower", action="store_true", help="also run Flower (127.0.0.1)")
    up.add_argument(
        "--flower-port",
        type=tcp_port,
        default=defaults.FLOWER_PORT,
        help=f"with --flower: its port (default {defaults.FLOWER_PORT})",
    )
    up.add_argument(
        "--metrics",
        action="store_true",
        help=f"serve Prometheus metrics: worker on {defaults.UP_WORKER_METRICS}, node i on"
        f" {defaults.UP_NODE_METRICS}+i",
    )
    up.add_argument(
        "--metrics-host",
        help="with --metrics: the address they listen on (default 127.0.0.1; metrics have no"
        " login; 0.0.0.0 for a Prometheus on another machine)",
    )

    wa = sub.add_parser(
        "watch",
        help="store every checkpoint written under a directory, once it is complete",
        description="Watch DIR (recursively) and store every new or rewritten *.safetensors "
        "as the name of its path relative to DIR, once the writer has finished it. Files "
        "still being written wait in a pending list; identical content stores nothing; "
        "what changed while the watcher was down is stored at start. Runs until SIGTERM "
        "or Ctrl-C; the transfers run on this host's worker (`smoltorrent worker`).",
    )
    wa.add_argument("directory", metavar="DIR")
    wa.add_argument(
        "--name-prefix", default="", metavar="P", help="put names under P/ (e.g. the run name)"
    )
    wa.add_argument(
        "--replicas",
        type=int,
        default=defaults.DEFAULT_REPLICAS,
        help=f"copies of each shard (default {defaults.DEFAULT_REPLICAS})",
    )

    rd = sub.add_parser(
        "redis",
        help="status or stop of the Redis smoltorrent runs itself",
        description="With no SMOLTORRENT_REDIS_URL, smoltorrent starts its own redis-server "
        "(AOF on, data in $SMOLTORRENT_HOME/redis) the first time a command needs it, on the "
        "same port every time. `status` says whether it runs and where; `stop` stops it "
        "(the data stays; the next command starts it again).",
    )
    rdsub = rd.add_subparsers(dest="redis_command", required=True, metavar="ACTION")
    rds = rdsub.add_parser("status", help="is this host's embedded Redis running, and where")
    _json_flag(rds)
    rdsub.add_parser("stop", help="stop it; its data stays for the next start")

    f = sub.add_parser("flower", help="run Flower (Celery monitoring) on the same broker")
    f.add_argument(
        "--port",
        type=tcp_port,
        default=defaults.FLOWER_PORT,
        help=f"the port Flower listens on (default {defaults.FLOWER_PORT})",
    )
    f.add_argument(
        "--address",
        default="127.0.0.1",
        help="address to listen on (default 127.0.0.1: Flower has no login and can revoke"
        " tasks; beyond loopback it needs a login, -- --basic-auth=USER:PASS or -- --auth=..."
        " (or FLOWER_BASIC_AUTH / FLOWER_AUTH), or --insecure)",
    )
    f.add_argument(
        "--insecure",
        action="store_true",
        help="allow --address beyond loopback with no login (anyone who reaches it can see"
        " every task and revoke them)",
    )
    f.add_argument(
        "flower_options",
        nargs=argparse.REMAINDER,
        metavar="-- FLOWER_OPTION",
        help="passed to Flower as they are, after `--` (e.g. -- --basic-auth=user:pass);"
        " Flower also reads FLOWER_* variables (FLOWER_BASIC_AUTH=user:pass)",
    )

    demo = sub.add_parser("demo", help="a complete local cluster, end to end, then cleaned up")
    demo.add_argument("--checkpoint", help="a .safetensors file to use (default: a built one)")
    demo.add_argument(
        "--size-mb",
        type=int,
        default=defaults.DEMO_CHECKPOINT_MB,
        help="size of the built checkpoint",
    )
    demo.add_argument("--keep", action="store_true", help="leave the cluster's files behind")
    _json_flag(demo)
    return p
