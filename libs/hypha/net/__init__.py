"""Networking shared by every role: mTLS servers and channels, the guard
(authentication, roles, revocation, error mapping), and telemetry."""
