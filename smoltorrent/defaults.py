"""Every tunable number in one place, with its unit and the reason for it.

Sections belong to the layer that reads them; keep each number's comment
saying why it has that value.
"""

# --- wire protocol (worker_server/protocol.py, worker_server/wire.py) -------

PROTOCOL_VERSION = 3  # bumped on any incompatible frame or operation change (3: progress)
DEFAULT_PORT = 7411  # TCP; unassigned by IANA, easy to remember
MAX_HEADER_BYTES = 64 * 1024  # bytes; JSON headers carry names and digests, never data
MAX_JSON_BODY_BYTES = 16 * 1024 * 1024  # bytes; inventories and manifests, bounded per request
# bytes a manifest may be at most, read or written in parts: a 16 GB checkpoint's is 2 MB,
# so this covers checkpoints of several TB, and a node that declares more is refused
MAX_MANIFEST_BYTES = 1024 * 1024 * 1024
# entries per page of a node's blob inventory or manifest list: a blob entry is at most 84
# bytes of JSON, a manifest key 131, so a full page stays under MAX_JSON_BODY_BYTES however
# many blobs a node holds (the client asks for pages until the node says there are no more)
LIST_PAGE_ENTRIES = 100_000
# manifest reads a rebuild keeps in flight on its one connection to a node (NodeClient.
# get_manifests): enough that the node reads the next copies while the coordinator parses
# the last; each request is ~150 bytes, so the window never fills a socket buffer and the
# node's answers never wait on a request stuck behind them
MANIFEST_GET_WINDOW = 16
MAX_BLOB_BYTES = 1 << 50  # bytes (1 PiB); a sanity cap far above any shard, below 2^63 lies
IO_CHUNK_BYTES = 1024 * 1024  # bytes; one fixed buffer per stream keeps memory flat
SOCKET_TIMEOUT_S = 30.0  # seconds without progress before a peer counts as stalled
# A peer whose host stops acknowledging (unplugged, powered off: packets vanish, no reset)
# is given up after STALL_S, not SOCKET_TIMEOUT_S: the kernel's TCP_INFO tells it from a
# peer that is alive but slow to read, which still answers window probes. 3 s is thousands
# of LAN round trips and 4 unanswered retransmissions (RTO from 200 ms, doubling); the
# Pi benchmark's lost-node store (target 1.5x line time) measured 1.50x with 5 s.
STALL_S = 3.0  # seconds without one ACK from the peer's host, with data waiting
STALL_UNANSWERED = 2  # retransmissions or window probes in a row without an answer
STALL_CHECK_S = 0.5  # seconds between looks at the kernel's TCP_INFO while a wait goes on
CONNECT_TIMEOUT_S = 3.0  # seconds; a LAN node that needs longer is down for our purposes
VERIFY_TIMEOUT_S = 3600.0  # seconds; re-hashing a full node is slow on an SD card
NONCE_BYTES = 32  # bytes; HMAC challenge size, as long as the SHA-256 output
# bytes a received blob or gathered file grows by before their writeback is started
# (worker_server/writeback.py): small enough that the final fsync finds little left to
# write, large enough that the kernel gets long sequential runs (16 MiB measured on the
# loopback bench: fsync of 400 MB after writing it, 0.34 s alone, 0.02-0.11 s this way)
WRITEBACK_CHUNK_BYTES = 16 * 1024 * 1024
SENDFILE_MAX_BYTES = 1 << 30  # bytes per sendfile call; Linux moves at most ~2 GiB per call
MAX_KEY_CHARS = 128  # characters in a manifest key; one file name on every file system we meet
# hex digits of a version's storage key (Manifest.storage_key): 128 bits of SHA-256 keep
# collisions out of reach while the key stays short enough for a file name
VERSION_KEY_CHARS = 32
VERIFY_BATCH_DIGESTS = 512  # digests per verify request; ~35 KB of JSON, under MAX_HEADER_BYTES
# seconds between progress frames of a node copying or re-hashing a blob; a node sends them
# at a quarter of its socket timeout if that is shorter, so a waiting peer never times out
PROGRESS_INTERVAL_S = 5.0
# nodes a chain_put may name to pass a blob on to: R - 1 for any R a cluster of Pis uses,
# and a bound on the connections one request can make a node open
MAX_CHAIN_FORWARD = 7
MAX_CHAIN_MESSAGE_CHARS = 300  # characters of an error sentence per node in a chain report
# A chain node waits this share of its socket timeout for the next node to take a chunk: a
# stalled next node is given up before the sender upstream gives up on this one (which
# waits a whole timeout), so the sender's copy still completes and the stall is reported.
CHAIN_DOWNSTREAM_TIMEOUT_SHARE = 0.5

# --- shard server (worker_server/server.py) ---------------------------------

# mDNS (worker_server/mdns.py, coordinator/discovery.py): RFC 6762's group and port, and
# its recommended TTLs: records naming a host or address live 2 minutes, others 75
MDNS_GROUP = "224.0.0.251"
MDNS_PORT = 5353  # UDP
MDNS_HOST_TTL_S = 120  # seconds; SRV and A records (RFC 6762 10)
MDNS_OTHER_TTL_S = 4500  # seconds; PTR and TXT records (RFC 6762 10)
# seconds between a node's checks of its own address (announced again when it changed,
# e.g. a DHCP renewal) and re-joins of the group on interfaces that came up since
MDNS_RECHECK_S = 10.0
# questions a query may ask before the responder ignores it: a browser asks one to four;
# each costs a name to parse, and 750 of them pointing at long names cost 330 ms of CPU
MDNS_MAX_QUESTIONS = 16
MDNS_MAX_NAME_BYTES = 255  # a DNS name's wire length at most (RFC 1035 2.3.4)

MAX_CONNECTIONS = 256  # concurrent connections per node; each costs one thread and one buffer
# Per remote address, so one host cannot take every slot: a coordinator runs 8 transfer
# threads per store and 4 worker processes (32 connections), plus room for a second store.
MAX_CONNECTIONS_PER_ADDRESS = 64
HANDSHAKE_DEADLINE_S = 5.0  # seconds for the whole handshake; a LAN peer needs milliseconds
# Bytes of JSON request bodies every connection together may hold: 4 full-size manifests.
# Without it 256 connections declaring 16 MiB could ask a 4 GB Pi for 4 GiB.
JSON_BODY_BUDGET_BYTES = 4 * MAX_JSON_BODY_BYTES
# A JSON body must arrive within this plus its size at MIN_TRANSFER_RATE_BPS (a 16 MiB
# manifest: 13 s), so a trickling peer cannot hold the budget for long.
JSON_BODY_DEADLINE_BASE_S = 5.0  # seconds
MAX_HAS_BODY_BYTES = 64 * 1024  # bytes; a `has` of HAS_BATCH_DIGESTS digests is ~35 KB of JSON
HAS_BATCH_DIGESTS = 512  # digests per `has` request the client sends
LISTEN_BACKLOG = 128  # pending accepts; bursts of parallel transfers at store time
ACCEPT_POLL_S = 0.5  # seconds; how soon the accept loop notices SIGTERM/SIGINT
ACCEPT_RETRY_S = 0.1  # seconds between accepts while out of file descriptors or memory
# A node's /metrics: seconds a scrape may take to send its request and read the answer (a
# LAN scrape takes milliseconds), and scrapes served at once (Prometheus sends one a target;
# more is a dashboard or a flood), so idle or greedy clients cannot pile up threads
METRICS_REQUEST_TIMEOUT_S = 5.0
METRICS_MAX_CONNECTIONS = 8
SHUTDOWN_GRACE_S = 10.0  # seconds in-flight requests get to finish after a stop signal
# seconds in all (not per read) spent reading a rejected peer's leftovers so it can read our
# error frame; a trickling peer cannot stretch it
CLOSE_DRAIN_S = 1.0
CLOSE_DRAIN_BYTES = 1024 * 1024  # bytes read and dropped at most before closing on a rejected peer
# bytes/s a node re-hashes its blobs at, at most (SMOLTORRENT_SCRUB_RATE_BPS): a quarter of
# a class-10 SD card's ~40 MB/s reads, so a scrub never starves the gathers the card serves;
# a Pi holding 100 GB still finishes a pass in under 3 hours
SCRUB_RATE_BPS = 10 * 1000 * 1000
SCRUB_CHUNK_BYTES = 256 * 1024  # bytes per scrub read; small, so pacing is smooth at low rates
SCRUB_CURSOR_SAVE_S = 5.0  # seconds between cursor saves; a restart re-reads at most this much
# seconds; from a ping on loopback (~1 ms) to a multi-GB shard over 100 Mbit/s (minutes)
NODE_REQUEST_BUCKETS_S = (0.001, 0.005, 0.025, 0.1, 0.5, 2.5, 10.0, 60.0, 300.0, 1800.0)

# --- planning and placement (coordinator/) ----------------------------------

DEFAULT_REPLICAS = 2  # R: survives any one node loss, doubles the bytes stored
# The most a request number (the one Redis counter, st:seq) may be, as a node's copy of a
# manifest gives it to a rebuild: 2^53 - 1, exact in JSON and far below the counter's end
# (2^63 - 1, which a hostile copy's seq wedged: every INCR after it fails); a cluster taking
# a thousand requests a second reaches it in 285,000 years
MAX_SEQ = 2**53 - 1
MAX_SAFETENSORS_HEADER_BYTES = 100 * 1000 * 1000  # bytes; the limit the safetensors spec sets
# fraction of the roomiest node's free space under which placement tells nodes apart: nodes
# on one disk report free bytes a few MB apart (1e-4 of 100 GB), and a node 1% smaller
# taking a blob fewer in a hundred is all the weighting could mean there
PLACEMENT_EQUAL_FREE_SHARE = 0.01
# paths of moves plan/balance.py makes, per node, to even out which node serves each shard
# (a gather's reader, a chain's head): greedy choices leave a shard or two of imbalance, so
# a few paths a node are all it takes, and a gather of 28,000 chunks never searches long
REBALANCE_ROUNDS_PER_NODE = 4

# Whether a store cuts a checkpoint into content-addressed chunks (manifest schema 3;
# SMOLTORRENT_CHUNKS overrides it). On: a fine-tune that changes 7.3% of a checkpoint
# moves 5.0% of it per replica encoded, whole shards move 100% (docs/benchmarks.md).
# Off (schema 2, whole shards) stays for the runs that measure the old format.
CHUNKED_STORE = True

# Chunks (coordinator/plan/chunks.py). A tensor this big or bigger is a chunk of its own:
# a fine-tune changes whole matrices, and a matrix packed with its neighbours would move
# them too. Below it (norms, biases, scalars: kilobytes) a chunk per tensor would cost
# more in requests, fsyncs on the node and manifest entries than it could ever save.
CHUNK_SOLO_BYTES = 1024 * 1024
# Bytes of a chunk at most: a run of small tensors stops here, a bigger tensor is cut at
# its multiples. 1.3 s on a 100 Mbit/s link, so a cut link loses little; a 16 GB
# checkpoint is about 1,000 chunks (manifest entries, Redis keys). A multiple of 8.
CHUNK_TARGET_BYTES = 16 * 1024 * 1024

# --- engines (coordinator/dataplane/store_engine.py, coordinator/dataplane/gather_engine.py) ----

TRANSFER_THREADS = 8  # parallel transfers per store/gather; saturates a few links, not the CPU
DIGEST_CACHE_ENTRIES = 4096  # files; plan digests kept per source identity (a few KiB each)
HASH_THREADS = 2  # threads hashing shards at plan time; hashlib releases the GIL, 2 cores here
# Calls a thread pool's map over chunks keeps submitted ahead of the one it waits for
# (coordinator/dataplane/ordered_map.py): more than any of our pools has threads
# (HASH_THREADS, TRANSFER_THREADS), so no thread waits for work; about 1.7 KB of Python
# objects each, against one per chunk (4,629 at 16 GB) with Executor.map.
MAP_AHEAD_CALLS = 16
# A chunked store whose lookup knows none of this many chunks in a row takes the content
# for new: it then encodes each chunk at once (one read, its raw digest from the same
# pass) and looks it up after, instead of hashing every chunk first and encoding what is
# new (two reads: 0.12 s of 1.2 s before the first byte of 200 MiB on 2 cores). A chunk
# found stored after all sends the store back to hashing first, so a fine-tune encodes
# at most a few unchanged chunks for nothing. 2: one chunk could be new by chance.
CHUNKS_NEW_BEFORE_ONE_PASS = 2

# Chunks a store records in Redis's chunks room per command (coordinator/state/chunks.py):
# entries, ~0.4 KB of arguments each. One command for a 16 GB checkpoint's 4,629 chunks
# held 1.8 MB of arguments at once in the store's pool child; 256 keep it at ~0.1 MB for
# 19 round trips (under a millisecond each beside a store of seconds). The store keeps
# its chunks' blob spans (~0.25 KB of JSON each) for its transfers as many a command too.
CHUNK_RECORD_BATCH = 256

# Blobs whose placement a gather reads per round trip (coordinator/state/blobs.py
# placement_of): a pipeline of a 16 GB checkpoint's 4,629 chunks held a command and a
# reply per chunk at once, ~5 MB of the gather's peak in Python objects; 512 keep it
# under 1 MB for 10 round trips (about a millisecond each before the first byte).
PLACEMENT_BATCH_DIGESTS = 512

# Bytes of a version's manifest written to and read from Redis per round trip
# (coordinator/state/versions.py): a store stages it in pieces before the script that
# records the version moves it in place, a commit and a gather parse it as the pieces
# come. A 16 GB checkpoint's 2 MB manifest sent whole was most of the ~5 MB of arguments
# of that script's one call, and read whole took ~6 MB at once (redis-py's read buffer,
# the reply's bytes and its text): the store's, the commit's and the gather's peaks.
# 256 KiB: 8 round trips each way at 16 GB (a millisecond each); a 1 GB checkpoint's
# 0.1 MB manifest is one piece.
MANIFEST_PIECE_BYTES = 256 * 1024
# A rebuild (coordinator/state/rebuild.py) records the versions it restores this many at
# a time (Versions.restore_committed_many): a handful of round trips for the batch, where
# five a version took ~40% of a rebuild of 10,000 versions (75 s, docs/benchmarks.md).
REBUILD_BATCH_VERSIONS = 32
# Bytes of manifests one pipeline of those versions' create scripts stages before it is
# sent, so Redis runs a few scripts at a time (~8 versions of 100 chunks, their manifests
# ~32 KB: a few ms), never the whole batch in one go, and the pipeline holds little in
# memory (a 16 GB checkpoint's 2 MB manifest goes alone).
REBUILD_PIPELINE_BYTES = 256 * 1024
# Seconds a staged manifest lasts whose version was never recorded (its store crashed
# between the two): long past any store's staging, which takes milliseconds.
MANIFEST_STAGED_TTL_S = 3600

# --bwlimit and SMOLTORRENT_BWLIMIT (coordinator/dataplane/bandwidth.py): a limited transfer
# moves its bytes in slices of at most BWLIMIT_SLICE_BYTES (a sendfile call, a recv) and
# pays each to one token bucket shared by all its sends. 256 KiB is 21 ms of a 100 Mbit/s
# link, so the training's own packets never queue behind a long burst, and at 1 GB/s
# still only 4,000 slices a second, each a lock on a small file: nothing next to the bytes.
BWLIMIT_SLICE_BYTES = 256 * 1024
# seconds of the rate a bucket lets through at once after an idle spell: short, so the
# rate counted over any second stays close to the limit; longer than a slice at every
# rate worth limiting (100 ms is 1.25 MB at 100 Mbit/s)
BWLIMIT_BURST_S = 0.1
# seconds a transfer's shared bucket file is kept (a store's transfers may retry for hours;
# the longest a store's transfers can run is MAX_TRANSFER_TIME_S): older ones are removed
# when a new one is made, so the directory holds only recent stores' 8-byte files
BWLIMIT_STATE_MAX_AGE_S = 24 * 3600

# --- encoded chunks (coordinator/dataplane/codec.py) ----------------------------

# raw bytes per frame: the encoder's and decoder's buffers are a few of these, whatever the
# chunk's size; zstd's blocks are 128 KiB, so a bigger frame gains nothing in ratio, and
# a smaller one adds per-frame Python work (decode of 1 MiB frames: see bench/RESULTS.md)
CODEC_FRAME_BYTES = 1024 * 1024
# bytes of SHA-256 naming a chunk's encoding (codec.encoding_of) in Redis's chunks room:
# a cluster sees a few dozen layouts, so 64 bits never collide, at 17 bytes an entry
CODEC_ENCODING_NAME_BYTES = 8
# encodings (layouts) codec.encoding_of keeps computed: a checkpoint has a few dozen
CODEC_ENCODINGS_KEPT = 4096
# raw bytes a decoder accepts in one frame: the encoder's own frame size, never more (it
# has never written bigger ones), since a frame is what a corrupt or hostile header makes
# the decoder allocate: 64 MiB frames let a 2 KB blob cost ~200 MiB a decoding thread
CODEC_MAX_FRAME_BYTES = CODEC_FRAME_BYTES
# zstd level 1: of levels -5..5 it gives byte-grouped N(0, 0.02) bf16 the best ratio
# (1.46x; level 3 1.41x, level -1 1.20x) and decodes faster than any level above it
# (`python -m bench.codec --levels`, bench/RESULTS.md)
CODEC_ZSTD_LEVEL = 1
# a plane is kept zstd-coded, and a chunk framed, only if that saves this share of its
# bytes: a smaller gain does not pay for the decoding (random mantissa bytes gain ~0%,
# the bf16 exponent plane ~63%), and a RAW chunk is sent with sendfile, no copy
CODEC_MIN_GAIN = 0.05
# What the store's encode-or-not policy rests on (coordinator/plan/encoding.py). Bytes per
# second two cores encode bf16 at (bench/codec.py: 170-230 MB/s per core at level 1)
CODEC_ENCODE_BPS = 380_000_000
# Encoding before sending pays on links slower than encode rate x (1 - 1/ratio): with
# bf16's 1.46x, about 120 MB/s (gigabit Ethernet is at the edge, a Pi's 100 Mbit/s far
# below, loopback's ~1 GB/s far above). SMOLTORRENT_ENCODE=raw is for links above it.
CODEC_ENCODE_PAYS_BELOW_BPS = int(CODEC_ENCODE_BPS * (1 - 1 / 1.46))
# seconds a spool directory (a store's encoded chunks) must sit unchanged before a worker's
# start removes it for a version no longer pending: a store writes its chunks there before
# it records the version, and encoding even 16 GB takes well under this
SPOOL_ORPHAN_AGE_S = 600

# --- metadata (coordinator/state/, its rooms) -------------------------------------

REDIS_TIMEOUT_S = 10.0  # seconds; a local or LAN Redis answers in milliseconds
NODE_ALIVE_TTL_S = 30  # seconds a node counts as up after it last answered a probe
# seconds a node a transfer could not reach is passed over by the others (unless it
# answers a probe sooner): with chunks a store has hundreds of transfers, and each one
# waiting CONNECT_TIMEOUT_S or STALL_S for the same lost node put the Pi benchmark's
# unplugged-node store at 2.0-2.3x line time. As long as a node counts as up.
NODE_UNREACHABLE_S = NODE_ALIVE_TTL_S
DLQ_STREAM_MAXLEN = 10_000  # entries kept in the dead-letter index stream, approximate
# seconds a dead letter is kept before the retention sweep forgets it: weeks to look at
# and replay it, past PENDING_DEADLINE_S (a version it could still complete is aborted by
# then), and Redis does not grow by one record per failure for ever
DEAD_LETTER_MAX_AGE_S = 30 * 24 * 3600
EMBEDDED_REDIS_START_S = 10.0  # seconds to wait for our own redis-server to answer
# seconds a removed version's tombstone stays: far longer than any late transfer or
# dead-letter replay that could still name it, short enough that Redis stays bounded
REMOVED_TOMBSTONE_TTL_S = 30 * 24 * 3600
# seconds a blob's "being deleted" tombstone lasts if its remove dies mid-way; the
# reconcile sweep resumes the remove long before (RECONCILE_GRACE_S)
BLOB_TOMBSTONE_TTL_S = 3600
MANIFEST_EXTRA_TIMEOUT_S = 5.0  # seconds a non-holder gets to take a manifest (a few KB)
# versions per pipeline of per-version reads (manifests, version hashes) and when the
# listing summaries are first filled: no one reply grows with the number of versions
LISTING_BATCH_VERSIONS = 1000
# versions and blob digests at most per Lua call of a listing (`ls`, `status`), each call
# alone: Redis serves no one else while a script runs, and a slice of 1,000 versions of 100
# chunks held it ~75 ms (10 of them in one MULTI, 0.7-1.4 s; bench/scale_sweeps.py). The
# script's work is mostly per digest (1-2 us each on a loaded 2-core box): 5,000 digests
# hold it for about 10 ms
LISTING_SLICE_VERSIONS = 1000
# entries a ZSCAN or HSCAN of every listed version asks for a call (the repair sweep's
# and verify's listing of states): each call a fraction of a millisecond, where one HGETALL
# of 10,000 versions' states held Redis 7-9 ms (bench/scale_sweeps.py)
LISTING_SCAN_COUNT = 1000
LISTING_SLICE_DIGESTS = 5000
# seconds the keys a listing had to read in a second run are kept for the next listing's
# first run (the pending versions of stores in flight): a store lasts seconds to minutes,
# and `ls` or a metrics scrape within that skip their second run; past it, one more run
LISTING_HINT_TTL_S = 120
# keys the hint names at most (each is passed to every slice of the next listing): the
# versions and blobs of a few dozen stores in flight, never thousands
LISTING_HINT_MAX_KEYS = 2000
# times a script that reads keys its caller read first (a remove, a trim mark, a listing)
# is run again because they changed in between; each run passes what the last one found
# missing, so a second run is almost always the last
SCRIPT_KEY_RETRIES = 20
ATTEMPTS_KEPT = 1000  # entries of a version's transfer attempt log kept (the latest ones)
ATTEMPTS_TTL_S = 7 * 24 * 3600  # seconds a committed version's attempt log stays readable
# seconds a pending version's blob spans (what each transfer reads instead of the whole
# manifest) stay in Redis if no commit drops them first: a day covers a slow store; a
# transfer after that (a replay) rebuilds its span from the manifest
SPANS_TTL_S = 24 * 3600
REQUEST_TTL_S = 7 * 24 * 3600  # seconds a finished request stays readable (CLI, API, audit)
# seconds a store or gather task's hold on its request lasts unless renewed: a second
# delivery of the task (a redelivery, a re-drive) while the first still runs waits for
# it instead of running it again; a run killed where nobody can tell (another host, a
# stopped process) is taken over once its lease lapses (on the Redis clock)
REQUEST_LEASE_S = 60.0
REQUEST_LEASE_REFRESH_S = 15.0  # seconds between renewals: four chances before it lapses
REQUEST_DEFER_MIN_S = 1.0  # seconds a deferred delivery waits at least before trying again

# --- Celery control plane (tasks/) ------------------------------------------

TRANSFER_RETRIES = 6  # retries of a failed transfer: 1+2+4+8+16+32 s = about a minute of outage
RETRY_BACKOFF_BASE_S = 1  # seconds; retry n waits base * 2^n, no jitter (predictable)
RETRY_BACKOFF_MAX_S = 600  # seconds; cap on one backoff step if retries are raised
# seconds before a task whose worker process died (SIGKILL, the OOM killer) runs again: a
# run of it cannot be going on (its request lease names the dead process), so at once
WORKER_LOST_RETRY_S = 1
MIN_TRANSFER_RATE_BPS = (
    2 * 1024 * 1024
)  # bytes/s; a Pi on an SD card over 100 Mbit still beats this
TRANSFER_TIME_BASE_S = 120  # seconds added to every transfer's limit: connect, handshake, fsync
MAX_TRANSFER_TIME_S = 12 * 3600  # seconds; cap so the visibility timeout stays finite
# The Redis transport redelivers any unacked message after this, including
# retries waiting out their countdown: above the longest transfer plus the
# whole backoff series, or a slow transfer would run twice at once.
VISIBILITY_TIMEOUT_S = MAX_TRANSFER_TIME_S + 2 * RETRY_BACKOFF_MAX_S * 7
WORKER_CONCURRENCY = 4  # prefork children per worker; transfers are I/O bound
# A chunked version's chunks whose chains go to the same nodes in the same order share a
# chain task (tasks/chain_batches.py): a task per chunk spent more in Celery dispatch and
# Redis reads than its chunk took to move (1 GB, 282 chunks: 57 ms a task for 3.5 MB).
# Bytes of blobs in one task at most: four chunk targets, 0.5 s at 1 Gbit/s and 5 s at
# 100 Mbit/s, so one task never holds a pool process long, and a retry, which moves only
# its entries still unplaced, redoes at most that.
CHAIN_BATCH_BYTES = 4 * CHUNK_TARGET_BYTES
# entries in one task at most: bounds its message, its dead letter and its Redis reads
CHAIN_BATCH_ENTRIES = 32
# tasks a store's chunks are cut into at least (when it has as many): two per pool process,
# so every process gets work and the last task to end is not far behind the others
CHAIN_BATCH_MIN_TASKS = 2 * WORKER_CONCURRENCY
STABLE_AFTER_S = 2.0  # seconds a file's mtime must be in the past before it is stored
SETTLED_MARGIN_S = 1.0  # seconds past STABLE_AFTER_S a file written whole is dated back
REMOVING_WAIT_S = 5.0  # seconds a store of bytes being removed waits before trying again
STABLE_RETRIES = 150  # times a store waits for an unstable file (150 x 2 s = 5 min)
# times a store that finds no live node backs off and plans again before it fails:
# 1+2+4+8 s, long enough for nodes restarting together (a power cut, an upgrade).
# SMOLTORRENT_NO_NODE_RETRIES sets it (a test of the failure itself waits 1 s, not 15)
NO_NODE_RETRIES = 4
GATHER_PROGRESS_INTERVAL_S = 0.5  # seconds between progress updates of a gather task
STORE_PROGRESS_INTERVAL_S = 0.5  # seconds between a transfer's writes of its bytes sent
# seconds a transfer's bytes-sent record lives after its last write: a view of work in
# flight for progress bars, so it goes by itself once nothing moves
SENT_PROGRESS_TTL_S = 3600
CLI_POLL_INTERVAL_S = 0.1  # seconds between CLI polls of a task's progress
# seconds a wake-up (coordinator/state/wakeups.py) waits for its waiter: one blocks on it
# within milliseconds of its last poll, so this only covers a waiter held up between the two
# (a Redis hiccup, a slow machine); past it a waiter still learns the end at its next poll
WAKE_TTL_S = 30
# seconds one BLPOP of a waiter blocks at most: below REDIS_TIMEOUT_S, the client's socket
# timeout, which a longer block would trip (a poll interval set longer waits in slices)
WAKE_BLOCK_SLICE_S = 5.0
# seconds a CLI or API call that is waiting on an operation goes on trying an unreachable
# Redis (metadata and broker) before saying the outcome is unknown: a restart from its
# AOF takes seconds, and a wait cut short by one would report a failure that then succeeds
CLIENT_OUTAGE_S = 60.0
CLIENT_OUTAGE_POLL_S = 0.5  # seconds between its tries: reconnecting costs milliseconds
# rows above which a terminal gets a table as plain aligned columns: rich lays out about
# 2,000 rows a second (`ls` of 10,000 versions took 6.5 s), plain columns take milliseconds
CLI_DRAWN_TABLE_MAX_ROWS = 500
# terminal columns a long cell (a name, an address, an error) keeps at least on a narrow
# terminal before the table leaves out a column of less use: "grpo/run1/step…" still
# says which, and a 12-character version id or an address with its port stays whole
CLI_ELIDED_CELL_MIN_COLUMNS = 16
LOG_ID_CHARS = 12  # hex characters of a version, blob or node id in a log line: unique enough
LOCAL_START_TIMEOUT_S = 15.0  # seconds for a local node or worker process to come up
# seconds; a small shard on loopback (~10 ms) to a checkpoint of tens of GB over 100 Mbit/s (hours)
WORKER_SECONDS_BUCKETS = (0.01, 0.05, 0.25, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, 1800.0, 7200.0)
FLOWER_PORT = 5555  # TCP; Flower's own default, what its docs and users expect
# Where node and worker /metrics listen unless --metrics-host says otherwise: loopback,
# since the page has no login (a Prometheus elsewhere needs 0.0.0.0 or an address).
METRICS_HOST = "127.0.0.1"
# characters of a task's readable args or kwargs (tasks/readable.py): a name, a shard, a
# node and a size fit; a path longer than this is cut rather than widen Flower's table
TASK_REPR_MAX_CHARS = 200
TASK_REPR_SHARDS = 4  # chunks a batched chain task's line names; then how many it holds
# The columns of Flower's task list: its default hides args and kwargs, which name the
# checkpoint, shard, node and bytes of each of our tasks (tasks/readable.py)
FLOWER_TASKS_COLUMNS = "name,args,kwargs,state,received,runtime,worker,uuid"
DEMO_CHECKPOINT_MB = 64  # MB; big enough to show parallel shards, small enough for a laptop
# A task publishing while Redis restarts (AOF load included) retries for about a minute:
# 0, 0.5, 1, 1.5, 2, 2, ... s between attempts, 30 attempts.
PUBLISH_RETRIES = 30
PUBLISH_RETRY_STEP_S = 0.5  # seconds added to the wait after each failed publish
PUBLISH_RETRY_MAX_S = 2.0  # seconds; the longest wait between two publish attempts
WORKER_HEARTBEAT_S = 5.0  # seconds between a worker's refreshes of its alive key
# seconds between a reconnected worker's looks at the tasks that were running when the
# broker connection broke: once one has ended, what it left is checked again (a retry it
# queued may have been lost with the connection)
RECONNECT_RECHECK_S = 1.0
WORKER_ALIVE_TTL_S = 20  # seconds; a worker silent this long (4 missed beats) is gone
# seconds a command waits for this host's worker that said it is starting (Celery's boot
# takes 2-3 s here, more on a small board) before saying none serves the host
WORKER_START_GRACE_S = 30
RECONCILE_INTERVAL_S = 60.0  # seconds between reconcile sweeps: a lost step waits at most this
# seconds a step (a queued commit, a remove, a re-driven request) may take before the
# sweep sends it again; every one of them is idempotent, so a repeat costs only work
RECONCILE_GRACE_S = 120.0
PENDING_DEADLINE_S = 7 * 24 * 3600  # seconds a version may stay pending before it is aborted
# seconds between health sweeps (SMOLTORRENT_HEALTH_INTERVAL_S): each pings every node and
# refreshes its alive key; well under NODE_ALIVE_TTL_S so a live node never looks down
HEALTH_INTERVAL_S = 10.0
# seconds a node may stay silent before it is dead (SMOLTORRENT_DEAD_AFTER_S) and its shards
# are copied elsewhere: a Pi reboot (~1 min) or a Wi-Fi drop must not set off a whole
# node's worth of copying, while a shard waits at R-1 copies no longer than this
DEAD_AFTER_S = 300.0
# seconds between scrub sweeps (SMOLTORRENT_SCRUB_INTERVAL_S): each collects every node's
# scrub report (bad copies it quarantined) and starts a pass where none runs, so a node re-
# hashes its whole inventory at least this often; a node of 100 GB at SCRUB_RATE_BPS needs
# ~3 h, so its passes run back to back. A bad copy is out of reads at once; the health probe
# sees the node hold it (its stat counts them) and has the reports collected then, so its
# shard waits about one HEALTH_INTERVAL_S at R-1 before the repair starts, not this long
SCRUB_INTERVAL_S = 3600.0
# seconds between repair sweeps (SMOLTORRENT_REPAIR_INTERVAL_S): each only reads Redis and
# sends copies, so it can run often; a shard below R waits at most this (plus the dead
# timeout when a node died) before its copy starts
REPAIR_INTERVAL_S = 30.0
# repair sessions touching one node at once, as sender or receiver (SMOLTORRENT_REPAIRS_PER_NODE):
# a safety cap beside the rate (REPAIR_BPS), which is the throttle: one out and one in lets
# a node send at its rate and receive, and keeps its SD card free enough for gathers
REPAIRS_PER_NODE = 2
# bytes/s each node's repair pushes keep to together (SMOLTORRENT_REPAIR_BPS; the node pays
# every slice to one token bucket, worker_server/token_bucket.py): 10 MB/s is 80 Mbit/s, so
# a Pi's 100 Mbit/s port keeps a fifth for gathers while a lost node heals, and three
# survivors sending at it carry its bytes back within 1.25x of what their links could
# (issue 37: within 1.5x); 0 lifts the limit (a fast LAN, a node lost with nothing to read)
REPAIR_BPS = 10_000_000
# repair sessions in flight in the whole cluster: each holds a worker process while its nodes
# copy. Three: a lost node of a 4-node cluster has its blobs' other copies on all three
# survivors (plan/placement.py), and each sends one session at REPAIR_BPS, so they heal it
# at 3 x 80 Mbit/s of their 3 x 100 (two sessions left one survivor idle: 2.5x its links'
# time on the Pi emulation); one process of WORKER_CONCURRENCY stays for stores and commits
REPAIRS_MAX_IN_FLIGHT = 3
# blobs one repair session carries between two nodes (one task, one node-to-node connection,
# replicate_batch): a lost node's chunks go in a few sessions, not a task and a handshake
# each; 128 digests are ~9 KB of the request's header (MAX_HEADER_BYTES) and the answer
REPAIR_BATCH_BLOBS = 128
# bytes one repair session carries (a first blob may be larger): 6.7 s at REPAIR_BPS, so a
# session's connect and handshake are nothing beside it, and the order (fewest copies
# first) is decided afresh every few seconds as sessions end
REPAIR_BATCH_BYTES = 64 * 1024 * 1024
# characters of one blob's outcome a replicate_batch answer keeps (a peer's error message):
# enough to say why, and 128 of them stay far under a JSON answer's limit
REPAIR_OUTCOME_CHARS = 300
# seconds one repair plan may hold its lock (beat/repair.py), and a planner waits for it: a
# plan reads Redis and sends tasks (milliseconds; ~1 s at 100k blobs), so a holder that died
# blocks the repairs a minute at most, as a sweep's lock does (SWEEP_LOCK_TTL_S)
REPAIR_PLAN_LOCK_S = 60
# seconds a repair target waits after its copy of a blob failed (SMOLTORRENT_REPAIR_BACKOFF_S),
# doubling with each failure in a row: a node that errs on every put (a full or failing card)
# is not sent the same copy every repair sweep; two sweeps at the default interval
REPAIR_BACKOFF_S = 60.0
# seconds the doubling repair backoff stops at: a target that failed for hours is still
# tried about hourly, which costs one copy attempt
REPAIR_BACKOFF_MAX_S = 3600.0
# seconds between a `store --replicas` change's passes over the version's blobs while the
# repair throttle holds copies back (beat/repair.py replicas): a copy of a small blob ends
# in about that, so the next pair starts soon after
REPLICAS_RECHECK_S = 5.0
# passes of such a change before it leaves the rest to the repair sweep: an hour of them
REPLICAS_RECHECKS = 720
# seconds `store --replicas` on stored content waits with no copy made or trimmed before it
# stops waiting (exit 3: the change is recorded, and the repair sweep carries it on); at
# least, since it waits as long as one copy of its biggest blob may take (its time limit)
REPLICAS_STALL_S = 120.0
# seconds between its looks at the copies: each reads every version's blobs from Redis
REPLICAS_POLL_S = 0.5
# seconds a trim (re-hash the copies kept, delete the surplus) may take before the sweep
# may send it again; a trim is rare (a dead node came back) and each step is idempotent
TRIM_TIME_LIMIT_S = 3600
# seconds a trim's mark on the copy it deletes lives (coordinator/state/trim_marks.py): as
# long as the trim task's hard time limit, so the mark cannot expire while its delete may
# still reach the node; the trim clears it as soon as the delete is answered
TRIM_MARK_TTL_S = TRIM_TIME_LIMIT_S
# seconds; a sweep's lock expires this long after its holder died mid-sweep on a host
# whose worker does not start again (one that does frees it at once: beat/boot.py), and a
# live holder renews it every third of it. Every pass of that sweep stands down meanwhile
# (health runs every 10 s: 600 s would stop it for ten minutes).
SWEEP_LOCK_TTL_S = 60
SWEEP_RUNS_KEPT = 100  # runs of each sweep kept on record (start, end, by whom)
# gathers run in a process of their own (the CLI, load()) kept for the host's worker to count
# in its metrics at its next scrape: a scrape comes every 15-60 s, so this many is hours of
# gathers; a host whose worker serves no metrics keeps at most this many, for a day
PROCESS_GATHERS_KEPT = 1000
PROCESS_GATHERS_TTL_S = 86_400
WORKER_CHECK_TIMEOUT_S = 1.0  # seconds the CLI waits for workers to say which queues they serve
LOCAL_STOP_TIMEOUT_S = 15.0  # seconds for SIGTERM to end a local node (its own grace is 10 s)
EMBEDDED_REDIS_ATTEMPT_S = 2.0  # seconds one redis-server start may take before trying again
EMBEDDED_PORT_LOW = 20000  # lowest port picked for our own Redis: above common services
EPHEMERAL_PORT_LOW = 32768  # Linux's default start of outgoing ports, if /proc does not say

# --- retention (beat/retention.py) -----------------------------------------------

# committed versions kept per name (SMOLTORRENT_KEEP_LAST): the current one and two to roll
# back to; a name re-saved every few minutes would otherwise fill the nodes' SD cards
KEEP_LAST = 3
# seconds between retention sweeps (SMOLTORRENT_RETENTION_INTERVAL_S): old versions only
# cost disk, so a few minutes late is fine, and a pass reads every name's versions
RETENTION_INTERVAL_S = 300.0
# seconds a gather's reader mark lasts unless refreshed: retention never removes a version
# with a live mark; a gather killed mid-way blocks the removal at most this long
GATHER_LEASE_TTL_S = 60
GATHER_LEASE_REFRESH_S = 15.0  # seconds between refreshes: four chances before it lapses

# --- crosscheck (beat/crosscheck.py) ---------------------------------------------

# seconds between crosscheck sweeps (SMOLTORRENT_CROSSCHECK_INTERVAL_S): each lists every
# node's blobs and manifests (one JSON answer per node), cheap next to a scrub
CROSSCHECK_INTERVAL_S = 900.0
# seconds a copy no version uses stays on a node before the crosscheck deletes it
# (SMOLTORRENT_ORPHAN_GRACE_S): it only costs disk, and an operator who restored Redis
# from an old backup has this long to notice before anything it forgot is collected
# (blobs named by a manifest on any node are never collected as orphans anyway)
ORPHAN_GRACE_S = 6 * 3600.0

# --- smoltorrent up (coordinator/local/stack.py) ----------------------------------

UP_NODES = 4  # local storage nodes `up` runs by default: R=2 with room for one to die
UP_POLL_S = 0.5  # seconds between `up`'s looks at its parts (a death stops the stack)
UP_GRACE_S = 15.0  # seconds a part gets after SIGTERM before SIGKILL (beat, watcher, Flower)
# seconds the worker gets after SIGTERM: a warm shutdown lets running transfers finish,
# and late acks re-run any that do not (as docker-compose.yml's stop_grace_period)
UP_WORKER_GRACE_S = 60.0
UP_WORKER_START_S = 60.0  # seconds for the worker's first heartbeat; Celery's start is slow
UP_WORKER_METRICS = 9410  # TCP; the worker's /metrics with `up --metrics` (deploy/ uses it)
UP_NODE_METRICS = 9411  # TCP; node i's /metrics is this + i with `up --metrics`
# seconds between a local Prometheus' scrapes (coordinator/local/prometheus.py: the metrics
# test and bench/dashboard.py): a store on loopback lasts about a second, so every one shows
LOCAL_PROMETHEUS_SCRAPE_S = 1
LOCAL_PROMETHEUS_START_S = 60.0  # seconds for a local Prometheus to answer /-/ready

# --- discovery (coordinator/discovery.py) --------------------------------------

DISCOVER_TIMEOUT_S = 3.0  # seconds `smoltorrent discover` listens; nodes answer in ~0.1 s
# milliseconds to resolve one advert (SRV, TXT, A); zeroconf asks again within it
DISCOVER_RESOLVE_TIMEOUT_MS = 2000
# seconds between the worker's re-resolutions of every known advert: a move whose
# announcement was lost is noticed within this (announcements normally arrive at once)
DISCOVER_REFRESH_S = 60.0

# --- watcher (coordinator/watcher.py) -----------------------------------------

# The original looked every 10 s; a stat is cheap, an unstored checkpoint is not.
WATCH_RECHECK_S = 2.0  # seconds between looks at files still being written

# --- saves from a training loop (smoltorrent/snapshot.py, smoltorrent/snapshot_writer.py) ---

# Where a save's snapshot lives until the writer process has written it to disk: shared
# memory (RAM, no disk on the training step's clock) that outlives the training process;
# the staging directory when there is none (macOS) or it has no room for the snapshot.
SNAPSHOT_SHM_DIR = "/dev/shm"
SNAPSHOT_ALIGN_BYTES = 64  # each tensor's bytes start on a cache line in the snapshot
# seconds between store submissions while no worker, Redis or cluster answers: a worker
# starting up is found within this, and a down Redis is not hammered
SAVE_RETRY_S = 2.0
# seconds a writer keeps trying to submit or follow a save before the handle reports the
# failure; the journal keeps the save, and the next save or load on this machine takes it
# up again. An hour covers a worker restart or a Redis failover; a trainer waiting on
# handle.result() learns of a longer outage.
SAVE_PATIENCE_S = 3600.0
WRITER_IDLE_POLL_S = 0.5  # seconds between a writer's checks that its trainer is done
# nice value (0 to 19) a trainer's writer process runs at, at least, and on Linux its
# session's autogroup too: the writer is background work the training step must not wait
# on. At 10 the kernel weighs it 110 against a nice-0 trainer's 1024 (its nice-to-weight
# table), so while the trainer keeps every core busy the writer has about a tenth of
# one, and all of any core the trainer leaves idle: slower, never stopped.
# SMOLTORRENT_WRITER_NICE overrides it (0: as its trainer). Measured in docs/benchmarks.md.
WRITER_NICE = 10
WRITER_NICE_MAX = 19  # the highest nice value, the lowest priority, Linux takes (macOS: 20)
# tries, and seconds between them, to set the writer's autogroup nice: Linux refuses an
# unprivileged change within 100 ms (HZ/10) of any other on the machine (EAGAIN), as when
# every rank of a job starts its writer at its first save
AUTOGROUP_NICE_TRIES = 20
AUTOGROUP_NICE_RETRY_S = 0.1
# snapshot buffers a trainer keeps mapped for its next save once the writer has staged
# them: one makes a steady save cadence fault no page, at the cost of one state's size of
# shared memory held between saves
SNAPSHOT_POOL_BUFFERS = 1

# --- steps of per-rank parts (smoltorrent/sharded.py, coordinator/state/steps.py) ---

# seconds between the heartbeats a rank's writer records while it stores its part of a
# step: one small Redis write, so that others can tell a part in flight from a dead one
STEP_BEAT_S = 5.0
# seconds without a heartbeat after which a part that began counts as abandoned (its
# writer died: killed, or its machine lost): six missed beats, so a Redis hiccup of a few
# seconds never makes a live part look dead
STEP_STALE_S = 30.0
# seconds save_sharded(wait=True) waits, once this rank's part is stored, for a rank that
# has not begun its part (SMOLTORRENT_STEP_PATIENCE_S); a rank whose writer still beats is
# waited for past it (its writer gives up after SAVE_PATIENCE_S and says so), a failed or
# abandoned one is reported at once. Ten minutes, as torch.distributed's default NCCL
# timeout: a rank that has not reached its save by then has not reached it at all.
STEP_PATIENCE_S = 600.0
STEP_WAIT_POLL_S = 0.2  # seconds between looks at the step while wait=True waits for it

# --- the local tier (smoltorrent/local_tier.py) ----------------------------------

# saves kept on the training machine once committed (SMOLTORRENT_LOCAL_KEEP; 0: none):
# the newest to resume from in seconds, and the one before it for a resume that finds
# the newest bad (a bit flipped on disk: its digests no longer match)
LOCAL_KEEP = 2
# bytes those saves may take together (SMOLTORRENT_LOCAL_BYTES): 64 GiB holds two saves
# of a 1.3B-parameter run with AdamW in fp32 (16 bytes a parameter, ~21 GB each) and is a
# few percent of a training machine's local NVMe; a larger run raises it
LOCAL_TIER_BYTES = 64 * 1024**3
# threads hashing a kept copy's shards at load: hashlib frees the GIL, and four keep a
# local NVMe busy without taking every core from a trainer resuming
LOCAL_VERIFY_THREADS = 4
