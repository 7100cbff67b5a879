"""Whether a store encodes its new chunks (coordinator/dataplane/codec.py) or sends them RAW.

Encoding costs CPU on the source's host and saves bytes on every link the chunk crosses
(the source's, node to node down the chain, and back at gather). The store encodes before
it sends, so encoding pays when

    S / encode_rate + S / (ratio x link_rate)  <  S / link_rate,
    i.e.  link_rate  <  encode_rate x (1 - 1 / ratio).

With the encode rate of two cores here (defaults.CODEC_ENCODE_BPS) and bf16's 1.46x, that
is links below about CODEC_ENCODE_PAYS_BELOW_BPS: every LAN up to gigabit Ethernet, never
loopback, where sending is a copy in memory at gigabytes a second. So the policy, by the
setting SMOLTORRENT_ENCODE where the store task runs (the worker's environment; there is
no command-line option for it):

    auto  (default) encode, unless every node the store can place on is on this host
          (a loopback address): there the codec could only make the store slower
    zstd  always encode (a slow or metered link, or to save the nodes' disk)
    raw   never encode (a link faster than CODEC_ENCODE_PAYS_BELOW_BPS: 10 GbE and up)

Either way a chunk is content-addressed by its raw bytes, so deduplication against what
is stored works the same, and a later store finds a RAW chunk as stored as an encoded one.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable

from smoltorrent.errors import ConfigError

ENCODE_MODES = ("auto", "zstd", "raw")


def check_mode(mode: str) -> str:
    if mode not in ENCODE_MODES:
        raise ConfigError(
            f"encoding {mode!r} is not one of {', '.join(ENCODE_MODES)}: auto encodes unless"
            " every node is on this host, zstd always, raw never"
        )
    return mode


def should_encode(mode: str, hosts: Iterable[str]) -> bool:
    """Whether a store in `mode` onto nodes at `hosts` (their address's host part)
    encodes its new chunks."""
    if check_mode(mode) != "auto":
        return mode == "zstd"
    hosts = list(hosts)
    return not hosts or not all(_loopback(host) for host in hosts)


def _loopback(host: str) -> bool:
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a name: a machine of the LAN, as far as a store can tell
