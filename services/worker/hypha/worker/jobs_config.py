"""``[worker.jobs]``: how the worker runs executor processes (its own module so config loading
stays free of the job machinery's imports).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict, Field

if TYPE_CHECKING:
    from hypha.worker.bridge import BridgeLimits
    from hypha.worker.model_fetch import HubSettings
    from hypha.worker.tensor_inbox import TransferSettings

#: ``sandbox`` values; kept here (not imported from ``sandbox``) so config loading stays light.
SandboxMode = Literal["auto", "bwrap", "landlock", "none"]

_DEFAULT_PASSTHROUGH = [
    "PATH",
    "HOME",
    "USER",
    "LANG",
    "LC_ALL",
    "TZ",
    "PYTHONPATH",
    "VIRTUAL_ENV",
    "LD_LIBRARY_PATH",
    "SSL_CERT_FILE",
    "SSL_CERT_DIR",
    "HF_HUB_OFFLINE",
    "HF_ENDPOINT",
]


#: Placeholders a configured executor's ``args`` may hold, filled per execution.
EXECUTOR_PLACEHOLDERS = ("{SOCKET_PATH}", "{WORK_DIR}", "{JOB_JSON}")


class ConfiguredExecutor(BaseModel):
    """One ``[[executors]]`` entry: a trainer program the worker runs for jobs that name it.

    The block is the reference system's (class, name, runtime, cmd, args), so an
    executor written for it is configured here unchanged; the program speaks the
    reference job bridge API (docs/job-bridge.md).
    """

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    executor_class: Literal["train"] = Field(
        alias="class", description="Executor class; 'train': a DiLoCo trainer."
    )
    name: str = Field(min_length=1, description="Name a job's [job.trainer_executor] gives.")
    runtime: Literal["process"] = Field("process", description="'process': a program the worker starts.")
    cmd: str = Field(min_length=1, description="The program (a path, or a name looked up in PATH).")
    args: list[str] = Field(
        default_factory=list,
        description="Its arguments; {SOCKET_PATH}, {WORK_DIR} and {JOB_JSON} are replaced by the "
        "bridge socket, the work dir and the job as JSON (also given as the environment variables "
        "SOCKET_PATH, WORK_DIR and JOB_JSON).",
    )


class JobsSection(BaseModel):
    """``[worker.jobs]``: how the worker runs executor processes."""

    model_config = ConfigDict(extra="forbid")

    max_concurrent_jobs: int = Field(16, ge=1, description="Executions running at once at most.")
    max_jobs_per_gpu: int = Field(
        1, ge=1, description="Executions that may share one GPU (each GPU is that many slots)."
    )
    gpus: int | None = Field(
        None, ge=0, description="GPUs handed out as slots; default: the worker's GPU capacity."
    )
    threads_per_job: int | None = Field(
        None,
        ge=1,
        description="Thread count (OMP/MKL/torch) of each executor; default: the job's CPU requirement, "
        "else the cores divided among the running jobs.",
    )
    stop_grace_s: float = Field(
        10.0, ge=0, description="Seconds between SIGTERM and SIGKILL when a job is stopped."
    )
    memory_poll_s: float = Field(
        0.25,
        gt=0,
        description="How often each job's memory is measured: the resident memory (RSS) of every "
        "process of its process group, summed (a page shared by several counts for each). A job "
        "over the memory_gb its lease grants is killed at once (SIGKILL, no grace) and fails; a "
        "spike shorter than this can pass unseen.",
    )
    default_memory_gb: float | None = Field(
        None,
        gt=0,
        description="Memory bound, in GB, of a job whose lease names no memory_gb, held like a "
        "leased one (memory_poll_s); none: such a job's memory is unbounded.",
    )
    disk_poll_s: float = Field(
        5.0,
        gt=0,
        description="How often each job's work dir is measured (the disk its files take, links not "
        "followed); a job over the storage_gb its lease grants is killed at once and fails. What it "
        "writes between two measurements can go past the bound.",
    )
    reattach_grace_s: float = Field(
        60.0,
        ge=0,
        description="How long a DiLoCo execution whose lease expired (its scheduler is away, e.g. "
        "restarting) keeps running for that scheduler to take it back; 0 stops it at once. "
        "Task executions always stop when their lease ends.",
    )
    default_task_timeout_s: float | None = Field(
        None, gt=0, description="Timeout of task jobs whose spec sets none (none: no timeout)."
    )
    max_task_timeout_s: float | None = Field(None, gt=0, description="Cap on any job's timeout.")
    marker_poll_s: float = Field(1.0, gt=0, description="How often a task's completion marker is looked for.")
    marker_exit_grace_s: float = Field(
        10.0, ge=0, description="How long a task may keep running after its completion marker appeared."
    )
    cleanup: Literal["always", "on_success", "never"] = Field(
        "on_success",
        description="When a finished job's work dir is removed at once; kept dirs (a later attempt "
        "resumes from their checkpoints) are removed after retain_s.",
    )
    retain_s: float = Field(86_400.0, ge=0, description="How long kept work dirs and results stay.")
    executor_commands: dict[str, list[str]] = Field(
        default_factory=dict,
        description="Command replacing a built-in executor program, by kind (diloco-trainer, "
        "parameter-server).",
    )
    sandbox: SandboxMode = Field(
        "auto",
        description="How executors are confined (docs/security.md): 'bwrap' runs each in a bubblewrap "
        "sandbox that sees only its work dir and the Python environment; 'landlock' (Linux 5.13+, "
        "works in containers where bwrap cannot) lets each read only the system dirs, the Python "
        "environment and sandbox_paths and write only its work dir, and refuses to start when this "
        "worker's key, config or state lie beneath those; 'none' runs them as this worker's user, "
        "able to read its key; 'auto' is bwrap, else landlock, and refuses to start where neither "
        "works.",
    )
    warm_executor: bool = Field(
        False,
        description="Keep one executor process started ahead, in the sandbox, with torch imported; "
        "the next built-in executor (trainer, parameter server, inference) in a fresh work dir becomes "
        "it instead of starting cold (a restored parameter server or a replacement trainer is serving "
        "seconds sooner: 10-12 s of imports on 2 busy cores, about 2 s idle). Costs one idle process "
        "(about 0.5 GB) per worker. Sandboxes 'landlock' and 'none' only; under 'bwrap' it is ignored.",
    )
    sandbox_paths: list[Path] = Field(
        default_factory=list,
        description="Extra paths executors may read inside the sandbox (e.g. a toolchain a task job "
        "runs, or the home of a replaced executor command).",
    )
    model_factories: list[str] = Field(
        default_factory=list,
        description="Torch model factories ('pkg.module:factory', or 'pkg.module:*' for all of a "
        "module) a DiLoCo job may name, besides the built-in ones; any other is refused before "
        "anything is imported.",
    )
    env_passthrough: list[str] = Field(
        default_factory=lambda: list(_DEFAULT_PASSTHROUGH),
        description="Worker environment variables executors inherit; nothing else is inherited.",
    )
    hf_endpoint: str | None = Field(None, description="Hugging Face hub endpoint (default: HF_ENDPOINT).")
    hf_token: str | None = Field(None, description="Hub token used when a job's spec carries none.")
    local_model_roots: list[Path] = Field(
        default_factory=list,
        description="Directories a job's local model/preprocessor path may point into (none: local "
        "paths are refused).",
    )
    max_request_bytes: int = Field(1 << 20, ge=1024, description="Largest job bridge request body.")
    max_wait_s: float = Field(3600.0, gt=0, description="Longest inbox or tensor fetch wait on the bridge.")
    slice_lookahead: bool = Field(True, description="Reserve and prefetch the next data slice early.")
    inbox_max: int = Field(16, ge=1, description="Received tensor payloads queued per job and kind.")
    max_tensor_bytes: int = Field(8 << 30, ge=1, description="Largest tensor payload received.")
    tensor_memory_bytes: int = Field(
        64 << 20,
        ge=0,
        description="Received tensor payloads larger than this are spooled to disk as they arrive, "
        "not held in memory.",
    )
    inbox_max_bytes: int = Field(
        16 << 30,
        ge=1,
        description="Bytes of received tensor payloads queued per job (in memory or spooled); "
        "further pushes wait, then fail with RESOURCE_EXHAUSTED.",
    )
    slice_cache_bytes: int = Field(
        20 << 30,
        ge=1,
        description="Size of the worker's data slice cache; the least recently used slices are "
        "evicted beyond it.",
    )
    slice_chunk_timeout_s: float = Field(
        30.0,
        gt=0,
        description="Longest wait for the next chunk (at most 1 MiB) of a data slice before the "
        "download is resumed from where it stopped, on a new connection or another provider: a data "
        "node that died mid-stream sends nothing and no error. Lower it to notice that sooner on "
        "fast links; at least ~1 s per MiB the link carries.",
    )
    send_attempts: int = Field(4, ge=1, description="Attempts of one tensor send when streams break.")
    log_queue_max: int = Field(10_000, ge=1, description="Log lines queued per job for the scheduler.")
    max_log_line_bytes: int = Field(16_384, ge=80, description="Longer log lines are cut.")
    status_timeout_s: float = Field(10.0, gt=0, description="Time spent reporting a job's final state.")

    def transfer_settings(self, spool_dir: Path | None = None) -> TransferSettings:
        from hypha.worker.tensor_inbox import TransferSettings

        return TransferSettings(
            inbox_max=self.inbox_max,
            max_payload_bytes=self.max_tensor_bytes,
            memory_payload_bytes=self.tensor_memory_bytes,
            inbox_max_bytes=self.inbox_max_bytes,
            spool_dir=spool_dir,
            send_attempts=self.send_attempts,
        )

    def bridge_limits(self) -> BridgeLimits:
        from hypha.worker.bridge import BridgeLimits

        return BridgeLimits(
            max_body_bytes=self.max_request_bytes,
            max_wait_s=self.max_wait_s,
            slice_lookahead=self.slice_lookahead,
        )

    def hub_settings(self, work_root: Path) -> HubSettings:
        from hypha.worker.model_fetch import HubSettings

        return HubSettings(
            cache_dir=work_root / "hub-cache",
            endpoint=self.hf_endpoint,
            token=self.hf_token,
            local_roots=tuple(self.local_model_roots),
        )
