"""Settings of the worker role: the common node sections plus [worker].

Market timings default to the reference system's values (ARCHITECTURE §5);
they are config values, not constants, so operators can tune them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from hypha.config.common import NodeSettings
from hypha.market.resources import ExecutorKind
from hypha.worker.jobs_config import ConfiguredExecutor, JobsSection
from hypha.worker.resources import ResourceLimits

ExecutorName = Literal["diloco-trainer", "parameter-server", "task", "inference"]


class ResourceValues(BaseModel):
    """One value per resource; unset fields are left alone."""

    model_config = ConfigDict(extra="forbid")

    cpu: float | None = Field(None, ge=0, description="CPU cores.")
    memory_gb: float | None = Field(None, ge=0, description="Memory in GB.")
    storage_gb: float | None = Field(None, ge=0, description="Disk space for job work dirs in GB.")
    gpu: float | None = Field(None, ge=0, description="Number of GPUs.")
    gpu_memory_gb: float | None = Field(None, ge=0, description="Total GPU memory across the GPUs, in GB.")

    def limits(self) -> ResourceLimits:
        return ResourceLimits(**self.model_dump())


class WorkerSection(BaseModel):
    model_config = ConfigDict(extra="forbid")

    grace_s: float = Field(5.0, ge=0, description="Seconds in-flight calls get to finish on shutdown.")
    # ---- what it sells, and for how much ------------------------------------
    price: float = Field(
        1.0,
        ge=0,
        description="Asking price for the whole machine (strategy 'whole' offers at max(price, bid)).",
    )
    floor: float = Field(
        0.0, ge=0, description="Lowest bid this worker answers; lower advertisements get no offer."
    )
    strategy: Literal["whole", "flexible"] = Field(
        "whole",
        description="'whole': offer the whole free machine at max(price, bid); "
        "'flexible': offer exactly the requested minimum at the bid.",
    )
    executors: list[ExecutorName] = Field(
        default_factory=lambda: [kind.value for kind in ExecutorKind],
        min_length=1,
        description="Executor kinds this worker runs (diloco-trainer, parameter-server, task, inference).",
    )
    work_dir: Path | None = Field(
        None,
        description="Where job work dirs go (its free disk space is the storage sold); "
        "default: STATE_DIR/work, or ./work-NAME without a state dir.",
    )
    resources: ResourceValues = Field(
        default_factory=ResourceValues,
        description="Capacity to sell instead of what is detected; an unset field is detected "
        "(CPU affinity, /proc/meminfo, free disk of work_dir, torch.cuda).",
    )
    max_resources: ResourceValues = Field(
        default_factory=ResourceValues,
        description="Caps applied after detection, e.g. to keep a core for the OS.",
    )
    # ---- market timings ------------------------------------------------------
    offer_ttl_s: float = Field(
        0.5,
        gt=0,
        description="How long resources stay reserved behind an offer the scheduler has not accepted. "
        "Schedulers' offer windows must end before it (see scheduler.offer_window_s).",
    )
    batch_window_s: float = Field(
        0.2, gt=0, description="How long advertisements are collected before deciding which to answer."
    )
    batch_max: int = Field(100, ge=1, description="Decide early once this many advertisements are waiting.")
    buffer_max: int = Field(
        1000, ge=1, description="Advertisements waiting at most; beyond, they are dropped."
    )
    lease_ttl_s: float = Field(
        10.0, gt=0, description="Lease life granted when an accepting scheduler does not ask for one."
    )
    max_lease_ttl_s: float = Field(60.0, gt=0, description="Longest lease life granted on accept or renewal.")
    prune_interval_s: float = Field(
        0.25, gt=0, description="How often expired leases are ended (and the jobs under them cancelled)."
    )
    max_leases: int = Field(10_000, ge=1, description="Live leases (offers included) held at most.")
    offer_timeout_s: float = Field(
        2.0,
        gt=0,
        description="Deadline of one SubmitOffer call; a failed offer frees its reservation at once.",
    )
    connect_timeout_s: float = Field(
        2.0,
        gt=0,
        description="How long a direct connection to a scheduler may take before the relay is used.",
    )
    max_concurrent_offers: int = Field(64, ge=1, description="Offers in flight at once.")
    metrics_listen: str = Field(
        "",
        description="HOST:PORT of this worker's Prometheus /metrics (HTTPS with the network's mTLS: any "
        "certificate of the network may scrape); port 0: any free port; empty (the default): no metrics "
        "endpoint.",
        examples=["0.0.0.0:9464"],
    )
    jobs: JobsSection = Field(default_factory=JobsSection, description="How executor processes are run.")

    @model_validator(mode="after")
    def _check(self) -> WorkerSection:
        if self.buffer_max < self.batch_max:
            raise ValueError("buffer_max must be at least batch_max")
        if self.max_lease_ttl_s < self.lease_ttl_s:
            raise ValueError("max_lease_ttl_s must be at least lease_ttl_s")
        return self


class WorkerSettings(NodeSettings):
    worker: WorkerSection = Field(default_factory=WorkerSection, description="Worker settings.")
    # NOTE: top level, as the reference system's worker config has it, so its block pastes unchanged.
    executors: list[ConfiguredExecutor] = Field(
        default_factory=list,
        description="Trainer programs ([[executors]]: class, name, runtime, cmd, args) that DiLoCo "
        "jobs may name in [job.trainer_executor] (docs/job-bridge.md).",
    )

    @model_validator(mode="after")
    def _unique_executors(self) -> WorkerSettings:
        names = [(e.executor_class, e.name) for e in self.executors]
        if len(names) != len(set(names)):
            raise ValueError("two [[executors]] entries share a class and name")
        return self

    def work_dir(self) -> Path:
        if self.worker.work_dir is not None:
            return self.worker.work_dir
        if self.state_dir is not None:
            return self.state_dir / "work"
        # Named per node, so several workers started in one directory never share job dirs.
        return Path.cwd() / f"work-{self.name}"
