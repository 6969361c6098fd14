"""Job files: our [job] table and the reference scheduler config's [scheduler.job] parse into a
JobSpec; every mistake names its key."""

from __future__ import annotations

import textwrap

import pytest

from hypha.errors import InvalidArgumentError
from hypha.jobfile import Defaults, normalize_spec, parse_job_table, parse_job_toml
from hypha.v1 import common_pb2

SEED_000 = """
name = "sched"
status_bridge = "aim-bridge.internal:61000"

[scheduler.job.model]
repository = "l45k/Resnet50"
revision = "main"
filenames = ["config.json", "model.safetensors"]
token = "hf_secret"
type = "vision-classification"

[scheduler.job.preprocessor]
repository = "l45k/Resnet50"
filenames = ["preprocessor_config.json"]

[scheduler.job.dataset]
dataset = "imagenet"

[scheduler.job.inner_optimizer]
learning_rate = 0.001
betas = [0.8, 0.99]

[scheduler.job.outer_optimizer]
learning_rate = 0.7
momentum = 0.9

[scheduler.job.resources]
num_workers = 4

[[scheduler.job.resources.worker]]
type = "GPU"
min = 10.0

[[scheduler.job.resources.worker]]
type = "CPU"
min = 2.0

[[scheduler.job.resources.worker]]
type = "Memory"
min = 8.0

[[scheduler.job.resources.worker]]
kind = "diloco-transformer"

[[scheduler.job.resources.parameter_server]]
type = "CPU"
min = 4.0

[[scheduler.job.resources.parameter_server]]
type = "Memory"
min = 16.0

[[scheduler.job.resources.parameter_server]]
kind = "parameter-server"

[scheduler.job.resources.worker_price]
bid = 110.0
max = 160.0

[scheduler.job.resources.parameter_server_price]
bid = 80.0
max = 120.0
"""

DILOCO = """
[job]
name = "tiny"
dataset = "arithmetic"
rounds = 3
samples_per_round = 256
max_batch_size = 16
[job.model]
local_path = "/models/tiny"
type = "causal-lm"
[job.resources]
num_workers = 2
worker = { cpu = 1, memory_gb = 2 }
"""

TASK = """
[job]
name = "train"
command = "python"
args = ["train.py", "--epochs", "3"]
env = { SEED = 1, FAST = true }
gpus = 1
timeout_s = 60
completion_marker = "out/done.txt"
resources = { cpu = 2, memory_gb = 4 }
price = { bid = 1.5 }
[job.retry]
max_attempts = 4
backoff_base = 1.0
backoff_max = 30.0
retry_on_worker_failure = false
"""


def test_seed_000_scheduler_job_section_parses_with_requirement_lists_and_prices() -> None:
    spec = parse_job_toml(SEED_000)
    d = spec.diloco
    assert spec.WhichOneof("kind") == "diloco"
    assert (
        d.model.repository == "l45k/Resnet50" and d.model.type == common_pb2.MODEL_TYPE_VISION_CLASSIFICATION
    )
    assert d.preprocessor.filenames == ["preprocessor_config.json"]
    assert d.dataset == "imagenet" and d.num_workers == 4
    assert (d.inner_optimizer.beta1, d.inner_optimizer.beta2) == (0.8, 0.99)
    w = d.worker_requirements
    assert (w.minimum.gpu_memory_gb, w.minimum.cpu, w.minimum.memory_gb) == (10.0, 2.0, 8.0)
    assert w.executor == common_pb2.EXECUTOR_KIND_DILOCO_TRAINER
    ps = d.parameter_server_requirements
    assert (ps.minimum.cpu, ps.minimum.memory_gb) == (4.0, 16.0)
    assert ps.executor == common_pb2.EXECUTOR_KIND_PARAMETER_SERVER
    assert (d.worker_price.bid, d.worker_price.max) == (110.0, 160.0)
    assert (d.parameter_server_price.bid, d.parameter_server_price.max) == (80.0, 120.0)
    assert d.rounds == Defaults.ROUNDS and d.quorum == Defaults.QUORUM


def test_job_table_gets_defaults_for_what_it_leaves_out() -> None:
    d = parse_job_toml(DILOCO).diloco
    assert (d.rounds, d.samples_per_round, d.min_batch_size, d.max_batch_size) == (3, 256, 1, 16)
    assert d.worker_requirements.minimum.cpu == 1 and d.worker_requirements.minimum.memory_gb == 2
    assert (
        d.outer_optimizer.learning_rate == Defaults.OUTER_LR
        and d.outer_optimizer.momentum == Defaults.MOMENTUM
    )
    assert d.inner_optimizer.weight_decay == Defaults.WEIGHT_DECAY
    assert (d.inner_optimizer.max_grad_norm, d.inner_optimizer.warmup_steps) == (0.0, 0)  # both off
    tuned = parse_job_toml(
        DILOCO.replace(
            "[job.model]", "[job.inner_optimizer]\nmax_grad_norm = 1.0\nwarmup_steps = 100\n[job.model]"
        )
    ).diloco.inner_optimizer
    assert (tuned.max_grad_norm, tuned.warmup_steps) == (1.0, 100)
    assert (d.inner_optimizer.decay_steps, d.inner_optimizer.min_lr_ratio) == (0, Defaults.MIN_LR_RATIO)
    decayed = parse_job_toml(
        DILOCO.replace(
            "[job.model]",
            "[job.inner_optimizer]\nwarmup_steps = 10\ndecay_steps = 500\nmin_lr_ratio = 0.0\n[job.model]",
        )
    ).diloco.inner_optimizer
    assert (decayed.warmup_steps, decayed.decay_steps, decayed.min_lr_ratio) == (10, 500, 0.0)
    # A job file's sync defaults are the measured slow-link settings (docs/compression.md).
    assert d.delta_dtype == common_pb2.DELTA_DTYPE_INT8 and d.streaming_fragments == 0
    streaming = parse_job_toml(
        DILOCO.replace("max_batch_size = 16", "max_batch_size = 16\nstreaming_fragments = 4")
    )
    assert streaming.diloco.streaming_fragments == 4
    assert d.max_samples_per_round == 0  # fixed rounds
    fitted = parse_job_toml(
        DILOCO.replace("max_batch_size = 16", "max_batch_size = 16\nmax_samples_per_round = 1024")
    )
    assert fitted.diloco.max_samples_per_round == 1024
    assert d.overlap_sync and d.update_dtype == common_pb2.DELTA_DTYPE_INT8
    exact = parse_job_toml(
        DILOCO.replace(
            "max_batch_size = 16",
            'max_batch_size = 16\noverlap_sync = false\ndelta_dtype = "FP32"\nupdate_dtype = "fp32"',
        )
    ).diloco
    assert not exact.overlap_sync
    # fp32 both ways: Δ exact, and θ_global itself comes down.
    assert exact.delta_dtype == exact.update_dtype == common_pb2.DELTA_DTYPE_FP32
    assert d.worker_price.bid == 0 and d.worker_price.max == 0  # 0: the scheduler's default


def test_task_job_parses_env_gpus_and_seed_001_retry_names() -> None:
    t = parse_job_toml(TASK).task
    assert t.command == "python" and list(t.args) == ["train.py", "--epochs", "3"]
    assert dict(t.env) == {"SEED": "1", "FAST": "true"}
    assert t.requirements.minimum.gpu == 1 and t.requirements.executor == common_pb2.EXECUTOR_KIND_TASK
    assert (t.price.bid, t.price.max) == (1.5, 1.5)
    r = t.retry
    assert (r.max_attempts, r.backoff_base_s, r.backoff_cap_s) == (4, 1.0, 30.0)
    assert r.retry_on_timeout and not r.retry_on_worker_loss


def test_kind_is_inferred_and_a_task_table_from_json_is_accepted() -> None:
    spec = parse_job_table({"command": "echo", "args": ["hi"]}, "task", kind="task")
    assert spec.task.command == "echo" and spec.task.retry.max_attempts == Defaults.MAX_ATTEMPTS
    with pytest.raises(InvalidArgumentError, match=r"^task\.kind: must be 'task' here"):
        parse_job_table({"kind": "diloco", "command": "echo"}, "task", kind="task")


MALFORMED = [
    (
        'worker_price = { bid = "cheap" }',
        "job.resources.worker_price.bid: must be a number",
    ),
    ("worker_price = { bid = 2.0, max = 1.0 }", "job.resources.worker_price.max: must be at least bid"),
    ('worker = [{ type = "TPU", min = 1 }]', "job.resources.worker[0].type: unknown resource type 'TPU'"),
    ('worker = [{ type = "CPU" }]', "job.resources.worker[0].min: missing"),
    ('worker = [{ kind = "parameter-server" }]', "job.resources.worker[0].kind: must be diloco-trainer here"),
    ("num_workers = 0", "job.resources.num_workers: must be at least 1"),
    ("num_workers = 1.5", "job.resources.num_workers: must be an integer"),
    ("worker = { cpus = 1 }", "job.resources.worker.cpus: unknown key"),
]


@pytest.mark.parametrize(("resources", "expected"), MALFORMED)
def test_malformed_resources_name_the_dotted_key(resources: str, expected: str) -> None:
    block = "num_workers = 2\nworker = { cpu = 1, memory_gb = 2 }"
    assert block in DILOCO
    if not resources.startswith("num_workers"):
        resources = "num_workers = 2\n" + resources
    text = DILOCO.replace(block, resources)
    with pytest.raises(InvalidArgumentError) as info:
        parse_job_toml(text)
    assert info.value.message.startswith(expected), info.value.message


@pytest.mark.parametrize(
    ("edit", "expected"),
    [
        (("rounds = 3", "rounds = 0"), "job.rounds: must be at least 1"),
        (("rounds = 3", "round = 3"), "job.round: unknown key"),
        (('dataset = "arithmetic"', ""), "job.dataset: missing"),
        (('dataset = "arithmetic"', 'dataset = ["a"]'), "job.dataset: must be a string"),
        (
            ("max_batch_size = 16", "max_batch_size = 16\nmin_batch_size = 32"),
            "job.max_batch_size: must be at least",
        ),
        (("max_batch_size = 16", "quorum = 2.0"), "job.quorum: must be in (0, 1]"),
        (("max_batch_size = 16", 'delta_dtype = "int4"'), "job.delta_dtype: unknown dtype"),
        (("max_batch_size = 16", "delta_topk = 1.5"), "job.delta_topk: must be 0 (off) or in"),
        (("max_batch_size = 16", 'update_dtype = "int4"'), "job.update_dtype: unknown dtype 'int4'"),
        (("max_batch_size = 16", 'delta_topk = "half"'), "job.delta_topk: must be a number"),
        (
            ("max_batch_size = 16", "max_samples_per_round = 100"),
            "job.max_samples_per_round: must be 0 (rounds of samples_per_round) or at least",
        ),
        (
            ("max_batch_size = 16", "streaming_fragments = 5000"),
            "job.streaming_fragments: must be 0 (off) or",
        ),
        (("max_batch_size = 16", "streaming_fragments = 2.5"), "job.streaming_fragments: must be an integer"),
        (("max_batch_size = 16", 'selection_policy = "cheapest"'), "job.selection_policy: unknown selection"),
        (('type = "causal-lm"', 'type = "gan"'), "job.model.type: unknown model type"),
        (('local_path = "/models/tiny"', 'repo = "x/y"'), "job.model.repo: unknown key"),
        (('local_path = "/models/tiny"', ""), "job.model.repository: missing"),
        (
            ("[job.model]", "[job.inner_optimizer]\nbetas = [0.9]\n[job.model]"),
            "job.inner_optimizer.betas: must be",
        ),
        (
            ("[job.model]", "[job.inner_optimizer]\nmax_grad_norm = -1.0\n[job.model]"),
            "job.inner_optimizer.max_grad_norm: must be 0 (no clipping) or positive",
        ),
        (
            ("[job.model]", "[job.inner_optimizer]\nwarmup_steps = 0.5\n[job.model]"),
            "job.inner_optimizer.warmup_steps: must be an integer",
        ),
        (
            ("[job.model]", "[job.inner_optimizer]\nwarmup_steps = -10\n[job.model]"),
            "job.inner_optimizer.warmup_steps: must not be negative",
        ),
        (
            ("[job.model]", "[job.inner_optimizer]\nwarmup_steps = 20\ndecay_steps = 20\n[job.model]"),
            "job.inner_optimizer.decay_steps: must be 0 (off) or above warmup_steps (20)",
        ),
        (
            ("[job.model]", "[job.inner_optimizer]\ndecay_steps = 100\nmin_lr_ratio = 1.5\n[job.model]"),
            "job.inner_optimizer.min_lr_ratio: must be in [0, 1]",
        ),
        (
            ("[job.model]", "[job.outer_optimizer]\nmomentum = 1.5\n[job.model]"),
            "job.outer_optimizer.momentum",
        ),
    ],
)
def test_malformed_diloco_jobs_name_the_dotted_key(edit: tuple[str, str], expected: str) -> None:
    old, new = edit
    assert old in DILOCO
    with pytest.raises(InvalidArgumentError) as info:
        parse_job_toml(DILOCO.replace(old, new, 1))
    assert info.value.message.startswith(expected), info.value.message


@pytest.mark.parametrize(
    ("edit", "expected"),
    [
        (('command = "python"', 'command = ""'), "job.command: must not be empty"),
        (
            ('completion_marker = "out/done.txt"', 'completion_marker = "../x"'),
            "job.completion_marker: must be a relative",
        ),
        (("timeout_s = 60", "timeout_s = -1"), "job.timeout_s: must not be negative"),
        (("max_attempts = 4", "max_attempts = 0"), "job.retry.max_attempts: must be at least 1"),
        (
            ("backoff_max = 30.0", "backoff_max = 0.5"),
            "job.retry.backoff_cap_s: must be at least backoff_base_s",
        ),
        (("max_attempts = 4", "max_attempts = 4\nretries = 2"), "job.retry.retries: unknown key"),
        (("gpus = 1", 'gpus = "one"'), "job.gpus: must be an integer"),
        (
            ("env = { SEED = 1, FAST = true }", "env = { SEED = [1] }"),
            "job.env.SEED: must be a string or number",
        ),
    ],
)
def test_malformed_task_jobs_name_the_dotted_key(edit: tuple[str, str], expected: str) -> None:
    old, new = edit
    assert old in TASK
    with pytest.raises(InvalidArgumentError) as info:
        parse_job_toml(TASK.replace(old, new, 1))
    assert info.value.message.startswith(expected), info.value.message


def test_file_level_mistakes_are_named_too() -> None:
    cases = {
        "[job\nname = 1": "job file: invalid TOML",
        "name = 'x'": "job: missing",
        DILOCO + "\n[extra]\nx = 1": "extra: unknown key",
        "[job]\nname = 'x'": "job.kind: missing",
        "[job]\nkind = 'batch'\ncommand = 'x'": "job.kind: unknown job kind 'batch'",
        SEED_000.replace(
            "min = 10.0", 'min = "lots"'
        ): "scheduler.job.resources.worker[0].min: must be a number",
    }
    for text, expected in cases.items():
        with pytest.raises(InvalidArgumentError) as info:
            parse_job_toml(text)
        assert info.value.message.startswith(expected), info.value.message


def test_structured_specs_get_the_same_defaults_and_checks_named_by_proto_field() -> None:
    spec = common_pb2.JobSpec(
        diloco=common_pb2.DilocoJobSpec(model=common_pb2.ModelSpec(repository="a/b"), dataset="d")
    )
    normalized = normalize_spec(spec)
    d = normalized.diloco
    assert d.rounds == Defaults.ROUNDS and d.num_workers == Defaults.NUM_WORKERS
    assert d.inner_optimizer.beta2 == Defaults.BETA2 and d.outer_optimizer.momentum == Defaults.MOMENTUM
    assert d.worker_requirements.executor == common_pb2.EXECUTOR_KIND_DILOCO_TRAINER
    spec.diloco.quorum = 3.0
    with pytest.raises(InvalidArgumentError, match=r"^spec\.diloco\.quorum: must be in"):
        normalize_spec(spec)
    with pytest.raises(InvalidArgumentError, match=r"^spec\.kind: missing"):
        normalize_spec(common_pb2.JobSpec(name="x"))


@pytest.mark.parametrize("text", [SEED_000, DILOCO, TASK])
def test_a_parsed_spec_is_already_normal(text: str) -> None:
    spec = parse_job_toml(text)
    assert normalize_spec(spec) == spec


def test_job_file_size_is_bounded() -> None:
    with pytest.raises(InvalidArgumentError, match="larger than"):
        parse_job_toml(textwrap.dedent(DILOCO) + "#" * 300_000)


def test_task_files_and_outputs_are_parsed_and_must_stay_relative() -> None:
    spec = parse_job_toml('[job]\ncommand = "python3"\nfiles = ["train.py", "data/"]\noutputs = ["out/"]\n')
    assert list(spec.task.files) == ["train.py", "data/"]
    assert list(spec.task.outputs) == ["out/"]
    with pytest.raises(InvalidArgumentError, match=r"^job\.outputs\[0\]: '\.\./x'"):
        parse_job_toml('[job]\ncommand = "x"\noutputs = ["../x"]\n')
    with pytest.raises(InvalidArgumentError, match=r"^job\.files\[1\]: '/etc'"):
        parse_job_toml('[job]\ncommand = "x"\nfiles = ["a", "/etc"]\n')


def test_a_relative_model_local_path_is_refused_naming_the_key() -> None:
    toml = '[job]\ndataset = "d"\n[job.model]\nlocal_path = "models/tiny"\n'
    with pytest.raises(
        InvalidArgumentError, match=r"^job\.model\.local_path: 'models/tiny' must be absolute"
    ):
        parse_job_toml(toml)
    assert (
        parse_job_toml(toml.replace("models/tiny", "/models/tiny")).diloco.model.local_path == "/models/tiny"
    )


# ---- inference jobs ----------------------------------------------------------------------

INFERENCE = """
[job]
kind = "inference"
name = "sums"
dataset = "arithmetic"
max_samples = 100
batch_size = 32
resources = { cpu = 1, memory_gb = 1 }
price = { bid = 1.0, max = 2.0 }
[job.model]
local_path = "/models/arithmetic"
type = "causal-lm"
"""


def test_inference_job_parses_its_model_dataset_and_resources() -> None:
    spec = parse_job_toml(INFERENCE)
    i = spec.inference
    assert spec.WhichOneof("kind") == "inference" and spec.name == "sums"
    assert i.dataset == "arithmetic" and i.max_samples == 100 and i.batch_size == 32
    assert i.model.local_path == "/models/arithmetic" and i.model.type == common_pb2.MODEL_TYPE_CAUSAL_LM
    assert i.requirements.executor == common_pb2.EXECUTOR_KIND_INFERENCE
    assert i.requirements.minimum.cpu == 1 and (i.price.bid, i.price.max) == (1.0, 2.0)
    assert normalize_spec(spec) == spec


def test_inference_kind_is_inferred_from_model_job_or_inputs() -> None:
    spec = parse_job_toml(
        '[job]\nmodel_job = "j1"\ninputs = [{ prompt = "012+035=", answer = "74" }, { prompt = "1+1=" }]'
    )
    i = spec.inference
    assert i.model_job == "j1" and i.model.type == common_pb2.MODEL_TYPE_CAUSAL_LM
    assert [(x.prompt, x.answer) for x in i.inputs] == [("012+035=", "74"), ("1+1=", "")]


@pytest.mark.parametrize(
    ("edit", "expected"),
    [
        (('dataset = "arithmetic"', ""), "job.dataset: missing: set dataset or inputs"),
        (
            ('dataset = "arithmetic"', 'dataset = "a"\ninputs = [{ prompt = "x" }]'),
            "job.inputs: set dataset or inputs, not both",
        ),
        (('local_path = "/models/arithmetic"', ""), "job.model_job: missing"),
        (
            ('name = "sums"', 'name = "sums"\nmodel_job = "j1"'),
            "job.model_job: set model_job or model.repository/model.local_path, not both",
        ),
        (('local_path = "/models/arithmetic"', 'local_path = "models"'), "job.model.local_path: "),
        (("batch_size = 32", "batch_size = 0"), "job.batch_size: must be at least 1"),
        (("max_samples = 100", "max_samples = -1"), "job.max_samples: must not be negative"),
        (("max_samples = 100", 'max_samples = "all"'), "job.max_samples: must be an integer"),
        (("max_samples = 100", "max_new_tokens = 99999"), "job.max_new_tokens: at most"),
        (("max_samples = 100", "samples = 5"), "job.samples: unknown key"),
        (('dataset = "arithmetic"', 'inputs = [{ answer = "1" }]'), "job.inputs[0].prompt: missing"),
        (('dataset = "arithmetic"', "inputs = 3"), "job.inputs: must be a list"),
        (('type = "causal-lm"', 'type = "llm"'), "job.model.type: unknown model type 'llm'"),
        (("resources = { cpu = 1, memory_gb = 1 }", "resources = { kind = 'task' }"), "job.resources.kind"),
    ],
)
def test_malformed_inference_jobs_name_the_dotted_key(edit: tuple[str, str], expected: str) -> None:
    old, new = edit
    assert old in INFERENCE
    with pytest.raises(InvalidArgumentError) as info:
        parse_job_toml(INFERENCE.replace(old, new, 1))
    assert info.value.message.startswith(expected), info.value.message


def test_inline_inputs_need_a_causal_lm_and_structured_specs_are_checked_by_proto_field() -> None:
    with pytest.raises(InvalidArgumentError, match=r"^job\.inputs: inline inputs are prompts"):
        parse_job_toml(
            '[job]\nmodel_job = "j1"\ninputs = [{ prompt = "x" }]\n'
            '[job.model]\ntype = "vision-classification"'
        )
    spec = common_pb2.JobSpec(
        inference=common_pb2.InferenceJobSpec(model_job="j1", dataset="d", model_bundle_sha256="forged")
    )
    normalized = normalize_spec(spec).inference
    assert normalized.batch_size > 0 and normalized.model_bundle_sha256 == ""
    assert normalized.requirements.executor == common_pb2.EXECUTOR_KIND_INFERENCE
    with pytest.raises(InvalidArgumentError, match=r"^spec\.inference\.dataset: missing"):
        normalize_spec(common_pb2.JobSpec(inference=common_pb2.InferenceJobSpec(model_job="j1")))
