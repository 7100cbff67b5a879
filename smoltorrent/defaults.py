"""Every tunable number in one place, with its unit and the reason for it.

Sections belong to the layer that reads them; keep each number's comment
saying why it has that value.
"""

# --- wire protocol (worker_server/protocol.py, worker_server/wire.py) -------

PROTOCOL_VERSION = 1  # bumped on any incompatible frame or operation change
DEFAULT_PORT = 7411  # TCP; unassigned by IANA, easy to remember
MAX_HEADER_BYTES = 64 * 1024  # bytes; JSON headers carry names and digests, never data
MAX_JSON_BODY_BYTES = 16 * 1024 * 1024  # bytes; inventories and manifests, bounded per request
MAX_BLOB_BYTES = 1 << 50  # bytes (1 PiB); a sanity cap far above any shard, below 2^63 lies
IO_CHUNK_BYTES = 1024 * 1024  # bytes; one fixed buffer per stream keeps memory flat
SOCKET_TIMEOUT_S = 30.0  # seconds without progress before a peer counts as stalled
CONNECT_TIMEOUT_S = 3.0  # seconds; a LAN node that needs longer is down for our purposes
VERIFY_TIMEOUT_S = 3600.0  # seconds; re-hashing a full node is slow on an SD card
NONCE_BYTES = 32  # bytes; HMAC challenge size, as long as the SHA-256 output
SENDFILE_MAX_BYTES = 1 << 30  # bytes per sendfile call; Linux moves at most ~2 GiB per call
MAX_KEY_CHARS = 128  # characters in a manifest key; one file name on every file system we meet

# --- shard server (worker_server/server.py) ---------------------------------

MAX_CONNECTIONS = 256  # concurrent connections per node; each costs one thread and one buffer
LISTEN_BACKLOG = 128  # pending accepts; bursts of parallel transfers at store time
ACCEPT_POLL_S = 0.5  # seconds; how soon the accept loop notices SIGTERM/SIGINT
SHUTDOWN_GRACE_S = 10.0  # seconds in-flight requests get to finish after a stop signal
CLOSE_DRAIN_S = 1.0  # seconds spent reading a rejected peer's leftovers so it can read our error
CLOSE_DRAIN_BYTES = 1024 * 1024  # bytes read and dropped at most before closing on a rejected peer

# --- planning and placement (coordinator/) ----------------------------------

DEFAULT_REPLICAS = 2  # R: survives any one node loss, doubles the bytes stored
MAX_SAFETENSORS_HEADER_BYTES = 100 * 1000 * 1000  # bytes; the limit the safetensors spec sets

# --- engines (coordinator/store_engine.py, coordinator/gather_engine.py) ----

TRANSFER_THREADS = 8  # parallel transfers per store/gather; saturates a few links, not the CPU
