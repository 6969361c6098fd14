"""Settings of the gateway role: the common node sections plus [gateway]."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from hypha.config.common import NodeSettings


class GatewaySection(BaseModel):
    model_config = ConfigDict(extra="forbid")

    peers: list[str] = Field(
        default_factory=list,
        description="Other gateways (HOST:PORT) to federate with. Federation is meant to be a full mesh: "
        "list every other gateway here (a link opened by either side serves both directions).",
    )
    queue_size: int = Field(
        1024,
        ge=1,
        description="Frames buffered per attached node or federation link; beyond it, topic "
        "messages to that subscriber are dropped (counted and logged) so one slow node never stalls others.",
    )
    max_payload_bytes: int = Field(
        1024 * 1024 + 64 * 1024,
        ge=1024,
        description="Largest payload of one publish or direct message; larger frames are refused.",
    )
    direct_timeout_s: float = Field(
        10.0,
        gt=0,
        description="How long a direct message may wait for room in the receiver's queue "
        "(direct messages are never dropped silently: the sender gets an error frame).",
    )
    hop_limit: int = Field(8, ge=1, description="How many gateways a published frame may cross.")
    max_hello_addresses: int = Field(
        16, ge=1, description="Most addresses one attached node may advertise in its Hello; more are refused."
    )
    max_hello_chars: int = Field(
        256, ge=16, description="Longest advertised address, and longest node name, a Hello may carry."
    )
    max_subscriptions: int = Field(
        256, ge=1, description="Most topics one attached node may subscribe to at once; more are refused."
    )
    dedup_ttl_s: float = Field(
        120.0, gt=0, description="How long a message id is remembered for de-duplication."
    )
    dedup_max: int = Field(200_000, ge=1000, description="Most message ids remembered at once.")
    reconnect_base_s: float = Field(0.2, gt=0, description="First retry delay of a lost federation link.")
    reconnect_cap_s: float = Field(5.0, gt=0, description="Longest retry delay of a lost federation link.")
    dht_port: int | None = Field(
        0,
        description="UDP port of this gateway's DHT bootstrap node (0: any free port). Unset to disable.",
    )
    dht_host: str = Field("127.0.0.1", description="Address the DHT node binds and advertises.")
    dht_bootstrap: list[str] = Field(
        default_factory=list,
        description="Other DHT nodes (HOST:PORT, host names allowed) to join through.",
    )
    dht_rpc_timeout_s: float = Field(2.0, gt=0, description="Timeout of one DHT RPC to one peer.")
    dht_max_records_per_provider: int = Field(
        256,
        ge=1,
        description="Most provider records (datasets) this gateway's DHT node keeps from one data node's "
        "certificate; more are refused.",
    )
    dht_max_stored_bytes: int = Field(
        64 * 1024 * 1024,
        ge=65536,
        description="Most bytes of provider records this gateway's DHT node keeps in all (records expire "
        "with their own lifetime, at most a day); more are refused.",
    )
    grace_s: float = Field(5.0, ge=0, description="Seconds in-flight calls get to finish on shutdown.")
    metrics_listen: str = Field(
        "",
        description="HOST:PORT of this gateway's Prometheus /metrics (HTTPS with the network's mTLS: any "
        "certificate of the network may scrape); port 0: any free port; empty (the default): no metrics "
        "endpoint.",
        examples=["0.0.0.0:9464"],
    )


class GatewaySettings(NodeSettings):
    gateway: GatewaySection = Field(default_factory=GatewaySection, description="Gateway settings.")
