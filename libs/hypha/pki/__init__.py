"""The private PKI: who a peer is (``identity``), issuing certificates
(``certs``), revocation (``crl``) and the ``hypha-certutil`` tool (``cli``).

Submodules are imported explicitly (``from hypha.pki.identity import Role``)
so that importing one does not load the others.
"""
