"""``serve.mode=ray``: each stage's engines as Ray actors, the pipeline's driver unchanged.

The driver is the same ``Pipeline`` as in ``mp`` mode (one asyncio loop, a task per request that
awaits stage k, runs the edge's glue and submits to stage k+1); only a stage's engine differs.
Here it is a ``RayStage``: the driver's handle on the stage's replicas, with the part of
``AsyncLLM``'s interface the pipeline, the streaming edge and the HTTP server use (``generate``,
``abort``, ``collective_rpc``, ``vllm_config``, ``errored``, ``shutdown``). Each replica is a
``StageReplica`` actor (``omnigen.serving.ray_replica``) hosting one vLLM engine in its own
process, built as ``inproc`` mode builds one.

- Placement: each replica asks Ray for the stage's ``serve.ray.stages.STAGE`` resources (CPUs,
  GPUs, custom resources, node labels). A stage with tensor or pipeline parallelism reserves a
  placement group per replica (its actor's bundle, then one GPU bundle per rank) and runs vLLM's
  Ray executor (``distributed_executor_backend=ray``), whose workers land in that group.
- Requests: each goes to the replica of its stage with the fewest requests in flight, as one
  call (``generate``: a Ray streaming generator of its ``RequestOutput``s, merged as ``AsyncLLM``
  merges them when the reader falls behind; only the final one where the caller reads no other).
  A request with a ``ray`` payload is two:
  ``submit`` (reads the payload, adds the request to the engine, returns) and ``outputs``; the
  first returning early frees the payload object.
- Failure: Ray restarts a replica whose process died (``max_restarts``); the requests it was
  running fail (``ReplicaDied``, an ``EngineDeadError``: the HTTP answer is 503). They are not
  retried: a request may have streamed part of its audio, and its payload was read once. A stage
  whose every replica died for good is ``errored`` (the server stops, as for a dead engine).

Nothing here imports Ray at module level: importing omnigen never starts or needs Ray.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
import uuid
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from vllm.v1.engine.exceptions import EngineDeadError

from omnigen.runtime import transport as transports
from omnigen.runtime.scheduler import STREAM_KEY
from omnigen.runtime.serialization import INLINE_PAYLOAD_KEY
from omnigen.serving import ray_transport

log = logging.getLogger("omnigen.serving")

RAY_INSTALL = "pip install 'omnigen[ray]' (ray==2.60.0; scripts/setup.sh installs it)"


class RayModeError(ValueError):
    """A ``serve.mode=ray`` setting that cannot run; names the key and the fix."""


class ReplicaDied(EngineDeadError):
    """The replica running a request died (Ray restarts it; the request is not retried)."""

    def __init__(self, stage: str, replica: str, request_id: str, cause: BaseException) -> None:
        super().__init__()
        self.detail = (
            f"stage {stage!r}: replica {replica} died while running request {request_id!r} "
            f"({type(cause).__name__}); the request is not retried (Ray restarts the replica "
            "while it has restarts left: serve.ray max_restarts)"
        )
        self.args = (self.detail,)

    def __str__(self) -> str:
        return self.detail


# -- options -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class StagePlacement:
    """``serve.ray.replica`` merged with ``serve.ray.stages.STAGE`` (omnigen/serve_schema.py: RayStageConf)."""

    replicas: int = 1
    num_cpus: float = 1.0
    num_gpus: float = 0.0
    resources: dict[str, float] = field(default_factory=dict)
    label_selector: dict[str, str] = field(default_factory=dict)
    max_restarts: int = 3


@dataclass(frozen=True)
class RayOptions:
    """``serve.ray`` (omnigen/serve_schema.py: RayConf), each stage's placement merged."""

    address: str | None = None
    namespace: str = "omnigen"
    env_vars: dict[str, str] = field(default_factory=dict)
    placement_timeout_s: float = 300.0
    replica: StagePlacement = field(default_factory=StagePlacement)
    stages: dict[str, StagePlacement] = field(default_factory=dict)

    @classmethod
    def from_config(cls, ray: Mapping[str, Any] | None) -> RayOptions:
        """From the ``serve.ray`` mapping (checked by ``problems`` first)."""
        ray = dict(ray or {})
        replica = {k: v for k, v in (ray.pop("replica", None) or {}).items() if v is not None}
        stages = {
            name: StagePlacement(**{**replica, **(conf or {})})
            for name, conf in (ray.pop("stages", None) or {}).items()
        }
        env = {name: _env_text(value) for name, value in (ray.pop("env_vars", None) or {}).items()}
        return cls(
            **{k: v for k, v in ray.items() if v is not None},
            env_vars=env,
            replica=StagePlacement(**replica),
            stages=stages,
        )

    def stage(self, name: str) -> StagePlacement:
        return self.stages.get(name) or self.replica


def _env_text(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


_PLACEMENT_KEYS = {f for f in StagePlacement.__dataclass_fields__}


def problems(ray: Mapping[str, Any], stages: Sequence[str], model: str) -> list[str]:
    """What is wrong with a ``serve.ray`` mapping, each naming its key."""
    found = []
    for name in sorted(set(ray.get("stages") or {}) - set(stages)):
        found.append(
            f"serve.ray.stages.{name}: {model} has no stage {name!r}; its stages: {', '.join(stages)}"
        )
    replica = dict(ray.get("replica") or {})
    found += _placement_problems(replica, "serve.ray.replica")
    for name, conf in (ray.get("stages") or {}).items():
        key = f"serve.ray.stages.{name}"
        if not isinstance(conf, Mapping):
            found.append(
                f"{key}: {conf!r}; give keys of serve.ray.replica ({', '.join(sorted(_PLACEMENT_KEYS))})"
            )
            continue
        for unknown in sorted(set(conf) - _PLACEMENT_KEYS):
            found.append(
                f"{key}.{unknown}: not a replica key; use one of {', '.join(sorted(_PLACEMENT_KEYS))}"
            )
        found += _placement_problems({k: v for k, v in conf.items() if k in _PLACEMENT_KEYS}, key)
    for name, value in (ray.get("env_vars") or {}).items():
        if not isinstance(value, str | int | float | bool):
            found.append(f"serve.ray.env_vars.{name}: {value!r} is not a value an environment variable holds")
    if not 0 < ray.get("placement_timeout_s", 1) < float("inf"):
        found.append(
            f"serve.ray.placement_timeout_s: {ray['placement_timeout_s']} must be a positive number of seconds"
        )
    return found


def _placement_problems(conf: Mapping[str, Any], key: str) -> list[str]:
    found = []
    number = int | float
    if "replicas" in conf and not (isinstance(conf["replicas"], int) and conf["replicas"] >= 1):
        found.append(f"{key}.replicas: {conf['replicas']!r} must be a whole number >= 1")
    for resource in ("num_cpus", "num_gpus"):
        if resource in conf and not (
            isinstance(conf[resource], number) and 0 <= conf[resource] < float("inf")
        ):
            found.append(f"{key}.{resource}: {conf[resource]!r} must be a number >= 0")
    resources = conf.get("resources") or {}
    if not isinstance(resources, Mapping):
        found.append(f"{key}.resources: {resources!r}; give resource names with amounts ({{gpu_host: 1}})")
        resources = {}
    for resource, amount in resources.items():
        if not (isinstance(amount, number) and 0 < amount < float("inf")):
            found.append(f"{key}.resources.{resource}: {amount!r} must be a positive number")
    labels = conf.get("label_selector") or {}
    if not (isinstance(labels, Mapping) and all(isinstance(v, str) for v in labels.values())):
        found.append(f"{key}.label_selector: {labels!r}; give node labels with their values as text")
    if "max_restarts" in conf and not (isinstance(conf["max_restarts"], int) and conf["max_restarts"] >= -1):
        found.append(f"{key}.max_restarts: {conf['max_restarts']!r} must be >= 0, or -1 (no limit)")
    return found


def _ray() -> Any:
    try:
        import ray
    except ImportError as exc:
        raise RayModeError(f"serve.mode=ray needs Ray, which is not installed here: {RAY_INSTALL}") from exc
    return ray


# -- the driver's side ---------------------------------------------------------------------------


class RayCluster:
    """The Ray connection of one pipeline and every replica it started; ``close`` undoes both."""

    def __init__(self, options: RayOptions, connected: bool) -> None:
        self.options = options
        self.connected = connected
        """This pipeline called ``ray.init`` (and so calls ``ray.shutdown``, which also stops a
        Ray instance it started)."""
        self.stages: dict[str, RayStage] = {}
        self.token = uuid.uuid4().hex[:8]

    @classmethod
    def connect(cls, options: RayOptions) -> RayCluster:
        """``ray.init``: join ``serve.ray.address``, else start a local Ray (this process's alone)."""
        ray = _ray()
        if ray.is_initialized():  # the caller's own connection (a script, a test): used as it is
            return cls(options, connected=False)
        started = time.perf_counter()
        context = ray.init(
            # "local": a new instance even where RAY_ADDRESS or a `ray start` cluster is about
            # (serve.ray.address=auto joins those).
            address=options.address or "local",
            namespace=options.namespace,
            include_dashboard=False,
            log_to_driver=True,
            configure_logging=False,
        )
        log.info(
            "Ray: %s %s in %.1f s (%d node(s))",
            "joined" if options.address else "started a local instance at",
            options.address or context.address_info.get("gcs_address"),
            time.perf_counter() - started,
            len(_alive_nodes()),
        )
        return cls(options, connected=True)

    def start(
        self,
        plan: Any,
        stage_args: Mapping[str, dict[str, Any]],
        plugin_env: Mapping[str, Mapping[str, str]],
    ) -> dict[str, RayStage]:
        """Start every replica of every stage at once (they load in parallel); wait until each
        is placed and its engine is up. ``stage_args``: stage -> vLLM engine arguments."""
        from omnigen import models

        check_shm_edges(plan)
        declared = models.Declared.from_plan(plan)
        shm_consumers = {
            plan.stages[i + 1].stage for i, s in enumerate(plan.stages[:-1]) if s.transport == "shm"
        }
        try:
            for stage in plan.stages:
                placement = self.options.stage(stage.stage)
                args = _stage_engine_args(stage, stage_args[stage.stage], placement)
                env = {
                    **self.options.env_vars,
                    **plugin_env[stage.stage],
                    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
                }
                self.stages[stage.stage] = RayStage(
                    stage.stage,
                    [
                        _start_replica(
                            f"{plan.name}-{stage.stage}-{i}-{self.token}",
                            stage.stage,
                            args,
                            declared,
                            placement,
                            env,
                            pin_to_driver=stage.stage in shm_consumers,
                        )
                        for i in range(placement.replicas)
                    ],
                )
            for stage in self.stages.values():
                stage.wait_placed(self.options.placement_timeout_s)
            for stage in self.stages.values():
                stage.wait_ready()
        except BaseException:
            self.close()
            raise
        return dict(self.stages)

    def close(self) -> None:
        """Stop every replica (and its placement group); ``ray.shutdown`` if this pipeline
        connected, which stops every Ray process too when it started them."""
        for stage in self.stages.values():
            stage.shutdown()
        self.stages.clear()
        if self.connected:
            ray = _ray()
            ray.shutdown()
            self.connected = False


def start_pipeline(
    plan: Any,
    stage_models: Mapping[str, str],
    engine_kwargs: Mapping[str, Mapping[str, Any]],
    ray: Mapping[str, Any] | RayOptions | None,
) -> tuple[RayCluster, dict[str, RayStage]]:
    """Connect to Ray and start every stage's replicas (``Pipeline.from_model`` in ray mode)."""
    from omnigen.serving.pipeline import _engine_args, _plugin_environment

    options = ray if isinstance(ray, RayOptions) else RayOptions.from_config(ray)
    unknown = sorted(set(options.stages) - {s.stage for s in plan.stages})
    if unknown:
        raise RayModeError(
            problems({"stages": dict.fromkeys(unknown)}, [s.stage for s in plan.stages], plan.name)[0]
        )
    args, env = {}, {}
    for stage in plan.stages:
        if stage.devices is not None:
            raise RayModeError(
                f"model.stages.{stage.stage}.devices: {stage.devices!r}; in serve.mode=ray Ray assigns "
                f"each replica its devices: drop it and set serve.ray.stages.{stage.stage}.num_gpus"
            )
        if stage.in_memory:
            raise RayModeError(stage.variant_refusal("ray"))
        kwargs = dict(engine_kwargs.get(stage.stage, {}))
        args[stage.stage] = _engine_args(stage, stage_models[stage.stage], kwargs)
        env[stage.stage] = _plugin_environment(stage)
    cluster = RayCluster.connect(options)
    try:
        return cluster, cluster.start(plan, args, env)
    except BaseException:
        cluster.close()
        raise


def check_shm_edges(plan: Any) -> None:
    """``shm`` reaches one machine: refused on a multi-node cluster (the driver writes each
    segment, the consumer's replica reads it, and Ray may place that replica anywhere)."""
    nodes = _alive_nodes()
    for index, stage in enumerate(plan.stages[:-1]):
        if stage.transport == "shm" and len(nodes) > 1:
            consumer = plan.stages[index + 1].stage
            raise RayModeError(
                f"model.stages.{stage.stage}.transport: shm is shared memory on one machine, and this "
                f"Ray cluster has {len(nodes)} nodes, so {consumer}'s replicas can land on another node "
                f"than this driver, which writes the segment; set model.stages.{stage.stage}.transport=ray "
                "(or inline)"
            )


def _alive_nodes() -> list[dict[str, Any]]:
    ray = _ray()
    return [node for node in ray.nodes() if node.get("Alive")]


def _stage_engine_args(stage: Any, args: dict[str, Any], placement: StagePlacement) -> dict[str, Any]:
    """The stage's engine arguments for a replica: vLLM's Ray executor for a parallel stage."""
    args = dict(args)
    # As AsyncLLM in mp mode (LLM turns it off): each output carries vLLM's request timestamps,
    # which the server's queue and run-time metrics read.
    args.setdefault("disable_log_stats", False)
    world = _world_size(args)
    if world > 1:
        backend = args.get("distributed_executor_backend")
        if backend not in (None, "ray"):
            raise RayModeError(
                f"serve.stage_engine.{stage.stage}.distributed_executor_backend: {backend!r}; in "
                "serve.mode=ray a parallel stage runs vLLM's Ray executor: drop it or set ray"
            )
        if placement.num_gpus:
            raise RayModeError(
                f"serve.ray.stages.{stage.stage}.num_gpus: {placement.num_gpus}, but the stage runs "
                f"{world} ranks, each with a GPU of the replica's placement group: leave num_gpus 0"
            )
        args["distributed_executor_backend"] = "ray"
    return args


def _world_size(args: Mapping[str, Any]) -> int:
    return int(args.get("tensor_parallel_size") or 1) * int(args.get("pipeline_parallel_size") or 1)


def _start_replica(
    name: str,
    stage: str,
    args: dict[str, Any],
    declared: Any,
    placement: StagePlacement,
    env: dict[str, str],
    *,
    pin_to_driver: bool,
) -> Replica:
    ray = _ray()
    options: dict[str, Any] = {
        "name": name,
        "num_cpus": placement.num_cpus,
        "num_gpus": placement.num_gpus,
        "max_restarts": placement.max_restarts,
        "max_task_retries": 0,
        "max_concurrency": 10_000,  # every in-flight request holds an outputs() call
        "runtime_env": {"env_vars": dict(env)},
    }
    if placement.resources:
        options["resources"] = dict(placement.resources)
    if placement.label_selector:
        options["label_selector"] = dict(placement.label_selector)
    group = None
    world = _world_size(args)
    if world > 1:
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        # Bundle 0 is the replica (the engine core); vLLM's Ray executor takes the GPU bundles.
        own = {"CPU": placement.num_cpus, **placement.resources}
        group = placement_group([own, *({"GPU": 1.0} for _ in range(world))], strategy="PACK")
        options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
            group, placement_group_bundle_index=0, placement_group_capture_child_tasks=True
        )
    elif pin_to_driver:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        # A shm consumer reads segments this driver writes: on this node only (check_shm_edges).
        options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(
            ray.get_runtime_context().get_node_id(), soft=False
        )
    from omnigen.serving.ray_replica import StageReplica

    actor = ray.remote(StageReplica).options(**options).remote(stage, name, args, declared)
    return Replica(name=name, actor=actor, group=group, asked=_asked(placement, world))


def _asked(placement: StagePlacement, world: int) -> dict[str, Any]:
    asked: dict[str, Any] = {"CPU": placement.num_cpus, **placement.resources}
    if placement.num_gpus or world > 1:
        asked["GPU"] = placement.num_gpus or world
    if placement.label_selector:
        asked["labels"] = dict(placement.label_selector)
    return asked


@dataclass
class Replica:
    """The driver's record of one replica actor."""

    name: str
    actor: Any
    group: Any = None
    asked: dict[str, Any] = field(default_factory=dict)
    in_flight: int = 0
    served: int = 0
    """Requests submitted to it so far (tests, the spread of requests)."""
    node: str | None = None
    """The Ray node id it started on, and its process (``info``; a restart may move it)."""
    pid: int | None = None
    dead: BaseException | None = None
    """Set when Ray says the actor died for good (no restarts left)."""
    restarting: bool = False
    """Its process died and Ray is starting it again: new requests go to the other replicas
    until it answers (``RayStage._until_back``)."""


class RayStage:
    """The driver's engine for one stage in ray mode; see the module docstring."""

    def __init__(self, stage: str, replicas: list[Replica]) -> None:
        self.stage = stage
        self.replicas = replicas
        self.vllm_config: Any = None
        self.model_config: Any = None
        self._turn = itertools.count()
        self._running: dict[str, Replica] = {}
        """Request id -> the replica it runs on (for ``abort``)."""
        self.dead_error: BaseException | None = None
        self._watches: set[asyncio.Future[None]] = set()

    # -- start and stop ----------------------------------------------------------------------

    def wait_placed(self, timeout_s: float) -> None:
        ray = _ray()
        pending = {replica.actor.ping.remote(): replica for replica in self.replicas}
        ready, _ = ray.wait(list(pending), num_returns=len(pending), timeout=timeout_s)
        missing = [pending[ref] for ref in pending if ref not in ready]
        if missing:
            free = {k: v for k, v in ray.available_resources().items() if not k.startswith("node:")}
            raise RayModeError(
                f"stage {self.stage!r}: Ray placed no node for replica(s) "
                f"{', '.join(r.name for r in missing)} within {timeout_s:g} s "
                f"(serve.ray.placement_timeout_s); each asks for {missing[0].asked}, the cluster has "
                f"{free} free. Lower serve.ray.stages.{self.stage}.num_cpus/num_gpus/replicas, fix its "
                "resources or label_selector, or add nodes"
            )
        ray.get(list(ready))

    def wait_ready(self) -> None:
        ray = _ray()
        try:
            infos = ray.get([replica.actor.info.remote() for replica in self.replicas])
        except ray.exceptions.RayTaskError as exc:
            raise RayModeError(
                f"stage {self.stage!r}: a replica's engine did not start: {exc.cause}"
            ) from exc
        self.vllm_config = infos[0]["vllm_config"]
        self.model_config = self.vllm_config.model_config
        for replica, info in zip(self.replicas, infos, strict=True):
            replica.node, replica.pid = info["node"], info["pid"]
            log.info(
                "stage %r: replica %s ready on node %s (pid %s)",
                self.stage,
                replica.name,
                info["node"],
                info["pid"],
            )

    def shutdown(self) -> None:
        """Stop the engines (briefly, so vLLM frees what it holds), then kill the actors."""
        ray = _ray()
        stops = [replica.actor.stop.remote() for replica in self.replicas if replica.dead is None]
        with contextlib.suppress(Exception):
            ray.wait(stops, num_returns=len(stops), timeout=30)
        for replica in self.replicas:
            with contextlib.suppress(Exception):
                ray.kill(replica.actor, no_restart=True)
            if replica.group is not None:
                from ray.util.placement_group import remove_placement_group

                with contextlib.suppress(Exception):
                    remove_placement_group(replica.group)
        self.replicas = []

    # -- what the pipeline and the server call -----------------------------------------------

    @property
    def errored(self) -> bool:
        """Every replica died for good (the server then answers 503 and stops)."""
        return bool(self.replicas) and all(replica.dead is not None for replica in self.replicas)

    def _pick(self) -> Replica:
        live = [replica for replica in self.replicas if replica.dead is None]
        if not live:
            raise self.dead_error or EngineDeadError()
        turn = next(self._turn)
        # Up before restarting; then fewest in flight; among equals the next in turn (so an idle
        # stage alternates). A stage whose every replica is restarting fails the request (503).
        return min(
            live,
            key=lambda r: (r.restarting, r.in_flight, (self.replicas.index(r) - turn) % len(self.replicas)),
        )

    def _lost(self, replica: Replica, error: BaseException) -> None:
        """A call to ``replica`` failed because its process is gone: dead for good, or restarting."""
        ray = _ray()
        if isinstance(error, ray.exceptions.ActorDiedError):
            replica.dead = error
            self.dead_error = error
        elif not replica.restarting:
            replica.restarting = True
            log.warning(
                "stage %r: replica %s lost its process; Ray is restarting it", self.stage, replica.name
            )
            watch = asyncio.ensure_future(self._until_back(replica))
            self._watches.add(watch)  # a task nothing references may be collected mid-way
            watch.add_done_callback(self._watches.discard)

    async def _until_back(self, replica: Replica) -> None:
        """Ask the restarting replica until its new engine answers (or it died for good)."""
        ray = _ray()
        while replica.dead is None:
            try:
                info = await replica.actor.info.remote()
            except ray.exceptions.ActorDiedError as exc:
                self._lost(replica, exc)
                return
            except ray.exceptions.RayActorError:
                await asyncio.sleep(0.5)
                continue
            replica.node, replica.pid, replica.restarting = info["node"], info["pid"], False
            log.info("stage %r: replica %s is back (pid %s)", self.stage, replica.name, replica.pid)
            return

    async def generate(self, prompt: Any, params: Any, request_id: str) -> AsyncIterator[Any]:
        """The request's ``RequestOutput``s from one replica, as ``AsyncLLM.generate`` yields them
        for a streaming producer's request (``STREAM_KEY`` in its ``extra_args``); for any other,
        only the final one (all that the pipeline reads of it)."""
        ray = _ray()
        replica = self._pick()
        refs = _payload_refs(params)
        replica.in_flight += 1
        replica.served += 1
        self._running[request_id] = replica
        finished = False
        # Only a streaming producer's caller reads the outputs before the last (its payload so
        # far); every other caller reads the final one, so only that one is sent.
        every = STREAM_KEY in (getattr(params, "extra_args", None) or {})
        try:
            if refs:  # admitted first: the payload object is freed once the replica has read it
                await replica.actor.submit.remote(prompt, params, request_id, refs)
                del refs
                outputs = replica.actor.outputs.remote(request_id, every)
            else:
                outputs = replica.actor.generate.remote(prompt, params, request_id, every)
            async for ref in outputs:
                output = await ref
                finished = output.finished
                yield output
        except ray.exceptions.RayTaskError as exc:
            raise exc.cause from None  # the engine's own error (an input it refused, ...)
        except ray.exceptions.RayActorError as exc:
            self._lost(replica, exc)
            finished = True  # nothing left to abort
            raise ReplicaDied(self.stage, replica.name, request_id, exc) from exc
        finally:
            replica.in_flight -= 1
            self._running.pop(request_id, None)
            if not finished and replica.dead is None:
                # Cancelled (or closed early): abort it in the replica now; the pipeline's own
                # abort comes after this generator is gone and no longer knows the replica.
                with contextlib.suppress(Exception):
                    replica.actor.abort.remote([request_id])

    async def abort(self, request_id: str | Sequence[str]) -> None:
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        for rid in ids:
            replica = self._running.get(rid)
            if replica is not None and replica.dead is None:
                with contextlib.suppress(Exception):
                    await replica.actor.abort.remote([rid])

    async def collective_rpc(self, method: str, timeout: float | None = None, args: tuple = ()) -> list[Any]:
        """``method`` on every worker of every live replica, their results in replica order."""
        replicas = [replica for replica in self.replicas if replica.dead is None]
        results = await asyncio.gather(*(replica.actor.rpc.remote(method, args) for replica in replicas))
        return [item for result in results for item in result]


def _payload_refs(params: Any) -> list[Any]:
    """The object a ``ray`` handle in ``params`` stands for, taken out of this process's table
    (passed with the call, so the object lives until the replica has read it)."""
    handle = (getattr(params, "extra_args", None) or {}).get(INLINE_PAYLOAD_KEY)
    if not (transports.is_handle(handle) and handle[transports.TRANSPORT_KEY] == ray_transport.NAME):
        return []
    return [transports.transport_for_handle(handle).take(handle)]
