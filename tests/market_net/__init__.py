"""The resource market over real gateways, TLS and node links."""
