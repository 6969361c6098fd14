"""The scheduler's DiLoCo run, one module per phase (as hivemind lays out ``averaging/``).

- ``run``: ``DilocoRun``, the job from start to result, answering its workers' reports;
- ``state``: the run's state (``DilocoState``) and the operations its phases use (``DilocoOps``);
- ``dispatch``: what the parameter server and each trainer are sent;
- ``trainers``: leasing, adding and replacing trainers;
- ``ps_state``, ``ps_recovery``: the parameter server's state kept every round, and its restore;
- ``elastic``: growing or shrinking a running job (``hypha scale``);
- ``snapshot``, ``resume``: the run's state saved incrementally, and the job resumed after a
  scheduler restart;
- ``round_planner``: how many batches each trainer runs before a sync;
- ``slice_tracker``: which trainer works on which dataset slice, epoch by epoch.

Nothing is imported here, so a caller that needs only the planner or the tracker loads no more.
"""
