"""Harness for tests and benchmarks: a throwaway PKI, in-process gateway meshes,
polling with a deadline, and stand-ins for the job bridge that executors talk to.

Like ``aiohttp.test_utils``, it ships with the library so that the test suite,
the benchmarks and anyone testing code against Hypha share one harness. Production
code never imports it (``tests/test_architecture_map.py`` checks). Unlike the rest
of the core it may import roles, since it drives them: ``mesh.Mesh`` starts gateways,
``real_bridge.start_real_bridge`` a worker's job bridge, ``rounds_sim`` runs the
scheduler's planner; those parts need that role's distribution installed.

- ``pki``: a root CA, an org CA and one certificate per role (``make_pki``).
- ``polling``: ``eventually`` / ``until``, waiting on a condition instead of sleeping.
- ``mesh``: gateways and node links started in-process (``Mesh``).
- ``executors``: ``FakeNetwork`` playing the workers and scheduler around executors,
  ``FakeBridge`` and job/data helpers.
- ``real_bridge``: the worker's real job bridge over a ``FakeNetwork`` (``start_real_bridge``,
  ``executor_env``).
- ``rounds_sim``: simulated workers driving a round planner (tests and the ``rounds`` benchmark).
- ``cluster``: a local cluster of real processes (``E2ECluster``: e2e tests, the ``chaos`` benchmark).
- ``wan``: a link lab, network namespaces joined by veth pairs capped with ``tbf`` (``wan_lab``:
  the ``wan`` benchmark); needs root and iproute2.
"""
