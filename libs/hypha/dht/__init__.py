"""Kademlia DHT that carries only signed provider records (ARCHITECTURE §3, §4)."""

from hypha.dht.node import DhtNode
from hypha.dht.protocol import provider_key
from hypha.dht.publisher import Publisher
from hypha.dht.records import ProviderRecord, RecordVerifier, sign_record

__all__ = ["DhtNode", "ProviderRecord", "Publisher", "RecordVerifier", "provider_key", "sign_record"]
