"""Settings of the data role: the common node sections plus [data]."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from hypha.config.common import NodeSettings

#: The largest chunk the wire conventions allow (``hypha.v1.Chunk``: at most 1 MiB of data).
MAX_CHUNK_BYTES = 1 << 20
#: How long a verified, unchanged slice file is served without hashing it again (``trust_verified_s``).
DEFAULT_TRUST_VERIFIED_S = 300.0
#: How slices travel (``hypha.data.wire_compression``).
WireCompression = Literal["auto", "gzip", "none"]
#: Longest lifetime a provider record may claim (``hypha.dht.records.MAX_LIFETIME_S``).
MAX_RECORD_TTL_S = 24 * 3600.0


class DataNodeSection(BaseModel):
    model_config = ConfigDict(extra="forbid")

    data_dir: Path = Field(
        Path("data"),
        description="Directory of prepared datasets, one sub-directory each (what `hypha-data prepare "
        "--data-dir` writes). A relative path in the config file is taken from the file's directory. "
        "It may be empty or missing at start: datasets prepared later are served (and announced) "
        "without a restart.",
    )
    chunk_bytes: int = Field(
        MAX_CHUNK_BYTES,
        ge=4096,
        le=MAX_CHUNK_BYTES,
        description="Bytes of slice data per streamed chunk (at most 1 MiB, the wire convention).",
    )
    wire_compression: WireCompression = Field(
        "auto",
        description="Slices sent gzip-compressed (gRPC's message compression; every reader takes it "
        "as is). `auto`: for each dataset whose slices gzip halves, judged once from 256 KiB of a slice "
        "(token ids stored as int64 shrink about tenfold; images and floats hardly at all, and are sent "
        "as they are); `gzip`: always; `none`: never (the data node's CPU is scarcer than the links).",
    )
    max_concurrent_streams: int = Field(
        16,
        ge=1,
        description="Slice streams served at once. A slice's first stream holds it whole in memory "
        "(it is checked before it is sent), later ones about two chunks, so this bounds memory at about "
        "this many slices.",
    )
    trust_verified_s: float = Field(
        DEFAULT_TRUST_VERIFIED_S,
        ge=0,
        description="How long a slice file that passed its sha256 check is served without hashing it "
        "again, while its stat (inode, size, mtime, ctime) is unchanged; after that its next stream is "
        "hashed as it is sent and its last chunk withheld if the bytes no longer match. Readers check "
        "every slice against the manifest's sha256 themselves, so bytes that rot without a trace in the "
        "stat are refused by the reader within this window and by the node after it. 0: hash every stream.",
    )
    stream_wait_s: float = Field(
        10.0,
        gt=0,
        description="How long a slice request waits for a free stream before it is refused with "
        "RESOURCE_EXHAUSTED (clients retry that with backoff).",
    )
    dht_bootstrap: list[str] = Field(
        default_factory=list,
        description="DHT nodes (HOST:PORT, usually the gateways' DHT ports) to join. When set, the node "
        "announces one signed provider record per dataset it serves; empty: no announcements.",
    )
    dht_host: str = Field("127.0.0.1", description="Address this node's DHT endpoint binds and advertises.")
    dht_port: int = Field(
        0, ge=0, le=65535, description="UDP port of this node's DHT endpoint (0: any free port)."
    )
    dht_rpc_timeout_s: float = Field(2.0, gt=0, description="Timeout of one DHT RPC to one peer.")
    record_ttl_s: float = Field(
        3600.0,
        gt=0,
        le=MAX_RECORD_TTL_S,
        description="Lifetime of a provider record; it is re-signed and republished at half its life.",
    )
    announce_poll_s: float = Field(
        10.0,
        gt=0,
        description="How often the data dir is checked for datasets to announce or withdraw.",
    )
    grace_s: float = Field(5.0, ge=0, description="Seconds in-flight calls get to finish on shutdown.")


class DataNodeSettings(NodeSettings):
    data: DataNodeSection = Field(default_factory=DataNodeSection, description="DataNode settings.")
