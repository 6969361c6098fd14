"""Settings of the scheduler role: the common node sections plus [scheduler].

Market timings default to the reference system's values (ARCHITECTURE §5).
NOTE: ``offer_window_s`` must end before the offers collected in it lapse on
the workers, which hold them for ``worker.batch_window_s`` (when the window
opens) plus ``worker.offer_ttl_s``: 0.2 s + 0.5 s by default, so the window
defaults to 0.4 s. A mismatch is tolerated twice over: the window closes
early, ``accept_margin_s`` before the first offer it kept would lapse, and an
accept that still arrives too late fails on that worker, after which the
allocation advertises again for what it is missing (until
``allocate_timeout_s``). It costs time, never a double promise.
"""

from __future__ import annotations

import ipaddress
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from hypha.config.common import NodeSettings
from hypha.market.policies import POLICY_NAMES

ExecutorName = Literal["diloco-trainer", "parameter-server", "task", "inference"]


class PoolSection(BaseModel):
    """Workers held from start to shutdown, whatever jobs do: warm capacity, and an operations check."""

    model_config = ConfigDict(extra="forbid")

    count: int = Field(
        0, ge=0, description="Workers to lease at start and keep (lost ones are replaced); 0: none."
    )
    executor: ExecutorName = Field("task", description="Executor kind the pool's workers must run.")
    cpu: float = Field(0.0, ge=0, description="Minimum CPU cores per worker.")
    memory_gb: float = Field(0.0, ge=0, description="Minimum memory per worker, GB.")
    storage_gb: float = Field(0.0, ge=0, description="Minimum free disk per worker, GB.")
    gpu: float = Field(0.0, ge=0, description="Minimum GPUs per worker.")
    gpu_memory_gb: float = Field(0.0, ge=0, description="Minimum total GPU memory per worker, GB.")
    bid: float | None = Field(None, ge=0, description="Published bid (default: scheduler.bid).")
    max_price: float | None = Field(None, ge=0, description="Private maximum (default: scheduler.max_price).")


class JobsSection(BaseModel):
    """Deadlines and bounds of job orchestration (DiLoCo and task jobs)."""

    model_config = ConfigDict(extra="forbid")

    allocate_wait_s: float = Field(
        60.0,
        gt=0,
        description="How long a starting DiLoCo job keeps the leases it got while it tries for the rest "
        "of its parameter server and trainers; then it gives them back and waits in the queue (PENDING) "
        "for its next try, as a task job does. Cancel a job that asks for more than the cluster has.",
    )
    replace_patience_s: float = Field(
        120.0,
        gt=0,
        description="How long a running DiLoCo job waits for a free worker to replace a lost trainer or "
        "parameter server (trying the market again with backoff; its rounds pause meanwhile) before it "
        "fails.",
    )
    queue_retry_s: float = Field(
        2.0,
        gt=0,
        description="Pause before a queued job that found no worker tries the market again; also the first "
        "pause (doubling, jittered) between tries of a DiLoCo job still missing workers.",
    )
    max_parallel_allocations: int = Field(
        4, ge=1, description="Jobs leasing workers at once; the rest wait their turn in submission order."
    )
    provider_wait_s: float = Field(
        60.0,
        gt=0,
        description="How long a DiLoCo job waits for a data node to announce its dataset in the DHT.",
    )
    dispatch_timeout_s: float = Field(15.0, gt=0, description="Deadline of one DispatchJob call.")
    cancel_timeout_s: float = Field(5.0, gt=0, description="Deadline of one CancelJob call.")
    status_poll_s: float = Field(
        5.0,
        gt=0,
        description="How often running executions are checked with GetJobStatus, in case a status "
        "report from a worker was lost.",
    )
    task_timeout_grace_s: float = Field(
        30.0,
        ge=0,
        description="Past a task's timeout_s, how long the scheduler waits for the worker to report the "
        "timeout before it cancels the attempt itself.",
    )
    max_replacements: int = Field(
        8,
        ge=0,
        description="Lost or failed trainers and parameter servers one DiLoCo job may replace before it "
        "fails.",
    )
    result_timeout_s: float = Field(
        300.0, gt=0, description="Deadline for pulling a finished job's result from its parameter server."
    )
    result_max_files: int = Field(
        1000, gt=0, description="Most files one job's result may hold; a pull bringing more fails the job."
    )
    result_max_bytes: int = Field(
        64 * 1024**3,
        gt=0,
        description="Most bytes one job's result may hold; a pull bringing more fails the job.",
    )
    max_metric_rows: int = Field(
        10_000,
        ge=1,
        description="Per-round metric rows (loss, throughput, bytes per worker) the store keeps per job; "
        "past it the oldest are dropped, so a long job cannot grow the database without end.",
    )
    progress_store_interval_s: float = Field(
        1.0,
        ge=0,
        description="Least time between two progress writes of one job to the store (trainers report up to "
        "every batch, several times a second; watchers see the latest).",
    )
    sync_lookahead: float = Field(
        0.25,
        gt=0,
        le=1,
        description="Performance-aware rounds: once the rest of a round's sample budget takes at most this "
        "fraction of the round's expected length, each trainer is told how many batches it has left.",
    )


class SchedulerSection(BaseModel):
    model_config = ConfigDict(extra="forbid")

    grace_s: float = Field(5.0, ge=0, description="Seconds in-flight calls get to finish on shutdown.")
    # ---- buying workers --------------------------------------------------------
    bid: float = Field(1.0, ge=0, description="Default bid published in advertisements.")
    max_price: float = Field(
        10.0, ge=0, description="Default private maximum: offers priced above it are ignored."
    )
    policy: str = Field(
        "price-performance",
        description="Default selection policy: price-performance, round-robin, least-loaded, best-fit, "
        "balanced or performance-aware.",
    )
    offer_window_s: float = Field(
        0.4,
        gt=0,
        description="How long offers are collected after an advertisement (less when enough "
        "arrive sooner). Keep it below the workers' batch_window_s + offer_ttl_s (0.7 s by default).",
    )
    accept_margin_s: float = Field(
        0.1,
        ge=0,
        description="Offers are accepted at least this long before they lapse: the window "
        "closes early when the first offer kept would otherwise expire before it is accepted.",
    )
    offer_sampling: float = Field(
        4.0,
        ge=0,
        description="Offers wanted per advertisement, as a multiple of (workers asked for + 2): once "
        "this scheduler knows more workers than that, each answers with probability wanted / known, "
        "so a large pool sends a handful of offers instead of one per free worker. A round that "
        "ends short asks four times as many on the next, up to everyone. 0: every free worker answers "
        "every advertisement.",
    )
    allocate_timeout_s: float = Field(
        5.0,
        gt=0,
        description="How long one allocation may take; also the deadline its advertisements "
        "carry. Within it, missing workers are advertised for again, one window at a time.",
    )
    lease_ttl_s: float = Field(
        20.0,
        gt=0,
        description="Lease life asked for on accept and renewal; leases are renewed at 2/3 of it. Longer "
        "than a scheduler's restart (about 10 s from a kill to taking leases back in a container on 2 "
        "busy cores): a lease that ran out meanwhile is leased and started again instead of taken back. "
        "A DiLoCo job's leases are watched, so their loss is noticed in watch_lost_s whatever this is.",
    )
    rpc_timeout_s: float = Field(2.0, gt=0, description="Deadline of one accept, renew or release call.")
    watch_interval_s: float = Field(
        1.0,
        gt=0,
        description="How often a watched lease (a DiLoCo job's parameter server and trainers: the loss "
        "of either holds up a round) is renewed.",
    )
    watch_lost_s: float = Field(
        6.0,
        gt=0,
        description="A watched lease whose worker has not answered for this long is lost (its part is "
        "restored elsewhere) without waiting for the lease to expire. Longer than a worker's "
        "usual stalls, shorter than lease_ttl_s.",
    )
    adopt_patience_s: float = Field(
        15.0,
        gt=0,
        description="How long a restarted scheduler keeps trying to reach a worker to take back a lease "
        "it held (its gateway link or the relay may not be up yet); a lease the worker has ended is "
        "given up at once.",
    )
    connect_timeout_s: float = Field(
        2.0, gt=0, description="How long a direct connection to a worker may take before the relay is used."
    )
    replace_retry_s: float = Field(
        1.0, gt=0, description="Pause between attempts to replace a lost worker while none is found."
    )
    pool: PoolSection = Field(default_factory=PoolSection, description="A standing pool of leased workers.")
    # ---- finding data ------------------------------------------------------------
    dht_bootstrap: list[str] = Field(
        default_factory=list,
        description="DHT nodes (HOST:PORT, usually the gateways' DHT ports) to join, to find the data "
        "nodes serving a job's dataset. Empty: DiLoCo jobs cannot find data and fail.",
    )
    dht_host: str = Field("127.0.0.1", description="Address this scheduler's DHT endpoint binds.")
    dht_port: int = Field(0, ge=0, le=65535, description="UDP port of the DHT endpoint (0: any free port).")
    dht_rpc_timeout_s: float = Field(2.0, gt=0, description="Timeout of one DHT RPC to one peer.")
    dht_lookup_timeout_s: float = Field(5.0, gt=0, description="Longest one provider lookup may take.")
    dht_min_stall_s: float = Field(
        0.005,
        gt=0,
        description="Floor of the stall threshold: a DHT query unanswered for 3x the 90th percentile of "
        "recent round trips (at least this) stops holding up a lookup, and its peer is backed off.",
    )
    dht_max_stall_s: float = Field(
        1.0, gt=0, description="Cap of the stall threshold (at most dht_rpc_timeout_s is used)."
    )
    dht_cache_fresh_s: float = Field(
        2.0,
        ge=0,
        description="A dataset whose providers a lookup collected less than this ago is answered from "
        "the scheduler's cache of verified records, without asking the DHT (0: every lookup asks).",
    )
    # ---- client access and monitoring ------------------------------------------------
    rest_listen: str = Field(
        "127.0.0.1:0",
        description="HOST:PORT of the REST mirror of the client API (HTTPS with the same mTLS; "
        "also serves Prometheus /metrics); port 0: any free port; empty: no REST server.",
    )
    status_page_listen: str = Field(
        "127.0.0.1:0",
        description="HOST:PORT of the read-only status web page (plain HTTP: jobs, rounds, loss and "
        "metric curves, workers; no client certificate needed, so loopback only unless "
        "status_page_public); port 0: any free port (the ready line names the URL); empty: off.",
    )
    status_page_public: bool = Field(
        False,
        description="Allow status_page_listen on a non-loopback address: anyone who can reach it "
        "sees every job's name, state and metrics (put a reverse proxy with authentication in front).",
    )
    status_bridge: str = Field(
        "",
        description="HOST:PORT (or URL) of an AIM status bridge: every training metric is POSTed to "
        "/status as JSON; empty: none.",
    )
    # ---- running jobs ----------------------------------------------------------------
    jobs: JobsSection = Field(default_factory=JobsSection, description="How jobs are run.")

    @model_validator(mode="after")
    def _check(self) -> SchedulerSection:
        if self.policy not in POLICY_NAMES:
            raise ValueError(f"unknown policy {self.policy!r} (valid: {', '.join(POLICY_NAMES)})")
        if self.max_price < self.bid:
            raise ValueError("max_price must be at least bid")
        if self.offer_window_s >= self.allocate_timeout_s:
            raise ValueError("offer_window_s must be shorter than allocate_timeout_s")
        if self.status_page_listen and not self.status_page_public:
            host = self.status_page_listen.rpartition(":")[0].strip("[]")
            if host != "localhost" and not _is_loopback(host):
                raise ValueError(
                    f"status_page_listen {self.status_page_listen!r} is not a loopback address: the page "
                    "has no authentication; set status_page_public = true to serve it there anyway"
                )
        return self


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


#: The state dir ``hypha-scheduler init`` writes: next to the config file (the loader makes it
#: absolute against the file's directory), so a scheduler started by hand keeps its jobs,
#: their history and results across restarts.
DEFAULT_STATE_DIR = "scheduler-state"


class SchedulerSettings(NodeSettings):
    state_dir: Path | None = Field(
        None,
        description="Directory of the job store (scheduler.db), task bundles and job results; "
        f'`hypha-scheduler init` writes "{DEFAULT_STATE_DIR}" (next to the config file). Unset: jobs '
        "live in memory only and are lost when the scheduler stops (a warning says so at start). "
        "A relative path is resolved against the config file's directory.",
        examples=[DEFAULT_STATE_DIR],
    )
    scheduler: SchedulerSection = Field(default_factory=SchedulerSection, description="Scheduler settings.")
